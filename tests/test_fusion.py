"""CPU: when the Hopper fused SReLU grouped MLP is selected, and the reasons when it is not."""

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format
from transformer_engine.pytorch.ops.fuser import OperationFuser

import te_offload_ops as teo
from te_offload_ops import fused
from te_offload_ops.fused import FusedScaledSReLUMLP, explain_fusion, runtime_blockers, static_blockers
from te_offload_ops.fused.expert_weights import weight_dtype


def mlp_ops(E=4, H=64, F=32, dtype=torch.bfloat16, **fc_kwargs):
    return [teo.GroupedLinear(E, H, F, bias=False, device="cpu", dtype=dtype, **fc_kwargs),
            teo.ScaledSReLU(),
            teo.GroupedLinear(E, F, H, bias=False, device="cpu", dtype=dtype, **fc_kwargs)]


@pytest.fixture
def hopper(monkeypatch):
    """An sm_90 GPU whose kernels are available (the fusion decision, not the kernels, is tested)."""
    monkeypatch.setattr(fused.selection, "_cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(fused.selection, "kernel_problem", lambda: None)
    monkeypatch.delenv(fused.selection.DISABLE_ENV, raising=False)


def test_missing_kernels_block_fusion_with_the_reason(hopper, monkeypatch):
    monkeypatch.setattr(fused.selection, "kernel_problem", lambda: "the CuTe DSL kernels do not import: boom")
    assert fused_plan(mlp_ops())[0] == [teo.GroupedLinear, teo.ScaledSReLU, teo.GroupedLinear]
    assert static_blockers(*mlp_ops()) == ["the CuTe DSL kernels do not import: boom"]


def fused_plan(ops, recipe=None):
    """What TE's own fuser runs forward, with our fusion registered."""
    fuser = OperationFuser(ops)
    x = torch.randn(8, ops[0].in_features, dtype=weight_dtype(ops[0]), requires_grad=True)
    splits = torch.tensor([2] * ops[0].num_groups)
    fuser.maybe_fuse_ops(True, recipe, x, [[splits], [torch.rand(8)], [splits]])
    return [type(op) for op, _ in fuser._forward_ops], [type(op) for op, _ in fuser._backward_ops]


def test_fuses_on_hopper_in_bf16_through_te_fuser(hopper):
    assert fused_plan(mlp_ops()) == ([FusedScaledSReLUMLP], [FusedScaledSReLUMLP])


def test_fp16_fuses_too(hopper):
    assert fused_plan(mlp_ops(dtype=torch.float16))[0] == [FusedScaledSReLUMLP]


def test_fuses_every_mlp_in_a_longer_pipeline(hopper):
    ops = mlp_ops() + mlp_ops()
    plan, _ = fused_plan(ops)
    assert plan == [FusedScaledSReLUMLP, FusedScaledSReLUMLP]


def test_explain_fusion_reports_reasons_per_window(hopper):
    seq = te.ops.Sequential(*mlp_ops(), teo.ScaledSReLU())
    report = dict(explain_fusion(seq))
    assert report[0] == []
    assert "not te_offload_ops" in report[1][0]


def test_block_scaling_fuses_on_hopper_through_te_fuser(hopper):
    assert static_blockers(*mlp_ops(), recipe=Float8BlockScaling()) == []
    assert fused_plan(mlp_ops(), recipe=Float8BlockScaling()) == ([FusedScaledSReLUMLP], [FusedScaledSReLUMLP])


@pytest.mark.parametrize("recipe, said", [
    (Float8BlockScaling(fp8_format=Format.HYBRID), "fp8_format=HYBRID"),
    (Float8BlockScaling(w_block_scaling_dim=1), "block dims (1, 1, 1)"),
    (Float8BlockScaling(w_block_scaling_dim=1, grad_block_scaling_dim=2), "block dims (1, 1, 2)"),
], ids=["hybrid", "w-1d", "grad-2d"])
def test_block_scaling_the_kernels_do_not_read_falls_back_with_the_reason(hopper, recipe, said):
    reasons = static_blockers(*mlp_ops(), recipe=recipe)
    assert any(said in r for r in reasons), reasons
    assert fused_plan(mlp_ops(), recipe=recipe)[0] == [teo.GroupedLinear, teo.ScaledSReLU, teo.GroupedLinear]


def test_block_scaling_needs_fp8_rows_of_16_bytes(hopper):
    reasons = static_blockers(*mlp_ops(H=64, F=40), recipe=Float8BlockScaling())
    assert any("out_features=40" in r and "multiple of 16" in r for r in reasons), reasons
    assert static_blockers(*mlp_ops(H=64, F=40)) == []  # bf16 takes rows of 8


@pytest.mark.parametrize("capability, expected", [((10, 0), "sm_100"), ((8, 0), "sm_80"), ((12, 0), "sm_120")])
def test_other_gpus_fall_back(capability, expected):
    reasons = static_blockers(*mlp_ops(), capability=capability)
    assert any(expected in r and "sm_90" in r for r in reasons)


def test_no_gpu_falls_back(monkeypatch):
    monkeypatch.setattr(fused.selection, "_cuda_capability", lambda: None)
    assert fused_plan(mlp_ops())[0] == [teo.GroupedLinear, teo.ScaledSReLU, teo.GroupedLinear]
    assert "no CUDA GPU" in static_blockers(*mlp_ops())


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_fp8_recipes_fall_back(recipe):
    reasons = static_blockers(*mlp_ops(), recipe=recipe, capability=(9, 0))
    assert any("quantization recipe" in r and type(recipe).__name__ in r for r in reasons)


def test_bias_falls_back(hopper):
    ops = mlp_ops()
    ops[2] = teo.GroupedLinear(4, 32, 64, bias=True, device="cpu", dtype=torch.bfloat16)
    assert any("has a bias" in r for r in static_blockers(*ops, capability=(9, 0)))


# What Megatron-Core passes to TE's grouped-MLP ops: each fuses (fused/weight_grads.py).
MEGATRON_SETTINGS = [dict(accumulate_into_main_grad=True), dict(delay_wgrad_compute=True),
                     dict(single_grouped_weight=True),
                     dict(accumulate_into_main_grad=True, delay_wgrad_compute=True, single_grouped_weight=True)]


@pytest.fixture
def single_param(monkeypatch):
    """TE builds single grouped weights only with this switch on (Megatron sets it)."""
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")


@pytest.mark.filterwarnings("ignore:GroupedLinear is using single_grouped_weight")
@pytest.mark.parametrize("kwargs", MEGATRON_SETTINGS, ids=lambda kw: "+".join(kw))
def test_megatron_settings_fuse(kwargs, hopper, single_param):
    assert mlp_ops(**kwargs)[0].single_grouped_weight == kwargs.get("single_grouped_weight", False)
    assert static_blockers(*mlp_ops(**kwargs), capability=(9, 0)) == []
    assert fused_plan(mlp_ops(**kwargs)) == ([FusedScaledSReLUMLP], [FusedScaledSReLUMLP])


@pytest.mark.filterwarnings("ignore:GroupedLinear is using single_grouped_weight")
def test_single_grouped_weight_is_seen_as_one_stacked_tensor(single_param):
    from te_offload_ops.fused.expert_weights import stacked_weight, weight_dtype, weight_params

    grouped, per_expert = mlp_ops(single_grouped_weight=True)[0], mlp_ops()[0]
    assert len(weight_params(grouped)) == 1 and len(weight_params(per_expert)) == 4
    assert weight_dtype(grouped) == torch.bfloat16
    w = stacked_weight(grouped)
    assert w.shape == (4, 32, 64) and w.data_ptr() == weight_params(grouped)[0].rowwise_data.data_ptr()
    # per-expert weights that tile one buffer are viewed, not copied
    assert stacked_weight(per_expert).data_ptr() == per_expert.weight0.data_ptr()
    assert torch.equal(stacked_weight(per_expert)[3], per_expert.weight3)


def test_expert_weights_are_read_in_place_in_either_order():
    """TE's packed buffer, and Megatron's DDP buffer (a module's parameters last first, padded),
    are read in place; separately allocated or unevenly spaced weights are stacked."""
    from mlp_steps import relay_expert_weights
    from te_offload_ops.fused.expert_weights import expert_weights, stacked_weight

    op = mlp_ops()[0]
    values = [getattr(op, f"weight{i}").detach().clone() for i in range(4)]
    w, rev = expert_weights(op)
    assert not rev and w.data_ptr() == op.weight0.data_ptr() and w.stride() == (32 * 64, 64, 1)

    buf = relay_expert_weights(op, order=[3, 2, 1, 0], pad=64)  # reverse order, padded
    w, rev = expert_weights(op)
    assert rev and w.data_ptr() == buf.data_ptr() and w.stride() == (32 * 64 + 64, 64, 1)
    assert all(torch.equal(w[j], values[3 - j]) for j in range(4))
    assert all(torch.equal(a, b) for a, b in zip(stacked_weight(op), values))

    relay_expert_weights(op, order=[0, 2, 1, 3])  # one buffer, but not evenly in either order: a copy
    w, rev = expert_weights(op)
    assert not rev and w.is_contiguous() and w.data_ptr() != op.weight0.data_ptr()
    assert all(torch.equal(w[e], values[e]) for e in range(4))

    for i in range(4):  # separately allocated
        getattr(op, f"weight{i}").data = values[i].clone()
    w, rev = expert_weights(op)
    assert not rev and all(torch.equal(w[e], values[e]) for e in range(4))
    assert w.untyped_storage().data_ptr() != op.weight0.untyped_storage().data_ptr()


def test_misaligned_and_mismatched_dims_fall_back(hopper):
    reasons = static_blockers(*mlp_ops(H=60), capability=(9, 0))
    assert any("in_features=60 is not a multiple of 8" in r for r in reasons)
    ops = mlp_ops()
    ops[2] = teo.GroupedLinear(4, 48, 64, bias=False, device="cpu", dtype=torch.bfloat16)
    assert any("fc1.out_features=32 != fc2.in_features=48" in r for r in static_blockers(*ops, capability=(9, 0)))
    ops[2] = teo.GroupedLinear(3, 32, 64, bias=False, device="cpu", dtype=torch.bfloat16)
    assert any("fc1 has 4 groups and fc2 3" in r for r in static_blockers(*ops, capability=(9, 0)))


def test_fp32_weights_fall_back(hopper):
    assert any("take bf16 or fp16" in r for r in static_blockers(*mlp_ops(dtype=torch.float32), capability=(9, 0)))


def test_other_activations_and_stock_te_ops_do_not_fuse(hopper):
    ops = mlp_ops()
    tanh = [ops[0], teo.ScaledTanhSReLU(tanh_clamp_scale=2.0), ops[2]]
    assert fused_plan(tanh)[0] == [teo.GroupedLinear, teo.ScaledTanhSReLU, teo.GroupedLinear]
    stock = [te.ops.GroupedLinear(4, 64, 32, bias=False, device="cpu", dtype=torch.bfloat16), te.ops.ScaledSReLU(),
             te.ops.GroupedLinear(4, 32, 64, bias=False, device="cpu", dtype=torch.bfloat16)]
    assert FusedScaledSReLUMLP not in fused_plan(stock)[0]

    class Doubled(teo.ScaledSReLU):
        def _scaled_unary_forward(self, input_, scales):
            return 2 * super()._scaled_unary_forward(input_, scales)

    assert any("changes the activation" in r for r in static_blockers(ops[0], Doubled(), ops[2], capability=(9, 0)))


def test_switch_turns_fusion_off(hopper, monkeypatch):
    monkeypatch.setenv(fused.selection.DISABLE_ENV, "0")
    assert fused_plan(mlp_ops())[0] == [teo.GroupedLinear, teo.ScaledSReLU, teo.GroupedLinear]
    assert "disabled by TEO_FUSED_SRELU_MLP=0" in static_blockers(*mlp_ops(), capability=(9, 0))


def test_runtime_blockers_name_each_problem():
    splits, probs = torch.tensor([4, 4]), torch.rand(8, dtype=torch.bfloat16)
    reasons = runtime_blockers(torch.randn(8, 64, dtype=torch.float32), splits, probs, weight_dtype=torch.bfloat16)
    text = " | ".join(reasons)
    assert "input is torch.float32" in text and "not on a CUDA device" in text
    assert "not a plain tensor" in runtime_blockers([1, 2], splits, probs, weight_dtype=torch.bfloat16)[0]
    assert any("takes (tokens, hidden)" in r for r in runtime_blockers(torch.randn(2, 4, 64, dtype=torch.bfloat16),
                                                                        splits, probs, weight_dtype=torch.bfloat16))


def test_separate_weights_that_happen_to_be_adjacent_are_stacked_not_viewed():
    """Weights allocated one by one may sit back to back in memory (the caching allocator does
    that on the GPU); a strided view of the first one's storage would read past it."""
    from te_offload_ops.fused.expert_weights import stacked_weight

    op = mlp_ops()[0]
    buf = torch.randn(4 * 32 * 64, dtype=torch.bfloat16)
    # four separate storages whose addresses we cannot control on the CPU: fake adjacency by
    # giving each its own storage copied from one buffer, then check the result is a copy
    for i in range(4):
        setattr(op, f"weight{i}", torch.nn.Parameter(buf[i * 2048:(i + 1) * 2048].clone().view(32, 64)))
    w = stacked_weight(op)
    assert w.shape == (4, 32, 64) and torch.equal(w.reshape(-1), buf)
    assert w.untyped_storage().data_ptr() != op.weight0.untyped_storage().data_ptr()


def test_different_split_sizes_for_fc1_and_fc2_run_unfused(hopper):
    """The kernels route both layers by one split-sizes tensor: the same tensor object for fc1
    and fc2 (what Megatron passes) keeps the fused path; another tensor falls back, with the reason.
    (On this CPU machine the call then fails in TE's unfused GEMM; the decision is what is checked.)"""
    mlp = te.ops.Sequential(*mlp_ops())
    x = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    s, p = torch.tensor([2, 2, 2, 2]), torch.rand(8, dtype=torch.bfloat16)
    for fc2_splits, expect_reason in ((s, False), (s.clone(), True)):
        with pytest.raises(Exception):  # TE's unfused GEMM on CPU tensors (which error depends on the machine)
            mlp(x, s, p, fc2_splits)
        reasons = mlp._module_groups[0]._forward_ops[0][0].last_fallback_reasons
        assert ("fc1 and fc2 were given different split_sizes tensors" in reasons) == expect_reason


def test_expert_weights_layout_is_reused_while_the_weights_stay_put(monkeypatch):
    """The in-place layout is found once per set of weights: the same Parameters at the same
    addresses reuse it; a Parameter replaced (even by one at the same address) or moved is looked
    at again. Nothing is kept that would hold weights alive once moved or replaced."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from mlp_steps import relay_expert_weights
    from te_offload_ops.fused import expert_weights as ew

    found = []
    real = ew._find_layout
    monkeypatch.setattr(ew, "_find_layout", lambda *a: found.append(1) or real(*a))
    op = mlp_ops()[0]
    first = ew.expert_weights(op)
    again = ew.expert_weights(op)
    assert len(found) == 1 and again[0].data_ptr() == first[0].data_ptr() and again[0].stride() == first[0].stride()
    buf = relay_expert_weights(op, order=[3, 2, 1, 0])  # moved: looked at again, now reversed
    moved = ew.expert_weights(op)
    assert len(found) == 2 and moved[1] and moved[0].data_ptr() == buf.data_ptr()
    old = StorageWeakRef(buf.untyped_storage())
    relay_expert_weights(op, order=[0, 1, 2, 3])  # moved again: the previous buffer must go
    del buf, moved
    assert old.expired()
    op.weight2 = torch.nn.Parameter(op.weight2.detach())  # another Parameter over the same bytes
    replaced = ew.expert_weights(op)
    assert len(found) == 3 and not replaced[1]


def test_dummy_grads_share_one_allocation_and_autograd_adopts_them():
    """Megatron's placeholder grads: one allocation for all the experts, each view adopted by
    autograd as that weight's .grad (not copied: the .grads still share the one storage);
    zero_out_wgrad zeroes them; weights without grad_added_to_main_grad get None."""
    from te_offload_ops.fused.weight_grads import _dummy_grads

    params = [torch.nn.Parameter(torch.randn(3, 5)) for _ in range(4)]
    for p in params[:3]:
        p.grad_added_to_main_grad = False
    params[1].zero_out_wgrad = True

    class Placeholders(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, *ws):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return (g, *_dummy_grads(params))

    x = torch.randn(2, requires_grad=True)
    Placeholders.apply(x, *params).sum().backward()
    assert [p.grad is None for p in params] == [False, False, False, True]
    assert all(p.grad_added_to_main_grad for p in params[:3]) and not hasattr(params[3], "grad_added_to_main_grad")
    storages = {p.grad.untyped_storage().data_ptr() for p in params[:3]}
    assert len(storages) == 1  # adopted views of one block, not three copies
    assert [p.grad.data_ptr() - params[0].grad.data_ptr() for p in params[:3]] == [0, 60, 120]
    assert torch.count_nonzero(params[1].grad) == 0
    mixed = [torch.nn.Parameter(torch.randn(3, 5)), torch.nn.Parameter(torch.randn(2, 5))]
    for p in mixed:
        p.grad_added_to_main_grad = False
    grads = _dummy_grads(mixed)
    assert [tuple(g.shape) for g in grads] == [(3, 5), (2, 5)]


def test_the_fused_backward_announces_the_weight_grads_it_allocates(monkeypatch):
    """What make_room is told of a GroupedLinear's weight grads: the grads (all experts, one block);
    into main_grad only the placeholders of parameters Megatron marked; nothing when frozen or
    delayed without main_grad."""
    import types

    from te_offload_ops.fused import weight_grads as wg

    params = [torch.nn.Parameter(torch.empty(4, 8, dtype=torch.bfloat16)) for _ in range(3)]
    monkeypatch.setattr(wg, "weight_params", lambda op: params)
    delayed = types.SimpleNamespace(delay_wgrad_compute=lambda: True)
    op = types.SimpleNamespace(_accumulate_into_main_grad=False, wgrad_store=None)
    assert wg.weight_grad_bytes(op) == [3 * 4 * 8 * 2]
    op.wgrad_store = delayed
    assert wg.weight_grad_bytes(op) == []
    op._accumulate_into_main_grad = True
    assert wg.weight_grad_bytes(op) == []  # no parameter marked by Megatron: no placeholders
    params[0].grad_added_to_main_grad = params[2].grad_added_to_main_grad = False
    assert wg.weight_grad_bytes(op) == [2 * 4 * 8 * 2]
    for p in params:
        p.requires_grad_(False)
    assert wg.weight_grad_bytes(op) == []


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8CurrentScaling()], ids=["delayed", "current"])
def test_fused_op_called_under_a_recipe_runs_unfused(recipe, monkeypatch):
    """Were a fused op reached under a recipe (outside its Sequential), it would not compute in bf16."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    monkeypatch.setattr(FP8GlobalStateManager, "is_fp8_enabled", classmethod(lambda cls: True))
    monkeypatch.setattr(FP8GlobalStateManager, "get_fp8_recipe", classmethod(lambda cls: recipe))
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    reasons = runtime_blockers(x, torch.tensor([8]), torch.rand(8), weight_dtype=torch.bfloat16)
    assert any("quantization recipe" in r and type(recipe).__name__ in r for r in reasons), reasons


def test_a_weight_written_between_forward_and_backward_is_refused_as_autograd_refuses_it():
    from te_offload_ops.fused.expert_weights import check_weight_versions, weight_params, weight_versions

    op = mlp_ops()[0]
    saved = weight_versions(weight_params(op))
    check_weight_versions(op, saved, "fc1")  # untouched: nothing to say
    with torch.no_grad():
        op.weight2.add_(1.0)  # an optimizer's in-place update, say
    # (the experts' weights may be views of one buffer: they then share one counter, as autograd sees them)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: fc1's weight \d is at version \d+; "
                                           r"expected version \d+ instead"):
        check_weight_versions(op, saved, "fc1")
    check_weight_versions(op, weight_versions(weight_params(op)), "fc1")  # a new forward records them again


