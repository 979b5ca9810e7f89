"""CPU: teo under a memory budget: held until copied, the oldest waited for only where memory would
pass the budget or an announced allocation would fit no free block; the learned room; prefetches
put off for room; the last layer's copies put off at n = L; the looks' host cost; the target
budget's arithmetic."""

import pytest
import torch

from te_offload_ops import hints
from te_offload_ops.engines import offload_context, target_budget
from te_offload_ops.engines.teo import TeoEngine
from te_offload_ops.engines.teo.copies import CopyState
from teo_fakes import BIG, FakeEvent, FakeStream, budget_engine, fake_reloads, put_off_engine, queued_copies


def test_budget_is_an_option_of_teo_only():
    with pytest.raises(ValueError, match="memory_budget is an option of the teo engine, not of 'v2'"):
        offload_context("v2", num_layers=1, model_layers=2, memory_budget=1 << 30)
    assert offload_context("teo", num_layers=1, model_layers=2, memory_budget=1 << 30)[0].engine.memory_budget == 1 << 30
    assert offload_context("teo", num_layers=1, model_layers=2)[0].engine.memory_budget is None


def test_under_the_budget_no_layer_is_waited_for_at_its_release(monkeypatch):
    """n=2 of L=4: the layer schedule waits for layer 0 at layer 2's entry and layer 1 at layer 3's;
    with room in the budget nothing is waited for, and bytes go back only as their copies end."""
    engine, stream, _ = budget_engine(monkeypatch, 2, 4, budget=1000)
    made = []
    for j in range(4):
        engine.enter_layer()
        if j < 2:
            made += queued_copies(engine, j, done=[False, False])
        engine.layer_done(j)
    assert stream.waited == [] and all(c.source is not None for c in made)
    made[0].copied.done = made[1].copied.done = True
    engine.pack("x")  # a save looks again: layer 0's ended copies give their bytes back, no wait
    assert [c.source is None for c in made] == [True, True, False, False] and stream.waited == []
    assert engine.budget_waits == 0


def test_over_the_budget_the_oldest_copies_are_waited_for_until_it_fits(monkeypatch):
    """Four 8-byte copies held (32 bytes) over a base of 10, budget 40: an op announcing 6 bytes
    needs 8 back (10 + 32 + 6 - 40): the compute stream waits for the oldest copy only."""
    engine, stream, extra = budget_engine(monkeypatch, 2, 4, budget=40, base=10)
    engine.enter_layer()
    l0 = queued_copies(engine, 0, done=[False, False])
    engine.enter_layer()
    l1 = queued_copies(engine, 1, done=[False, False])
    engine.schedule.look(6)
    assert stream.waited == [l0[0].copied] and [c.source is None for c in l0 + l1] == [True, False, False, False]
    assert (engine.budget_waits, engine.budget_wait_bytes) == (1, 8)
    extra[0] = 12  # ops allocated more since: at the next layer entry 10 + 12 + 24 > 40 by 6
    engine.enter_layer()
    assert stream.waited == [l0[0].copied, l0[1].copied] and engine.budget_waits == 2


def test_a_dropped_source_that_frees_nothing_does_not_count_toward_the_room(monkeypatch):
    """A saved tensor still used elsewhere (the layer's output) frees nothing when the engine lets
    go of it: the engine reads the memory again and goes on to the next copy."""
    engine, stream, _ = budget_engine(monkeypatch, 1, 2, budget=20)
    engine.enter_layer()
    l0 = queued_copies(engine, 0, done=[False, False, False])
    still_used = l0[0].source  # a reference outside the engine keeps its bytes allocated
    memory = engine.schedule.read_memory
    engine.schedule.read_memory = lambda: memory() + (8 if l0[0].source is None else 0)
    engine.schedule.look(4)  # 24 + 4 - 20 = 8 over: the first frees nothing, the second frees 8
    assert stream.waited == [l0[0].copied, l0[1].copied] and l0[2].source is not None
    del still_used


