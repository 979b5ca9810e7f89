"""CPU: the policy's marks on plain, grouped and quantized storages, under V1 and V2 semantics."""

import pytest
import torch
from transformer_engine.pytorch import cpu_offload
from transformer_engine.pytorch.tensor import GroupedTensorStorage
from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

from te_offload_ops import policy
from te_offload_ops.policy import KEEP_ATTR, V1_OFFLOAD_ATTR, data_tensors, mark_saved_tensors
from te_storages import fp8_storage, grouped_storage


@pytest.fixture(params=["v2", "v1"])
def engine(request, monkeypatch):
    """Which TE engine's semantics the mark functions follow (TE reads the env var at import)."""
    monkeypatch.setattr(cpu_offload, "NVTE_CPU_OFFLOAD_V1", request.param == "v1")
    return request.param


@pytest.fixture
def started(monkeypatch):
    """Pretend an engine is active and record start_offload calls (it records CUDA events)."""
    calls = []
    monkeypatch.setattr(cpu_offload, "is_cpu_offload_enabled", lambda: True)
    monkeypatch.setattr(cpu_offload, "start_offload", lambda *ts: calls.extend(ts))
    return calls


def same(found, expected) -> bool:
    return len(found) == len(expected) and all(a is b for a, b in zip(found, expected))


def kept(t) -> bool:
    return getattr(t, KEEP_ATTR, False) is True


def v1_marked(t) -> bool:
    return hasattr(t, V1_OFFLOAD_ATTR)


STORAGES = {
    "plain": lambda: torch.randn(8, 4),
    "grouped": grouped_storage,
    "fp8-storage": fp8_storage,
    "fp8-tensor": lambda: fp8_storage(Float8Tensor),
}


@pytest.mark.parametrize("kind", list(STORAGES))
def test_offloaded_activation_marks(kind, engine, started):
    act = STORAGES[kind]()
    mark_saved_tensors([act], offload=True)
    for t in data_tensors(act):
        assert not kept(t)
        # V1 offloads only what carries its attribute; V2 offloads whatever is unmarked.
        assert v1_marked(t) == (engine == "v1")
    assert same(started, [act])


@pytest.mark.parametrize("kind", list(STORAGES))
def test_activation_of_opted_out_op_is_kept(kind, engine, started):
    act = STORAGES[kind]()
    # The TE op marked it for V1 before our policy ran: the opt-out must undo that.
    cpu_offload.mark_activation_offload(act)
    mark_saved_tensors([act], offload=False)
    for t in data_tensors(act):
        assert kept(t) and not v1_marked(t)
    if isinstance(act, torch.Tensor):
        assert kept(act)  # a tensor subclass reaches the hooks whole
    assert started == []


@pytest.mark.parametrize("kind", list(STORAGES))
@pytest.mark.parametrize("offload", [True, False])
def test_weights_are_never_offloaded(kind, offload, engine, started):
    weight = STORAGES[kind]()
    param = torch.nn.Parameter(torch.randn(4, 4))
    act = torch.randn(4, 4)
    mark_saved_tensors([act, weight, param], offload=offload, weights=[weight])
    for t in (*data_tensors(weight), param):
        assert kept(t) and not v1_marked(t)
    assert kept(act) == (not offload)
    assert same(started, [act] if offload else [])


def test_parameter_counts_as_weight_even_when_not_listed(engine, started):
    param = torch.nn.Parameter(torch.randn(4, 4))
    mark_saved_tensors([param], offload=True)
    assert kept(param) and not v1_marked(param)
    assert started == []


def test_no_start_offload_without_an_engine(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_offload, "start_offload", lambda *ts: calls.extend(ts))
    assert not cpu_offload.is_cpu_offload_enabled()
    mark_saved_tensors([torch.randn(4)], offload=True)
    assert calls == []


def test_keep_wins_over_offload_for_a_shared_tensor(engine, started):
    shared = torch.randn(4, 4)
    mark_saved_tensors([shared], offload=False)  # e.g. saved by an op with offload=False
    mark_saved_tensors([shared], offload=True)   # and by another op later in the same forward
    assert kept(shared) and not v1_marked(shared)
    assert started == []


def test_none_entries_are_skipped(engine):
    mark_saved_tensors([None, torch.randn(2)], offload=True, weights=[None])


@pytest.mark.parametrize("bad", ["yes", 1, None, 0.0])
def test_offload_flag_must_be_bool(bad):
    t = torch.randn(2)
    with pytest.raises(TypeError, match="offload must be a bool"):
        mark_saved_tensors([t], offload=bad)
    assert not kept(t) and not v1_marked(t)


