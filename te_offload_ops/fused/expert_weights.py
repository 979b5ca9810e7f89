"""A GroupedLinear's expert weights as the fused kernels take them, whichever way TE stores them.

TE keeps one Parameter per expert (``weight0 .. weight{E-1}``) or, with
``single_grouped_weight=True``, one ``GroupedTensor`` Parameter ``weight`` whose ``rowwise_data``
holds all experts back to back. The kernels want one (E, out, in) tensor.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

from ..te_internals import registered_parameters

_log = logging.getLogger(__name__)
_STACKED_NOTED: set = set()  # ops whose weights were said to be stacked (once each)
# op -> (weak references to its weights, their addresses, the layout _find_layout found for them):
# the layout checks walk every expert (~0.4 ms a call at E=64), the step calls it four times. No
# tensor is kept: weights moved off the GPU (model.cpu()) or replaced must not stay alive here.
_LAYOUTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=64)
def _weight_names(num_groups: int) -> tuple[str, ...]:
    return tuple(f"weight{i}" for i in range(num_groups))


def weight_params(op) -> list[torch.Tensor]:
    """The op's weight Parameters in registration order (one when single_grouped_weight)."""
    if op.single_grouped_weight:
        return [op.weight]
    names = _weight_names(op.num_groups)
    registered = registered_parameters(op)  # no Module.__getattr__ per expert
    if all(n in registered for n in names):
        return [registered[n] for n in names]
    return [getattr(op, n) for n in names]


def weight_versions(params) -> tuple[int, ...]:
    """The version counters of ``params`` (every in-place write bumps its tensor's)."""
    return tuple(p._version for p in params)


def check_weight_versions(op, versions: tuple[int, ...], name: str) -> None:
    """Raise, as autograd does for a saved tensor written in place, where one of ``op``'s weights
    was written since the forward that recorded ``versions`` (``name``: the op, for the message)."""
    now = weight_versions(weight_params(op))
    if now != versions:
        i = next(j for j, (a, b) in enumerate(zip(now, versions)) if a != b) if len(now) == len(versions) else 0
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"{name}'s weight {i} is at version {now[i] if now else None}; expected version "
            f"{versions[i] if versions else None} instead. The fused MLP's backward reads the weights as they "
            "are now: a weight written between its forward and its backward would give wrong gradients")


def weight_dtype(op) -> torch.dtype:
    return weight_params(op)[0].dtype


def _grouped_data(w: torch.Tensor) -> torch.Tensor:
    # A GroupedTensor keeps its bytes in rowwise_data; a plain (E, out, in) tensor is its own data.
    data = getattr(w, "rowwise_data", None)
    return w.detach() if data is None else data


def expert_weights(op) -> tuple[torch.Tensor, bool]:
    """The experts' weights as the kernels read them, without a copy where their layout allows:
    ``(w, reversed)`` with ``w`` an (E, out, in) tensor, each expert's matrix contiguous and the
    experts a fixed number of elements apart in one storage; ``reversed``: ``w[j]`` is expert
    ``E - 1 - j`` (Megatron's DDP buffer lays a module's parameters out last first). TE's own
    packed buffer, one grouped weight, and such buffers with padding between parameters are read
    in place; anything else (separately allocated weights) is stacked into a new tensor."""
    E, n, k = op.num_groups, op.out_features, op.in_features
    if op.single_grouped_weight:
        return _grouped_data(op.weight).view(E, n, k), False
    params = weight_params(op)
    ptrs = tuple(w.data_ptr() for w in params)
    hit = _LAYOUTS.get(op)
    if hit is not None and hit[1] == ptrs and all(r() is p for r, p in zip(hit[0], params)):
        layout = hit[2]  # the same Parameters at the same addresses: the same layout
    else:
        layout = _find_layout(params, E, n, k)
        if layout is None:
            _LAYOUTS.pop(op, None)
        else:
            _LAYOUTS[op] = (tuple(weakref.ref(p) for p in params), ptrs, layout)
    if layout is not None:
        first, stride, reversed_order = layout
        return params[first].detach().as_strided((E, n, k), (stride, k, 1)), reversed_order
    ws = [w.detach() for w in params]
    if E == 1:
        return ws[0].view(1, n, k), False
    if id(op) not in _STACKED_NOTED:
        _STACKED_NOTED.add(id(op))
        _log.info("%s: its %d expert weights are not evenly spaced in one storage; each fused GEMM stacks "
                  "them into a copy (%d MB)", type(op).__name__, E, E * n * k * ws[0].element_size() >> 20)
    return torch.stack(ws), False


def _find_layout(params, E: int, n: int, k: int) -> tuple[int, int, bool] | None:
    """``(index of the lowest-addressed weight, elements from one expert to the next, reversed)``
    where the experts' weights can be read in place as one strided tensor, else None."""
    ws = [w.detach() for w in params]
    w0 = ws[0]
    size = w0.element_size()
    storage = w0.untyped_storage()
    same = all(w.is_contiguous() and w.dtype == w0.dtype and w.untyped_storage().data_ptr() == storage.data_ptr()
               for w in ws)
    if same and E > 1:
        step = ws[1].data_ptr() - w0.data_ptr()  # bytes from one expert to the next, either sign
        evenly = step != 0 and abs(step) % size == 0 and all(
            w.data_ptr() == w0.data_ptr() + i * step for i, w in enumerate(ws))
        if evenly and abs(step) >= n * k * size:
            first_index = 0 if step > 0 else E - 1  # the lowest address
            first = ws[first_index]
            # adjacent addresses are not enough: separately allocated weights can sit back to
            # back in the caching allocator; a view must stay inside one storage
            end = first.storage_offset() * size + (E - 1) * abs(step) + n * k * size
            if storage.nbytes() >= end:
                return first_index, abs(step) // size, step < 0
    return None


def stacked_weight(op) -> torch.Tensor:
    """The (E, out, in) weight tensor in expert order: a view when the experts' weights tile one
    buffer in that order, else a copy."""
    w, reversed_order = expert_weights(op)
    return w.flip(0) if reversed_order else w