def test_with_every_layer_offloaded_the_last_layer_stays_for_its_backward_in_place(monkeypatch):
    """n = L = 2 with room: no release at the last layer's sync; its backward uses its bytes in
    place, and a budget look in backward does not wait for a copy whose bytes serve in place."""
    engine, stream, extra = budget_engine(monkeypatch, 2, 2, budget=100)
    engine.enter_layer()
    l0 = queued_copies(engine, 0, done=[False])
    engine.layer_done(0)
    engine.enter_layer()
    l1 = queued_copies(engine, 1, done=[False, False])
    engine.layer_done(1)
    assert stream.waited == [] and all(c.source is not None for c in l0 + l1)
    sources = [c.source for c in l1]
    engine.reload(1)
    assert all(c.gpu is s for c, s in zip(l1, sources)) and stream.waited == []
    extra[0] = 90  # the backward allocates: 90 + 24 > 100; layer 1's serve in place, layer 0's copy is waited for
    engine.schedule.look()
    assert stream.waited == [l0[0].copied] and all(c.source is not None for c in l1)


def test_a_reload_makes_room_for_its_bytes_first_without_dropping_its_own(monkeypatch):
    """Layer 1's reload brings back 8 bytes (one copy ended and was let go; the other, still held,
    serves in place): the budget asks room for those 8, taken from layer 0's held bytes, never
    from layer 1's own."""
    engine, stream, _ = budget_engine(monkeypatch, 2, 3, budget=28)
    engine.enter_layer()
    l0 = queued_copies(engine, 0, done=[False])
    engine.enter_layer()
    l1 = queued_copies(engine, 1, done=[False, False])
    l1[0].copy_done()  # as if its copy had ended (and its bytes gone back): 16 bytes held
    engine.enter_layer()
    assert stream.waited == []
    engine.d2h, engine.h2d = FakeStream("d2h"), FakeStream("h2d")
    reloaded = fake_reloads(monkeypatch)
    engine.reload(1)  # 16 held + 8 coming back = 24 <= 28: nothing waited for
    assert stream.waited == [] and reloaded == [l1[0]] and l1[1].gpu is l1[1].source
    assert l1[1].state is CopyState.IN_PLACE
    engine.copies.layers[1].reloaded = False
    l1[1].release_gpu()  # back to being held for its running copy
    engine.schedule.memory_budget = 20  # now 16 + 8 > 20: layer 0's copy is waited for, layer 1's held one stays
    engine.reload(1)
    assert stream.waited == [l0[0].copied] and l1[1].source is not None and l0[0].source is None


def test_make_room_reaches_budget_engines_on_the_device_only(monkeypatch):
    engine, stream, _ = budget_engine(monkeypatch, 1, 2, budget=16)
    engine.enter_layer()
    l0 = queued_copies(engine, 0, done=[False, False])
    plain = TeoEngine(1, 2)  # no budget: never asked
    assert hints.listeners() == [engine.schedule] and plain.schedule.memory_budget is None
    engine.device = torch.device("cuda", 1)
    hints.make_room(8, torch.device("cuda", 0))  # another GPU: nothing
    assert stream.waited == []
    hints.make_room(8, torch.device("cuda", 1))  # 16 + 8 > 16: the oldest copy waited for
    assert stream.waited == [l0[0].copied]
    hints.make_room(12)  # any device: 8 + 12 > 16
    assert stream.waited == [l0[0].copied, l0[1].copied]


def test_allocations_that_fit_no_free_block_make_held_copies_go_back_though_under_the_budget(monkeypatch):
    """Memory far under the budget, but the allocator (as the fake room tells) could place the
    announced allocations only once 16 bytes of held copies are free: the oldest two saved on this
    stream are waited for (one saved on a side stream would free into that stream's pool), then no
    more; a total announced as one int asks nothing of the room."""
    engine, stream, _ = budget_engine(monkeypatch, 2, 4, budget=1000)
    engine.enter_layer()
    l0 = queued_copies(engine, 0, done=[False, False])
    engine.enter_layer()
    l1 = queued_copies(engine, 1, done=[False, False])
    asked = []

    def room(sizes, stream=None):
        asked.append(list(sizes))
        freed = sum(c.nbytes for c in l0 + l1 if c.source is None)
        return [] if freed >= 16 else [max(sizes)]

    engine.schedule.short_of = room
    engine.device = torch.device("cuda", 0)
    engine.schedule.trace = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent())
    hints.make_room(24)  # one int: a total, not an allocation; 48 is far under 1000
    assert asked == [] and stream.waited == []
    l0[1].source_stream = FakeStream()  # saved on a side stream: its bytes would not serve this stream
    hints.make_room([16, 8], torch.device("cuda", 0))
    assert asked == [[16, 8]] * 3 and stream.waited == [l0[0].copied, l1[0].copied]
    assert [c.source is None for c in l0 + l1] == [True, False, True, False]
    assert [w["why"] for w in engine.schedule.trace[0]["waits"]] == ["fit", "fit"]
    assert (engine.budget_waits, engine.budget_wait_bytes) == (2, 16)


