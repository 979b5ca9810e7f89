"""Diagnostic: GPU memory at each teo schedule event of one MoE step (where does the peak sit?).

python3 scripts/diag_teo_memory.py [--unfused] [--layers 4] [policy ...]   e.g. layer:2 mlp:3
Prints, per event (forward enter/sync, backward start, region end), memory allocated and the
allocated peak since the previous event, in MiB above the step's start, and which layers hold
reloads. Not a benchmark: one step after one warm-up step.
"""
import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))
cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
cli.add_argument("--unfused", action="store_true", help="this package's MLP ops through TE's unfused path")
cli.add_argument("--layers", type=int, default=4, help="layers of the step (default 4)")
cli.add_argument("policies", nargs="*", default=["layer:2", "mlp:3"], help="mlp:N / layer:N (default layer:2 mlp:3)")
opts = cli.parse_intermixed_args()  # policies before or after the options
if opts.unfused:
    os.environ["TEO_FUSED_SRELU_MLP"] = "0"
os.environ.setdefault("NVTE_CPU_OFFLOAD_V1", "0")

import torch  # noqa: E402

import moe_step  # noqa: E402
from te_offload_ops.engines.teo import TeoEngine  # noqa: E402

unfused, policies = opts.unfused, opts.policies
# moe_step's parser checks the layers and policies and names what is wrong
args = moe_step.parse_args(["--quick", "--layers", str(opts.layers), "--engines", "teo", "--no-cap",
                            "--policies", ",".join(policies)] + (["--unfused"] if unfused else []))
bench = moe_step.StepBench("base", moe_step.SHAPES["base"], args, "teo")
MiB = 2**20
log = []
start = [0]


def mark(what):
    torch.cuda.synchronize()
    now = torch.cuda.memory_allocated() - start[0]
    peak = torch.cuda.max_memory_allocated() - start[0]
    torch.cuda.reset_peak_memory_stats()
    log.append((what, now / MiB, peak / MiB))


def wrap(name, label):
    original = getattr(TeoEngine, name)

    def hooked(self, *a):
        mark(f"before {label}{a}")
        out = original(self, *a)
        reloaded = sorted(j for j, c in self.copies.layers.items() if c.reloaded)
        mark(f"after  {label}{a} reloaded={reloaded}")
        return out
    setattr(TeoEngine, name, hooked)


for name, label in (("enter_layer", "enter"), ("layer_done", "sync"), ("backward_boundary", "bwd start"),
                    ("region_backward_done", "region end")):
    wrap(name, label)

for text in ["none"] + policies:
    policy = moe_step.NO_OFFLOAD if text == "none" else moe_step.parse_policies(text, bench.L)[0]
    ctx = bench._context(policy)
    x, dy = bench._inputs(args.batch)
    bench._step(x, dy, args.batch, policy, ctx)  # warm-up
    torch.cuda.synchronize()
    start[0] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    log.clear()
    bench._step(x, dy, args.batch, policy, ctx)
    mark("step end")
    print(f"\n=== {text} ({'unfused' if unfused else 'fused'} MLP, L={bench.L}): MiB above the step's start")
    top = max(p for _, _, p in log)
    for what, now, peak in log:
        print(f"{now:9.1f} now {peak:9.1f} peak-since-last{'  <== step peak' if peak == top else ''}  {what}")
