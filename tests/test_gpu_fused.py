"""GPU (sm_90): the fused SReLU grouped MLP against TE's unfused ops and an fp32 reference."""

import pytest
import torch

from mlp_steps import Config, forward_plan, fused_path_problem, make_inputs, make_stack, relay_expert_weights, run_step
from te_offload_ops.fused.selection import DISABLE_ENV

pytestmark = pytest.mark.skipif(fused_path_problem() is not None, reason=fused_path_problem() or "")

CASES = {  # name -> (experts, hidden, ffn, splits)
    "small-uneven-zero": (4, 256, 128, (0, 300, 77, 651)),
    "one-token-experts": (4, 128, 256, (1, 1, 0, 1)),
    "large-uneven": (8, 2688, 1856, (2048, 0, 4096, 1, 1500, 2047, 300, 2500)),
    "wide-ffn": (2, 1024, 4096, (3000, 1096)),
}


def reference(stack, inputs):
    """The same step in fp32 with autograd, expert by expert."""
    x, probs, dy, splits = inputs
    rows = splits.tolist()
    x32 = x.detach().float().requires_grad_()
    p32 = [p.detach().float().requires_grad_() for p in probs]
    params = [[w.detach().float().requires_grad_() for w in mlp.parameters()] for mlp in stack]
    h = x32
    for mlp_params, p in zip(params, p32):
        E = len(mlp_params) // 2
        w1, w2 = mlp_params[:E], mlp_params[E:]
        outs = []
        for e, (xe, pe) in enumerate(zip(h.split(rows), p.split(rows))):
            z = xe @ w1[e].t()
            outs.append((torch.relu(z) ** 2 * pe[:, None]) @ w2[e].t())
        h = torch.cat(outs)
    h.backward(dy.float())
    grads = {"x": x32.grad, **{f"probs{i}": p.grad for i, p in enumerate(p32)}}
    for i, mlp_params in enumerate(params):
        E = len(mlp_params) // 2
        for e in range(E):
            grads[f"L{i}.0.weight{e}"] = mlp_params[e].grad
            grads[f"L{i}.2.weight{e}"] = mlp_params[E + e].grad
    return h.detach(), grads


