"""GPU: this package's ops under TE's quantization recipes, against TE's own ops with the same recipe.

Under a recipe the Hopper fused MLP declines (its kernels are bf16/fp16), so the ops run as TE's
unfused ops do, with the policy marking what they save. Checked per recipe this GPU runs:
bitwise the same outputs and grads as TE's ops under every offload engine, the same error where
TE raises, no weight byte moved, the quantized activations moved (or kept with ``offload=False``),
and ``offload`` switched between steps taking effect at the next step.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformer_engine.pytorch as te

from conftest import requires_gpu
from mlp_steps import (Config, copy_weights, forward_plan, fused_path_problem, make_inputs, make_recipe, make_stack,
                       quantized, recipe_problem, run_step)
from offload_spy import Saved
from te_offload_ops.fused import explain_fusion
from te_offload_ops.fused.selection import DISABLE_ENV

# Splits a multiple of 16 rows (FP8 GEMMs need it); one expert without tokens.
ALIGNED = (0, 768, 1280, 32)
FP8_RECIPES = ["delayed", "current"]
ALL_RECIPES = ["delayed", "current", "block", "mxfp8", "nvfp4"]
UNFUSED = ["GroupedLinear", "ScaledSReLU", "GroupedLinear"]


def _skip_unless_runs(recipe):
    if (problem := recipe_problem(recipe)) is not None:
        pytest.skip(problem)


def _stock_and_ours(recipe, **kw):
    ours = make_stack(Config(splits=ALIGNED, recipe=recipe, **kw))
    stock = make_stack(Config(splits=ALIGNED, recipe=recipe, stock_te=True, **kw))
    copy_weights(ours, stock)
    return stock, ours


def _assert_same(a, b):
    assert torch.equal(a["out"], b["out"])
    assert a["grads"].keys() == b["grads"].keys()
    for name, g in a["grads"].items():
        assert torch.equal(g, b["grads"][name]), name


def _weight_bytes(moved):
    return sum(n for (_, kind), n in moved.items() if kind == "weight")


def _activation_bytes(moved, op_suffix=""):
    return sum(n for (op, kind), n in moved.items() if kind == "activation" and op.endswith(op_suffix))


@requires_gpu
@pytest.mark.parametrize("engine", ["none", "v2", "teo", "spy"])
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_matches_te_ops_bitwise_under_each_engine(recipe, engine):
    _skip_unless_runs(recipe)
    if engine == "v2" and os.environ.get("NVTE_CPU_OFFLOAD_V1") == "1":
        pytest.skip("this process runs TE's V1 engine (NVTE_CPU_OFFLOAD_V1=1)")
    stock, ours = _stock_and_ours(recipe)
    inputs = make_inputs(Config(splits=ALIGNED))
    reference = run_step(stock, inputs, "none")
    run = run_step(ours, inputs, engine)
    assert all(forward_plan(mlp) == UNFUSED for mlp in ours)  # no bf16 fused compute under a recipe
    _assert_same(reference, run)
    if engine != "none":
        assert _weight_bytes(run["moved"]) == 0, run["moved"]
        assert _activation_bytes(run["moved"]) > 0, run["moved"]


@requires_gpu
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_v1_engine_matches_and_moves_no_weight(recipe, tmp_path):
    _skip_unless_runs(recipe)
    out = tmp_path / "v1.pt"
    worker = Path(__file__).with_name("v1_step_worker.py")
    root = str(worker.parent.parent)
    env = dict(os.environ, NVTE_CPU_OFFLOAD_V1="1", TEO_TEST_RECIPE=recipe,
               TEO_TEST_SPLITS=",".join(map(str, ALIGNED)),
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(worker), str(out), "v1", "1", "1", "1"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = torch.load(out)
    assert all(plan == UNFUSED for plan in res["plans"])
    assert torch.equal(res["none"]["out"], res["v1"]["out"])
    for name, g in res["none"]["grads"].items():
        assert torch.equal(g, res["v1"]["grads"][name]), name
    moved = {tuple(k.split("|")): n for k, n in res["v1"]["moved"].items()}
    assert _weight_bytes(moved) == 0 and _activation_bytes(moved) > 0, moved


@requires_gpu
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_policy_on_quantized_saves(recipe):
    """Weights' FP8 workspaces stay; activations' FP8 data moves; an opted-out op keeps its own."""
    _skip_unless_runs(recipe)
    stack = make_stack(Config(splits=ALIGNED, recipe=recipe, offload=(False, True, True)))
    run = run_step(stack, make_inputs(Config(splits=ALIGNED)), "spy")
    entries = run["recorder"].entries
    weights = [e for e in entries if e.kind == "weight"]
    assert weights and all(e.kept for e in weights)  # FP8 weight copies are marked to stay
    assert _weight_bytes(run["moved"]) == 0
    assert _activation_bytes(run["moved"], ".fc1") == 0  # offload=False
    for layer in range(2):
        fc2_fp8 = [e for e in entries if e.op == f"L{layer}.fc2" and e.kind == "activation" and e.nbytes >= 2**18]
        assert fc2_fp8, "fc2 saved no large activation under FP8"
        # fc2's saved input is 1-byte FP8 data (its transpose for wgrad), moved whole
        assert all(e.nbytes == e.numel for e in fc2_fp8)
        assert _activation_bytes(run["moved"], f"L{layer}.fc2") >= sum(e.nbytes for e in fc2_fp8)


@requires_gpu
@pytest.mark.parametrize("recipe", [None, *FP8_RECIPES])
def test_offload_switch_takes_effect_at_the_next_step(recipe):
    """TE's fuser caches its plan per recipe; the switch is read at each forward. A twin stack that
    always offloads runs the same steps (delayed scaling changes its scales from step to step)."""
    _skip_unless_runs(recipe)
    stack = make_stack(Config(splits=ALIGNED, recipe=recipe))
    twin = make_stack(Config(splits=ALIGNED, recipe=recipe))
    inputs = make_inputs(Config(splits=ALIGNED))
    moved_fc1 = []
    for fc1_offload in (True, False, True):
        for mlp in stack:
            mlp[0].offload = fc1_offload
        run, reference = run_step(stack, inputs, "spy"), run_step(twin, inputs, "spy")
        _assert_same(reference, run)
        moved_fc1.append(_activation_bytes(run["moved"], ".fc1"))
        assert _activation_bytes(run["moved"], ".act") > 0
    assert moved_fc1[0] > 0 and moved_fc1[1] == 0 and moved_fc1[2] == moved_fc1[0], moved_fc1


@requires_gpu
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fused_path_says_why_it_declines(recipe, monkeypatch):
    _skip_unless_runs(recipe)
    monkeypatch.setenv(DISABLE_ENV, "1")
    mlp = make_stack(Config(layers=1, splits=ALIGNED, recipe=recipe))[0]
    reasons = dict(explain_fusion(mlp, recipe=make_recipe(recipe)))[0]
    assert any("recipe" in r and type(make_recipe(recipe)).__name__ in r for r in reasons), reasons
    x, probs, dy, splits = make_inputs(Config(layers=1, splits=ALIGNED))
    with quantized(recipe):
        mlp(x, splits, probs[0], splits).backward(dy)
    assert forward_plan(mlp) == UNFUSED


def _error_of(stack, inputs):
    try:
        run_step(stack, inputs, "none")
    except Exception as exc:  # noqa: BLE001 (the error itself is what is compared)
        return type(exc), str(exc).splitlines()[0]
    return None


@requires_gpu
@pytest.mark.parametrize("recipe", ALL_RECIPES)
def test_same_errors_as_te_ops(recipe):
    """Where TE's ops raise under a recipe (unaligned splits, a recipe cuBLAS has no algorithm for),
    ours raise the same, and the process runs a bf16 step afterwards. Float8BlockScaling on Hopper
    is the exception: ours runs it on the fused op's FP8 kernels, whatever TE's cuBLAS has."""
    _skip_unless_runs(recipe)
    fused_fp8 = recipe == "block" and fused_path_problem() is None
    for splits in ((0, 700, 1329, 19), ALIGNED):
        ours = make_stack(Config(splits=splits, recipe=recipe))
        stock = make_stack(Config(splits=splits, recipe=recipe, stock_te=True))
        copy_weights(ours, stock)
        inputs = make_inputs(Config(splits=splits))
        te_error = _error_of(stock, inputs)
        if fused_fp8:
            assert _error_of(ours, inputs) is None
            assert all(forward_plan(mlp) == ["FusedScaledSReLUMLP"] for mlp in ours)
            continue
        assert _error_of(ours, inputs) == te_error
        if te_error is None:
            _assert_same(run_step(stock, inputs, "none"), run_step(ours, inputs, "none"))
    torch.cuda.synchronize()
    plain = make_stack(Config(splits=ALIGNED))
    run = run_step(plain, make_inputs(Config(splits=ALIGNED)), "none")
    assert torch.isfinite(run["out"]).all()
