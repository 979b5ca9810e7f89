"""GPU: the teo offload engine is exact, moves what the policy allows (never weights), frees what it
moves, reuses its pinned buffers and never synchronizes with the host."""

import pytest
import torch

from conftest import requires_gpu
from engines import Config, make_inputs, make_stack, run_step
from test_gpu_engines import POLICIES, _assert_moves_follow_policy, _assert_same, _check_path
from te_offload_ops import engines_teo
from te_offload_ops.engines import active_engine, offload_context
from te_offload_ops.policy import MIN_OFFLOAD_NUMEL

LAYERS = 3

if active_engine() == "v1":  # teo refuses a process running TE's V1 engine
    pytestmark = pytest.mark.skip(reason="this process runs TE's V1 engine (NVTE_CPU_OFFLOAD_V1=1), which teo refuses")


def _union_bytes(ranges) -> int:
    """Bytes covered by (start, nbytes) ranges: views of one saved range are copied once."""
    total, end = 0, -1
    for start, n in sorted(ranges):
        if start + n > end:
            total += start + n - max(start, end)
            end = start + n
    return total


def expected_bytes(recorder, layer: int) -> int:
    """What an engine with V2's rule moves for ``layer``: its large activations that no op kept
    (an op that keeps a tensor another op saved keeps it for both). Only the layer's own entries
    count: teo hands a moved tensor's memory back during the forward (a layer or more later), so
    another layer's kept tensor can sit at the same address."""
    mine = [e for e in recorder.entries if e.op.startswith(f"L{layer}.")]
    kept = {(e.data_ptr, e.nbytes) for e in mine if e.kept}
    return _union_bytes({(e.data_ptr, e.nbytes) for e in mine
                         if e.kind == "activation" and e.numel >= MIN_OFFLOAD_NUMEL and (e.data_ptr, e.nbytes) not in kept})


def _moved_by_layer(moved: dict) -> dict[int, int]:
    out = {}
    for key, n in moved.items():
        op = key[0] if isinstance(key, tuple) else key.split("|")[0]
        layer = int(op.split(".")[0][1:])
        out[layer] = out.get(layer, 0) + n
    return out


@requires_gpu
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("num_layers", [1, LAYERS - 1, LAYERS])
def test_exact_and_moves_what_the_policy_allows(num_layers, policy, path):
    cfg = Config(layers=LAYERS, offload=POLICIES[policy])
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    base = run_step(stack, inputs, "none")
    run = run_step(stack, inputs, "teo", offload_layers=num_layers)
    _check_path(stack, path)
    _assert_same(base, run)  # outputs and every grad bitwise equal
    _assert_moves_follow_policy(run["moved"], cfg.offload, run["recorder"].entries, list(range(num_layers)))
    by_layer = _moved_by_layer(run["moved"])
    expected = {i: expected_bytes(run["recorder"], i) for i in range(num_layers)}
    print(f"{policy} n={num_layers}: moved per layer {by_layer}, expected {expected}")
    assert all(by_layer.get(i, 0) == 0 for i in range(num_layers, LAYERS)), by_layer
    assert {i: by_layer.get(i, 0) for i in range(num_layers)} == expected
    assert sum(expected.values()) > 0


@requires_gpu
@pytest.mark.parametrize("prefetch", [None, 0, 2])
def test_prefetch_distance_keeps_results_exact(prefetch, path):
    cfg = Config(layers=LAYERS)
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    base = run_step(stack, inputs, "none")
    x, probs, dy, splits = inputs
    ctx, sync, counter = offload_context("teo", num_layers=LAYERS, model_layers=LAYERS, prefetch=prefetch)
    for p in [x, *probs, *(q for mlp in stack for q in mlp.parameters())]:
        p.grad = None
    h = x * 1.0
    for i, mlp in enumerate(stack):
        with ctx:
            h = mlp(h, splits, probs[i], splits)
        h = sync(h)
    out = h.detach().clone()
    h.backward(dy)
    torch.cuda.synchronize()
    assert counter.total > 0
    assert torch.equal(out, base["out"]) and torch.equal(x.grad, base["grads"]["x"])
    assert all(torch.equal(p.grad, base["grads"][f"probs{i}"]) for i, p in enumerate(probs))


