"""Compiled grouped-GEMM kernels kept on disk, so that later processes load them instead of compiling.

An entry is one kernel variant as the CuTe DSL exports it ahead of time: a host object file with
the kernel's cubin inside (``export_to_c`` for the TVM-FFI call convention, ``dump_to_object`` for
the DSL's Python executor), loaded back by ``cutlass.cute.runtime.load_module`` in milliseconds
where tracing and compiling it takes seconds. A TVM-FFI entry also holds that object linked into
a shared object where the compiling process could link it (:mod:`.shared_object`): later
processes load it with ``tvm_ffi.load_module`` and never import the DSL (about a second of their
start), given its settings for their context (:mod:`.dsl_settings`). The DSL's own file cache is
no substitute: ``cute.compile`` turns it off, and its key is a hash of the traced IR, so even a
hit would trace the kernel's Python again.

Where: ``$TEO_KERNEL_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/te_offload_ops/kernels``;
``TEO_KERNEL_CACHE=0`` turns the disk cache off (kernels are then compiled in every process and
kept in its memory only).

An entry's file name is a hash of its key, which names everything that changes the code: the
kernel sources (every ``kernels/*.py``), the variant (the in-memory cache key and the parameters
its plan derives, :mod:`.gemm_plan`), the call convention, the DSL's version and its compile
settings (GPU architecture among them), apache-tvm-ffi's version where it is called through it,
this package's version and the host's architecture. The file holds the key itself and the length
and SHA-256 of the object and of the shared object, so a torn, truncated, foreign or colliding
file is told apart from a good one; such a file costs one warning and a compile, and the compiled
kernel replaces it. A shared object that does not load (a run path gone, a scratch directory
mounted without exec) costs an INFO line, and the object is loaded through the DSL.

Many processes at once (the ranks of a job): entries are written to a temporary file in the same
directory and renamed over the entry (``os.replace``), so a reader sees a whole entry or none; and
one process at a time compiles a given variant (an advisory ``flock`` on the entry's ``.lock``
file, released by the kernel if the holder dies) while the others wait, then load what it wrote.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import struct
import tempfile
import time
from pathlib import Path

from . import dsl, dsl_settings as settings_memo, shared_object
from .atomic_file import write_atomic

_log = logging.getLogger(__name__)

CACHE_ENV = "TEO_KERNEL_CACHE"  # "0": no disk cache
CACHE_DIR_ENV = "TEO_KERNEL_CACHE_DIR"
FORMAT = 2  # of the entry file below; a change gives every key a new name
MAGIC = b"TEOKERNL"
SUFFIX = ".kernel"
_HEADER_LEN = struct.Struct("<I")
LOCK_WAIT_S = 300.0  # past this, a process compiles without waiting any longer for another's compile
ORPHAN_AGE_S = 3600.0  # a temporary file this old was left by a writer that died

# what this process did, for warm-up reports and tests: file name -> seconds
LOADED: dict[str, float] = {}
STORED: dict[str, float] = {}
# file name -> how it was loaded: through tvm_ffi from the shared object, or through the DSL
LOADED_BY: dict[str, str] = {}
BY_SHARED_OBJECT, BY_DSL = "shared object", "CuTe DSL"
_WARNED_DIRS: set = set()


class BadEntry(Exception):
    """An entry file that must not be loaded; the message says why."""


def enabled() -> bool:
    """Whether compiled kernels are read from and written to disk ($TEO_KERNEL_CACHE, default 1)."""
    raw = os.environ.get(CACHE_ENV, "").strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise ValueError(f"{CACHE_ENV} must be 1 (kernels cached on disk, the default) or 0 (not), got {raw!r}")


def cache_dir() -> Path:
    """$TEO_KERNEL_CACHE_DIR, else ``te_offload_ops/kernels`` under $XDG_CACHE_HOME (an absolute
    path, as the XDG convention has it) or ~/.cache."""
    given = os.environ.get(CACHE_DIR_ENV, "").strip()
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "te_offload_ops" / "kernels"


# -- the key ------------------------------------------------------------------------------------------

KERNEL_SOURCES = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=4)
def source_digest(directory: Path = KERNEL_SOURCES) -> str:
    """SHA-256 over the kernel sources: every ``*.py`` of ``directory`` (this one), by name and
    content. Read once per process, at its first kernel: about when the DSL reads the kernel's
    source to trace it."""
    h = hashlib.sha256()
    for path in sorted(Path(directory).glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=1)
def _package_version() -> str:
    from .. import __version__

    return __version__


def dsl_settings(directory: Path) -> str:
    """The DSL's own statement of the settings that change what it compiles (the GPU architecture,
    line info, assertions, compiler options, its libraries, ...), as its in-memory JIT cache keys
    them: read from the DSL where it is imported, else as a process of this context read them
    (:mod:`.dsl_settings`, kept in ``directory``); per call, since the environment may change
    between compiles."""
    return settings_memo.current(directory)


def describe(variant_key: tuple, kernel_params: tuple, call: str, directory: Path) -> str:
    """The full key of one compiled kernel, as text (stored in the entry and compared on load)."""
    lines = [
        f"te_offload_ops kernel cache format {FORMAT}",
        f"te_offload_ops {_package_version()}",
        f"kernel sources sha256 {source_digest()}",
        f"variant {variant_key!r}",
        f"kernel parameters {kernel_params!r}",
        f"call convention {call}",
        "nvidia-cutlass-dsl " + " ".join(_version(d) for d in (
            "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core")),
        f"dsl settings {dsl_settings(directory)}",
        f"apache-tvm-ffi {_version('apache-tvm-ffi') if call == 'tvm-ffi' else 'unused'}",
        f"host {platform.system()} {platform.machine()}",
    ]
    return "\n".join(lines)


def file_name(description: str) -> str:
    return hashlib.sha256(description.encode()).hexdigest()[:40] + SUFFIX


def symbol_prefix(name: str) -> str:
    """The exported function's name: unique per entry, so loaded modules never share a symbol."""
    return "teo_gemm_" + name[:16]


