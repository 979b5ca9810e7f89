"""The FP8 steps of the fused SReLU grouped MLP (:mod:`.srelu_mlp`) under Transformer Engine's
``Float8BlockScaling`` on Hopper: what it quantizes, which kernels it calls, what it saves.

Every dgrad and fprop GEMM reads FP8 e4m3 operands with TE's block scales (1x128 for activations
and gradients, 128x128 for weights), quantized with the recipe's settings as TE's
``Float8BlockQuantizer`` quantizes, and promotes its partial sums to fp32 once per 128-wide K block
(:func:`..kernels.grouped_gemm_fp8_blockwise`):

* forward: ``z = q(x) @ q(W1)^T``; ``act = srelu(z) * prob``; ``y = q(act) @ q(W2)^T``;
* backward: ``dact = q(dy) @ q(W2)``; ``dz = dact * 2 relu(z) * prob`` and
  ``dprob = sum(dact * relu(z)^2)``; ``dx = q(dz) @ q(W1)``; the wgrads run in bf16 on the saved
  FP8 operands dequantized (x, and act recomputed from z), with Megatron's settings
  (:mod:`.weight_grads`), or with ``TEO_FP8_WGRAD=fp8`` in FP8 on per-expert columnwise copies
  (:mod:`.fp8_wgrad`; x is then saved as its columnwise copy).

The row passes (x's and dy's quantization, x's dequantization) and the weights' quantization are
Triton kernels (:mod:`..kernels.fp8_rows`) that write the bytes TE's quantizer writes; fc1's GEMM
writes act and z quantized from its epilogue and fc2's dgrad runs the SReLU backward in its epilogue
(the same bytes, dprob summed in another order; no bf16 z or dact in memory:
:func:`..kernels.grouped_gemm_fp8_srelu_quantize`, :func:`..kernels.grouped_gemm_fp8_dsrelu_quantize`).
``TEO_FP8_ROWS=triton`` runs SReLU and its backward as Triton row passes between plain FP8 GEMMs;
``TEO_FP8_ROWS=torch`` runs every row pass as torch ops and TE's quantizer (so does a process
without Triton, for the passes the GEMMs do not take).

Saved for backward, each through the policy: x and z in FP8 with their 1x128 scales (half the bytes
of the bf16 path's x and z), probs and the split sizes; the weights' FP8 columnwise data for the
dgrads as weights (never offloaded). Weights are quantized in every forward, as TE's ops quantize
theirs (an optimizer may write them through ``.data``, which leaves no version to compare), unless
the op's ``is_first_microbatch`` says otherwise (:func:`step_weights`): Megatron sets it at each
step's first micro-batch, and the later micro-batches of the step reuse that quantization.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .. import settings
from ..capture import capturing
from . import fp8_wgrad
from .expert_weights import expert_weights, stacked_weight

BLOCK = 128  # TE's block length for both 1x128 and 128x128 scales
BLOCK_DIMS = (1, 2, 1)  # (x, w, grad) block_scaling_dim the kernels take
ROWS_PER_PASS = 4096  # token rows per elementwise pass of the torch fallback (bounds its fp32 temporaries)
ROWS_ENV = settings.FP8_ROWS_ENV  # gemm (default), triton or torch: settings.fp8_rows


def _row_kernels():
    """:mod:`..kernels.fp8_rows` where Triton runs (one pass per step piece), else None (torch ops)."""
    from ..kernels import fp8_rows

    if settings.fp8_rows() == "torch" or fp8_rows.unavailable() is not None:
        return None
    return fp8_rows


def qparams(recipe, role: str) -> tuple[float, bool]:
    """(amax epsilon, power-of-two scales) the recipe quantizes ``role`` ("input" or "grad") with."""
    params = recipe.fp8_quant_fwd_inp if role == "input" else recipe.fp8_quant_bwd_grad
    return float(params.amax_epsilon), bool(params.power_2_scale)


def quantize_for(recipe, role: str, t: torch.Tensor) -> "Rows":
    """Rows ``t`` in FP8 as the recipe quantizes ``role`` ("input" or "grad")."""
    if t.is_cuda and (fast := _row_kernels()) is not None:
        return Rows(*fast.quantize(t.contiguous(), *qparams(recipe, role)))
    return quantize_rows(t, quantizer(recipe, role))


def quantize_with_columns(recipe, role: str, t: torch.Tensor, split_sizes: Optional[torch.Tensor]):
    """``(rows, columns or None)``: :func:`quantize_for`'s rows, and with ``split_sizes`` the
    per-expert columnwise copy an FP8 weight gradient reads, both from one read of ``t`` (the
    caller asks for columns only where :func:`.fp8_wgrad.wanted`, i.e. where Triton runs)."""
    if split_sizes is None:
        return quantize_for(recipe, role, t), None
    from ..kernels import fp8_rows

    rows, row_scales, data, scales = fp8_rows.quantize_both(t.contiguous(), split_sizes, *qparams(recipe, role))
    return Rows(rows, row_scales), fp8_wgrad.Cols(data, scales, t.shape[0])


def recipe_problem(recipe: Any) -> Optional[str]:
    """Why the fused op cannot run under ``recipe`` (None: it can, in FP8 when a recipe is set)."""
    if recipe is None:
        return None
    from transformer_engine.common.recipe import Float8BlockScaling, Format

    if not isinstance(recipe, Float8BlockScaling):
        return (f"a quantization recipe is active ({type(recipe).__name__}); the Hopper kernels take bf16/fp16, "
                "or FP8 under Float8BlockScaling")
    if recipe.fp8_format != Format.E4M3:
        return (f"Float8BlockScaling with fp8_format={recipe.fp8_format.name}: the FP8 kernels read e4m3 only, "
                "gradients included")
    dims = (recipe.x_block_scaling_dim, recipe.w_block_scaling_dim, recipe.grad_block_scaling_dim)
    if dims != BLOCK_DIMS:
        return f"Float8BlockScaling with (x, w, grad) block dims {dims}: the FP8 kernels take {BLOCK_DIMS}"
    return None


@functools.lru_cache(maxsize=32)
def _quantizer(dim: int, columnwise: bool, amax_epsilon: float, pow_2_scales: bool):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch import Float8BlockQuantizer

    return Float8BlockQuantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=columnwise,
                                amax_epsilon=amax_epsilon, force_pow_2_scales=pow_2_scales,
                                block_scaling_dim=dim)


def quantizer(recipe: Any, role: str):
    """TE's quantizer for ``role`` ("input", "weight" with its columnwise copy, or "grad") as the
    recipe makes it for GroupedLinear."""
    params = {"input": recipe.fp8_quant_fwd_inp, "weight": recipe.fp8_quant_fwd_weight,
              "grad": recipe.fp8_quant_bwd_grad}[role]
    weight = role == "weight"
    return _quantizer(2 if weight else 1, weight, float(params.amax_epsilon), bool(params.power_2_scale))


@dataclass
class Rows:
    """Token rows in FP8: ``data`` (T, K) e4m3 as uint8, ``scale_inv`` TE's 1x128 layout
    (ceil(K / 128), T padded to a multiple of 4)."""

    data: torch.Tensor
    scale_inv: torch.Tensor


def quantize_rows(t: torch.Tensor, q) -> Rows:
    if t.shape[0] == 0:  # TE's quantizer takes no empty tensor; nothing reads these
        return Rows(t.new_empty(t.shape, dtype=torch.uint8), t.new_empty((-(-t.shape[1] // BLOCK), 0),
                                                                         dtype=torch.float32))
    parts = q(t).get_metadata()
    return Rows(parts["rowwise_data"], parts["rowwise_scale_inv"])


def _dequantized_pass(rows: Rows, first: int, stop: int) -> torch.Tensor:
    """fp32 values of rows ``first:stop``."""
    data = rows.data[first:stop].view(torch.float8_e4m3fn)
    k = data.shape[1]
    scales = rows.scale_inv[:, first:stop].t()  # (rows, k-blocks)
    out = data.float()
    whole = k // BLOCK
    if whole:
        out[:, : whole * BLOCK].view(-1, whole, BLOCK).mul_(scales[:, :whole, None])
    if k % BLOCK:  # a partial last block has a scale of its own
        out[:, whole * BLOCK:].mul_(scales[:, whole:whole + 1])
    return out


def dequantize_rows(rows: Rows, dtype: torch.dtype) -> torch.Tensor:
    if rows.data.is_cuda and (fast := _row_kernels()) is not None:
        return fast.dequantize(rows.data, rows.scale_inv, dtype)
    out = torch.empty(rows.data.shape, dtype=dtype, device=rows.data.device)
    for first in range(0, rows.data.shape[0], ROWS_PER_PASS):
        stop = min(rows.data.shape[0], first + ROWS_PER_PASS)
        out[first:stop] = _dequantized_pass(rows, first, stop)
    return out


@dataclass
class Weights:
    """An op's experts in FP8 with 128x128 scales, expert order: ``rows`` (E, N, K) and
    ``row_scales`` (E, ceil(N / 128), ceil(K / 128) padded to 4) for the forward; ``cols``
    (E, K, N) and ``col_scales`` (E, ceil(K / 128), ceil(N / 128) padded to 4) for the dgrad."""

    rows: torch.Tensor
    row_scales: torch.Tensor
    cols: torch.Tensor
    col_scales: torch.Tensor


def quantize_weights(op, q, recipe=None) -> Weights:
    """Each expert's weight in 128x128 blocks, both orientations: the Triton kernel where it runs
    (``recipe`` given), else TE's 2D quantizer (rowwise and columnwise at once; with
    ``out_features`` a multiple of 128 no block straddles two experts and one call takes all)."""
    if recipe is not None and (fast := _row_kernels()) is not None:
        w, reversed_experts = expert_weights(op)
        params = recipe.fp8_quant_fwd_weight
        if w.is_cuda and w.stride(1) == w.shape[2] and w.stride(2) == 1:
            return Weights(*fast.quantize_weights(w, reversed_experts, float(params.amax_epsilon),
                                                  bool(params.power_2_scale)))
    w = stacked_weight(op)
    e, n, k = w.shape
    if n % BLOCK == 0:
        parts = q(w.reshape(e * n, k)).get_metadata()
        nb, kb = n // BLOCK, -(-k // BLOCK)
        cols = parts["columnwise_data"].view(k, e, n).transpose(0, 1).contiguous()
        col_scales = parts["columnwise_scale_inv"][:, : e * nb].reshape(kb, e, nb).transpose(0, 1)
        pad = -(-nb // 4) * 4 - nb  # each expert's scale rows padded as TE pads one expert's
        col_scales = torch.nn.functional.pad(col_scales, (0, pad)).contiguous()
        return Weights(parts["rowwise_data"].view(e, n, k), parts["rowwise_scale_inv"].view(e, nb, -1),
                       cols, col_scales)
    per_expert = [q(w[i]).get_metadata() for i in range(e)]
    return Weights(*(torch.stack([p[name] for p in per_expert]) for name in
                     ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")))


def step_weights(op, q, recipe) -> Weights:
    """The op's FP8 weights under TE's and Megatron's ``is_first_microbatch`` convention: None
    (the default), quantized in this call; True, quantized and kept on the op; False, the kept
    ones (quantized now if there are none, or the recipe's weight settings changed). Megatron's
    ``set_is_first_microbatch`` sets True at each step's first micro-batch (with FP8 on), and the
    flag turns False after the call, so the later micro-batches of a step, where the weights
    cannot change, reuse the first one's (set it True again after writing the weights outside an
    optimizer step, e.g. loading a checkpoint). A CUDA graph capture always quantizes: a replay
    must read the weights of its step."""
    first = getattr(op, "is_first_microbatch", None)
    if first is None or capturing():
        return quantize_weights(op, q, recipe)
    params = recipe.fp8_quant_fwd_weight if recipe is not None else None
    key = None if params is None else (float(params.amax_epsilon), bool(params.power_2_scale))
    kept = getattr(op, "_teo_step_weights", None)
    if first or kept is None or kept[0] != key:
        op._teo_step_weights = kept = None  # the old copies go before the new ones are made
        kept = op._teo_step_weights = (key, quantize_weights(op, q, recipe))
    op.is_first_microbatch = False
    return kept[1]


def gemm(a: Rows, b_data: torch.Tensor, b_scales: torch.Tensor, split_sizes: torch.Tensor,
         out_dtype: torch.dtype) -> torch.Tensor:
    from .. import kernels

    return kernels.grouped_gemm_fp8_blockwise(a.data, a.scale_inv, b_data, b_scales, split_sizes, out_dtype)


def scaled_srelu(z: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``relu(z)^2 * prob`` per row, in fp32, rounded to z's dtype."""
    act = torch.empty_like(z)
    for first in range(0, z.shape[0], ROWS_PER_PASS):
        stop = min(z.shape[0], first + ROWS_PER_PASS)
        r = torch.relu(z[first:stop].float())
        act[first:stop] = r.square_().mul_(probs[first:stop, None].float())
    return act


