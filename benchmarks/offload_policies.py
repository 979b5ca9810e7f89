#!/usr/bin/env python3
"""Memory saved and time spent by each offload policy on a stack of grouped SReLU MLPs.

For each engine (TE V2, TE V1) and policy (all activations offloaded; fc1 / activation / fc2 kept
resident in turn; stock TE ops as the baseline) it reports the median step time, the peak memory
of the whole step (forward and backward) above the static floor (weights, their grads kept in
preallocated buffers as with main_grad, the stack's inputs), activation memory at the end of
forward, bytes offloaded, R = peak freed / bytes offloaded (against the no-offload run of the same
ops), and the PCIe lower bound from bandwidth measured in the same run:

    bound = max(fwd_no_offload, bytes / BW_d2h) + max(bwd_no_offload, bytes / BW_h2d)

One offload context serves all the steps of a policy, as in training. TE chooses V1 or V2 when it
is imported (NVTE_CPU_OFFLOAD_V1), so each engine runs in a child process; this process merges
their rows and writes JSON, markdown and a PNG chart. MLP layers alone have too little compute to
hide their copies; benchmarks/moe_step.py measures the whole MoE transformer step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing

from bench_common import cuda_problem, measure_pcie  # noqa: E402

POLICIES = {  # name -> (ops, offload flags of fc1, act, fc2)
    "stock TE ops": ("te", (True, True, True)),
    "all activations": ("teo", (True, True, True)),
    "keep fc1": ("teo", (False, True, True)),
    "keep act": ("teo", (True, False, True)),
    "keep fc2": ("teo", (True, True, False)),
}
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", "-E", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per expert on average")
    p.add_argument("--routing", choices=["uniform", "skewed"], default="uniform",
                   help="skewed: expert i gets tokens in proportion to 2^-i (the last ones get few)")
    p.add_argument("--hidden", "-H", type=int, default=2688)
    p.add_argument("--ffn", "-F", type=int, default=1856)
    p.add_argument("--layers", "-L", type=int, default=8)
    p.add_argument("--offload-layers", type=int, default=None, help="layers offloaded (default L-1)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--engines", default="v2,v1", help="comma-separated, from v2,v1")
    p.add_argument("--unfused", action="store_true",
                   help="run our ops unfused even where the Hopper fused SReLU MLP could run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for JSON, markdown, PNG")
    p.add_argument("--child", choices=["v2", "v1"], help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.offload_layers = args.layers - 1 if args.offload_layers is None else args.offload_layers
    if not 0 < args.offload_layers < args.layers:
        p.error(f"--offload-layers must be between 1 and L-1={args.layers - 1}")
    for name in ("experts", "tokens", "hidden", "ffn", "iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not args.engines or any(e not in ("v2", "v1") for e in args.engines):
        p.error("--engines takes v2 and/or v1")
    return args


# ------------------------------------------------------------------------------------------------
# Child: one engine, all policies


def split_sizes(args) -> list[int]:
    total = args.experts * args.tokens
    if args.routing == "uniform":
        return [args.tokens] * args.experts
    weights = [2.0 ** -i for i in range(args.experts)]
    sizes = [int(total * w / sum(weights)) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


def build_stack(args, ops: str, offload):
    import torch
    import transformer_engine.pytorch as te

    import te_offload_ops as teo

    E, H, F, dt = args.experts, args.hidden, args.ffn, getattr(torch, DTYPES[args.dtype])
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        if ops == "te":
            mlp = te.ops.Sequential(te.ops.GroupedLinear(E, H, F, bias=False, device="cuda", dtype=dt),
                                    te.ops.ScaledSReLU(),
                                    te.ops.GroupedLinear(E, F, H, bias=False, device="cuda", dtype=dt))
        else:
            mlp = te.ops.Sequential(teo.GroupedLinear(E, H, F, bias=False, device="cuda", dtype=dt, offload=offload[0]),
                                    teo.ScaledSReLU(offload=offload[1]),
                                    teo.GroupedLinear(E, F, H, bias=False, device="cuda", dtype=dt, offload=offload[2]))
        layers.append(mlp)
    return layers


def compute_path(mlp) -> str:
    """Which ops TE's fuser ran forward: "fused" (our Hopper fused op) or "unfused"."""
    ran = [op for group in mlp._module_groups for op, _ in group._forward_ops]
    fused = [op for op in ran if type(op).__name__ == "FusedScaledSReLUMLP"]
    return "fused" if fused and not any(op.last_fallback_reasons for op in fused) else "unfused"


