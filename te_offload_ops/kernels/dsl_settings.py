"""The CuTe DSL's compile settings, for the disk cache's key, without importing the DSL where
they are known.

The settings (GPU architecture, line info, assertions, compiler options, the runtime library, ...)
are the DSL's own statement of what changes its code; reading them needs the DSL imported, about
a second of a process's start. Yet they follow from inputs a process can read without it: the
DSL's installation (where, which versions and CUDA flavours), its ``CUTE_DSL_*`` environment
variables, GPU 0's architecture and the CUDA driver's version (which pick the arch and the
flavour where no variable does). A process that imports the DSL writes the settings it reads into
the cache directory under a hash of those inputs (a *context*); a later process of the same
context reads them back there instead of importing the DSL. A context the directory does not
know yet costs its first process the DSL's import.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
from pathlib import Path

from . import dsl
from .atomic_file import write_atomic

_log = logging.getLogger(__name__)

ENV_PREFIX = "CUTE_DSL_"
DISTRIBUTIONS = ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
                 "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13")
PREFIX, SUFFIX = "dsl-settings-", ".json"


def dsl_environment() -> dict:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIX)}


def _same_environment() -> bool:
    """The DSL's variables are those :func:`.dsl.load` imported it under (the DSL reads them
    once): only then are its settings those of this process's context."""
    return dsl.environment_at_import() == dsl_environment()


@functools.lru_cache(maxsize=1)
def _installation() -> dict:
    """Where the DSL is and which of its distributions (its CUDA flavours among them) are installed,
    at which versions; read once per process (a process does not see packages change under it)."""
    versions = {}
    for dist in DISTRIBUTIONS:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    try:
        spec = importlib.util.find_spec("cutlass")
    except (ImportError, ValueError):
        spec = None
    where = None
    if spec is not None:
        where = next(iter(spec.submodule_search_locations or []), None) or spec.origin
    return {"package": where, "versions": versions}


def _driver_version():
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        return version.value if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0 else None
    except (OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=1)
def _gpu():
    """GPU 0's compute capability (the DSL detects the architecture there) and the driver's CUDA
    version (it picks the DSL's CUDA flavour); None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        capability = list(torch.cuda.get_device_capability(0))
    except Exception as exc:  # a GPU torch sees but cannot query: a context of its own
        capability = f"unreadable ({exc.__class__.__name__})"
    return {"device 0": capability, "driver": _driver_version()}


def context() -> dict:
    """Every input of the DSL's settings that a process can read without importing the DSL."""
    return {"installation": _installation(), "environment": dsl_environment(), "gpu": _gpu()}


def _memo_path(directory: Path, ctx: dict) -> Path:
    digest = hashlib.sha256(json.dumps(ctx, sort_keys=True).encode()).hexdigest()[:40]
    return Path(directory) / f"{PREFIX}{digest}{SUFFIX}"


def recall(directory: Path):
    """The settings a process of this context read from the DSL, as it left them in ``directory``;
    None where none did (or the file is not whole and of this context)."""
    ctx = context()
    try:
        memo = json.loads(_memo_path(directory, ctx).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(memo, dict) or memo.get("context") != ctx or not isinstance(memo.get("settings"), str):
        return None
    return memo["settings"]


def remember(directory: Path, settings: str) -> None:
    """Leave ``settings`` in ``directory`` for later processes of this context."""
    ctx = context()
    with contextlib.suppress(OSError):
        Path(directory).mkdir(parents=True, exist_ok=True)
        write_atomic(_memo_path(directory, ctx), json.dumps({"context": ctx, "settings": settings}).encode())


def read_from_dsl() -> str:
    """The settings as the DSL states them (imports it): those its in-memory JIT cache keys."""
    dsl.load()
    from cutlass.cutlass_dsl import CuTeDSL

    return CuTeDSL._get_dsl().envar.cache_key_str()


def current(directory: Path) -> str:
    """The settings the DSL compiles under in this process: read from the DSL where it is imported
    (and left in ``directory`` for later processes), else recalled from ``directory``, else read
    from the DSL after importing it."""
    if not dsl.imported():
        known = recall(directory)
        if known is not None:
            return known
    settings = read_from_dsl()
    if not _same_environment():  # another context's settings, or unknown ones: nothing to file
        return settings
    known = recall(directory)
    if known != settings:
        if known is not None:
            _log.warning("the CuTe DSL's settings differ from those recalled for this context (%s); "
                         "kernels loaded without the DSL could have been compiled under other settings",
                         _memo_path(directory, context()).name)
        remember(directory, settings)
    return settings
