"""Torch entry points for the grouped weight gradients, ``dW[e] = dy_e^T @ x_e``: into a new bf16/fp16
tensor (:func:`grouped_wgrad`) or added into Megatron's fp32 ``main_grad`` buffers in the kernel's
epilogue (:func:`grouped_wgrad_main_grad`, its three ways of adding and the table of the buffers'
offsets the kernel reads). The kernels are :mod:`.gemm_sm90`'s weight-gradient form, built and
compiled by :mod:`.api` and launched by :mod:`.launch`; like every entry point here they never read
``split_sizes`` on the host.
"""

from __future__ import annotations

import os

import torch

from ..capture import GraphCaptureError, capturing, warm_up_hint
from .api import get_kernel
from .launch import launch_gemm
from .operands import DTYPES, INT32_MAX, aligned, splits_i32
from .tiling import SCHEDULE_ENV

WGRAD_BACKEND_ENV = "TEO_WGRAD_BACKEND"  # "cute" or "torch": overrides the default below
WGRAD_BACKENDS = ("cute", "torch")
# measured on H100 (benchmarks/results/bench_kernels*): see docs/fused-mlp.md, "Kernels"
DEFAULT_WGRAD_BACKEND = "cute"


def wgrad_backend(backend: str | None = None) -> str:
    """The wgrad backend a call uses: the argument, else $TEO_WGRAD_BACKEND, else the default."""
    choice = backend or os.environ.get(WGRAD_BACKEND_ENV) or DEFAULT_WGRAD_BACKEND
    if choice not in WGRAD_BACKENDS:
        raise ValueError(f"wgrad backend must be one of {WGRAD_BACKENDS}, got {choice!r}")
    return choice


def _check_wgrad(dy, x, split_sizes):
    if not isinstance(dy, torch.Tensor) or not isinstance(x, torch.Tensor):
        raise TypeError("dy and x must be torch tensors")
    if not isinstance(split_sizes, torch.Tensor) or split_sizes.is_floating_point():
        raise TypeError("split_sizes must be an integer torch tensor")
    if not (dy.is_cuda and x.is_cuda) or dy.device != x.device:
        raise ValueError(f"dy and x must be on one CUDA device, got {dy.device} and {x.device}")
    if dy.dtype not in DTYPES or x.dtype != dy.dtype:
        raise TypeError(f"grouped wgrad takes bf16 or fp16 operands of one dtype, got {dy.dtype} and {x.dtype}")
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy and x must be (T, N) and (T, K) with one T, got {tuple(dy.shape)} and {tuple(x.shape)}")
    if split_sizes.dim() != 1 or split_sizes.numel() == 0:
        raise ValueError("split_sizes must be a 1-D tensor with one entry per expert")
    if dy.shape[1] % 8 or x.shape[1] % 8:
        raise ValueError("N and K must be multiples of 8 (16-byte rows)")
    if dy.shape[0] > INT32_MAX:
        raise ValueError(f"the grouped wgrad takes at most {INT32_MAX} token rows, got {dy.shape[0]}")


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


