#!/usr/bin/env python3
"""The first training step of a fresh process: this package's fused MLP with a cold kernel cache,
with a warm one, and with stock Transformer Engine ops.

Each run is a new Python process (the way a job's ranks start) that imports torch, Transformer
Engine and this package, builds the workload and times its first forward + backward (synchronized),
then its second. Modes:

* cold  - this package's ops, an empty kernel cache directory: every kernel is compiled (and written);
* warm  - this package's ops, the directory the cold run just filled: every kernel is loaded;
* stock - TE's own ops (te.ops.GroupedLinear, te.ops.ScaledSReLU) in place of this package's;
* off   - this package's ops with TEO_KERNEL_CACHE=0 (compiled, nothing written; not run by default).

Workloads: "mlp", one grouped SReLU MLP (E experts, T routed rows); "model", benchmarks/moe_model.py's
stack of MoE transformer layers (attention, router, permutation, the grouped MLP). The rounds run the
modes interleaved (cold, warm, stock, ...), each a fresh cache directory for cold; medians over rounds.
The target: a warm cache's first step within 1 s of stock's. Writes ``first_step_<GPU>.{json,md,png}``
into ``--out``.

Where the time goes, per process: the imports (torch, Transformer Engine, this package) before the
workload is built; in the first step, the CuTe DSL's import (where the process imported it: to
compile, or to load an entry the disk cache holds without a shared object), the kernels' compiles
or loads, and their first launches (host time of the launch that loads a kernel onto the GPU).
``--profile`` adds one more process per workload and mode under cProfile (the first step only),
its functions by cumulative time in ``first_step_<GPU>_profile_<workload>_<mode>.txt``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_common import cuda_problem, file_stem, mlp_path, pyplot, refuse, save_png, utc_now, write_reports  # noqa: E402
from timing import median, wall_ms  # noqa: E402

MODES = ("cold", "warm", "stock", "off")
WORKLOADS = ("mlp", "model")
TARGET_S = 1.0  # a warm cache's first step at most this much longer than stock's


def _command(argv: list) -> str:
    from bench_common import command_line

    return command_line("benchmarks/first_step.py", argv)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="mlp,model", help=f"comma-separated, from {', '.join(WORKLOADS)}")
    p.add_argument("--modes", default="cold,warm,stock", help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("--rounds", type=int, default=2, help="processes per (workload, mode)")
    p.add_argument("--experts", "-E", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--hidden", "-H", type=int, default=2048)
    p.add_argument("--ffn", "-F", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16, help="attention heads (model)")
    p.add_argument("--layers", "-L", type=int, default=4, help="MoE transformer layers (model)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence; one sequence a step")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--profile", action="store_true",
                   help="one more process per workload and mode with its first step under cProfile")
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--profile-to", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("rounds", "experts", "topk", "hidden", "ffn", "heads", "layers", "seq"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    if args.topk > args.experts:
        p.error(f"--topk={args.topk} must be at most --experts={args.experts}")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.workloads or any(w not in WORKLOADS for w in args.workloads):
        p.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    if not args.modes or any(m not in MODES for m in args.modes):
        p.error(f"--modes: choose from {', '.join(MODES)}")
    if "warm" in args.modes and "cold" not in args.modes:
        p.error("--modes: warm loads what cold wrote; name cold too")
    return args


# -- one process: the first steps ---------------------------------------------------------------------

def _stock_mlp(te, E, H, F, dtype):
    kw = dict(bias=False, device="cuda", dtype=dtype)
    return te.ops.Sequential(te.ops.GroupedLinear(E, H, F, **kw), te.ops.ScaledSReLU(),
                             te.ops.GroupedLinear(E, F, H, **kw))


def _build(args, workload: str, mode: str):
    """(step function, fused-path check) for one workload; the step is forward + backward."""
    import torch
    import transformer_engine.pytorch as te

    import te_offload_ops as teo

    dtype, E, H, F = torch.bfloat16, args.experts, args.hidden, args.ffn
    torch.manual_seed(0)
    if workload == "mlp":
        rows = args.seq * args.topk
        if mode == "stock":
            mlp = _stock_mlp(te, E, H, F, dtype)
        else:
            kw = dict(bias=False, device="cuda", dtype=dtype)
            mlp = te.ops.Sequential(teo.GroupedLinear(E, H, F, **kw), teo.ScaledSReLU(), teo.GroupedLinear(E, F, H, **kw))
        x = torch.randn(rows, H, device="cuda", dtype=dtype, requires_grad=True)
        probs = torch.rand(rows, device="cuda", dtype=dtype, requires_grad=True)
        cuts = torch.sort(torch.randint(0, rows + 1, (E - 1,))).values
        splits = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([rows])])).to("cuda")
        dy = torch.randn(rows, H, device="cuda", dtype=dtype)

        def step():
            mlp(x, splits, probs, splits).backward(dy)

        return step, (lambda: "stock TE ops" if mode == "stock" else mlp_path(mlp))
    from moe_model import LayerShape, build_stack, compute_path, forward_stack

    shape = LayerShape(hidden=H, heads=args.heads, ffn=F, experts=E, topk=args.topk)
    stack = build_stack(shape, args.layers, dtype)
    if mode == "stock":
        for layer in stack:
            layer.mlp = _stock_mlp(te, E, H, F, dtype)
    x = torch.randn(args.seq, H, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(args.seq, H, device="cuda", dtype=dtype)

    def step():
        forward_stack(stack, x, 1, "layer").backward(dy)

    return step, (lambda: "stock TE ops" if mode == "stock" else compute_path(stack))


PROFILE_LINES = 60  # functions listed per profile, by cumulative time


def _profiled(step, path: Path):
    """``step`` under cProfile, its statistics written to ``path``."""
    import cProfile
    import io
    import pstats

    def run():
        profile = cProfile.Profile()
        profile.runcall(step)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(PROFILE_LINES)
        path.write_text(text.getvalue())

    return run


def child(args) -> int:
    started = time.time()
    workload, mode = args.child
    import torch
    import transformer_engine.pytorch  # noqa: F401

    import te_offload_ops  # noqa: F401
    from te_offload_ops.kernels import registry

    imported = time.time()
    step, path = _build(args, workload, mode)
    torch.cuda.synchronize()
    built = time.time()
    first = _profiled(step, args.profile_to) if args.profile_to else step
    times = [wall_ms(fn, 1) / 1e3 for fn in (first, step)]  # the first step, then the second
    launched = float(os.environ["TEO_BENCH_LAUNCHED"])
    print("RESULT " + json.dumps({
        "workload": workload, "mode": mode, "first_step_s": times[0], "second_step_s": times[1],
        "start_to_built_s": built - launched, "imports_s": imported - started,
        "process_s": time.time() - launched, "in_process_setup_s": built - started,
        "path": path(), "compiled": len(registry.compile_times()), "compile_s": sum(registry.compile_times().values()),
        "loaded": len(registry.load_times()), "load_s": sum(registry.load_times().values()),
        "loaded_by": sorted(set(registry.loaded_by().values())), "dsl_imported": "cutlass" in sys.modules,
        "dsl_import_s": registry.dsl_import_seconds(), "first_launch_s": sum(registry.first_launch_times().values())}),
        flush=True)
    return 0


# -- the parent: processes, report --------------------------------------------------------------------

def _run(args, workload: str, mode: str, cache: Path, profile_to: Path | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
           "TEO_KERNEL_CACHE": "0" if mode == "off" else "1", "TEO_KERNEL_CACHE_DIR": str(cache),
           "TEO_BENCH_LAUNCHED": repr(time.time())}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", workload, mode,
           "--experts", str(args.experts), "--topk", str(args.topk), "--hidden", str(args.hidden),
           "--ffn", str(args.ffn), "--heads", str(args.heads), "--layers", str(args.layers), "--seq", str(args.seq)]
    if profile_to is not None:
        cmd += ["--profile-to", str(profile_to)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{workload}/{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def summarize(runs: list[dict], workloads, modes) -> list[dict]:
    rows = []
    for w in workloads:
        stock = [r["first_step_s"] for r in runs if r["workload"] == w and r["mode"] == "stock"]
        for m in modes:
            mine = [r for r in runs if r["workload"] == w and r["mode"] == m]
            if not mine:
                continue
            row = {"workload": w, "mode": m, "runs": len(mine)}
            for k in ("first_step_s", "second_step_s", "process_s", "imports_s", "compiled", "loaded", "compile_s",
                      "load_s", "dsl_import_s", "first_launch_s"):
                row[k] = median(r[k] for r in mine)
            row["paths"] = sorted({r["path"] for r in mine})
            row["loaded_by"] = sorted({by for r in mine for by in r["loaded_by"]})
            row["dsl_imported"] = sum(bool(r["dsl_imported"]) for r in mine)
            if stock and m != "stock":
                row["vs_stock_s"] = row["first_step_s"] - median(stock)
            rows.append(row)
    return rows


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"# First step of a fresh process ({result['gpu']}, {result['date']})", "",
             f"mlp: {s['experts']} experts, H={s['hidden']}, F={s['ffn']}, {s['seq'] * s['topk']} routed rows "
             f"(bf16); model: {s['layers']} MoE layers of that MLP with {s['heads']}-head attention, top-{s['topk']} "
             f"routing, one sequence of {s['seq']} tokens. Medians over {s['rounds']} process(es) per row. "
             f"Target: warm within {TARGET_S:.0f} s of stock's first step. Imports: torch, Transformer Engine and "
             f"this package, before the workload is built. In the first step: the CuTe DSL's import (processes "
             f"that imported it / runs), compiles or loads (and how loaded), the kernels' first launches.", "",
             "| workload | mode | first step (s) | vs stock (s) | second step (s) | imports (s) | DSL import (s) | "
             "kernels compiled | compile (s) | kernels loaded | load (s) | loaded by | first launches (s) | "
             "process start to 2nd step done (s) | path |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|"]
    for r in result["summary"]:
        vs = f"{r['vs_stock_s']:+.2f}" if "vs_stock_s" in r else ""
        lines.append(f"| {r['workload']} | {r['mode']} | {r['first_step_s']:.2f} | {vs} | {r['second_step_s']:.3f} | "
                     f"{r['imports_s']:.2f} | {r['dsl_import_s']:.2f} ({r['dsl_imported']}/{r['runs']}) | "
                     f"{r['compiled']:.0f} | {r['compile_s']:.2f} | {r['loaded']:.0f} | {r['load_s']:.3f} | "
                     f"{', '.join(r['loaded_by']) or '-'} | {r['first_launch_s']:.3f} | "
                     f"{r['process_s']:.1f} | {', '.join(r['paths'])} |")
    verdicts = [f"{r['workload']}: warm {r['vs_stock_s']:+.2f} s vs stock: "
                f"{'meets' if r['vs_stock_s'] <= TARGET_S else 'misses'} the target"
                for r in result["summary"] if r["mode"] == "warm" and "vs_stock_s" in r]
    return "\n".join(lines + ([""] + verdicts if verdicts else [])) + "\n"


def chart(result: dict, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = result["summary"]
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(modes)
    for j, m in enumerate(modes):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            for r in rows:
                if r["workload"] == w and r["mode"] == m:
                    xs.append(i + (j - (len(modes) - 1) / 2) * width)
                    ys.append(r["first_step_s"])
        bars = ax.bar(xs, ys, width, label=m)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("first step of a fresh process (s)")
    ax.set_title(f"First step: kernel cache cold / warm vs stock TE ({result['gpu']})", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return True


def _version(dist: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    if problem := cuda_problem():
        return refuse("first_step.py", problem)
    import torch

    from te_offload_ops.fused.selection import kernel_problem

    if torch.cuda.get_device_capability() != (9, 0) or kernel_problem():
        return refuse("first_step.py", f"the fused MLP needs an sm_90 GPU and the CuTe DSL "
                                       f"({kernel_problem() or torch.cuda.get_device_name()})")
    gpu = torch.cuda.get_device_name()
    order = [m for m in MODES if m in args.modes]  # cold before warm
    plan = [(r, w, m) for r in range(args.rounds) for w in args.workloads for m in order]
    runs = []
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="teo-first-step-") as tmp:
        for i, (r, w, m) in enumerate(plan, 1):
            cache = Path(tmp) / f"round{r}-{w}"  # cold fills it, warm reads it
            print(f"[{i}/{len(plan)}] round {r + 1} {w} {m} ...", flush=True)
            run = _run(args, w, m, cache)
            run["round"] = r
            runs.append(run)
            print(f"[{i}/{len(plan)}] round {r + 1} {w} {m}: first step {run['first_step_s']:.2f} s "
                  f"({run['compiled']} compiled in {run['compile_s']:.1f} s, {run['loaded']} loaded in "
                  f"{run['load_s'] * 1e3:.0f} ms by {', '.join(run['loaded_by']) or '-'}, DSL import "
                  f"{run['dsl_import_s']:.2f} s, first launches {run['first_launch_s'] * 1e3:.0f} ms), second "
                  f"{run['second_step_s'] * 1e3:.1f} ms, imports {run['imports_s']:.1f} s, path {run['path']}, "
                  f"process {run['process_s']:.1f} s", flush=True)
        profiles = []
        if args.profile:  # after the timed rounds: the last round's caches are warm
            stem = file_stem("first_step", gpu, "profile")
            args.out.mkdir(parents=True, exist_ok=True)
            for w in args.workloads:
                for m in (m for m in order if m != "cold"):
                    out = args.out / f"{stem}_{w}_{m}.txt"
                    print(f"profiling {w} {m} -> {out}", flush=True)
                    _run(args, w, m, Path(tmp) / f"round{args.rounds - 1}-{w}", profile_to=out)
                    profiles.append(str(out))
    result = {"benchmark": "first_step", "gpu": gpu, "date": utc_now(),
              "command": _command(argv if argv is not None else sys.argv[1:]),
              "versions": {d: _version(d) for d in ("torch", "transformer-engine", "nvidia-cutlass-dsl")},
              "settings": {k: getattr(args, k) for k in ("experts", "topk", "hidden", "ffn", "heads", "layers",
                                                          "seq", "rounds", "workloads", "modes")},
              "runs": runs, "summary": summarize(runs, args.workloads, order), "profiles": profiles,
              "wall_s": time.time() - t_start}
    paths = write_reports(args.out, file_stem("first_step", gpu), result, markdown, chart)
    print(f"wrote {', '.join(str(p) for p in paths)} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
