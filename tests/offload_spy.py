"""Test helpers: which op saved which tensor, and a Megatron-style offload engine that counts bytes.

``SaveRecorder`` wraps the policy's ``save_for_backward`` so each tensor an op of this package
hands to autograd is attributed to (op name, "weight" | "activation"). ``SpyEngine`` is a plain ``saved_tensors_hooks`` engine in
the manner of Megatron-Core's fine-grained offloading: it moves every saved CUDA tensor without
``_TE_do_not_offload`` to CPU during forward and back during backward, counting bytes per kind.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from te_offload_ops import policy
from te_offload_ops.policy import KEEP_ATTR, data_tensors, is_storage


def _saved_carriers(obj):
    # What reaches autograd for this entry: a tensor (subclass or not) goes whole, a plain
    # storage as its data tensors (TE's prepare_for_saving).
    if isinstance(obj, torch.Tensor):
        return (obj,)
    return data_tensors(obj) if is_storage(obj) else ()


@dataclass(frozen=True)
class Saved:
    """What an op handed to autograd, noted when it was saved (the recorder holds no tensor)."""

    op: str
    kind: str  # "weight" | "activation"
    data_ptr: int
    nbytes: int
    numel: int
    kept: bool  # carried _TE_do_not_offload once the policy had run


@dataclass
class SaveRecorder:
    """Attributes saved tensors to the op that saved them, by identity, without keeping them alive."""

    entries: list[Saved] = field(default_factory=list)
    _by_id: dict[int, tuple[weakref.ref, Saved]] = field(default_factory=dict)

    def kind_of(self, tensor: torch.Tensor) -> tuple[str, str]:
        ref, saved = self._by_id.get(id(tensor), (None, None))
        if ref is None or ref() is not tensor:  # an id reused by a later tensor
            return ("unknown", "unknown")
        return (saved.op, saved.kind)

    def _note(self, t: torch.Tensor, op: str, kind: str) -> None:
        saved = Saved(op, kind, t.data_ptr(), t.numel() * t.element_size(), t.numel(), bool(getattr(t, KEEP_ATTR, False)))
        self.entries.append(saved)
        self._by_id[id(t)] = (weakref.ref(t), saved)

    @contextlib.contextmanager
    def watch(self, named_ops: dict[str, torch.nn.Module]):
        """Record what each op in ``named_ops`` saves through the policy while the context is open.

        Every save of this package's ops, fused or not, goes through policy.save_for_backward.
        """
        names = {id(op): name for name, op in named_ops.items()}
        original = policy.save_for_backward

        def recording_save(ctx, *tensors, offload, weights=(), owner=None):
            original(ctx, *tensors, offload=offload, weights=weights, owner=owner)
            name = names.get(id(owner), "unnamed op")
            weight_ids = {id(w) for w in weights if w is not None}
            for obj in tensors:
                if obj is None:
                    continue
                is_weight = id(obj) in weight_ids or isinstance(obj, torch.nn.Parameter)
                for t in _saved_carriers(obj):
                    self._note(t, name, "weight" if is_weight else "activation")

        policy.save_for_backward = recording_save
        try:
            yield self
        finally:
            policy.save_for_backward = original


class SpyEngine:
    """Offloads every saved CUDA tensor that lacks ``_TE_do_not_offload``; counts bytes per kind."""

    def __init__(self, recorder: SaveRecorder):
        self.recorder = recorder
        self.bytes_moved: dict[tuple[str, str], int] = defaultdict(int)
        self.bytes_kept: dict[tuple[str, str], int] = defaultdict(int)

    def _pack(self, t: torch.Tensor):
        kind = self.recorder.kind_of(t)
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cuda" or getattr(t, KEEP_ATTR, False):
            self.bytes_kept[kind] += nbytes
            return ("kept", t)
        self.bytes_moved[kind] += nbytes
        return ("moved", t.device, t.to("cpu"), t.requires_grad)

    @staticmethod
    def _unpack(packed):
        if packed[0] == "kept":
            return packed[1]
        _, device, cpu, _ = packed
        return cpu.to(device)

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def moved(self, *, op: str | None = None, kind: str | None = None) -> int:
        return sum(
            n for (o, k), n in self.bytes_moved.items() if (op is None or o == op) and (kind is None or k == kind)
        )
