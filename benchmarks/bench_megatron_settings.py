#!/usr/bin/env python3
"""The fused SReLU grouped MLP with the settings Megatron-Core passes, against the plain fused op.

Variants of one layer's fwd+bwd (bf16), timed interleaved round by round (clocks drift between
runs by up to 10%, so each round times every variant once and medians are taken over rounds):

* plain           - the fused op as benchmarked in bench_fused_mlp.py
* main_grad       - accumulate_into_main_grad=True: wgrads added into fp32 main_grad buffers
                    the default way (kernels.main_grad_add, kernels.pick_schedule)
* main_grad(A,S)  - the same with add A (rmw: the epilogue loads, adds and stores; red: 8-byte
                    fire-and-forget reductions in L2; tma: bulk reduce-adds of staged 128 x 32
                    boxes) and schedule S (coop: 128 x BN tiles, both
                    warpgroups on one tile; ping: 128 x 128, one warpgroup's epilogue under the
                    other's mainloop): the ablation behind the default
* delay           - delay_wgrad_compute=True: fwd, bwd, then backward_dw() of both GroupedLinears
* main_grad+delay - both, as Megatron runs them with its expert-parallel overlap
* split_check     - plain with the deferred split-size check on (the default); the four above
                    run with it off (TEO_CHECK_SPLIT_SIZES=off), so they compare settings alone

Each is timed back to back (timing.event_ms: CUDA-event time per step, host gaps included) and
with the host ahead (timing.host_ahead_ms: GPU work only). The split check cannot be timed host-ahead:
a one-layer step queued behind a sleep kernel must wait at the end of its backward for its own
forward's copy (by design: a bad step raises before backward() returns), so its GPU cost is
taken from the profiler (device time per step, plain vs split_check) and its host cost from
the back-to-back wall time. The profiler also lists main_grad's kernels against plain's: how much
of its extra GPU time is kernels running longer (and which), how much is between them, and
the same by GEMM (the profiler range each launch runs in, kernels.launch.profile_label).
Writes megatron_settings_<GPU>[_sweep].{json,md,png} into --out.

    python3 benchmarks/bench_megatron_settings.py [--sweep] [--default-way-only | --ways WAY ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_common import (  # noqa: E402
    add_mlp_shape_args, cuda_problem, file_stem, mlp_path, pyplot, refuse, save_png, utc_now, write_reports,
)
from timing import event_ms, host_ahead_ms, kernel_times, median  # noqa: E402

# main_grad ablation: variant -> (TEO_MAIN_GRAD_ADD, schedule of the main_grad wgrad)
MAIN_GRAD_WAYS = {"main_grad(rmw,ping)": ("rmw", "pingpong"), "main_grad(rmw,coop)": ("rmw", "cooperative"),
                  "main_grad(red,ping)": ("red", "pingpong"), "main_grad(red,coop)": ("red", "cooperative"),
                  "main_grad(tma,ping)": ("tma", "pingpong"), "main_grad(tma,coop)": ("tma", "cooperative")}
VARIANTS = ("plain", "main_grad", *MAIN_GRAD_WAYS, "delay", "main_grad+delay", "split_check")
SETTINGS = VARIANTS[1:-1]  # compared with plain, split-size check off
SWEEP = [(8, 2048, 2688, 1856), (8, 4096, 2688, 1856), (32, 1024, 2048, 768), (32, 2048, 4096, 1536),
         (64, 512, 2048, 768)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help=f"configs (E, tokens/expert, H, F): {SWEEP}")
    add_mlp_shape_args(p)
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds (each times every variant)")
    p.add_argument("--default-way-only", action="store_true",
                   help="time main_grad the default way only, not each add x schedule (fewer kernels to compile)")
    p.add_argument("--ways", nargs="+", choices=list(MAIN_GRAD_WAYS), metavar="WAY",
                   help=f"time only these of the main_grad ways (default: all of {list(MAIN_GRAD_WAYS)})")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for JSON, markdown, PNG")
    args = p.parse_args(argv)
    for name in ("experts", "tokens", "hidden", "ffn", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    return args


def _build(E, H, F, variant):
    import torch
    import transformer_engine.pytorch as te

    import te_offload_ops as teo

    kw = dict(bias=False, device="cuda", dtype=torch.bfloat16,
              accumulate_into_main_grad="main_grad" in variant, delay_wgrad_compute="delay" in variant)
    mlp = te.ops.Sequential(teo.GroupedLinear(E, H, F, **kw), teo.ScaledSReLU(), teo.GroupedLinear(E, F, H, **kw))
    if "main_grad" in variant:
        # as in Megatron's grad buffer: one layer's experts one after another, in reverse order
        for op in (mlp[0], mlp[2]):
            weights = list(op.parameters())
            buffer = torch.zeros(len(weights), *weights[0].shape, device="cuda", dtype=torch.float32)
            for p, g in zip(weights, reversed(buffer.unbind(0))):
                p.main_grad = g
                p.grad_added_to_main_grad = False
    return mlp


def measure(E, tokens, H, F, rounds, variants=VARIANTS) -> dict:
    import torch

    T = E * tokens
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    splits = torch.full((E,), tokens, device="cuda", dtype=torch.int64)
    VARIANTS = variants  # noqa: N806 (this run's subset)
    mlps = {v: _build(E, H, F, v) for v in VARIANTS}
    for v in VARIANTS[1:]:
        for p, q in zip(mlps[v].parameters(), mlps["plain"].parameters()):
            p.data.copy_(q.data)

    from te_offload_ops.kernels import main_grads, tiling

    # the library's own choice for this shape (kernels.main_grad_way), as the default variants get it
    preset = os.environ.pop("TEO_MAIN_GRAD_ADD", None)
    way_add, way_schedule = main_grads.main_grad_way(T, E, preset)
    default_schedule = tiling.DEFAULT_SCHEDULE["wgrad_main_grad"]
    default_way = (way_add, way_schedule or tiling.pick_schedule("acc_f32", True))

    def step(variant):
        mlp = mlps[variant]
        for t in (x, probs, *mlp.parameters()):
            t.grad = None
        os.environ["TEO_CHECK_SPLIT_SIZES"] = "deferred" if variant == "split_check" else "off"
        if variant in MAIN_GRAD_WAYS:
            add, schedule = MAIN_GRAD_WAYS[variant]
            os.environ["TEO_MAIN_GRAD_ADD"] = add
            tiling.DEFAULT_SCHEDULE["wgrad_main_grad"] = schedule
        else:  # left to the library (or to a TEO_MAIN_GRAD_ADD the run was started with)
            if preset is None:
                os.environ.pop("TEO_MAIN_GRAD_ADD", None)
            else:
                os.environ["TEO_MAIN_GRAD_ADD"] = preset
            tiling.DEFAULT_SCHEDULE["wgrad_main_grad"] = default_schedule
        mlp(x, splits, probs, splits).backward(dy)
        for op in (mlp[0], mlp[2]):
            op.backward_dw()  # a no-op unless the wgrads were delayed

    for v in VARIANTS:  # compile, and check that every variant runs fused
        step(v)
    torch.cuda.synchronize()
    paths = {v: mlp_path(mlps[v]) for v in VARIANTS}
    wall = {v: [] for v in VARIANTS}
    gpu = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for v in VARIANTS:
            wall[v].append(event_ms(lambda: step(v), 3, inner=5))
            if v != "split_check":
                gpu[v].append(host_ahead_ms(lambda: step(v)) or float("nan"))
    kernels = {v: kernel_times(lambda: step(v), steps=10, top=0)
               for v in ("plain", "split_check", "main_grad") if v in VARIANTS}
    busy = {v: sum(k["us_per_step"] for k in rows) / 1e3 for v, rows in kernels.items()}
    # by GEMM: a profile of its own (CPU events too, for the ranges), not mixed into the busy times
    gemms = {v: gemm_ranges(lambda: step(v)) for v in VARIANTS if v == "plain" or v.startswith("main_grad")}
    os.environ.pop("TEO_CHECK_SPLIT_SIZES", None)
    os.environ.pop("TEO_MAIN_GRAD_ADD", None)
    tiling.DEFAULT_SCHEDULE["wgrad_main_grad"] = default_schedule
    if preset is not None:
        os.environ["TEO_MAIN_GRAD_ADD"] = preset
    flop = 6 * 2 * T * H * F
    row = {"E": E, "tokens_per_expert": tokens, "H": H, "F": F, "paths": paths, "variants": {},
           "main_grad_default": {"add": default_way[0], "schedule": default_way[1]}}
    for v in VARIANTS:
        w, g = median(wall[v]), median(gpu[v])
        row["variants"][v] = {"wall_ms": w, "gpu_ms": g, "wall_tflops": flop / w / 1e9, "gpu_tflops": flop / g / 1e9,
                              "wall_samples": wall[v], "gpu_samples": gpu[v]}
    base = row["variants"]["plain"]
    for v in VARIANTS:
        d = row["variants"][v]
        d["wall_vs_plain"], d["gpu_vs_plain"] = d["wall_ms"] / base["wall_ms"], d["gpu_ms"] / base["gpu_ms"]
    row["split_check_cost"] = {"wall": row["variants"]["split_check"]["wall_ms"] / base["wall_ms"] - 1,
                               "gpu_busy": busy["split_check"] / busy["plain"] - 1,
                               "gpu_busy_ms": busy}
    if "main_grad" in kernels:
        row["main_grad_kernels"] = kernel_diff(kernels["plain"], kernels["main_grad"])
        row["main_grad_gemms"] = kernel_diff(gemms["plain"], gemms["main_grad"])
        # every main_grad way's GEMMs, us per step: {variant: {GEMM: us}}
        row["gemm_us"] = {v: {r["kernel"]: r["us_per_step"] for r in rows} for v, rows in gemms.items()}
    del mlps, x, probs, dy
    torch.cuda.empty_cache()
    return row


def kernel_diff(plain: list[dict], other: list[dict]) -> list[dict]:
    """Per kernel name: us per step in each profile and the difference, largest difference first
    (a kernel only one of them runs counts 0 in the other; names the profiler cut to the same
    prefix add up)."""
    a, b = {}, {}
    for rows, into in ((plain, a), (other, b)):
        for k in rows:
            into[k["kernel"]] = into.get(k["kernel"], 0.0) + k["us_per_step"]
    rows = [{"kernel": name, "plain_us": a.get(name, 0.0), "other_us": b.get(name, 0.0),
             "diff_us": b.get(name, 0.0) - a.get(name, 0.0)} for name in dict.fromkeys([*a, *b])]
    rows.sort(key=lambda r: -abs(r["diff_us"]))
    return rows


def gemm_ranges(fn, steps: int = 10) -> list[dict]:
    """GPU time per step of each GEMM of the fused op, in ``kernel_diff``'s rows, named by the
    profiler range its launch runs in (``kernels.launch.profile_label``: wgrad or not, epilogue, N x K).
    The profiler does not tie the DSL's driver-API launches to their ranges (measured: no device
    time reached them), so ranges and GEMM kernels are paired in order (one stream: the n-th
    launch is the n-th kernel); empty when their counts differ."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from te_offload_ops.kernels.launch import PROFILE_LABEL

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    ranges, kernels = [], []
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name.startswith(PROFILE_LABEL):
            ranges.append((e.time_range.start, e.name))
        elif e.device_type == DeviceType.CUDA and GEMM_KERNEL in e.name:
            kernels.append((e.time_range.start, e.time_range.elapsed_us()))
    return pair_in_order(ranges, kernels, steps)


