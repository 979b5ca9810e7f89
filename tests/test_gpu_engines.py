"""GPU: offloaded training steps are exact under each engine, and engines move only what the policy allows."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_gpu
from mlp_steps import (POLICIES, Config, assert_moves_follow_policy, assert_same, check_path, make_inputs, make_stack,
                       offloadable_activation_bytes, run_step)
from offload_spy import Saved
from te_offload_ops.fused.selection import DISABLE_ENV


@requires_gpu
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("engine", ["v2", "spy"])
def test_in_process_engines(engine, policy, path):
    if engine == "v2" and os.environ.get("NVTE_CPU_OFFLOAD_V1") == "1":
        pytest.skip("this process runs TE's V1 engine (NVTE_CPU_OFFLOAD_V1=1)")
    cfg = Config(offload=POLICIES[policy])
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    base = run_step(stack, inputs, "none")
    run = run_step(stack, inputs, engine)
    check_path(stack, path)
    assert_same(base, run)
    offloaded_layers = list(range(cfg.layers)) if engine == "spy" else [0]
    assert_moves_follow_policy(run["moved"], cfg.offload, run["recorder"].entries, offloaded_layers)


@requires_gpu
@pytest.mark.parametrize("policy", list(POLICIES))
def test_v1_engine(policy, path, tmp_path):
    flags = ["1" if f else "0" for f in POLICIES[policy]]
    out = tmp_path / "v1.pt"
    worker = Path(__file__).with_name("v1_step_worker.py")
    root = str(worker.parent.parent)  # the checkout, so the child imports te_offload_ops as we do
    env = dict(os.environ, NVTE_CPU_OFFLOAD_V1="1", **{DISABLE_ENV: "1" if path == "fused" else "0"},
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(worker), str(out), "v1", *flags], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = torch.load(out)
    assert all(plan == (["FusedScaledSReLUMLP"] if path == "fused" else ["GroupedLinear", "ScaledSReLU", "GroupedLinear"])
               for plan in res["plans"])
    assert_same(res["none"], res["v1"])
    assert_moves_follow_policy(res["v1"]["moved"], POLICIES[policy], [Saved(*e) for e in res["v1"]["entries"]], [0])


@requires_gpu
@pytest.mark.parametrize("policy", ["all", "keep-fc1"])
def test_v2_memory_saved_matches_offloaded_bytes(policy, path):
    """Activation memory drops by >= 97% of the bytes of the offloaded layer's activations."""
    if os.environ.get("NVTE_CPU_OFFLOAD_V1") == "1":
        pytest.skip("this process runs TE's V1 engine (NVTE_CPU_OFFLOAD_V1=1)")
    cfg = Config(offload=POLICIES[policy], experts=4, hidden=1024, ffn=768, splits=(1024, 0, 3000, 72))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    base = run_step(stack, inputs, "none")
    run = run_step(stack, inputs, "v2")
    check_path(stack, path)
    theoretical = offloadable_activation_bytes(run["recorder"], layer=0)
    moved = sum(run["moved"].values())
    assert theoretical > 0 and moved == theoretical, (moved, theoretical)
    end_of_forward = (base["fwd_mem"] - run["fwd_mem"]) / theoretical
    peak = (base["fwd_peak"] - run["fwd_peak"]) / theoretical
    print(f"{policy}: offloaded {theoretical / 2**20:.1f} MiB, saved at end of forward "
          f"{end_of_forward:.2%}, peak {peak:.2%}")
    assert end_of_forward >= 0.97
    assert peak >= 0.97
