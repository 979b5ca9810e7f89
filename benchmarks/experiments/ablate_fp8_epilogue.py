"""What the grouped FP8 GEMM's epilogue costs: the kernel as it ships against the same kernel
whose epilogue stores nothing (the tile's sums still computed; the rounding, staging, stores and
barriers left out; wrong output, the time without that work), timed interleaved at the forward
GEMMs' shapes.

The gap bounds what any faster epilogue could buy at each K. Operands are random FP8 bytes with unit scales (the time does not
depend on their values); kernels compile here without the disk cache (the ablated one must not
enter it). GPU time per call with the host ahead, medians of ``--reps`` interleaved rounds of
``--inner`` calls, as ``benchmarks/bench_kernels.py`` times them; the SM clock and power while
each row ran (``benchmarks/gpu_clocks.py``).

    python3 benchmarks/experiments/ablate_fp8_epilogue.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from bench_common import cuda_problem, refuse, utc_now  # noqa: E402

SHAPES = ((7168, 2048), (2048, 7168), (2688, 1856), (1856, 2688))
TOKENS = (2048, 8192)


def _problem() -> str | None:
    import importlib.util

    import torch

    if (problem := cuda_problem()):
        return problem
    if torch.cuda.get_device_capability() != (9, 0):
        return f"the kernels need an sm_90 GPU (H100/H200), found {torch.cuda.get_device_name()}"
    if importlib.util.find_spec("cutlass") is None:
        return "the CuTe DSL (nvidia-cutlass-dsl) is not installed"
    return None


def _no_store_epilogue():
    """An ``_epilogue`` that sums the tile's accumulators and stores nothing (a branch no thread
    takes keeps the sums, and so the promotion, live)."""
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def _epilogue(self, etid, cwg, n_blk, row0, rows_here, cols_here, acc, prob_r, z_r, thr_mma, c_id, thr_cp,
                  cp_id, st, m_c, m_z, m_act, m_part):
        total = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc)):
            total = total + acc[i]
        g_c = self._chunk(m_c, row0, 0)
        value = total.to(self.dtype)
        if rows_here < 0:
            g_c[0, 0] = value

    return _epilogue


def _kernels(n: int, k: int, e: int):
    from te_offload_ops.kernels import api_fp8
    from te_offload_ops.kernels.gemm_fp8_sm90 import GroupedGemmFp8Sm90

    shipped = api_fp8.compile_variant_fp8(n, k, e)
    original = GroupedGemmFp8Sm90._epilogue
    GroupedGemmFp8Sm90._epilogue = _no_store_epilogue()
    try:
        ablated = api_fp8.compile_variant_fp8(n, k, e)
    finally:
        GroupedGemmFp8Sm90._epilogue = original
    return {"shipped": shipped, "no stores": ablated}


def measure(args) -> dict:
    import torch
    from bench_kernels import time_interleaved
    from gpu_clocks import GpuClocks

    from te_offload_ops.kernels import api, api_fp8

    rows = []
    e = args.experts
    for n, k in args.shapes:
        kernels = _kernels(n, k, e)
        for tok in args.tokens:
            t = e * tok
            a = torch.randint(0, 0x70, (t, k), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
            b = torch.randint(0, 0x70, (e, n, k), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
            kb, nb = -(-k // 128), -(-n // 128)
            sa = torch.ones(kb, -(-t // 4) * 4, device="cuda")
            sb = torch.ones(e, nb, -(-kb // 4) * 4, device="cuda")
            s = torch.full((e,), tok, dtype=torch.int32, device="cuda")
            outs = {name: torch.empty(t, n, dtype=torch.bfloat16, device="cuda") for name in kernels}
            fns = {name: (lambda kern=kern, compiled=compiled, c=outs[name]:
                          api_fp8._launch_fp8(kern, compiled, a, b, c, s, sa, sb, t))
                   for name, (kern, compiled, _) in kernels.items()}
            with GpuClocks() as clocks:
                times = time_interleaved(fns, args.reps, args.inner)
            flops = 2.0 * t * n * k
            row = {"tokens_per_expert": tok, "n": n, "k": k, **clocks.summary(),
                   "tflops": {name: flops / times[name][0] / 1e9 for name in fns},
                   "promotion": kernels["shipped"][0].promotion,
                   "compile_s": {name: round(v[2], 2) for name, v in kernels.items()}}
            row["no_stores_over_shipped"] = row["tflops"]["no stores"] / row["tflops"]["shipped"]
            rows.append(row)
            print(f"E={e} x {tok}, N={n}, K={k}: shipped {row['tflops']['shipped']:.0f}, no stores "
                  f"{row['tflops']['no stores']:.0f} TFLOP/s ({row['no_stores_over_shipped']:.3f}x)", flush=True)
            del a, b, outs, fns
            torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "date": utc_now(), "experts": e, "reps": args.reps,
            "inner": args.inner, "command": " ".join(["python3", "benchmarks/experiments/ablate_fp8_epilogue.py",
                                                       *sys.argv[1:]]),
            "call_convention": api.kernel_call_convention(), "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"# Grouped FP8 GEMM: shipped epilogue against no stores, {result['gpu']} ({result['date']})", "",
             f"E={result['experts']}, even splits; GPU time per call with the host ahead, medians of "
             f"{result['reps']} interleaved rounds. Command: `{result['command']}`", "",
             "| tokens/expert | N | K | promotion | shipped TFLOP/s | no stores TFLOP/s | no stores / shipped "
             "| SM MHz (lowest) | W |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        clock = f"{r['sm_MHz']:.0f} ({r['sm_MHz_min']:.0f})" if "sm_MHz" in r else "-"
        watts = f"{r['power_W']:.0f}" if "power_W" in r else "-"
        lines.append(f"| {r['tokens_per_expert']} | {r['n']} | {r['k']} | {r['promotion']} | "
                     f"{r['tflops']['shipped']:.0f} | {r['tflops']['no stores']:.0f} | "
                     f"{r['no_stores_over_shipped']:.3f} | {clock} | {watts} |")
    return "\n".join(lines) + "\n"


def _shape(text: str) -> tuple[int, int]:
    n, k = text.lower().split("x")
    return int(n), int(k)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=_shape, nargs="+", default=list(SHAPES), help="NxK pairs")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="tokens per expert")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    if (problem := _problem()):
        return refuse("ablate_fp8_epilogue.py", problem)
    os.environ["TEO_KERNEL_CACHE"] = "0"
    result = measure(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"ablate_fp8_epilogue_{result['gpu'].replace(' ', '_')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
