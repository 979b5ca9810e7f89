"""One forward and backward of a fused SReLU grouped MLP in a process of its own, for
test_kernel_cache_gpu.py: saves its outputs and gradients (``--out``, torch.save) and prints which
kernels it compiled and which it loaded from the disk cache ($TEO_KERNEL_CACHE_DIR), how it
loaded them, and whether the process imported the CuTe DSL.

    python tests/kernel_cache_worker.py --layout te|megatron [--main-grad] --out FILE
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from mlp_steps import Config, forward_plan, linears, make_inputs, make_stack, relay_expert_weights, run_step

SHAPE = dict(experts=4, hidden=256, ffn=384, splits=(0, 700, 1329, 19))  # one expert without tokens


def ddp_main_grads(op, seed: int) -> None:
    """fp32 main_grad buffers as Megatron's DDP lays them out: one buffer, experts last first (as
    the weights after relay_expert_weights), each filled with known values."""
    params = list(op.parameters())
    n, k = params[0].shape
    buf = torch.empty(len(params) * n * k, dtype=torch.float32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    for slot, p in enumerate(reversed(params)):
        p.main_grad = buf[slot * n * k:(slot + 1) * n * k].view(n, k)
        p.main_grad.copy_(0.01 * torch.randn(n, k, device="cuda", generator=g))
        p.grad_added_to_main_grad = False
        p.teo_main_grad_init = p.main_grad.clone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", choices=["te", "megatron"], required=True)
    p.add_argument("--main-grad", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = Config(layers=1, megatron=("main_grad",) if args.main_grad else (), **SHAPE)
    stack = make_stack(cfg)
    for i, op in enumerate(linears(stack)):
        if args.layout == "megatron":
            relay_expert_weights(op, list(range(op.num_groups))[::-1])
        if args.main_grad:
            if args.layout != "megatron":
                raise SystemExit("--main-grad goes with --layout megatron here (buffers the TMA add can address)")
            ddp_main_grads(op, seed=11 + i)
    result = run_step(stack, make_inputs(cfg), "none")
    from te_offload_ops.kernels import registry

    torch.save({"out": result["out"].cpu(),
                "grads": {name: g.cpu() for name, g in result["grads"].items() if g is not None}}, args.out)
    print("RESULT " + json.dumps({"plan": forward_plan(stack[0]), "tokens": cfg.tokens,
                                  "compiled": sorted(map(repr, registry.compile_times())),
                                  "loaded": sorted(map(repr, registry.load_times())),
                                  "loaded_by": sorted(set(registry.loaded_by().values())),
                                  "dsl_imported": "cutlass" in sys.modules}))


if __name__ == "__main__":
    main()
