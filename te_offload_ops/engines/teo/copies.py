"""A saved byte range's trip to pinned host memory and back, as an explicit state machine.

Each range a teo engine moves is one :class:`HostCopy`. Its :class:`CopyState` says where its bytes
are; each transition is a method that checks the state it starts from and raises, naming both
states, on any other (a wrong transition is a bug in the engine, never something to go on from):

=============  ================================================================  ===================
state          the bytes                                                         entered by
=============  ================================================================  ===================
PUT_OFF        on the GPU, held by the engine; no copy to the host queued        construction
COPYING        copy to the host queued; the GPU bytes held until it is seen to   :meth:`begin_copy`
               end (or waited for)
IN_PLACE       the held GPU bytes serve the backward; a copy may still run       :meth:`serve_in_place`
ON_HOST        only on the host: the GPU bytes went back                         :meth:`copy_done`,
                                                                                 :meth:`release_gpu`
RELOADING      copied back into new GPU memory; the stream it was taken on has   :meth:`begin_reload`
               not waited for the copy yet
RELOADED       copied back, and that stream waited                               :meth:`reload_waited`
DISCARDED      a put-off range let go uncopied: nothing reads it again            :meth:`discard`
=============  ================================================================  ===================

:class:`StepCopies` holds one step's copies: per layer, and those whose GPU bytes the engine may
still hold, in the order they were saved. The functions at the end queue the copies on the GPU.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .pool import HostBuffer, PinnedBufferPool

__all__ = ["CopyState", "HostCopy", "LayerCopies", "Moved", "StepCopies", "queue_copy_to_host", "queue_reload",
           "wait_and_give_back"]


class CopyState(enum.Enum):
    PUT_OFF = "put off"
    COPYING = "copying"
    IN_PLACE = "in place"
    ON_HOST = "on host"
    RELOADING = "reloading"
    RELOADED = "reloaded"
    DISCARDED = "discarded"


_S = CopyState


@dataclass(eq=False)
class HostCopy:
    """One byte range of a GPU storage, copied to a host buffer (and back in backward)."""

    nbytes: int
    start: int  # where the range begins in the source storage (for views of it saved later)
    storage_ptr: int
    storage_ref: Optional[StorageWeakRef]
    source: Optional[torch.Tensor]  # uint8 view of the GPU bytes, held until the copy is seen to end
    source_stream: Any = None  # the stream the tensor was saved on (its memory goes back there)
    ready: Any = None  # the event after which the source's bytes may be read
    layer: Optional[int] = None  # the layer that saved it
    count: Optional[tuple] = None  # (counter key, bytes) to count when its copy starts
    host: Optional[HostBuffer] = None
    copied: Any = None  # event: the copy to the host is done
    gpu: Optional[torch.Tensor] = None  # uint8 bytes the backward reads (a reload, or the source in place)
    reloaded: Any = None  # event: the copy back is done (kept after the reload goes: the buffer's last use)
    reload_stream: Any = None  # the stream the reload's memory was taken on
    handles: int = 0  # handles to this range autograd holds (packs this step)
    unpacks: int = 0  # of those, unpacked in this backward
    state: CopyState = field(default=CopyState.PUT_OFF)

    def _move(self, action: str, allowed: tuple, to: CopyState) -> None:
        if self.state not in allowed:
            raise RuntimeError(
                f"teo offload: a host copy of layer {self.layer} cannot {action} in state {self.state.value!r} "
                f"(to {to.value!r}; only from {', '.join(repr(s.value) for s in allowed)})")
        self.state = to

    @property
    def used_up(self) -> bool:
        """Every handle autograd held to it has been unpacked in this backward."""
        return bool(self.handles) and self.unpacks >= self.handles

    @property
    def holds_source(self) -> bool:
        """The engine holds the range's GPU bytes for a copy to the host (running or put off)."""
        return self.source is not None

    def begin_copy(self, host: HostBuffer, copied: Any) -> None:
        """Its copy to ``host`` is queued (``copied``: the event after it)."""
        if self.state is _S.IN_PLACE and self.copied is None:
            pass  # put off and serving in place: the copy starts, the bytes stay in place
        else:
            self._move("start its copy to the host", (_S.PUT_OFF,), _S.COPYING)
        self.host, self.copied, self.ready = host, copied, None

    def copy_done(self) -> None:
        """Its copy to the host is over (seen ended, or waited for): the engine lets go of the source.
        In place, the backward still reads the bytes."""
        if self.state is _S.IN_PLACE and self.copied is not None and self.source is not None:
            self.source = None
            return
        self._move("let go of its bytes after the copy", (_S.COPYING,), _S.ON_HOST)
        self.source = None

    def discard(self) -> None:
        """A put-off range nothing will read again goes without a copy."""
        allowed = (_S.PUT_OFF, _S.IN_PLACE) if self.copied is None else (_S.PUT_OFF,)
        self._move("go uncopied", allowed, _S.DISCARDED)
        self.source, self.gpu = None, None

    def serve_in_place(self) -> None:
        """Its layer's backward reads the bytes the engine still holds (no copy back)."""
        self._move("serve in place", (_S.PUT_OFF, _S.COPYING), _S.IN_PLACE)
        self.gpu, self.reloaded = self.source, None

    def begin_reload(self, gpu: torch.Tensor, reloaded: Any, stream: Any) -> None:
        """Its copy back into ``gpu`` (taken on ``stream``) is queued; ``reloaded``: the event after it."""
        self._move("start a reload", (_S.ON_HOST,), _S.RELOADING)
        self.gpu, self.reloaded, self.reload_stream = gpu, reloaded, stream

    def reload_waited(self) -> None:
        """The stream its reload was taken on waited for the copy back."""
        self._move("be waited for", (_S.RELOADING,), _S.RELOADED)

    def release_gpu(self) -> None:
        """The engine lets go of the bytes the backward read: a reload goes to autograd (last use)
        or back to the allocator (its layer's end); bytes in place go back to being a copy's source
        (its copy still running) or go."""
        if self.state is _S.IN_PLACE:
            if self.source is not None and self.copied is None:
                raise RuntimeError(f"teo offload: a host copy of layer {self.layer} in state 'in place' cannot "
                                   "let go of its bytes before its copy to the host starts (or it is discarded)")
            self.gpu = None
            self.state = _S.COPYING if self.source is not None else _S.ON_HOST
            return
        self._move("let go of its reload", (_S.RELOADING, _S.RELOADED), _S.ON_HOST)
        self.gpu = None


