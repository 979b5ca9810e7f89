"""Pinned host buffers by size class, reused from step to step by every teo context.

Requests fall into a geometric series of size classes (8 per octave); a request takes a free
buffer from its class up to twice the size it would allocate (so a buffer may serve a request of
a fifth of its size); where none is free it takes the smallest free buffer up to
``_LARGEST_REUSE`` times its size rather than pin new memory: pinning 32 MiB holds the host for
10-25 ms, and a step that pins mid-way runs that much later. New buffers are whole powers of two
at least three classes (30%) above the request, 1.3x to 2.6x its size: torch's pinned-memory
allocator rounds every allocation up to a power of two, so that size costs no more host memory
than the request's 30% rounded would, and a tensor that grows by up to 30% from step to step
(what a rank receives under expert parallelism changes with routing) still fits the buffer it
had. A buffer handed back is given out again after the GPU work that last used it (its ``ready``
event), so a steady sequence of steps allocates pinned memory in its first steps only.

``TEO_HOST_MEMORY=write-combined`` gives the default pool write-combined pinned memory (the
driver's ``cuMemHostAlloc`` with ``CU_MEMHOSTALLOC_WRITECOMBINED``) instead of torch's pinned
memory, which the CPU does not cache (it never reads an offloaded tensor's bytes). It is an
option, not the default: in Megatron's GPT step on an H200 the copies cost more from it than from
pinned memory (docs/results.md).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["HOST_MEMORY_ENV", "HostBuffer", "PinnedBufferPool", "allocation_class", "class_bytes", "default_pool",
           "free_pinned_buffers", "host_bytes", "size_class", "write_combined_bytes"]

_CLASSES_PER_OCTAVE = 8
_MIN_CLASS_BYTES = 64 * 1024
# A new buffer is at least this many classes larger than needed (then rounded up to a power of two).
_HEADROOM_CLASSES = 3
# Where nothing near its size is free, a request takes a free buffer up to this many times its size.
_LARGEST_REUSE = 16


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


def allocation_class(k: int) -> int:
    """The size class a new buffer for a request of class ``k`` gets: a power of two (classes that
    are multiples of an octave) at least ``_HEADROOM_CLASSES`` above ``k``."""
    return -(-(k + _HEADROOM_CLASSES) // _CLASSES_PER_OCTAVE) * _CLASSES_PER_OCTAVE


@dataclass
class HostBuffer:
    tensor: torch.Tensor  # uint8, pinned
    size_class: int
    ready: Any = None  # the event after the last GPU work that reads or writes it


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


_CU_MEMHOSTALLOC_PORTABLE, _CU_MEMHOSTALLOC_WRITECOMBINED = 0x01, 0x04
_NO_CONTEXT = (3, 201)  # CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_INVALID_CONTEXT


def _driver():
    import ctypes

    return ctypes.CDLL("libcuda.so.1")


class _DriverHostMemory:
    """Owns one ``cuMemHostAlloc`` allocation: freed when the last tensor viewing it is gone, in
    the context it was made in (whichever thread lets it go). torch does not track this memory's
    copies as it does its own pinned blocks: whoever drops a buffer waits for its last copy first
    (:meth:`PinnedBufferPool.clear` does)."""

    def __init__(self, driver, ptr, context):
        self.driver, self.ptr, self.context = driver, ptr, context

    def __del__(self):
        import ctypes

        try:
            pushed = self.context.value and self.driver.cuCtxPushCurrent(self.context) == 0
            rc = self.driver.cuMemFreeHost(self.ptr)
            if pushed:
                self.driver.cuCtxPopCurrent(ctypes.byref(ctypes.c_void_p()))
        except Exception:  # noqa: BLE001 (the driver may be gone at interpreter exit)
            return
        if rc != 0:
            import warnings

            warnings.warn(f"teo: cuMemFreeHost of a write-combined buffer failed (CUresult {rc}): its pinned "
                          "memory stays pinned", RuntimeWarning, stacklevel=1)


def write_combined_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of pinned, write-combined host memory as a uint8 tensor (freed with its last view).
    Needs the CUDA context current on this thread (any CUDA op makes it so)."""
    import ctypes

    driver = _driver()
    ptr, context = ctypes.c_void_p(), ctypes.c_void_p()
    rc = driver.cuMemHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes),
                               ctypes.c_uint(_CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_WRITECOMBINED))
    if rc != 0 or not ptr.value:
        why = ""
        if rc in _NO_CONTEXT:
            why = " (no CUDA context current on this thread: run a CUDA op first)"
        raise RuntimeError(f"teo: cuMemHostAlloc of {nbytes} write-combined bytes failed (CUresult {rc}){why}")
    driver.cuCtxGetCurrent(ctypes.byref(context))
    memory = _DriverHostMemory(driver, ptr, context)
    view = (ctypes.c_uint8 * nbytes).from_address(ptr.value)
    view.owner = memory  # the tensor's storage keeps the view, the view its memory
    tensor = torch.frombuffer(view, dtype=torch.uint8)
    if not _is_pinned(tensor):  # torch would copy it synchronously, through a staging buffer
        raise RuntimeError("teo: the write-combined host buffer is not seen as pinned memory by torch")
    return tensor


