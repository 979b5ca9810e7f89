"""teo's memory budget: bytes go back where memory would pass it, not on a layer schedule (the
schedule, :class:`BudgetSchedule`, and the budget arithmetic :mod:`te_offload_ops.engines.measure` and the engine share).

With ``memory_budget=B`` (bytes of ``torch.cuda.memory_allocated`` the step may reach) every
offloaded tensor's GPU bytes stay until the host sees its copy end; the oldest still being copied
go back early, after the streams waited for their copies, only where the memory allocated plus the
next allocation announced (:func:`te_offload_ops.hints.make_room`, or the engine's own reloads)
would pass ``B``, or where an announced allocation would fit no free block of the allocator and
no memory the cap leaves to map (the allocator would release its cache and remap, stalling the
GPU: ``allocator_room``). So the forward waits only where memory runs out.

The engine looks at each layer entry, save, use in backward, backward boundary and announcement.
A look keeps room for what ops allocated after the same look in the last two steps whose backward
ran through (saved-tensor hooks see an op's outputs only once it made them: :class:`Headroom`).
A look reads the allocator only where it could act: while the engine holds bytes it could give
back, to close the growth of the last look that read, and before a reload.

With every layer offloaded (n = L) the last layer's copies are put off until the budget needs
their room: its backward comes first and uses them in place.

:func:`target_budget` is the budget of a target peak, from what a step measures
(``te_offload_ops.engines.measure_budget`` measures it).
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from ... import capture
from .allocator_room import AllocatorView
from .copies import CopyState, HostCopy, wait_and_give_back
from .schedule import Schedule

__all__ = ["BudgetSchedule", "Headroom", "check_target_options", "target_budget"]


def check_int(name: str, value: Any) -> None:
    """Raises TypeError unless ``value`` is an int (a bool is not)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def check_target_options(*, num_layers: int, model_layers: int, freed: float, slack_bytes: int) -> None:
    """Raises for the layers, share and slack :func:`target_budget` refuses: a caller that runs
    steps to measure the other figures refuses them before it runs any."""
    for name, value in (("num_layers", num_layers), ("model_layers", model_layers), ("slack_bytes", slack_bytes)):
        check_int(name, value)
    if model_layers < 1 or not 0 <= num_layers <= model_layers:
        raise ValueError(f"need 0 <= num_layers <= model_layers and model_layers >= 1, got {num_layers}, {model_layers}")
    if isinstance(freed, bool) or not isinstance(freed, (int, float)) or not 0 < freed <= 1:
        raise ValueError(f"freed must be a share of the moved bytes in (0, 1], got {freed!r}")


def target_budget(*, floor_bytes: int, no_offload_peak_bytes: int, moved_bytes: int, num_layers: int,
                  model_layers: int, freed: float = 0.96, slack_bytes: int = 0) -> int:
    """The ``memory_budget`` whose peak is no offload's less ``freed`` of the bytes moved.

    ``floor_bytes``: memory allocated between steps (weights, grads, optimizer state, workspaces);
    ``no_offload_peak_bytes``: a step's peak without offload, above that floor; ``moved_bytes``:
    what teo's default schedule moves in a step of this policy (its counter's total);
    ``freed``: the share of those bytes off the GPU at the peak, in (0, 1]; ``slack_bytes``: added
    room. With every layer offloaded (``num_layers == model_layers``) the layer whose backward
    comes first is back on the GPU at the peak under any schedule (its bytes serve its backward in
    place), so the target frees ``freed`` of the other ``L - 1`` layers' bytes."""
    for name, value in (("floor_bytes", floor_bytes), ("no_offload_peak_bytes", no_offload_peak_bytes),
                        ("moved_bytes", moved_bytes)):
        check_int(name, value)
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    check_target_options(num_layers=num_layers, model_layers=model_layers, freed=freed, slack_bytes=slack_bytes)
    moved = moved_bytes
    if num_layers == model_layers:
        # layers move equal bytes (the same shapes, and routing sends every layer T x top-k rows)
        moved = moved * (model_layers - 1) // model_layers
    budget = int(floor_bytes + no_offload_peak_bytes - moved * freed + slack_bytes)
    if budget <= 0:
        raise ValueError(f"the target budget is {budget} bytes: the bytes to free ({freed} of {moved}) are more "
                         f"than the floor ({floor_bytes}) and the peak ({no_offload_peak_bytes}) hold")
    return budget


