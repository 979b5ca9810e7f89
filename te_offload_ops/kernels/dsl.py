"""The CuTe DSL, imported where the kernels need it: to compile, to call through its Python
executor, to load an entry that holds no shared object. Importing it costs about a second of a
process's start, so every import of it in this package goes through :func:`load`, which times it
(:func:`import_seconds`, for first-step reports)."""

from __future__ import annotations

import os
import sys
import time

_SECONDS: list[float] = []
_ENVIRONMENT: list[dict] = []  # the DSL's variables when load() imported it


def imported() -> bool:
    """Whether the DSL is in this process (imported by this package or by anyone else)."""
    return "cutlass.cute" in sys.modules


def load():
    """(``cutlass``, ``cutlass.cute``), imported on first use."""
    if not imported():
        environment = {k: v for k, v in os.environ.items() if k.startswith("CUTE_DSL_")}
        t0 = time.perf_counter()
        import cutlass.cute  # noqa: F401

        _SECONDS.append(time.perf_counter() - t0)
        _ENVIRONMENT.append(dict(sorted(environment.items())))
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


def import_seconds() -> float:
    """Seconds this process spent importing the DSL through :func:`load` (0.0: it did not)."""
    return sum(_SECONDS)


def environment_at_import():
    """The ``CUTE_DSL_*`` variables as :func:`load` imported the DSL under them (it reads them
    then); None where it did not import it."""
    return _ENVIRONMENT[0] if _ENVIRONMENT else None


def runtime():
    """(``cutlass``, ``cutlass.cute``, ``make_ptr``, ``make_fake_stream``): what compiling a
    kernel and calling it through the DSL's Python executor need, imported on first use."""
    cutlass, cute = load()
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    return cutlass, cute, make_ptr, make_fake_stream


def element_type(dtype):
    """The DSL's element type of a 16-bit torch float dtype (a kernel's A/B or output type)."""
    import torch

    cutlass = load()[0]
    if dtype == torch.bfloat16:
        return cutlass.BFloat16
    if dtype == torch.float16:
        return cutlass.Float16
    raise TypeError(f"grouped GEMM supports bf16 and fp16, got {dtype}")
