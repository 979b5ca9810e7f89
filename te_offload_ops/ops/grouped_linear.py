"""TE's GroupedLinear with the offload switch: its saved tensors follow the policy, weights never
move, and the layout TE 2.20 saves them in (split-path slices repacked into one buffer) is read
here; the split path is refused under CUDA-graph capture."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import transformer_engine.pytorch as te

from ..capture import refuse_split_path
from ..policy import is_storage
from ..te_internals import scales_bias, weight_tensors
from ._offloadable import OffloadableOp
from .input_checks import check_input, check_split_sizes

# TE 2.20's GroupedLinear saves [split_sizes, base_split_offsets, split_points,
# input_tensor_offsets, output_tensor_offsets, (scales if scale_bias), <input>, <weights>], where
# <input> is one GroupedTensorStorage (graph-safe path) or one slice per group (split path), and
# <weights> is one grouped weight or one weight per group.
_METADATA_SLOTS = 5


def _covering_buffer(slices: Sequence[torch.Tensor], candidates: Sequence[Any]) -> Optional[torch.Tensor]:
    """The contiguous 2-D tensor that ``slices`` tile row by row, in order, if there is one."""
    rows = sum(x.shape[0] for x in slices)
    for buf in candidates:
        if type(buf) is not torch.Tensor or buf.dim() != 2 or not buf.is_contiguous() or buf.shape[0] != rows:
            continue
        width, offset = buf.shape[1], buf.storage_offset()
        ptr = buf.untyped_storage().data_ptr()
        for x in slices:
            if (type(x) is not torch.Tensor or x.dtype != buf.dtype or x.shape[1:] != buf.shape[1:]
                    or x.untyped_storage().data_ptr() != ptr or x.storage_offset() != offset
                    or not x.is_contiguous()):
                break
            offset += x.shape[0] * width
        else:
            return buf
    return None


class GroupedLinear(OffloadableOp, te.ops.GroupedLinear):
    """``te.ops.GroupedLinear`` whose saved inputs follow the offload policy; weights stay resident.

    On TE's split path the input is saved as one slice per expert, all views of one buffer. An
    engine that skips small tensors (TE V2 skips < 256 Ki elements) keeps a small expert's slice
    on the GPU, and that view keeps the whole buffer alive, so nothing is saved. This op saves the
    buffer itself instead and cuts the slices again in backward.

    ``is_first_microbatch`` follows TE's and Megatron's convention for FP8 weights, on the fused
    Float8BlockScaling path: None (default) quantizes the weights in every forward; True at a
    step's first micro-batch quantizes and keeps them, and the later micro-batches (False) reuse
    them. Under Megatron-Core, ``TEOGroupedMLP`` hands over the flag Megatron sets each step.
    """

    is_first_microbatch: Optional[bool] = None

    def _layout(self) -> tuple[int, int]:
        """(metadata slots, weight slots) of TE's saved tuple."""
        return _METADATA_SLOTS + int(scales_bias(self)), 1 if self.single_grouped_weight else self.num_groups

    def saved_weights(self, saved: Sequence[Optional[Any]]) -> Sequence[Optional[Any]]:
        prefix, num_weights = self._layout()
        if len(saved) not in (prefix + 1 + num_weights, prefix + self.num_groups + num_weights):
            raise RuntimeError(
                f"{type(self).__name__}: TE saved {len(saved)} tensors, which matches no known "
                "GroupedLinear layout; this TE version is not supported by te_offload_ops"
            )
        weights = saved[-num_weights:]
        for w in weights:
            if not self._looks_like_weight(w):
                raise RuntimeError(
                    f"{type(self).__name__}: expected a weight at the end of TE's saved tensors, "
                    f"found {type(w).__name__} of shape {tuple(getattr(w, 'shape', ()))}"
                )
        return weights

    def _looks_like_weight(self, w: Any) -> bool:
        if w is None or isinstance(w, torch.nn.Parameter) or is_storage(w):
            return True
        return isinstance(w, torch.Tensor) and tuple(w.shape[-2:]) == (self.out_features, self.in_features)

    def repack_saved(self, ctx, saved: tuple, input_) -> tuple:
        prefix, num_weights = self._layout()
        if self.num_groups == 1 or len(saved) != prefix + self.num_groups + num_weights:
            return saved  # one input entry already (graph-safe path, or a single group)
        slices = saved[prefix : prefix + self.num_groups]
        if any(type(x) is not torch.Tensor for x in slices):
            # Quantized slices: split_quantize allocates them one by one under FP8 delayed and
            # current scaling (nothing shared to save instead), in one block under block scaling
            # and MXFP8/NVFP4, whose storages TE's engines take part by part as TE's ops do.
            return saved
        buf = _covering_buffer(slices, (input_, slices[0]._base))
        if buf is None:
            return saved
        ctx.teo_input_rows = [x.shape[0] for x in slices]
        return saved[:prefix] + (buf,) + saved[prefix + self.num_groups :]

    def check_inputs(self, input_, extra_inputs) -> None:
        refuse_split_path(self)  # before TE's split path syncs on split_sizes.tolist() in a capture
        device = weight_tensors(self)[0].device
        name = type(self).__name__
        if type(input_) is torch.Tensor:  # quantized inputs are TE's to check
            check_input(name, input_, self.in_features, device)
        check_split_sizes(name, extra_inputs[0], self.num_groups, device)

    def fuser_backward(self, basic_op_ctxs, grad_output, **kwargs):  # noqa: D102 (TE's signature)
        ctx = basic_op_ctxs[0]
        rows = getattr(ctx, "teo_input_rows", None)
        if rows is not None:
            prefix, _ = self._layout()
            saved = list(ctx.saved_tensors)
            # a list, as TE's fuser hands it over: TE keeps slices of it (its delayed-wgrad
            # store tells activation lists from grouped storages by type)
            ctx.saved_tensors = saved[:prefix] + list(torch.split(saved[prefix], rows)) + saved[prefix + 1 :]
            ctx.teo_input_rows = None
        return super().fuser_backward(basic_op_ctxs, grad_output, **kwargs)

    def _config_repr(self) -> list[str]:
        return [
            f"num_groups={self.num_groups}",
            f"in_features={self.in_features}",
            f"out_features={self.out_features}",
            f"bias={self.use_bias}",
        ]
