"""Where a fault of the grouped FP8 GEMM lies: each case in its own process (a device fault is
sticky: it ends every later launch of the process), one piece of the kernel's design at a time.

Cases, in order, each after its own ``torch.cuda.synchronize()``:

* ``te_quantize``: TE's ``Float8BlockQuantizer`` (1x128 tokens, 128x128 weights) and dequantize;
* ``bf16_control``: this package's bf16 grouped GEMM on the dequantized operands, same shape;
* ``fp8_c1_bn128``: the FP8 kernel without cluster pairs; ``fp8_c1_bn128_no_scales``: the same
  without the TMA of A's scales (scales read as 1; compared against the scales' product set to 1);
* ``fp8_c2_bn128``: with cluster pairs (A multicast); ``fp8_c1_bn64`` / ``fp8_c1_bn192``: the
  other tiles (BN=192 straddles two B scale blocks).

Each case runs a small problem (E=2, 256 x 256 x 256) and then the MLP's fc1 shape with zero-token
and partial experts (E=8, N=1792, K=2688). ``CUDA_LAUNCH_BLOCKING=1`` and ``CUTE_DSL_LINEINFO=1``
are set so a fault names its launch and, under Compute Sanitizer (``--sanitizer``: the first
faulting FP8 case again under ``compute-sanitizer --show-backtrace device``), its source line.

    python benchmarks/experiments/diagnose_fp8_gemm.py --out results/fp8_diag [--sanitizer auto]

Writes ``cases.json`` (per case: exit status, the stage it reached, the error, relative errors
against the fp64 reference of the dequantized operands) and ``sanitizer.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # the package, for the cases' own processes too
CASES = ["te_quantize", "bf16_control", "fp8_c1_bn128", "fp8_c1_bn128_no_scales", "fp8_c2_bn128",
         "fp8_c1_bn64", "fp8_c1_bn192"]
# (splits, N, K): small and aligned, then fc1 at H=2688, F=1792 with the GPU test's splits
PROBLEMS = [([128, 128], 256, 256), ([0, 130, 1, 0, 383, 128, 7, 2000], 1792, 2688)]


def _operands(splits, n, k, no_scales):
    import torch

    import transformer_engine.pytorch  # noqa: F401  (loads the extension first)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    def quantizer(dim):
        return Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, block_scaling_dim=dim)

    g = torch.Generator(device="cuda").manual_seed(0)
    t, e = sum(splits), len(splits)
    x = torch.randn(t, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(e, n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    xq = quantizer(1)(x)
    wq = [quantizer(2)(w[i]) for i in range(e)]
    a, sa = xq._rowwise_data, xq._rowwise_scale_inv
    b = torch.stack([q._rowwise_data for q in wq])
    sb = torch.stack([q._rowwise_scale_inv for q in wq])
    a_real = xq.dequantize(dtype=torch.float32)
    if no_scales:  # the kernel reads every A scale as 1: the reference does too
        a_real = a.view(torch.float8_e4m3fn).float()
    b_real = torch.stack([q.dequantize(dtype=torch.float32) for q in wq])
    ref = torch.empty(t, n, dtype=torch.float64, device="cuda")
    row = 0
    for i, rows in enumerate(splits):  # fp64 product of the operands as TE dequantizes them
        ref[row:row + rows] = a_real[row:row + rows].double() @ b_real[i].double().T
        row += rows
    torch.cuda.synchronize()
    return a, sa, b, sb, a_real, b_real, ref


def run_case(name: str) -> dict:
    """One case in this process; returns what it reached (raises on a fault)."""
    import torch

    from te_offload_ops import kernels
    from te_offload_ops.kernels import api_fp8
    from te_offload_ops.kernels.gemm_fp8_sm90 import GroupedGemmFp8Sm90

    got = {"case": name, "problems": []}
    for splits, n, k in PROBLEMS:
        row = {"n": n, "k": k, "experts": len(splits), "tokens": sum(splits), "stage": "quantize"}
        got["problems"].append(row)
        no_scales = name.endswith("no_scales")
        a, sa, b, sb, a_real, b_real, ref = _operands(splits, n, k, no_scales)
        if name == "te_quantize":
            row["stage"] = "done"
            continue
        s = torch.tensor(splits, dtype=torch.int32, device="cuda")
        row["stage"] = "launch"
        if name == "bf16_control":
            out = kernels.grouped_gemm(a_real.bfloat16(), b_real.bfloat16(), s)
        else:
            bn = int(name.split("_bn")[1].split("_")[0])
            cluster = int(name.split("_c")[1][0])
            GroupedGemmFp8Sm90.LOAD_A_SCALES = not no_scales
            kern, compiled, _ = kernels.compile_variant_fp8(n, k, len(splits), tile=(128, bn), cluster_n=cluster,
                                                            sb_cols=sb.shape[2], call="python")
            out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
            api_fp8._launch_fp8(kern, compiled, api_fp8._as_e4m3(a), api_fp8._as_e4m3(b), out, s, sa,
                                sb.contiguous(), a.shape[0])
        torch.cuda.synchronize()
        rows = sum(splits)
        err = ((out[:rows].double() - ref[:rows]).norm() / ref[:rows].norm().clamp_min(1e-30)).item()
        row.update(stage="done", rel_err=err, nan_rows=int(torch.isnan(out[:rows]).any(dim=1).sum()))
    return got


def _child(name: str, out: Path, sanitizer: str | None = None, timeout: int = 240) -> dict:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", CUTE_DSL_LINEINFO="1", TEO_KERNEL_CACHE="0",
               PYTHONUNBUFFERED="1")
    cmd = [sys.executable, str(HERE), "--case", name, "--out", str(out)]
    if sanitizer:
        cmd = [sanitizer, "--tool", "memcheck", "--show-backtrace", "device", "--print-limit", "8"] + cmd
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
        text = text.decode() if isinstance(text, bytes) else text
    found = out / f"{name}.json"
    result = json.loads(found.read_text()) if found.exists() and not sanitizer else {"case": name}
    result.update(rc=rc, tail=text[-3000:])
    return result


def _sanitizer(choice: str) -> str | None:
    if choice != "auto":
        return choice or None
    for cand in (shutil.which("compute-sanitizer"), f"{os.environ.get('CUDA_HOME', '/usr/local/cuda')}/bin/compute-sanitizer",
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if cand and Path(cand).exists():
            return cand
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("fp8_diag"))
    ap.add_argument("--case", choices=CASES, help="run one case in this process (what the driver starts)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset, in order")
    ap.add_argument("--sanitizer", default="auto", help="compute-sanitizer path, 'auto' (search) or '' (none)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("diagnose_fp8_gemm.py: cannot run: needs a Hopper (sm_90) GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    if args.case:
        got = run_case(args.case)
        (args.out / f"{args.case}.json").write_text(json.dumps(got, indent=1))
        return 0
    results = []
    for name in args.cases.split(","):
        res = _child(name, args.out)
        results.append(res)
        ok = res["rc"] == 0
        where = ", ".join(f"{p['n']}x{p['k']} {p['stage']} err={p.get('rel_err', '-')}" for p in res.get("problems", []))
        print(f"{name:26s} {'ok' if ok else 'FAULT rc=' + str(res['rc'])}  {where}", flush=True)
        if not ok:
            print("    " + res["tail"].strip().splitlines()[-1][:300] if res["tail"].strip() else "", flush=True)
    (args.out / "cases.json").write_text(json.dumps(results, indent=1))
    first_bad = next((r["case"] for r in results if r["rc"] != 0 and r["case"].startswith("fp8")), None)
    tool = _sanitizer(args.sanitizer)
    if first_bad and tool:
        print(f"{first_bad} again under {tool}", flush=True)
        res = _child(first_bad, args.out, sanitizer=tool, timeout=540)
        (args.out / "sanitizer.log").write_text(res["tail"])
        print(res["tail"][-2000:])
    elif first_bad:
        print("no compute-sanitizer found: pass --sanitizer PATH for the faulting line")
    return 0


if __name__ == "__main__":
    sys.exit(main())
