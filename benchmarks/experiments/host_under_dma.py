"""How much slower the host runs while pinned copies stream between GPU and host memory.

Offloading moves about 1.3 GiB each way per step in the Megatron GPT benchmark, and those steps
are host-bound: if the host's own work slows while the copy engines read and write host memory,
the step slows by that share whatever the engine's code costs. This measures three host
workloads with the GPU's copy engines idle, copying device to host, host to device, and both:

* ``launch``: small CUDA ops launched back to back (the host side of a training step);
* ``python``: pure Python (dictionaries and lists, no CUDA);
* ``memcpy``: a 64 MiB host-memory copy (bandwidth-bound).

Each workload runs while the copies are still in flight (checked: a copy event not yet done at its
end); the figure is the median over repeats, and each mode is measured in several rounds in turn.

    python benchmarks/experiments/host_under_dma.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

MODES = ("idle", "d2h", "h2d", "both")


def launch_work(a, b, out, n=2000):
    for _ in range(n):
        torch.add(a, b, out=out)


def python_work(n=60000):
    d = {}
    for i in range(n):
        d[i % 977] = d.get(i % 977, 0) + i
    return sorted(d.values())[-1]


def memcpy_work(src, dst, n=8):
    for _ in range(n):
        dst.copy_(src)


def start_copies(mode, gpu, host, streams, count):
    """Queue ``count`` copies of ``gpu``'s bytes each way the mode names; the event of the last."""
    last = None
    for direction, stream in zip(("d2h", "h2d"), streams):
        if mode not in (direction, "both"):
            continue
        with torch.cuda.stream(stream):
            for _ in range(count):
                (host.copy_(gpu, non_blocking=True) if direction == "d2h" else gpu.copy_(host, non_blocking=True))
            last = torch.cuda.Event()
            last.record(stream)
    return last


def measure(mode, work, gpu, host, streams, repeats, count):
    times, overlapped = [], True
    done = start_copies(mode, gpu, host, streams, count)
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        times.append((time.perf_counter() - t0) * 1e3)
    if done is not None:
        overlapped = not done.query()
    torch.cuda.synchronize()
    return statistics.median(times), overlapped


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copy-mib", type=int, default=512, help="bytes of each queued copy")
    p.add_argument("--copies", type=int, default=24, help="copies queued each way per measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("host_under_dma: needs a CUDA GPU", file=sys.stderr)
        return 2
    numel = args.copy_mib * 2**20 // 2
    gpu = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    host = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    a = torch.randn(1024, device="cuda")
    b, out = torch.randn_like(a), torch.empty_like(a)
    src, dst = torch.randn(16 * 2**20), torch.empty(16 * 2**20)
    works = {"launch": lambda: launch_work(a, b, out), "python": python_work,
             "memcpy": lambda: memcpy_work(src, dst)}
    for w in works.values():  # warm
        w()
    results = {w: {m: [] for m in MODES} for w in works}
    not_overlapped = []
    for _ in range(args.rounds):
        for name, work in works.items():
            for mode in MODES:
                ms, overlapped = measure(mode, work, gpu, host, streams, args.repeats, args.copies)
                results[name][mode].append(ms)
                if not overlapped:
                    not_overlapped.append((name, mode))
    gpu_name = torch.cuda.get_device_name()
    rows = []
    print(f"Host work while pinned copies run ({gpu_name}; median ms of {args.repeats} x {args.rounds}; "
          f"x: against idle)")
    print("| work | " + " | ".join(MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for name in works:
        med = {m: statistics.median(results[name][m]) for m in MODES}
        rows.append({"work": name, "ms": med, "ms_each": results[name]})
        print(f"| {name} | " + " | ".join(
            f"{med[m]:.2f}" + ("" if m == "idle" else f" (x{med[m] / med['idle']:.2f})") for m in MODES) + " |")
    if not_overlapped:
        print(f"copies had finished before the work did in: {sorted(set(not_overlapped))} (queue more: --copies)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"host_under_dma_{gpu_name.replace(' ', '_')}.json"
        path.write_text(json.dumps({"gpu": gpu_name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                    "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                    "not_overlapped": not_overlapped}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
