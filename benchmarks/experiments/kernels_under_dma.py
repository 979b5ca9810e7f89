"""How much slower GPU kernels on the compute stream run while pinned copies stream between GPU and host memory.

An offload engine streams its copies on side streams while the compute stream runs the step's
kernels: in the Megatron GPT benchmark with offloading about 2.5 GiB a step go each way at about
55 GB/s. If the GPU ran its kernels slower beside the copy engines' DMA (a lower clock under the
added power, contention in the memory system), no engine schedule could avoid that cost. This measures
kernels alone on the compute stream with the copy engines idle, copying device to host, host to
device, and both:

* ``gemm_bf16``: a bf16 ``torch.matmul`` at a compute-bound size (``--gemm-size``, M=N=K);
* ``grouped_mlp_gemms``: the fused MLP's two forward GEMM shapes as plain bf16 matmuls at
  E=8 x 2048 tokens, H=2688, F=1856: (16384 x 2688) @ (2688 x 1856), then
  (16384 x 1856) @ (1856 x 2688);
* ``memory_bound``: an out-of-place add of a scalar over a 1 GiB bf16 tensor (HBM-bound; the
  page gives the GB/s it read and wrote);
* ``fp8_gemm``: ``torch._scaled_mm`` on float8_e4m3fn with per-tensor scales at
  ``--gemm-size``, where it runs on this GPU (tried once, checked against fp32; skipped with the
  reason otherwise).

The copies: chunks of ``--chunk-mib`` between pinned host memory (torch's ``pin_memory``) and
device memory, one side stream per direction, each cycling through about 512 MiB of buffers on
both sides. The host keeps ``--depth`` chunks queued on each copy stream while the timed kernels
run (it tops the queues up between launches and while it waits for the last kernel), so the copy
engines stay busy through the whole timed span; a row whose copies began after the span, ended
before it, or ran dry within it is marked.

A measurement: the copies start, ``iters // 4`` untimed calls of the workload, then ``--iters``
calls back to back timed by CUDA events on the compute stream (ms per call); the copies' GB/s in
that span come from CUDA events after each chunk (chunks completed in the span over the time
between the first and the last of them); the SM clock and board power come from nvidia-smi
(``gpu_clocks.GpuClocks``) over the untimed and timed calls. Each round measures every workload
under every copy mode, the modes' order rotated from round to round, after a warm-up round that
is not kept; the page gives per workload and mode the median over rounds and their range, and
the time against the copy engines idle (the median over rounds of each round's ratio to its own
idle measurement). The copies' rate alone (``timing.pcie_bandwidth``) is in the header.

    python benchmarks/experiments/kernels_under_dma.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))

from bench_common import (MLP_SHAPE, command_line, file_stem, pyplot, refuse, save_png, utc_now,  # noqa: E402
                          write_reports)
from gpu_clocks import GpuClocks, summarize  # noqa: E402
from timing import median, pcie_bandwidth  # noqa: E402

MODES = ("idle", "d2h", "h2d", "both")
WORKLOADS = ("gemm_bf16", "grouped_mlp_gemms", "memory_bound", "fp8_gemm")
MiB = 1 << 20
RING_BYTES = 512 * MiB  # each direction's host and device buffers, cycled through chunk by chunk
MEMORY_BOUND_BYTES = 1 << 30
CLOCK_PERIOD_MS = 20


def directions(mode: str) -> tuple:
    """The copy directions a mode runs."""
    return {"idle": (), "d2h": ("d2h",), "h2d": ("h2d",), "both": ("d2h", "h2d")}[mode]


def rotated(modes, r: int) -> list:
    """``modes`` in round ``r``'s order: started ``r`` places further along, so that each mode in
    turn runs first in a round (right after the previous workload)."""
    k = r % len(modes)
    return list(modes[k:]) + list(modes[:k])


def window_gbps(done_ms, start_ms: float, end_ms: float, chunk_bytes: int):
    """GB/s of one direction's copies within the timed span [``start_ms``, ``end_ms``], from the
    times its chunks completed (``done_ms``, in order): the chunks completed after the first one in
    the span over the time from that first one to the last one in it; None with fewer than two
    completions in the span."""
    inside = [t for t in done_ms if start_ms <= t <= end_ms]
    if len(inside) < 2 or inside[-1] <= inside[0]:
        return None
    return (len(inside) - 1) * chunk_bytes / ((inside[-1] - inside[0]) * 1e-3) / 1e9


def copies_spanned(begin_ms: float, done_ms, start_ms: float, end_ms: float, ran_dry: bool) -> bool:
    """Whether one direction's copies ran through the whole timed span: begun before it, the last
    chunk completed after it, and the queue never empty in between."""
    return bool(done_ms) and begin_ms <= start_ms and done_ms[-1] >= end_ms and not ran_dry


def build_rows(records: list, works: dict, modes) -> list:
    """The page's rows, one per (workload, mode), from the kept measurements.

    ``records``: ``{"work", "mode", "round", "ms", "d2h_GBps", "h2d_GBps", "spanned",
    "clock_samples"}`` per measurement (``spanned`` None where no copies ran; GB/s None where that
    direction did not copy); ``works``: workload -> ``{"flop": per call}`` or ``{"bytes": moved
    per call}``. A row gives the median ms per call over rounds, its range, the time against idle
    (the median and range over rounds of the round's ms over that round's idle ms of the same
    workload), the work's rate at the median (TFLOP/s or GB/s), the copies' median GB/s each way,
    whether the copies ran through the span in every round, and the clock and power over all the
    rounds' samples (``gpu_clocks.summarize``)."""
    rows = []
    for work, meta in works.items():
        idle = {r["round"]: r["ms"] for r in records if r["work"] == work and r["mode"] == "idle"}
        for mode in modes:
            mine = sorted((r for r in records if r["work"] == work and r["mode"] == mode), key=lambda r: r["round"])
            if not mine:
                continue
            each = [r["ms"] for r in mine]
            ms = median(each)
            ratios = [r["ms"] / idle[r["round"]] for r in mine if idle.get(r["round"])]
            row = {"work": work, "mode": mode, "ms": ms, "ms_min": min(each), "ms_max": max(each), "ms_each": each,
                   "x_idle": median(ratios) if ratios else None,
                   "x_idle_min": min(ratios) if ratios else None, "x_idle_max": max(ratios) if ratios else None}
            if "flop" in meta:
                row["rate"], row["rate_unit"] = meta["flop"] / (ms * 1e-3) / 1e12, "TFLOP/s"
            else:
                row["rate"], row["rate_unit"] = meta["bytes"] / (ms * 1e-3) / 1e9, "GB/s"
            for way in ("d2h", "h2d"):
                got = [r[f"{way}_GBps"] for r in mine if r.get(f"{way}_GBps") is not None]
                row[f"{way}_GBps"] = median(got) if got else None
            spans = [r["spanned"] for r in mine if r["spanned"] is not None]
            row["copies_spanned"] = all(spans) if spans else None
            row.update(summarize([tuple(s) for r in mine for s in r["clock_samples"]]))
            rows.append(row)
    return rows


