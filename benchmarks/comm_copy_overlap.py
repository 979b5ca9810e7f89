"""Where offload copies and NCCL's kernels meet, from a torch.profiler chrome trace.

:func:`analyze` takes the trace's events (``prof.export_chrome_trace``'s ``traceEvents``) and
returns, in ms per profiled step:

* ``nccl_ms``: time some NCCL kernel (the all-to-alls, the grads' reduce-scatter) runs;
* ``offload_d2h_ms`` / ``offload_h2d_ms``: time the copy engines move offload copies (copies of
  at least ``small_bytes``) each way, and ``overlap_ms``: how much of that runs beside NCCL;
* ``small_d2h``: the small copies to the host (the token dispatcher's split sizes, which the
  host waits for before it can start the all-to-all): how many, how long each waited on the GPU
  between its launch returning and its start, and how much of that wait fell while an offload
  copy to the host was running (the copy engine busy with it: a wait on the all-to-all's path);
* ``kernel_dtoh``: the same for the dispatcher's split sizes written to the host by a kernel
  (``te_offload_ops.megatron.use_kernel_dtoh``), found by their kernel's name.

Pure functions over dicts: tested on synthetic events (tests/test_megatron_gpt_bench.py).
"""

from __future__ import annotations

from typing import Optional

from step_profile import length, union  # the step profile's interval arithmetic

SMALL_COPY_BYTES = 1 << 20
KERNEL_DTOH_NAME = "_splits_to_host"  # the Triton kernel of te_offload_ops.megatron.dispatch_sync


def intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two merged interval lists."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def copy_direction(name: str) -> Optional[str]:
    """"d2h" / "h2d" for a memcpy event's name ("Memcpy DtoH (Device -> Pinned)"), else None."""
    if "DtoH" in name:
        return "d2h"
    if "HtoD" in name:
        return "h2d"
    return None


def _span(event: dict) -> tuple[float, float]:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def analyze(events: list[dict], steps: int = 1, small_bytes: int = SMALL_COPY_BYTES) -> dict:
    """The summary above for ``events`` covering ``steps`` steps (times in the trace are in us)."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    nccl, copies, launches, small, kernel_dtoh = [], {"d2h": [], "h2d": []}, {}, [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, name, args = e.get("cat", ""), e.get("name", ""), e.get("args", {}) or {}
        if cat == "kernel" and "nccl" in name.lower():
            nccl.append(_span(e))
        elif cat == "kernel" and KERNEL_DTOH_NAME in name:
            kernel_dtoh.append(e)
        elif cat == "gpu_memcpy" and (direction := copy_direction(name)) is not None:
            nbytes = int(args.get("bytes", 0) or 0)
            if nbytes >= small_bytes:
                copies[direction].append(_span(e))
            elif direction == "d2h":
                small.append(e)
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:  # Triton launches via the driver
            launches[args["correlation"]] = _span(e)[1]  # when the launch call returned
    nccl_u = union(nccl)
    d2h_u, h2d_u = union(copies["d2h"]), union(copies["h2d"])
    offload_u = union(d2h_u + h2d_u)

    def waits(items: list[dict]) -> dict:
        total = behind = worst = 0.0
        for e in items:
            start, _ = _span(e)
            launched = launches.get((e.get("args") or {}).get("correlation"))
            if launched is None or start <= launched:
                continue
            total += start - launched
            worst = max(worst, start - launched)
            behind += length(intersection([(launched, start)], d2h_u))
        ms = 1e-3 / steps
        return {"count": len(items) / steps, "wait_ms": total * ms, "max_wait_ms": worst * 1e-3,
                "wait_behind_offload_ms": behind * ms}

    ms = 1e-3 / steps
    overlap = length(intersection(offload_u, nccl_u))
    return {
        "steps": steps,
        "nccl_ms": length(nccl_u) * ms,
        "offload_d2h_ms": length(d2h_u) * ms,
        "offload_h2d_ms": length(h2d_u) * ms,
        "overlap_ms": overlap * ms,
        "overlap_share_of_nccl": overlap / length(nccl_u) if nccl_u else None,
        "small_d2h": waits(small),
        "kernel_dtoh": waits(kernel_dtoh),
    }
