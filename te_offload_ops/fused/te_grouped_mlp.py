"""Blackwell: TE's own fused grouped MLP (MXFP8/NVFP4 on sm_100), saving through the offload policy.

TE 2.20 fuses GroupedLinear, a scaled activation and GroupedLinear into one op
(``transformer_engine/pytorch/ops/fused/grouped_mlp.py``): ``GroupedMLP_CuTeGEMMUnary`` for SReLU
and tanh-SReLU, ``GroupedMLP_CuTeGEMMGLU`` for SwiGLU, SiTU-GLU and clamped QGeGLU, when its
own checks pass (sm_100, an MXFP8 or NVFP4 recipe, ``NVTE_CUTEDSL_FUSED_GROUPED_MLP=1``, the cuDNN
frontend's kernels, dims). Its forward saves everything on fc1's context, marks the activations
for offload whenever offload is on, whatever each op's ``offload`` says, and leaves its
quantized weight workspaces (new tensors every step, not Parameters) to the engines.

:func:`fuse_te_grouped_mlp` runs before TE's fusion. Where TE's would fuse three ops of this
package, it builds a subclass of TE's fused op instead. TE's forward runs unchanged; what it
saved is then checked against TE 2.20's layout and saved again through
:func:`te_offload_ops.policy.save_for_backward`, each tensor under the flag of the op that owns it:

================================================  ==========================================
TE's saved tensor                                 owner
================================================  ==========================================
split sizes, base offsets, split points           fc1 and fc2: kept if either keeps (both
                                                  layers read them, as when unfused)
fc1 input/output offsets, fc1 input (grouped)     fc1
fc1 weights (quantized workspaces or params)      fc1, always kept
activation input (fc1 output), probs              the activation
fc2 input/output offsets, fc2 input (grouped)     fc2
fc2 weights                                       fc2, always kept
================================================  ==========================================

Backward puts the tensors back in TE's order and runs TE's backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from transformer_engine.pytorch.ops.fused import grouped_mlp as te_grouped_mlp
from transformer_engine.pytorch.tensor import GroupedTensorStorage

from .. import policy
from ..ops import SCALED_ACTIVATIONS, GroupedLinear
from ..policy import is_storage

__all__ = [
    "PolicyGroupedMLPGLU",
    "PolicyGroupedMLPUnary",
    "TESavedLayout",
    "fuse_te_grouped_mlp",
    "policy_fused_op",
    "te_fusion_blockers",
]

# TE 2.20 saves, on fc1's context:
#   [split_sizes, base_split_offsets, split_points, fc1_x_offsets, fc1_out_offsets, fc2_x_offsets,
#    fc2_out_offsets, fc1_x, *fc1_weights, activation_in, scales, fc2_x, *fc2_weights]
_METADATA_SLOTS = 7
_SHARED_METADATA = 3  # split sizes, base offsets, split points: read by both layers
_FC1_METADATA_END = 5  # then fc1's two offsets; fc2's two follow
_UNSUPPORTED = "this TE version is not supported by te_offload_ops"


def _num_weights(fc: Any) -> int:
    return 1 if fc.single_grouped_weight else fc.num_groups


@dataclass(frozen=True)
class TESavedLayout:
    """What TE's fused grouped MLP saved, slot by slot, as TE 2.20 lays it out."""

    shared_metadata: tuple
    fc1_metadata: tuple
    fc2_metadata: tuple
    fc1_input: Any
    fc1_weights: tuple
    activation_input: torch.Tensor
    scales: Optional[torch.Tensor]
    fc2_input: Any
    fc2_weights: tuple

    @classmethod
    def parse(cls, saved: Sequence[Any], fc1: Any, fc2: Any) -> "TESavedLayout":
        """Split ``saved`` into its slots, checking each; raises on a layout TE 2.20 does not write."""
        name = "TE's fused grouped MLP"
        n1, n2 = _num_weights(fc1), _num_weights(fc2)
        expected = _METADATA_SLOTS + 1 + n1 + 2 + 1 + n2
        if len(saved) != expected:
            raise RuntimeError(
                f"{name} saved {len(saved)} tensors; TE 2.20's layout has {expected} for "
                f"{n1} fc1 and {n2} fc2 weights: {_UNSUPPORTED}"
            )
        metadata, rest = tuple(saved[:_METADATA_SLOTS]), saved[_METADATA_SLOTS:]
        fc1_input, fc1_weights, rest = rest[0], tuple(rest[1 : 1 + n1]), rest[1 + n1 :]
        activation_input, scales, fc2_input, fc2_weights = rest[0], rest[1], rest[2], tuple(rest[3:])

        def fail(slot: str, found: Any) -> RuntimeError:
            shape = tuple(getattr(found, "shape", None) or getattr(found, "logical_shape", ()))
            return RuntimeError(f"{name}: expected {slot}, found {type(found).__name__} of shape {shape}: "
                                f"{_UNSUPPORTED}")

        for i, t in enumerate(metadata):
            if t is not None and (type(t) is not torch.Tensor or t.is_floating_point() or t.dim() > 1):
                raise fail(f"split metadata (an integer vector) in slot {i}", t)
        if not _is_grouped_input(fc1_input, fc1):
            raise fail(f"fc1's input as a grouped storage (tokens, {fc1.in_features})", fc1_input)
        for fc_name, fc, weights in (("fc1", fc1, fc1_weights), ("fc2", fc2, fc2_weights)):
            for w in weights:
                if not _is_weight(w, fc):
                    raise fail(f"a {fc_name} weight ({fc.out_features}, {fc.in_features})", w)
        if (type(activation_input) is not torch.Tensor or activation_input.dim() != 2
                or activation_input.shape[-1] != fc1.out_features):
            raise fail(f"the activation input (tokens, {fc1.out_features})", activation_input)
        if scales is not None and not (isinstance(scales, torch.Tensor) and scales.is_floating_point()):
            raise fail("the activation's probs", scales)
        if fc2_input is not None and not _is_grouped_input(fc2_input, fc2):
            raise fail(f"fc2's input as a grouped storage (tokens, {fc2.in_features}) or None", fc2_input)
        return cls(
            shared_metadata=metadata[:_SHARED_METADATA],
            fc1_metadata=metadata[_SHARED_METADATA:_FC1_METADATA_END],
            fc2_metadata=metadata[_FC1_METADATA_END:],
            fc1_input=fc1_input,
            fc1_weights=fc1_weights,
            activation_input=activation_input,
            scales=scales,
            fc2_input=fc2_input,
            fc2_weights=fc2_weights,
        )

    def fc1_part(self) -> tuple:
        return (*self.shared_metadata, *self.fc1_metadata, self.fc1_input, *self.fc1_weights)

    def activation_part(self) -> tuple:
        return (self.activation_input, self.scales)

    def fc2_part(self) -> tuple:
        return (*self.fc2_metadata, self.fc2_input, *self.fc2_weights)

    @staticmethod
    def te_order(fc1_part: Sequence[Any], activation_part: Sequence[Any], fc2_part: Sequence[Any]) -> tuple:
        """The three parts (as restored in backward) back in TE's order."""
        k, n = _FC1_METADATA_END, _METADATA_SLOTS - _FC1_METADATA_END
        return (*fc1_part[:k], *fc2_part[:n], *fc1_part[k:], *activation_part, *fc2_part[n:])


