"""CPU: teo's engine on its own: what a save returns, reloads and their return to the allocator,
bytes served in place, uses on other streams, unpacks past the count (copies need a GPU:
tests/test_gpu_teo_engine.py)."""

import logging

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from te_offload_ops import policy
from te_offload_ops.engines.teo import TeoEngine
from te_offload_ops.engines.teo.copies import CopyState, HostCopy, LayerCopies, Moved
from te_offload_ops.engines.teo.plan import Move
from te_offload_ops.engines import OffloadCounter
from teo_fakes import (FakeStream, QueriedEvent, copy_streams, current_stream, fake_pool, host_copy, layer_copies,
                       on_host)

BIG = policy.MIN_OFFLOAD_NUMEL  # elements: the smallest tensor V2's rule moves


@pytest.fixture
def cpu_is_offloadable(monkeypatch):
    """Let the rule take CPU tensors for the device it moves from, so saves are testable here."""
    monkeypatch.setattr(policy, "OFFLOAD_DEVICE_TYPE", "cpu")


def _handle(engine, index=0, layer=0, shape=(2,), stride=(1,), offset=0):
    return Moved(engine.step, layer, index, offset, shape, stride, torch.float32)


def test_saves_outside_offloaded_layers_or_kept_are_returned_as_is(cpu_is_offloadable):
    engine = TeoEngine(1, 2)
    t = torch.empty(BIG)
    assert engine.pack(t) is t  # before any layer
    engine.enter_layer()
    small = torch.empty(10)
    assert engine.pack(small) is small and engine.unpack(small) is small
    engine.enter_layer()  # layer 1: not offloaded
    assert engine.pack(t) is t


def test_stale_handle_is_refused():
    engine = TeoEngine(1, 1)
    engine.step = 2
    handle = Moved(1, 0, 0, 0, (2,), (1,), torch.float32)  # saved in step 1
    with pytest.raises(RuntimeError, match="saved in step 1 is used after that step ended"):
        engine.unpack(handle)


def test_saving_a_range_again_counts_one_more_handle_to_its_copy(monkeypatch, cpu_is_offloadable):
    engine = TeoEngine(1, 2)
    engine.enter_layer()
    started = []
    monkeypatch.setattr(engine, "_held_copy", lambda t, storage, span: HostCopy(
        span.nbytes, span.start, storage.data_ptr(), StorageWeakRef(storage), torch.zeros(1, dtype=torch.uint8)))
    monkeypatch.setattr(engine, "start_copy", lambda c: started.append(c))
    t = torch.zeros(2 * BIG)
    handles = [engine.pack(t), engine.pack(t), engine.pack(t[BIG:])]  # saved twice, then a view of it
    assert len(started) == 1 and engine.copies.layers[0].copies[0].handles == 3
    assert [h.index for h in handles] == [0, 0, 0]


def test_tensors_on_another_device_than_the_engines_stay(cpu_is_offloadable, caplog):
    engine = TeoEngine(1, 1)
    engine.enter_layer()
    engine.device = torch.device("cuda", 1)  # the first tensor it moved was on cuda:1
    t = torch.empty(BIG)
    with caplog.at_level(logging.INFO, logger="te_offload_ops.engines.teo"):
        assert engine.pack(t) is t  # a host tensor: nothing to say
        assert not caplog.records
        other = [torch.empty(BIG, device="meta") for _ in range(2)]  # stands for a second GPU's tensors
        assert all(engine.pack(o) is o for o in other)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "tensors saved on meta stay there" in said[0] and "(cuda:1's" in said[0]


# ------------------------------------------------------------------------------------------------
# Reloads, and bytes the engine still holds served in place


def _reloaded_layer(engine, stream, data: torch.Tensor, handles: int) -> HostCopy:
    """Layer 0 with one range reloaded into ``data`` on ``stream`` (event "reload0"), not waited for."""
    c = on_host(host_copy(0, copied="L0.copy0"))
    c.host.tensor = data.clone()
    c.begin_reload(data, "reload0", stream)
    c.handles = handles
    engine.copies.layers[0] = LayerCopies(copies=[c], reloaded=True)
    return c


def test_a_reload_goes_back_in_stream_order_after_its_copy(monkeypatch):
    """No record_stream: a reload that was never used makes the compute stream wait for its copy
    before its memory goes back; one already waited for by its use goes back without a new wait."""
    stream = current_stream(monkeypatch)
    engine = TeoEngine(2, 3)
    copies = layer_copies(0)
    for i, c in enumerate(copies.copies):
        on_host(c).begin_reload(torch.zeros(8, dtype=torch.uint8), f"reload{i}", stream)
    copies.copies[0].reload_waited()  # copy 0 was used
    copies.reloaded = True
    engine.copies.layers[0] = copies
    engine.release_reload(0)
    assert stream.waited == ["reload1"]
    assert all(c.gpu is None and c.state is CopyState.ON_HOST for c in copies.copies) and not copies.reloaded


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
    copy = HostCopy(src.numel(), start, base.data_ptr(), None, src, layer=0)
    copy.begin_copy(None, "copied")
    engine.copies.layers[0] = LayerCopies(copies=[copy])
    got = engine.unpack(_handle(engine, shape=tuple(view.shape), stride=view.stride(), offset=1200 - start))
    assert got.data_ptr() == view.data_ptr() and torch.equal(got, view)
    assert got.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # no copy
    assert copy.state is CopyState.IN_PLACE