def dscaled_srelu(dact: torch.Tensor, z: Rows, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """From the FP8 z: ``dz = dact * 2 relu(z) * prob`` (in place of dact), ``dprob`` (fp32) and
    the recomputed ``act`` (dact's dtype), in fp32 a pass of rows at a time."""
    act = torch.empty_like(dact)
    dprobs = torch.empty(dact.shape[0], dtype=torch.float32, device=dact.device)
    for first in range(0, dact.shape[0], ROWS_PER_PASS):
        stop = min(dact.shape[0], first + ROWS_PER_PASS)
        r = torch.relu_(_dequantized_pass(z, first, stop))
        d = dact[first:stop].float()
        p = probs[first:stop, None].float()
        r2 = r.square()
        dprobs[first:stop] = (d * r2).sum(dim=1)
        act[first:stop] = r2.mul_(p)
        dact[first:stop] = d.mul_(r).mul_(p).mul_(2.0)
    return dact, dprobs, act


def forward(fc1, fc2, recipe, x: torch.Tensor, split_sizes: torch.Tensor, probs: torch.Tensor,
            x_columns: bool = False):
    """Returns ``(y, x in FP8, z in FP8, fc1's weights, fc2's weights, x's columnwise copy or None)``
    (the copy where ``x_columns``: for an FP8 weight gradient)."""
    qx, qw = quantizer(recipe, "input"), quantizer(recipe, "weight")
    xq, xc = quantize_with_columns(recipe, "input", x, split_sizes if x_columns else None)
    w1 = step_weights(fc1, qw, recipe)
    if x.is_cuda and settings.fp8_rows() == "gemm":  # act and z quantized in fc1's epilogue
        from .. import kernels

        eps, pow2 = qparams(recipe, "input")
        act_data, act_scales, z_data, z_scales = kernels.grouped_gemm_fp8_srelu_quantize(
            xq.data, xq.scale_inv, w1.rows, w1.row_scales, split_sizes, probs, eps=eps, pow2=pow2, out_dtype=x.dtype)
        w2 = step_weights(fc2, qw, recipe)
        y = gemm(Rows(act_data, act_scales), w2.rows, w2.row_scales, split_sizes, x.dtype)
        return y, xq, Rows(z_data, z_scales), w1, w2, xc
    z = gemm(xq, w1.rows, w1.row_scales, split_sizes, x.dtype)
    if (fast := _row_kernels()) is not None:  # act and z quantized in one pass over z
        act_data, act_scales, z_data, z_scales = fast.srelu_quantize(z, probs.contiguous(), *qparams(recipe, "input"))
        act, zq = Rows(act_data, act_scales), Rows(z_data, z_scales)
    else:
        act = quantize_rows(scaled_srelu(z, probs), qx)
        zq = quantize_rows(z, qx)
    del z
    w2 = step_weights(fc2, qw, recipe)
    y = gemm(act, w2.rows, w2.row_scales, split_sizes, x.dtype)
    return y, xq, zq, w1, w2, xc


def dgrads(recipe, dy: torch.Tensor, z: Rows, probs: torch.Tensor, split_sizes: torch.Tensor,
           w2_cols: tuple[torch.Tensor, torch.Tensor], dy_columns: bool = False):
    """fc2's dgrad and the activation's backward: ``(dz, dz in FP8 or None, dprobs, act, dy's
    columnwise copy or None)`` (the copy where ``dy_columns``: for fc2's FP8 weight gradient)."""
    dyq, dyc = quantize_with_columns(recipe, "grad", dy, split_sizes if dy_columns else None)
    if dy.is_cuda and settings.fp8_rows() == "gemm":  # the SReLU backward in fc2's dgrad epilogue
        from .. import kernels

        eps, pow2 = qparams(recipe, "grad")
        dz, dz_data, dz_scales, dprobs, act = kernels.grouped_gemm_fp8_dsrelu_quantize(
            dyq.data, dyq.scale_inv, *w2_cols, split_sizes, z.data, z.scale_inv, probs, eps=eps, pow2=pow2,
            out_dtype=dy.dtype)
        return dz, Rows(dz_data, dz_scales), dprobs, act, dyc
    dact = gemm(dyq, *w2_cols, split_sizes, dy.dtype)
    if dact.is_cuda and (fast := _row_kernels()) is not None:
        dz, dz_data, dz_scales, dprobs, act = fast.dsrelu_quantize(dact, z.data, z.scale_inv, probs.contiguous(),
                                                                   *qparams(recipe, "grad"))
        return dz, Rows(dz_data, dz_scales), dprobs, act, dyc
    dz, dprobs, act = dscaled_srelu(dact, z, probs)
    return dz, None, dprobs, act, dyc


def input_grad(recipe, dz: torch.Tensor, dz_fp8: Optional[Rows], split_sizes: torch.Tensor,
               w1_cols: tuple[torch.Tensor, torch.Tensor]):
    dz_fp8 = dz_fp8 if dz_fp8 is not None else quantize_for(recipe, "grad", dz)
    return gemm(dz_fp8, *w1_cols, split_sizes, dz.dtype)