def _layer_of_three_copies_to_reload(monkeypatch):
    """A budget engine (40 bytes) with layer 1's three 8-byte copies ended and given back, and
    reloads that take their bytes at once: (engine, extra memory, layer 1's copies, reloads started)."""
    engine, stream, extra = budget_engine(monkeypatch, 2, 3, budget=40)
    engine.enter_layer()
    engine.enter_layer()
    l1 = queued_copies(engine, 1, done=[True, True, True])
    engine.enter_layer()  # the ended copies give their bytes back: nothing held
    engine.d2h, engine.h2d = FakeStream("d2h"), FakeStream("h2d")
    return engine, extra, l1, fake_reloads(monkeypatch, take=True)


def test_a_put_off_prefetch_starts_the_copies_that_fit_the_last_saved_first(monkeypatch):
    """Layer 1's three 8-byte copies into a budget of 40 with 21 in use: 19 bytes of room take two,
    the last saved first (the backward uses them first), and only as many as the allocator has free
    blocks for (one, then the other at the next look); the layer stays put off. At a region's end
    with room the third starts, and the layer counts as reloaded; a use then copies nothing again.
    Released after its backward, the early copies go back with the rest."""
    engine, extra, l1, reloaded = _layer_of_three_copies_to_reload(monkeypatch)
    extra[0] = 21
    engine.device = torch.device("cuda", 0)
    engine.schedule.short_of = lambda sizes, stream=None: sizes[1:]  # the allocator has a block for one of them only
    assert engine.reload(1, prefetch=True) is False
    assert reloaded == [l1[2]] and engine.schedule.deferred == [1] and not engine.copies.layers[1].reloaded
    engine.schedule.short_of = lambda sizes, stream=None: []
    assert engine.reload(1, prefetch=True) is False  # 19 - 8 = 11 bytes of room left: one more
    assert reloaded == [l1[2], l1[1]] and engine.schedule.deferred == [1] and not engine.copies.layers[1].reloaded
    assert (engine.reloads_deferred, engine.reloads_started_early) == (1, 2)
    extra[0] = 5  # the backward freed room (the early copies count in the memory too: 5 + 16 + 8 <= 40)
    engine.region_backward_done(2)
    assert reloaded == [l1[2], l1[1], l1[0]] and engine.schedule.deferred == [] and engine.copies.layers[1].reloaded
    assert engine.reload(1) is True and len(reloaded) == 3
    engine.release_reload(1)
    assert all(c.gpu is None for c in l1) and not engine.copies.layers[1].reloaded


def test_a_layer_started_in_part_whose_backward_ended_unused_is_not_reloaded_again(monkeypatch):
    """A put-off prefetch started two of layer 1's copies; its region's backward ends without a use:
    the early copies go back and the layer leaves the put-off list, so no later look reloads it."""
    engine, extra, l1, reloaded = _layer_of_three_copies_to_reload(monkeypatch)
    extra[0] = 21
    assert engine.reload(1, prefetch=True) is False and reloaded == [l1[2], l1[1]]
    extra[0] = 0
    engine.region_backward_done(1)
    assert engine.schedule.deferred == [] and all(c.gpu is None for c in l1) and reloaded == [l1[2], l1[1]]


def test_held_copies_stay_where_giving_them_all_back_could_not_fit_the_allocation(monkeypatch):
    """An announced allocation of 100 bytes fits nowhere; the allocator could give one allocation at
    most 50 bytes now (free blocks and room to map), and the four held copies free 32: no copy is
    waited for (it would cost the wait and leave the allocation as short), and the look is counted.
    With 70 bytes of room they could help: the oldest go back one by one until it fits."""
    engine, stream, _ = budget_engine(monkeypatch, 2, 4, budget=1000)
    engine.enter_layer()
    l0 = queued_copies(engine, 0, done=[False, False])
    engine.enter_layer()
    l1 = queued_copies(engine, 1, done=[False, False])
    engine.device = torch.device("cuda", 0)
    engine.schedule.short_of = lambda sizes, stream=None: [] if sum(c.nbytes for c in l0 + l1 if c.source is None) >= 24 else [100]
    engine.schedule.most_room = lambda stream=None: 50
    hints.make_room([100], torch.device("cuda", 0))
    assert stream.waited == [] and all(c.source is not None for c in l0 + l1)
    assert (engine.fits_given_up, engine.budget_waits) == (1, 0)
    engine.schedule.most_room = lambda stream=None: 70
    hints.make_room([100], torch.device("cuda", 0))
    assert [c.source is None for c in l0 + l1] == [True, True, True, False]
    assert (engine.fits_given_up, engine.budget_waits) == (1, 3)


