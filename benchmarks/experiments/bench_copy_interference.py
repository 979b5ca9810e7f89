#!/usr/bin/env python3
"""How long a small copy on the compute stream waits behind an offload engine's large copy.

An offload engine copies hundreds of MiB per layer to the host on a side stream. A small copy in
the same direction on the compute stream (a ``.cpu()`` of tokens per expert, as Megatron's token
dispatchers do) waits for the large copy in flight: in the MoE step of moe_step.py such waits
stalled the compute stream for milliseconds per step (``moe_step.py --profile`` shows them). This
measures that wait directly, for each direction, with the large copy issued whole or in chunks
(does the copy engine take the small copy between two chunks? an engine could copy in
pieces), and what chunking costs the large copy's bandwidth. ``--paced-depth K`` adds rows where
the chunks are fed by a host thread that keeps at most K of them queued (it waits for chunk i - K
to end before queueing chunk i): the queue a small copy can find ahead of it is then K chunks.

Per direction (d2h, h2d) and chunk size: the side stream copies ``--mib`` MiB in chunks; the
compute stream sleeps ``--lead-ms`` (so that the large copy is under way), then copies 512 bytes
in the same direction (pinned host memory). Reported, median of ``--reps``: the small copy's wait
(its end minus the end of the sleep before it), and the large copy's GB/s; a first row per
direction without the large copy gives the small copy's own time; a row where the large copy had
ended before the small copy was issued in any repetition is marked (raise ``--mib``). Writes
``copy_interference_<GPU>.{json,md,png}`` into ``--out``.

    python3 benchmarks/experiments/bench_copy_interference.py [--mib 512 --chunks-mib 0,256,64,16,4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from bench_common import cuda_problem, file_stem, pyplot, refuse, save_png, utc_now, write_reports  # noqa: E402
from timing import median  # noqa: E402

MiB = 1 << 20
SMALL_BYTES = 512


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512, help="size of the large copy, MiB (one MoE layer's MLP: 568)")
    p.add_argument("--chunks-mib", default="0,256,64,16,4",
                   help="chunk sizes of the large copy, MiB; 0 = one copy (comma-separated)")
    p.add_argument("--lead-ms", type=float, default=2.0, help="compute-stream sleep before the small copy")
    p.add_argument("--paced-depth", type=int, default=0,
                   help="also feed each chunked large copy from a host thread, at most this many chunks queued "
                        "(0: not)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", type=Path, default=BENCH / "results", help="folder for JSON, markdown, PNG")
    args = p.parse_args(argv)
    items = [c.strip() for c in args.chunks_mib.split(",") if c.strip()]
    if not items or not all(c.isdigit() for c in items):
        p.error(f"--chunks-mib must be whole numbers of MiB >= 0, comma-separated, got {args.chunks_mib!r}")
    args.chunks = [int(c) for c in items]
    if args.mib <= 0 or args.reps < 1 or not args.lead_ms > 0 or args.paced_depth < 0:
        p.error(f"need --mib > 0, --reps >= 1, --lead-ms > 0 and --paced-depth >= 0 (got {args.mib}, {args.reps}, "
                f"{args.lead_ms}, {args.paced_depth})")
    return args


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond, measured once."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # warm-up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


def copy_pieces(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """(start, end) byte ranges that cover ``nbytes`` in pieces of ``chunk`` bytes (0: one piece)."""
    if chunk <= 0 or chunk >= nbytes:
        return [(0, nbytes)]
    return [(a, min(a + chunk, nbytes)) for a in range(0, nbytes, chunk)]


def feed(pieces, src, dst, side, depth: int, ends: list, device) -> None:
    """Queues ``pieces`` of ``src`` into ``dst`` on ``side``, at most ``depth`` not yet ended (a host
    thread's loop: it waits for piece i - depth before queueing piece i); ``ends`` gets each
    piece's event, the last one's after the whole copy."""
    import torch

    torch.cuda.set_device(device)
    with torch.cuda.stream(side):
        for i, (a, b) in enumerate(pieces):
            if i >= depth:
                ends[i - depth].synchronize()
            dst[a:b].copy_(src[a:b], non_blocking=True)
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record(side)


def measure(direction: str, chunk_mib, args, buffers, cycles_per_ms: float, depth: int = 0) -> dict:
    """One row: ``chunk_mib`` None runs the small copy alone, 0 the large copy whole; ``depth`` > 0
    feeds the chunks from a host thread, at most that many queued."""
    import threading

    import torch

    dev, host, dev_small, host_small = buffers
    side, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    src, dst = (dev, host) if direction == "d2h" else (host, dev)
    small_src, small_dst = (dev_small, host_small) if direction == "d2h" else (host_small, dev_small)
    pieces = [] if chunk_mib is None else copy_pieces(src.numel(), chunk_mib * MiB)
    waits, rates, overlapped = [], [], True
    for _ in range(args.reps):
        torch.cuda.synchronize()
        ev = {k: torch.cuda.Event(enable_timing=True) for k in ("big0", "big1", "lead", "small")}
        side.wait_stream(compute)
        ev["big0"].record(side)
        feeder, ends = None, []
        if depth and pieces:
            feeder = threading.Thread(target=feed, args=(pieces, src, dst, side, depth, ends, src.device.index
                                                         if src.is_cuda else dst.device.index))
            feeder.start()
        else:
            with torch.cuda.stream(side):
                for a, b in pieces:
                    dst[a:b].copy_(src[a:b], non_blocking=True)
        torch.cuda._sleep(int(args.lead_ms * cycles_per_ms))
        ev["lead"].record(compute)
        small_dst.copy_(small_src, non_blocking=True)
        ev["small"].record(compute)
        if feeder is not None:
            feeder.join()
        ev["big1"].record(side)
        torch.cuda.synchronize()
        waits.append(ev["lead"].elapsed_time(ev["small"]))
        if pieces:
            rates.append(src.numel() / (ev["big0"].elapsed_time(ev["big1"]) * 1e-3) / 1e9)
            overlapped &= ev["lead"].elapsed_time(ev["big1"]) > 0  # still copying when the small copy came
    big = median(rates) if rates else None
    return {"direction": direction, "chunk_MiB": chunk_mib, "chunks": len(pieces), "paced_depth": depth or None,
            "small_wait_ms": median(waits), "small_wait_max_ms": max(waits),
            "big_GBps": big, "big_ms": src.numel() / (big * 1e9) * 1e3 if big else None,
            "overlapped": overlapped if pieces else None}


def markdown(result: dict) -> str:
    lines = [f"# A small copy on the compute stream behind a large offload copy, {result['gpu']} ({result['date']})",
             "",
             f"Large copy: {result['mib']} MiB on a side stream, whole or in chunks; {result['lead_ms']} ms later "
             f"a {SMALL_BYTES}-byte copy in the same direction on the compute stream. Medians of {result['reps']} "
             "repetitions. *wait*: the small copy's end minus the compute stream's work before it.",
             "",
             "| direction | chunk MiB | chunks | small copy wait ms (max) | large copy GB/s | large copy ms |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        chunk = "no large copy" if r["chunk_MiB"] is None else "whole" if r["chunk_MiB"] == 0 else str(r["chunk_MiB"])
        if r.get("paced_depth"):
            chunk += f", fed {r['paced_depth']} at a time"
        late = " (large copy already done: not measured)" if r.get("overlapped") is False else ""
        big = "- | -" if r["big_GBps"] is None else f"{r['big_GBps']:.1f} | {r['big_ms']:.2f}"
        lines.append(f"| {r['direction']} | {chunk} | {r['chunks']} | {r['small_wait_ms']:.3f} "
                     f"({r['small_wait_max_ms']:.3f}){late} | {big} |")
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for direction in ("d2h", "h2d"):
        for paced in (False, True):
            rows = [r for r in result["rows"] if r["direction"] == direction and r["chunk_MiB"] is not None
                    and bool(r.get("paced_depth")) == paced]
            if rows:
                label = direction + (f", fed {rows[0]['paced_depth']} at a time" if paced else "")
                ax.plot([str(r["chunk_MiB"] or "whole") for r in rows], [r["small_wait_ms"] for r in rows],
                        marker="o", linestyle="--" if paced else "-", label=label)
    ax.set_xlabel("chunk of the large copy, MiB")
    ax.set_ylabel("small copy's wait, ms")
    ax.set_title(f"{SMALL_BYTES} B copy behind a {result['mib']} MiB copy, {result['gpu']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if problem := cuda_problem():
        return refuse("bench_copy_interference.py", problem)
    import torch

    nbytes = args.mib * MiB
    buffers = (torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
               torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
               torch.zeros(SMALL_BYTES, dtype=torch.uint8, device="cuda"),
               torch.zeros(SMALL_BYTES, dtype=torch.uint8, pin_memory=True))
    cycles_per_ms = sleep_cycles_per_ms()
    rows = []
    plan = [(d, c, 0) for d in ("d2h", "h2d") for c in [None, *args.chunks]]  # None: the small copy alone
    if args.paced_depth:
        plan += [(d, c, args.paced_depth) for d in ("d2h", "h2d") for c in args.chunks if c]
    for i, (direction, chunk, depth) in enumerate(plan, 1):
        row = measure(direction, chunk, args, buffers, cycles_per_ms, depth)
        rows.append(row)
        what = "no large copy" if chunk is None else f"chunk {chunk or 'whole'} MiB" + (
            f", fed {depth} at a time" if depth else "")
        print(f"[{i}/{len(plan)}] {direction} {what}: small copy waits {row['small_wait_ms']:.3f} ms"
              + (f"; large copy {row['big_GBps']:.1f} GB/s" if row["big_GBps"] else "")
              + ("; the large copy had ended first: raise --mib" if row["overlapped"] is False else ""), flush=True)
    gpu = torch.cuda.get_device_name()
    result = {"benchmark": "copy_interference", "gpu": gpu, "mib": args.mib, "lead_ms": args.lead_ms,
              "reps": args.reps, "rows": rows,
              "date": utc_now()}
    write_reports(args.out, file_stem("copy_interference", gpu), result, markdown, chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
