"""Hopper fused SReLU grouped MLP, registered with TE's op fuser when te_offload_ops is imported.

``te.ops.Sequential(te_offload_ops.GroupedLinear, te_offload_ops.ScaledSReLU,
te_offload_ops.GroupedLinear)`` then runs as one fused op on sm_90 in bf16/fp16 with no FP8
recipe. Anywhere else the three ops run unfused: :func:`explain_fusion` says why for a
Sequential, and a fused op that had to fall back at run time keeps its reasons in
``last_fallback_reasons`` (also logged at INFO by ``te_offload_ops.fused.srelu_mlp``).
"""

from __future__ import annotations

from typing import Any

import transformer_engine.pytorch as te

from .selection import runtime_blockers, static_blockers
from .srelu_mlp import FusedScaledSReLUMLP

__all__ = ["FusedScaledSReLUMLP", "explain_fusion", "fuse_srelu_mlp", "register", "runtime_blockers",
           "static_blockers"]


def fuse_srelu_mlp(ops: list, *, recipe: Any = None, **unused: Any) -> list:
    """TE fusion function: replaces each fusable (GroupedLinear, ScaledSReLU, GroupedLinear) run."""
    del unused
    out, i = [], 0
    while i < len(ops):
        window = ops[i : i + 3]
        if len(window) == 3 and not static_blockers(*window, recipe=recipe):
            out.append(FusedScaledSReLUMLP(fc1=window[0], activation=window[1], fc2=window[2]))
            i += 3
        else:
            out.append(ops[i])
            i += 1
    return out


def explain_fusion(module: te.ops.Sequential, *, recipe: Any = None) -> list[tuple[int, list[str]]]:
    """For each run of three consecutive basic ops in ``module``: (index of the first, reasons not to fuse)."""
    basic = [op for op in module if isinstance(op, te.ops.BasicOperation)]
    return [(i, static_blockers(*basic[i : i + 3], recipe=recipe)) for i in range(len(basic) - 2)]


_registered = False


def register() -> None:
    """Put the fusion ahead of TE's own (idempotent)."""
    global _registered
    if not _registered:
        te.ops.register_forward_backward_fusion(fuse_srelu_mlp, prepend=True)
        _registered = True


register()
