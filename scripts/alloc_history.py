"""Where the caching allocator maps and unmaps memory in one recorded stretch (one training step),
from a ``torch.cuda.memory._snapshot()`` taken with ``torch.cuda.memory._record_memory_history``.

Under a cap (``set_per_process_memory_fraction``) with expandable segments, an allocation that no
cached block fits and that the cap leaves no room to map makes the allocator give its cached pages
back (unmapping waits for the stream) and map them again: the pauses this reports. Each burst of
unmaps is printed with the allocation that came next (the one that asked), its size, stream and
the frames of this package, TE and the benchmark that made it, and the host time until that
allocation was served.
"""

from __future__ import annotations

MiB = 2**20
_OWN_FRAMES = ("te_offload_ops", "transformer_engine", "moe_model", "moe_step")


def _frames(entry: dict, limit: int = 4) -> str:
    names = [f"{f.get('name', '?')}:{f.get('line', '?')}" for f in entry.get("frames") or []
             if any(k in (f.get("filename") or "") for k in _OWN_FRAMES)]
    return " < ".join(names[:limit]) or "-"


def bursts(trace: list[dict], action: str) -> list[dict]:
    """Consecutive runs of ``action`` in ``trace`` (one device's entries in order), each with its
    count, bytes, first time (us) and the next allocation after it (None if none came)."""
    out, i = [], 0
    while i < len(trace):
        if trace[i].get("action") != action:
            i += 1
            continue
        j = i
        while j < len(trace) and trace[j].get("action") == action:
            j += 1
        nxt = next((e for e in trace[j:] if e.get("action") == "alloc"), None)
        out.append({"count": j - i, "bytes": sum(e.get("size", 0) for e in trace[i:j]),
                    "time_us": trace[i].get("time_us"), "stream": trace[i].get("stream"), "next_alloc": nxt})
        i = j
    return out


def summarize(snapshot: dict, device: int = 0) -> list[str]:
    """Readable lines: counts per action, then every unmap burst (the allocator's retries) with the
    allocation it served, and the map bursts' total."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    if not trace:
        return ["no allocator events recorded"]
    t0 = trace[0].get("time_us") or 0
    counts: dict[str, int] = {}
    for e in trace:
        counts[e.get("action", "?")] = counts.get(e.get("action", "?"), 0) + 1
    lines = ["events: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))]
    for b in bursts(trace, "segment_unmap"):
        nxt = b["next_alloc"]
        ms = "?" if b["time_us"] is None else f"{(b['time_us'] - t0) / 1e3:.1f}"
        if nxt is None:
            lines.append(f"  at {ms} ms: {b['count']} unmaps, {b['bytes'] / MiB:.0f} MiB; no allocation after")
            continue
        took = "" if nxt.get("time_us") is None or b["time_us"] is None else \
            f", served {(nxt['time_us'] - b['time_us']) / 1e3:.1f} ms after the first unmap"
        lines.append(f"  at {ms} ms: {b['count']} unmaps, {b['bytes'] / MiB:.0f} MiB (stream {b['stream']}), "
                     f"for {nxt.get('size', 0) / MiB:.1f} MiB on stream {nxt.get('stream')}{took}: {_frames(nxt)}")
    maps = bursts(trace, "segment_map")
    if maps:
        lines.append(f"  maps: {len(maps)} bursts, {sum(b['bytes'] for b in maps) / MiB:.0f} MiB in all")
    for e in trace:
        if e.get("action") == "oom":
            lines.append(f"  out of memory asking {e.get('size', 0) / MiB:.1f} MiB: {_frames(e)}")
    return lines
