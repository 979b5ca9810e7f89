"""One job of ``benchmarks/megatron_gpt.py`` in processes of its own: one process per rank
(``torchrun`` for several ranks, the script itself for one), its progress lines passed on, its
whole output kept (or its last lines shown where it fails), a time limit, and what each rank wrote.

A job's processes start with a fresh CUDA context and a fresh Megatron, so nothing one variant
allocates or installs (hooks, Megatron's offloading manager) reaches the next.

No torch here: tested with stand-in scripts (tests/test_megatron_gpt_bench.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Optional

PROGRESS = "[progress] "  # a worker's line the launcher shows
TAIL_LINES = 60


def progress(text: str) -> None:
    """A progress line from a worker, for the launcher to show."""
    print(PROGRESS + text, flush=True)


def command(script: Path, argv: list, ranks: int) -> list:
    """The command line of a job of ``ranks`` processes running ``script argv``."""
    if ranks == 1:
        return [sys.executable, str(script), *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(script),
            *argv]


def descendants(pid: int) -> list:
    """The processes below ``pid`` (children first), from /proc; [] where there is none to read."""
    children: dict = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile, or not a process's stat
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(0), [])
        found += below
        todo += below
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process below it with its own group: torchrun
    runs each rank in a process group of its own (setsid), so the ranks (and what they started) are
    outside torchrun's group, and a SIGKILL to torchrun alone leaves them running, holding their GPUs and
    the output pipe. The caller's own group is spared."""
    own = os.getpgrp()
    for target in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            group = os.getpgid(target)
            if group != own:
                os.killpg(group, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, signal.SIGKILL)


def run(cmd: list, out: Path, *, env: dict, cwd: Path, timeout: float, show: Callable[[str], None],
        log_path: Optional[Path] = None) -> dict:
    """Runs ``cmd`` (whose ranks write ``out/rank<r>.json``) to its end or ``timeout`` seconds
    (then it is killed with its ranks, :func:`kill_tree`); progress lines go to ``show``. Returns
    the ranks' results in rank order, the exit status, the seconds, whether it timed out, and its
    last lines."""
    tail = deque(maxlen=TAIL_LINES)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    expired = threading.Event()

    def kill():
        expired.set()
        kill_tree(proc.pid)

    timer = threading.Timer(timeout, kill)
    timer.start()
    log = open(log_path, "w") if log_path is not None else None
    try:
        for line in proc.stdout:
            tail.append(line)
            if log is not None:
                log.write(line)
            if line.startswith(PROGRESS):
                show(line[len(PROGRESS):].rstrip("\n"))
        rc = proc.wait()
    finally:
        timer.cancel()
        if log is not None:
            log.close()
    files = sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    per_rank = []
    for f in files:
        try:
            per_rank.append(json.loads(f.read_text()))
        except json.JSONDecodeError as exc:
            per_rank.append({"rank": int(f.stem[4:]), "error": f"unreadable result file: {exc}"})
    return {"per_rank": per_rank, "rc": rc, "seconds": time.monotonic() - start, "timed_out": expired.is_set(),
            "tail": "".join(tail)}


def failure(job: dict, ranks: int) -> Optional[str]:
    """Why a job gave no full result (None where every rank wrote one and it ended well)."""
    if job["timed_out"]:
        return f"ran past the time limit and was stopped ({len(job['per_rank'])} of {ranks} ranks wrote results)"
    # a rank that failed writes why and exits, and torchrun then stops the others before they write
    errors = [r["error"] for r in job["per_rank"] if "error" in r]
    if errors:
        return errors[0]
    if len(job["per_rank"]) < ranks:
        return f"{len(job['per_rank'])} of {ranks} ranks wrote results (exit status {job['rc']})"
    if job["rc"] != 0:
        return f"the processes ended with exit status {job['rc']}"
    return None
