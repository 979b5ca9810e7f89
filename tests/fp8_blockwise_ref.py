"""Pure-torch oracles for the grouped FP8 GEMM with Transformer Engine's block scaling.

* :func:`quantize_rows_1x128` / :func:`quantize_blocks_128x128`: ``Float8BlockQuantizer``'s
  rowwise output (power-of-two scales by default, as TE's recipe uses), in TE's GEMM layouts:
  1x128 scales transposed to ``(ceil(K/128), roundup(T, 4))``, 128x128 scales
  ``(ceil(N/128), roundup(ceil(K/128), 4))``. The padding entries are NaN here, so any use of
  them shows in a result.
* :func:`dequantize_rows_1x128` / :func:`dequantize_blocks_128x128`: back to real values.
* :func:`emulate_grouped_gemm_fp8`: what the kernel computes, in its order: per expert and
  128-K block, an fp32 partial sum of the FP8 products, then ``acc = fma(partial, sa * sb, acc)``
  in fp32 (the fused multiply-add emulated through fp64, one rounding), then one rounding to the
  output dtype. Only the tensor cores' own summation order inside a k-block differs.
* :func:`reference_grouped_gemm`: fp64 matmul of the dequantized operands per expert.
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3_MAX = 448.0


def _scales(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """Quantization scales from fp32 block maxima: FP8's largest value over amax, rounded down to
    a power of two where ``pow2``; 1 for an all-zero block."""
    scale = E4M3_MAX / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    if pow2:
        _, exp = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exp - 1)
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _pad_to(n: int, mult: int) -> int:
    return -(-n // mult) * mult


def quantize_rows_1x128(x: torch.Tensor, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, K) -> (e4m3 data (T, K), fp32 scale_inv (ceil(K/128), roundup(T, 4)))."""
    t, k = x.shape
    kb = -(-k // BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, kb * BLOCK - k)).view(t, kb, BLOCK)
    scale = _scales(xf.abs().amax(dim=2), pow2)  # (T, kb)
    data = _to_e4m3(xf * scale[:, :, None]).view(t, kb * BLOCK)[:, :k].contiguous()
    scale_inv = torch.full((kb, _pad_to(t, 4)), float("nan"), dtype=torch.float32, device=x.device)
    scale_inv[:, :t] = scale.reciprocal().t()
    return data, scale_inv


def quantize_blocks_128x128(w: torch.Tensor, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) -> (e4m3 data (N, K), fp32 scale_inv (ceil(N/128), roundup(ceil(K/128), 4)))."""
    n, k = w.shape
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    wf = torch.nn.functional.pad(w.float(), (0, kb * BLOCK - k, 0, nb * BLOCK - n))
    blocks = wf.view(nb, BLOCK, kb, BLOCK)
    scale = _scales(blocks.abs().amax(dim=(1, 3)), pow2)  # (nb, kb)
    data = _to_e4m3(blocks * scale[:, None, :, None]).view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous()
    scale_inv = torch.full((nb, _pad_to(kb, 4)), float("nan"), dtype=torch.float32, device=w.device)
    scale_inv[:, :kb] = scale.reciprocal()
    return data, scale_inv


def dequantize_rows_1x128(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    t, k = data.shape
    s = scale_inv[:, :t].t().repeat_interleave(BLOCK, dim=1)[:, :k]  # (T, K)
    return data.view(torch.float8_e4m3fn).float() * s


def dequantize_blocks_128x128(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    n, k = data.shape
    kb = -(-k // BLOCK)
    s = scale_inv[:, :kb].repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:n, :k]
    return data.view(torch.float8_e4m3fn).float() * s


def _offsets(split_sizes) -> list[int]:
    off = [0]
    for s in torch.as_tensor(split_sizes).tolist():
        off.append(off[-1] + int(s))
    return off


def emulate_grouped_gemm_fp8(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes, out_dtype=torch.bfloat16):
    """The kernel's arithmetic on (T, K) / (E, N, K) e4m3 data and TE-layout scales; ``b_scale_inv``
    (E, ceil(N/128), Kp). ``out_dtype=None`` returns the fp32 accumulator. Rows past
    sum(split_sizes) are NaN (the kernel leaves them unwritten)."""
    t, k = a_data.shape
    e, n, _ = b_data.shape
    kb = -(-k // BLOCK)
    a = a_data.view(torch.float8_e4m3fn).float()
    b = b_data.view(torch.float8_e4m3fn).float()
    out = torch.full((t, n), float("nan"), dtype=torch.float32, device=a.device)
    off = _offsets(split_sizes)
    col_block = torch.arange(n, device=a.device) // BLOCK
    for ex in range(e):
        r0, r1 = off[ex], off[ex + 1]
        if r1 == r0:
            continue
        acc = torch.zeros(r1 - r0, n, dtype=torch.float32, device=a.device)
        for j in range(kb):
            ks = slice(j * BLOCK, min((j + 1) * BLOCK, k))
            partial = a[r0:r1, ks] @ b[ex, :, ks].t()  # fp32 partial sum of one k-block
            s = a_scale_inv[j, r0:r1][:, None] * b_scale_inv[ex, col_block, j][None, :]  # fp32 product
            acc = (acc.double() + partial.double() * s.double()).float()  # fma: one rounding
        out[r0:r1] = acc
    return out if out_dtype is None else out.to(out_dtype)


def reference_grouped_gemm(a_real: torch.Tensor, b_real: torch.Tensor, split_sizes) -> torch.Tensor:
    """fp64 ``a_e @ b_e^T`` per expert of real-valued (dequantized) operands; rows past the splits NaN."""
    off = _offsets(split_sizes)
    out = torch.full((a_real.shape[0], b_real.shape[1]), float("nan"), dtype=torch.float64, device=a_real.device)
    for ex in range(b_real.shape[0]):
        r0, r1 = off[ex], off[ex + 1]
        if r1 > r0:
            out[r0:r1] = a_real[r0:r1].double() @ b_real[ex].double().t()
    return out


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| over all elements, in fp64."""
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))
