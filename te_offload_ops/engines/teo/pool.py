"""Pinned host buffers by size class, reused from step to step by every teo context.

Buffer sizes form a geometric series (8 classes per octave, so at most ~9% of a buffer is unused),
so that slightly different sizes, such as per-expert slices under new routing, share buffers. A
buffer handed back is given out again after the GPU work that last used it (its ``ready`` event):
a steady sequence of steps allocates pinned memory in its first step only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["HostBuffer", "PinnedBufferPool", "class_bytes", "default_pool", "free_pinned_buffers", "size_class"]

_CLASSES_PER_OCTAVE = 8
_MIN_CLASS_BYTES = 64 * 1024
# A new buffer is this many classes larger than needed, so that a tensor a little larger next step
# (per-expert slices under new routing) still fits the buffer it had.
_HEADROOM_CLASSES = 1


def size_class(nbytes: int) -> int:
    """The index of the pool's size class for ``nbytes``."""
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
    """Pinned host buffers by size class; a buffer handed back is given out again."""

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
