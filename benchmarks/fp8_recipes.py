#!/usr/bin/env python3
"""The grouped MLP under each of TE's quantization recipes: this package's ops against TE's, same run.

One MoE expert MLP (GroupedLinear -> ScaledSReLU -> GroupedLinear, bf16 weights) at E experts x
tokens per expert, forward + backward back to back, for: no recipe, ``DelayedScaling``,
``Float8CurrentScaling``, ``Float8BlockScaling`` (where cuBLAS has an algorithm for it). Per recipe and
implementation:

- fwd+bwd time: median of CUDA-event samples, each over back-to-back calls, TE's and ours sampled
  in turn;
- bytes saved for backward per layer, split into activations and weight copies (FP8 transposes of
  the weights that the forward made): every tensor autograd saved, each storage counted once;
- bytes TE's V2 engine moves per layer, measured: a two-layer stack under
  ``offload_context("v2", num_layers=1)``, the first layer's bytes as the engine's counter adds them.

Where an implementation fails under a recipe (TE raises), its row holds the error; the other is
still measured. Writes JSON, markdown and a
PNG into ``--out`` as ``fp8_recipes_<GPU>[_<shape>][_<recipes>][_main_grad][_later_micro_batch]``:
the shape where it is not the default (e.g. ``_E8x4096_H7168_F2048``), the recipes where not all ran
(e.g. ``_bf16_and_block``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_common import (  # noqa: E402
    add_mlp_shape_args, attach_main_grads, cuda_problem, file_stem, mlp_shape_suffix, pyplot, refuse, save_png,
    split_check_off, utc_now, write_reports,
)
from timing import event_ms, interleaved, median  # noqa: E402

RECIPES = ("none", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")
IMPLS = ("te", "ours")
MiB = 2**20
RECIPE_NAMES = {"none": "bf16", "DelayedScaling": "delayed", "Float8CurrentScaling": "current",
                "Float8BlockScaling": "block"}  # in file stems


def recipes_suffix(recipes: list) -> str:
    """A results-file suffix naming the recipes where not all ran, e.g. ``bf16_and_block``."""
    return "" if sorted(recipes) == sorted(RECIPES) else "_and_".join(RECIPE_NAMES[r] for r in RECIPES
                                                                       if r in recipes)


def results_stem(gpu: str, args) -> str:
    return file_stem("fp8_recipes", gpu, mlp_shape_suffix(args), recipes_suffix(args.recipes),
                     "main_grad" if args.main_grad else "", "later_micro_batch" if args.later_micro_batch else "")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_mlp_shape_args(p)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, of {', '.join(RECIPES)}")
    p.add_argument("--main-grad", action="store_true",
                   help="Megatron's wgrad fusion on both implementations: accumulate_into_main_grad=True, wgrads "
                        "added into fp32 main_grad buffers, .grad dropped (results stem gets _main_grad)")
    p.add_argument("--later-micro-batch", action="store_true",
                   help="time this package's ops as a later micro-batch of an optimizer step: FP8 weights "
                        "quantized at the first call and reused (is_first_microbatch=False, as Megatron sets it "
                        "after a step's first micro-batch; TE's ops unchanged; results stem gets "
                        "_later_micro_batch)")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    for name in ("experts", "tokens", "hidden", "ffn", "iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    args.recipes = [r for r in args.recipes.split(",") if r]
    if bad := [r for r in args.recipes if r not in RECIPES]:
        p.error(f"unknown recipe(s) {bad}; choose from {RECIPES}")
    return args


def make_recipe(name: str):
    from transformer_engine.common import recipe

    return None if name == "none" else getattr(recipe, name)()


def make_mlp(impl: str, args, seed: int = 0):
    import torch
    import transformer_engine.pytorch as te

    import te_offload_ops as teo

    ns = te.ops if impl == "te" else teo
    torch.manual_seed(seed)
    main_grad = getattr(args, "main_grad", False)
    kw = dict(bias=False, device="cuda", dtype=torch.bfloat16, accumulate_into_main_grad=main_grad)
    mlp = te.ops.Sequential(ns.GroupedLinear(args.experts, args.hidden, args.ffn, **kw), ns.ScaledSReLU(),
                            ns.GroupedLinear(args.experts, args.ffn, args.hidden, **kw))
    if main_grad:
        attach_main_grads(mlp)
    if impl == "ours" and getattr(args, "later_micro_batch", False):
        for op in (mlp[0], mlp[2]):
            op.is_first_microbatch = False  # the first call quantizes and keeps the weights; later calls reuse them
    return mlp


def make_inputs(args, seed: int = 1):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    tokens = args.experts * args.tokens
    x = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    probs = torch.rand(tokens, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn(tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    splits = torch.full((args.experts,), args.tokens, device="cuda", dtype=torch.int64)
    return x, probs, dy, splits


def autocast(recipe_name: str):
    import contextlib

    import transformer_engine.pytorch as te

    recipe = make_recipe(recipe_name)
    return contextlib.nullcontext() if recipe is None else te.autocast(enabled=True, recipe=recipe)


def step(mlp, inputs, recipe_name: str):
    x, probs, dy, splits = inputs
    with autocast(recipe_name):
        y = mlp(x, splits, probs, splits)
    y.backward(dy)


def time_ms(fns: dict, iters: int, inner: int = 5) -> dict:
    """Median CUDA-event ms per call of each function, sampled in turn (``timing.interleaved``) so
    that drift falls on every one alike; each sample times ``inner`` back-to-back calls."""
    samples = interleaved({name: (lambda fn=fn: event_ms(fn, 1, inner=inner, warmup=0)) for name, fn in fns.items()},
                          iters)
    return {name: median(v) for name, v in samples.items()}


def weight_shaped(t, args) -> bool:
    """A saved tensor with a weight's shape (either orientation): a weight or a copy the forward made."""
    shapes = {(args.ffn, args.hidden), (args.hidden, args.ffn)}
    return tuple(t.shape[-2:]) in shapes and (t.dim() == 2 or t.shape[0] == args.experts)