def test_main_grad_off_an_8_byte_boundary_keeps_the_fp8_wgrad_out(monkeypatch):
    """The FP8 wgrad adds into main_grad by fp32 pairs: buffers it cannot pair take the bf16 wgrad."""
    import types

    from te_offload_ops.fused import weight_grads as wg

    params = [torch.nn.Parameter(torch.zeros(4, 8)) for _ in range(2)]
    monkeypatch.setattr(wg, "weight_params", lambda op: params)
    op = types.SimpleNamespace(_accumulate_into_main_grad=False)
    assert wg.main_grads_take_fp8(op)  # no main_grad: the op's own grads
    op._accumulate_into_main_grad = True
    assert wg.main_grads_take_fp8(op)  # none allocated yet (FSDP makes them later): checked in backward
    buffer = torch.zeros(2 * 32 + 1)
    params[0].main_grad, params[1].main_grad = buffer[:32].view(4, 8), buffer[32:64].view(4, 8)
    assert wg.main_grads_take_fp8(op)
    params[1].main_grad = buffer[33:65].view(4, 8)  # 4 bytes past an 8-byte boundary
    assert not wg.main_grads_take_fp8(op)


def test_fp8_columnwise_operands_take_the_fp8_wgrad_now_delayed_and_into_main_grad(monkeypatch):
    """weight_grads sends FP8 columnwise copies (fp8_wgrad.Cols) to the FP8 kernels, bf16 token
    matrices to the bf16 ones, on each path: returned grads (the params' dtype), delayed (queued
    on the wgrad store, run by backward_dw) and into main_grad (accumulating or overwriting)."""
    import types

    from te_offload_ops import kernels
    from te_offload_ops.fused import fp8_wgrad
    from te_offload_ops.fused import weight_grads as wg

    e, out_f, in_f = 3, 4, 8
    params = [torch.nn.Parameter(torch.zeros(out_f, in_f, dtype=torch.bfloat16)) for _ in range(e)]
    monkeypatch.setattr(wg, "weight_params", lambda op: params)
    calls = []

    def fake_fp8(dy, x, split, out_dtype):
        calls.append(("fp8", out_dtype))
        return torch.ones(e, out_f, in_f, dtype=out_dtype)

    monkeypatch.setattr(fp8_wgrad, "wgrad", fake_fp8)
    monkeypatch.setattr(fp8_wgrad, "wgrad_main_grad",
                        lambda dy, x, split, mg, accumulate: calls.append(("fp8 main_grad", accumulate)))
    monkeypatch.setattr(kernels, "grouped_wgrad",
                        lambda dy, x, split: calls.append("bf16") or torch.zeros(e, out_f, in_f))
    monkeypatch.setattr(wg, "_main_grads", lambda op: ["buffers"])
    cols = fp8_wgrad.Cols(torch.empty(0), torch.empty(0), 5)
    split = torch.tensor([2, 0, 3])
    op = types.SimpleNamespace(_accumulate_into_main_grad=False, wgrad_store=None, single_grouped_weight=False)

    grads = wg.weight_grads(op, cols, cols, split, temporaries=[])
    assert calls == [("fp8", torch.bfloat16)] and all(g.eq(1).all() for g in grads)
    calls.clear()
    wg.weight_grads(op, torch.zeros(5, out_f), torch.zeros(5, in_f), split, temporaries=[])
    assert calls == ["bf16"]

    queued = []
    op.wgrad_store = types.SimpleNamespace(delay_wgrad_compute=lambda: True, put=lambda args, job: queued.append((args, job)))
    calls.clear()
    assert wg.weight_grads(op, cols, cols, split, temporaries=[]) == [None] * e
    assert calls == []  # nothing until backward_dw
    (temps, operands, grad_weights), job = queued[0]
    job(temps, operands, grad_weights)
    assert calls == [("fp8", torch.bfloat16)] and len(grad_weights) == e

    op.wgrad_store, op._accumulate_into_main_grad = None, True
    for overwrite in (False, True):
        for p in params:
            p.overwrite_main_grad = overwrite
        calls.clear()
        wg.weight_grads(op, cols, cols, split, temporaries=[])
        assert calls == [("fp8 main_grad", not overwrite)]


def test_fp8_wgrad_setting_is_bf16_unless_asked_and_refuses_unknown_values(monkeypatch):
    from te_offload_ops import settings
    from te_offload_ops.fused import fp8_wgrad

    monkeypatch.delenv(settings.FP8_WGRAD_ENV, raising=False)
    assert settings.fp8_wgrad() == "bf16"
    assert not fp8_wgrad.wanted(torch.zeros(2))
    monkeypatch.setenv(settings.FP8_WGRAD_ENV, "fp8")
    assert settings.fp8_wgrad() == "fp8"
    assert not fp8_wgrad.wanted(torch.zeros(2))  # on the CPU: the bf16 wgrads
    monkeypatch.setenv(settings.FP8_WGRAD_ENV, "e5m2")
    with pytest.raises(ValueError, match=r"TEO_FP8_WGRAD must be one of bf16, fp8, got 'e5m2'"):
        settings.fp8_wgrad()
