"""GPU: kernels loaded from the disk cache run, and give the bits the compiled ones give.

Process A runs one forward and backward of the fused SReLU MLP with an empty cache directory (it
compiles every kernel and writes it); process B runs the same step on the same directory: it
compiles nothing, loads every kernel A compiled, and its outputs and gradients equal A's bit for
bit. Called through TVM-FFI where A could link shared objects (a C compiler), B loads them without
ever importing the CuTe DSL. The warm-up command, given the shapes, leaves nothing for the step to
compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_sm90
from te_offload_ops.kernels import shared_object

HERE = Path(__file__).resolve().parent
WORKER = HERE / "kernel_cache_worker.py"
FUSED = ["FusedScaledSReLUMLP"]


def _env(cache: Path, call: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]), "TEO_KERNEL_CACHE": "1",
           "TEO_KERNEL_CACHE_DIR": str(cache)}
    env.pop("TEO_KERNEL_CALL", None)
    env.pop("TEO_GEMM_CLUSTER_M", None)  # the clusters each GEMM picks by default
    if call:
        env["TEO_KERNEL_CALL"] = call
    return env


def _step(cache: Path, out: Path, layout: str, main_grad: bool, call: str | None = None) -> dict:
    cmd = [sys.executable, str(WORKER), "--layout", layout, "--out", str(out)] + (["--main-grad"] if main_grad else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(cache, call), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert result["plan"] == FUSED, result["plan"]  # else the step ran no kernel of ours
    result["warnings"] = [ln for ln in proc.stderr.splitlines() if "kernel cache" in ln]
    return result


SETTINGS = {  # name -> (weight layout, main_grad, call convention)
    "te": ("te", False, None),
    "megatron-main-grad": ("megatron", True, None),
    "te-python-call": ("te", False, "python"),
}


@requires_sm90
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_second_process_loads_every_kernel_and_gives_the_same_bits(tmp_path, setting):
    layout, main_grad, call = SETTINGS[setting]
    cache = tmp_path / "cache"
    a = _step(cache, tmp_path / "a.pt", layout, main_grad, call)
    assert a["loaded"] == [] and len(a["compiled"]) >= 6, a  # fc1/fc2 forward, two dgrads, two wgrads
    assert len(list(cache.glob("*.kernel"))) == len(a["compiled"])
    b = _step(cache, tmp_path / "b.pt", layout, main_grad, call)
    assert b["compiled"] == [] and b["loaded"] == a["compiled"], b
    assert a["warnings"] == [] and b["warnings"] == []
    if call is None and shared_object.compiler() is not None:  # TVM-FFI, shared objects linked by A
        assert b["loaded_by"] == ["shared object"] and not b["dsl_imported"], b
    if call == "python":  # the DSL's executor: loaded through the DSL
        assert b["loaded_by"] == ["CuTe DSL"] and b["dsl_imported"], b
    ra, rb = torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt")
    assert torch.equal(ra["out"], rb["out"])
    assert ra["grads"].keys() == rb["grads"].keys() and len(ra["grads"]) > 2
    for name, g in ra["grads"].items():
        assert torch.equal(g, rb["grads"][name]), name


WARM_UP_ARGS = {  # setting -> the warm-up command's arguments for the worker's shapes
    "te": ["--num-experts", "4", "--hidden-size", "256", "--ffn-hidden-size", "384"],
    "megatron-main-grad": ["--num-experts", "8", "--expert-model-parallel-size", "2", "--hidden-size", "256",
                           "--ffn-hidden-size", "384", "--megatron"],
}


@requires_sm90
@pytest.mark.parametrize("setting", list(WARM_UP_ARGS))
def test_the_warm_up_command_leaves_the_step_nothing_to_compile(tmp_path, setting):
    layout, main_grad, call = SETTINGS[setting]
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "te_offload_ops.kernels.warmup", *WARM_UP_ARGS[setting]],
                          capture_output=True, text=True, env=_env(cache), timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    warmed = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert warmed and all(": compiled in " in ln for ln in warmed), proc.stdout
    step = _step(cache, tmp_path / "s.pt", layout, main_grad, call)
    assert step["compiled"] == [] and len(step["loaded"]) >= 6, step


_FP8_GEMM = """
import json, sys, torch
from te_offload_ops.kernels import api_fp8, registry
g = torch.Generator(device="cuda").manual_seed(0)
t, n, k, e = 700, int(sys.argv[2]), 256, 3
a = torch.randint(0, 120, (t, k), dtype=torch.uint8, device="cuda", generator=g)  # finite e4m3 bytes
sa = torch.rand((k // 128, -(-t // 4) * 4), device="cuda", generator=g)
b = torch.randint(0, 120, (e, n, k), dtype=torch.uint8, device="cuda", generator=g)
sb = torch.rand((e, n // 128, 4), device="cuda", generator=g)
out = api_fp8.grouped_gemm_fp8_blockwise(a, sa, b, sb, torch.tensor([300, 0, 400], device="cuda"))
torch.save(out.cpu(), sys.argv[1])
print("RESULT " + json.dumps({"compiled": len(registry.compile_times()), "loaded": len(registry.load_times()),
                              "loaded_by": sorted(set(registry.loaded_by().values())),
                              "dsl_imported": "cutlass" in sys.modules,
                              "cluster_m": [2 if ("cluster_m", 2) in k else 1 for k in registry.CACHE
                                            if k[0] == "fp8_blockwise"]}))
"""


@requires_sm90
@pytest.mark.parametrize("n", [384, 512], ids=["pair", "2x2"])
@pytest.mark.parametrize("call", [None, "python"], ids=["tvm-ffi", "python-call"])
def test_a_second_process_loads_the_fp8_gemm_and_gives_the_same_bits(tmp_path, call, n):
    """N=384: three n-blocks, CTA pairs; N=512: four, 2 x 2 clusters, whose occupancy answer the
    first process kept beside the kernel, so the second asks no DSL for it either."""
    from te_offload_ops.kernels import cluster_fit

    cache, results = tmp_path / "cache", []
    for name in ("a", "b"):
        proc = subprocess.run([sys.executable, "-c", _FP8_GEMM, str(tmp_path / f"{name}.pt"), str(n)],
                              capture_output=True, text=True, env=_env(cache, call), timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results.append(json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:]))
    a, b = results
    assert (a["compiled"], a["loaded"], b["compiled"], b["loaded"]) == (1, 0, 0, 1), results
    assert a["cluster_m"] == b["cluster_m"] == [2 if n == 512 else 1], results
    assert (cache / cluster_fit.FILE_NAME).exists() == (n == 512)
    if call is None and shared_object.compiler() is not None:
        assert b["loaded_by"] == ["shared object"] and not b["dsl_imported"], b
    assert torch.equal(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt"))
