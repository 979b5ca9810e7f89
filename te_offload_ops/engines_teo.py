"""teo: this package's CPU-offload schedule, a saved-tensor-hook engine on TE's marks.

``engines.offload_context("teo", num_layers=n, model_layers=L)`` returns ``(context, sync,
counter)`` used as TE's pair is: ``with context: y = layer(x)`` then ``y = sync(y)`` per layer.
What moves is what TE V2 would move (``policy.keep_reason``: the marks the policy and TE's own
modules leave); when it moves is this module's own schedule:

* forward: each saved tensor of the first ``n`` layers starts its copy to pinned host memory the
  moment it is saved (on a copy stream, after the event TE's ``start_offload`` recorded, or one
  recorded then). The engine holds the GPU bytes until their copy ends: each time a tensor is
  saved or a layer begins, the copies the host sees ended (an event query, no wait) give their
  bytes back. By layer ``i + b``'s entry (``b = max(L - n, 1)``, see :func:`release_lag`) layer
  ``i``'s must be gone: the stream the tensor was saved on and the current one wait for the copies
  still running and the bytes go back to the allocator, reusable at once in stream order. With
  ``max_held_bytes`` (opt-in, e.g. the room a memory cap leaves above the step's peak) up to that
  many bytes of released layers stay held instead, the oldest waited for first, so the forward
  waits only for what is past it; they go back as their copies end, and the step's memory stays
  within the layer schedule's plus ``max_held_bytes`` everywhere. What is still held when the
  backward begins stays until its layer's backward, which uses it in place (no copy back): with
  ``n = L`` and ``max_held_bytes`` at least the last layer's bytes, that layer makes no round trip
  (it is on the GPU at the step's peak under any schedule).
  That wait is the backpressure that keeps the forward within the no-offload peak less what
  is offloaded when copies are slower than the compute that makes activations (a host running
  ahead cannot free memory a copy still reads: ``record_stream`` would only return it once the
  host sees the copy done). The last layer with ``n = L`` has no later layer: its bytes go back
  when its ``sync`` is called (a wait for its copies: this frees it across whatever follows the
  stack, such as an LM head, and it reloads at once when the backward begins). With
  ``release="memory"`` (opt-in) a layer whose release is due stays held while the previous step's
  figures (the memory each stretch of forward reaches under the layer schedule, and the memory at
  the start of backward) say the forward stays under its end with one layer's bytes to spare: the
  forward waits on copies only where memory runs out (see :func:`sources_to_release`). With
  ``memory_budget=B`` (opt-in; bytes of ``torch.cuda.memory_allocated``, e.g. a memory cap less
  room for what ops allocate between two of the engine's looks) no layer is released on a
  schedule: every offloaded tensor's GPU bytes stay until its copy ends, and the oldest still
  being copied go back early, after the streams waited for their copies, only where the memory
  allocated plus the next allocation announced (:func:`make_room`, or the engine's own reloads)
  would pass ``B``, or where an announced allocation would fit no free block of the allocator
  and no memory the cap leaves to map (the allocator would release its cache and remap, which
  stalls the GPU: ``allocator_room``). The engine looks at each layer entry, save, use in backward and backward
  boundary. So the forward waits only where memory runs out at the cap, not at every layer entry,
  and what the peak cannot hold is gone by then (see :meth:`TeoEngine.fit_budget`). With ``n = L``
  the last layer's copies are put off until the budget needs their room (its backward comes
  first and uses them in place: see :meth:`TeoEngine._puts_off_copies`);
* backward: reloads run on a second stream, into memory taken on the compute stream after the
  work queued there so far; a saved tensor's first use makes the compute stream wait for its own
  reload only. A reload goes back to the allocator as a tensor kept on the GPU does: the engine
  lets go of it at the last use it counted (as many unpacks as autograd holds handles to it),
  leaving the tensor to autograd, which frees it when the op that used it is done; what was
  never used goes back (after a wait for its copy) when its layer's backward is over. (Holding
  every reload to the end of its layer's backward put the whole layer at the backward's peak,
  where autograd would have freed part of it: 6 MiB of 20 per layer in the GPU test of the
  whole-step peak.) By default (``prefetch=None``) the schedule never raises the
  step's peak: a layer's reload starts as soon as enough of the layers after it have finished
  their backward for its bytes to fit under the no-offload peak less what was offloaded (see
  :func:`reloads_at_backward_start` and :func:`reloads_at_region_end`). A layer's "region" is
  what ran inside its context (the MoE MLP, or the whole layer); when the region's backward is
  over its reloads are dropped and the next reload starts, so a layer's MLP reloads under the
  backward of the next layer's attention. ``prefetch=k`` instead starts layers ``i`` to ``i - k``
  when layer ``i``'s backward begins (more overlap, more memory at the peak);
* host buffers come from a pool shared by every teo context and reused from step to step (they go
  back to it when the backward ends; ``free_pinned_buffers`` empties it);
* no host synchronization anywhere: streams wait on events;
* ``TEO_OFFLOAD_COPY_CHUNK_MIB`` (default 0: one copy per saved range) splits each copy to the
  host into pieces of that many MiB. A small copy to the host on the compute stream (a ``.cpu()``
  of tokens per expert) waits on the copy engine behind the large copy in flight; in pieces it
  might go between two of them (``benchmarks/bench_copy_interference.py`` measures whether it
  does, and what the pieces cost: one launch each, from the forward's host path). Reloads stay
  whole copies (a step's small copies go to the host);
* one GPU per engine (the device of the first tensor it moves; tensors on others stay, said once
  in the log).

Deliberately kept on the GPU (documented limits): tensor subclasses other than TE's
``QuantizedTensor`` (e.g. ``GroupedTensor``: its bytes live in several buffers whose layout this
engine does not take apart; TE's own ops hand grouped storages to autograd as plain tensors), and
non-contiguous tensors with gaps between their elements (TE V2 keeps those too; dense permutations
such as a transpose do move, with their strides restored). Quantized tensors move part by part, as
V2 moves them. Refused under CUDA graph capture (the pool's buffers and the per-step events are
not capture-safe).
"""

from __future__ import annotations

import logging
import math
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from transformer_engine.pytorch import cpu_offload
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

from . import allocator_room, capture, policy
from .settings import mib_from_env

_log = logging.getLogger(__name__)

__all__ = ["COPY_CHUNK_ENV", "RELEASES", "make_room", "PinnedBufferPool", "TeoEngine", "sources_to_release", "copy_chunk_bytes", "copy_pieces", "default_pool", "free_pinned_buffers", "layers_to_reload",
           "make_teo_context", "peak_neutral_lead", "release_lag", "plan_saved", "reloads_at_backward_start",
           "reloads_at_region_end", "watch_region"]


# ---------------------------------------------------------------------------------------------
# What to do with one saved tensor (pure: no copies, testable without a GPU)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Keep:
    reason: str


@dataclass(frozen=True)
class Move:
    start: int  # first byte of the tensor's storage it needs
    nbytes: int


@dataclass
class Parts:
    """A QuantizedTensor taken apart as V2 does: a detached copy emptied by prepare_for_saving."""

    shell: Any
    tensors: list  # the parts, in prepare_for_saving order (None kept as None)
    plans: list


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one range of its storage without gaps or overlaps."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def byte_span(t: torch.Tensor) -> Optional[Move]:
    """The bytes of ``t``'s storage that hold its elements, if they form one range; else None."""
    if not _is_dense(t):
        return None
    itemsize = t.element_size()
    return Move(t.storage_offset() * itemsize, t.numel() * itemsize)


