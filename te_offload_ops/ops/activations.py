"""The scaled activations TE uses between the two GroupedLinears of an MoE expert MLP."""

from __future__ import annotations

import transformer_engine.pytorch as te

from ._offloadable import OffloadableOp


class ScaledSReLU(OffloadableOp, te.ops.ScaledSReLU):
    """``te.ops.ScaledSReLU`` whose saved input and probs follow the offload policy."""


class ScaledTanhSReLU(OffloadableOp, te.ops.ScaledTanhSReLU):
    """``te.ops.ScaledTanhSReLU`` whose saved input and probs follow the offload policy."""


class ScaledSwiGLU(OffloadableOp, te.ops.ScaledSwiGLU):
    """``te.ops.ScaledSwiGLU`` whose saved input and probs follow the offload policy."""


class ScaledSiTUGLU(OffloadableOp, te.ops.ScaledSiTUGLU):
    """``te.ops.ScaledSiTUGLU`` whose saved input and probs follow the offload policy."""


class ScaledClampedQGeGLU(OffloadableOp, te.ops.ScaledClampedQGeGLU):
    """``te.ops.ScaledClampedQGeGLU`` whose saved input and probs follow the offload policy."""


SCALED_ACTIVATIONS = (ScaledSReLU, ScaledTanhSReLU, ScaledSwiGLU, ScaledSiTUGLU, ScaledClampedQGeGLU)
