"""Whether this process can run the kernels, and how it calls them once compiled: through the CuTe
DSL's TVM-FFI convention (raw pointers and ints cross one C call) or its Python executor."""

from __future__ import annotations

import functools
import importlib.util
import os

from . import disk_cache, dsl, dsl_settings

CALL_ENV = "TEO_KERNEL_CALL"  # "tvm-ffi" or "python": how compiled kernels are called
CALLS = ("tvm-ffi", "python")

# why the TVM-FFI convention, picked by default, failed to compile (then "python" is used)
TVM_FFI_FAILED: list[str] = []


def unavailable_reasons() -> list[str]:
    """Why the kernels cannot be compiled in this process (empty: they can).

    Checks that the CuTe DSL and its CUDA driver bindings import; the GPU
    itself is the fusion selector's business."""
    reasons = []
    try:
        dsl.runtime()
    except Exception as exc:  # any import failure of the DSL stack
        reasons.append(f"the CuTe DSL (nvidia-cutlass-dsl) does not import: {exc}")
    try:
        import cuda.bindings.driver  # noqa: F401
    except Exception as exc:
        reasons.append(f"cuda-python driver bindings do not import: {exc}")
    return reasons


def loads_without_dsl() -> bool:
    """Whether this process may take the kernels' availability as given without importing the
    CuTe DSL: kernels are called through TVM-FFI (installed), the disk cache is on, the DSL is
    installed, and the cache directory holds the DSL's settings for this process's context, which
    only a process of this context that imported the DSL leaves there. Kernels the cache holds
    as shared objects then load without the DSL; any other is compiled, importing it (as it did
    there)."""
    try:
        if not disk_cache.enabled() or kernel_call_convention() != "tvm-ffi":
            return False
    except (ValueError, RuntimeError):  # a bad setting: the full check (and the call) will say so
        return False
    if importlib.util.find_spec("cutlass") is None:
        return False
    return dsl_settings.recall(disk_cache.cache_dir()) is not None


@functools.lru_cache(maxsize=None)
def has_tvm_ffi() -> bool:
    """Whether apache-tvm-ffi is installed (not imported: the DSL imports it where it compiles)."""
    return importlib.util.find_spec("tvm_ffi") is not None


def kernel_call_convention() -> str:
    """How compiled kernels are called: "tvm-ffi" (the CuTe DSL's TVM-FFI convention: raw
    pointers and ints cross one C call) where apache-tvm-ffi is installed and compiles, else
    "python" (the DSL's Python executor, which costs more host time a call);
    $TEO_KERNEL_CALL picks, and then a failure is not papered over."""
    choice = os.environ.get(CALL_ENV)
    if not choice:
        return "tvm-ffi" if has_tvm_ffi() and not TVM_FFI_FAILED else "python"
    if choice not in CALLS:
        raise ValueError(f"{CALL_ENV} must be one of {CALLS}, got {choice!r}")
    if choice == "tvm-ffi" and not has_tvm_ffi():
        raise RuntimeError(f"{CALL_ENV}=tvm-ffi, but apache-tvm-ffi is not installed")
    return choice
