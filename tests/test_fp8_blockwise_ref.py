"""CPU: the pure-torch oracles of the grouped FP8 GEMM (``fp8_blockwise_ref``) are right.

The GPU test compares the kernel with two oracles: the fp64 product of the operands as TE
dequantizes them, and an emulation of the kernel's own arithmetic. Here the test helpers'
quantizer is checked against TE's dequantization code (the scale layouts), and the emulation
against the fp64 reference, on the shapes and splits the GPU test uses.
"""

import pytest
import torch

from fp8_blockwise_ref import (
    dequantize_blocks_128x128,
    dequantize_rows_1x128,
    emulate_grouped_gemm_fp8,
    quantize_blocks_128x128,
    quantize_rows_1x128,
    reference_grouped_gemm,
    rel_err,
)


def _te_dequantize(data, scale_inv, two_d):
    """TE's own dequantization (pure torch) of a Float8BlockwiseQTensorStorage built on the CPU."""
    import transformer_engine.pytorch  # noqa: F401  (loads the extension module first)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.storage.float8_blockwise_tensor_storage import (
        Float8BlockwiseQTensorStorage,
    )

    q = Float8BlockwiseQTensorStorage(data.view(torch.uint8), scale_inv, None, None, tex.DType.kFloat8E4M3,
                                      None, two_d, fake_dtype=torch.float32)
    return q.dequantize(dtype=torch.float32)


@pytest.mark.parametrize("t,k", [(200, 256), (131, 1856), (4, 128)])
def test_rowwise_1x128_layout_is_tes(t, k):
    x = torch.randn(t, k, dtype=torch.bfloat16) * torch.logspace(-3, 3, t)[:, None].bfloat16()
    data, sa = quantize_rows_1x128(x)
    assert sa.shape == (-(-k // 128), -(-t // 4) * 4)  # transposed, tokens padded to 4
    assert torch.isnan(sa[:, t:]).all()  # padding poisoned: a use of it would show
    mine = dequantize_rows_1x128(data, sa)
    torch.testing.assert_close(mine, _te_dequantize(data, sa, False), rtol=0, atol=0)
    assert rel_err(mine, x.float()) < 0.04  # e4m3 keeps 3 mantissa bits
    # power-of-two scales, one per row and 128-K block
    assert torch.equal(torch.frexp(sa[:, :t])[0].abs(), torch.full_like(sa[:, :t], 0.5))


@pytest.mark.parametrize("n,k", [(384, 256), (1856, 2688), (2688, 1856)])
def test_blockwise_128x128_layout_is_tes(n, k):
    w = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
    data, sb = quantize_blocks_128x128(w)
    kb = -(-k // 128)
    assert sb.shape == (-(-n // 128), -(-kb // 4) * 4)  # k-blocks padded to 4
    mine = dequantize_blocks_128x128(data, sb)
    torch.testing.assert_close(mine, _te_dequantize(data, sb, True), rtol=0, atol=0)
    assert rel_err(mine, w.float()) < 0.04


def make_problem(splits, n, k, seed=0, expert_gain=1.0):
    """Random bf16 operands quantized as TE's recipe does: A 1x128 (one tensor over all tokens),
    each expert's weight 128x128 (expert i's weights ``expert_gain ** i`` times larger), the
    weights' scales stacked (E, ceil(N/128), Kp)."""
    g = torch.Generator().manual_seed(seed)
    t, e = sum(splits), len(splits)
    x = torch.randn(t, k, generator=g).bfloat16()
    gain = torch.tensor([expert_gain**i for i in range(e)])[:, None, None]
    w = (torch.randn(e, n, k, generator=g) * k**-0.5 * gain).bfloat16()
    a, sa = quantize_rows_1x128(x)
    bq = [quantize_blocks_128x128(w[i]) for i in range(e)]
    b = torch.stack([q[0] for q in bq])
    sb = torch.stack([q[1] for q in bq])
    return a, sa, b, sb, torch.tensor(splits)


# zero tokens, counts off the 128 grid, one large expert; N and K with partial 128-blocks
SPLITS = [[0, 130, 1, 0, 383, 128, 7, 600], [1000], [5, 0, 0]]
SHAPES = [(256, 384), (1856, 256), (384, 1856), (192, 128)]


@pytest.mark.parametrize("splits", SPLITS, ids=["mixed", "one", "tiny"])
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"N{n}-K{k}" for n, k in SHAPES])
def test_emulation_matches_the_fp64_product_of_the_dequantized_operands(splits, n, k):
    a, sa, b, sb, s = make_problem(splits, n, k)
    a_real = dequantize_rows_1x128(a, sa)
    b_real = torch.stack([dequantize_blocks_128x128(b[i], sb[i]) for i in range(b.shape[0])])
    ref = reference_grouped_gemm(a_real, b_real, s)
    acc = emulate_grouped_gemm_fp8(a, sa, b, sb, s, out_dtype=None)
    assert not torch.isnan(acc).any()  # every row belongs to an expert; no padding scale read
    assert rel_err(acc, ref) < 1e-6  # fp32 partial sums, one rounding per promotion
    out = emulate_grouped_gemm_fp8(a, sa, b, sb, s)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 3e-3  # bf16 output rounding: 2^-9 relative at most


def test_emulation_leaves_rows_past_the_splits_and_sees_scale_mistakes():
    a, sa, b, sb, s = make_problem([100, 50], 256, 256)
    out = emulate_grouped_gemm_fp8(a, sa, b, sb, torch.tensor([100, 40]), out_dtype=None)
    assert torch.isnan(out[140:]).all() and not torch.isnan(out[:140]).any()
    # the comparison is sensitive to the scale indexing: the experts' B scales swapped
    a, sa, b, sb, s = make_problem([100, 50], 256, 256, expert_gain=4.0)
    a_real = dequantize_rows_1x128(a, sa)
    b_real = torch.stack([dequantize_blocks_128x128(b[i], sb[i]) for i in range(2)])
    ref = reference_grouped_gemm(a_real, b_real, s)
    swapped = emulate_grouped_gemm_fp8(a, sa, b, sb.flip(0), s, out_dtype=None)
    assert rel_err(swapped, ref) > 0.5
