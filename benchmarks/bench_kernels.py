#!/usr/bin/env python3
"""The Hopper grouped GEMM kernels against cuBLAS bmm and torch._grouped_mm, GEMM by GEMM.

Shape: E experts x tokens/expert, H (hidden) and F (ffn):
  fc1 fwd   x(T,H) @ W1_e^T      K=H, N=F   (plain, and fused SReLU epilogue)
  fc2 fwd   act(T,F) @ W2_e^T    K=F, N=H
  fc2 dgrad dy(T,H) @ W2_e       K=H, N=F   (fused dSReLU epilogue)
  fc1 dgrad dz(T,F) @ W1_e       K=F, N=H
  wgrads    dY_e^T @ X_e         ours (CuTe, weight-gradient form) vs bmm and
                                 torch._grouped_mm

Ours runs under both schedules (cooperative, pingpong; "ours" is the one the kernels pick by default
for that GEMM kind). The contenders of a case are timed interleaved (timing.interleaved), one
sample each per round, so clock and power drift hits them alike; each number is the median over
--reps rounds of the GPU time per call with the host ahead (timing.host_ahead: --inner calls queued
behind untimed ones, no sleep kernel), and the host time per call is reported on its own. The first
call of each kernel (compilation included) is timed apart. Writes grouped_gemms_<GPU>.{json,md,png}
into --out.

    python3 benchmarks/bench_kernels.py [--experts 8 --tokens-per-expert 2048 --hidden 2688 --ffn 1856]
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_common import cuda_problem, file_stem, pyplot, refuse, save_png, utc_now, write_reports  # noqa: E402
from timing import host_ahead, interleaved, median  # noqa: E402

# Each sample first queues LEAD untimed calls of the same contender: the GPU works through them, at
# the clocks of sustained load, while the host queues the timed calls, so a contender's GPU time is
# free of its host launch cost (the CuTe DSL call path costs more host time than cuBLAS's). A sleep
# kernel in front would keep the host ahead too, but after it the GPU runs a short burst at boost
# clocks (cuBLAS bmm at 745 TFLOP/s against 625-660 under sustained load on an H100, and the two
# schedules in the other order), which a training step does not see.
LEAD = 10
SCHEDULES = ("cooperative", "pingpong")


def time_interleaved(fns: dict, reps: int, inner: int, warmup: int = 3) -> dict:
    """{label: (median GPU ms per call, median host us per call, samples where the host did not stay
    ahead, whose GPU time may hold host gaps)}; one sample of every contender per round."""
    import torch

    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples = interleaved({label: (lambda fn=fn: host_ahead(fn, inner, lead=LEAD, hold=False))
                           for label, fn in fns.items()}, reps)
    return {label: (median(x.gpu_ms for x in v), median(x.host_us for x in v), sum(not x.ahead for x in v))
            for label, v in samples.items()}


def uneven_splits(e: int, per_expert: int, seed: int = 0):
    """``e`` split sizes summing to ``e * per_expert``, uneven (weights from 0.25 to 1.25)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = torch.rand(e, generator=g) + 0.25
    s = (w / w.sum() * e * per_expert).floor().long()
    s[-1] += e * per_expert - int(s.sum())
    return s


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens-per-expert", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2688)
    ap.add_argument("--ffn", type=int, default=1856)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=20, help="interleaved rounds")
    ap.add_argument("--inner", type=int, default=10, help="timed calls per sample")
    ap.add_argument("--out", type=Path, default=HERE / "results", help="folder for JSON, markdown, PNG")
    ap.add_argument("--watchdog", type=float, default=120.0,
                    help="seconds one case may take before the stacks are dumped and the run exits")
    args = ap.parse_args(argv)
    for name in ("experts", "tokens_per_expert", "hidden", "ffn", "reps", "inner"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    return args


def gemm_cases(args):
    """[(name, GEMM kind, output N, ours(schedule), bmm or None, grouped_mm or None)] on fresh operands."""
    import torch

    from te_offload_ops import kernels as K

    dtype = getattr(torch, args.dtype)
    e, m, h, f = args.experts, args.tokens_per_expert, args.hidden, args.ffn
    t = e * m
    dev = "cuda"
    torch.manual_seed(0)
    x = torch.randn(t, h, device=dev).to(dtype)
    w1 = (torch.randn(e, f, h, device=dev) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, f, device=dev) / f**0.5).to(dtype)
    act = torch.randn(t, f, device=dev).to(dtype)
    z = torch.randn(t, f, device=dev).to(dtype)
    dy = torch.randn(t, h, device=dev).to(dtype)
    dz = torch.randn(t, f, device=dev).to(dtype)
    probs = torch.rand(t, device=dev).to(dtype)
    even = torch.full((e,), m, device=dev, dtype=torch.int64)
    uneven = uneven_splits(e, m).to(dev)
    offs = torch.cumsum(even, 0).to(torch.int32)

    xb, actb, dyb, dzb = (v.view(e, m, -1) for v in (x, act, dy, dz))
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
    cases = [
        # name, GEMM kind, output N, ours(schedule), bmm, grouped_mm
        ("fc1 fwd (plain)", "plain", f,
         lambda sc: K.grouped_gemm(x, w1, even, schedule=sc),
         lambda: torch.bmm(xb, w1t),
         lambda: torch._grouped_mm(x, w1t, offs=offs)),
        ("fc1 fwd +srelu", "srelu", f,
         lambda sc: K.grouped_gemm_srelu_fwd(x, w1, even, probs, schedule=sc), None, None),
        ("fc1 fwd +srelu uneven", "srelu", f,
         lambda sc: K.grouped_gemm_srelu_fwd(x, w1, uneven, probs, schedule=sc), None, None),
        ("fc2 fwd (plain)", "plain", h,
         lambda sc: K.grouped_gemm(act, w2, even, schedule=sc),
         lambda: torch.bmm(actb, w2t),
         lambda: torch._grouped_mm(act, w2t, offs=offs)),
        ("fc2 dgrad +dsrelu", "dsrelu", f,
         lambda sc: K.grouped_gemm_dsrelu_bwd(dy, w2, even, z, probs, schedule=sc),
         lambda: torch.bmm(dyb, w2),
         lambda: torch._grouped_mm(dy, w2, offs=offs)),
        ("fc2 dgrad (plain)", "plain", f,
         lambda sc: K.grouped_gemm(dy, w2, even, trans_b=True, schedule=sc), None, None),
        ("fc1 dgrad (plain)", "plain", h,
         lambda sc: K.grouped_gemm(dz, w1, even, trans_b=True, schedule=sc),
         lambda: torch.bmm(dzb, w1),
         lambda: torch._grouped_mm(dz, w1, offs=offs)),
        ("fc1 dgrad uneven", "plain", h,
         lambda sc: K.grouped_gemm(dz, w1, uneven, trans_b=True, schedule=sc), None, None),
        # wgrads: "gmm" is the torch backend of grouped_wgrad (torch._grouped_mm)
        ("fc2 wgrad dy^T act", "wgrad", f,
         lambda sc: K.grouped_wgrad(dy, act, even, backend="cute", schedule=sc),
         lambda: torch.bmm(dyb.transpose(1, 2), actb),
         lambda: K.grouped_wgrad(dy, act, even, backend="torch")),
        ("fc2 wgrad uneven", "wgrad", f,
         lambda sc: K.grouped_wgrad(dy, act, uneven, backend="cute", schedule=sc), None,
         lambda: K.grouped_wgrad(dy, act, uneven, backend="torch")),
        ("fc1 wgrad dz^T x", "wgrad", h,
         lambda sc: K.grouped_wgrad(dz, x, even, backend="cute", schedule=sc),
         lambda: torch.bmm(dzb.transpose(1, 2), xb),
         lambda: K.grouped_wgrad(dz, x, even, backend="torch")),
        ("fc1 wgrad uneven", "wgrad", h,
         lambda sc: K.grouped_wgrad(dz, x, uneven, backend="cute", schedule=sc), None,
         lambda: K.grouped_wgrad(dz, x, uneven, backend="torch")),
    ]

    return cases


