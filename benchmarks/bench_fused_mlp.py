#!/usr/bin/env python3
"""Fused SReLU grouped MLP vs TE's unfused ops vs a cuBLAS bmm roof, forward and forward+backward.

One grouped MLP layer (GroupedLinear -> ScaledSReLU -> GroupedLinear, bf16) with uniform splits so
that the same GEMMs can also run as cuBLAS batched GEMMs (the roof: 2 bmm forward, 6 forward +
backward). Times are medians of CUDA-event timings (timing.event_ms), and the forward+backward also
with the host ahead of the GPU (timing.host_ahead_ms: GPU work alone, as in a deep model); TFLOP/s
count 2*T*H*F per GEMM. The first call of the fused op (kernel compilation included) is timed
separately. Writes fused_mlp_<GPU>[_sweep].{json,md,png} into --out.

    python3 benchmarks/bench_fused_mlp.py [--sweep] [--profile] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_common import (  # noqa: E402
    add_mlp_shape_args, cuda_problem, file_stem, mlp_path, pyplot, refuse, save_png, split_check_off, utc_now,
    write_reports,
)
from timing import event_ms, host_ahead_ms, kernel_times  # noqa: E402

MODEL_SHAPES = {  # name -> (hidden, ffn) of MoE experts with non-gated activations, or close
    "H2688-F1856": (2688, 1856),
    "H2048-F768": (2048, 768),
    "H4096-F1536": (4096, 1536),
    "H7168-F2048": (7168, 2048),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="E in {8, 32} x tokens/expert in {256..4096} x model shapes")
    add_mlp_shape_args(p)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--profile", action="store_true", help="also record GPU time per kernel of our fwd+bwd")
    p.add_argument("--max-tokens", type=int, default=64 * 1024, help="sweep: skip configs with more tokens in all")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for JSON, markdown, PNG")
    args = p.parse_args(argv)
    for name in ("experts", "tokens", "hidden", "ffn", "iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    return args


def configs(args):
    if not args.sweep:
        return [(args.experts, args.tokens, args.hidden, args.ffn)]
    out = []
    for E in (8, 32):
        for tokens in (256, 512, 1024, 2048, 4096):
            for H, F in MODEL_SHAPES.values():
                if E * tokens <= args.max_tokens:
                    out.append((E, tokens, H, F))
    return out


def measure(E, tokens, H, F, dtype, iters, profile=False) -> dict:
    import torch
    import transformer_engine.pytorch as te

    import te_offload_ops as teo

    T = E * tokens
    ours = te.ops.Sequential(teo.GroupedLinear(E, H, F, bias=False, device="cuda", dtype=dtype), teo.ScaledSReLU(),
                             teo.GroupedLinear(E, F, H, bias=False, device="cuda", dtype=dtype))
    stock = te.ops.Sequential(te.ops.GroupedLinear(E, H, F, bias=False, device="cuda", dtype=dtype),
                              te.ops.ScaledSReLU(), te.ops.GroupedLinear(E, F, H, bias=False, device="cuda", dtype=dtype))
    stock.load_state_dict(ours.state_dict())
    x = torch.randn(T, H, device="cuda", dtype=dtype, requires_grad=True)
    probs = torch.rand(T, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(T, H, device="cuda", dtype=dtype)
    splits = torch.full((E,), tokens, device="cuda", dtype=torch.int64)

    def fwd(mlp):
        with torch.no_grad():
            mlp(x, splits, probs, splits)

    def fwd_bwd(mlp):
        # a training step starts from empty grads (zero_grad(set_to_none=True)); otherwise each
        # repetition would also time adding into x.grad, probs.grad and every weight's grad
        for t in (x, probs, *mlp.parameters()):
            t.grad = None
        mlp(x, splits, probs, splits).backward(dy)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd_bwd(ours)  # first call: compiles the kernels if the fused path runs
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0
    path = mlp_path(ours)
    row = {"E": E, "tokens_per_expert": tokens, "H": H, "F": F, "path": path, "first_call_s": first_call_s}
    fused_ops = [op for g in ours._module_groups for op, _ in g._forward_ops if hasattr(op, "last_fallback_reasons")]
    row["fallback_reasons"] = fused_ops[0].last_fallback_reasons if fused_ops else ["fusion not selected"]

    w1 = torch.randn(E, F, H, device="cuda", dtype=dtype)
    w2 = torch.randn(E, H, F, device="cuda", dtype=dtype)
    xb, dyb = x.detach().view(E, tokens, H), dy.view(E, tokens, H)
    a = torch.randn(E, tokens, F, device="cuda", dtype=dtype)

    def bmm_fwd():
        torch.bmm(xb, w1.transpose(1, 2))
        torch.bmm(a, w2.transpose(1, 2))

    def bmm_fwd_bwd():
        bmm_fwd()
        torch.bmm(dyb, w2)                      # fc2 dgrad
        torch.bmm(dyb.transpose(1, 2), a)       # fc2 wgrad
        torch.bmm(a, w1)                        # fc1 dgrad
        torch.bmm(a.transpose(1, 2), xb)        # fc1 wgrad

    flop = 2 * T * H * F
    for label, fn, n_gemm in (("fwd", fwd, 2), ("fwd_bwd", fwd_bwd, 6)):
        ms_ours, ms_te = event_ms(lambda: fn(ours), iters, inner=5), event_ms(lambda: fn(stock), iters, inner=5)
        ms_bmm = event_ms(bmm_fwd if label == "fwd" else bmm_fwd_bwd, iters, inner=5)
        row[label] = {
            "ours_ms": ms_ours, "te_ms": ms_te, "bmm_ms": ms_bmm,
            "ours_tflops": n_gemm * flop / ms_ours / 1e9, "te_tflops": n_gemm * flop / ms_te / 1e9,
            "bmm_tflops": n_gemm * flop / ms_bmm / 1e9, "speedup_vs_te": ms_te / ms_ours,
        }
    # wall time above includes host overhead when the GPU outruns Python (small problems, the
    # op fuser's per-call work); with the host ahead the time is the GPU work alone (the deferred
    # split-size check, which would wait for the held GPU at the end of a backward, off for it)
    b = row["fwd_bwd"]
    with split_check_off():
        b["ours_gpu_ms"], b["te_gpu_ms"] = host_ahead_ms(lambda: fwd_bwd(ours)), host_ahead_ms(lambda: fwd_bwd(stock))
    for who in ("ours", "te"):  # a run that syncs every call cannot beat its wall time
        b[f"{who}_host_waits_on_gpu"] = b[f"{who}_gpu_ms"] is None
        if b[f"{who}_gpu_ms"] is None:
            b[f"{who}_gpu_ms"] = b[f"{who}_ms"]
        b[f"{who}_gpu_tflops"] = 6 * flop / b[f"{who}_gpu_ms"] / 1e9
    b["gpu_speedup_vs_te"] = b["te_gpu_ms"] / b["ours_gpu_ms"]
    if profile:
        row["fused_fwd_bwd_kernels"] = kernel_times(lambda: fwd_bwd(ours))
    del ours, stock, x, probs, dy, w1, w2, a
    torch.cuda.empty_cache()
    return row


def markdown(result) -> str:
    lines = [f"# Fused SReLU grouped MLP on {result['gpu']} ({result['date']})", "",
             f"{result['dtype']}, uniform splits; median of {result['iters']} CUDA-event timings of 5 back-to-back calls each; "
             "TFLOP/s = GEMM flops / time (2 GEMMs forward, 6 forward+backward). "
             "`path` says whether our ops ran the fused kernels. Host-ahead = the same fwd+bwd timed while "
             "the host is ahead of the GPU (queued behind a sleep kernel), as in a deep model: GPU work only; "
             "`*` marks a run whose host waits on the GPU every call (TE's unfused grouped linear reads the "
             "split sizes on the host), where the wall time is used.", "",
             "| E | tok/expert | H | F | path | fwd ms ours / TE / bmm | fwd TFLOP/s ours / TE / bmm "
             "| fwd+bwd ms ours / TE / bmm | fwd+bwd TFLOP/s ours / TE / bmm | vs TE "
             "| fwd+bwd host-ahead ms ours / TE | host-ahead TFLOP/s ours / TE | vs TE, host ahead | first call s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        f, b = r["fwd"], r["fwd_bwd"]
        lines.append(
            f"| {r['E']} | {r['tokens_per_expert']} | {r['H']} | {r['F']} | {r['path']} "
            f"| {f['ours_ms']:.3f} / {f['te_ms']:.3f} / {f['bmm_ms']:.3f} "
            f"| {f['ours_tflops']:.0f} / {f['te_tflops']:.0f} / {f['bmm_tflops']:.0f} "
            f"| {b['ours_ms']:.3f} / {b['te_ms']:.3f} / {b['bmm_ms']:.3f} "
            f"| {b['ours_tflops']:.0f} / {b['te_tflops']:.0f} / {b['bmm_tflops']:.0f} "
            f"| {b['speedup_vs_te']:.2f}x | {b['ours_gpu_ms']:.3f}{'*' if b['ours_host_waits_on_gpu'] else ''} "
            f"/ {b['te_gpu_ms']:.3f}{'*' if b['te_host_waits_on_gpu'] else ''} "
            f"| {b['ours_gpu_tflops']:.0f} / {b['te_gpu_tflops']:.0f} | {b['gpu_speedup_vs_te']:.2f}x "
            f"| {r['first_call_s']:.1f} |")
    reasons = {"; ".join(r["fallback_reasons"]) for r in result["rows"] if r["fallback_reasons"]}
    if reasons:
        lines += ["", "Unfused because: " + " / ".join(sorted(reasons))]
    return "\n".join(lines) + "\n"


def chart(result, path: Path) -> bool:
    """TFLOP/s of forward+backward per config: ours and TE's with the host ahead, the bmm roof."""
    plt = pyplot()
    if plt is None:
        return False
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(rows) + 3), 4.5))
    xs = range(len(rows))
    series = (("ours, host ahead", "ours_gpu_tflops", "#dd8452"), ("TE unfused, host ahead", "te_gpu_tflops", "#4c72b0"),
              ("cuBLAS bmm roof", "bmm_tflops", "#888888"))
    for j, (label, key, color) in enumerate(series):
        ax.bar([x + (j - 1) * 0.27 for x in xs], [r["fwd_bwd"][key] for r in rows], 0.27, label=label, color=color)
    ax.set_xticks(list(xs), [f"E{r['E']}x{r['tokens_per_expert']}\nH{r['H']} F{r['F']}" for r in rows], fontsize=7)
    ax.set_ylabel("forward + backward TFLOP/s")
    ax.set_title(f"Fused SReLU grouped MLP vs TE's ops, {result['gpu']} ({result['date']})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if problem := cuda_problem():
        return refuse("bench_fused_mlp.py", problem)
    import torch

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    gpu = torch.cuda.get_device_name()
    plan = configs(args)
    rows = []
    print(f"[bench_fused_mlp] {gpu}: {len(plan)} configs, {args.iters} samples each", flush=True)
    start = time.perf_counter()
    for i, (E, tokens, H, F) in enumerate(plan, 1):
        row = measure(E, tokens, H, F, dtype, args.iters, profile=args.profile)
        rows.append(row)
        b = row["fwd_bwd"]
        print(f"[bench_fused_mlp] config {i}/{len(plan)} E={E} tok={tokens} H={H} F={F} {row['path']}: fwd+bwd "
              f"{b['ours_ms']:.3f} ms ({b['ours_tflops']:.0f} TFLOP/s; host ahead {b['ours_gpu_ms']:.3f} ms, "
              f"{b['ours_gpu_tflops']:.0f} TFLOP/s) vs TE {b['te_ms']:.3f} ms (host ahead {b['te_gpu_ms']:.3f} ms), "
              f"bmm roof {b['bmm_tflops']:.0f} TFLOP/s | elapsed {time.perf_counter() - start:.0f} s", flush=True)
        for k in row.get("fused_fwd_bwd_kernels", []):
            print(f"    {k['us_per_step']:8.1f} us  x{k['calls_per_step']:<4g} {k['kernel']}", flush=True)
    result = {"benchmark": "fused_srelu_mlp", "gpu": gpu, "dtype": args.dtype, "iters": args.iters,
              "date": utc_now(), "rows": rows}
    paths = write_reports(args.out, file_stem("fused_mlp", gpu, "sweep" if args.sweep else ""), result, markdown, chart)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
