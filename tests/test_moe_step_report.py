"""CPU checks of benchmarks/moe_step.py: its options, policies, bound, cap search and reports,
from synthetic results (the GPU run itself is tests/test_moe_step_gpu.py)."""

import contextlib
import copy
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import moe_step  # noqa: E402
import moe_step_report as rep  # noqa: E402
from moe_step import Policy  # noqa: E402


# ------------------------------------------------------------------------------------------------
# Options and policies


def test_the_default_run_is_one_shape_two_engines_and_four_policies():
    args = moe_step.parse_args([])
    assert list(args.shapes) == ["base"] and args.preset == "default"
    assert args.shapes["base"] == {"hidden": 2688, "heads": 21, "ffn": 1856, "experts": 8, "topk": 2}
    assert (args.layers, args.batch, args.seq, args.engines) == (8, 8, 4096, ["teo", "v2"])
    assert [p.label(8) for p in args.policies] == ["MLP 4/8", "MLP 7/8", "MLP 8/8", "layer 4/8"]
    assert (args.warmup, args.iters, args.cap_trials, args.no_cap) == (2, 3, 3, False)
    assert args.caps == {}


def test_full_run_covers_both_shapes_three_engines_and_eight_policies():
    args = moe_step.parse_args(["--full"])
    assert list(args.shapes) == ["base", "moe-heavy"] and args.preset == "full"
    assert (args.layers, args.batch, args.engines, args.iters, args.cap_trials) == (8, 8, ["v2", "v1", "teo"], 5, 4)
    assert [p.label(8) for p in args.policies] == [
        "MLP 2/8", "MLP 4/8", "MLP 6/8", "MLP 7/8", "MLP 8/8", "layer 2/8", "layer 4/8", "layer 6/8"]
    assert moe_step.parse_args(["--full", "--engines", "teo"]).engines == ["teo"]  # a flag wins over the preset
    with pytest.raises(SystemExit):
        moe_step.parse_args(["--full", "--quick"])


def test_steps_planned_per_shape_count_every_run_and_every_cap_trial():
    args = moe_step.parse_args([])
    # (none + 4 policies) x (2 + 3) steps, then 3 searches x 3 trials x (1 + 2) steps
    assert moe_step.steps_planned(args) == 5 * 5 + 3 * 3 * 3
    assert moe_step.steps_planned(moe_step.parse_args(["--no-cap"])) == 25
    assert moe_step.steps_planned(moe_step.parse_args(["--policies", "mlp:4", "--no-cap"])) == 10
    assert moe_step.steps_planned(moe_step.parse_args(["--policies", "mlp:4"])) == 10 + 2 * 3 * 3  # two searches at most
    assert moe_step.steps_planned(moe_step.parse_args(["--profile", "none"])) == 0


