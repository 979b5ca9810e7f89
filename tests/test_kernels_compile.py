"""CPU-only: every grouped-GEMM kernel variant compiles for sm_90a.

``CUTE_DSL_ARCH=sm_90a`` lets the CuTe DSL compile Hopper kernels without a
GPU.  The DSL snapshots its environment when ``cutlass.cute`` is imported, so
the variable is set here, at collection, before anything imports it.  Each
test checks the generated PTX for the Hopper instructions the design relies
on (wgmma, TMA bulk tensor loads) rather than only "it did not raise".
"""

import os
import re
import tempfile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# --keep-ptx writes a file; keep it out of the checkout
os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="teo-ptx-"))

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

_HAVE_DSL = importlib.util.find_spec("cutlass") is not None
if _HAVE_DSL:
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        _HAVE_DSL = False
        _WHY = f"CuTe DSL (nvidia-cutlass-dsl) failed to import: {exc}"
else:
    _WHY = "CuTe DSL (nvidia-cutlass-dsl) is not installed"

pytestmark = pytest.mark.skipif(not _HAVE_DSL, reason=_WHY if not _HAVE_DSL else "")


def _ptx(dtype, n, k, e, b_n_major, epilogue, tile=None, schedule=None):
    from te_offload_ops.kernels import compile_variant

    kern, compiled, secs = compile_variant(
        dtype, n, k, e, b_n_major=b_n_major, epilogue=epilogue, tile=tile, options="--keep-ptx",
        schedule=schedule,
    )
    ptx = str(compiled.artifacts.PTX)
    return kern, ptx, secs


# (dtype, N, K, E, B N-major, epilogue): the four fused-MLP kernels at the
# benchmark shape, fp16 variants at a small odd shape, and the BN extremes.
VARIANTS = [
    (torch.bfloat16, 1856, 2688, 8, False, "plain"),  # fc1 fwd
    (torch.bfloat16, 1856, 2688, 8, False, "srelu"),  # fc1 fwd + SReLU
    (torch.bfloat16, 2688, 1856, 8, False, "plain"),  # fc2 fwd
    (torch.bfloat16, 1856, 2688, 8, True, "dsrelu"),  # fc2 dgrad + dSReLU
    (torch.bfloat16, 2688, 1856, 8, True, "plain"),  # fc1 dgrad
    (torch.float16, 200, 136, 5, False, "srelu"),
    (torch.float16, 200, 136, 5, True, "dsrelu"),
    (torch.float16, 64, 64, 3, True, "plain"),  # BN = 64
    (torch.bfloat16, 4096, 1024, 4, False, "plain"),  # BN = 256
]


def _variant_id(v):
    return f"{str(v[0])[6:]}-N{v[1]}-K{v[2]}-E{v[3]}-{'nmaj' if v[4] else 'kmaj'}-{v[5]}"


@pytest.mark.parametrize("dtype,n,k,e,b_n_major,epilogue", VARIANTS, ids=map(_variant_id, VARIANTS))
def test_variant_compiles_for_sm90a(dtype, n, k, e, b_n_major, epilogue):
    from te_offload_ops.kernels import pick_tile

    kern, ptx, secs = _ptx(dtype, n, k, e, b_n_major, epilogue, schedule="cooperative")
    bn = pick_tile(n)[1]
    assert kern.bn == bn
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    assert ".target sm_90a" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{ab}.{ab}" in ptx
    assert "cp.async.bulk.tensor.2d" in ptx  # A: one descriptor over (T, K)
    assert "cp.async.bulk.tensor.3d" in ptx  # B: (N, K, E), indexed by expert
    assert "mbarrier.try_wait" in ptx
    # warp-specialized: the producer warpgroup gives registers to the consumers
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx
    # the staged epilogue leaves shared memory as 16-byte stores
    assert "st.global.v4.b32" in ptx
    if epilogue == "dsrelu":
        assert "shfl.sync.bfly" in ptx  # dprobs row reduction across the quad
    else:
        assert "shfl.sync.bfly" not in ptx
    print(f"compile {epilogue} N={n} K={k} E={e} BN={bn}: {secs:.2f} s")


def _has_turn_handover(ptx):
    """A named-barrier arrive and a sync over both consumer warpgroups (256 threads)."""
    return bool(re.search(r"^\s*bar\.arrive\s+\S+,\s*256;", ptx, re.M)) and bool(
        re.search(r"^\s*bar\.sync\s+\S+,\s*256;", ptx, re.M)
    )