def test_over_the_budget_copies_go_back_even_where_no_fit_could_be_helped(monkeypatch):
    """The budget's own drops do not depend on the fit: 10 + 32 + 10 bytes against a budget of 44 is
    8 over, so the oldest copy goes back though the allocator could give at most 20 bytes at once and
    the announced 100 fits nowhere; then the fit gives up (copies saved on a side stream, not counted
    toward what giving back could free, are left alone too)."""
    engine, stream, _ = budget_engine(monkeypatch, 2, 4, budget=44, base=10)
    engine.enter_layer()
    l0 = queued_copies(engine, 0, done=[False, False])
    engine.enter_layer()
    l1 = queued_copies(engine, 1, done=[False, False])
    l1[1].source_stream = FakeStream()
    engine.device = torch.device("cuda", 0)
    engine.schedule.short_of = lambda sizes, stream=None: [100]
    most = []
    engine.schedule.most_room = lambda stream=None: most.append(stream) or 20
    engine.schedule.look(10, sizes=[10, 100])
    assert stream.waited == [l0[0].copied] and [c.source is None for c in l0 + l1] == [True, False, False, False]
    assert (engine.budget_waits, engine.fits_given_up, len(most)) == (1, 1, 1)


def test_a_reload_asks_room_for_each_copy_it_brings_back(monkeypatch):
    """Reloads allocate one block per copy: the budget's fit is asked with each copy's size (where a
    held copy could be given back to make room; with none held nothing is asked: nothing could help)."""
    engine, stream, _ = budget_engine(monkeypatch, 3, 4, budget=1000)
    engine.enter_layer()
    engine.enter_layer()
    l1 = queued_copies(engine, 1, done=[True, True])
    engine.enter_layer()  # the ended copies give their bytes back
    l2 = queued_copies(engine, 2, done=[False])  # still held
    assert all(c.source is None for c in l1) and l2[0].source is not None
    asked = []
    engine.schedule.short_of = lambda sizes, stream=None: asked.append(list(sizes)) or []
    engine.device = torch.device("cuda", 0)
    engine.d2h, engine.h2d = FakeStream("d2h"), FakeStream("h2d")
    fake_reloads(monkeypatch)
    engine.reload(1)
    assert asked == [[c.nbytes for c in l1]] and stream.waited == []
    engine.copies.layers[1].reloaded = False
    l2[0].copied.done = True  # nothing held any more: the fit has nothing to give back
    engine.reload(1)
    assert asked == [[c.nbytes for c in l1]] and l2[0].source is None


def test_the_budget_keeps_room_for_what_ops_allocated_after_a_look_in_the_last_step(monkeypatch):
    """Budget 34, 16 bytes held over a base of 10. Step 1: a save looks at 26 (under the budget);
    then ops allocate 12 bytes the engine cannot see coming (saved-tensor hooks see outputs once
    made): 38, over the budget until the next look waits for a copy. Step 2 learned those 12 bytes
    for that look: it waits there, before the ops allocate, and the memory stays within the budget.
    What a look announces is not counted again (a reload's own bytes)."""
    engine, stream, extra = budget_engine(monkeypatch, 1, 2, budget=34, base=10)
    monkeypatch.setattr(engine.pool, "release", lambda buf, ready: None)  # the fake copies have no host buffers
    peaks = []
    for step in range(2):
        extra[0] = 0
        engine.enter_layer()
        queued_copies(engine, 0, done=[False, False])
        waited = len(stream.waited)
        engine.pack("x")  # a save looks: 26 bytes in use
        waited_at_save = len(stream.waited) - waited
        extra[0] = 12  # the next op's outputs
        peaks.append(engine.schedule.read_memory())
        engine.enter_layer()  # layer 1 looks: over the budget (step 1) or not (step 2)
        engine.schedule.look(5, where="make_room")  # an announced allocation, then made
        extra[0] += 5
        engine.pack("y")
        engine.finish_backward()  # its backward ran through: a step whose bursts teach the next
        assert (step, waited_at_save) in ((0, 0), (1, 1))
    assert peaks == [38, 30]  # step 2 waited for one 8-byte copy before the ops allocated
    assert engine.schedule.headroom.learned()[0][("save", 0, None, 0)] == 12
    assert engine.schedule.headroom.learned()[0][("make_room", 1, None, 0)] == 0  # announced bytes are not a burst


