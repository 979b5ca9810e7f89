"""Whether PyTorch's caching allocator can serve a run of allocations without giving memory back.

Under a cap (``torch.cuda.set_per_process_memory_fraction``) an allocation that no cached free
block fits, and that the cap leaves no room to map, makes the allocator release its cache and map
again: with expandable segments that waits for the stream and remaps gigabytes, measured at
85-200 ms a time in the MoE step. Memory allocated under a budget is not enough to avoid it: the
free bytes may lie in pieces. teo's ``memory_budget`` asks here, for allocations it is told of in
advance, and gives back held bytes until each one fits.

A model of the allocator's choice: best fit among the free blocks of the stream's large pool
(from ``torch.cuda.memory_snapshot()``), else new memory of the whole size in pages of the large
segment size, against the cap less what is reserved. With expandable segments the allocator would
map only what a free block ending the mapped range lacks, but under a memory fraction it first
checks the whole size against the cap, so that block does not help (measured on an H100,
``tests/test_gpu_teo_allocator_room.py``). Not modelled: the small pool (<= 1 MiB), which does not
fragment here. The model holds for the torch releases in :data:`MODELLED_TORCH` with the
allocator settings it reads (:func:`model_problem`); elsewhere :func:`model_problem` says why and
the budget gives bytes back for the budget alone.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from typing import Iterable, Optional, Sequence

import torch

__all__ = ["MODELLED_TORCH", "AllocatorView", "free_blocks", "model_problem", "most_room", "short_of",
           "unplaced"]

_log = logging.getLogger(__name__)

# torch (major, minor) releases whose allocator this model follows: measured on 2.11; 2.14's
# constants (c10/core/AllocatorConfig.h: 512-byte rounding, 1 MiB small sizes, 20 MiB large
# segments) are the same
MODELLED_TORCH = ((2, 11), (2, 14))
# allocator settings that change rounding or splitting, which the model leaves out
_UNMODELLED_SETTINGS = ("max_split_size_mb", "roundup_power2_divisions", "large_segment_size_mb")
_SNAPSHOT_KEYS = ("segment_type", "stream", "blocks")

_ROUND = 512  # the allocator rounds every size up to this
_LARGE = 1 << 20  # sizes above this come from the large pool; smaller remainders are not split off
_MAP_GRANULE = 20 << 20  # expandable segments map the large pool in pages of this size
_DEFAULT_POOL = (0, 0)


def _round(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


def _torch_release(version: str) -> tuple[int, ...]:
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else ()


def model_problem(torch_version: Optional[str] = None, alloc_conf: Optional[str] = None) -> Optional[str]:
    """Why this model does not describe the installed allocator, or None: a torch release outside
    :data:`MODELLED_TORCH`, or an allocator setting it leaves out (``PYTORCH_CUDA_ALLOC_CONF``)."""
    release = _torch_release(torch.__version__ if torch_version is None else torch_version)
    low, high = MODELLED_TORCH
    if not release or not low <= release <= high:
        return (f"torch {torch_version or torch.__version__} is outside the releases whose caching allocator "
                f"this model follows ({low[0]}.{low[1]} to {high[0]}.{high[1]})")
    if alloc_conf is None:
        alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    for setting in _UNMODELLED_SETTINGS:
        if setting in alloc_conf:
            return f"the allocator setting {setting} (PYTORCH_CUDA_ALLOC_CONF={alloc_conf!r}) is not modelled"
    return None


def free_blocks(segments: Iterable[dict], stream: int) -> list[int]:
    """Sizes of the free blocks an allocation on ``stream`` (its ``cuda_stream`` handle) may take from
    the default pool's large segments, as ``torch.cuda.memory_snapshot()`` lists them."""
    out = []
    for seg in segments:
        if seg.get("segment_type") != "large" or seg.get("stream") != stream:
            continue
        if tuple(seg.get("segment_pool_id") or _DEFAULT_POOL) != _DEFAULT_POOL:
            continue  # a CUDA graph's or a MemPool's: not for ordinary allocations
        out.extend(b["size"] for b in seg.get("blocks", ()) if b.get("state") == "inactive")
    return out


