"""CPU: the engines' public surface: offload_context's choice and refusals, and measure_budget's
measurements and advice (its steps and CUDA's memory figures stood in)."""

import contextlib

import pytest
import torch
from transformer_engine.pytorch import cpu_offload

from te_offload_ops import engines
from te_offload_ops.engines import BudgetAdvice, OffloadCounter, measure_budget, offload_context
from te_offload_ops.engines.teo import TeoContext, default_pool, make_teo_context


def test_teo_is_selected_through_offload_context():
    counter_classify = lambda t: "k"  # noqa: E731
    ctx, sync, counter = offload_context("teo", num_layers=4, model_layers=4, classify=counter_classify)
    assert isinstance(ctx, TeoContext) and sync == ctx.sync
    assert isinstance(counter, OffloadCounter) and ctx.engine.counter is counter
    assert (ctx.engine.num_layers, ctx.engine.model_layers, ctx.engine.memory_budget) == (4, 4, None)
    assert ctx.engine.pool is default_pool()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"num_layers": 5, "model_layers": 4}, ValueError, "num_layers must be in 0..model_layers=4, got 5"),
    ({"num_layers": -1, "model_layers": 4}, ValueError, "got -1"),
    ({"num_layers": 0, "model_layers": 0}, ValueError, "model_layers must be >= 1, got 0"),
    ({"num_layers": 1.0, "model_layers": 4}, TypeError, "num_layers must be an int, got float"),
    ({"num_layers": 1, "model_layers": 4, "retain_pinned_cpu_buffers": True}, ValueError,
     "teo has no such option"),
    ({"num_layers": 1, "model_layers": 4, "memory_budget": 0}, ValueError, "memory_budget must be a positive .*got 0"),
    ({"num_layers": 1, "model_layers": 4, "memory_budget": 2.0**30}, TypeError, "memory_budget must be an int, got float"),
    # options of no schedule teo has are refused by name
    ({"num_layers": 1, "model_layers": 4, "release": "memory"}, TypeError, "unexpected keyword argument 'release'"),
    ({"num_layers": 1, "model_layers": 4, "prefetch": 1}, TypeError, "unexpected keyword argument 'prefetch'"),
    ({"num_layers": 1, "model_layers": 4, "max_held_bytes": 8}, TypeError, "unexpected keyword argument 'max_held"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        offload_context("teo", **kwargs)


@pytest.mark.parametrize("engine", ["none", "teo"])
def test_a_classify_that_is_not_a_function_is_refused_at_once(engine):
    with pytest.raises(TypeError, match="classify must be a function of a tensor \\(or None\\), got str"):
        offload_context(engine, num_layers=1, model_layers=2, classify="layer")


def test_an_unknown_engine_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"engine must be one of \('none', 'v2', 'v1', 'teo'\), got 'v3'"):
        offload_context("v3", num_layers=1, model_layers=2)


def test_teo_is_refused_in_a_process_running_te_v1(monkeypatch):
    # TE's modules leave V1's marks there, which teo does not read: it would move FP8 workspaces
    monkeypatch.setattr(cpu_offload, "NVTE_CPU_OFFLOAD_V1", True)
    assert engines.active_engine() == "v1"
    with pytest.raises(RuntimeError, match="this process runs TE's V1 engine \\(NVTE_CPU_OFFLOAD_V1=1"):
        offload_context("teo", num_layers=1, model_layers=2)
    with pytest.raises(RuntimeError, match="V1"):
        make_teo_context(1, 2)
    with pytest.raises(RuntimeError, match="this process runs TE's v1 engine; v2 needs NVTE_CPU_OFFLOAD_V1=0"):
        offload_context("v2", num_layers=1, model_layers=2)
    monkeypatch.setattr(cpu_offload, "NVTE_CPU_OFFLOAD_V1", False)
    assert isinstance(offload_context("teo", num_layers=1, model_layers=2)[0], TeoContext)


def test_no_offload_is_a_context_that_does_nothing():
    ctx, sync, counter = offload_context("none", num_layers=0, model_layers=3)
    t = torch.ones(2)
    with ctx:
        pass
    assert sync(t) is t and counter.total == 0


# ------------------------------------------------------------------------------------------------
# measure_budget


class _FakeCuda:
    """CUDA's memory figures for measure_budget, from what the fake steps say they allocate."""

    def __init__(self, monkeypatch):
        self.allocated, self.peak = 1000, 1000
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)

    def reach(self, peak):
        self.peak = max(self.peak, peak)