def test_save_for_backward_marks_then_saves(engine, started):
    class Ctx:
        def save_for_backward(self, *ts):
            self.to_save = ts

    ctx, act, w = Ctx(), torch.randn(3), torch.nn.Parameter(torch.randn(3))
    policy.save_for_backward(ctx, act, None, w, offload=True, weights=[w])
    assert ctx.to_save == (act, None, w)
    assert kept(w) and not kept(act)


def test_grouped_data_tensors_fallback_matches_te(monkeypatch):
    """Without GroupedTensorStorage.get_data_tensors(), prepare_for_saving() answers the same."""
    storage = grouped_storage()
    expected = tuple(t for t in storage.get_data_tensors() if t is not None)
    monkeypatch.delattr(GroupedTensorStorage, "get_data_tensors")
    found = data_tensors(storage)
    assert len(found) == len(expected) and all(a is b for a, b in zip(found, expected))
    assert storage.rowwise_data is expected[0]  # the storage itself is left whole
    mark_saved_tensors([storage], offload=False)
    assert all(kept(t) for t in expected)


def test_data_tensors_rejects_other_types():
    with pytest.raises(TypeError, match="expected a tensor or a TE tensor storage"):
        data_tensors([torch.randn(2)])


def test_storage_sharing_a_kept_tensor_still_offloads_the_rest(engine, started):
    """Grouped storages of one MLP share their split sizes: keeping one storage must not pin the other."""
    kept_storage, other = grouped_storage(), grouped_storage()
    other.first_dims = kept_storage.first_dims
    mark_saved_tensors([kept_storage], offload=False)
    mark_saved_tensors([other], offload=True)
    assert kept(other.first_dims) and not v1_marked(other.first_dims)
    for t in (other.rowwise_data, other.tensor_offsets):
        assert not kept(t)
        assert v1_marked(t) == (engine == "v1")
    assert same(started, [other])


@pytest.mark.parametrize("offload", [True, False])
def test_weight_scales_are_kept_too(offload, engine, started):
    """Hook engines see every tensor a storage hands to autograd, its scales included."""
    weight = fp8_storage()
    mark_saved_tensors([weight], offload=offload, weights=[weight])
    assert kept(weight._scale_inv) and not v1_marked(weight._scale_inv)


def test_a_weight_kept_again_stays_kept_and_loses_a_v1_mark_set_since():
    """Weights are saved every step: once kept, keeping them again changes nothing (and is
    skipped), unless something marked them for V1 since, which keeping must still clear."""
    from te_offload_ops import policy

    w = torch.nn.Parameter(torch.randn(4, 4))
    policy.mark_saved_tensors([w], offload=True, weights=[w])
    assert getattr(w, policy.KEEP_ATTR) is True and not hasattr(w, policy.V1_OFFLOAD_ATTR)
    policy.mark_saved_tensors([w], offload=True, weights=[w])
    assert getattr(w, policy.KEEP_ATTR) is True
    setattr(w, policy.V1_OFFLOAD_ATTR, True)  # as TE's own ops mark their inputs under V1
    policy.mark_saved_tensors([w], offload=True, weights=[w])
    assert getattr(w, policy.KEEP_ATTR) is True and not hasattr(w, policy.V1_OFFLOAD_ATTR)


class _Op:
    """An op saving through the policy (weak-referenceable, as modules are)."""

    def __init__(self, offload: bool):
        self.offload = offload

    def save(self, *ts, weights=()):
        class Ctx:
            def save_for_backward(self, *saved):
                self.saved = saved

        policy.save_for_backward(Ctx(), *ts, offload=self.offload, weights=weights, owner=self)


def test_an_activation_kept_in_one_forward_is_offloaded_in_a_later_one_where_no_op_keeps_it(engine, started):
    """A tensor that outlives the step (the caller's split sizes) saved by two layers' ops."""
    splits, weight = torch.randn(4), torch.nn.Parameter(torch.randn(3))
    layer0, layer1 = _Op(offload=False), _Op(offload=True)
    for op in (layer0, layer1):  # forward 1: layer 0 keeps it, and keep wins in its forward
        op.save(splits, weight, weights=[weight])
        assert kept(splits) and started == []
    layer0.offload, layer1.offload = True, False  # forward 2: layer 1 keeps it
    layer0.save(splits, weight, weights=[weight])
    assert not kept(splits) and sum(t is splits for t in started) == 1
    layer1.save(splits, weight, weights=[weight])
    assert kept(splits)
    layer1.offload = True  # forward 3: no op keeps it
    for op in (layer0, layer1):
        op.save(splits, weight, weights=[weight])
        assert not kept(splits)
    assert sum(t is splits for t in started) == 3 and kept(weight)  # a weight's mark is for good


def test_a_keep_mark_without_an_owner_lasts(engine, started):
    shared = torch.randn(4)
    mark_saved_tensors([shared], offload=False)
    _Op(offload=True).save(shared)
    assert kept(shared) and started == []
