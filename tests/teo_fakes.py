"""Stand-ins for CPU tests of the teo engine: streams and events that note what they are asked, host
copies in a given state, and engines whose memory reads are computed from what they hold."""

from __future__ import annotations

import contextlib

import torch

from te_offload_ops import hints, policy
from te_offload_ops.engines import OffloadCounter
from te_offload_ops.engines.teo import PinnedBufferPool, TeoEngine
from te_offload_ops.engines.teo.copies import HostCopy, LayerCopies
from te_offload_ops.engines.teo.pool import HostBuffer

BIG = policy.MIN_OFFLOAD_NUMEL  # elements: the smallest tensor V2's rule moves


class FakeStream:
    """Notes each event it was told to wait for."""

    def __init__(self, name: str = "stream"):
        self.name = name
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)

    def wait_stream(self, stream):
        self.waited.append(("stream", stream.name))

    def __repr__(self):
        return self.name


class FakeEvent:
    def record(self, stream=None):
        pass


class QueriedEvent:
    """A copy's event the host can query: ``done`` says whether the copy ended."""

    def __init__(self, name, done=False):
        self.name, self.done = name, done

    def query(self):
        return self.done

    def record(self, stream=None):
        pass

    def __repr__(self):
        return self.name


def fake_pool():
    """A pool of plain host tensors, and the list of sizes it allocated."""
    made = []

    def allocate(n):
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    return PinnedBufferPool(allocate), made


def host_copy(layer: int = 0, nbytes: int = 8, stream=None, copied=None, source=None) -> HostCopy:
    """A range of ``nbytes`` saved in ``layer``, its copy to the host queued (``copied``: its event,
    by default the string "L<layer>.copy")."""
    c = HostCopy(nbytes, 0, 0, None, torch.zeros(nbytes, dtype=torch.uint8) if source is None else source,
                 source_stream=stream, layer=layer)
    c.begin_copy(HostBuffer(torch.zeros(nbytes, dtype=torch.uint8), 0), copied or f"L{layer}.copy")
    return c


def on_host(c: HostCopy) -> HostCopy:
    """``c`` after its copy ended and its GPU bytes went back."""
    c.copy_done()
    return c


def layer_copies(layer: int, count: int = 2, stream=None) -> LayerCopies:
    """``count`` copies of 8 bytes saved in ``layer``, named "L<layer>.copy<i>", all queued."""
    return LayerCopies(copies=[host_copy(layer, stream=stream, copied=f"L{layer}.copy{i}") for i in range(count)])


def queued_copies(engine: TeoEngine, layer: int, done) -> list:
    """Layer ``layer``'s copies as the engine's saves leave them: in its layer and in its copy queue,
    each with an event that says ``done``."""
    made = [host_copy(layer, copied=QueriedEvent(f"L{layer}.copy{i}", d)) for i, d in enumerate(done)]
    for c in made:
        engine.copies.add(layer, c)
    return made


def current_stream(monkeypatch, stream=None) -> FakeStream:
    """``torch.cuda.current_stream`` gives ``stream`` (a new FakeStream by default)."""
    stream = stream or FakeStream("compute")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    return stream


def copy_streams(monkeypatch, engine: TeoEngine):
    """A compute stream (the current one) and copy streams without a GPU; events record nothing."""
    compute = current_stream(monkeypatch)
    engine.d2h, engine.h2d = FakeStream("d2h"), FakeStream("h2d")
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: QueriedEvent("event"))
    return compute, engine.h2d


def budget_engine(monkeypatch, n, L, budget, base=0):
    """A budget engine whose memory is ``base`` plus ``extra[0]`` plus the GPU bytes its held
    sources (and reloads) keep: what the allocator's statistics would read. Its announcements'
    allocations always fit (tests of the fit set their own), and giving held bytes back can always
    help. Returns (engine, the current stream, extra)."""
    stream = current_stream(monkeypatch)
    monkeypatch.setattr(hints, "_LISTENERS", type(hints._LISTENERS)())  # make_room elsewhere never reaches it
    engine = TeoEngine(n, L, memory_budget=budget)
    extra = [0]

    def memory():
        live = {id(t): t.numel() for lc in engine.copies.layers.values() for c in lc.copies
                for t in (c.source, c.gpu) if t is not None}
        return base + extra[0] + sum(live.values())

    budget_of(engine).read_memory = memory
    budget_of(engine).short_of = lambda sizes, stream=None: []
    budget_of(engine).most_room = lambda stream=None: 1 << 60
    return engine, stream, extra


def budget_of(engine: TeoEngine):
    return engine.schedule


def put_off_engine(monkeypatch, budget):
    """A budget engine, n = L = 2, that packs CPU tensors through the real save path: fake streams
    and events (each copy's event queried as not ended), a fake pool and a counter. Returns
    (engine, the current stream, extra memory, the copy stream to the host)."""
    engine, stream, extra = budget_engine(monkeypatch, 2, 2, budget=budget)
    monkeypatch.setattr(policy, "OFFLOAD_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: QueriedEvent("event"))
    engine.d2h, engine.h2d = FakeStream("d2h"), FakeStream("h2d")
    engine.pool, _ = fake_pool()
    engine.counter = OffloadCounter()
    return engine, stream, extra, engine.d2h


def fake_reloads(monkeypatch, take: bool = False) -> list:
    """Reloads noted instead of queued (the list returned); ``take``: each takes its bytes at once and
    counts as waited for, else the copy stays on the host."""
    from te_offload_ops.engines.teo import engine as teo_engine

    started = []

    def queue_reload(c, h2d, device):
        started.append(c)
        if take:
            c.begin_reload(torch.zeros(c.nbytes, dtype=torch.uint8), FakeEvent(), h2d)
            c.reload_waited()

    monkeypatch.setattr(teo_engine, "queue_reload", queue_reload)
    return started