GEMM_KERNEL = "GroupedGemmSm90"  # in the profiler's name of every DSL GEMM kernel


def pair_in_order(ranges, kernels, steps: int) -> list[dict]:
    """``ranges``: (start, label) of each launch's range; ``kernels``: (start, us) of each GEMM
    kernel. The n-th range by start goes with the n-th kernel by start; us per step by
    :func:`gemm_row_name`. Empty when the counts differ (a pairing would be a guess)."""
    if len(ranges) != len(kernels):
        return []
    totals: dict[str, float] = {}
    for (_, label), (_, us) in zip(sorted(ranges), sorted(kernels)):
        name = gemm_row_name(label)
        totals[name] = totals.get(name, 0.0) + us
    return [{"kernel": name, "us_per_step": us / steps} for name, us in totals.items()]


def gemm_row_name(label: str) -> str:
    """A wgrad's range without its epilogue: plain's bf16 store and main_grad's fp32 add of the
    same GEMM share a row (the other GEMMs keep theirs: fc2's forward and fc1's dgrad share N x K)."""
    return re.sub(r"\[wgrad \S+ ", "[wgrad ", label)


def kernel_diff_lines(row, top: int = 8) -> list[str]:
    """Markdown: where main_grad's extra GPU time goes, kernels against the gap between them."""
    diff = row.get("main_grad_kernels")
    if not diff or "main_grad" not in row["variants"]:
        return []
    busy = sum(r["diff_us"] for r in diff)
    gpu = (row["variants"]["main_grad"]["gpu_ms"] - row["variants"]["plain"]["gpu_ms"]) * 1e3
    if math.isfinite(gpu):  # two measurements (host-ahead medians, a 10-step profile): the rest carries both's noise
        head = (f"{gpu:+.1f} us of GPU time (host ahead), of which kernels {busy:+.1f} us (profiler) and "
                f"the rest ({gpu - busy:+.1f} us, not in any kernel's time by this difference) between or around them.")
    else:
        head = f"kernels {busy:+.1f} us (profiler; no host-ahead GPU time to set it against)."
    lines = ["", f"Where main_grad's extra GPU time goes (E={row['E']}, {row['tokens_per_expert']} tokens per "
             f"expert; us per step): {head}", "",
             "| kernel | plain us | main_grad us | difference us |", "|---|---|---|---|"]
    for r in diff[:top]:
        name = r["kernel"].replace("|", "/")
        lines.append(f"| {name} | {r['plain_us']:.1f} | {r['other_us']:.1f} | {r['diff_us']:+.1f} |")
    gemms = row.get("main_grad_gemms")
    if gemms is not None:
        lines += ["", "The same by GEMM (each launch's profiler range, naming kind, epilogue and N x K, "
                  "paired in order with the GEMM kernels: the profiler gives every GEMM kernel one name):", ""]
        if not any(r["plain_us"] or r["other_us"] for r in gemms):
            lines.append("(no pairing: the counts of launch ranges and GEMM kernels differed)")
        else:
            lines += ["| GEMM | plain us | main_grad us | difference us |", "|---|---|---|---|"]
            lines += [f"| {r['kernel']} | {r['plain_us']:.1f} | {r['other_us']:.1f} | {r['diff_us']:+.1f} |"
                      for r in gemms]
    return lines