class Headroom:
    """What ops allocated after each look, learned per look from the last two steps that ran through.

    A look's key is its place in the step, the same from step to step: what looks, in which forward
    and backward layer, and how often such a look came before it in this step. The growth after a
    look is the memory at the next look that reads it less the memory the look left (its own
    announced bytes included, so they are not counted again)."""

    def __init__(self):
        self._growth: dict = {}  # look key -> bytes allocated after it, this step
        self._last: list[dict] = []  # the same, from the last two steps whose backward ran through
        self._seen: dict = {}  # (where, forward layer, backward layer) -> looks so far this step
        self.open: Optional[tuple] = None  # (key, memory the look left): the growth being measured

    def key(self, where: str, fwd_layer: Optional[int], bwd_layer: Optional[int]) -> tuple:
        base = (where, fwd_layer, bwd_layer)
        seen = self._seen.get(base, 0)
        self._seen[base] = seen + 1
        return base + (seen,)

    def room(self, key: tuple) -> int:
        """The room to keep at look ``key``: the most ops allocated after it in the last two steps."""
        return max((g.get(key, 0) for g in self._last), default=0)

    def close(self, memory: int) -> None:
        """The growth since the open look ends at ``memory`` (read before anything goes back here:
        bytes given back would hide it)."""
        if self.open is not None:
            key, left = self.open
            self._growth[key] = max(self._growth.get(key, 0), memory - left)
            self.open = None

    def learned(self) -> list[dict]:
        return self._last

    def step_ended(self, ran_through: bool) -> None:
        if self._growth and ran_through:  # a step that ran through teaches the next two
            self._last = [self._growth] + self._last[:1]
        self._growth, self._seen, self.open = {}, {}, None