class Copies:
    """The copy engines' load for one measurement: chunks copied device to host and/or host to
    device, each direction on its own side stream, kept ``depth`` queued by :meth:`top_up`."""

    def __init__(self, ways: tuple, buffers: dict, streams: dict, depth: int):
        self.ways, self.buffers, self.streams, self.depth = ways, buffers, streams, depth
        self.pending = {w: deque() for w in ways}
        self.done = {w: [] for w in ways}  # every chunk's completion event, in order
        self.begin, self.queued, self.ran_dry = {}, {w: 0 for w in ways}, {w: False for w in ways}
        self.watch = False  # set once the timed span's start is queued: a queue found empty then is marked

    def start(self) -> None:
        for way in self.ways:
            self.begin[way] = torch.cuda.Event(enable_timing=True)
            self.begin[way].record(self.streams[way])
        self.top_up()

    def top_up(self) -> None:
        for way in self.ways:
            pending = self.pending[way]
            while pending and pending[0].query():
                pending.popleft()
            if not pending and self.watch:
                self.ran_dry[way] = True
            host, device = self.buffers[way]
            with torch.cuda.stream(self.streams[way]):
                while len(pending) < self.depth:
                    slot = self.queued[way] % host.shape[0]
                    if way == "d2h":
                        host[slot].copy_(device[slot], non_blocking=True)
                    else:
                        device[slot].copy_(host[slot], non_blocking=True)
                    event = torch.cuda.Event(enable_timing=True)
                    event.record()
                    pending.append(event)
                    self.done[way].append(event)
                    self.queued[way] += 1


