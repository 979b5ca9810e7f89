"""allocator_room: the model of what the caching allocator serves without a release of its cache."""

import pytest
import torch

from te_offload_ops import allocator_room
from te_offload_ops.allocator_room import free_blocks, unplaced

MiB = 2**20


def _segment(blocks, stream=7, kind="large", pool=(0, 0)):
    return {"segment_type": kind, "stream": stream, "segment_pool_id": pool,
            "blocks": [{"size": n * MiB, "state": st} for n, st in blocks]}


def test_free_blocks_are_the_inactive_ones_of_the_streams_large_default_pool_segments():
    segments = [
        _segment([(100, "active_allocated"), (40, "inactive"), (8, "active_pending_free"), (300, "inactive")]),
        _segment([(500, "inactive")], stream=9),  # another stream's: not for this one
        _segment([(1, "inactive")], kind="small"),
        _segment([(700, "inactive")], pool=(1, 3)),  # a graph's private pool
    ]
    assert free_blocks(segments, 7) == [40 * MiB, 300 * MiB]


def test_best_fit_takes_the_smallest_block_that_fits_and_splits_off_the_rest():
    # 100 -> the 120 block (rest 20 stays free), 20 -> that rest, 250 -> the 300 block
    assert unplaced([100 * MiB, 20 * MiB, 250 * MiB], [300 * MiB, 120 * MiB], mappable=0) == []
    # the same without the split: 20 has no block left
    assert unplaced([100 * MiB, 250 * MiB, 60 * MiB], [300 * MiB, 120 * MiB], mappable=0) == [60 * MiB]


def test_new_memory_takes_what_no_block_fits_in_whole_pages_of_the_cap_left():
    # 5376 MiB: no block fits; 5380 MiB (269 pages of 20 MiB) may be mapped
    assert unplaced([5376 * MiB], [384 * MiB] * 6, mappable=5380 * MiB) == []
    # the pieces add up to more, but no piece fits and the cap leaves too little: it would release its cache
    assert unplaced([5376 * MiB, 1536 * MiB], [384 * MiB] * 20, mappable=1000 * MiB) == [5376 * MiB, 1536 * MiB]
    # after the first took the pages, the second finds none
    assert unplaced([30 * MiB, 30 * MiB], [], mappable=40 * MiB) == [30 * MiB]


def test_small_and_empty_allocations_are_not_asked_about():
    assert unplaced([0, 512, MiB], [], mappable=0) == []


def test_short_of_reads_no_snapshot_where_new_memory_takes_everything(monkeypatch):
    monkeypatch.setattr(allocator_room, "mappable_bytes", lambda device: 100 * MiB)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **kw: pytest.fail("no snapshot needed"))
    assert allocator_room.short_of([40 * MiB, 60 * MiB], torch.device("cuda", 0), stream=7) == []


def test_short_of_reads_the_snapshot_of_its_device_where_the_cap_is_near(monkeypatch):
    monkeypatch.setattr(allocator_room, "mappable_bytes", lambda device: 20 * MiB)
    here, other = _segment([(64, "inactive")]), _segment([(4096, "inactive")])
    here["device"], other["device"] = 1, 0
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **kw: asked.append(kw) or [other, here])
    assert allocator_room.short_of([60 * MiB, 100 * MiB], torch.device("cuda", 1), stream=7) == [100 * MiB]
    assert asked == [{"include_traces": False}]  # the recorded history is not read


def test_most_room_is_the_room_to_map_and_every_free_block_of_the_stream_on_its_device(monkeypatch):
    monkeypatch.setattr(allocator_room, "mappable_bytes", lambda device: 20 * MiB)
    here = _segment([(64, "inactive"), (100, "active_allocated"), (30, "inactive")])
    side, other = _segment([(500, "inactive")], stream=9), _segment([(4096, "inactive")])
    here["device"] = side["device"] = 1
    other["device"] = 0
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **kw: [other, side, here])
    assert allocator_room.most_room(torch.device("cuda", 1), stream=7) == (20 + 64 + 30) * MiB
