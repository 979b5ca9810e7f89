"""The grouped FP8 GEMM (TE's block scaling) against the bf16 grouped GEMM and TE's FP8 grouped GEMM.

Forward form ``C_e = A_e @ B_e^T`` at E experts x {2048, 4096, 8192} tokens per expert and
(N, K) in {(2048, 4096), (4096, 2048), (1792, 2688)} (``--tokens``, ``--shapes`` choose others). Contenders, timed interleaved as
``bench_kernels.py`` times them (GPU time per call with the host ahead, medians over ``--reps``
rounds of ``--inner`` calls):

* ``fp8``: ``kernels.grouped_gemm_fp8_blockwise``, default tile (128 x 128), serial promotion
  (``promotion="serial"``, whatever $TEO_FP8_PROMOTION says), on operands quantized
  by TE's ``Float8BlockQuantizer`` (A 1x128 over all tokens, each expert's weight 128x128);
* ``fp8 overlap``: the same with the overlapped promotion (the entry points' default: the next
  128-K block's WGMMAs run while a block is promoted), in 2 x 2 clusters where the entry points
  take them (an even n-block count, ``kernels.tiling.pick_cluster_m_fp8``);
* ``fp8 overlap pair``: the same in CTA pairs only (``TEO_GEMM_CLUSTER_M=1``);
* ``fp8 BN192``: the same with 128 x 192 tiles;
* ``bf16``: ``kernels.grouped_gemm`` on the bf16 operands (its default schedule and tile);
* ``te fp8``: TE's ``general_grouped_gemm`` as ``GroupedLinear`` calls it under
  ``Float8BlockScaling`` (cuBLAS; each expert's tokens quantized on their own), where it runs.

Quantization is outside every timed call. Each case also reports the FP8 output's relative error
(Frobenius norm) against the bf16 GEMM of TE's dequantized operands and against TE's FP8 output,
and the SM clock and power the GPU held while it was timed (``gpu_clocks.py``).
Writes ``fp8_gemm_<GPU>.{json,md,png}`` to ``--out`` (``fp8_gemm_<GPU>_N<n>K<k>...`` for other
``--shapes``); exits 2 where it cannot run. The overlapped contender takes the overlapped promotion
at every K, past the entry points' default limit (``kernels.api_fp8.OVERLAP_MAX_K``) too.

    python3 benchmarks/bench_fp8_gemm.py --out "$OUT/results"
    python3 benchmarks/bench_fp8_gemm.py --shapes 2048x7168 7168x2048 --tokens 4096 8192
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_common import (add_gemm_timing_args, bar_chart, check_gemm_timing_args, command_line,  # noqa: E402
                          file_stem, sm90_kernel_problem,
                          refuse, utc_now, write_reports)
from gpu_clocks import GpuClocks  # noqa: E402

TOKENS = (2048, 4096, 8192)
SHAPES = ((2048, 4096), (4096, 2048), (1792, 2688))
CONTENDERS = ("fp8", "fp8 overlap", "fp8 overlap pair", "fp8 BN192", "bf16", "te fp8")
CLUSTER_M_ENV = "TEO_GEMM_CLUSTER_M"  # kernels.tiling.CLUSTER_M_ENV


def _clusters(value, fn):
    """``fn`` with $TEO_GEMM_CLUSTER_M set to ``value`` (None: unset, the entry points' choice)
    while it picks its kernel."""
    def call():
        before = os.environ.pop(CLUSTER_M_ENV, None)
        if value is not None:
            os.environ[CLUSTER_M_ENV] = value
        try:
            return fn()
        finally:
            os.environ.pop(CLUSTER_M_ENV, None)
            if before is not None:
                os.environ[CLUSTER_M_ENV] = before
    return call


def _quantizer(dim):
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    return Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, block_scaling_dim=dim)


def _rel(x, ref) -> float:
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm())


def _case(e, tokens, n, k, torch):
    """{contender: fn or an unavailability reason} and the error figures of one case."""
    from te_offload_ops import kernels as K

    t = e * tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(e, n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    s = torch.full((e,), tokens, dtype=torch.int32, device="cuda")
    xq = _quantizer(1)(x)
    wq = [_quantizer(2)(w[i]) for i in range(e)]
    a, sa = xq._rowwise_data, xq._rowwise_scale_inv
    b = torch.stack([q._rowwise_data for q in wq])
    sb = torch.stack([q._rowwise_scale_inv for q in wq])
    out8, out8o, out8p, out8w, out16 = (torch.empty(t, n, dtype=torch.bfloat16, device="cuda") for _ in range(5))
    fns = {
        "fp8": _clusters(None, lambda: K.grouped_gemm_fp8_blockwise(a, sa, b, sb, s, out=out8, promotion="serial")),
        "fp8 overlap": _clusters(None, lambda: K.grouped_gemm_fp8_blockwise(a, sa, b, sb, s, out=out8o,
                                                                            promotion="overlap")),
        "fp8 overlap pair": _clusters("1", lambda: K.grouped_gemm_fp8_blockwise(a, sa, b, sb, s, out=out8p,
                                                                                promotion="overlap")),
        "fp8 BN192": _clusters(None, lambda: K.grouped_gemm_fp8_blockwise(a, sa, b, sb, s, tile=(128, 192),
                                                                          out=out8w)),
        "bf16": lambda: K.grouped_gemm(x, w, s, out=out16),
    }
    # TE's path: per-expert quantized tokens (split_quantize), cuBLAS grouped GEMM
    try:
        from transformer_engine.pytorch.cpp_extensions import general_grouped_gemm

        xs = [_quantizer(1)(part) for part in x.split([tokens] * e)]
        out_te = torch.empty(t, n, dtype=torch.bfloat16, device="cuda")

        def te_fp8():
            general_grouped_gemm(wq, xs, [out_te], [None] * e, torch.bfloat16, single_output=True,
                                 m_splits=[tokens] * e, use_split_accumulator=True)

        te_fp8()
        torch.cuda.synchronize()
        fns["te fp8"] = te_fp8
    except Exception as exc:  # noqa: BLE001 (any failure: reported, the others still run)
        fns["te fp8"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        out_te = None
    for name in ("fp8", "fp8 overlap", "fp8 overlap pair", "fp8 BN192", "bf16"):
        fns[name]()
    torch.cuda.synchronize()
    # the bf16 GEMM of the dequantized operands: what the FP8 GEMM should give
    a_real = xq.dequantize(dtype=torch.bfloat16)
    b_real = torch.stack([q.dequantize(dtype=torch.bfloat16) for q in wq])
    ref = K.grouped_gemm(a_real, b_real, s)
    errors = {"fp8_vs_dequant_bf16": _rel(out8, ref), "fp8_bn192_vs_fp8": _rel(out8w, out8),
              "fp8_overlap_vs_fp8": _rel(out8o, out8), "fp8_pair_vs_fp8": _rel(out8p, out8),
              "fp8_vs_te_fp8": _rel(out8, out_te) if out_te is not None else None,
              "bf16_vs_dequant_bf16": _rel(out16, ref)}
    return fns, errors, 2.0 * t * n * k


def measure(args) -> dict:
    import torch

    from bench_kernels import time_interleaved

    from te_offload_ops.kernels import registry

    rows = []
    cases = [(tok, n, k) for (n, k) in args.shapes for tok in args.tokens]
    for i, (tok, n, k) in enumerate(cases, 1):
        faulthandler.dump_traceback_later(args.watchdog, exit=True)
        fns, errors, flops = _case(args.experts, tok, n, k, torch)
        runnable = {name: fn for name, fn in fns.items() if callable(fn)}
        with GpuClocks() as clocks:
            times = time_interleaved(runnable, args.reps, args.inner)
        faulthandler.cancel_dump_traceback_later()
        row = {"tokens_per_expert": tok, "n": n, "k": k, "gflop": flops / 1e9, **errors, **clocks.summary(),
               "contenders": {}}
        for name in CONTENDERS:
            fn = fns.get(name)
            if callable(fn):
                ms, host_us, behind = times[name]
                row["contenders"][name] = {"ms": ms, "TFLOPs": flops / ms / 1e9, "host_us": host_us,
                                           "host_behind_samples": behind}
            else:
                row["contenders"][name] = {"unavailable": fn}
        rows.append(row)
        c = row["contenders"]
        said = ", ".join(f"{name} {c[name]['TFLOPs']:.0f}" if "TFLOPs" in c[name] else f"{name} n/a"
                         for name in CONTENDERS)
        clock = f"; SM {row['sm_MHz']:.0f} MHz (min {row['sm_MHz_min']:.0f})" if "sm_MHz" in row else ""
        print(f"[{i}/{len(cases)}] E={args.experts} x {tok}, N={n}, K={k}: TFLOP/s {said}; "
              f"fp8 rel err vs dequantized bf16 {errors['fp8_vs_dequant_bf16']:.2e}{clock}", flush=True)
        del fns
        torch.cuda.empty_cache()
    # key: ("fp8_blockwise", dtype, tile, cluster_n, n, k, e, sb_cols, [promotion], [("cluster_m", 2)], call)
    compile_s = [{"n": key[4], "k": key[5], "bn": key[2][1], "promotion": "overlap" if "overlap" in key else "serial",
                  "clusters": "2x2" if ("cluster_m", 2) in key else "pair" if key[3] == 2 else "none",
                  "seconds": round(secs, 2)}
                 for key, secs in registry.compile_times().items() if key[0] == "fp8_blockwise"]
    return {"gpu": torch.cuda.get_device_name(),
            "date": utc_now(),
            "experts": args.experts, "reps": args.reps, "inner": args.inner,
            "torch": torch.__version__, "fp8_compile_seconds": compile_s, "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# Grouped FP8 GEMM (Float8BlockScaling) vs bf16 and TE, {result['gpu']} ({result['date']})", "",
             f"C_e = A_e @ B_e^T, E={result['experts']} experts, even splits; TFLOP/s from GPU time per call "
             f"with the host ahead, medians of {result['reps']} interleaved rounds of {result['inner']} calls. "
             "fp8: A 1x128 and B 128x128 scales, fp32 promotion per 128-K block, bf16 output. "
             "Errors: relative Frobenius norm against the bf16 GEMM of TE's dequantized operands. "
             "SM MHz: the clock nvidia-smi read while the row's contenders ran (median, lowest)."
             + (f" Command: `{result['command']}`" if result.get("command") else ""), "",
             "ours: fp8 overlap, the default promotion and clusters (fp8, the serial one, where a file lacks it); "
             "fp8 overlap pair: the same in CTA pairs only (TEO_GEMM_CLUSTER_M=1). Errors of every FP8 contender "
             "against fp8's: 0 (the same bits) unless listed.", "",
             "| tokens/expert | N | K | " + " | ".join(f"{c} TFLOP/s" for c in CONTENDERS)
             + " | ours / bf16 | ours / te fp8 | fp8 err | fp8 vs te fp8 | SM MHz (lowest) | W |",
             "|---|---|---|" + "---|" * (len(CONTENDERS) + 6)]
    for r in result["rows"]:
        c = r["contenders"]
        tf = {name: c.get(name, {}).get("TFLOPs") for name in CONTENDERS}  # a result file may lack a contender
        cells = [f"{tf[name]:.0f}" if tf[name] else "n/a" for name in CONTENDERS]
        ours = tf["fp8 overlap"] or tf["fp8"]
        ratio_bf16 = f"{ours / tf['bf16']:.2f}" if ours and tf["bf16"] else "n/a"
        ratio_te = f"{ours / tf['te fp8']:.2f}" if ours and tf["te fp8"] else "n/a"
        vs_te = f"{r['fp8_vs_te_fp8']:.1e}" if r["fp8_vs_te_fp8"] is not None else "n/a"
        clock = f"{r['sm_MHz']:.0f} ({r['sm_MHz_min']:.0f})" if "sm_MHz" in r else "-"
        watts = f"{r['power_W']:.0f}" if "power_W" in r else "-"
        lines.append(f"| {r['tokens_per_expert']} | {r['n']} | {r['k']} | " + " | ".join(cells)
                     + f" | {ratio_bf16} | {ratio_te} | {r['fp8_vs_dequant_bf16']:.1e} | {vs_te} | {clock} | {watts} |")
    differ = [f"{r['tokens_per_expert']} x N={r['n']} K={r['k']}: {name} {r[name]:.1e}" for r in result["rows"]
              for name in ("fp8_overlap_vs_fp8", "fp8_pair_vs_fp8", "fp8_bn192_vs_fp8") if r.get(name)]
    if differ:
        lines += ["", "FP8 contenders whose output differs from fp8's (relative error): " + "; ".join(differ)]
    missing = {c["unavailable"] for r in result["rows"] for c in r["contenders"].values() if "unavailable" in c}
    if missing:
        lines += ["", "Not run: " + "; ".join(sorted(missing))]
    compiled = result.get("fp8_compile_seconds")
    if isinstance(compiled, list) and compiled:
        lines += ["", "FP8 kernel compile seconds (first call): "
                  + ", ".join(f"N={c['n']} K={c['k']} BN={c['bn']} {c['promotion']}"
                              + (f" {c['clusters']}" if "clusters" in c else "") + f" {c['seconds']}" for c in compiled)]
    elif compiled:  # files that keyed them by the kernel cache's key
        lines += ["", "FP8 kernel compile seconds (first call): " + ", ".join(f"{v}" for v in compiled.values())]
    return "\n".join(lines) + "\n"


def chart(result: dict, path) -> bool:
    rows = result["rows"]
    return bar_chart(path, f"Grouped GEMM, E={result['experts']} x tokens/expert ({result['gpu']})",
                     [f"{r['tokens_per_expert']}\nN{r['n']} K{r['k']}" for r in rows],
                     {name: [r["contenders"].get(name, {}).get("TFLOPs", 0.0) for r in rows] for name in CONTENDERS},
                     size=(11, 4.5), line=(1100, "1,100 TFLOP/s"))


def _shape(text: str) -> tuple[int, int]:
    """``NxK`` -> (N, K): N a multiple of 8, K of 16 (the FP8 kernel's operand rows)."""
    try:
        n, k = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is NxK, e.g. 2048x7168, got {text!r}") from None
    if n < 8 or k < 16 or n % 8 or k % 16:
        raise argparse.ArgumentTypeError(f"N must be a positive multiple of 8 and K of 16, got {text!r}")
    return n, k


def shapes_suffix(shapes) -> str:
    """The results stem's suffix for shapes other than the default set ("" for the default)."""
    shapes = [tuple(s) for s in shapes]
    return "" if shapes == list(SHAPES) else "_".join(f"N{n}K{k}" for n, k in shapes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gemm_timing_args(ap, TOKENS)
    ap.add_argument("--shapes", type=_shape, nargs="+", default=list(SHAPES), metavar="NxK",
                    help="(N, K) of the weights, e.g. 2048x7168 (default: "
                         + " ".join(f"{n}x{k}" for n, k in SHAPES) + "; others name the results files)")
    args = ap.parse_args(argv)
    check_gemm_timing_args(ap, args)
    if (problem := sm90_kernel_problem()):
        return refuse("bench_fp8_gemm.py", problem)
    result = measure(args)
    result["command"] = command_line("benchmarks/bench_fp8_gemm.py", sys.argv[1:] if argv is None else argv)
    write_reports(Path(args.out), file_stem("fp8_gemm", result["gpu"], shapes_suffix(args.shapes)), result,
                  markdown, chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