def measure_policy(args, engine: str, ops: str, offload) -> dict:
    """Median step time, forward time, memory and bytes offloaded for one (engine, policy)."""
    import torch

    from te_offload_ops.engines import offload_context

    stack = build_stack(args, ops, offload)
    dt = getattr(torch, DTYPES[args.dtype])
    T = args.experts * args.tokens
    x = torch.randn(T, args.hidden, device="cuda", dtype=dt, requires_grad=True)
    probs = [torch.rand(T, device="cuda", dtype=dt, requires_grad=True) for _ in stack]
    dy = torch.randn(T, args.hidden, device="cuda", dtype=dt)
    splits = torch.tensor(split_sizes(args), device="cuda", dtype=torch.int64)
    weights = [p for mlp in stack for p in mlp.parameters()]
    for w in weights:  # weight grads live in buffers of their own across steps, as main_grad does
        w.grad = torch.zeros_like(w)
    ctx, sync, counter = offload_context(engine, num_layers=args.offload_layers, model_layers=args.layers)

    def step(sync_after_forward: bool):
        counter.bytes.clear()
        for w in weights:
            w.grad.zero_()
        for t in (x, *probs):  # input grads are the step's outputs, not buffers
            t.grad = None
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        h = x * 1.0  # stands in for the previous block's output, which the model does not keep
        for i, mlp in enumerate(stack):
            with ctx:
                h = mlp(h, splits, probs[i], splits)
            h = sync(h)
        ev[1].record()
        fwd_mem = None
        if sync_after_forward:
            torch.cuda.synchronize()
            fwd_mem = torch.cuda.memory_allocated()
        h.backward(dy)
        ev[2].record()
        del h
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[2]), fwd_mem, counter.total

    for _ in range(max(1, args.warmup)):
        step(False)
    path = compute_path(stack[0])
    for t in (x, *probs):
        t.grad = None
    torch.cuda.synchronize()
    floor = torch.cuda.memory_allocated()  # weights, weight grads, inputs: what stays between steps
    _, _, fwd_mem, offloaded = step(True)
    torch.cuda.reset_peak_memory_stats()
    times = [step(False) for _ in range(args.iters)]
    peak = torch.cuda.max_memory_allocated()  # over the whole of each timed step
    fwd_ms = statistics.median(t[0] for t in times)
    step_ms = statistics.median(t[1] for t in times)
    del stack, weights, x, probs, dy, ctx, sync
    torch.cuda.empty_cache()
    return {"path": path, "step_ms": step_ms, "fwd_ms": fwd_ms, "bwd_ms": step_ms - fwd_ms,
            "step_ms_min": min(t[1] for t in times), "step_ms_max": max(t[1] for t in times),
            "floor_MiB": floor / 2**20, "peak_MiB": (peak - floor) / 2**20, "act_MiB": (fwd_mem - floor) / 2**20,
            "offloaded_MiB": offloaded / 2**20}