def test_the_learned_room_counts_what_ops_allocated_before_ended_copies_gave_bytes_back(monkeypatch):
    """Ops allocate 12 bytes after a save; a copy (8 bytes) ends before the next look, which gives
    its bytes back: the growth up to that look was 12, not 4. A step whose backward did not run
    through (abandoned) teaches nothing; the room is the larger of the last two steps'."""
    engine, stream, extra = budget_engine(monkeypatch, 1, 2, budget=100, base=10)
    monkeypatch.setattr(engine.pool, "release", lambda buf, ready: None)

    def step(growth, finish=True):
        extra[0] = 0
        engine.enter_layer()
        copies = queued_copies(engine, 0, done=[False, False])
        engine.pack("x")
        extra[0] = growth
        copies[0].copied.done = True  # ended before the next look
        engine.enter_layer()
        if finish:
            engine.finish_backward()
        else:
            engine.abandon_step()

    key = ("save", 0, None, 0)
    step(12)
    assert engine.schedule.headroom.learned()[0][key] == 12
    step(30, finish=False)
    assert len(engine.schedule.headroom.learned()) == 1 and engine.schedule.headroom.learned()[0][key] == 12
    step(5)
    extra[0] = 0
    engine.enter_layer()
    queued_copies(engine, 0, done=[False])
    engine.pack("x")
    assert engine.schedule.margin == 12  # the larger of the last two whole steps' 5 and 12


def test_budget_engines_read_allocated_and_reserved_bytes_from_one_nested_read(monkeypatch):
    """The memory read at a look: the nested statistics' current allocated bytes (0 where the
    allocator has none yet), with the reserved bytes the fit's room check needs from the same read,
    never torch.cuda.memory_allocated's or memory_reserved's flattened and sorted copy of them all."""
    engine = TeoEngine(1, 2, memory_budget=1 << 30)
    engine.device = torch.device("cuda", 0)
    asked = []
    stats = {"allocated_bytes": {"all": {"current": 1234}}, "reserved_bytes": {"all": {"current": 4096}}}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: asked.append(device) or stats)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: pytest.fail("the flattened read"))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: pytest.fail("the flattened read"))
    assert engine.schedule._read() == 1234 and asked == [0] and engine.schedule.allocator.reserved == 4096
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {})
    assert engine.schedule._read() == 0 and engine.schedule.allocator.reads == 2


def test_a_prefetch_past_the_budget_waits_for_room_and_a_use_never_waits(monkeypatch):
    """Layer 1's 16 bytes come back into a budget of 40 with 30 in use: its prefetch is put off
    (nothing held to give back); once the backward frees room, the next region's end starts it (a
    use, where an op is about to allocate, does not). A reload for a use starts whatever the
    budget says."""
    engine, stream, extra = budget_engine(monkeypatch, 2, 3, budget=40)
    engine.enter_layer()
    engine.enter_layer()
    l1 = queued_copies(engine, 1, done=[True, True])
    engine.enter_layer()  # the ended copies give their bytes back: nothing held
    engine.d2h, engine.h2d = FakeStream("d2h"), FakeStream("h2d")
    reloaded = fake_reloads(monkeypatch)
    extra[0] = 33  # 7 bytes of room: not one 8-byte copy fits
    assert engine.reload(1, prefetch=True) is False
    assert reloaded == [] and engine.reloads_deferred == 1 and engine.schedule.deferred == [1]
    engine.region_backward_done(2)  # a region's end with no more room: still put off, counted once
    assert reloaded == [] and engine.reloads_deferred == 1
    extra[0] = 20  # the backward freed 10: 20 + 16 <= 40
    engine.unpack("kept on the GPU")  # a use (an op is about to allocate): not the moment
    assert reloaded == [] and engine.schedule.deferred == [1]
    engine.region_backward_done(2)
    assert reloaded == l1 and engine.schedule.deferred == [] and engine.copies.layers[1].reloaded
    engine.copies.layers[1].reloaded = False
    reloaded.clear()
    extra[0] = 39
    assert engine.reload(1) is True and reloaded == l1  # for a use: no waiting for room


