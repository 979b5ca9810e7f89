#!/usr/bin/env python3
"""Whether the memory budget te_offload_ops recommends is ever slower than teo's default schedule.

The step: 8 MoE transformer layers of ``benchmarks/moe_model.py`` (H=2688, 21 heads, F=1856, 8
experts, top-2, bf16, SDPA attention), 2 x 4096 tokens, forward, backward and a fused AdamW step:
a step the host cannot run far ahead of. For each policy (MLP 7/8, MLP 8/8, layer 4/8):

1. ``te_offload_ops.engines.measure_budget`` with this step: the target budget (no offload's peak
   less 0.96 of the bytes teo's default schedule moves) and its advice (the budget, or the default
   schedule where the budget's step measured slower);
2. teo's default schedule and teo under the target budget, alternately in this process
   (``--warmup`` steps each, then ``--steps`` pairs): median step ms (CUDA events from the
   forward's start to the optimizer's end: host gaps included) and the active peak above the
   static floor (MiB), and the budget's counters per step: copies waited for, prefetches put off,
   looks, memory reads and the host ms its looks took;
3. the verdict: the recommendation's median step against the default's (no slower, within
   ``--tolerance``, at the same or lower peak, or the recommendation is the default itself).

Prints one table and writes ``teo_budget_check_<GPU>.{json,md}`` into ``--out``. About 1-2 minutes
on an H100 (most of it building the model and compiling the fused MLP's kernels); on a machine
without a GPU it says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from bench_common import cuda_problem, file_stem, refuse, utc_now, write_reports  # noqa: E402
from timing import active_bytes, median  # noqa: E402

SHAPE = {"hidden": 2688, "heads": 21, "ffn": 1856, "experts": 8, "topk": 2}
POLICIES = ("mlp:7", "mlp:8", "layer:4")
MiB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=2, help="sequences per step (default 2)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--policies", default=",".join(POLICIES), help="scope:n, comma-separated (scope mlp or layer)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each arm before the pairs")
    p.add_argument("--steps", type=int, default=10, help="timed pairs (default arm, budget arm)")
    p.add_argument("--freed", type=float, default=0.96, help="share of the moved bytes the target frees")
    p.add_argument("--tolerance", type=float, default=0.01, help="noise allowed in the verdict (default 1%%)")
    args = p.parse_args(argv)
    try:
        args.policies = [_policy(text, args.layers) for text in args.policies.split(",") if text.strip()]
    except ValueError as exc:
        p.error(str(exc))
    for name in ("layers", "batch", "seq", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or not 0 < args.freed <= 1 or args.tolerance < 0:
        p.error("--warmup must be >= 0, --freed in (0, 1], --tolerance >= 0")
    return args


def _policy(text: str, layers: int) -> tuple[str, int]:
    scope, _, n = text.strip().partition(":")
    if scope not in ("mlp", "layer") or not n.isdigit() or not 1 <= int(n) <= layers:
        raise ValueError(f"a policy is mlp:N or layer:N with 1 <= N <= --layers={layers}, got {text!r}")
    return scope, int(n)


def verdict(row: dict, tolerance: float) -> str:
    """Whether the recommendation is no slower than the default schedule at the same or lower peak."""
    if not row["recommended_budget"]:
        return "recommends the default schedule: the same step"
    ratio = row["budget_ms"] / row["default_ms"]
    if ratio <= 1 + tolerance:
        return f"no slower: {ratio:.3f}x the default's step"
    if row["budget_peak_MiB"] < row["default_peak_MiB"]:
        return f"slower ({ratio:.3f}x) at a lower peak: a trade, not a loss at the same peak"
    return f"SLOWER: {ratio:.3f}x the default's step at no lower peak"


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"# teo's recommended budget against its default schedule, {result['gpu']}", "",
             f"{c['layers']} layers, {c['batch']} x {c['seq']} tokens, H={SHAPE['hidden']}, F={SHAPE['ffn']}, "
             f"{SHAPE['experts']} experts top-{SHAPE['topk']}, bf16, MLP path {result['path']}; static floor "
             f"{result['floor_MiB']:.0f} MiB. Medians of {c['steps']} alternating pairs after {c['warmup']} warm-up "
             f"steps each; peaks are the allocator's active peak above the floor; the budget is the target of "
             f"measure_budget (freeing {c['freed']} of the bytes moved); counters per step.", "",
             "| policy | default ms | default peak MiB | budget ms | budget peak MiB | budget GiB | advice | "
             "waits (MiB) | put off | looks / reads | look host ms | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['policy']} | {r['default_ms']:.1f} | {r['default_peak_MiB']:.0f} | {r['budget_ms']:.1f} | "
            f"{r['budget_peak_MiB']:.0f} | {r['budget_bytes'] / 2**30:.2f} | "
            f"{'budget' if r['recommended_budget'] else 'default'} | {r['waits']:.1f} ({r['wait_MiB']:.0f}) | "
            f"{r['deferred']:.1f} | {r['looks']:.0f} / {r['reads']:.0f} | {r['look_ms']:.2f} | {r['verdict']} |")
    lines += ["", "measure_budget's reasons:", ""] + [f"- {r['policy']}: {r['reason']}" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if problem := cuda_problem():
        return refuse("teo_budget_check.py", problem)
    import torch

    from moe_model import LayerShape, build_stack, compute_path, forward_stack
    from te_offload_ops.engines import measure_budget, offload_context

    dtype = torch.bfloat16
    stack = build_stack(LayerShape(**SHAPE), args.layers, dtype)
    params = [p for p in stack.parameters() if p.requires_grad]
    for p in params:  # grads in buffers of their own for the whole run, as main_grad would be
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-6, fused=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens = args.batch * args.seq
    x = torch.randn(tokens, SHAPE["hidden"], device="cuda", dtype=dtype, generator=g)
    dy = torch.randn(tokens, SHAPE["hidden"], device="cuda", dtype=dtype, generator=g)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    def step(scope):
        def run(ctx, sync):
            events[0].record()
            out = forward_stack(stack, x.clone(), args.batch, scope, ctx, sync)
            out.backward(dy)
            del out
            opt.step()
            opt.zero_grad(set_to_none=False)
            events[1].record()
        return run

    none = offload_context("none", num_layers=0, model_layers=args.layers)
    step("layer")(none[0], none[1])  # allocates the optimizer state and what stays between steps
    torch.cuda.synchronize()
    floor = active_bytes()
    path = compute_path(stack)
    rows = []
    for scope, n in args.policies:
        label = f"{'MLP' if scope == 'mlp' else 'layer'} {n}/{args.layers}"
        print(f"[teo_budget_check] {label}: measure_budget, then {args.steps} alternating steps ...", flush=True)
        run = step(scope)
        advice = measure_budget(run, num_layers=n, model_layers=args.layers, freed=args.freed)
        arms = {"default": offload_context("teo", num_layers=n, model_layers=args.layers),
                "budget": offload_context("teo", num_layers=n, model_layers=args.layers,
                                          memory_budget=advice.target_bytes)}
        for name, (ctx, sync, _) in arms.items():
            for _ in range(args.warmup):
                run(ctx, sync)
        budget_engine = arms["budget"][0].engine
        schedule = budget_engine.schedule
        before = (budget_engine.budget_waits, budget_engine.budget_wait_bytes, budget_engine.reloads_deferred,
                  schedule.looks, schedule.allocator.reads, schedule.look_seconds)
        times = {"default": [], "budget": []}
        peaks = {"default": 0, "budget": 0}
        for _ in range(args.steps):
            for name, (ctx, sync, _) in arms.items():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                run(ctx, sync)
                torch.cuda.synchronize()
                times[name].append(events[0].elapsed_time(events[1]))
                peaks[name] = max(peaks[name], active_bytes(peak=True) - floor)
        after = (budget_engine.budget_waits, budget_engine.budget_wait_bytes, budget_engine.reloads_deferred,
                 schedule.looks, schedule.allocator.reads, schedule.look_seconds)
        per = [(b - a) / args.steps for a, b in zip(before, after)]
        row = {"policy": label, "scope": scope, "layers": n, "budget_bytes": advice.target_bytes,
               "recommended_budget": advice.budget is not None, "reason": advice.reason,
               "default_ms": median(times["default"]), "budget_ms": median(times["budget"]),
               "default_peak_MiB": peaks["default"] / MiB, "budget_peak_MiB": peaks["budget"] / MiB,
               "no_offload_peak_MiB": advice.no_offload_peak_bytes / MiB, "moved_MiB": advice.moved_bytes / MiB,
               "waits": per[0], "wait_MiB": per[1] / MiB, "deferred": per[2], "looks": per[3], "reads": per[4],
               "look_ms": per[5] * 1e3, "steps_ms": times}
        row["verdict"] = verdict(row, args.tolerance)
        print(f"{label}: default {row['default_ms']:.1f} ms / {row['default_peak_MiB']:.0f} MiB, budget "
              f"{row['budget_ms']:.1f} ms / {row['budget_peak_MiB']:.0f} MiB: {row['verdict']}", flush=True)
        rows.append(row)
        del arms, budget_engine, schedule
    gpu = torch.cuda.get_device_name()
    result = {"gpu": gpu, "date": utc_now(), "path": path, "floor_MiB": floor / MiB, "rows": rows,
              "config": {k: getattr(args, k) for k in ("layers", "batch", "seq", "warmup", "steps", "freed",
                                                       "tolerance")} | {"policies": [f"{s}:{n}" for s, n in args.policies]}}
    write_reports(args.out, file_stem("teo_budget_check", gpu), result, markdown, lambda r, p: False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