@requires_gpu
@pytest.mark.parametrize("num_layers", [LAYERS - 1, LAYERS])
def test_memory_freed_matches_bytes_moved(num_layers, path):
    """At the end of forward (copies done) >= 95% of the moved bytes are free; at the forward's peak,
    >= 95% of what the layers before the last moved (the last layer's own saves are alive at its peak
    under either engine). The peak asserted is memory_allocated's, which counts a block as free once
    the engine drops it: it checks that the engine lets go of what it moves. (teo drops a
    layer's bytes only after a stream waited for their copy, so the allocator's active peak, printed,
    should agree; the benchmark reports that one.)"""
    cfg = Config(layers=LAYERS, experts=4, hidden=1024, ffn=768, splits=(1024, 0, 3000, 72))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    base = run_step(stack, inputs, "none")
    run = run_step(stack, inputs, "teo", offload_layers=num_layers)
    _check_path(stack, path)
    by_layer = _moved_by_layer(run["moved"])
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
    _assert_same(base, run)
    by_layer = _moved_by_layer(run["moved"])
    moved = sum(by_layer.values())
    counted = moved - (by_layer.get(LAYERS - 1, 0) if num_layers == LAYERS else 0)
    freed = base["step_active_peak"] - run["step_active_peak"]
    print(f"n={num_layers}: moved {moved / 2**20:.1f} MiB, whole-step active peak {base['step_active_peak'] / 2**20:.1f}"
          f" -> {run['step_active_peak'] / 2**20:.1f} MiB: freed {freed / moved:.2%} of the bytes moved")
    assert freed >= 0.95 * counted


MEMORY_LAYERS = 5


@requires_gpu
@pytest.mark.parametrize("num_layers", [MEMORY_LAYERS - 1, MEMORY_LAYERS])
def test_memory_release_is_exact_and_keeps_the_whole_step_peak(monkeypatch, num_layers, path):
    """release="memory" (one context over steps: the third holds sources by the second's figures)
    gives the same bits and a whole-step active peak no higher than the layer schedule's. Copies
    are slowed (a sleep before each on the copy stream): the engine gives back what has been
    copied by itself, so only copies still running leave anything to hold.

    Each layer keeps its input (fc1 not offloaded, hidden 1024 per token) and moves about half as
    much (ffn 256): early in the forward there is room to hold a layer past its release, which the
    engine's public count must show (else the test would only compare the layer schedule with itself)."""
    cfg = Config(layers=MEMORY_LAYERS, experts=4, hidden=1024, ffn=256, splits=(1024, 0, 3000, 72),
                 offload=POLICIES["keep-fc1"])
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    run_step(stack, inputs, "none")  # allocates the grads
    base = run_step(stack, inputs, "none", keep_grads=True)
    _slow_copies_to_host(monkeypatch)
    layered = run_step(stack, inputs, "teo", offload_layers=num_layers, keep_grads=True)
    context = offload_context("teo", num_layers=num_layers, model_layers=MEMORY_LAYERS, release="memory")
    for _ in range(3):
        run = run_step(stack, inputs, "teo", offload_layers=num_layers, keep_grads=True, context=context)
    _assert_same(base, run)
    engine = context[0].engine
    assert engine._last_figures is not None  # the third step ran by figures
    print(f"n={num_layers}: whole-step active peak, layer schedule {layered['step_active_peak'] / 2**20:.1f} MiB, "
          f"memory release {run['step_active_peak'] / 2**20:.1f} MiB, layers held past their release "
          f"{engine.layers_held}")
    assert engine.layers_held > 0
    assert run["step_active_peak"] <= layered["step_active_peak"] + 2**20  # allocator rounding


@requires_gpu
def test_pinned_pool_does_not_grow_in_steady_state(path):
    cfg = Config(layers=LAYERS)
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    pool = engines_teo.default_pool()
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
def test_slow_copies_and_reused_memory_keep_steps_exact(monkeypatch, path):
    """Cross-stream ordering under stress: every offload and reload copy is queued behind a ~1 ms
    sleep on its copy stream (so the compute stream runs far ahead), and after each forward the
    compute stream fills large fresh allocations with NaN (so a block handed out before its copy
    finished, or a pinned buffer overwritten while read, would poison the result). Three steps back
    to back with one context and no host synchronization: each bitwise equal to no offload."""
    cfg = Config(layers=LAYERS)
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    none_ctx, none_sync, _ = offload_context("none", num_layers=0, model_layers=LAYERS)
    _zero_grads(stack, inputs)
    _plain_step(stack, inputs, none_ctx, none_sync)
    ref = _grads_of(stack, inputs)

    to_host, to_gpu = engines_teo.TeoEngine._copy_to_host, engines_teo.TeoEngine._reload

    def slow_to_host(self, t, storage, span):
        d2h, _ = self._streams(t.device)
        with torch.cuda.stream(d2h):
            torch.cuda._sleep(1_000_000)
        return to_host(self, t, storage, span)

    def slow_reload(self, layer, prefetch=False):
        if self._h2d is not None:
            with torch.cuda.stream(self._h2d):
                torch.cuda._sleep(1_000_000)
        return to_gpu(self, layer, prefetch)

    monkeypatch.setattr(engines_teo.TeoEngine, "_copy_to_host", slow_to_host)
    monkeypatch.setattr(engines_teo.TeoEngine, "_reload", slow_reload)
    ctx, sync, counter = offload_context("teo", num_layers=LAYERS, model_layers=LAYERS)
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
    assert counter.total > 0
    for step, got in enumerate(results):
        for i, (a, b) in enumerate(zip(got, ref)):
            assert torch.equal(a, b), (step, i)


