"""GPU (sm_90, megatron-core 0.19.2): this package's experts inside Megatron's whole-MoE-layer CUDA
graphs (drop-and-pad MoE, ``cuda_graph_modules=["attn", "moe"]``), in bf16 and FP8 block scaling.

Runs ``benchmarks/megatron_gpt.py`` on a small GPTModel at EP=1 as a user runs it: ours in bf16
and in FP8 train under the graphs (captured after the warm-up, then replayed), each variant in
processes of its own; both must run on the fused op with the graphs captured, and FP8's first loss
(eager, same weights and tokens) lie within FP8's error of bf16's. About two minutes.
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


def test_our_experts_run_in_megatrons_moe_layer_graphs_in_bf16_and_fp8(tmp_path):
    import megatron_gpt as mg

    rc = mg.main([*SMALL, "--ep", "1", "--variants", "ours,ours+fp8block", "--cuda-graphs", "attn,moe",
                  "--capacity-factor", "1.0", "--warmup", "2", "--iters", "3", "--no-numerics",
                  "--job-timeout", "240", "--out", str(tmp_path), "--job-logs", str(tmp_path / "logs")])
    found = list(tmp_path.glob("megatron_gpt_*.json"))
    assert len(found) == 1
    rows = {r["variant"]: r for r in json.loads(found[0].read_text())["rows"]}
    assert rc == 0, {k: r.get("error") for k, r in rows.items()}
    for name in ("ours", "ours+fp8block"):
        r = rows[name]
        assert r["experts_path"].startswith("FusedScaledSReLUMLP"), r["experts_path"]
        assert r["cuda_graphs"] == ["attn", "moe"] and r["graph_capture_s"] > 0
        # the timed steps replayed the experts: their op never ran in Python
        assert r["experts_eager_forwards_timed_per_rank"] == [0], r["experts_eager_forwards_timed_per_rank"]
        assert all(math.isfinite(x) for x in r["timed_losses_per_rank"][0])
    bf16, fp8 = rows["ours"], rows["ours+fp8block"]
    assert abs(fp8["first_loss"] - bf16["first_loss"]) <= 2e-2 * abs(bf16["first_loss"])
    # the replayed steps train alike: their losses within FP8's error of bf16's
    for a, b in zip(bf16["timed_losses_per_rank"][0], fp8["timed_losses_per_rank"][0]):
        assert abs(b - a) <= 2e-2 * abs(a)