def _fake_contexts(monkeypatch, cuda, clock, seconds, peaks, moved=600):
    """offload_context stood in: each engine's step takes ``seconds[name]`` and peaks at
    ``peaks[name]`` above the floor; the default schedule moves ``moved`` bytes. Returns the log
    of (engine, budget) per step."""
    from te_offload_ops.engines import measure

    made = []

    def fake_context(engine, *, num_layers, model_layers, memory_budget=None):
        name = "none" if engine == "none" else ("default" if memory_budget is None else "budget")
        counter = OffloadCounter()

        class Ctx(contextlib.nullcontext):
            def __enter__(self):
                made.append((name, memory_budget))
                clock[0] += seconds[name]
                cuda.reach(cuda.allocated + peaks[name])
                if name == "default":
                    counter.bytes["all"] += moved
                return self

        return Ctx(), (lambda t: t), counter

    monkeypatch.setattr(measure, "offload_context", fake_context)
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])
    return made


def _step(context, sync):
    with context:
        pass


@pytest.mark.parametrize("budget_s, recommended", [(0.090, True), (0.100, True), (0.110, False)])
def test_measure_budget_recommends_the_budget_only_where_its_step_is_no_slower(monkeypatch, budget_s, recommended):
    cuda = _FakeCuda(monkeypatch)
    clock = [0.0]
    made = _fake_contexts(monkeypatch, cuda, clock, {"none": 0.08, "default": 0.100, "budget": budget_s},
                          {"none": 5000, "default": 4400, "budget": 4424})
    advice = measure_budget(_step, num_layers=7, model_layers=8, warmup_steps=1, compare_steps=3)
    target = int(1000 + 5000 - 600 * 0.96)
    assert advice.target_bytes == target and (advice.floor_bytes, advice.no_offload_peak_bytes) == (1000, 5000)
    assert advice.moved_bytes == 600
    assert advice.budget == (target if recommended else None)
    assert advice.options() == ({"memory_budget": target} if recommended else {})
    assert advice.default_step_s == pytest.approx(0.100) and advice.budget_step_s == pytest.approx(budget_s)
    assert (advice.default_peak_bytes, advice.budget_peak_bytes) == (4400, 4424)
    assert advice.reason.startswith("the budget:" if recommended else "the default schedule:")
    # 1 + warm-up steps without offload, then its measured step; the default's warm-up and measured
    # step; the budget's warm-up; then the two alternately
    assert [name for name, _ in made] == (["none"] * 3 + ["default"] * 2 + ["budget"] + ["default", "budget"] * 3)
    assert all(b == target for name, b in made if name == "budget")


def test_measure_budget_without_a_comparison_recommends_the_target(monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    made = _fake_contexts(monkeypatch, cuda, [0.0], {"none": 0, "default": 0, "budget": 0},
                          {"none": 5000, "default": 4400, "budget": 0})
    advice = measure_budget(_step, num_layers=8, model_layers=8, freed=1.0, compare_steps=0, warmup_steps=0)
    assert advice.budget == advice.target_bytes == 1000 + 5000 - 600 * 7 // 8  # n = L
    assert advice.default_step_s is None and "not compared" in advice.reason
    assert [name for name, _ in made] == ["none", "none", "default"]


def test_measure_budget_refuses_what_it_cannot_measure(monkeypatch):
    with pytest.raises(TypeError, match="step must be a callable taking \\(context, sync\\), got int"):
        measure_budget(3, num_layers=1, model_layers=2)
    with pytest.raises(ValueError, match="compare_steps must be an int >= 0, got -1"):
        measure_budget(_step, num_layers=1, model_layers=2, compare_steps=-1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        measure_budget(_step, num_layers=1, model_layers=2)


@pytest.mark.parametrize("change, error, match", [
    ({"num_layers": 9}, ValueError, "need 0 <= num_layers <= model_layers and model_layers >= 1, got 9, 8"),
    ({"model_layers": 0, "num_layers": 0}, ValueError, "model_layers >= 1"),
    ({"num_layers": 7.0}, TypeError, "num_layers must be an int, got float"),
    ({"freed": 0}, ValueError, r"freed must be a share of the moved bytes in \(0, 1\], got 0"),
    ({"slack_bytes": 0.5}, TypeError, "slack_bytes must be an int, got float"),
])
def test_measure_budget_refuses_what_target_budget_would_before_running_a_step(monkeypatch, change, error, match):
    cuda = _FakeCuda(monkeypatch)
    made = _fake_contexts(monkeypatch, cuda, [0.0], {"none": 0, "default": 0, "budget": 0},
                          {"none": 5000, "default": 4400, "budget": 0})
    with pytest.raises(error, match=match):
        measure_budget(_step, **{"num_layers": 7, "model_layers": 8, **change})
    assert made == []  # refused before any step ran


def test_advice_is_a_value_to_pass_on():
    advice = BudgetAdvice(None, 10, 1, 2, 3, reason="why")
    assert advice.options() == {} and advice.reason == "why"
