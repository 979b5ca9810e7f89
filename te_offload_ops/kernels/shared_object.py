"""TVM-FFI kernels as shared objects: linked once where they are compiled, loaded by
``tvm_ffi.load_module`` wherever they are used, without importing the CuTe DSL.

The DSL exports a compiled kernel as a relocatable object (``export_to_c``) whose symbols come
from the DSL's runtime library and TVM-FFI's; the DSL's documented way to use it elsewhere is to
link it into a shared object against those two (``python -m cutlass.cute.export.aot_config``).
That takes the system's C compiler driver ($CC, else ``cc``, ``gcc`` or ``clang``), tens of
milliseconds; where there is none, entries keep the object alone and later processes load it
through the DSL.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

_log = logging.getLogger(__name__)

COMPILERS = ("cc", "gcc", "clang")
LINK_TIMEOUT_S = 120.0
_SAID: set = set()


def compiler():
    """The C compiler driver's command (a list), or None where there is none."""
    given = os.environ.get("CC", "").strip()
    if given:
        return shlex.split(given)
    found = next((shutil.which(c) for c in COMPILERS if shutil.which(c)), None)
    return [found] if found else None


def _once(why: str) -> None:
    if why not in _SAID:
        _SAID.add(why)
        _log.info("kernels are cached without a shared object (%s); later processes load them through the "
                  "CuTe DSL (about a second more at their start)", why)


def runtime_libraries() -> list[str]:
    """The DSL's runtime library and TVM-FFI's, as the DSL finds them (imports the DSL)."""
    from cutlass.runtime import find_runtime_libraries

    return [str(Path(p).resolve()) for p in find_runtime_libraries(enable_tvm_ffi=True)]


def link(object_bytes: bytes, libraries: list[str]):
    """The shared object of an exported TVM-FFI kernel object, linked against ``libraries`` (found
    again at load time where they are now: their directories go in its run path); None where it
    cannot be linked here (said once per process at INFO)."""
    cmd = compiler()
    if cmd is None:
        _once(f"no C compiler: none of $CC, {', '.join(COMPILERS)}")
        return None
    dirs = list(dict.fromkeys(str(Path(p).parent) for p in libraries))
    with tempfile.TemporaryDirectory(prefix="teo-kernel-") as d:
        obj, out = os.path.join(d, "kernel.o"), os.path.join(d, "kernel.so")
        Path(obj).write_bytes(object_bytes)
        argv = [*cmd, "-shared", "-o", out, obj, *libraries, "-Wl,-z,defs",
                *(f"-Wl,-rpath,{p}" for p in dirs)]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=LINK_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            _once(f"{cmd[0]} did not run: {exc.__class__.__name__}: {exc}")
            return None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
            _once(f"{' '.join(cmd)} could not link it: {tail[0][:200]}")
            return None
        return Path(out).read_bytes()


@functools.lru_cache(maxsize=1)
def _scratch() -> Path:
    """A directory of this process's own for the shared objects it loads (the loader takes a path),
    removed when the process ends."""
    path = Path(tempfile.mkdtemp(prefix="teo-kernels-"))
    atexit.register(_remove, path)
    return path


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def load(shared_bytes: bytes, symbol: str, name: str):
    """The ``tvm_ffi.Function`` exported as ``symbol`` by these shared-object bytes. ``name`` (the
    entry's, unique to its key) names the file it is loaded from: the dynamic loader knows a
    library by its path, and a path loaded before gives the library loaded then. The file is
    removed once loaded; the module stays loaded for the life of the process."""
    import tvm_ffi

    path = _scratch() / f"{name}.so"
    path.write_bytes(shared_bytes)
    try:
        module = tvm_ffi.load_module(str(path))
        return module[symbol]
    finally:
        path.unlink(missing_ok=True)
