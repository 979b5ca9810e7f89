#!/usr/bin/env python3
"""Where the host's time goes in one fused MLP step with Megatron's settings (cProfile).

At E=64 experts the sweep of bench_megatron_settings.py ran host-bound: plain 5.1 ms of wall time
per fwd+bwd against 1.4 ms of GPU time, main_grad 8.0 ms. This profiles N steps of one variant
(`plain`, `main_grad`, `delay`, `main_grad+delay`, built as that benchmark builds them) and prints
the functions with the most own time and the most cumulative time per step.

    python3 benchmarks/profile_host.py --variant main_grad -E 64 --tokens 512 -H 2048 -F 768
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="main_grad", choices=["plain", "main_grad", "delay", "main_grad+delay"])
    p.add_argument("--experts", "-E", type=int, default=64)
    p.add_argument("--tokens", type=int, default=512, help="tokens per expert")
    p.add_argument("--hidden", "-H", type=int, default=2048)
    p.add_argument("--ffn", "-F", type=int, default=768)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    from offload_policies import cuda_problem

    if problem := cuda_problem():
        print(f"profile_host.py: cannot run: {problem}", file=sys.stderr)
        return 2
    import os
    import time

    import torch
    from bench_megatron_settings import _build

    os.environ.setdefault("TEO_CHECK_SPLIT_SIZES", "off")  # as the benchmark times the settings
    E, T = args.experts, args.experts * args.tokens
    x = torch.randn(T, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(T, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, args.hidden, device="cuda", dtype=torch.bfloat16)
    splits = torch.full((E,), args.tokens, device="cuda", dtype=torch.int64)
    mlp = _build(E, args.hidden, args.ffn, args.variant)

    def step():
        for t in (x, probs, *mlp.parameters()):
            t.grad = None
        mlp(x, splits, probs, splits).backward(dy)
        for op in (mlp[0], mlp[2]):
            op.backward_dw()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # host time alone: the GPU is held by a sleep kernel longer than the steps take to queue, so
    # nothing on the host waits for it (a host sync in the step would show as the sleep's length)
    torch.cuda._sleep(2_000_000_000)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    bare = (time.perf_counter() - t0) / args.steps
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    host = (time.perf_counter() - t0) / args.steps
    torch.cuda.synchronize()
    print(f"{args.variant}, E={E} x {args.tokens} tokens, H={args.hidden}, F={args.ffn}: "
          f"{bare * 1e3:.2f} ms of host time per step ({args.steps} steps queued behind a sleep), "
          f"{host * 1e3:.2f} ms under cProfile")
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(f"--- by {key}\n" + out.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
