"""CPU: the hint API ops call before large allocations, and who hears it."""

import re

import pytest
import torch

from te_offload_ops import hints


class _Listener:
    def __init__(self):
        self.heard = []

    def make_room(self, sizes, exact, device):
        self.heard.append((sizes, exact, device))


@pytest.fixture
def listener(monkeypatch):
    monkeypatch.setattr(hints, "_LISTENERS", type(hints._LISTENERS)())
    heard = _Listener()
    hints.listen(heard)
    return heard


def test_listeners_hear_each_allocation_or_a_total_and_the_device(listener):
    hints.make_room([16, 8], "cuda:1")
    hints.make_room(24)
    hints.make_room((4,), torch.device("cpu"))
    assert listener.heard == [([16, 8], True, torch.device("cuda", 1)), ([24], False, None),
                              ([4], True, torch.device("cpu"))]


def test_a_listener_is_held_weakly(listener, monkeypatch):
    assert hints.listeners() == [listener]
    monkeypatch.setattr(hints, "_LISTENERS", type(hints._LISTENERS)())
    other = _Listener()
    hints.listen(other)
    del other
    assert hints.listeners() == []
    hints.make_room(8)  # nobody left: nothing happens


@pytest.mark.parametrize("nbytes", [-1, 1.5, True, "8", [], [8, -1], [8, True], (8, 2.0)])
def test_make_room_refuses_what_is_not_a_byte_count(nbytes, listener):
    with pytest.raises(ValueError, match=re.escape(f"an int >= 0 or a list of them (one per allocation); got {nbytes!r}")):
        hints.make_room(nbytes)
    assert listener.heard == []
