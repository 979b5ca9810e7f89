"""Triton kernels for the token-row passes of the fused MLP under Float8BlockScaling.

Each reads its inputs once and writes FP8 rows with TE's 1x128 block scales (e4m3, scale from
the block's amax as TE's ``compute_scale_from_amax``: the recipe's epsilon floor, power-of-two
rounding by clearing the mantissa, fp32 scale-inverses laid out ``(ceil(F / 128), roundup(T, 4))``),
so the bytes equal those of TE's ``Float8BlockQuantizer`` applied to the same bf16/fp16 values:

* :func:`srelu_quantize`: ``act = relu(z)^2 * prob`` (rounded to z's dtype, as the GEMM would
  read it) quantized for fc2, and z quantized to be saved; one pass over z;
* :func:`dsrelu_quantize`: from ``dact`` and the saved FP8 z, ``dz = dact * 2 relu(z) * prob``
  (written over ``dact``) and quantized for fc1's dgrad, ``dprob = sum(dact * relu(z)^2)`` (fp32)
  and ``act`` recomputed for fc2's wgrad; one pass;
* :func:`quantize`: rows in 1x128 blocks (x for fc1, dy for fc2's dgrad);
* :func:`dequantize`: FP8 rows back to bf16/fp16 (fc1's wgrad reads x);
* :func:`quantize_columns`: tokens in 128x1 blocks per expert, for an FP8 weight gradient (whose
  reduction runs over tokens): each expert's ``(K, T_e)`` columnwise copy as TE's quantizer writes
  it for that expert alone, the experts' copies side by side with each one's tokens padded to a
  multiple of 128 (zeros), offsets on the GPU (no split sizes read on the host);
* :func:`quantize_both`: :func:`quantize` and :func:`quantize_columns` from one read (x when the
  weight gradients run in FP8, dy likewise);
* :func:`quantize_weights`: each expert's weight in 128x128 blocks, both orientations at once (the
  fprop reads W, the dgrad W^T), as TE's 2D quantizer writes each expert's rowwise and columnwise
  data and scales; one pass over the weights, read in place (Megatron's reversed buffer too).
"""

from __future__ import annotations

from typing import Optional

import torch

BLOCK = 128
ROWS = 16  # token rows per program
WEIGHT_WARPS = 8  # a 128x128 weight block per program: 8 warps keep it in registers
# Element offsets are 64-bit: an operand may pass 2^31 elements (tokens x ffn at large batches).


try:
    import triton
    import triton.language as tl
except ImportError as _exc:  # torch's CUDA wheels bring Triton; elsewhere the callers use torch
    triton, _IMPORT_ERROR = None, _exc
else:
    _IMPORT_ERROR = None


def unavailable() -> Optional[str]:
    """Why the Triton kernels cannot run here, or None."""
    return None if triton is not None else f"Triton does not import: {_IMPORT_ERROR}"


