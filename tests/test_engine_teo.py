"""CPU: the teo offload engine's decisions, schedule, pinned pool and refusals (copies need a GPU:
tests/test_gpu_engine_teo.py)."""

import pytest
import torch
from transformer_engine.pytorch import cpu_offload
from test_policy import fp8_storage
from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

from te_offload_ops import capture, engines_teo, policy
from te_offload_ops.engines import OffloadCounter, offload_context
from te_offload_ops.engines_teo import (Keep, Move, Parts, PinnedBufferPool, TeoEngine, class_bytes,
                                        layers_to_reload, plan_saved, size_class)

BIG = policy.MIN_OFFLOAD_NUMEL  # elements: the smallest tensor V2's rule moves


@pytest.fixture
def cpu_is_offloadable(monkeypatch):
    """Let the rule take CPU tensors for the device it moves from, so plans are testable here."""
    monkeypatch.setattr(policy, "OFFLOAD_DEVICE_TYPE", "cpu")


# ------------------------------------------------------------------------------------------------
# Selection and arguments


def test_teo_is_selected_through_offload_context():
    counter_classify = lambda t: "k"  # noqa: E731
    ctx, sync, counter = offload_context("teo", num_layers=4, model_layers=4, classify=counter_classify)
    assert isinstance(ctx, engines_teo.TeoContext) and sync == ctx.sync
    assert isinstance(counter, OffloadCounter) and ctx.engine.counter is counter
    assert (ctx.engine.num_layers, ctx.engine.model_layers, ctx.engine.prefetch) == (4, 4, 1)
    assert ctx.engine.pool is engines_teo.default_pool()
    assert offload_context("teo", num_layers=1, model_layers=4, prefetch=3)[0].engine.prefetch == 3


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_layers": 5, "model_layers": 4}, ValueError, "num_layers must be in 0..model_layers=4, got 5"),
    ({"num_layers": -1, "model_layers": 4}, ValueError, "got -1"),
    ({"num_layers": 0, "model_layers": 0}, ValueError, "model_layers must be >= 1, got 0"),
    ({"num_layers": 1, "model_layers": 4, "prefetch": -1}, ValueError, "prefetch must be >= 0 layers, got -1"),
    ({"num_layers": 1.0, "model_layers": 4}, TypeError, "num_layers must be an int, got float"),
    ({"num_layers": 1, "model_layers": 4, "prefetch": True}, TypeError, "prefetch must be an int, got bool"),
    ({"num_layers": 1, "model_layers": 4, "retain_pinned_cpu_buffers": True}, ValueError,
     "teo has no such option"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        offload_context("teo", **kwargs)


def test_prefetch_belongs_to_teo_only():
    with pytest.raises(ValueError, match="prefetch is an option of the teo engine, not of 'v2'"):
        offload_context("v2", num_layers=1, model_layers=2, prefetch=2)


# ------------------------------------------------------------------------------------------------
# Which saved tensors move: V2's rule from the policy, then the layout


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


# ------------------------------------------------------------------------------------------------
# The backward schedule


@pytest.mark.parametrize("layer, prefetch, offloaded, expected", [
    (3, 1, 4, [3, 2]),  # all layers offloaded: the first backward layer reloads at once, the next ahead
    (3, 1, 3, [2]),  # layer 3 is resident: layer 2 starts while layer 3's backward runs
    (3, 2, 3, [2, 1]),
    (1, 1, 4, [1, 0]),
    (0, 1, 4, [0]),
    (2, 0, 4, [2]),  # no prefetch: each layer when its backward begins
    (3, 1, 0, []),
])
def test_layers_to_reload(layer, prefetch, offloaded, expected):
    assert layers_to_reload(layer, prefetch, offloaded) == expected


def test_sync_marks_layer_boundaries_in_backward(monkeypatch):
    """Boundaries arrive last layer first, then the backward's end; nothing moves with num_layers=0."""
    ctx, sync, _ = offload_context("teo", num_layers=0, model_layers=3)
    seen = []
    monkeypatch.setattr(ctx.engine, "backward_boundary", lambda layer: seen.append(layer))
    x = torch.randn(8, 8, requires_grad=True)
    h = x
    for _ in range(3):
        with ctx:
            assert cpu_offload.is_cpu_offload_enabled()  # TE's modules see an engine, as under V2
            h = torch.tanh(h)
        h = sync(h)
    assert not cpu_offload.is_cpu_offload_enabled()
    h.sum().backward()
    assert seen == [2, 1, 0]
    assert torch.equal(x.grad, torch.autograd.grad(torch.tanh(torch.tanh(torch.tanh(x))).sum(), x)[0])


def test_layers_count_per_step():
    engine = TeoEngine(1, 3)
    assert [engine.enter_layer() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_saves_outside_offloaded_layers_or_kept_are_returned_as_is(cpu_is_offloadable):
    engine = TeoEngine(1, 2)
    t = torch.empty(BIG)
    assert engine.pack(t) is t  # before any layer
    engine.enter_layer()
    small = torch.empty(10)
    assert engine.pack(small) is small and engine.unpack(small) is small
    engine.enter_layer()  # layer 1: not offloaded
    assert engine.pack(t) is t


def test_context_misuse_is_refused():
    ctx, sync, _ = offload_context("teo", num_layers=1, model_layers=2)
    with pytest.raises(RuntimeError, match="before the context was ever entered"):
        sync(torch.ones(2, requires_grad=True) * 2)
    with ctx:
        with pytest.raises(RuntimeError, match="entered again"):
            ctx.__enter__()
        with pytest.raises(RuntimeError, match="inside its context"):
            sync(torch.ones(2, requires_grad=True) * 2)
    with pytest.raises(ValueError, match="grad_fn"):
        sync(torch.ones(2, requires_grad=True))  # a leaf: no node to hook the layer's backward on
    frozen = torch.ones(2)
    assert sync(frozen) is frozen  # a frozen layer saved nothing: nothing to reload


def test_stale_handle_is_refused():
    engine = TeoEngine(1, 1)
    engine._step = 2
    handle = engines_teo._Moved(1, 0, 0, 0, (2,), (1,), torch.float32)  # saved in step 1
    with pytest.raises(RuntimeError, match="saved in step 1 is used after that step ended"):
        engine.unpack(handle)


# ------------------------------------------------------------------------------------------------
# Pinned buffers


def _fake_pool():
    made = []

    def allocate(n):
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    return PinnedBufferPool(allocate), made


def test_size_classes_cover_and_waste_little():
    for n in (1, 65536, 65537, 262144, 300_000, 10**6, 123_456_789):
        size = class_bytes(size_class(n))
        assert size >= n and size % 512 == 0
        if n > 65536:
            assert size <= n * 1.095 + 512
            assert class_bytes(size_class(n) - 1) < n  # the smallest class that fits


def test_pool_reuses_buffers_across_steps():
    pool, made = _fake_pool()
    sizes = [3 << 20, 1 << 20, 1 << 20, 5 << 20]
    for step in range(3):
        # per-expert slices change a little with routing from step to step
        bufs = [pool.acquire(n + step * 4096) for n in sizes]
        assert all(b.tensor.numel() >= n + step * 4096 for b, n in zip(bufs, sizes))
        assert pool.in_use == 4
        for b in bufs:
            pool.release(b, ready=f"event{step}")
        assert pool.in_use == 0
    assert pool.allocations == len(made) == 4  # only the first step allocated
    assert pool.allocated_bytes == sum(made) == pool.free_bytes
    again = pool.acquire(1 << 20)
    assert again.ready == "event2"  # the next user waits for the last GPU use


def test_pool_does_not_hand_out_much_larger_buffers_or_shared_ones():
    pool, made = _fake_pool()
    big = pool.acquire(8 << 20)
    pool.release(big, None)
    small = pool.acquire(1 << 20)  # three octaves smaller: a buffer of its own
    assert small is not big and pool.allocations == 2
    a, b = pool.acquire(8 << 20), pool.acquire(8 << 20)
    assert a is big and b is not a and pool.allocations == 3


def test_pool_clear_drops_free_buffers_only():
    pool, _ = _fake_pool()
    held, free = pool.acquire(1 << 20), pool.acquire(1 << 20)
    pool.release(free, None)
    pool.clear()
    assert pool.free_bytes == 0
    pool.release(held, None)
    assert pool.free_bytes == held.tensor.numel()


# ------------------------------------------------------------------------------------------------
# CUDA graph capture


def test_refused_under_capture(monkeypatch):
    ctx, _, _ = offload_context("teo", num_layers=1, model_layers=2)
    monkeypatch.setattr(capture, "capturing", lambda: True)
    with pytest.raises(capture.GraphCaptureError, match="teo offload engine cannot run under CUDA graph capture"):
        ctx.__enter__()
    assert not ctx._inside and cpu_offload.OFFLOAD_SYNCHRONIZER is None  # refused before anything changed
    with pytest.raises(capture.GraphCaptureError):
        ctx.engine.pack(torch.empty(4))