class BudgetSchedule(Schedule):
    """Held until copied; the oldest waited for only where memory would pass the budget."""

    def __init__(self, memory_budget: int):
        self.memory_budget = memory_budget
        self.headroom = Headroom()
        self.margin = 0  # the room kept at the last look for what ops allocate before the next (public)
        self.deferred: list[int] = []  # layers whose prefetch waits for room, in order
        # counters (public): copies waited for and their bytes, prefetches put off, copies of put-off
        # prefetches started in the room there was, looks where giving bytes back could not make an
        # allocation fit, looks and the host seconds spent in them
        self.waits = self.wait_bytes = self.reloads_deferred = self.reloads_started_early = 0
        self.fits_given_up = self.looks = 0
        self.look_seconds = 0.0
        self.trace: Optional[list] = None  # a list: each look that waited is recorded there (diagnostic)
        self._bwd_layer: Optional[int] = None
        self.allocator = AllocatorView()  # seams for CPU tests: read, short_of, most_room
        self.read_memory = self.allocator.read
        self.short_of = self.allocator.short_of
        self.most_room = self.allocator.most_room

    # -- the engine's events ---------------------------------------------------------------

    def puts_off_copies(self, layer: int) -> bool:
        """Under a budget with every layer offloaded, the last layer's copies wait until the budget
        needs their bytes. Its backward comes first, so its bytes are back on the GPU when the
        backward begins under any schedule: copied at once, they would take the copy engine from
        the layers before it and come back at once. Kept, they serve its backward in place."""
        e = self.engine
        return e.num_layers == e.model_layers == layer + 1

    def layer_entered(self, layer: int) -> None:
        self.look(where="enter")

    def saving(self) -> None:
        self.look(where="save")

    def using(self) -> None:
        self.look(where="use")

    def backward_begins(self, layer: int) -> None:
        if self.headroom.open is not None:  # before the releases below give bytes back
            self.headroom.close(self._read())
        self._bwd_layer = layer

    def backward_ready(self, layer: int) -> None:
        self.look(keep_layer=layer, where="backward")  # (its held bytes serve it in place)

    def region_ended(self) -> None:
        """Prefetches put off for want of room start, in order, once they fit."""
        while self.deferred:
            layer = self.deferred[0]
            copies = self.engine.copies.layers.get(layer)
            if copies is None or copies.reloaded:  # gone, or reloaded for a use meanwhile
                self.deferred.pop(0)
            elif not self.engine.reload(layer, prefetch=True):  # started: reload took it off the list
                return

    def reload_dropped(self, layer: int) -> None:
        if layer in self.deferred:  # started in part, its backward over: not to be started again
            self.deferred.remove(layer)

    def step_ended(self, ran_through: bool) -> None:
        self.deferred.clear()
        self.headroom.step_ended(ran_through)
        self._bwd_layer = None
        self.allocator.new_step()

    def make_room(self, sizes: list[int], exact: bool, device: Any) -> None:
        """An op announced allocations (:func:`te_offload_ops.hints.make_room`)."""
        e = self.engine
        if capture.capturing():  # a capture can neither query nor wait on the engine's events
            return
        if not e.in_step or (device is not None and e.device is not None and e.device != device):
            return
        self.look(sum(sizes), where="make_room", sizes=sizes if exact else ())

    def reload_now(self, layer: int, pending: list, prefetch: bool) -> Optional[list]:
        """Room first for the reload's bytes (the layer's own held bytes stay). A ``prefetch`` that
        would pass the budget less the room ops took after this look last step is put off in whole
        or in part: the copies that fit start now, the last saved first (the backward uses them
        first); the rest at a later region's end once the backward has freed room, or at the layer's
        first use (not at each use, where an op is about to allocate)."""
        sizes = [c.nbytes for c in pending]
        memory = self.look(sum(sizes), keep_layer=layer, where="reload", sizes=sizes)
        limit = self.memory_budget - self.margin
        if prefetch and sizes and memory + sum(sizes) > limit:
            if layer not in self.deferred:
                self.deferred.append(layer)
                self.reloads_deferred += 1
            room, now = limit - memory, []
            for c in reversed(pending):
                if c.nbytes > room:
                    break
                room -= c.nbytes
                now.append(c)
            while now and self._short_of([c.nbytes for c in now]):  # only where the allocator has the blocks
                now.pop()
            if self.headroom.open is not None:  # the look announced the whole layer: count what starts
                key, left = self.headroom.open
                self.headroom.open = (key, left - sum(sizes) + sum(c.nbytes for c in now))
            self.reloads_started_early += len(now)
            return now
        if layer in self.deferred:
            self.deferred.remove(layer)
        return None

    # -- looks -----------------------------------------------------------------------------

    def _read(self) -> int:
        self.allocator.device = self.engine.device
        return self.read_memory()

    def _short_of(self, sizes: Sequence[int]) -> list:
        """The allocations of ``sizes`` the allocator could not serve now without a release of its cache."""
        return self.short_of(sizes) if self.engine.device is not None else []

    def look(self, incoming: int = 0, keep_layer: Optional[int] = None, where: str = "",
             sizes: Sequence[int] = ()) -> int:
        """Copies the host sees ended give their bytes back; then, while the memory allocated plus
        ``incoming`` (bytes about to be allocated) plus the learned room is over the budget, the
        oldest GPU bytes still being copied go back after the streams waited for their copies (one
        at a time, the memory read again after each: bytes still used elsewhere free nothing).
        ``sizes``: the allocations ``incoming`` is made of, where known: while one of them would fit
        no free block and no memory the cap leaves to map, held bytes go back the same way; none
        where giving back every held byte saved on this stream could not make room for the largest
        of them (counted in :attr:`fits_given_up`). ``keep_layer``: a layer whose bytes are about to
        serve its backward in place stays. Returns the memory after the look (0 where it read none:
        it holds nothing it could give back, and no growth is being measured)."""
        began = time.perf_counter()
        e = self.engine
        self.looks += 1
        key = self.headroom.key(where, e.fwd_layer, self._bwd_layer)
        holds = e.copies.holds_bytes()
        if not holds and self.headroom.open is None and where != "reload":
            self.look_seconds += time.perf_counter() - began
            return 0
        memory = self._read()
        self.headroom.close(memory)
        if holds and e.copies.drop_copied():
            memory = self._read()
            holds = e.copies.holds_bytes()
        self.margin = self.headroom.room(key)
        after = memory
        try:
            if holds:
                after = self._fit(memory, incoming, keep_layer, where, sizes)
        finally:
            if holds or where == "reload":  # a look that could act learns what comes after it
                self.headroom.open = (key, after + incoming)
            self.look_seconds += time.perf_counter() - began
        return after

    def _fit(self, memory: int, incoming: int, keep_layer: Optional[int], where: str, sizes: Sequence[int]) -> int:
        """:meth:`look`'s waits. Returns the memory after them."""
        over = memory + incoming + self.margin - self.memory_budget
        held = self.engine.copies.held(keep_layer)
        if not held:
            return memory
        device = self.engine.device
        here = torch.cuda.current_stream(device) if device is not None else None
        # (bytes saved on another stream go back to that stream's pool: no room for this one's)
        fits = {id(c): c for c in held if c.source_stream is None or c.source_stream == here}
        short = [] if over > 0 or not sizes or not fits else self._short_of(sizes)
        if over <= 0 and not short:
            return memory
        trace = self.trace
        record = None if trace is None else {"where": where, "layer": self.engine.fwd_layer,
                                             "bwd_layer": self._bwd_layer, "step": self.engine.step,
                                             "memory": memory, "incoming": incoming, "over": over,
                                             "margin": self.margin, "waits": []}
        hopeless = None  # whether giving back could not fit the largest short allocation: asked once
        for c in held:
            if over > 0:
                gone, memory = self._give_back(c, memory, record, "budget")
                over -= gone
                if over <= 0 and sizes:
                    short = self._short_of(sizes)
            elif id(c) in fits:
                if hopeless is None:
                    left = sum(f.nbytes for f in fits.values() if f.source is not None)
                    hopeless = max(short) > self.most_room() + left
                    self.fits_given_up += hopeless
                    if record is not None and hopeless:
                        record["gave_up"] = max(short)
                if hopeless:
                    break
                _, memory = self._give_back(c, memory, record, "fit")
                short = self._short_of(sizes)
            if over <= 0 and not short:
                break
        if record is not None and (record["waits"] or "gave_up" in record):
            trace.append(record)
        return memory

    def _give_back(self, c: HostCopy, memory: int, record: Optional[dict], why: str) -> tuple[int, int]:
        """One held copy's GPU bytes go back after the streams waited for its copy: (bytes freed,
        memory after)."""
        if record is not None:
            reach = torch.cuda.Event(enable_timing=True)
            reach.record(torch.cuda.current_stream(c.source.device))
        if c.state is CopyState.PUT_OFF:  # put off until the budget needed its bytes: now
            self.engine.start_copy(c)
        wait_and_give_back([c])
        self.waits += 1
        self.wait_bytes += c.nbytes
        after = self._read()
        freed = memory - after
        if record is not None:
            resume = torch.cuda.Event(enable_timing=True)
            resume.record(torch.cuda.current_stream(self.engine.device))
            record["waits"].append({"copy_of_layer": c.layer, "nbytes": c.nbytes, "freed": freed, "why": why,
                                    "events": (reach, resume)})
        return freed, after