@dataclass
class LayerCopies:
    copies: list = field(default_factory=list)
    reloaded: bool = False  # its reload was started whole (or it serves in place)
    released: bool = False  # the forward gave the sources back (layer schedule)


@dataclass(frozen=True)
class Moved:
    """What autograd holds instead of an offloaded tensor."""

    step: int
    layer: int
    index: int
    byte_offset: int  # of the tensor in its host copy
    shape: tuple
    stride: tuple
    dtype: torch.dtype


class StepCopies:
    """One step's copies: per layer, and in save order those whose GPU bytes may still be held."""

    def __init__(self):
        self.layers: dict[int, LayerCopies] = {}
        self.in_flight: deque = deque()

    def add(self, layer: int, copy: HostCopy) -> int:
        """Adds ``copy`` to ``layer``'s; returns its index there."""
        copies = self.layers.setdefault(layer, LayerCopies())
        copies.copies.append(copy)
        self.in_flight.append(copy)
        return len(copies.copies) - 1

    def holds_bytes(self) -> bool:
        """Whether any copy still holds GPU bytes for a copy to the host."""
        return any(c.source is not None for c in self.in_flight)

    def held(self, keep_layer: Optional[int] = None) -> list:
        """Copies whose GPU bytes going back would free them, oldest first: held for a copy and not
        serving in place (nor of ``keep_layer``, whose backward is about to read them)."""
        return [c for c in self.in_flight if c.source is not None and c.state is not _S.IN_PLACE
                and not (keep_layer is not None and c.layer == keep_layer)]

    def drop_copied(self) -> bool:
        """The bytes of every copy to the host that has ended go back to the allocator: an event
        query, no wait (one copy stream runs the copies in order: the first not ended stops the
        scan). Whether any went back."""
        queue, dropped = self.in_flight, False
        while queue:
            c = queue[0]
            if c.source is not None:
                if c.copied is None or not c.copied.query():  # (a put-off copy ends only once started)
                    return dropped
                c.copy_done()  # the memory can be reused at once, in any stream's order
                dropped = True
            queue.popleft()
        return dropped

    def clear(self) -> None:
        self.layers.clear()
        self.in_flight.clear()


def wait_and_give_back(held: list) -> None:
    """The streams the sources were saved on, and the current one, wait for the copies to the host;
    then the bytes go back. (The memory returns to the stream it was allocated on, most often the
    one it was saved on or the current one; one copy stream runs the copies in order, so the last
    one's event covers them all.)"""
    if not held:
        return
    last = held[-1].copied
    streams = {c.source_stream for c in held if c.source_stream is not None}
    streams.add(torch.cuda.current_stream(held[0].source.device))
    for stream in streams:
        stream.wait_event(last)
    for c in held:
        c.copy_done()


def queue_copy_to_host(c: HostCopy, d2h: Any, pool: PinnedBufferPool) -> None:
    """Queues ``c``'s copy to a pinned host buffer on the copy stream ``d2h``."""
    host = pool.acquire(c.nbytes)
    d2h.wait_event(c.ready)
    if host.ready is not None:
        d2h.wait_event(host.ready)  # last step's reload from this buffer
    with torch.cuda.stream(d2h):
        host.tensor[: c.nbytes].copy_(c.source, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(d2h)
    c.begin_copy(host, copied)


def queue_reload(c: HostCopy, h2d: Any, device: Any) -> None:
    """Queues one range's copy back into new memory taken on the compute stream (``h2d`` has
    waited for the compute stream's work so far)."""
    compute = torch.cuda.current_stream(device)
    gpu = torch.empty(c.nbytes, dtype=torch.uint8, device=device)
    h2d.wait_event(c.copied)
    with torch.cuda.stream(h2d):
        gpu.copy_(c.host.tensor[: c.nbytes], non_blocking=True)
    # No record_stream: a block freed under it is reusable only once the host has seen the copy
    # stream pass the free, which a host running ahead of a busy copy stream does not, so the
    # allocator would take new memory for the next reload and the peak would grow by a layer each
    # time. The compute stream waits for the copy instead (at the first use, or at the layer's end
    # for a reload never used), and the memory goes back in its order.
    reloaded = torch.cuda.Event()
    reloaded.record(h2d)
    c.begin_reload(gpu, reloaded, compute)
