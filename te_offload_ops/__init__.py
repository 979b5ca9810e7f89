"""te_offload_ops: Transformer Engine grouped-MLP ops under one CPU-offload policy.

Import torch before Transformer Engine: torch loads the NVIDIA libraries TE's core links to.
"""

import torch  # noqa: F401  (must precede transformer_engine)

from . import engines, fused, policy
from .ops import (
    GroupedLinear,
    OffloadableOp,
    ScaledClampedQGeGLU,
    ScaledSiTUGLU,
    ScaledSReLU,
    ScaledSwiGLU,
    ScaledTanhSReLU,
)

__version__ = "0.1.0"

__all__ = [
    "engines",
    "fused",
    "policy",
    "OffloadableOp",
    "GroupedLinear",
    "ScaledSReLU",
    "ScaledTanhSReLU",
    "ScaledSwiGLU",
    "ScaledSiTUGLU",
    "ScaledClampedQGeGLU",
]