# ------------------------------------------------------------------------------------------------
# n = L under a budget: the last layer's copies are put off until the budget needs their bytes


def test_with_every_layer_offloaded_the_last_layers_copies_wait_for_the_budget(monkeypatch):
    """n = L under a budget with room: the first layer's saves are copied at once; the last layer's
    are held on the GPU with no copy queued, no host buffer taken and nothing counted as offloaded;
    its backward uses them in place and its end lets them go, still without a copy."""
    engine, stream, extra, d2h = put_off_engine(monkeypatch, budget=1 << 40)
    first, last = torch.arange(BIG, dtype=torch.float32), torch.arange(BIG, dtype=torch.float32) * 2
    engine.enter_layer()
    engine.pack(first)
    engine.layer_done(0)
    engine.enter_layer()
    handle = engine.pack(last)
    engine.layer_done(1)
    (c0,), (c1,) = engine.copies.layers[0].copies, engine.copies.layers[1].copies
    assert c0.copied is not None and c0.host is not None and torch.equal(c0.host.tensor[: c0.nbytes].view(torch.float32), first)
    assert c1.copied is None and c1.host is None and c1.source is not None
    assert engine.counter.total == BIG * 4 and engine.pool.in_use == 1  # the first layer's only
    engine._finish_queued = True  # (as in a backward: the step's end is queued there)
    engine.backward_boundary(1)
    out = engine.unpack(handle)
    assert out.data_ptr() == last.data_ptr() and torch.equal(out, last)  # in place
    waited = list(stream.waited)
    engine.region_backward_done(1)
    assert c1.source is None and c1.gpu is None and c1.copied is None  # gone without a copy
    assert stream.waited == waited and engine.counter.total == BIG * 4 and engine.pool.in_use == 1
    with pytest.raises(RuntimeError, match="layer 1 was unpacked more often than it was saved, after its layer's "
                                           "backward ended; its copy to the host was put off"):
        engine.unpack(handle)


def test_a_put_off_copy_starts_when_the_budget_needs_its_bytes(monkeypatch):
    """Over the budget with only the last layer's bytes held: its copy starts then (counted as
    offloaded), the compute stream waits for it, and the bytes go back; the data reaches the host."""
    engine, stream, extra, d2h = put_off_engine(monkeypatch, budget=1 << 40)
    engine.enter_layer()
    engine.layer_done(0)
    engine.enter_layer()
    last = torch.arange(BIG, dtype=torch.float32)
    engine.pack(last)
    (c1,) = engine.copies.layers[1].copies
    assert c1.copied is None and engine.counter.total == 0
    engine.schedule.memory_budget = BIG * 4  # the held bytes plus what comes next pass it
    engine.schedule.look(1)
    assert c1.copied is not None and c1.source is None and stream.waited == [c1.copied]
    assert engine.counter.total == BIG * 4 and engine.budget_waits == 1
    assert torch.equal(c1.host.tensor[: c1.nbytes].view(torch.float32), last)


def test_a_put_off_copy_not_yet_used_when_its_region_ends_starts_then_and_reloads_later(monkeypatch):
    """A region's end reported before all its uses (multi-threaded autograd, a reentrant
    checkpoint): the range used already goes without a copy; the one not yet used starts its copy
    to the host then (counted then), stays held, no stream waiting, until the copy is seen to end,
    and its later use reloads it with the right bytes."""
    engine, stream, extra, d2h = put_off_engine(monkeypatch, budget=1 << 40)
    engine.enter_layer()
    engine.layer_done(0)
    engine.enter_layer()
    a, b = torch.arange(BIG, dtype=torch.float32), torch.arange(BIG, dtype=torch.float32) * 3
    ha, hb = engine.pack(a), engine.pack(b)
    engine.layer_done(1)
    engine._finish_queued = True
    engine.backward_boundary(1)
    assert torch.equal(engine.unpack(ha), a)
    engine.region_backward_done(1)  # too early: b is still to be used
    ca, cb = engine.copies.layers[1].copies
    assert ca.copied is None and ca.host is None and ca.source is None  # used: gone without a copy
    assert cb.copied is not None and cb.source is not None and cb.copied not in stream.waited
    assert engine.counter.total == BIG * 4
    cb.copied.done = True
    engine.schedule.look()  # a look sees the copy ended: its bytes go back
    assert cb.source is None and cb.copied not in stream.waited
    b_again = engine.unpack(hb)
    assert b_again.data_ptr() != b.data_ptr() and torch.equal(b_again, b)  # reloaded from the host


