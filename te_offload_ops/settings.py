"""Settings read from the environment that more than one module shares the rules of."""

from __future__ import annotations

import os


def mib_from_env(name: str, default: int, zero_means: str) -> int:
    """``$name`` as a whole number of MiB >= 0 (``default`` when unset or empty); anything else
    raises ValueError naming the variable, what 0 means and the value given."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a whole number of MiB >= 0 (0: {zero_means}), got {raw!r}")
    return value


FP8_ROWS_ENV = "TEO_FP8_ROWS"
FP8_ROWS_CHOICES = ("gemm", "triton", "torch")


def fp8_rows() -> str:
    """Where the FP8 path's passes between its GEMMs run: ``gemm`` (default: SReLU and its backward
    with their quantization in the GEMMs' epilogues), ``triton`` (separate Triton row passes) or
    ``torch`` (torch ops and TE's quantizer)."""
    raw = os.environ.get(FP8_ROWS_ENV, "") or FP8_ROWS_CHOICES[0]
    if raw not in FP8_ROWS_CHOICES:
        raise ValueError(f"{FP8_ROWS_ENV} must be one of {', '.join(FP8_ROWS_CHOICES)}, got {raw!r}")
    return raw


FP8_WGRAD_ENV = "TEO_FP8_WGRAD"
FP8_WGRAD_CHOICES = ("bf16", "fp8")


def fp8_wgrad() -> str:
    """How the FP8 path computes its weight gradients: ``bf16`` (default: bf16 GEMMs on the saved
    FP8 operands dequantized) or ``fp8`` (FP8 GEMMs on per-expert columnwise copies, TE's 128x1
    blocks, as TE's recipe computes them)."""
    raw = os.environ.get(FP8_WGRAD_ENV, "") or FP8_WGRAD_CHOICES[0]
    if raw not in FP8_WGRAD_CHOICES:
        raise ValueError(f"{FP8_WGRAD_ENV} must be one of {', '.join(FP8_WGRAD_CHOICES)}, got {raw!r}")
    return raw
