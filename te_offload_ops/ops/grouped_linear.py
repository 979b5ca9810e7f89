"""GroupedLinear with the offload switch."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import transformer_engine.pytorch as te

from ..policy import is_storage
from ._offloadable import OffloadableOp

# TE 2.20's GroupedLinear saves [split_sizes, base_split_offsets, split_points,
# input_tensor_offsets, output_tensor_offsets, (scales if scale_bias), <input>, <weights>], where
# <input> is one GroupedTensorStorage (graph-safe path) or one slice per group (split path), and
# <weights> is one grouped weight or one weight per group.
_METADATA_SLOTS = 5


class GroupedLinear(OffloadableOp, te.ops.GroupedLinear):
    """``te.ops.GroupedLinear`` whose saved inputs follow the offload policy; weights stay resident."""

    def saved_weights(self, saved: Sequence[Optional[Any]]) -> Sequence[Optional[Any]]:
        num_weights = 1 if self.single_grouped_weight else self.num_groups
        prefix = _METADATA_SLOTS + int(self._scale_bias)
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

    def _config_repr(self) -> list[str]:
        return [
            f"num_groups={self.num_groups}",
            f"in_features={self.in_features}",
            f"out_features={self.out_features}",
            f"bias={self.use_bias}",
        ]
