"""GPU: teo's engine under its default schedule is exact, moves what the policy allows (never
weights), frees what it moves, reuses its pinned buffers and never synchronizes with the host."""

import pytest
import torch

from conftest import requires_gpu
from gpu_teo_steps import LAYERS, expected_bytes, moved_by_layer, slow_copies_to_host, slow_reloads
from mlp_steps import (POLICIES, Config, assert_moves_follow_policy, assert_same, check_path, make_inputs, make_stack,
                       run_step)
from te_offload_ops.engines import active_engine, offload_context
from te_offload_ops.engines.teo import default_pool

if active_engine() == "v1":  # teo refuses a process running TE's V1 engine
    pytestmark = pytest.mark.skip(reason="this process runs TE's V1 engine (NVTE_CPU_OFFLOAD_V1=1), which teo refuses")


@requires_gpu
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("num_layers", [1, LAYERS - 1, LAYERS])
def test_exact_and_moves_what_the_policy_allows(num_layers, policy, path):
    cfg = Config(layers=LAYERS, offload=POLICIES[policy])
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    base = run_step(stack, inputs, "none")
    run = run_step(stack, inputs, "teo", offload_layers=num_layers)
    check_path(stack, path)
    assert_same(base, run)  # outputs and every grad bitwise equal
    assert_moves_follow_policy(run["moved"], cfg.offload, run["recorder"].entries, list(range(num_layers)))
    by_layer = moved_by_layer(run["moved"])
    expected = {i: expected_bytes(run["recorder"], i) for i in range(num_layers)}
    print(f"{policy} n={num_layers}: moved per layer {by_layer}, expected {expected}")
    assert all(by_layer.get(i, 0) == 0 for i in range(num_layers, LAYERS)), by_layer
    assert {i: by_layer.get(i, 0) for i in range(num_layers)} == expected
    assert sum(expected.values()) > 0


@requires_gpu
@pytest.mark.parametrize("num_layers", [LAYERS - 1, LAYERS])
def test_memory_freed_matches_bytes_moved(num_layers, path):
    """At the end of forward (copies done) >= 95% of the moved bytes are free; at the forward's peak,
    >= 95% of what the layers before the last moved (the last layer's own saves are alive at its peak
    under either engine). The peak asserted is memory_allocated's, which counts a block as free once
    the engine drops it: it checks that the engine lets go of what it moves. (teo drops a layer's
    bytes only after a stream waited for their copy, so the allocator's active peak, printed, should
    agree; the benchmark reports that one.)"""
    cfg = Config(layers=LAYERS, experts=4, hidden=1024, ffn=768, splits=(1024, 0, 3000, 72))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    base = run_step(stack, inputs, "none")
    run = run_step(stack, inputs, "teo", offload_layers=num_layers)
    check_path(stack, path)
    by_layer = moved_by_layer(run["moved"])
    moved = sum(by_layer.values())
    before_last = sum(n for layer, n in by_layer.items() if layer < LAYERS - 1)
    end_of_forward = (base["fwd_mem"] - run["fwd_mem"]) / moved
    peak = (base["fwd_peak"] - run["fwd_peak"]) / before_last
    active = (base["fwd_active_peak"] - run["fwd_active_peak"]) / before_last
    print(f"n={num_layers}: moved {moved / 2**20:.1f} MiB ({before_last / 2**20:.1f} before the last layer); "
          f"freed at end of forward {end_of_forward:.2%} of it, at the peak {peak:.2%} of the earlier layers' "
          f"(active peak: {active:.2%})")
    assert end_of_forward >= 0.95
    assert peak >= 0.95


