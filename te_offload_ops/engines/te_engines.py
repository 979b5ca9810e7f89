"""TE's own CPU-offload engines (V2, V1) behind one call, each offload counted.

TE picks one when it is imported (``NVTE_CPU_OFFLOAD_V1=1`` selects V1), so one process runs one
of them: :func:`active_engine` says which.
"""

from __future__ import annotations

import warnings

import transformer_engine.pytorch as te

from .. import te_internals
from .counter import OffloadCounter

__all__ = ["active_engine", "te_offload_context"]


def active_engine() -> str:
    """The TE engine this process runs: "v1" if NVTE_CPU_OFFLOAD_V1=1 was set at import, else "v2"."""
    return "v1" if te_internals.uses_te_v1_offload() else "v2"


def te_offload_context(engine: str, *, num_layers: int, model_layers: int, counter: OffloadCounter,
                       retain_pinned_cpu_buffers: bool = False):
    """``(context, sync_function)`` of TE's ``engine`` ("v2" or "v1"), each tensor it offloads added to ``counter``."""
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
    count = te_internals.count_v2_offloads if engine == "v2" else te_internals.count_v1_offloads
    count(ctx, counter.add)
    return ctx, sync
