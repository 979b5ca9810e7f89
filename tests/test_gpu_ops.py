"""GPU: our ops compute exactly what TE's ops compute (bitwise), on uneven splits."""

import pytest
import torch

from conftest import requires_gpu
from mlp_steps import Config, forward_plan, make_inputs, make_stack, run_step
from te_offload_ops.fused.selection import DISABLE_ENV


@pytest.fixture(autouse=True)
def unfused(monkeypatch):
    """These tests compare with TE's unfused ops, so our ops run unfused too."""
    monkeypatch.setenv(DISABLE_ENV, "0")

SPLITS = [
    (0, 700, 1329, 19),        # one expert without tokens
    (512, 512, 512, 512),      # even
    (2048, 0, 0, 1),           # mostly empty experts
]


@requires_gpu
@pytest.mark.parametrize("splits", SPLITS, ids=["uneven-zero", "even", "sparse"])
@pytest.mark.parametrize("offload", [(True, True, True), (False, True, False)], ids=["offload", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_outputs_and_grads_equal_te_bitwise(splits, offload, dtype):
    cfg = Config(layers=1, splits=splits, offload=offload, dtype=dtype)
    ours = make_stack(cfg)
    stock = make_stack(Config(layers=1, splits=splits, dtype=dtype, stock_te=True))
    stock[0].load_state_dict(ours[0].state_dict())
    inputs = make_inputs(cfg)
    a = run_step(ours, inputs, "none")
    b = run_step(stock, inputs, "none")
    assert forward_plan(ours[0]) == ["GroupedLinear", "ScaledSReLU", "GroupedLinear"]
    assert torch.equal(a["out"], b["out"])
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name
    # Everything that needs a gradient got one (an expert with no tokens gets zeros).
    assert all(g is not None for g in a["grads"].values())
