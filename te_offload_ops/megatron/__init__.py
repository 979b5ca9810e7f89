"""Megatron-Core's MoE experts on te_offload_ops, under Megatron's fine-grained offloading or teo.

Supports megatron-core >=0.19.2,<0.20 (tested with 0.19.2); other versions are refused with
:class:`UnsupportedMegatronError`. Megatron-Core is imported only when :class:`TEOGroupedMLP` or
:func:`use_te_offload_ops` is first used, so this module imports without it::

    from te_offload_ops.megatron import use_te_offload_ops

    spec = use_te_offload_ops(get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True))
    config = TransformerConfig(..., use_transformer_engine_op_fuser=True,
                               activation_func=squared_relu, use_fused_weighted_squared_relu=True,
                               add_bias_linear=False)

and, for this package's offload schedule in Megatron's training loop,
``use_teo_offload(model, scope="layer", memory_budget=...)`` (:mod:`.teo_offload`).
"""

from __future__ import annotations

from typing import Any

from .adopt import adopt
from .dispatch_sync import KernelDtoH, use_kernel_dtoh
from .offload import EXPERT_OFFLOAD_MODULES, ExpertOffload, expert_offload
from .spec import replace_builders, use_te_offload_ops
from .teo_offload import SCOPE_CLASSES, TeoOffload, find_offload_modules, teo_offload_problems, use_teo_offload
from .version import SUPPORTED, TESTED, UnsupportedMegatronError, check_version, installed_version, require_megatron

__all__ = [
    "EXPERT_OFFLOAD_MODULES",
    "SCOPE_CLASSES",
    "SUPPORTED",
    "TESTED",
    "ExpertOffload",
    "KernelDtoH",
    "TEOGroupedMLP",
    "TeoOffload",
    "UnsupportedMegatronError",
    "adopt",
    "check_version",
    "expert_offload",
    "find_offload_modules",
    "installed_version",
    "replace_builders",
    "require_megatron",
    "teo_offload_problems",
    "use_kernel_dtoh",
    "use_te_offload_ops",
    "use_teo_offload",
]


def __getattr__(name: str) -> Any:
    # TEOGroupedMLP subclasses Megatron's class, so it exists only once Megatron is imported.
    if name == "TEOGroupedMLP":
        from .experts import TEOGroupedMLP

        return TEOGroupedMLP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
