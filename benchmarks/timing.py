"""How the benchmarks time GPU work and read GPU memory: one module, so that every number they
report comes from the same methods.

Time:

* :func:`event_ms`: the median CUDA-event time per call, the host in the loop (what a caller
  that waits for each call sees);
* :func:`host_ahead` / :func:`host_ahead_ms`: GPU time per call while the host stays ahead of the
  GPU (as in a deep model where the host queues layer after layer): GPU work without host gaps;
* :func:`wall_ms`: host-clock time per call with the GPU synchronized at both ends;
* :class:`PhaseTimer`: CUDA events at the boundaries of a step's phases (forward, backward, ...);
* :func:`interleaved`: one sample of each contender per round, so clock and power drift hits them
  alike; medians over rounds (:func:`median`);
* :func:`kernel_times`: GPU time per kernel from torch.profiler.

Memory and copies: :func:`active_bytes` (in use now, or the most in use since
``torch.cuda.reset_peak_memory_stats()``: a step's peak); :func:`pcie_bandwidth` (pinned host memory,
each direction and both at once).

Importing this module needs neither torch nor a GPU; the functions that measure import torch.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional


def median(values) -> float:
    """The median of the finite values (NaN stands for a sample that could not be taken); NaN if none."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


# ------------------------------------------------------------------------------------------------
# Time


def event_ms(fn: Callable, iters: int, *, inner: int = 1, warmup: int = 1) -> float:
    """Median over ``iters`` samples of the CUDA-event time per call, each sample timing ``inner``
    back-to-back calls after ``warmup`` untimed ones. Host gaps between calls count."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return median(times)


@dataclass(frozen=True)
class Sample:
    gpu_ms: float  # GPU time per call
    host_us: float  # host time per call to queue the timed calls
    ahead: bool  # the GPU had not reached the timed calls when the host had queued them all
    host_unblocked: bool = False  # the GPU was still asleep when the host had queued them all: no
    # call waited for the GPU to make room in its launch queue, so host_us is the host's own time


def host_ahead(fn: Callable, calls: int = 10, *, lead: int = 3, hold: bool = True, tries: int = 4) -> Sample:
    """GPU time per call of ``fn`` with the host ahead of the GPU.

    ``lead`` untimed calls go first (the GPU works through them at the clocks of sustained load
    while the host queues the timed ones), then ``calls`` calls timed by CUDA events. With ``hold``
    a sleep kernel keeps the GPU busy while the host queues, doubled until the host finishes before
    the GPU wakes (at most ``tries`` times); without it the lead calls alone must keep the GPU busy, which keeps
    a short post-idle boost out of the timed span. ``ahead`` says whether it worked: where it did
    not, the GPU time may hold host gaps (``fn`` may wait for the GPU itself)."""
    import torch

    cycles = 20_000_000
    for attempt in range(tries if hold else 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        woke = torch.cuda.Event()
        if hold:
            torch.cuda._sleep(cycles)
        woke.record()
        for _ in range(lead):
            fn()
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        host_us = (time.perf_counter() - t0) / calls * 1e6
        ahead, unblocked = not start.query(), hold and not woke.query()
        end.record()
        end.synchronize()
        if (ahead and unblocked) or attempt == tries - 1 or not hold:
            return Sample(start.elapsed_time(end) / calls, host_us, ahead, unblocked)
        cycles *= 2
    raise AssertionError("unreachable")


def host_ahead_ms(fn: Callable, calls: int = 10, *, lead: int = 3) -> Optional[float]:
    """:func:`host_ahead`'s GPU ms per call (the GPU held by a sleep kernel), or None where the host
    never got ahead: ``fn`` waits for the GPU, so its wall time is already its best."""
    return host_and_gpu_ahead_ms(fn, calls, lead=lead)[1]


def host_and_gpu_ahead_ms(fn: Callable, calls: int = 10, *, lead: int = 3) -> tuple[Optional[float], Optional[float]]:
    """(host ms to queue one call, GPU ms per call) with the GPU held by a sleep kernel, or
    (None, None) where the host never got ahead (``fn`` waits for the GPU). The host figure is
    what a call costs the host alone (None where the GPU woke before the host was done: a call may
    then have waited for room in the launch queue): a step back to back takes the larger of the two."""
    import torch

    fn()
    torch.cuda.synchronize()
    sample = host_ahead(fn, calls, lead=lead, hold=True)
    if not sample.ahead:
        return None, None
    return (sample.host_us / 1e3 if sample.host_unblocked else None), sample.gpu_ms


def wall_ms(fn: Callable, calls: int) -> float:
    """Host-clock time per call of ``calls`` back-to-back calls, the GPU synchronized before and after."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / calls


