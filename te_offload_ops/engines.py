"""CPU-offload engines behind one call, with a count of the bytes each one moves.

``offload_context("v2" | "v1" | "teo" | "none", num_layers=..., model_layers=...)`` returns a
context and synchronization function plus an :class:`OffloadCounter` that adds up, per key of
your choosing, the bytes the engine decided to copy to CPU. "v2" and "v1" are TE's
(``te.get_cpu_offload_context``); TE picks one when it is imported (``NVTE_CPU_OFFLOAD_V1=1``
selects V1), so one process runs one of them. "teo" is this package's schedule on TE's marks
(``engines_teo``), read as V2 reads them, so it runs in a V2 process (the default) and is refused
in a V1 one: there TE's own modules leave V1's marks instead (``mark_not_offload`` sets no
``_TE_do_not_offload``), and teo would move their weights' non-Parameter copies (e.g. FP8
workspaces) too.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import defaultdict
from typing import Any, Callable, Hashable, Optional

import torch
import transformer_engine.pytorch as te
from transformer_engine.pytorch import cpu_offload

ENGINES = ("none", "v2", "v1", "teo")


def active_engine() -> str:
    """The TE engine this process runs: "v1" if NVTE_CPU_OFFLOAD_V1=1 was set at import, else "v2"."""
    return "v1" if cpu_offload.NVTE_CPU_OFFLOAD_V1 else "v2"


class OffloadCounter:
    """Bytes an engine chose to offload, keyed by ``classify(tensor)`` (default: one key)."""

    def __init__(self, classify: Optional[Callable[[torch.Tensor], Hashable]] = None):
        self.classify = classify or (lambda t: "all")
        self.bytes: dict[Hashable, int] = defaultdict(int)

    def add(self, t: torch.Tensor) -> None:
        self.bytes[self.classify(t)] += t.numel() * t.element_size()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def _count_v2(ctx: Any, counter: OffloadCounter) -> None:
    sync = ctx.offload_synchronizer
    push = sync.push_tensor

    def counting_push(t):
        handle = push(t)
        if not isinstance(handle, torch.Tensor):  # an index (or a tuple for quantized): offloaded
            counter.add(t)
        return handle

    sync.push_tensor = counting_push


def _count_v1(ctx: Any, counter: OffloadCounter) -> None:
    handler = ctx.offload_handler
    push = handler.tensor_push

    def counting_push(t, **kwargs):
        tag = push(t, **kwargs)
        # V1 keeps a GPU reference in tensor_tag_to_buf for exactly the tensors it will offload
        # (a list of data tensors for a quantized tensor).
        buf = handler.tensor_tag_to_buf.get(tag)
        for part in buf if isinstance(buf, list) else [buf]:
            if part is not None:
                counter.add(part)
        return tag

    handler.tensor_push = counting_push


def offload_context(
    engine: str,
    *,
    num_layers: int,
    model_layers: int,
    classify: Optional[Callable[[torch.Tensor], Hashable]] = None,
    retain_pinned_cpu_buffers: bool = False,
    prefetch: Optional[int] = None,
    release: Optional[str] = None,
    max_held_bytes: Optional[int] = None,
    memory_budget: Optional[int] = None,
):
    """Returns ``(context, sync_function, counter)`` for ``engine`` over ``model_layers`` layers.

    Use as TE documents: ``with context: y = layer(x)`` then ``y = sync_function(y)`` per layer.
    ``retain_pinned_cpu_buffers`` (V2 only) keeps the pinned host buffers from step to step, which
    CUDA graph capture needs (see ``te_offload_ops.capture``). The counter counts what the engine
    chose to offload while Python ran: under a graph, the capture, not the replays.
    ``prefetch`` ("teo" only): None (default) reloads each layer as early as it fits under the
    step's no-offload peak less what was offloaded; an int k starts layers i..i-k when layer i's
    backward begins (more overlap, more memory at the peak).
    ``release`` ("teo" only): "layers" (default) gives each offloaded layer's GPU bytes back a fixed
    number of layers later, the forward waiting for its copies there; "memory" holds them longer
    while the previous step's figures say the forward stays under its end-of-forward memory, so
    the forward waits less where copies are slower than compute (opt-in, see
    ``engines_teo.sources_to_release``).
    ``max_held_bytes`` ("teo" only): bytes of released layers whose copies to the host are still
    running that the forward may keep on the GPU instead of waiting for them (default 0); the step's
    memory stays within the layer schedule's plus this much, so give it the room a memory cap leaves.
    ``memory_budget`` ("teo" only): bytes of ``torch.cuda.memory_allocated`` the step may reach;
    instead of a release schedule, offloaded tensors' GPU bytes stay until their copies end and
    the oldest go back early (after a wait for their copies) only where memory would pass the
    budget. Each look (saves, uses in backward, layer boundaries, and :func:`make_room` calls, which
    this package's fused MLP makes before its large outputs) keeps room for what ops allocated
    after the same look in the last two steps; for a memory cap, still give it the cap less some room
    (what an op allocates and frees again between two looks is not learned). Not combined with
    ``release`` or ``max_held_bytes``.
    "teo" accepts ``num_layers == model_layers``; its pinned buffers are always kept for reuse.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if retain_pinned_cpu_buffers and engine in ("v1", "teo"):
        raise ValueError(f"retain_pinned_cpu_buffers is an option of TE's V2 engine; {engine} has no such option"
                         + (" (it always reuses its pinned buffers)" if engine == "teo" else ""))
    if prefetch is not None and engine != "teo":
        raise ValueError(f"prefetch is an option of the teo engine, not of {engine!r}")
    if release is not None and engine != "teo":
        raise ValueError(f"release is an option of the teo engine, not of {engine!r}")
    if max_held_bytes is not None and engine != "teo":
        raise ValueError(f"max_held_bytes is an option of the teo engine, not of {engine!r}")
    if memory_budget is not None and engine != "teo":
        raise ValueError(f"memory_budget is an option of the teo engine, not of {engine!r}")
    counter = OffloadCounter(classify)
    if engine == "none":
        return contextlib.nullcontext(), (lambda t: t), counter
    if engine == "teo":
        from .engines_teo import make_teo_context

        kwargs = {} if release is None else {"release": release}  # teo's own defaults otherwise
        if max_held_bytes is not None:
            kwargs["max_held_bytes"] = max_held_bytes
        if memory_budget is not None:
            kwargs["memory_budget"] = memory_budget
        ctx, sync = make_teo_context(num_layers, model_layers, prefetch=prefetch, counter=counter, **kwargs)
        return ctx, sync, counter
    if engine != active_engine():
        raise RuntimeError(
            f"this process runs TE's {active_engine()} engine; {engine} needs "
            f"NVTE_CPU_OFFLOAD_V1={'1' if engine == 'v1' else '0'} set before transformer_engine is imported"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE warns that offloading L-1 of L layers leaves little overlap
        kwargs = {"retain_pinned_cpu_buffers": True} if retain_pinned_cpu_buffers else {}
        ctx, sync = te.get_cpu_offload_context(enabled=True, num_layers=num_layers, model_layers=model_layers,
                                               **kwargs)
    (_count_v2 if engine == "v2" else _count_v1)(ctx, counter)
    return ctx, sync, counter


def make_room(nbytes: Any, device: Any = None) -> None:
    """An op is about to allocate ``nbytes`` on ``device`` (an int, or a list with one int per
    allocation): teo engines with a ``memory_budget`` give back what they hold past it, and under
    a cap what keeps each allocation from fitting (see ``engines_teo.make_room``); nothing happens
    without one."""
    teo = sys.modules.get(f"{__package__}.engines_teo")
    if teo is not None:  # checks nbytes; not imported: no teo engine exists, nothing to check it for
        teo.make_room(nbytes, device)