def test_a_step_whose_backward_never_ran_lets_put_off_copies_go_without_starting_them(monkeypatch):
    """A forward, then the next step's forward with no backward between (evaluation, a skipped
    step): the last layer's put-off copies never start, and no pinned buffer is given back for them."""
    engine, stream, extra, d2h = put_off_engine(monkeypatch, budget=1 << 40)
    for _ in range(2):
        engine.enter_layer()
        engine.pack(torch.arange(BIG, dtype=torch.float32))
        engine.layer_done(0)
        engine.enter_layer()
        engine.pack(torch.arange(BIG, dtype=torch.float32))
        engine.layer_done(1)
    assert engine.step == 1 and engine.pool.in_use == 1  # the first step's layer-0 buffer went back
    assert engine.counter.total == 2 * BIG * 4 and all(c.copied is None for c in engine.copies.layers[1].copies)


@pytest.mark.parametrize("n, L, budget", [(1, 2, 1 << 40), (2, 2, None)])
def test_copies_are_put_off_only_for_the_last_layer_of_a_budget_engine_offloading_all(n, L, budget):
    engine = TeoEngine(n, L, memory_budget=budget)
    assert not any(engine.schedule.puts_off_copies(j) for j in range(L))
    assert TeoEngine(L, L, memory_budget=1 << 40).schedule.puts_off_copies(L - 1)
    assert not TeoEngine(L, L, memory_budget=1 << 40).schedule.puts_off_copies(L - 2)


def test_a_backward_boundary_look_never_gives_back_the_bytes_of_the_layer_it_begins(monkeypatch):
    """Over the budget as layer 1's backward begins: older layers' copies are waited for, never
    layer 1's own held bytes (its backward would bring them straight back)."""
    engine, stream, extra = budget_engine(monkeypatch, 2, 2, budget=100)
    engine.enter_layer()
    l0 = queued_copies(engine, 0, done=[False])
    engine.enter_layer()
    l1 = queued_copies(engine, 1, done=[False, False])
    engine._finish_queued = True  # (as in a backward: the step's end is queued there)
    monkeypatch.setattr(engine, "reload", lambda layer, prefetch=False: True)
    extra[0] = 90  # 90 + 24 held > 100, and still over once layer 0's 8 are back
    engine.backward_boundary(1)
    assert stream.waited == [l0[0].copied] and all(c.source is not None for c in l1)


# ------------------------------------------------------------------------------------------------
# What a look costs the host: the allocator is read only where the look could act


def _counted_reads(engine):
    reads, read = [], engine.schedule.read_memory
    engine.schedule.read_memory = lambda: reads.append(1) or read()
    return reads


def test_a_look_with_nothing_to_give_back_reads_nothing_once_the_last_growth_is_closed(monkeypatch):
    """While copies are held every look reads the memory; the first look after the last held bytes
    went back reads once more (it closes the growth after the look before it), then looks read
    nothing until bytes are held again. Such looks are still counted (their keys stay in step)."""
    engine, stream, extra = budget_engine(monkeypatch, 1, 2, budget=1000)
    reads = _counted_reads(engine)
    engine.enter_layer()  # nothing held, nothing open: no read
    assert reads == [] and engine.schedule.looks == 1
    l0 = queued_copies(engine, 0, done=[False])
    engine.pack("x")
    assert len(reads) == 1 and engine.schedule.headroom.open is not None
    l0[0].copied.done = True
    engine.pack("y")  # closes the growth, sees the copy ended (a second read after it let go), holds nothing
    assert len(reads) == 3 and engine.schedule.headroom.open is None
    for _ in range(5):
        engine.pack("z")
        engine.unpack("kept")
    hints.make_room([64, 64])
    assert len(reads) == 3 and engine.schedule.looks == 14


