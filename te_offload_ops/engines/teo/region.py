"""When the backward of what ran inside a teo context is over (autograd hooks; no GPU needed).

A layer's "region" is what ran inside its context (the MoE MLP, or the whole layer). The engine
drops a layer's reloads, and may start the next, once autograd has run the region's nodes and
released what they saved.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["next_sequence_nr", "watch_region"]

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
