"""Measure, with the user's own training step, the memory budget teo should run under (if any).

:func:`measure_budget` runs the step without offload (the floor and the peak), under teo's default
schedule (the bytes it moves), computes the budget of the target peak
(:func:`te_offload_ops.engines.teo.budget.target_budget`), then times teo's default schedule and
teo under that budget alternately. It recommends the budget only where it measured the budget's
step no slower than the default schedule's: where the default schedule's forward does not wait
for copies (a host that cannot run ahead of the GPU, few layers offloaded, a long forward per byte
moved) a budget has no wait to spare and costs the host a memory read per look.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .contexts import offload_context
from .teo.budget import check_target_options, target_budget

__all__ = ["BudgetAdvice", "measure_budget"]


@dataclass(frozen=True)
class BudgetAdvice:
    """What :func:`measure_budget` measured and recommends. Bytes of ``torch.cuda.memory_allocated``;
    peaks are above the floor."""

    budget: Optional[int]  # the memory_budget to run teo with; None: teo's default schedule
    target_bytes: int  # the budget of the target peak, recommended or not
    floor_bytes: int
    no_offload_peak_bytes: int
    moved_bytes: int  # what the default schedule moves in a step
    default_step_s: Optional[float] = None  # medians of the compared steps (None: not compared)
    budget_step_s: Optional[float] = None
    default_peak_bytes: Optional[int] = None
    budget_peak_bytes: Optional[int] = None
    reason: str = ""

    def options(self) -> dict:
        """Keyword arguments for ``offload_context("teo", ...)`` that follow the advice."""
        return {} if self.budget is None else {"memory_budget": self.budget}


def _run(step: Callable, context: tuple) -> tuple[float, int]:
    """One step: (wall seconds, peak bytes allocated)."""
    ctx, sync, counter = context
    counter.bytes.clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    step(ctx, sync)
    torch.cuda.synchronize()
    return time.perf_counter() - began, torch.cuda.max_memory_allocated()


def measure_budget(step: Callable[[Any, Callable], Any], *, num_layers: int, model_layers: int,
                   freed: float = 0.96, slack_bytes: int = 0, warmup_steps: int = 2,
                   compare_steps: int = 5) -> BudgetAdvice:
    """Measures the budget for teo offloading the first ``num_layers`` of ``model_layers`` layers.

    ``step(context, sync)`` runs one whole training step (forward, backward, optimizer) with the
    pair used as ``offload_context`` documents: ``with context: y = layer(x)`` then ``y = sync(y)``
    per layer. It is called ``3 + 3 * warmup_steps + 2 * compare_steps`` times (19 by default;
    ``3 + 2 * warmup_steps`` with ``compare_steps=0``; a first step without offload allocates what
    stays between steps); each is a real step of your training, so run it on your first batches,
    with the shapes you train with, on the GPU you train on.

    The target peak is no offload's peak less ``freed`` (in (0, 1]) of the bytes teo's default
    schedule moves, plus ``slack_bytes`` (:func:`target_budget`). With ``compare_steps > 0`` the
    default schedule and the budget then run alternately (``warmup_steps`` each first, so the
    budget learns the room ops take between its looks), and the budget is recommended only where
    its median step took no longer than the default's; ``compare_steps=0`` recommends the target
    without timing it. Returns a :class:`BudgetAdvice`: pass ``**advice.options()`` to
    ``offload_context("teo", ...)``.
    """
    if not callable(step):
        raise TypeError(f"step must be a callable taking (context, sync), got {type(step).__name__}")
    for name, value in (("warmup_steps", warmup_steps), ("compare_steps", compare_steps)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    check_target_options(num_layers=num_layers, model_layers=model_layers, freed=freed, slack_bytes=slack_bytes)
    if not torch.cuda.is_available():
        raise RuntimeError("measure_budget measures GPU memory and needs a CUDA GPU (none is visible)")
    layers = {"num_layers": num_layers, "model_layers": model_layers}
    none = offload_context("none", **layers)
    for _ in range(1 + warmup_steps):  # the first allocates what stays between steps (optimizer state)
        _run(step, none)
    floor = torch.cuda.memory_allocated()
    _, peak = _run(step, none)
    default = offload_context("teo", **layers)
    for _ in range(warmup_steps):
        _run(step, default)
    _run(step, default)
    moved = default[2].total
    target = target_budget(floor_bytes=floor, no_offload_peak_bytes=max(0, peak - floor), moved_bytes=moved,
                           freed=freed, slack_bytes=slack_bytes, **layers)
    measured = {"target_bytes": target, "floor_bytes": floor, "no_offload_peak_bytes": max(0, peak - floor),
                "moved_bytes": moved}
    if compare_steps == 0:
        return BudgetAdvice(target, reason="the target budget, not compared with the default schedule", **measured)
    budget = offload_context("teo", memory_budget=target, **layers)
    for _ in range(warmup_steps):
        _run(step, budget)
    times: dict[str, list] = {"default": [], "budget": []}
    peaks = {"default": 0, "budget": 0}
    for _ in range(compare_steps):
        for name, context in (("default", default), ("budget", budget)):
            seconds, top = _run(step, context)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], top - floor)
    t_default, t_budget = statistics.median(times["default"]), statistics.median(times["budget"])
    compared = {"default_step_s": t_default, "budget_step_s": t_budget, "default_peak_bytes": peaks["default"],
                "budget_peak_bytes": peaks["budget"]}
    if t_budget <= t_default:
        reason = (f"the budget: its step took {t_budget * 1e3:.1f} ms against the default schedule's "
                  f"{t_default * 1e3:.1f} ms (medians of {compare_steps})")
        return BudgetAdvice(target, reason=reason, **measured, **compared)
    reason = (f"the default schedule: the budget's step took {t_budget * 1e3:.1f} ms against its "
              f"{t_default * 1e3:.1f} ms (medians of {compare_steps}), so the default's forward waits for no "
              "copy the budget could spare here")
    return BudgetAdvice(None, reason=reason, **measured, **compared)