def unplaced(sizes: Sequence[int], free: Iterable[int], mappable: int) -> list[int]:
    """The sizes, in allocation order, that neither a free block (best fit, the rest split off)
    nor ``mappable`` bytes of new memory would take: each would make the allocator release its cache."""
    blocks = sorted(free)
    left, out = mappable, []
    for size in sizes:
        if size <= 0:
            continue
        need = _round(size)
        if need <= _LARGE:
            continue  # the small pool: 2 MiB segments, not what fragments here
        i = bisect.bisect_left(blocks, need)
        if i < len(blocks):
            rest = blocks.pop(i) - need
            if rest > _LARGE:
                bisect.insort(blocks, rest)
            continue
        pages = -(-need // _MAP_GRANULE) * _MAP_GRANULE
        if pages <= left:
            left -= pages
        else:
            out.append(size)
    return out


def _pages(sizes: Sequence[int]) -> int:
    return sum(-(-_round(s) // _MAP_GRANULE) * _MAP_GRANULE for s in sizes)


def _snapshot() -> list:
    try:  # without the allocator's recorded history, where torch can leave it out (cheaper)
        return torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:
        return torch.cuda.memory_snapshot()


class AllocatorView:
    """One device's caching allocator as a memory budget reads it, at little host cost.

    :meth:`read` takes the allocated and reserved bytes from one read of the allocator's nested
    statistics (``torch.cuda.memory_allocated`` flattens and sorts every statistic first). The
    driver's free memory is read once per step (:meth:`new_step`) and followed through what this
    process reserves after it. The cap is the memory fraction torch reports."""

    _told: set = set()  # problems already logged, once per process

    def __init__(self, device: Optional[torch.device] = None):
        self.device = device
        self.reserved = 0
        self.reads = 0  # nested-statistics reads so far (a diagnostic)
        self._driver: Optional[tuple[int, int, int]] = None  # (free, total, reserved then)
        problem = model_problem()
        self.problem = problem
        if problem is not None:
            self._tell(f"teo's memory budget does not check that announced allocations fit a free block: {problem}; "
                       "it gives held bytes back for the budget alone")

    def _tell(self, message: str) -> None:
        if message not in AllocatorView._told:
            AllocatorView._told.add(message)
            _log.warning(message)

    def _index(self) -> int:
        if self.device is not None and self.device.index is not None:
            return self.device.index
        return torch.cuda.current_device()

    def read(self) -> int:
        """The bytes allocated now (0 where CUDA is absent or the allocator holds nothing yet)."""
        if self.device is None and not torch.cuda.is_available():
            return 0
        stats = torch.cuda.memory_stats_as_nested_dict(self._index())
        self.reads += 1
        if not stats:
            self.reserved = 0
            return 0
        self.reserved = stats["reserved_bytes"]["all"]["current"] if "reserved_bytes" in stats else 0
        return stats["allocated_bytes"]["all"]["current"]

    def new_step(self) -> None:
        """The driver's free memory is read again at the next need."""
        self._driver = None

    def mappable(self) -> int:
        """What the allocator may still map: the cap (its memory fraction of the GPU, where torch
        tells it) less what it has reserved, and no more than the driver has free."""
        index = self._index()
        if self._driver is None:
            free, total = torch.cuda.mem_get_info(index)
            self._driver = (free, total, self.reserved)
        free, total, reserved_then = self._driver
        free -= self.reserved - reserved_then
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if getter is None:
            self._tell("this torch cannot tell the per-process memory fraction: a cap set with "
                       "set_per_process_memory_fraction is not seen, and teo's memory budget takes the GPU's free "
                       "memory as room to map")
        limit = total if getter is None else int(getter(index) * total)
        return max(0, min(free, limit - self.reserved))

    def _free_blocks(self, stream: Optional[int]) -> list[int]:
        if stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        index = self._index()
        segments = [s for s in _snapshot() if s.get("device") in (None, index)]
        if segments and any(k not in segments[0] for k in _SNAPSHOT_KEYS):
            self.problem = f"torch's memory snapshot lacks {', '.join(_SNAPSHOT_KEYS)}"
            self._tell(f"teo's memory budget stops checking that allocations fit a free block: {self.problem}")
            return []
        return free_blocks(segments, stream)

    def short_of(self, sizes: Sequence[int], stream: Optional[int] = None) -> list[int]:
        """The sizes that would not fit as the allocator stands at the last :meth:`read` (for the
        current stream by default); empty where new memory takes them all (no snapshot read then),
        and where the model does not hold here."""
        sizes = [s for s in sizes if s > 0]
        if not sizes or self.problem is not None:
            return []
        mappable = self.mappable()
        if _pages(sizes) <= mappable:
            return []
        blocks = self._free_blocks(stream)
        if self.problem is not None:
            return []
        return unplaced(sizes, blocks, mappable)

    def most_room(self, stream: Optional[int] = None) -> int:
        """The most bytes one allocation (on the current stream by default) could get without the
        allocator releasing its cache, were all the stream's free blocks one: what the cap leaves
        to map plus every free block. An upper bound: an allocation larger than it plus what giving
        held bytes back would free cannot be helped by giving them back."""
        return self.mappable() + sum(self._free_blocks(stream))


def _view(device: torch.device) -> AllocatorView:
    view = AllocatorView(device)
    view.read()
    return view


def short_of(sizes: Sequence[int], device: torch.device, stream: Optional[int] = None) -> list[int]:
    """:meth:`AllocatorView.short_of` for ``device`` as it stands now."""
    return _view(device).short_of(sizes, stream)


def most_room(device: torch.device, stream: Optional[int] = None) -> int:
    """:meth:`AllocatorView.most_room` for ``device`` as it stands now."""
    return _view(device).most_room(stream)
