"""Benchmark the Hopper grouped GEMM kernels against cuBLAS bmm and torch._grouped_mm.

Shape: E experts x tokens/expert, H (hidden) and F (ffn):
  fc1 fwd   x(T,H) @ W1_e^T      K=H, N=F   (plain, and fused SReLU epilogue)
  fc2 fwd   act(T,F) @ W2_e^T    K=F, N=H
  fc2 dgrad dy(T,H) @ W2_e       K=H, N=F   (fused dSReLU epilogue)
  fc1 dgrad dz(T,F) @ W1_e       K=F, N=H
  wgrads    dY_e^T @ X_e         ours (CuTe, weight-gradient form) vs bmm and
                                 torch._grouped_mm

Ours runs under both schedules (cooperative, pingpong; "ours" is the one the
kernels pick by default for that GEMM kind).  The contenders of a case are
timed interleaved, one sample each per round, so clock and power drift hits
them alike; each number is the median over `--reps` rounds of CUDA-event time
per call, each sample timing `--inner` back-to-back calls queued while the
GPU still works through untimed ones (GPU time without host launch cost; the
host time per call is reported on its own).  Prints a table and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


# Each sample first queues `_LEAD` untimed calls of the same contender: the GPU works through
# them, at the clocks of sustained load, while the host queues the timed calls, so a
# contender's GPU time is free of its host launch cost (the CuTe DSL call path costs more host
# time than cuBLAS's; it is measured on its own and reported beside it).  A sleep kernel would
# do the first part too, but after it the GPU runs a short burst at boost clocks (seen here:
# cuBLAS bmm at 745 TFLOP/s against 625-660 under sustained load, and the schedules' order
# reversed: results/bench_kernels_sleep_timing_rejected.log), which a training step does not see.
_LEAD = 10


def _sample(fn, inner):
    """(GPU ms per call, host us per call, host stayed ahead) of `inner` back-to-back calls.
    The host stayed ahead when the GPU had not reached the timed calls once they were all
    queued: then no host gap can be inside the timed span."""
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    for _ in range(_LEAD):
        fn()
    a.record()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    host_us = (time.perf_counter() - t0) / inner * 1e6
    ahead = not a.query()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / inner, host_us, ahead


def _time_interleaved(fns, reps, inner, warmup=3):
    """{label: (median GPU ms per call, median host us per call, samples where the host did not
    stay ahead, whose GPU time may hold host gaps)}; one sample of every contender per round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    samples = {label: [] for label in fns}
    for _ in range(reps):
        for label, fn in fns.items():
            samples[label].append(_sample(fn, inner))
    return {
        label: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v),
                sum(not x[2] for x in v))
        for label, v in samples.items()
    }


def _uneven_splits(e, per_expert, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(e, generator=g) + 0.25
    s = (w / w.sum() * e * per_expert).floor().long()
    s[-1] += e * per_expert - int(s.sum())
    return s


SCHEDULES = ("cooperative", "pingpong")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens-per-expert", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2688)
    ap.add_argument("--ffn", type=int, default=1856)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--watchdog", type=float, default=120.0,
                    help="seconds one case may take before the stacks are dumped and the run exits")
    args = ap.parse_args()
    from offload_policies import cuda_problem

    if problem := cuda_problem():
        print(f"bench_kernels.py: cannot run: {problem}", file=sys.stderr)
        return 2

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
    uneven = _uneven_splits(e, m).to(dev)
    offs = torch.cumsum(even, 0).to(torch.int32)

    def fmt(v, w=9, p=1):
        return f"{v:{w}.{p}f}" if isinstance(v, float) else f"{'-':>{w}}"

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

    # first calls compile: time them.  A hung kernel must not eat the whole
    # run silently: the watchdog dumps the Python stacks and exits.
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
            print(f"first call {name} [{sc}]: {compile_s[f'{name} [{sc}]']:.2f} s", flush=True)
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}  dtype={args.dtype}  E={e} tokens/expert={m} H={h} F={f}")
    print("TFLOP/s of GPU time, contenders timed interleaved; ours = the default schedule for the "
          "GEMM kind; host us = host time per call")
    print(f"{'case':<24}{'ours':>6}{'ms':>7}{'TFLOP/s':>9}{'coop':>7}{'pingpong':>9}{'bmm':>7}"
          f"{'gmm':>7}{'ours/bmm':>9}{'host us ours':>13}{'bmm':>6}", flush=True)

    rows = []
    for name, kind, nn, ours, bmm, gmm in cases:
        fl = 2.0 * t * h * f
        wgrad = kind == "wgrad"
        epilogue = "plain" if wgrad else kind
        default = K.pick_schedule(epilogue, wgrad)
        r = {"case": name, "kind": kind, "N": nn, "flop": fl, "schedule": default,
             "tile": {sc: list(K.pick_tile(nn, sc)) for sc in SCHEDULES}}
        fns = {sc: (lambda sc=sc: ours(sc)) for sc in SCHEDULES}
        if bmm is not None:
            fns["bmm"] = bmm
        if gmm is not None:
            fns["grouped_mm"] = gmm
        faulthandler.dump_traceback_later(args.watchdog * len(fns), exit=True)
        try:
            timed = _time_interleaved(fns, args.reps, args.inner)
        except Exception as exc:  # report, keep going
            timed = {}
            r["error"] = repr(exc)[:300]
        faulthandler.cancel_dump_traceback_later()
        ms = {label: v[0] for label, v in timed.items()}
        for label in ("cooperative", "pingpong", "bmm", "grouped_mm"):
            r[label + "_ms"] = ms.get(label)
            r[label + "_tflops"] = fl / ms[label] / 1e9 if label in ms else None
            r[label + "_host_us"] = timed[label][1] if label in timed else None
            r[label + "_host_behind_samples"] = timed[label][2] if label in timed else None
        r["ours_ms"], r["ours_tflops"] = r[default + "_ms"], r[default + "_tflops"]
        if r.get("ours_ms") and r.get("bmm_ms"):
            r["ours_vs_bmm"] = r["bmm_ms"] / r["ours_ms"]
        rows.append(r)
        print(f"{name:<24}{default[:4]:>6}{fmt(r['ours_ms'], 7, 3)}{fmt(r['ours_tflops'])}"
              f"{fmt(r['cooperative_tflops'], 7, 0)}{fmt(r['pingpong_tflops'], 9, 0)}"
              f"{fmt(r['bmm_tflops'], 7, 0)}{fmt(r['grouped_mm_tflops'], 7, 0)}"
              f"{fmt(r.get('ours_vs_bmm'), p=2)}{fmt(r[default + '_host_us'], 13, 0)}"
              f"{fmt(r['bmm_host_us'], 6, 0)}", flush=True)
        behind = {k: r[k + "_host_behind_samples"] for k in fns if r.get(k + "_host_behind_samples")}
        if behind:
            print("    host did not stay ahead in samples (their GPU time may hold host gaps):", behind)
        if "error" in r:
            print("   ", r["error"], flush=True)
    print("first call (compile + run) seconds:", {k: round(v, 2) for k, v in compile_s.items()})
    out = {
        "gpu": gpu, "dtype": args.dtype, "experts": e, "tokens_per_expert": m,
        "hidden": h, "ffn": f, "reps": args.reps, "inner": args.inner,
        "first_call_seconds": compile_s,
        "compile_seconds": {str(k): v for k, v in K.compile_times().items()},
        "rows": rows,
    }
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    sys.exit(main())
