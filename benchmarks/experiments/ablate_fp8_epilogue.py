"""What the grouped FP8 GEMM's epilogue costs, timed interleaved at the forward GEMMs' shapes:

* ``shipped``: the kernel as it ships (each tile staged through shared memory, 64 columns at a
  time, and stored by the threads as 16-byte row vectors, predicated; each math warpgroup stages
  and stores its own 64 rows and meets only its own 128 threads at a barrier);
* ``one barrier``: the same staging and stores, both math warpgroups meeting at one tile-wide
  barrier around each chunk (the bf16 kernel's staged epilogue, which the FP8 kernel inherits);
  its output is checked bit for bit against the shipped kernel's on uneven splits;
* ``direct``: the same kernel storing each thread's column pairs straight from the accumulator
  layout (4-byte stores, a quad's lanes covering 16 bytes of a row), predicated, with no staging
  and no barrier; its output checked as ``one barrier``'s;
* ``no stores``: the tile's sums computed and nothing written (wrong output: the time without
  the epilogue's rounding, staging, stores and barriers), a bound on what any faster epilogue
  could buy at each K, not a kernel.

Operands are random FP8 bytes with unit scales (the time does not depend on their values);
kernels compile here without the disk cache (the variants must not enter it). GPU time per call
with the host ahead, medians of ``--reps`` interleaved rounds of ``--inner`` calls, as
``benchmarks/bench_kernels.py`` times them; the SM clock and power while each row ran
(``benchmarks/gpu_clocks.py``).

    python3 benchmarks/experiments/ablate_fp8_epilogue.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from bench_common import refuse, sm90_kernel_problem, utc_now  # noqa: E402

SHAPES = ((7168, 2048), (2048, 7168), (2688, 1856), (1856, 2688))
TOKENS = (2048, 8192)


def _no_store_epilogue():
    """An ``_epilogue_plain`` that sums the tile's accumulators and stores nothing (a branch no thread
    takes keeps the sums, and so the promotion, live)."""
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def _epilogue(self, etid, cwg, n_blk, row0, rows_here, cols_here, acc, thr_mma, c_id, st, m_c):
        total = cutlass.Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc)):
            total = total + acc[i]
        g_c = self._chunk(m_c, row0, 0)
        value = total.to(self.dtype)
        if rows_here < 0:
            g_c[0, 0] = value

    return _epilogue


def _direct_epilogue():
    """An ``_epilogue_plain`` that stores the tile straight from the accumulator layout: each thread's
    column pairs (4 bytes; a quad's four lanes cover 16 bytes of a row), predicated on the row and
    column, with no staging through shared memory and so no barrier between the math warpgroups."""
    import cutlass
    import cutlass.cute as cute

    @cute.jit
    def _epilogue(self, etid, cwg, n_blk, row0, rows_here, cols_here, acc, thr_mma, c_id, st, m_c):
        bm, bn = self.bm, self.bn
        # 64-bit: row0 * N passes 2^31 for operands past 2^31 elements; N % 8 == 0 and even columns
        ptr = (m_c.iterator + (cutlass.Int64(row0) * self.n + n_blk * bn)).align(4)
        t_g = thr_mma.partition_C(cute.make_tensor(ptr, cute.make_layout((bm, bn), stride=(self.n, 1))))
        shp = acc.shape
        n_half, n_grp = cute.size(shp[0][1]), cute.size(shp[0][2])
        pair = cute.make_rmem_tensor(cute.make_layout(2), self.dtype)
        for mm in cutlass.range_constexpr(cute.size(shp[1])):
            for h in cutlass.range_constexpr(n_half):
                for g in cutlass.range_constexpr(n_grp):
                    rc = c_id[(0, h, g), mm, 0]
                    for pr in cutlass.range_constexpr(2):
                        pair[pr] = acc[(pr, h, g), mm, 0].to(self.dtype)
                    if rc[0] < rows_here:
                        if rc[1] < cols_here:
                            cute.autovec_copy(pair, t_g[(None, h, g), mm, 0])

    return _epilogue


def _one_barrier_epilogue():
    """An ``_epilogue_plain`` that hands the tile to the bf16 kernel's staged epilogue: the same
    staging and 16-byte stores, both math warpgroups at one tile-wide barrier around each chunk."""
    import cutlass
    import cutlass.cute as cute

    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    @cute.jit
    def _epilogue(self, etid, cwg, n_blk, row0, rows_here, cols_here, acc, thr_mma, c_id, st, m_c):
        thr_cp = self._staging_copy().get_slice(etid)
        cp_id = thr_cp.partition_S(cute.make_identity_tensor((self.bm, self.epi_cols)))
        n_rows = cute.size(acc.shape[0][1]) * cute.size(acc.shape[1])
        prob_r = cute.make_rmem_tensor(cute.make_layout(n_rows), cutlass.Float32)  # plain: read by none
        GroupedGemmSm90._epilogue(self, etid, cwg, n_blk, row0, rows_here, cols_here, acc, prob_r, [], thr_mma,
                                  c_id, thr_cp, cp_id, st, m_c, m_c, m_c, m_c)

    return _epilogue


# the epilogue each variant compiles with (None: the kernel's own); "no stores" is a bound
EPILOGUES = {"shipped": None, "one barrier": _one_barrier_epilogue, "direct": _direct_epilogue,
             "no stores": _no_store_epilogue}


def _kernels(n: int, k: int, e: int, names, options=None):
    """{variant: (kernel object, compiled, seconds)}; the kernel class as it was afterwards."""
    from te_offload_ops.kernels import api_fp8
    from te_offload_ops.kernels.gemm_fp8_sm90 import GroupedGemmFp8Sm90

    original = GroupedGemmFp8Sm90._epilogue_plain
    out = {}
    try:
        for name in names:
            make = EPILOGUES[name]
            GroupedGemmFp8Sm90._epilogue_plain = original if make is None else make()
            out[name] = api_fp8.compile_variant_fp8(n, k, e, options=options)
    finally:
        GroupedGemmFp8Sm90._epilogue_plain = original
    return out


def _same_bits(kernels: dict, n: int, k: int, e: int, torch) -> dict:
    """Each storing variant's output against the shipped kernel's, bit for bit, on uneven splits
    (tiles holding two experts' rows, a partial last tile, empty experts) with random scales; rows
    no expert owns stay as they were (NaN)."""
    from te_offload_ops.kernels import api_fp8

    sizes = ([300, 0, 1, 777, 128, 2000, 64, 5] * -(-e // 8))[:e]
    t = sum(sizes) + 7  # rows past the experts' own
    kb, nb = -(-k // 128), -(-n // 128)
    a = torch.randint(0, 0x70, (t, k), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    b = torch.randint(0, 0x70, (e, n, k), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    sa = torch.rand(kb, -(-t // 4) * 4, device="cuda")
    sb = torch.rand(e, nb, -(-kb // 4) * 4, device="cuda")
    s = torch.tensor(sizes, dtype=torch.int32, device="cuda")
    outs = {}
    for name, (kern, compiled, _) in kernels.items():
        if name == "no stores":
            continue
        outs[name] = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        api_fp8._launch_fp8(kern, compiled, a, b, outs[name], s, sa, sb, t)
    torch.cuda.synchronize()
    ref = outs.pop("shipped").view(torch.int16)
    return {name: bool(torch.equal(out.view(torch.int16), ref)) for name, out in outs.items()}


def measure(args) -> dict:
    import torch
    from bench_kernels import time_interleaved
    from gpu_clocks import GpuClocks

    from te_offload_ops.kernels import api_fp8, availability

    rows = []
    e = args.experts
    for n, k in args.shapes:
        kernels = _kernels(n, k, e, args.variants)
        same = _same_bits(kernels, n, k, e, torch)
        if same:
            print(f"N={n}, K={k}: bits equal to the shipped kernel's on uneven splits: {same}", flush=True)
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
                   "promotion": kernels["shipped"][0].promotion, "same_bits": same,
                   "compile_s": {name: round(v[2], 2) for name, v in kernels.items()}}
            row["over_shipped"] = {name: v / row["tflops"]["shipped"] for name, v in row["tflops"].items()}
            rows.append(row)
            print(f"E={e} x {tok}, N={n}, K={k}: TFLOP/s " + ", ".join(
                f"{name} {v:.0f} ({row['over_shipped'][name]:.3f}x)" for name, v in row["tflops"].items()), flush=True)
            del a, b, outs, fns
            torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "date": utc_now(), "experts": e, "reps": args.reps,
            "variants": args.variants,
            "inner": args.inner, "command": shlex.join(["python3", "benchmarks/experiments/ablate_fp8_epilogue.py",
                                                       *sys.argv[1:]]),
            "call_convention": availability.kernel_call_convention(), "rows": rows}


def markdown(result: dict) -> str:
    names = result.get("variants", ["shipped", "no stores"])
    others = [n for n in names if n != "shipped"]
    lines = [f"# Grouped FP8 GEMM: what its epilogue costs, {result['gpu']} ({result['date']})", "",
             f"E={result['experts']}, even splits; TFLOP/s from GPU time per call with the host ahead, medians of "
             f"{result['reps']} interleaved rounds. shipped: the kernel's own epilogue (staged through shared "
             "memory, each warpgroup its own rows and barriers); one barrier: the same staging, both warpgroups "
             "at one tile-wide barrier; direct: stores from the accumulator layout, no staging; no stores: the "
             "sums computed, nothing written (a bound, not a kernel). Same bits: the storing variants' outputs against the "
             f"shipped one's on uneven splits. Command: `{result['command']}`", "",
             "| tokens/expert | N | K | promotion | " + " | ".join(f"{n} TFLOP/s" for n in names) + " | "
             + " | ".join(f"{n} / shipped" for n in others) + " | same bits | SM MHz (lowest) | W |",
             "|---|---|---|---|" + "---|" * (len(names) + len(others)) + "---|---|---|"]
    for r in result["rows"]:
        clock = f"{r['sm_MHz']:.0f} ({r['sm_MHz_min']:.0f})" if "sm_MHz" in r else "-"
        watts = f"{r['power_W']:.0f}" if "power_W" in r else "-"
        same = r.get("same_bits") or {}
        same_text = "-" if not same else ("yes" if all(same.values()) else "NO: " + ", ".join(
            n for n, ok in same.items() if not ok))
        ratio = {n: r["tflops"][n] / r["tflops"]["shipped"] for n in names}
        lines.append(f"| {r['tokens_per_expert']} | {r['n']} | {r['k']} | {r['promotion']} | "
                     + " | ".join(f"{r['tflops'][n]:.0f}" for n in names) + " | "
                     + " | ".join(f"{ratio[n]:.3f}" for n in others) + f" | {same_text} | {clock} | {watts} |")
    return "\n".join(lines) + "\n"


def _shape(text: str) -> tuple[int, int]:
    n, k = text.lower().split("x")
    return int(n), int(k)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=_shape, nargs="+", default=list(SHAPES), help="NxK pairs")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="tokens per expert")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=list(EPILOGUES), choices=list(EPILOGUES),
                    help="epilogues to time (shipped always runs: the others are set against it)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    args.variants = ["shipped"] + [v for v in args.variants if v != "shipped"]
    if (problem := sm90_kernel_problem()):
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
