"""CUDA graph capture: what this package does differently, and refuses, while a graph is captured.

The fused Hopper MLP never reads split sizes on the host, so its forward and backward can be
captured (``torch.cuda.graph`` or TE's ``make_graphed_callables``) and replayed with new routing.
What cannot be captured is refused with a :class:`GraphCaptureError` (defined here; the checks
for TE's ops and engines live here, the kernels' and teo's where those run) that says what to
change, raised before any kernel of the call is queued, so the capture ends cleanly:

* TE's unfused ``GroupedLinear`` on its split path (it calls ``split_sizes.tolist()``, a sync);
* a kernel's first call (compiling and loading the module): run one eager step first;
* TE's V1 offload engine, and V2 without ``retain_pinned_cpu_buffers=True`` or before a warm-up
  step filled its pinned buffers (pinned memory allocated in a capture is freed after it while
  the graph keeps copying into it);
* teo, which offloads eagerly only.
"""

from __future__ import annotations

from typing import Any

import torch

from . import te_internals

__all__ = ["GraphCaptureError", "capturing", "check_offload_engine", "check_offload_layer_ready",
           "refuse_split_path", "sizes_filled_on_device"]

_HOW_TO_WARM_UP = ("run one eager forward and backward with the same shapes and settings before capturing "
                   "(TE's make_graphed_callables does this in its warm-up iterations)")


class GraphCaptureError(RuntimeError):
    """Something this package cannot run under CUDA graph capture; the message says what to change."""


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False where CUDA was never initialized)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def warm_up_hint() -> str:
    return _HOW_TO_WARM_UP


def sizes_filled_on_device(sizes: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host split sizes as an int32 tensor on ``device``, written by fill kernels (one per run of
    equal sizes) rather than copied: a capture may not copy pageable host memory, and a copy of
    pinned memory would read that buffer again at every replay. The graph keeps the sizes it was
    captured with, as TE's GroupedLinear keeps host ``m_splits``: right for static routing
    (Megatron's drop-and-pad experts); routing that changes between replays passes a CUDA tensor."""
    values = sizes.reshape(-1).tolist()
    out = torch.empty(len(values), dtype=torch.int32, device=device)
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or values[end] != values[start]:
            out[start:end].fill_(values[start])
            start = end
    return out


def _te_takes_split_path(op: Any) -> bool:
    """Whether TE's GroupedLinear would take its split path (host split sizes) for this call."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    recipe = FP8GlobalStateManager.get_fp8_recipe() if FP8GlobalStateManager.is_fp8_enabled() else None
    autocast = torch.is_autocast_enabled()
    dtype = torch.get_autocast_dtype("cuda") if autocast else te_internals.weight_tensors(op)[0].dtype
    return not te_internals.grouped_tensor_path_supported(recipe, dtype)


def refuse_split_path(op: Any) -> None:
    """Raise if ``op`` (a GroupedLinear run unfused) is captured on TE's split path."""
    if not capturing() or not _te_takes_split_path(op):
        return
    raise GraphCaptureError(
        f"{type(op).__name__}(num_groups={op.num_groups}, in_features={op.in_features}, "
        f"out_features={op.out_features}) runs unfused inside a CUDA graph capture: TE's GroupedLinear "
        "takes its split path here, which reads split_sizes on the host (split_sizes.tolist(), a device "
        "sync) and cannot be captured. Capture the fused path instead (sm_90, bf16/fp16, no FP8 recipe, "
        "te_offload_ops GroupedLinear -> ScaledSReLU -> GroupedLinear without bias; "
        "te_offload_ops.fused.explain_fusion(module) says why these ops did not fuse, and the fused op's "
        "last_fallback_reasons why a call ran unfused), or run this module outside the graph."
    )


def check_offload_engine() -> None:
    """Refuse TE offload engines that cannot be captured (called when saving under capture)."""
    if not te_internals.is_cpu_offload_enabled():
        return
    if te_internals.uses_te_v1_offload():
        raise GraphCaptureError(
            "TE's V1 CPU-offload engine (NVTE_CPU_OFFLOAD_V1=1) allocates pinned host buffers on every "
            "step, which a CUDA graph cannot replay; capture with TE's default (V2) engine, created with "
            "te.get_cpu_offload_context(..., retain_pinned_cpu_buffers=True)"
        )
    if te_internals.v2_layers_without_retained_buffers():
        raise GraphCaptureError(
            "TE's CPU-offload context was created without retain_pinned_cpu_buffers=True: it allocates "
            "pinned host buffers each step and frees them after it, while a captured graph keeps copying "
            "into the same addresses. Create it with te.get_cpu_offload_context(..., "
            "retain_pinned_cpu_buffers=True) (te_offload_ops.engines.offload_context passes it on) and "
            + _HOW_TO_WARM_UP
        )


def check_offload_layer_ready() -> None:
    """Refuse to offload, under capture, in a V2 layer whose pinned buffers no warm-up step made."""
    if te_internals.uses_te_v1_offload():
        return
    layer = te_internals.v2_current_layer_without_buffers()
    if layer is not None:
        raise GraphCaptureError(
            f"TE's CPU-offload layer {layer} has no pinned host buffers yet, so they would be allocated "
            "during CUDA graph capture; " + _HOW_TO_WARM_UP + " under the same offload context"
        )