# the fused MLP's GEMMs (fc1 fwd + SReLU, fc2 fwd, fc2 dgrad + dSReLU, fc1
# dgrad) and an fp16 odd shape, under the pingpong schedule
PINGPONG_VARIANTS = [v for v in VARIANTS if v[1] in (1856, 2688)] + [VARIANTS[6]]


@pytest.mark.parametrize(
    "dtype,n,k,e,b_n_major,epilogue", PINGPONG_VARIANTS, ids=map(_variant_id, PINGPONG_VARIANTS)
)
def test_pingpong_variant_compiles_for_sm90a(dtype, n, k, e, b_n_major, epilogue):
    """Pingpong: one warpgroup per 128 x 128 tile, turns handed over by named barriers."""
    kern, ptx, _ = _ptx(dtype, n, k, e, b_n_major, epilogue, schedule="pingpong")
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    assert kern.schedule == "pingpong" and kern.bn == 128 and kern.tile_threads == 128
    assert f"wgmma.mma_async.sync.aligned.m64n{kern.bn}k16.f32.{ab}.{ab}" in ptx
    # the turn hand-over: a non-blocking arrive by one warpgroup, a sync by the other
    assert _has_turn_handover(ptx)
    assert "st.global.v4.b32" in ptx
    assert ("shfl.sync.bfly" in ptx) == (epilogue == "dsrelu")


def test_pingpong_wgrad_compiles_for_sm90a():
    from te_offload_ops.kernels import compile_variant

    kern, compiled, _ = compile_variant(
        torch.bfloat16, 2688, 0, 8, b_n_major=True, epilogue="plain", options="--keep-ptx",
        wgrad_m=1856, schedule="pingpong",
    )
    ptx = str(compiled.artifacts.PTX)
    assert kern.schedule == "pingpong" and kern.bn == 128
    assert "fence.proxy.async.shared::cta" in ptx
    assert _has_turn_handover(ptx)


def test_pingpong_refuses_wide_tiles_and_unknown_schedules():
    import cutlass

    from te_offload_ops.kernels import tiling
    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    with pytest.raises(ValueError, match="BN <= 128"):
        GroupedGemmSm90(cutlass.BFloat16, 1856, 64, 2, b_n_major=False, tile_mn=(128, 192),
                        schedule="pingpong")
    with pytest.raises(ValueError, match="schedule"):
        GroupedGemmSm90(cutlass.BFloat16, 256, 64, 2, b_n_major=False, schedule="stream-k")
    with pytest.raises(ValueError, match="schedule"):
        tiling.pick_schedule("plain", schedule="stream-k")
    assert tiling.pick_tile(1856, "pingpong") == (128, 128)


@pytest.mark.parametrize("cluster_n", [1, 2])
def test_cluster_pair_multicasts_a(cluster_n):
    from te_offload_ops.kernels import compile_variant

    kern, compiled, _ = compile_variant(
        torch.bfloat16, 1856, 256, 4, b_n_major=False, epilogue="srelu", options="--keep-ptx",
        cluster_n=cluster_n,
    )
    ptx = str(compiled.artifacts.PTX)
    assert kern.cluster_n == cluster_n
    assert ("multicast::cluster" in ptx) == (cluster_n == 2)


def test_cluster_pairs_odd_n_block_counts():
    """An odd n-block count still clusters: the pair that straddles two m-blocks loads its A
    tiles whole through a second, plain TMA descriptor, the others multicast."""
    import cutlass

    from te_offload_ops.kernels import compile_variant, tiling
    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    assert tiling.pick_cluster(3 * 192, (128, 192)) == 2
    assert tiling.pick_cluster(1856, (128, 128)) == 2  # 15 n-blocks
    assert tiling.pick_cluster(192, (128, 192)) == 1  # one n-block: every pair would straddle
    with pytest.raises(ValueError, match="cluster_n"):
        GroupedGemmSm90(cutlass.BFloat16, 256, 64, 2, b_n_major=False, cluster_n=4)
    kern, compiled, _ = compile_variant(
        torch.bfloat16, 3 * 192, 256, 4, b_n_major=False, epilogue="plain", options="--keep-ptx",
        tile=(128, 192),
    )
    ptx = str(compiled.artifacts.PTX)
    assert kern.cluster_n == 2 and kern.n_tiles == 3
    loads = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor.2d" in ln]
    assert any("multicast::cluster" in ln for ln in loads)  # A, shared by the pair
    assert any("multicast::cluster" not in ln for ln in loads)  # A, whole, for a straddling pair


