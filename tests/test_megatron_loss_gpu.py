"""GPU (sm_90, megatron-core 0.19.2): the loss benchmark trains Megatron's GPT-MoE model on this
package's experts, bf16 and FP8 block scaling, and the corpus is learnt.

A small GPTModel (2 MoE layers, H=256, 4 experts top-2) runs ``benchmarks/megatron_loss.py`` for
40 steps of one seed in each precision, each in processes of its own, as a user runs it: the loss
must fall well below its start towards the corpus' floor, both runs start from the same weights
and first loss (the same tokens), and FP8 ends near bf16. About a minute.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from megatron_skip import megatron_skip_reason

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

pytestmark = pytest.mark.skipif(megatron_skip_reason(kernels=True) is not None,
                                reason=megatron_skip_reason(kernels=True) or "")

ARGS = ["--layers", "2", "--hidden", "256", "--heads", "4", "--ffn", "256", "--experts", "4", "--topk", "2",
        "--seq", "256", "--micro-batch", "4", "--microbatches", "2", "--vocab", "1024", "--corpus-vocab", "128",
        "--steps", "40", "--tail", "5", "--seeds", "1", "--lr", "1e-3", "--job-timeout", "300"]


def test_bf16_and_fp8_block_scaling_learn_the_corpus_alike(tmp_path):
    import megatron_loss as ml

    assert ml.main([*ARGS, "--out", str(tmp_path), "--job-logs", str(tmp_path / "logs")]) == 0
    found = list(tmp_path.glob("megatron_loss_*.json"))
    assert len(found) == 1
    result = json.loads(found[0].read_text())
    bf16, fp8 = result["runs"]
    assert (bf16["variant"], fp8["variant"]) == ("ours", "ours+fp8block")
    assert bf16["experts_path"] == fp8["experts_path"] == "FusedScaledSReLUMLP"
    assert bf16["weights_digest"] == fp8["weights_digest"]  # the same initial weights
    assert bf16["tokens_digest"] == fp8["tokens_digest"]  # and tokens
    assert fp8["losses"][0] == pytest.approx(bf16["losses"][0], rel=2e-2)
    for run in (bf16, fp8):  # learnt: from about ln(1024) towards the floor
        assert run["final"] < 0.6 * run["losses"][0], run["losses"]
    assert abs(fp8["final"] - bf16["final"]) < 0.05 * bf16["final"]
