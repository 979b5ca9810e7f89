"""CPU: teo's context and sync function: layer counting, backward boundaries and region ends heard
through real autograd hooks, misuse and capture refused, steps that raise or are cut short."""

import logging

import pytest
import torch
from transformer_engine.pytorch import cpu_offload

from te_offload_ops import capture
from te_offload_ops.engines import offload_context
from te_offload_ops.engines.teo import TeoEngine
from teo_fakes import current_stream, layer_copies


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


def test_refused_under_capture(monkeypatch):
    ctx, _, _ = offload_context("teo", num_layers=1, model_layers=2)
    monkeypatch.setattr(capture, "capturing", lambda: True)
    with pytest.raises(capture.GraphCaptureError, match="teo offload engine cannot run under CUDA graph capture"):
        ctx.__enter__()
    assert not ctx._inside and cpu_offload.OFFLOAD_SYNCHRONIZER is None  # refused before anything changed
    with pytest.raises(capture.GraphCaptureError):
        ctx.engine.pack(torch.empty(4))


def test_region_ends_release_and_reload_through_real_hooks(monkeypatch):
    """The engine's own reactions to a real backward (4 layers, 3 offloaded, whole-layer regions
    with an op outside each context): each region's end drops its reloads and starts the next."""
    ctx, sync, _ = offload_context("teo", num_layers=3, model_layers=4)
    engine = ctx.engine
    calls = []
    monkeypatch.setattr(engine, "reload", lambda layer, prefetch=False: calls.append(("reload", layer)))
    monkeypatch.setattr(engine, "release_reload", lambda layer: calls.append(("release", layer)))
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


def test_a_frozen_last_layer_still_gives_its_bytes_back(monkeypatch):
    stream = current_stream(monkeypatch)
    ctx, sync, _ = offload_context("teo", num_layers=2, model_layers=2)
    x = torch.randn(4, requires_grad=True)
    with ctx:
        h = x * 2
    sync(h)
    with ctx:
        ctx.engine.copies.layers[1] = layer_copies(1, stream=stream)
        frozen = torch.randn(4)
    assert sync(frozen) is frozen
    assert ctx.engine.copies.layers[1].released and stream.waited


def test_a_region_with_nothing_after_it_is_said_once(caplog):
    ctx, sync, _ = offload_context("teo", num_layers=1, model_layers=3)
    with caplog.at_level(logging.INFO, logger="te_offload_ops.engines.teo"):
        for _ in range(3):
            x = torch.randn(4, requires_grad=True)  # each layer's input a leaf
            with ctx:
                h = torch.tanh(x) * 2
            sync(h)
    said = [r.getMessage() for r in caplog.records if "nothing in autograd follows" in r.getMessage()]
    assert len(said) == 1 and "layer 1's region" in said[0]


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
    assert step() == [0, 1, 2, 3]  # not [2, 3, 0, 1]: a failed step's layers do not carry into the next
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case: no CUDA to read memory from")
def test_a_budget_engine_runs_steps_where_cuda_is_absent():
    """Every look of a budget engine through real hooks (saves, uses, layer entries, backward
    boundaries, region ends) over three steps, with nothing moved: the same grads, and no memory read
    (it held nothing it could give back)."""
    ctx, sync, _ = offload_context("teo", num_layers=1, model_layers=2, memory_budget=1 << 30)
    x = torch.randn(4, requires_grad=True)
    for _ in range(3):
        x.grad = None
        h = x * 1.0
        for _ in range(2):
            with ctx:
                h = h * 2
            h = sync(h)
        h.sum().backward()
        assert torch.equal(x.grad, torch.full((4,), 4.0))
    schedule = ctx.engine.schedule
    assert schedule.looks > 0 and schedule.allocator.reads == 0 and not ctx.engine.in_step