def _main_grad_offsets(bufs, device, slots: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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


def _check_main_grads(main_grads, e: int, n: int, k: int, device) -> list[torch.Tensor]:
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


def _vector_aligned(bufs) -> bool:
    """The kernel reads and writes main_grad as 8-byte pairs."""
    return all(g.data_ptr() % 8 == 0 for g in bufs)


MAIN_GRAD_ADD_ENV = "TEO_MAIN_GRAD_ADD"  # "tma" (default), "red" or "rmw": how the kernel adds into main_grad
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


def grouped_wgrad_main_grad(dy, x, split_sizes, main_grads, *, accumulate: bool = True,
                            backend: str | None = None, tile=None, schedule=None, add: str | None = None) -> None:
    """Megatron's wgrad fusion: ``main_grads[e] += dy_e^T @ x_e`` in fp32 (``= `` with
    ``accumulate=False``, i.e. ``overwrite_main_grad``), for every expert, no host sync.

    ``main_grads``: one (E, N, K) fp32 tensor or E fp32 (N, K) tensors at any addresses on dy's
    device (each expert's buffer is found through a table of 64-bit offsets). The CuTe kernel
    adds the fp32 accumulator into them in its epilogue: no bf16 temporary, no extra pass.
    Experts with no tokens add nothing (or store zeros when overwriting). ``add`` and the
    schedule, where not given: see :func:`main_grad_way`."""
    _check_wgrad(dy, x, split_sizes)
    e, n, k = split_sizes.numel(), dy.shape[1], x.shape[1]
    bufs = _check_main_grads(main_grads, e, n, k, dy.device)
    s = splits_i32(split_sizes, dy.device)
    t = dy.shape[0]
    if t == 0:
        if not accumulate:
            for g in bufs:
                g.zero_()
        return
    if wgrad_backend(backend) == "torch":
        # torch's grouped GEMM writes its inputs' dtype on Hopper (no fp32 output): each expert's
        # wgrad is rounded to bf16/fp16 before the fp32 add, as a plain bf16 wgrad would be
        offs = torch.cumsum(s, 0, dtype=torch.int32)
        dw = torch._grouped_mm(dy.t(), x, offs=offs)
        for g, d in zip(bufs, dw.unbind(0)):
            g.add_(d) if accumulate else g.copy_(d)
        return
    if not _vector_aligned(bufs):
        # the kernel adds 8-byte fp32 pairs: it works on an aligned copy (fresh allocations are),
        # which then goes back into the caller's buffers
        staged = torch.stack(bufs) if accumulate else torch.empty((e, n, k), dtype=torch.float32, device=dy.device)
        grouped_wgrad_main_grad(dy, x, s, staged, accumulate=accumulate, backend=backend, tile=tile,
                                schedule=schedule, add=add)
        for g, d in zip(bufs, staged.unbind(0)):
            g.copy_(d)
        return
    if accumulate:
        add, schedule = main_grad_way(t, e, add, schedule)
        epilogue = MAIN_GRAD_ADDS[add]
    else:  # overwrite_main_grad: stores only, under the schedule given or pick_schedule's
        epilogue = "store_f32"
    layout = main_grad_slots([g.data_ptr() for g in bufs], n * k) if epilogue == "tma_f32" else None
    if epilogue == "tma_f32" and layout is None:  # buffers TMA cannot address as one array
        epilogue = MAIN_GRAD_ADDS["red"]
    kern, compiled = get_kernel(dy.dtype, k, 0, e, b_n_major=True, epilogue=epilogue, tile=tile, wgrad_m=n,
                                schedule=schedule, slot_stride=layout[0] if layout else None)
    base, offsets = _main_grad_offsets(bufs, dy.device, layout[1] if layout else None)
    dy, x = aligned(dy), aligned(x)
    launch_gemm(
        kern, compiled,
        [(dy, "m"), (x, "m"), (base, "f32"), (s, "i32"), (dy, "vec"), (dy, "m"), (dy, "m"),
         (offsets, "i64")],
        t,
    )


def grouped_wgrad(dy, x, split_sizes, *, backend: str | None = None, tile=None, schedule=None):
    """dW[e] = dy_e^T @ x_e  ->  (E, N, K) in dy.dtype, no host sync.

    dy is (T, N), x is (T, K), split_sizes has E entries.  Experts with zero
    tokens get zeros.  ``backend``: "cute" (the Hopper kernel's weight-gradient
    form) or "torch" (``torch._grouped_mm``); see :func:`wgrad_backend`."""
    _check_wgrad(dy, x, split_sizes)
    choice = wgrad_backend(backend)
    e = split_sizes.numel()
    n, k = dy.shape[1], x.shape[1]
    s = splits_i32(split_sizes, dy.device)
    if choice == "torch":
        offs = torch.cumsum(s, 0, dtype=torch.int32)
        return torch._grouped_mm(dy.t(), x, offs=offs)
    t = dy.shape[0]
    if t == 0:
        return torch.zeros(e, n, k, dtype=dy.dtype, device=dy.device)
    # C[e] (M=N_dy, N=K_x) = A_e^T B_e with A = dy, B = x
    kern, compiled = get_kernel(dy.dtype, k, 0, e, b_n_major=True, epilogue="plain", tile=tile,
                                wgrad_m=n, schedule=schedule)
    dw = torch.empty(e, n, k, dtype=dy.dtype, device=dy.device)
    dy, x = aligned(dy), aligned(x)
    launch_gemm(
        kern, compiled,
        [(dy, "m"), (x, "m"), (dw, "m"), (s, "i32"), (dy, "vec"), (dw, "m"), (dw, "m"),
         (s, "f32")],
        t,
    )
    return dw