def measure(args) -> dict:
    import torch

    from te_offload_ops import kernels as K

    e, m, h, f = args.experts, args.tokens_per_expert, args.hidden, args.ffn
    t = e * m
    cases = gemm_cases(args)
    gpu = torch.cuda.get_device_name()
    print(f"[bench_kernels] {gpu}: {args.dtype}, E={e} x {m} tokens, H={h}, F={f}; {len(cases)} cases, "
          f"{args.reps} rounds each", flush=True)
    start = time.perf_counter()
    # first calls compile: time them. A hung kernel must not eat the whole run silently: the
    # watchdog dumps the Python stacks and exits.
    compile_s = {}
    for name, _, _, ours, _, _ in cases:
        if "uneven" in name:
            continue  # the kernels of the case before
        for sc in SCHEDULES:
            faulthandler.dump_traceback_later(args.watchdog, exit=True)
            t0 = time.perf_counter()
            ours(sc)
            torch.cuda.synchronize()
            compile_s[f"{name} [{sc}]"] = time.perf_counter() - t0
            faulthandler.cancel_dump_traceback_later()
            print(f"[bench_kernels] first call {name} [{sc}]: {compile_s[f'{name} [{sc}]']:.2f} s", flush=True)
    rows = []
    for i, (name, kind, nn, ours, bmm, gmm) in enumerate(cases, 1):
        fl = 2.0 * t * h * f
        wgrad = kind == "wgrad"
        default = K.pick_schedule("plain" if wgrad else kind, wgrad)
        r = {"case": name, "kind": kind, "N": nn, "flop": fl, "schedule": default,
             "tile": {sc: list(K.pick_tile(nn, sc)) for sc in SCHEDULES}}
        fns = {sc: (lambda sc=sc: ours(sc)) for sc in SCHEDULES}
        if bmm is not None:
            fns["bmm"] = bmm
        if gmm is not None:
            fns["grouped_mm"] = gmm
        faulthandler.dump_traceback_later(args.watchdog * len(fns), exit=True)
        try:
            timed = time_interleaved(fns, args.reps, args.inner)
        except Exception as exc:  # noqa: BLE001 (report, keep going)
            timed = {}
            r["error"] = repr(exc)[:300]
        faulthandler.cancel_dump_traceback_later()
        for label in ("cooperative", "pingpong", "bmm", "grouped_mm"):
            ms = timed[label][0] if label in timed else None
            r[label + "_ms"] = ms
            r[label + "_tflops"] = fl / ms / 1e9 if ms else None
            r[label + "_host_us"] = timed[label][1] if label in timed else None
            r[label + "_host_behind_samples"] = timed[label][2] if label in timed else None
        r["ours_ms"], r["ours_tflops"] = r[default + "_ms"], r[default + "_tflops"]
        r["ours_vs_bmm"] = r["bmm_ms"] / r["ours_ms"] if r.get("ours_ms") and r.get("bmm_ms") else None
        rows.append(r)
        print(f"[bench_kernels] case {i}/{len(cases)} {name}: "
              + (f"ours ({default}) {r['ours_ms']:.3f} ms, {r['ours_tflops']:.0f} TFLOP/s"
                 + (f", bmm {r['bmm_tflops']:.0f}" if r["bmm_tflops"] else "")
                 + (f", grouped_mm {r['grouped_mm_tflops']:.0f}" if r["grouped_mm_tflops"] else "")
                 if r.get("ours_ms") else f"failed: {r.get('error')}")
              + f" | elapsed {time.perf_counter() - start:.0f} s", flush=True)
        behind = {k: r[k + "_host_behind_samples"] for k in fns if r.get(k + "_host_behind_samples")}
        if behind:
            print("    host did not stay ahead in samples (their GPU time may hold host gaps):", behind, flush=True)
    return {"benchmark": "grouped_gemms", "gpu": gpu, "date": utc_now(), "dtype": args.dtype, "experts": e,
            "tokens_per_expert": m, "hidden": h, "ffn": f, "reps": args.reps, "inner": args.inner,
            "first_call_seconds": compile_s,
            "compile_seconds": {str(k): v for k, v in K.compile_times().items()}, "rows": rows}


