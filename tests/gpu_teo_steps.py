"""Test helpers for the teo engine's GPU tests: what a step should move per layer, and copies slowed
on purpose so that they still run when the schedule reaches them."""

import torch

from te_offload_ops.engines.teo import TeoEngine
from te_offload_ops.policy import MIN_OFFLOAD_NUMEL

LAYERS = 3


def _union_bytes(ranges) -> int:
    """Bytes covered by (start, nbytes) ranges: views of one saved range are copied once."""
    total, end = 0, -1
    for start, n in sorted(ranges):
        if start + n > end:
            total += start + n - max(start, end)
            end = start + n
    return total


def expected_bytes(recorder, layer: int) -> int:
    """What an engine with V2's rule moves for ``layer``: its large activations that no op kept
    (an op that keeps a tensor another op saved keeps it for both). Only the layer's own entries
    count: teo hands a moved tensor's memory back during the forward (a layer or more later), so
    another layer's kept tensor can sit at the same address."""
    mine = [e for e in recorder.entries if e.op.startswith(f"L{layer}.")]
    kept = {(e.data_ptr, e.nbytes) for e in mine if e.kept}
    return _union_bytes({(e.data_ptr, e.nbytes) for e in mine
                         if e.kind == "activation" and e.numel >= MIN_OFFLOAD_NUMEL and (e.data_ptr, e.nbytes) not in kept})


def moved_by_layer(moved: dict) -> dict[int, int]:
    out = {}
    for key, n in moved.items():
        op = key[0] if isinstance(key, tuple) else key.split("|")[0]
        layer = int(op.split(".")[0][1:])
        out[layer] = out.get(layer, 0) + n
    return out


def slow_copies_to_host(monkeypatch, ns: int = 2_000_000) -> None:
    """Each copy to the host queued behind a sleep of ``ns`` on the copy stream: copies still run
    when the schedule reaches them."""
    start_copy = TeoEngine.start_copy

    def slow_start_copy(self, c):
        d2h, _ = self.streams()
        with torch.cuda.stream(d2h):
            torch.cuda._sleep(ns)
        return start_copy(self, c)

    monkeypatch.setattr(TeoEngine, "start_copy", slow_start_copy)


def slow_reloads(monkeypatch, ns: int = 1_000_000) -> None:
    """Each layer's reloads queued behind a sleep of ``ns`` on the copy stream back."""
    reload = TeoEngine.reload

    def slow_reload(self, layer, prefetch=False):
        if self.h2d is not None:
            with torch.cuda.stream(self.h2d):
                torch.cuda._sleep(ns)
        return reload(self, layer, prefetch)

    monkeypatch.setattr(TeoEngine, "reload", slow_reload)
