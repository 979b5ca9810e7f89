"""Benchmark the Hopper grouped GEMM kernels against cuBLAS bmm and torch._grouped_mm.

Shape: E experts x tokens/expert, H (hidden) and F (ffn):
  fc1 fwd   x(T,H) @ W1_e^T      K=H, N=F   (plain, and fused SReLU epilogue)
  fc2 fwd   act(T,F) @ W2_e^T    K=F, N=H
  fc2 dgrad dy(T,H) @ W2_e       K=H, N=F   (fused dSReLU epilogue)
  fc1 dgrad dz(T,F) @ W1_e       K=F, N=H
  wgrads    dY_e^T @ X_e         ours (CuTe, weight-gradient form) vs bmm and
                                 torch._grouped_mm

Each number is the median over `--reps` samples of CUDA-event time per call,
each sample timing `--inner` back-to-back calls.  Prints a table and writes
JSON to --out.
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


def _time(fn, reps, inner, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) / inner)
    return statistics.median(samples)


def _uneven_splits(e, per_expert, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(e, generator=g) + 0.25
    s = (w / w.sum() * e * per_expert).floor().long()
    s[-1] += e * per_expert - int(s.sum())
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens-per-expert", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2688)
    ap.add_argument("--ffn", type=int, default=1856)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--tile-n", type=int, default=0, help="force BN (0: pick per N)")
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--watchdog", type=float, default=120.0,
                    help="seconds one case may take before the stacks are dumped and the run exits")
    args = ap.parse_args()

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
    tile = (128, args.tile_n) if args.tile_n else None

    def tile_for(n):
        return tile if tile else K.pick_tile(n)

    def fmt(v, w=9, p=1):
        return f"{v:{w}.{p}f}" if isinstance(v, float) else f"{'-':>{w}}"

    # first calls compile: time them.  A hung kernel must not eat the whole
    # run silently: the watchdog dumps the Python stacks and exits.
    compile_s = {}
    for name, fn in [
        ("fc1_plain", lambda: K.grouped_gemm(x, w1, even, tile=tile)),
        ("fc1_srelu", lambda: K.grouped_gemm_srelu_fwd(x, w1, even, probs, tile=tile)),
        ("fc2_plain", lambda: K.grouped_gemm(act, w2, even, tile=tile)),
        ("fc2_dgrad_dsrelu", lambda: K.grouped_gemm_dsrelu_bwd(dy, w2, even, z, probs, tile=tile)),
        ("fc1_dgrad", lambda: K.grouped_gemm(dz, w1, even, trans_b=True, tile=tile)),
        ("fc2_wgrad", lambda: K.grouped_wgrad(dy, act, even, backend="cute")),
        ("fc1_wgrad", lambda: K.grouped_wgrad(dz, x, even, backend="cute")),
    ]:
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        compile_s[name] = time.perf_counter() - t0
        faulthandler.cancel_dump_traceback_later()
        print(f"first call {name}: {compile_s[name]:.2f} s", flush=True)
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}  dtype={args.dtype}  E={e} tokens/expert={m} H={h} F={f}")
    print(f"{'case':<24}{'ours ms':>9}{'TFLOP/s':>9}{'bmm ms':>9}{'TFLOP/s':>9}"
          f"{'gmm ms':>9}{'TFLOP/s':>9}{'ours/bmm':>9}", flush=True)

    xb, actb, dyb, dzb = (v.view(e, m, -1) for v in (x, act, dy, dz))
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
    cases = [
        # name, K, N, ours, bmm, grouped_mm
        ("fc1 fwd (plain)", h, f,
         lambda: K.grouped_gemm(x, w1, even, tile=tile),
         lambda: torch.bmm(xb, w1t),
         lambda: torch._grouped_mm(x, w1t, offs=offs)),
        ("fc1 fwd +srelu", h, f,
         lambda: K.grouped_gemm_srelu_fwd(x, w1, even, probs, tile=tile), None, None),
        ("fc1 fwd +srelu uneven", h, f,
         lambda: K.grouped_gemm_srelu_fwd(x, w1, uneven, probs, tile=tile), None, None),
        ("fc2 fwd (plain)", f, h,
         lambda: K.grouped_gemm(act, w2, even, tile=tile),
         lambda: torch.bmm(actb, w2t),
         lambda: torch._grouped_mm(act, w2t, offs=offs)),
        ("fc2 dgrad +dsrelu", h, f,
         lambda: K.grouped_gemm_dsrelu_bwd(dy, w2, even, z, probs, tile=tile),
         lambda: torch.bmm(dyb, w2),
         lambda: torch._grouped_mm(dy, w2, offs=offs)),
        ("fc2 dgrad (plain)", h, f,
         lambda: K.grouped_gemm(dy, w2, even, trans_b=True, tile=tile), None, None),
        ("fc1 dgrad (plain)", f, h,
         lambda: K.grouped_gemm(dz, w1, even, trans_b=True, tile=tile),
         lambda: torch.bmm(dzb, w1),
         lambda: torch._grouped_mm(dz, w1, offs=offs)),
        ("fc1 dgrad uneven", f, h,
         lambda: K.grouped_gemm(dz, w1, uneven, trans_b=True, tile=tile), None, None),
        # wgrads: "gmm" is the torch backend of grouped_wgrad (torch._grouped_mm)
        ("fc2 wgrad dy^T act", None, f,
         lambda: K.grouped_wgrad(dy, act, even, backend="cute"),
         lambda: torch.bmm(dyb.transpose(1, 2), actb),
         lambda: K.grouped_wgrad(dy, act, even, backend="torch")),
        ("fc2 wgrad uneven", None, f,
         lambda: K.grouped_wgrad(dy, act, uneven, backend="cute"), None,
         lambda: K.grouped_wgrad(dy, act, uneven, backend="torch")),
        ("fc1 wgrad dz^T x", None, h,
         lambda: K.grouped_wgrad(dz, x, even, backend="cute"),
         lambda: torch.bmm(dzb.transpose(1, 2), xb),
         lambda: K.grouped_wgrad(dz, x, even, backend="torch")),
        ("fc1 wgrad uneven", None, h,
         lambda: K.grouped_wgrad(dz, x, uneven, backend="cute"), None,
         lambda: K.grouped_wgrad(dz, x, uneven, backend="torch")),
    ]

    rows = []
    for name, kk, nn, ours, bmm, gmm in cases:
        fl = 2.0 * t * h * f
        r = {"case": name, "K": kk, "N": nn, "flop": fl,
             "tile": list(tile_for(nn)) if nn else None}
        for label, fn in (("ours", ours), ("bmm", bmm), ("grouped_mm", gmm)):
            if fn is None:
                r[label + "_ms"] = None
                r[label + "_tflops"] = None
                continue
            faulthandler.dump_traceback_later(args.watchdog, exit=True)
            try:
                ms = _time(fn, args.reps, args.inner)
                r[label + "_ms"] = ms
                r[label + "_tflops"] = fl / ms / 1e9
            except Exception as exc:  # report, keep going
                r[label + "_ms"] = None
                r[label + "_tflops"] = None
                r[label + "_error"] = repr(exc)[:300]
            faulthandler.cancel_dump_traceback_later()
        if r.get("ours_ms") and r.get("bmm_ms"):
            r["ours_vs_bmm"] = r["bmm_ms"] / r["ours_ms"]
        rows.append(r)
        print(f"{r['case']:<24}{fmt(r['ours_ms'], p=3)}{fmt(r['ours_tflops'])}"
              f"{fmt(r['bmm_ms'], p=3)}{fmt(r['bmm_tflops'])}"
              f"{fmt(r['grouped_mm_ms'], p=3)}{fmt(r['grouped_mm_tflops'])}"
              f"{fmt(r.get('ours_vs_bmm'), p=2)}", flush=True)
        for key in ("ours_error", "bmm_error", "grouped_mm_error"):
            if key in r:
                print("   ", key, r[key], flush=True)
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
    main()
