"""Where the fused MLP's step under Float8BlockScaling spends its time: GPU time per kernel family,
the step's wall time against its GPU time (host-bound or not), and the host's time to queue it
by Python function.

    python3 benchmarks/experiments/profile_fp8_mlp.py [--experts 8 --tokens 2048 --hidden 2688 --ffn 1856]

Prints a table of CUDA kernels by total time over ``--steps`` profiled steps and writes it as JSON
to ``--out`` (default ``profile_fp8_mlp.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_common import add_mlp_shape_args, command_line, cuda_problem, refuse, split_check_off, utc_now  # noqa: E402


def host_time(step, steps: int) -> dict:
    """The host's time to queue one step while the GPU is kept busy behind it (a long kernel ahead
    of the steps), then the functions it runs, under cProfile, by cumulative time; the split-size
    check off (:func:`bench_common.split_check_off`)."""
    with split_check_off():
        return _host_time(step, steps)


def _host_time(step, steps: int) -> dict:
    import cProfile
    import pstats
    import time

    import torch

    def queued_ms() -> float:
        torch.cuda._sleep(int(2e9))  # ~1 s of GPU time ahead: the steps only queue
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        ms = (time.perf_counter() - t0) * 1e3 / steps
        torch.cuda.synchronize()
        return ms

    host_ms = min(queued_ms() for _ in range(3))
    prof = cProfile.Profile()
    torch.cuda._sleep(int(2e9))
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    rows = [{"function": f"{Path(path).name}:{line}({func})" if line else func, "calls": calls / steps,
             "self_ms": tottime * 1e3 / steps, "cum_ms": cumtime * 1e3 / steps}
            for (path, line, func), (_, calls, tottime, cumtime, _) in pstats.Stats(prof).stats.items()]
    rows.sort(key=lambda r: -r["cum_ms"])
    return {"host_ms": host_ms, "top": rows[:60]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mlp_shape_args(ap)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("profile_fp8_mlp.json"))
    argv = sys.argv[1:]
    args = ap.parse_args(argv)
    if problem := cuda_problem():
        return refuse("profile_fp8_mlp.py", problem)
    import torch
    from torch.profiler import ProfilerActivity, profile

    import fp8_recipes as fr

    mlp, inputs = fr.make_mlp("ours", args), fr.make_inputs(args)
    for _ in range(3):
        fr.step(mlp, inputs, "Float8BlockScaling")
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.steps):
        fr.step(mlp, inputs, "Float8BlockScaling")
    stop.record()
    torch.cuda.synchronize()
    wall_ms = start.elapsed_time(stop) / args.steps
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            fr.step(mlp, inputs, "Float8BlockScaling")
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        gpu = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        # this package's launch labels (record_function ranges) carry their kernel's device time too
        if gpu and ev.device_type.name == "CUDA" and not ev.key.startswith("te_offload_ops."):
            rows.append({"kernel": ev.key[:110], "calls": ev.count // args.steps, "us_per_step": gpu / args.steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    gpu_ms = sum(r["us_per_step"] for r in rows) / 1e3
    print(f"step: {wall_ms:.2f} ms wall (host ahead), {gpu_ms:.2f} ms of kernels")
    for r in rows[:40]:
        print(f"{r['us_per_step']:9.1f} us  x{r['calls']:<3d} {r['kernel']}")
    host = host_time(lambda: fr.step(mlp, inputs, "Float8BlockScaling"), args.steps)
    print(f"host: {host['host_ms']:.2f} ms per step to queue it (no profiler); under cProfile, by cumulative time:")
    for r in host["top"][:30]:
        print(f"{r['cum_ms']:8.3f} ms cum {r['self_ms']:8.3f} ms self  x{r['calls']:<4.0f} {r['function']}")
    args.out.write_text(json.dumps({"wall_ms": wall_ms, "gpu_ms": gpu_ms, "kernels": rows, "host": host,
                                    "gpu": torch.cuda.get_device_name(), "date": utc_now(),
                                    "command": command_line("benchmarks/experiments/profile_fp8_mlp.py", argv)},
                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
