"""Where a training step's time goes, from torch.profiler's events: moe_step.py's ``--profile`` mode.

Two halves. The analysis (``Event``, ``events_from_trace``, ``analyze_step``, ``summarize``,
``markdown``, ``chart``) is pure: it takes plain event records and needs neither torch nor a GPU,
so CPU tests check it on synthetic events. The capture (``profile_steps``, ``phase_mark``,
``layer_marks``) runs steps under torch.profiler with CUDA activities and hands back those records.

What the analysis derives, per step (all from the events, nothing estimated):

* forward / backward / optimizer: the host span of each phase's annotation, and its GPU span (first
  start to last end of the GPU work launched while the phase ran, on any stream and host thread);
* the compute stream (the one with the most kernel time): busy time, the union of its kernels,
  copies and memsets;
* copies by direction (D2H, H2D, D2D): count, bytes, time, achieved GB/s (bytes over the time
  any copy of that direction was in flight), and how much of that time compute-stream kernels ran;
* the compute stream's idle gaps, each split into a host part (the next op was not yet launched
  when the stream ran dry: the host was busy, or blocked in a synchronizing call) and a device part
  (it was launched in time but started late: waiting on another stream's copy or kernel, found as
  the work on another stream that ended just before it started, on the streams a "Stream Wait
  Event" names where the trace has them);
* per layer: its forward and backward on the compute stream, and the D2H and H2D copies launched
  while it ran (a copy belongs to the layer during whose forward or backward it was queued).

A layer's backward is found through autograd's sequence numbers: backward ops carry the number of
the forward op they differentiate, and each layer's forward is annotated.
"""

from __future__ import annotations

import bisect
import contextlib
import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

STEP_MARK = "teo_step"
PHASE_MARK = "teo_phase"
LAYER_MARK = "teo_layer"
PHASES = ("forward", "backward", "optimizer")
GPU_KINDS = ("kernel", "memcpy", "memset")
DIRECTIONS = ("d2h", "h2d", "d2d")

# Host calls that block until the GPU has done something (a .tolist() or .item() ends in one).
HOST_SYNC_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2",
})
HOST_SYNC_KINDS = frozenset({"Stream Sync", "Event Sync", "Context Sync"})  # CUPTI's names, kind "sync"
STREAM_WAIT = "Stream Wait Event"

# A kernel launched in time starts within a few microseconds of the one before it ends; an op that
# waited on another stream starts within a few microseconds of that stream's work ending.
LAUNCH_LATENCY_US = 5.0
WAIT_MATCH_US = 20.0
MIN_GAP_US = 5.0


@dataclass(frozen=True)
class Event:
    """One profiler record. Times in microseconds on one clock (torch.profiler aligns host and GPU).

    kind: "kernel", "memcpy", "memset" (GPU, with ``stream``); "runtime" (a CUDA runtime or driver
    call, with ``tid``), "cpu_op", "annotation" (record_function ranges), "sync" (CUPTI's
    synchronization records: ``stream`` and, for a stream wait, ``wait_on_stream``).
    ``corr`` links a runtime call to the GPU op it launched; ``seq`` is autograd's sequence number.
    """

    kind: str
    name: str
    start: float
    dur: float
    stream: Optional[int] = None
    tid: Optional[int] = None
    corr: Optional[int] = None
    nbytes: int = 0
    seq: Optional[int] = None
    wait_on_stream: Optional[int] = None

    @property
    def end(self) -> float:
        return self.start + self.dur

    @property
    def direction(self) -> Optional[str]:
        return copy_direction(self.name) if self.kind == "memcpy" else None


def copy_direction(name: str) -> Optional[str]:
    """ "Memcpy DtoH (Device -> Pinned)" -> "d2h"; CUPTI names copies by their endpoints."""
    m = re.search(r"\b([DHP])to([DHP])\b", name)
    if not m:
        return None
    ends = {"D": "d", "H": "h", "P": "d"}  # P: peer device
    return f"{ends[m.group(1)]}2{ends[m.group(2)]}"


# ------------------------------------------------------------------------------------------------
# Chrome trace -> events

_CATEGORIES = {
    "kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset", "cuda_runtime": "runtime",
    "cuda_driver": "runtime", "cpu_op": "cpu_op", "user_annotation": "annotation", "cuda_sync": "sync",
}