def saved_bytes(mlp, inputs, recipe_name: str, args) -> dict:
    """Bytes autograd saved in one forward, each storage once: activations and weight copies."""
    import torch

    seen, parts = set(), {"activations": 0, "weight_copies": 0, "parameters": 0}

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if t.device.type == "cuda" and key not in seen:
            seen.add(key)
            kind = ("parameters" if isinstance(t, torch.nn.Parameter) else
                    "weight_copies" if weight_shaped(t, args) else "activations")
            parts[kind] += key[1]
        return t

    x, probs, dy, splits = inputs
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(recipe_name):
        y = mlp(x, splits, probs, splits)
    y.backward(dy)
    return {k: v / MiB for k, v in parts.items()}


def v2_moved(impl: str, args, recipe_name: str) -> float:
    """MiB TE's V2 engine moves for the first of two layers (what it offloads per layer)."""
    import torch

    from te_offload_ops.engines import offload_context

    layers = [make_mlp(impl, args, seed=i) for i in range(2)]
    x, probs, dy, splits = make_inputs(args)
    ctx, sync, counter = offload_context("v2", num_layers=1, model_layers=2)
    h = x * 1.0
    for mlp in layers:
        with ctx, autocast(recipe_name):
            h = mlp(h, splits, probs, splits)
        h = sync(h)
    h.backward(dy)
    torch.cuda.synchronize()
    return counter.total / MiB


