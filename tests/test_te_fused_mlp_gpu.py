"""GPU: TE's own fused grouped MLP (Blackwell, MXFP8/NVFP4) under real offload engines, on the policy.

On any CUDA GPU (H100 here) TE's real fused-op class, fusion and forward run with only their
sm_100 pieces stood in (tests/te_fused_standins.py lists them), under TE's V2 engine, TE's V1
engine (in a subprocess: TE picks V1 at import) and a saved-tensor-hook engine. Checked per step
(te_fused_engines.policy_problems): no weight bytes move, nothing of an op with offload=False
moves, each offloading op of an offloaded layer moves at least its large activations, and what
TE's backward is handed equals byte for byte what TE's forward saved, weights being the very
same tensors. Not exercised there: TE's fused backward itself (its GEMMs and the gradient
quantization need sm_100; a recorder takes its place and returns no gradients) and the real
kernels' numbers (the stand-ins write random bytes of the right shapes).

On sm_100 with NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 and the cuDNN frontend's kernels, the last test
runs the same with nothing stood in and compares with TE's own fused op; it skips elsewhere.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformer_engine.pytorch.ops.fused import grouped_mlp as te_mlp

from te_fused_engines import CASES, POLICIES, StepConfig, moved_by_kind, policy_problems, run_step
from te_fused_standins import blackwell_standins, clear_te_caches, frontend_problem
from te_offload_ops.engines import active_engine


def _standin_problem():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none visible); TE's fused grouped MLP runs there with its sm_100 kernels stood in"
    return frontend_problem()


pytestmark = pytest.mark.skipif(_standin_problem() is not None, reason=_standin_problem() or "")



@pytest.fixture
def standins(monkeypatch):
    recorder = blackwell_standins(monkeypatch)
    yield recorder
    clear_te_caches()


def _v2_here():
    if active_engine() != "v2":
        pytest.skip("this process runs TE's V1 engine (NVTE_CPU_OFFLOAD_V1=1)")


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("engine", ["v2", "spy"])
def test_engines_move_only_what_the_policy_allows(engine, case, policy, standins, monkeypatch):
    if engine == "v2":
        _v2_here()
    activation, recipe = CASES[case]
    cfg = StepConfig(activation=activation, recipe=recipe, offload=POLICIES[policy])
    result = run_step(cfg, engine, monkeypatch, standins)
    assert all(name.startswith("PolicyGroupedMLP") for name in result.plan), result.plan
    offloaded = [0] if engine == "v2" else list(range(cfg.layers))  # V2 offloads all layers but the last
    problems = policy_problems(result, cfg, offloaded)
    print(engine, case, policy, moved_by_kind(result.moved))
    assert problems == [], problems


@pytest.mark.parametrize("engine", ["v2", "spy"])
def test_without_our_fusion_te_moves_weights_and_opted_out_activations(engine, standins, monkeypatch):
    """The same ops and step with TE's fused op saving as it likes: what this package prevents."""
    if engine == "v2":
        _v2_here()
    cfg = StepConfig(offload=POLICIES["keep-fc1"], te_alone=True)
    result = run_step(cfg, engine, monkeypatch, standins)
    assert result.plan == ["GroupedMLP_CuTeGEMMUnary"] * cfg.layers
    problems = policy_problems(result, cfg, [0])
    print(engine, "TE's op alone", moved_by_kind(result.moved), problems)
    assert any(p.endswith("weight bytes") for p in problems)  # quantized weight workspaces, every step
    assert any("of fc1, which has offload=False" in p for p in problems)


def test_v1_engine_in_its_own_process(tmp_path):
    """TE's V1 engine (it is chosen when TE is imported): the policies and cases above, in one child process."""
    worker = Path(__file__).with_name("te_fused_worker.py")
    root = str(worker.parent.parent)
    env = dict(os.environ, NVTE_CPU_OFFLOAD_V1="1",
               PYTHONPATH=os.pathsep.join(filter(None, [root, str(worker.parent), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "v1.txt"
    proc = subprocess.run([sys.executable, str(worker), str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = out.read_text()
    print(report)
    lines = report.splitlines()
    assert len(lines) == len(POLICIES) * len(CASES) + 1  # one line per run, then TE's op alone
    for line in lines[:-1]:
        assert "PolicyGroupedMLP" in line and line.endswith("problems: []"), line
    # V1 moves only marked tensors, and TE's op marks its activations whatever the op's flag says.
    assert "of fc1, which has offload=False" in lines[-1], lines[-1]


# -- Blackwell, nothing stood in --------------------------------------------------------------

def _blackwell_problem():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 10:
        return ("needs an sm_100 GPU (Blackwell) with NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 and the cuDNN frontend's "
                "sm100 grouped GEMM kernels")
    if not te_mlp.GroupedMLP_CuTeGEMMUnary.is_supported():
        return "TE's fused grouped MLP is not supported here (set NVTE_CUTEDSL_FUSED_GROUPED_MLP=1; cuDNN frontend)"
    return None


@pytest.mark.skipif(_blackwell_problem() is not None, reason=_blackwell_problem() or "")
@pytest.mark.parametrize("policy", ["all", "keep-fc1"])
@pytest.mark.parametrize("engine", ["v2", "spy"])
def test_on_blackwell_real_kernels(engine, policy, monkeypatch):
    if engine == "v2":
        _v2_here()
    cfg = StepConfig(offload=POLICIES[policy])
    ours = run_step(cfg, engine, monkeypatch)
    theirs = run_step(StepConfig(stock=True), "none", monkeypatch)
    assert all(name == "PolicyGroupedMLPUnary" for name in ours.plan), ours.plan
    assert policy_problems(ours, cfg, [0] if engine == "v2" else [0, 1]) == []
    torch.testing.assert_close(ours.out, theirs.out)
    for name, grad in theirs.grads.items():
        torch.testing.assert_close(ours.grads[name], grad, msg=name)
