"""CPU: TE's own fused grouped MLP (Blackwell, MXFP8/NVFP4) taken over by the policy-aware subclass.

TE's real fusion functions, fused-op class and forward run here; only what needs sm_100 (or, on
CPU, CUDA) is stood in (tests/te_fused_standins.py says exactly what). So the tensors checked are
the ones TE's own forward saves, in its order.
"""

import pytest
import torch
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import DelayedScaling, MXFP8BlockScaling, NVFP4BlockScaling
from transformer_engine.pytorch import cpu_offload
from transformer_engine.pytorch.ops.fused import grouped_mlp as te_mlp
from transformer_engine.pytorch.ops.fuser import OperationFuser

from te_offload_ops import fused
from te_offload_ops.fused import FusedScaledSReLUMLP, PolicyGroupedMLPGLU, PolicyGroupedMLPUnary, explain_fusion
from te_offload_ops.fused.te_grouped_mlp import TESavedLayout
from te_offload_ops.policy import KEEP_ATTR, V1_OFFLOAD_ATTR
from offload_spy import SpyEngine
from te_fused_steps import StepConfig, moved_by_kind, policy_problems, run_step
from te_fused_standins import (
    ACTIVATIONS, TE_FUSIONS, clear_te_caches, frontend_problem, make_ops, te_fused, te_slot_owners,  # noqa: F401
    watch_te_saves,
)

pytestmark = pytest.mark.skipif(frontend_problem() is not None, reason=frontend_problem() or "")

RECIPES = {"mxfp8": MXFP8BlockScaling, "nvfp4": NVFP4BlockScaling}
UNFUSED = ["GroupedLinear", "ScaledSReLU", "GroupedLinear"]
TOKENS, SPLITS = 512, (0, 200, 300, 12)


