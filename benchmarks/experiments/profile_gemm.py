"""One grouped-GEMM launch of ours, bracketed for Nsight Compute.

    ncu --profile-from-start off --launch-count 1 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats \
        python3 benchmarks/experiments/profile_gemm.py fc1 pingpong

The GEMM (fc1 fwd plain, fc2 fwd plain, fc1 fwd + SReLU, fc2 dgrad + dSReLU, fc1's weight
gradient in bf16 (``wgrad``) or added into Megatron's fp32 main_grad (``wgrad_main_grad``, by
``--add`` tma / red / rmw: the L2 traffic the add costs against the plain wgrad), or fc1's
forward in FP8 under Float8BlockScaling (``fp8_fc1``, ``fp8_fc2``: the grouped FP8 GEMM alone, its
operands quantized beforehand) runs three times to compile and warm up, then once between
cudaProfilerStart/Stop, so ``--profile-from-start off --launch-count 1`` catches exactly our
kernel.  Shape: E=8 x ``--tokens`` (2048) tokens, H=``--hidden`` (2688), F=``--ffn`` (1856), bf16,
int32 split sizes (no conversion kernel). fc2's forward GEMM at an H=7168 expert::

    python3 benchmarks/experiments/profile_gemm.py fp8_fc2 --hidden 7168 --ffn 2048 --tokens 8192
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from bench_common import cuda_problem, refuse  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gemm", nargs="?", default="fc1",
                    choices=["fc1", "fc2", "srelu", "dsrelu", "wgrad", "wgrad_main_grad", "fp8_fc1", "fp8_fc2"])
    ap.add_argument("schedule", nargs="?", default="pingpong", choices=["cooperative", "pingpong"])
    ap.add_argument("--add", choices=["tma", "red", "rmw"], default="tma", help="main_grad add (wgrad_main_grad)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per expert")
    ap.add_argument("--hidden", type=int, default=2688, help="H: fc1's K, fc2's N")
    ap.add_argument("--ffn", type=int, default=1856, help="F: fc1's N, fc2's K")
    args = ap.parse_args()
    for name in ("tokens", "hidden", "ffn"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name} must be positive, got {getattr(args, name)}")
    if problem := cuda_problem():
        return refuse("profile_gemm.py", problem)
    import torch

    from te_offload_ops import kernels as K

    torch.manual_seed(0)
    e, m, h, f = 8, args.tokens, args.hidden, args.ffn
    t, dt = e * m, torch.bfloat16
    x = torch.randn(t, h, device="cuda").to(dt)
    w1 = (torch.randn(e, f, h, device="cuda") / h**0.5).to(dt)
    w2 = (torch.randn(e, h, f, device="cuda") / f**0.5).to(dt)
    z = torch.randn(t, f, device="cuda").to(dt)
    dy = torch.randn(t, h, device="cuda").to(dt)
    p = torch.rand(t, device="cuda").to(dt)
    s = torch.full((e,), m, device="cuda", dtype=torch.int32)
    dh = torch.randn(t, f, device="cuda").to(dt)  # fc1's output grad: dW1[e] = dh_e^T x_e, (F, H)
    main_grad = torch.zeros(e, f, h, device="cuda", dtype=torch.float32) if args.gemm == "wgrad_main_grad" else None
    sc = args.schedule
    if args.gemm.startswith("fp8_"):  # operands quantized here, outside the bracket
        from te_offload_ops.kernels import fp8_rows

        a, w = (x, w1) if args.gemm == "fp8_fc1" else (z, w2)
        aq, a_s = fp8_rows.quantize(a, 0.0, True)
        wq, w_s, _, _ = fp8_rows.quantize_weights(w, False, 0.0, True)
    fn = {
        "fc1": lambda: K.grouped_gemm(x, w1, s, schedule=sc),
        "fc2": lambda: K.grouped_gemm(z, w2, s, schedule=sc),
        "srelu": lambda: K.grouped_gemm_srelu_fwd(x, w1, s, p, schedule=sc),
        "dsrelu": lambda: K.grouped_gemm_dsrelu_bwd(dy, w2, s, z, p, schedule=sc),
        "wgrad": lambda: K.grouped_wgrad(dh, x, s, backend="cute", schedule=sc),
        "wgrad_main_grad": lambda: K.grouped_wgrad_main_grad(dh, x, s, main_grad, backend="cute", schedule=sc,
                                                             add=args.add),
    }.get(args.gemm, lambda: K.grouped_gemm_fp8_blockwise(aq, a_s, wq, w_s, s))  # fp8_fc1, fp8_fc2
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
