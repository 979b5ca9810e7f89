"""CPU: a host copy's state machine, and one step's copies in save order."""

import pytest
import torch

from te_offload_ops.engines.teo.copies import CopyState, HostCopy, StepCopies
from te_offload_ops.engines.teo.pool import HostBuffer
from teo_fakes import QueriedEvent, host_copy

S = CopyState


def _put_off(layer=3) -> HostCopy:
    return HostCopy(8, 0, 0, None, torch.zeros(8, dtype=torch.uint8), layer=layer)


def _host():
    return HostBuffer(torch.zeros(8, dtype=torch.uint8), 0)


def test_a_range_goes_to_the_host_and_back():
    c = _put_off()
    assert c.state is S.PUT_OFF and c.holds_source
    c.begin_copy(_host(), "copied")
    assert c.state is S.COPYING and c.copied == "copied" and c.ready is None
    c.copy_done()
    assert c.state is S.ON_HOST and c.source is None
    gpu = torch.ones(8, dtype=torch.uint8)
    c.begin_reload(gpu, "reloaded", "compute")
    assert c.state is S.RELOADING and c.gpu is gpu and c.reload_stream == "compute"
    c.reload_waited()
    assert c.state is S.RELOADED
    c.release_gpu()
    assert c.state is S.ON_HOST and c.gpu is None and c.reloaded == "reloaded"  # the buffer's last use stays known


def test_bytes_still_held_serve_in_place_and_go_back_to_their_copy_after():
    c = host_copy()
    source = c.source
    c.serve_in_place()
    assert c.state is S.IN_PLACE and c.gpu is source and c.reloaded is None
    c.release_gpu()  # its copy still runs: the bytes stay held for it
    assert c.state is S.COPYING and c.source is source and c.gpu is None
    c.serve_in_place()
    c.copy_done()  # the copy ended while in place: the backward still reads the bytes
    assert c.state is S.IN_PLACE and c.source is None and c.gpu is source
    c.release_gpu()
    assert c.state is S.ON_HOST


def test_a_put_off_range_serving_in_place_starts_its_copy_or_goes_uncopied():
    c = _put_off()
    c.serve_in_place()
    c.begin_copy(_host(), "copied")  # a region's end came before its last use: the copy starts now
    assert c.state is S.IN_PLACE and c.copied == "copied"
    c.release_gpu()
    assert c.state is S.COPYING
    d = _put_off()
    d.serve_in_place()
    d.discard()
    assert d.state is S.DISCARDED and d.source is None and d.gpu is None


@pytest.mark.parametrize("setup, action, match", [
    (lambda c: None, lambda c: c.copy_done(), "cannot let go of its bytes after the copy in state 'put off'"),
    (lambda c: None, lambda c: c.begin_reload(None, None, None), "cannot start a reload in state 'put off'"),
    (lambda c: c.begin_copy(_host(), "e"), lambda c: c.discard(), "cannot go uncopied in state 'copying'"),
    (lambda c: c.begin_copy(_host(), "e"), lambda c: c.begin_copy(_host(), "e"),
     "cannot start its copy to the host in state 'copying'"),
    (lambda c: (c.begin_copy(_host(), "e"), c.copy_done()), lambda c: c.serve_in_place(),
     "cannot serve in place in state 'on host'"),
    (lambda c: (c.begin_copy(_host(), "e"), c.copy_done()), lambda c: c.reload_waited(),
     "cannot be waited for in state 'on host'"),
    (lambda c: c.discard(), lambda c: c.release_gpu(), "cannot let go of its reload in state 'discarded'"),
    (lambda c: c.serve_in_place(), lambda c: c.release_gpu(), "before its copy to the host starts"),
])
def test_a_wrong_transition_names_the_state_it_came_from_and_the_one_asked(setup, action, match):
    c = _put_off(layer=3)
    setup(c)
    state = c.state
    with pytest.raises(RuntimeError, match=match) as err:
        action(c)
    assert "of layer 3" in str(err.value) and c.state is state  # nothing changed


def test_the_scan_lets_go_of_ended_copies_in_order_and_stops_at_the_first_running():
    copies = StepCopies()
    made = [host_copy(0, copied=QueriedEvent(f"c{i}", done)) for i, done in enumerate([True, False, True])]
    for c in made:
        copies.add(0, c)
    assert copies.holds_bytes() and copies.drop_copied()
    assert [c.state for c in made] == [S.ON_HOST, S.COPYING, S.COPYING]  # the third waits its turn
    made[1].copied.done = True
    assert copies.drop_copied() and not copies.holds_bytes() and not copies.in_flight


def test_held_copies_leave_out_those_in_place_and_the_layer_kept():
    copies = StepCopies()
    a, b, c = host_copy(0), host_copy(1), host_copy(2)
    for x in (a, b, c):
        copies.add(x.layer, x)
    b.serve_in_place()
    assert copies.held() == [a, c] and copies.held(keep_layer=2) == [a]
    assert [len(copies.layers[j].copies) for j in range(3)] == [1, 1, 1]
