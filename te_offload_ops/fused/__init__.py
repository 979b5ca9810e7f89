"""Fused grouped MLPs, registered with TE's op fuser (ahead of TE's own) when te_offload_ops is imported.

* Hopper: ``te.ops.Sequential(te_offload_ops.GroupedLinear, te_offload_ops.ScaledSReLU,
  te_offload_ops.GroupedLinear)`` runs as one fused op of ours on sm_90 in bf16/fp16 with no FP8
  recipe, or in FP8 under ``Float8BlockScaling`` (:mod:`.srelu_mlp`, :mod:`.block_fp8`).
* Blackwell: where TE's own fused grouped MLP would take three ops of this package (sm_100,
  MXFP8/NVFP4), a subclass of TE's op that saves through the offload policy takes them
  (:mod:`.te_grouped_mlp`).

Anywhere else the ops run unfused: :func:`explain_fusion` says why for a Sequential, and a Hopper
fused op that had to fall back at run time keeps its reasons in ``last_fallback_reasons`` (also
logged at INFO by ``te_offload_ops.fused.srelu_mlp``).
"""

from __future__ import annotations

from typing import Any

import transformer_engine.pytorch as te

from .selection import runtime_blockers, static_blockers
from .srelu_mlp import FusedScaledSReLUMLP
from .te_grouped_mlp import (PolicyGroupedMLPGLU, PolicyGroupedMLPUnary, fuse_te_grouped_mlp, policy_fused_op,
                             te_fusion_blockers)

__all__ = ["FusedScaledSReLUMLP", "PolicyGroupedMLPGLU", "PolicyGroupedMLPUnary", "explain_fusion",
           "fuse_srelu_mlp", "fuse_te_grouped_mlp", "register", "runtime_blockers", "static_blockers"]


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
    """For each run of three consecutive basic ops in ``module``: (index of the first, reasons not to fuse).

    Empty when either fusion takes the run; otherwise the Hopper fusion's reasons, then TE's
    Blackwell fusion's (for runs of this package's ops).
    """
    basic = [op for op in module if isinstance(op, te.ops.BasicOperation)]
    report = []
    for i in range(len(basic) - 2):
        window = basic[i : i + 3]
        hopper = static_blockers(*window, recipe=recipe)
        if hopper and policy_fused_op(window, recipe=recipe) is None:
            report.append((i, hopper + te_fusion_blockers(window, recipe=recipe)))
        else:
            report.append((i, []))
    return report


_registered = False


def register() -> None:
    """Put both fusions ahead of TE's own, the Hopper one first (idempotent).

    They never take the same ops: one needs sm_90 and no recipe or Float8BlockScaling, the other
    sm_100 and MXFP8/NVFP4.
    """
    global _registered
    if not _registered:
        te.ops.register_forward_backward_fusion(fuse_te_grouped_mlp, prepend=True)
        te.ops.register_forward_backward_fusion(fuse_srelu_mlp, prepend=True)
        _registered = True


register()
