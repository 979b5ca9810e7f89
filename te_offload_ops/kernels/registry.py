"""The process's compiled kernels: one per variant key (dtype, tile, cluster, epilogue, shape, ...,
call convention), loaded from the disk cache or compiled on its first use and kept, and how long
each took to compile, load and first launch. Every GEMM family (bf16, FP8, their weight
gradients) keeps its kernels here, so :func:`compile_times` and :func:`clear_cache` cover them all.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from ..capture import GraphCaptureError, capturing, warm_up_hint
from . import availability, disk_cache, dsl

_log = logging.getLogger(__name__)

CACHE: dict = {}  # key -> (kernel object or plan, compiled kernel)
LOCK = threading.Lock()
_COMPILE_SECONDS: dict = {}
_LOAD_SECONDS: dict = {}
_LOADED_BY: dict = {}
_FIRST_LAUNCH_SECONDS: dict = {}

_RUNTIME_ATTRS = ("call", "launched", "cache_key")  # set on a kernel object after it is built


def kernel_params(kern) -> tuple:
    """A plan's plain parameters (tile, stages, epilogue chunking, ...), for the disk cache's key:
    what :class:`~.gemm_plan.GemmPlan` derives (a kernel object is a plan), so a variant built
    differently (a constant of the plan module changed at run time, say) never loads another's
    code."""
    plain = (bool, int, float, str, type(None))
    return tuple(sorted(
        (name, value) for name, value in vars(kern).items()
        if name not in _RUNTIME_ATTRS and (isinstance(value, plain) or (
            isinstance(value, tuple) and all(isinstance(v, plain) for v in value)))))


def compile_timed(kern, args: list, call: str, options: str | None):
    """(kernel object, compiled, seconds) of ``cute.compile(kern, *args)`` under the call
    convention ``call`` ("tvm-ffi" adds its compile option), ``options`` passed on; the kernel
    object records the convention, which tells its launch how to pass the arguments."""
    _, cute = dsl.load()
    if call == "tvm-ffi":
        options = f"{options} --enable-tvm-ffi" if options else "--enable-tvm-ffi"
    kern.call = call
    extra = {"options": options} if options else {}
    t0 = time.perf_counter()
    compiled = cute.compile(kern, *args, **extra)
    return kern, compiled, time.perf_counter() - t0


def cached_kernel(key: tuple, load):
    """(kernel, compiled) of the variant ``key`` (its last element the call convention): from the
    in-memory cache, else ``load(key, call)`` (the disk cache or a compile), once per process.

    Where the TVM-FFI call path fails to compile (an apache-tvm-ffi the DSL cannot use) and no
    call convention was asked for, the Python executor compiles the same kernel instead, from then
    on (a broken kernel raises there again). A first call inside a CUDA graph capture raises."""
    hit = CACHE.get(key)
    if hit is None and capturing():
        raise GraphCaptureError(first_call_in_capture(key))
    if hit is None:
        with LOCK:
            hit = CACHE.get(key)
            if hit is None:
                call = key[-1]
                try:
                    kern, compiled = load(key, call)
                except Exception as exc:
                    if call != "tvm-ffi" or os.environ.get(availability.CALL_ENV):
                        raise
                    key = key[:-1] + ("python",)
                    kern, compiled = load(key, "python")
                    availability.TVM_FFI_FAILED.append(repr(exc)[:300])
                    _log.warning("the TVM-FFI kernel call path failed to compile (%s); using the "
                                 "CuTe DSL's Python executor", availability.TVM_FFI_FAILED[-1])
                kern.cache_key = key  # named in errors
                hit = CACHE[key] = (kern, compiled)
    return hit


def note_loaded(key: tuple, entry: "disk_cache.Entry", what: str) -> None:
    """Record (and log) that the kernel ``key`` (a ``what``: "grouped GEMM", ...) came from the
    disk cache's ``entry``."""
    _LOAD_SECONDS[key] = disk_cache.LOADED[entry.name]
    _LOADED_BY[key] = disk_cache.LOADED_BY[entry.name]
    _log.info("loaded %s %s from %s (%s) in %.3f s", what, key, entry.path, _LOADED_BY[key], _LOAD_SECONDS[key])


def note_compiled(key: tuple, seconds: float, what: str) -> None:
    """Record (and log) that the kernel ``key`` was compiled in this process."""
    _COMPILE_SECONDS[key] = seconds
    _log.info("compiled %s %s in %.2f s", what, key, seconds)


def note_first_launch(kern, seconds: float) -> None:
    """Record the host time of ``kern``'s first launch (the one that loads its code onto the GPU)."""
    _FIRST_LAUNCH_SECONDS[getattr(kern, "cache_key", None) or type(kern).__name__] = seconds


def how_obtained(key: tuple) -> tuple[str, float | None]:
    """("compiled" | "loaded" | "in memory", seconds it took or None) of the kernel ``key``."""
    if key in _COMPILE_SECONDS:
        return "compiled", _COMPILE_SECONDS[key]
    if key in _LOAD_SECONDS:
        return "loaded", _LOAD_SECONDS[key]
    return "in memory", None


def first_call_in_capture(key) -> str:
    """The error of a kernel's first call (compile, load) inside a CUDA graph capture."""
    return (f"grouped GEMM kernel {key} would be compiled and loaded on its first call, inside a CUDA graph "
            f"capture, where compiling and loading a module are not allowed; {warm_up_hint()}")


def compile_times() -> dict:
    """{cache key: first-call compile seconds} for every kernel this process compiled."""
    return dict(_COMPILE_SECONDS)


def load_times() -> dict:
    """{cache key: seconds} for every kernel this process loaded from the disk cache instead."""
    return dict(_LOAD_SECONDS)


def loaded_by() -> dict:
    """{cache key: "shared object" (through tvm_ffi, no DSL) or "CuTe DSL"} for every kernel this
    process loaded from the disk cache."""
    return dict(_LOADED_BY)


def first_launch_times() -> dict:
    """{cache key: host seconds} of the first launch of each kernel this process launched: the
    launch that loads the kernel's code onto the GPU."""
    return dict(_FIRST_LAUNCH_SECONDS)


def dsl_import_seconds() -> float:
    """Seconds this process spent importing the CuTe DSL for the kernels (0.0: it did not)."""
    return dsl.import_seconds()


def clear_cache() -> None:
    """Forget the kernels of this process (the disk cache stays: see :mod:`.disk_cache`)."""
    with LOCK:
        CACHE.clear()
        _COMPILE_SECONDS.clear()
        _LOAD_SECONDS.clear()
        _LOADED_BY.clear()
        _FIRST_LAUNCH_SECONDS.clear()
