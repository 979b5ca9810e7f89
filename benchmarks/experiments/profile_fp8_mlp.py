"""Where the fused MLP's step under Float8BlockScaling spends its time: GPU time per kernel family,
and the step's wall time against its GPU time (host-bound or not).

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2688)
    ap.add_argument("--ffn", type=int, default=1856)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("profile_fp8_mlp.json"))
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    import fp8_recipes as fr

    if not torch.cuda.is_available():
        print("profile_fp8_mlp.py: cannot run: no CUDA GPU", file=sys.stderr)
        return 2
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
        if gpu and ev.device_type.name == "CUDA":
            rows.append({"kernel": ev.key[:110], "calls": ev.count // args.steps, "us_per_step": gpu / args.steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    gpu_ms = sum(r["us_per_step"] for r in rows) / 1e3
    print(f"step: {wall_ms:.2f} ms wall (host ahead), {gpu_ms:.2f} ms of kernels")
    for r in rows[:40]:
        print(f"{r['us_per_step']:9.1f} us  x{r['calls']:<3d} {r['kernel']}")
    args.out.write_text(json.dumps({"wall_ms": wall_ms, "gpu_ms": gpu_ms, "kernels": rows,
                                    "gpu": torch.cuda.get_device_name()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
