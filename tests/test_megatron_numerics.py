"""CPU: the first-step numerics of ours against stock (benchmarks/megatron_gpt_numerics.py) apart
from the GPU runs: routing flips, comparisons, the noise, merging ranks, the bounds, and recording
and replaying routing through Megatron's RouterReplay on stand-in MoE layers (those skip without
Megatron-Core).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import megatron_gpt_numerics as mn  # noqa: E402


def megatron_problem() -> str | None:
    try:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function  # noqa: F401
        from megatron.core.transformer.moe.router_replay import RouterReplay  # noqa: F401
    except ImportError as exc:
        return f"needs Megatron-Core ({exc})"
    return None


requires_megatron = pytest.mark.skipif(megatron_problem() is not None, reason=megatron_problem() or "")


# -- flips, comparisons, noise -------------------------------------------------------------------


def test_a_token_flips_when_its_set_of_experts_differs_not_its_order():
    a = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    b = torch.tensor([[1, 0], [2, 4], [4, 5], [7, 1]])  # same set, one differs, same, one differs
    assert mn.flipped_tokens(a, b) == 2 and mn.flipped_tokens(a, a) == 0
    with pytest.raises(ValueError, match=r"top-k shapes differ: \(4, 2\) and \(4, 1\)"):
        mn.flipped_tokens(a, b[:, :1])


def test_flips_add_up_over_each_layers_calls():
    x = torch.tensor([[0, 1], [2, 3]])
    y = torch.tensor([[0, 2], [2, 3]])
    layers_a = [[x, x], [x, x, x]]
    layers_b = [[y, y], [x, y, y]]
    assert mn.flips_per_layer(layers_a, layers_b) == [2, 2]
    assert mn.tokens_per_layer(layers_a) == [4, 6]
    with pytest.raises(ValueError, match="differ in layers or calls"):
        mn.flips_per_layer(layers_a, [[y, y], [x]])


def test_compare_finds_the_worst_key_and_a_missing_one_is_worst():
    ref = {"a": torch.ones(4), "b": torch.full((4,), 2.0), "c": torch.ones(2)}
    got = {"a": torch.ones(4), "b": torch.full((4,), 2.2), "c": torch.ones(3)}
    cmp = mn.compare(got, ref)
    assert cmp["a"] == {"rel_err": 0.0, "equal": True} and cmp["b"]["rel_err"] == pytest.approx(0.1, rel=1e-5)
    assert cmp["c"]["missing"]
    assert mn.summary(cmp) == {"max_rel_err": None, "worst": "c", "all_equal": False, "keys": 3}
    same = mn.summary(mn.compare(ref, ref))
    assert same["all_equal"] and same["max_rel_err"] == 0.0
    assert mn.summary({})["keys"] == 0


def test_the_noise_has_the_relative_size_asked_and_passes_the_gradient_through():
    y = torch.randn(256, 512, dtype=torch.bfloat16).requires_grad_()
    noisy = mn.perturbed(y, 5e-3, torch.Generator().manual_seed(3))
    assert 0.9 * 5e-3 <= mn.rel_err(noisy.detach(), y.detach()) <= 1.1 * 5e-3
    again = mn.perturbed(y, 5e-3, torch.Generator().manual_seed(3))
    assert torch.equal(noisy, again)  # the same seed, the same noise: the runs with and without replay match
    noisy.float().sum().backward()
    assert torch.equal(y.grad, torch.ones_like(y))


@pytest.mark.parametrize("rel", [1e-3, 3e-4, 2e-2])
def test_noise_below_the_bf16_rounding_step_still_reaches_the_size_asked(rel):
    """Added in bf16 as is, noise of 1e-3 reaches about 5e-4 and 3e-4 nothing at all."""
    y = torch.randn(256, 512, dtype=torch.bfloat16)
    plain = y + (y.float() * torch.randn(y.shape, generator=torch.Generator().manual_seed(4)) * rel).to(y.dtype)
    if rel < 2e-3:
        assert mn.rel_err(plain, y) < 0.75 * rel  # what the correction is for
    noisy = mn.perturbed(y, rel, torch.Generator().manual_seed(4))
    assert 0.9 * rel <= mn.rel_err(noisy, y) <= 1.1 * rel


def test_noise_of_size_zero_leaves_the_output_as_it_is():
    y = torch.randn(64, 64, dtype=torch.bfloat16)
    assert torch.equal(mn.perturbed(y, 0.0, torch.Generator().manual_seed(5)), y)


# -- across ranks and the bounds -----------------------------------------------------------------


def _rank(flips_ours=(0, 5), err=None, equal=True, input_equal=True, loss_ours=1e-4, replay_flips=(0, 0)):
    err = {"stock_replay": 0.0, "ours": 0.2, "noise": 0.15, "ours_replay": 0.01, "noise_replay": 0.004,
           **(err or {})}
    return {
        "tokens": [100, 100],
        "flips": {"stock_replay": [0, 0], "ours": list(flips_ours), "noise": [0, 4], "ours_replay": list(replay_flips),
                  "noise_replay": [0, 0]},
        "moe0_input_equal": input_equal, "moe0_output_rel_err": 5e-3, "noise_rel_achieved": 5.2e-3,
        "losses": {"stock": 10.0, "ours": 10.0 + loss_ours * 10},
        "loss_rel_err": {"stock_replay": 0.0, "ours": loss_ours, "noise": 1e-4, "ours_replay": 1e-4,
                         "noise_replay": 1e-5},
        "grads": {name: {"max_rel_err": e, "worst": f"w.{name}", "all_equal": name == "stock_replay" and equal,
                         "keys": 30} for name, e in err.items()},
    }


def test_ranks_merge_to_summed_flips_and_the_worst_rank():
    merged = mn.merge_ranks([_rank(), _rank(flips_ours=(0, 7), err={"ours": 0.3}, equal=False)])
    assert merged["ranks"] == 2 and merged["tokens"] == [200, 200]
    assert merged["flips"]["ours"] == [0, 12] and merged["flips"]["noise"] == [0, 8]
    assert merged["grads"]["ours"]["max_rel_err"] == 0.3 and merged["grads"]["ours"]["worst"] == "w.ours"
    assert merged["grads"]["stock_replay"]["all_equal"] is False
    assert mn.merge_ranks([_rank(), {"error": "RuntimeError: boom"}]) == {"error": "RuntimeError: boom"}
    assert "no rank" in mn.merge_ranks([])["error"]


def test_the_bounds_hold_on_a_sound_result():
    found = mn.checks(mn.merge_ranks([_rank(), _rank()]), ep=2)
    assert len(found) == 5 and all(c["met"] for c in found), found
    assert all("(EP=2)" in c["check"] for c in found)


@pytest.mark.parametrize("change, which", [
    (dict(input_equal=False), "layer 0"),
    (dict(flips_ours=(1, 5)), "layer 0"),  # the first layer's routing depends on nothing of ours
    (dict(equal=False), "replaying its own routing"),
    (dict(loss_ours=6e-3), "first loss"),
    (dict(err={"ours_replay": 0.05}), "with stock's routing"),  # above 3e-2 and 3x its floor of 0.004
    (dict(replay_flips=(0, 1)), "with stock's routing"),  # the replay did not hold
    (dict(err={"ours": 0.5}), "with its own routing"),  # above 3x the floor of 0.15
])
def test_each_bound_fails_on_what_it_guards(change, which):
    found = mn.checks(mn.merge_ranks([_rank(**change)]), ep=1)
    failed = [c["check"] for c in found if not c["met"]]
    assert len(failed) == 1 and which in failed[0], found


def test_the_grad_bound_is_the_larger_of_the_tolerance_and_the_floor_multiple():
    assert mn.grad_bound(None) == mn.GRAD_REL_TOL and mn.grad_bound(0.001) == mn.GRAD_REL_TOL
    assert mn.grad_bound(0.15) == pytest.approx(0.45)
    assert mn.checks({"error": "x" * 300}, 1)[0]["met"] is False


# -- routing record and replay, MoE hooks (stand-in layers, Megatron's routing code) -------------


class Router(torch.nn.Module):
    """A stand-in for Megatron's TopKRouter: gating weights, Megatron's top-k routing, a RouterReplay."""

    def __init__(self, hidden: int, experts: int, k: int, replay: bool = True):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden) / hidden**0.5)
        self.k = k
        self.router_replay = RouterReplay() if replay else None

    def forward(self, x):
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        return topk_routing_with_score_function(x @ self.weight.t(), self.k, router_replay=self.router_replay)


class MoE(torch.nn.Module):
    def __init__(self, hidden: int, experts: int, k: int, replay: bool = True):
        super().__init__()
        self.router = Router(hidden, experts, k, replay)
        self.experts = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        probs, routing_map = self.router(x)
        gate = (probs * routing_map).sum(-1, keepdim=True) + routing_map.float().argmax(-1, keepdim=True) / 8
        return (torch.tanh(self.experts(x)) * gate).to(x.dtype), None


class Model(torch.nn.Module):
    def __init__(self, layers=3, hidden=32, experts=8, k=2, replay=True):
        super().__init__()
        self.layers = torch.nn.ModuleList(MoE(hidden, experts, k, replay) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)[0]
        return x


def _step(model, xs, **tape):
    """Two calls (micro-batches) with grads; returns (outputs, grads, tape)."""
    for p in model.parameters():
        p.grad = None
    with mn.RoutingTape(model, **tape) as t:
        outs = [model(x) for x in xs]
        sum(o.square().sum() for o in outs).backward()
    return [o.detach() for o in outs], {n: p.grad.clone() for n, p in model.named_parameters()}, t


@requires_megatron
def test_replaying_a_models_own_routing_reproduces_it_bitwise():
    torch.manual_seed(0)
    model = Model()
    xs = [torch.randn(64, 32) for _ in range(2)]
    outs, grads, recorded = _step(model, xs)
    assert [len(calls) for calls in recorded.topk] == [2, 2, 2] and recorded.topk[0][0].shape == (64, 2)
    outs2, grads2, replayed = _step(model, xs, replay=recorded.topk)
    assert all(torch.equal(a, b) for a, b in zip(outs, outs2))
    assert all(torch.equal(grads[n], grads2[n]) for n in grads)
    assert mn.flips_per_layer(replayed.topk, recorded.topk) == [0, 0, 0]


def _model_and_a_perturbed_copy():
    """A model, a copy with every weight off by about 5% (it routes some tokens otherwise), and inputs."""
    torch.manual_seed(1)
    model = Model()
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1 + 0.05 * torch.randn_like(p))
    return model, other, [torch.randn(256, 32) for _ in range(2)]


@requires_megatron
def test_a_replay_routes_a_perturbed_model_as_the_recorded_one_and_trains_its_router():
    from megatron.core.transformer.moe.router_replay import RouterReplay

    model, other, xs = _model_and_a_perturbed_copy()
    _, _, recorded = _step(model, xs)
    _, _, own = _step(other, xs)
    assert sum(mn.flips_per_layer(own.topk, recorded.topk)) > 0  # the perturbation moves tokens...
    _, grads, held = _step(other, xs, replay=recorded.topk)
    assert mn.flips_per_layer(held.topk, recorded.topk) == [0, 0, 0]  # ...which the replay holds
    assert all(grads[f"layers.{i}.router.weight"].abs().sum() > 0 for i in range(3))  # probs from its own logits
    routers = [layer.router for layer in other.layers]
    assert all(r.router_replay.router_replay_action is None for r in routers)  # routing on its own again
    assert not any(r.router_replay in RouterReplay.global_router_replay_instances for r in routers)


@requires_megatron
def test_a_replay_must_cover_every_call_and_every_router():
    torch.manual_seed(2)
    model = Model()
    xs = [torch.randn(16, 32) for _ in range(2)]
    _, _, recorded = _step(model, xs)
    with pytest.raises(RuntimeError, match="router 0 called 2 times; the replay holds 1 calls"):
        _step(model, xs, replay=[calls[:1] for calls in recorded.topk])
    with pytest.raises(RuntimeError, match=r"called \[1, 1, 1\] times; the replay holds \[2, 2, 2\]"):
        _step(model, xs[:1], replay=recorded.topk)
    with pytest.raises(ValueError, match="the replay has 2 layers, the model 3 routers"):
        mn.RoutingTape(model, replay=recorded.topk[:2])
    with pytest.raises(ValueError, match="moe_enable_routing_replay=True"):
        mn.RoutingTape(Model(replay=False))
    with pytest.raises(ValueError, match="no MoE router"):
        mn.RoutingTape(torch.nn.Linear(2, 2))


class BypassingRouter(Router):
    """Has a RouterReplay but routes by its own top-k (as a fused router would)."""

    def forward(self, x):
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        return topk_routing_with_score_function(x @ self.weight.t(), self.k)


@requires_megatron
def test_a_router_that_bypasses_the_replay_is_caught_not_counted_as_held():
    model, other, xs = _model_and_a_perturbed_copy()
    _, _, recorded = _step(model, xs)
    for layer in other.layers:
        layer.router.__class__ = BypassingRouter
    with pytest.raises(RuntimeError, match="router 0 routed tokens to experts outside the top-k it was given"):
        _step(other, xs, replay=recorded.topk)
    with pytest.raises(RuntimeError, match="router 0 routed without its RouterReplay"):
        _step(other, xs)


@requires_megatron
def test_moe_hooks_keep_the_first_layers_traffic_and_perturb_every_layer():
    torch.manual_seed(3)
    model = Model().to(torch.bfloat16)
    x = torch.randn(128, 32, dtype=torch.bfloat16)
    with mn.MoEHooks(model, watch=True) as plain:
        y = model(x)
    assert len(plain.inputs) == 1 and torch.equal(plain.inputs[0], x) and plain.achieved == []
    with mn.MoEHooks(model, noise=1e-2, seed=5) as noisy:
        y_noisy = model(x)
    with mn.MoEHooks(model, noise=1e-2, seed=5):
        y_again = model(x)
    assert len(noisy.achieved) == 3 and all(8e-3 < a < 1.3e-2 for a in noisy.achieved)
    assert not torch.equal(y, y_noisy) and torch.equal(y_noisy, y_again)
    assert torch.equal(model(x), y)  # the hooks are gone
    with pytest.raises(ValueError, match="no MoE layer"):
        mn.MoEHooks(torch.nn.Linear(2, 2))
