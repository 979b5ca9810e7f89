"""CPU: the teo offload engine's decisions, schedule, pinned pool and refusals (copies need a GPU:
tests/test_gpu_engine_teo.py)."""

import contextlib
import logging
import re
import weakref

import pytest
import torch
from transformer_engine.pytorch import cpu_offload
from test_policy import fp8_storage
from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

from te_offload_ops import capture, engines_teo, policy
from te_offload_ops.engines import OffloadCounter, offload_context
from te_offload_ops.engines_teo import (Keep, Move, Parts, PinnedBufferPool, TeoEngine, class_bytes,
                                        layers_to_reload, next_sequence_nr, peak_neutral_lead, plan_saved,
                                        reloads_at_backward_start, reloads_at_region_end, size_class,
                                        watch_region)

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
    assert (ctx.engine.num_layers, ctx.engine.model_layers, ctx.engine.prefetch) == (4, 4, None)  # peak-neutral
    assert ctx.engine.pool is engines_teo.default_pool()
    assert offload_context("teo", num_layers=1, model_layers=4, prefetch=3)[0].engine.prefetch == 3


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_layers": 5, "model_layers": 4}, ValueError, "num_layers must be in 0..model_layers=4, got 5"),
    ({"num_layers": -1, "model_layers": 4}, ValueError, "got -1"),
    ({"num_layers": 0, "model_layers": 0}, ValueError, "model_layers must be >= 1, got 0"),
    ({"num_layers": 1, "model_layers": 4, "prefetch": -1}, ValueError, "prefetch must be >= 0 layers \\(or None: peak-neutral\\), got -1"),
    ({"num_layers": 1.0, "model_layers": 4}, TypeError, "num_layers must be an int, got float"),
    ({"num_layers": 1, "model_layers": 4, "prefetch": True}, TypeError, "prefetch must be an int, got bool"),
    ({"num_layers": 1, "model_layers": 4, "retain_pinned_cpu_buffers": True}, ValueError,
     "teo has no such option"),
    ({"num_layers": 1, "model_layers": 4, "max_held_bytes": -1}, ValueError, "max_held_bytes must be >= 0 .*got -1"),
    ({"num_layers": 1, "model_layers": 4, "max_held_bytes": 1.5}, TypeError, "max_held_bytes must be an int, got float"),
    ({"num_layers": 1, "model_layers": 4, "memory_budget": 0}, ValueError, "memory_budget must be a positive .*got 0"),
    ({"num_layers": 1, "model_layers": 4, "memory_budget": 2.0**30}, TypeError, "memory_budget must be an int, got float"),
    ({"num_layers": 1, "model_layers": 4, "memory_budget": 1 << 30, "release": "memory"}, ValueError,
     "cannot be combined with release='memory'"),
    ({"num_layers": 1, "model_layers": 4, "memory_budget": 1 << 30, "max_held_bytes": 8}, ValueError,
     "cannot be combined with .*max_held_bytes=8"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        offload_context("teo", **kwargs)


def test_refused_in_a_process_running_te_v1(monkeypatch):
    # TE's modules leave V1's marks there, which teo does not read: it would move FP8 workspaces
    monkeypatch.setattr(cpu_offload, "NVTE_CPU_OFFLOAD_V1", True)
    with pytest.raises(RuntimeError, match="this process runs TE's V1 engine \\(NVTE_CPU_OFFLOAD_V1=1"):
        offload_context("teo", num_layers=1, model_layers=2)
    with pytest.raises(RuntimeError, match="V1"):
        engines_teo.make_teo_context(1, 2)
    monkeypatch.setattr(cpu_offload, "NVTE_CPU_OFFLOAD_V1", False)
    assert isinstance(offload_context("teo", num_layers=1, model_layers=2)[0], engines_teo.TeoContext)


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


def _peak_neutral_schedule(n: int, L: int) -> list[tuple[str, int, list[int]]]:
    """The reloads started at each event of a backward: layer j begins, then j's region ends."""
    events = []
    for j in range(L - 1, -1, -1):
        events.append(("start", j, reloads_at_backward_start(j, None, n, L)))
        events.append(("end", j, reloads_at_region_end(j, None, n, L)))
    return events


@pytest.mark.parametrize("n, L", [(n, L) for L in (1, 2, 4, 8) for n in range(L + 1)])
def test_peak_neutral_schedule_never_holds_more_layers_than_the_peak_allows(n, L):
    """Count layers on the GPU through a backward: a layer not offloaded is there until its region
    ends; an offloaded one from its reload until its region ends. At every point the count stays
    within what the no-offload peak less the offloaded layers holds (L - n, and at least the layer
    being run), every offloaded layer is reloaded before its backward begins or at it, and each
    reload starts once."""
    on_gpu = set(range(n, L))
    allowed = max(L - n, 1)
    started = []
    for what, j, reloads in _peak_neutral_schedule(n, L):
        if what == "end":
            on_gpu.discard(j)
        on_gpu.update(reloads)
        started += [r for r in reloads if r not in started]
        if what == "start":
            assert j in on_gpu, (what, j)
        assert len(on_gpu) <= allowed, (what, j, sorted(on_gpu))
    assert sorted(started) == list(range(n))


@pytest.mark.parametrize("n, L, expected", [
    (3, 4, {2: ("end", 3), 1: ("end", 2), 0: ("end", 1)}),  # V2 starts each at its own layer: no overlap
    (4, 4, {3: ("start", 3), 2: ("end", 3), 1: ("end", 2), 0: ("end", 1)}),  # V2 cannot run n = L
    (2, 4, {1: ("end", 3), 0: ("end", 2)}),  # one layer further ahead, as far as V2 goes
    (1, 8, {0: ("end", 7)}),
])
def test_peak_neutral_reloads_start_when_a_region_frees_room(n, L, expected):
    first = {}
    for what, j, reloads in _peak_neutral_schedule(n, L):
        for r in reloads:
            first.setdefault(r, (what, j))
    assert first == expected
    assert peak_neutral_lead(n, L) == max(L - 1 - n, 0)


def test_a_prefetch_distance_replaces_the_peak_neutral_schedule():
    assert reloads_at_backward_start(3, 1, 4, 4) == [3, 2] and reloads_at_region_end(3, 1, 4, 4) == []
    assert reloads_at_backward_start(2, 0, 3, 4) == [2]


class _Handle:
    """What a saved-tensor hook hands autograd; says when autograd lets go of it."""

    def __init__(self, t, released):
        self.t, self.released = t, released

    def __del__(self):
        self.released.append(1)


def test_region_end_comes_once_after_the_region_ran_and_released_what_it_saved():
    saved, released, seen = [], [], []
    x = torch.randn(4, 4, requires_grad=True)
    before = torch.tanh(x)  # outside the region: created before it
    since = next_sequence_nr()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or _Handle(t, released), lambda h: h.t):
        a = torch.sigmoid(before)  # the region: two branches that join
        b = torch.exp(before)
        out = a * b
    del a, b
    inside, after = watch_region(out.grad_fn, since, lambda: seen.append(("end", len(released), len(saved))))
    assert (inside, after) == (3, 1)  # sigmoid, exp, mul; tanh was before `since`
    before.grad_fn.register_prehook(lambda _g: seen.append("tanh begins"))
    (out * 3).sum().backward()
    assert seen[0][0] == "end" and seen[0][1] == seen[0][2] > 0  # all released by then
    assert seen[1:] == ["tanh begins"]


def test_region_end_without_a_node_after_it_is_never_reported():
    x = torch.randn(4, requires_grad=True)  # a leaf feeds the region: no node runs after it
    since = next_sequence_nr()
    out = torch.sigmoid(x) * 2
    seen = []
    watch_region(out.grad_fn, since, lambda: seen.append("end"))
    out.sum().backward()
    assert seen == []


def test_no_region_is_watched_without_grad():
    with torch.no_grad():
        assert next_sequence_nr() is None


def test_the_engine_hears_each_region_end_in_backward_order(monkeypatch):
    ctx, sync, _ = offload_context("teo", num_layers=2, model_layers=3)
    events = []
    monkeypatch.setattr(ctx.engine, "backward_boundary", lambda layer: events.append(("start", layer)))
    monkeypatch.setattr(ctx.engine, "region_backward_done", lambda layer: events.append(("end", layer)))
    x = torch.randn(8, 8, requires_grad=True)
    h = x * 1.0
    for _ in range(3):
        h = h + 1  # outside the context (the layer's attention, say)
        with ctx:
            h = torch.tanh(h) * 2
        h = sync(h)
    h.sum().backward()
    assert events == [("start", 2), ("end", 2), ("start", 1), ("end", 1), ("start", 0), ("end", 0)]


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


