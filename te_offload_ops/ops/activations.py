"""The scaled activations TE uses between the two GroupedLinears of an MoE expert MLP."""

from __future__ import annotations

import torch
import transformer_engine.pytorch as te

from ._offloadable import OffloadableOp
from .input_checks import check_scales


class _ScaledActivation(OffloadableOp):
    """Shared input check of the scaled activations: one scale per token, on the input's device."""

    def check_inputs(self, input_, extra_inputs) -> None:
        if type(input_) is torch.Tensor:  # quantized inputs are TE's to check
            check_scales(type(self).__name__, extra_inputs[0], input_)


class ScaledSReLU(_ScaledActivation, te.ops.ScaledSReLU):
    """``te.ops.ScaledSReLU`` whose saved input and probs follow the offload policy."""


class ScaledTanhSReLU(_ScaledActivation, te.ops.ScaledTanhSReLU):
    """``te.ops.ScaledTanhSReLU`` whose saved input and probs follow the offload policy."""


class ScaledSwiGLU(_ScaledActivation, te.ops.ScaledSwiGLU):
    """``te.ops.ScaledSwiGLU`` whose saved input and probs follow the offload policy."""


class ScaledSiTUGLU(_ScaledActivation, te.ops.ScaledSiTUGLU):
    """``te.ops.ScaledSiTUGLU`` whose saved input and probs follow the offload policy."""


class ScaledClampedQGeGLU(_ScaledActivation, te.ops.ScaledClampedQGeGLU):
    """``te.ops.ScaledClampedQGeGLU`` whose saved input and probs follow the offload policy."""


SCALED_ACTIVATIONS = (ScaledSReLU, ScaledTanhSReLU, ScaledSwiGLU, ScaledSiTUGLU, ScaledClampedQGeGLU)