@requires_gpu
def test_copies_in_pieces_keep_results_exact(path, monkeypatch):
    """TEO_OFFLOAD_COPY_CHUNK_MIB=1: every saved range goes to the host in 1 MiB pieces (reloads are
    whole copies); the pieces themselves are checked on the CPU (test_engine_teo.py)."""
    monkeypatch.setenv(engines_teo.COPY_CHUNK_ENV, "1")
    cfg = Config(layers=LAYERS)
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    base = run_step(stack, inputs, "none")
    context = offload_context("teo", num_layers=LAYERS, model_layers=LAYERS)
    assert context[0].engine.copy_chunk == 1 << 20  # the engine read the setting
    run = run_step(stack, inputs, "teo", offload_layers=LAYERS, context=context)
    assert sum(run["moved"].values()) > 1 << 20  # more than one piece crossed
    _assert_same(base, run)


def _exact_steps_with_one_context(stack, inputs, base, num_layers, steps: int = 2, **options):
    """``steps`` steps through one teo context with ``options``, each bitwise equal to ``base``;
    returns the last step's run and the engine."""
    context = offload_context("teo", num_layers=num_layers, model_layers=len(stack), **options)
    for _ in range(steps):
        run = run_step(stack, inputs, "teo", offload_layers=num_layers, keep_grads=True, context=context)
        _assert_same(base, run)
    return run, context[0].engine


def _slow_copies_to_host(monkeypatch, ns: int = 2_000_000):
    """Each copy to the host queued behind a sleep of ``ns`` on the copy stream: copies still run
    when their layer is released."""
    to_host = engines_teo.TeoEngine._copy_to_host

    def slow_to_host(self, t, storage, span):
        d2h, _ = self._streams(t.device)
        with torch.cuda.stream(d2h):
            torch.cuda._sleep(ns)
        return to_host(self, t, storage, span)

    monkeypatch.setattr(engines_teo.TeoEngine, "_copy_to_host", slow_to_host)


@requires_gpu
@pytest.mark.parametrize("num_layers", [LAYERS - 1, LAYERS])
def test_held_bytes_keep_steps_exact_and_the_peak_within_the_limit(monkeypatch, num_layers, path):
    """max_held_bytes with slow copies: bytes of released layers stay held instead of waited for
    (the engine's count shows it), results stay bitwise equal to no offload over steps with one
    context, and the whole-step active peak stays within the layer schedule's plus the limit."""
    cfg = Config(layers=LAYERS, experts=4, hidden=1024, ffn=768, splits=(1024, 0, 3000, 72))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    run_step(stack, inputs, "none")  # allocates the grads
    base = run_step(stack, inputs, "none", keep_grads=True)
    _slow_copies_to_host(monkeypatch)
    layered = run_step(stack, inputs, "teo", offload_layers=num_layers, keep_grads=True)
    limit = 12 << 20  # above the largest single copy (8 MiB): what is held goes by whole copies
    run, engine = _exact_steps_with_one_context(stack, inputs, base, num_layers, max_held_bytes=limit)
    print(f"n={num_layers}: held past release {engine.bytes_held_past_release / 2**20:.1f} MiB over 2 steps; whole-step "
          f"active peak: layer schedule {layered['step_active_peak'] / 2**20:.1f} MiB, held "
          f"{run['step_active_peak'] / 2**20:.1f} MiB (limit {limit / 2**20:.0f} MiB)")
    assert engine.bytes_held_past_release > 0
    assert run["step_active_peak"] <= layered["step_active_peak"] + limit + 2**20  # allocator rounding


@requires_gpu
def test_copies_seen_ended_free_their_bytes_during_the_forward(monkeypatch, path):
    """A layer's bytes go back as its copies end, not at its release: one layer of four offloaded
    (released only at the last layer's entry), its copies slowed (20 ms each); after the second
    layer's forward the memory is lower by what layer 0 moved when the host waited for those
    copies before the second layer than when it did not."""
    cfg = Config(layers=4, experts=4, hidden=1024, ffn=768, splits=(1024, 0, 3000, 72))
    stack, inputs = make_stack(cfg), make_inputs(cfg)
    x, probs, _, splits = inputs
    _slow_copies_to_host(monkeypatch, ns=20_000_000)
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
    by_layer = _moved_by_layer(run_step(stack, inputs, "teo", offload_layers=LAYERS, keep_grads=True)["moved"])
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
    _slow_copies_to_host(monkeypatch)
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
