"""Fused SReLU grouped MLP for Hopper: GroupedLinear -> ScaledSReLU -> GroupedLinear as one op.

Forward: fc1 GEMM with an epilogue writing ``act = srelu(z) * prob`` (fc2's input) and ``z``;
fc2 GEMM; where ``act`` would pass ``$TEO_FUSED_ACT_CHUNK_MIB`` (1024), both a block of token
rows at a time (``row_chunks``: the same results, one block of ``act`` alive). Backward: fc2
dgrad with an epilogue that applies dSReLU and the prob scale, reduces the prob gradient and
recomputes ``act`` for fc2's wgrad; wgrads; fc1 dgrad.

Saved for backward, each through the policy under the flag of the op that owns it:
fc1 -> its input ``x`` (and the split sizes); activation -> ``z`` and ``probs``; fc2 -> nothing
but its weights (``act`` is recomputed, so an ``offload=False`` fc2 costs no memory). Weights of
both layers are always kept resident. The backward writes the recomputed ``act`` over ``z`` (one
tokens x ffn buffer less at the backward's peak, where a capped allocator would otherwise need a
second such block); TE's op fuser runs no second backward through the same graph (for its own
ops either), and this op would refuse one.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from transformer_engine.pytorch.ops.op import FusedOperation

from .. import hints, policy
from ..capture import capturing, sizes_filled_on_device
from ..ops.input_checks import check_input, check_scales, check_split_sizes
from .expert_weights import check_weight_versions, expert_weights, weight_dtype, weight_params, weight_versions
from .row_chunks import block_split_sizes, chunk_rows, expert_row_ranges
from . import block_fp8, fp8_wgrad
from .selection import active_recipe, runtime_blockers
from .split_check import check_now, resolve_in_backward, start_check
from .weight_grads import check_main_grad, main_grads_take_fp8, weight_grad_bytes, weight_grads

log = logging.getLogger(__name__)

_MAX_PENDING_CHECKS = 64  # split-size checks of earlier calls kept before the oldest is awaited


def _make_room(sizes: list[int], device) -> None:
    """``hints.make_room`` for allocations that may be none (a wgrad into main_grad or delayed)."""
    if sizes:
        hints.make_room(sizes, device)


class FusedScaledSReLUMLP(FusedOperation):
    """Joint forward/backward fusion of te_offload_ops GroupedLinear, ScaledSReLU, GroupedLinear."""

    def __init__(self, *, fc1, activation, fc2) -> None:
        super().__init__((fc1, activation, fc2))
        self.last_fallback_reasons: list[str] = []
        self._pending_checks: list = []  # split-size checks of earlier calls, resolved at later forwards

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
        self._check_inputs(input_, split_sizes, probs, basic_op_extra_inputs[2][0])
        self._resolve_landed_checks()
        reasons = runtime_blockers(input_, split_sizes, probs, weight_dtype=weight_dtype(self.fc1))
        if any(basic_op_kwargs):
            reasons.append("output or grad-input buffers were passed through op kwargs")
        if basic_op_extra_inputs[2][0] is not split_sizes:  # the kernels use one routing for both layers
            reasons.append("fc1 and fc2 were given different split_sizes tensors")
        if reasons:
            self._note_fallback(reasons)
            basic_op_ctxs[0].teo_fused = False
            return self._forward_unfused(basic_op_ctxs, input_, basic_op_extra_inputs, prev_op_grad_output_quantizer,
                                         next_op_input_quantizer, basic_op_kwargs)
        self.last_fallback_reasons = []
        return self._forward_fused(basic_op_ctxs, input_, split_sizes, probs)

    def _check_inputs(self, x, split_sizes, probs, fc2_split_sizes) -> None:
        """What TE's ops would reject, rejected here before any kernel, with the values named."""
        fc1, _, fc2 = self.basic_ops
        device = weight_params(fc1)[0].device
        check_input("fused SReLU MLP (fc1)", x, fc1.in_features, device)
        check_split_sizes("fused SReLU MLP (fc1)", split_sizes, fc1.num_groups, device)
        check_split_sizes("fused SReLU MLP (fc2)", fc2_split_sizes, fc2.num_groups, device)
        check_scales("fused SReLU MLP (ScaledSReLU)", probs, x)
        check_main_grad(fc1, "fused SReLU MLP fc1")
        check_main_grad(fc2, "fused SReLU MLP fc2")

    def _resolve_landed_checks(self) -> None:
        """Split-size checks of earlier calls (without grad, or whose backward has not run): raise
        for those that landed bad and have not raised yet."""
        pending = self._pending_checks
        if pending and capturing():  # querying an event is not allowed in a capture; later
            return
        while pending and (pending[0].landed or len(pending) > _MAX_PENDING_CHECKS):
            pending.pop(0).resolve(again=False)

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

    def _device_split_sizes(self, x2d, split_sizes):
        """Split sizes on the GPU as the kernels read them (int32, made once for the forward's and
        the backward's six GEMMs), and their pending check (None where they were read on the host).
        The check reads the sizes as given: one past int32 raises there, and the kernels clamp what
        they read, so a truncated size never reaches past the tokens."""
        where = f"{type(self).__name__} ({self.fc1.num_groups} experts)"
        if split_sizes.device.type == "cpu":  # readable now: check at once, then hand them over
            check_now(split_sizes, x2d.shape[0], where)
            if capturing():  # no host copy in a capture: the graph keeps these sizes
                return sizes_filled_on_device(split_sizes, x2d.device), None
            return split_sizes.reshape(-1).to(x2d.device, torch.int32, non_blocking=True), None
        check = start_check(split_sizes, x2d.shape[0], where)
        return split_sizes.to(torch.int32).reshape(-1), check

    def _forward_fused(self, ctxs, x, split_sizes, probs):
        from .. import kernels

        fc1, act_op, fc2 = self.basic_ops
        x2d = x.contiguous()  # (tokens, hidden): other ranks run unfused (selection.runtime_blockers)
        tokens = x2d.shape[0]
        split_sizes, check = self._device_split_sizes(x2d, split_sizes)
        recipe = active_recipe()
        if recipe is not None:  # selection lets through Float8BlockScaling alone
            return self._forward_fp8(ctxs, x, x2d, split_sizes, probs, check, recipe)
        probs_flat = probs.reshape(-1)
        ffn, itemsize = fc1.out_features, x2d.element_size()
        rows = chunk_rows(tokens, ffn, itemsize)
        # z, act (one block of rows) and y, in allocation order: an offload engine with a memory
        # budget makes room for each just before it is allocated (copies still running have until
        # then to end; room for all at once would wait for them sooner)
        z_act_bytes = [tokens * ffn * itemsize, min(rows, tokens) * ffn * itemsize]
        y_bytes = tokens * fc2.out_features * itemsize
        if rows >= tokens:
            hints.make_room(z_act_bytes, x2d.device)
            w1, rev1 = expert_weights(fc1)  # one at a time: where they must be stacked, a copy each
            act, z = kernels.grouped_gemm_srelu_fwd(x2d, w1, split_sizes, probs_flat, reversed_experts=rev1)
            del w1
            hints.make_room([y_bytes], x2d.device)
            w2, rev2 = expert_weights(fc2)
            y = kernels.grouped_gemm(act, w2, split_sizes, reversed_experts=rev2)
            del w2
        else:  # z, act's block and y are allocated up front
            hints.make_room([*z_act_bytes, y_bytes], x2d.device)
            z, y = self._forward_in_blocks(x2d, split_sizes, probs_flat, rows)
        if check is not None:  # a later forward resolves it if no backward has (one that never runs)
            self._pending_checks.append(check)
        if not any(ctx.requires_grad for ctx in ctxs):
            return y, [(), (), ()]
        ctx1, ctx_act, ctx2 = ctxs
        ctx1.teo_fused = True
        ctx1.teo_split_check = check
        ctx1.input_requires_grad = x.requires_grad
        ctx_act.probs_require_grad = probs.requires_grad
        ctx_act.probs_shape = probs.shape
        policy.save_for_backward(ctx1, x2d, split_sizes, offload=fc1.offload, owner=fc1)
        policy.save_for_backward(ctx_act, z, probs_flat, offload=act_op.offload, owner=act_op)
        # The backward reads the live weights, so they are not saved: their version counters give
        # autograd's in-place check, without a saved-tensor hook per expert weight for the engines.
        ctx1.teo_weight_versions = weight_versions(weight_params(fc1))
        ctx2.teo_weight_versions = weight_versions(weight_params(fc2))
        return y, [(), (), ()]

    def _forward_fp8(self, ctxs, x, x2d, split_sizes, probs, check, recipe):
        """The forward under Float8BlockScaling (:mod:`.block_fp8`)."""
        fc1, act_op, fc2 = self.basic_ops
        probs_flat = probs.reshape(-1)
        tokens, itemsize = x2d.shape[0], x2d.element_size()
        # x for fc1's wgrad: its FP8 rows (dequantized for a bf16 wgrad), or its per-expert
        # columnwise copy for the FP8 wgrad (TE's recipe saves that copy alone)
        x_cols = (fp8_wgrad.wanted(x2d) and weight_params(fc1)[0].requires_grad
                  and any(ctx.requires_grad for ctx in ctxs) and main_grads_take_fp8(fc1))
        # z, act and y in bf16, x and z in FP8 (tokens x (hidden + ffn) bytes), x's columnwise copy
        x_cols_bytes = [fp8_wgrad.column_bytes(tokens, fc1.in_features, fc1.num_groups)] if x_cols else []
        hints.make_room([tokens * fc1.out_features * itemsize, tokens * fc1.out_features * itemsize,
                         tokens * fc2.out_features * itemsize, tokens * (fc1.in_features + fc1.out_features),
                         *x_cols_bytes], x2d.device)
        y, xq, zq, w1, w2, xc = block_fp8.forward(fc1, fc2, recipe, x2d, split_sizes, probs_flat, x_columns=x_cols)
        if check is not None:
            self._pending_checks.append(check)
        if not any(ctx.requires_grad for ctx in ctxs):
            return y, [(), (), ()]
        ctx1, ctx_act, ctx2 = ctxs
        ctx1.teo_fused, ctx1.teo_recipe = True, recipe
        ctx1.teo_split_check = check
        ctx1.input_requires_grad = x.requires_grad
        ctx_act.probs_require_grad = probs.requires_grad
        ctx_act.probs_shape = probs.shape
        w1_cols, w2_cols = (w1.cols, w1.col_scales), (w2.cols, w2.col_scales)
        ctx1.teo_x_cols = x_cols
        x_saved = (xc.data, xc.scale_inv) if x_cols else (xq.data, xq.scale_inv)
        del xq, xc
        policy.save_for_backward(ctx1, *x_saved, split_sizes, *w1_cols, offload=fc1.offload,
                                 weights=w1_cols, owner=fc1)
        policy.save_for_backward(ctx_act, zq.data, zq.scale_inv, probs_flat, offload=act_op.offload, owner=act_op)
        policy.save_for_backward(ctx2, *w2_cols, offload=fc2.offload, weights=w2_cols, owner=fc2)
        return y, [(), (), ()]

    def _forward_in_blocks(self, x2d, split_sizes, probs_flat, rows):
        """fc1 -> SReLU -> fc2 on ``rows`` token rows at a time (``row_chunks``): z and y whole,
        act one block's worth, reused."""
        from .. import kernels

        fc1, _, fc2 = self.basic_ops
        tokens = x2d.shape[0]
        z = x2d.new_empty(tokens, fc1.out_features)
        act = x2d.new_empty(rows, fc1.out_features)
        y = x2d.new_empty(tokens, fc2.out_features)
        starts, ends = expert_row_ranges(split_sizes)
        probs = probs_flat.to(x2d.dtype)
        (w1, rev1), (w2, rev2) = expert_weights(fc1), expert_weights(fc2)
        for first in range(0, tokens, rows):
            stop = min(tokens, first + rows)
            sizes = block_split_sizes(starts, ends, first, stop)
            kernels.grouped_gemm_srelu_fwd(x2d[first:stop], w1, sizes, probs[first:stop], reversed_experts=rev1,
                                           out=(act[: stop - first], z[first:stop]))
            kernels.grouped_gemm(act[: stop - first], w2, sizes, reversed_experts=rev2, out=y[first:stop])
        return z, y

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

        if getattr(ctxs[0], "teo_recipe", None) is not None:
            return self._backward_fp8(ctxs, dy)

        fc1, _, fc2 = self.basic_ops
        ctx1, ctx_act, ctx2 = ctxs
        check, ctx1.teo_split_check = ctx1.teo_split_check, None
        resolve_in_backward(check)  # bad split sizes raise now or when this backward pass ends
        check_weight_versions(fc1, ctx1.teo_weight_versions, "fc1")
        check_weight_versions(fc2, ctx2.teo_weight_versions, "fc2")
        x, split_sizes = ctx1.saved_tensors
        z, probs = ctx_act.saved_tensors
        dy = dy.contiguous()

        if getattr(ctx_act, "teo_z_spent", False):  # TE's fuser refuses a second backward before this
            raise RuntimeError(f"{type(self).__name__}: a second backward through the same graph; the first wrote "
                               "act over the saved z (TE's op fuser does not run a second backward of its ops either)")
        # what this backward allocates, in its order: dz and dprobs' partial sums (act is written
        # over z), fc2's wgrad (unless into main_grad or delayed), dx, fc1's wgrad: an offload
        # engine with a memory budget makes room for each just before it (what it gives back may
        # be a copy still running, which then has until that allocation to end)
        device = z.device
        hints.make_room(list(kernels.dsrelu_bwd_bytes(z.shape[0], z.shape[1], dy.element_size())), device)
        w2, rev2 = expert_weights(fc2)
        dz, dprobs, act = kernels.grouped_gemm_dsrelu_bwd(dy, w2, split_sizes, z, probs, reversed_experts=rev2,
                                                          act_in_z=True)
        ctx_act.teo_z_spent = True
        del w2, z
        _make_room(weight_grad_bytes(fc2), device)
        dw2 = weight_grads(fc2, dy, act, split_sizes, temporaries=[act])
        del act
        dx = None
        if ctx1.input_requires_grad:
            _make_room([x.shape[0] * fc1.in_features * dy.element_size()], device)
            w1, rev1 = expert_weights(fc1)
            dx = kernels.grouped_gemm(dz, w1, split_sizes, trans_b=True, reversed_experts=rev1)
        _make_room(weight_grad_bytes(fc1), device)
        dw1 = weight_grads(fc1, dz, x, split_sizes, temporaries=[dz])
        dprobs = dprobs.view(ctx_act.probs_shape) if ctx_act.probs_require_grad else None
        return dx, [dw1, (), dw2], [(None,), (dprobs,), (None,)]

    def _backward_fp8(self, ctxs, dy):
        """The backward under Float8BlockScaling (:mod:`.block_fp8`)."""
        fc1, _, fc2 = self.basic_ops
        ctx1, ctx_act, ctx2 = ctxs
        check, ctx1.teo_split_check = ctx1.teo_split_check, None
        resolve_in_backward(check)
        recipe = ctx1.teo_recipe
        x_data, x_scales, split_sizes, *w1_cols = ctx1.saved_tensors
        z_data, z_scales, probs = ctx_act.saved_tensors
        w2_cols = ctx2.saved_tensors
        dy = dy.contiguous()
        device, itemsize = dy.device, dy.element_size()
        tokens, ffn = z_data.shape
        experts = fc1.num_groups
        fp8_w2 = (fp8_wgrad.wanted(dy) and weight_params(fc2)[0].requires_grad  # fc2's wgrad in FP8
                  and main_grads_take_fp8(fc2))
        # dact (dz over it), act, dz in FP8 and dprobs; dy's columnwise copy for an FP8 wgrad
        dy_cols_bytes = [fp8_wgrad.column_bytes(tokens, fc2.out_features, experts)] if fp8_w2 else []
        hints.make_room([tokens * ffn * itemsize, tokens * ffn * itemsize, tokens * ffn, tokens * 4, *dy_cols_bytes],
                        device)
        dz, dz_fp8, dprobs, act, dyc = block_fp8.dgrads(recipe, dy, block_fp8.Rows(z_data, z_scales), probs,
                                                        split_sizes, w2_cols, dy_columns=fp8_w2)
        del z_data, z_scales
        in_q, grad_q = block_fp8.qparams(recipe, "input"), block_fp8.qparams(recipe, "grad")
        if fp8_w2:  # act columnwise per expert too
            _make_room([fp8_wgrad.column_bytes(tokens, ffn, experts)], device)
            actc = fp8_wgrad.columns(*in_q, act, split_sizes)
            del act
            _make_room(weight_grad_bytes(fc2), device)
            dw2 = weight_grads(fc2, dyc, actc, split_sizes, temporaries=[])
            del dyc, actc
        else:
            _make_room(weight_grad_bytes(fc2), device)
            dw2 = weight_grads(fc2, dy, act, split_sizes, temporaries=[act])
            del act
        dx = None
        if ctx1.input_requires_grad:
            _make_room([tokens * fc1.in_features * itemsize], device)
            dx = block_fp8.input_grad(recipe, dz, dz_fp8, split_sizes, tuple(w1_cols))
        del dz_fp8
        if ctx1.teo_x_cols:
            _make_room([fp8_wgrad.column_bytes(tokens, ffn, experts)], device)
            dzc = fp8_wgrad.columns(*grad_q, dz, split_sizes)
            del dz
            _make_room(weight_grad_bytes(fc1), device)
            dw1 = weight_grads(fc1, dzc, fp8_wgrad.Cols(x_data, x_scales, tokens), split_sizes, temporaries=[])
        else:
            _make_room([tokens * fc1.in_features * itemsize, *weight_grad_bytes(fc1)], device)
            x = block_fp8.dequantize_rows(block_fp8.Rows(x_data, x_scales), dy.dtype)
            dw1 = weight_grads(fc1, dz, x, split_sizes, temporaries=[dz, x])
        dprobs = dprobs.to(probs.dtype).view(ctx_act.probs_shape) if ctx_act.probs_require_grad else None
        return dx, [dw1, (), dw2], [(None,), (dprobs,), (None,)]
