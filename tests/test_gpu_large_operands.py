"""GPU: the fused path on operands past 2^31 elements (8 experts x 102,400 tokens, H=2688, F=1856:
x, y, dy and dx have 2.2e9 elements each), in bf16 and under Float8BlockScaling (its weight
gradients in bf16 and in FP8), checked on sampled rows against an fp32 reference.

About 40 GB of GPU memory; skipped on smaller GPUs."""

import pytest
import torch

from mlp_steps import Config, fused_path_problem, make_stack
from te_offload_ops.fused.selection import DISABLE_ENV

E, PER_EXPERT, H, F = 8, 102_400, 2688, 1856
T = E * PER_EXPERT
NEEDED_BYTES = 48 << 30


def _step(recipe=None):
    """One forward and backward of the fused MLP at these shapes (under ``recipe``'s autocast):
    (mlp, y, x with its grad, probs, dy); the fused path ran, with no fallback."""
    from mlp_steps import quantized

    torch.manual_seed(0)
    mlp = make_stack(Config(layers=1, experts=E, hidden=H, ffn=F, splits=(PER_EXPERT,) * E, recipe=recipe))[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    probs = torch.rand(T, device="cuda", dtype=torch.bfloat16, generator=g)
    splits = torch.full((E,), PER_EXPERT, device="cuda", dtype=torch.int64)
    with quantized(recipe):
        y = mlp(x, splits, probs, splits)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    y.backward(dy)
    torch.cuda.synchronize()
    assert mlp._module_groups[0]._forward_ops[0][0].last_fallback_reasons == []
    return mlp, y, x, probs, dy


def _sampled_rows():
    """(expert, its rows) for rows where row * H passes 2^31 (the last experts), and a few early ones."""
    first_past = 2**31 // H + 1
    rows = torch.cat([torch.arange(0, 64), torch.arange(first_past - 32, first_past + 32), torch.arange(T - 64, T)])
    rows = rows.to("cuda")
    experts = rows // PER_EXPERT
    return [(e, rows[experts == e]) for e in experts.unique().tolist()]


@pytest.mark.gpu("sm_90", free_gib=NEEDED_BYTES >> 30)
@pytest.mark.skipif(fused_path_problem() is not None, reason=fused_path_problem() or "")
def test_fused_mlp_past_2_31_elements(monkeypatch):
    assert T * H > 2**31 and T * F < 2**31  # y, dy, dx past 2^31; z, act below
    monkeypatch.setenv(DISABLE_ENV, "1")
    mlp, y, x, probs, dy = _step()
    w1 = [w.detach().float() for w in list(mlp[0].parameters())]
    w2 = [w.detach().float() for w in list(mlp[2].parameters())]
    for e, r in _sampled_rows():
        xe, pe, dye = x.detach()[r].float(), probs[r].float()[:, None], dy[r].float()
        z = xe @ w1[e].t()
        act = torch.relu(z) ** 2 * pe
        ref_y = act @ w2[e].t()
        ref_dx = ((dye @ w2[e]) * pe * 2 * torch.relu(z)) @ w1[e]
        torch.testing.assert_close(y.detach()[r].float(), ref_y, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(x.grad[r].float(), ref_dx, atol=3e-2, rtol=3e-2)
    # the last expert's fc2 weight gradient, whose token rows all lie past 2^31 / H
    e = E - 1
    lo = e * PER_EXPERT
    xe = x.detach()[lo:].float()
    act = torch.relu(xe @ w1[e].t()) ** 2 * probs[lo:].float()[:, None]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # a 1-TFLOP reference; TF32's 1e-3 is well inside the bound
    try:
        ref_dw2 = dy[lo:].float().t() @ act
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    got = list(mlp[2].parameters())[e].grad.float()
    assert ((got - ref_dw2).norm() / ref_dw2.norm()).item() < 1e-2


@pytest.mark.gpu("sm_90", free_gib=(NEEDED_BYTES >> 30) + 8)
@pytest.mark.skipif(fused_path_problem() is not None, reason=fused_path_problem() or "")
def test_fused_fp8_mlp_past_2_31_elements(monkeypatch):
    """The same shapes under Float8BlockScaling: x, y, dy, dx and their FP8 copies past 2^31
    elements; sampled rows against fp32 on the same FP8 operands (row quantization is row-local, so
    the rows' reference quantizes only them), and against the unquantized step."""
    from test_gpu_fused_fp8 import _deq_rows, _deq_weight, rel_err
    from transformer_engine.common.recipe import Float8BlockScaling

    from te_offload_ops.fused import block_fp8

    monkeypatch.setenv(DISABLE_ENV, "1")
    mlp, y, x, probs, dy = _step("block")
    recipe = Float8BlockScaling()
    qx, qw, qg = (block_fp8.quantizer(recipe, r) for r in ("input", "weight", "grad"))
    w1 = [_deq_weight(w.detach(), qw) for w in mlp[0].parameters()]
    w2 = [_deq_weight(w.detach(), qw) for w in mlp[2].parameters()]
    for e, r in _sampled_rows():
        pe = probs[r].float()[:, None]
        z = _deq_rows(x.detach()[r], qx) @ w1[e].t()
        ref_y = _deq_rows((torch.relu(z) ** 2 * pe).bfloat16(), qx) @ w2[e].t()
        zr = torch.relu(_deq_rows(z.bfloat16(), qx))  # z is saved in FP8
        dz = (_deq_rows(dy[r], qg) @ w2[e]) * 2 * zr * pe
        ref_dx = _deq_rows(dz.bfloat16(), qg) @ w1[e]
        assert rel_err(y.detach()[r], ref_y) < 2e-2, (e, rel_err(y.detach()[r], ref_y))
        assert rel_err(x.grad[r], ref_dx) < 2e-2, (e, rel_err(x.grad[r], ref_dx))
        # the FP8 error itself against the unquantized step
        w1p, w2p = list(mlp[0].parameters())[e].detach().float(), list(mlp[2].parameters())[e].detach().float()
        plain_y = (torch.relu(x.detach()[r].float() @ w1p.t()) ** 2 * pe) @ w2p.t()
        assert rel_err(y.detach()[r], plain_y) < 1e-1
    # the last expert's fc2 weight gradient (bf16 GEMM on the saved FP8 z), rows all past 2^31 / H
    e = E - 1
    lo = e * PER_EXPERT
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True  # TF32's 1e-3 is well inside the bound
    try:
        zr = torch.relu(_deq_rows((_deq_rows(x.detach()[lo:], qx) @ w1[e].t()).bfloat16(), qx))
        ref_dw2 = dy[lo:].float().t() @ (zr * zr * probs[lo:].float()[:, None])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    got = list(mlp[2].parameters())[e].grad
    assert rel_err(got, ref_dw2) < 2e-2, rel_err(got, ref_dw2)


@pytest.mark.gpu("sm_90", free_gib=(NEEDED_BYTES >> 30) + 16)
@pytest.mark.skipif(fused_path_problem() is not None, reason=fused_path_problem() or "")
def test_fused_fp8_wgrads_past_2_31_elements(monkeypatch):
    """FP8 weight gradients (``TEO_FP8_WGRAD=fp8``) at these shapes: dy's and x's per-expert
    columnwise copies (H x padded tokens) pass 2^31 elements. The step's output and dx are those of
    the bf16-wgrad step bit for bit on sampled rows (the wgrads feed nothing else), and each
    expert's weight grads lie within FP8's error of that step's."""
    from test_gpu_fused_fp8 import rel_err

    from te_offload_ops.fused import fp8_wgrad
    from te_offload_ops.kernels import fp8_rows

    assert fp8_rows.padded_tokens(T, E) * H > 2**31
    monkeypatch.setenv(DISABLE_ENV, "1")
    rows = torch.cat([r for _, r in _sampled_rows()])
    runs = {}
    for mode in ("bf16", "fp8"):
        monkeypatch.setenv("TEO_FP8_WGRAD", mode)
        mlp, y, x, probs, dy = _step("block")
        if mode == "fp8":
            assert fp8_wgrad.wanted(dy)
        runs[mode] = (y.detach()[rows].clone(), x.grad[rows].clone(),
                      [p.grad.clone() for op in (mlp[0], mlp[2]) for p in op.parameters()])
        del mlp, y, x, probs, dy
        torch.cuda.empty_cache()
    (y16, dx16, w16), (y8, dx8, w8) = runs["bf16"], runs["fp8"]
    assert torch.equal(y8, y16) and torch.equal(dx8, dx16)
    for i, (got, want) in enumerate(zip(w8, w16, strict=True)):
        assert 0 < rel_err(got, want) < 6e-2, (i, rel_err(got, want))
