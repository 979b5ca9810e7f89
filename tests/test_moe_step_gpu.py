"""GPU: the MoE transformer step of benchmarks/moe_step.py computes the same thing with and without
offload, and a quick run of the benchmark reports every policy of every engine."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_gpu

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

# Small, but every activation the engines see has >= 256 Ki elements (TE V2 skips smaller ones).
SHAPE = {"hidden": 512, "heads": 4, "ffn": 256, "experts": 8, "topk": 2}
LAYERS, BATCH, SEQ = 3, 2, 512


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _step(stack, x, dy, scope, context):
    from moe_model import forward_stack

    ctx, sync, counter = context
    counter.bytes.clear()
    for p in stack.parameters():
        p.grad = None
    out = forward_stack(stack, x, BATCH, scope, ctx, sync)
    out.backward(dy)
    torch.cuda.synchronize()
    return out.detach().clone(), {n: p.grad.clone() for n, p in stack.named_parameters()}, counter.total


@requires_gpu
@pytest.mark.parametrize("scope,layers", [("mlp", 2), ("layer", 1), ("layer", 2)])
def test_offloaded_step_matches_the_step_without_offload(scope, layers):
    from moe_model import LayerShape, build_stack

    from te_offload_ops.engines import active_engine, offload_context

    stack = build_stack(LayerShape(**SHAPE), LAYERS, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(BATCH * SEQ, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(BATCH * SEQ, SHAPE["hidden"], device="cuda", dtype=torch.bfloat16, generator=g)
    ref_out, ref_grads, _ = _step(stack, x, dy, scope, offload_context("none", num_layers=0, model_layers=LAYERS))
    ctx = offload_context(active_engine(), num_layers=layers, model_layers=LAYERS)
    for _ in range(2):  # the same context serves consecutive steps
        out, grads, moved = _step(stack, x, dy, scope, ctx)
        assert moved > 0
        assert torch.equal(out, ref_out)  # the forward does not depend on where saved tensors live
        # attention's backward accumulates with atomics: equal up to summation order
        worst = max((_rel(grads[n], ref_grads[n]), n) for n in ref_grads)
        assert worst[0] < 2e-2, worst


@requires_gpu
def test_quick_run_reports_every_policy_of_every_engine(tmp_path):
    cmd = [sys.executable, str(BENCH / "moe_step.py"), "--quick", "--layers", str(LAYERS), "--seq", "1024",
           *(a for k, v in SHAPE.items() for a in (f"--{k}", str(v))), "--memory-target", "80", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    [path] = tmp_path.glob("moe_step_*_base_quick.json")
    result = json.loads(path.read_text())
    [shape] = result["shapes"]
    assert [run["engine"] for run in shape["runs"]] == ["v2", "v1", "teo"]
    for run in shape["runs"]:
        rows = {r["policy"]: r for r in run["rows"]}
        assert list(rows) == ["none", "MLP 1/3", "MLP 2/3", "MLP 3/3", "layer 1/3", "layer 2/3"]
        for label, r in rows.items():
            if run["engine"] == "v2" and label == "MLP 3/3":
                assert "Cannot offload all layers" in r["error"]  # TE V2 refuses n = L
                continue
            assert not r.get("error"), r
            assert r["peak_above_MiB"] > 0 and r["step_ms"] > 0
            if r["scope"] != "none":
                assert r["offloaded_MiB"] > 0, r
        if run["engine"] == "v2":  # V2 releases an offloaded layer before the backward reaches its peak
            assert all(rows[f"layer {n}/3"]["freed_MiB"] > 0 for n in (1, 2)), rows
        searches = run["cap"]["searches"]
        assert searches[0]["scope"] == "none" and searches[0]["batch"] >= 1
        assert all(t["fits"] == (t["peak_above_MiB"] is not None) for s in searches for t in s["trials"])
    assert shape["memory_target"]["policy"] is not None  # 80 GiB: every policy meets it
    assert path.with_suffix(".md").exists()
    assert "[moe_step] engine=v1 shape=base policy=layer 2/3 (6/6): step" in proc.stdout  # a line per policy
    assert "[moe_step] engine=teo (3/3) shape=base policy=none (1/6) step 4/4: " in proc.stdout  # and per step
    assert path.with_suffix(".png").exists()
