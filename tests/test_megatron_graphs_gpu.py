"""GPU (sm_90, megatron-core 0.19.2): this package's experts inside Megatron's whole-MoE-layer CUDA
graphs (drop-and-pad MoE, ``cuda_graph_modules=["attn", "moe"]``), in bf16; FP8 with the
attention graphed and the experts eager.

Runs ``benchmarks/megatron_gpt.py`` on a small GPTModel at EP=1 as a user runs it: ours in bf16
trains under the whole-layer graphs (captured after the warm-up, then replayed) with the fused op
inside them, and its losses equal those of its eager twin (the same configuration, RNG tracker and
stream, never captured; TE's deterministic kernels in both); FP8 block scaling under drop-and-pad
(the experts eager: Megatron pads FP8 experts' tokens through a host copy no capture takes) trains
within FP8's error of bf16. About four minutes.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from megatron_skip import megatron_skip_reason

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

pytestmark = pytest.mark.skipif(megatron_skip_reason(kernels=True) is not None,
                                reason=megatron_skip_reason(kernels=True) or "")

SMALL = ["--layers", "2", "--hidden", "512", "--heads", "4", "--ffn", "256", "--experts", "4", "--topk", "2",
         "--seq", "512", "--micro-batch", "2", "--microbatches", "2", "--vocab", "2048"]


def _run(tmp_path, name, *argv):
    import megatron_gpt as mg

    out = tmp_path / name
    rc = mg.main([*SMALL, "--ep", "1", "--capacity-factor", "1.0", "--iters", "3", "--no-numerics",
                  "--job-timeout", "240", "--out", str(out), "--job-logs", str(out / "logs"), *argv])
    found = list(out.glob("megatron_gpt_*.json"))
    assert len(found) == 1
    rows = {r["variant"]: r for r in json.loads(found[0].read_text())["rows"]}
    assert rc == 0, {k: r.get("error") for k, r in rows.items()}
    return rows


def _close(a, b, rel):
    return all(abs(y - x) <= rel * abs(x) for x, y in zip(a, b, strict=True))


def test_our_experts_run_in_megatrons_moe_layer_graphs_and_train_as_eagerly(tmp_path):
    # the twin steps eagerly where the graphed run captures and replays: same steps, same tokens
    graphs = ("--variants", "ours", "--cuda-graphs", "attn,moe", "--warmup", "2", "--deterministic")
    graphed = _run(tmp_path, "graphed", *graphs)["ours"]
    twin = _run(tmp_path, "twin", *graphs, "--no-capture")["ours"]
    eager = _run(tmp_path, "eager", "--variants", "ours,ours+fp8block", "--warmup", "3")
    for r in (graphed, twin, *eager.values()):
        assert r["experts_path"].startswith("FusedScaledSReLUMLP"), r["experts_path"]
        assert all(math.isfinite(x) for x in r["timed_losses_per_rank"][0])
    assert graphed["cuda_graphs"] == ["attn", "moe"] and graphed["graph_capture_s"] > 0
    assert twin["cuda_graphs"] == ["attn", "moe"] and twin["graph_capture_s"] is None
    # the timed steps replayed the experts: their op never ran in Python
    assert graphed["experts_eager_forwards_timed_per_rank"] == [0], graphed["experts_eager_forwards_timed_per_rank"]
    assert twin["experts_eager_forwards_timed_per_rank"][0] > 0
    # the same start: weights, and the first (eager) step of both
    assert graphed["weights_digest"] == twin["weights_digest"] == eager["ours"]["weights_digest"]
    assert graphed["first_loss"] == pytest.approx(twin["first_loss"], rel=1e-6)
    # the replays train as the eager steps do (same weights, tokens and kernels; sizes from the capture)
    assert _close(twin["timed_losses_per_rank"][0], graphed["timed_losses_per_rank"][0], 5e-3)
    # FP8 block scaling under drop-and-pad trains within FP8's error of bf16
    bf16, fp8 = eager["ours"], eager["ours+fp8block"]
    assert abs(fp8["first_loss"] - bf16["first_loss"]) <= 2e-2 * abs(bf16["first_loss"])
    assert _close(bf16["timed_losses_per_rank"][0], fp8["timed_losses_per_rank"][0], 2e-2)