@requires_gpu
@pytest.mark.parametrize("num_layers", [1, LAYERS - 1, LAYERS])
def test_whole_step_peak_falls_by_what_moved(num_layers, path):
    """The default (peak-neutral) schedule: over forward and backward, with grads kept allocated
    from step to step (Megatron's main_grad buffers) and the output's grad made in the step, the
    allocator's active peak (blocks an in-flight copy still reads count) falls by >= 95% of the
    bytes moved. With every layer
    offloaded the layer whose backward comes first is on the GPU at the peak under any schedule:
    >= 95% of what the others moved."""
    cfg = Config(layers=LAYERS, experts=4, hidden=1024, ffn=768, splits=(1024, 0, 3000, 72))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    run_step(stack, inputs, "none")  # allocates the grads
    base = run_step(stack, inputs, "none", keep_grads=True)
    run = run_step(stack, inputs, "teo", offload_layers=num_layers, keep_grads=True)
    assert_same(base, run)
    by_layer = moved_by_layer(run["moved"])
    moved = sum(by_layer.values())
    counted = moved - (by_layer.get(LAYERS - 1, 0) if num_layers == LAYERS else 0)
    freed = base["step_active_peak"] - run["step_active_peak"]
    print(f"n={num_layers}: moved {moved / 2**20:.1f} MiB, whole-step active peak {base['step_active_peak'] / 2**20:.1f}"
          f" -> {run['step_active_peak'] / 2**20:.1f} MiB: freed {freed / moved:.2%} of the bytes moved")
    assert freed >= 0.95 * counted


@requires_gpu
def test_pinned_pool_does_not_grow_in_steady_state(path):
    cfg = Config(layers=LAYERS)
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    pool = default_pool()
    allocations = []
    for _ in range(3):  # a new context per step, as the benchmark's fallback does: the pool is shared
        run_step(stack, inputs, "teo", offload_layers=LAYERS)
        assert pool.in_use == 0  # every buffer went back when the backward ended
        allocations.append(pool.allocations)
    ctx, sync, _ = offload_context("teo", num_layers=LAYERS, model_layers=LAYERS)
    for _ in range(2):  # and one context reused from step to step
        _plain_step(stack, inputs, ctx, sync)
        allocations.append(pool.allocations)
    print(f"pinned allocations after each step: {allocations}, {pool.allocated_bytes / 2**20:.1f} MiB")
    assert allocations[1:] == [allocations[0]] * 4


def _plain_step(stack, inputs, ctx, sync):
    """Forward and backward with no host synchronization of its own."""
    x, probs, dy, splits = inputs
    h = x * 1.0
    for i, mlp in enumerate(stack):
        with ctx:
            h = mlp(h, splits, probs[i], splits)
        h = sync(h)
    h.backward(dy)


@requires_gpu
def test_no_host_synchronization(path):
    """A warm step under torch.cuda.set_sync_debug_mode("error"): any synchronizing call raises."""
    cfg = Config(layers=LAYERS)
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    none_ctx, none_sync, _ = offload_context("none", num_layers=0, model_layers=LAYERS)
    ctx, sync, counter = offload_context("teo", num_layers=LAYERS, model_layers=LAYERS)
    _plain_step(stack, inputs, none_ctx, none_sync)  # compile and warm up
    _plain_step(stack, inputs, ctx, sync)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        try:
            _plain_step(stack, inputs, none_ctx, none_sync)
        except RuntimeError as exc:
            pytest.skip(f"the {path} MLP step synchronizes by itself, without offload: {str(exc).splitlines()[0]}")
        counter.bytes.clear()
        _plain_step(stack, inputs, ctx, sync)  # raises on a synchronizing call
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert counter.total > 0


