"""Why a Megatron-Core GPU test cannot run on this machine: the one rule the Megatron GPU tests
share (the GPUs, Hopper, the supported megatron-core, and the fused kernels where they run them)."""

from __future__ import annotations

import torch

from conftest import gpu_skip_reason


def megatron_skip_reason(gpus: int = 1, kernels: bool = True) -> str | None:
    """Why a test of ``gpus`` GPUs of one host (sm_90) with megatron-core, and with the fused
    Hopper kernels where ``kernels``, cannot run here; None where it can."""
    if gpus > 1 and torch.cuda.device_count() < gpus:
        return f"needs {gpus} GPUs of one host, {torch.cuda.device_count()} visible"
    if (reason := gpu_skip_reason("sm_90")) is not None:
        return reason
    from te_offload_ops.megatron import require_megatron

    try:
        require_megatron()
    except ImportError as exc:
        return str(exc)
    if not kernels:
        return None
    from te_offload_ops.fused.selection import kernel_problem

    return kernel_problem()
