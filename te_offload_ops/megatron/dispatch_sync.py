"""Megatron's dispatch split sizes to the host by a kernel, past the copy engine's queue.

Before each expert-parallel all-to-all, Megatron's alltoall token dispatcher copies a few small
tensors to the host (tokens per expert, the input and output splits) and the host waits for
them ("before_ep_alltoall"): the all-to-all cannot be launched before. Those copies go to the
copy engine that also carries offload copies to the host, which serves them in order, so with
activation offloading on, each MoE layer's dispatch waits for the offload copies queued before it
(measured in this package: a small copy waits behind a large one, pieces or not). With
:func:`use_kernel_dtoh` the dispatcher's small tensors are written into pinned host memory by a
small Triton kernel on the same stream instead: the GPU's stores reach mapped host memory over
PCIe without the copy engine, and the dispatcher's event and wait keep their meaning.

The first transfer is checked against a plain copy; where the kernel cannot run (no Triton, host
memory not mapped), the dispatcher's own copies are used, said once in the log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

_log = logging.getLogger(__name__)

__all__ = ["KernelDtoH", "MAX_NUMEL", "to_host_by_kernel", "use_kernel_dtoh"]

DISPATCHER_MODULE = "megatron.core.transformer.moe.token_dispatcher"
MAX_NUMEL = 1 << 16  # split sizes: a few elements per expert or rank; larger tensors keep the plain copy
_BLOCK = 1024
_state: dict = {"kernel": None, "usable": None}


def _kernel():
    if _state["kernel"] is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _splits_to_host(src, dst, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)

        _state["kernel"] = (_splits_to_host, triton.cdiv)
    return _state["kernel"]


def to_host_by_kernel(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of CUDA ``tensor`` written by a kernel on the current stream (ready once
    the stream's work up to here is done, as a non-blocking copy is)."""
    src = tensor.detach().contiguous().view(-1)
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    if src.numel():
        kernel, cdiv = _kernel()
        kernel[(cdiv(src.numel(), _BLOCK),)](src, out.view(-1), src.numel(), BLOCK=_BLOCK)
    return out


def _eligible(tensor: Any) -> bool:
    return (torch.is_tensor(tensor) and tensor.is_cuda and tensor.numel() <= MAX_NUMEL
            and tensor.dtype in (torch.int32, torch.int64, torch.float32))


def _usable(tensor: torch.Tensor) -> bool:
    """Whether the kernel path works here: tried once, against a plain copy."""
    if _state["usable"] is None:
        try:
            got = to_host_by_kernel(tensor)
            torch.cuda.current_stream().synchronize()
            _state["usable"] = bool(torch.equal(got, tensor.cpu()))
            reason = "its result differed from a plain copy"
        except Exception as exc:  # noqa: BLE001 (any failure: keep the dispatcher's own copies)
            _state["usable"], reason = False, f"{type(exc).__name__}: {exc}"
        if not _state["usable"]:
            _log.warning("te_offload_ops: split sizes to the host by kernel do not work here (%s); Megatron's "
                         "dispatcher keeps its own copies", reason)
    return _state["usable"]


@dataclass
class KernelDtoH:
    """The dispatcher's patched function; :meth:`remove` puts Megatron's back."""

    module: Any
    original: Callable

    def remove(self) -> None:
        if getattr(self.module.maybe_move_tensor_to_cpu, "_te_offload_ops", False):
            self.module.maybe_move_tensor_to_cpu = self.original


def use_kernel_dtoh(dispatcher_module: Optional[Any] = None) -> KernelDtoH:
    """Have Megatron's alltoall token dispatcher bring its split sizes to the host by kernel
    (see the module docstring). Returns a handle whose ``remove()`` undoes it; calling again
    while on returns a handle to the same patch. ``dispatcher_module``: the module whose
    ``maybe_move_tensor_to_cpu(tensor, as_numpy, record_stream)`` the dispatcher calls (default:
    Megatron's, after the version check: that function and its call are those of the supported
    releases)."""
    if dispatcher_module is None:
        import importlib

        from .version import require_megatron

        require_megatron()
        dispatcher_module = importlib.import_module(DISPATCHER_MODULE)
    current = getattr(dispatcher_module, "maybe_move_tensor_to_cpu", None)
    if not callable(current):
        raise TypeError(f"use_kernel_dtoh patches a token dispatcher module's maybe_move_tensor_to_cpu(tensor, "
                        f"as_numpy, record_stream); {getattr(dispatcher_module, '__name__', dispatcher_module)!r} "
                        "has no such function")
    if getattr(current, "_te_offload_ops", False):
        return KernelDtoH(dispatcher_module, current._original)
    original = current

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if not _eligible(tensor) or not _usable(tensor):
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        host = to_host_by_kernel(tensor)
        if record_stream:  # as Megatron's: the source is read on this (side) stream
            tensor.record_stream(torch.cuda.current_stream())
        return host.numpy() if as_numpy else host

    maybe_move_tensor_to_cpu._te_offload_ops = True
    maybe_move_tensor_to_cpu._original = original
    dispatcher_module.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    return KernelDtoH(dispatcher_module, original)
