"""GPU: the fused path on operands past 2^31 elements (8 experts x 102,400 tokens, H=2688, F=1856:
x, y, dy and dx have 2.2e9 elements each), checked on sampled rows against an fp32 reference.

About 40 GB of GPU memory; skipped on smaller GPUs."""

import pytest
import torch

from mlp_steps import Config, fused_path_problem, make_stack
from te_offload_ops.fused.selection import DISABLE_ENV

E, PER_EXPERT, H, F = 8, 102_400, 2688, 1856
T = E * PER_EXPERT
NEEDED_BYTES = 48 << 30


@pytest.mark.gpu("sm_90", free_gib=NEEDED_BYTES >> 30)
@pytest.mark.skipif(fused_path_problem() is not None, reason=fused_path_problem() or "")
def test_fused_mlp_past_2_31_elements(monkeypatch):
    assert T * H > 2**31 and T * F < 2**31  # y, dy, dx past 2^31; z, act below
    monkeypatch.setenv(DISABLE_ENV, "1")
    torch.manual_seed(0)
    mlp = make_stack(Config(layers=1, experts=E, hidden=H, ffn=F, splits=(PER_EXPERT,) * E))[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    probs = torch.rand(T, device="cuda", dtype=torch.bfloat16, generator=g)
    splits = torch.full((E,), PER_EXPERT, device="cuda", dtype=torch.int64)
    y = mlp(x, splits, probs, splits)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    y.backward(dy)
    torch.cuda.synchronize()
    assert mlp._module_groups[0]._forward_ops[0][0].last_fallback_reasons == []

    w1 = [w.detach().float() for w in list(mlp[0].parameters())]
    w2 = [w.detach().float() for w in list(mlp[2].parameters())]
    # rows where row * H passes 2^31 (the last experts), and a few early ones
    first_past = 2**31 // H + 1
    rows = torch.cat([torch.arange(0, 64), torch.arange(first_past - 32, first_past + 32), torch.arange(T - 64, T)])
    rows = rows.to("cuda")
    experts = rows // PER_EXPERT
    for e in experts.unique().tolist():
        r = rows[experts == e]
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
