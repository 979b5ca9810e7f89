"""teo's engine: saved-tensor hooks that move offloaded layers' activations to pinned host memory.

What moves is what TE V2 would move (:mod:`.plan`); when the GPU bytes go back in the forward and
when reloads start is the :mod:`.schedule` strategy's call. The engine does the rest:

* forward: each saved tensor of the first ``n`` layers starts its copy to pinned host memory the
  moment it is saved (on a copy stream, after the event TE's ``start_offload`` recorded, or one
  recorded then), unless the schedule puts it off. The engine holds the GPU bytes until their copy
  ends: the copies the host sees ended (an event query, no wait) give their bytes back. What is
  still held when a layer's backward begins serves it in place (no copy back);
* backward: reloads run on a second stream, into memory taken on the compute stream after the
  work queued there so far; a saved tensor's first use makes the compute stream wait for its own
  reload only. A reload goes back to the allocator as a tensor kept on the GPU does: the engine
  lets go of it at the last use it counted (as many unpacks as autograd holds handles to it),
  leaving the tensor to autograd, which frees it when the op that used it is done; what was never
  used goes back (after a wait for its copy) when its layer's region is over;
* host buffers come from a pool shared by every teo context, reused from step to step;
* no host synchronization anywhere: streams wait on events;
* one GPU per engine (the device of the first tensor it moves; tensors on others stay, said once
  in the log).

Each range moved is a :class:`.copies.HostCopy`, whose state machine refuses a wrong transition.
Deliberately kept on the GPU (documented limits): tensor subclasses other than TE's
``QuantizedTensor`` (e.g. ``GroupedTensor``), and non-contiguous tensors with gaps between their
elements (TE V2 keeps those too; dense permutations such as a transpose move, with their strides
restored). Quantized tensors move part by part, as V2 moves them. Refused under CUDA graph capture
(the pool's buffers and the per-step events are not capture-safe).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ... import capture, hints, te_internals
from .budget import BudgetSchedule, check_int
from .copies import CopyState, HostCopy, LayerCopies, Moved, StepCopies, queue_copy_to_host, queue_reload
from .copies import wait_and_give_back
from .plan import Keep, Move, Parts, plan_saved
from .pool import PinnedBufferPool, default_pool
from .schedule import LayerSchedule, Schedule, reloads_at_backward_start, reloads_at_region_end

__all__ = ["CAPTURE_MESSAGE", "PartsHandle", "TeoEngine"]

_log = logging.getLogger(__package__)  # teo's messages, one logger

CAPTURE_MESSAGE = (
    "the teo offload engine cannot run under CUDA graph capture: it takes pinned host buffers from a "
    "pool and records events per step, which a replayed graph would not redo. Capture with TE's V2 "
    "engine (te_offload_ops.engines.offload_context('v2', ..., retain_pinned_cpu_buffers=True)) or run "
    "the offloaded layers outside the graph")


class PartsHandle:
    """What autograd holds instead of a quantized tensor whose parts moved."""

    __slots__ = ("shell", "handles")

    def __init__(self, shell: Any, handles: list):
        self.shell, self.handles = shell, handles


class TeoEngine:
    """Pack/unpack hooks behind one teo context (one model's layers); the schedule says when."""

    def __init__(self, num_layers: int, model_layers: int, *, counter: Any = None,
                 pool: Optional[PinnedBufferPool] = None, memory_budget: Optional[int] = None,
                 reload_ahead: int = 0):
        check_int("num_layers", num_layers)
        check_int("model_layers", model_layers)
        check_int("reload_ahead", reload_ahead)
        if reload_ahead < 0:
            raise ValueError(f"reload_ahead must be >= 0 (layers), got {reload_ahead}")
        if memory_budget is not None:
            check_int("memory_budget", memory_budget)
        if model_layers < 1:
            raise ValueError(f"model_layers must be >= 1, got {model_layers}")
        if not 0 <= num_layers <= model_layers:
            raise ValueError(f"num_layers must be in 0..model_layers={model_layers}, got {num_layers}")
        if memory_budget is not None and memory_budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes (or None), got {memory_budget}")
        if te_internals.uses_te_v1_offload():
            # teo reads V2's marks; in a V1 process TE's modules leave V1's instead, so teo would
            # move their weights' non-Parameter copies (FP8 workspaces) along with activations.
            raise RuntimeError("the teo offload engine reads TE's V2 marks, but this process runs TE's V1 engine "
                               "(NVTE_CPU_OFFLOAD_V1=1 when transformer_engine was imported): run teo in a process "
                               "without NVTE_CPU_OFFLOAD_V1=1, or use offload_context('v1', ...)")
        self.num_layers, self.model_layers = num_layers, model_layers
        self.reload_ahead = reload_ahead
        self.counter = counter
        self.pool = pool if pool is not None else default_pool()
        self.schedule: Schedule = LayerSchedule() if memory_budget is None else BudgetSchedule(memory_budget)
        self.schedule.attach(self)
        if memory_budget is not None:
            hints.listen(self.schedule)  # ops' announcements reach it while this engine lives
        self.copies = StepCopies()
        self.device: Optional[torch.device] = None  # of the first tensor moved: reloads go there
        self.d2h: Optional[torch.cuda.Stream] = None
        self.h2d: Optional[torch.cuda.Stream] = None
        self.step = 0
        self.fwd_layer: Optional[int] = None
        self.in_step = False  # between a step's first layer entry and its end
        self.told_no_region_end = False
        self.told_extra_unpack = False
        self.told_abandoned_forward = False
        self.told_other_device = False
        # the last layer output's backward-boundary hook, weakly: it dies with that layer's autograd
        # graph, which in a forward that goes on stays referenced by what follows (None: unknown)
        self._last_graph: Optional[weakref.ref] = None
        self._finish_queued = False

    # -- the budget's figures (None / 0 under the layer schedule) ----------------------------

    @property
    def memory_budget(self) -> Optional[int]:
        return self.schedule.memory_budget

    def _budget_count(self, name: str):
        return getattr(self.schedule, name, 0)

    budget_waits = property(lambda self: self._budget_count("waits"),
                            doc="copies whose end the compute stream waited for to stay under the budget")
    budget_wait_bytes = property(lambda self: self._budget_count("wait_bytes"), doc="their bytes")
    reloads_deferred = property(lambda self: self._budget_count("reloads_deferred"),
                                doc="prefetches put off for want of room under the budget")
    reloads_started_early = property(lambda self: self._budget_count("reloads_started_early"),
                                     doc="copies of put-off prefetches started in the room there was")
    fits_given_up = property(lambda self: self._budget_count("fits_given_up"),
                             doc="looks where giving held bytes back could not make an allocation fit")
    budget_margin = property(lambda self: self._budget_count("margin"),
                             doc="the room the last look kept for what ops allocate before the next")

    @property
    def budget_trace(self) -> Optional[list]:
        """A list to record each look that waited in (a diagnostic; None: off)."""
        return getattr(self.schedule, "trace", None)

    @budget_trace.setter
    def budget_trace(self, records: Optional[list]) -> None:
        self.schedule.trace = records

    # -- forward ---------------------------------------------------------------------------

    def enter_layer(self) -> int:
        """A layer's forward begins; layer 0 again begins a new step. Returns the layer."""
        if self._forward_abandoned():
            self.abandon_step()
        self._last_graph = None  # the check looks at the previous layer's graph only (set by its sync)
        if self.fwd_layer is None or self.fwd_layer == self.model_layers - 1:
            self._end_step()  # a forward whose backward never ran (or raised) leaves its buffers here
            self._finish_queued = False
            self.fwd_layer = 0
        else:
            self.fwd_layer += 1
        self.in_step = True
        self.schedule.layer_entered(self.fwd_layer)
        return self.fwd_layer

    def _forward_abandoned(self) -> bool:
        """A forward cut short between layers (an error outside the context, caught by the caller):
        its autograd graph is gone before its backward began. The next entry is then layer 0 of a
        new step; counting on from the cut would offset every later step's layers, and a step
        would end (its host buffers back to the pool) in the middle of the next forward."""
        if (self.fwd_layer is None or self.fwd_layer == self.model_layers - 1
                or self._last_graph is None or self._last_graph() is not None):
            return False
        if not self.told_abandoned_forward:
            self.told_abandoned_forward = True
            _log.info("teo: the forward stopped after layer %d of %d and its autograd graph was freed before "
                      "any backward: the next layer entered starts a new step", self.fwd_layer, self.model_layers)
        return True

    def note_layer_graph(self, hook: Optional[object]) -> None:
        """``sync`` hands the hook it put on the layer output's grad_fn (None: a frozen layer, no graph)."""
        self._last_graph = None if hook is None else weakref.ref(hook)

    def layer_done(self, layer: int) -> None:
        """Layer ``layer``'s forward ended (its sync)."""
        self.schedule.layer_done(layer)

    def abandon_step(self) -> None:
        """A layer's forward raised: this step's copies go back and the next entry is layer 0 of a
        new step (else every later step would be counted from the failed layer on)."""
        self._end_step(ran_through=False)
        self.fwd_layer = None
        self._finish_queued = False
        self._last_graph = None

    def _end_step(self, ran_through: bool = False) -> None:
        """The step's host copies go back to the pool (a reuse waits for their last GPU use)."""
        self.schedule.step_ended(ran_through)
        self.in_step = False
        self.copies.in_flight.clear()
        layers = self.copies.layers
        if not layers:
            return
        for layer in list(layers):
            self.release_reload(layer, step_over=True)
            self._drop_sources(layers[layer], step_over=True)
            for c in layers[layer].copies:
                if c.host is not None:  # (a copy put off and never started took no buffer)
                    self.pool.release(c.host, c.reloaded if c.reloaded is not None else c.copied)
        self.copies.clear()
        self.step += 1

    def pack(self, t: torch.Tensor) -> Any:
        if capture.capturing():
            raise capture.GraphCaptureError(CAPTURE_MESSAGE)
        self.schedule.saving()
        layer = self.fwd_layer
        if layer is None or layer >= self.num_layers or not isinstance(t, torch.Tensor):
            return t
        if self.device is not None and t.device != self.device:
            if t.device.type != "cpu" and not self.told_other_device:  # host tensors stay anyway
                self.told_other_device = True
                _log.info("teo: tensors saved on %s stay there: one engine moves one GPU's tensors (%s's, the "
                          "first it moved); use one context per GPU", t.device, self.device)
            return t  # one GPU per engine: its copy streams and reloads live on the first one's
        return self._pack(plan_saved(t), t, t)

    def _pack(self, plan, t: torch.Tensor, owner: torch.Tensor) -> Any:
        if isinstance(plan, Keep):
            return t
        if isinstance(plan, Parts):
            return PartsHandle(plan.shell, [None if p is None else self._pack(pl, p, owner)
                                            for p, pl in zip(plan.tensors, plan.plans)])
        return self._offload(t, plan, owner)

    def _offload(self, t: torch.Tensor, span: Move, owner: torch.Tensor) -> Moved:
        layer = self.fwd_layer
        copies = self.copies.layers.setdefault(layer, LayerCopies())
        storage = t.untyped_storage()
        ptr, itemsize = storage.data_ptr(), t.element_size()
        at = t.storage_offset() * itemsize  # the tensor's first byte (span may be its base's)
        found = None
        for i, c in enumerate(copies.copies):  # saved twice, or a view of a range already copied
            if (c.storage_ptr == ptr and c.start <= span.start and span.start + span.nbytes <= c.start + c.nbytes
                    and (at - c.start) % itemsize == 0 and not c.storage_ref.expired()):
                found = i
                break
        if found is None:
            c = self._held_copy(t, storage, span)
            c.layer, c.count = layer, self._count_key(t, owner, span.nbytes)
            found = self.copies.add(layer, c)
            if not self.schedule.puts_off_copies(layer):
                self.start_copy(c)
        copy = copies.copies[found]
        copy.handles += 1
        return Moved(self.step, layer, found, at - copy.start, tuple(t.shape), tuple(t.stride()), t.dtype)

    def _count_key(self, t: torch.Tensor, owner: torch.Tensor, nbytes: int) -> Optional[tuple]:
        """(counter key, bytes) that moving ``t`` adds to the counter (None: no counter): a tensor
        autograd saved counts whole, a part of a quantized one its range's bytes under that tensor."""
        if self.counter is None:
            return None
        return (self.counter.classify(owner), t.numel() * t.element_size() if t is owner else nbytes)

    def streams(self) -> tuple:
        """(copies to the host, copies back): made on the model's device, which need not be the current one."""
        if self.d2h is None:
            self.d2h = torch.cuda.Stream(device=self.device)
        if self.h2d is None:
            self.h2d = torch.cuda.Stream(device=self.device)
        return self.d2h, self.h2d

    def _held_copy(self, t: torch.Tensor, storage, span: Move) -> HostCopy:
        """The record of ``t``'s range ``span`` of ``storage``, held on the GPU, its copy not yet queued."""
        if self.device is None:
            self.device = t.device
        saved_on = torch.cuda.current_stream(t.device)
        ready = te_internals.offload_ready_event(t)  # TE's start_offload: ready before it was saved
        if ready is None:
            ready = torch.cuda.Event()
            ready.record(saved_on)
        # from a 512-byte boundary of the storage: a reloaded view keeps its address's alignment
        start = span.start - span.start % 512
        nbytes = span.start + span.nbytes - start
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage, start, (nbytes,), (1,))
        # the engine holds the bytes (src) until the copy ends or the schedule needs them back, where
        # the stream it was saved on waits for the copy (a side stream inside the context: that
        # stream's pool gets the memory back)
        return HostCopy(nbytes, start, storage.data_ptr(), StorageWeakRef(storage), src, saved_on, ready)

    def start_copy(self, c: HostCopy) -> None:
        """Queues ``c``'s copy to a pinned host buffer on the copy stream; counts its bytes."""
        d2h, _ = self.streams()
        queue_copy_to_host(c, d2h, self.pool)
        if c.count is not None and self.counter is not None:
            key, nbytes = c.count
            self.counter.bytes[key] += nbytes
        c.count = None

    # -- backward --------------------------------------------------------------------------

    def backward_boundary(self, layer: int) -> None:
        """Layer ``layer``'s backward begins: drop later layers' reloads, reload this one and prefetch."""
        self.schedule.backward_begins(layer)
        if not self._finish_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
            self._finish_queued = True
        for done in [j for j in self.copies.layers if j > layer]:
            self.release_reload(done)
        self.schedule.backward_ready(layer)
        for j in reloads_at_backward_start(layer, self.num_layers, self.model_layers, self.reload_ahead):
            self.reload(j, prefetch=j != layer)

    def region_backward_done(self, layer: int) -> None:
        """The backward of what ran in layer ``layer``'s context is over and autograd released its
        saved tensors: its reloads go back to the allocator, and the next reload may start."""
        self.release_reload(layer)
        self.schedule.region_ended()
        for j in reloads_at_region_end(layer, self.num_layers, self.model_layers, self.reload_ahead):
            self.reload(j, prefetch=True)

    def finish_backward(self) -> None:
        """The backward is over: its reloads are dropped and its host buffers go back to the pool,
        as TE's engines do (so a second backward through the same graph is refused)."""
        self._finish_queued = False
        self._end_step(ran_through=True)

    def reload(self, layer: int, prefetch: bool = False) -> bool:
        """Queues ``layer``'s copies back to the GPU (its held bytes serve in place); False where the
        schedule put a ``prefetch`` off in whole or in part."""
        copies = self.copies.layers.get(layer)
        if copies is None or copies.reloaded or not copies.copies:
            return True
        # not those used up in an earlier reload of this layer (an unpack past the count copies it
        # back), nor those a put-off prefetch already started, nor those never copied
        pending = [c for c in copies.copies if c.state is CopyState.ON_HOST and not c.used_up]
        now = self.schedule.reload_now(layer, pending, prefetch)
        if now is not None:
            self._start_reloads(now)
            return False
        copies.reloaded = True  # first: a raise below leaves what was started for release_reload to wait on
        for c in copies.copies:
            if c.state in (CopyState.PUT_OFF, CopyState.COPYING):  # never given back: no copy needed
                c.serve_in_place()
        self._start_reloads([c for c in copies.copies if c.state is CopyState.ON_HOST and not c.used_up])
        return True

    def _start_reloads(self, copies: list) -> None:
        if not copies:
            return
        _, h2d = self.streams()
        # Reloads are allocated on the compute stream, whose earlier kernels may still use the
        # memory the allocator hands out: the copy stream starts after them.
        h2d.wait_stream(torch.cuda.current_stream(self.device))
        for c in copies:
            queue_reload(c, h2d, self.device)

    def release_reload(self, layer: int, step_over: bool = False) -> None:
        """``layer``'s backward is over: its reloads and bytes in place go back (a reload never used
        after the stream it was taken on waited for its copy)."""
        copies = self.copies.layers.get(layer)
        gpu_states = (CopyState.RELOADING, CopyState.RELOADED, CopyState.IN_PLACE)
        if copies is None or not (copies.reloaded or any(c.state in gpu_states for c in copies.copies)):
            return
        self.schedule.reload_dropped(layer)
        self._drop_sources(copies, step_over)
        for c in copies.copies:
            if c.state is CopyState.RELOADING:  # a prefetch never used: its copy may still run
                c.reload_stream.wait_event(c.reloaded)
                c.reload_waited()
            if c.state in gpu_states:
                c.release_gpu()  # back to the allocator on the stream it came from, after the copy
        copies.reloaded = False  # the host copy stays valid until the next step (retain_graph)

    def _drop_sources(self, copies: LayerCopies, step_over: bool = False) -> None:
        """All of a layer's held GPU bytes go back after the streams waited for its copies. A copy
        still put off goes without ever starting where nothing will read it again: its step is over,
        or autograd unpacked every handle it held to it. Otherwise (a region's end seen before all
        its uses, as multi-threaded autograd or a reentrant checkpoint can report it) it starts now
        and its bytes stay held until it ends, as any copy's: a later use finds them in place or
        reloads them, so an early end costs memory and copies, not results."""
        starting = set()
        for c in copies.copies:
            if c.copied is None and c.source is not None:
                if step_over or c.used_up:
                    c.discard()
                else:
                    self.start_copy(c)
                    starting.add(id(c))
        wait_and_give_back([c for c in copies.copies if c.source is not None and id(c) not in starting])

    def unpack(self, handle: Any) -> Any:
        if isinstance(handle, PartsHandle):
            handle.shell.restore_from_saved([None if h is None else self.unpack(h) for h in handle.handles])
            return handle.shell
        self.schedule.using()
        if not isinstance(handle, Moved):
            return handle
        if handle.step != self.step:
            raise RuntimeError(
                f"teo offload: a tensor saved in step {handle.step} is used after that step ended (its backward "
                "finished, or the next forward began) and its host buffer went back to the pool. teo runs one "
                f"forward then one backward per step (model_layers={self.model_layers} context entries make a "
                "step); a second backward through the same graph (retain_graph=True) is not supported")
        self.reload(handle.layer)  # no-op when prefetched
        c = self.copies.layers[handle.layer].copies[handle.index]
        if c.state is CopyState.DISCARDED:
            raise RuntimeError(
                f"teo offload: a saved tensor of layer {handle.layer} was unpacked more often than it was saved, "
                "after its layer's backward ended; its copy to the host was put off (the last layer's, under "
                "memory_budget with every layer offloaded) and its GPU bytes went back at its last counted use, "
                "so there is nothing to bring back")
        if c.state is CopyState.ON_HOST:  # used more often than autograd held handles to it: bring it back again
            if not self.told_extra_unpack:
                self.told_extra_unpack = True
                _log.info("teo: a saved tensor of layer %d was unpacked more often than it was saved; it is "
                          "copied back again (host to device traffic that a single unpack would not need)",
                          handle.layer)
            self._start_reloads([c])
        if c.state in (CopyState.RELOADING, CopyState.RELOADED):
            stream = torch.cuda.current_stream(c.gpu.device)
            if stream == c.reload_stream:
                if c.state is CopyState.RELOADING:
                    stream.wait_event(c.reloaded)
                    c.reload_waited()
            else:  # used on a side stream: it waits too, and the memory is not reused before it is done
                stream.wait_event(c.reloaded)
                c.gpu.record_stream(stream)
        # c.gpu starts at byte c.start of the tensor's storage (in place) or at 0 of its own (a reload)
        out = torch.empty(0, dtype=handle.dtype, device=c.gpu.device).set_(
            c.gpu.untyped_storage(), (c.gpu.storage_offset() + handle.byte_offset) // handle.dtype.itemsize,
            handle.shape, handle.stride)
        c.unpacks += 1
        if c.state in (CopyState.RELOADING, CopyState.RELOADED) and c.unpacks >= c.handles:
            # its last use: autograd holds the only reference and frees it once the op using it is
            # done (in the compute stream's order: that stream waited for the copy above, or the
            # side stream that uses it recorded itself on it)
            c.release_gpu()
        return out