def _int(value) -> Optional[int]:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def events_from_trace(trace: dict) -> list[Event]:
    """Events of a chrome trace as torch.profiler exports it (complete events, "ph": "X")."""
    out = []
    for e in trace.get("traceEvents", []):
        kind = _CATEGORIES.get(e.get("cat"))
        if kind is None or e.get("ph") != "X" or "ts" not in e:
            continue
        args = e.get("args") or {}
        gpu = kind in GPU_KINDS or kind == "sync"
        out.append(Event(
            kind=kind, name=str(e.get("name", "")), start=float(e["ts"]), dur=float(e.get("dur", 0.0)),
            stream=_int(args.get("stream")) if gpu else None,
            tid=None if kind in GPU_KINDS else _int(e.get("tid")),
            corr=_int(args.get("correlation")), nbytes=_int(args.get("bytes")) or 0,
            seq=_int(args.get("Sequence number")), wait_on_stream=_int(args.get("wait_on_stream")),
        ))
    out.sort(key=lambda ev: (ev.start, -ev.dur))
    return out


def load_trace(path: Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------
# Intervals


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, merged, non-empty intervals."""
    merged: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    return sum(e - s for s, e in union(intervals))


def overlap(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> float:
    """Time covered by both sets of intervals."""
    ua, ub = union(a), union(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(0.0, hi - lo)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def clip(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def gaps(busy: Sequence[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of [lo, hi] that ``busy`` (merged) leaves uncovered."""
    out, at = [], lo
    for s, e in clip(union(busy), lo, hi):
        if s > at:
            out.append((at, s))
        at = max(at, e)
    if at < hi:
        out.append((at, hi))
    return out


# ------------------------------------------------------------------------------------------------
# Host-side lookups


class HostIndex:
    """Which host ranges contain a moment on a thread: cpu ops (innermost first) by nesting."""

    def __init__(self, events: Sequence[Event]):
        self.by_tid: dict[int, tuple[list[float], list[Event], list[int]]] = {}
        per_tid: dict[int, list[Event]] = {}
        for e in events:
            if e.kind == "cpu_op" and e.tid is not None:
                per_tid.setdefault(e.tid, []).append(e)
        for tid, ops in per_tid.items():
            ops.sort(key=lambda e: (e.start, -e.dur))
            parent, stack = [], []
            for i, op in enumerate(ops):
                while stack and ops[stack[-1]].end < op.end:
                    stack.pop()
                parent.append(stack[-1] if stack else -1)
                stack.append(i)
            self.by_tid[tid] = ([op.start for op in ops], ops, parent)

    def chain(self, tid: Optional[int], at: float) -> list[str]:
        """Names of the cpu ops containing ``at`` on ``tid``, outermost first."""
        if tid not in self.by_tid:
            return []
        starts, ops, parent = self.by_tid[tid]
        i = bisect.bisect_right(starts, at) - 1
        names = []
        while i >= 0:
            if ops[i].end >= at:
                names.append(ops[i].name)
            i = parent[i]
        return names[::-1]


def _context(chain: list[str]) -> str:
    """The outermost op and the two innermost: enough to say where the host was."""
    if len(chain) > 3:
        chain = [chain[0], "...", *chain[-2:]]
    return " > ".join(chain) if chain else "(no cpu op)"


# ------------------------------------------------------------------------------------------------
# One step


def _range(events: Sequence[Event], name: str) -> list[Event]:
    return [e for e in events if e.kind == "annotation" and e.name == name]


def _within(e: Event, outer: Event) -> bool:
    return outer.start <= e.start and e.end <= outer.end


def default_compute_stream(events: Sequence[Event]) -> Optional[int]:
    """The stream with the most kernel time."""
    time: dict[int, float] = {}
    for e in events:
        if e.kind == "kernel" and e.stream is not None:
            time[e.stream] = time.get(e.stream, 0.0) + e.dur
    return max(time, key=time.get) if time else None


def _launch_phase(launch: Optional[Event], phases: dict[str, Event]) -> Optional[str]:
    if launch is None:
        return None
    return next((p for p, r in phases.items() if r.start <= launch.start <= r.end), None)


def _copy_stats(copies: list[Event], compute_kernels: list[tuple[float, float]], compute_stream: int) -> dict:
    spans = [(c.start, c.end) for c in copies]
    off_stream = [(c.start, c.end) for c in copies if c.stream != compute_stream]
    busy = length(spans)
    nbytes = sum(c.nbytes for c in copies)
    covered = overlap(off_stream, compute_kernels)
    side_busy = length(off_stream)
    return {
        "count": len(copies), "bytes": nbytes, "MiB": nbytes / 2**20,
        "time_ms": sum(c.dur for c in copies) / 1e3, "busy_ms": busy / 1e3,
        "GBps": nbytes / busy / 1e3 if busy else None,
        "on_compute_stream": sum(c.stream == compute_stream for c in copies),
        "overlap_compute_ms": covered / 1e3,
        "overlap_fraction": covered / side_busy if side_busy else None,
    }


def _wait_target(t0: float, t1: float, others: list[Event], streams: Optional[set]) -> Optional[Event]:
    """The work on another stream that ended last before ``t1``, inside the gap, just before it."""
    best = None
    for e in others:
        if streams and e.stream not in streams:
            continue
        if t0 <= e.end <= t1 + LAUNCH_LATENCY_US and t1 - e.end <= WAIT_MATCH_US and (best is None or e.end > best.end):
            best = e
    return best


def _op_label(e: Event) -> str:
    if e.kind == "memcpy":
        return f"{(e.direction or 'other').upper()} copy"
    return f"{e.kind} on stream {e.stream}"


def attribute_gap(t0: float, t1: float, nxt: Optional[Event], launch: Optional[Event], *,
                  others: list[Event], host_syncs: list[Event], stream_waits: list[Event],
                  prev_launch: Optional[float], hosts: Optional[HostIndex] = None) -> dict:
    """Why the compute stream sat idle in [t0, t1] before op ``nxt`` (None: the step's tail).

    Host part: from t0 until the host issued ``nxt`` (its launch call's start), "host: blocked in a
    sync" where a synchronizing call overlapped that part, else "host: busy". Device part: the rest;
    "wait: <the op>" where another stream's work ended just before ``nxt`` started (among the
    streams the compute stream was told to wait on between the previous launch and this one, where
    the trace records those waits), else "launch latency" (short) or "device: unexplained".
    """
    gap = t1 - t0
    out = {"start": t0, "dur": gap, "next": nxt.name if nxt else None}
    if nxt is None:  # nothing more on the compute stream: the step waits for other streams' work
        last = max((e for e in others if e.end > t0), key=lambda e: e.end, default=None)
        out["parts"] = {f"tail: {_op_label(last)}" if last else "tail": gap}
        return out
    if launch is None:
        out["parts"] = {"unknown (no launch record)": gap}
        return out
    host = min(max(launch.start - t0, 0.0), gap)
    parts: dict[str, float] = {}
    if host > 0:
        blocked = next((s for s in host_syncs if s.start < t0 + host and s.end > t0), None)
        parts["host: blocked in " + blocked.name if blocked else "host: busy"] = host
        if hosts is not None:
            out["launched_from"] = _context(hosts.chain(launch.tid, launch.start))
    device = gap - host
    if device > 0:
        lo = prev_launch if prev_launch is not None else t0 - 1e9
        waited = {w.wait_on_stream for w in stream_waits if lo <= w.start <= launch.start and w.wait_on_stream is not None}
        target = _wait_target(t0, t1, others, waited or None)
        if target is not None:
            parts[f"wait: {_op_label(target)}"] = device
        elif device <= LAUNCH_LATENCY_US:
            parts["launch latency"] = device
        else:
            parts["device: unexplained"] = device
    out["parts"] = parts
    return out


def _layer_runs(events: Sequence[Event], step: Event, main_tid: Optional[int]) -> tuple[dict, dict]:
    """Forward annotations per layer, and per layer the backward ops (autograd's evaluate_function
    ranges whose sequence number falls in that layer's forward range of numbers)."""
    fwd = {}
    for e in events:
        if e.kind == "annotation" and e.name.startswith(LAYER_MARK + " ") and _within(e, step):
            fwd[int(e.name.split()[1])] = e
    first_seq = {}
    for i, r in fwd.items():
        seqs = [e.seq for e in events if e.kind == "cpu_op" and e.seq is not None and e.seq >= 0
                and _within(e, r) and (main_tid is None or e.tid == main_tid)]
        if seqs:
            first_seq[i] = min(seqs)
    bounds = sorted((s, i) for i, s in first_seq.items())
    bwd: dict[int, list[Event]] = {}
    if bounds:
        starts = [s for s, _ in bounds]
        for e in events:
            if (e.kind == "cpu_op" and e.seq is not None and e.name.startswith("autograd::engine::evaluate_function")
                    and _within(e, step)):
                k = bisect.bisect_right(starts, e.seq) - 1
                if k >= 0:
                    bwd.setdefault(bounds[k][1], []).append(e)
    return fwd, bwd


def _layer_owner(ops: list[Event], launch_of: dict, fwd: dict, bwd: dict) -> dict:
    """id(op) -> (layer, "fwd" or "bwd"): the layer whose forward annotation, or one of whose
    backward ops, was running on the launching thread when the op was launched."""
    ranges: dict[Optional[int], list[tuple[float, float, tuple]]] = {}
    for i, r in fwd.items():
        ranges.setdefault(r.tid, []).append((r.start, r.end, (i, "fwd")))
    for i, rs in bwd.items():
        for r in rs:
            ranges.setdefault(r.tid, []).append((r.start, r.end, (i, "bwd")))
    index = {tid: (sorted(rs), [s for s, _, _ in sorted(rs)]) for tid, rs in ranges.items()}
    owner = {}
    for op in ops:
        launch = launch_of[id(op)]
        if launch is None or launch.tid not in index:
            continue
        rs, starts = index[launch.tid]
        k = bisect.bisect_right(starts, launch.start) - 1
        for j in range(k, max(k - 4, -1), -1):  # the latest range first; a few back where ranges nest
            if rs[j][0] <= launch.start <= rs[j][1]:
                owner[id(op)] = rs[j][2]
                break
    return owner


def analyze_step(events: Sequence[Event], step_name: str, compute_stream: Optional[int] = None,
                 min_gap_us: float = MIN_GAP_US, top_gaps: int = 10) -> dict:
    """The breakdown of one annotated step (``step_name``: its record_function range)."""
    [step] = _range(events, step_name) or [None]
    if step is None:
        raise ValueError(f"no annotation {step_name!r} in the events")
    if compute_stream is None:
        compute_stream = default_compute_stream(events)
    phases = {}
    for p in PHASES:
        found = [e for e in _range(events, f"{PHASE_MARK} {p}") if _within(e, step)]
        if found:
            phases[p] = found[0]
    main_tid = step.tid
    launches = {e.corr: e for e in events if e.kind == "runtime" and e.corr is not None}
    ops = [e for e in events if e.kind in GPU_KINDS]
    launch_of = {id(e): launches.get(e.corr) for e in ops}
    in_step = [e for e in ops if (lau := launch_of[id(e)]) is not None and step.start <= lau.start <= step.end]
    if not in_step:
        raise ValueError(f"no GPU work launched during {step_name!r}")
    lo, hi = min(e.start for e in in_step), max(e.end for e in in_step)
    ms = lambda t: (t - lo) / 1e3  # noqa: E731  (times relative to the step's first GPU op)

    compute = [e for e in in_step if e.stream == compute_stream]
    others = [e for e in in_step if e.stream != compute_stream]
    compute_busy = union((e.start, e.end) for e in compute)
    compute_kernels = union((e.start, e.end) for e in compute if e.kind == "kernel")

    # busy splits into kernels and the stream's own copies (copies keep the compute stream busy
    # though no kernel runs)
    compute_copies = union((e.start, e.end) for e in compute if e.kind == "memcpy")
    result = {"step": step_name, "compute_stream": compute_stream, "host_ms": step.dur / 1e3,
              "gpu_ms": (hi - lo) / 1e3, "compute_busy_ms": length(compute_busy) / 1e3,
              "compute_kernels_ms": length(compute_kernels) / 1e3, "compute_copies_ms": length(compute_copies) / 1e3}
    result["compute_busy_fraction"] = result["compute_busy_ms"] / result["gpu_ms"] if hi > lo else None

    # phases: host span, GPU span of what they launched, compute busy within
    by_phase: dict[str, list[Event]] = {p: [] for p in phases}
    for e in in_step:
        p = _launch_phase(launch_of[id(e)], phases)
        if p:
            by_phase[p].append(e)
    result["phases"] = {}
    for p, r in phases.items():
        mine = by_phase[p]
        row = {"host_start_ms": ms(r.start), "host_ms": r.dur / 1e3}
        if mine:
            s, t = min(e.start for e in mine), max(e.end for e in mine)
            busy = length((e.start, e.end) for e in mine if e.stream == compute_stream)
            row.update({"gpu_start_ms": ms(s), "gpu_end_ms": ms(t), "gpu_ms": (t - s) / 1e3, "compute_busy_ms": busy / 1e3})
        result["phases"][p] = row

    # copies by direction
    copies = [e for e in in_step if e.kind == "memcpy"]
    result["copies"] = {d: _copy_stats([c for c in copies if c.direction == d], compute_kernels, compute_stream)
                        for d in DIRECTIONS if any(c.direction == d for c in copies)}
    for d, stats in result["copies"].items():
        stats["by_phase_MiB"] = {p: sum(c.nbytes for c in by_phase[p] if c.direction == d) / 2**20 for p in by_phase}

    # the compute stream's idle gaps, each attributed
    host_syncs = [e for e in events if (e.kind == "runtime" and e.name in HOST_SYNC_CALLS)
                  or (e.kind == "sync" and e.name in HOST_SYNC_KINDS)]
    stream_waits = [e for e in events if e.kind == "sync" and e.name == STREAM_WAIT and e.stream == compute_stream]
    hosts = HostIndex([e for e in events if e.kind == "cpu_op" and step.start <= e.start <= step.end])
    starts = sorted(compute, key=lambda e: e.start)
    start_times = [e.start for e in starts]
    totals: dict[str, dict[str, float]] = {}
    listed, short = [], {}
    for t0, t1 in gaps(compute_busy, lo, hi):
        k = bisect.bisect_left(start_times, t1 - 1e-6)
        nxt = starts[k] if k < len(starts) and abs(starts[k].start - t1) < 1e-3 else None
        launch = launch_of[id(nxt)] if nxt is not None else None
        before = launch_of[id(starts[k - 1])] if k > 0 else None  # the op the stream ran before the gap
        prev_launch = before.start if before is not None else None
        phase = "tail" if nxt is None else _launch_phase(launch, phases) or "outside phases"
        if t1 - t0 < min_gap_us:
            short[phase] = short.get(phase, 0.0) + (t1 - t0)
            continue
        g = attribute_gap(t0, t1, nxt, launch, others=others, host_syncs=host_syncs, stream_waits=stream_waits,
                          prev_launch=prev_launch, hosts=hosts)
        g["phase"] = phase
        for cause, us in g["parts"].items():
            totals.setdefault(phase, {})
            totals[phase][cause] = totals[phase].get(cause, 0.0) + us / 1e3
        listed.append(g)
    for phase, us in short.items():
        totals.setdefault(phase, {})[f"gaps < {min_gap_us:g} us"] = us / 1e3
    result["idle_ms"] = {p: dict(sorted(c.items(), key=lambda kv: -kv[1])) for p, c in totals.items()}
    result["idle_total_ms"] = {p: sum(c.values()) for p, c in totals.items()}
    groups: dict[tuple, dict] = {}
    for g in listed:
        for cause, us in g["parts"].items():
            key = (g["phase"], cause, g.get("launched_from", "") if cause.startswith("host") else "")
            entry = groups.setdefault(key, {"phase": key[0], "cause": cause, "launched_from": key[2], "count": 0, "ms": 0.0})
            entry["count"] += 1
            entry["ms"] += us / 1e3
    result["gap_groups"] = sorted(groups.values(), key=lambda g: -g["ms"])[:top_gaps]
    result["largest_gaps"] = [
        {"phase": g["phase"], "start_ms": ms(g["start"]), "ms": g["dur"] / 1e3, "next": g["next"],
         "parts_ms": {c: us / 1e3 for c, us in g["parts"].items()}, "launched_from": g.get("launched_from")}
        for g in sorted(listed, key=lambda g: -g["dur"])[:top_gaps]]

    # per layer: compute and the copies launched while it ran
    fwd, bwd = _layer_runs(events, step, main_tid)
    owner = _layer_owner(in_step, launch_of, fwd, bwd)
    layers = []
    for i in sorted(fwd):
        row = {"layer": i}
        for part in ("fwd", "bwd"):
            mine = [e for e in in_step if owner.get(id(e)) == (i, part)]
            comp = [(e.start, e.end) for e in mine if e.stream == compute_stream]
            entry = {}
            if comp:
                s, t = min(c[0] for c in comp), max(c[1] for c in comp)
                entry = {"start_ms": ms(s), "end_ms": ms(t), "busy_ms": length(comp) / 1e3,
                         "idle_ms": (t - s - length(comp)) / 1e3}
            for d in ("d2h", "h2d"):
                cs = [e for e in mine if e.kind == "memcpy" and e.direction == d and e.stream != compute_stream]
                if cs:
                    s, t = min(c.start for c in cs), max(c.end for c in cs)
                    entry[d] = {"MiB": sum(c.nbytes for c in cs) / 2**20, "start_ms": ms(s), "end_ms": ms(t),
                                "busy_ms": length((c.start, c.end) for c in cs) / 1e3,
                                "overlap_compute_ms": overlap([(c.start, c.end) for c in cs], compute_kernels) / 1e3}
            row[part] = entry
        layers.append(row)
    result["layers"] = layers

    # the timeline for the chart: merged busy intervals per row, in ms from the step's start
    rows = {"compute": compute_busy}
    for d in ("d2h", "h2d"):
        rows[d.upper()] = union((c.start, c.end) for c in copies if c.direction == d and c.stream != compute_stream)
    result["timeline"] = {name: [[round(ms(s), 4), round((e - s) / 1e3, 4)] for s, e in iv] for name, iv in rows.items()}
    return result


def _mean_tree(items: list):
    """Mean of numbers at the same keys of several dicts (missing numbers count as 0); lists dropped."""
    if all(isinstance(x, dict) for x in items):
        keys = {k for x in items for k in x}
        out = {}
        for k in keys:
            vals = [x.get(k) for x in items]
            nums = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if nums and len(nums) == sum(v is not None for v in vals):
                out[k] = sum(nums) / len(items)
            elif all(v is None for v in vals):  # e.g. an overlap fraction of copies that never ran
                out[k] = None
            elif all(isinstance(v, dict) or v is None for v in vals):
                out[k] = _mean_tree([v or {} for v in vals])
        return out
    return None


def summarize(steps: list[dict]) -> dict:
    """The mean over steps of every number that is not per-gap or per-layer detail."""
    keep = ("host_ms", "gpu_ms", "compute_busy_ms", "compute_kernels_ms", "compute_copies_ms", "compute_busy_fraction",
            "phases", "copies", "idle_ms", "idle_total_ms")
    return _mean_tree([{k: s[k] for k in keep if k in s} for s in steps])


# ------------------------------------------------------------------------------------------------
# Reports


def _f(v, fmt=".2f") -> str:
    return "-" if v is None else format(v, fmt)


def profile_markdown(p: dict) -> list[str]:
    """Tables for one engine + policy profile (``p``: {"engine", "policy", "steps", "mean", ...})."""
    head = f"### {p['engine']}, {p['policy']}"
    if p.get("error"):
        return [head, "", f"did not run: {p['error']}", ""]
    m, steps = p["mean"], p["steps"]
    lines = [head, "",
             f"Mean of {len(steps)} profiled steps. Step on the GPU {_f(m.get('gpu_ms'))} ms (host "
             f"{_f(m.get('host_ms'))} ms); compute stream (#{steps[0]['compute_stream']}) busy "
             f"{_f(m.get('compute_busy_ms'))} ms = {_f(100 * (m.get('compute_busy_fraction') or 0), '.1f')}%.", "",
             "| phase | host ms | GPU span ms | compute busy ms | idle ms |", "|---|---|---|---|---|"]
    for ph in PHASES:
        r = m.get("phases", {}).get(ph)
        if r:
            lines.append(f"| {ph} | {_f(r.get('host_ms'))} | {_f(r.get('gpu_ms'))} | {_f(r.get('compute_busy_ms'))} | "
                         f"{_f(m.get('idle_total_ms', {}).get(ph))} |")
    lines += ["", "| copies | count | MiB | busy ms | GB/s | overlap with compute kernels | on compute stream |",
              "|---|---|---|---|---|---|---|"]
    for d, c in m.get("copies", {}).items():
        frac = c.get("overlap_fraction")
        lines.append(f"| {d.upper()} | {c['count']:.0f} | {c['MiB']:.1f} | {c['busy_ms']:.2f} | {_f(c.get('GBps'), '.1f')} | "
                     f"{_f(c.get('overlap_compute_ms'))} ms ({_f(None if frac is None else 100 * frac, '.0f')}%) | "
                     f"{c['on_compute_stream']:.0f} |")
    lines += ["", "Compute stream idle, by cause (ms per step):", "", "| phase | cause | ms |", "|---|---|---|"]
    for ph, causes in m.get("idle_ms", {}).items():
        for cause, v in causes.items():
            lines.append(f"| {ph} | {cause} | {v:.3f} |")
    first = steps[0]
    lines += ["", f"Largest gap groups ({first['step']}): where the host was when it issued the op after the gap.", "",
              "| phase | cause | host was in | gaps | ms |", "|---|---|---|---|---|"]
    for g in first["gap_groups"]:
        lines.append(f"| {g['phase']} | {g['cause']} | {g['launched_from'] or '-'} | {g['count']} | {g['ms']:.3f} |")
    lines += ["", f"Per layer ({first['step']}; ms from the step's first GPU op; copies by the layer that queued them):", "",
              "| layer | fwd start-end | fwd busy / idle | D2H MiB | D2H start-end | D2H overlap | bwd start-end | "
              "bwd busy / idle | H2D MiB | H2D start-end | H2D overlap |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in first["layers"]:
        cells = [str(row["layer"])]
        for part, d in (("fwd", "d2h"), ("bwd", "h2d")):
            e = row.get(part, {})
            c = e.get(d, {})
            cells += [f"{_f(e.get('start_ms'))}-{_f(e.get('end_ms'))}" if "start_ms" in e else "-",
                      f"{_f(e.get('busy_ms'))} / {_f(e.get('idle_ms'))}",
                      _f(c.get("MiB"), ".1f"), f"{_f(c.get('start_ms'))}-{_f(c.get('end_ms'))}" if c else "-",
                      _f(c.get("overlap_compute_ms"))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def markdown(result: dict) -> str:
    lines = [f"# Where the MoE step's time goes, {result['gpu']} ({result['date']})", "",
             "From torch.profiler (CUDA activities), after warm-up. GPU span: first start to last end of the work "
             "a phase launched. Idle: the compute stream's gaps inside the step; host = the op after the gap "
             "was not yet launched when the stream ran dry; wait = it was launched but started when another "
             "stream's work ended; launch latency = under "
             f"{LAUNCH_LATENCY_US:g} us. A gap counts toward the phase of the op that ends it (the gap before the "
             "optimizer's first kernel is the optimizer's); \"tail\": after the compute stream's last op. Copies' overlap: time any copy of that direction ran beside a "
             "compute-stream kernel.", ""]
    for engine, bw in result.get("pcie", {}).items():
        lines.append(f"- {engine} process: pinned copies alone reach D2H {bw['d2h_GBps']:.1f} GB/s, "
                     f"H2D {bw['h2d_GBps']:.1f} GB/s, both at once {bw['bidirectional_each_GBps']:.1f} GB/s each")
    lines.append("")
    for shape in result["shapes"]:
        lines += [f"## {shape['name']}: {shape['layers']} layers, {shape['batch']} x {shape['seq']} tokens, "
                  f"MLP path {shape.get('path')}", ""]
        for engine, error in shape.get("failed", {}).items():
            lines += [f"- {engine}: could not build and run the model: {error}", ""]
        for p in shape["profiles"]:
            lines += profile_markdown(p)
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> bool:
    """One panel per profile: compute, D2H and H2D busy along one step, layers shaded."""
    from bench_common import pyplot, save_png

    plt = pyplot()
    profiles = [(s["name"], p) for s in result["shapes"] for p in s["profiles"] if not p.get("error")]
    if plt is None or not profiles:
        return False
    fig, axes = plt.subplots(len(profiles), 1, figsize=(14, 2.4 * len(profiles) + 0.6), squeeze=False)
    rows = ("compute", "D2H", "H2D")
    colors = {"compute": "tab:blue", "D2H": "tab:orange", "H2D": "tab:green"}
    for ax, (shape, p) in zip(axes[:, 0], profiles):
        step = p["steps"][0]
        for y, name in enumerate(rows):
            spans = step["timeline"].get(name, [])
            ax.broken_barh([tuple(s) for s in spans], (y - 0.35, 0.7), color=colors[name])
        for row in step["layers"]:
            for part, shade in (("fwd", "0.85"), ("bwd", "0.92")):
                e = row.get(part) or {}
                if "start_ms" in e:
                    ax.axvspan(e["start_ms"], e["end_ms"], color=shade if row["layer"] % 2 else "0.97", zorder=0)
                    ax.text((e["start_ms"] + e["end_ms"]) / 2, len(rows) - 0.45, f"L{row['layer']} {part}",
                            ha="center", va="bottom", fontsize=7)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_ylim(-0.6, len(rows) + 0.1)
        ax.set_xlim(0, step["gpu_ms"])
        ax.set_title(f"{shape}: {p['engine']}, {p['policy']} ({step['step']}, compute busy "
                     f"{100 * (step['compute_busy_fraction'] or 0):.0f}% of {step['gpu_ms']:.1f} ms)", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the step's first GPU op")
    fig.suptitle(f"MoE step timeline, {result['gpu']}", fontsize=10)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------
# Capture (torch; a GPU to see CUDA activity)


def phase_mark(name: str):
    """The annotation that names a phase of a step."""
    from torch.profiler import record_function

    return record_function(f"{PHASE_MARK} {name}")


@contextlib.contextmanager
def layer_marks(layers: Sequence):
    """Annotates each layer's forward ("teo_layer <i>") through forward hooks, removed on exit."""
    from torch.profiler import record_function

    handles, open_marks = [], {}
    for i, layer in enumerate(layers):
        def enter(_module, _args, i=i):
            open_marks[i] = record_function(f"{LAYER_MARK} {i}")
            open_marks[i].__enter__()

        def leave(_module, _args, _out, i=i):
            mark = open_marks.pop(i, None)
            if mark is not None:
                mark.__exit__(None, None, None)

        handles += [layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for mark in open_marks.values():  # a forward that raised
            mark.__exit__(None, None, None)


def profiler_config():
    """CUPTI's synchronization records (stream waits, host syncs) where this torch offers them."""
    import torch

    try:
        return torch.profiler._ExperimentalConfig(enable_cuda_sync_events=True)
    except (AttributeError, TypeError):
        return None


def profile_steps(step: Callable[[], None], layers: Sequence, steps: int, trace_path: Path,
                  cuda: bool = True) -> list[str]:
    """Runs one untraced step and then ``steps`` traced ones under torch.profiler (CPU + CUDA),
    each annotated "teo_step <k>", with the layers' forwards annotated; writes the chrome trace to
    ``trace_path`` (gzip if it ends in .gz). Returns the step annotations recorded. ``cuda=False``
    records host activity only (what the CPU tests can check)."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    kwargs = {}
    config = profiler_config()
    if config is not None:
        kwargs["experimental_config"] = config
    names = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with layer_marks(layers), profile(activities=activities,
                                      schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
                                      on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace_path)),
                                      **kwargs) as prof:
        for k in range(steps + 1):  # the profiler's warm-up step first: CUPTI's set-up stays out of the record
            name = f"{STEP_MARK} {k}"
            with record_function(name):
                step()
            if k:
                names.append(name)
            prof.step()
    return names


def analyze_trace(trace_path: Path, step_names: list[str]) -> dict:
    """Per-step breakdowns and their mean, from a trace ``profile_steps`` wrote."""
    events = events_from_trace(load_trace(trace_path))
    compute = default_compute_stream(events)
    steps = [analyze_step(events, name, compute) for name in step_names]
    return {"steps": steps, "mean": summarize(steps), "sync_records": any(e.kind == "sync" for e in events)}