def rel_err(a, ref):
    return ((a.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_matches_unfused_and_fp32_reference(case, dtype, monkeypatch):
    E, H, F, splits = CASES[case]
    cfg = Config(layers=1, experts=E, hidden=H, ffn=F, splits=splits, dtype=dtype)
    monkeypatch.setenv(DISABLE_ENV, "1")
    fused = make_stack(cfg)
    monkeypatch.setenv(DISABLE_ENV, "0")
    unfused = make_stack(cfg)
    unfused[0].load_state_dict(fused[0].state_dict())
    inputs = make_inputs(cfg)
    monkeypatch.setenv(DISABLE_ENV, "1")
    got = run_step(fused, inputs, "none")
    monkeypatch.setenv(DISABLE_ENV, "0")
    base = run_step(unfused, inputs, "none")
    assert forward_plan(fused[0]) == ["FusedScaledSReLUMLP"]
    assert forward_plan(unfused[0]) == ["GroupedLinear", "ScaledSReLU", "GroupedLinear"]
    assert fused[0]._module_groups[0]._forward_ops[0][0].last_fallback_reasons == []

    ref_out, ref_grads = reference(fused, inputs)
    checks = {"out": (got["out"], base["out"], ref_out)}
    checks.update({k: (got["grads"][k], base["grads"][k], ref_grads[k]) for k in ref_grads})
    for name, (ours, theirs, ref) in checks.items():
        assert ours is not None and ours.shape == ref.shape, name
        if ref.abs().max() == 0:  # an expert without tokens: its weight grads are exactly zero
            assert torch.count_nonzero(ours) == 0 and torch.count_nonzero(theirs) == 0, name
            continue
        ours_err, theirs_err = rel_err(ours, ref), rel_err(theirs, ref)
        # As accurate as TE's own bf16/fp16 path, to within rounding noise.
        assert ours_err <= 1.5 * theirs_err + 2e-3, (name, ours_err, theirs_err)


@pytest.mark.parametrize("order, pad", [("reversed", 0), ("reversed", 64), ("ascending", 64)])
def test_weights_in_a_padded_buffer_are_read_in_place(order, pad):
    """Megatron's DDP moves each parameter into its buffer (``param.data`` = a view), a module's
    parameters last first and padded apart: the fused op reads them there (no stacked copy) and
    gives the same bits as with TE's own packed weights."""
    from te_offload_ops.fused.expert_weights import expert_weights
    from te_offload_ops.kernels import registry

    cfg = Config(layers=1, experts=4, hidden=256, ffn=384, splits=(300, 0, 650, 74))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    base = run_step(stack, inputs, "none")
    for op in (stack[0][0], stack[0][2]):
        n, k = op.out_features, op.in_features
        experts = list(range(op.num_groups))
        buf = relay_expert_weights(op, experts[::-1] if order == "reversed" else experts, pad)
        w, rev = expert_weights(op)
        assert rev == (order == "reversed") and w.data_ptr() == buf.data_ptr() and w.stride(0) == n * k + pad
    got = run_step(stack, inputs, "none")
    assert forward_plan(stack[0]) == ["FusedScaledSReLUMLP"]
    # the kernels' cache keys name the layout they were compiled for: (stride or None if packed, reversed)
    assert any(isinstance(key[-2], tuple) and key[-2][0] == "b" and key[-2][2] == (order == "reversed")
               and (key[-2][1] is None) == (pad == 0) for key in registry.compile_times()), \
        "no kernel for this weight layout ran"
    assert torch.equal(got["out"], base["out"])
    for name, g in base["grads"].items():
        assert torch.equal(got["grads"][name], g), name


def test_a_second_backward_through_the_graph_is_refused_as_te_refuses_it_for_its_own_ops(monkeypatch):
    """The fused backward writes act over z. A second backward through the same graph
    (retain_graph=True) is refused by TE's op fuser for its own unfused ops too (it lets go of the
    saved tensors after the first): ours raises the same, never computes from an overwritten z."""
    cfg = Config(layers=1, experts=4, hidden=256, ffn=512, splits=(300, 0, 77, 651), dtype=torch.bfloat16)
    errors = {}
    for fused in (True, False):
        monkeypatch.setenv(DISABLE_ENV, "1" if fused else "0")
        mlp = make_stack(cfg)[0]
        x, probs, dy, splits = make_inputs(cfg)
        out = mlp(x, splits, probs[0], splits)
        assert forward_plan(mlp) == (["FusedScaledSReLUMLP"] if fused else ["GroupedLinear", "ScaledSReLU", "GroupedLinear"])
        leaves = [x, probs[0], *mlp.parameters()]
        torch.autograd.grad(out, leaves, dy, retain_graph=True)
        with pytest.raises(Exception) as info:
            torch.autograd.grad(out, leaves, dy)
        errors[fused] = (type(info.value), str(info.value))
    assert errors[True] == errors[False]


def test_the_forward_in_row_blocks_gives_the_same_results_bit_for_bit(monkeypatch):
    """act of 3028 tokens x 512 bf16 is 3 MiB: with a 1 MiB limit the forward runs in blocks of
    1024 rows, cutting experts 0 and 3 at block edges; output and grads equal the whole act's."""
    from te_offload_ops.fused.row_chunks import CHUNK_ENV
    from te_offload_ops.fused.srelu_mlp import FusedScaledSReLUMLP

    cfg = Config(layers=1, experts=4, hidden=256, ffn=512, splits=(1300, 0, 77, 1651), dtype=torch.bfloat16)
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    blocked = []
    run_blocks = FusedScaledSReLUMLP._forward_in_blocks
    monkeypatch.setattr(FusedScaledSReLUMLP, "_forward_in_blocks",
                        lambda self, *a: blocked.append(a[-1]) or run_blocks(self, *a))
    monkeypatch.setenv(CHUNK_ENV, "0")
    whole = run_step(stack, inputs, "none")
    assert blocked == []
    monkeypatch.setenv(CHUNK_ENV, "1")
    blocks = run_step(stack, inputs, "none")
    assert blocked == [1024]
    assert torch.equal(blocks["out"], whole["out"])
    assert whole["grads"].keys() == blocks["grads"].keys()
    for name, grad in whole["grads"].items():
        assert torch.equal(blocks["grads"][name], grad), name


def test_the_backward_announces_what_it_allocates_in_the_order_it_allocates_it(monkeypatch):
    """An offload engine's memory budget fits each announced size into the allocator's free blocks
    in turn (te_offload_ops.engines.teo.allocator_room), so the fused backward must name its allocations as the
    allocator sees them: dz and dprobs' fp32 partials, then fc2's wgrad, dx, fc1's wgrad, each
    announced just before it is allocated (a copy the budget gives back has until then to end).
    Checked in the allocator's history: a marker allocation at each announcement, and each
    announced size allocated after its marker and before the next (other, smaller allocations may
    come between)."""
    from te_offload_ops import hints

    cfg = Config(layers=1, experts=4, hidden=256, ffn=512, splits=(900, 0, 77, 1051), dtype=torch.bfloat16)
    mlp = make_stack(cfg)[0]
    x, probs, dy, splits = make_inputs(cfg)
    x = x.detach().requires_grad_()
    out = mlp(x, splits, probs[0], splits)
    assert forward_plan(mlp) == ["FusedScaledSReLUMLP"]
    announced, marks = [], [(1003 + k) * 512 for k in range(8)]  # sizes no op of this step allocates
    real = hints.make_room

    def announce(sizes, *a, **k):
        torch.empty(marks[len(announced)], dtype=torch.uint8, device="cuda")  # allocated and freed: in the history
        announced.append(list(sizes))
        return real(sizes, *a, **k)

    monkeypatch.setattr(hints, "make_room", announce)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    try:
        out.backward(dy)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    t, h, f = x.shape[0], cfg.hidden, cfg.ffn
    assert len(announced) == 4 and announced[0][0] == t * f * 2 and len(announced[0]) == 2, announced
    assert announced[1:] == [[4 * h * f * 2], [t * h * 2], [4 * f * h * 2]], announced
    allocs = [e["size"] for e in snap["device_traces"][torch.cuda.current_device()] if e["action"] == "alloc"]
    at = [allocs.index(m) for m in marks[:4]] + [len(allocs)]
    for i, sizes in enumerate(announced):
        it = iter(allocs[at[i] + 1: at[i + 1]])  # between this announcement and the next, in order
        assert all(any(size == a for a in it) for size in sizes), f"announced {sizes}, allocated {allocs[at[i]:at[i + 1]]}"
