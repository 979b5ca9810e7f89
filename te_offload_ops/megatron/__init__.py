"""Megatron-Core's MoE experts on te_offload_ops, under Megatron's own fine-grained offloading.

Supports megatron-core >=0.19.2,<0.20 (tested with 0.19.2); other versions are refused with
:class:`UnsupportedMegatronError`. Megatron-Core is imported only when :class:`TEOGroupedMLP` or
:func:`use_te_offload_ops` is first used, so this module imports without it::

    from te_offload_ops.megatron import use_te_offload_ops

    spec = use_te_offload_ops(get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True))
    config = TransformerConfig(..., use_transformer_engine_op_fuser=True,
                               activation_func=squared_relu, use_fused_weighted_squared_relu=True)
"""

from __future__ import annotations

from typing import Any

from .adopt import adopt
from .offload import EXPERT_OFFLOAD_MODULES, ExpertOffload, expert_offload
from .spec import replace_builders, use_te_offload_ops
from .version import SUPPORTED, TESTED, UnsupportedMegatronError, check_version, installed_version, require_megatron

__all__ = [
    "EXPERT_OFFLOAD_MODULES",
    "SUPPORTED",
    "TESTED",
    "ExpertOffload",
    "TEOGroupedMLP",
    "UnsupportedMegatronError",
    "adopt",
    "check_version",
    "expert_offload",
    "installed_version",
    "replace_builders",
    "require_megatron",
    "use_te_offload_ops",
]


def __getattr__(name: str) -> Any:
    # TEOGroupedMLP subclasses Megatron's class, so it exists only once Megatron is imported.
    if name == "TEOGroupedMLP":
        from .experts import TEOGroupedMLP

        return TEOGroupedMLP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
