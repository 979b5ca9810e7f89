"""CPU: when the backward of what ran inside a teo context is over (autograd prehooks)."""

import torch

from te_offload_ops.engines.teo.region import next_sequence_nr, watch_region


class _Handle:
    """What a saved-tensor hook hands autograd; says when autograd lets go of it."""

    def __init__(self, t, released):
        self.t, self.released = t, released

    def __del__(self):
        self.released.append(1)


def test_region_end_comes_once_after_the_region_ran_and_released_what_it_saved():
    saved, released, seen = [], [], []
    x = torch.randn(4, 4, requires_grad=True)
    before = torch.tanh(x)  # outside the region: created before it
    since = next_sequence_nr()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or _Handle(t, released), lambda h: h.t):
        a = torch.sigmoid(before)  # the region: two branches that join
        b = torch.exp(before)
        out = a * b
    del a, b
    inside, after = watch_region(out.grad_fn, since, lambda: seen.append(("end", len(released), len(saved))))
    assert (inside, after) == (3, 1)  # sigmoid, exp, mul; tanh was before `since`
    before.grad_fn.register_prehook(lambda _g: seen.append("tanh begins"))
    (out * 3).sum().backward()
    assert seen[0][0] == "end" and seen[0][1] == seen[0][2] > 0  # all released by then
    assert seen[1:] == ["tanh begins"]


def test_region_end_without_a_node_after_it_is_never_reported():
    x = torch.randn(4, requires_grad=True)  # a leaf feeds the region: no node runs after it
    since = next_sequence_nr()
    out = torch.sigmoid(x) * 2
    seen = []
    watch_region(out.grad_fn, since, lambda: seen.append("end"))
    out.sum().backward()
    assert seen == []


def test_no_region_is_watched_without_grad():
    with torch.no_grad():
        assert next_sequence_nr() is None
