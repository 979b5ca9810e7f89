"""CPU checks of the benchmark scripts: their bookkeeping, and a clear exit without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))


def _row(engine, ops, act, moved, fwd=5.0, bwd=10.0, step=15.0):
    return {"engine": engine, "ops": ops, "act_MiB": act, "offloaded_MiB": moved,
            "fwd_ms": fwd, "bwd_ms": bwd, "step_ms": step}


def test_r_compares_each_row_with_the_no_offload_run_of_its_own_ops():
    from offload_policies import derive

    rows = [_row("none", "teo", 1200, 0), _row("none", "te", 1700, 0, fwd=6.0, bwd=12.0),
            _row("v2", "teo", 200, 1000, step=40.0), _row("v2", "te", 300, 1400, step=80.0)]
    pcie = {"d2h_GBps": 50.0, "h2d_GBps": 50.0}
    derive(rows, pcie)
    assert rows[2]["R"] == pytest.approx(1.0) and rows[3]["R"] == pytest.approx(1.0)
    moved_ms = 1400 * 2**20 / 50e9 * 1e3  # > the stock run's fwd and bwd: the bound is PCIe
    assert rows[3]["bound_ms"] == pytest.approx(2 * moved_ms)
    assert rows[0]["R"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("script", ["offload_policies.py", "bench_fused_mlp.py", "bench_kernels.py",
                                    "ablate_epilogue.py"])
def test_benchmarks_exit_clearly_without_a_gpu(script):
    proc = subprocess.run([sys.executable, str(BENCH / script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "cannot run" in proc.stderr and "Traceback" not in proc.stderr
