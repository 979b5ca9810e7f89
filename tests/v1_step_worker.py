"""Runs one step without offload and one under an engine, in a fresh process, and saves both.

TE reads NVTE_CPU_OFFLOAD_V1 when it is imported, so the V1 engine needs its own process:
    NVTE_CPU_OFFLOAD_V1=1 python tests/v1_step_worker.py OUT.pt v1 FC1 ACT FC2   (flags 0/1)
"""

import dataclasses
import os
import sys

import torch

from mlp_steps import Config, attach_main_grads, forward_plan, make_inputs, make_stack, run_step


def main(out_path: str, engine: str, *flags: str) -> None:
    # TEO_TEST_MEGATRON: comma-separated keys of mlp_steps.MEGATRON_KWARGS (e.g. "main_grad,delay")
    megatron = tuple(filter(None, os.environ.get("TEO_TEST_MEGATRON", "").split(",")))
    # TEO_TEST_RECIPE: a key of mlp_steps.RECIPES (the forward runs under that recipe)
    recipe = os.environ.get("TEO_TEST_RECIPE") or None
    # TEO_TEST_SPLITS: comma-separated tokens per expert (FP8 GEMMs need multiples of 16)
    splits = os.environ.get("TEO_TEST_SPLITS")
    extra = {"splits": tuple(int(n) for n in splits.split(","))} if splits else {}
    cfg = Config(offload=tuple(f == "1" for f in flags), megatron=megatron, recipe=recipe, **extra)
    inputs = make_inputs(cfg)
    runs = {}
    for name in ("none", engine):
        # a stack of its own per run, built alike (same seed): a recipe's state (delayed scaling's
        # amax history) moves with each step, so a second step on one stack would differ anyway
        stack = make_stack(cfg)
        if "main_grad" in megatron:
            attach_main_grads(stack)
        runs[name] = run_step(stack, inputs, name)
    results = {name: {"out": r["out"].cpu(), "grads": {k: None if v is None else v.cpu() for k, v in r["grads"].items()},
                       "moved": {"|".join(k): n for k, n in r["moved"].items()},
                       "entries": [dataclasses.astuple(e) for e in r["recorder"].entries]}
               for name, r in runs.items()}
    results["plans"] = [forward_plan(mlp) for mlp in stack]
    torch.save(results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
