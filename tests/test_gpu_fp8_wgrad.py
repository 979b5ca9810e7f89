"""GPU (sm_90): the grouped FP8 weight gradient (``kernels.api_fp8_wgrad``) against fp64 on the
same quantized operands.

The operands are the per-expert columnwise copies ``fp8_rows.quantize_columns`` makes (each
expert's tokens in TE's 128 x 1 blocks, padded to 128); the reference dequantizes them and sums
each expert's products in fp64. FP8 WGMMA accumulates a k-block in reduced precision before the
kernel promotes it to fp32, so the bound is relative (about 1e-3 of the result's scale) plus the
output dtype's rounding. Splits cover experts of 0, 1, 127, 128, 129 and thousands of tokens;
M and N include partial 128-blocks.
"""

from __future__ import annotations

import pytest
import torch

from mlp_steps import fused_path_problem

pytestmark = pytest.mark.skipif(fused_path_problem() is not None, reason=fused_path_problem() or "")

SPLITS = [0, 1, 127, 128, 129, 300, 2047, 5]


def _dequantize_columns(data, scales, rows):
    """(rows, Tp) fp64 from e4m3 bytes and their (Tp / 128, >= rows) scale-inverses."""
    values = data.view(torch.float8_e4m3fn).to(torch.float64)
    per_col = scales[:, :rows].t().to(torch.float64).repeat_interleave(128, dim=1)
    return values * per_col


def _reference(a_cols, b_cols, poff, splits):
    out = []
    for e, t in enumerate(splits):
        p0 = int(poff[e])
        out.append(a_cols[:, p0:p0 + t] @ b_cols[:, p0:p0 + t].t())
    return torch.stack(out)


def _operands(m, n, splits, seed):
    from te_offload_ops.kernels import fp8_rows

    if (reason := fp8_rows.unavailable()) is not None:
        pytest.skip(reason)
    split = torch.tensor(splits, device="cuda", dtype=torch.int32)
    t = sum(splits)
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(t, m, device="cuda", generator=g) * 0.5).bfloat16()  # e.g. dy
    b = (torch.randn(t, n, device="cuda", generator=g) * 2.0).bfloat16()  # e.g. act or x
    if t > 420:
        a[400:420] *= 1e-3  # a block of small values: another scale
    qa, sa = fp8_rows.quantize_columns(a, split, 0.0, False)
    _, poff = fp8_rows.expert_offsets(split)
    qb, sb = fp8_rows.quantize_columns(b, split, 0.0, False)
    return split, t, (qa, sa), (qb, sb), poff


