"""A GroupedLinear's expert weights as the fused kernels take them, whichever way TE stores them.

TE keeps one Parameter per expert (``weight0 .. weight{E-1}``) or, with
``single_grouped_weight=True``, one ``GroupedTensor`` Parameter ``weight`` whose ``rowwise_data``
holds all experts back to back. The kernels want one (E, out, in) tensor.
"""

from __future__ import annotations

import torch


def weight_params(op) -> list[torch.Tensor]:
    """The op's weight Parameters in registration order (one when single_grouped_weight)."""
    if op.single_grouped_weight:
        return [op.weight]
    return [getattr(op, f"weight{i}") for i in range(op.num_groups)]


def weight_dtype(op) -> torch.dtype:
    return weight_params(op)[0].dtype


def _grouped_data(w: torch.Tensor) -> torch.Tensor:
    # A GroupedTensor keeps its bytes in rowwise_data; a plain (E, out, in) tensor is its own data.
    data = getattr(w, "rowwise_data", None)
    return w.detach() if data is None else data


def stacked_weight(op) -> torch.Tensor:
    """The (E, out, in) weight tensor: a view when the experts' weights tile one buffer."""
    E, n, k = op.num_groups, op.out_features, op.in_features
    if op.single_grouped_weight:
        return _grouped_data(op.weight).view(E, n, k)
    ws = weight_params(op)
    w0 = ws[0]
    step = n * k * w0.element_size()
    storage = w0.untyped_storage()
    # adjacent addresses are not enough: separately allocated weights can sit back to back in
    # the caching allocator; a view must stay inside one storage
    tiled = (storage.nbytes() >= w0.storage_offset() * w0.element_size() + E * step
             and all(w.is_contiguous() and w.dtype == w0.dtype and w.data_ptr() == w0.data_ptr() + i * step
                     and w.untyped_storage().data_ptr() == storage.data_ptr() for i, w in enumerate(ws)))
    if tiled:
        return w0.detach().as_strided((E, n, k), (n * k, k, 1))
    return torch.stack([w.detach() for w in ws])
