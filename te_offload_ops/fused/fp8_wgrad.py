"""FP8 weight gradients of the fused MLP under ``Float8BlockScaling`` (``TEO_FP8_WGRAD=fp8``).

TE's recipe computes ``dW_e = dy_e^T x_e`` in FP8 from columnwise copies: each operand quantized
in 128-token x 1 blocks, per expert. Here those copies are made by
:func:`..kernels.fp8_rows.quantize_columns` (each expert's tokens padded to 128, so a block never
holds two experts' tokens; x's and dy's together with their rows, from one read:
:func:`..kernels.fp8_rows.quantize_both`) and multiplied by the grouped FP8 weight-gradient kernel
(:mod:`..kernels.api_fp8_wgrad`), into the output dtype or straight into fp32 ``main_grad``.
Roles as TE quantizes them: x and act as inputs, dy and dz as gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import settings


@dataclass
class Cols:
    """A (T, K) token matrix in FP8, columnwise per expert: ``data`` (K, Tp) uint8, ``scale_inv``
    (Tp / 128, roundup(K, 4)) fp32, ``num_tokens`` T."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    num_tokens: int


def wanted(t: torch.Tensor) -> bool:
    """Whether this backward's wgrads run in FP8: asked for, on a GPU, with Triton for the copies."""
    if settings.fp8_wgrad() != "fp8" or not t.is_cuda or settings.fp8_rows() == "torch":
        return False
    from ..kernels import fp8_rows

    return fp8_rows.unavailable() is None


def column_bytes(tokens: int, features: int, experts: int) -> int:
    """Bytes of a (tokens, features) matrix's columnwise copy: data and scales (for make_room)."""
    from ..kernels.fp8_rows import padded_tokens

    padded = padded_tokens(tokens, experts)
    return features * padded + padded // 128 * (-(-features // 4) * 4) * 4


def columns(eps: float, pow2: bool, t: torch.Tensor, split_sizes: torch.Tensor) -> Cols:
    from ..kernels import fp8_rows

    data, scales = fp8_rows.quantize_columns(t.contiguous(), split_sizes, eps, pow2)
    return Cols(data, scales, t.shape[0])


def wgrad(dy: Cols, x: Cols, split_sizes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """(E, out, in) in ``out_dtype``."""
    from ..kernels.api_fp8_wgrad import grouped_wgrad_fp8_blockwise

    return grouped_wgrad_fp8_blockwise(dy.data, dy.scale_inv, x.data, x.scale_inv, split_sizes, dy.num_tokens,
                                       out_dtype=out_dtype)


def wgrad_main_grad(dy: Cols, x: Cols, split_sizes: torch.Tensor, main_grads, accumulate: bool) -> None:
    from ..kernels.api_fp8_wgrad import grouped_wgrad_fp8_main_grad

    grouped_wgrad_fp8_main_grad(dy.data, dy.scale_inv, x.data, x.scale_inv, split_sizes, dy.num_tokens, main_grads,
                                accumulate=accumulate)