def test_a_copy_given_back_costs_one_read_after_its_wait(monkeypatch):
    engine, stream, extra = budget_engine(monkeypatch, 1, 2, budget=20, base=10)
    engine.enter_layer()
    queued_copies(engine, 0, done=[False, False])
    reads = _counted_reads(engine)
    engine.schedule.look(4)  # 10 + 16 + 4 - 20 = 10 over: both copies go back, a read after each
    assert engine.budget_waits == 2 and len(reads) == 1 + 2


def test_announcements_outside_the_engines_step_or_under_capture_are_not_its_business(monkeypatch):
    """Another model's announcements between this engine's steps (its step over, the next not begun),
    or any under CUDA graph capture, leave it alone: no look, no key counted."""
    from te_offload_ops import capture

    engine, stream, extra = budget_engine(monkeypatch, 1, 2, budget=1)
    hints.make_room([8])  # before its first step
    engine.enter_layer()
    queued_copies(engine, 0, done=[False])
    monkeypatch.setattr(capture, "capturing", lambda: True)
    hints.make_room([8])
    monkeypatch.setattr(capture, "capturing", lambda: False)
    assert engine.schedule.looks == 1 and stream.waited == []  # the layer entry only
    engine.finish_backward()
    hints.make_room([8])
    assert engine.schedule.looks == 1


# ------------------------------------------------------------------------------------------------
# The budget of a target peak


MiB = 1 << 20


def test_target_budget_frees_a_share_of_the_moved_bytes_below_no_offloads_peak():
    kw = dict(floor_bytes=1000 * MiB, no_offload_peak_bytes=4000 * MiB, moved_bytes=600 * MiB, model_layers=8)
    assert target_budget(num_layers=7, freed=1, **kw) == 4400 * MiB
    assert target_budget(num_layers=7, **kw) == int(5000 * MiB - 600 * MiB * 0.96)  # 0.96 by default
    assert target_budget(num_layers=7, freed=1, slack_bytes=512 * MiB, **kw) == 4912 * MiB
    # n = L: the last layer's bytes are on the GPU at the peak under any schedule; the target frees the rest
    assert target_budget(num_layers=8, freed=1, **kw) == 5000 * MiB - 600 * MiB * 7 // 8
    assert target_budget(num_layers=8, freed=0.5, **kw) == int(5000 * MiB - (600 * MiB * 7 // 8) * 0.5)


@pytest.mark.parametrize("change, error, match", [
    ({"freed": 0}, ValueError, r"freed must be a share of the moved bytes in \(0, 1\], got 0"),
    ({"freed": 1.2}, ValueError, "got 1.2"),
    ({"freed": True}, ValueError, "got True"),
    ({"moved_bytes": -1}, ValueError, "moved_bytes must be >= 0, got -1"),
    ({"floor_bytes": 1.5}, TypeError, "floor_bytes must be an int, got float"),
    ({"num_layers": 9}, ValueError, "0 <= num_layers <= model_layers"),
    ({"moved_bytes": 10**12}, ValueError, "the target budget is -"),
])
def test_target_budget_refuses_what_no_step_could_measure(change, error, match):
    kw = dict(floor_bytes=1000, no_offload_peak_bytes=4000, moved_bytes=600, num_layers=7, model_layers=8)
    with pytest.raises(error, match=match):
        target_budget(**{**kw, **change})


def test_an_engine_no_one_holds_stops_hearing_announcements_at_once(monkeypatch):
    monkeypatch.setattr(hints, "_LISTENERS", type(hints._LISTENERS)())
    engine = offload_context("teo", num_layers=1, model_layers=2, memory_budget=1)[0].engine
    assert hints.listeners() == [engine.schedule]
    del engine
    assert hints.listeners() == []  # no cycle keeps it for the garbage collector


def test_the_budgets_figures_read_through_the_engine(monkeypatch):
    engine, stream, extra = budget_engine(monkeypatch, 1, 2, budget=20, base=10)
    engine.budget_trace = []
    engine.enter_layer()
    queued_copies(engine, 0, done=[False, False])
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent())
    engine.schedule.look(4)
    assert (engine.budget_waits, engine.budget_wait_bytes, engine.budget_margin) == (2, 16, 0)
    assert engine.budget_trace is engine.schedule.trace and len(engine.budget_trace) == 1
    plain = TeoEngine(1, 2)
    assert (plain.memory_budget, plain.budget_waits, plain.budget_trace) == (None, 0, None)