# ------------------------------------------------------------------------------------------------
# The forward's backpressure: when an offloaded layer's GPU bytes go back


@pytest.mark.parametrize("n, L, lag", [(1, 4, 3), (2, 4, 2), (3, 4, 1), (4, 4, 1), (6, 8, 2), (0, 3, 3)])
def test_release_lag_keeps_the_forward_within_the_layers_the_peak_holds(n, L, lag):
    assert engines_teo.release_lag(n, L) == lag


class _FakeStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


def _fake_layer_copies(layer: int, count: int = 2, stream=None):
    copies = [engines_teo._HostCopy(host=None, nbytes=8, start=0, storage_ptr=0, storage_ref=None,
                                    copied=f"L{layer}.copy{i}", source=torch.zeros(8, dtype=torch.uint8),
                                    source_stream=stream)
              for i in range(count)]
    return engines_teo._LayerCopies(copies=copies)


@pytest.mark.parametrize("n, L, released_at", [
    (3, 4, {0: ("enter", 1), 1: ("enter", 2), 2: ("enter", 3)}),
    (2, 4, {0: ("enter", 2), 1: ("enter", 3)}),
    (4, 4, {0: ("enter", 1), 1: ("enter", 2), 2: ("enter", 3), 3: ("sync", 3)}),  # the last at its own end
])
def test_forward_gives_each_offloaded_layers_bytes_back_after_waiting_for_its_copies(monkeypatch, n, L, released_at):
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    engine = TeoEngine(n, L)
    seen = {}

    def note(when, layer):
        for j, copies in engine._layers.items():
            if j not in seen and all(c.source is None for c in copies.copies):
                seen[j] = (when, layer)
                assert stream.waited[-1] == f"L{j}.copy1"  # waited for its copies before letting go

    for k in range(L):
        engine.enter_layer()
        note("enter", k)
        if k < n:
            engine._layers[k] = _fake_layer_copies(k, stream=stream)  # what its saves copied
        engine.layer_done(k)
        note("sync", k)
    assert seen == released_at
    assert all(engine._layers[j].released for j in range(n))


def test_a_reload_goes_back_in_stream_order_after_its_copy(monkeypatch):
    """No record_stream: a reload that was never used makes the compute stream wait for its copy
    before its memory goes back; one already waited for by its use goes back without a new wait."""
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    engine = TeoEngine(2, 3)
    copies = _fake_layer_copies(0)
    for i, c in enumerate(copies.copies):
        c.source = None
        c.gpu, c.reloaded, c.waited = torch.zeros(8, dtype=torch.uint8), f"reload{i}", i == 0  # copy 0 was used
        c.reload_stream = stream
    copies.reloaded = True
    engine._layers[0] = copies
    engine._release_reload(0)
    assert stream.waited == ["reload1"]
    assert all(c.gpu is None for c in copies.copies) and not copies.reloaded


def test_a_source_never_given_back_is_served_in_place_with_its_offset():
    """A layer whose backward begins before its release (no later layer entered) unpacks from the
    bytes the engine still holds: no copy back, the same storage, the element at the same address,
    for a view saved at an unaligned offset of a range copied from a 512-byte boundary."""
    engine = TeoEngine(1, 2)
    engine.enter_layer()
    base = torch.arange(4096, dtype=torch.float32)
    view = base[300:1300].view(40, 25)  # starts 1200 bytes into the storage
    start = 1200 - 1200 % 512
    src = torch.empty(0, dtype=torch.uint8).set_(base.untyped_storage(), start, (1200 + 4000 - start,), (1,))
    copy = engines_teo._HostCopy(host=None, nbytes=src.numel(), start=start, storage_ptr=base.data_ptr(),
                                 storage_ref=None, copied="copied", source=src)
    engine._layers[0] = engines_teo._LayerCopies(copies=[copy])
    handle = engines_teo._Moved(engine._step, 0, 0, 1200 - start, tuple(view.shape), view.stride(), view.dtype)
    got = engine.unpack(handle)
    assert got.data_ptr() == view.data_ptr() and torch.equal(got, view)
    assert got.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # no copy


def test_region_ends_release_and_reload_through_real_hooks(monkeypatch):
    """The engine's own reactions to a real backward (4 layers, 3 offloaded, whole-layer regions
    with an op outside each context): each region's end drops its reloads and starts the next."""
    ctx, sync, _ = offload_context("teo", num_layers=3, model_layers=4)
    engine = ctx.engine
    calls = []
    monkeypatch.setattr(engine, "_reload", lambda layer, prefetch=False: calls.append(("reload", layer)))
    monkeypatch.setattr(engine, "_release_reload", lambda layer: calls.append(("release", layer)))
    x = torch.randn(8, 8, requires_grad=True)
    h = x * 1.0
    for _ in range(4):
        h = h + 1
        with ctx:
            h = torch.tanh(h) * 2
        h = sync(h)
    h.sum().backward()
    # lead 0 (n = L - 1): layer 3's end starts layer 2, and so on; starts add the layer itself (a no-op
    # when already started)
    assert [c for c in calls if c[0] == "reload"] == [
        ("reload", 2), ("reload", 2), ("reload", 1), ("reload", 1), ("reload", 0), ("reload", 0)]
    assert ("release", 3) in calls and calls.index(("release", 3)) < calls.index(("reload", 2))


class _NamedStream(_FakeStream):
    def __init__(self, name):
        super().__init__()
        self.name = name


class _FakeEvent:
    def record(self, stream):
        pass


def _fake_copy_streams(monkeypatch):
    """A compute stream (the current one) and a copy stream without a GPU; each notes what it
    waited for, the copy stream also the streams it waited on, as ("stream", name)."""
    compute, h2d = _NamedStream("compute"), _NamedStream("h2d")
    h2d.wait_stream = lambda stream: h2d.waited.append(("stream", stream.name))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    return compute, h2d


def test_sources_go_back_after_both_their_save_stream_and_the_current_one_waited(monkeypatch):
    """A tensor saved on a side stream: that stream and the current one (either may have allocated
    it) wait for the last copy before the engine lets go."""
    side, current = _NamedStream("side"), _NamedStream("current")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    engine = TeoEngine(1, 2)
    engine.enter_layer()
    engine._layers[0] = _fake_layer_copies(0, stream=side)
    engine.enter_layer()  # layer 1 enters: layer 0's sources go back
    assert side.waited == ["L0.copy1"] and current.waited == ["L0.copy1"]
    assert all(c.source is None for c in engine._layers[0].copies)


@pytest.mark.parametrize("handles", [1, 2])
def test_a_reload_used_on_another_stream_is_kept_for_that_stream(monkeypatch, handles):
    """Used on a side stream: that stream waits for the copy and records itself on the memory. With
    its one handle used, the engine lets go (the recorded use keeps the memory from reuse); with a
    second handle never unpacked, the engine keeps it to the layer's end, where the stream it was
    taken on waits for the copy before it goes back."""
    taken_on, used_on = _NamedStream("compute"), _NamedStream("side")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: used_on)
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append(stream))
    engine = TeoEngine(1, 2)
    engine.enter_layer()
    c = _reloaded_layer(engine, taken_on, torch.zeros(8, dtype=torch.uint8), handles=handles)
    engine.unpack(engines_teo._Moved(engine._step, 0, 0, 0, (2,), (1,), torch.float32))
    assert used_on.waited == ["reload0"] and recorded == [used_on] and not c.waited
    assert (c.gpu is None) == (handles == 1) and taken_on.waited == []
    engine._release_reload(0)
    assert taken_on.waited == ([] if handles == 1 else ["reload0"])


def test_a_reload_that_raises_midway_leaves_its_started_copies_to_be_waited_on(monkeypatch):
    compute, h2d = _fake_copy_streams(monkeypatch)
    engine = TeoEngine(1, 2)
    monkeypatch.setattr(engine, "_streams", lambda device=None: (None, h2d))
    copies = _fake_layer_copies(0)
    for c in copies.copies:
        c.source, c.host = None, engines_teo.HostBuffer(torch.zeros(8, dtype=torch.uint8), 0)
    engine._layers[0] = copies
    real_empty, made = torch.empty, []

    def empty(*a, **k):
        if len(made) == 1:
            raise torch.cuda.OutOfMemoryError("no room for the second reload")
        made.append(1)
        return real_empty(*a, **{**k, "device": "cpu"})

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        engine._reload(0)
    monkeypatch.setattr(torch, "empty", real_empty)
    engine._release_reload(0)
    first = copies.copies[0]
    assert compute.waited == [first.reloaded] and first.gpu is None


