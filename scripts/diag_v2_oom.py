"""Diagnostic: does TE V2 keep GPU memory after an out-of-memory step in the cap search, and does
moe_step's release of TE's offload synchronizers give it back?

In the tenth and thirteenth sessions' big-ffn runs (benchmarks/results/moe_step_NVIDIA_H100_80GB_HBM3_big-ffn_te.md,
..._big-ffn_67_all.md) V2's layer 2/4 fit no batch under the 67 GiB cap, 8 sequences included, after
the MLP 2/4 search's last trial (12 sequences) ran out of memory. Read from TE 2.20's cpu_offload.py
(thirteenth session): a step that fails mid-forward leaves its OffloadSynchronizer holding the saved
GPU tensors, and the step's autograd graph holds the synchronizer (unpack hooks, the layer-output
prehook): a cycle through C++ graph nodes that gc cannot break. moe_step now releases every
synchronizer's layer states after a failed step (release_te_offload_state). This replays the trials
in one process with that release turned off, prints TE's synchronizers and what they hold, then
releases them and tries 8 sequences again. Needs a GPU: python3 scripts/diag_v2_oom.py [v2|v1|teo]."""
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

MiB, GiB = 2**20, 2**30
args = moe_step.parse_args(["--shapes", "big-ffn", "--layers", "4", "--engines", engine, "--policies", "mlp:2,layer:2"])
bench = moe_step.StepBench("big-ffn", args.shapes["big-ffn"], args, engine)
P = moe_step.Policy
release = moe_step.release_te_offload_state
moe_step.release_te_offload_state = lambda: 0  # off while the leak is looked at


def report(what):
    gc.collect()
    torch.cuda.synchronize()
    st = torch.cuda.memory_stats()
    print(f"{what}: allocated above floor {torch.cuda.memory_allocated() / MiB - bench.floor_MiB:.0f} MiB, "
          f"reserved {torch.cuda.memory_reserved() / MiB:.0f} MiB, inactive split "
          f"{st.get('inactive_split_bytes.all.current', 0) / MiB:.0f} MiB", flush=True)


def group_bytes(group):
    return sum(t.untyped_storage().nbytes() for t in getattr(group, "tensor_list", ()) if torch.is_tensor(t))


def synchronizers():
    """TE V2's synchronizers alive and what their layer states hold on the GPU and the host."""
    co = sys.modules.get("transformer_engine.pytorch.cpu_offload")
    kind = getattr(co, "OffloadSynchronizer", None)
    if kind is None:
        print("  (TE's cpu_offload module is not loaded)")
        return
    print(f"  OFFLOAD_SYNCHRONIZER: {type(getattr(co, 'OFFLOAD_SYNCHRONIZER', None)).__name__}", flush=True)
    for sync in [o for o in gc.get_objects() if isinstance(o, kind)]:
        held = {i: (s.state, group_bytes(s.fwd_gpu_tensor_group) / MiB, group_bytes(s.bwd_gpu_tensor_group) / MiB,
                    group_bytes(s.cpu_tensor_group) / MiB) for i, s in sync.layer_states.items()}
        refs = [type(r).__name__ for r in gc.get_referrers(sync)][:6]
        print(f"  {type(sync).__name__}: num_of_fwds {sync.num_of_fwds}, current layer {sync.current_layer_id}, "
              f"referrers {refs}", flush=True)
        for i, (state, fwd, bwd, cpu) in held.items():
            print(f"    layer {i}: {state}, fwd GPU {fwd:.0f} MiB, bwd GPU {bwd:.0f} MiB, host {cpu:.0f} MiB", flush=True)


def trial(policy, batch):
    t = bench.cap_trial(policy, batch, 67.0, True)
    print(f"{policy.label(4)} {batch} seqs: fits={t['fits']} error={t['error']}", flush=True)
    report(f"after {policy.label(4)} {batch}")


report("built")
trial(P("layer", 2), 8)
trial(P("mlp", 2), 11)
trial(P("mlp", 2), 12)  # the out-of-memory trial that came before the layer search both times
synchronizers()
trial(P("layer", 2), 8)
synchronizers()
print(f"released: {release()} synchronizers", flush=True)
report("after the release")
trial(P("layer", 2), 8)
trial(P("layer", 2), 12)