@pytest.mark.parametrize("handles", [1, 2])
def test_a_reload_used_on_another_stream_is_kept_for_that_stream(monkeypatch, handles):
    """Used on a side stream: that stream waits for the copy and records itself on the memory. With
    its one handle used, the engine lets go (the recorded use keeps the memory from reuse); with a
    second handle never unpacked, the engine keeps it to the layer's end, where the stream it was
    taken on waits for the copy before it goes back."""
    taken_on, used_on = FakeStream("compute"), current_stream(monkeypatch, FakeStream("side"))
    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: recorded.append(stream))
    engine = TeoEngine(1, 2)
    engine.enter_layer()
    c = _reloaded_layer(engine, taken_on, torch.zeros(8, dtype=torch.uint8), handles=handles)
    engine.unpack(_handle(engine))
    assert used_on.waited == ["reload0"] and recorded == [used_on] and c.state is not CopyState.RELOADED
    assert (c.gpu is None) == (handles == 1) and taken_on.waited == []
    engine.release_reload(0)
    assert taken_on.waited == ([] if handles == 1 else ["reload0"])


def test_a_reload_that_raises_midway_leaves_its_started_copies_to_be_waited_on(monkeypatch):
    engine = TeoEngine(1, 2)
    compute, h2d = copy_streams(monkeypatch, engine)
    copies = layer_copies(0)
    for c in copies.copies:
        on_host(c)
    engine.copies.layers[0] = copies
    real_empty, made = torch.empty, []

    def empty(*a, **k):
        if len(made) == 1:
            raise torch.cuda.OutOfMemoryError("no room for the second reload")
        made.append(1)
        return real_empty(*a, **{**k, "device": "cpu"})

    monkeypatch.setattr(torch, "empty", empty)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        engine.reload(0)
    monkeypatch.setattr(torch, "empty", real_empty)
    engine.release_reload(0)
    first = copies.copies[0]
    assert compute.waited == [first.reloaded] and first.gpu is None and first.state is CopyState.ON_HOST


def test_a_reload_goes_back_at_its_last_counted_use(monkeypatch):
    """Two handles to one reloaded range: the engine keeps it after the first unpack and lets go at
    the second, leaving the bytes to the tensor it returned (autograd frees it after the op)."""
    stream = current_stream(monkeypatch)
    engine = TeoEngine(1, 2)
    engine.enter_layer()
    data = torch.arange(8, dtype=torch.uint8)
    c = _reloaded_layer(engine, stream, data, handles=2)
    first = engine.unpack(_handle(engine))
    assert c.gpu is data and stream.waited == ["reload0"] and c.state is CopyState.RELOADED
    second = engine.unpack(_handle(engine))
    assert c.gpu is None and stream.waited == ["reload0"]  # waited once, at the first use
    assert torch.equal(second, data.view(torch.float32)) and torch.equal(first, second)
    engine.release_reload(0)  # the layer's end: nothing left to wait for or drop
    assert stream.waited == ["reload0"] and not engine.copies.layers[0].reloaded


def test_an_unpack_past_the_counted_uses_copies_the_range_back_again(monkeypatch, caplog):
    engine = TeoEngine(1, 2)
    compute, h2d = copy_streams(monkeypatch, engine)
    engine.device = torch.device("cpu")
    engine.enter_layer()
    data = torch.arange(8, dtype=torch.uint8)
    c = _reloaded_layer(engine, compute, data, handles=1)
    engine.unpack(_handle(engine))
    assert c.gpu is None
    with caplog.at_level(logging.INFO, logger="te_offload_ops.engines.teo"):
        again = engine.unpack(_handle(engine))
    assert torch.equal(again, data.view(torch.float32))  # copied back from the host buffer
    assert h2d.waited == [("stream", "compute"), "L0.copy0"]  # after the compute stream's work and the D2H copy
    assert isinstance(c.reloaded, QueriedEvent) and compute.waited[-1] is c.reloaded
    assert c.gpu is None and c.state is CopyState.ON_HOST  # let go again: this use is past the count too
    assert "unpacked more often than it was saved" in caplog.text


def test_a_layer_reloaded_again_skips_the_ranges_it_used_up(monkeypatch):
    engine = TeoEngine(1, 2)
    copy_streams(monkeypatch, engine)
    engine.device = torch.device("cpu")
    copies = layer_copies(0)
    for c in copies.copies:
        on_host(c).handles = 1
    used, unused = copies.copies
    used.unpacks = 1  # its one handle was unpacked in the layer's first reload
    engine.copies.layers[0] = copies
    engine.reload(0)
    assert used.gpu is None and unused.gpu is not None and unused.state is CopyState.RELOADING


def test_a_copy_to_the_host_fills_a_pool_buffer_from_the_aligned_start(monkeypatch):
    """The saved range's bytes, from the 512-byte boundary below it, reach a pool buffer in one copy
    on the copy stream, after the tensor's ready event; the copy counts the bytes autograd saved."""
    engine = TeoEngine(1, 2, pool=fake_pool()[0], counter=OffloadCounter())
    compute, _ = copy_streams(monkeypatch, engine)
    engine.enter_layer()
    t = torch.arange(3000, dtype=torch.uint8)
    c = engine._held_copy(t, t.untyped_storage(), Move(600, 2400))
    c.layer, c.count = 0, ("all", 2400)
    ready = c.ready
    engine.start_copy(c)
    assert c.start == 512 and c.nbytes == 2488 and c.state is CopyState.COPYING
    assert torch.equal(c.host.tensor[:2488], t[512:]) and engine.counter.total == 2400
    assert engine.d2h.waited == [ready] and c.ready is None  # after the tensor was ready (a new buffer: no reuse)