def plan_saved(t: torch.Tensor) -> Keep | Move | Parts:
    """What the engine does with saved tensor ``t`` of an offloaded layer: what TE V2 would move.

    Beyond the policy's marks (``policy.keep_reason``) that means V2's layout rules too: a
    non-contiguous tensor stays, unless TE asked for its base to move (``offload_base_tensor``,
    TE's interleaved q, k, v views), in which case the base's bytes move."""
    reason = policy.keep_reason(t)
    if reason is not None:
        return Keep(reason)
    if t.layout != torch.strided or t.is_conj() or t.is_neg():
        # raw bytes would lose what the layout or the lazy conj/neg bit says
        return Keep(f"layout {t.layout}, conj {t.is_conj()}, neg {t.is_neg()}: not plain strided bytes")
    if isinstance(t, QuantizedTensor):
        shell = t.detach()
        tensors, _ = shell.prepare_for_saving()
        return Parts(shell, list(tensors), [None if p is None else plan_saved(p) for p in tensors])
    if type(t) is not torch.Tensor:
        return Keep(f"a {type(t).__name__}, a tensor subclass this engine does not take apart")
    if getattr(t, "offload_base_tensor", False) and t._base is not None:
        span = byte_span(t._base)
    elif not t.is_contiguous():
        return Keep(f"non-contiguous (shape {tuple(t.shape)}, stride {t.stride()}): TE V2 keeps these too")
    else:
        span = byte_span(t)
    if span is None:
        return Keep(f"its base has gaps (shape {tuple(t._base.shape)}, stride {t._base.stride()})")
    return span


COPY_CHUNK_ENV = "TEO_OFFLOAD_COPY_CHUNK_MIB"


def copy_chunk_bytes() -> int:
    """Bytes per piece of a copy to the host per :data:`COPY_CHUNK_ENV` (0: whole copies)."""
    return mib_from_env(COPY_CHUNK_ENV, 0, "whole copies") << 20


