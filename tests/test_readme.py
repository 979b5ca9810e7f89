"""README's quick start runs as a reader copies it, block after block in one namespace (GPU, sm_90).

The ops under TE's V2 engine (activations reach the host, the three ops run as one fused op),
teo with the budget ``measure_budget`` advises, and the same layers under ``Float8BlockScaling``
(fused on the FP8 kernels). Megatron's snippet has its own test (``test_megatron.py``).
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch
from mlp_steps import forward_plan, fused_path_problem, recipe_problem

README = Path(__file__).resolve().parent.parent / "README.md"

_GPU_PROBLEM = fused_path_problem() or recipe_problem("block")


def _quick_start_blocks() -> list[str]:
    """README's python blocks from its quick start up to the Megatron snippet, in order."""
    text = README.read_text()
    section = text[text.index("## Quick start"):text.index("## Results")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return [b for b in blocks if "TransformerConfig(" not in b]


def test_the_quick_start_is_three_blocks_of_valid_python():
    """Without a GPU too: the blocks the GPU test runs are there and parse."""
    blocks = _quick_start_blocks()
    assert len(blocks) == 3
    for code in blocks:
        compile(code, "README.md", "exec")
    assert 'offload_context("v2"' in blocks[0] and "measure_budget(step" in blocks[1]
    assert "Float8BlockScaling()" in blocks[2]


@pytest.mark.skipif(_GPU_PROBLEM is not None, reason=_GPU_PROBLEM or "")
def test_the_quick_start_offloads_fuses_budgets_and_runs_fp8_as_written():
    blocks = _quick_start_blocks()
    assert len(blocks) == 3, [b.splitlines()[0] for b in blocks]
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(blocks[0], "README.md quick start", "exec"), scope)  # noqa: S102 (the docs' own code)
    torch.cuda.synchronize()
    assert scope["counter"].total > 0 and scope["x"].grad is not None
    assert scope["teops"].fused.explain_fusion(scope["layers"][0]) == [(0, [])]  # one fused op, nothing against
    assert printed.getvalue().split()[0] == str(scope["counter"].total >> 20)

    exec(compile(blocks[1], "README.md budget", "exec"), scope)  # noqa: S102
    advice = scope["advice"]
    assert isinstance(advice.options(), dict)
    scope["x"].grad = None
    scope["step"](scope["ctx"], scope["sync"])  # a step under teo's context, as advised
    torch.cuda.synchronize()
    assert scope["counter"].total > 0 and torch.isfinite(scope["x"].grad).all()

    exec(compile(blocks[2], "README.md FP8", "exec"), scope)  # noqa: S102
    y = scope["y"]
    assert y.shape == scope["x"].shape and torch.isfinite(y).all()
    assert forward_plan(scope["layers"][0]) == ["FusedScaledSReLUMLP"]  # the FP8 kernels, fused