def measure(work, mode: str, buffers: dict, streams: dict, iters: int, depth: int) -> dict:
    """One measurement of ``work`` under the mode's copies (see the module's docstring)."""
    torch.cuda.synchronize()
    copies = Copies(directions(mode), buffers, streams, depth)
    ref, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    with GpuClocks(period_ms=CLOCK_PERIOD_MS) as clocks:
        ref.record()  # the compute stream is idle: every later event's time counts from here
        copies.start()
        for _ in range(max(1, iters // 4)):
            work()
            copies.top_up()
        start.record()
        copies.watch = True
        for _ in range(iters):
            work()
            copies.top_up()
        end.record()
        while not end.query():
            copies.top_up()
            time.sleep(2e-4)
    torch.cuda.synchronize()
    start_ms, end_ms = ref.elapsed_time(start), ref.elapsed_time(end)
    out = {"ms": (end_ms - start_ms) / iters, "d2h_GBps": None, "h2d_GBps": None, "spanned": None,
           "clock_samples": [list(s) for s in clocks.samples]}
    spans = []
    for way in copies.ways:
        done_ms = [ref.elapsed_time(e) for e in copies.done[way]]
        chunk_bytes = buffers[way][0].shape[1]
        out[f"{way}_GBps"] = window_gbps(done_ms, start_ms, end_ms, chunk_bytes)
        spans.append(copies_spanned(ref.elapsed_time(copies.begin[way]), done_ms, start_ms, end_ms,
                                    copies.ran_dry[way]))
    if spans:
        out["spanned"] = all(spans)
    return out


def fp8_gemm(n: int):
    """(call, None) for an n x n x n ``torch._scaled_mm`` on float8_e4m3fn with per-tensor scales
    and a bf16 output, or (None, why it does not run here)."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return None, f"torch {torch.__version__} has no torch._scaled_mm or float8_e4m3fn"
    try:
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm needs
        one = torch.ones((), device="cuda")

        def call():
            out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            return out[0] if isinstance(out, tuple) else out  # torch < 2.4 also gives the amax

        got = call()[:256, :256].float()
        want = a[:256].float() @ b[:, :256].float()
        err = ((got - want).norm() / want.norm()).item()
    except Exception as exc:  # noqa: BLE001 (any failure: the workload does not run here)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"torch._scaled_mm on float8_e4m3fn failed: {first}"
    if not err < 1e-2:
        return None, f"torch._scaled_mm on float8_e4m3fn is off from fp32 by {err:.3g} (relative)"
    return call, None


def build_works(names, gemm_size: int):
    """({workload: (call, {"flop"|"bytes": per call})}, {workload skipped: why}) for ``names``."""
    works, skipped = {}, {}
    n = gemm_size
    for name in names:
        if name == "gemm_bf16":
            a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            b, c = torch.randn_like(a), torch.empty_like(a)
            works[name] = (lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), {"flop": 2 * n**3})
        elif name == "grouped_mlp_gemms":
            t, h, f = MLP_SHAPE["experts"] * MLP_SHAPE["tokens"], MLP_SHAPE["hidden"], MLP_SHAPE["ffn"]
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            w1 = torch.randn(f, h, device="cuda", dtype=torch.bfloat16) / h**0.5
            w2 = torch.randn(h, f, device="cuda", dtype=torch.bfloat16) / f**0.5
            mid, y = torch.empty(t, f, device="cuda", dtype=torch.bfloat16), torch.empty_like(x)

            def mlp(x=x, w1=w1, w2=w2, mid=mid, y=y):
                torch.matmul(x, w1.t(), out=mid)
                torch.matmul(mid, w2.t(), out=y)

            works[name] = (mlp, {"flop": 2 * 2 * t * h * f})
        elif name == "memory_bound":
            src = torch.randn(MEMORY_BOUND_BYTES // 2, device="cuda", dtype=torch.bfloat16)
            dst = torch.empty_like(src)
            works[name] = (lambda src=src, dst=dst: torch.add(src, 1.0, out=dst), {"bytes": 2 * MEMORY_BOUND_BYTES})
        elif name == "fp8_gemm":
            call, why = fp8_gemm(n)
            if call is None:
                print(f"fp8_gemm skipped: {why}")
                skipped[name] = why
            else:
                works[name] = (call, {"flop": 2 * n**3})
    return works, skipped


def copy_buffers(chunk_bytes: int) -> dict:
    """Per direction (pinned host ring, device ring): as many chunks as fit ``RING_BYTES`` (at
    least two), uint8, one row per chunk."""
    slots = max(2, RING_BYTES // chunk_bytes)
    out = {}
    for way in ("d2h", "h2d"):
        host = torch.empty(slots, chunk_bytes, dtype=torch.uint8, pin_memory=True)
        device = torch.randint(0, 255, (slots, chunk_bytes), dtype=torch.uint8, device="cuda")
        out[way] = (host, device)
    return out


def fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def markdown(result: dict) -> str:
    pcie = result.get("copies_alone") or {}
    lines = [f"# Compute-stream kernels while pinned copies run ({result['gpu']}, {result['date']})", "",
             f"torch {result['torch']}. ms per call: the median over {result['rounds']} rounds of {result['iters']} "
             "calls back to back timed by CUDA events, [the rounds' range]; x idle: the median [range] over rounds "
             "of each round's time against the same workload with the copy engines idle. Copies: "
             f"{result['chunk_mib']} MiB chunks of pinned memory, {result['depth']} queued on each direction's "
             "stream; their GB/s: completed within the timed calls. SM clock (lowest) and power: nvidia-smi over "
             f"the rounds. Command: `{result['command']}`", ""]
    if pcie:
        lines += [f"Copies alone (timing.pcie_bandwidth): d2h {fmt(pcie.get('d2h_GBps'), '.1f')} GB/s, h2d "
                  f"{fmt(pcie.get('h2d_GBps'), '.1f')} GB/s, both at once "
                  f"{fmt(pcie.get('bidirectional_each_GBps'), '.1f')} GB/s each way.", ""]
    lines += ["| work | copies | ms per call [range] | x idle [range] | rate | d2h GB/s | h2d GB/s | SM MHz (lowest) "
              "| power W |", "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        mode = row["mode"] + (" (copies not through the span)" if row.get("copies_spanned") is False else "")
        ratio = "-" if row.get("x_idle") is None else (
            f"{row['x_idle']:.3f} [{row['x_idle_min']:.3f}-{row['x_idle_max']:.3f}]")
        clock = "-" if "sm_MHz" not in row else f"{row['sm_MHz']:.0f} ({row['sm_MHz_min']:.0f})"
        lines.append(f"| {row['work']} | {mode} | {row['ms']:.3f} [{row['ms_min']:.3f}-{row['ms_max']:.3f}] | {ratio} "
                     f"| {row['rate']:.0f} {row['rate_unit']} | {fmt(row.get('d2h_GBps'), '.1f')} "
                     f"| {fmt(row.get('h2d_GBps'), '.1f')} | {clock} | {fmt(row.get('power_W'), '.0f')} |")
    for work, why in (result.get("skipped") or {}).items():
        lines += ["", f"{work} not measured: {why}"]
    short = sorted({(row["work"], row["mode"]) for row in result["rows"] if row.get("copies_spanned") is False})
    if short:
        lines += ["", "Copies did not run through the whole timed span in some round of: "
                  + ", ".join(f"{w} {m}" for w, m in short) + " (raise --depth)."]
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path):
    """Each workload's time against the copy engines idle, per copy mode."""
    plt = pyplot()
    if plt is None:
        return False
    works = list(dict.fromkeys(row["work"] for row in result["rows"]))
    modes = [m for m in dict.fromkeys(row["mode"] for row in result["rows"]) if m != "idle"]
    if not works or not modes:
        return False
    ratio = {(row["work"], row["mode"]): row.get("x_idle") for row in result["rows"]}
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(works))]
        ys = [ratio.get((w, mode)) for w in works]
        ax.bar([x for x, y in zip(xs, ys) if y is not None], [y for y in ys if y is not None], width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(works)), works, fontsize=8)
    ax.set_ylabel("time against copies idle")
    ax.set_title(f"Compute-stream kernels while pinned copies run ({result['gpu']})", fontsize=10)
    ax.legend(title="copies", fontsize=8)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return True


