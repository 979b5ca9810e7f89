"""Fused SReLU grouped MLP for Hopper: GroupedLinear -> ScaledSReLU -> GroupedLinear as one op.

Forward: fc1 GEMM with an epilogue writing ``act = srelu(z) * prob`` (fc2's input) and ``z``;
fc2 GEMM. Backward: fc2 dgrad with an epilogue that applies dSReLU and the prob scale, reduces
the prob gradient and recomputes ``act`` for fc2's wgrad; wgrads; fc1 dgrad.

Saved for backward, each through the policy under the flag of the op that owns it:
fc1 -> its input ``x`` (and the split sizes); activation -> ``z`` and ``probs``; fc2 -> nothing
but its weights (``act`` is recomputed, so an ``offload=False`` fc2 costs no memory). Weights of
both layers are always kept resident.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformer_engine.pytorch.ops.op import FusedOperation

from .. import policy
from .selection import runtime_blockers

log = logging.getLogger(__name__)


def expert_weights(op) -> tuple[torch.Tensor, ...]:
    return tuple(getattr(op, f"weight{i}") for i in range(op.num_groups))


def stacked_weight(op) -> torch.Tensor:
    """The (E, out, in) weight tensor: a view when the per-expert weights tile one buffer."""
    ws = expert_weights(op)
    w0 = ws[0]
    n, k = w0.shape
    step = n * k * w0.element_size()
    tiled = all(w.is_contiguous() and w.dtype == w0.dtype and w.data_ptr() == w0.data_ptr() + i * step
                for i, w in enumerate(ws))
    if tiled:
        return w0.detach().as_strided((len(ws), n, k), (n * k, k, 1))
    return torch.stack([w.detach() for w in ws])


class FusedScaledSReLUMLP(FusedOperation):
    """Joint forward/backward fusion of te_offload_ops GroupedLinear, ScaledSReLU, GroupedLinear."""

    def __init__(self, *, fc1, activation, fc2) -> None:
        super().__init__((fc1, activation, fc2))
        self.last_fallback_reasons: list[str] = []

    @property
    def fc1(self):
        return self.basic_ops[0]

    @property
    def activation(self):
        return self.basic_ops[1]

    @property
    def fc2(self):
        return self.basic_ops[2]

    # -- forward ---------------------------------------------------------------------------

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, prev_op_grad_output_quantizer,
                      next_op_input_quantizer, basic_op_kwargs):
        split_sizes, probs = basic_op_extra_inputs[0][0], basic_op_extra_inputs[1][0]
        reasons = runtime_blockers(input_, split_sizes, probs, weight_dtype=self.fc1.weight0.dtype,
                                   hidden=self.fc1.in_features)
        if any(basic_op_kwargs):
            reasons.append("output or grad-input buffers were passed through op kwargs")
        if reasons:
            self._note_fallback(reasons)
            basic_op_ctxs[0].teo_fused = False
            return self._forward_unfused(basic_op_ctxs, input_, basic_op_extra_inputs, prev_op_grad_output_quantizer,
                                         next_op_input_quantizer, basic_op_kwargs)
        self.last_fallback_reasons = []
        return self._forward_fused(basic_op_ctxs, input_, split_sizes, probs)

    def _note_fallback(self, reasons: list[str]) -> None:
        if reasons != self.last_fallback_reasons:
            log.info("fused SReLU grouped MLP runs unfused: %s", "; ".join(reasons))
        self.last_fallback_reasons = reasons

    def _forward_unfused(self, ctxs, x, extra_inputs, prev_quantizer, next_quantizer, op_kwargs):
        ops = list(self.basic_ops)
        for i, op in enumerate(ops):
            x, _ = op.fuser_forward(
                [ctxs[i]], x, basic_op_extra_inputs=[extra_inputs[i]],
                prev_op_grad_output_quantizer=prev_quantizer if i == 0 else ops[i - 1].get_grad_output_quantizer(),
                next_op_input_quantizer=next_quantizer if i == len(ops) - 1 else ops[i + 1].get_input_quantizer(),
                basic_op_kwargs=[op_kwargs[i]],
            )
        return x, [() for _ in ops]

    def _forward_fused(self, ctxs, x, split_sizes, probs):
        from .. import kernels

        fc1, act_op, fc2 = self.basic_ops
        x = x.contiguous()
        act, z = kernels.grouped_gemm_srelu_fwd(x, stacked_weight(fc1), split_sizes, probs)
        y = kernels.grouped_gemm(act, stacked_weight(fc2), split_sizes)
        if any(ctx.requires_grad for ctx in ctxs):
            ctx1, ctx_act, ctx2 = ctxs
            ctx1.teo_fused = True
            ctx1.input_requires_grad = x.requires_grad
            ctx_act.probs_require_grad = probs.requires_grad
            w1, w2 = expert_weights(fc1), expert_weights(fc2)
            policy.save_for_backward(ctx1, x, split_sizes, *w1, offload=fc1.offload, weights=w1, owner=fc1)
            policy.save_for_backward(ctx_act, z, probs, offload=act_op.offload, owner=act_op)
            policy.save_for_backward(ctx2, *w2, offload=fc2.offload, weights=w2, owner=fc2)
        return y, [(), (), ()]

    # -- backward --------------------------------------------------------------------------

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        if not getattr(basic_op_ctxs[0], "teo_fused", False):
            return self._backward_unfused(basic_op_ctxs, grad_output)
        return self._backward_fused(basic_op_ctxs, grad_output)

    def _backward_unfused(self, ctxs, dy):
        grads: list[Any] = [()] * 3
        extras: list[Any] = [()] * 3
        for i in reversed(range(3)):
            dy, op_grads, op_extras = self.basic_ops[i].fuser_backward([ctxs[i]], dy, basic_op_grad_extra_outputs=[()])
            grads[i], extras[i] = op_grads[0], op_extras[0]
        return dy, grads, extras

    def _backward_fused(self, ctxs, dy):
        from .. import kernels

        fc1, _, fc2 = self.basic_ops
        ctx1, ctx_act, ctx2 = ctxs
        E = fc1.num_groups
        x, split_sizes, *_ = ctx1.saved_tensors
        z, probs = ctx_act.saved_tensors
        dy = dy.contiguous()

        dz, dprobs, act = kernels.grouped_gemm_dsrelu_bwd(dy, stacked_weight(fc2), split_sizes, z, probs)
        dw2 = list(kernels.grouped_wgrad(dy, act, split_sizes).unbind(0)) if fc2.weight0.requires_grad else [None] * E
        del act
        dx = kernels.grouped_gemm(dz, stacked_weight(fc1), split_sizes, trans_b=True) if ctx1.input_requires_grad else None
        dw1 = list(kernels.grouped_wgrad(dz, x, split_sizes).unbind(0)) if fc1.weight0.requires_grad else [None] * E
        return dx, [dw1, (), dw2], [(None,), (dprobs if ctx_act.probs_require_grad else None,), (None,)]