def test_cache_reuses_compiled_kernel():
    from te_offload_ops.kernels import api, registry

    registry.clear_cache()
    k1 = api.get_kernel(torch.bfloat16, 192, 128, 2, b_n_major=False, epilogue="plain")
    k2 = api.get_kernel(torch.bfloat16, 192, 128, 2, b_n_major=False, epilogue="plain")
    k3 = api.get_kernel(torch.bfloat16, 192, 128, 2, b_n_major=True, epilogue="plain")
    assert k1 is k2 and k3 is not k1
    times = registry.compile_times()
    assert len(times) == 2 and all(t > 0 for t in times.values())


@pytest.mark.parametrize("atoms,threads,bn", [((2, 1, 1), 256, 192), ((1, 1, 1), 128, 128)],
                         ids=["cooperative", "pingpong"])
def test_accumulator_layout_matches_row_reduction(atoms, threads, bn):
    """The dSReLU epilogue sums a row over ((pair, half, group), m, n) value
    modes and then across the 4 lanes of a quad: check that layout assumption
    on the tiled MMAs the kernel builds (two warpgroups of 64 rows, or one
    warpgroup over both 64-row halves)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode

    seen = {}

    @cute.jit
    def probe():
        tm = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, atoms, tiler_mn=(64, bn),
        )
        ident = cute.make_identity_tensor((128, bn))
        for t in cutlass.range_constexpr(threads):  # static: coordinates are ints
            pc = tm.get_slice(t).partition_C(ident)
            seen[t] = (
                tuple(cute.size(pc.shape[0][i]) for i in range(3)) + (cute.size(pc.shape[1]),),
                [[tuple(pc[(p, h, g), mm, 0]) for g in range(bn // 8) for p in range(2)]
                 for mm in range(cute.size(pc.shape[1])) for h in range(2)],
            )

    probe()
    cover = set()
    for t, (modes, rows_of) in seen.items():
        assert modes == (2, 2, bn // 8, 256 // threads)
        for crds in rows_of:  # fixed (m, half) -> one row per thread
            assert len({c[0] for c in crds}) == 1
            cover.update(crds)
        mine = {crds[0][0] for crds in rows_of}
        for q in range((t // 4) * 4, (t // 4) * 4 + 4):  # the quad's 4 lanes hold the same rows
            assert {crds[0][0] for crds in seen[q][1]} == mine
    assert len(cover) == 128 * bn  # every element owned by exactly one thread


def test_rejects_bad_shapes():
    import cutlass

    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    with pytest.raises(ValueError):
        GroupedGemmSm90(cutlass.BFloat16, 100, 64, 2, b_n_major=False)  # N % 8
    with pytest.raises(ValueError):
        GroupedGemmSm90(cutlass.BFloat16, 128, 64, 2, b_n_major=False, epilogue="gelu")
    with pytest.raises(ValueError):
        GroupedGemmSm90(cutlass.BFloat16, 128, 64, 2, b_n_major=False, tile_mn=(128, 96))


def test_pick_tile():
    from te_offload_ops.kernels import pick_tile

    assert pick_tile(2688) == (128, 192)  # 14 exact blocks
    assert pick_tile(1856) == (128, 192)  # 96.7 % of the last blocks used
    assert pick_tile(4096) == (128, 256)
    assert pick_tile(48) == (128, 64)


# (dtype, M, N, E, cluster): the two fused-MLP wgrads at the benchmark shape,
# an odd fp16 shape, and the single-CTA form
WGRAD_VARIANTS = [
    (torch.bfloat16, 1856, 2688, 8, None),  # fc1 wgrad dz^T x
    (torch.bfloat16, 2688, 1856, 8, None),  # fc2 wgrad dy^T act
    (torch.float16, 136, 200, 5, None),
    (torch.bfloat16, 1856, 2688, 8, 1),
]


@pytest.mark.parametrize(
    "dtype,m,n,e,cluster_n", WGRAD_VARIANTS,
    ids=[f"{str(v[0])[6:]}-M{v[1]}-N{v[2]}-E{v[3]}-c{v[4]}" for v in WGRAD_VARIANTS],
)
def test_wgrad_form_compiles_for_sm90a(dtype, m, n, e, cluster_n):
    """Weight-gradient form: both operands MN-major, the tail k-tile zeroed in smem."""
    from te_offload_ops.kernels import compile_variant, pick_tile

    kern, compiled, secs = compile_variant(
        dtype, n, 0, e, b_n_major=True, epilogue="plain", options="--keep-ptx", wgrad_m=m,
        cluster_n=cluster_n,
    )
    ptx = str(compiled.artifacts.PTX)
    bn = pick_tile(n, kern.schedule)[1]
    ab = "bf16" if dtype == torch.bfloat16 else "f16"
    assert kern.wgrad_m == m and kern.bn == bn
    assert f"wgmma.mma_async.sync.aligned.m64n{bn}k16.f32.{ab}.{ab}" in ptx
    # A (M, T) and B (N, T): 2-D descriptors over the token matrices, no per-expert mode
    assert "cp.async.bulk.tensor.2d" in ptx and "cp.async.bulk.tensor.3d" not in ptx
    # generic-proxy zeroing of the tail k-tile is fenced before WGMMA reads it
    assert "fence.proxy.async.shared::cta" in ptx
    assert "bar.sync" in ptx or "barrier.sync" in ptx
    assert ("multicast::cluster" in ptx) == (kern.cluster_n == 2)
    assert "st.global.v4.b32" in ptx
    print(f"compile wgrad M={m} N={n} E={e}: {secs:.2f} s")


def test_wgrad_form_rejects_bad_arguments():
    import cutlass

    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    with pytest.raises(ValueError, match="plain or main-grad epilogue"):
        GroupedGemmSm90(cutlass.BFloat16, 128, 0, 2, b_n_major=True, epilogue="srelu", wgrad_m=128)
    with pytest.raises(ValueError, match="plain or main-grad epilogue"):
        GroupedGemmSm90(cutlass.BFloat16, 128, 64, 2, b_n_major=True, wgrad_m=128)  # k != 0
    with pytest.raises(ValueError, match="belongs to the weight-gradient form"):
        GroupedGemmSm90(cutlass.BFloat16, 128, 64, 2, b_n_major=True, epilogue="acc_f32")
    with pytest.raises(ValueError, match="multiple of 8"):
        GroupedGemmSm90(cutlass.BFloat16, 128, 0, 2, b_n_major=True, wgrad_m=100)


def test_two_output_epilogues_stage_narrower_chunks_for_one_more_stage():
    """srelu/dsrelu stage 32 columns at a time, plain 64: at the pingpong tile the narrower
    staging leaves shared memory for 5 mainloop stages where 64 columns allow 4.  Both widths
    compile to 16-byte stores; other widths are refused."""
    import cutlass

    from te_offload_ops.kernels import compile_variant
    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    def make(epilogue, **kw):
        return GroupedGemmSm90(cutlass.BFloat16, 1856, 2688, 8, b_n_major=epilogue == "dsrelu",
                               epilogue=epilogue, tile_mn=(128, 128), schedule="pingpong", **kw)

    for epilogue in ("srelu", "dsrelu"):
        assert (make(epilogue).epi_cols, make(epilogue).stages) == (32, 5)
        assert (make(epilogue, epi_cols=64).epi_cols, make(epilogue, epi_cols=64).stages) == (64, 4)
    assert (make("plain").epi_cols, make("plain").stages) == (64, 5)
    with pytest.raises(ValueError, match="columns"):
        make("srelu", epi_cols=48)
    for cols in (32, 64):
        kern, compiled, _ = compile_variant(
            torch.bfloat16, 384, 1856, 4, b_n_major=True, epilogue="dsrelu", options="--keep-ptx",
            schedule="pingpong", epi_cols=cols,
        )
        assert kern.epi_cols == cols
        assert "st.global.v4.b32" in str(compiled.artifacts.PTX)


@pytest.mark.parametrize("call", ["tvm-ffi", "python"])
def test_both_call_conventions_compile(call):
    """The TVM-FFI convention (the default where apache-tvm-ffi is installed) and the Python
    executor compile the same kernel; the kernel object records which one _launch must use."""
    from te_offload_ops.kernels import availability, compile_variant

    if call == "tvm-ffi" and not availability.has_tvm_ffi():
        pytest.skip("apache-tvm-ffi is not installed")
    kern, compiled, _ = compile_variant(
        torch.bfloat16, 384, 256, 4, b_n_major=False, epilogue="srelu", options="--keep-ptx", call=call,
    )
    assert kern.call == call
    assert ("TVMFFI" in type(compiled).__name__) == (call == "tvm-ffi")
    assert "wgmma.mma_async" in str(compiled.artifacts.PTX)


@pytest.mark.parametrize("epilogue", ["acc_f32", "store_f32"])
@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
def test_main_grad_wgrad_compiles_and_writes_fp32_in_place(epilogue, schedule):
    """Megatron's wgrad fusion: the weight-gradient form with an fp32 epilogue into main_grad.

    acc_f32 reads each accumulator element's main_grad value and stores the sum, as 8-byte column
    pairs (as many vector loads as stores); store_f32 only stores. The
    expert's buffer is found through a 64-bit offset load; nothing is staged through shared
    memory and nothing spills."""
    from te_offload_ops.kernels import compile_variant

    kern, compiled, _ = compile_variant(torch.bfloat16, 2688, 0, 8, b_n_major=True, epilogue=epilogue,
                                        wgrad_m=1856, schedule=schedule, options="--keep-ptx", call="python")
    ptx = str(compiled.artifacts.PTX)
    acc_elems = kern.bm * kern.bn // kern.tile_threads
    stores = len(re.findall(r"st\.global\.v2\.b32", ptx))  # column pairs as 8-byte vectors
    loads = len(re.findall(r"ld\.global\.v2\.b32", ptx))
    assert stores == acc_elems // 2
    assert loads == (acc_elems // 2 if epilogue == "acc_f32" else 0)
    assert "ld.global.b64" in ptx  # the expert's offset into the main_grad allocation
    assert "st.shared" not in ptx.split("wgmma.mma_async")[-1]  # no staging after the last MMA
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx



@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
def test_main_grad_by_reductions_issues_one_red_per_pair_and_no_loads(schedule):
    """The "red" add into main_grad: one fire-and-forget 8-byte fp32 reduction per accumulator
    column pair, no main_grad loads, no stores."""
    from te_offload_ops.kernels import compile_variant

    kern, compiled, _ = compile_variant(torch.bfloat16, 2688, 0, 8, b_n_major=True, epilogue="red_f32",
                                        wgrad_m=1856, schedule=schedule, options="--keep-ptx", call="python")
    ptx = str(compiled.artifacts.PTX)
    pairs = kern.bm * kern.bn // kern.tile_threads // 2
    assert len(re.findall(r"red\.relaxed\.gpu\.global\.add\.v2\.f32", ptx)) == pairs
    assert not re.search(r"ld\.global\.v2|st\.global", ptx)


@pytest.mark.parametrize("schedule", ["cooperative", "pingpong"])
def test_main_grad_by_tma_reduce_adds_one_bulk_reduction_per_box(schedule):
    """The "tma" add: the tile leaves as BN / 32 bulk tensor reduce-adds (fp32 boxes of 128 x 32
    staged in shared memory) into a 3-D (M, N, slot) tensor map; no main_grad loads, no per-element
    stores or reductions to global memory, nothing spilled."""
    from te_offload_ops.kernels import compile_variant

    kern, compiled, _ = compile_variant(torch.bfloat16, 2688, 0, 8, b_n_major=True, epilogue="tma_f32",
                                        wgrad_m=1856, schedule=schedule, options="--keep-ptx", call="python",
                                        slot_stride=1856 * 2688)
    ptx = str(compiled.artifacts.PTX)
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor\.3d\.global\.shared::cta\.add", ptx)) == kern.bn // 32
    assert not re.search(r"ld\.global\.v2|st\.global|red\.relaxed", ptx)
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_tma_epilogue_needs_a_slot_stride():
    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    with pytest.raises(ValueError, match="slot_stride"):
        GroupedGemmSm90(cutlass.BFloat16, 128, 0, 2, b_n_major=True, epilogue="tma_f32", wgrad_m=64)
    with pytest.raises(ValueError, match="at least M \\* N"):
        GroupedGemmSm90(cutlass.BFloat16, 128, 0, 2, b_n_major=True, epilogue="tma_f32", wgrad_m=64,
                        slot_stride=64 * 128 - 4)
    with pytest.raises(ValueError, match="slot_stride"):
        GroupedGemmSm90(cutlass.BFloat16, 128, 0, 2, b_n_major=True, epilogue="red_f32", wgrad_m=64,
                        slot_stride=64 * 128)


@pytest.mark.parametrize("epilogue, b_n_major", [("srelu", False), ("dsrelu", True), ("plain", True)])
def test_weights_in_reverse_order_with_padding_compile(epilogue, b_n_major):
    """Megatron's DDP buffer: the experts' weights last first, padded apart. The forward and dgrad
    kernels read them in place (a padded expert stride, expert e at slot E - 1 - e)."""
    from te_offload_ops.kernels import compile_variant

    n, k = (1856, 2688) if not b_n_major else (2688, 1856)
    kern, compiled, _ = compile_variant(torch.bfloat16, n, k, 8, b_n_major=b_n_major, epilogue=epilogue,
                                        options="--keep-ptx", call="python", b_layout=(n * k + 64, True))
    assert kern.b_reversed and kern.b_stride == n * k + 64
    ptx = str(compiled.artifacts.PTX)
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_weight_layout_checks():
    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    with pytest.raises(ValueError, match="b_stride must be at least"):
        GroupedGemmSm90(cutlass.BFloat16, 128, 64, 2, b_n_major=False, b_stride=128 * 64 - 8)
    with pytest.raises(ValueError, match="not wgrad"):
        GroupedGemmSm90(cutlass.BFloat16, 128, 0, 2, b_n_major=True, wgrad_m=64, b_reversed=True)


def test_main_grad_add_choice(monkeypatch):
    from te_offload_ops.kernels import main_grad_add

    monkeypatch.delenv("TEO_MAIN_GRAD_ADD", raising=False)
    assert main_grad_add() == "tma"
    monkeypatch.setenv("TEO_MAIN_GRAD_ADD", "rmw")
    assert main_grad_add() == "rmw"
    assert main_grad_add("tma") == "tma"
    monkeypatch.setenv("TEO_MAIN_GRAD_ADD", "atomic")
    with pytest.raises(ValueError, match="rmw.*red"):
        main_grad_add()


# ---------------------------------------------------------------------------------------------
# 2 x 2 clusters (opt-in, TEO_GEMM_CLUSTER_M=2): B multicast over m-block pairs as well as A
# over n-block pairs


@pytest.mark.parametrize("schedule", ["pingpong", "cooperative"])
@pytest.mark.parametrize("epilogue", ["plain", "tma_f32", "red_f32", "acc_f32", "store_f32"])
def test_two_by_two_cluster_wgrad_compiles_and_multicasts_both_operands(epilogue, schedule):
    from te_offload_ops.kernels import compile_variant

    m, n, e = 1856, 2688, 8  # fc1's wgrad: 15 m-blocks, an odd count (phantom m-partners)
    kw = {"slot_stride": m * n} if epilogue == "tma_f32" else {}
    kern, compiled, _ = compile_variant(
        torch.bfloat16, n, 0, e, b_n_major=True, epilogue=epilogue, options="--keep-ptx", wgrad_m=m,
        schedule=schedule, cluster_n=2, cluster_m=2, **kw,
    )
    ptx = str(compiled.artifacts.PTX)
    assert (kern.cluster_m, kern.cluster_n, kern.cluster_size) == (2, 2, 4)
    # (m-pairs x n-pairs) groups per expert, each of four tiles
    assert kern.wgrad_groups == -(-kern.m_tiles // 2) * -(-kern.n_tiles // 2)
    assert kern.wgrad_tiles == 4 * kern.wgrad_groups
    loads = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor.2d" in ln and "global" in ln]
    # A and B both multicast (two multicast load sites); no whole-A load for straddling pairs
    assert sum("multicast::cluster" in ln for ln in loads) >= 2, loads
    assert all("multicast::cluster" in ln for ln in loads), loads
    # every consumer warp arrives on three CTAs' empty barriers (itself, its row, its column)
    assert "mapa" in ptx or "shared::cluster" in ptx


def test_two_by_two_cluster_is_opt_in(monkeypatch):
    import cutlass

    from te_offload_ops.kernels import tiling
    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    monkeypatch.delenv(tiling.CLUSTER_M_ENV, raising=False)
    assert tiling.pick_cluster_m(1856, 2688, (128, 128), 2) == 1  # off unless asked for
    monkeypatch.setenv(tiling.CLUSTER_M_ENV, "2")
    assert tiling.pick_cluster_m(1856, 2688, (128, 128), 2) == 2
    assert tiling.pick_cluster_m(None, 2688, (128, 128), 2) == 2  # forward / dgrad: per m-pair
    assert tiling.pick_cluster_m(None, 128, (128, 128), 2) == 1  # one n-block
    assert tiling.pick_cluster_m(128, 2688, (128, 128), 2) == 1  # one m-block: nothing to share
    assert tiling.pick_cluster_m(1856, 2688, (128, 128), 1) == 1
    monkeypatch.setenv(tiling.CLUSTER_M_ENV, "4")
    with pytest.raises(ValueError, match="TEO_GEMM_CLUSTER_M must be 1 or 2, got '4'"):
        tiling.pick_cluster_m(1856, 2688, (128, 128), 2)

    with pytest.raises(ValueError, match="goes with cluster_n=2"):
        GroupedGemmSm90(cutlass.BFloat16, 256, 64, 2, b_n_major=False, cluster_n=1, cluster_m=2)
    with pytest.raises(ValueError, match="cluster_m must be 1 or 2"):
        GroupedGemmSm90(cutlass.BFloat16, 256, 0, 2, b_n_major=True, wgrad_m=256, cluster_n=2, cluster_m=3)


FORWARD_2X2 = [
    (1856, 2688, False, "srelu", "pingpong"),  # fc1 fwd + SReLU
    (2688, 1856, False, "plain", "pingpong"),  # fc2 fwd
    (1856, 2688, True, "dsrelu", "pingpong"),  # fc2 dgrad + dSReLU
    (2688, 1856, True, "plain", "cooperative"),  # fc1 dgrad
]


@pytest.mark.parametrize("n,k,b_n_major,epilogue,schedule", FORWARD_2X2)
def test_two_by_two_cluster_forward_forms_compile(n, k, b_n_major, epilogue, schedule):
    """Forward / dgrad: A (token rows) shared by the n-pair, B (the expert's weight tile) by the
    m-pair where both m-blocks are of one expert, else loaded whole through a plain descriptor."""
    from te_offload_ops.kernels import compile_variant

    kern, compiled, _ = compile_variant(
        torch.bfloat16, n, k, 8, b_n_major=b_n_major, epilogue=epilogue, options="--keep-ptx",
        schedule=schedule, cluster_n=2, cluster_m=2,
    )
    ptx = str(compiled.artifacts.PTX)
    assert (kern.cluster_m, kern.cluster_size, kern.n_pairs) == (2, 4, -(-kern.n_tiles // 2))
    loads = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln and "global" in ln]
    multicast = [ln for ln in loads if "multicast::cluster" in ln]
    assert multicast and len(multicast) < len(loads), loads  # shared A and B, and B whole
    assert all(".3d" in ln for ln in loads if ln not in multicast)  # the whole B: (N, K, expert)


@pytest.mark.parametrize("n", [64, 200, 1856, 4096, 14336])
def test_dsrelu_bwd_bytes_match_the_kernel_the_launch_builds(n, monkeypatch):
    """What the fused backward announces to an offload engine's budget for the dsrelu GEMM: dz, then
    one fp32 row of dprobs partials per n-block of the kernel get_kernel builds for the launch (its
    tile and schedule captured from the call that would compile it)."""
    import cutlass

    from te_offload_ops.kernels import api, registry
    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    built = []

    def fake_compile(dtype, n_, k, e, b_n_major, epilogue, tile, *, cluster_n, wgrad_m, schedule, call,
                     slot_stride, b_layout, cluster_m):
        built.append(GroupedGemmSm90(cutlass.BFloat16, n_, k, e, b_n_major=b_n_major, epilogue=epilogue, tile_mn=tile,
                                     cluster_n=cluster_n, schedule=schedule))
        return built[-1], None, 0.0

    monkeypatch.setattr(api, "_compile", fake_compile)
    # an empty cache, so that the call compiles; the real kernels are back afterwards (the fake must
    # not serve a later test)
    monkeypatch.setattr(registry, "CACHE", {})
    monkeypatch.setattr(registry, "_COMPILE_SECONDS", {})
    api.get_kernel(torch.bfloat16, n, 1024, 8, b_n_major=True, epilogue="dsrelu")
    t = 12345
    assert api.dsrelu_bwd_bytes(t, n, 2) == [t * n * 2, built[0].n_tiles * t * 4]
    assert api.dsrelu_bwd_bytes(0, n, 2) == [0]
