"""One call for every CPU-offload engine, with a count of the bytes each one moves.

``offload_context("v2" | "v1" | "teo" | "none", num_layers=..., model_layers=...)`` returns a
context and synchronization function plus an :class:`OffloadCounter` that adds up, per key of
your choosing, the bytes the engine decided to copy to CPU. "v2" and "v1" are TE's
(``te.get_cpu_offload_context``; one per process, see :func:`active_engine`). "teo" is this
package's engine (:mod:`te_offload_ops.engines.teo`), which reads TE's marks as V2 reads them, so
it runs in a V2 process (the default) and is refused in a V1 one: there TE's own modules leave
V1's marks instead, and teo would move their weights' non-Parameter copies (e.g. FP8 workspaces).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Hashable, Optional

import torch

from .counter import OffloadCounter
from .te_engines import te_offload_context
from .teo import make_teo_context

__all__ = ["ENGINES", "offload_context"]

ENGINES = ("none", "v2", "v1", "teo")


def offload_context(
    engine: str,
    *,
    num_layers: int,
    model_layers: int,
    classify: Optional[Callable[[torch.Tensor], Hashable]] = None,
    retain_pinned_cpu_buffers: bool = False,
    memory_budget: Optional[int] = None,
    reload_ahead: int = 0,
):
    """Returns ``(context, sync_function, counter)`` for ``engine`` over ``model_layers`` layers,
    the first ``num_layers`` offloaded.

    Use as TE documents: ``with context: y = layer(x)`` then ``y = sync_function(y)`` per layer.
    ``retain_pinned_cpu_buffers`` (V2 only) keeps the pinned host buffers from step to step, which
    CUDA graph capture needs (see ``te_offload_ops.capture``). The counter counts what the engine
    chose to offload while Python ran: under a graph, the capture, not the replays.

    ``memory_budget`` ("teo" only): bytes of ``torch.cuda.memory_allocated`` the step may reach.
    Without it (the default) teo gives each offloaded layer's GPU bytes back a fixed number of
    layers later, the forward waiting for its copies there. With it, offloaded tensors' GPU bytes
    stay until their copies end and the oldest go back early (after a wait for their copies) only
    where memory would pass the budget; each look keeps room for what ops allocated after it in the
    last two steps. :func:`te_offload_ops.engines.measure_budget` measures the budget of a target
    peak with your step and says whether it beats the default there; a budget pays off only where
    the default schedule's forward waits for copies (see its documentation).
    ``reload_ahead`` ("teo" only): start each reload that many layers earlier than the
    peak-neutral point (a layer's reload starts once the layers after it that the peak holds have
    finished their backward). Where reloads are slower than the backward between that point and
    their use, the backward waits for them; each layer ahead hides up to one layer's backward of
    copy time and may raise the peak by up to one offloaded layer's bytes.
    "teo" accepts ``num_layers == model_layers``; its pinned buffers are always kept for reuse.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if retain_pinned_cpu_buffers and engine in ("v1", "teo"):
        raise ValueError(f"retain_pinned_cpu_buffers is an option of TE's V2 engine; {engine} has no such option"
                         + (" (it always reuses its pinned buffers)" if engine == "teo" else ""))
    if memory_budget is not None and engine != "teo":
        raise ValueError(f"memory_budget is an option of the teo engine, not of {engine!r}")
    if reload_ahead and engine != "teo":
        raise ValueError(f"reload_ahead is an option of the teo engine, not of {engine!r}")
    counter = OffloadCounter(classify)
    if engine == "none":
        return contextlib.nullcontext(), (lambda t: t), counter
    if engine == "teo":
        ctx, sync = make_teo_context(num_layers, model_layers, counter=counter, memory_budget=memory_budget,
                                     reload_ahead=reload_ahead)
        return ctx, sync, counter
    ctx, sync = te_offload_context(engine, num_layers=num_layers, model_layers=model_layers, counter=counter,
                                   retain_pinned_cpu_buffers=retain_pinned_cpu_buffers)
    return ctx, sync, counter