def test_a_frozen_last_layer_still_gives_its_bytes_back(monkeypatch):
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    ctx, sync, _ = offload_context("teo", num_layers=2, model_layers=2)
    x = torch.randn(4, requires_grad=True)
    with ctx:
        h = x * 2
    sync(h)
    with ctx:
        ctx.engine._layers[1] = _fake_layer_copies(1, stream=stream)
        frozen = torch.randn(4)
    assert sync(frozen) is frozen
    assert ctx.engine._layers[1].released and stream.waited


def test_a_region_with_nothing_after_it_is_said_once(caplog):
    ctx, sync, _ = offload_context("teo", num_layers=1, model_layers=3)
    with caplog.at_level(logging.INFO, logger="te_offload_ops.engines_teo"):
        for _ in range(3):
            x = torch.randn(4, requires_grad=True)  # each layer's input a leaf
            with ctx:
                h = torch.tanh(x) * 2
            sync(h)
    said = [r.getMessage() for r in caplog.records if "nothing in autograd follows" in r.getMessage()]
    assert len(said) == 1 and "layer 1's region" in said[0]


def test_tensors_on_another_device_than_the_engines_stay(cpu_is_offloadable, caplog):
    engine = TeoEngine(1, 1)
    engine.enter_layer()
    engine._device = torch.device("cuda", 1)  # the first tensor it moved was on cuda:1
    t = torch.empty(BIG)
    with caplog.at_level(logging.INFO, logger="te_offload_ops.engines_teo"):
        assert engine.pack(t) is t  # a host tensor: nothing to say
        assert not caplog.records
        other = [torch.empty(BIG, device="meta") for _ in range(2)]  # stands for a second GPU's tensors
        assert all(engine.pack(o) is o for o in other)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "tensors saved on meta stay there" in said[0] and "(cuda:1's" in said[0]


# ------------------------------------------------------------------------------------------------
# A reload goes back at its last use, as a tensor kept on the GPU does


def _reloaded_layer(engine, stream, data: torch.Tensor, handles: int):
    copies = _fake_layer_copies(0, count=1)
    c = copies.copies[0]
    c.source, c.gpu, c.reloaded, c.reload_stream, c.handles = None, data, "reload0", stream, handles
    c.host = engines_teo.HostBuffer(data.clone(), 0)
    copies.reloaded = True
    engine._layers[0] = copies
    return c


def test_saving_a_range_again_counts_one_more_handle_to_its_copy(monkeypatch, cpu_is_offloadable):
    engine = TeoEngine(1, 2)
    engine.enter_layer()
    made = []

    def copy_to_host(t, storage, span):
        made.append(span)
        return engines_teo._HostCopy(host=None, nbytes=span.nbytes, start=span.start, storage_ptr=storage.data_ptr(),
                                     storage_ref=engines_teo.StorageWeakRef(storage), copied="copied")

    monkeypatch.setattr(engine, "_copy_to_host", copy_to_host)
    t = torch.zeros(2 * BIG)
    handles = [engine.pack(t), engine.pack(t), engine.pack(t[BIG:])]  # saved twice, then a view of it
    assert len(made) == 1 and engine._layers[0].copies[0].handles == 3
    assert [h.index for h in handles] == [0, 0, 0]


def test_a_reload_goes_back_at_its_last_counted_use(monkeypatch):
    """Two handles to one reloaded range: the engine keeps it after the first unpack and lets go at
    the second, leaving the bytes to the tensor it returned (autograd frees it after the op)."""
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    engine = TeoEngine(1, 2)
    engine.enter_layer()
    data = torch.arange(8, dtype=torch.uint8)
    c = _reloaded_layer(engine, stream, data, handles=2)
    handle = engines_teo._Moved(engine._step, 0, 0, 0, (2,), (1,), torch.float32)
    first = engine.unpack(handle)
    assert c.gpu is data and stream.waited == ["reload0"]
    second = engine.unpack(handle)
    assert c.gpu is None and stream.waited == ["reload0"]  # waited once, at the first use
    assert torch.equal(second, data.view(torch.float32)) and torch.equal(first, second)
    engine._release_reload(0)  # the layer's end: nothing left to wait for or drop
    assert stream.waited == ["reload0"] and not engine._layers[0].reloaded


def test_an_unpack_past_the_counted_uses_copies_the_range_back_again(monkeypatch, caplog):
    compute, h2d = _fake_copy_streams(monkeypatch)
    engine = TeoEngine(1, 2)
    engine._device = torch.device("cpu")
    monkeypatch.setattr(engine, "_streams", lambda device=None: (None, h2d))
    engine.enter_layer()
    data = torch.arange(8, dtype=torch.uint8)
    c = _reloaded_layer(engine, compute, data, handles=1)
    handle = engines_teo._Moved(engine._step, 0, 0, 0, (2,), (1,), torch.float32)
    engine.unpack(handle)
    assert c.gpu is None
    with caplog.at_level(logging.INFO, logger=engines_teo.__name__):
        again = engine.unpack(handle)
    assert torch.equal(again, data.view(torch.float32))  # copied back from the host buffer
    assert h2d.waited == [("stream", "compute"), "L0.copy0"]  # after the compute stream's work and the D2H copy
    assert isinstance(c.reloaded, _FakeEvent) and compute.waited[-1] is c.reloaded and c.waited
    assert c.gpu is None  # let go again: this use is past the count too
    assert "unpacked more often than it was saved" in caplog.text


# ------------------------------------------------------------------------------------------------
# Copies in pieces (TEO_OFFLOAD_COPY_CHUNK_MIB)


def test_copy_pieces_cover_each_byte_once():
    assert engines_teo.copy_pieces(10, 0) == [(0, 10)]
    assert engines_teo.copy_pieces(10, 10) == [(0, 10)] and engines_teo.copy_pieces(10, 64) == [(0, 10)]
    assert engines_teo.copy_pieces(10, 4) == [(0, 4), (4, 8), (8, 10)]


@pytest.mark.parametrize("raw, expected", [(None, 0), ("", 0), ("0", 0), ("16", 16 << 20)])
def test_copy_chunk_comes_from_the_environment(monkeypatch, raw, expected):
    if raw is None:
        monkeypatch.delenv(engines_teo.COPY_CHUNK_ENV, raising=False)
    else:
        monkeypatch.setenv(engines_teo.COPY_CHUNK_ENV, raw)
    assert engines_teo.copy_chunk_bytes() == expected
    assert TeoEngine(1, 2).copy_chunk == expected


@pytest.mark.parametrize("raw", ["-1", "16MiB", "1.5"])
def test_a_bad_copy_chunk_is_refused_with_its_value(monkeypatch, raw):
    monkeypatch.setenv(engines_teo.COPY_CHUNK_ENV, raw)
    with pytest.raises(ValueError, match=f"TEO_OFFLOAD_COPY_CHUNK_MIB must be a whole number of MiB >= 0.*got '{raw}'"):
        TeoEngine(1, 2)


def test_a_copy_to_the_host_goes_in_pieces(monkeypatch):
    """The saved range's bytes reach the host buffer through copies of at most the chunk, in order,
    all on the copy stream before its one event."""
    d2h = _NamedStream("d2h")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _NamedStream("compute"))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    pool, _ = _fake_pool()
    engine = TeoEngine(1, 2, pool=pool)
    engine.copy_chunk = 1000
    monkeypatch.setattr(engine, "_streams", lambda device=None: (d2h, None))
    t = torch.arange(3000, dtype=torch.uint8)  # 3000 bytes from byte 512: 2488 of them, in 3 pieces
    sizes, real_copy = [], torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, non_blocking=False: (
        sizes.append(src.numel()), real_copy(self, src, non_blocking=non_blocking))[1])
    copy = engine._copy_to_host(t, t.untyped_storage(), Move(600, 2400))
    assert sizes == [1000, 1000, 488] and copy.start == 512 and copy.nbytes == 2488
    assert torch.equal(copy.host.tensor[:2488], t[512:])


def test_a_layer_reloaded_again_skips_the_ranges_it_used_up(monkeypatch):
    compute, h2d = _fake_copy_streams(monkeypatch)
    engine = TeoEngine(1, 2)
    engine._device = torch.device("cpu")
    monkeypatch.setattr(engine, "_streams", lambda device=None: (None, h2d))
    copies = _fake_layer_copies(0)
    for c in copies.copies:
        c.source, c.host, c.handles = None, engines_teo.HostBuffer(torch.zeros(8, dtype=torch.uint8), 0), 1
    used, unused = copies.copies
    used.unpacks = 1  # its one handle was unpacked in the layer's first reload
    engine._layers[0] = copies
    engine._reload(0)
    assert used.gpu is None and unused.gpu is not None


