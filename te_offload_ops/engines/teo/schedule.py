"""When teo moves bytes: the forward's releases and the backward's reloads.

A :class:`Schedule` decides, at the engine's events, when an offloaded layer's GPU bytes go back in
the forward and whether a reload may start now. Two strategies share the interface:

* :class:`LayerSchedule` (the default): layer ``i``'s bytes go back by layer ``i + b``'s entry
  (``b = max(L - n, 1)``, :func:`release_lag`), the streams waiting for its copies still running.
  That wait is the backpressure that keeps the forward within the no-offload peak less what is
  offloaded when copies are slower than the compute that makes activations. Between releases the
  copies the host sees ended give their bytes back at once.
* ``budget.BudgetSchedule`` (``memory_budget``): no release schedule; bytes go back where memory
  would pass the budget.

Reloads follow :func:`reloads_at_backward_start` and :func:`reloads_at_region_end` under either:
a layer's reload starts as soon as enough of the layers after it have finished their backward for
its bytes to fit under the no-offload peak less what was offloaded (peak-neutral). ``reload_ahead``
starts each reload that many layers earlier still: where a reload takes longer than the backward
between its start and its use (with ``n = L - 1`` peak-neutral leaves it only what runs outside
the offloaded region), each layer ahead hides up to one layer's backward of copy time for up to one
offloaded layer's bytes more at the peak.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

from .copies import wait_and_give_back

__all__ = ["LayerSchedule", "Schedule", "peak_neutral_lead", "release_lag", "reloads_at_backward_start",
           "reloads_at_region_end"]


def release_lag(num_layers: int, model_layers: int) -> int:
    """How many layers after it an offloaded layer's GPU bytes are given back in forward: the
    forward then holds at most ``L - n`` layers' offloadable activations (at least the layer being
    run), as the peak at the start of backward does."""
    return max(model_layers - num_layers, 1)


def peak_neutral_lead(num_layers: int, model_layers: int) -> int:
    """How many layers ahead of its backward an offloaded layer may be back on the GPU without
    raising the step's peak: L - 1 - n (the peak, at the start of backward, holds the L - n
    layers not offloaded; each layer whose backward is over frees room for one reload). TE V2's
    default schedule uses the same distance, with its reloads at layer starts."""
    return max(model_layers - 1 - num_layers, 0)


def reloads_at_backward_start(layer: int, num_layers: int, model_layers: int, ahead: int = 0) -> list[int]:
    """Offloaded layers whose reload starts when layer ``layer``'s backward begins, the one needed
    first first: ``layer`` itself (needed now) and the layer ``peak_neutral_lead + ahead`` below it,
    where TE V2 would start it with ``ahead=0`` (normally already started by
    :func:`reloads_at_region_end`). The backward's first layer also starts every layer between,
    whose points would fall before the backward began."""
    lead = peak_neutral_lead(num_layers, model_layers) + ahead
    first = layer == model_layers - 1
    candidates = range(layer, layer - lead - 1, -1) if first else (layer, layer - lead)
    return [j for j in dict.fromkeys(candidates) if 0 <= j < num_layers]


def reloads_at_region_end(layer: int, num_layers: int, model_layers: int, ahead: int = 0) -> list[int]:
    """Offloaded layers whose reload starts when the backward of ``layer``'s region is over and its
    memory has gone back: the layer ``peak_neutral_lead + ahead + 1`` below."""
    j = layer - peak_neutral_lead(num_layers, model_layers) - ahead - 1
    return [j] if 0 <= j < num_layers else []


class Schedule:
    """What a schedule decides, at the engine's events. The base decides nothing: every hook is a
    no-op, every reload starts whole."""

    memory_budget: Optional[int] = None

    def attach(self, engine: Any) -> None:
        """``engine``: the TeoEngine this schedule decides for (its copies, layers and reloads), held
        weakly: an engine no context holds any more goes at once, and stops hearing ops' hints."""
        self.engine = weakref.proxy(engine)

    def puts_off_copies(self, layer: int) -> bool:
        """Whether ``layer``'s copies to the host wait until their bytes are needed."""
        return False

    def layer_entered(self, layer: int) -> None:
        """Layer ``layer``'s forward begins."""

    def saving(self) -> None:
        """A tensor is being saved (before the engine decides on it)."""

    def using(self) -> None:
        """A saved tensor is being unpacked."""

    def layer_done(self, layer: int) -> None:
        """Layer ``layer``'s forward ended (its sync)."""

    def backward_begins(self, layer: int) -> None:
        """Layer ``layer``'s backward begins, before later layers' reloads go back."""

    def backward_ready(self, layer: int) -> None:
        """Layer ``layer``'s backward begins, after later layers' reloads went back."""

    def reload_now(self, layer: int, pending: list, prefetch: bool) -> Optional[list]:
        """Before ``layer``'s reload: None to start it whole, or the copies of ``pending`` to start
        now, the rest put off (a ``prefetch`` only)."""
        return None

    def region_ended(self) -> None:
        """A region's backward is over and its reloads went back."""

    def reload_dropped(self, layer: int) -> None:
        """``layer``'s reloads went back (its backward is over)."""

    def step_ended(self, ran_through: bool) -> None:
        """The step's copies are gone; ``ran_through``: its backward finished."""


class LayerSchedule(Schedule):
    """Layer ``i``'s GPU bytes go back by layer ``i + release_lag``'s entry, after its copies."""

    def layer_entered(self, layer: int) -> None:
        self.engine.copies.drop_copied()
        self._release(layer - release_lag(self.engine.num_layers, self.engine.model_layers))

    def saving(self) -> None:
        if self.engine.copies.in_flight:
            self.engine.copies.drop_copied()

    def layer_done(self, layer: int) -> None:
        """A layer with no later one to release it at gives its bytes back now (the last with
        n = L: this frees it across whatever follows the stack, such as an LM head; it reloads at
        once when the backward begins)."""
        if layer + release_lag(self.engine.num_layers, self.engine.model_layers) >= self.engine.model_layers:
            self._release(layer)

    def _release(self, layer: int) -> None:
        copies = self.engine.copies.layers.get(layer)
        if copies is None or copies.released or not copies.copies:
            return
        copies.released = True
        wait_and_give_back([c for c in copies.copies if c.source is not None])
