"""GPU correctness of the Hopper grouped GEMM kernels against fp32 torch references."""

import importlib.util

import pytest
import torch

from conftest import requires_sm90

pytestmark = [requires_sm90]
if importlib.util.find_spec("pytest_timeout") is not None:
    # a hung kernel (mbarrier deadlock) blocks inside a CUDA call: only the
    # thread method can report it (it dumps the stacks and ends the run)
    pytestmark.append(pytest.mark.timeout(240, method="thread"))

DTYPES = [torch.bfloat16, torch.float16]
SCHEDULES = ["cooperative", "pingpong"]

# (split sizes, N, K): uneven splits, a zero-token expert, a lone partial tile,
# small and large N/K (N not a multiple of the tile, K not a multiple of 64).
SHAPES = [
    ([37, 0, 300, 129], 64, 64),
    ([128, 1, 0, 255, 513], 200, 136),
    ([0, 0, 70, 0], 1856, 2688),
    ([700, 300, 0, 1100], 2688, 1856),
]


def _offsets(splits):
    off = [0]
    for s in splits:
        off.append(off[-1] + s)
    return off


def _inputs(splits, n, k, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t, e = sum(splits), len(splits)
    x = torch.randn(t, k, device="cuda", dtype=torch.float32, generator=g).to(dtype)
    w = (torch.randn(e, n, k, device="cuda", dtype=torch.float32, generator=g) / k**0.5).to(dtype)
    s = torch.tensor(splits, device="cuda", dtype=torch.int64)
    return x, w, s


def _ref_mm(x, w, splits, trans_b):
    off = _offsets(splits)
    n = w.shape[2] if trans_b else w.shape[1]
    out = torch.zeros(x.shape[0], n, device=x.device, dtype=torch.float32)
    for e in range(len(splits)):
        xe = x[off[e] : off[e + 1]].float()
        we = w[e].float()
        out[off[e] : off[e + 1]] = xe @ (we if trans_b else we.t())
    return out


def _close(got, ref, dtype, scale=1.0):
    tol = (2e-2 if dtype == torch.bfloat16 else 5e-3) * scale
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits,n,k", SHAPES)
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_grouped_gemm(dtype, splits, n, k, trans_b, schedule):
    from te_offload_ops.kernels import grouped_gemm

    x, w, s = _inputs(splits, n, k, dtype)
    if trans_b:
        w = w.transpose(1, 2).contiguous()  # (E, K, N)
    c = grouped_gemm(x, w, s, trans_b=trans_b, schedule=schedule)
    assert c.shape == (sum(splits), n) and c.dtype == dtype
    _close(c, _ref_mm(x, w, splits, trans_b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits,n,k", SHAPES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_srelu_fwd(dtype, splits, n, k, schedule):
    from te_offload_ops.kernels import grouped_gemm_srelu_fwd

    x, w, s = _inputs(splits, n, k, dtype, seed=1)
    probs = torch.rand(x.shape[0], device="cuda").to(dtype)
    act, z = grouped_gemm_srelu_fwd(x, w, s, probs, schedule=schedule)
    z_ref = _ref_mm(x, w, splits, False)
    act_ref = torch.relu(z_ref) ** 2 * probs.float()[:, None]
    _close(z, z_ref, dtype)
    _close(act, act_ref, dtype, scale=2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits,n,k", SHAPES)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dsrelu_bwd(dtype, splits, n, k, schedule):
    from te_offload_ops.kernels import grouped_gemm_dsrelu_bwd

    # fc2 backward: dy (T, H=K), w2 (E, H=K, F=N), z (T, F=N)
    dy, w2t, s = _inputs(splits, n, k, dtype, seed=2)
    w2 = w2t.transpose(1, 2).contiguous()  # (E, K, N)
    t = dy.shape[0]
    g = torch.Generator(device="cuda").manual_seed(3)
    z = torch.randn(t, n, device="cuda", generator=g).to(dtype)
    probs = torch.rand(t, device="cuda", generator=g).to(dtype)
    dz, dprobs, act = grouped_gemm_dsrelu_bwd(dy, w2, s, z, probs, schedule=schedule)

    dact = _ref_mm(dy, w2, splits, True)
    r = torch.relu(z.float())
    p = probs.float()[:, None]
    _close(dz, dact * p * 2 * r, dtype, scale=2.0)
    _close(act, r * r * p, dtype)
    dprobs_ref = (dact * r * r).sum(1)
    # a sum over N terms: scale the tolerance with the row magnitude
    mag = (dact.abs() * r * r).sum(1)
    err = (dprobs.float() - dprobs_ref).abs()
    bound = 2e-2 * mag + 2e-2 * dprobs_ref.abs() + 1e-3
    assert dprobs.shape == (t,) and dprobs.dtype == dtype
    assert bool((err <= bound).all()), f"max dprobs error {err.max().item()}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_dsrelu_bwd_writes_act_over_z_with_the_same_results(schedule):
    """act_in_z: act lands in z's memory, and dz, dprobs and act are those of a separate act, bit
    for bit (each tile reads its z before it stores its act)."""
    from te_offload_ops.kernels import grouped_gemm_dsrelu_bwd

    splits, n, k = SHAPES[-1]
    dy, w2t, s = _inputs(splits, n, k, torch.bfloat16, seed=2)
    w2 = w2t.transpose(1, 2).contiguous()
    g = torch.Generator(device="cuda").manual_seed(3)
    z = torch.randn(dy.shape[0], n, device="cuda", generator=g).to(torch.bfloat16)
    probs = torch.rand(dy.shape[0], device="cuda", generator=g).to(torch.bfloat16)
    want = grouped_gemm_dsrelu_bwd(dy, w2, s, z, probs, schedule=schedule)
    z_ptr = z.data_ptr()
    got = grouped_gemm_dsrelu_bwd(dy, w2, s, z, probs, schedule=schedule, act_in_z=True)
    assert got[2].data_ptr() == z_ptr
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_no_host_sync_and_deterministic():
    """The entry points must not synchronise on split sizes, and dprobs must
    reproduce bit for bit."""
    from te_offload_ops.kernels import grouped_gemm_dsrelu_bwd, grouped_gemm_srelu_fwd

    splits, n, k = [300, 0, 517, 131], 192, 256
    x, w, s = _inputs(splits, n, k, torch.bfloat16, seed=4)
    probs = torch.rand(x.shape[0], device="cuda").to(torch.bfloat16)
    grouped_gemm_srelu_fwd(x, w, s, probs)  # compile outside the sync check
    w2 = w.transpose(1, 2).contiguous()
    z = torch.randn(x.shape[0], n, device="cuda").to(torch.bfloat16)
    dy = torch.randn(x.shape[0], k, device="cuda").to(torch.bfloat16)
    grouped_gemm_dsrelu_bwd(dy, w2, s, z, probs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_gemm_srelu_fwd(x, w, s, probs)
        out1 = grouped_gemm_dsrelu_bwd(dy, w2, s, z, probs)
        out2 = grouped_gemm_dsrelu_bwd(dy, w2, s, z, probs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(out1, out2):
        assert torch.equal(a, b)


def _ref_wgrad(dy, x, splits):
    off = _offsets(splits)
    return torch.stack(
        [dy[off[e] : off[e + 1]].float().t() @ x[off[e] : off[e + 1]].float() for e in range(len(splits))]
    )


# (split sizes, N = dy columns, K = x columns): a zero-token expert, experts
# shorter than one k-tile, tails of every length class, the benchmark's fc1/fc2
WGRAD_SHAPES = [
    ([64, 0, 200, 136], 128, 192),
    ([1, 63, 65, 0, 127], 200, 136),
    ([0, 0, 70, 0], 1856, 2688),
    ([700, 300, 0, 1100], 2688, 1856),
]


@pytest.mark.parametrize(
    "backend,schedule", [("cute", "cooperative"), ("cute", "pingpong"), ("torch", None)]
)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits,n,k", WGRAD_SHAPES)
def test_wgrad(backend, schedule, dtype, splits, n, k):
    from te_offload_ops.kernels import grouped_wgrad

    x, _, s = _inputs(splits, 1, k, dtype, seed=5)
    dy = torch.randn(x.shape[0], n, device="cuda").to(dtype)
    dw = grouped_wgrad(dy, x, s, backend=backend, schedule=schedule)
    ref = _ref_wgrad(dy, x, splits)
    assert dw.shape == (len(splits), n, k) and dw.dtype == dtype
    # sums over up to 1100 tokens of unit-variance products: scale the tolerance
    _close(dw, ref, dtype, scale=max(1.0, max(splits) ** 0.5 / 4))
    for e, cnt in enumerate(splits):
        if cnt == 0:
            assert torch.count_nonzero(dw[e]) == 0


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_wgrad_tail_reads_nothing_of_the_next_expert(schedule):
    """The last k-tile of expert e is read past its end (TMA); the kernel zeroes
    those rows in shared memory, so even non-finite values of expert e+1 stay out."""
    from te_offload_ops.kernels import grouped_wgrad

    splits, n, k = [100, 30, 77], 256, 192
    x, _, s = _inputs(splits, 1, k, torch.bfloat16, seed=8)
    dy = torch.randn(x.shape[0], n, device="cuda").to(torch.bfloat16)
    x[100:130] = float("inf")
    dy[100:130] = float("nan")
    dw = grouped_wgrad(dy, x, s, backend="cute", schedule=schedule)
    ref = _ref_wgrad(dy, x, splits)
    _close(dw[0], ref[0], torch.bfloat16, scale=2.0)
    _close(dw[2], ref[2], torch.bfloat16, scale=2.0)
    assert not torch.isfinite(dw[1]).any()


def test_wgrad_cute_no_sync_deterministic_and_cluster_free(monkeypatch):
    from te_offload_ops.kernels import grouped_wgrad, tiling

    splits, n, k = [300, 0, 517, 131], 1856, 512
    x, _, s = _inputs(splits, 1, k, torch.bfloat16, seed=9)
    dy = torch.randn(x.shape[0], n, device="cuda").to(torch.bfloat16)
    first = grouped_wgrad(dy, x, s, backend="cute")  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = grouped_wgrad(dy, x, s, backend="cute")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(first, again)
    # the 2-CTA multicast of A changes nothing in the math
    assert tiling.pick_cluster(k, tiling.pick_tile(k)) == 2
    monkeypatch.setenv(tiling.CLUSTER_ENV, "1")
    single = grouped_wgrad(dy, x, s, backend="cute")
    assert torch.equal(first, single)


def test_cluster_pair_matches_single_cta(monkeypatch):
    """The 2-CTA cluster only changes who loads A (multicast), not the math: bitwise equal."""
    from te_offload_ops.kernels import grouped_gemm_dsrelu_bwd, grouped_gemm_srelu_fwd, tiling

    splits, n, k = [300, 0, 517, 131], 1856, 512  # at least two n-blocks: clusters
    assert tiling.pick_cluster(n, tiling.pick_tile(n)) == 2
    x, w, s = _inputs(splits, n, k, torch.bfloat16, seed=6)
    probs = torch.rand(x.shape[0], device="cuda").to(torch.bfloat16)
    w2 = w.transpose(1, 2).contiguous()
    z = torch.randn(x.shape[0], n, device="cuda").to(torch.bfloat16)
    dy = torch.randn(x.shape[0], k, device="cuda").to(torch.bfloat16)
    pair = grouped_gemm_srelu_fwd(x, w, s, probs) + grouped_gemm_dsrelu_bwd(dy, w2, s, z, probs)
    monkeypatch.setenv(tiling.CLUSTER_ENV, "1")
    single = grouped_gemm_srelu_fwd(x, w, s, probs) + grouped_gemm_dsrelu_bwd(dy, w2, s, z, probs)
    for a, b in zip(pair, single):
        assert torch.equal(a, b)


@pytest.mark.parametrize("excess", [-5, 100])
def test_split_sizes_not_summing_to_tokens_never_write_out_of_bounds(excess):
    """The sum is not checked on the host (that would sync): the kernel still runs, and rows
    covered by both the splits and T are right (stores past T are predicated off in the kernel;
    this test cannot observe a stray write directly)."""
    from te_offload_ops.kernels import grouped_gemm

    splits, n, k = [100, 0, 300], 192, 128
    x, w, _ = _inputs(splits, n, k, torch.bfloat16, seed=7)
    t = x.shape[0]
    s = torch.tensor(splits[:-1] + [splits[-1] + excess], device="cuda")
    c = grouped_gemm(x, w, s)
    covered = min(t, sum(splits) + excess)
    ref = _ref_mm(x, w, splits, False)
    _close(c[:covered], ref[:covered], torch.bfloat16)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("epilogue", ["plain", "srelu", "dsrelu", "wgrad"])
def test_many_turns_phantom_tiles_and_empty_experts(epilogue, schedule):
    """Enough tiles that every cluster runs several (pingpong: both warpgroups take turns,
    each skipping the other's pipeline stages), odd tile counts (a phantom partner for the
    last tile; in the wgrad form one per expert), 0-token experts and partial tiles."""
    from te_offload_ops.kernels import (
        grouped_gemm, grouped_gemm_dsrelu_bwd, grouped_gemm_srelu_fwd, grouped_wgrad,
    )

    # 143 m-blocks (odd); N=1920 -> 15 n-blocks of 128; K=320 -> 3 n-blocks when it is the
    # output width (dSReLU, wgrad: 15 x 3 tiles per expert, odd)
    splits = [0, 6000, 3, 0, 8400, 64, 0, 3500]
    n, k = 1920, 320
    x, w, s = _inputs(splits, n, k, torch.bfloat16, seed=10)
    probs = torch.rand(x.shape[0], device="cuda").to(torch.bfloat16)
    if epilogue == "plain":
        _close(grouped_gemm(x, w, s, schedule=schedule), _ref_mm(x, w, splits, False), torch.bfloat16)
    elif epilogue == "srelu":
        ref = _ref_mm(x, w, splits, False)
        act, z = grouped_gemm_srelu_fwd(x, w, s, probs, schedule=schedule)
        _close(z, ref, torch.bfloat16)
        _close(act, torch.relu(ref) ** 2 * probs.float()[:, None], torch.bfloat16, scale=2.0)
    elif epilogue == "dsrelu":  # w as (E, K=n, N=k)
        z = torch.randn(x.shape[0], k, device="cuda").to(torch.bfloat16)
        dy = torch.randn(x.shape[0], n, device="cuda").to(torch.bfloat16)
        dz, dprobs, act = grouped_gemm_dsrelu_bwd(dy, w, s, z, probs, schedule=schedule)
        dact = _ref_mm(dy, w, splits, True)
        r = torch.relu(z.float())
        p = probs.float()[:, None]
        _close(dz, dact * p * 2 * r, torch.bfloat16, scale=2.0)
        _close(act, r * r * p, torch.bfloat16)
        ref = (dact * r * r).sum(1)
        err = (dprobs.float() - ref).abs()
        assert bool((err <= 2e-2 * (dact.abs() * r * r).sum(1) + 2e-2 * ref.abs() + 1e-3).all())
    else:
        dy = torch.randn(x.shape[0], n, device="cuda").to(torch.bfloat16)
        dw = grouped_wgrad(dy, x, s, backend="cute", schedule=schedule)
        _close(dw, _ref_wgrad(dy, x, splits), torch.bfloat16, scale=max(splits) ** 0.5 / 4)
        for e, cnt in enumerate(splits):
            if cnt == 0:
                assert torch.count_nonzero(dw[e]) == 0


@pytest.mark.parametrize(
    "kind,schedule,n,k",
    [("srelu", "pingpong", 1856, 384), ("plain", "cooperative", 3 * 192, 384),
     ("dsrelu", "pingpong", 2688, 384), ("wgrad", "pingpong", 1856, 384),
     ("wgrad", "cooperative", 3 * 192, 3 * 192)],
)
def test_cluster_pairs_with_odd_n_blocks_match_single_cta(monkeypatch, kind, schedule, n, k):
    """Odd n-block counts: pairs that straddle two m-blocks (or, in the wgrad form, two
    m-blocks of one expert) load A whole, the last tile may have a phantom partner; the
    results equal the single-CTA kernel's bit for bit."""
    from te_offload_ops.kernels import (
        grouped_gemm, grouped_gemm_dsrelu_bwd, grouped_gemm_srelu_fwd, grouped_wgrad, tiling,
    )

    splits = [300, 0, 517, 131]
    x, w, s = _inputs(splits, n, k, torch.bfloat16, seed=11)
    probs = torch.rand(x.shape[0], device="cuda").to(torch.bfloat16)
    z = torch.randn(x.shape[0], k, device="cuda").to(torch.bfloat16)
    dy = torch.randn(x.shape[0], n, device="cuda").to(torch.bfloat16)

    def run():
        if kind == "plain":
            return (grouped_gemm(x, w, s, schedule=schedule),)
        if kind == "srelu":
            return grouped_gemm_srelu_fwd(x, w, s, probs, schedule=schedule)
        if kind == "dsrelu":  # w as (E, K=n, N=k)
            return grouped_gemm_dsrelu_bwd(dy, w, s, z, probs, schedule=schedule)
        return (grouped_wgrad(dy, x, s, backend="cute", schedule=schedule),)  # (E, n, k)

    tile_n = k if kind in ("dsrelu", "wgrad") else n
    tile = tiling.pick_tile(tile_n, schedule)
    n_tiles = -(-tile_n // tile[1])
    if kind == "wgrad":  # tiles per expert: (n / 128 m-blocks) x n_tiles, odd
        assert (-(-n // 128) * n_tiles) % 2 == 1
    else:
        assert n_tiles % 2 == 1
    assert tiling.pick_cluster(tile_n, tile) == 2
    pair = run()
    monkeypatch.setenv(tiling.CLUSTER_ENV, "1")
    single = run()
    for a, b in zip(pair, single):
        assert torch.equal(a, b)
    if kind == "plain":
        _close(pair[0], _ref_mm(x, w, splits, False), torch.bfloat16)
    if kind == "wgrad":
        _close(pair[0], _ref_wgrad(dy, x, splits), torch.bfloat16, scale=max(splits) ** 0.5 / 4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_fused_epilogue_chunk_widths_give_the_same_bits(monkeypatch, schedule):
    """The two-output epilogues stage 32 columns at a time by default; 64-column chunks only
    change the staging, so every output (z, act, dz, dprobs, act) must be bit-identical."""
    from te_offload_ops.kernels import gemm_plan, grouped_gemm_dsrelu_bwd, grouped_gemm_srelu_fwd, registry

    splits = [300, 0, 517, 131]
    n, k = 1856, 384
    x, w, s = _inputs(splits, n, k, torch.bfloat16, seed=5)
    probs = torch.rand(x.shape[0], device="cuda").to(torch.bfloat16)
    z = torch.randn(x.shape[0], k, device="cuda").to(torch.bfloat16)
    dy = torch.randn(x.shape[0], n, device="cuda").to(torch.bfloat16)

    def run(cols):
        registry.clear_cache()
        out = (*grouped_gemm_srelu_fwd(x, w, s, probs, schedule=schedule),
               *grouped_gemm_dsrelu_bwd(dy, w, s, z, probs, schedule=schedule))  # w as (E, K, N)
        assert {kern.epi_cols for kern, _ in registry.CACHE.values()} == {cols}
        return out

    try:
        narrow = run(32)
        monkeypatch.setattr(gemm_plan, "_EPI_COLS_TWO_OUTPUTS", 64)
        wide = run(64)
    finally:
        registry.clear_cache()  # no 64-column kernels left behind for later tests
    for a, b in zip(narrow, wide):
        assert torch.equal(a, b)


def test_call_conventions_give_the_same_bits(monkeypatch):
    """The TVM-FFI call path passes raw addresses, ints and the stream handle; it must launch
    exactly what the Python executor launches."""
    from te_offload_ops.kernels import (
        availability, grouped_gemm, grouped_gemm_dsrelu_bwd, grouped_gemm_srelu_fwd, grouped_wgrad, registry,
    )

    if not availability.has_tvm_ffi():
        pytest.skip("apache-tvm-ffi is not installed")
    splits = [300, 0, 517, 131]
    x, w, s = _inputs(splits, 384, 256, torch.bfloat16, seed=7)
    probs = torch.rand(x.shape[0], device="cuda").to(torch.bfloat16)
    dy = torch.randn(x.shape[0], 384, device="cuda").to(torch.bfloat16)
    z = torch.randn(x.shape[0], 256, device="cuda").to(torch.bfloat16)

    def run(call):
        monkeypatch.setenv(availability.CALL_ENV, call)
        registry.clear_cache()
        out = (grouped_gemm(x, w, s), *grouped_gemm_srelu_fwd(x, w, s, probs),
               *grouped_gemm_dsrelu_bwd(dy, w, s, z, probs),  # w as (E, K=384, N=256)
               grouped_wgrad(dy, x, s, backend="cute"))
        assert {kern.call for kern, _ in registry.CACHE.values()} == {call}
        return out

    try:
        python, ffi = run("python"), run("tvm-ffi")
    finally:
        registry.clear_cache()
    for a, b in zip(python, ffi):
        assert torch.equal(a, b)


@pytest.mark.parametrize("call", ["tvm-ffi", "python"])
def test_kernels_launch_on_the_current_stream(monkeypatch, call):
    """A kernel queued behind a long sleep on one stream has not written its output while the
    sleep runs; the same launch on an idle stream has (the control: the read sees writes)."""
    from te_offload_ops.kernels import api, availability, launch, registry

    if call == "tvm-ffi" and not availability.has_tvm_ffi():
        pytest.skip("apache-tvm-ffi is not installed")
    monkeypatch.setenv(availability.CALL_ENV, call)
    splits = [200, 56]
    x, w, s = _inputs(splits, 128, 64, torch.bfloat16, seed=3)
    s32 = s.to(torch.int32)
    behind, idle = (torch.full((x.shape[0], 128), float("nan"), device="cuda", dtype=torch.bfloat16)
                    for _ in range(2))

    def run_into(c):
        launch.launch_gemm(kern, compiled, [(x, "m"), (w, "m"), (c, "m"), (s32, "i32"), (x, "vec"), (c, "m"),
                                     (c, "m"), (s32, "f32")], x.shape[0])

    try:
        kern, compiled = api.get_kernel(torch.bfloat16, 128, 64, 2, b_n_major=False, epilogue="plain")
        # pinned, non-blocking copies on a third stream wait for nothing else
        snaps = [torch.empty(c.shape, dtype=c.dtype, pin_memory=True) for c in (behind, idle)]
        sleeping, free, reader = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
        run_into(behind)  # the first launch loads the module, which waits for the whole device
        behind.fill_(float("nan"))
        torch.cuda.synchronize()
        with torch.cuda.stream(sleeping):
            for _ in range(3):
                torch.cuda._sleep(2_000_000_000)  # about a second each
            run_into(behind)
        with torch.cuda.stream(free):
            run_into(idle)
        free.synchronize()
        with torch.cuda.stream(reader):
            for snap, c in zip(snaps, (behind, idle)):
                snap.copy_(c, non_blocking=True)
        reader.synchronize()
        assert not sleeping.query(), "the sleep ended before the read: the check proves nothing"
        assert torch.isnan(snaps[0].float()).all()
        assert not torch.isnan(snaps[1].float()).any()
        sleeping.synchronize()
        _close(behind, _ref_mm(x, w, splits, False), torch.bfloat16)
    finally:
        registry.clear_cache()


# 2 x 2 clusters for the weight gradients (TEO_GEMM_CLUSTER_M=2, opt-in): each tile runs the same
# k-loop as under the CTA pair, only where its operands come from changes, so the bits must match.
# Shapes: odd m- and n-block counts (phantoms past M and past N), an expert without tokens,
# experts shorter than one k-tile, and fc1's wgrad at the benchmark width.
CLUSTER_M_SHAPES = [
    ([300, 0, 517, 131], 1856, 512),  # M=1856: 15 m-blocks
    ([1, 63, 65, 0, 127], 392, 576),  # 4 m-blocks; 5 n-blocks at BN 128 (pingpong), 3 at BN 192
    ([700, 300, 0, 1100], 1856, 2688),
]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("splits,m,n", CLUSTER_M_SHAPES)
def test_two_by_two_clusters_give_the_pair_bits(monkeypatch, schedule, splits, m, n):
    from te_offload_ops.kernels import grouped_wgrad, grouped_wgrad_main_grad, registry, tiling

    g = torch.Generator(device="cuda").manual_seed(11)
    t = sum(splits)
    dy = torch.randn(t, m, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(t, n, device="cuda", generator=g).to(torch.bfloat16)
    s = torch.tensor(splits, device="cuda")
    start = torch.randn(len(splits), m, n, device="cuda", generator=g)
    out = {}
    for cm in ("1", "2"):
        monkeypatch.setenv(tiling.CLUSTER_M_ENV, cm)
        dw = grouped_wgrad(dy, x, s, backend="cute", schedule=schedule)
        grads = {}
        for add in ("tma", "red"):
            buf = start.clone()
            grouped_wgrad_main_grad(dy, x, s, list(buf.unbind(0)), add=add, backend="cute", schedule=schedule)
            grads[add] = buf
        out[cm] = (dw, grads)
    keys = [k for k in registry.compile_times() if ("cluster_m", 2) in k]
    assert keys, "no 2 x 2 kernel was compiled"
    assert torch.equal(out["1"][0], out["2"][0])
    for add in ("tma", "red"):
        assert torch.equal(out["1"][1][add], out["2"][1][add]), add
    assert torch.count_nonzero(out["2"][0][splits.index(0)]) == 0


def test_cluster_slots_of_four_fit_the_device():
    from te_offload_ops.kernels import launch

    dev = torch.cuda.current_device()
    sms = launch.sm_count(dev)
    four = launch.cluster_slots(dev, 4)
    assert four % 4 == 0 and 4 <= four <= sms
    assert launch.cluster_slots(dev, 2) == sms // 2 * 2


# Forward and dgrad under 2 x 2 clusters: m-pairs within one expert share B, those straddling two
# experts (odd m-block counts per expert here) load it whole, phantoms past the last m-block and
# past N store nothing; the same bits as the pair, every epilogue, reversed weights included.
FORWARD_2X2_SHAPES = [
    ([129, 0, 300, 1, 255], 576, 200),  # 2, 0, 3, 1, 2 m-blocks: pairs straddle; 5/3 n-blocks
    ([700, 300, 0, 1000], 1856, 2688),  # 17 m-blocks: a phantom partner past the last one
]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("splits,n,k", FORWARD_2X2_SHAPES)
def test_two_by_two_clusters_forward_forms_give_the_pair_bits(monkeypatch, schedule, splits, n, k):
    from te_offload_ops.kernels import grouped_gemm, grouped_gemm_dsrelu_bwd, grouped_gemm_srelu_fwd, registry, tiling

    x, w, s = _inputs(splits, n, k, torch.bfloat16, seed=12)
    g = torch.Generator(device="cuda").manual_seed(13)
    probs = torch.rand(x.shape[0], device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(x.shape[0], k, device="cuda", generator=g).to(torch.bfloat16)
    w2 = (torch.randn(len(splits), k, n, device="cuda", generator=g) / n**0.5).to(torch.bfloat16)
    out = {}
    for cm in ("1", "2"):
        monkeypatch.setenv(tiling.CLUSTER_M_ENV, cm)
        y = grouped_gemm(x, w, s, schedule=schedule)
        y_rev = grouped_gemm(x, w.flip(0).contiguous(), s, schedule=schedule, reversed_experts=True)
        act, z = grouped_gemm_srelu_fwd(x, w, s, probs, schedule=schedule)
        dz, dprobs, act2 = grouped_gemm_dsrelu_bwd(dy, w2, s, z, probs, schedule=schedule)
        dx = grouped_gemm(dz, w, s, trans_b=True, schedule=schedule)
        out[cm] = (y, y_rev, act, z, dz, dprobs, act2, dx)
    assert any(("cluster_m", 2) in key for key in registry.compile_times()), "no 2 x 2 kernel was compiled"
    for name, a, b in zip(("y", "y_rev", "act", "z", "dz", "dprobs", "act2", "dx"), out["1"], out["2"]):
        assert torch.equal(a, b), name
    _close(out["2"][0], _ref_mm(x, w, splits, trans_b=False), torch.bfloat16, scale=2.0)