def test_a_layer_that_raises_ends_the_step_and_the_next_starts_at_layer_0():
    """An op's error inside the context (bad split sizes raise at the op's next call) must not leave
    the engine counting later steps from the failed layer."""
    ctx, sync, _ = offload_context("teo", num_layers=0, model_layers=3)
    x = torch.randn(4, requires_grad=True)

    def step(fail_at=None):
        seen, h = [], x * 1.0
        for i in range(3):
            with ctx:
                seen.append(ctx._layer)
                if i == fail_at:
                    raise ValueError("bad split sizes")
                h = h * 2
            h = sync(h)
        return seen

    assert step() == [0, 1, 2]
    with pytest.raises(ValueError, match="bad split sizes"):
        step(fail_at=1)
    assert not ctx._inside and cpu_offload.OFFLOAD_SYNCHRONIZER is None
    assert step() == [0, 1, 2]


@pytest.mark.parametrize("num_layers", [0, 2])
def test_a_forward_cut_between_layers_lets_the_next_step_start_at_layer_0(num_layers):
    """An error outside the context (a router's, a dispatcher's), caught by the training loop: the
    graph of the cut forward is freed, and the next step must count its layers from 0 (not go on
    from the cut, which would end a step, and free its host buffers, in the middle of a forward).
    (CPU tensors stay where they are: this is the engine's count, with its real autograd hooks.)"""
    ctx, sync, _ = offload_context("teo", num_layers=num_layers, model_layers=4)
    x = torch.randn(512, 512, requires_grad=True)

    def step(fail_after=None):
        seen, h = [], x * 1.0
        for i in range(4):
            with ctx:
                seen.append(ctx._layer)
                h = (h * 2).sin()
            h = sync(h)
            if i == fail_after:
                raise RuntimeError("the router's error")
        h.sum().backward()
        return seen

    assert step() == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="the router's error"):
        step(fail_after=1)
    assert step() == [0, 1, 2, 3]  # not [2, 3, 0, 1]: the cut forward ended its step, so the next entry is layer 0
    assert step() == [0, 1, 2, 3]


def test_a_layer_without_sync_is_not_taken_for_a_cut():
    """Only the graph of the layer just before an entry counts: with layer 0's sync left out, the
    last step's graph (gone with its backward) must not end the step at layer 1."""
    ctx, sync, _ = offload_context("teo", num_layers=0, model_layers=3)
    x = torch.randn(4, requires_grad=True)
    for _ in range(3):
        h, seen = x * 1.0, []
        for i in range(3):
            with ctx:
                seen.append(ctx._layer)
                h = h * 2
            if i:
                h = sync(h)
        h.sum().backward()
        assert seen == [0, 1, 2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case: no CUDA to read memory from")
def test_release_by_memory_runs_where_cuda_is_absent():
    ctx, sync, _ = offload_context("teo", num_layers=1, model_layers=2, release="memory")
    x = torch.randn(4, requires_grad=True)
    for _ in range(3):  # the third step has figures of the second
        h = x * 1.0
        for _ in range(2):
            with ctx:
                h = h * 2
            h = sync(h)
        h.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 12.0))


def test_a_forward_whose_graph_is_still_referenced_is_not_taken_for_cut(monkeypatch):
    """The check looks at the graph, not at time: a forward that goes on keeps its layers' graphs
    referenced by what follows, so counting goes on."""
    ctx, sync, _ = offload_context("teo", num_layers=0, model_layers=3)
    x = torch.randn(4, requires_grad=True)
    h, seen = x * 1.0, []
    for _ in range(3):
        with ctx:
            seen.append(ctx._layer)
            h = h * 2
        h = sync(h)
        h = h + 1  # what follows the layer holds its graph
    assert seen == [0, 1, 2]
    h.sum().backward()
    del h  # the graph goes after its backward: the next entry is layer 0 by the count anyway
    with ctx:
        assert ctx._layer == 0
        h = x * 2
    h = sync(h)
    keep = h * 1  # a partial forward whose graph the caller still holds is not cut: layer 1 next
    with ctx:
        assert ctx._layer == 1
    del keep


# ---------------------------------------------------------------------------------------------
# release="memory": sources held past the layer schedule while the forward stays under its end


def test_sources_to_release_keeps_the_oldest_last_only_while_memory_allows():
    due = [(0, 100), (1, 100), (2, 100)]
    assert engines_teo.sources_to_release(due, None, 1000, 10) == [0, 1, 2]  # no figures yet: all
    assert engines_teo.sources_to_release(due, 500, 1000, 10) == []  # 500 + 300 <= 990: all held
    assert engines_teo.sources_to_release(due, 750, 1000, 10) == [0]  # 750 + 300 > 990; 750 + 200 fits
    assert engines_teo.sources_to_release(due, 850, 1000, 10) == [0, 1]
    assert engines_teo.sources_to_release(due, 1000, 1000, 10) == [0, 1, 2]  # the forward's end: none held
    assert engines_teo.sources_to_release([], 1000, 1000, 10) == []


def _finish_step(engine):
    """The step's end as the backward's would be, without its reloads (fake copies have no host side)."""
    engine._layers.clear()
    engine._end_step()


class _MemoryStep:
    """Fake forwards for release="memory": each layer adds ``kept`` bytes that stay and ``moved``
    bytes that an offloaded layer (k < n) holds as a source until released. Records, per layer,
    the layers still held after its entry and the memory at the end of its stretch."""

    def __init__(self, monkeypatch, L, n, kept, moved):
        stream = _FakeStream()
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
        self.engine = TeoEngine(n, L, release="memory")
        self.engine._memory = self.allocated
        self.L, self.n, self.kept, self.moved = L, n, kept, moved
        self.now = 0

    def allocated(self):
        given_back = sum(c.nbytes for lc in self.engine._layers.values() for c in lc.copies if c.source is None)
        return self.now - given_back

    def forward(self, backward=True):
        engine, held, stretch_ends = self.engine, [], []
        self.now = 0
        for k in range(self.L):
            if k:
                stretch_ends.append(self.allocated())
            engine.enter_layer()
            held.append([j for j, lc in sorted(engine._layers.items()) if not lc.released])
            self.now += self.kept + self.moved
            if k < self.n:
                engine._layers[k] = _fake_layer_copies(k, count=1)
                engine._layers[k].copies[0].nbytes = self.moved
            engine.layer_done(k)
        stretch_ends.append(self.allocated())
        assert all(engine._layers[k].released for k in range(self.n))  # by the forward's end
        end = self.allocated()
        if backward:
            engine._note_forward_end()
            _finish_step(engine)
        return held, stretch_ends, end


@pytest.mark.parametrize("kept, layer_ends, held_then, ends_then", [
    (300, [400, 700, 1000, 1300], [[], [0], [0, 1], []], [400, 800, 1200, 1300]),
    # less room: at layer 2's entry holding both would leave no spare (1050 > 1100 - 100)
    (250, [350, 600, 850, 1100], [[], [0], [1], []], [350, 700, 950, 1100]),
])
def test_memory_release_holds_sources_where_later_layers_have_not_grown_yet(monkeypatch, kept, layer_ends,
                                                                           held_then, ends_then):
    """Layers that keep activations on the GPU (attention, say) leave room early in the forward:
    the first offloaded layers' sources stay held there, the memory never passes the forward's end
    (nor its end less one layer's bytes before the last stretch), and all go back by the end."""
    run = _MemoryStep(monkeypatch, L=4, n=3, kept=kept, moved=100)
    for step in range(2):  # no figures, then the first step's (ignored): the layer schedule
        held, ends, end = run.forward()
        assert held == [[], [], [], []] and ends == layer_ends and end == layer_ends[-1]
    assert run.engine.layers_held == 0
    for step in range(2):  # the figures of a step like this one
        held, ends, end = run.forward()
        assert held == held_then, step
        assert ends == ends_then and end == layer_ends[-1]
        assert max(ends[:-1]) <= end - run.moved  # one layer's bytes to spare before the last stretch
    # the public count of holds: each layer still held after an entry was due there (both steps)
    assert run.engine.layers_held == 2 * sum(len(h) for h in held_then)


def test_memory_release_holds_nothing_where_the_layer_schedule_is_already_at_the_end(monkeypatch):
    run = _MemoryStep(monkeypatch, L=8, n=7, kept=0, moved=100)
    for _ in range(4):
        held, ends, end = run.forward()
        assert held == [[]] * 8 and max(ends) <= end
    assert run.engine.layers_held == 0


def test_memory_release_figures_come_only_from_steps_that_reached_their_backward(monkeypatch):
    run = _MemoryStep(monkeypatch, L=4, n=3, kept=300, moved=100)
    run.forward()
    run.forward()
    figures = run.engine._last_figures
    assert figures is not None and figures[1] == 1300 and figures[2] == 100
    run.forward(backward=False)  # a forward whose backward never ran (a logged loss) leaves them
    run.engine._layers.clear()  # (fake copies have no host buffers to give back)
    run.engine.abandon_step()
    assert run.engine._last_figures == figures
    held, _, _ = run.forward()
    assert held == [[], [0], [0, 1], []]


