"""Files that readers in other processes see whole: written to a temporary file in the same
directory, flushed to disk, renamed over the target (``os.replace``)."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from pathlib import Path


@functools.lru_cache(maxsize=1)
def file_mode() -> int:
    """What ``open`` would give a new file under this process's umask (mkstemp gives 0600; a
    cache directory shared by a group keeps working)."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        umask = 0o022
    return 0o666 & ~umask


def write_atomic(path: Path, blob: bytes) -> None:
    """Write ``blob`` as ``path`` so that a reader sees the old file, the new one, or none: a
    temporary file in the same directory, flushed to disk, renamed over ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fchmod(f.fileno(), file_mode())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
