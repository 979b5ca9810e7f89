"""Whether PyTorch's caching allocator can serve a run of allocations without giving memory back.

Under a cap (``torch.cuda.set_per_process_memory_fraction``) an allocation that no cached free
block fits, and that the cap leaves no room to map, makes the allocator release its cache and map
again: with expandable segments that waits for the stream and remaps gigabytes, measured at
85-200 ms a time in the MoE step (README, Status). Memory allocated under a budget is not enough to
avoid it: the free bytes may lie in pieces. teo's ``memory_budget`` asks here, for allocations it
is told of in advance, and gives back held bytes until each one fits.

Read from ``torch.cuda.memory_snapshot()`` (the blocks of the default pool) and the allocator's
reserved bytes against the cap; a model of the allocator's choice (best fit among the free blocks
of the stream's large pool, else new memory of the whole size). With expandable segments the
allocator would map only what a free block ending the mapped range lacks, but under a memory
fraction it first checks the whole size against the cap, so that block does not help: measured
(tests/test_gpu_allocator_room.py), and modelled so. Not modelled: ``max_split_size_mb`` (blocks
above it are not split) and the small pool (<= 1 MiB), which does not fragment here.
"""

from __future__ import annotations

import bisect
import logging
from typing import Iterable, Optional, Sequence

import torch

_log = logging.getLogger(__name__)
_told_no_fraction = False

_ROUND = 512  # the allocator rounds every size up to this
_LARGE = 1 << 20  # sizes above this come from the large pool; smaller remainders are not split off
_MAP_GRANULE = 20 << 20  # expandable segments map the large pool in pages of this size
_DEFAULT_POOL = (0, 0)


def _round(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


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


def mappable_bytes(device: torch.device) -> int:
    """What the allocator may still map on ``device``: the cap (its memory fraction of the GPU, if
    torch tells it) less what it has reserved, and no more than the driver has free."""
    global _told_no_fraction
    index = device.index if device.index is not None else torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(index)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None and not _told_no_fraction:
        _told_no_fraction = True
        _log.warning("this torch cannot tell the per-process memory fraction: a cap set with "
                     "set_per_process_memory_fraction is not seen, and teo's memory budget takes the GPU's free "
                     "memory as room to map (the allocator may still release its cache at such a cap)")
    limit = total if getter is None else int(getter(index) * total)
    return max(0, min(free, limit - torch.cuda.memory_reserved(index)))


def _snapshot() -> list:
    try:  # without the allocator's recorded history, where torch can leave it out (cheaper)
        return torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:
        return torch.cuda.memory_snapshot()


def short_of(sizes: Sequence[int], device: torch.device, stream: Optional[int] = None) -> list[int]:
    """The sizes that would not fit as the allocator stands now on ``device`` (for the current
    stream by default); empty where new memory takes them all (no snapshot read then)."""
    sizes = [s for s in sizes if s > 0]
    if not sizes:
        return []
    mappable = mappable_bytes(device)
    if sum(-(-_round(s) // _MAP_GRANULE) * _MAP_GRANULE for s in sizes) <= mappable:
        return []
    if stream is None:
        stream = torch.cuda.current_stream(device).cuda_stream
    index = device.index if device.index is not None else torch.cuda.current_device()
    segments = [s for s in _snapshot() if s.get("device") in (None, index)]
    return unplaced(sizes, free_blocks(segments, stream), mappable)


def most_room(device: torch.device, stream: Optional[int] = None) -> int:
    """The most bytes one allocation on ``device`` (the current stream by default) could get without
    the allocator releasing its cache, were all the stream's free blocks one: what the cap leaves
    to map plus every free block. An upper bound: an allocation larger than it plus what giving
    held bytes back would free cannot be helped by giving them back."""
    if stream is None:
        stream = torch.cuda.current_stream(device).cuda_stream
    index = device.index if device.index is not None else torch.cuda.current_device()
    segments = [s for s in _snapshot() if s.get("device") in (None, index)]
    return mappable_bytes(device) + sum(free_blocks(segments, stream))