def test_release_is_an_option_of_teo_only():
    with pytest.raises(ValueError, match="release must be one of"):
        TeoEngine(1, 2, release="lazy")
    with pytest.raises(ValueError, match="release is an option of the teo engine"):
        offload_context("v2", num_layers=1, model_layers=2, release="memory")


def test_max_held_bytes_is_an_option_of_teo_only():
    with pytest.raises(ValueError, match="max_held_bytes is an option of the teo engine, not of 'v2'"):
        offload_context("v2", num_layers=1, model_layers=2, max_held_bytes=1 << 30)
    assert offload_context("teo", num_layers=1, model_layers=2, max_held_bytes=1 << 30)[0].engine.max_held_bytes == 1 << 30
    assert offload_context("teo", num_layers=1, model_layers=2)[0].engine.max_held_bytes == 0


# ------------------------------------------------------------------------------------------------
# Copies that have ended give their bytes back at once; released layers may keep some held


class _QueriedEvent:
    """A copy's event the host can query: ``done`` says whether the copy ended."""

    def __init__(self, name, done=False):
        self.name, self.done = name, done

    def query(self):
        return self.done

    def __repr__(self):
        return self.name


def _queued_copies(engine, layer, done):
    """Layer ``layer``'s copies as _offload leaves them: in its layer and in the engine's copy queue."""
    copies = _fake_layer_copies(layer, count=len(done))
    for i, (c, d) in enumerate(zip(copies.copies, done)):
        c.copied = _QueriedEvent(f"L{layer}.copy{i}", d)
        c.layer = layer
    engine._layers[layer] = copies
    engine._in_flight.extend(copies.copies)
    return copies.copies


def test_copies_seen_ended_give_their_bytes_back_without_a_wait(monkeypatch):
    """At a save or a layer entry the engine queries the oldest copies in order and lets go of the
    ended ones: no stream waits, and a copy not ended stops the scan (the copy stream runs in order)."""
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    engine = TeoEngine(2, 4)
    engine.enter_layer()
    first = _queued_copies(engine, 0, done=[True, True, False])
    assert engine.pack("not a tensor") == "not a tensor"  # any save scans
    assert [c.source is None for c in first] == [True, True, False] and stream.waited == []
    first[2].copied.done = True
    later = _queued_copies(engine, 0, done=[False])
    later[0].copied.done = True  # ended too, but behind one the host has not seen: its turn comes next scan
    engine.enter_layer()
    assert all(c.source is None for c in first + later) and stream.waited == [] and not engine._in_flight


def test_released_layers_hold_up_to_max_held_bytes_waiting_for_the_oldest_copies(monkeypatch):
    """n=2 of L=4 (layer i released at layer i+2's entry), 8-byte copies, max_held_bytes=8: at each
    release the compute stream waits only for the oldest copies past the 8 held bytes."""
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    engine = TeoEngine(2, 4, max_held_bytes=8)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False, False])
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[False, False])
    engine.enter_layer()  # layer 0 released: 16 bytes uncopied, 8 may stay
    assert stream.waited == [l0[0].copied] and [c.source is None for c in l0] == [True, False]
    engine.enter_layer()  # layer 1 released: 8 + 16 uncopied -> the oldest 16 go, after their copies
    assert stream.waited == [l0[0].copied, l1[0].copied]
    assert [c.source is None for c in l0 + l1] == [True, True, True, False]
    assert engine.bytes_held_past_release == 8 + 8
    l1[1].copied.done = True
    engine.layer_done(3)
    assert engine.pack("x") == "x" and l1[1].source is None and len(stream.waited) == 2


def test_held_bytes_never_exceed_the_limit_over_a_forward(monkeypatch):
    """Whatever ends when, the bytes of released layers still held stay within max_held_bytes after
    every release, and nothing of a layer not yet released is waited for."""
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    L, n, limit = 6, 4, 20
    engine = TeoEngine(n, L, max_held_bytes=limit)
    made = []
    for j in range(L):
        engine.enter_layer()
        released = [c for i, lc in engine._layers.items() if lc.released for c in lc.copies]
        assert sum(c.nbytes for c in released if c.source is not None) <= limit
        assert all(str(e).split(".")[0] in {f"L{i}" for i, lc in engine._layers.items() if lc.released}
                   for e in stream.waited)
        if j < n:
            made += _queued_copies(engine, j, done=[False] * 3)
        for c in made[: len(made) // 3]:  # the copy stream is a third of the way behind
            c.copied.done = True
        engine.layer_done(j)
    assert len(stream.waited) > 0 and any(c.source is not None for c in made)  # some waited, some held


def test_with_every_layer_offloaded_the_last_layers_held_bytes_serve_its_backward_in_place(monkeypatch):
    """n = L = 2, max_held_bytes = one layer's 16 bytes: at the forward's end the older layer's
    copies are waited for and the last layer's stay held; its backward uses them with no copy back."""
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    engine = TeoEngine(2, 2, max_held_bytes=16)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False, False])
    engine.layer_done(0)
    engine.enter_layer()  # layer 0 released: all 16 bytes may stay
    assert stream.waited == []
    l1 = _queued_copies(engine, 1, done=[False, False])
    engine.layer_done(1)  # layer 1 released at its own end: 32 held -> layer 0's go after their copies
    assert stream.waited == [l0[1].copied] and all(c.source is None for c in l0)
    sources = [c.source for c in l1]
    engine._reload(1)
    assert all(c.gpu is s for c, s in zip(l1, sources)) and len(stream.waited) == 1


# ------------------------------------------------------------------------------------------------
# memory_budget: held until copied, the oldest waited for only where memory would pass the budget


def _budget_engine(monkeypatch, n, L, budget, base=0):
    """A budget engine whose memory is ``base`` plus ``extra[0]`` plus the GPU bytes its held
    sources (and in-place reloads) keep: what torch.cuda.memory_allocated would read."""
    stream = _FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(engines_teo, "_BUDGET_ENGINES", weakref.WeakSet())  # make_room elsewhere never sees these
    engine = TeoEngine(n, L, memory_budget=budget)
    extra = [0]

    def memory():
        live = {id(t): t.numel() for lc in engine._layers.values() for c in lc.copies
                for t in (c.source, c.gpu) if t is not None}
        return base + extra[0] + sum(live.values())

    engine._memory = memory
    engine._room = lambda sizes, device: []  # every announced allocation fits (tests of the fit set their own)
    engine._most_room = lambda device: 1 << 60  # giving held bytes back can always help (one test sets less)
    return engine, stream, extra


def test_budget_is_an_option_of_teo_only():
    with pytest.raises(ValueError, match="memory_budget is an option of the teo engine, not of 'v2'"):
        offload_context("v2", num_layers=1, model_layers=2, memory_budget=1 << 30)
    assert offload_context("teo", num_layers=1, model_layers=2, memory_budget=1 << 30)[0].engine.memory_budget == 1 << 30
    assert offload_context("teo", num_layers=1, model_layers=2)[0].engine.memory_budget is None


def test_under_the_budget_no_layer_is_waited_for_at_its_release(monkeypatch):
    """n=2 of L=4: the layer schedule waits for layer 0 at layer 2's entry and layer 1 at layer 3's;
    with room in the budget nothing is waited for, and bytes go back only as their copies end."""
    engine, stream, _ = _budget_engine(monkeypatch, 2, 4, budget=1000)
    made = []
    for j in range(4):
        engine.enter_layer()
        if j < 2:
            made += _queued_copies(engine, j, done=[False, False])
        engine.layer_done(j)
    assert stream.waited == [] and all(c.source is not None for c in made)
    made[0].copied.done = made[1].copied.done = True
    engine.pack("x")  # a save looks again: layer 0's ended copies give their bytes back, no wait
    assert [c.source is None for c in made] == [True, True, False, False] and stream.waited == []
    assert engine.budget_waits == 0


def test_over_the_budget_the_oldest_copies_are_waited_for_until_it_fits(monkeypatch):
    """Four 8-byte copies held (32 bytes) over a base of 10, budget 40: an op announcing 6 bytes
    needs 8 back (10 + 32 + 6 - 40): the compute stream waits for the oldest copy only."""
    engine, stream, extra = _budget_engine(monkeypatch, 2, 4, budget=40, base=10)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False, False])
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[False, False])
    engine.fit_budget(6)
    assert stream.waited == [l0[0].copied] and [c.source is None for c in l0 + l1] == [True, False, False, False]
    assert (engine.budget_waits, engine.budget_wait_bytes) == (1, 8)
    extra[0] = 12  # ops allocated more since: at the next layer entry 10 + 12 + 24 > 40 by 6
    engine.enter_layer()
    assert stream.waited == [l0[0].copied, l0[1].copied] and engine.budget_waits == 2


