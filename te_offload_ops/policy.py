"""The offload policy: the one place that decides whether a saved tensor may leave the GPU.

Every op of this package saves for backward through :func:`save_for_backward`. Engines read the
marks it leaves on each tensor at the moment the op fuser hands the tensors to autograd:

* TE V2 (default) offloads every saved CUDA tensor of >= 256 Ki elements that is not an
  ``nn.Parameter`` and has no ``_TE_do_not_offload`` attribute.
* TE V1 (``NVTE_CPU_OFFLOAD_V1=1``) offloads only tensors carrying ``activation_offloading``.
* Megatron-style saved-tensor-hook engines offload what has no ``_TE_do_not_offload``.
* This package's "teo" engine (``engines.teo``) moves what :func:`keep_reason` allows: V2's rule.
  The policy says what *may* leave; an engine still keeps what it cannot carry as raw bytes, as
  TE V2 does: teo keeps tensors on another GPU than the first it moved from, non-contiguous or
  sparse ones, and subclasses other than TE's quantized tensors (``engines.teo.plan.plan_saved``).

So weights get ``mark_not_offload`` (never moved: they stay resident anyway and would only waste
PCIe), activations of an op with ``offload=False`` get ``mark_not_offload`` too, and the other
activations get ``mark_activation_offload`` plus ``start_offload``. A weight's mark is for good;
an activation's holds for the forward that set it: a tensor that outlives the step (the caller's
split sizes, an input reused) is offloaded again in a later forward where no op keeps it. A
forward ends where an op saves a second time (each op saves once a forward).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import torch
from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage
from transformer_engine.pytorch.tensor import GroupedTensorStorage

from . import capture, te_internals

__all__ = [
    "KEEP_ATTR",
    "V1_OFFLOAD_ATTR",
    "data_tensors",
    "is_storage",
    "keep_reason",
    "mark_saved_tensors",
    "engine_sees_saves",
    "save_for_backward",
]

# TE's marks on saved tensors (its protocol with its engines), named for the tests and diagnostics
KEEP_ATTR = te_internals.KEEP_MARK
V1_OFFLOAD_ATTR = te_internals.V1_MARKS[0]
# The forward an op's offload=False kept an activation in. Each op saves once a forward, so a
# forward ends where an op saves a second time in it; the mark is spent after that.
_KEPT_IN_ATTR = "_teo_kept_in"
_LAST_SAVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # op -> forward of its last save
_forward = 0
# TE V2 leaves smaller saved tensors where they are; every engine here follows its rule.
MIN_OFFLOAD_NUMEL = te_internals.V2_MIN_OFFLOAD_NUMEL
# The device whose saved tensors may move; a seam for CPU tests of engines, CUDA otherwise.
OFFLOAD_DEVICE_TYPE = "cuda"


def keep_reason(t: torch.Tensor) -> Optional[str]:
    """Why an engine that reads the marks as TE V2 does keeps saved tensor ``t`` where it is, or None.

    The same rule as V2's: a CUDA tensor of >= 256 Ki elements that is not an ``nn.Parameter``
    and has no ``_TE_do_not_offload`` may move. Layout (contiguity, views) is the engine's business.
    """
    if t.numel() < MIN_OFFLOAD_NUMEL:
        return f"fewer than {MIN_OFFLOAD_NUMEL} elements ({t.numel()})"
    if isinstance(t, torch.nn.Parameter):
        return "an nn.Parameter (a weight)"
    if te_internals.has_keep_mark(t):
        return f"marked {KEEP_ATTR} (a weight, or an op with offload=False)"
    if isinstance(t, torch._subclasses.FakeTensor):
        return "a fake tensor"
    if t.device.type != OFFLOAD_DEVICE_TYPE:
        return f"on {t.device.type}, not {OFFLOAD_DEVICE_TYPE}"
    return None


def is_storage(obj: Any) -> bool:
    """Whether ``obj`` is a TE storage whose bytes live in several data tensors."""
    return isinstance(obj, (QuantizedTensorStorage, GroupedTensorStorage))


def _saved_parts(storage: Any) -> tuple[torch.Tensor, ...]:
    # The tensors, in order, that prepare_for_saving() hands to autograd (scales and amaxes too);
    # restoring them at once leaves the storage as it was (TE's mark_not_offload does the same).
    tensors, _ = storage.prepare_for_saving()
    storage.restore_from_saved(tensors)
    return tuple(t for t in tensors if t is not None)


def data_tensors(obj: Any) -> tuple[torch.Tensor, ...]:
    """The plain tensors that carry ``obj``'s bytes: what an engine sees and may offload.

    TE storages answer ``get_data_tensors()``; a GroupedTensorStorage from a TE without it is
    answered from ``prepare_for_saving()``, which is what the fuser saves.
    """
    if obj is None:
        return ()
    if is_storage(obj):
        if hasattr(obj, "get_data_tensors"):
            found = obj.get_data_tensors()
        elif isinstance(obj, GroupedTensorStorage):
            found = _saved_parts(obj)
        else:
            raise TypeError(f"{type(obj).__name__} has no get_data_tensors()")
        return tuple(t for t in found if t is not None)
    if isinstance(obj, torch.Tensor):
        return (obj,)
    raise TypeError(f"expected a tensor or a TE tensor storage, got {type(obj).__name__}")


def _mark_carriers(obj: Any) -> tuple[torch.Tensor, ...]:
    # Where engines look for marks: a tensor subclass (Float8Tensor, GroupedTensor) reaches
    # autograd whole and V2/Megatron hooks read the wrapper; plain storages reach it as every
    # tensor their prepare_for_saving() gives (data, scales: what hook engines see), and V1 and
    # V2's decomposition of quantized tensors look at their data tensors.
    if not is_storage(obj):
        return data_tensors(obj)
    if isinstance(obj, torch.Tensor):
        return (obj,) + data_tensors(obj)
    found = {id(t): t for t in data_tensors(obj) + _saved_parts(obj)}
    return tuple(found.values())


def _is_weight(obj: Any, weight_ids: set[int]) -> bool:
    # A Parameter is a weight whichever list it came in.
    return id(obj) in weight_ids or isinstance(obj, torch.nn.Parameter)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exactly these types: no storage, no subclass


def _keep_resident(obj: Any, owner: Any = None) -> None:
    """``owner``: the op whose offload=False keeps this activation (None: a weight, kept for good)."""
    carriers = _mark_carriers(obj)
    if owner is not None:
        for t in carriers:
            setattr(t, _KEPT_IN_ATTR, _forward)
    elif type(obj) in _PLAIN and te_internals.has_keep_mark(obj) and not te_internals.has_v1_marks(obj):
        _mark_for_good(carriers)
        return  # marked by an earlier step (a weight is saved every step): nothing would change
    else:
        _mark_for_good(carriers)
    te_internals.mark_not_offload(obj)
    for t in carriers:
        te_internals.set_keep_mark(t)
        # mark_not_offload cannot undo a V1 mark set earlier (TE's own ops mark their inputs
        # when offload is enabled), and V1 offloads whatever carries it: take it off.
        te_internals.clear_v1_marks(t)


def _mark_for_good(carriers) -> None:
    for t in carriers:
        if hasattr(t, _KEPT_IN_ATTR):
            delattr(t, _KEPT_IN_ATTR)


def _kept_now(t: torch.Tensor) -> bool:
    """Whether ``t``'s keep mark holds: for good, or set in this forward."""
    if not te_internals.has_keep_mark(t):
        return False
    kept_in = getattr(t, _KEPT_IN_ATTR, None)
    if kept_in is None or kept_in == _forward:
        return True
    te_internals.clear_keep_mark(t)  # kept by an op in an earlier forward: the mark is spent
    delattr(t, _KEPT_IN_ATTR)
    return False


