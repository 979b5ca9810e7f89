"""CPU: the pieces of the fused MLP's Float8BlockScaling path that are not GPU kernels: the
recipe's quantizers, the experts' FP8 weights in both orientations, dequantization of saved
rows, and the scaled SReLU's forward and backward from an FP8 z."""

import pytest
import torch
from transformer_engine.common.recipe import Float8BlockScaling, QParams

import te_offload_ops as teo
from te_offload_ops.fused import block_fp8

from fp8_blockwise_ref import (BLOCK, dequantize_blocks_128x128, dequantize_rows_1x128, quantize_blocks_128x128,
                               quantize_rows_1x128)


class RefQuantizer:
    """TE's Float8BlockQuantizer's outputs (uint8 data, GEMM-layout scales) from the torch oracle."""

    def __init__(self, dim: int):
        self.dim = dim

    def __call__(self, t):
        t = t.float()
        if self.dim == 1:
            data, scales = quantize_rows_1x128(t)
            return _Meta(rowwise_data=data.view(torch.uint8), rowwise_scale_inv=scales)
        data, scales = quantize_blocks_128x128(t)
        cols, col_scales = quantize_blocks_128x128(t.t().contiguous())
        return _Meta(rowwise_data=data.view(torch.uint8), rowwise_scale_inv=scales,
                     columnwise_data=cols.view(torch.uint8), columnwise_scale_inv=col_scales)


class _Meta:
    def __init__(self, **parts):
        self.parts = parts

    def get_metadata(self):
        return self.parts


def test_quantizers_follow_the_recipe():
    recipe = Float8BlockScaling()  # its QParams are class attributes, not constructor arguments
    recipe.fp8_quant_fwd_inp = QParams(power_2_scale=False, amax_epsilon=1e-3)
    qx, qw, qg = (block_fp8.quantizer(recipe, role) for role in ("input", "weight", "grad"))
    assert (qx.block_scaling_dim, qw.block_scaling_dim, qg.block_scaling_dim) == (1, 2, 1)
    assert (qx.force_pow_2_scales, qx.amax_epsilon) == (False, 1e-3)
    assert (qg.force_pow_2_scales, qg.amax_epsilon) == (True, 0.0)
    assert qw.columnwise_usage and not qx.columnwise_usage and not qg.columnwise_usage
    assert block_fp8.quantizer(Float8BlockScaling(), "grad") is qg  # one per setting


@pytest.mark.parametrize("n", [256, 192], ids=["out-multiple-of-128-one-call", "per-expert"])
def test_expert_weights_in_both_orientations_match_each_experts_own_quantization(n):
    e, k = 3, 200  # a partial last K block
    fc = teo.GroupedLinear(e, k, n, bias=False, device="cpu", dtype=torch.bfloat16)
    w = torch.stack([getattr(fc, f"weight{i}").detach() for i in range(e)])
    got = block_fp8.quantize_weights(fc, RefQuantizer(2))
    assert got.rows.shape == (e, n, k) and got.cols.shape == (e, k, n)
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    for i in range(e):
        ref = dequantize_blocks_128x128(*quantize_blocks_128x128(w[i].float()))
        assert torch.equal(dequantize_blocks_128x128(got.rows[i], got.row_scales[i]), ref)
        # the dgrad reads W^T: (K, N) rows with (ceil(K/128), ceil(N/128)) block scales
        assert got.col_scales.shape[1] == kb and got.col_scales.shape[2] >= nb
        assert torch.equal(dequantize_blocks_128x128(got.cols[i], got.col_scales[i]), ref.t())


def test_dequantized_rows_match_the_oracle_across_passes(monkeypatch):
    monkeypatch.setattr(block_fp8, "ROWS_PER_PASS", 7)
    x = torch.randn(30, 200) * torch.logspace(-3, 3, 30)[:, None]
    data, scales = quantize_rows_1x128(x)
    rows = block_fp8.Rows(data.view(torch.uint8), scales)
    got = block_fp8.dequantize_rows(rows, torch.float32)
    assert torch.equal(got, dequantize_rows_1x128(data, scales))
    assert block_fp8.dequantize_rows(rows, torch.bfloat16).dtype == torch.bfloat16


