"""Launching a compiled grouped GEMM on the current CUDA stream: the persistent grid's size (CTAs
that all fit at once, no more than a bound of the tiles that needs no split sizes on the host), the
stream handle, a profiler range per launch, and the arguments as the kernel's call convention
takes them."""

from __future__ import annotations

import functools
import logging
import threading
import time

import torch

from ..capture import GraphCaptureError, capturing
from . import cluster_fit, dsl, registry
from .tiling import CLUSTER_M_ENV

_log = logging.getLogger(__name__)
_PROBE_LOCK = threading.Lock()  # the cluster occupancy query compiles and loads a probe kernel


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """The SMs of ``device_index`` (a persistent grid's CTA bound)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def stream_handle(device_index: int) -> int:
    """The current CUDA stream of ``device_index`` as the driver's handle (the capturing stream
    while a graph is captured): the launch goes there. torch's raw-stream query where it has one
    (a launch's host time matters: the fused MLP launches a dozen kernels per step), else the
    public path."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _probe_clusters(device_index: int, cluster_size: int) -> int:
    """The driver's count of clusters of ``cluster_size`` that fit at once (a probe kernel the CuTe
    DSL compiles and loads), or the count a GPC-blind grid would take where it gives no answer."""
    sms = sm_count(device_index)
    dsl.load()
    from cutlass.utils import HardwareInfo

    with _PROBE_LOCK, torch.cuda.device(device_index):
        torch.cuda.current_stream(device_index)  # the device's context is current from here
        try:
            return HardwareInfo(device_index).get_max_active_clusters(cluster_size)
        except Exception as exc:  # said so
            _log.warning("could not ask the driver how many clusters of %d fit (%r); using %d",
                         cluster_size, exc, sms // cluster_size)
            return sms // cluster_size


@functools.lru_cache(maxsize=None)
def cluster_slots(device_index: int, cluster_size: int) -> int:
    """CTAs of a persistent grid of clusters that all run at once (one CTA per SM). Pairs fit
    every SM pair; a cluster of 4 must sit in one GPC, whose SM count need not divide by 4, so
    the driver's occupancy query decides (a cluster left waiting would run after the others),
    asked once per GPU (:mod:`.cluster_fit`). 0 where no cluster of that size fits."""
    sms = sm_count(device_index)
    if cluster_size <= 2:
        return sms // cluster_size * cluster_size
    clusters = cluster_fit.max_active_clusters(device_index, cluster_size, _probe_clusters)
    return max(0, min(clusters, sms // cluster_size)) * cluster_size


def grid_slots(device_index: int, cluster_size: int) -> int:
    """:func:`cluster_slots` for a launch: raises where no cluster of that size fits."""
    slots = cluster_slots(device_index, cluster_size)
    if slots < 1:
        raise RuntimeError(f"the driver says no cluster of {cluster_size} CTAs of this kernel's size fits on "
                           f"device {device_index}; set {CLUSTER_M_ENV}=1")
    return slots


PROFILE_LABEL = "te_offload_ops.gemm"


def profile_label(kern) -> str:
    """The profiler range around a launch of ``kern``: the profiler cuts the DSL's kernel names
    to one prefix for every GEMM, so the range names which (epilogue, wgrad, N x K) it was."""
    kind = "wgrad" if getattr(kern, "wgrad_m", None) is not None else "gemm"
    return f"{PROFILE_LABEL}[{kind} {getattr(kern, 'epilogue', '?')} n={kern.n} k={kern.k}]"


def launch_gemm(kern, compiled, tensors, num_tokens) -> None:
    """Launch the grouped GEMM ``compiled`` (of the kernel object or plan ``kern``) over
    ``tensors``, a list of (tensor, kind) in the kernel's argument order: kind "m" a 16-byte
    aligned matrix, "vec" a vector of the kernel's dtype, "i32" / "f32" / "i64" a vector of that
    type. The first launch of a kernel inside a CUDA graph capture raises (it loads the module)."""
    if torch.autograd._profiler_enabled():  # a range per launch, only while a profiler records
        with torch.profiler.record_function(profile_label(kern)):
            _launch_now(kern, compiled, tensors, num_tokens)
        return
    _launch_now(kern, compiled, tensors, num_tokens)


def persistent_grid(kern, num_tokens: int, device_index: int) -> int:
    """CTAs of ``kern``'s persistent grid: one per SM at most (whole clusters that fit at once), and
    no more than a bound of its tile count that needs no split sizes on the host."""
    if kern.wgrad_m is not None:  # static tiles: E times the (M, N) blocks
        tile_bound = kern.num_experts * kern.wgrad_tiles
    else:  # every expert may start a partial m-block
        m_bound = -(-num_tokens // kern.bm) + kern.num_experts
        if getattr(kern, "cluster_m", 1) > 1:  # (m-pair, n-pair) groups of four
            tile_bound = -(-m_bound // 2) * kern.n_pairs * kern.cluster_size
        else:
            tile_bound = m_bound * kern.n_tiles
    cn = getattr(kern, "cluster_size", kern.cluster_n)
    return min(grid_slots(device_index, cn), -(-tile_bound // cn) * cn)


def _launch_now(kern, compiled, tensors, num_tokens):
    if not getattr(kern, "launched", False) and capturing():  # the first call loads the module
        raise GraphCaptureError(registry.first_call_in_capture(getattr(kern, "cache_key", type(kern).__name__)))
    num_ctas = persistent_grid(kern, num_tokens, tensors[0][0].device.index)
    # the capturing stream when a graph is captured: the launch becomes a node of the graph
    stream = stream_handle(tensors[0][0].device.index)
    timing_the_first(kern, _call, kern, compiled, tensors, num_tokens, num_ctas, stream)


def timing_the_first(kern, call, *args) -> None:
    """``call(*args)``, a launch of ``kern``; the first launch of a kernel is timed
    (:func:`.registry.first_launch_times`): it loads the kernel's code onto the GPU."""
    if getattr(kern, "launched", False):
        call(*args)
        return
    kern.launched = True
    t0 = time.perf_counter()
    call(*args)
    registry.note_first_launch(kern, time.perf_counter() - t0)


def _call(kern, compiled, tensors, num_tokens: int, num_ctas: int, stream: int) -> None:
    if getattr(kern, "call", "python") == "tvm-ffi":  # addresses, ints and the stream handle
        compiled(*(t.data_ptr() for t, _ in tensors), num_tokens, num_ctas, stream)
        return
    dt = kern.dtype
    cutlass, cute, make_ptr, _ = dsl.runtime()
    import cuda.bindings.driver as cuda

    gmem = cute.AddressSpace.gmem
    ptrs = []
    for t, kind in tensors:
        if kind == "i32":
            ptrs.append(make_ptr(cutlass.Int32, t.data_ptr(), gmem, assumed_align=4))
        elif kind == "f32":
            ptrs.append(make_ptr(cutlass.Float32, t.data_ptr(), gmem, assumed_align=4))
        elif kind == "i64":
            ptrs.append(make_ptr(cutlass.Int64, t.data_ptr(), gmem, assumed_align=8))
        elif kind == "vec":
            ptrs.append(make_ptr(dt, t.data_ptr(), gmem, assumed_align=2))
        else:
            ptrs.append(make_ptr(dt, t.data_ptr(), gmem, assumed_align=16))
    compiled(*ptrs, cutlass.Int32(num_tokens), cutlass.Int32(num_ctas), cuda.CUstream(stream))