def test_progress_estimates_the_time_left_from_the_pace_of_the_steps_done(capsys, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(moe_step.time, "time", lambda: clock[0])
    progress = moe_step.Progress("teo", ["teo", "v2"], started=40.0, launched=60.0)
    progress.plan(20)
    assert progress.left_s(100.0) is None  # nothing done yet
    progress.step("first step (kernels compile)", counted=False)
    assert "left ?" in capsys.readouterr().out
    progress.begin()  # set-up took 40 s (launched at 60, steps begin at 100)
    for _ in range(10):
        clock[0] += 2.0
        progress.step("shape=base policy=none (1/5) step 1/5: 250.0 ms")
    line = capsys.readouterr().out.splitlines()[-1]
    # 10 steps in 20 s: 10 left here (20 s), then v2 as long as this one: 40 s + 20 x 2 s
    assert progress.left_s(clock[0]) == pytest.approx(20 + 40 + 40)
    assert line == ("[moe_step] engine=teo (1/2) shape=base policy=none (1/5) step 1/5: 250.0 ms | "
                    "elapsed 1:20, left ~1:40")
    progress.drop(10)  # a search that settled early: nothing left here
    assert progress.left_s(clock[0]) == pytest.approx(0 + 40 + 10 * 2)


class _FakeBench(moe_step.StepBench):
    """StepBench's bookkeeping on synthetic steps: the peak above the floor grows by 1000 MiB per
    sequence, less 40% with an MLP policy and 60% with whole layers; a step takes 10 ms per
    sequence, 20% more with offload. The allocator's cap raises OutOfMemoryError past it."""

    def __init__(self, name, shape, args, engine, progress=None):
        self.args, self.engine, self.name, self.progress = args, engine, name, progress
        self.torch = type("T", (), {"cuda": type("C", (), {"empty_cache": staticmethod(lambda: None),
                                                          "max_memory_reserved": staticmethod(lambda: 0),
                                                          "OutOfMemoryError": MemoryError})})
        self.L, self.seq, self.floor_MiB, self.path = args.layers, args.seq, 5000.0, "fused"
        self.floor = {"floor_MiB": 5000.0, "params_MiB": 1, "grads_MiB": 1, "optimizer_MiB": 1, "other_MiB": 0}
        self.cap_bytes, self.budget_waits, self.none_peak_MiB = None, None, {}
        self.where, self.ticks = moe_step.FIRST_STEP, 0
        self._tick("step 1/1", {"step_ms": 1000.0})

    @contextlib.contextmanager
    def under_cap(self, cap_GiB):
        self.cap_bytes = cap_GiB * moe_step.GiB
        try:
            yield
        finally:
            self.cap_bytes = None

    def _steps(self, policy, batch, count, warmup=0, reuse=True):
        share = {"none": 1.0, "mlp": 0.6, "layer": 0.4}[policy.scope]
        peak = self.floor_MiB + 1000.0 * batch * share
        step = {"fwd_ms": 3.0 * batch, "bwd_ms": 7.0 * batch, "opt_ms": 0.0,
                "step_ms": 10.0 * batch * (1.0 if policy.scope == "none" else 1.2),
                "offloaded": int(1000 * batch * (1 - share)) * moe_step.MiB}
        for i in range(warmup + count):
            if self.cap_bytes is not None and peak * moe_step.MiB > self.cap_bytes:
                raise MemoryError("out of memory")
            self._tick(f"step {i + 1}/{warmup + count}", step)
        return [step] * count, peak, self.floor_MiB

    def _recover(self):
        pass


def test_an_engine_process_runs_every_planned_step_and_its_progress_ends_at_zero_left(monkeypatch, tmp_path, capsys):
    """run_child on synthetic steps: rows for no offload and every policy, the cap searches, and
    progress bookkeeping whose plan (steps_planned, less what failed runs and settled searches
    dropped) matches the steps that ran."""
    import torch

    seen = []
    real_init = moe_step.Progress.__init__

    def keep(self, *a, **k):
        real_init(self, *a, **k)
        seen.append(self)

    monkeypatch.setattr(moe_step.Progress, "__init__", keep)
    monkeypatch.setattr(moe_step, "StepBench", _FakeBench)
    monkeypatch.setattr(moe_step, "pcie_bandwidth", lambda: PCIE)
    monkeypatch.setattr(moe_step, "_empty_host_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: type("P", (), {"total_memory": 80 << 30})())
    import time

    now = time.time()
    args = moe_step.parse_args(["--engines", "teo", "--child", "teo", "--child-out", str(tmp_path / "c.json"),
                                "--clock", f"{now - 75},{now - 5}"])
    moe_step.run_child(args)
    out = json.loads((tmp_path / "c.json").read_text())["shapes"]["base"]
    assert [r["policy"] for r in out["rows"]] == ["none", "MLP 4/8", "MLP 7/8", "MLP 8/8", "layer 4/8"]
    searches = out["cap"]["searches"]
    # the automatic cap holds 8 sequences without offload; whole layers fit 8 / 0.4 = 20
    assert [(x["policy"], x["batch"]) for x in searches][0] == ("none", 8)
    assert ("layer 4/8", 20) in [(x["policy"], x["batch"]) for x in searches]
    [progress] = seen
    # two searches (the MLP policies run 20% slower), each a trial that fit (3 steps) and one that
    # failed at its first step
    assert progress.done == progress.total == 5 * 5 + 2 * 3
    assert progress.left_s(time.time()) == 0  # the only engine
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("[moe_step] engine=teo (1/1) shape=base policy=MLP 7/8 (3/5) step 5/5: 96.0 ms | "
                               "elapsed 1:1") for line in lines)
    assert any("[moe_step] engine=teo shape=base cap 13.0 GiB policy=layer 4/8 batch 20 (trial " in line
               for line in lines)


def test_result_names_say_the_shapes_and_what_sets_the_run_apart():
    gpu = "NVIDIA H100 80GB HBM3"
    stem = lambda argv: moe_step.result_stem(gpu, moe_step.parse_args(argv))  # noqa: E731
    assert stem([]) == "moe_step_NVIDIA_H100_80GB_HBM3_base"
    assert stem(["--full"]) == "moe_step_NVIDIA_H100_80GB_HBM3_base_moe-heavy_full"
    assert stem(["--quick", "--unfused"]) == "moe_step_NVIDIA_H100_80GB_HBM3_base_unfused_quick"
    assert stem(["--shapes", "big-ffn", "--engines", "teo-t"]) == "moe_step_NVIDIA_H100_80GB_HBM3_big-ffn_teo-t"


def test_the_big_ffn_shape_runs_only_when_named_and_its_moe_bytes_dominate():
    assert "big-ffn" not in moe_step.parse_args([]).shapes
    args = moe_step.parse_args(["--shapes", "big-ffn", "--layers", "4"])
    big = args.shapes["big-ffn"]
    assert big == {"hidden": 4096, "heads": 32, "ffn": 14336, "experts": 8, "topk": 4}
    # the comment's estimate: MoE's saved bytes per token, 2 top-k (H + F), against about 19 H for
    # the rest, and FLOPs per saved byte against base's
    def per_token(s, seq=4096):
        moe, rest = 2 * s["topk"] * (s["hidden"] + s["ffn"]), 19 * s["hidden"]
        flops = 8 * s["hidden"] ** 2 + 2 * seq * s["hidden"] + 4 * s["topk"] * s["hidden"] * s["ffn"]
        return moe / (moe + rest), flops / (moe + rest)
    share, big_ratio = per_token(big)
    _, base_ratio = per_token(moe_step.SHAPES["base"])
    assert 0.6 < share < 0.7 and 2.5 < big_ratio / base_ratio < 3.2


def test_the_wide_shape_runs_only_when_named():
    args = moe_step.parse_args(["--shapes", "wide,base"])
    assert list(args.shapes) == ["wide", "base"]
    wide = args.shapes["wide"]
    assert wide == {"hidden": 4096, "heads": 32, "ffn": 2048, "experts": 8, "topk": 2}
    assert wide["hidden"] % wide["heads"] == 0 and wide["topk"] <= wide["experts"]


def test_quick_fills_only_what_is_not_given():
    args = moe_step.parse_args(["--quick", "--layers", "6"])
    assert list(args.shapes) == ["base"] and args.batch == 1 and args.iters == 3
    assert args.layers == 6 and args.engines == ["v2", "v1", "teo"]
    assert Policy("mlp", 6) in args.policies and Policy("mlp", 5) in args.policies and Policy("layer", 1) in args.policies


def test_shape_flags_override_every_shape_run():
    args = moe_step.parse_args(["--full", "--experts", "16", "--topk", "4"])
    assert all(s["experts"] == 16 and s["topk"] == 4 for s in args.shapes.values())
    assert args.shapes["moe-heavy"]["hidden"] == 2048


@pytest.mark.parametrize("argv", [
    ["--engines", "v3"], ["--shapes", "tiny"], ["--policies", "mlp:9"], ["--policies", "attn:2"],
    ["--hidden", "1000", "--heads", "3"], ["--topk", "9", "--shapes", "base"], ["--batch", "0"],
    ["--memory-cap", "nope=3"], ["--memory-cap", "-1"],
])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        moe_step.parse_args(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["--memory-cap", "nan"], "--memory-cap must be a positive, finite number of GiB, got 'nan'"),
    (["--memory-cap", "inf"], "got 'inf'"),
    (["--memory-cap", "lots"], "--memory-cap: 'lots' is not a number of GiB"),
    (["--memory-cap", "base=", "--shapes", "base"], "--memory-cap for 'base': '' is not a number of GiB"),
    (["--memory-cap", "base=nan", "--shapes", "base"], "--memory-cap for 'base' must be a positive"),
    (["--memory-target", "nan"], "--memory-target must be a positive, finite number of GiB, got 'nan'"),
    (["--memory-target", "-2"], "--memory-target must be a positive"),
    (["--cap-slowdown", "nan"], "--cap-slowdown must be a finite fraction >= 0 (0.05: up to 5% slower), got nan"),
    (["--cap-slowdown", "-0.1"], "got -0.1"),
    (["--budget-margin", "nan"], "--budget-margin must be a finite number of GiB >= 0, got nan"),
    (["--budget-margin", "-1"], "got -1.0"),
    (["--alloc-conf", "expandable_segments"], "--alloc-conf: 'expandable_segments' is not option:value"),
    (["--alloc-conf", "expandable_segments:True,max_split_size_mb"], "bad part(s): ['max_split_size_mb']"),
    (["--alloc-conf", "roundup_power2_divisions:[256:1,512:2"], "is not option:value"),
])
def test_bad_values_are_refused_by_name(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        moe_step.parse_args(argv)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("conf", ["expandable_segments:True", "max_split_size_mb:512,expandable_segments:True",
                                  "roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6",
                                  # PyTorch's parser skips blanks and empty parts
                                  "expandable_segments: True", "roundup_power2_divisions:[256:1, 512:2, >:8]",
                                  "expandable_segments:True,", "backend:cudaMallocAsync"])
def test_allocator_settings_of_pytorch_form_are_taken(conf):
    assert moe_step.parse_args(["--alloc-conf", conf]).alloc_conf == conf


def test_a_cap_above_the_gpu_is_refused_not_silently_clipped(capsys):
    moe_step.check_caps_fit({"base": 79.0}, 79.1, "H100")
    with pytest.raises(SystemExit) as exc:
        moe_step.check_caps_fit({"base": 30.0, "moe-heavy": 120.0}, 79.19, "H100")
    assert exc.value.code == moe_step.BAD_ARGS_EXIT
    assert "--memory-cap moe-heavy=120 is above this GPU's 79.190 GiB (H100)" in capsys.readouterr().err


def test_policies_parse_all_and_drop_repeats():
    assert moe_step.parse_policies("mlp:all, layer:2,mlp:4", 4) == [Policy("mlp", 4), Policy("layer", 2)]
    assert moe_step.default_policies(1) == [Policy("mlp", 1), Policy("layer", 1)]
    assert moe_step.full_policies(1) == [Policy("mlp", 1), Policy("layer", 1)]
    assert moe_step.default_policies(3) == [Policy("mlp", 1), Policy("mlp", 2), Policy("mlp", 3), Policy("layer", 1)]
    with pytest.raises(ValueError, match="1..4"):
        moe_step.parse_policies("mlp:0", 4)


def test_caps_one_for_all_or_per_shape_and_back():
    shapes = ["base", "moe-heavy"]
    assert moe_step.parse_caps("30", shapes) == {"base": 30.0, "moe-heavy": 30.0}
    caps = moe_step.parse_caps("base=22.5", shapes)
    assert caps == {"base": 22.5}
    assert moe_step.parse_caps(moe_step.format_caps({"base": 22.5, "moe-heavy": 31.0}), shapes) == {
        "base": 22.5, "moe-heavy": 31.0}
    assert moe_step.parse_caps(None, shapes) == {}


def test_engines_are_one_environment_entry_each():
    assert moe_step.ENGINE_ENV["v1"] == {"NVTE_CPU_OFFLOAD_V1": "1"}
    assert moe_step.ENGINE_ENV["v2"] == {"NVTE_CPU_OFFLOAD_V1": "0"}
    # teo reads the marks as V2 does; its copies are whole unless the engine's name says otherwise
    assert moe_step.ENGINE_ENV["teo"] == {"NVTE_CPU_OFFLOAD_V1": "0", "TEO_OFFLOAD_COPY_CHUNK_MIB": "0"}
    assert moe_step.ENGINE_ENV["teo-c16"]["TEO_OFFLOAD_COPY_CHUNK_MIB"] == "16"
    # every variant of teo is an engine of its own process, with options offload_context takes
    import inspect
    from te_offload_ops.engines import offload_context
    accepted = set(inspect.signature(offload_context).parameters)
    for name, (engine, options) in moe_step.ENGINE_OPTIONS.items():
        assert name in moe_step.ENGINE_ENV and engine == "teo" and set(options) <= accepted, name
    assert moe_step.ENGINE_OPTIONS["teo-h4"][1] == {"max_held_bytes": 4 << 30}


def test_rows_where_te_schedules_fall_short_are_marked():
    assert moe_step.schedule_notes("v2", 7, 8) and not moe_step.schedule_notes("v1", 7, 8)
    assert moe_step.schedule_notes("v2", 8, 8) and moe_step.schedule_notes("v1", 8, 8)
    assert moe_step.schedule_notes("v2", 4, 8) == []
    assert moe_step.schedule_notes("teo", 7, 8) == []  # an engine of ours carries no TE caveat
    assert moe_step.schedule_notes("teo", 8, 8) == [  # but n = L frees less at the peak, by construction
        "n = L: the layer whose backward comes first is back on the GPU when the backward begins (under any "
        "schedule), so at most (L-1)/L of the bytes are freed at that peak"]


def test_automatic_cap_rounds_up_to_half_a_gib_and_stays_below_the_device():
    # floor 10 GiB, 2 sequences took 3 GiB: 4 sequences need 16 GiB in all
    assert moe_step.auto_cap_GiB(10 * 1024, 3 * 1024, 2, 4, 80.0) == 16.0
    assert moe_step.auto_cap_GiB(10 * 1024, 3 * 1024 + 10, 2, 4, 80.0) == 16.5
    assert moe_step.auto_cap_GiB(10 * 1024, 60 * 1024, 1, 4, 79.6) == 78


# ------------------------------------------------------------------------------------------------
# Derivations


def _row(scope, layers, step, peak, moved, fwd=None, bwd=None, opt=2.0, engine="v2", tokens=8192, error=None):
    fwd = step / 3 if fwd is None else fwd
    bwd = step - fwd - opt if bwd is None else bwd
    row = {"engine": engine, "scope": scope, "layers": layers, "policy": rep.policy_label(scope, layers, 8),
           "batch": 2, "tokens": tokens, "floor_MiB": 7000.0, "notes": [], "context": "reused"}
    if error:
        row["error"] = error
        return row
    row.update({"step_ms": step, "fwd_ms": fwd, "bwd_ms": bwd, "opt_ms": opt, "tokens_per_s": tokens / step * 1e3,
                "peak_above_MiB": peak, "offloaded_MiB": moved})
    return row


PCIE = {"d2h_GBps": 50.0, "h2d_GBps": 40.0, "bidirectional_each_GBps": 30.0}


def test_rows_are_compared_with_the_no_offload_row_of_their_run():
    rows = [_row("none", 0, 60.0, 5000, 0, fwd=20.0, bwd=38.0), _row("mlp", 2, 63.0, 4700, 300),
            _row("layer", 4, 100.0, 2800, 2200), _row("mlp", 8, 0, 0, 0, error="ValueError: no")]
    rep.derive_rows(rows, PCIE)
    none, mlp, layer, failed = rows
    assert none["vs_none"] == 1.0 and none["freed_MiB"] is None
    assert mlp["vs_none"] == pytest.approx(1.05) and mlp["freed_MiB"] == 300
    assert mlp["freed_per_offloaded"] == pytest.approx(1.0)
    # 300 MiB hide under both phases: the bound is the no-offload step
    assert mlp["bound_ms"] == pytest.approx(60.0)
    # 2200 MiB: 46.1 ms down (> fwd 20), 57.7 ms up (> bwd 38), plus the optimizer
    d2h, h2d = 2200 * 2**20 / 50e9 * 1e3, 2200 * 2**20 / 40e9 * 1e3
    assert layer["bound_ms"] == pytest.approx(d2h + h2d + 2.0)
    assert layer["vs_bound"] == pytest.approx(100.0 / (d2h + h2d + 2.0))
    assert layer["freed_per_offloaded"] == pytest.approx(2200 / 2200)
    assert failed["vs_none"] is None and failed["bound_ms"] is None


def test_whole_layers_get_the_peak_neutral_bound():
    # the base shape's teo run at 8 x 4096 on the H100: layer 4/8 moved 8344 MiB
    pcie = {"d2h_GBps": 54.7, "h2d_GBps": 54.1, "bidirectional_each_GBps": 41.3}
    rows = [_row("none", 0, 249.0, 18255, 0, fwd=75.4, bwd=167.3, opt=6.3), _row("layer", 4, 425.2, 10364, 8344),
            _row("layer", 2, 307.8, 14250, 4172), _row("mlp", 4, 263.9, 15983, 2272), _row("layer", 8, 900.0, 5000, 16000)]
    rep.derive_rows(rows, pcie, model_layers=8)
    none, four, two, mlp, every = rows
    d2h, h2d = 8344 * 2**20 / 54.7e9 * 1e3, 8344 * 2**20 / 54.1e9 * 1e3  # 159.9, 161.7 ms
    # the backward cannot reload before layer 7's backward is done nor finish before layer 0's has run
    assert four["pn_bound_ms"] == pytest.approx(d2h + (2 * 167.3 / 8 + h2d) + 6.3)  # 369.8 ms
    assert four["pn_bound_ms"] > four["bound_ms"] and four["vs_pn_bound"] == pytest.approx(425.2 / four["pn_bound_ms"])
    # 2 of 8: the reloads fit in the backward: the same as the PCIe bound
    assert two["pn_bound_ms"] == pytest.approx(two["bound_ms"])
    assert mlp["pn_bound_ms"] is None and every["pn_bound_ms"] is None and none["pn_bound_ms"] is None
    rep.derive_rows(rows, pcie)  # no layer count: not derived
    assert four["pn_bound_ms"] is None


def test_predicted_batch_scales_the_peak_per_sequence():
    assert rep.predicted_batch(3000, 2, 7600) == 5
    assert rep.predicted_batch(3000, 2, -10) == 0
    with pytest.raises(ValueError, match="positive"):
        rep.predicted_batch(0, 2, 100)


def _memory_model(constant, per_seq, cap_above, max_ok=None):
    """A trial runner for a step whose peak is constant + per_seq * batch; past max_ok it OOMs
    whatever its peak (fragmentation)."""
    calls = []

    def trial(batch):
        calls.append(batch)
        peak = constant + per_seq * batch
        fits = peak <= cap_above and (max_ok is None or batch <= max_ok)
        return {"batch": batch, "fits": fits, "peak_above_MiB": peak if fits else None}

    return trial, calls


@pytest.mark.parametrize("constant,per_seq,cap_above,expected", [
    (800, 1500, 9000, 5),     # (9000 - 800) / 1500 = 5.47
    (800, 1500, 700, 0),      # not even one sequence
    (0, 1000, 12000, 12),     # exactly at the cap fits
    (2000, 300, 9000, 23),    # a large constant: the first guess (through the origin) is low
])
def test_cap_search_finds_the_largest_batch_and_brackets_it(constant, per_seq, cap_above, expected):
    trial, calls = _memory_model(constant, per_seq, cap_above)
    base = (2, constant + 2 * per_seq)
    trials, best, bracketed = rep.search_cap(trial, base, cap_above, max_batch=32, budget=6)
    assert best == expected and bracketed
    assert len(calls) <= 4  # the line through measured points gets there fast
    assert len(set(calls)) == len(calls)  # never the same batch twice


def test_cap_search_stops_at_the_largest_batch_allowed():
    trial, calls = _memory_model(0, 100, 1e6)
    trials, best, bracketed = rep.search_cap(trial, (2, 200), 1e6, max_batch=8, budget=6)
    assert (best, bracketed, calls) == (8, False, [8])


def test_cap_search_steps_down_past_an_oom_below_the_predicted_peak():
    trial, calls = _memory_model(800, 1500, 9000, max_ok=4)  # the peak says 5 fits; the allocator says 4
    trials, best, bracketed = rep.search_cap(trial, (2, 3800), 9000, max_batch=32, budget=6)
    assert (best, bracketed) == (4, True)
    assert calls == [4, 5]


def test_cap_search_reports_at_least_when_its_budget_runs_out():
    trial, calls = _memory_model(2000, 300, 9000)
    trials, best, bracketed = rep.search_cap(trial, (2, 2600), 9000, max_batch=32, budget=1)
    assert len(calls) == 1 and not bracketed and best == calls[0]


def test_max_batch_cell_says_exact_bound_or_none_found():
    trial = lambda b, ok: {"batch": b, "fits": ok}  # noqa: E731
    assert rep._max_batch_cell({"batch": 3, "bracketed": True, "trials": [trial(3, True), trial(4, False)]}) == "3"
    assert rep._max_batch_cell({"batch": 3, "bracketed": False, "trials": [trial(3, True)]}) == "3 (at least)"
    # a search whose budget ended before anything fit says so, not "0 (at least)"
    assert rep._max_batch_cell({"batch": 0, "bracketed": False, "trials": [trial(4, False), trial(3, False)]}) \
        == "< 3 (none fit in 2 trials)"


def test_cap_candidates_no_offload_the_best_fast_one_and_the_best_overall():
    rows = [_row("none", 0, 60.0, 5000, 0), _row("mlp", 2, 62.0, 4700, 300), _row("mlp", 6, 63.0, 4100, 850),
            _row("layer", 4, 100.0, 2800, 2200), _row("mlp", 8, 0, 0, 0, error="ValueError")]
    picks = rep.cap_candidates(rows, cap_above_MiB=20000, batch=2, slowdown=0.05)
    assert [r["policy"] for r in picks] == ["none", "MLP 6/8", "layer 4/8"]
    # when the best overall is also fast, it is searched once
    picks = rep.cap_candidates(rows[:3], cap_above_MiB=20000, batch=2, slowdown=0.05)
    assert [r["policy"] for r in picks] == ["none", "MLP 6/8"]


def test_memory_target_names_the_fastest_policy_that_meets_it():
    rows = [_row("none", 0, 60.0, 5000, 0), _row("mlp", 2, 62.0, 4700, 300), _row("mlp", 6, 66.0, 4100, 850),
            _row("layer", 4, 100.0, 2800, 2200, engine="v1")]
    best, least = rep.fastest_within(rows, 7000 + 4800)
    assert best["policy"] == "MLP 2/8"
    best, least = rep.fastest_within(rows, 7000 + 4200)
    assert best["policy"] == "MLP 6/8"
    best, least = rep.fastest_within(rows, 7000 + 1000)
    assert best is None and least["policy"] == "layer 4/8"
    text = rep.memory_target_text({"runs": [{"rows": rows}]}, (7000 + 1000) / 1024)["text"]
    assert "no measured policy meets it" in text and "layer 4/8" in text


# ------------------------------------------------------------------------------------------------
# Targets and reports from a synthetic two-engine result


def _search(engine, scope, layers, batch, rate, predicted=None):
    return {"engine": engine, "scope": scope, "layers": layers, "policy": rep.policy_label(scope, layers, 8),
            "predicted_batch": predicted or batch, "batch": batch, "bracketed": True, "tokens": batch * 4096,
            "tokens_per_s": rate, "step_ms": batch * 4096 / rate * 1e3, "peak_above_MiB": 9000.0,
            "trials": [{"batch": batch, "fits": True, "peak_above_MiB": 9000.0},
                       {"batch": batch + 1, "fits": False, "peak_above_MiB": None}]}


def _result():
    floor = {"floor_MiB": 7000.0, "params_MiB": 1700.0, "grads_MiB": 1700.0, "optimizer_MiB": 3400.0,
             "other_MiB": 200.0}
    v2_rows = [_row("none", 0, 60.0, 5000, 0), _row("mlp", 2, 61.0, 4716, 284), _row("mlp", 7, 93.0, 4006, 994),
               _row("mlp", 8, 0, 0, 0, error="ValueError: Cannot offload all layers")]
    v2_rows[2]["notes"] = moe_step.schedule_notes("v2", 7, 8)
    v1_rows = [_row("none", 0, 61.0, 5000, 0, engine="v1"), _row("mlp", 2, 61.5, 4716, 284, engine="v1"),
               _row("mlp", 8, 64.0, 3900, 1136, engine="v1"), _row("layer", 4, 80.0, 2722, 2248, engine="v1")]
    runs = [
        {"engine": "v2", "floor": floor, "path": "fused", "rows": v2_rows,
         "cap": {"cap_GiB": 16.5, "how": "given", "searches": [_search("v2", "none", 0, 3, 120000),
                                                               _search("v2", "mlp", 7, 4, 90000)]}},
        {"engine": "v1", "floor": floor, "path": "fused", "rows": v1_rows,
         "cap": {"cap_GiB": 16.5, "how": "given", "searches": [_search("v1", "none", 0, 3, 120000),
                                                               _search("v1", "layer", 4, 5, 117000)]}},
    ]
    shape = {"name": "base", "shape": dict(moe_step.SHAPES["base"]), "layers": 8, "batch": 2, "seq": 4096,
             "dtype": "bf16", "attention": "sdpa", "path": "fused", "runs": runs}
    return {"benchmark": "moe_step", "gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-24 00:00 UTC",
            "config": {"engines": ["v2", "v1"], "policies": [], "warmup": 2, "iters": 5, "unfused": False,
                       "quick": False, "cap_slowdown": 0.05, "memory_target_GiB": 11.0},
            "pcie": {"v2": PCIE, "v1": PCIE}, "shapes": [shape]}


def test_targets_are_judged_per_engine_from_the_worst_policy():
    result = _result()
    rep.finish(result)
    t = {(x["engine"], x["target"]): x for x in result["shapes"][0]["targets"]}
    # n < L and n = L apart: V2's worst n < L is MLP 7/8; it could not run MLP 8/8 at all, so its
    # n = L target is not met although no value was measured
    assert t[("v2", "mlp_step")]["met"] is False
    assert t[("v2", "mlp_step")]["value"] == pytest.approx(93.0 / 60.0)
    assert t[("v2", "mlp_step_all")]["value"] is None and t[("v2", "mlp_step_all")]["met"] is False
    assert t[("v1", "mlp_step")]["value"] == pytest.approx(61.5 / 61.0) and t[("v1", "mlp_step")]["met"] is True
    assert t[("v1", "mlp_step_all")]["value"] == pytest.approx(64.0 / 61.0)
    assert t[("v1", "mlp_step_all")]["met"] is False
    # the worst n < L row (MLP 2/8 frees all it moved); MLP 8/8's 1100 of 1136 is left out (n = L)
    assert t[("v1", "freed")]["value"] == pytest.approx(1.0) and t[("v1", "freed")]["met"] is True
    assert t[("v2", "layer_bound")]["value"] is None and t[("v2", "layer_bound")]["met"] is None
    # V2's offload fits 4/3 the tokens at 0.75x the rate: no gain counted at >= 0.95x (no offload's
    # own 1.0), not met, and the note says what it fit and at what rate; V1's 5/3 at 0.975x: met
    assert t[("v2", "cap_tokens")]["value"] == 1.0 and t[("v2", "cap_tokens")]["met"] is False
    assert "most tokens: x1.33 (MLP 7/8) at 0.750x the tokens/s" in t[("v2", "cap_tokens")]["note"]
    assert "most tokens" not in t[("v1", "cap_tokens")]["note"]
    assert t[("v1", "cap_tokens")]["value"] == pytest.approx(5 / 3) and t[("v1", "cap_tokens")]["met"] is True


def test_reports_hold_every_row_the_cap_table_targets_and_the_memory_choice(tmp_path):
    result = _result()
    rep.finish(result, memory_target_GiB=11.0)
    paths = rep.write_reports(result, tmp_path, "moe_step_test")
    data = json.loads((tmp_path / "moe_step_test.json").read_text())
    assert data["shapes"][0]["memory_target"]["policy"] == "MLP 8/8"  # 7000 + 3900 MiB, the fastest under 11 GiB
    md = (tmp_path / "moe_step_test.md").read_text()
    # rows, cap searches, targets (five: MLP n < L and n = L apart) and v1's layer 4/8 against the
    # peak-neutral bound
    assert md.count("\n| v2 |") == 4 + 2 + 5 and md.count("\n| v1 |") == 4 + 2 + 5 + 1
    assert "MoE-MLP offload, n = L: step / no offload" in md
    assert "Whole layers against the peak-neutral bound" in md
    assert "did not run: ValueError: Cannot offload all layers" in md
    assert "TE V2 at n = L-1" in md
    assert "Most tokens per step under 16.5 GiB" in md
    assert "Memory target 11.0 GiB: fastest measured policy is v1 MLP 8/8" in md
    # the two answers in words, per engine: cost per policy, sequences under the cap
    assert ("- v1, cost against no offload (61.0 ms, peak 4.9 GiB above the floor): MLP 2/8 x1.008 the step, "
            "peak -0.3 GiB (0.3 GiB moved); MLP 8/8 x1.049 the step, peak -1.1 GiB (1.1 GiB moved); "
            "layer 4/8 x1.311 the step, peak -2.2 GiB (2.2 GiB moved)") in md
    assert "MLP 8/8 did not run" in md
    assert ("- v1, sequences of 4096 tokens per step under 16.5 GiB (runs under the cap): no offload 3; "
            "layer 4/8 5 (x1.67 tokens, x0.97 tokens/s)") in md
    assert md.index("### In short") < md.index("### Every policy") < md.index("### Most tokens per step")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert len(paths) == 2
    else:
        from PIL import Image

        with Image.open(tmp_path / "moe_step_test.png") as chart:  # a palette PNG (bench_common.save_png)
            assert chart.mode == "P" and len(chart.getcolors()) <= 64 and chart.size[0] > 400


def test_save_png_keeps_a_chart_in_few_colours_and_fewer_bytes(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    from bench_common import save_png
    from PIL import Image

    fig, ax = plt.subplots()
    for k in range(6):
        ax.plot(range(50), [((i * (k + 3)) % 17) for i in range(50)], marker="o", label=f"series {k}")
    ax.legend()
    fig.savefig(tmp_path / "full.png", dpi=110)
    save_png(fig, tmp_path / "small.png", dpi=110)
    plt.close(fig)
    with Image.open(tmp_path / "full.png") as full, Image.open(tmp_path / "small.png") as small:
        assert small.size == full.size and small.mode == "P" and len(small.getcolors()) <= 64
    assert (tmp_path / "small.png").stat().st_size < (tmp_path / "full.png").stat().st_size


def test_merge_puts_each_engine_process_under_its_shape_and_keeps_failures_apart():
    args = moe_step.parse_args(["--quick", "--shapes", "base,moe-heavy"])
    shape_run = {"floor": {}, "path": "fused", "rows": []}
    children = [{"engine": e, "gpu": "GPU", "pcie": PCIE,
                 "shapes": {"base": dict(shape_run), "moe-heavy": {"error": "OutOfMemoryError: x"} if e == "v1"
                            else dict(shape_run)}} for e in ("v2", "v1")]
    merged = moe_step.merge(args, children)
    base, heavy = merged["shapes"]
    assert [r["engine"] for r in base["runs"]] == ["v2", "v1"] and base["failed"] == {}
    assert [r["engine"] for r in heavy["runs"]] == ["v2"] and heavy["failed"] == {"v1": "OutOfMemoryError: x"}
    assert merged["pcie"] == {"v2": PCIE, "v1": PCIE} and base["layers"] == 4


def test_file_stem_is_safe():
    from bench_common import file_stem

    assert file_stem("moe_step", "NVIDIA H100 80GB HBM3", "", "quick") == "moe_step_NVIDIA_H100_80GB_HBM3_quick"


# ------------------------------------------------------------------------------------------------
# The cap search bisects once a batch has failed


# The H100 run of moe-heavy (teo, layer 6/8) under a 42 GiB cap: 8 sequences peaked 9021 MiB above a
# 17449 MiB floor without the cap; the line through the origin said 22; 22, 21, 20, 19 all ran out of memory.
H100_BASE = (8, 9021.0)
H100_CAP_ABOVE = 42 * 1024 - 17449


def test_after_the_predicted_batch_fails_the_search_bisects_down_to_what_fit_without_the_cap():
    assert rep.predicted_batch(H100_BASE[1], H100_BASE[0], H100_CAP_ABOVE) == 22
    assert rep.next_cap_batch([], H100_BASE, H100_CAP_ABOVE, max_batch=32) == 22  # no failure yet: the line
    trials = [{"batch": 22, "fits": False, "peak_above_MiB": None}]
    # the base run (8 sequences, its peak under the cap) is known to fit: midway to 22, not 21
    assert rep.next_cap_batch(trials, H100_BASE, H100_CAP_ABOVE, max_batch=32) == (8 + 22) // 2 == 15
    # a base run over the cap bounds nothing from below: at most midway between 0 and 22 (here the
    # line through that base run says 7, and 7 it is)
    over = (8, H100_CAP_ABOVE + 1)
    assert rep.next_cap_batch(trials, over, H100_CAP_ABOVE, max_batch=32) == rep.predicted_batch(
        over[1], over[0], H100_CAP_ABOVE) == 7
    assert rep.next_cap_batch(trials, (30, H100_CAP_ABOVE + 1), H100_CAP_ABOVE, max_batch=32) == 22 // 2


@pytest.mark.parametrize("peak15,expected", [
    (15 * 9021.0 / 8, 18),  # peaks in proportion: the line says 22 again, the midpoint of 15 and 22 wins
    (21000.0, 17),          # a steeper line says 17: below the midpoint, it is taken
    (25000.0, 18),          # the line says 15 (no room): the midpoint, not one up from what fit
])
def test_after_a_fit_the_search_goes_up_by_the_line_but_stays_below_the_failure(peak15, expected):
    trials = [{"batch": 22, "fits": False, "peak_above_MiB": None},
              {"batch": 15, "fits": True, "peak_above_MiB": peak15}]
    nxt = rep.next_cap_batch(trials, H100_BASE, H100_CAP_ABOVE, max_batch=32)
    assert nxt == expected and 15 < nxt <= (15 + 22) // 2 < 22


def test_bisection_ends_within_its_budget_and_settles_next_to_the_failure():
    # the allocator fails past 12 sequences whatever the peak says (fragmentation under the cap)
    trial, calls = _memory_model(0, 9021.0 / 8, H100_CAP_ABOVE, max_ok=12)
    trials, best, bracketed = rep.search_cap(trial, H100_BASE, H100_CAP_ABOVE, max_batch=32, budget=6)
    assert calls == [22, 15, 11, 13, 12] and (best, bracketed) == (12, True)
    assert rep.next_cap_batch(trials, H100_BASE, H100_CAP_ABOVE, max_batch=32) is None  # 12 fits, 13 does not
    trial, calls = _memory_model(0, 9021.0 / 8, H100_CAP_ABOVE, max_ok=12)
    trials, best, bracketed = rep.search_cap(trial, H100_BASE, H100_CAP_ABOVE, max_batch=32, budget=4)
    assert calls == [22, 15, 11, 13] and (best, bracketed) == (11, False)


def test_when_nothing_above_the_base_fits_the_base_batch_itself_is_tried_under_the_cap():
    # the answer counts runs under the cap only: the base run bounds the search but is no result
    trial, calls = _memory_model(0, 9021.0 / 8, H100_CAP_ABOVE, max_ok=8)
    trials, best, bracketed = rep.search_cap(trial, H100_BASE, H100_CAP_ABOVE, max_batch=32, budget=6)
    assert calls == [22, 15, 11, 9, 8] and (best, bracketed) == (8, True)
    # and if even that fails under the cap, below it, still bisecting
    trial, calls = _memory_model(0, 9021.0 / 8, H100_CAP_ABOVE, max_ok=5)
    trials, best, bracketed = rep.search_cap(trial, H100_BASE, H100_CAP_ABOVE, max_batch=32, budget=8)
    assert calls == [22, 15, 11, 9, 8, 4, 6, 5] and (best, bracketed) == (5, True)
    assert rep.settled_batch([{"batch": 22, "fits": False}]) == (0, False)  # no trial fit: nothing new


# ------------------------------------------------------------------------------------------------
# Out-of-memory detail, the allocator's reserved peak and its option


OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 2.38 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.02 GiB "
    "is free. Including non-PyTorch memory, this process has 78.16 GiB memory in use. Of the allocated memory "
    "37.12 GiB is allocated by PyTorch, and 3.31 GiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html"
    "#environment-variables)")


def test_oom_detail_keeps_the_request_and_what_was_reserved_but_unallocated():
    assert rep.oom_detail(OOM_MESSAGE) == "tried to allocate 2.38 GiB; 3.31 GiB reserved but unallocated"
    assert rep.oom_error(OOM_MESSAGE) == "out of memory (tried to allocate 2.38 GiB; 3.31 GiB reserved but unallocated)"
    older = ("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.01 GiB already "
             "allocated; 5.75 MiB free; 14.41 GiB reserved in total by PyTorch)")
    assert rep.oom_detail(older) == "tried to allocate 20.00 MiB"
    assert rep.oom_detail("Allocation on device would exceed allowed memory. (out of memory)") == ""
    assert rep.oom_error("") == "out of memory"
    assert rep.oom_error(OOM_MESSAGE).startswith("out of memory")


def test_cap_table_shows_the_reserved_peak_where_recorded():
    search = _search("teo", "layer", 6, 12, 100000)
    cells = dict(zip([h for h, _, _ in rep.CAP_COLUMNS], rep._cap_cells(search, 7000.0)))
    assert cells["reserved GiB"] == "-" and cells["peak GiB"] == f"{(7000 + 9000) / 1024:.1f}"
    search["reserved_peak_MiB"] = 20 * 1024.0
    cells = dict(zip([h for h, _, _ in rep.CAP_COLUMNS], rep._cap_cells(search, 7000.0)))
    assert cells["reserved GiB"] == "20.0"


def test_alloc_conf_goes_into_each_engine_process_only_when_given(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    args = moe_step.parse_args(["--quick"])
    assert args.alloc_conf == ""
    assert moe_step.child_env(args, "teo")["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"  # left as it is
    args = moe_step.parse_args(["--quick", "--alloc-conf", "expandable_segments:True", "--unfused"])
    env = moe_step.child_env(args, "v1")
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and "PYTORCH_ALLOC_CONF" not in env
    assert env["NVTE_CPU_OFFLOAD_V1"] == "1" and env[moe_step.FUSION_ENV] == "0"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")  # the newer name must not override it
    assert moe_step.child_env(args, "v1")["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


def test_merge_records_the_allocator_setting_the_processes_saw():
    args = moe_step.parse_args(["--quick", "--alloc-conf", "expandable_segments:True"])
    child = {"engine": "teo", "gpu": "GPU", "pcie": PCIE, "alloc_conf": "expandable_segments:True",
             "shapes": {"base": {"floor": {}, "path": "fused", "rows": []}}}
    assert moe_step.merge(args, [child])["alloc_conf"] == "expandable_segments:True"
    del child["alloc_conf"]  # a child that did not say: what the parent gave it
    assert moe_step.merge(args, [child])["alloc_conf"] == "expandable_segments:True"


def test_report_header_names_the_allocator_setting():
    result = _result()
    rep.finish(result)
    assert "- allocator: PYTORCH_CUDA_ALLOC_CONF -\n" in rep.markdown(result)  # a result without the setting
    result["alloc_conf"] = ""
    assert "- allocator: PYTORCH_CUDA_ALLOC_CONF unset (PyTorch's default)" in rep.markdown(result)
    result["alloc_conf"] = "expandable_segments:True"
    assert "- allocator: PYTORCH_CUDA_ALLOC_CONF `expandable_segments:True`" in rep.markdown(result)


# ------------------------------------------------------------------------------------------------
# The ceiling of the tokens-under-a-cap target


def test_cap_ceiling_from_what_pcie_moves_by_the_peak():
    # the H100 run of moe-heavy without offload: fwd 76.9 ms, step 261.4 ms, 25194 MiB above the floor,
    # d2h 54.6 GB/s: 54.6e9 B/s x (0.0769 + 0.05 x 0.2614) s = 4.912e9 B = 4685 MiB by the peak
    assert rep.cap_tokens_ceiling(76.9, 261.4, 25194, 54.6) == pytest.approx(1 / (1 - 4684.8 / 25194), rel=1e-4)
    assert rep.cap_tokens_ceiling(76.9, 261.4, 25194, 54.6) == pytest.approx(1.228, abs=5e-4)
    assert rep.cap_tokens_ceiling(76.9, 261.4, 4000, 54.6) == float("inf")  # the forward could move it all
    assert rep.cap_tokens_ceiling(76.9, 261.4, 25194, 54.6, slowdown=0.0) == pytest.approx(
        1 / (1 - 54.6e9 * 0.0769 / 2**20 / 25194))
    with pytest.raises(ValueError, match="positive"):
        rep.cap_tokens_ceiling(76.9, 261.4, 0, 54.6)


def test_cap_ceiling_goes_under_the_cap_table_and_into_the_cap_target_only():
    result = _result()
    result["pcie"]["v1"] = dict(PCIE, d2h_GBps=54.6)
    none = result["shapes"][0]["runs"][1]["rows"][0]
    none.update({"fwd_ms": 76.9, "step_ms": 261.4, "peak_above_MiB": 25194.0})
    rep.finish(result)
    run = result["shapes"][0]["runs"][1]
    assert run["cap_ceiling"]["ceiling"] == pytest.approx(1.228, abs=5e-4)
    assert run["cap_ceiling"]["movable_MiB"] == pytest.approx(4684.8, abs=0.5)
    t = {(x["engine"], x["target"]): x for x in result["shapes"][0]["targets"]}
    assert t[("v1", "cap_tokens")]["ceiling"] == pytest.approx(1.228, abs=5e-4)
    others = [x for x in result["shapes"][0]["targets"] if x["target"] != "cap_tokens"]
    assert all("ceiling" not in x and "note" not in x for x in others)
    md = rep.markdown(result)
    assert "- v1 process: ceiling at <= 5% slower, copies within the forward: x1.23 tokens" in md
    assert "ceiling at <= 5% slower, copies within the forward: x1.23 (1.5 out of reach) |" in md
    assert "| engine | target | bound | measured | met | notes |" in md
    json.dumps(result, allow_nan=False)  # the JSON stays strict


def test_committed_results_render_with_or_without_the_optional_fields():
    from bench_common import read_result

    committed = sorted(p for pattern in ("moe_step_*.json", "moe_step_*.json.gz")
                       for p in (BENCH / "results").glob(pattern) if not p.name.startswith("moe_step_profile"))
    if not committed:
        pytest.skip("no moe_step results in this checkout")
    for path in committed:
        result = read_result(path)
        rep.finish(result, result["config"].get("memory_target_GiB"))
        md = rep.markdown(result)
        # a result without the allocator setting says "-"; others what their processes ran under
        assert f"- allocator: PYTORCH_CUDA_ALLOC_CONF {rep.alloc_conf_text(result.get('alloc_conf'))}\n" in md, path.name
        assert "### Targets" in md, path.name


def test_a_line_at_or_below_what_fits_does_not_walk_up_one_batch_per_trial():
    # each run fits with a peak near the cap (the line sees no room), and 101 failed: bisect
    near = H100_CAP_ABOVE - 1.0
    trials = [{"batch": 101, "fits": False, "peak_above_MiB": None}, {"batch": 20, "fits": True, "peak_above_MiB": near}]
    assert rep.next_cap_batch(trials, (8, near * 8 / 20), H100_CAP_ABOVE, max_batch=128) == 60
    trials.append({"batch": 60, "fits": True, "peak_above_MiB": near})
    assert rep.next_cap_batch(trials, (8, near * 8 / 20), H100_CAP_ABOVE, max_batch=128) == 80


# ------------------------------------------------------------------------------------------------
# One report from runs made in separate calls (moe_step_combine.py)


def _split_by_engine(result):
    """The synthetic two-engine result as two one-engine runs, as separate calls would write them."""
    parts = []
    for engine in result["config"]["engines"]:
        part = copy.deepcopy(result)
        part["config"]["engines"] = [engine]
        part["pcie"] = {engine: result["pcie"][engine]}
        for s in part["shapes"]:
            s["runs"] = [r for r in s["runs"] if r["engine"] == engine]
        part["date"] = f"2026-11-24 0{len(parts)}:00 UTC"
        parts.append(part)
    return parts


def test_runs_made_apart_combine_to_the_report_one_run_gives(tmp_path):
    import moe_step_combine

    whole = _result()
    rep.finish(whole, memory_target_GiB=11.0)
    parts = _split_by_engine(_result())
    for part in parts:
        rep.finish(part)  # as written by each call: derived values present, then derived again
    paths = []
    for i, part in enumerate(parts):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(part))
    assert moe_step_combine.main([*map(str, paths), "--stem", "both"]) == 0
    both = json.loads((tmp_path / "both.json").read_text())
    assert both["shapes"][0]["targets"] == whole["shapes"][0]["targets"]
    assert [r["engine"] for r in both["shapes"][0]["runs"]] == ["v2", "v1"]
    assert both["date"] == "2026-11-24 00:00 UTC / 2026-11-24 01:00 UTC"
    md = (tmp_path / "both.md").read_text()
    assert "- from part0.json (2026-11-24 00:00 UTC): v2" in md and md.count("\n| v1 |") == 4 + 2 + 5 + 1


def test_combined_runs_keep_the_budget_margin_of_the_run_with_teo_b(tmp_path):
    # teo-b ran with --budget-margin 1 in the second call; the first call's default (2) must not
    # name its budget in the combined report
    import moe_step_combine

    parts = _split_by_engine(_result())
    parts[0]["config"]["budget_margin_GiB"] = 2.0
    parts[1]["config"].update(engines=["teo-b"], budget_margin_GiB=1.0)
    parts[1]["pcie"] = {"teo-b": parts[1]["pcie"].pop("v1")}
    for s in parts[1]["shapes"]:
        for r in s["runs"]:
            r["engine"] = "teo-b"
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, part in zip(paths, parts):
        path.write_text(json.dumps(part))
    assert moe_step_combine.main([*map(str, paths), "--stem", "both"]) == 0
    both = json.loads((tmp_path / "both.json").read_text())
    assert both["config"]["budget_margin_GiB"] == 1.0
    assert "memory_budget = the cap in force (the GPU's memory where none is) less 1 GiB" in (tmp_path / "both.md").read_text()


@pytest.mark.parametrize("change, named", [
    (lambda r: r.update(gpu="NVIDIA H200"), "gpu differs between the runs"),
    (lambda r: r["config"].update(iters=9), "config.iters differs"),
    (lambda r: r["shapes"][0].update(batch=4), "shape 'base': batch is 2 in an earlier run, 4 in"),
    (lambda r: r["pcie"].update(v2=PCIE), "engine 'v2' is in more than one run"),
    (lambda r: r.update(benchmark="moe_step_profile"), "is not a moe_step result"),
])
def test_runs_that_cannot_be_compared_are_refused_by_name(change, named, tmp_path, capsys):
    import moe_step_combine

    parts = _split_by_engine(_result())
    change(parts[1])
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, part in zip(paths, parts):
        path.write_text(json.dumps(part))
    assert moe_step_combine.main(list(map(str, paths))) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "a_combined.json").exists()


class _FakeCuda:
    """What StepBench.memory_budget reads of torch.cuda: one 80 GiB device."""

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def get_device_properties(_):
        return type("Props", (), {"total_memory": 80 * moe_step.GiB})()


def test_teo_b_budget_is_the_cap_in_force_less_the_margin():
    """teo-b's memory_budget: the cap while a run under it is on, else the GPU's memory, less
    --budget-margin; the engine option is teo's memory_budget."""
    bench = moe_step.StepBench.__new__(moe_step.StepBench)  # no model: only the budget's arithmetic
    bench.torch = type("T", (), {"cuda": _FakeCuda})
    bench.args = moe_step.parse_args(["--budget-margin", "1.5"])
    bench.cap_bytes = None
    assert bench.memory_budget() == int(78.5 * moe_step.GiB)
    bench.cap_bytes = 67 * moe_step.GiB
    assert bench.memory_budget() == int(65.5 * moe_step.GiB)
    assert moe_step.parse_args([]).budget_margin == 2.0
    bench.L, bench.engine = 4, "teo-b"
    context = bench._context(Policy("layer", 2))
    assert context[0].engine.memory_budget == int(65.5 * moe_step.GiB) and context[0].engine.num_layers == 2
    assert "teo-b" in moe_step.ENGINE_ENV and moe_step.ENGINE_ENV["teo-b"]["NVTE_CPU_OFFLOAD_V1"] == "0"


def test_teo_t_budget_is_the_target_peak_no_offload_less_what_the_policy_moves():
    """teo-t's memory_budget: the floor plus this process's no-offload peak (scaled by sequences
    where only another batch was measured) less the bytes plain teo moves in a step of the policy
    (measured once per policy and batch; at n = L the (L - 1) / L of it that any schedule can free at
    the peak), plus --target-slack; no offload measured first where it did not run (a profile)."""
    bench = moe_step.StepBench.__new__(moe_step.StepBench)
    bench.args = moe_step.parse_args(["--engines", "teo-t", "--target-slack", "0.5"])
    bench.L, bench.engine, bench.floor_MiB = 8, "teo-t", 1000.0
    bench.none_peak_MiB, bench.moved_bytes = {}, {}
    measured = []
    bench._moved = lambda policy, batch: measured.append((policy.label(8), batch)) or 300 * moe_step.MiB * batch
    MiB, GiB = moe_step.MiB, moe_step.GiB
    ran = []  # where no no-offload run came first (a profile), one step of it is measured
    bench._steps = lambda policy, batch, count, warmup=0: ran.append((policy.scope, batch)) or ([], 5000.0, 0.0)
    assert bench.target_budget(Policy("mlp", 7), 2) == int(5000 * MiB - 600 * MiB + 0.5 * GiB)
    assert ran == [("none", 2)] and bench.none_peak_MiB == {2: 4000.0}
    assert bench.target_budget(Policy("mlp", 7), 2) == int(5000 * MiB - 600 * MiB + 0.5 * GiB)
    assert bench.target_budget(Policy("mlp", 7), 2) == int(5000 * MiB - 600 * MiB + 0.5 * GiB)
    assert bench.target_budget(Policy("mlp", 7), 3) == int((1000 + 6000) * MiB - 900 * MiB + 0.5 * GiB)
    assert measured == [("MLP 7/8", 2), ("MLP 7/8", 3)] and len(ran) == 1  # once per policy and batch
    context = bench._context(Policy("mlp", 7), 2)
    assert context[0].engine.memory_budget == int(4400 * MiB + 0.5 * GiB) and context[0].engine.num_layers == 7
    assert bench._context(Policy("none", 0))[0] is not None and measured == [("MLP 7/8", 2), ("MLP 7/8", 3)]
    # n = L: the last layer's bytes are on the GPU at the peak under any schedule; the target frees the rest
    assert bench.target_budget(Policy("mlp", 8), 2) == int(5000 * MiB - 600 * MiB * 7 // 8 + 0.5 * GiB)
    assert bench.target_budget(Policy("layer", 8), 2) == int(5000 * MiB - 600 * MiB * 7 // 8 + 0.5 * GiB)
    assert moe_step.ENGINE_ENV["teo-t"]["NVTE_CPU_OFFLOAD_V1"] == "0"
    for bad in ("nan", "-1"):
        with pytest.raises(SystemExit):
            moe_step.parse_args(["--target-slack", bad])
    result = _result()
    result["config"].update(engines=["v2", "v1", "teo-t"], target_slack_GiB=0.5)
    assert "- teo-t: teo with memory_budget = the static floor plus no offload's peak less the bytes the policy " \
           "moves, plus 0.5 GiB" in rep.markdown(rep.finish(result) or result)
    # --target-freed: the budget frees that share of the bytes moved
    bench.args = moe_step.parse_args(["--engines", "teo-t", "--target-freed", "0.96"])
    # (to a byte: the package's rounding of a fraction of the bytes is its own)
    assert bench.target_budget(Policy("mlp", 7), 2) == pytest.approx(5000 * MiB - 600 * MiB * 0.96, abs=1)
    assert bench.target_budget(Policy("mlp", 8), 2) == pytest.approx(5000 * MiB - (600 * MiB * 7 // 8) * 0.96, abs=1)
    for bad in ("0", "1.2", "nan", "-0.5"):
        with pytest.raises(SystemExit):
            moe_step.parse_args(["--target-freed", bad])
    result["config"].update(target_slack_GiB=0, target_freed=0.96)
    assert "less 0.96 of the bytes the policy moves, plus 0 GiB" in rep.markdown(rep.finish(result) or result)


def test_teo_t_budget_comes_from_the_package_where_it_has_one(monkeypatch):
    """moe_step.target_budget hands its arguments to te_offload_ops.engines.target_budget where the
    package has it, and computes the same formula where it does not."""
    import te_offload_ops.engines as engines

    MiB = moe_step.MiB
    kw = dict(floor_bytes=1000 * MiB, no_offload_peak_bytes=4000 * MiB, moved_bytes=800 * MiB, num_layers=8,
              model_layers=8, freed=0.5, slack_bytes=10 * MiB)
    monkeypatch.delattr(engines, "target_budget", raising=False)
    assert moe_step.target_budget(**kw) == (1000 + 4000 - 350 + 10) * MiB  # n = L: half of 7/8 of 800 MiB
    assert moe_step.target_budget(**{**kw, "num_layers": 7}) == (1000 + 4000 - 400 + 10) * MiB
    seen = []
    monkeypatch.setattr(engines, "target_budget", lambda **given: seen.append(given) or 123, raising=False)
    assert moe_step.target_budget(**kw) == 123 and seen == [kw]


def test_after_a_failed_step_te_offload_synchronizers_let_go_of_their_tensors(monkeypatch):
    """What a step that failed mid-forward left in TE V2's synchronizers (held alive by its autograd
    graph, out of gc's reach) is released in every layer state; none found where TE's module is absent."""
    import sys
    import types

    released = []

    class State:
        def __init__(self, name):
            self.name = name

        def release_all_memory(self):
            released.append(self.name)

    fake = types.ModuleType("transformer_engine.pytorch.cpu_offload")
    fake.OffloadSynchronizer = type("OffloadSynchronizer", (), {})
    sync = fake.OffloadSynchronizer()
    sync.layer_states = {0: State("L0"), 1: State("L1")}
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.cpu_offload", fake)
    assert moe_step.release_te_offload_state() == 1 and sorted(released) == ["L0", "L1"]
    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch.cpu_offload")
    assert moe_step.release_te_offload_state() == 0


def test_under_cap_limits_the_allocator_and_always_restores_it():
    """The cap search and a profile under --memory-cap both run inside under_cap: the allocator's
    fraction and teo-b's cap are set inside and restored after, also when the run raises."""
    fractions = []
    cuda = type("Cuda", (_FakeCuda,), {"set_per_process_memory_fraction": staticmethod(fractions.append)})
    bench = moe_step.StepBench.__new__(moe_step.StepBench)
    bench.torch = type("T", (), {"cuda": cuda})
    bench.args = moe_step.parse_args(["--budget-margin", "2"])
    bench.cap_bytes = None
    with bench.under_cap(40.0):
        assert fractions == [0.5] and bench.memory_budget() == 38 * moe_step.GiB
    assert fractions == [0.5, 1.0] and bench.cap_bytes is None
    with pytest.raises(RuntimeError, match="out of memory"), bench.under_cap(20.0):
        raise RuntimeError("out of memory")
    assert fractions == [0.5, 1.0, 0.25, 1.0] and bench.cap_bytes is None
    with bench.under_cap(None):  # no cap: nothing touched
        assert bench.cap_bytes is None
    assert len(fractions) == 4
