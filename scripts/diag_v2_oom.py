"""Diagnostic: does TE V2 keep GPU memory after an out-of-memory error in the cap search?

In the tenth session's big-ffn run (benchmarks/results/moe_step_NVIDIA_H100_80GB_HBM3_big-ffn_te.md)
V2's layer 2/4 fit no batch under the 67 GiB cap, 8 sequences included, which fit before its
12-sequence trial ran out of memory. This runs the same trials in one process and lists the large
CUDA tensors left alive after them, with what holds them. Written in the tenth session, committed
in the eleventh; not run yet (needs a GPU): python3 scripts/diag_v2_oom.py [v2|v1|teo]."""
import gc
import os
import sys

os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
sys.path.insert(0, "benchmarks")
engine = sys.argv[1] if len(sys.argv) > 1 else "v2"
os.environ["NVTE_CPU_OFFLOAD_V1"] = "1" if engine == "v1" else "0"  # TE picks its engine at import
from bench_common import cuda_problem  # noqa: E402

if cuda_problem():
    sys.exit(f"diag_v2_oom.py needs a CUDA GPU with Transformer Engine: {cuda_problem()}")
import torch  # noqa: E402

import moe_step  # noqa: E402

MiB = 2**20
args = moe_step.parse_args(["--shapes", "big-ffn", "--layers", "4", "--engines", engine, "--policies", "mlp:2,layer:2"])
bench = moe_step.StepBench("big-ffn", args.shapes["big-ffn"], args, engine)
P = moe_step.Policy


def report(what):
    gc.collect()
    torch.cuda.synchronize()
    st = torch.cuda.memory_stats()
    print(f"{what}: allocated above floor {torch.cuda.memory_allocated() / MiB - bench.floor_MiB:.0f} MiB, "
          f"reserved {torch.cuda.memory_reserved() / MiB:.0f} MiB, inactive split "
          f"{st.get('inactive_split_bytes.all.current', 0) / MiB:.0f} MiB, segments {st.get('segment.all.current')}", flush=True)


def big_cuda_tensors():
    out = []
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o) and o.is_cuda and o.untyped_storage().nbytes() > 64 * MiB:
                out.append(o)
        except Exception:  # noqa: BLE001
            pass
    return out


def trial(policy, batch):
    t = bench.cap_trial(policy, batch, 67.0, True)
    print(f"{policy.label(4)} {batch} seqs: fits={t['fits']} error={t['error']}", flush=True)
    report(f"after {policy.label(4)} {batch}")


report("built")
base = {id(t) for t in big_cuda_tensors()}
trial(P("layer", 2), 8)
trial(P("mlp", 2), 11)
trial(P("layer", 2), 12)
left = [t for t in big_cuda_tensors() if id(t) not in base]
print(f"{len(left)} large CUDA tensors alive that were not there after the build, "
      f"{sum(t.untyped_storage().nbytes() for t in left) / MiB:.0f} MiB", flush=True)
for t in left[:12]:
    refs = [type(r).__module__ + "." + type(r).__qualname__ for r in gc.get_referrers(t)]
    print(f"  {tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / MiB:.0f} MiB, held by {refs[:5]}", flush=True)
    for r in gc.get_referrers(t)[:3]:
        if isinstance(r, (list, dict, tuple)):
            outer = [type(x).__module__ + "." + type(x).__qualname__ for x in gc.get_referrers(r)][:5]
            print(f"    that {type(r).__name__} is held by {outer}", flush=True)
del left
trial(P("layer", 2), 8)
trial(P("layer", 2), 10)
