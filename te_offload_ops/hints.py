"""Hints ops give offload engines, without knowing which engines exist.

An op about to make a large allocation calls :func:`make_room` first. Engines that can act on it
(teo with a memory budget) register themselves with :func:`listen`; with none listening the call
checks its argument and returns. Ops import this module, never an engine.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

__all__ = ["RoomListener", "listen", "listeners", "make_room"]


class RoomListener(Protocol):
    def make_room(self, sizes: list[int], exact: bool, device: Any) -> None:
        """``sizes``: bytes about to be allocated on ``device`` (None: unknown); ``exact``: each entry
        is one allocation (False: one total of several)."""


_LISTENERS: "weakref.WeakSet[RoomListener]" = weakref.WeakSet()


def listen(listener: RoomListener) -> None:
    """``listener`` hears every :func:`make_room` call while it lives (held weakly)."""
    _LISTENERS.add(listener)


def listeners() -> list:
    """The live listeners (for tests and diagnostics)."""
    return list(_LISTENERS)


def make_room(nbytes: Any, device: Any = None) -> None:
    """An op is about to allocate ``nbytes`` on ``device`` (None: the current one): an int (a total),
    or a list with one int per allocation, in the order they are made (their sizes let an engine
    check that each fits a free block of the allocator). Listening engines give back what keeps
    the allocation from fitting their budget; nothing happens without one."""
    total_only = isinstance(nbytes, int) and not isinstance(nbytes, bool)
    sizes = [nbytes] if total_only else nbytes
    if not isinstance(sizes, (list, tuple)) or not sizes or \
            any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
        raise ValueError("make_room takes the bytes about to be allocated, an int >= 0 or a list of them "
                         f"(one per allocation); got {nbytes!r}")
    if not _LISTENERS:
        return
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    for listener in list(_LISTENERS):
        listener.make_room(list(sizes), not total_only, device)
