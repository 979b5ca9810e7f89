"""CPU: when teo moves bytes under its default layer schedule: the forward's releases (after a wait
for the copies still running) and the peak-neutral reload timing every schedule follows."""

import pytest

from te_offload_ops.engines.teo import TeoEngine
from te_offload_ops.engines.teo.copies import CopyState
from te_offload_ops.engines.teo.schedule import (peak_neutral_lead, release_lag, reloads_at_backward_start,
                                                 reloads_at_region_end)
from teo_fakes import FakeStream, current_stream, layer_copies, queued_copies

# ------------------------------------------------------------------------------------------------
# The backward: reloads that never raise the step's peak


def _peak_neutral_schedule(n: int, L: int, ahead: int = 0) -> list[tuple[str, int, list[int]]]:
    """The reloads started at each event of a backward: layer j begins, then j's region ends."""
    events = []
    for j in range(L - 1, -1, -1):
        events.append(("start", j, reloads_at_backward_start(j, n, L, ahead)))
        events.append(("end", j, reloads_at_region_end(j, n, L, ahead)))
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


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize("n, L", [(3, 4), (2, 4), (4, 4), (7, 8), (1, 8)])
def test_reload_ahead_starts_each_reload_that_many_layers_earlier_for_as_many_layers_more(n, L, ahead):
    """Each reload starts ``ahead`` layers' events (a start and a region end each) earlier than
    peak-neutral, or at the backward's first event where that would be before it; every one before
    its use, and the layers on the GPU exceed the peak-neutral count by at most ``ahead``."""
    def first_event(events):
        first = {}
        for i, (_, _, reloads) in enumerate(events):
            for r in reloads:
                first.setdefault(r, i)
        return first

    neutral, early = first_event(_peak_neutral_schedule(n, L)), first_event(_peak_neutral_schedule(n, L, ahead))
    assert sorted(early) == list(range(n))
    assert {layer: early[layer] for layer in neutral} == {layer: max(i - 2 * ahead, 0) for layer, i in neutral.items()}
    on_gpu, allowed = set(range(n, L)), max(L - n, 1) + ahead
    for what, j, reloads in _peak_neutral_schedule(n, L, ahead):
        if what == "end":
            on_gpu.discard(j)
        on_gpu.update(reloads)
        if what == "start":
            assert j in on_gpu
        assert len(on_gpu) <= allowed, (what, j, sorted(on_gpu))


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_reload_ahead_must_be_a_count_of_layers(bad, error):
    with pytest.raises(error, match="reload_ahead"):
        TeoEngine(3, 4, reload_ahead=bad)


def test_reload_ahead_belongs_to_teo_alone():
    from te_offload_ops.engines import offload_context

    with pytest.raises(ValueError, match="reload_ahead is an option of the teo engine"):
        offload_context("v2", num_layers=1, model_layers=2, reload_ahead=1)
    assert offload_context("teo", num_layers=1, model_layers=2, reload_ahead=1)[0].engine.reload_ahead == 1


# ------------------------------------------------------------------------------------------------
# The forward's backpressure: when an offloaded layer's GPU bytes go back


@pytest.mark.parametrize("n, L, lag", [(1, 4, 3), (2, 4, 2), (3, 4, 1), (4, 4, 1), (6, 8, 2), (0, 3, 3)])
def test_release_lag_keeps_the_forward_within_the_layers_the_peak_holds(n, L, lag):
    assert release_lag(n, L) == lag


@pytest.mark.parametrize("n, L, released_at", [
    (3, 4, {0: ("enter", 1), 1: ("enter", 2), 2: ("enter", 3)}),
    (2, 4, {0: ("enter", 2), 1: ("enter", 3)}),
    (4, 4, {0: ("enter", 1), 1: ("enter", 2), 2: ("enter", 3), 3: ("sync", 3)}),  # the last at its own end
])
def test_forward_gives_each_offloaded_layers_bytes_back_after_waiting_for_its_copies(monkeypatch, n, L, released_at):
    stream = current_stream(monkeypatch)
    engine = TeoEngine(n, L)
    seen = {}

    def note(when, layer):
        for j, copies in engine.copies.layers.items():
            if j not in seen and all(c.source is None for c in copies.copies):
                seen[j] = (when, layer)
                assert stream.waited[-1] == f"L{j}.copy1"  # waited for its copies before letting go

    for k in range(L):
        engine.enter_layer()
        note("enter", k)
        if k < n:
            engine.copies.layers[k] = layer_copies(k, stream=stream)  # what its saves copied
        engine.layer_done(k)
        note("sync", k)
    assert seen == released_at
    assert all(engine.copies.layers[j].released for j in range(n))
    assert all(c.state is CopyState.ON_HOST for j in range(n) for c in engine.copies.layers[j].copies)


def test_sources_go_back_after_both_their_save_stream_and_the_current_one_waited(monkeypatch):
    """A tensor saved on a side stream: that stream and the current one (either may have allocated
    it) wait for the last copy before the engine lets go."""
    side, current = FakeStream("side"), current_stream(monkeypatch)
    engine = TeoEngine(1, 2)
    engine.enter_layer()
    engine.copies.layers[0] = layer_copies(0, stream=side)
    engine.enter_layer()  # layer 1 enters: layer 0's sources go back
    assert side.waited == ["L0.copy1"] and current.waited == ["L0.copy1"]
    assert all(c.source is None for c in engine.copies.layers[0].copies)


def test_copies_seen_ended_give_their_bytes_back_without_a_wait(monkeypatch):
    """At a save or a layer entry the engine queries the oldest copies in order and lets go of the
    ended ones: no stream waits, and a copy not ended stops the scan (the copy stream runs in order)."""
    stream = current_stream(monkeypatch)
    engine = TeoEngine(2, 4)
    engine.enter_layer()
    first = queued_copies(engine, 0, done=[True, True, False])
    assert engine.pack("not a tensor") == "not a tensor"  # any save scans
    assert [c.source is None for c in first] == [True, True, False] and stream.waited == []
    first[2].copied.done = True
    later = queued_copies(engine, 0, done=[False])
    later[0].copied.done = True  # ended too, but behind one the host has not seen: its turn comes next scan
    engine.enter_layer()
    assert all(c.source is None for c in first + later) and stream.waited == [] and not engine.copies.in_flight
