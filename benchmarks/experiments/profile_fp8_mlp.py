"""Where the fused MLP's step under Float8BlockScaling spends its time: GPU time per kernel family;
the step back to back (CUDA events, and on the host clock with the deferred split-size check on
and off); the host's time to queue it, by Python function (cProfile) and by CUDA runtime call;
and the host's cost of queueing one call of each row pass and FP8 GEMM entry point it uses.

    python3 benchmarks/experiments/profile_fp8_mlp.py [--experts 8 --tokens 2048 --hidden 2688 --ffn 1856] [--main-grad]

``--main-grad``: the wgrads added into fp32 ``main_grad`` (Megatron's wgrad fusion). Prints the
tables and writes them as JSON to ``--out`` (default ``profile_fp8_mlp.json``).
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


def back_to_back_ms(step, steps: int) -> dict:
    """Wall time per step back to back (host clock, GPU synchronized before and after), with the
    deferred split-size check as the environment sets it (on by default) and off."""
    from timing import wall_ms

    from te_offload_ops.fused.split_check import check_mode

    mode = check_mode()
    as_set = min(wall_ms(step, steps) for _ in range(3))
    with split_check_off():
        off = min(wall_ms(step, steps) for _ in range(3))
    return {"check_mode": mode, "check_on_ms": as_set, "check_off_ms": off}


def runtime_calls(prof, steps: int) -> list:
    """CUDA runtime and driver calls the host made per step (launches, syncs, copies): count and
    host microseconds, from a torch profiler run."""
    rows = []
    for ev in prof.key_averages():
        if ev.device_type.name == "CPU" and ev.key.startswith("cu") and ev.count:
            rows.append({"call": ev.key, "calls": ev.count / steps, "host_us": ev.cpu_time_total / steps})
    rows.sort(key=lambda r: -r["host_us"])
    return rows


def launch_costs(args, calls: int = 50) -> list:
    """Host microseconds to queue one call of the FP8 step's row passes, weight quantization and
    forward FP8 GEMM entry points, and of a GPU allocation (behind a sleeping GPU, so no call waits
    for it), at the step's shapes."""
    import time

    import torch

    from te_offload_ops import kernels
    from te_offload_ops.kernels import fp8_rows

    t, h, f, e = args.experts * args.tokens, args.hidden, args.ffn, args.experts
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, f, h, device="cuda", dtype=torch.bfloat16)
    splits = torch.full((e,), args.tokens, device="cuda", dtype=torch.int32)
    probs = torch.rand(t, device="cuda", dtype=torch.float32)
    xd, xs = fp8_rows.quantize(x, 0.0, False)
    wr, wrs, _, _ = fp8_rows.quantize_weights(w, False, 0.0, False)
    cases = {
        "fp8_rows.quantize": lambda: fp8_rows.quantize(x, 0.0, False),
        "fp8_rows.dequantize": lambda: fp8_rows.dequantize(xd, xs, torch.bfloat16),
        "fp8_rows.quantize_weights": lambda: fp8_rows.quantize_weights(w, False, 0.0, False),
        "grouped_gemm_fp8_blockwise": lambda: kernels.grouped_gemm_fp8_blockwise(xd, xs, wr, wrs, splits,
                                                                                 torch.bfloat16),
        "grouped_gemm_fp8_srelu_quantize": lambda: kernels.grouped_gemm_fp8_srelu_quantize(
            xd, xs, wr, wrs, splits, probs, eps=0.0, pow2=False, out_dtype=torch.bfloat16),
        "torch.empty": lambda: torch.empty((t, h), device="cuda", dtype=torch.uint8),
    }
    rows = []
    for name, fn in cases.items():
        fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(5e8))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rows.append({"call": name, "host_us": (time.perf_counter() - t0) * 1e6 / calls})
        torch.cuda.synchronize()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mlp_shape_args(ap)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--main-grad", action="store_true", help="wgrads added into fp32 main_grad (Megatron's)")
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
    print(f"step: {wall_ms:.2f} ms back to back (CUDA events), {gpu_ms:.2f} ms of kernels")
    for r in rows[:40]:
        print(f"{r['us_per_step']:9.1f} us  x{r['calls']:<3d} {r['kernel']}")
    runtime = runtime_calls(prof, args.steps)
    print("CUDA runtime/driver calls per step:")
    for r in runtime[:15]:
        print(f"{r['host_us']:9.1f} us  x{r['calls']:<5.1f} {r['call']}")
    b2b = back_to_back_ms(lambda: fr.step(mlp, inputs, "Float8BlockScaling"), args.steps)
    print(f"back to back: {b2b['check_on_ms']:.3f} ms (split-size check {b2b['check_mode']}), "
          f"{b2b['check_off_ms']:.3f} ms (off)")
    launches = launch_costs(args)
    for r in launches:
        print(f"{r['host_us']:8.1f} us to queue {r['call']}")
    host = host_time(lambda: fr.step(mlp, inputs, "Float8BlockScaling"), args.steps)
    print(f"host: {host['host_ms']:.2f} ms per step to queue it (no profiler); under cProfile, by cumulative time:")
    for r in host["top"][:30]:
        print(f"{r['cum_ms']:8.3f} ms cum {r['self_ms']:8.3f} ms self  x{r['calls']:<4.0f} {r['function']}")
    args.out.write_text(json.dumps({"wall_ms": wall_ms, "gpu_ms": gpu_ms, "kernels": rows, "host": host,
                                    "runtime_calls": runtime, "back_to_back": b2b, "launch_host_us": launches,
                                    "gpu": torch.cuda.get_device_name(), "date": utc_now(),
                                    "command": command_line("benchmarks/experiments/profile_fp8_mlp.py", argv)},
                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
