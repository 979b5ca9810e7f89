"""GPU: the grouped FP8 GEMM against two oracles, on operands quantized by TE's own quantizer.

Operands are random bf16 data quantized by TE's ``Float8BlockQuantizer`` (1x128 for the tokens,
128x128 for each expert's weight, power-of-two scales as ``Float8BlockScaling`` uses); the
padding entries of both scale tensors are set to NaN and the output is poisoned with NaN before
each run, so a read of padding, a missed row or a write past an expert shows. Oracles:

* the fp64 product of the operands as TE dequantizes them, per expert;
* ``fp8_blockwise_ref.emulate_grouped_gemm_fp8``, the kernel's own blocking and promotion
  order in fp32, whose only difference is the tensor cores' summation inside a 128-K block
  (it reads the scales as this package understands TE's layouts: where only the first oracle
  fails, the layouts are misread; where both fail, the kernel is wrong).

Against either, the relative error (Frobenius norm) must stay within the output dtype's rounding.
"""

import importlib.util

import pytest
import torch
from conftest import requires_sm90
from fp8_blockwise_ref import emulate_grouped_gemm_fp8, reference_grouped_gemm, rel_err

pytestmark = [requires_sm90]
if importlib.util.find_spec("pytest_timeout") is not None:
    # a hung kernel (mbarrier deadlock) blocks inside a CUDA call: only the thread method reports it
    pytestmark.append(pytest.mark.timeout(300, method="thread"))

# relative-error bounds against either oracle's unrounded result: the output dtype's rounding
# (bf16 1.66e-3, fp16 2.1e-4 on such data) plus the FP8 tensor cores' in-block summation
TOL = {torch.bfloat16: 2e-3, torch.float16: 4e-4}