def test_scaled_srelu_and_its_backward_from_fp8_z_match_autograd(monkeypatch):
    monkeypatch.setattr(block_fp8, "ROWS_PER_PASS", 5)
    t, f = 12, 160
    data, scales = quantize_rows_1x128(torch.randn(t, f))
    z = dequantize_rows_1x128(data, scales).requires_grad_()
    probs = torch.rand(t, requires_grad=True)
    act = torch.relu(z).square() * probs[:, None]
    dact = torch.randn(t, f)
    act.backward(dact)
    dz, dprobs, act_again = block_fp8.dscaled_srelu(dact.clone(), block_fp8.Rows(data.view(torch.uint8), scales),
                                                    probs.detach())
    torch.testing.assert_close(dz, z.grad)
    torch.testing.assert_close(dprobs, probs.grad)
    torch.testing.assert_close(act_again, act.detach())
    torch.testing.assert_close(block_fp8.scaled_srelu(z.detach(), probs.detach()), act.detach())


def test_empty_rows_quantize_to_empty_fp8():
    rows = block_fp8.quantize_rows(torch.empty(0, 256), RefQuantizer(1))
    assert rows.data.shape == (0, 256) and rows.data.dtype == torch.uint8 and rows.scale_inv.shape == (2, 0)
    assert block_fp8.dequantize_rows(rows, torch.bfloat16).shape == (0, 256)


def test_step_weights_follow_megatrons_is_first_microbatch(monkeypatch):
    import te_offload_ops.fused.block_fp8 as mod

    made = []
    monkeypatch.setattr(mod, "quantize_weights", lambda op, q, recipe: made.append(op) or f"w{len(made)}")
    fc = teo.GroupedLinear(2, 128, 128, bias=False, device="cpu", dtype=torch.bfloat16)
    recipe = Float8BlockScaling()
    assert fc.is_first_microbatch is None  # the attribute Megatron's set_is_first_microbatch looks for
    assert [block_fp8.step_weights(fc, None, recipe) for _ in range(2)] == ["w1", "w2"]  # None: every call
    fc.is_first_microbatch = True  # a step's first micro-batch: quantized and kept
    assert block_fp8.step_weights(fc, None, recipe) == "w3" and fc.is_first_microbatch is False
    assert block_fp8.step_weights(fc, None, recipe) == "w3"  # later micro-batches: the kept ones
    fc.is_first_microbatch = True  # the next step (the optimizer may have written the weights)
    assert block_fp8.step_weights(fc, None, recipe) == "w4"
    other = Float8BlockScaling()
    other.fp8_quant_fwd_weight = QParams(power_2_scale=False, amax_epsilon=0.0)
    assert block_fp8.step_weights(fc, None, other) == "w5"  # other weight settings: not the kept ones
    monkeypatch.setattr(mod, "capturing", lambda: True)
    fc.is_first_microbatch = False
    assert block_fp8.step_weights(fc, None, other) == "w6"  # a graph's replays must quantize their step's
    assert made == [fc] * 6


def test_the_fp8_row_passes_default_to_the_gemm_epilogues_and_refuse_unknown_choices(monkeypatch):
    from te_offload_ops import settings

    monkeypatch.delenv(block_fp8.ROWS_ENV, raising=False)
    assert settings.fp8_rows() == "gemm"
    for choice in ("gemm", "triton", "torch"):
        monkeypatch.setenv(block_fp8.ROWS_ENV, choice)
        assert settings.fp8_rows() == choice
    monkeypatch.setenv(block_fp8.ROWS_ENV, "cublas")
    with pytest.raises(ValueError, match=r"TEO_FP8_ROWS must be one of gemm, triton, torch, got 'cublas'"):
        settings.fp8_rows()
    # the torch fallback does the rows in torch ops whatever Triton offers
    monkeypatch.setenv(block_fp8.ROWS_ENV, "torch")
    assert block_fp8._row_kernels() is None
