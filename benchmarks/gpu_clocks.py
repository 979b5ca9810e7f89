"""The SM clock and board power a GPU held while a block of timed work ran, sampled by nvidia-smi.

A GEMM's TFLOP/s follows the clock the GPU holds, and a GPU lowers its clock when a long run
draws the most power. A row timed under :class:`GpuClocks` carries the clock it ran at, so that
two rows (or two runs) are compared at the clocks they had:

    with GpuClocks(device) as clocks:
        times = time_interleaved(...)
    row.update(clocks.summary())   # {"sm_MHz": ..., "sm_MHz_min": ..., "power_W": ...} or {}

Importing this module needs neither torch nor a GPU; where nvidia-smi is missing the summary is
empty and the timing runs as without it.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from statistics import median
from typing import Optional


def parse_samples(text: str) -> list[tuple[float, Optional[float]]]:
    """(SM MHz, watts or None) per line of ``nvidia-smi --query-gpu=clocks.sm,power.draw
    --format=csv,noheader,nounits`` output; lines that are not two such numbers are skipped
    ("[N/A]" power counts as None)."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            mhz = float(parts[0])
        except ValueError:
            continue
        try:
            watts: Optional[float] = float(parts[1])
        except ValueError:
            watts = None
        samples.append((mhz, watts))
    return samples


def summarize(samples: list[tuple[float, Optional[float]]]) -> dict:
    """The median and lowest SM clock and the median power of ``samples``; {} for none."""
    if not samples:
        return {}
    out = {"sm_MHz": median(m for m, _ in samples), "sm_MHz_min": min(m for m, _ in samples),
           "clock_samples": len(samples)}
    watts = [w for _, w in samples if w is not None]
    if watts:
        out["power_W"] = median(watts)
    return out


def nvidia_smi_id(device=None) -> Optional[str]:
    """nvidia-smi's name for a torch CUDA device (default: the current one) by its UUID (indices
    differ under CUDA_VISIBLE_DEVICES), or None where torch does not give one."""
    try:
        import torch

        index = device if device is not None else torch.cuda.current_device()
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:  # noqa: BLE001 (no GPU, no torch: no id)
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"


class GpuClocks:
    """Samples the SM clock and power of one GPU every ``period_ms`` while the ``with`` block runs
    (an nvidia-smi process beside this one: nothing is added to the GPU's work)."""

    def __init__(self, device=None, period_ms: int = 50, command: str = "nvidia-smi"):
        if not isinstance(period_ms, int) or period_ms < 10:
            raise ValueError(f"period_ms must be an int >= 10, got {period_ms!r}")
        self.device, self.period_ms, self.command = device, period_ms, command
        self.samples: list[tuple[float, Optional[float]]] = []
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "GpuClocks":
        exe = shutil.which(self.command)
        if exe is None:
            return self
        gpu = nvidia_smi_id(self.device)
        if gpu is None:  # without the device's id every GPU would answer, their clocks mixed
            return self
        args = [exe, f"--id={gpu}", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                f"--loop-ms={self.period_ms}"]
        try:
            self._proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self._proc = None
        return self

    def __exit__(self, *exc) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGINT)  # nvidia-smi ends its loop and flushes what it sampled
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        self.samples = parse_samples(out or "")

    def summary(self) -> dict:
        return summarize(self.samples)
