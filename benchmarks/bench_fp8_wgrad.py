"""The grouped FP8 weight gradient (TE's block scaling) against the bf16 grouped weight gradient.

``dW_e = A_e^T B_e`` over each expert's tokens at E experts x {2048, 4096, 8192} tokens per expert
and (M, N) in {(2688, 1856), (1856, 2688)} (fc2's and fc1's weight gradients of the MLP at H=2688,
F=1856). Contenders, timed interleaved as ``bench_kernels.py`` times them (GPU time per call with
the host ahead, medians over ``--reps`` rounds of ``--inner`` calls):

* ``fp8``: ``grouped_wgrad_fp8_blockwise`` on the per-expert columnwise copies
  (``fp8_rows.quantize_columns``), bf16 output, with the default (overlapped) promotion;
* ``fp8 main_grad``: the same added into fp32 main_grad buffers (``grouped_wgrad_fp8_main_grad``);
* ``fp8 serial``, ``fp8 main_grad serial``: the same with ``promotion="serial"`` (each k-block
  promoted after its WGMMAs);
* ``bf16``: ``kernels.grouped_wgrad`` on the bf16 token matrices;
* ``bf16 main_grad``: ``kernels.grouped_wgrad_main_grad``;
* ``columns``: the two ``quantize_columns`` passes the FP8 form needs (not inside the GEMM timings).

Each case reports the FP8 output's relative error (Frobenius norm) against the bf16 GEMM of the
dequantized columnwise operands. Writes ``fp8_wgrad_<GPU>.{json,md,png}`` to ``--out``; exits 2
where it cannot run.

    python3 benchmarks/bench_fp8_wgrad.py --out "$OUT/results"
"""

from __future__ import annotations

import argparse
import faulthandler
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import (add_gemm_timing_args, bar_chart, check_gemm_timing_args, command_line, file_stem,  # noqa: E402
                          refuse, sm90_kernel_problem, utc_now, write_reports)
from bench_fp8_gemm import _rel  # noqa: E402

TOKENS = (2048, 4096, 8192)
SHAPES = ((2688, 1856), (1856, 2688))  # (M, N): fc2's dW (H x F), fc1's dW (F x H)
GEMMS = ("fp8", "fp8 main_grad", "fp8 serial", "fp8 main_grad serial", "bf16", "bf16 main_grad")
CONTENDERS = (*GEMMS, "columns")


def _dequantized(data, scales, rows, torch):
    values = data.view(torch.float8_e4m3fn).float()
    return values * scales[:, :rows].t().repeat_interleave(128, dim=1)


def _case(e, tokens, m, n, torch):
    from te_offload_ops import kernels as K
    from te_offload_ops.kernels import fp8_rows
    from te_offload_ops.kernels.api_fp8_wgrad import grouped_wgrad_fp8_blockwise, grouped_wgrad_fp8_main_grad

    t = e * tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(t, m, device="cuda", generator=g).bfloat16()
    b = torch.randn(t, n, device="cuda", generator=g).bfloat16()
    s = torch.full((e,), tokens, dtype=torch.int32, device="cuda")
    qa, sa = fp8_rows.quantize_columns(a, s, 0.0, False)
    _, poff = fp8_rows.expert_offsets(s)
    qb, sb = fp8_rows.quantize_columns(b, s, 0.0, False)
    mg8 = torch.zeros(e, m, n, device="cuda")
    mg16 = torch.zeros(e, m, n, device="cuda")
    fns = {
        "fp8": lambda: grouped_wgrad_fp8_blockwise(qa, sa, qb, sb, s, t),
        "fp8 main_grad": lambda: grouped_wgrad_fp8_main_grad(qa, sa, qb, sb, s, t, mg8),
        "fp8 serial": lambda: grouped_wgrad_fp8_blockwise(qa, sa, qb, sb, s, t, promotion="serial"),
        "fp8 main_grad serial": lambda: grouped_wgrad_fp8_main_grad(qa, sa, qb, sb, s, t, mg8, promotion="serial"),
        "bf16": lambda: K.grouped_wgrad(a, b, s),
        "bf16 main_grad": lambda: K.grouped_wgrad_main_grad(a, b, s, mg16),
        "columns": lambda: (fp8_rows.quantize_columns(a, s, 0.0, False), fp8_rows.quantize_columns(b, s, 0.0, False)),
    }
    out8 = fns["fp8"]()
    torch.cuda.synchronize()
    a_real = _dequantized(qa, sa, m, torch).t().contiguous().bfloat16()  # (Tp, M), padding rows zero
    b_real = _dequantized(qb, sb, n, torch).t().contiguous().bfloat16()
    sp = (poff[1:] - poff[:-1]).to(torch.int32)
    ref = K.grouped_wgrad(a_real, b_real, sp)
    errors = {"fp8_vs_dequant_bf16": _rel(out8, ref)}
    return fns, errors, 2.0 * t * m * n