# -- the file -----------------------------------------------------------------------------------------

def encode(description: str, call: str, prefix: str, payload: bytes, shared: bytes | None = None) -> bytes:
    """An entry: the header (key, call, symbol, each part's length and SHA-256), the object, then
    the shared object where there is one."""
    shared = shared or b""
    header = json.dumps({"key": description, "call": call, "prefix": prefix, "bytes": len(payload),
                         "sha256": hashlib.sha256(payload).hexdigest(), "shared_bytes": len(shared),
                         "shared_sha256": hashlib.sha256(shared).hexdigest()}).encode()
    return MAGIC + _HEADER_LEN.pack(len(header)) + header + payload + shared


def decode(blob: bytes, description: str) -> tuple[dict, bytes, bytes | None]:
    """(header, object bytes, shared-object bytes or None) of an entry written for
    ``description``; raises BadEntry."""
    head = len(MAGIC) + _HEADER_LEN.size
    if len(blob) < head or not blob.startswith(MAGIC):
        raise BadEntry("not a kernel cache entry (no header)")
    (n,) = _HEADER_LEN.unpack_from(blob, len(MAGIC))
    try:
        header = json.loads(blob[head:head + n].decode())
        key, size, digest = header["key"], header["bytes"], header["sha256"]
        shared_size, shared_digest = header["shared_bytes"], header["shared_sha256"]
        body = blob[head + n:]
        payload, shared = body[:size], body[size:]
    except (ValueError, KeyError, TypeError) as exc:
        raise BadEntry(f"unreadable header ({exc.__class__.__name__})") from None
    if key != description:
        raise BadEntry("written for another kernel or version (its key differs)")
    if len(body) != size + shared_size:
        raise BadEntry(f"truncated or padded: {len(body)} bytes after the header, the header says "
                       f"{size} + {shared_size}")
    if hashlib.sha256(payload).hexdigest() != digest or hashlib.sha256(shared).hexdigest() != shared_digest:
        raise BadEntry("checksum mismatch")
    return header, payload, (shared or None)


