"""What teo does with one saved tensor: keep it, move a byte range of its storage, or move its parts.

Pure decisions (no copies), testable without a GPU. What may move is the policy's call
(``policy.keep_reason``: V2's rule on the marks); what can move as raw bytes is this module's:
V2's layout rules, and TE's quantized tensors taken apart as V2 takes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

from ... import policy, te_internals

__all__ = ["Keep", "Move", "Parts", "byte_span", "plan_saved"]


@dataclass(frozen=True)
class Keep:
    reason: str


@dataclass(frozen=True)
class Move:
    start: int  # first byte of the tensor's storage it needs
    nbytes: int


@dataclass
class Parts:
    """A QuantizedTensor taken apart as V2 does: a detached copy emptied by prepare_for_saving."""

    shell: Any
    tensors: list  # the parts, in prepare_for_saving order (None kept as None)
    plans: list


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one range of its storage without gaps or overlaps."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def byte_span(t: torch.Tensor) -> Optional[Move]:
    """The bytes of ``t``'s storage that hold its elements, if they form one range; else None."""
    if not _is_dense(t):
        return None
    itemsize = t.element_size()
    return Move(t.storage_offset() * itemsize, t.numel() * itemsize)


def plan_saved(t: torch.Tensor) -> Keep | Move | Parts:
    """What the engine does with saved tensor ``t`` of an offloaded layer: what TE V2 would move.

    Beyond the policy's marks (``policy.keep_reason``) that means V2's layout rules too: a
    non-contiguous tensor stays, unless TE asked for its base to move (``offload_base_tensor``,
    TE's interleaved q, k, v views), in which case the base's bytes move."""
    reason = policy.keep_reason(t)
    if reason is not None:
        return Keep(reason)
    if t.layout != torch.strided or t.is_conj() or t.is_neg():
        # raw bytes would lose what the layout or the lazy conj/neg bit says
        return Keep(f"layout {t.layout}, conj {t.is_conj()}, neg {t.is_neg()}: not plain strided bytes")
    if isinstance(t, QuantizedTensor):
        shell = t.detach()
        tensors, _ = shell.prepare_for_saving()
        return Parts(shell, list(tensors), [None if p is None else plan_saved(p) for p in tensors])
    if type(t) is not torch.Tensor:
        return Keep(f"a {type(t).__name__}, a tensor subclass this engine does not take apart")
    if te_internals.wants_base_offloaded(t) and t._base is not None:
        span = byte_span(t._base)
    elif not t.is_contiguous():
        return Keep(f"non-contiguous (shape {tuple(t.shape)}, stride {t.stride()}): TE V2 keeps these too")
    else:
        span = byte_span(t)
    if span is None:
        return Keep(f"its base has gaps (shape {tuple(t._base.shape)}, stride {t._base.stride()})")
    return span
