"""How much slower the host runs while pinned copies stream between GPU and host memory.

Offloading moves about 1.3 GiB each way per step in the Megatron GPT benchmark, and those steps
are host-bound: if the host's own work slows while the copy engines read and write host memory,
the step slows by that share whatever the engine's code costs. This measures four host
workloads with the GPU's copy engines idle, copying device to host, host to device, and both:

* ``launch``: small CUDA ops launched back to back (the host side of a training step);
* ``python``: pure Python on a small working set (a dictionary that stays in the core's caches);
* ``python-large``: pure Python reading a 2-million-entry list in a shuffled order (a working
  set of about 70 MB, which lives in the shared last-level cache and memory, as a training
  step's Python objects and dispatcher tables do; inbound DMA may pass through that cache);
* ``memcpy``: a 64 MiB host-memory copy (bandwidth-bound).

Each workload runs while the copies are still in flight (checked: each way's last copy not yet
done at its end); each round measures every mode in turn (the median of its repeats), after a
warm-up round; the page gives the median over rounds and their range.

``--host-memory write-combined`` puts the copies' host side in write-combined pinned memory
(teo's ``write_combined_bytes``, what ``TEO_HOST_MEMORY=write-combined`` gives teo) instead of
torch's pinned memory: the CPU does not cache it, so the copies need not pass through the CPU's
caches (an offload engine's host buffers are never read by the CPU). Does the host's own work
then slow less?

    python benchmarks/experiments/host_under_dma.py --out benchmarks/results [--host-memory write-combined]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))

from bench_common import command_line, file_stem, pyplot, refuse, save_png, write_reports  # noqa: E402

MODES = ("idle", "d2h", "h2d", "both")


def host_buffer(kind: str, numel: int):
    """The copies' host side, bf16: torch's pinned memory or write-combined pinned memory (freed
    with its last view)."""
    if kind == "pinned":
        return torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
    sys.path.insert(0, str(BENCH.parent))
    from te_offload_ops.engines.teo.pool import write_combined_bytes  # what teo's pool allocates (needs TE)

    return write_combined_bytes(numel * 2).view(torch.bfloat16)


def launch_work(a, b, out, n=2000):
    for _ in range(n):
        torch.add(a, b, out=out)


def python_work(n=60000):
    d = {}
    for i in range(n):
        d[i % 977] = d.get(i % 977, 0) + i
    return sorted(d.values())[-1]


def large_python_work(values, order):
    total = 0
    for i in order:
        total += values[i]
    return total


def memcpy_work(src, dst, n=8):
    for _ in range(n):
        dst.copy_(src)


def start_copies(mode, gpu, host, streams, count):
    """Queue ``count`` copies of ``gpu``'s bytes each way the mode names; each way's last event."""
    done = []
    for direction, stream in zip(("d2h", "h2d"), streams):
        if mode not in (direction, "both"):
            continue
        with torch.cuda.stream(stream):
            for _ in range(count):
                (host.copy_(gpu, non_blocking=True) if direction == "d2h" else gpu.copy_(host, non_blocking=True))
            done.append(torch.cuda.Event())
            done[-1].record(stream)
    return done


def measure(mode, work, gpu, host, streams, repeats, count):
    """Median ms of ``repeats`` runs of ``work`` while the mode's copies run, and whether every
    way's copies were still running when the work ended."""
    times = []
    done = start_copies(mode, gpu, host, streams, count)
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        times.append((time.perf_counter() - t0) * 1e3)
    overlapped = not any(event.query() for event in done)
    torch.cuda.synchronize()
    return statistics.median(times), overlapped


def markdown(result: dict) -> str:
    memory = result.get("host_memory", "pinned")
    lines = [f"# Host work while pinned copies run ({result['gpu']}, {result['date']})", "",
             "Median ms of each workload over the rounds, [the rounds' range]; x: the median against the copy "
             f"engines idle. The copies' host memory: {memory}. Command: `{result['command']}`", "",
             "| work | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
    for row in result["rows"]:
        med = row["ms"]
        each = row["ms_each"]
        lines.append(f"| {row['work']} | " + " | ".join(
            f"{med[m]:.2f} [{min(each[m]):.2f}-{max(each[m]):.2f}]"
            + ("" if m == "idle" else f" (x{med[m] / med['idle']:.2f})") for m in MODES) + " |")
    if result["not_overlapped"]:
        lines += ["", f"Copies had finished before the work did in: {result['not_overlapped']} (queue more: --copies)."]
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path):
    """Each workload's time against the copy engines idle, per copy mode."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / (len(MODES) - 1)
    for i, mode in enumerate(MODES[1:]):
        ratios = [row["ms"][mode] / row["ms"]["idle"] for row in result["rows"]]
        ax.bar([j + i * width for j in range(len(ratios))], ratios, width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width for j in range(len(result["rows"]))], [row["work"] for row in result["rows"]])
    ax.set_ylabel("time against copies idle")
    ax.set_title(f"Host work while pinned copies run ({result['gpu']})")
    ax.legend(title="copies")
    save_png(fig, path)
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--copy-mib", type=int, default=512, help="bytes of each queued copy")
    p.add_argument("--copies", type=int, default=24, help="copies queued each way per measurement")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--host-memory", choices=("pinned", "write-combined"), default="pinned",
                   help="the copies' host buffer: torch's pinned memory, or write-combined pinned memory")
    p.add_argument("--out", type=Path, default=None, help="folder for JSON, markdown and PNG")
    args = p.parse_args()
    if not torch.cuda.is_available():  # torch alone: it needs neither TE nor this package
        return refuse("host_under_dma.py", "no CUDA GPU is visible (torch.cuda.is_available() is False)")
    numel = args.copy_mib * 2**20 // 2
    gpu = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
    try:
        host = host_buffer(args.host_memory, numel)
    except (ImportError, RuntimeError) as exc:
        return refuse("host_under_dma.py", f"no {args.host_memory} host buffer: {exc}")
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    a = torch.randn(1024, device="cuda")
    b, out = torch.randn_like(a), torch.empty_like(a)
    src, dst = torch.randn(16 * 2**20), torch.empty(16 * 2**20)
    import random

    values = [random.random() for _ in range(2_000_000)]
    order = random.Random(0).sample(range(len(values)), 100_000)
    works = {"launch": lambda: launch_work(a, b, out), "python": python_work,
             "python-large": lambda: large_python_work(values, order), "memcpy": lambda: memcpy_work(src, dst)}
    results = {w: {m: [] for m in MODES} for w in works}
    not_overlapped = []
    for r in range(args.rounds + 1):  # round 0 warms caches, clocks and the copy paths: not kept
        for name, work in works.items():
            for mode in MODES:
                ms, overlapped = measure(mode, work, gpu, host, streams, args.repeats, args.copies)
                if r == 0:
                    continue
                results[name][mode].append(ms)
                if not overlapped:
                    not_overlapped.append((name, mode))
    result = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "host_memory": args.host_memory,
              "command": command_line("benchmarks/experiments/host_under_dma.py", sys.argv[1:]),
              "args": {k: str(v) for k, v in vars(args).items() if k != "out"},
              "rows": [{"work": name, "ms": {m: statistics.median(results[name][m]) for m in MODES},
                        "ms_each": results[name]} for name in works],
              "not_overlapped": sorted(set(not_overlapped))}
    if args.out:
        suffix = () if args.host_memory == "pinned" else ("write_combined",)
        paths = write_reports(args.out, file_stem("host_under_dma", result["gpu"], *suffix), result, markdown, chart)
        print("wrote " + ", ".join(str(x) for x in paths))
    else:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
