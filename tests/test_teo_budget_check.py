"""CPU: benchmarks/teo_budget_check.py's arguments, verdict and report, and its exit without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import teo_budget_check as check  # noqa: E402


def _row(recommended, default_ms, budget_ms, default_peak=4000.0, budget_peak=4100.0):
    return {"policy": "MLP 7/8", "recommended_budget": recommended, "default_ms": default_ms, "budget_ms": budget_ms,
            "default_peak_MiB": default_peak, "budget_peak_MiB": budget_peak}


def test_the_verdict_compares_the_recommendation_with_the_default_schedule():
    assert check.verdict(_row(False, 66.0, 90.0), 0.01).startswith("recommends the default schedule")
    assert check.verdict(_row(True, 66.0, 66.5), 0.01) == "no slower: 1.008x the default's step"
    assert check.verdict(_row(True, 66.0, 80.0), 0.01).startswith("SLOWER: 1.212x")
    assert "a trade" in check.verdict(_row(True, 66.0, 80.0, budget_peak=3000.0), 0.01)


def test_policies_are_checked_against_the_layers():
    assert check.parse_args([]).policies == [("mlp", 7), ("mlp", 8), ("layer", 4)]
    assert check.parse_args(["--policies", "layer:2", "--layers", "4"]).policies == [("layer", 2)]
    for bad in (["--policies", "mlp:9"], ["--policies", "experts:2"], ["--steps", "0"], ["--freed", "1.5"]):
        with pytest.raises(SystemExit):
            check.parse_args(bad)


def test_the_report_has_a_row_per_policy_with_its_verdict_and_reason():
    row = {**_row(True, 66.0, 60.0), "budget_bytes": 12 << 30, "waits": 2.0, "wait_MiB": 300.0, "deferred": 0.0,
           "looks": 400.0, "reads": 250.0, "look_ms": 3.5, "reason": "the budget: its step took ..."}
    row["verdict"] = check.verdict(row, 0.01)
    result = {"gpu": "NVIDIA H100 80GB HBM3", "path": "fused", "floor_MiB": 6747.0, "rows": [row],
              "config": {"layers": 8, "batch": 2, "seq": 4096, "warmup": 2, "steps": 10, "freed": 0.96}}
    text = check.markdown(result)
    assert "| MLP 7/8 | 66.0 | 4000 | 60.0 | 4100 | 12.00 | budget | 2.0 (300) | 0.0 | 400 / 250 | 3.50 | no slower" in text
    assert "- MLP 7/8: the budget: its step took ..." in text and "8 layers, 2 x 4096 tokens" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_it_exits_clearly_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "teo_budget_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "teo_budget_check.py: cannot run: " in proc.stderr
    assert "Traceback" not in proc.stderr and not list(tmp_path.iterdir())
