"""How many token rows per program and warps per program the FP8 row kernels
(`te_offload_ops/kernels/fp8_rows.py`) run fastest with, at the fused MLP's shape.

    python3 benchmarks/experiments/tune_fp8_rows.py [--experts 8 --tokens 2048 --hidden 2688 --ffn 1856]

Times each kernel (CUDA events, median of ``--iters``) at every ROWS x num_warps choice and prints
microseconds and the DRAM bandwidth its bytes imply; writes the table as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_common import add_mlp_shape_args, cuda_problem, refuse  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mlp_shape_args(ap)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("tune_fp8_rows.json"))
    args = ap.parse_args()
    if problem := cuda_problem():
        return refuse("tune_fp8_rows.py", problem)
    import torch

    from timing import event_ms

    from te_offload_ops.kernels import fp8_rows as fr

    t, h, f, e = args.experts * args.tokens, args.hidden, args.ffn, args.experts
    dev, bf16, u8 = "cuda", torch.bfloat16, torch.uint8
    x = torch.randn(t, h, device=dev, dtype=bf16)
    z = torch.randn(t, f, device=dev, dtype=bf16)
    p = torch.rand(t, device=dev, dtype=bf16)
    w = torch.randn(e, f, h, device=dev, dtype=bf16)
    inf = torch.finfo(bf16).max
    xq, xs = fr.quantize(x, 0.0, False)
    zq, zs = fr.quantize(z, 0.0, False)
    out_x = torch.empty(t, h, device=dev, dtype=u8)
    out_z = [torch.empty(t, f, device=dev, dtype=u8) for _ in range(3)]
    sx, sz = fr._scales(t, h, dev), [fr._scales(t, f, dev) for _ in range(3)]
    act16, dact = torch.empty(t, f, device=dev, dtype=bf16), z.clone()
    dp = torch.empty(t, device=dev, dtype=torch.float32)
    deq = torch.empty(t, h, device=dev, dtype=bf16)
    cdiv = lambda a, b: -(-a // b)  # noqa: E731

    def launches(rows: int, warps: int) -> dict:
        kw = dict(POW2=False, INF_VALUE=inf, ROWS=rows, num_warps=warps)
        return {
            "quantize x": (lambda: fr.quantize_kernel[(cdiv(t, rows), cdiv(h, 128))](
                x, out_x, sx, t, h, sx.stride(0), 0.0, **kw), t * h * 3),
            "srelu_quantize": (lambda: fr.srelu_quantize_kernel[(cdiv(t, rows), cdiv(f, 128))](
                z, p, out_z[0], sz[0], out_z[1], sz[1], t, f, sz[0].stride(0), 0.0, **kw), t * f * 4),
            "dsrelu_quantize": (lambda: fr.dsrelu_quantize_kernel[(cdiv(t, rows),)](
                dact, zq, zs, p, act16, out_z[2], sz[2], dp, t, f, zs.stride(0), 0.0, K_BLOCKS=cdiv(f, 128), **kw),
                t * f * 8),
            "dequantize x": (lambda: fr.dequantize_kernel[(cdiv(t, rows), cdiv(h, 128))](
                xq, xs, deq, t, h, xs.stride(0), ROWS=rows, num_warps=warps), t * h * 3),
        }

    results = []
    for rows in (8, 16, 32, 64):
        for warps in (2, 4, 8):
            for name, (fn, nbytes) in launches(rows, warps).items():
                us = event_ms(fn, args.iters, inner=5) * 1e3
                results.append({"kernel": name, "rows": rows, "warps": warps, "us": us, "TBps": nbytes / us / 1e6})
    for warps in (4, 8, 16):
        fr_warps = fr.WEIGHT_WARPS
        fr.WEIGHT_WARPS = warps
        us = event_ms(lambda: fr.quantize_weights(w, False, 0.0, False), args.iters, inner=5) * 1e3
        fr.WEIGHT_WARPS = fr_warps
        results.append({"kernel": "quantize_weights", "rows": 128, "warps": warps, "us": us,
                        "TBps": w.numel() * 4 / us / 1e6})
    print(f"{torch.cuda.get_device_name()}: T={t} H={h} F={f} E={e}")
    for name in dict.fromkeys(r["kernel"] for r in results):
        mine = sorted((r for r in results if r["kernel"] == name), key=lambda r: r["us"])
        best = mine[0]
        print(f"{name:18s} best rows={best['rows']:3d} warps={best['warps']:2d} {best['us']:7.1f} us "
              f"({best['TBps']:.2f} TB/s); " + ", ".join(f"{r['rows']}/{r['warps']}: {r['us']:.0f}" for r in mine[1:6]))
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "shape": vars(args) | {"out": None},
                                    "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