def run_child(args) -> None:
    import torch

    engine = args.child
    out = {"engine": engine, "pcie": measure_pcie(), "rows": []}
    print(f"[{engine}] PCIe d2h {out['pcie']['d2h_GBps']:.1f} GB/s, h2d {out['pcie']['h2d_GBps']:.1f} GB/s, "
          f"both {out['pcie']['bidirectional_each_GBps']:.1f} GB/s each", flush=True)
    # one no-offload reference per op kind: on Hopper ours run fused, TE's unfused, and they save
    # different tensors, so each offloading row is compared with its own kind
    plan = [("no offload", "teo", (True, True, True), "none"),
            ("no offload, stock TE ops", "te", (True, True, True), "none")]
    plan += [(name, ops, flags, engine) for name, (ops, flags) in POLICIES.items()]
    for i, (name, ops, flags, eng) in enumerate(plan, 1):
        row = {"engine": engine if eng != "none" else "none", "policy": name, "ops": ops,
               "offload": dict(zip(("fc1", "act", "fc2"), flags))}
        row.update(measure_policy(args, eng, ops, flags))
        out["rows"].append(row)
        print(f"[{engine} {i}/{len(plan)}] {name:16s} {row['path']:7s} step {row['step_ms']:7.2f} ms  peak above floor {row['peak_MiB']:8.0f} MiB  "
              f"offloaded {row['offloaded_MiB']:7.0f} MiB", flush=True)
    out["gpu"] = torch.cuda.get_device_name()
    args.child_out.write_text(json.dumps(out))


# ------------------------------------------------------------------------------------------------
# Parent: run the engines, derive R and the bound, report


def derive(rows: list[dict], pcie: dict) -> None:
    """Adds R (peak freed / bytes offloaded) and the PCIe bound to each row, from the no-offload
    row of the same engine run and the same ops (ours or stock TE)."""
    refs = {r["ops"]: r for r in rows if r["engine"] == "none"}
    for r in rows:
        ref = refs[r["ops"]]
        moved = r["offloaded_MiB"] * 2**20
        freed = (ref["peak_MiB"] - r["peak_MiB"]) * 2**20
        r["R"] = freed / moved if moved else None
        d2h_ms = moved / (pcie["d2h_GBps"] * 1e9) * 1e3
        h2d_ms = moved / (pcie["h2d_GBps"] * 1e9) * 1e3
        r["bound_ms"] = max(ref["fwd_ms"], d2h_ms) + max(ref["bwd_ms"], h2d_ms)
        r["vs_bound"] = r["step_ms"] / r["bound_ms"]


def main(argv=None) -> int:
    args = parse_args(argv)
    problem = cuda_problem()
    if problem:
        print(f"offload_policies.py: cannot run: {problem}; it measures GPU memory and PCIe traffic",
              file=sys.stderr)
        return 2
    if args.child:
        run_child(args)
        return 0

    from offload_report import write_reports

    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    print(f"offload policies on {gpu}: E={args.experts} tokens/expert={args.tokens} H={args.hidden} "
          f"F={args.ffn} L={args.layers} (offloading {args.offload_layers}) {args.dtype}", flush=True)
    runs = []
    for engine in args.engines:
        child_out = args.out / f".child_{engine}.json"
        env = dict(os.environ, NVTE_CPU_OFFLOAD_V1="1" if engine == "v1" else "0", PYTHONUNBUFFERED="1")
        if args.unfused:
            env["TEO_FUSED_SRELU_MLP"] = "0"
        cmd = [sys.executable, __file__, "--child", engine, "--child-out", str(child_out)] + (argv or sys.argv[1:])
        if subprocess.run(cmd, env=env).returncode != 0:
            print(f"offload_policies.py: the {engine} run failed (output above)", file=sys.stderr)
            return 1
        run = json.loads(child_out.read_text())
        child_out.unlink()
        derive(run["rows"], run["pcie"])
        runs.append(run)
    result = {
        "benchmark": "offload_policies", "gpu": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": {**{k: getattr(args, k) for k in ("experts", "tokens", "routing", "hidden", "ffn", "layers",
                                                    "offload_layers", "dtype", "warmup", "iters")},
                   "split_sizes": split_sizes(args)},
        "bound_formula": "max(fwd_no_offload, bytes/BW_d2h) + max(bwd_no_offload, bytes/BW_h2d)",
        "runs": runs,
    }
    paths = write_reports(result, args.out)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