def copy_pieces(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges that cover ``nbytes`` in pieces of ``chunk`` bytes (0: one piece)."""
    if chunk <= 0 or chunk >= nbytes:
        return [(0, nbytes)]
    return [(a, min(a + chunk, nbytes)) for a in range(0, nbytes, chunk)]


def layers_to_reload(layer: int, prefetch: int, offloaded_layers: int) -> list[int]:
    """Layers whose reload starts when layer ``layer``'s backward begins: itself, then ``prefetch`` more."""
    return [j for j in range(layer, layer - prefetch - 1, -1) if 0 <= j < offloaded_layers]


def release_lag(num_layers: int, model_layers: int) -> int:
    """How many layers after it an offloaded layer's GPU bytes are given back in forward: the
    forward then holds at most ``L - n`` layers' offloadable activations (at least the layer being
    run), as the peak at the start of backward does."""
    return max(model_layers - num_layers, 1)


RELEASES = ("layers", "memory")


def sources_to_release(due: list[tuple[int, int]], next_strict_bytes: Optional[int], end_bytes: Optional[int],
                       margin: int) -> list[int]:
    """``release="memory"``: which layers whose release is due (``due``: (layer, GPU bytes still held),
    oldest first) give their bytes back now.

    The layer schedule releases each at once, making the forward wait for its copies. Memory only
    has to stay under what the forward reaches at its end (the start of backward, the step's
    peak): a layer may be held while the memory the layer schedule reaches at the end of the next
    stretch of forward (``next_strict_bytes``, from the previous step) plus what stays held is
    within ``end_bytes`` (the previous step's memory at the start of backward) less ``margin``
    (room for what a stretch allocates and frees inside itself, which the figures at entries do
    not see). Without figures, all go. Oldest first: their copies end first.

    Steps assumed alike: a step shaped unlike the one before (other token counts per layer) may
    go above its own layer-schedule peak by up to what is held less the margin."""
    layers = [j for j, _ in due]
    if next_strict_bytes is None or end_bytes is None:
        return layers
    held = sum(n for _, n in due)
    out = []
    for j, n in due:
        if next_strict_bytes + held <= end_bytes - margin:
            break
        out.append(j)
        held -= n
    return out


def peak_neutral_lead(num_layers: int, model_layers: int) -> int:
    """How many layers ahead of its backward an offloaded layer may be back on the GPU without
    raising the step's peak: L - 1 - n (the peak, at the start of backward, holds the L - n
    layers not offloaded; each layer whose backward is over frees room for one reload). TE V2's
    default schedule uses the same distance, with its reloads at layer starts."""
    return max(model_layers - 1 - num_layers, 0)


def reloads_at_backward_start(layer: int, prefetch: Optional[int], num_layers: int, model_layers: int) -> list[int]:
    """Offloaded layers whose reload starts when layer ``layer``'s backward begins.

    ``prefetch=k``: ``layer`` and the ``k`` layers below it. ``prefetch=None`` (peak-neutral):
    ``layer`` itself (needed now) and the layer ``peak_neutral_lead`` below it, where TE V2 would
    start it (normally already started by :func:`reloads_at_region_end`)."""
    if prefetch is not None:
        return layers_to_reload(layer, prefetch, num_layers)
    lead = peak_neutral_lead(num_layers, model_layers)
    return [j for j in dict.fromkeys((layer, layer - lead)) if 0 <= j < num_layers]


def reloads_at_region_end(layer: int, prefetch: Optional[int], num_layers: int, model_layers: int) -> list[int]:
    """Offloaded layers whose reload starts when the backward of ``layer``'s region is over and its
    memory has gone back (peak-neutral schedule only): the layer ``peak_neutral_lead + 1`` below."""
    if prefetch is not None:
        return []
    j = layer - peak_neutral_lead(num_layers, model_layers) - 1
    return [j] if 0 <= j < num_layers else []


# ---------------------------------------------------------------------------------------------
# When a region's backward is over (autograd hooks; no GPU needed)
# ---------------------------------------------------------------------------------------------

_NO_SEQUENCE = 2**64 - 1  # AccumulateGrad nodes have no sequence number


def next_sequence_nr() -> Optional[int]:
    """A number below that of every autograd node created from now on in this thread (None when
    grad mode is off: nothing will be recorded)."""
    if not torch.is_grad_enabled():
        return None
    return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr()


def watch_region(output_fn, since: int, on_end: Callable[[], None]) -> tuple[int, int]:
    """Call ``on_end`` once, when the backward of the region that produced ``output_fn`` is over
    and autograd has released what the region saved: the nodes reachable from ``output_fn`` that
    were created after sequence number ``since``. Prehooks count the region's nodes as they begin;
    prehooks on the nodes just outside it call ``on_end`` once all have begun: autograd runs one
    device's nodes one at a time, so by then every region node has finished and released its saved
    tensors. (Prehooks, not post-hooks: a node with post-hooks keeps a copy of its incoming grads
    until they run.) If no such node runs later (the region's inputs are leaves, or a partial
    ``autograd.grad``), ``on_end`` is not called. Where autograd runs nodes on more than one
    thread (CPU-only grads beside a GPU's, a reentrant checkpoint's backward) the end may be
    reported early: that costs memory and overlap, not results (a later use reloads again).
    Returns (region nodes, nodes just outside)."""
    inside, outside, stack, seen = [], [], [output_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None:
            continue
        seq = fn._sequence_nr()
        if seq in seen or seq == _NO_SEQUENCE:
            continue
        seen.add(seq)
        if seq <= since:
            outside.append(fn)
            continue
        inside.append(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    if not inside:
        return 0, len(outside)
    state = {"pending": len(inside), "fired": False}

    def begins(*_):
        state["pending"] -= 1

    def next_begins(*_):
        if state["pending"] <= 0 and not state["fired"]:
            state["fired"] = True
            on_end()

    for fn in inside:
        fn.register_prehook(begins)
    for fn in outside:
        fn.register_prehook(next_begins)
    return len(inside), len(outside)


# ---------------------------------------------------------------------------------------------
# Pinned host buffers reused across steps
# ---------------------------------------------------------------------------------------------

_CLASSES_PER_OCTAVE = 8  # buffer sizes step by 2^(1/8): at most ~9% of a buffer is unused
_MIN_CLASS_BYTES = 64 * 1024
# A new buffer is this many classes larger than needed, so that a tensor a little larger next step
# (per-expert slices under new routing) still fits the buffer it had.
_HEADROOM_CLASSES = 1


def size_class(nbytes: int) -> int:
    """The index of the pool's size class for ``nbytes`` (a geometric series of sizes, so that
    slightly different sizes, e.g. per-expert slices under new routing, share buffers)."""
    if nbytes <= _MIN_CLASS_BYTES:
        return 0
    k = math.ceil(_CLASSES_PER_OCTAVE * math.log2(nbytes / _MIN_CLASS_BYTES))
    while class_bytes(k) < nbytes:  # float rounding
        k += 1
    while k > 0 and class_bytes(k - 1) >= nbytes:
        k -= 1
    return k


def class_bytes(k: int) -> int:
    """Bytes of a buffer of size class ``k`` (whole 512-byte blocks)."""
    size = math.ceil(_MIN_CLASS_BYTES * 2 ** (k / _CLASSES_PER_OCTAVE))
    return -(-size // 512) * 512


@dataclass
class HostBuffer:
    tensor: torch.Tensor  # uint8, pinned
    size_class: int
    ready: Any = None  # the event after the last GPU work that reads or writes it


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class PinnedBufferPool:
    """Pinned host buffers by size class; a buffer handed back is given out again, so a steady
    sequence of steps allocates pinned memory in its first step only."""

    def __init__(self, allocate: Callable[[int], torch.Tensor] = _pinned_bytes):
        self._allocate = allocate
        self._free: dict[int, list[HostBuffer]] = defaultdict(list)
        self.allocations = 0  # pinned buffers allocated so far
        self.allocated_bytes = 0  # their bytes (those dropped by clear() included)
        self.in_use = 0

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of at least ``nbytes``: a free one of its size class or up to an octave above."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        k = size_class(nbytes)
        for larger in range(k, k + _CLASSES_PER_OCTAVE + 1):
            bucket = self._free.get(larger)
            if bucket:
                self.in_use += 1
                return bucket.pop()
        k += _HEADROOM_CLASSES
        buf = HostBuffer(self._allocate(class_bytes(k)), k)
        self.allocations += 1
        self.allocated_bytes += class_bytes(k)
        self.in_use += 1
        return buf

    def release(self, buf: HostBuffer, ready: Any) -> None:
        """Give ``buf`` back; whoever takes it next waits for ``ready`` (an event) on the GPU first."""
        buf.ready = ready
        self.in_use -= 1
        self._free[buf.size_class].append(buf)

    @property
    def free_bytes(self) -> int:
        return sum(b.tensor.numel() for bucket in self._free.values() for b in bucket)

    def clear(self) -> None:
        """Drop the free buffers (those in use come back later and stay until the next clear)."""
        self._free.clear()


_DEFAULT_POOL: Optional[PinnedBufferPool] = None


def default_pool() -> PinnedBufferPool:
    """The pool every teo context shares unless given its own."""
    global _DEFAULT_POOL
    if _DEFAULT_POOL is None:
        _DEFAULT_POOL = PinnedBufferPool()
    return _DEFAULT_POOL


def free_pinned_buffers() -> None:
    """Drop the default pool's free buffers and return torch's cached pinned memory to the system."""
    if _DEFAULT_POOL is not None:
        _DEFAULT_POOL.clear()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


@dataclass
class _HostCopy:
    """One byte range of a GPU storage, copied to a host buffer (and back in backward)."""

    host: Optional[HostBuffer]  # None while the copy is put off (see TeoEngine._puts_off_copies)
    nbytes: int
    start: int  # where the range begins in the source storage (for views of it saved later)
    storage_ptr: int
    storage_ref: StorageWeakRef
    copied: Any  # event: the D2H copy is done (None: put off, not started)
    source: Optional[torch.Tensor] = None  # uint8 view of the GPU bytes, held until the copy is seen to end
    source_stream: Any = None  # the stream the tensor was saved on (its memory goes back there)
    gpu: Optional[torch.Tensor] = None  # uint8 bytes on the GPU (the reload, or the source) while reloaded
    reloaded: Any = None  # event: the H2D copy is done
    reload_stream: Any = None  # the stream the reload's memory was taken on
    waited: bool = False  # reload_stream waited for `reloaded`
    handles: int = 0  # handles to this range autograd holds (packs this step)
    unpacks: int = 0  # of those, unpacked in this backward: at `handles` the engine lets go of the reload
    layer: Optional[int] = None  # the layer that saved it
    ready: Any = None  # a put-off copy: the event after which its bytes may be read
    count: Optional[tuple] = None  # a put-off copy: (counter key, bytes) to count when it starts

    @property
    def used_up(self) -> bool:
        """Every handle autograd held to it has been unpacked in this backward."""
        return bool(self.handles) and self.unpacks >= self.handles


@dataclass
class _LayerCopies:
    copies: list = field(default_factory=list)
    reloaded: bool = False
    released: bool = False  # the forward gave the sources back


@dataclass(frozen=True)
class _Moved:
    """What autograd holds instead of an offloaded tensor."""

    step: int
    layer: int
    index: int
    byte_offset: int  # of the tensor in its host copy
    shape: tuple
    stride: tuple
    dtype: torch.dtype


@dataclass
class _PartsHandle:
    shell: Any
    handles: list


class TeoEngine:
    """Pack/unpack hooks and the schedule behind one teo context (one model's layers)."""

    def __init__(self, num_layers: int, model_layers: int, *, prefetch: Optional[int] = None,
                 counter: Any = None, pool: Optional[PinnedBufferPool] = None, release: str = "layers",
                 max_held_bytes: int = 0, memory_budget: Optional[int] = None):
        for name, value in (("num_layers", num_layers), ("model_layers", model_layers), ("prefetch", prefetch),
                            ("max_held_bytes", max_held_bytes), ("memory_budget", memory_budget)):
            if name in ("prefetch", "memory_budget") and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if model_layers < 1:
            raise ValueError(f"model_layers must be >= 1, got {model_layers}")
        if not 0 <= num_layers <= model_layers:
            raise ValueError(f"num_layers must be in 0..model_layers={model_layers}, got {num_layers}")
        if prefetch is not None and prefetch < 0:
            raise ValueError(f"prefetch must be >= 0 layers (or None: peak-neutral), got {prefetch}")
        if max_held_bytes < 0:
            raise ValueError(f"max_held_bytes must be >= 0 (0: wait for every copy at its layer's release), "
                             f"got {max_held_bytes}")
        if release not in RELEASES:
            raise ValueError(f"release must be one of {RELEASES}, got {release!r}")
        if memory_budget is not None:
            if memory_budget <= 0:
                raise ValueError(f"memory_budget must be a positive number of bytes (or None), got {memory_budget}")
            if release != "layers" or max_held_bytes:
                raise ValueError("memory_budget replaces the release schedule: it cannot be combined with "
                                 f"release={release!r} or max_held_bytes={max_held_bytes}")
        from .engines import active_engine  # engines imports this module lazily

        if active_engine() == "v1":
            # teo reads V2's marks; in a V1 process TE's modules leave V1's instead, so teo would
            # move their weights' non-Parameter copies (FP8 workspaces) along with activations.
            raise RuntimeError("the teo offload engine reads TE's V2 marks, but this process runs TE's V1 engine "
                               "(NVTE_CPU_OFFLOAD_V1=1 when transformer_engine was imported): run teo in a process "
                               "without NVTE_CPU_OFFLOAD_V1=1, or use offload_context('v1', ...)")
        self.num_layers, self.model_layers, self.prefetch = num_layers, model_layers, prefetch
        self.release = release
        self.max_held_bytes = max_held_bytes
        self.bytes_held_past_release = 0  # summed over releases: what stayed held instead of waited for (public)
        self.memory_budget = memory_budget
        # memory_budget: copies whose end the compute stream waited for to stay under it, and their bytes (public)
        self.budget_waits = 0
        self.budget_wait_bytes = 0
        self.budget_trace: Optional[list] = None  # a list: fit_budget records its waits there (diagnostic)
        self.reloads_deferred = 0  # prefetches put off for want of room under the budget (public)
        self.reloads_started_early = 0  # copies of a put-off prefetch started in the room there was (public)
        self._deferred_reloads: list[int] = []  # layers whose prefetch waits for room, in order
        # memory_budget: what ops allocated between one look and the next, learned per look from the
        # last two whole steps and kept free under the budget (see _fit)
        self._bursts: dict = {}  # look key -> bytes allocated after it, this step
        self._last_bursts: list[dict] = []  # the same, from the last two steps whose backward ran through
        self._backward_finished = False  # this step's backward ran through (finish_backward)
        self._look_seen: dict = {}  # look key -> how often seen this step (the key's last part)
        self._last_look: Optional[tuple] = None  # (key, memory at its end) of this step's last look
        self._bwd_layer: Optional[int] = None  # the layer whose backward began last (a look's key)
        self.budget_margin = 0  # the room kept at the last look for what ops allocate before the next (public)
        if memory_budget is not None:
            _BUDGET_ENGINES.add(self)
        # copies to the host whose GPU bytes the engine may still hold, in the copy stream's order
        self._in_flight: deque = deque()
        # release="memory": this step's and the last step's figures (bytes the allocator holds)
        self._memory = self._memory_allocated  # a seam for CPU tests
        self._room = allocator_room.short_of  # (sizes, device) -> those that would not fit: a seam for CPU tests
        self._most_room = allocator_room.most_room  # (device) -> bytes one allocation could get at most: a seam
        self.fits_given_up = 0  # looks where giving held bytes back could not make an allocation fit (public)
        self._strict_at_entry: dict[int, int] = {}
        self._end_bytes: Optional[int] = None
        self._layer_bytes = 0
        self._last_figures: Optional[tuple[dict, int, int]] = None  # (strict at entry, end, margin)
        self._had_figure_step = False
        # release="memory": how often a layer due for release was held instead (public, for tests)
        self.layers_held = 0
        self.counter = counter
        self.pool = pool if pool is not None else default_pool()
        self.copy_chunk = copy_chunk_bytes()
        self._d2h: Optional[torch.cuda.Stream] = None
        self._h2d: Optional[torch.cuda.Stream] = None
        self._device: Optional[torch.device] = None  # of the first tensor moved: reloads go there
        self.told_no_region_end = False
        self.told_extra_unpack = False
        self.told_abandoned_forward = False
        self.told_other_device = False
        # the last layer output's backward-boundary hook, weakly: it dies with that layer's autograd
        # graph, which in a forward that goes on stays referenced by what follows (None: unknown)
        self._last_graph: Optional[weakref.ref] = None
        self._step = 0
        self._fwd_layer: Optional[int] = None
        self._layers: dict[int, _LayerCopies] = {}
        self._finish_queued = False

    # -- forward ---------------------------------------------------------------------------

    def enter_layer(self) -> int:
        """A layer's forward begins; layer 0 again begins a new step. Returns the layer."""
        if self._forward_abandoned():
            self.abandon_step()
        self._last_graph = None  # the check looks at the previous layer's graph only (set by its sync)
        if self._fwd_layer is None or self._fwd_layer == self.model_layers - 1:
            self._end_step()  # a forward whose backward never ran (or raised) leaves its buffers here
            self._finish_queued = False
            self._fwd_layer = 0
        else:
            self._fwd_layer += 1
        j = self._fwd_layer
        if self.memory_budget is not None:  # no release schedule: held until copied or the budget needs them
            self.fit_budget(where="enter")
            return j
        self._drop_copied()
        due = j - release_lag(self.num_layers, self.model_layers)
        if self.release == "layers":
            self._release_sources(due)
        else:
            self._release_by_memory(j, due)
        return j

    def _forward_abandoned(self) -> bool:
        """A forward cut short between layers (an error outside the context, caught by the caller):
        its autograd graph is gone before its backward began. The next entry is then layer 0 of a
        new step; counting on from the cut would offset every later step's layers, and a step
        would end (its host buffers back to the pool) in the middle of the next forward."""
        if (self._fwd_layer is None or self._fwd_layer == self.model_layers - 1
                or self._last_graph is None or self._last_graph() is not None):
            return False
        if not self.told_abandoned_forward:
            self.told_abandoned_forward = True
            _log.info("teo: the forward stopped after layer %d of %d and its autograd graph was freed before "
                      "any backward: the next layer entered starts a new step", self._fwd_layer, self.model_layers)
        return True

    def note_layer_graph(self, hook: Optional[object]) -> None:
        """``sync`` hands the hook it put on the layer output's grad_fn (None: a frozen layer, no graph)."""
        self._last_graph = None if hook is None else weakref.ref(hook)

    def _memory_allocated(self) -> int:
        if self._device is None and not torch.cuda.is_available():
            return 0  # nothing can have moved: no figures to keep (every due layer is released)
        device = self._device if self._device is not None else torch.cuda.current_device()
        # the allocator's nested stats, not torch.cuda.memory_allocated: that one flattens and sorts
        # every statistic first, host time that a budget engine's few hundred looks a step pay
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        return stats["allocated_bytes"]["all"]["current"] if stats else 0

    def _held_bytes(self, layer: int) -> int:
        copies = self._layers.get(layer)
        if copies is None or copies.released:
            return 0
        return sum(c.nbytes for c in copies.copies if c.source is not None)

    def _release_by_memory(self, j: int, due: int) -> None:
        """``release="memory"``: layers due for release (``<= due``) are held while the last step's
        figures say the forward stays under its end-of-forward memory (:func:`sources_to_release`).

        The figure kept for entry ``j`` is the memory the layer schedule holds as the stretch before
        it ends (before its release at ``j``): what is held now less the layers it would have given
        back earlier (``< due``)."""
        pending = [(i, n) for i in sorted(self._layers) if i <= due for n in (self._held_bytes(i),) if n]
        self._strict_at_entry[j] = self._memory() - sum(n for i, n in pending if i < due)
        figures = self._last_figures
        if figures is None:
            go = [i for i, _ in pending]
        else:
            strict, end, margin = figures
            go = sources_to_release(pending, strict.get(j + 1, end), end, margin)
        self.layers_held += len(pending) - len(go)
        for i in go:
            self._release_sources(i)

    def layer_done(self, layer: int) -> None:
        """Layer ``layer``'s forward ended (its sync): a layer with no later one to release it at
        gives its bytes back now (under release="memory", the last layer gives back all still held;
        under memory_budget nothing goes on a schedule)."""
        if self.memory_budget is not None:
            return
        if layer + release_lag(self.num_layers, self.model_layers) >= self.model_layers:
            self._release_sources(layer)
        if self.release == "memory" and layer == self.model_layers - 1:
            for i in sorted(self._layers):
                self._release_sources(i)

    def _release_sources(self, layer: int) -> None:
        """``layer``'s GPU bytes go back: those still being copied once the compute stream has waited
        for their copies, except up to ``max_held_bytes`` of them (see :meth:`_hold_within_limit`)."""
        copies = self._layers.get(layer)
        if copies is None or copies.released or not copies.copies:
            return
        copies.released = True
        self._hold_within_limit()

    def _hold_within_limit(self) -> None:
        """Released layers' bytes whose copies have not ended (as far as the host has seen) stay on
        the GPU up to ``max_held_bytes``; past that, the oldest go back after the streams waited for
        their copies. What is held only shrinks between releases (:meth:`_drop_copied`), so the
        forward's memory stays within the layer schedule's plus ``max_held_bytes`` at every point."""
        held = [c for j in sorted(self._layers) if self._layers[j].released
                for c in self._layers[j].copies if c.source is not None]  # in copy order: layers release in order
        excess = sum(c.nbytes for c in held) - self.max_held_bytes
        cut = 0
        while excess > 0:
            excess -= held[cut].nbytes
            cut += 1
        self._wait_and_drop(held[:cut])
        self.bytes_held_past_release += sum(c.nbytes for c in held[cut:])

    def _drop_copied(self) -> bool:
        """The bytes of every copy to the host that has ended go back to the allocator: an event
        query, no wait (one copy stream runs the copies in order: the first not ended stops the scan).
        Whether any went back."""
        queue, dropped = self._in_flight, False
        while queue:
            c = queue[0]
            if c.source is not None:
                if c.copied is None or not c.copied.query():  # (a put-off copy ends only once started)
                    return dropped
                c.source = None  # its copy is over: the memory can be reused at once, in any stream's order
                dropped = True
            queue.popleft()
        return dropped

    def _note_burst(self, memory: int) -> None:
        """What ops allocated since the last look beyond what it announced, read before anything
        goes back at this one (bytes given back after the peak would hide it)."""
        if self._last_look is not None:
            last_key, last_end = self._last_look
            self._bursts[last_key] = max(self._bursts.get(last_key, 0), memory - last_end)
            self._last_look = None

    def fit_budget(self, incoming: int = 0, keep_layer: Optional[int] = None, where: str = "",
                   sizes: Sequence[int] = ()) -> None:
        """``memory_budget``: the copies the host sees ended give their bytes back; then, while the
        memory allocated plus ``incoming`` (bytes about to be allocated) is over the budget, the
        oldest GPU bytes still being copied go back after the streams waited for their copies (one
        at a time, the memory read again after each: bytes still used elsewhere free nothing).
        ``sizes``: the allocations ``incoming`` is made of, where known: while one of them would fit
        no free block and no memory the cap leaves to map (``allocator_room``: the allocator would
        give its cache back and remap, stalling every stream), held bytes go back the same way;
        none where giving back every held byte saved on this stream could not make room for the
        largest of them (``allocator_room.most_room``: counted in :attr:`fits_given_up`).
        (Freeing the oldest layer whole instead was measured: the allocator's retries under a cap
        stayed, and the waits grew; README, Status.)
        ``keep_layer``: a layer whose bytes are about to serve its backward in place stays.
        ``where``: what look this is, for :attr:`budget_trace` (a list there: one record per look
        that waited, with timing events around each wait; a diagnostic, off by default)."""
        if self.memory_budget is None:
            return
        memory = self._memory()
        self._note_burst(memory)
        if self._drop_copied():
            memory = self._memory()
        key = self._look_key(where)
        self.budget_margin = max((b.get(key, 0) for b in self._last_bursts), default=0)
        after = memory
        try:
            after = self._fit(memory, incoming, keep_layer, where, sizes)
        finally:
            self._last_look = (key, after + incoming)

    def _look_key(self, where: str) -> tuple:
        """A look's place in the step, the same from step to step: what looks, in which forward and
        backward layer, and how often such a look came before it in this step."""
        base = (where, self._fwd_layer, self._bwd_layer)
        seen = self._look_seen.get(base, 0)
        self._look_seen[base] = seen + 1
        return base + (seen,)

    def _fit(self, memory: int, incoming: int, keep_layer: Optional[int], where: str, sizes: Sequence[int]) -> int:
        """:meth:`fit_budget`'s waits. The room kept (``budget_margin``) is what ops allocated after
        this look in the last two steps before the engine looked again: saved-tensor hooks see an
        op's outputs only once it has made them, and a look that filled the budget with held copies
        left the peak over it by as much (measured without it: about 1 GiB over at base MLP 7/8; at
        wide MLP 7/8 the peak came at the last layer's MLP in the forward, 1 GiB held). Nothing is
        learned in the first step. Returns the memory after the waits (no second read where nothing
        was waited for: a read costs host time)."""
        over = memory + incoming + self.budget_margin - self.memory_budget
        short = [] if over > 0 or not sizes else self._short_of(sizes)
        if over <= 0 and not short:
            return memory
        freed = 0
        trace = self.budget_trace
        record = None if trace is None else {"where": where, "layer": self._fwd_layer, "bwd_layer": self._bwd_layer,
                                             "step": self._step,
                                             "memory": self._memory(), "incoming": incoming, "over": over,
                                             "margin": self.budget_margin, "waits": []}
        held = [c for c in self._in_flight if c.source is not None  # oldest first: copy order
                and not (keep_layer is not None and c.layer == keep_layer) and c.gpu is None]  # in place: frees nothing
        here = torch.cuda.current_stream(self._device) if self._device is not None else None
        # (bytes saved on another stream go back to that stream's pool: no room for this one's)
        fits = {id(c): c for c in held if c.source_stream is None or c.source_stream == here}
        hopeless = None  # whether giving back could not fit the largest short allocation: asked once
        for c in held:
            if over > 0:
                gone = self._drop_held(c, record, "budget")
                freed += gone
                over -= gone
                if over <= 0 and sizes:
                    short = self._short_of(sizes)
            elif id(c) in fits:
                if hopeless is None:
                    left = sum(f.nbytes for f in fits.values() if f.source is not None)
                    hopeless = max(short) > self._most_room(self._device) + left
                    self.fits_given_up += hopeless
                    if record is not None and hopeless:
                        record["gave_up"] = max(short)
                if hopeless:
                    break
                freed += self._drop_held(c, record, "fit")
                short = self._short_of(sizes)
            if over <= 0 and not short:
                break
        if record is not None and (record["waits"] or "gave_up" in record):
            trace.append(record)
        return memory - freed

    def _short_of(self, sizes: Sequence[int]) -> list:
        """The allocations of ``sizes`` the allocator could not serve now without a release of its cache."""
        return self._room(sizes, self._device) if self._device is not None else []

    def _drop_held(self, c: _HostCopy, record: Optional[dict], why: str) -> int:
        """One held copy's GPU bytes go back after the streams waited for its copy: the bytes freed."""
        before = self._memory()
        if record is not None:
            reach = torch.cuda.Event(enable_timing=True)
            reach.record(torch.cuda.current_stream(c.source.device))
        if c.copied is None:  # put off until the budget needed its bytes: now
            self._start_copy(c)
        self._wait_and_drop([c])
        self.budget_waits += 1
        self.budget_wait_bytes += c.nbytes
        freed = before - self._memory()
        if record is not None:
            resume = torch.cuda.Event(enable_timing=True)
            resume.record(torch.cuda.current_stream(self._device))
            record["waits"].append({"copy_of_layer": c.layer, "nbytes": c.nbytes, "freed": freed, "why": why,
                                    "events": (reach, resume)})
        return freed

    def _drop_sources(self, copies: "_LayerCopies", step_over: bool = False) -> None:
        """All of a layer's GPU bytes go back after the streams waited for its copies. A copy still
        put off goes without ever starting where nothing will read it again: its step is over, or
        autograd unpacked every handle it held to it. Otherwise (a region's end seen before all
        its uses, as multi-threaded autograd or a reentrant checkpoint can report it) it starts
        now and its bytes stay held until it ends, as any copy's: a later use finds them in place
        or reloads them, so an early end costs memory and copies, not results."""
        starting = set()
        for c in copies.copies:
            if c.copied is None and c.source is not None:
                if step_over or c.used_up:
                    c.source = None
                else:
                    self._start_copy(c)
                    starting.add(id(c))
        self._wait_and_drop([c for c in copies.copies if c.source is not None and id(c) not in starting])

    @staticmethod
    def _wait_and_drop(held: list) -> None:
        """The streams the sources were saved on, and the current one, wait for the copies to the
        host; then the bytes go back. (The memory returns to the stream it was allocated on, most
        often the one it was saved on or the current one; one copy stream runs the copies in
        order, so the last one's event covers them all.)"""
        if not held:
            return
        last = held[-1].copied
        streams = {c.source_stream for c in held if c.source_stream is not None}
        streams.add(torch.cuda.current_stream(held[0].source.device))
        for stream in streams:
            stream.wait_event(last)
        for c in held:
            c.source = None

    def abandon_step(self) -> None:
        """A layer's forward raised: this step's copies go back and the next entry is layer 0 of a
        new step (else every later step would be counted from the failed layer on)."""
        self._end_bytes = None  # no figures from a step that did not run through
        self._end_step()
        self._fwd_layer = None
        self._finish_queued = False
        self._last_graph = None

    def _end_step(self) -> None:
        """The step's host copies go back to the pool (a reuse waits for their last GPU use)."""
        if self.release == "memory":  # a step that reached its backward leaves its figures to the next
            if self._end_bytes is not None and self._strict_at_entry:
                # not the first such step's: buffers allocated once, in the middle of its forward,
                # would make its earlier figures low
                if self._had_figure_step:
                    self._last_figures = (dict(self._strict_at_entry), self._end_bytes, self._layer_bytes)
                self._had_figure_step = True
            self._strict_at_entry, self._end_bytes, self._layer_bytes = {}, None, 0
        self._in_flight.clear()
        self._deferred_reloads.clear()
        if self._bursts and self._backward_finished:  # a step that ran through: its bursts teach the next two
            self._last_bursts = [self._bursts] + self._last_bursts[:1]
        self._bursts, self._look_seen, self._last_look, self._bwd_layer = {}, {}, None, None
        self._backward_finished = False
        if not self._layers:
            return
        for layer in list(self._layers):
            self._release_reload(layer, step_over=True)
            self._drop_sources(self._layers[layer], step_over=True)
            for c in self._layers[layer].copies:
                if c.host is not None:  # (a copy put off and never started took no buffer)
                    self.pool.release(c.host, c.reloaded if c.reloaded is not None else c.copied)
        self._layers.clear()
        self._step += 1

    def pack(self, t: torch.Tensor) -> Any:
        if capture.capturing():
            raise capture.GraphCaptureError(_CAPTURE_MESSAGE)
        if self.memory_budget is not None:
            self.fit_budget(where="save")
        elif self._in_flight:
            self._drop_copied()
        layer = self._fwd_layer
        if layer is None or layer >= self.num_layers or not isinstance(t, torch.Tensor):
            return t
        if self._device is not None and t.device != self._device:
            if t.device.type != "cpu" and not self.told_other_device:  # host tensors stay anyway
                self.told_other_device = True
                _log.info("teo: tensors saved on %s stay there: one engine moves one GPU's tensors (%s's, the "
                          "first it moved); use one context per GPU", t.device, self._device)
            return t  # one GPU per engine: its copy streams and reloads live on the first one's
        return self._pack(plan_saved(t), t, t)

    def _pack(self, plan, t: torch.Tensor, owner: torch.Tensor) -> Any:
        if isinstance(plan, Keep):
            return t
        if isinstance(plan, Parts):
            return _PartsHandle(plan.shell, [None if p is None else self._pack(pl, p, owner)
                                             for p, pl in zip(plan.tensors, plan.plans)])
        return self._offload(t, plan, owner)

    def _offload(self, t: torch.Tensor, span: Move, owner: torch.Tensor) -> _Moved:
        layer = self._layers.setdefault(self._fwd_layer, _LayerCopies())
        storage = t.untyped_storage()
        ptr, itemsize = storage.data_ptr(), t.element_size()
        at = t.storage_offset() * itemsize  # the tensor's first byte (span may be its base's)
        found = None
        for i, c in enumerate(layer.copies):  # saved twice, or a view of a range already copied
            if (c.storage_ptr == ptr and c.start <= span.start and span.start + span.nbytes <= c.start + c.nbytes
                    and (at - c.start) % itemsize == 0 and not c.storage_ref.expired()):
                found = i
                break
        if found is None:
            count = self._count_key(t, owner, span.nbytes)
            if self._puts_off_copies(self._fwd_layer):
                c = self._host_copy(t, storage, span)
                c.count = count  # counted when (if) it starts
            else:
                c = self._copy_to_host(t, storage, span)
                self._count(count)
            c.layer = self._fwd_layer
            layer.copies.append(c)
            self._in_flight.append(c)
            found = len(layer.copies) - 1
        layer.copies[found].handles += 1
        return _Moved(self._step, self._fwd_layer, found, at - layer.copies[found].start,
                      tuple(t.shape), tuple(t.stride()), t.dtype)

    def _count_key(self, t: torch.Tensor, owner: torch.Tensor, nbytes: int) -> Optional[tuple]:
        """(counter key, bytes) that moving ``t`` adds to the counter (None: no counter): a tensor
        autograd saved counts whole, a part of a quantized one its range's bytes under that tensor."""
        if self.counter is None:
            return None
        return (self.counter.classify(owner), t.numel() * t.element_size() if t is owner else nbytes)

    def _count(self, count: Optional[tuple]) -> None:
        if count is not None:
            key, nbytes = count
            self.counter.bytes[key] += nbytes

    def _puts_off_copies(self, layer: int) -> bool:
        """Whether ``layer``'s copies to the host wait until the budget needs their bytes: under a
        ``memory_budget`` with every layer offloaded (n = L), the last layer's. Its backward comes
        first, so its bytes are back on the GPU when the backward begins under any schedule: copied
        at once, they would take the copy engine from the layers before it and come back at once
        (measured at base MLP 8/8: 16 ms of the first layer's backward waiting, against 7 at 7/8).
        Kept, they serve its backward in place, unless the budget asks for their room first."""
        return self.memory_budget is not None and self.num_layers == self.model_layers == layer + 1

    def _streams(self, device=None):
        if self._d2h is None:  # on the model's device, which need not be the current one
            self._d2h, self._h2d = torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)
        return self._d2h, self._h2d

    def _copy_to_host(self, t: torch.Tensor, storage, span: Move) -> _HostCopy:
        """``t``'s range ``span`` of ``storage``, its copy to the host queued at once."""
        c = self._host_copy(t, storage, span)
        self._start_copy(c)
        return c

    def _host_copy(self, t: torch.Tensor, storage, span: Move) -> _HostCopy:
        """The record of ``t``'s range ``span`` of ``storage``, held on the GPU, its copy not yet queued."""
        self._streams(t.device)
        if self._device is None:
            self._device = t.device
        saved_on = torch.cuda.current_stream(t.device)
        ready = getattr(t, "start_reload_event", None)  # TE's start_offload: ready before it was saved
        if ready is None:
            ready = torch.cuda.Event()
            ready.record(saved_on)
        # from a 512-byte boundary of the storage: a reloaded view keeps its address's alignment
        start = span.start - span.start % 512
        span = Move(start, span.start + span.nbytes - start)
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, span.start, (span.nbytes,), (1,))
        # the engine holds the bytes (src) until the copy ends or the budget or a release needs them
        # back, where the stream it was saved on waits for the copy (a side stream inside the
        # context: that stream's pool gets the memory back)
        return _HostCopy(None, span.nbytes, span.start, storage.data_ptr(), StorageWeakRef(storage), None, src,
                         saved_on, ready=ready)

    def _start_copy(self, c: _HostCopy) -> None:
        """Queues ``c``'s copy to a pinned host buffer on the copy stream (counted if it was put off)."""
        d2h, _ = self._streams(self._device)
        host = self.pool.acquire(c.nbytes)
        d2h.wait_event(c.ready)
        if host.ready is not None:
            d2h.wait_event(host.ready)  # last step's reload from this buffer
        with torch.cuda.stream(d2h):
            for a, b in copy_pieces(c.nbytes, self.copy_chunk):
                host.tensor[a:b].copy_(c.source[a:b], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(d2h)
        c.host, c.copied, c.ready = host, copied, None
        self._count(c.count)
        c.count = None

    # -- backward --------------------------------------------------------------------------

    def backward_boundary(self, layer: int) -> None:
        """Layer ``layer``'s backward begins: drop later layers' reloads, reload this one and prefetch."""
        self._note_forward_end()
        if self.memory_budget is not None:  # before the releases below give bytes back
            self._note_burst(self._memory())
        self._bwd_layer = layer
        if not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self._finish_queued = True
        for done in [j for j in self._layers if j > layer]:
            self._release_reload(done)
        self.fit_budget(keep_layer=layer, where="backward")  # (its held bytes serve it in place)
        for j in reloads_at_backward_start(layer, self.prefetch, self.num_layers, self.model_layers):
            self._reload(j, prefetch=j != layer)

    def _note_forward_end(self) -> None:
        """release="memory": the memory at the start of backward (the step's peak) and the largest
        layer's offloaded bytes (the margin), once per step."""
        if self.release == "memory" and self._end_bytes is None:
            self._end_bytes = self._memory()
            self._layer_bytes = max((sum(c.nbytes for c in lc.copies) for lc in self._layers.values()), default=0)

    def region_backward_done(self, layer: int) -> None:
        """The backward of what ran in layer ``layer``'s context is over and autograd released its
        saved tensors: its reloads go back to the allocator, and the next reload may start."""
        self._release_reload(layer)
        self._retry_deferred_reloads()
        for j in reloads_at_region_end(layer, self.prefetch, self.num_layers, self.model_layers):
            self._reload(j, prefetch=True)

    def finish_backward(self) -> None:
        """The backward is over: its reloads are dropped and its host buffers go back to the pool,
        as TE's engines do (so a second backward through the same graph is refused)."""
        self._finish_queued = False
        self._backward_finished = True
        self._end_step()

    def _retry_deferred_reloads(self) -> None:
        """memory_budget: prefetches put off for want of room start, in order, once they fit."""
        while self._deferred_reloads:
            layer = self._deferred_reloads[0]
            copies = self._layers.get(layer)
            if copies is None or copies.reloaded:  # gone, or reloaded for a use meanwhile
                self._deferred_reloads.pop(0)
            elif not self._reload(layer, prefetch=True):  # started: _reload took it off the list
                return

    def _reload(self, layer: int, prefetch: bool = False) -> bool:
        """Queues ``layer``'s copies back to the GPU; False where a ``prefetch`` under a memory
        budget was put off in whole or in part: the copies that fit the room under the budget
        start now, the last saved first (the backward uses them first); the rest start at a later
        region's end once the backward has freed room, or at the layer's first use (not at each
        use, where an op is about to allocate)."""
        copies = self._layers.get(layer)
        if copies is None or copies.reloaded or not copies.copies:
            return True
        if self.memory_budget is not None:  # the reloads below allocate: room first (the layer's own held bytes stay)
            pending = [c for c in copies.copies
                       if c.source is None and not c.used_up and c.gpu is None and c.copied is not None]
            sizes = [c.nbytes for c in pending]
            self.fit_budget(sum(sizes), keep_layer=layer, where="reload", sizes=sizes)
            limit = self.memory_budget - self.budget_margin  # the room ops took after this look last step
            if prefetch and sizes and self._memory() + sum(sizes) > limit:
                if layer not in self._deferred_reloads:
                    self._deferred_reloads.append(layer)
                    self.reloads_deferred += 1
                room, now = limit - self._memory(), []
                for c in reversed(pending):
                    if c.nbytes > room:
                        break
                    room -= c.nbytes
                    now.append(c)
                while now and self._short_of([c.nbytes for c in now]):  # only where the allocator has the blocks
                    now.pop()
                if self._last_look is not None:  # the look announced the whole layer: count what starts
                    key, end = self._last_look
                    self._last_look = (key, end - sum(sizes) + sum(c.nbytes for c in now))
                self._start_reloads(now)
                self.reloads_started_early += len(now)
                return False
            if layer in self._deferred_reloads:
                self._deferred_reloads.remove(layer)
        copies.reloaded = True  # first: a raise below leaves what was started for _release_reload to wait on
        for c in copies.copies:
            if c.source is not None:  # never given back (a backward before the release): no copy needed
                c.gpu, c.reloaded, c.waited = c.source, None, True
        # not those used up in an earlier reload of this layer (an unpack past the count copies it
        # back), nor those a put-off prefetch already started, nor those never copied (put off, and
        # let go at their layer's end: an unpack after it raises there)
        self._start_reloads([c for c in copies.copies
                             if c.source is None and not c.used_up and c.gpu is None and c.copied is not None])
        return True

    def _start_reloads(self, copies: list) -> None:
        if not copies:
            return
        _, h2d = self._streams(self._device)
        # Reloads are allocated on the compute stream, whose earlier kernels may still use the
        # memory the allocator hands out: the copy stream starts after them.
        h2d.wait_stream(torch.cuda.current_stream(self._device))
        for c in copies:
            self._reload_copy(c, h2d)

    def _reload_copy(self, c: _HostCopy, h2d) -> None:
        """Queues one range's copy back into new memory taken on the compute stream (``h2d`` has
        waited for the compute stream's work so far)."""
        compute = torch.cuda.current_stream(self._device)
        c.gpu = torch.empty(c.nbytes, dtype=torch.uint8, device=self._device)
        c.reload_stream = compute
        h2d.wait_event(c.copied)
        with torch.cuda.stream(h2d):
            c.gpu.copy_(c.host.tensor[: c.nbytes], non_blocking=True)
        # No record_stream: a block freed under it is reusable only once the host has seen the
        # copy stream pass the free, which a host running ahead of a busy copy stream does not, so
        # the allocator takes new memory for the next reload and the peak grows by a layer each
        # time. The compute stream waits for the copy instead (at the first use, or in
        # _release_reload for a reload never used), and the memory goes back in its order.
        c.reloaded = torch.cuda.Event()
        c.reloaded.record(h2d)
        c.waited = False

    def _release_reload(self, layer: int, step_over: bool = False) -> None:
        copies = self._layers.get(layer)
        if copies is None or not (copies.reloaded or any(c.reloaded is not None and c.gpu is not None
                                                          for c in copies.copies)):  # (nor started in part)
            return
        if layer in self._deferred_reloads:  # started in part, its backward over: not to be started again
            self._deferred_reloads.remove(layer)
        self._drop_sources(copies, step_over)  # its backward is over
        for c in copies.copies:
            if c.gpu is not None and c.reloaded is not None and not c.waited:  # a prefetch never used
                c.reload_stream.wait_event(c.reloaded)  # its copy may still run
                c.waited = True
            c.gpu = None  # back to the allocator on the stream it came from, after the copy in stream order
        copies.reloaded = False  # the host copy stays valid until the next step (retain_graph)

    def unpack(self, handle: Any) -> Any:
        if isinstance(handle, _PartsHandle):
            handle.shell.restore_from_saved([None if h is None else self.unpack(h) for h in handle.handles])
            return handle.shell
        if self.memory_budget is not None:
            self.fit_budget(where="use")
        if not isinstance(handle, _Moved):
            return handle
        if handle.step != self._step:
            raise RuntimeError(
                f"teo offload: a tensor saved in step {handle.step} is used after that step ended (its backward "
                "finished, or the next forward began) and its host buffer went back to the pool. teo runs one "
                f"forward then one backward per step (model_layers={self.model_layers} context entries make a "
                "step); a second backward through the same graph (retain_graph=True) is not supported")
        self._reload(handle.layer)  # no-op when prefetched
        c = self._layers[handle.layer].copies[handle.index]
        if c.gpu is None and c.copied is None:
            raise RuntimeError(
                f"teo offload: a saved tensor of layer {handle.layer} was unpacked more often than it was saved, "
                "after its layer's backward ended; its copy to the host was put off (the last layer's, under "
                "memory_budget with every layer offloaded) and its GPU bytes went back at its last counted use, "
                "so there is nothing to bring back")
        if c.gpu is None:  # used more often than autograd held handles to it: bring it back again
            if not self.told_extra_unpack:
                self.told_extra_unpack = True
                _log.info("teo: a saved tensor of layer %d was unpacked more often than it was saved; it is "
                          "copied back again (host to device traffic that a single unpack would not need)",
                          handle.layer)
            _, h2d = self._streams(self._device)
            h2d.wait_stream(torch.cuda.current_stream(self._device))
            self._reload_copy(c, h2d)
        if c.reloaded is not None:
            stream = torch.cuda.current_stream(c.gpu.device)
            if stream == c.reload_stream:
                if not c.waited:
                    stream.wait_event(c.reloaded)
                    c.waited = True
            else:  # used on a side stream: it waits too, and the memory is not reused before it is done
                stream.wait_event(c.reloaded)
                c.gpu.record_stream(stream)
        # c.gpu starts at byte c.start of the tensor's storage (a source) or at 0 of its own (a reload)
        out = torch.empty(0, dtype=handle.dtype, device=c.gpu.device).set_(
            c.gpu.untyped_storage(), (c.gpu.storage_offset() + handle.byte_offset) // handle.dtype.itemsize,
            handle.shape, handle.stride)
        c.unpacks += 1
        if c.reloaded is not None and c.unpacks >= c.handles:
            # its last use: autograd holds the only reference and frees it once the op using it is
            # done (in the compute stream's order: that stream waited for the copy above, or the
            # side stream that uses it recorded itself on it)
            c.gpu = None
        return out


_CAPTURE_MESSAGE = (
    "the teo offload engine cannot run under CUDA graph capture: it takes pinned host buffers from a "
    "pool and records events per step, which a replayed graph would not redo. Capture with TE's V2 "
    "engine (te_offload_ops.engines.offload_context('v2', ..., retain_pinned_cpu_buffers=True)) or run "
    "the offloaded layers outside the graph")


class _BackwardBoundary:
    """The prehook on a layer output's grad_fn that starts the layer's backward in the engine; it
    lives as long as that autograd graph, which the engine watches through a weak reference."""

    __slots__ = ("engine", "layer", "__weakref__")

    def __init__(self, engine: TeoEngine, layer: int):
        self.engine, self.layer = engine, layer

    def __call__(self, _grads):
        self.engine.backward_boundary(self.layer)


class TeoContext:
    """The context and synchronization function of one teo engine, used as TE's pair is."""

    def __init__(self, engine: TeoEngine):
        self.engine = engine
        self._layer: Optional[int] = None
        self._inside = False
        self._hooks = None
        self._previous_te_sync = None
        self._since: Optional[int] = None  # autograd nodes after this one ran in the context

    def __enter__(self):
        if capture.capturing():
            raise capture.GraphCaptureError(_CAPTURE_MESSAGE)
        current_node = getattr(torch._C, "_current_autograd_node", None)
        if current_node is not None and current_node() is not None:
            raise RuntimeError(
                "teo offload context entered during a backward pass (activation recomputation?): teo counts "
                "one forward then one backward per step and cannot offload a recomputed layer; keep "
                "recomputed layers outside its context or use TE's V2 engine")
        if self._inside:
            raise RuntimeError("teo offload context entered again before its sync function was called")
        self._inside = True
        self._layer = self.engine.enter_layer()
        self._since = next_sequence_nr() if self.engine.num_layers else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.engine.pack, self.engine.unpack)
        self._hooks.__enter__()
        # TE's modules mark their weights and start offloads only while an engine is on: show
        # them this one (V2 semantics), as TE's own context does.
        self._previous_te_sync = cpu_offload.OFFLOAD_SYNCHRONIZER
        cpu_offload.OFFLOAD_SYNCHRONIZER = self.engine
        return self

    def __exit__(self, *exc):
        cpu_offload.OFFLOAD_SYNCHRONIZER = self._previous_te_sync
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._inside = False
        if exc[0] is not None:  # e.g. an op's error for bad input: the process goes on with a new step
            self.engine.abandon_step()
        return False

    def sync(self, tensor: torch.Tensor) -> torch.Tensor:
        """Marks the end of the layer just run: its backward begins where ``tensor``'s grad arrives."""
        if self._inside:
            raise RuntimeError("teo offload sync function called inside its context; call it after the layer")
        if self._layer is None:
            raise RuntimeError("teo offload sync function called before the context was ever entered")
        if isinstance(tensor, torch.Tensor) and not tensor.requires_grad:
            self.engine.layer_done(self._layer)
            self.engine.note_layer_graph(None)
            return tensor  # a frozen layer: nothing of it was saved for a backward
        if not isinstance(tensor, torch.Tensor) or tensor.grad_fn is None:
            raise ValueError(
                "teo offload sync function needs the layer's output, a tensor with a grad_fn (requires_grad "
                f"and not a leaf); got {type(tensor).__name__} with requires_grad="
                f"{getattr(tensor, 'requires_grad', None)}")
        layer, engine = self._layer, self.engine
        engine.layer_done(layer)
        boundary = _BackwardBoundary(engine, layer)
        tensor.grad_fn.register_prehook(boundary)
        engine.note_layer_graph(boundary)
        if self._since is not None:
            _, after = watch_region(tensor.grad_fn, self._since, lambda: engine.region_backward_done(layer))
            if not after and layer > 0 and not engine.told_no_region_end:
                engine.told_no_region_end = True
                _log.info("teo: nothing in autograd follows layer %d's region (its inputs are leaves?): its "
                          "backward's end is not seen, and reloads start only at layer starts", layer)
        return tensor


def make_teo_context(num_layers: int, model_layers: int, *, prefetch: Optional[int] = None, counter: Any = None,
                     pool: Optional[PinnedBufferPool] = None, release: str = "layers", max_held_bytes: int = 0,
                     memory_budget: Optional[int] = None):
    """``(context, sync_function)`` of a new teo engine (see the module docstring)."""
    ctx = TeoContext(TeoEngine(num_layers, model_layers, prefetch=prefetch, counter=counter, pool=pool,
                               release=release, max_held_bytes=max_held_bytes, memory_budget=memory_budget))
    return ctx, ctx.sync


# engines with a memory budget, alive: make_room reaches them without a handle
_BUDGET_ENGINES: "weakref.WeakSet[TeoEngine]" = weakref.WeakSet()


def make_room(nbytes: Any, device: Any = None) -> None:
    """An op is about to allocate ``nbytes`` on ``device`` (None: any) outside the engine's view: an
    int, or one int per allocation (their sizes let the engine also check that each fits a free
    block under a cap). Every live teo engine with a ``memory_budget`` on that device gives back,
    after a wait for their copies, as many of the GPU bytes it still holds as keep the allocation
    within its budget and each announced allocation servable without a release of the allocator's
    cache. Cheap where no engine has a budget (the fused MLP calls it before its large outputs)."""
    total_only = isinstance(nbytes, int) and not isinstance(nbytes, bool)  # a total: not one allocation
    sizes = [nbytes] if total_only else nbytes
    if not isinstance(sizes, (list, tuple)) or not sizes or \
            any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
        raise ValueError("make_room takes the bytes about to be allocated, an int >= 0 or a list of them "
                         f"(one per allocation); got {nbytes!r}")
    if not _BUDGET_ENGINES or capture.capturing():  # a capture cannot query or wait on the engine's events
        return
    want = None if device is None else torch.device(device)
    if want is not None and want.type == "cuda" and want.index is None:
        want = torch.device("cuda", torch.cuda.current_device())
    for engine in list(_BUDGET_ENGINES):
        if want is None or engine._device is None or engine._device == want:
            engine.fit_budget(sum(sizes), where="make_room", sizes=() if total_only else list(sizes))
