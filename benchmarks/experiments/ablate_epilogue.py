"""Where the fused epilogues' time goes: one GEMM shape, epilogue variants timed interleaved.

The two GEMMs with N=F, K=H carry the fused epilogues: fc1 forward (SReLU: writes z and
act) and fc2 dgrad (dSReLU: reads z, writes dz and act, sums the dprobs partials).  Each is
timed with its plain epilogue and its fused one, under the pingpong schedule (their default),
with the epilogue staged 32 or 64 columns at a time (the narrower staging leaves shared memory
for one more mainloop stage), and the dSReLU one also with its z loads left out (zeros: wrong
numbers, the time without that traffic).  cuBLAS bmm gives the roof.  Outputs of the two chunk
widths are compared bit for bit.  Timing as in bench_kernels.py (GPU time, host excluded).

    python3 benchmarks/experiments/ablate_epilogue.py [--out epilogue_staging.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from bench_common import cuda_problem, refuse  # noqa: E402


def _no_z_kernel():
    """The kernel with its z loads left out (the epilogue sees z = 0): an ablation only."""
    import cutlass.cute as cute

    from te_offload_ops.kernels.gemm_sm90 import GroupedGemmSm90

    class NoZLoads(GroupedGemmSm90):
        @cute.jit
        def _load_z_chunk(self, ch, z_reg, row0, rows_here, cols_here, n_blk, m_z, thr_cp, cp_id):
            z_reg.fill(0.0)

    return NoZLoads


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--tokens-per-expert", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=2688)
    ap.add_argument("--ffn", type=int, default=1856)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", default="epilogue_staging.json")
    args = ap.parse_args()
    if problem := cuda_problem():
        return refuse("ablate_epilogue.py", problem)
    import torch

    from bench_kernels import time_interleaved
    from te_offload_ops.kernels import api, launch

    e, m, h, f = args.experts, args.tokens_per_expert, args.hidden, args.ffn
    t = e * m
    dt = torch.bfloat16
    torch.manual_seed(0)
    x = torch.randn(t, h, device="cuda", dtype=dt)
    dy = torch.randn(t, h, device="cuda", dtype=dt)
    w1 = torch.randn(e, f, h, device="cuda", dtype=dt) * h ** -0.5
    w2 = torch.randn(e, h, f, device="cuda", dtype=dt) * h ** -0.5
    z = torch.randn(t, f, device="cuda", dtype=dt)
    probs = torch.rand(t, device="cuda", dtype=dt)
    splits = torch.full((e,), m, dtype=torch.int32, device="cuda")
    no_z = _no_z_kernel()

    # name: (GEMM, epilogue, chunk columns, kernel class)
    spec = {}
    for gemm, fused in (("fc1 fwd", "srelu"), ("fc2 dgrad", "dsrelu")):
        spec[f"{gemm} plain, 64 cols"] = (gemm, "plain", 64, None)
        spec[f"{gemm} plain, 32 cols"] = (gemm, "plain", 32, None)
        spec[f"{gemm} {fused}, 64 cols"] = (gemm, fused, 64, None)
        spec[f"{gemm} {fused}, 32 cols"] = (gemm, fused, 32, None)
    spec["fc2 dgrad dsrelu, 64 cols, no z loads"] = ("fc2 dgrad", "dsrelu", 64, no_z)
    spec["fc2 dgrad dsrelu, 32 cols, no z loads"] = ("fc2 dgrad", "dsrelu", 32, no_z)

    fns, info, outputs = {}, {}, {}
    for name, (gemm, epilogue, cols, cls) in spec.items():
        fc1 = gemm == "fc1 fwd"
        kern, compiled, secs = api.compile_variant(
            dt, f, h, e, b_n_major=not fc1, epilogue=epilogue, schedule="pingpong", epi_cols=cols,
            kernel_class=cls,
        )
        a, b = (x, w1) if fc1 else (dy, w2)
        o0, o1 = torch.empty(t, f, device="cuda", dtype=dt), torch.empty(t, f, device="cuda", dtype=dt)
        part = torch.zeros(kern.n_tiles, t, device="cuda", dtype=torch.float32)
        # the entry points' argument lists (api.py), with outputs allocated once
        if epilogue == "plain":
            targs = [(a, "m"), (b, "m"), (o0, "m"), (splits, "i32"), (a, "vec"), (o0, "m"), (o0, "m"),
                     (splits, "f32")]
        elif epilogue == "srelu":
            targs = [(a, "m"), (b, "m"), (o0, "m"), (splits, "i32"), (probs, "vec"), (o0, "m"), (o1, "m"),
                     (splits, "f32")]
        else:
            targs = [(a, "m"), (b, "m"), (o0, "m"), (splits, "i32"), (probs, "vec"), (z, "m"), (o1, "m"),
                     (part, "f32")]
        fns[name] = lambda kern=kern, compiled=compiled, targs=targs: launch.launch_gemm(kern, compiled, targs, t)
        fns[name]()
        torch.cuda.synchronize()
        outputs[name] = (o0, o1, part)
        info[name] = {"gemm": gemm, "epilogue": epilogue, "epi_cols": cols, "stages": kern.stages,
                      "no_z_loads": cls is not None, "compile_s": secs}
        print(f"compiled {name}: {kern.stages} stages, {secs:.1f} s", flush=True)

    same_bits = {}
    for gemm, fused in (("fc1 fwd", "srelu"), ("fc2 dgrad", "dsrelu")):
        wide, narrow = outputs[f"{gemm} {fused}, 64 cols"], outputs[f"{gemm} {fused}, 32 cols"]
        same_bits[f"{gemm} {fused}"] = all(torch.equal(u, v) for u, v in zip(wide, narrow))
    print("32 vs 64 columns, same bits:", same_bits, flush=True)

    xb, w1t, dyb = x.view(e, m, h), w1.transpose(1, 2), dy.view(e, m, h)
    fns["fc1 fwd cuBLAS bmm"] = lambda: torch.bmm(xb, w1t)
    fns["fc2 dgrad cuBLAS bmm"] = lambda: torch.bmm(dyb, w2)
    info["fc1 fwd cuBLAS bmm"] = {"gemm": "fc1 fwd"}
    info["fc2 dgrad cuBLAS bmm"] = {"gemm": "fc2 dgrad"}
    timed = time_interleaved(fns, args.reps, args.inner)

    flop = 2.0 * t * h * f
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}  E={e} tokens/expert={m} H={h} F={f} bf16, pingpong, GPU time per call")
    print(f"{'variant':<42}{'stages':>7}{'ms':>8}{'TFLOP/s':>9}")
    rows = []
    for name, (ms, host_us, behind) in timed.items():
        row = {"variant": name, **info[name], "ms": ms, "tflops": flop / ms / 1e9, "host_us": host_us,
               "host_behind_samples": behind}
        rows.append(row)
        print(f"{name:<42}{str(row.get('stages', '-')):>7}{ms:8.3f}{row['tflops']:9.1f}", flush=True)
    with open(args.out, "w") as fh:
        json.dump({"gpu": gpu, "experts": e, "tokens_per_expert": m, "hidden": h, "ffn": f,
                   "dtype": "bfloat16", "schedule": "pingpong", "reps": args.reps, "inner": args.inner,
                   "same_bits_32_vs_64_cols": same_bits, "rows": rows}, fh, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    sys.exit(main())
