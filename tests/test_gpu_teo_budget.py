"""GPU: teo under a memory budget is exact, holds what it moves until its copies end, waits for
copies only where memory would pass the budget, leaves the last layer uncopied at n = L with room;
measure_budget measures a real step and follows its own timings."""

import pytest
import torch

from conftest import requires_gpu
from gpu_teo_steps import LAYERS, moved_by_layer, slow_copies_to_host
from mlp_steps import Config, assert_same, make_inputs, make_stack, run_step
from te_offload_ops.engines import active_engine, measure_budget, offload_context

if active_engine() == "v1":  # teo refuses a process running TE's V1 engine
    pytestmark = pytest.mark.skip(reason="this process runs TE's V1 engine (NVTE_CPU_OFFLOAD_V1=1), which teo refuses")


def _exact_steps_with_one_context(stack, inputs, base, num_layers, steps: int = 2, **options):
    """``steps`` steps through one teo context with ``options``, each bitwise equal to ``base``;
    returns the last step's run and the engine."""
    context = offload_context("teo", num_layers=num_layers, model_layers=len(stack), **options)
    for _ in range(steps):
        run = run_step(stack, inputs, "teo", offload_layers=num_layers, keep_grads=True, context=context)
        assert_same(base, run)
    return run, context[0].engine


@requires_gpu
def test_with_every_layer_offloaded_a_budget_with_room_leaves_the_last_layer_uncopied(path):
    """n = L under a budget with room: the last layer's saved tensors never cross PCIe (its
    backward, which comes first, uses them in place), every other layer's move as plain teo moves
    them, nothing is waited for, and two steps through one context are bitwise equal to no offload.
    (Under a tight budget its copies start when the budget needs their room: the test below.)"""
    cfg = Config(layers=LAYERS, experts=4, hidden=1024, ffn=768, splits=(1024, 0, 3000, 72))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    run_step(stack, inputs, "none")  # allocates the grads
    base = run_step(stack, inputs, "none", keep_grads=True)
    by_layer = moved_by_layer(run_step(stack, inputs, "teo", offload_layers=LAYERS, keep_grads=True)["moved"])
    assert by_layer.get(LAYERS - 1, 0) > 0  # plain teo moves the last layer too
    floor = torch.cuda.memory_allocated()
    _, engine = _exact_steps_with_one_context(stack, inputs, base, LAYERS, memory_budget=floor + (1 << 30))
    assert engine.budget_waits == 0
    assert engine.counter.total == 2 * sum(n for j, n in by_layer.items() if j != LAYERS - 1)


@requires_gpu
@pytest.mark.parametrize("num_layers", [LAYERS - 1, LAYERS])
def test_memory_budget_keeps_steps_exact_and_memory_at_the_budget(monkeypatch, num_layers, path):
    """memory_budget with slow copies, one context over two steps each. With room to spare nothing
    is waited for: the forward holds what it moves until the copies end, and reaches some peak.
    With a budget 24 MiB under that peak the engine must wait for copies (its count shows it), and
    the forward's peak stays within the budget plus what ops allocate between the engine's looks
    (the unfused ops' outputs, which nothing announces: well under 32 MiB here). Results bitwise
    equal to no offload either way."""
    cfg = Config(layers=LAYERS, experts=4, hidden=1024, ffn=768, splits=(1024, 0, 3000, 72))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    run_step(stack, inputs, "none")  # allocates the grads
    base = run_step(stack, inputs, "none", keep_grads=True)
    slow_copies_to_host(monkeypatch)
    floor = torch.cuda.memory_allocated()  # what run_step measures its peaks above (grads kept)
    run, loose = _exact_steps_with_one_context(stack, inputs, base, num_layers, memory_budget=floor + (1 << 30))
    held_peak = run["fwd_peak"]
    assert loose.budget_waits == 0
    budget = floor + held_peak - (24 << 20)
    run, engine = _exact_steps_with_one_context(stack, inputs, base, num_layers, memory_budget=budget)
    print(f"n={num_layers}: forward peak above the floor, holding until copied {held_peak / 2**20:.1f} MiB; budget "
          f"{(budget - floor) / 2**20:.1f} MiB above it: peak {run['fwd_peak'] / 2**20:.1f} MiB, waited for "
          f"{engine.budget_waits} copies ({engine.budget_wait_bytes / 2**20:.1f} MiB) over 2 steps")
    assert engine.budget_waits > 0
    assert floor + run["fwd_peak"] <= budget + (32 << 20)


@requires_gpu
def test_measure_budget_measures_a_real_step_and_follows_its_own_timings(path):
    """measure_budget on a step of three MLPs, two offloaded: the figures it measured give the target
    (no offload's peak less 0.96 of the bytes moved), the budget's compared steps peak within the
    target plus what ops allocate between the engine's looks, and its advice follows its timings."""
    from te_offload_ops.engines import target_budget

    cfg = Config(layers=LAYERS, experts=4, hidden=1024, ffn=768, splits=(1024, 0, 3000, 72))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    x, probs, dy, splits = inputs

    def step(ctx, sync):
        h = x * 1.0
        for i, mlp in enumerate(stack):
            with ctx:
                h = mlp(h, splits, probs[i], splits)
            h = sync(h)
        (h * dy).sum().backward()

    advice = measure_budget(step, num_layers=LAYERS - 1, model_layers=LAYERS, warmup_steps=2, compare_steps=3)
    print(advice)
    assert advice.floor_bytes > 0 and advice.no_offload_peak_bytes > advice.moved_bytes > 0
    assert advice.target_bytes == target_budget(floor_bytes=advice.floor_bytes, moved_bytes=advice.moved_bytes,
                                                no_offload_peak_bytes=advice.no_offload_peak_bytes,
                                                num_layers=LAYERS - 1, model_layers=LAYERS)
    assert advice.floor_bytes + advice.budget_peak_bytes <= advice.target_bytes + (32 << 20)
    assert (advice.budget is None) == (advice.budget_step_s > advice.default_step_s)
    assert advice.options() == ({} if advice.budget is None else {"memory_budget": advice.target_bytes})
