"""Megatron-Core's fine-grained activation offloading around one step of bare MoE layers, counting
what it copies to the host: a test builds the layers itself, so no TransformerBlock sets it up."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Hashable, Optional


@contextlib.contextmanager
def megatron_offloading(config: Any, moved: Any, key: Optional[Callable[[Any], Hashable]] = None):
    """Megatron's fine-grained offloading for one step (a warm-up step: every group is offloaded).

    The bytes of each tensor Megatron copies to the host are added to ``moved[key(tensor)]``
    (``moved[0]`` without ``key``)."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    off = fgo.FineGrainedActivationOffloadingInterface
    real = fgo.ChunkOffloadHandler.offload

    def counting(handler, src_tensor, *args, **kwargs):
        moved[0 if key is None else key(src_tensor)] += src_tensor.numel() * src_tensor.element_size()
        return real(handler, src_tensor, *args, **kwargs)

    off.reset_instance()
    fgo.ChunkOffloadHandler.offload = counting
    try:
        off.init_chunk_handler(pp_rank=0, vp_size=None, vp_stage=None,
                               min_offloaded_tensor_size=config.min_offloaded_tensor_size,
                               delta_offload_bytes_across_pp_ranks=0, activation_offload_fraction=1.0)
        yield
        off.reset()
    finally:
        fgo.ChunkOffloadHandler.offload = real
        off.reset_instance()
