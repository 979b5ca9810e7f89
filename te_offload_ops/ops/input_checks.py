"""Input checks shared by the unfused ops and the fused MLP: inputs TE's ops would reject (or
crash on) get a clear error before any kernel runs, naming the values; the process stays usable.

Inputs TE accepts are left alone here (e.g. an input dtype other than the weights', which TE
casts): the fused op decides separately whether it can take them or runs unfused.
"""

from __future__ import annotations

from typing import Any

import torch


def _describe(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return type(t).__name__


def check_input(where: str, x: Any, in_features: int, device: torch.device) -> None:
    """``x`` must be a tensor on the weights' device whose last dim is ``in_features``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{where}: input must be a torch.Tensor, got {_describe(x)}")
    if x.device != device:
        raise ValueError(f"{where}: input is on {x.device}, but the weights are on {device}; "
                         "move the input to the weights' device")
    if x.dim() == 0 or x.shape[-1] != in_features:
        raise ValueError(f"{where}: input has shape {tuple(x.shape)}; its last dimension must be "
                         f"in_features={in_features}")


def check_split_sizes(where: str, split_sizes: Any, num_groups: int, device: torch.device) -> None:
    """One integer per group, on the CPU or on the weights' device (values are checked apart)."""
    if not isinstance(split_sizes, torch.Tensor):
        raise TypeError(f"{where}: split_sizes must be an integer torch.Tensor with {num_groups} "
                        f"entries, got {_describe(split_sizes)}")
    if split_sizes.is_floating_point() or split_sizes.is_complex() or split_sizes.dtype == torch.bool:
        raise TypeError(f"{where}: split_sizes must have an integer dtype (int32/int64), got "
                        f"{split_sizes.dtype}")
    if split_sizes.numel() != num_groups or split_sizes.dim() > 1:
        raise ValueError(f"{where}: split_sizes must hold one size per group ({num_groups}), got "
                         f"{_describe(split_sizes)}")
    if split_sizes.device.type != "cpu" and split_sizes.device != device:
        raise ValueError(f"{where}: split_sizes are on {split_sizes.device}, the weights on {device}; "
                         "keep them on the CPU or on the weights' device")


def check_scales(where: str, scales: Any, x: torch.Tensor) -> None:
    """Per-row scales (router probs): one per row of ``x``, on ``x``'s device."""
    if not isinstance(scales, torch.Tensor):
        raise TypeError(f"{where}: probs must be a torch.Tensor with one value per token, got {_describe(scales)}")
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if scales.numel() != rows:
        raise ValueError(f"{where}: probs have {scales.numel()} values ({_describe(scales)}) for "
                         f"{rows} tokens; pass one per token")
    if scales.device != x.device:
        raise ValueError(f"{where}: probs are on {scales.device}, the input on {x.device}")