@contextlib.contextmanager
def _object_file(payload: bytes):
    """A path whose content is ``payload``, for the DSL's loader (which takes a path): an
    anonymous in-memory file where the OS has them, so the bytes loaded are the bytes checked."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("teo-kernel", os.MFD_CLOEXEC)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="teo-kernel-") as d:
        path = os.path.join(d, "kernel.o")
        with open(path, "wb") as f:
            f.write(payload)
        yield path


def export_object(compiled, call: str, prefix: str) -> bytes:
    """The compiled function as the DSL exports it: a relocatable host object holding the cubin."""
    if call == "tvm-ffi":
        with tempfile.TemporaryDirectory(prefix="teo-kernel-") as d:
            path = os.path.join(d, "kernel.o")
            compiled.export_to_c(path, function_name=prefix)
            with open(path, "rb") as f:
                return f.read()
    return compiled.dump_to_object(prefix)


def link_shared(payload: bytes, prefix: str, name: str):
    """The exported TVM-FFI object linked into a shared object that loads here (so it will load in
    later processes of this install), or None (said once per process at INFO)."""
    try:
        shared = shared_object.link(payload, shared_object.runtime_libraries())
        if shared is not None:
            shared_object.load(shared, prefix, name)
        return shared
    except Exception as exc:
        _log.info("kernel cache entry %s is kept without a shared object (%s: %s); later processes load it "
                  "through the CuTe DSL", name, exc.__class__.__name__, _first_line(exc))
        return None


def load_object(payload: bytes, call: str, prefix: str):
    """The callable of an exported object, loaded through the DSL: a ``tvm_ffi.Function``
    (TVM-FFI) or the DSL's ``JitCompiledFunction`` (Python executor); each keeps its loaded
    module alive."""
    dsl.load()
    from cutlass.cute.runtime import load_module

    with _object_file(payload) as path:
        module = load_module(path, enable_tvm_ffi=call == "tvm-ffi")
    return module[prefix]


# -- one entry ----------------------------------------------------------------------------------------

class Entry:
    """The disk entry of one kernel variant under one call convention."""

    def __init__(self, variant_key: tuple, kernel_params: tuple, call: str, directory: Path | None = None):
        self.call = call
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.description = describe(variant_key, kernel_params, call, self.directory)
        self.name = file_name(self.description)
        self.path = self.directory / self.name
        self.prefix = symbol_prefix(self.name)

    def _usable_dir(self) -> bool:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            return True
        except OSError as exc:
            if str(self.directory) not in _WARNED_DIRS:
                _WARNED_DIRS.add(str(self.directory))
                _log.warning("kernel cache directory %s is not usable (%s); compiling kernels without it "
                             "(set %s, or %s=0)", self.directory, exc, CACHE_DIR_ENV, CACHE_ENV)
            return False

    @contextlib.contextmanager
    def claim(self):
        """Held while this process loads, or compiles and stores, the entry: another process
        after the same entry waits here, then finds it written (the lock is advisory; where the
        file system has no flock, nobody waits and each process compiles for itself)."""
        if not self._usable_dir():
            yield
            return
        try:
            import fcntl

            fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o666)
        except (ImportError, OSError):
            yield
            return
        locked = False
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    locked = True
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES):
                        break  # no locks on this file system
                if time.monotonic() > deadline:
                    _log.warning("waited %.0f s for another process to compile %s; compiling it here",
                                 LOCK_WAIT_S, self.name)
                    break
                time.sleep(0.05)
            yield
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def load(self):
        """The loaded kernel, or None: absent (silently) or unusable (one warning; the caller
        compiles and :meth:`store` replaces the file)."""
        if not self._usable_dir():
            return None
        t0 = time.perf_counter()
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            return self._reject(f"unreadable: {exc}")
        try:
            header, payload, shared = decode(blob, self.description)
            if header.get("call") != self.call or header.get("prefix") != self.prefix:
                raise BadEntry("written for another call convention or symbol")
            if shared is not None and self.call != "tvm-ffi":
                raise BadEntry("a shared object in an entry of the Python executor")
        except BadEntry as exc:
            return self._reject(str(exc))
        compiled, by = None, BY_SHARED_OBJECT
        if shared is not None:
            try:
                compiled = shared_object.load(shared, self.prefix, self.name)
            except Exception as exc:  # the object itself may still load, through the DSL
                _log.info("kernel cache entry %s: its shared object did not load (%s: %s); loading its object "
                          "through the CuTe DSL", self.path, exc.__class__.__name__, _first_line(exc))
        if compiled is None:
            by = BY_DSL
            try:
                compiled = load_object(payload, self.call, self.prefix)
            except Exception as exc:  # the DSL refused the object: treat it as any bad entry
                return self._reject(f"the CuTe DSL could not load it: {exc.__class__.__name__}: {_first_line(exc)}")
        LOADED[self.name] = time.perf_counter() - t0
        LOADED_BY[self.name] = by
        return compiled

    def _reject(self, why: str) -> None:
        _log.warning("kernel cache entry %s is unusable (%s); compiling the kernel again", self.path, why)
        return None

    def store(self, compiled) -> None:
        """Write the compiled kernel as this entry; a failure costs one warning, not the kernel."""
        if not self._usable_dir():
            return
        t0 = time.perf_counter()
        try:
            payload = export_object(compiled, self.call, self.prefix)
            shared = link_shared(payload, self.prefix, self.name) if self.call == "tvm-ffi" else None
            write_atomic(self.path, encode(self.description, self.call, self.prefix, payload, shared))
        except Exception as exc:
            _log.warning("could not write kernel cache entry %s (%s: %s); the kernel is used from memory",
                         self.path, exc.__class__.__name__, _first_line(exc))
            return
        STORED[self.name] = time.perf_counter() - t0
        self._remove_orphans()

    def _remove_orphans(self) -> None:
        """Temporary files of this entry that a writer killed mid-write left behind (old enough
        that no live writer can still be writing them)."""
        cutoff = time.time() - ORPHAN_AGE_S
        for tmp in self.directory.glob(f".{self.name}.*.tmp"):
            with contextlib.suppress(OSError):
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""
