"""CPU: what teo moves of each saved tensor: V2's rule on the policy's marks, then the layout."""

import pytest
import torch
from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

from te_offload_ops import policy
from te_offload_ops.engines.teo.plan import Keep, Move, Parts, plan_saved
from te_storages import fp8_storage

BIG = policy.MIN_OFFLOAD_NUMEL  # elements: the smallest tensor V2's rule moves


@pytest.fixture
def cpu_is_offloadable(monkeypatch):
    """Let the rule take CPU tensors for the device it moves from, so plans are testable here."""
    monkeypatch.setattr(policy, "OFFLOAD_DEVICE_TYPE", "cpu")


def test_keep_reason_is_v2s_rule():
    assert "fewer than 262144 elements (10)" in policy.keep_reason(torch.empty(10))
    assert "Parameter" in policy.keep_reason(torch.nn.Parameter(torch.empty(BIG)))
    marked = torch.empty(BIG)
    policy.mark_saved_tensors([marked], offload=False)
    assert policy.KEEP_ATTR in policy.keep_reason(marked)
    assert policy.keep_reason(torch.empty(BIG)) == "on cpu, not cuda"


def test_plans_follow_the_policy_marks(cpu_is_offloadable):
    weight, act, opted_out = torch.empty(BIG), torch.empty(BIG), torch.empty(BIG)
    policy.mark_saved_tensors([weight, act], offload=True, weights=[weight])
    policy.mark_saved_tensors([opted_out], offload=False)
    assert isinstance(plan_saved(weight), Keep)
    assert isinstance(plan_saved(opted_out), Keep)
    assert plan_saved(act) == Move(0, BIG * 4)
    assert isinstance(plan_saved(torch.nn.Parameter(torch.empty(BIG))), Keep)
    assert isinstance(plan_saved(torch.empty(BIG - 1)), Keep)


def test_plans_by_layout(cpu_is_offloadable):
    base = torch.empty(4, BIG, dtype=torch.bfloat16)
    assert plan_saved(base[1:3]) == Move(BIG * 2, 2 * BIG * 2)  # a row range: its bytes only
    # non-contiguous tensors stay, as under V2 (which warns and skips them) ...
    transposed, gapped = plan_saved(base.t()), plan_saved(base[:, : BIG // 2])
    assert isinstance(transposed, Keep) and "non-contiguous" in transposed.reason
    assert isinstance(gapped, Keep) and "non-contiguous" in gapped.reason
    # ... unless TE asks for the base to move (its interleaved q, k, v views): then the base's bytes do
    view = base.t()
    view.offload_base_tensor = True
    assert plan_saved(view) == Move(0, 4 * BIG * 2)
    # lazy conj/neg bits and other layouts would be lost in a byte copy
    assert isinstance(plan_saved(torch.empty(BIG, dtype=torch.complex64).conj()), Keep)
    assert isinstance(plan_saved(torch.empty(BIG).neg_().neg()._neg_view()), Keep)


def test_tensor_subclasses_stay_unless_quantized(cpu_is_offloadable):
    class Other(torch.Tensor):
        pass

    other = torch.empty(BIG).as_subclass(Other)
    assert "Other, a tensor subclass" in plan_saved(other).reason


def test_quantized_tensor_moves_part_by_part_as_v2(cpu_is_offloadable):
    t = fp8_storage(Float8Tensor, shape=(1024, 512))  # 512 Ki elements; its fp8 scale is one element
    plan = plan_saved(t)
    assert isinstance(plan, Parts) and plan.shell is not t and type(plan.shell) is Float8Tensor
    kinds = {(p.numel() if p is not None else None): type(pl).__name__
             for p, pl in zip(plan.tensors, plan.plans)}
    assert kinds[1024 * 512] == "Move" and kinds[1] == "Keep"
    assert t._data is not None  # the saved tensor itself is left whole