class PhaseTimer:
    """CUDA events at the start of a step and at the end of each of its phases, read after one
    synchronize; the host clock over the same span.

        timer = PhaseTimer()
        forward(); timer.mark("fwd")
        backward(); timer.mark("bwd")
        times = timer.finish()   # {"fwd_ms", "bwd_ms", "gpu_ms", "wall_ms"}
    """

    def __init__(self):
        import torch

        self._torch = torch
        self._names: list[str] = []
        self._events = [torch.cuda.Event(enable_timing=True)]
        self._events[0].record()
        self._t0 = time.perf_counter()

    def mark(self, phase: str) -> None:
        event = self._torch.cuda.Event(enable_timing=True)
        event.record()
        self._names.append(phase)
        self._events.append(event)

    def finish(self) -> dict:
        self._torch.cuda.synchronize()
        wall = (time.perf_counter() - self._t0) * 1e3
        out = {f"{name}_ms": self._events[i].elapsed_time(self._events[i + 1]) for i, name in enumerate(self._names)}
        out["gpu_ms"] = self._events[0].elapsed_time(self._events[-1])
        out["wall_ms"] = wall
        return out


def interleaved(samplers: dict, rounds: int) -> dict:
    """``{label: [sample, ...]}``: ``rounds`` rounds, each taking one sample of every contender in
    turn (``samplers``: label -> a call returning one sample)."""
    samples = {label: [] for label in samplers}
    for _ in range(rounds):
        for label, take in samplers.items():
            samples[label].append(take())
    return samples


def kernel_times(fn: Callable, steps: int = 5, top: int = 12) -> list[dict]:
    """GPU time per kernel per call of ``fn`` from torch.profiler, averaged over ``steps`` calls
    after one untimed: ``{"kernel", "calls_per_step", "us_per_step"}``, longest first (``top``: how
    many; 0 for all)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dev_us > 0:
            rows.append({"kernel": ev.key[:90], "calls_per_step": ev.count / steps, "us_per_step": dev_us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top] if top else rows


# ------------------------------------------------------------------------------------------------
# Memory


def active_bytes(peak: bool = False) -> int:
    """GPU memory in use as the caching allocator sees it: blocks held by tensors plus blocks freed
    while a side stream still uses them (``record_stream``: an offload copy in flight), which
    ``memory_allocated`` counts as free already. ``peak``: the most since the peak was reset."""
    import torch

    if not peak:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # an allocation makes the allocator retire finished stream uses
    return torch.cuda.memory_stats()["active_bytes.all." + ("peak" if peak else "current")]


def pcie_bandwidth(nbytes: int = 1 << 29, reps: int = 5) -> dict:
    """GB/s host<->device with pinned memory: each direction alone, then both at once (median of ``reps``)."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty_like(host, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        main = torch.cuda.current_stream()
        for s in (s1, s2):
            s.wait_stream(main)
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)
        for s in (s1, s2):
            main.wait_stream(s)

    def gbps(fn) -> float:
        torch.cuda.synchronize()
        return nbytes / (event_ms(fn, reps, warmup=0) / 1e3) / 1e9

    out = {"d2h_GBps": gbps(lambda: host.copy_(dev, non_blocking=True)),
           "h2d_GBps": gbps(lambda: dev.copy_(host, non_blocking=True)),
           "bidirectional_each_GBps": gbps(both)}
    del dev, dev2, host, host2
    torch.cuda.empty_cache()
    return out