def _is_pinned(tensor: torch.Tensor) -> bool:
    return tensor.is_pinned()


HOST_MEMORY_ENV = "TEO_HOST_MEMORY"
_HOST_MEMORY = {"pinned": _pinned_bytes, "write-combined": write_combined_bytes}


def _default_allocator() -> Callable[[int], torch.Tensor]:
    kind = os.environ.get(HOST_MEMORY_ENV, "") or "pinned"
    if kind not in _HOST_MEMORY:
        raise ValueError(f"{HOST_MEMORY_ENV} must be one of {tuple(_HOST_MEMORY)}, got {kind!r}")
    return _HOST_MEMORY[kind]


def host_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of the host memory teo's shared pool takes (as $TEO_HOST_MEMORY says), uint8."""
    return _default_allocator()(nbytes)


class PinnedBufferPool:
    """Pinned host buffers by size class; a buffer handed back is given out again."""

    def __init__(self, allocate: Callable[[int], torch.Tensor] = _pinned_bytes):
        self._allocate = allocate
        self._free: dict[int, list[HostBuffer]] = defaultdict(list)
        self.allocations = 0  # pinned buffers allocated so far
        self.allocated_bytes = 0  # their bytes (those dropped by clear() included)
        self.allocation_seconds = 0.0  # the host's time in those allocations
        self.in_use = 0
        self.oversized_reuses = 0  # requests served by a free buffer far larger than they need
        # the latest allocations, each with what the pool held when the request found no buffer:
        # why a steady run still pins memory (sizes growing, or more buffers at once than before)
        self.recent_allocations: deque = deque(maxlen=64)

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of at least ``nbytes``: a free one from its size class up to twice the size a new
        one would have (so a tensor that shrinks a little finds the buffer it had), else the smallest
        free one up to ``_LARGEST_REUSE`` times ``nbytes``, else a new one."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be positive, got {nbytes}")
        k = size_class(nbytes)
        for larger in range(k, allocation_class(k) + _CLASSES_PER_OCTAVE + 1):
            bucket = self._free.get(larger)
            if bucket:
                self.in_use += 1
                return bucket.pop()
        roomy = [c for c, bucket in self._free.items() if bucket and class_bytes(c) <= _LARGEST_REUSE * nbytes
                 and c >= k]
        if roomy:  # larger than it needs, but already pinned
            self.oversized_reuses += 1
            self.in_use += 1
            return self._free[min(roomy)].pop()
        free = [class_bytes(c) for c, bucket in self._free.items() for _ in bucket]
        k = allocation_class(k)
        start = time.perf_counter()
        buf = HostBuffer(self._allocate(class_bytes(k)), k)
        seconds = time.perf_counter() - start
        self.allocations += 1
        self.allocated_bytes += class_bytes(k)
        self.allocation_seconds += seconds
        self.recent_allocations.append({"requested": nbytes, "allocated": class_bytes(k), "seconds": seconds,
                                        "in_use": self.in_use, "free": len(free), "largest_free": max(free, default=0)})
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
        """Drop the free buffers (those in use come back later and stay until the next clear),
        each after its last copy has ended (memory the pool did not get from torch is freed at once)."""
        for bucket in self._free.values():
            for buf in bucket:
                if buf.ready is not None:
                    buf.ready.synchronize()
        self._free.clear()


_DEFAULT_POOL: Optional[PinnedBufferPool] = None


def default_pool() -> PinnedBufferPool:
    """The pool every teo context shares unless given its own; its memory as $TEO_HOST_MEMORY says
    when it is made (``pinned``, the default, or ``write-combined``)."""
    global _DEFAULT_POOL
    if _DEFAULT_POOL is None:
        _DEFAULT_POOL = PinnedBufferPool(_default_allocator())
    return _DEFAULT_POOL


def free_pinned_buffers() -> None:
    """Drop the default pool's free buffers and return torch's cached pinned memory to the system."""
    if _DEFAULT_POOL is not None:
        _DEFAULT_POOL.clear()
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
