"""Our experts against stock in a Megatron GPTModel's first training step, with routing set apart.

Our fused kernels and TE's unfused ops round differently in bf16 (an MoE layer's output differs
by a few 1e-3). A token whose top-k is near a tie can then pick another expert in a later layer;
whole tokens reach other experts, and those experts' weight grads change wholesale. So the grads
are compared three ways, from the same weights and tokens:

* where the inputs are the same, exactly: the first MoE layer's input and its routing;
* with the routing held: ours replaying stock's top-k (Megatron's ``RouterReplay``) against stock,
  which leaves our kernels' rounding alone;
* each with its own routing, against a measured noise floor: stock with every MoE layer's output
  perturbed by random noise of the size of ours' difference at the first MoE layer.

:func:`measure` runs one first step of each of ``RUNS`` on a rank (the ``stock`` run records every
router's top-k; ``stock_replay`` replays it into stock, which must reproduce stock bitwise, or the
replay changed more than the routing) and returns what it found; :func:`merge_ranks` sums flips
and takes the worst errors over ranks; :func:`checks` states the bounds. Comparisons, flip counts,
merging and checks need no GPU (tests/test_megatron_numerics.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Optional

LOSS_REL_TOL = 5e-3  # the first step's loss, ours against stock
GRAD_REL_TOL = 3e-2  # a grad's relative error that passes whatever the noise floor
FLOOR_RATIO = 3.0  # ... else at most this many times the noise floor's worst
# the first step of each; "noise": stock with every MoE layer's output perturbed (see above)
RUNS = ("stock", "stock_replay", "ours", "noise", "ours_replay", "noise_replay")


# -- comparisons (no GPU) ------------------------------------------------------------------------


def rel_err(a, b) -> float:
    """||a - b|| / ||b|| in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def compare(a: dict, b: dict) -> dict:
    """Per key of ``b``: relative error and bitwise equality of ``a``'s tensor against ``b``'s."""
    import torch

    out = {}
    for k in b:
        if a.get(k) is None or b[k] is None or a[k].shape != b[k].shape:
            out[k] = {"rel_err": None, "equal": False, "missing": True}
        else:
            out[k] = {"rel_err": rel_err(a[k], b[k]), "equal": bool(torch.equal(a[k], b[k]))}
    return out


def summary(comparison: dict) -> dict:
    """The worst relative error over the keys (a missing key is the worst), its key, and whether
    every key is equal."""
    if not comparison:
        return {"max_rel_err": None, "worst": None, "all_equal": False, "keys": 0}
    worst = max(comparison.items(), key=lambda kv: float("inf") if kv[1]["rel_err"] is None else kv[1]["rel_err"])
    return {"max_rel_err": worst[1]["rel_err"], "worst": worst[0],
            "all_equal": all(v["equal"] for v in comparison.values()), "keys": len(comparison)}


