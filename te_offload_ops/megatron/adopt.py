"""Turn a TE op that someone else built into this package's op of the same kind, in place.

Megatron-Core builds the experts' ops itself, with arguments that depend on its config and its
version (meta device, its parameters registered on the op, main_grad accumulation, delayed
wgrad, GLU interleaving, clamps). Rather than re-deriving those arguments, the op it built
becomes ours: each of this package's ops is its TE op plus the ``offload`` flag, with no other
state, so switching the class and setting the flag equals constructing ours with the same
arguments (tests/test_megatron.py checks the instance state matches).
"""

from __future__ import annotations

import torch

from ..ops import SCALED_ACTIVATIONS, GroupedLinear

__all__ = ["adopt", "ours_for"]


def ours_for(te_op_type: type) -> type:
    """This package's op class extending exactly ``te_op_type``; TypeError if there is none."""
    for cls in (GroupedLinear, *SCALED_ACTIVATIONS):
        if cls.te_op is te_op_type:
            return cls
    raise TypeError(
        f"te_offload_ops has no op for {te_op_type.__module__}.{te_op_type.__qualname__}; it extends "
        f"{', '.join(cls.te_op.__name__ for cls in (GroupedLinear, *SCALED_ACTIVATIONS))} (exactly those classes)"
    )


def adopt(op: torch.nn.Module, *, offload: bool) -> torch.nn.Module:
    """Make ``op`` (an instance of a TE op class) this package's op, with ``offload``; returns it."""
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool, got {type(offload).__name__} {offload!r}")
    cls = ours_for(type(op))
    op.__class__ = cls
    op.offload = offload
    return op