if triton is not None:
    @triton.jit
    def block_scale(amax, eps, POW2: tl.constexpr, INF_VALUE: tl.constexpr):
        amax = tl.maximum(amax, eps)
        scale = tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)  # e4m3 largest
        scale = tl.where(scale > 3.4028234663852886e38, INF_VALUE, scale)
        if POW2:
            scale = (scale.to(tl.uint32, bitcast=True) & 0xFF800000).to(tl.float32, bitcast=True)
        return tl.where((amax == 0.0) | (amax > 3.4028234663852886e38) | (amax != amax), 1.0, scale)

    @triton.jit
    def store_fp8(x, data_ptr, scale_ptr, rows, cols, mask, row_mask, kb, F, scale_stride, eps,
                  POW2: tl.constexpr, INF_VALUE: tl.constexpr):
        scale = block_scale(tl.max(tl.abs(x), axis=1), eps, POW2, INF_VALUE)
        q = (x * scale[:, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(data_ptr + rows.to(tl.int64)[:, None] * F + cols[None, :], q, mask=mask)
        scale_inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        tl.store(scale_ptr + (rows.to(tl.int64) + kb * scale_stride), scale_inv, mask=row_mask)

    @triton.jit
    def srelu_quantize_kernel(z_ptr, p_ptr, act_ptr, act_s_ptr, zq_ptr, zq_s_ptr, T, F, scale_stride, eps,
                              POW2: tl.constexpr, INF_VALUE: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        kb = tl.program_id(1)
        cols = kb * 128 + tl.arange(0, 128)
        row_mask = rows < T
        mask = row_mask[:, None] & (cols < F)[None, :]
        z16 = tl.load(z_ptr + rows.to(tl.int64)[:, None] * F + cols[None, :], mask=mask, other=0.0)
        z = z16.to(tl.float32)
        p = tl.load(p_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        r = tl.maximum(z, 0.0)
        act = (r * r * p[:, None]).to(z16.dtype).to(tl.float32)
        store_fp8(act, act_ptr, act_s_ptr, rows, cols, mask, row_mask, kb, F, scale_stride, eps, POW2, INF_VALUE)
        store_fp8(z, zq_ptr, zq_s_ptr, rows, cols, mask, row_mask, kb, F, scale_stride, eps, POW2, INF_VALUE)

    @triton.jit
    def dsrelu_quantize_kernel(dact_ptr, zq_ptr, zq_s_ptr, p_ptr, act_ptr, dzq_ptr, dzq_s_ptr, dp_ptr, T, F,
                               scale_stride, eps, K_BLOCKS: tl.constexpr, POW2: tl.constexpr,
                               INF_VALUE: tl.constexpr, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_mask = rows < T
        p = tl.load(p_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        dprob = tl.zeros((ROWS,), tl.float32)
        for kb in range(K_BLOCKS):
            cols = kb * 128 + tl.arange(0, 128)
            mask = row_mask[:, None] & (cols < F)[None, :]
            offs = rows.to(tl.int64)[:, None] * F + cols[None, :]
            d16 = tl.load(dact_ptr + offs, mask=mask, other=0.0)
            d = d16.to(tl.float32)
            zq = tl.load(zq_ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            zs = tl.load(zq_s_ptr + (rows.to(tl.int64) + kb * scale_stride), mask=row_mask, other=0.0)
            r = tl.maximum(zq * zs[:, None], 0.0)
            r2 = r * r
            dprob += tl.sum(d * r2, axis=1)
            tl.store(act_ptr + offs, (r2 * p[:, None]).to(d16.dtype), mask=mask)
            dz = (d * r * p[:, None] * 2.0).to(d16.dtype)
            tl.store(dact_ptr + offs, dz, mask=mask)  # dz over dact: each element read before
            store_fp8(dz.to(tl.float32), dzq_ptr, dzq_s_ptr, rows, cols, mask, row_mask, kb, F, scale_stride, eps,
                      POW2, INF_VALUE)
        tl.store(dp_ptr + rows, dprob, mask=row_mask)

    @triton.jit
    def quantize_kernel(x_ptr, q_ptr, s_ptr, T, K, scale_stride, eps, POW2: tl.constexpr, INF_VALUE: tl.constexpr,
                        ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        kb = tl.program_id(1)
        cols = kb * 128 + tl.arange(0, 128)
        row_mask = rows < T
        mask = row_mask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        store_fp8(x, q_ptr, s_ptr, rows, cols, mask, row_mask, kb, K, scale_stride, eps, POW2, INF_VALUE)

    @triton.jit
    def dequantize_kernel(q_ptr, s_ptr, out_ptr, T, K, scale_stride, ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        kb = tl.program_id(1)
        cols = kb * 128 + tl.arange(0, 128)
        row_mask = rows < T
        mask = row_mask[:, None] & (cols < K)[None, :]
        offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
        q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s = tl.load(s_ptr + (rows.to(tl.int64) + kb * scale_stride), mask=row_mask, other=0.0)
        tl.store(out_ptr + offs, (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


    @triton.jit
    def expert_block(split_ptr, pos, E, T, E_P2: tl.constexpr):
        """(first token, end token, first padded column) of the expert whose padded range holds
        column ``pos``, from the split sizes alone (no host read, no torch pass); past the last
        expert an empty range. Sizes are clamped to [0, T]: they are checked only later, on the
        host, and bad ones must not reach outside x meanwhile."""
        e_idx = tl.arange(0, E_P2)
        sizes = tl.load(split_ptr + e_idx, mask=e_idx < E, other=0)
        sizes = tl.minimum(tl.maximum(sizes, 0), T).to(tl.int32)
        padded = (sizes + 127) // 128 * 128
        p_end = tl.cumsum(padded, 0)
        t_end = tl.cumsum(sizes, 0)
        # the expert: how many experts' padded ranges end at or before pos
        e = tl.sum(((p_end <= pos) & (e_idx < E)).to(tl.int32), axis=0)
        here = (e_idx == e) & (e_idx < E)
        past = (e >= E).to(tl.int32)  # nothing selected: start at the padded end, read nothing
        p0 = tl.sum(tl.where(here, p_end - padded, 0), axis=0) + past * tl.sum(padded, axis=0)
        t0 = tl.sum(tl.where(here, t_end - sizes, 0), axis=0) + past * tl.sum(sizes, axis=0)
        return t0, t0 + tl.sum(tl.where(here, sizes, 0), axis=0), p0

    @triton.jit
    def column_block(x_ptr, split_ptr, E, T, K, pb, kb, E_P2: tl.constexpr):
        """Block ``(pb, kb)`` of the padded copy, read from x: (values fp32 (128 tokens, 128
        features), tokens, features, mask); padding and blocks past the last expert read as zeros."""
        pos = pb * 128
        t0, t_end, p0 = expert_block(split_ptr, pos, E, T, E_P2)
        tok = t0 + (pos - p0) + tl.arange(0, 128)
        k = kb * 128 + tl.arange(0, 128)
        tok_ok = (tok < t_end) & (tok < T) & (tok >= 0)
        mask = tok_ok[:, None] & (k < K)[None, :]
        x = tl.load(x_ptr + tok.to(tl.int64)[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        return x, tok, k, mask, tok_ok

    @triton.jit
    def store_columns(x, q_ptr, s_ptr, pb, k, K, TP, KP, eps, POW2: tl.constexpr, INF_VALUE: tl.constexpr):
        """The block's 128x1 quantization: (K, TP) rows of tokens, scales at (pb, k)."""
        scale = block_scale(tl.max(tl.abs(x), axis=0), eps, POW2, INF_VALUE)  # per feature, over the tokens
        q = (x * scale[None, :]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        cols = pb * 128 + tl.arange(0, 128)
        tl.store(q_ptr + k.to(tl.int64)[:, None] * TP + cols[None, :], tl.trans(q), mask=(k < K)[:, None])
        scale_inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        tl.store(s_ptr + pb.to(tl.int64) * KP + k, scale_inv, mask=k < K)

    @triton.jit
    def quantize_columns_kernel(x_ptr, split_ptr, q_ptr, s_ptr, E, T, K, TP, KP, eps, E_P2: tl.constexpr,
                                POW2: tl.constexpr, INF_VALUE: tl.constexpr):
        pb = tl.program_id(0)  # a 128-token block of the padded copy
        kb = tl.program_id(1)
        x, _, k, _, _ = column_block(x_ptr, split_ptr, E, T, K, pb, kb, E_P2)
        store_columns(x, q_ptr, s_ptr, pb, k, K, TP, KP, eps, POW2, INF_VALUE)

    @triton.jit
    def quantize_both_kernel(x_ptr, split_ptr, q_ptr, s_ptr, r_ptr, rs_ptr, E, T, K, TP, KP, row_stride, eps,
                             E_P2: tl.constexpr, POW2: tl.constexpr, INF_VALUE: tl.constexpr):
        """quantize_columns_kernel's block, also written as rows (quantize_kernel's bytes): one read."""
        pb = tl.program_id(0)
        kb = tl.program_id(1)
        x, tok, k, mask, tok_ok = column_block(x_ptr, split_ptr, E, T, K, pb, kb, E_P2)
        store_fp8(x, r_ptr, rs_ptr, tok, k, mask, tok_ok, kb, K, row_stride, eps, POW2, INF_VALUE)
        store_columns(x, q_ptr, s_ptr, pb, k, K, TP, KP, eps, POW2, INF_VALUE)

    @triton.jit
    def quantize_weights_kernel(w_ptr, expert_stride, rows_ptr, row_s_ptr, cols_ptr, col_s_ptr, E, N, K, NBP, KBP,
                                eps, REVERSED: tl.constexpr, POW2: tl.constexpr, INF_VALUE: tl.constexpr):
        e = tl.program_id(0)
        nb = tl.program_id(1)
        kb = tl.program_id(2)
        src = (E - 1 - e) if REVERSED else e
        n = nb * 128 + tl.arange(0, 128)
        k = kb * 128 + tl.arange(0, 128)
        mask = (n < N)[:, None] & (k < K)[None, :]
        w = tl.load(w_ptr + src.to(tl.int64) * expert_stride + n.to(tl.int64)[:, None] * K + k[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
        scale = block_scale(amax, eps, POW2, INF_VALUE)
        q = (w * scale).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        base = e.to(tl.int64) * N * K
        tl.store(rows_ptr + base + n.to(tl.int64)[:, None] * K + k[None, :], q, mask=mask)
        # W^T: (K, N) rows; transposed in registers so both stores write whole rows
        tl.store(cols_ptr + base + k.to(tl.int64)[:, None] * N + n[None, :], tl.trans(q), mask=tl.trans(mask))
        scale_inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        tl.store(row_s_ptr + (e * ((N + 127) // 128) + nb) * KBP + kb, scale_inv)
        tl.store(col_s_ptr + (e * ((K + 127) // 128) + kb) * NBP + nb, scale_inv)


def quantize_weights(w: torch.Tensor, reversed_experts: bool, eps: float, pow2: bool):
    """``(rows (E, N, K), row scales (E, ceil(N/128), roundup(ceil(K/128), 4)), cols (E, K, N),
    col scales (E, ceil(K/128), roundup(ceil(N/128), 4)))`` in expert order from ``w`` (E, N, K),
    each expert's matrix contiguous and the experts ``w.stride(0)`` apart (``w[j]`` is expert
    ``E - 1 - j`` where ``reversed_experts``)."""
    e, n, k = w.shape
    if w.stride(1) != k or w.stride(2) != 1:
        raise ValueError(f"each expert's weight must be contiguous, got stride {tuple(w.stride())}")
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    nbp, kbp = -(-nb // 4) * 4, -(-kb // 4) * 4
    rows = torch.empty((e, n, k), dtype=torch.uint8, device=w.device)
    cols = torch.empty((e, k, n), dtype=torch.uint8, device=w.device)
    row_s = torch.zeros((e, nb, kbp), dtype=torch.float32, device=w.device)
    col_s = torch.zeros((e, kb, nbp), dtype=torch.float32, device=w.device)
    quantize_weights_kernel[(e, nb, kb)](w, w.stride(0), rows, row_s, cols, col_s, e, n, k, nbp, kbp, float(eps),
                                         REVERSED=reversed_experts, POW2=pow2, INF_VALUE=_inf_value(w.dtype),
                                         num_warps=WEIGHT_WARPS)
    return rows, row_s, cols, col_s


def padded_tokens(num_tokens: int, num_experts: int) -> int:
    """Columns of :func:`quantize_columns`' copy: room for every expert's tokens rounded up to 128,
    whatever the split (known on the host from the shapes alone): the rounded sizes sum to at most
    ``T + 127 E`` and to a multiple of 128; none without tokens."""
    if num_tokens == 0:
        return 0
    return (num_tokens + (BLOCK - 1) * num_experts) // BLOCK * BLOCK


def expert_offsets(split_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(off, poff)``, int32 (E + 1,) on the split sizes' device: each expert's first token, and
    its first column in :func:`quantize_columns`' padded copy (the exclusive sums of the sizes and
    of the sizes rounded up to 128). The kernels derive these themselves; this is for callers
    that slice the copy per expert (tests, references)."""
    sizes = split_sizes.reshape(-1).to(torch.int64)
    zero = sizes.new_zeros(1)
    off = torch.cat([zero, sizes.cumsum(0)])
    poff = torch.cat([zero, ((sizes + BLOCK - 1) // BLOCK * BLOCK).cumsum(0)])
    return off.to(torch.int32), poff.to(torch.int32)


def _column_args(x: torch.Tensor, split_sizes: torch.Tensor):
    """Checks; ``(T, K, E, Tp, roundup(K, 4), split sizes as the kernels read them)``."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be a 2-D bf16/fp16 (tokens, features) tensor, got {x.dtype} {tuple(x.shape)}")
    t, k = x.shape
    e = split_sizes.numel()
    if e == 0:
        raise ValueError("split_sizes must hold at least one expert")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got stride {tuple(x.stride())}")
    if split_sizes.dtype not in (torch.int32, torch.int64) or split_sizes.device != x.device:
        raise ValueError(f"split_sizes must be int32/int64 on {x.device}, got {split_sizes.dtype} on "
                         f"{split_sizes.device}")
    return t, k, e, padded_tokens(t, e), -(-k // 4) * 4, split_sizes.reshape(-1).contiguous()


def _grid_args(e: int, tp: int, k: int):
    return (tp // BLOCK, -(-k // BLOCK)), max(2, 1 << (e - 1).bit_length())  # E_P2 holds the E experts


def quantize_columns(x: torch.Tensor, split_sizes: torch.Tensor, eps: float, pow2: bool):
    """``(data, scales)`` of contiguous bf16/fp16 tokens ``x`` (T, K), experts' rows in
    ``split_sizes`` (E,) order, in 128-token x 1 blocks per expert: ``data`` (K, Tp) uint8 with
    expert ``e``'s tokens at columns ``poff[e]:poff[e] + T_e`` (zeros up to ``poff[e + 1]`` and
    past ``poff[E]``; ``poff`` as :func:`expert_offsets` gives it), ``scales`` (Tp / 128,
    roundup(K, 4)) fp32 (1 for padding blocks); Tp = :func:`padded_tokens`. Expert ``e``'s slices
    are the bytes of TE's ``Float8BlockQuantizer`` (1D) columnwise data and scales of
    ``x[off[e]:off[e + 1]]`` alone. One launch: the kernel finds each block's expert from the
    split sizes on the GPU."""
    t, k, e, tp, kp, sizes = _column_args(x, split_sizes)
    data = torch.empty((k, tp), dtype=torch.uint8, device=x.device)
    scales = torch.empty((tp // BLOCK, kp), dtype=torch.float32, device=x.device)
    if tp:
        grid, e_p2 = _grid_args(e, tp, k)
        quantize_columns_kernel[grid](x, sizes, data, scales, e, t, k, tp, kp, float(eps), E_P2=e_p2, POW2=pow2,
                                      INF_VALUE=_inf_value(x.dtype), num_warps=WEIGHT_WARPS)
    return data, scales


def quantize_both(x: torch.Tensor, split_sizes: torch.Tensor, eps: float, pow2: bool):
    """``(rows, row scales, columns, column scales)``: :func:`quantize`'s and
    :func:`quantize_columns`' outputs from one read of ``x`` (the same bytes)."""
    t, k, e, tp, kp, sizes = _column_args(x, split_sizes)
    rows = torch.empty((t, k), dtype=torch.uint8, device=x.device)
    row_scales = _scales(t, k, x.device)
    data = torch.empty((k, tp), dtype=torch.uint8, device=x.device)
    scales = torch.empty((tp // BLOCK, kp), dtype=torch.float32, device=x.device)
    if tp:
        grid, e_p2 = _grid_args(e, tp, k)
        quantize_both_kernel[grid](x, sizes, data, scales, rows, row_scales, e, t, k, tp, kp, row_scales.stride(0),
                                   float(eps), E_P2=e_p2, POW2=pow2, INF_VALUE=_inf_value(x.dtype),
                                   num_warps=WEIGHT_WARPS)
    return rows, row_scales, data, scales


def _scales(t: int, k: int, device) -> torch.Tensor:
    return torch.empty((-(-k // BLOCK), -(-t // 4) * 4), dtype=torch.float32, device=device)


def _inf_value(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max  # TE: the input type's largest finite value where the scale overflows


def srelu_quantize(z: torch.Tensor, probs: torch.Tensor, eps: float, pow2: bool):
    """``(act data, act scales, z data, z scales)`` from bf16/fp16 ``z`` (T, F) and ``probs`` (T,)."""
    t, f = z.shape
    act, zq = (torch.empty((t, f), dtype=torch.uint8, device=z.device) for _ in range(2))
    act_s, zq_s = _scales(t, f, z.device), _scales(t, f, z.device)
    if t:
        kern = srelu_quantize_kernel
        grid = (-(-t // ROWS), -(-f // BLOCK))
        kern[grid](z, probs, act, act_s, zq, zq_s, t, f, act_s.stride(0), float(eps), POW2=pow2,
                   INF_VALUE=_inf_value(z.dtype), ROWS=ROWS)
    return act, act_s, zq, zq_s


def dsrelu_quantize(dact: torch.Tensor, z_data: torch.Tensor, z_scales: torch.Tensor, probs: torch.Tensor,
                    eps: float, pow2: bool):
    """``(dz, dz data, dz scales, dprobs, act)``; ``dz`` is written over ``dact``, dprobs in fp32."""
    t, f = dact.shape
    act = torch.empty_like(dact)
    dzq = torch.empty((t, f), dtype=torch.uint8, device=dact.device)
    dzq_s = _scales(t, f, dact.device)
    dprobs = torch.empty(t, dtype=torch.float32, device=dact.device)
    if t:
        kern = dsrelu_quantize_kernel
        kern[(-(-t // ROWS),)](dact, z_data, z_scales, probs, act, dzq, dzq_s, dprobs, t, f, z_scales.stride(0),
                               float(eps), K_BLOCKS=-(-f // BLOCK), POW2=pow2, INF_VALUE=_inf_value(dact.dtype),
                               ROWS=ROWS)
    return dact, dzq, dzq_s, dprobs, act


def quantize(x: torch.Tensor, eps: float, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scales)`` of contiguous bf16/fp16 rows ``x`` (T, K) in 1x128 blocks."""
    t, k = x.shape
    data = torch.empty((t, k), dtype=torch.uint8, device=x.device)
    scales = _scales(t, k, x.device)
    if t:
        quantize_kernel[(-(-t // ROWS), -(-k // BLOCK))](x, data, scales, t, k, scales.stride(0), float(eps), POW2=pow2,
                                                         INF_VALUE=_inf_value(x.dtype), ROWS=ROWS)
    return data, scales


def dequantize(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t, k = data.shape
    out = torch.empty((t, k), dtype=dtype, device=data.device)
    if t:
        kern = dequantize_kernel
        kern[(-(-t // ROWS), -(-k // BLOCK))](data, scales, out, t, k, scales.stride(0), ROWS=ROWS)
    return out
