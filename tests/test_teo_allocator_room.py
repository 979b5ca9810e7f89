"""CPU: teo's model of what the caching allocator serves without a release of its cache, and what it
costs a look to ask it."""

import pytest
import torch

from te_offload_ops.engines.teo import allocator_room
from te_offload_ops.engines.teo.allocator_room import AllocatorView, free_blocks, model_problem, unplaced

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


def _view(monkeypatch, mappable, device=1):
    view = AllocatorView(torch.device("cuda", device))
    view.problem = None  # the model holds (a test of the fallback sets one)
    monkeypatch.setattr(view, "mappable", lambda: mappable)
    return view


def test_short_of_reads_no_snapshot_where_new_memory_takes_everything(monkeypatch):
    view = _view(monkeypatch, 100 * MiB, device=0)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **kw: pytest.fail("no snapshot needed"))
    assert view.short_of([40 * MiB, 60 * MiB], stream=7) == []


def test_short_of_reads_the_snapshot_of_its_device_where_the_cap_is_near(monkeypatch):
    view = _view(monkeypatch, 20 * MiB)
    here, other = _segment([(64, "inactive")]), _segment([(4096, "inactive")])
    here["device"], other["device"] = 1, 0
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **kw: asked.append(kw) or [other, here])
    assert view.short_of([60 * MiB, 100 * MiB], stream=7) == [100 * MiB]
    assert asked == [{"include_traces": False}]  # the recorded history is not read


def test_most_room_is_the_room_to_map_and_every_free_block_of_the_stream_on_its_device(monkeypatch):
    view = _view(monkeypatch, 20 * MiB)
    here = _segment([(64, "inactive"), (100, "active_allocated"), (30, "inactive")])
    side, other = _segment([(500, "inactive")], stream=9), _segment([(4096, "inactive")])
    here["device"] = side["device"] = 1
    other["device"] = 0
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda **kw: [other, side, here])
    assert view.most_room(stream=7) == (20 + 64 + 30) * MiB


def test_room_to_map_reads_the_driver_once_a_step_and_follows_what_the_process_reserves(monkeypatch):
    """The cap (the memory fraction) less what is reserved, no more than the driver has free; the
    driver is asked once per step, and what this process reserves after it comes off its answer."""
    view = AllocatorView(torch.device("cuda", 0))
    driver = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: driver.append(index) or (60 * MiB, 100 * MiB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 0.5, raising=False)
    view.reserved = 10 * MiB
    assert view.mappable() == 40 * MiB  # the cap (50) less 10 reserved; the driver's 60 is more
    view.reserved = 30 * MiB  # the allocator mapped 20 more since the driver was asked
    assert view.mappable() == 20 * MiB and driver == [0]
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda index: 1.0, raising=False)
    assert view.mappable() == 40 * MiB  # no cap: the driver's 60 less the 20 mapped since
    view.new_step()
    assert view.mappable() == 60 * MiB and driver == [0, 0]  # asked again: 60 free now


@pytest.mark.parametrize("version, conf, problem", [
    ("2.11.0+cu130", "", None),
    ("2.14.1+cu130", "expandable_segments:True", None),
    ("2.10.0", "", "torch 2.10.0 is outside the releases whose caching allocator this model follows (2.11 to 2.14)"),
    ("3.0.0", "", "outside the releases"),
    ("2.11.0", "expandable_segments:True,max_split_size_mb:512", "the allocator setting max_split_size_mb"),
    ("2.11.0", "roundup_power2_divisions:4", "roundup_power2_divisions"),
])
def test_the_model_says_where_it_does_not_describe_the_allocator(version, conf, problem):
    found = model_problem(version, conf)
    assert found == problem if problem is None else problem in found


def test_where_the_model_does_not_hold_the_budget_asks_no_fit_of_it(monkeypatch):
    view = AllocatorView(torch.device("cuda", 0))
    view.problem = "not modelled here"
    monkeypatch.setattr(view, "mappable", lambda: pytest.fail("not asked"))
    assert view.short_of([1 << 30]) == []