def _is_grouped_input(x: Any, fc: Any) -> bool:
    # An activation's grouped storage has one row range per expert (first_dims), a grouped weight none.
    return (isinstance(x, GroupedTensorStorage) and x.first_dims is not None
            and tuple(x.logical_shape)[-1] == fc.in_features)


def _is_weight(w: Any, fc: Any) -> bool:
    if isinstance(w, torch.nn.Parameter):
        return True  # TE saves the parameters themselves for distributed weights
    if isinstance(w, GroupedTensorStorage):  # a single grouped weight, quantized or not
        return w.first_dims is None and tuple(w.logical_shape) == (fc.num_groups * fc.out_features, fc.in_features)
    if is_storage(w) or isinstance(w, torch.Tensor):  # one expert's quantized workspace or weight
        return tuple(w.shape[-2:]) == (fc.out_features, fc.in_features)
    return False


class _SavesThroughPolicy:
    """Mixin over TE's fused grouped MLP: its forward, then its saved tensors re-saved per owner."""

    te_fused_op: type  # the TE class this one extends

    @classmethod
    def is_supported(cls) -> bool:
        # TE's answer, cached when TE registered its fusion: ours fuses exactly where TE's would.
        return cls.te_fused_op.is_supported()

    def fuser_forward(self, basic_op_ctxs, input_, **kwargs):  # noqa: D102 (TE's signature)
        out = super().fuser_forward(basic_op_ctxs, input_, **kwargs)
        fc1_ctx, act_ctx, fc2_ctx = basic_op_ctxs
        if fc1_ctx.to_save is not None:
            fc1, act, fc2 = self.basic_ops
            saved = TESavedLayout.parse(tuple(fc1_ctx.to_save), fc1, fc2)
            # fc2 keeps the shared metadata first when it opts out; fc1's own marks then leave it kept.
            policy.mark_saved_tensors(saved.shared_metadata, offload=fc2.offload)
            policy.save_for_backward(fc1_ctx, *saved.fc1_part(), offload=fc1.offload,
                                     weights=saved.fc1_weights, owner=fc1)
            policy.save_for_backward(act_ctx, *saved.activation_part(), offload=act.offload, owner=act)
            policy.save_for_backward(fc2_ctx, *saved.fc2_part(), offload=fc2.offload,
                                     weights=saved.fc2_weights, owner=fc2)
            fc1_ctx.teo_split_saved = True
        return out

    def fuser_backward(self, basic_op_ctxs, grad_output, **kwargs):  # noqa: D102 (TE's signature)
        fc1_ctx, act_ctx, fc2_ctx = basic_op_ctxs
        if getattr(fc1_ctx, "teo_split_saved", False):
            fc1_ctx.saved_tensors = TESavedLayout.te_order(fc1_ctx.saved_tensors, act_ctx.saved_tensors,
                                                           fc2_ctx.saved_tensors)
            fc1_ctx.teo_split_saved = False
        return super().fuser_backward(basic_op_ctxs, grad_output, **kwargs)