def test_a_dropped_source_that_frees_nothing_does_not_count_toward_the_room(monkeypatch):
    """A saved tensor still used elsewhere (the layer's output) frees nothing when the engine lets
    go of it: the engine reads the memory again and goes on to the next copy."""
    engine, stream, _ = _budget_engine(monkeypatch, 1, 2, budget=20)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False, False, False])
    still_used = l0[0].source  # a reference outside the engine keeps its bytes allocated
    memory = engine._memory
    engine._memory = lambda: memory() + (8 if l0[0].source is None else 0)
    engine.fit_budget(4)  # 24 + 4 - 20 = 8 over: the first frees nothing, the second frees 8
    assert stream.waited == [l0[0].copied, l0[1].copied] and l0[2].source is not None
    del still_used


def test_with_every_layer_offloaded_the_last_layer_stays_for_its_backward_in_place(monkeypatch):
    """n = L = 2 with room: no release at the last layer's sync; its backward uses its bytes in
    place, and a budget look in backward does not wait for a copy whose bytes serve in place."""
    engine, stream, extra = _budget_engine(monkeypatch, 2, 2, budget=100)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False])
    engine.layer_done(0)
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[False, False])
    engine.layer_done(1)
    assert stream.waited == [] and all(c.source is not None for c in l0 + l1)
    sources = [c.source for c in l1]
    engine._reload(1)
    assert all(c.gpu is s for c, s in zip(l1, sources)) and stream.waited == []
    extra[0] = 90  # the backward allocates: 90 + 24 > 100; layer 1's serve in place, layer 0's copy is waited for
    engine.fit_budget()
    assert stream.waited == [l0[0].copied] and all(c.source is not None for c in l1)


def test_a_reload_makes_room_for_its_bytes_first_without_dropping_its_own(monkeypatch):
    """Layer 1's reload brings back 8 bytes (one copy ended and was let go; the other, still held,
    serves in place): the budget asks room for those 8, taken from layer 0's held bytes, never
    from layer 1's own."""
    engine, stream, _ = _budget_engine(monkeypatch, 2, 3, budget=28)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False])
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[False, False])
    l1[0].source = None  # as if its copy had ended (and its bytes gone back): 16 bytes held
    engine.enter_layer()
    assert stream.waited == []
    h2d = _FakeStream()
    h2d.wait_stream = lambda other: None
    monkeypatch.setattr(engine, "_streams", lambda device=None: (None, h2d))
    reloaded = []
    monkeypatch.setattr(engine, "_reload_copy", lambda c, stream: reloaded.append(c))
    engine._reload(1)  # 16 held + 8 coming back = 24 <= 28: nothing waited for
    assert stream.waited == [] and reloaded == [l1[0]] and l1[1].gpu is l1[1].source
    engine._layers[1].reloaded, l1[1].gpu = False, None
    engine.memory_budget = 20  # now 16 + 8 > 20: layer 0's copy is waited for, layer 1's held one stays
    engine._reload(1)
    assert stream.waited == [l0[0].copied] and l1[1].source is not None and l0[0].source is None


def test_make_room_reaches_budget_engines_on_the_device_only(monkeypatch):
    engine, stream, _ = _budget_engine(monkeypatch, 1, 2, budget=16)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False, False])
    plain = TeoEngine(1, 2)  # no budget: never asked
    plain.fit_budget = lambda *a, **k: pytest.fail("an engine without a budget was asked for room")
    engine._device = torch.device("cuda", 1)
    engine_make_room = engines_teo.make_room
    engine_make_room(8, torch.device("cuda", 0))  # another GPU: nothing
    assert stream.waited == []
    engine_make_room(8, torch.device("cuda", 1))  # 16 + 8 > 16: the oldest copy waited for
    assert stream.waited == [l0[0].copied]
    from te_offload_ops import engines

    engines.make_room(12)  # through the engines module, any device: 8 + 12 > 16
    assert stream.waited == [l0[0].copied, l0[1].copied]


@pytest.mark.parametrize("nbytes", [-1, 1.5, True, "8", [], [8, -1], [8, True], (8, 2.0)])
def test_make_room_refuses_what_is_not_a_byte_count(nbytes):
    from te_offload_ops import engines

    with pytest.raises(ValueError, match=re.escape(f"an int >= 0 or a list of them (one per allocation); got {nbytes!r}")):
        engines.make_room(nbytes)


def test_allocations_that_fit_no_free_block_make_held_copies_go_back_though_under_the_budget(monkeypatch):
    """Memory far under the budget, but the allocator (as the fake room tells) could place the
    announced allocations only once 16 bytes of held copies are free: the oldest two saved on this
    stream are waited for (one saved on a side stream would free into that stream's pool), then no
    more; a total announced as one int asks nothing of the room."""
    engine, stream, _ = _budget_engine(monkeypatch, 2, 4, budget=1000)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False, False])
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[False, False])
    asked = []

    def room(sizes, device):
        asked.append(list(sizes))
        freed = sum(c.nbytes for c in l0 + l1 if c.source is None)
        return [] if freed >= 16 else [max(sizes)]

    engine._room = room
    engine._device = torch.device("cuda", 0)
    engine.budget_trace = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: _FakeEvent())
    monkeypatch.setattr(engines_teo, "_BUDGET_ENGINES", weakref.WeakSet([engine]))
    engines_teo.make_room(24)  # one int: a total, not an allocation; 48 is far under 1000
    assert asked == [] and stream.waited == []
    l0[1].source_stream = _FakeStream()  # saved on a side stream: its bytes would not serve this stream
    engines_teo.make_room([16, 8], torch.device("cuda", 0))
    assert asked == [[16, 8]] * 3 and stream.waited == [l0[0].copied, l1[0].copied]
    assert [c.source is None for c in l0 + l1] == [True, False, True, False]
    assert [w["why"] for w in engine.budget_trace[0]["waits"]] == ["fit", "fit"]
    assert (engine.budget_waits, engine.budget_wait_bytes) == (2, 16)


def _layer_of_three_copies_to_reload(monkeypatch):
    """A budget engine (40 bytes) with layer 1's three 8-byte copies ended and given back, and
    reloads that take their bytes at once: (engine, extra memory, layer 1's copies, reloads started)."""
    engine, stream, extra = _budget_engine(monkeypatch, 2, 3, budget=40)
    engine.enter_layer()
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[True, True, True])
    engine.enter_layer()  # the ended copies give their bytes back: nothing held
    h2d = _FakeStream()
    h2d.wait_stream = lambda other: None
    monkeypatch.setattr(engine, "_streams", lambda device=None: (None, h2d))
    reloaded = []

    def reload_copy(c, stream):
        reloaded.append(c)
        c.gpu, c.reloaded, c.reload_stream, c.waited = torch.zeros(c.nbytes, dtype=torch.uint8), _FakeEvent(), h2d, True

    monkeypatch.setattr(engine, "_reload_copy", reload_copy)
    return engine, extra, l1, reloaded


def test_a_put_off_prefetch_starts_the_copies_that_fit_the_last_saved_first(monkeypatch):
    """Layer 1's three 8-byte copies into a budget of 40 with 21 in use: 19 bytes of room take two,
    the last saved first (the backward uses them first), and only as many as the allocator has free
    blocks for (one, then the other at the next look); the layer stays put off. At a region's end
    with room the third starts, and the layer counts as reloaded; a use then copies nothing again.
    Released after its backward, the early copies go back with the rest."""
    engine, extra, l1, reloaded = _layer_of_three_copies_to_reload(monkeypatch)
    extra[0] = 21
    engine._device = torch.device("cuda", 0)
    engine._room = lambda sizes, device: sizes[1:]  # the allocator has a block for one of them only
    assert engine._reload(1, prefetch=True) is False
    assert reloaded == [l1[2]] and engine._deferred_reloads == [1] and not engine._layers[1].reloaded
    engine._room = lambda sizes, device: []
    assert engine._reload(1, prefetch=True) is False  # 19 - 8 = 11 bytes of room left: one more
    assert reloaded == [l1[2], l1[1]] and engine._deferred_reloads == [1] and not engine._layers[1].reloaded
    assert (engine.reloads_deferred, engine.reloads_started_early) == (1, 2)
    extra[0] = 5  # the backward freed room (the early copies count in the memory too: 5 + 16 + 8 <= 40)
    engine.region_backward_done(2)
    assert reloaded == [l1[2], l1[1], l1[0]] and engine._deferred_reloads == [] and engine._layers[1].reloaded
    assert engine._reload(1) is True and len(reloaded) == 3
    engine._release_reload(1)
    assert all(c.gpu is None for c in l1) and not engine._layers[1].reloaded


