"""Whether PyTorch's caching allocator can serve a run of allocations without giving memory back.

Under a cap (``torch.cuda.set_per_process_memory_fraction``) an allocation that no cached free
block fits, and that the cap leaves no room to map, makes the allocator release its cache and map
again: with expandable segments that waits for the stream and remaps gigabytes, measured at
85-200 ms a time in the MoE step (README, Status). Memory allocated under a budget is not enough to
avoid it: the free bytes may lie in pieces. teo's ``memory_budget`` asks here, for allocations it
is told of in advance, and gives back held bytes until each one fits.

Read from ``torch.cuda.memory_snapshot()`` (the blocks of the default pool) and the allocator's
reserved bytes against the cap; a model of the allocator's choice: best fit among the free blocks
of the stream's large pool, else new memory. With expandable segments the new pages go at the end
of a mapped range of the stream's segment (the snapshot lists each mapped range as a segment), the
first in address order with the address space, joined to the free block that ends it: what must
be mapped is the size less that block. Not modelled: ``max_split_size_mb`` (blocks above it are not
split) and the small pool (<= 1 MiB), which does not fragment here.
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
    # (a CUDA graph's or a MemPool's segments are not for ordinary allocations)
    return [b["size"] for seg in _stream_pool(segments, stream) for b in seg.get("blocks", ())
            if b.get("state") == "inactive"]


def _pages(n: int) -> int:
    return -(-max(n, 0) // _MAP_GRANULE) * _MAP_GRANULE


def _stream_pool(segments: Iterable[dict], stream: int) -> list[dict]:
    return [seg for seg in segments if seg.get("segment_type") == "large" and seg.get("stream") == stream
            and tuple(seg.get("segment_pool_id") or _DEFAULT_POOL) == _DEFAULT_POOL]


def expandable_ends(segments: Iterable[dict], stream: int) -> tuple[list[int], list[tuple[int, float]]]:
    """The stream's free blocks as :func:`unplaced` takes them: those inside mapped ranges, and for
    each mapped range of an expandable segment, in address order, (the free block that ends it or
    0, the unmapped address space after it: to the next range, unbounded after the last)."""
    inner, ranges = [], []
    for seg in _stream_pool(segments, stream):
        sizes = [b["size"] if b.get("state") == "inactive" else 0 for b in seg.get("blocks", ())]
        if seg.get("is_expandable") and sizes:
            ranges.append((seg["address"], seg["address"] + seg["total_size"], sizes.pop()))
        inner.extend(n for n in sizes if n)
    ranges.sort()
    ends = [(free, (ranges[i + 1][0] - end) if i + 1 < len(ranges) else float("inf"))
            for i, (_, end, free) in enumerate(ranges)]
    return inner, ends


def unplaced(sizes: Sequence[int], free: Iterable[int], mappable: int,
             ends: Sequence[tuple[int, float]] = ()) -> list[int]:
    """The sizes, in allocation order, that neither a free block (best fit, the rest split off)
    nor new memory within ``mappable`` bytes would take: each would make the allocator release its
    cache. ``ends``: with expandable segments, (free block at the end, address space after it) of
    each mapped range in address order (:func:`expandable_ends`); new pages then extend the first
    range with the address space, its end block joined to them; ``free`` the other free blocks."""
    blocks = sorted(free)
    ends = [list(e) for e in ends]
    left, out = mappable, []
    for size in sizes:
        if size <= 0:
            continue
        need = _round(size)
        if need <= _LARGE:
            continue  # the small pool: 2 MiB segments, not what fragments here
        i = bisect.bisect_left(blocks, need)
        end = min((e for e in ends if e[0] >= need), key=lambda e: e[0], default=None)
        if end is not None and (i == len(blocks) or end[0] < blocks[i]):
            end[0] = end[0] - need if end[0] - need > _LARGE else 0
            continue
        if i < len(blocks):
            rest = blocks.pop(i) - need
            if rest > _LARGE:
                bisect.insort(blocks, rest)
            continue
        grow = next((e for e in ends if e[0] + e[1] >= need), None)
        pages = _pages(need - (grow[0] if grow else 0))
        if pages > left:
            out.append(size)
            continue
        left -= pages
        if grow is not None:  # the end block and the new pages: what is left of them ends the range
            rest = grow[0] + pages - need
            grow[0], grow[1] = (rest if rest > _LARGE else 0), grow[1] - pages
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
    inner, ends = expandable_ends(segments, stream)
    return unplaced(sizes, inner, mappable, ends)


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