class PolicyGroupedMLPUnary(_SavesThroughPolicy, te_grouped_mlp.GroupedMLP_CuTeGEMMUnary):
    """TE's fused GroupedLinear + SReLU / tanh-SReLU + GroupedLinear, saving through the policy."""

    te_fused_op = te_grouped_mlp.GroupedMLP_CuTeGEMMUnary


class PolicyGroupedMLPGLU(_SavesThroughPolicy, te_grouped_mlp.GroupedMLP_CuTeGEMMGLU):
    """TE's fused GroupedLinear + scaled GLU + GroupedLinear, saving through the policy."""

    te_fused_op = te_grouped_mlp.GroupedMLP_CuTeGEMMGLU


# (TE's fusion function, the class it builds, ours), in the order TE registers them.
_TE_FUSIONS = (
    (te_grouped_mlp.fuse_glu_ops, te_grouped_mlp.GroupedMLP_CuTeGEMMGLU, PolicyGroupedMLPGLU),
    (te_grouped_mlp.fuse_unary_activation_ops, te_grouped_mlp.GroupedMLP_CuTeGEMMUnary, PolicyGroupedMLPUnary),
)


def _all_ours(window: Sequence[Any]) -> bool:
    return (len(window) == 3 and isinstance(window[0], GroupedLinear)
            and isinstance(window[1], SCALED_ACTIVATIONS) and isinstance(window[2], GroupedLinear))


def policy_fused_op(window: Sequence[Any], *, recipe: Any = None):
    """The policy-aware fused op for three ops of this package if TE's fusion would fuse them, else None.

    TE decides: its own fusion function runs on the window, and its choice is rebuilt as ours.
    """
    if not _all_ours(window):
        return None
    for te_fusion, te_cls, ours in _TE_FUSIONS:
        if not te_cls.is_supported():  # TE registered te_fusion only if this held
            continue
        fused = te_fusion(list(window), recipe=recipe)
        if len(fused) == 1 and type(fused[0]) is te_cls:
            return ours(fc1=window[0], activation=window[1], fc2=window[2])
    return None


def fuse_te_grouped_mlp(ops: list, *, recipe: Any = None, **unused: Any) -> list:
    """TE fusion function: each run of three ops of this package that TE would fuse, fused our way."""
    del unused
    out, i = [], 0
    while i < len(ops):
        fused = policy_fused_op(ops[i : i + 3], recipe=recipe)
        if fused is not None:
            out.append(fused)
            i += 3
        else:
            out.append(ops[i])
            i += 1
    return out


def te_fusion_blockers(window: Sequence[Any], *, recipe: Any = None) -> list[str]:
    """Why TE's Blackwell fusion does not take ``window`` (for explain_fusion); [] if it does."""
    if not _all_ours(window):
        return []  # nothing to explain here: the ops are not all this package's
    if policy_fused_op(window, recipe=recipe) is not None:
        return []
    prefix = "TE's fused grouped MLP (Blackwell)"
    if not any(te_cls.is_supported() for _, te_cls, _ in _TE_FUSIONS):
        return [f"{prefix} is not available here: it needs an sm_100 GPU, NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 "
                "and the cuDNN frontend's sm100 grouped GEMM kernels"]
    if recipe is None or not (recipe.mxfp8() or recipe.nvfp4()):
        return [f"{prefix} needs an MXFP8 or NVFP4 recipe, got {type(recipe).__name__ if recipe else 'none'}"]
    return [f"{prefix} declines these ops (TE's checks: activation type, dims multiple of 64, GLU "
            "interleave 32, recipe details)"]
