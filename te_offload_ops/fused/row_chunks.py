"""Where the fused MLP's forward cuts its token rows into blocks, and each block's split sizes, so
that ``act`` (fc2's input, never saved: the backward recomputes it) exists one block at a time
instead of whole (the loop: ``srelu_mlp.FusedScaledSReLUMLP._forward_in_blocks``).

fc1, SReLU and fc2 act on each token row alone, so the rows can be cut anywhere; a cut inside an
expert's rows gives each side of it its own split size. Each GEMM element is accumulated in the
same order either way, so the results are the same, bit for bit. What it saves: tokens x ffn
elements of ``act`` less one block, at the forward's largest moment (5.25 GiB at 196608 routed
tokens and ffn 14336 in bf16), where a memory cap is tightest.
"""

from __future__ import annotations

import torch

from ..settings import mib_from_env

CHUNK_ENV = "TEO_FUSED_ACT_CHUNK_MIB"
DEFAULT_CHUNK_MIB = 1024  # up to this an act is made whole (one GEMM pair)
_ROW_ALIGN = 128  # blocks of whole tiles (the kernels' largest row tile)


def chunk_mib() -> int:
    """The most MiB of ``act`` one block may hold: ``$TEO_FUSED_ACT_CHUNK_MIB`` (0: never cut)."""
    return mib_from_env(CHUNK_ENV, DEFAULT_CHUNK_MIB, "act made whole")


def chunk_rows(tokens: int, ffn: int, itemsize: int) -> int:
    """Token rows per block: ``tokens`` (one block) where the whole act fits the limit, else the
    most whole 128-row tiles that do (at least one tile)."""
    limit = chunk_mib() << 20
    row_bytes = ffn * itemsize
    if limit == 0 or tokens * row_bytes <= limit:
        return max(tokens, 1)
    return max(_ROW_ALIGN, limit // row_bytes // _ROW_ALIGN * _ROW_ALIGN)


def expert_row_ranges(split_sizes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's rows [starts, ends), in order (on the split sizes' device: no host sync). A
    negative size counts as 0 here (the split-size check raises for it), so the ranges never
    overlap and a block's sizes never add up to more rows than it has."""
    sizes = split_sizes.reshape(-1).clamp(min=0)
    ends = sizes.cumsum(0)
    return ends - sizes, ends


def block_split_sizes(starts: torch.Tensor, ends: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    """Each expert's rows inside rows [first, stop), from :func:`expert_row_ranges`."""
    return ends.clamp(first, stop) - starts.clamp(first, stop)