def measure(recipe_name: str, args) -> list[dict]:
    """Rows for TE's ops and ours under one recipe; times from one round-robin sampling."""
    import torch

    rows = {impl: {"impl": impl, "recipe": recipe_name} for impl in IMPLS}
    mlps, inputs = {impl: make_mlp(impl, args) for impl in IMPLS}, make_inputs(args)
    runs = {}
    for impl in IMPLS:  # each alone first: one that raises (TE's error is its result) leaves the other timed
        try:
            step(mlps[impl], inputs, recipe_name)
            torch.cuda.synchronize()
            runs[impl] = mlps[impl]
        except Exception as exc:  # noqa: BLE001
            rows[impl]["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    if runs:
        times = time_ms({impl: (lambda m=mlp: step(m, inputs, recipe_name)) for impl, mlp in runs.items()},
                        args.iters)
        for impl in runs:
            row = rows[impl]
            row["ms"] = times[impl]
            row["saved_MiB"] = saved_bytes(mlps[impl], inputs, recipe_name, args)
            row["v2_moved_MiB"] = v2_moved(impl, args, recipe_name)
            row["host_queue_ms"], row["host_ahead_ms"] = gpu_time_host_ahead(mlps[impl], inputs, recipe_name)
            row["plan"] = [type(op).__name__ for group in mlps[impl]._module_groups for op, _ in group._forward_ops]
    torch.cuda.synchronize()
    return [rows[impl] for impl in IMPLS]


def command_line(argv: list) -> str:
    from bench_common import command_line as named

    return named("benchmarks/fp8_recipes.py", argv)


def gpu_time_host_ahead(mlp, inputs, recipe_name: str):
    """(host ms to queue the step, the step's GPU ms) with the host ahead of the GPU (its queueing
    hidden, as in a deep model), or (None, None) where the step waits for the GPU on the host (TE's
    ops read the split sizes there).
    The deferred split-size check, which waits at the backward's end for its copy when the GPU
    lags far behind, is off for this figure only."""
    from timing import host_and_gpu_ahead_ms

    with split_check_off():
        return host_and_gpu_ahead_ms(lambda: step(mlp, inputs, recipe_name))


def tflops(args, ms: float) -> float:
    flops = 6 * 2 * args.experts * args.tokens * args.hidden * args.ffn  # 2 GEMMs fwd, 4 bwd
    return flops / (ms * 1e-3) / 1e12


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Grouped MLP under TE's quantization recipes ({result['gpu']}, {result['date']})", "",
             f"E={a['experts']} x {a['tokens']} tokens, H={a['hidden']}, F={a['ffn']}, bf16 weights, fwd+bwd"
             + (", wgrads added into fp32 main_grad (Megatron's wgrad fusion)" if a.get("main_grad") else "")
             + (", this package's ops timed as a later micro-batch of a step (FP8 weights quantized once, reused)"
                if a.get("later_micro_batch") else "") + ". "
             f"Command: `{result['command']}`", "",
             "Host ahead: the GPU time of a step queued behind a sleeping GPU (no host time in it; `-`: the "
             "step waits for the GPU on the host); host queue: the host's time to queue that step. Back to back "
             "a step takes at least the larger of the two.", "",
             "| recipe | ops | fwd+bwd ms | TFLOP/s | host ahead ms | TFLOP/s host ahead | host queue ms | "
             "saved activations MiB | saved weight copies MiB | V2 moves per layer MiB | ran as |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        name = "TE ops" if r["impl"] == "te" else "te_offload_ops"
        if "error" in r:
            lines.append(f"| {r['recipe']} | {name} | {r['error']} | | | | | | | | |")
            continue
        s = r["saved_MiB"]
        ahead = r.get("host_ahead_ms")
        ahead_cells = "- | -" if ahead is None else f"{ahead:.2f} | {tflops(argparse.Namespace(**result['args']), ahead):.0f}"
        queue = r.get("host_queue_ms")  # absent from results written before the column
        ahead_cells += " | " + ("-" if queue is None else f"{queue:.2f}")
        lines.append(f"| {r['recipe']} | {name} | {r['ms']:.2f} | {tflops_of(result, r):.0f} | {ahead_cells} | "
                     f"{s['activations']:.0f} | {s['weight_copies']:.0f} | {r['v2_moved_MiB']:.0f} | "
                     f"{' + '.join(r['plan'])} |")
    return "\n".join(lines) + "\n"


def tflops_of(result, row) -> float:
    return tflops(argparse.Namespace(**result["args"]), row["ms"])


def plot(result: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in result["rows"] if "error" not in r]
    recipes = [r for r in RECIPES if any(x["recipe"] == r for x in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for k, impl in enumerate(IMPLS):
        by = {r["recipe"]: r for r in rows if r["impl"] == impl}
        xs = [i + (k - 0.5) * width for i in range(len(recipes))]
        label = "TE ops" if impl == "te" else "te_offload_ops"
        axes[0].bar(xs, [by[r]["ms"] if r in by else 0 for r in recipes], width, label=label)
        axes[1].bar(xs, [by[r]["v2_moved_MiB"] if r in by else 0 for r in recipes], width, label=label)
    for ax, title in zip(axes, ("fwd+bwd ms", "MiB TE V2 moves per layer")):
        ax.set_xticks(range(len(recipes)), recipes, rotation=15)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"Grouped MLP per recipe, {result['gpu']}, {result['date']}")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if problem := cuda_problem():
        return refuse("fp8_recipes.py", problem)
    import torch

    gpu = torch.cuda.get_device_name()
    rows = []
    for k, recipe_name in enumerate(args.recipes, 1):
        print(f"[fp8_recipes] {k}/{len(args.recipes)} {recipe_name}: TE ops and te_offload_ops ...", flush=True)
        for row in measure(recipe_name, args):
            rows.append(row)
            print(f"[fp8_recipes]   {json.dumps(row)}", flush=True)
    result = {"gpu": gpu, "date": utc_now(), "args": {k: v for k, v in vars(args).items()
              if k in ("experts", "tokens", "hidden", "ffn", "iters", "main_grad", "later_micro_batch")},
              "command": command_line(argv if argv is not None else sys.argv[1:]),
              "torch": torch.__version__, "rows": rows}
    paths = write_reports(args.out, results_stem(gpu, args), result, markdown, plot)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
