"""2 x 2 clusters against the CTA pair, per grouped GEMM of the fused MLP (``TEO_GEMM_CLUSTER_M``).

The GEMMs are bound by L2 sectors (Nsight Compute): a 2 x 2
cluster multicasts B over m-block pairs as well as A over n-block pairs, a quarter less operand
traffic per tile, at the cost of phantom tiles where a block count is odd. Each GEMM of one fused
MLP step (E experts x tokens, H, F; uneven routing with ``--skew``) runs under its default
schedule with the pair (``TEO_GEMM_CLUSTER_M=1``) and with 2 x 2 clusters, timed interleaved as
``bench_kernels.py`` times (GPU time with the host ahead, medians over ``--reps`` rounds), and
the two outputs are compared bit for bit (each tile runs the same k-loop: they must be equal).
``--fp8``: the FP8 GEMMs of one step under ``Float8BlockScaling`` instead (fc1 forward with the
quantizing SReLU epilogue, fc2 forward, fc2 dgrad with the quantizing dSReLU epilogue, fc1 dgrad;
operands quantized by the package's row and weight kernels). Writes
``cluster2x2_<GPU>[_fp8][_<shape>][_skewed].{json,md,png}`` to ``--out``.

    python3 benchmarks/experiments/bench_cluster2x2.py [--skew] [--fp8] --out "$OUT/results"
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from bench_common import (  # noqa: E402
    add_mlp_shape_args, bar_chart, command_line, file_stem, mlp_shape_suffix, refuse, sm90_kernel_problem, utc_now,
    write_reports,
)

ENV = "TEO_GEMM_CLUSTER_M"


def _gemms(e, tokens, h, f, skew, torch):
    """{name: (flops, fn, buffer)} for the six GEMMs of one fused MLP step and fc1's weight
    gradient added into an fp32 main_grad: fn returns the output(s), or adds into ``buffer``."""
    from bench_kernels import uneven_splits

    from te_offload_ops import kernels as K

    s = uneven_splits(e, tokens) if skew else torch.full((e,), tokens, dtype=torch.int64)
    s = s.to(device="cuda", dtype=torch.int32)  # int32: no conversion kernel inside the timed calls
    t = e * tokens
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    x, dy = rnd(t, h), rnd(t, h)
    w1, w2 = rnd(e, f, h, scale=h**-0.5), rnd(e, h, f, scale=f**-0.5)
    p = torch.rand(t, device="cuda", generator=g).to(torch.bfloat16)
    z, dz = rnd(t, f), rnd(t, f)
    main_grad = torch.zeros(e, f, h, device="cuda")
    mm = 2.0 * t * h * f
    return {
        "fc1 fwd + SReLU": (mm, lambda: K.grouped_gemm_srelu_fwd(x, w1, s, p), None),
        "fc2 fwd": (mm, lambda: K.grouped_gemm(z, w2, s), None),
        "fc2 dgrad + dSReLU": (mm, lambda: K.grouped_gemm_dsrelu_bwd(dy, w2, s, z, p), None),
        "fc1 dgrad": (mm, lambda: K.grouped_gemm(dz, w1, s, trans_b=True), None),
        "fc1 wgrad": (mm, lambda: K.grouped_wgrad(dz, x, s, backend="cute"), None),
        "fc2 wgrad": (mm, lambda: K.grouped_wgrad(dy, z, s, backend="cute"), None),
        "fc1 wgrad into main_grad": (mm, lambda: K.grouped_wgrad_main_grad(dz, x, s, main_grad, backend="cute"),
                                     main_grad),
    }


def _gemms_fp8(e, tokens, h, f, skew, torch):
    """{name: (flops, fn, None)} for the four FP8 GEMMs of one fused MLP step (``Float8BlockScaling``,
    power-of-two scales): the token-major GEMMs the fused op runs in FP8."""
    from bench_kernels import uneven_splits

    from te_offload_ops import kernels as K
    from te_offload_ops.kernels import fp8_rows

    s = uneven_splits(e, tokens) if skew else torch.full((e,), tokens, dtype=torch.int64)
    s = s.to(device="cuda", dtype=torch.int32)
    t = int(s.sum())
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    xd, xs = fp8_rows.quantize(rnd(t, h), 0.0, True)
    dyd, dys = fp8_rows.quantize(rnd(t, h), 0.0, True)
    w1d, w1s, w1td, w1ts = fp8_rows.quantize_weights(rnd(e, f, h, scale=h**-0.5), False, 0.0, True)
    w2d, w2s, w2td, w2ts = fp8_rows.quantize_weights(rnd(e, h, f, scale=f**-0.5), False, 0.0, True)
    p = torch.rand(t, device="cuda", generator=g)
    act_d, act_s, zd, zs = K.grouped_gemm_fp8_srelu_quantize(xd, xs, w1d, w1s, s, p)
    _, dzd, dzs, _, _ = K.grouped_gemm_fp8_dsrelu_quantize(dyd, dys, w2td, w2ts, s, zd, zs, p)
    mm = 2.0 * t * h * f
    return {
        "fc1 fwd + SReLU (FP8 out)": (mm, lambda: K.grouped_gemm_fp8_srelu_quantize(xd, xs, w1d, w1s, s, p), None),
        "fc2 fwd": (mm, lambda: K.grouped_gemm_fp8_blockwise(act_d, act_s, w2d, w2s, s), None),
        "fc2 dgrad + dSReLU (FP8 out)": (
            mm, lambda: K.grouped_gemm_fp8_dsrelu_quantize(dyd, dys, w2td, w2ts, s, zd, zs, p), None),
        "fc1 dgrad": (mm, lambda: K.grouped_gemm_fp8_blockwise(dzd, dzs, w1td, w1ts, s), None),
    }


def _with(cluster_m: str, fn):
    def call():
        os.environ[ENV] = cluster_m
        return fn()
    return call


def _keys_fetched(fn, registry):
    """(fn's result, the kernel cache keys it fetched): which variants a call ran."""
    fetched = []
    original = registry.cached_kernel

    def spy(key, load):
        fetched.append(key)
        return original(key, load)

    registry.cached_kernel = spy
    try:
        return fn(), fetched
    finally:
        registry.cached_kernel = original


def _same_bits(a, b, torch) -> bool:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return all(torch.equal(u, v) for u, v in zip(a, b))


def measure(args) -> dict:
    import torch

    from bench_kernels import time_interleaved

    from te_offload_ops.kernels import registry

    make = _gemms_fp8 if args.fp8 else _gemms
    gemms = make(args.experts, args.tokens, args.hidden, args.ffn, args.skew, torch)
    rows = []
    for i, (name, (flops, fn, buffer)) in enumerate(gemms.items(), 1):
        outs = {}
        fetched = {}
        for cm in ("1", "2"):
            os.environ[ENV] = cm
            if buffer is not None:  # the add accumulates: compare one call from equal starts
                buffer.zero_()
                _, fetched[cm] = _keys_fetched(fn, registry)
                outs[cm] = buffer.clone()
            else:
                outs[cm], fetched[cm] = _keys_fetched(fn, registry)
        same = _same_bits(outs["1"], outs["2"], torch)
        # did a 2 x 2 kernel run at all? (one n-block, or TEO_GEMM_CLUSTER_N=1, leaves the pair)
        ran_2x2 = any(("cluster_m", 2) in key for key in fetched["2"])
        times = time_interleaved({"pair": _with("1", fn), "2x2": _with("2", fn)}, args.reps, args.inner)
        pair_ms, two_ms = times["pair"][0], times["2x2"][0]
        rows.append({"gemm": name, "pair_ms": pair_ms, "two_by_two_ms": two_ms, "speedup": pair_ms / two_ms,
                     "pair_TFLOPs": flops / pair_ms / 1e9, "two_by_two_TFLOPs": flops / two_ms / 1e9,
                     "same_bits": same, "ran_2x2": ran_2x2,
                     "host_behind_samples": times["pair"][2] + times["2x2"][2]})
        print(f"[{i}/{len(gemms)}] {name}: pair {pair_ms:.3f} ms, 2x2 {two_ms:.3f} ms "
              f"(x{pair_ms / two_ms:.3f}), same bits: {same}{'' if ran_2x2 else ' (no 2 x 2 kernel ran)'}",
              flush=True)
    os.environ.pop(ENV, None)
    return {"gpu": torch.cuda.get_device_name(), "date": utc_now(), "shape": {"experts": args.experts, "tokens_per_expert": args.tokens,
            "hidden": args.hidden, "ffn": args.ffn, "skew": args.skew}, "reps": args.reps, "inner": args.inner,
            "fp8": args.fp8, "rows": rows}


def markdown(result: dict) -> str:
    sh = result["shape"]
    lines = [f"# 2 x 2 clusters against the CTA pair, {result['gpu']} ({result['date']})", "",
             f"E={sh['experts']} x {sh['tokens_per_expert']} tokens{' (uneven)' if sh['skew'] else ''}, "
             f"H={sh['hidden']}, F={sh['ffn']}, "
             + ("FP8 (Float8BlockScaling, cooperative 128 x 128 tiles)" if result.get("fp8") else
                "bf16, each GEMM under its default schedule")
             + f"; GPU time per call with the host ahead, medians of {result['reps']} interleaved rounds of "
             f"{result['inner']} calls." + (f" Command: `{result['command']}`" if "command" in result else ""),
             "", "| GEMM | pair ms | 2x2 ms | pair / 2x2 | pair TFLOP/s | 2x2 TFLOP/s | same bits |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['gemm']} | {r['pair_ms']:.3f} | {r['two_by_two_ms']:.3f} | {r['speedup']:.3f} | "
                     f"{r['pair_TFLOPs']:.0f} | {r['two_by_two_TFLOPs']:.0f} | {'yes' if r['same_bits'] else '**no**'} |"
                     + ("" if r.get("ran_2x2", True) else " (no 2 x 2 kernel ran: the pair both times)"))
    return "\n".join(lines) + "\n"


def chart(result: dict, path) -> bool:
    rows = result["rows"]
    return bar_chart(path, f"Grouped GEMMs, pair vs 2 x 2 clusters ({result['gpu']})", [r["gemm"] for r in rows],
                     {"CTA pair (A shared)": [r["pair_TFLOPs"] for r in rows],
                      "2 x 2 (A and B shared)": [r["two_by_two_TFLOPs"] for r in rows]},
                     size=(9, 4), rotation=20, ha="right", fontsize=8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mlp_shape_args(ap, "tokens per expert (on average with --skew)")
    ap.add_argument("--skew", action="store_true", help="uneven tokens per expert")
    ap.add_argument("--fp8", action="store_true", help="the FP8 (Float8BlockScaling) GEMMs instead of bf16")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", default=str(BENCH / "results"), help="folder for JSON, markdown, PNG")
    args = ap.parse_args(argv)
    for name in ("experts", "tokens", "hidden", "ffn", "reps", "inner"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if (problem := sm90_kernel_problem()):
        return refuse("bench_cluster2x2.py", problem)
    result = measure(args)
    result["command"] = command_line("benchmarks/experiments/bench_cluster2x2.py", sys.argv[1:] if argv is None else argv)
    shape = mlp_shape_suffix(args)
    write_reports(Path(args.out), file_stem("cluster2x2", result["gpu"], "fp8" if args.fp8 else "", shape,
                                            "skewed" if args.skew else ""), result, markdown, chart)
    return 0 if all(r["same_bits"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