def _num(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def markdown(result: dict) -> str:
    lines = [f"# Grouped GEMM kernels, {result['gpu']} ({result['date']})", "",
             f"{result['dtype']}, E={result['experts']} x {result['tokens_per_expert']} tokens, H={result['hidden']}, "
             f"F={result['ffn']}. GPU time per call with the host ahead, median of {result['reps']} interleaved "
             f"rounds of {result['inner']} calls; ours = the kernels' default schedule for the GEMM kind; host us = "
             "host time per call to launch.", "",
             "| case | schedule | ours ms | ours TFLOP/s | cooperative | pingpong | bmm | grouped_mm | bmm / ours "
             "| host us ours | host us bmm |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['case']} | {r['schedule']} | {_num(r.get('ours_ms'), '{:.3f}')} | "
                     f"{_num(r.get('ours_tflops'), '{:.0f}')} | {_num(r.get('cooperative_tflops'), '{:.0f}')} | "
                     f"{_num(r.get('pingpong_tflops'), '{:.0f}')} | {_num(r.get('bmm_tflops'), '{:.0f}')} | "
                     f"{_num(r.get('grouped_mm_tflops'), '{:.0f}')} | {_num(r.get('ours_vs_bmm'), '{:.2f}')} | "
                     f"{_num(r.get(r['schedule'] + '_host_us'), '{:.0f}')} | {_num(r.get('bmm_host_us'), '{:.0f}')} |")
    failed = [f"{r['case']}: {r['error']}" for r in result["rows"] if r.get("error")]
    if failed:
        lines += ["", "Failed: " + "; ".join(failed)]
    first = result.get("first_call_seconds") or {}
    if first:
        lines += ["", "First call (compile and run), seconds: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in first.items())]
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(rows) + 3), 4.5))
    xs = range(len(rows))
    series = (("cooperative", "#4c72b0"), ("pingpong", "#dd8452"), ("bmm", "#888888"), ("grouped_mm", "#55a868"))
    width = 0.8 / len(series)
    for j, (label, color) in enumerate(series):
        ax.bar([x + (j - 1.5) * width for x in xs], [r.get(label + "_tflops") or 0 for r in rows], width,
               label=label, color=color)
    ax.set_xticks(list(xs), [r["case"] for r in rows], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("TFLOP/s (GPU time, host ahead)")
    ax.set_title(f"Grouped GEMMs, E={result['experts']} x {result['tokens_per_expert']}, H={result['hidden']}, "
                 f"F={result['ffn']}, {result['gpu']}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if problem := cuda_problem():
        return refuse("bench_kernels.py", problem)
    import torch

    from te_offload_ops.fused.selection import kernel_problem

    if torch.cuda.get_device_capability() != (9, 0) or kernel_problem():
        return refuse("bench_kernels.py", f"the kernels need an sm_90 GPU and the CuTe DSL "
                                          f"({kernel_problem() or torch.cuda.get_device_name()})")
    result = measure(args)
    paths = write_reports(args.out, file_stem("grouped_gemms", result["gpu"]), result, markdown, chart)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