@pytest.mark.parametrize("m,n", [(256, 128), (200, 136), (1856, 2688), (64, 64)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fp8_wgrad_matches_fp64_on_the_quantized_operands(m, n, out_dtype):
    from te_offload_ops.kernels.api_fp8_wgrad import grouped_wgrad_fp8_blockwise

    split, t, (qa, sa), (qb, sb), poff = _operands(m, n, SPLITS, seed=m + n)
    got = grouped_wgrad_fp8_blockwise(qa, sa, qb, sb, split, t, out_dtype=out_dtype)
    torch.cuda.synchronize()
    want = _reference(_dequantize_columns(qa, sa, m), _dequantize_columns(qb, sb, n), poff, SPLITS)
    assert got.shape == (len(SPLITS), m, n) and got.dtype == out_dtype
    assert torch.all(got[0] == 0), "an expert with no tokens gets zeros"
    for e, tokens in enumerate(SPLITS):
        if tokens == 0:
            continue
        g, w = got[e].to(torch.float64), want[e]
        scale = w.abs().max().item()
        err = (g - w).abs()
        rel = (err.norm() / w.norm()).item()
        assert rel < 2e-3, f"expert {e} ({tokens} tokens): relative error {rel:.2e}"
        assert err.max().item() <= 4e-3 * scale + 1e-30, f"expert {e}: worst {err.max().item():.3e} of {scale:.3e}"


def test_fp8_wgrad_runs_again_with_new_splits_and_no_host_sync():
    """One compiled variant, other routings (all tokens on one expert; every expert empty but
    one), and a capture of the launch: it reads the split sizes on the GPU only."""
    from te_offload_ops.kernels.api_fp8_wgrad import grouped_wgrad_fp8_blockwise

    m, n = 256, 128
    for splits in ([0, 0, 3000, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0], SPLITS):
        split, t, (qa, sa), (qb, sb), poff = _operands(m, n, splits, seed=len(splits) + sum(splits))
        got = grouped_wgrad_fp8_blockwise(qa, sa, qb, sb, split, t)
        want = _reference(_dequantize_columns(qa, sa, m), _dequantize_columns(qb, sb, n), poff, splits)
        rel = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert rel < 2e-3, (splits, rel)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_wgrad_fp8_blockwise(qa, sa, qb, sb, split, t)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)



@pytest.mark.parametrize("epilogue", ["plain", "main_grad"])
def test_fp8_wgrad_overlapped_promotion_gives_the_serial_promotions_bits(epilogue, monkeypatch):
    """The overlapped promotion (chunks of unrolled k-blocks, then a serial tail) sums the same
    products in the same order as the serial one: the same bits, for experts whose k-blocks fill
    whole chunks, end in a tail, or hold only a tail."""
    from te_offload_ops.kernels import api_fp8
    from te_offload_ops.kernels.api_fp8_wgrad import grouped_wgrad_fp8_blockwise, grouped_wgrad_fp8_main_grad
    from te_offload_ops.kernels.gemm_fp8_wgrad_sm90 import OVERLAP_CHUNK

    chunk_tokens = 128 * OVERLAP_CHUNK
    splits = [chunk_tokens, chunk_tokens + 300, 0, 300, 3 * chunk_tokens - 5, 1]
    m, n = 200, 256
    split, t, (qa, sa), (qb, sb), poff = _operands(m, n, splits, seed=7)
    outs = {}
    for promotion in ("serial", "overlap"):
        monkeypatch.setenv(api_fp8.PROMOTION_ENV, promotion)
        if epilogue == "plain":
            outs[promotion] = grouped_wgrad_fp8_blockwise(qa, sa, qb, sb, split, t)
        else:
            grads = torch.full((len(splits), m, n), 0.25, device="cuda")
            grouped_wgrad_fp8_main_grad(qa, sa, qb, sb, split, t, grads, accumulate=True)
            outs[promotion] = grads
    torch.cuda.synchronize()
    assert torch.equal(outs["overlap"], outs["serial"])
    want = _reference(_dequantize_columns(qa, sa, m), _dequantize_columns(qb, sb, n), poff, splits)
    got = outs["overlap"].double() - (0.25 if epilogue == "main_grad" else 0.0)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 2e-3, rel

# -- the fused op with TEO_FP8_WGRAD=fp8 ------------------------------------------------------------

FUSED_CASES = {  # name -> (experts, hidden, ffn, splits)
    "uneven-zero-partial-ffn": (4, 384, 320, (0, 130, 1, 253)),
    "mlp-shape": (8, 2688, 1856, (2048, 0, 4096, 1, 1500, 2047, 300, 2500)),
}


def _rel(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _fused_run(monkeypatch, mode, case, megatron=(), prepare=None):
    from mlp_steps import Config, attach_main_grads, make_inputs, make_stack, recipe_problem, run_step

    if (reason := recipe_problem("block")) is not None:
        pytest.skip(reason)
    monkeypatch.setenv("TEO_FP8_WGRAD", mode)
    e, h, f, splits = FUSED_CASES[case]
    cfg = Config(layers=1, experts=e, hidden=h, ffn=f, splits=splits, recipe="block", megatron=megatron)
    stack = make_stack(cfg)
    if "main_grad" in megatron:
        attach_main_grads(stack)
    if prepare is not None:
        prepare(stack)
    return run_step(stack, make_inputs(cfg), "none"), stack


def _main_grads_off_8_bytes(stack):
    """Each main_grad moved 4 bytes past an 8-byte boundary (same values)."""
    from mlp_steps import linears

    for op in linears(stack):
        for p in op.parameters():
            moved = torch.empty(p.main_grad.numel() + 1, device="cuda", dtype=torch.float32)[1:]
            moved.copy_(p.main_grad.reshape(-1))
            p.main_grad = moved.view(p.main_grad.shape)
            assert p.main_grad.data_ptr() % 8 == 4


def test_main_grad_off_an_8_byte_boundary_takes_the_bf16_wgrad(monkeypatch):
    """The FP8 wgrad adds fp32 pairs; buffers it cannot pair get the bf16 wgrad (the step runs,
    and its main_grad gains are those of the bf16-wgrad step, bit for bit)."""
    case = "uneven-zero-partial-ffn"
    bf16, _ = _fused_run(monkeypatch, "bf16", case, ("main_grad",), _main_grads_off_8_bytes)
    fp8, _ = _fused_run(monkeypatch, "fp8", case, ("main_grad",), _main_grads_off_8_bytes)
    assert torch.equal(fp8["out"], bf16["out"])
    for name, want in bf16["grads"].items():
        assert torch.equal(fp8["grads"][name], want), name


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_fp8_wgrads_change_only_the_weight_grads_and_those_by_fp8_error(case, monkeypatch):
    """The same step with bf16 and with FP8 wgrads: output, dx and dprobs bitwise alike (the
    wgrads feed nothing else); each expert's weight grad within FP8's error of the bf16 wgrad's,
    zero for an expert without tokens; x saved as its columnwise copy."""
    bf16, _ = _fused_run(monkeypatch, "bf16", case)
    fp8, stack = _fused_run(monkeypatch, "fp8", case)
    assert torch.equal(fp8["out"], bf16["out"])
    for name, want in bf16["grads"].items():
        got = fp8["grads"][name]
        if ".weight" not in name:
            assert torch.equal(got, want), name
        elif want.abs().max() == 0:
            assert torch.count_nonzero(got) == 0, name
        else:
            assert 0 < _rel(got, want) < 6e-2, (name, _rel(got, want))


@pytest.mark.parametrize("megatron", [("main_grad",), ("main_grad", "delay")], ids=["main_grad", "main_grad+delay"])
def test_fp8_wgrads_reach_main_grad_as_the_plain_fp8_wgrads(megatron, monkeypatch):
    """Megatron's settings: the FP8 wgrad added into fp32 main_grad (now or in backward_dw) gives
    the weight grads the op returns without them, to fp32 against bf16 rounding."""
    case = "uneven-zero-partial-ffn"
    plain, _ = _fused_run(monkeypatch, "fp8", case)
    got, _ = _fused_run(monkeypatch, "fp8", case, megatron=megatron)
    torch.testing.assert_close(got["out"], plain["out"], rtol=0, atol=0)
    for name, want in plain["grads"].items():
        if not name.startswith("L0."):
            continue
        g = got["grads"][name]
        if want.abs().max() == 0:
            assert torch.count_nonzero(g) == 0, name
        else:
            assert _rel(g, want) < 1e-2, (name, _rel(g, want))


@pytest.mark.parametrize("splits", [[0], [0, 0, 0, 0]], ids=["one-expert", "four-experts"])
def test_fp8_wgrad_of_a_rank_without_tokens_is_zero_and_overwrites_or_adds_nothing(splits):
    """No tokens (a rank under expert parallelism can get none): the padded copies are empty, the
    plain form returns zeros, main_grad keeps its values (even -0.0) or is zeroed when overwritten."""
    from te_offload_ops.kernels.api_fp8_wgrad import grouped_wgrad_fp8_blockwise, grouped_wgrad_fp8_main_grad

    e = len(splits)
    split, t, (qa, sa), (qb, sb), _ = _operands(64, 64, splits, seed=3)
    assert qa.shape[1] == 0
    assert torch.count_nonzero(grouped_wgrad_fp8_blockwise(qa, sa, qb, sb, split, t)) == 0
    mg = torch.ones(e, 64, 64, device="cuda")
    mg[:, 0, 0] = -0.0
    grouped_wgrad_fp8_main_grad(qa, sa, qb, sb, split, t, mg, accumulate=True)
    assert bool((mg[:, 1:] == 1).all()) and bool(torch.signbit(mg[:, 0, 0]).all())
    grouped_wgrad_fp8_main_grad(qa, sa, qb, sb, split, t, mg, accumulate=False)
    assert torch.count_nonzero(mg) == 0


def test_fp8_wgrad_reads_strided_split_sizes_as_their_values():
    """A split-size view with a stride (every other entry of a longer tensor) gives the wgrads of
    its values, as the contiguous copy does."""
    from te_offload_ops.kernels.api_fp8_wgrad import grouped_wgrad_fp8_blockwise

    split, t, (qa, sa), (qb, sb), _ = _operands(128, 128, SPLITS, seed=11)
    wide = torch.stack([split, torch.full_like(split, 7)], dim=1).reshape(-1)
    strided = wide[::2]
    assert not strided.is_contiguous() and torch.equal(strided, split)
    assert torch.equal(grouped_wgrad_fp8_blockwise(qa, sa, qb, sb, strided, t),
                       grouped_wgrad_fp8_blockwise(qa, sa, qb, sb, split, t))