class _SavesViews(torch.autograd.Function):
    """Saves one buffer five ways: itself twice, a row range, its transpose, and a column slice."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, x, x[1:], x.t(), x[:, : x.shape[1] // 2])
        return x * 2

    @staticmethod
    def backward(ctx, g):
        a, b, rows, xt, cols = ctx.saved_tensors
        assert rows.shape == (a.shape[0] - 1, a.shape[1]) and xt.stride() == (1, a.shape[1])
        out = g * (a + b) + g * xt.t()
        out[1:] += rows
        out[:, : cols.shape[1]] += cols
        return out


@requires_gpu
def test_views_and_tensors_saved_twice_are_copied_once():
    x = torch.randn(1024, 512, device="cuda", requires_grad=True)  # 512 Ki elements
    g = torch.randn(1024, 512, device="cuda")
    ref = torch.autograd.grad(_SavesViews.apply(x * 1.0), x, g)[0]
    ctx, sync, counter = offload_context("teo", num_layers=1, model_layers=1)
    with ctx:
        y = _SavesViews.apply(x * 1.0)
    y = sync(y)
    got = torch.autograd.grad(y, x, g)[0]
    assert torch.equal(got, ref)
    # x twice, its rows and its transpose: one copy of x; the column slice has gaps and stays
    assert counter.total == x.numel() * x.element_size()


def _grads_of(stack, inputs):
    x, probs, _, _ = inputs
    return [t.grad.clone() for t in [x, *probs, *(q for mlp in stack for q in mlp.parameters())]]


def _zero_grads(stack, inputs):
    x, probs, _, _ = inputs
    for t in [x, *probs, *(q for mlp in stack for q in mlp.parameters())]:
        t.grad = None


@requires_gpu
@pytest.mark.parametrize("host_memory", ["pinned", "write-combined"])
@pytest.mark.parametrize("reload_ahead", [0, 2])
def test_slow_copies_and_reused_memory_keep_steps_exact(monkeypatch, path, reload_ahead, host_memory):
    """Cross-stream ordering under stress: every offload and reload copy is queued behind a ~1 ms
    sleep on its copy stream (so the compute stream runs far ahead), and after each forward the
    compute stream fills large fresh allocations with NaN (so a block handed out before its copy
    finished, or a pinned buffer overwritten while read, would poison the result). Three steps back
    to back with one context and no host synchronization: each bitwise equal to no offload; also
    with reloads started two layers ahead of peak-neutral, and with write-combined host buffers."""
    from te_offload_ops.engines.teo import pool as pool_mod

    pool = pool_mod.PinnedBufferPool(pool_mod._HOST_MEMORY[host_memory])
    monkeypatch.setattr(pool_mod, "_DEFAULT_POOL", pool)  # the engine's shared pool, for this test
    cfg = Config(layers=LAYERS)
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    none_ctx, none_sync, _ = offload_context("none", num_layers=0, model_layers=LAYERS)
    _zero_grads(stack, inputs)
    _plain_step(stack, inputs, none_ctx, none_sync)
    ref = _grads_of(stack, inputs)

    slow_copies_to_host(monkeypatch, ns=1_000_000)
    slow_reloads(monkeypatch, ns=1_000_000)
    ctx, sync, counter = offload_context("teo", num_layers=LAYERS, model_layers=LAYERS, reload_ahead=reload_ahead)
    x, probs, dy, splits = inputs
    results = []
    for _ in range(3):
        _zero_grads(stack, inputs)
        h = x * 1.0
        for i, mlp in enumerate(stack):
            with ctx:
                h = mlp(h, splits, probs[i], splits)
            h = sync(h)
        poison = [torch.full((64, 2**20), float("nan"), device="cuda") for _ in range(4)]  # 1 GiB
        del poison
        h.backward(dy)
        results.append(_grads_of(stack, inputs))  # clones queued on the compute stream, no sync
    torch.cuda.synchronize()
    assert counter.total > 0 and pool.allocations > 0
    for step, got in enumerate(results):
        for i, (a, b) in enumerate(zip(got, ref)):
            assert torch.equal(a, b), (step, i)


@requires_gpu
def test_copies_seen_ended_free_their_bytes_during_the_forward(monkeypatch, path):
    """A layer's bytes go back as its copies end, not at its release: one layer of four offloaded
    (released only at the last layer's entry), its copies slowed (20 ms each); after the second
    layer's forward the memory is lower by what layer 0 moved when the host waited for those
    copies before the second layer than when it did not."""
    cfg = Config(layers=4, experts=4, hidden=1024, ffn=768, splits=(1024, 0, 3000, 72))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    x, probs, _, splits = inputs
    slow_copies_to_host(monkeypatch, ns=20_000_000)
    mems = []
    for wait in (False, True):
        ctx, sync, counter = offload_context("teo", num_layers=1, model_layers=4)
        torch.cuda.synchronize()
        with ctx:
            h = stack[0](x * 1.0, splits, probs[0], splits)
        h = sync(h)
        if wait:
            torch.cuda.synchronize()  # layer 0's copies are over: the next save sees it
        with ctx:
            h = stack[1](h, splits, probs[1], splits)
        h = sync(h)
        mems.append(torch.cuda.memory_allocated())
        del h
        ctx.engine.abandon_step()
        torch.cuda.synchronize()
    moved = counter.total
    print(f"after layer 1: {mems[0] / 2**20:.1f} MiB with layer 0's copies running, {mems[1] / 2**20:.1f} MiB "
          f"once they ended ({moved / 2**20:.1f} MiB moved by layer 0)")
    assert mems[0] - mems[1] >= 0.9 * moved