def measure(args) -> dict:
    import torch

    from bench_kernels import time_interleaved

    rows = []
    cases = [(tok, m, n) for (m, n) in SHAPES for tok in args.tokens]
    for i, (tok, m, n) in enumerate(cases, 1):
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
        fns, errors, flops = _case(args.experts, tok, m, n, torch)
        times = time_interleaved(fns, args.reps, args.inner)
        faulthandler.cancel_dump_traceback_later()
        row = {"tokens_per_expert": tok, "m": m, "n": n, "gflop": flops / 1e9, **errors, "contenders": {}}
        for name in CONTENDERS:
            ms, host_us, behind = times[name]
            row["contenders"][name] = {"ms": ms, "host_us": host_us, "host_behind_samples": behind,
                                       **({"TFLOPs": flops / ms / 1e9} if name in GEMMS else {})}
        rows.append(row)
        c = row["contenders"]
        said = ", ".join(f"{name} {c[name]['TFLOPs']:.0f}" for name in GEMMS)
        print(f"[{i}/{len(cases)}] E={args.experts} x {tok}, M={m}, N={n}: TFLOP/s {said}; columns "
              f"{c['columns']['ms'] * 1e3:.0f} us; fp8 rel err {errors['fp8_vs_dequant_bf16']:.2e}", flush=True)
        del fns
        torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "date": utc_now(), "experts": args.experts, "reps": args.reps,
            "inner": args.inner, "torch": torch.__version__,
            "command": command_line("benchmarks/bench_fp8_wgrad.py", args.argv), "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# Grouped FP8 weight gradient (Float8BlockScaling) vs bf16, {result['gpu']} ({result['date']})", "",
             f"dW_e = A_e^T B_e, E={result['experts']} experts, even splits; TFLOP/s from GPU time per call with the "
             f"host ahead, medians of {result['reps']} interleaved rounds of {result['inner']} calls. fp8: per-expert "
             "columnwise copies (128x1 token blocks), fp32 promotion per 128-token block, overlapped with the next "
             "block's WGMMAs (serial: after each block's WGMMAs). columns: the two "
             "quantize_columns passes, outside the GEMMs' times. Error: relative Frobenius norm against the bf16 "
             f"GEMM of the dequantized operands. Command: `{result.get('command', '')}`", "",
             "| tokens/expert | M | N | " + " | ".join(f"{c} TFLOP/s" for c in GEMMS)
             + " | columns us | fp8 / bf16 | overlapped / serial promotion | fp8 err |",
             "|---|---|---|" + "---|" * (len(GEMMS) + 4)]
    for r in result["rows"]:
        c = r["contenders"]
        tf = {name: c[name]["TFLOPs"] for name in GEMMS}
        lines.append(f"| {r['tokens_per_expert']} | {r['m']} | {r['n']} | "
                     + " | ".join(f"{tf[name]:.0f}" for name in GEMMS)
                     + f" | {c['columns']['ms'] * 1e3:.0f} | {tf['fp8'] / tf['bf16']:.2f} | "
                       f"{tf['fp8'] / tf['fp8 serial']:.2f} | {r['fp8_vs_dequant_bf16']:.1e} |")
    return "\n".join(lines) + "\n"


def chart(result: dict, path) -> bool:
    rows = result["rows"]
    return bar_chart(path, f"Grouped weight gradient, E={result['experts']} x tokens/expert ({result['gpu']})",
                     [f"{r['tokens_per_expert']}\nM{r['m']} N{r['n']}" for r in rows],
                     {name: [r["contenders"][name]["TFLOPs"] for r in rows] for name in GEMMS})


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gemm_timing_args(ap, TOKENS)
    args = ap.parse_args(argv)
    args.argv = argv
    check_gemm_timing_args(ap, args)
    if (problem := sm90_kernel_problem()):
        return refuse("bench_fp8_wgrad.py", problem)
    result = measure(args)
    write_reports(Path(args.out), file_stem("fp8_wgrad", result["gpu"]), result, markdown, chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