def test_a_layer_started_in_part_whose_backward_ended_unused_is_not_reloaded_again(monkeypatch):
    """A put-off prefetch started two of layer 1's copies; its region's backward ends without a use:
    the early copies go back and the layer leaves the put-off list, so no later look reloads it."""
    engine, extra, l1, reloaded = _layer_of_three_copies_to_reload(monkeypatch)
    extra[0] = 21
    assert engine._reload(1, prefetch=True) is False and reloaded == [l1[2], l1[1]]
    extra[0] = 0
    engine.region_backward_done(1)
    assert engine._deferred_reloads == [] and all(c.gpu is None for c in l1) and reloaded == [l1[2], l1[1]]


def test_held_copies_stay_where_giving_them_all_back_could_not_fit_the_allocation(monkeypatch):
    """An announced allocation of 100 bytes fits nowhere; the allocator could give one allocation at
    most 50 bytes now (free blocks and room to map), and the four held copies free 32: no copy is
    waited for (it would cost the wait and leave the allocation as short), and the look is counted.
    With 70 bytes of room they could help: the oldest go back one by one until it fits."""
    engine, stream, _ = _budget_engine(monkeypatch, 2, 4, budget=1000)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False, False])
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[False, False])
    engine._device = torch.device("cuda", 0)
    engine._room = lambda sizes, device: [] if sum(c.nbytes for c in l0 + l1 if c.source is None) >= 24 else [100]
    engine._most_room = lambda device: 50
    monkeypatch.setattr(engines_teo, "_BUDGET_ENGINES", weakref.WeakSet([engine]))
    engines_teo.make_room([100], torch.device("cuda", 0))
    assert stream.waited == [] and all(c.source is not None for c in l0 + l1)
    assert (engine.fits_given_up, engine.budget_waits) == (1, 0)
    engine._most_room = lambda device: 70
    engines_teo.make_room([100], torch.device("cuda", 0))
    assert [c.source is None for c in l0 + l1] == [True, True, True, False]
    assert (engine.fits_given_up, engine.budget_waits) == (1, 3)


def test_over_the_budget_copies_go_back_even_where_no_fit_could_be_helped(monkeypatch):
    """The budget's own drops do not depend on the fit: 10 + 32 + 10 bytes against a budget of 44 is
    8 over, so the oldest copy goes back though the allocator could give at most 20 bytes at once and
    the announced 100 fits nowhere; then the fit gives up (copies saved on a side stream, not counted
    toward what giving back could free, are left alone too)."""
    engine, stream, _ = _budget_engine(monkeypatch, 2, 4, budget=44, base=10)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False, False])
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[False, False])
    l1[1].source_stream = _FakeStream()
    engine._device = torch.device("cuda", 0)
    engine._room = lambda sizes, device: [100]
    most = []
    engine._most_room = lambda device: most.append(device) or 20
    engine.fit_budget(10, sizes=[10, 100])
    assert stream.waited == [l0[0].copied] and [c.source is None for c in l0 + l1] == [True, False, False, False]
    assert (engine.budget_waits, engine.fits_given_up, len(most)) == (1, 1, 1)


def test_a_reload_asks_room_for_each_copy_it_brings_back(monkeypatch):
    """Reloads allocate one block per copy: the budget's fit is asked with each copy's size."""
    engine, stream, _ = _budget_engine(monkeypatch, 2, 3, budget=1000)
    engine.enter_layer()
    _queued_copies(engine, 0, done=[True])
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[True, True])
    engine.enter_layer()  # the ended copies give their bytes back
    assert all(c.source is None for c in l1)
    asked = []
    engine._room = lambda sizes, device: asked.append(list(sizes)) or []
    engine._device = torch.device("cuda", 0)
    h2d = _FakeStream()
    h2d.wait_stream = lambda other: None
    monkeypatch.setattr(engine, "_streams", lambda device=None: (None, h2d))
    monkeypatch.setattr(engine, "_reload_copy", lambda c, stream: None)
    engine._reload(1)
    assert asked == [[c.nbytes for c in l1]] and stream.waited == []


def test_the_budget_keeps_room_for_what_ops_allocated_after_a_look_in_the_last_step(monkeypatch):
    """Budget 34, 16 bytes held over a base of 10. Step 1: a save looks at 26 (under the budget);
    then ops allocate 12 bytes the engine cannot see coming (saved-tensor hooks see outputs once
    made): 38, over the budget until the next look waits for a copy. Step 2 learned those 12 bytes
    for that look: it waits there, before the ops allocate, and the memory stays within the budget.
    What a look announces is not counted again (a reload's own bytes)."""
    engine, stream, extra = _budget_engine(monkeypatch, 1, 2, budget=34, base=10)
    monkeypatch.setattr(engine.pool, "release", lambda buf, ready: None)  # the fake copies have no host buffers
    peaks = []
    for step in range(2):
        extra[0] = 0
        engine.enter_layer()
        _queued_copies(engine, 0, done=[False, False])
        waited = len(stream.waited)
        engine.pack("x")  # a save looks: 26 bytes in use
        waited_at_save = len(stream.waited) - waited
        extra[0] = 12  # the next op's outputs
        peaks.append(engine._memory())
        engine.enter_layer()  # layer 1 looks: over the budget (step 1) or not (step 2)
        engine.fit_budget(5, where="make_room")  # an announced allocation, then made
        extra[0] += 5
        engine.pack("y")
        engine.finish_backward()  # its backward ran through: a step whose bursts teach the next
        assert (step, waited_at_save) in ((0, 0), (1, 1))
    assert peaks == [38, 30]  # step 2 waited for one 8-byte copy before the ops allocated
    assert engine._last_bursts[0][("save", 0, None, 0)] == 12
    assert engine._last_bursts[0][("make_room", 1, None, 0)] == 0  # announced bytes are not a burst


def test_the_learned_room_counts_what_ops_allocated_before_ended_copies_gave_bytes_back(monkeypatch):
    """Ops allocate 12 bytes after a save; a copy (8 bytes) ends before the next look, which gives
    its bytes back: the growth up to that look was 12, not 4. A step whose backward did not run
    through (abandoned) teaches nothing; the room is the larger of the last two steps'."""
    engine, stream, extra = _budget_engine(monkeypatch, 1, 2, budget=100, base=10)
    monkeypatch.setattr(engine.pool, "release", lambda buf, ready: None)

    def step(growth, finish=True):
        extra[0] = 0
        engine.enter_layer()
        copies = _queued_copies(engine, 0, done=[False, False])
        engine.pack("x")
        extra[0] = growth
        copies[0].copied.done = True  # ended before the next look
        engine.enter_layer()
        if finish:
            engine.finish_backward()
        else:
            engine.abandon_step()

    key = ("save", 0, None, 0)
    step(12)
    assert engine._last_bursts[0][key] == 12
    step(30, finish=False)
    assert len(engine._last_bursts) == 1 and engine._last_bursts[0][key] == 12
    step(5)
    extra[0] = 0
    engine.enter_layer()
    _queued_copies(engine, 0, done=[False])
    engine.pack("x")
    assert engine.budget_margin == 12  # the larger of the last two whole steps' 5 and 12


def test_budget_engines_read_the_allocators_nested_statistics(monkeypatch):
    """The memory read at every look: the nested statistics' current allocated bytes (0 where the
    allocator has none yet), not torch.cuda.memory_allocated's flattened copy of them all."""
    engine = TeoEngine(1, 2, memory_budget=1 << 30)
    engine._device = torch.device("cuda", 0)
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict",
                        lambda device=None: asked.append(device) or {"allocated_bytes": {"all": {"current": 1234}}})
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: pytest.fail("the flattened read"))
    assert engine._memory_allocated() == 1234 and asked == [engine._device]
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {})
    assert engine._memory_allocated() == 0


