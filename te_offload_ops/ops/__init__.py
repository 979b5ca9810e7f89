"""Drop-in ``te.ops`` basic ops with an ``offload`` switch."""

from ._offloadable import OffloadableOp
from .activations import (
    SCALED_ACTIVATIONS,
    ScaledClampedQGeGLU,
    ScaledSiTUGLU,
    ScaledSReLU,
    ScaledSwiGLU,
    ScaledTanhSReLU,
)
from .grouped_linear import GroupedLinear

__all__ = [
    "OffloadableOp",
    "GroupedLinear",
    "ScaledSReLU",
    "ScaledTanhSReLU",
    "ScaledSwiGLU",
    "ScaledSiTUGLU",
    "ScaledClampedQGeGLU",
    "SCALED_ACTIVATIONS",
]