# E=8: zero-token experts, counts off the 128-row grid, one large expert
SPLITS = [0, 130, 1, 0, 383, 128, 7, 2000]


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    """The emulation's fp32 partial sums must not run in TF32."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _quantizer(dim):
    import transformer_engine.pytorch  # noqa: F401  (loads the extension module first)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    return Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, block_scaling_dim=dim)


def make_operands(splits, n, k, seed=0, tokens=None):
    """TE-quantized operands and their TE-dequantized values: (a, sa, b, sb, a_real, b_real).
    ``tokens``: rows of A (>= sum(splits); the rest belong to no expert)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    t, e = tokens or sum(splits), len(splits)
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(e, n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    xq = _quantizer(1)(x)
    wq = [_quantizer(2)(w[i]) for i in range(e)]
    a, sa = xq._rowwise_data, xq._rowwise_scale_inv
    b = torch.stack([q._rowwise_data for q in wq])
    sb = torch.stack([q._rowwise_scale_inv for q in wq])
    kb = -(-k // 128)
    assert sa.shape == (kb, -(-t // 4) * 4) and sb.shape == (e, -(-n // 128), -(-kb // 4) * 4)
    sa[:, t:] = float("nan")  # TE leaves the padding uninitialised: no read of it may matter
    sb[:, :, kb:] = float("nan")
    a_real = xq.dequantize(dtype=torch.float32)
    b_real = torch.stack([q.dequantize(dtype=torch.float32) for q in wq])
    return a, sa, b, sb, a_real, b_real


def _run(a, sa, b, sb, splits, out_dtype=torch.bfloat16, **kw):
    from te_offload_ops.kernels import grouped_gemm_fp8_blockwise

    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=out_dtype, device="cuda")
    s = torch.tensor(splits, dtype=torch.int32, device="cuda")
    got = grouped_gemm_fp8_blockwise(a, sa, b, sb, s, out_dtype, out=out, **kw)
    assert got.data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    return out


def _check(out, a, sa, b, sb, a_real, b_real, splits):
    rows = sum(splits)
    assert not torch.isnan(out[:rows]).any(), "rows of an expert left unwritten (or NaN from a padding scale)"
    assert torch.isnan(out[rows:]).all(), "rows past the split sizes were written"
    ref = reference_grouped_gemm(a_real, b_real, splits)
    emu = emulate_grouped_gemm_fp8(a, sa, b, sb, splits, out_dtype=None)  # fp32, before the output rounding
    err_ref, err_emu = rel_err(out[:rows], ref[:rows]), rel_err(out[:rows], emu[:rows])
    said = f"relative error vs fp64 reference {err_ref:.2e}, vs emulation {err_emu:.2e}"
    assert err_ref < TOL[out.dtype] and err_emu < TOL[out.dtype], said
    return err_ref, err_emu


# the MLP's GEMMs at H=2688 with F=1792 (aligned) and F=1856 (a partial 128-block in N for fc1,
# in K for fc2), and the benchmark's shapes
SHAPES = [(1792, 2688), (2688, 1792), (1856, 2688), (2688, 1856), (2048, 4096), (4096, 2048)]


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
def test_fp8_grouped_gemm_matches_both_oracles(n, k):
    a, sa, b, sb, a_real, b_real = make_operands(SPLITS, n, k)
    out = _run(a, sa, b, sb, SPLITS)
    errs = _check(out, a, sa, b, sb, a_real, b_real, SPLITS)
    print(f"N={n} K={k}: rel err vs fp64 {errs[0]:.2e}, vs emulation {errs[1]:.2e}")


@pytest.mark.parametrize("n,k", [(1856, 2688), (2688, 1856), (64, 128)], ids=["fc1", "fc2", "one-k-block"])
def test_fp8_promotions_give_the_same_bits(n, k):
    """The overlapped promotion (the default) adds the same fp32 products in the same order as the
    serial one: outputs equal bit for bit, both within the oracles' tolerance."""
    a, sa, b, sb, a_real, b_real = make_operands(SPLITS, n, k, seed=3)
    outs = {p: _run(a, sa, b, sb, SPLITS, promotion=p) for p in ("serial", "overlap")}
    _check(outs["overlap"], a, sa, b, sb, a_real, b_real, SPLITS)
    rows = sum(SPLITS)
    assert torch.equal(outs["serial"][:rows], outs["overlap"][:rows])


@pytest.mark.parametrize("tile,cluster", [((128, 64), "auto"), ((128, 192), "auto"), ((128, 128), "1")],
                         ids=["BN64", "BN192", "BN128-no-cluster"])
def test_fp8_tiles_and_cluster_choice(tile, cluster, monkeypatch):
    if cluster == "1":
        monkeypatch.setenv("TEO_GEMM_CLUSTER_N", "1")
    n, k = 1856, 1856  # partial blocks in N and K; BN=192 tiles straddle two scale blocks
    a, sa, b, sb, a_real, b_real = make_operands(SPLITS, n, k, seed=1)
    out = _run(a, sa, b, sb, SPLITS, tile=tile)
    _check(out, a, sa, b, sb, a_real, b_real, SPLITS)


def test_fp8_fp16_output():
    n, k = 2688, 1856
    a, sa, b, sb, a_real, b_real = make_operands(SPLITS, n, k, seed=2)
    out = _run(a, sa, b, sb, SPLITS, torch.float16)
    _check(out, a, sa, b, sb, a_real, b_real, SPLITS)


def test_fp8_rows_past_the_splits_and_strided_scales():
    """T beyond sum(splits) (those rows stay untouched), A's scales read through a row stride
    wider than TE's (a view of a larger buffer), B's scales as TE's 2-D stack, splits on the CPU."""
    splits = [300, 0, 77, 129]
    n, k = 384, 640
    a, sa, b, sb, a_real, b_real = make_operands(splits, n, k, seed=3, tokens=600)
    wide = torch.full((sa.shape[0], sa.shape[1] + 64), float("nan"), device="cuda")
    wide[:, : sa.shape[1]] = sa
    sa_view = wide[:, : sa.shape[1]]
    assert sa_view.stride(0) != sa.shape[1]
    from te_offload_ops.kernels import grouped_gemm_fp8_blockwise

    out = torch.full((600, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    grouped_gemm_fp8_blockwise(a, sa_view, b, sb.reshape(-1, sb.shape[2]), torch.tensor(splits), out=out)
    torch.cuda.synchronize()
    _check(out, a, sa, b, sb, a_real, b_real, splits)


def test_fp8_all_experts_empty_and_one_token():
    from te_offload_ops.kernels import grouped_gemm_fp8_blockwise

    a, sa, b, sb, a_real, b_real = make_operands([0, 1, 0], 256, 256, seed=4, tokens=8)
    out = _run(a, sa, b, sb, [0, 1, 0])
    _check(out, a, sa, b, sb, a_real, b_real, [0, 1, 0])
    out = _run(a, sa, b, sb, [0, 0, 0])
    assert torch.isnan(out).all()  # nothing to do: nothing written
    empty = grouped_gemm_fp8_blockwise(a[:0], sa, b, sb, torch.zeros(3, dtype=torch.int32, device="cuda"))
    assert empty.shape == (0, 256)


def test_fp8_large_tokens_per_expert():
    """E=8 x 4096 tokens at fc1's shape (F=1792): the persistent grid walks many tiles per CTA."""
    splits = [4096] * 8
    a, sa, b, sb, a_real, b_real = make_operands(splits, 1792, 2688, seed=5)
    out = _run(a, sa, b, sb, splits)
    _check(out, a, sa, b, sb, a_real, b_real, splits)


# 2 x 2 clusters (TEO_GEMM_CLUSTER_M=2): each tile runs the pair's k-loop, only where its operands
# come from changes, so every FP8 form must give the pair's bits. m-pairs straddling two experts
# (B loaded whole), phantoms past the last m-block and past N (odd block counts), partial k-blocks
FP8_2X2_SHAPES = [
    ([129, 0, 300, 1, 255], 576, 208),  # 2, 0, 3, 1, 2 m-blocks: pairs straddle; 5 n-blocks; K 128 + 80
    ([700, 300, 0, 1000], 1856, 2688),  # 17 m-blocks: a phantom partner past the last one
]


@pytest.mark.parametrize("splits,n,k", FP8_2X2_SHAPES, ids=["straddling-pairs", "phantom-partner"])
def test_fp8_two_by_two_clusters_give_the_pair_bits(monkeypatch, splits, n, k):
    from te_offload_ops import kernels
    from te_offload_ops.kernels import fp8_rows, registry, tiling

    if (reason := fp8_rows.unavailable()) is not None:
        pytest.skip(reason)
    a, sa, b, sb, a_real, b_real = make_operands(splits, n, k, seed=21)
    g = torch.Generator(device="cuda").manual_seed(22)
    t = sum(splits)
    s = torch.tensor(splits, dtype=torch.int32, device="cuda")
    probs = torch.rand(t, device="cuda", generator=g)
    # fc2's dgrad form: dy (T, K) against the weights (E, N, K), the saved z (T, N) in FP8
    z = (torch.randn(t, n, device="cuda", generator=g) * 2).bfloat16()
    _, _, zd, zs = fp8_rows.srelu_quantize(z, probs, 0.0, True)
    out = {}
    for cm in ("1", "2"):
        monkeypatch.setenv(tiling.CLUSTER_M_ENV, cm)
        out[cm] = (_run(a, sa, b, sb, splits),
                   *kernels.grouped_gemm_fp8_srelu_quantize(a, sa, b, sb, s, probs),
                   *kernels.grouped_gemm_fp8_dsrelu_quantize(a, sa, b, sb, s, zd, zs, probs))
        torch.cuda.synchronize()
    assert any(("cluster_m", 2) in key for key in registry.compile_times()), "no 2 x 2 kernel was compiled"
    names = ("c", "act", "act scales", "z", "z scales", "dz", "dz fp8", "dz scales", "dprobs", "act (bwd)")
    for name, x1, x2 in zip(names, out["1"], out["2"], strict=True):
        if name.endswith("scales"):  # (blocks, roundup(T, 4)): the padding past T is never written
            x1, x2 = x1[:, :t], x2[:, :t]
        assert torch.equal(x1, x2), name
    _check(out["2"][0], a, sa, b, sb, a_real, b_real, splits)
