"""Weight gradients of the fused MLP with the settings Megatron-Core passes to TE's GroupedLinear.

Mirrors what TE's GroupedLinear does in its backward, with our kernels:

* ``accumulate_into_main_grad``: the wgrad kernel adds its fp32 accumulator into each weight's
  ``main_grad`` (or overwrites it when the weight has ``overwrite_main_grad``), then the op
  returns placeholder grads and sets ``grad_added_to_main_grad`` as TE does, so DDP adds
  nothing twice.
* ``delay_wgrad_compute``: the wgrad GEMM is queued on the op's ``wgrad_store`` and runs in
  ``op.backward_dw()``, whose bookkeeping (``.grad`` or hooks) is TE's own.
* ``single_grouped_weight``: one (E, out, in) gradient, or the grouped view of ``main_grad``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from ..te_internals import (
    accumulates_into_main_grad,
    get_accumulate_flag_in_param,
    get_main_grad_from_param,
    view_main_grad_as_grouped_buffer,
)

from . import fp8_wgrad
from .expert_weights import weight_params


def check_main_grad(op, name: str) -> None:
    """Forward-time check, as TE makes: accumulate_into_main_grad needs main_grad buffers."""
    if not accumulates_into_main_grad(op):
        return
    for i, p in enumerate(weight_params(op)):
        if getattr(p, "main_grad", None) is None and not hasattr(p, "__fsdp_param__"):
            raise RuntimeError(
                f"{name} (GroupedLinear) has accumulate_into_main_grad=True, but its weight "
                f"{'weight' if op.single_grouped_weight else f'weight{i}'} has no main_grad buffer; "
                "allocate one per weight (Megatron's DDP does) or turn the setting off"
            )


def _dummy_grads(params) -> list[Optional[torch.Tensor]]:
    """What TE's ``get_dummy_wgrads_for_params`` gives Megatron: ``grad_added_to_main_grad`` set,
    and a placeholder ``.grad`` (zeros with ``zero_out_wgrad``) for each such parameter.

    The placeholders are fresh memory rather than TE's one cached buffer per shape: autograd
    can adopt a tensor nobody else holds as ``.grad``, but copies a shared one: a full weight-sized
    copy per parameter and step. One allocation holds all the experts' placeholders (views of it,
    each adopted as its own ``.grad``): a torch.empty per expert cost ~8 us of host time each."""
    need = [i for i, p in enumerate(params) if hasattr(p, "grad_added_to_main_grad")]
    out: list[Optional[torch.Tensor]] = [None] * len(params)
    if not need:
        return out
    p0 = params[need[0]]
    zero = [getattr(params[i], "zero_out_wgrad", False) for i in need]
    if all(params[i].shape == p0.shape and params[i].dtype == p0.dtype and params[i].device == p0.device
           for i in need):
        block = torch.empty((len(need), *p0.shape), dtype=p0.dtype, device=p0.device)
        if all(zero):
            block.zero_()
        views = block.unbind(0)
        for j, i in enumerate(need):
            if zero[j] and not all(zero):
                views[j].zero_()
            out[i] = views[j]
    else:  # mixed shapes (not TE's GroupedLinear): one each
        for j, i in enumerate(need):
            make = torch.zeros if zero[j] else torch.empty
            out[i] = make(params[i].shape, dtype=params[i].dtype, device=params[i].device)
    for i in need:
        params[i].grad_added_to_main_grad = True
    return out


def _main_grads(op) -> list[torch.Tensor] | torch.Tensor:
    params = weight_params(op)
    if op.single_grouped_weight:
        main_grad = get_main_grad_from_param(params[0], op_label="GroupedLinear")
        return view_main_grad_as_grouped_buffer(main_grad, op.num_groups, (op.out_features, op.in_features),
                                                label="GroupedLinear weight")
    return [get_main_grad_from_param(p, op_label="GroupedLinear") for p in params]


def main_grads_take_fp8(op) -> bool:
    """Whether the FP8 wgrad kernel can write ``op``'s weight grads: it adds into fp32 main_grad by
    8-byte pairs, so buffers off an 8-byte boundary take the bf16 wgrad instead (which has a
    fallback for them); True where ``op`` does not accumulate into main_grad."""
    if not accumulates_into_main_grad(op):
        return True
    from ..kernels import main_grads

    # the buffers as they stand (FSDP may make them only in backward: those are checked there)
    bufs = [g for g in (getattr(p, "main_grad", None) for p in weight_params(op)) if isinstance(g, torch.Tensor)]
    return main_grads.vector_aligned(bufs)


def _gemm(dy, x, split_sizes, out_dtype) -> torch.Tensor:
    """(E, out, in): bf16/fp16 token matrices, or their FP8 columnwise copies (:class:`.fp8_wgrad.Cols`)."""
    from .. import kernels

    if isinstance(dy, fp8_wgrad.Cols):
        return fp8_wgrad.wgrad(dy, x, split_sizes, out_dtype)
    return kernels.grouped_wgrad(dy, x, split_sizes)


def _gemm_main_grad(dy, x, split_sizes, main_grads, accumulate) -> None:
    from .. import kernels

    if isinstance(dy, fp8_wgrad.Cols):
        fp8_wgrad.wgrad_main_grad(dy, x, split_sizes, main_grads, accumulate)
    else:
        kernels.grouped_wgrad_main_grad(dy, x, split_sizes, main_grads, accumulate=accumulate)


def _run_wgrad(temporaries, operands, grad_weights, *, main_grads, accumulate, out_dtype) -> None:
    """The delayed wgrad GEMM, run by ``op.backward_dw()``: into ``main_grads``, or per-expert
    grads into the list ``grad_weights`` that TE's backward_dw then assigns to ``.grad``.
    ``temporaries`` only ride along: backward_dw frees them once this returns."""
    del temporaries
    dy, x, split_sizes = operands
    if main_grads is not None:
        _gemm_main_grad(dy, x, split_sizes, main_grads, accumulate)
    else:
        grad_weights[:] = _gemm(dy, x, split_sizes, out_dtype).unbind(0)


def weight_grad_bytes(op) -> list[int]:
    """What :func:`weight_grads` allocates for ``op`` when called now (for an offload engine's
    memory budget): the grads themselves (one block), or into main_grad only the placeholder
    grads of the parameters Megatron marked; nothing when frozen, or delayed without main_grad."""
    params = weight_params(op)
    if not params[0].requires_grad:
        return []
    if accumulates_into_main_grad(op):
        placeholders = sum(p.numel() * p.element_size() for p in params if hasattr(p, "grad_added_to_main_grad"))
        return [placeholders] if placeholders else []
    if op.wgrad_store is not None and op.wgrad_store.delay_wgrad_compute():
        return []
    return [sum(p.numel() for p in params) * params[0].element_size()]


def weight_grads(op, dy: torch.Tensor, x: torch.Tensor, split_sizes: torch.Tensor,
                 temporaries: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
    """Grads to return for ``op``'s weight Parameters for ``W_e = dy_e^T @ x_e``: ``dy`` and ``x``
    the (T, out) and (T, in) token matrices, or both FP8 columnwise copies (:mod:`.fp8_wgrad`).

    ``temporaries`` are tensors of the fused op's own that the GEMM reads (freed after it when
    delayed; the saved input is not among them, it may be the caller's)."""
    params = weight_params(op)
    if not params[0].requires_grad:
        return [None] * len(params)
    into_main_grad = accumulates_into_main_grad(op)
    main_grads = _main_grads(op) if into_main_grad else None
    accumulate = into_main_grad and get_accumulate_flag_in_param(params[0])
    if op.wgrad_store is not None and op.wgrad_store.delay_wgrad_compute():
        job = functools.partial(_run_wgrad, main_grads=main_grads, accumulate=accumulate, out_dtype=params[0].dtype)
        op.wgrad_store.put([list(temporaries), [dy, x, split_sizes], []], job)
        return _dummy_grads(params) if into_main_grad else [None] * len(params)
    if into_main_grad:
        _gemm_main_grad(dy, x, split_sizes, main_grads, accumulate)
        return _dummy_grads(params)
    dw = _gemm(dy, x, split_sizes, params[0].dtype)
    return [dw] if op.single_grouped_weight else list(dw.unbind(0))