def flipped_tokens(a, b) -> int:
    """Tokens whose set of experts differs between two [tokens, k] top-k index tensors (the order
    within a token's k does not matter: the routing map is the same)."""
    if a.shape != b.shape:
        raise ValueError(f"top-k shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    return int((a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1).sum())


def flips_per_layer(a: list, b: list) -> list:
    """Per router (layer): tokens routed differently, over all its calls (micro-batches).
    ``a`` and ``b``: per router, the list of its calls' top-k index tensors."""
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise ValueError(f"the routings differ in layers or calls: {[len(x) for x in a]} and {[len(y) for y in b]}")
    return [sum(flipped_tokens(x, y) for x, y in zip(xs, ys)) for xs, ys in zip(a, b)]


def tokens_per_layer(topk: list) -> list:
    return [sum(int(t.shape[0]) for t in calls) for calls in topk]


def perturbed(y, rel: float, generator, tries: int = 40):
    """``y`` plus random noise whose ``rel_err`` against ``y`` after rounding to ``y``'s dtype is
    ``rel`` (within 10% where ``tries`` steps of the search reach it); the gradient passes through
    unchanged.

    Rounding to bf16 swallows a perturbation below half a unit in the last place (about 2e-3
    relative), so noise added as asked reaches about 5e-4 at 1e-3 and nothing at 3e-4. For one
    draw of the noise the rounded perturbation grows with its scale, so the scale that reaches
    ``rel`` is searched for: doubling up to a bracket, then bisection."""
    import torch

    if rel <= 0:  # nothing to match (ours equal to stock): no noise
        return y + torch.zeros_like(y)
    noise = torch.randn(y.shape, generator=generator, device=y.device, dtype=torch.float32)
    base = y.detach()

    def attempt(scale):
        delta = (base.float() * noise * scale).to(y.dtype)
        return rel_err(base + delta, base), delta

    lo, hi = 0.0, None  # scales known to reach less than rel, and at least rel
    scale, best = rel, None
    for _ in range(tries):
        reached, delta = attempt(scale)
        if best is None or abs(reached - rel) < best[0]:
            best = (abs(reached - rel), delta)
        if abs(reached / rel - 1.0) <= 0.1:
            break
        if reached < rel:
            lo = scale
            scale = 2.0 * scale if hi is None else 0.5 * (scale + hi)
        else:
            hi = scale
            scale = 0.5 * (lo + scale)
    return y + best[1]


# -- across ranks, and the bounds (no GPU) -------------------------------------------------------


def merge_ranks(per_rank: list) -> dict:
    """One result from every rank's :func:`measure`: flips and tokens summed, equalities all-ranks,
    errors the worst rank's; an error on any rank makes the result that error."""
    if not per_rank:
        return {"error": "no rank wrote a result"}
    errors = [r["error"] for r in per_rank if "error" in r]
    if errors:
        return {"error": errors[0]}
    first = per_rank[0]

    def summed(get):
        return [sum(vals) for vals in zip(*(get(r) for r in per_rank))]

    grads = {}
    for name in first["grads"]:
        rows = [r["grads"][name] for r in per_rank]
        worst = max(rows, key=lambda s: float("inf") if s["max_rel_err"] is None else s["max_rel_err"])
        grads[name] = {**worst, "all_equal": all(s["all_equal"] for s in rows), "keys": min(s["keys"] for s in rows)}
    return {
        "ranks": len(per_rank),
        "tokens": summed(lambda r: r["tokens"]),
        "flips": {name: summed(lambda r, n=name: r["flips"][n]) for name in first["flips"]},
        "moe0_input_equal": all(r["moe0_input_equal"] for r in per_rank),
        "moe0_output_rel_err": max(r["moe0_output_rel_err"] for r in per_rank),
        "noise_rel_achieved": max(r["noise_rel_achieved"] for r in per_rank),
        "loss_rel_err": {name: max(r["loss_rel_err"][name] for r in per_rank) for name in first["loss_rel_err"]},
        "grads": grads,
    }


def grad_bound(floor: Optional[float]) -> float:
    """What a compared run's worst grad error may reach against a noise floor's worst."""
    return max(GRAD_REL_TOL, FLOOR_RATIO * (floor or 0.0))


def checks(merged: dict, ep: int) -> list:
    """The bounds on a merged result, each {"check", "value", "met"} (met None where not measured)."""
    if "error" in merged:
        return [{"check": f"first-step numerics against stock (EP={ep})", "value": merged["error"][:200],
                 "met": False}]
    g, flips, tokens = merged["grads"], merged["flips"], merged["tokens"]
    replay = g["stock_replay"]

    def err(name):
        return g[name]["max_rel_err"]

    out = [
        {"check": f"layer 0: ours gets stock's MoE input and routing, bitwise (EP={ep})",
         "value": f"input {'equal' if merged['moe0_input_equal'] else 'differs'}, "
                  f"{flips['ours'][0]} of {tokens[0]} tokens routed otherwise",
         "met": merged["moe0_input_equal"] and flips["ours"][0] == 0},
        {"check": f"stock replaying its own routing reproduces stock bitwise (EP={ep})",
         "value": f"loss rel err {merged['loss_rel_err']['stock_replay']:.1e}, grads "
                  f"{'equal' if replay['all_equal'] else 'differ, worst ' + str(replay['worst'])}",
         "met": replay["all_equal"] and merged["loss_rel_err"]["stock_replay"] == 0
                and not any(flips["stock_replay"])},
        {"check": f"ours' first loss within {LOSS_REL_TOL:g} of stock's (EP={ep})",
         "value": merged["loss_rel_err"]["ours"], "met": merged["loss_rel_err"]["ours"] <= LOSS_REL_TOL},
    ]
    for run, floor, what in (("ours_replay", "noise_replay", "with stock's routing"),
                             ("ours", "noise", "with its own routing")):
        bound = grad_bound(err(floor))
        out.append({"check": f"ours' grads {what} within max({GRAD_REL_TOL:g}, {FLOOR_RATIO:g}x noise floor) of "
                             f"stock's (EP={ep})",
                    "value": f"{err(run):.3g} ({g[run]['worst']}) vs floor {err(floor):.3g}",
                    "met": err(run) is not None and err(run) <= bound
                           and (run != "ours_replay" or not any(flips["ours_replay"]))})
    return out


# -- on the GPU: routing tape, MoE layer hooks, one first step -----------------------------------


def moe_routers(model) -> list:
    """The model's MoE routers (Megatron's TopKRouter: modules with a ``router_replay`` slot), in
    layer order."""
    return [m for m in model.modules() if hasattr(m, "router_replay")]


def moe_layers(model) -> list:
    """The model's MoE layers (modules with a router and experts), in layer order."""
    return [m for m in model.modules() if hasattr(m, "router") and hasattr(m, "experts")]


class RoutingTape:
    """Each router's top-k expert indices per call, in call order: recorded from the model, or
    replayed into it from another run's tape (``replay``: per router, its calls' indices).

    Uses Megatron's ``RouterReplay``, so the model's config needs ``moe_enable_routing_replay``
    (and not ``moe_router_fusion``, whose fused top-k does not replay). A context manager; on
    exit the routers route on their own again. ``topk`` holds what each call routed by."""

    def __init__(self, model, replay: Optional[list] = None):
        self.routers = moe_routers(model)
        if not self.routers:
            raise ValueError("the model has no MoE router")
        if any(r.router_replay is None for r in self.routers):
            raise ValueError("the routers have no RouterReplay: build the model with moe_enable_routing_replay=True")
        if any(getattr(getattr(r, "config", None), "moe_router_fusion", False) for r in self.routers):
            raise ValueError("moe_router_fusion's fused top-k bypasses RouterReplay: turn it off to record or replay")
        if replay is not None and len(replay) != len(self.routers):
            raise ValueError(f"the replay has {len(replay)} layers, the model {len(self.routers)} routers")
        self.replay = replay
        self.topk = [[] for _ in self.routers]
        self._handles = []

    def __enter__(self):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        action = RouterReplayAction.RECORD if self.replay is None else RouterReplayAction.REPLAY_FORWARD
        for i, router in enumerate(self.routers):
            router.router_replay.clear_indices()
            router.router_replay.set_router_replay_action(action)
            if self.replay is not None:
                self._handles.append(router.register_forward_pre_hook(self._give(i)))
            self._handles.append(router.register_forward_hook(self._take(i)))
        return self

    def _give(self, i: int):
        def hook(router, args):
            call = len(self.topk[i])
            if call >= len(self.replay[i]):
                raise RuntimeError(f"router {i} called {call + 1} times; the replay holds {len(self.replay[i])} calls")
            router.router_replay.set_target_indices(self.replay[i][call].to(args[0].device))
        return hook

    def _take(self, i: int):
        def hook(router, args, output):
            replay = router.router_replay
            used = replay.target_topk_idx if self.replay is not None else replay.recorded_topk_idx
            if used is None:
                raise RuntimeError(f"router {i} routed without its RouterReplay: nothing was recorded")
            self._check_routed(i, output, used)
            self.topk[i].append(used.detach().clone())
            replay.clear_indices()  # drops the replay's own list of what it was given
        return hook

    def _check_routed(self, i: int, output, used) -> None:
        """The tape holds what the router was meant to route by; a router that routed by anything
        else (a path that bypasses RouterReplay) would make every flip count of a replay read 0.
        Megatron's routers return (probs, routing_map [tokens, experts]): no token may go to an
        expert outside its top-k (a subset, so dropped tokens pass)."""
        import torch

        routing_map = output[1] if isinstance(output, (tuple, list)) and len(output) > 1 else None
        if not (torch.is_tensor(routing_map) and routing_map.dtype == torch.bool and routing_map.dim() == 2
                and routing_map.shape[0] == used.shape[0]):
            return
        chosen = torch.zeros_like(routing_map).scatter(1, used.to(routing_map.device), True)
        if bool((routing_map & ~chosen).any()):
            raise RuntimeError(f"router {i} routed tokens to experts outside the top-k it "
                               f"{'was given' if self.replay is not None else 'recorded'}: RouterReplay was bypassed")

    def __exit__(self, *exc):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        for h in self._handles:
            h.remove()
        for router in self.routers:
            router.router_replay.clear_router_replay_action()
            router.router_replay.clear_indices()
            with contextlib.suppress(ValueError):  # Megatron's list of every instance keeps them alive
                RouterReplay.global_router_replay_instances.remove(router.router_replay)
        if self.replay is not None and exc[0] is None:
            used, given = [len(t) for t in self.topk], [len(t) for t in self.replay]
            if used != given:
                raise RuntimeError(f"the routers were called {used} times; the replay holds {given} calls")
        return False


class MoEHooks:
    """Forward hooks on a model's MoE layers: keep the first layer's inputs and outputs per call
    (``watch``), and perturb every layer's output by :func:`perturbed` noise of relative size
    ``noise`` (``achieved``: the relative size each perturbation reached after rounding)."""

    def __init__(self, model, *, watch: bool = False, noise: Optional[float] = None, seed: int = 0):
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("the model has no MoE layer")
        self.watch, self.noise, self.seed = watch, noise, seed
        self.inputs, self.outputs, self.achieved = [], [], []
        self._handles, self._calls = [], 0

    def __enter__(self):
        if self.watch:
            self._handles.append(self.layers[0].register_forward_hook(self._keep))
        if self.noise is not None:
            for i, layer in enumerate(self.layers):
                self._handles.append(layer.register_forward_hook(self._perturb(i)))
        return self

    def _keep(self, layer, args, output):
        self.inputs.append(args[0].detach().clone())
        self.outputs.append(output[0].detach().clone())

    def _perturb(self, i: int):
        import torch

        def hook(layer, args, output):
            out, bias = output
            self._calls += 1
            g = torch.Generator(device=out.device).manual_seed(self.seed * 1_000_003 + 1009 * i + self._calls)
            noisy = perturbed(out, self.noise, g)
            self.achieved.append(rel_err(noisy.detach(), out.detach()))
            return noisy, bias
        return hook

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return False


def first_step(shape, variant, ep: int, weights: dict, batches: list, *, replay=None, noise=None, seed: int = 0,
               watch: bool = False) -> dict:
    """One training step's forward and backward (no optimizer step) of a GPTModel built from
    ``weights`` under ``variant``, with routing recorded or replayed: loss, every main_grad after
    the reduce, the top-k per layer and call, and (``watch``) the first MoE layer's inputs and outputs."""
    import torch

    from megatron_gpt_model import build_gpt, make_config, release, train_step, wrap_for_training

    variant = replace(variant, extra={**variant.extra, "moe_enable_routing_replay": True})
    config = make_config(shape, variant, ep)
    model = build_gpt(shape, config, variant.ours, weights)
    ddp, _ = wrap_for_training(model, config, optimizer=False)
    grads = {}

    def read_grads(ddp_model):
        grads.update({n: p.main_grad.detach().clone() for n, p in ddp_model.module.named_parameters()})

    with RoutingTape(model, replay) as tape, MoEHooks(model, watch=watch, noise=noise, seed=seed) as hooks:
        loss = train_step(ddp, None, shape, batches, after_backward=read_grads)
    torch.cuda.synchronize()
    out = {"loss": loss, "grads": grads, "topk": [[t.cpu() for t in calls] for calls in tape.topk],
           "moe0_in": hooks.inputs, "moe0_out": hooks.outputs,
           "noise_rel": sum(hooks.achieved) / len(hooks.achieved) if hooks.achieved else None}
    del ddp, model
    release(config)
    return out


def measure(shape, ep: int, weights: dict, batches: list, *, seed: int = 0, log=None) -> dict:
    """The runs of ``RUNS`` from ``weights`` on ``batches`` (this rank's), each compared with stock
    as it ends (only stock's grads stay in memory)."""
    import torch

    from megatron_gpt_model import Variant

    log = log or (lambda text: None)
    stock_v, ours_v = Variant(ours=False), Variant(ours=True)
    stock = first_step(shape, stock_v, ep, weights, batches, watch=True)
    log(f"numerics: stock, loss {stock['loss']:.6f}")
    result = {"tokens": tokens_per_layer(stock["topk"]), "flips": {}, "losses": {"stock": stock["loss"]},
              "loss_rel_err": {}, "grads": {}}

    def judge(name: str, run: dict) -> dict:
        result["flips"][name] = flips_per_layer(run["topk"], stock["topk"])
        result["losses"][name] = run["loss"]
        result["loss_rel_err"][name] = abs(run["loss"] - stock["loss"]) / max(abs(stock["loss"]), 1e-30)
        result["grads"][name] = summary(compare(run.pop("grads"), stock["grads"]))
        torch.cuda.empty_cache()
        return run

    judge("stock_replay", first_step(shape, stock_v, ep, weights, batches, replay=stock["topk"]))
    ours = judge("ours", first_step(shape, ours_v, ep, weights, batches, watch=True))
    # the noise is as large as ours' difference where both MoE layers see the same input
    size = sum(rel_err(o, s) for o, s in zip(ours["moe0_out"], stock["moe0_out"])) / len(stock["moe0_out"])
    result["moe0_input_equal"] = all(torch.equal(o, s) for o, s in zip(ours["moe0_in"], stock["moe0_in"]))
    result["moe0_output_rel_err"] = size
    del ours
    log(f"numerics: ours, loss {result['losses']['ours']:.6f}; the first MoE layer's output off by {size:.2e}, "
        f"tokens routed otherwise per layer {result['flips']['ours']} of {result['tokens']}")
    noise = judge("noise", first_step(shape, stock_v, ep, weights, batches, noise=size, seed=seed))
    result["noise_rel_achieved"] = noise["noise_rel"]
    log(f"numerics: noise of {noise['noise_rel']:.2e}: tokens routed otherwise per layer {result['flips']['noise']}")
    judge("ours_replay", first_step(shape, ours_v, ep, weights, batches, replay=stock["topk"]))
    judge("noise_replay", first_step(shape, stock_v, ep, weights, batches, replay=stock["topk"], noise=size,
                                     seed=seed))
    log("numerics: worst grad errors against stock: " + ", ".join(
        f"{n} {result['grads'][n]['max_rel_err']:.3g}" for n in RUNS[1:]))
    return result