def test_a_prefetch_past_the_budget_waits_for_room_and_a_use_never_waits(monkeypatch):
    """Layer 1's 16 bytes come back into a budget of 40 with 30 in use: its prefetch is put off
    (nothing held to give back); once the backward frees room, the next region's end starts it (a
    use, where an op is about to allocate, does not). A reload for a use starts whatever the
    budget says."""
    engine, stream, extra = _budget_engine(monkeypatch, 2, 3, budget=40)
    engine.enter_layer()
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[True, True])
    engine.enter_layer()  # the ended copies give their bytes back: nothing held
    h2d = _FakeStream()
    h2d.wait_stream = lambda other: None
    monkeypatch.setattr(engine, "_streams", lambda device=None: (None, h2d))
    reloaded = []
    monkeypatch.setattr(engine, "_reload_copy", lambda c, stream: reloaded.append(c))
    extra[0] = 33  # 7 bytes of room: not one 8-byte copy fits
    assert engine._reload(1, prefetch=True) is False
    assert reloaded == [] and engine.reloads_deferred == 1 and engine._deferred_reloads == [1]
    engine.region_backward_done(2)  # a region's end with no more room: still put off, counted once
    assert reloaded == [] and engine.reloads_deferred == 1
    extra[0] = 20  # the backward freed 10: 20 + 16 <= 40
    engine.unpack("kept on the GPU")  # a use (an op is about to allocate): not the moment
    assert reloaded == [] and engine._deferred_reloads == [1]
    engine.region_backward_done(2)
    assert reloaded == l1 and engine._deferred_reloads == [] and engine._layers[1].reloaded
    engine._layers[1].reloaded = False
    reloaded.clear()
    extra[0] = 39
    assert engine._reload(1) is True and reloaded == l1  # for a use: no waiting for room


# ------------------------------------------------------------------------------------------------
# n = L under a budget: the last layer's copies are put off until the budget needs their bytes


class _RecordedEvent(_QueriedEvent):
    def record(self, stream=None):
        pass


def _put_off_engine(monkeypatch, budget):
    """A budget engine, n = L = 2, that packs CPU tensors through the real save path: fake streams
    and events (each copy's event is queried as not ended), a fake pool and a counter."""
    engine, stream, extra = _budget_engine(monkeypatch, 2, 2, budget=budget)
    monkeypatch.setattr(policy, "OFFLOAD_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _RecordedEvent("event"))
    d2h = _NamedStream("d2h")
    monkeypatch.setattr(engine, "_streams", lambda device=None: (d2h, None))
    engine.pool, _ = _fake_pool()
    engine.counter = OffloadCounter()
    return engine, stream, extra, d2h


def test_with_every_layer_offloaded_the_last_layers_copies_wait_for_the_budget(monkeypatch):
    """n = L under a budget with room: the first layer's saves are copied at once; the last layer's
    are held on the GPU with no copy queued, no host buffer taken and nothing counted as offloaded;
    its backward uses them in place and its end lets them go, still without a copy."""
    engine, stream, extra, d2h = _put_off_engine(monkeypatch, budget=1 << 40)
    first, last = torch.arange(BIG, dtype=torch.float32), torch.arange(BIG, dtype=torch.float32) * 2
    engine.enter_layer()
    engine.pack(first)
    engine.layer_done(0)
    engine.enter_layer()
    handle = engine.pack(last)
    engine.layer_done(1)
    (c0,), (c1,) = engine._layers[0].copies, engine._layers[1].copies
    assert c0.copied is not None and c0.host is not None and torch.equal(c0.host.tensor[: c0.nbytes].view(torch.float32), first)
    assert c1.copied is None and c1.host is None and c1.source is not None
    assert engine.counter.total == BIG * 4 and engine.pool.in_use == 1  # the first layer's only
    engine._finish_queued = True  # (as in a backward: the step's end is queued there)
    engine.backward_boundary(1)
    out = engine.unpack(handle)
    assert out.data_ptr() == last.data_ptr() and torch.equal(out, last)  # in place
    waited = list(stream.waited)
    engine.region_backward_done(1)
    assert c1.source is None and c1.gpu is None and c1.copied is None  # gone without a copy
    assert stream.waited == waited and engine.counter.total == BIG * 4 and engine.pool.in_use == 1
    with pytest.raises(RuntimeError, match="layer 1 was unpacked more often than it was saved, after its layer's "
                                           "backward ended; its copy to the host was put off"):
        engine.unpack(handle)


def test_a_put_off_copy_starts_when_the_budget_needs_its_bytes(monkeypatch):
    """Over the budget with only the last layer's bytes held: its copy starts then (counted as
    offloaded), the compute stream waits for it, and the bytes go back; the data reaches the host."""
    engine, stream, extra, d2h = _put_off_engine(monkeypatch, budget=1 << 40)
    engine.enter_layer()
    engine.layer_done(0)
    engine.enter_layer()
    last = torch.arange(BIG, dtype=torch.float32)
    engine.pack(last)
    (c1,) = engine._layers[1].copies
    assert c1.copied is None and engine.counter.total == 0
    engine.memory_budget = BIG * 4  # the held bytes plus what comes next pass it
    engine.fit_budget(1)
    assert c1.copied is not None and c1.source is None and stream.waited == [c1.copied]
    assert engine.counter.total == BIG * 4 and engine.budget_waits == 1
    assert torch.equal(c1.host.tensor[: c1.nbytes].view(torch.float32), last)


def test_a_put_off_copy_not_yet_used_when_its_region_ends_starts_then_and_reloads_later(monkeypatch):
    """A region's end reported before all its uses (multi-threaded autograd, a reentrant
    checkpoint): the range used already goes without a copy; the one not yet used starts its copy
    to the host then (counted then), stays held, no stream waiting, until the copy is seen to end,
    and its later use reloads it with the right bytes."""
    engine, stream, extra, d2h = _put_off_engine(monkeypatch, budget=1 << 40)
    h2d = _NamedStream("h2d")
    h2d.wait_stream = lambda other: None
    monkeypatch.setattr(engine, "_streams", lambda device=None: (d2h, h2d))
    engine.enter_layer()
    engine.layer_done(0)
    engine.enter_layer()
    a, b = torch.arange(BIG, dtype=torch.float32), torch.arange(BIG, dtype=torch.float32) * 3
    ha, hb = engine.pack(a), engine.pack(b)
    engine.layer_done(1)
    engine._finish_queued = True
    engine.backward_boundary(1)
    assert torch.equal(engine.unpack(ha), a)
    engine.region_backward_done(1)  # too early: b is still to be used
    ca, cb = engine._layers[1].copies
    assert ca.copied is None and ca.host is None and ca.source is None  # used: gone without a copy
    assert cb.copied is not None and cb.source is not None and cb.copied not in stream.waited
    assert engine.counter.total == BIG * 4
    cb.copied.done = True
    engine.fit_budget()  # a look sees the copy ended: its bytes go back
    assert cb.source is None and cb.copied not in stream.waited
    b_again = engine.unpack(hb)
    assert b_again.data_ptr() != b.data_ptr() and torch.equal(b_again, b)  # reloaded from the host


def test_a_step_whose_backward_never_ran_lets_put_off_copies_go_without_starting_them(monkeypatch):
    """A forward, then the next step's forward with no backward between (evaluation, a skipped
    step): the last layer's put-off copies never start, and no pinned buffer is given back for them."""
    engine, stream, extra, d2h = _put_off_engine(monkeypatch, budget=1 << 40)
    for _ in range(2):
        engine.enter_layer()
        engine.pack(torch.arange(BIG, dtype=torch.float32))
        engine.layer_done(0)
        engine.enter_layer()
        engine.pack(torch.arange(BIG, dtype=torch.float32))
        engine.layer_done(1)
    assert engine._step == 1 and engine.pool.in_use == 1  # the first step's layer-0 buffer went back
    assert engine.counter.total == 2 * BIG * 4 and all(c.copied is None for c in engine._layers[1].copies)


@pytest.mark.parametrize("n, L, budget", [(1, 2, 1 << 40), (2, 2, None)])
def test_copies_are_put_off_only_for_the_last_layer_of_a_budget_engine_offloading_all(n, L, budget):
    engine = TeoEngine(n, L, memory_budget=budget)
    assert not any(engine._puts_off_copies(j) for j in range(L))
    assert TeoEngine(L, L, memory_budget=1 << 40)._puts_off_copies(L - 1)
    assert not TeoEngine(L, L, memory_budget=1 << 40)._puts_off_copies(L - 2)


def test_a_backward_boundary_look_never_gives_back_the_bytes_of_the_layer_it_begins(monkeypatch):
    """Over the budget as layer 1's backward begins: older layers' copies are waited for, never
    layer 1's own held bytes (its backward would bring them straight back)."""
    engine, stream, extra = _budget_engine(monkeypatch, 2, 2, budget=100)
    engine.enter_layer()
    l0 = _queued_copies(engine, 0, done=[False])
    engine.enter_layer()
    l1 = _queued_copies(engine, 1, done=[False, False])
    engine._finish_queued = True  # (as in a backward: the step's end is queued there)
    monkeypatch.setattr(engine, "_reload", lambda layer, prefetch=False: True)
    extra[0] = 90  # 90 + 24 held > 100, and still over once layer 0's 8 are back
    engine.backward_boundary(1)
    assert stream.waited == [l0[0].copied] and all(c.source is not None for c in l1)
