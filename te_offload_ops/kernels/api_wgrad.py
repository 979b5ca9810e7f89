"""Torch entry points for the grouped weight gradients, ``dW[e] = dy_e^T @ x_e``: into a new bf16/fp16
tensor (:func:`grouped_wgrad`) or added into Megatron's fp32 ``main_grad`` buffers in the kernel's
epilogue (:func:`grouped_wgrad_main_grad`; the buffers' checks, offsets table and ways of adding:
:mod:`.main_grads`). The kernels are :mod:`.gemm_sm90`'s weight-gradient form, built and
compiled by :mod:`.api` and launched by :mod:`.launch`; like every entry point here they never read
``split_sizes`` on the host.
"""

from __future__ import annotations

import os

import torch

from .api import get_kernel
from .launch import launch_gemm
from .main_grads import (MAIN_GRAD_ADDS, check_main_grads, main_grad_offsets, main_grad_slots, main_grad_way,
                         vector_aligned)
from .operands import INT32_MAX, aligned, check_pair, splits_i32

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
    check_pair(dy, x, split_sizes, ("dy", "x"), "grouped wgrad")
    if dy.dim() != 2 or x.dim() != 2 or dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy and x must be (T, N) and (T, K) with one T, got {tuple(dy.shape)} and {tuple(x.shape)}")
    if split_sizes.dim() != 1 or split_sizes.numel() == 0:
        raise ValueError("split_sizes must be a 1-D tensor with one entry per expert")
    if dy.shape[1] % 8 or x.shape[1] % 8:
        raise ValueError("N and K must be multiples of 8 (16-byte rows)")
    if dy.shape[0] > INT32_MAX:
        raise ValueError(f"the grouped wgrad takes at most {INT32_MAX} token rows, got {dy.shape[0]}")


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
    bufs = check_main_grads(main_grads, e, n, k, dy.device)
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
    if not vector_aligned(bufs):
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
    base, offsets = main_grad_offsets(bufs, dy.device, layout[1] if layout else None)
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