def _offload(obj: Any) -> None:
    # A tensor another op asked to keep during this forward stays kept: keeping is always safe.
    # Storages can share a data tensor with another op's storage (grouped storages of one MLP
    # share their split sizes): the kept part stays kept, the rest is still offloaded.
    carriers = _mark_carriers(obj)
    kept = [t for t in carriers if _kept_now(t)]
    if len(kept) == len(carriers):
        return
    if capture.capturing():  # pinned buffers must exist before a graph copies into them
        capture.check_offload_layer_ready()
    te_internals.mark_activation_offload(obj)
    for t in kept:
        te_internals.clear_v1_marks(t)
    if te_internals.is_cpu_offload_enabled():
        te_internals.start_offload(obj)


def mark_saved_tensors(
    tensors: Iterable[Optional[Any]],
    *,
    offload: bool,
    weights: Iterable[Optional[Any]] = (),
    owner: Optional[Any] = None,
) -> None:
    """Mark each saved tensor for the offload engines.

    ``weights`` are the entries of ``tensors`` that are weights (parameters, weight workspaces,
    quantized or grouped weight storages), matched by identity; any ``nn.Parameter`` counts as a
    weight too. Everything else is an activation of the op; ``offload`` is the op's flag.
    ``owner``: the op saving (its keep marks on activations then last for this forward); without
    one, a keep mark lasts for good.
    """
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool, got {type(offload).__name__}")
    weight_ids = {id(w) for w in weights if w is not None}
    for obj in tensors:
        if obj is None:
            continue
        if _is_weight(obj, weight_ids):
            _keep_resident(obj)
        elif not offload:
            _keep_resident(obj, owner)
        else:
            _offload(obj)


def save_for_backward(
    ctx: Any,
    *tensors: Optional[Any],
    offload: bool,
    weights: Sequence[Optional[Any]] = (),
    owner: Optional[Any] = None,
) -> None:
    """Mark ``tensors`` by the policy, then save them on ``ctx`` (an OperationContext).

    ``owner`` is the op whose tensors these are: a keep mark it leaves on an activation lasts for
    this forward (one save of each op).
    """
    if not isinstance(offload, bool):
        raise TypeError(f"offload must be a bool, got {type(offload).__name__}")
    if capture.capturing():
        capture.check_offload_engine()
    if owner is not None:
        global _forward
        if _LAST_SAVE.get(owner) == _forward:  # its second save in this forward: a new one began
            _forward += 1
        _LAST_SAVE[owner] = _forward
    if engine_sees_saves():
        mark_saved_tensors(tensors, offload=offload, weights=weights, owner=owner)
    ctx.save_for_backward(*tensors)


def engine_sees_saves() -> bool:
    """Whether an offload engine sees the tensors saved now: TE's V1/V2 (their context is on) or a
    saved-tensor-hooks engine (teo, Megatron's fine-grained offloading, activation checkpointing).

    Engines read the marks when a tensor is saved, so where none is on the marks would go unread:
    the ops skip them and their host time (under FP8, a dozen quantized storages per op and call).
    """
    if te_internals.is_cpu_offload_enabled():
        return True
    return _saved_tensors_hooks_on()


def _saved_tensors_hooks_on() -> bool:
    # torch keeps the stack of torch.autograd.graph.saved_tensors_hooks in C++ and exposes its top
    # privately; where that call is missing or changed, assume a hook may be on (mark every save).
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks
    except AttributeError:
        return True
    try:
        return top(False) is not None
    except TypeError:
        try:
            return top() is not None
        except Exception:  # noqa: BLE001 (an unknown signature: mark, as where the hook is missing)
            return True