def gemm_table_lines(row) -> list[str]:
    """Markdown: each GEMM's us per step under plain and every main_grad way timed (when more
    than the default way was)."""
    table = row.get("gemm_us") or {}
    if len(table) <= 2 or not all(table.values()):
        return []
    names = list(dict.fromkeys(name for us in table.values() for name in us))
    lines = ["", "GPU time per GEMM, us per step (the same pairing), by variant:", "",
             "| GEMM | " + " | ".join(table) + " |", "|---|" + "---|" * len(table)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{us.get(name, 0.0):.1f}" for us in table.values()) + " |")
    return lines


def _settings(row) -> list[str]:
    """The settings timed in ``row`` (all, or the default ways only)."""
    return [v for v in SETTINGS if v in row["variants"]]


def markdown(result) -> str:
    lines = [f"# Fused SReLU grouped MLP with Megatron-Core's settings on {result['gpu']} ({result['date']})", "",
             f"bf16, uniform splits, fwd+bwd (+ backward_dw where delayed); medians over {result['rounds']} interleaved "
             "rounds. *wall*: back to back, host cost included; *GPU*: host ahead (GPU work only). Ratios are against "
             "the plain fused op of the same round set; these settings run with the split-size check off. *split check*: "
             "the deferred split-size check's cost: back-to-back wall time, and GPU busy time per step from the "
             "profiler (its copy of E sizes to the host), each against plain.", "",
             "| E | tok/expert | H | F | variant | wall ms | GPU ms | wall x plain | GPU x plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cfg = f"| {r['E']} | {r['tokens_per_expert']} | {r['H']} | {r['F']} |"
        way = r.get("main_grad_default")
        for v in ("plain", *_settings(r)):
            d = r["variants"][v]
            name = f"main_grad (default: {way['add']}, {way['schedule']})" if v == "main_grad" and way else v
            lines.append(f"{cfg} {name} | {d['wall_ms']:.3f} | {d['gpu_ms']:.3f} | {d['wall_vs_plain']:.3f} | "
                         f"{d['gpu_vs_plain']:.3f} |")
        c = r["split_check_cost"]
        lines.append(f"{cfg} split check (vs plain) | {c['wall']:+.2%} | {c['gpu_busy']:+.2%} busy | | |")
    for r in result["rows"]:
        lines += kernel_diff_lines(r)
        lines += gemm_table_lines(r)
    unfused = {f"{r['E']}x{r['tokens_per_expert']}:{v}" for r in result["rows"] for v, p in r["paths"].items() if p != "fused"}
    if unfused:
        lines += ["", "Ran unfused (not comparable): " + ", ".join(sorted(unfused))]
    return "\n".join(lines) + "\n"


def plot(result, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = result["rows"]
    labels = [f"E{r['E']}x{r['tokens_per_expert']}\nH{r['H']} F{r['F']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows) + 2), 4))
    settings = [v for v in SETTINGS if all(v in r["variants"] for r in rows)]
    width = 0.8 / len(settings)
    for i, v in enumerate(settings):
        vals = [r["variants"][v]["gpu_vs_plain"] for r in rows]
        ax.bar([j + (i - (len(settings) - 1) / 2) * width for j in range(len(rows))], vals, width, label=v)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(1.03, color="red", lw=0.8, ls="--", label="+3% target")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("fwd+bwd GPU time / plain fused")
    ax.set_ylim(0.9, max(1.1, max(r["variants"][v]["gpu_vs_plain"] for r in rows for v in settings) + 0.02))
    ax.set_title(f"Megatron settings on the fused MLP, {result['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if problem := cuda_problem():
        return refuse("bench_megatron_settings.py", problem)
    import torch

    gpu = torch.cuda.get_device_name()
    plan = SWEEP if args.sweep else [(args.experts, args.tokens, args.hidden, args.ffn)]
    rows, start = [], time.perf_counter()
    print(f"[bench_megatron_settings] {gpu}: {len(plan)} configs, {args.rounds} rounds each", flush=True)
    for i, (E, tokens, H, F) in enumerate(plan, 1):
        ways = () if args.default_way_only else args.ways or tuple(MAIN_GRAD_WAYS)
        variants = tuple(v for v in VARIANTS if v in ways or v not in MAIN_GRAD_WAYS)
        row = measure(E, tokens, H, F, args.rounds, variants)
        rows.append(row)
        v = row["variants"]
        print(f"[bench_megatron_settings] config {i}/{len(plan)} E={E} tok={tokens} H={H} F={F}: plain {v['plain']['gpu_ms']:.3f} ms GPU; "
              + ", ".join(f"{k} x{v[k]['gpu_vs_plain']:.3f}" for k in _settings(row))
              + f"; split check {row['split_check_cost']['wall']:+.2%} wall, "
              f"{row['split_check_cost']['gpu_busy']:+.2%} GPU busy | elapsed {time.perf_counter() - start:.0f} s",
              flush=True)
    result = {"benchmark": "megatron_settings", "gpu": gpu, "rounds": args.rounds, "rows": rows, "date": utc_now()}
    paths = write_reports(args.out, file_stem("megatron_settings", gpu, "sweep" if args.sweep else ""), result,
                          markdown, plot)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
