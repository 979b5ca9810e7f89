"""GPU: moe_step.py --profile runs a small step under torch.profiler and its breakdown adds up
(the analysis itself is checked on synthetic events in tests/test_step_profile.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import requires_gpu

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SHAPE = {"hidden": 512, "heads": 4, "ffn": 256, "experts": 8, "topk": 2}  # activations >= 256 Ki elements


@requires_gpu
@pytest.mark.parametrize("unfused", [False, True], ids=["fused-or-default", "unfused"])
def test_profile_mode_writes_a_breakdown_that_adds_up(tmp_path, unfused):
    cmd = [sys.executable, str(BENCH / "moe_step.py"), "--quick", "--layers", "3", "--seq", "1024", "--engines", "v2",
           "--profile", "none,mlp:1", "--profile-steps", "2", "--trace", "--out", str(tmp_path),
           *(a for k, v in SHAPE.items() for a in (f"--{k}", str(v))), *(["--unfused"] if unfused else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    [path] = tmp_path.glob("moe_step_profile_*.json")
    assert path.name.endswith("_unfused.json") == unfused
    assert path.with_suffix(".md").exists() and path.with_suffix(".png").exists()
    assert len(list(tmp_path.glob("*.trace.json.gz"))) == 2  # --trace keeps one per policy
    [shape] = json.loads(path.read_text())["shapes"]
    profiles = {p["policy"]: p for p in shape["profiles"]}
    assert list(profiles) == ["none", "MLP 1/3"]
    for label, p in profiles.items():
        assert not p.get("error"), p
        assert [s["step"] for s in p["steps"]] == ["teo_step 1", "teo_step 2"]
        for s in p["steps"]:
            assert set(s["phases"]) == {"forward", "backward", "optimizer"}
            assert 0 < s["compute_busy_ms"] <= s["gpu_ms"]
            # every idle moment of the compute stream inside the step is attributed to some cause
            assert sum(s["idle_total_ms"].values()) + s["compute_busy_ms"] == pytest.approx(s["gpu_ms"], rel=1e-6)
            assert [row["layer"] for row in s["layers"]] == [0, 1, 2]
            assert all(row["fwd"].get("busy_ms", 0) > 0 and row["bwd"].get("busy_ms", 0) > 0 for row in s["layers"])
        print(f"\n{label}: GPU {p['mean']['gpu_ms']:.2f} ms, busy {p['mean']['compute_busy_ms']:.2f} ms, "
              f"idle {p['mean']['idle_ms']}, copies {p['mean'].get('copies')}, sync records {p['sync_records']}")
    offloaded = profiles["MLP 1/3"]["mean"]["copies"]
    assert offloaded["d2h"]["MiB"] > 1 and offloaded["h2d"]["MiB"] > 1  # the first MLP's activations went and came back
    assert offloaded["d2h"]["GBps"] > 0
    assert profiles["none"]["mean"].get("copies", {}).get("h2d", {}).get("MiB", 0) < 1