def plan(ops, recipe):
    """Names of the ops TE's fuser runs forward for ``ops`` under ``recipe``."""
    fuser = OperationFuser(ops)
    x = torch.randn(TOKENS, ops[0].in_features, dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor(SPLITS)
    fuser.maybe_fuse_ops(True, recipe, x, [[splits], [torch.rand(TOKENS)], [splits]])
    return [type(op).__name__ for op, _ in fuser._forward_ops]


def run_forward(ops, recipe, *, backward=False):
    mlp = te.ops.Sequential(*ops)
    x = torch.randn(TOKENS, ops[0].in_features, dtype=torch.bfloat16, requires_grad=True)
    splits = torch.tensor(SPLITS)
    probs = torch.rand(TOKENS, dtype=torch.bfloat16, requires_grad=True)
    with te.autocast(enabled=True, recipe=recipe):
        y = mlp(x, splits, probs, splits)
    if backward:
        y.sum().backward()
    return mlp, [type(op).__name__ for group in mlp._module_groups for op, _ in group._forward_ops]


# -- selection --------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_ours_fuses_exactly_where_te_fuses(activation, recipe, te_fused):
    te_choice = plan(make_ops(activation, stock=True), RECIPES[recipe]())
    ours = plan(make_ops(activation), RECIPES[recipe]())
    glu = ACTIVATIONS[activation][2]
    if len(te_choice) == 1:
        te_cls = te_mlp.GroupedMLP_CuTeGEMMGLU if glu else te_mlp.GroupedMLP_CuTeGEMMUnary
        assert te_choice == [te_cls.__name__]
        ours_cls = PolicyGroupedMLPGLU if glu else PolicyGroupedMLPUnary
        assert ours == [ours_cls.__name__] and issubclass(ours_cls, te_cls)
    else:
        assert len(ours) == 3  # TE declines (this cuDNN frontend lacks the activation): so do we
    if activation in ("srelu", "swiglu"):  # what every supported frontend fuses
        assert len(ours) == 1


def test_fusions_run_hopper_then_ours_then_te(te_fused):
    funcs = OperationFuser.forward_backward_fusion_functions
    positions = [funcs.index(f) for f in (fused.fuse_srelu_mlp, fused.fuse_te_grouped_mlp, *TE_FUSIONS)]
    assert positions == sorted(positions)


def test_hopper_keeps_its_fusion_without_a_recipe(te_fused, monkeypatch):
    monkeypatch.setattr(fused.selection, "_cuda_capability", lambda: (9, 0))
    monkeypatch.setattr(fused.selection, "kernel_problem", lambda: None)
    monkeypatch.delenv(fused.selection.DISABLE_ENV, raising=False)
    assert plan(make_ops(), None) == [FusedScaledSReLUMLP.__name__]
    assert plan(make_ops(), MXFP8BlockScaling()) == [PolicyGroupedMLPUnary.__name__]


def test_stock_or_mixed_ops_are_left_to_te(te_fused):
    stock = make_ops(stock=True)
    assert plan(stock, MXFP8BlockScaling()) == ["GroupedMLP_CuTeGEMMUnary"]
    ours = make_ops()
    mixed = [ours[0], stock[1], ours[2]]  # TE's activation has no offload flag: TE saves as it likes
    assert plan(mixed, MXFP8BlockScaling()) == ["GroupedMLP_CuTeGEMMUnary"]


@pytest.mark.parametrize("recipe", [None, DelayedScaling()], ids=["no-recipe", "delayed"])
def test_other_recipes_stay_unfused_with_reasons(recipe, te_fused, monkeypatch):
    monkeypatch.setattr(fused.selection, "_cuda_capability", lambda: (10, 0))  # the Hopper fusion sees sm_100 too
    ops = make_ops()
    if recipe is None:  # (DelayedScaling's recipe state needs CUDA; the decision itself does not)
        assert plan(ops, recipe) == UNFUSED
    assert fused.fuse_te_grouped_mlp(ops, recipe=recipe) == ops
    reasons = dict(explain_fusion(te.ops.Sequential(*ops), recipe=recipe))[0]
    assert any("sm_100" in r and "sm_90" in r for r in reasons)  # the Hopper fusion's
    name = type(recipe).__name__ if recipe else "none"
    assert any("needs an MXFP8 or NVFP4 recipe, got " + name in r for r in reasons)


def test_te_checks_decide(te_fused):
    odd = make_ops(hidden=96)  # TE needs dims that are multiples of 64
    assert plan(odd, MXFP8BlockScaling()) == UNFUSED
    assert plan(make_ops(), NVFP4BlockScaling(disable_rht=True)) == UNFUSED  # TE's NVFP4 path needs RHT
    assert any("declines these ops" in r for r in dict(explain_fusion(te.ops.Sequential(*odd),
                                                                      recipe=MXFP8BlockScaling()))[0])
    assert dict(explain_fusion(te.ops.Sequential(*make_ops()), recipe=MXFP8BlockScaling()))[0] == []


def test_not_available_without_te_switch_or_blackwell(monkeypatch):
    clear_te_caches()
    try:
        monkeypatch.delenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", raising=False)
        assert not te_mlp.GroupedMLP_CuTeGEMMUnary.is_supported()
        ops = make_ops()
        assert plan(ops, MXFP8BlockScaling()) == UNFUSED
        reasons = dict(explain_fusion(te.ops.Sequential(*ops), recipe=MXFP8BlockScaling()))[0]
        assert any("not available here" in r for r in reasons)
        clear_te_caches()
        monkeypatch.setenv("NVTE_CUTEDSL_FUSED_GROUPED_MLP", "1")
        monkeypatch.setattr(te_mlp, "get_device_compute_capability", lambda: (9, 0))
        assert not te_mlp.GroupedMLP_CuTeGEMMUnary.is_supported()
        assert plan(make_ops(), MXFP8BlockScaling()) == UNFUSED
    finally:
        clear_te_caches()


# -- TE's saved layout --------------------------------------------------------------------------

@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("activation", ["srelu", "swiglu"])
def test_backward_gets_back_what_te_saved_in_te_order(activation, recipe, te_fused, monkeypatch):
    seen = watch_te_saves(monkeypatch)
    _, forward = run_forward(make_ops(activation), RECIPES[recipe](), backward=True)
    assert len(forward) == 1 and forward[0].startswith("PolicyGroupedMLP")
    te_saved, (handed_back,) = seen[0].saved, te_fused.calls
    assert len(seen) == 1 and len(handed_back) == len(te_saved) == 7 + 1 + 4 + 3 + 4
    assert all(a is b for a, b in zip(handed_back, te_saved))


def test_single_grouped_weights(te_fused, monkeypatch):
    """One grouped weight per layer: one weight slot each, kept resident."""
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
    engine_is_on(monkeypatch, "v1")
    seen = watch_te_saves(monkeypatch)
    _, forward = run_forward(make_ops(single_grouped_weight=True, offload=(False, True, True)), MXFP8BlockScaling(),
                             backward=True)
    assert forward == [PolicyGroupedMLPUnary.__name__]
    te_saved, (handed_back,) = seen[0].saved, te_fused.calls
    assert len(te_saved) == 7 + 1 + 1 + 3 + 1
    assert all(a is b for a, b in zip(handed_back, te_saved))
    for slot in (8, 12):  # the grouped weights
        assert all(getattr(t, KEEP_ATTR, False) and not hasattr(t, V1_OFFLOAD_ATTR) for t in seen[0].carriers[slot])
    fc1_input = seen[0].carriers[7][0]  # its columnwise data (MXFP8 saves no rowwise copy)
    act_input = seen[0].carriers[9][0]
    assert getattr(fc1_input, KEEP_ATTR, False) and not hasattr(fc1_input, V1_OFFLOAD_ATTR)
    assert hasattr(act_input, V1_OFFLOAD_ATTR) and not getattr(act_input, KEEP_ATTR, False)


def test_recomputed_fc2_input_is_an_empty_slot(te_fused, monkeypatch):
    seen = watch_te_saves(monkeypatch)
    run_forward(make_ops(activation_kwargs={"activation_recompute_in_mlp": True}), MXFP8BlockScaling(),
                backward=True)
    te_saved, (handed_back,) = seen[0].saved, te_fused.calls
    assert te_saved[14] is None  # TE recomputes fc2's input from the dSReLU kernel
    assert all(a is b for a, b in zip(handed_back, te_saved))


def test_layout_splits_and_reorders_exactly(te_fused, monkeypatch):
    seen = watch_te_saves(monkeypatch)
    ops = make_ops()
    run_forward(ops, MXFP8BlockScaling(), backward=True)  # after backward, the storages hold their data again
    saved = seen[0].saved
    layout = TESavedLayout.parse(saved, ops[0], ops[2])
    back = TESavedLayout.te_order(layout.fc1_part(), layout.activation_part(), layout.fc2_part())
    assert len(back) == len(saved) and all(a is b for a, b in zip(back, saved))
    assert layout.fc1_input is saved[7] and layout.activation_input is saved[12]


def _drop_last(s):
    return s[:-1]


def _swap_input_and_weight(s):
    return s[:7] + (s[8], s[7]) + s[9:]


def _swap_activation_and_probs(s):
    return s[:12] + (s[13], s[12]) + s[14:]


def _extra_tensor(s):
    return s + (torch.zeros(3),)


@pytest.mark.parametrize("change", [_drop_last, _swap_input_and_weight, _swap_activation_and_probs, _extra_tensor])
def test_a_different_te_layout_raises(change, te_fused, monkeypatch):
    te_forward = te_mlp._GroupedMLP_CuTeGEMMBase.fuser_forward

    def other_te(self, basic_op_ctxs, *args, **kwargs):
        out = te_forward(self, basic_op_ctxs, *args, **kwargs)
        basic_op_ctxs[0].to_save = change(tuple(basic_op_ctxs[0].to_save))
        return out

    monkeypatch.setattr(te_mlp._GroupedMLP_CuTeGEMMBase, "fuser_forward", other_te)
    with pytest.raises(RuntimeError, match="not supported by te_offload_ops"):
        run_forward(make_ops(), MXFP8BlockScaling())


# -- marks --------------------------------------------------------------------------------------

POLICIES = {
    "all": (True, True, True),
    "keep-fc1": (False, True, True),
    "keep-act": (True, False, True),
    "keep-fc2": (True, True, False),
    "keep-all": (False, False, False),
}


def engine_is_on(monkeypatch, engine: str) -> None:
    """An engine of TE's kind is on: TE's forward marks its activations, our policy starts offloads."""
    monkeypatch.setattr(cpu_offload, "NVTE_CPU_OFFLOAD_V1", engine == "v1")
    for module in (cpu_offload, te_mlp):
        monkeypatch.setattr(module, "is_cpu_offload_enabled", lambda: True)
        monkeypatch.setattr(module, "start_offload", lambda *ts, **kw: None)  # it records CUDA events


@pytest.fixture(params=["v2", "v1"])
def engine_on(request, monkeypatch):
    engine_is_on(monkeypatch, request.param)
    return request.param


def expected_keep(seen, flags):
    """(tensor, whether it must stay resident) per data tensor: weights always; others if any owner keeps."""
    owners = te_slot_owners(4, 4)
    assert len(owners) == len(seen.saved)
    result = {}
    for carriers, (kind, who) in zip(seen.carriers, owners):
        keep = kind == "weight" or not all(flags[name] for name in who)
        for t in carriers:
            result[id(t)] = (t, keep or result.get(id(t), (t, False))[1])
    return result.values()


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_marks_follow_each_owner_flag(policy, recipe, engine_on, te_fused, monkeypatch):
    seen = watch_te_saves(monkeypatch)
    offload = POLICIES[policy]
    run_forward(make_ops(offload=offload), RECIPES[recipe]())
    flags = dict(zip(("fc1", "act", "fc2"), offload))
    checked = 0
    for t, keep in expected_keep(seen[0], flags):
        assert getattr(t, KEEP_ATTR, False) == keep, (policy, tuple(t.shape))
        # V1 offloads whatever carries its mark, and TE's own forward marked its activations.
        assert hasattr(t, V1_OFFLOAD_ATTR) == (engine_on == "v1" and not keep), (policy, tuple(t.shape))
        checked += 1
    assert checked > 20


def test_te_own_op_ignores_flags_and_leaves_weights_to_the_engine(te_fused, monkeypatch):
    """What this package changes: TE's op (V1 engine on) marks every activation and keeps no weight."""
    engine_is_on(monkeypatch, "v1")
    seen = watch_te_saves(monkeypatch)
    run_forward(make_ops(stock=True), MXFP8BlockScaling())
    slots = seen[0].carriers
    weights = [t for slot in slots[8:12] + slots[15:] for t in slot]
    activations = [t for slot in (slots[7], slots[12], slots[14]) for t in slot]
    assert weights and not any(getattr(t, KEEP_ATTR, False) for t in weights)
    assert activations and all(hasattr(t, V1_OFFLOAD_ATTR) for t in activations)


# -- a hook engine over TE's real forward -------------------------------------------------------

class CopyingEngine(SpyEngine):
    """offload_spy's hook engine, moving CPU tensors too: a copy stands in for the trip to host memory."""

    def _pack(self, t):
        kind, nbytes = self.recorder.kind_of(t), t.numel() * t.element_size()
        if getattr(t, KEEP_ATTR, False):
            self.bytes_kept[kind] += nbytes
            return ("kept", t)
        self.bytes_moved[kind] += nbytes
        return ("moved", t.device, t.clone(), t.requires_grad)


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "keep-all"])
@pytest.mark.parametrize("case", [("srelu", "mxfp8"), ("swiglu", "nvfp4")], ids=["srelu-mxfp8", "swiglu-nvfp4"])
def test_hook_engine_moves_only_what_the_policy_allows(case, policy, te_fused, monkeypatch):
    cfg = StepConfig(activation=case[0], recipe=case[1], offload=POLICIES[policy], device="cpu", hidden=512, ffn=512)
    result = run_step(cfg, "spy", monkeypatch, te_fused, spy_cls=CopyingEngine)
    assert all(name.startswith("PolicyGroupedMLP") for name in result.plan)
    assert policy_problems(result, cfg, offloaded_layers=[0, 1]) == []


def test_without_our_fusion_the_hook_engine_moves_weights_and_opted_out_inputs(te_fused, monkeypatch):
    cfg = StepConfig(offload=POLICIES["keep-fc1"], device="cpu", hidden=512, ffn=512, te_alone=True)
    result = run_step(cfg, "spy", monkeypatch, te_fused, spy_cls=CopyingEngine)
    assert result.plan == ["GroupedMLP_CuTeGEMMUnary"] * cfg.layers
    problems = policy_problems(result, cfg, offloaded_layers=[0, 1])
    assert moved_by_kind(result.moved)["weight"] > 0
    assert any("of fc1, which has offload=False" in p for p in problems)
    assert any("a weight came back as another tensor" in p for p in problems)
