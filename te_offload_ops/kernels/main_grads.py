"""Megatron's fp32 ``main_grad`` buffers as the weight-gradient kernels add into them: the checks,
whether the experts' buffers form one evenly spaced array (TMA's reduce-adds need it), the table of
their offsets the kernels read (built once per set of addresses, CUDA-graph safe), and which way
of adding (TMA, L2 reductions, load-add-store) and schedule a wgrad of a given shape uses."""

from __future__ import annotations

import os

import torch

from ..capture import GraphCaptureError, capturing, warm_up_hint
from .tiling import SCHEDULE_ENV

_OFFSETS_CACHE: dict = {}  # (device, addresses) -> int64 element offsets on the GPU (and their pinned source)
_OFFSETS_CACHE_MAX = 256
# keys whose offsets a captured graph reads: never evicted, or a replay would read freed memory
_OFFSETS_CAPTURED: set = set()


def _build_offsets(offsets: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    host = torch.tensor(offsets, dtype=torch.int64).pin_memory()
    return host.to(device, non_blocking=True), host


def _evict_one_offsets() -> None:
    for key in _OFFSETS_CACHE:
        if key not in _OFFSETS_CAPTURED:
            del _OFFSETS_CACHE[key]
            return


def main_grad_slots(ptrs, mn: int) -> tuple[int, list[int]] | None:
    """(slot stride in elements, each buffer's slot) when E fp32 buffers of ``mn`` elements at
    byte addresses ``ptrs`` are slots 0..E-1 of one evenly spaced array (in any order), as
    TMA's reduce-adds need: a 16-byte aligned start, a stride of whole 16-byte units, no
    overlap. One (E, M, N) tensor and Megatron's experts of one layer (allocated one after
    another in its grad buffer) are. None otherwise."""
    base, e = min(ptrs), len(ptrs)
    rel = [p - base for p in ptrs]
    if base % 16 or any(r % 16 for r in rel) or len(set(rel)) != e:
        return None
    if e == 1:
        return -(-mn // 4) * 4, [0]
    step = max(rel) // (e - 1)
    if step * (e - 1) != max(rel) or step < 4 * mn or any(r % step for r in rel):
        return None
    return step // 4, [r // step for r in rel]


def main_grad_offsets(bufs, device, slots: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lowest-addressed buffer, int64 element offsets of each expert's buffer from it) on ``device``;
    with ``slots`` (see :func:`main_grad_slots`), the table holds those instead.

    Megatron's grad buffers are persistent, so the offsets are built once per set of addresses
    and copied from pinned memory without a host sync. Under CUDA graph capture they must have
    been built by an eager step (building them pins host memory and copies from it); the entry
    is then kept for as long as the process lives, since the graph reads it on every replay."""
    ptrs = tuple(b.data_ptr() for b in bufs)
    base = min(range(len(bufs)), key=lambda i: ptrs[i])
    key = (device, ptrs, slots is not None)
    hit = _OFFSETS_CACHE.get(key)
    in_capture = capturing()
    if hit is None and in_capture:
        raise GraphCaptureError(
            f"the main_grad buffers of this wgrad ({len(bufs)} experts on {device}) were not used by an eager "
            f"step before this CUDA graph capture (their offsets table is built from pinned host memory); "
            f"{warm_up_hint()}, with the same main_grad buffers")
    if hit is None:
        if len(_OFFSETS_CACHE) >= _OFFSETS_CACHE_MAX:
            _evict_one_offsets()
        table = slots if slots is not None else [(p - ptrs[base]) // 4 for p in ptrs]
        hit = _OFFSETS_CACHE[key] = _build_offsets(table, device)
    if in_capture:
        _OFFSETS_CAPTURED.add(key)
    return bufs[base], hit[0]


def check_main_grads(main_grads, e: int, n: int, k: int, device) -> list[torch.Tensor]:
    """E fp32 (N, K) buffers on ``device``: a sequence of them, or one (E, N, K) tensor."""
    if isinstance(main_grads, torch.Tensor):
        if main_grads.dim() != 3:
            raise ValueError(f"main_grad must be (E, N, K) = ({e}, {n}, {k}) or a list of (N, K) buffers, "
                             f"got shape {tuple(main_grads.shape)}")
        main_grads = list(main_grads.unbind(0))
    bufs = list(main_grads)
    if len(bufs) != e:
        raise ValueError(f"expected {e} main_grad buffers (one per expert), got {len(bufs)}")
    for i, g in enumerate(bufs):
        if not isinstance(g, torch.Tensor) or g.dtype != torch.float32 or g.device != device:
            raise TypeError(f"main_grad[{i}] must be an fp32 tensor on {device}, got "
                            f"{getattr(g, 'dtype', type(g).__name__)} on {getattr(g, 'device', '?')}")
        if tuple(g.shape) != (n, k) or not g.is_contiguous():
            raise ValueError(f"main_grad[{i}] must be a contiguous ({n}, {k}) tensor, got shape "
                             f"{tuple(g.shape)} with stride {tuple(g.stride())}")
    return bufs


def vector_aligned(bufs) -> bool:
    """The kernel reads and writes main_grad as 8-byte pairs."""
    return all(g.data_ptr() % 8 == 0 for g in bufs)


MAIN_GRAD_ADD_ENV = "TEO_MAIN_GRAD_ADD"  # "tma", "red" or "rmw": how the kernel adds into main_grad (unset: main_grad_way)
MAIN_GRAD_ADDS = {"rmw": "acc_f32", "red": "red_f32", "tma": "tma_f32"}


def main_grad_add(choice: str | None = None) -> str:
    """How the wgrad kernel adds into main_grad: "tma" (TMA bulk reduce-adds of staged 128 x 32
    fp32 boxes, for buffers evenly spaced as :func:`main_grad_slots` describes: one (E, N, K)
    tensor, or Megatron's experts of one layer in its grad buffer; "red" for other layouts),
    "red" (8-byte fire-and-forget reductions done in L2: no load round trips in the epilogue) or
    "rmw" (loads, adds, stores). All give the same bits (each element gets one add per kernel).
    The argument, else $TEO_MAIN_GRAD_ADD, else "tma" (:func:`main_grad_way` picks by shape)."""
    choice = choice or os.environ.get(MAIN_GRAD_ADD_ENV) or "tma"
    if choice not in MAIN_GRAD_ADDS:
        raise ValueError(f"{MAIN_GRAD_ADD_ENV} must be one of {tuple(MAIN_GRAD_ADDS)}, got {choice!r}")
    return choice


# mean tokens per expert (the wgrads' K) below which the load-add-store epilogue beats TMA's
# reduce-adds, and below which it runs best under the cooperative schedule
RMW_BELOW_TOKENS, COOPERATIVE_BELOW_TOKENS = 1536, 768


def main_grad_way(tokens: int, experts: int, add: str | None = None,
                  schedule: str | None = None) -> tuple[str, str | None]:
    """(add, schedule or None for :func:`.tiling.pick_schedule`'s) of a wgrad into main_grad over
    ``tokens`` rows and ``experts`` experts. An add given (argument or $TEO_MAIN_GRAD_ADD) is
    used as given. Otherwise by the mean tokens per expert, as measured on an H100 (fwd+bwd GPU
    time over the plain fused op, benchmarks/results/megatron_settings_*, 2026-11-24): the
    shorter the wgrads' K, the more the fp32 add's traffic dominates them, and the way that
    bears it best changes: E=8 x 2048 tma/pingpong 1.054x (rmw 1.092x); E=32 x 1024
    rmw/pingpong 1.159x (tma 1.207x); E=64 x 512 rmw/cooperative 1.272x (tma 1.374x, rmw/pingpong
    1.378x). The thresholds between the measured shapes are their midpoints."""
    given = add or os.environ.get(MAIN_GRAD_ADD_ENV)
    if given:
        return main_grad_add(given), schedule
    mean = tokens / max(experts, 1)
    if mean >= RMW_BELOW_TOKENS:
        return "tma", schedule
    if schedule is None and mean < COOPERATIVE_BELOW_TOKENS and not os.environ.get(SCHEDULE_ENV):
        schedule = "cooperative"
    return "rmw", schedule