def comma_list(text: str, known: tuple, flag: str, parser) -> list:
    items = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in items if s not in known]
    if not items or unknown:
        parser.error(f"{flag} takes a comma list of {', '.join(known)}; got {text!r}")
    return list(dict.fromkeys(items))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=BENCH / "results", help="folder for JSON, markdown and PNG")
    p.add_argument("--rounds", type=int, default=8,
                   help="rounds kept, after one warm-up round; a multiple of the modes' count, so that each mode "
                        "runs in each place of a round equally often (a round's places differ by a few percent)")
    p.add_argument("--iters", type=int, default=200, help="timed calls back to back per measurement")
    p.add_argument("--chunk-mib", type=int, default=64, help="MiB per queued copy")
    p.add_argument("--depth", type=int, default=4, help="chunks kept queued on each copy stream")
    p.add_argument("--gemm-size", type=int, default=8192, help="M=N=K of gemm_bf16 and fp8_gemm")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)} (idle among them)")
    args = p.parse_args(argv)
    args.workload_list = comma_list(args.workloads, WORKLOADS, "--workloads", p)
    args.mode_list = comma_list(args.modes, MODES, "--modes", p)
    if "idle" not in args.mode_list:
        p.error("--modes must include idle: every mode is set against it")
    for flag in ("rounds", "iters", "chunk_mib", "depth", "gemm_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.rounds % len(args.mode_list):
        p.error(f"--rounds must be a multiple of the {len(args.mode_list)} modes (each mode in each place of a "
                f"round equally often), got {args.rounds}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():  # torch alone: it needs neither TE nor this package
        return refuse("kernels_under_dma.py", "no CUDA GPU is visible (torch.cuda.is_available() is False)")
    copies_alone = pcie_bandwidth()
    chunk_bytes = args.chunk_mib * MiB
    try:
        buffers = copy_buffers(chunk_bytes)
    except RuntimeError as exc:
        return refuse("kernels_under_dma.py", f"no pinned host buffers of {args.chunk_mib} MiB chunks: {exc}")
    streams = {way: torch.cuda.Stream() for way in ("d2h", "h2d")}
    works, skipped = build_works(args.workload_list, args.gemm_size)
    if not works:
        return refuse("kernels_under_dma.py", "none of the workloads asked for runs here: "
                      + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    records = []
    for r in range(args.rounds + 1):  # round 0 warms clocks, kernels and the copy paths: not kept
        for name, (work, _) in works.items():
            for mode in rotated(args.mode_list, r):
                got = measure(work, mode, buffers, streams, args.iters, args.depth)
                if r:
                    records.append({"work": name, "mode": mode, "round": r, **got})
        print(f"round {r} of {args.rounds} done" + (" (warm-up)" if r == 0 else ""), flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "date": utc_now(), "torch": torch.__version__,
              "command": command_line("benchmarks/experiments/kernels_under_dma.py",
                                      sys.argv[1:] if argv is None else list(argv)),
              "args": {k: str(v) for k, v in vars(args).items() if k not in ("out", "workload_list", "mode_list")},
              "rounds": args.rounds, "iters": args.iters, "chunk_mib": args.chunk_mib, "depth": args.depth,
              "copies_alone": copies_alone, "skipped": skipped,
              "rows": build_rows(records, {k: meta for k, (_, meta) in works.items()}, args.mode_list),
              "records": records}
    paths = write_reports(args.out, file_stem("kernels_under_dma", result["gpu"]), result, markdown, chart)
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
