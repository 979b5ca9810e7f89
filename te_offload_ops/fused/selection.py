"""When the Hopper fused SReLU grouped MLP may replace GroupedLinear, ScaledSReLU, GroupedLinear.

Two stages, because TE's fuser decides a fusion once per recipe and caches it:

* :func:`static_blockers` at fusion time: the GPU, the recipe, the ops and their settings, and
  the switch ``TEO_FUSED_SRELU_MLP=0``, and whether the CuTe DSL kernels import (or load from the
  disk cache without the DSL).
* :func:`runtime_blockers` at each forward: inputs TE accepts that the kernels do not take (another
  dtype, a quantized input). The fused op then runs the three ops unfused and records why.

Each returns the list of reasons that stop fusion (empty: fuse).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Optional

import torch

from .. import te_internals
from . import block_fp8
from .expert_weights import weight_dtype

DISABLE_ENV = "TEO_FUSED_SRELU_MLP"  # "0" turns the fusion off (read when TE's fuser fuses)

# TMA needs 16-byte aligned rows: 8 elements of a 16-bit type, 16 of FP8.
ROW_ALIGNMENT = 8
FP8_ROW_ALIGNMENT = 16
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def kernel_problem() -> Optional[str]:
    """Why the CuTe DSL kernels cannot run in this process, or None. Imports the DSL to tell, unless
    a process of this context did and the kernels load without it (:func:`kernels.loads_without_dsl`)."""
    try:
        from .. import kernels
    except ImportError as exc:
        return f"the CuTe DSL kernels do not import: {exc}"
    if kernels.loads_without_dsl():
        return None
    reasons = kernels.unavailable_reasons()
    return "; ".join(reasons) if reasons else None


def _cuda_capability() -> Optional[tuple[int, int]]:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def active_recipe() -> Any:
    """The quantization recipe of the enclosing ``te.autocast``, or None outside one."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager.get_fp8_recipe() if FP8GlobalStateManager.is_fp8_enabled() else None


def _recipe_blocker(recipe: Any) -> Optional[str]:
    return block_fp8.recipe_problem(recipe)


def _linear_blockers(name: str, op: Any) -> list[str]:
    # accumulate_into_main_grad, delay_wgrad_compute and single_grouped_weight fuse
    # (fused/weight_grads.py does what TE's GroupedLinear does with them)
    reasons = []
    if op.use_bias:
        reasons.append(f"{name} has a bias")
    if te_internals.with_quantized_weight(op):
        reasons.append(f"{name} has quantized weights")
    if te_internals.is_distributed_weight(op):
        reasons.append(f"{name} has distributed (sharded) weights, which TE gathers per call")
    for dim_name in ("in_features", "out_features"):
        if getattr(op, dim_name) % ROW_ALIGNMENT:
            reasons.append(f"{name}.{dim_name}={getattr(op, dim_name)} is not a multiple of {ROW_ALIGNMENT}")
    dtype = weight_dtype(op)
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"{name} weights are {dtype}; the kernels take bf16 or fp16")
    return reasons


def static_blockers(fc1: Any, act: Any, fc2: Any, *, recipe: Any = None,
                    capability: Optional[tuple[int, int]] = None) -> list[str]:
    """Why (fc1, act, fc2) cannot fuse on this GPU with this recipe; [] if it can.

    ``capability`` defaults to the current CUDA device's.
    """
    from ..ops import GroupedLinear, ScaledSReLU

    if not (isinstance(fc1, GroupedLinear) and isinstance(act, ScaledSReLU) and isinstance(fc2, GroupedLinear)):
        return ["the ops are not te_offload_ops GroupedLinear, ScaledSReLU, GroupedLinear"]
    reasons = []
    if os.environ.get(DISABLE_ENV, "1") == "0":
        reasons.append(f"disabled by {DISABLE_ENV}=0")
    capability = _cuda_capability() if capability is None else capability
    if capability is None:
        reasons.append("no CUDA GPU")
    elif tuple(capability) != (9, 0):
        reasons.append(f"GPU is sm_{capability[0]}{capability[1]}; the kernels are for sm_90 (Hopper)")
    if (blocker := _recipe_blocker(recipe)) is not None:
        reasons.append(blocker)
    if not reasons and (problem := kernel_problem()) is not None:
        reasons.append(problem)
    if not te_internals.same_scaled_activation(act, ScaledSReLU):
        reasons.append(f"{type(act).__name__} changes the activation")
    if act.activation_recompute_in_mlp:
        reasons.append("activation_recompute_in_mlp is set (the fused op chooses what to recompute)")
    reasons += _linear_blockers("fc1", fc1) + _linear_blockers("fc2", fc2)
    if recipe is not None:  # every dimension is some FP8 GEMM's K
        for name, op in (("fc1", fc1), ("fc2", fc2)):
            for dim_name in ("in_features", "out_features"):
                if getattr(op, dim_name) % FP8_ROW_ALIGNMENT:
                    reasons.append(f"{name}.{dim_name}={getattr(op, dim_name)} is not a multiple of "
                                   f"{FP8_ROW_ALIGNMENT}, which FP8 rows need")
    if fc1.num_groups != fc2.num_groups:
        reasons.append(f"fc1 has {fc1.num_groups} groups and fc2 {fc2.num_groups}")
    if fc1.out_features != fc2.in_features:
        reasons.append(f"fc1.out_features={fc1.out_features} != fc2.in_features={fc2.in_features}")
    if weight_dtype(fc1) != weight_dtype(fc2):
        reasons.append(f"fc1 weights are {weight_dtype(fc1)} and fc2 weights {weight_dtype(fc2)}")
    return reasons


def runtime_blockers(x: Any, split_sizes: Any, probs: Any, *, weight_dtype: torch.dtype) -> list[str]:
    """Why this call's inputs, which TE's ops accept, cannot take the fused path; [] if they can.

    Inputs TE rejects never get here: the fused op raises for them first (ops/input_checks.py)."""
    del split_sizes, probs  # any integer dtype, CPU or GPU, and any probs dtype are taken
    reasons = []
    # TE's fuser re-fuses when the recipe changes, so this holds only for a fused op called
    # outside its Sequential; the kernels never compute in bf16 what a recipe asks in FP8.
    if (blocker := _recipe_blocker(active_recipe())) is not None:
        reasons.append(blocker)
    if type(x) is not torch.Tensor:
        reasons.append(f"input is a {type(x).__name__}, not a plain tensor")
        return reasons
    if torch.is_autocast_enabled() and torch.get_autocast_dtype("cuda") != weight_dtype:
        reasons.append(f"autocast to {torch.get_autocast_dtype('cuda')} differs from the weights' {weight_dtype}")
    if x.dtype != weight_dtype:
        reasons.append(f"input is {x.dtype}, weights are {weight_dtype}")
    if not x.is_cuda:
        reasons.append("input is not on a CUDA device")
    if x.dim() != 2:  # TE splits dim 0 by the split sizes whatever the rank; the kernels take rows
        reasons.append(f"input has shape {tuple(x.shape)}; the fused op takes (tokens, hidden)")
    return reasons
