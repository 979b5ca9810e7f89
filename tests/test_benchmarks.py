"""CPU checks of the benchmark scripts: their bookkeeping, and a clear exit without a GPU."""

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

MiB = 2**20
BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "experiments"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("script", ["moe_step.py", "bench_fused_mlp.py", "bench_kernels.py", "bench_graphs.py",
                                    "bench_megatron_settings.py", "megatron_moe_layer.py", "fp8_recipes.py",
                                    "megatron_gpt.py", "first_step.py", "bench_fp8_gemm.py", "fp8_training_loss.py",
                                    "megatron_loss.py", "bench_fp8_wgrad.py", "experiments/ablate_epilogue.py", "experiments/profile_fp8_mlp.py",
                                    "experiments/bench_copy_interference.py", "experiments/bench_cluster2x2.py",
                                    "experiments/profile_gemm.py", "experiments/diagnose_fp8_gemm.py",
                                    "experiments/tune_fp8_rows.py", "experiments/ablate_fp8_epilogue.py",
                                    "experiments/kernels_under_dma.py"])
def test_benchmarks_exit_clearly_without_a_gpu(script):
    proc = subprocess.run([sys.executable, str(BENCH / script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"{Path(script).name}: cannot run: " in proc.stderr and "Traceback" not in proc.stderr


def test_every_benchmark_script_is_kept_run_or_an_experiment_with_a_line():
    """benchmarks/ holds the benchmarks users run and their shared modules; each experiment has its
    line in experiments/README.md."""
    kept = {"moe_step.py", "moe_model.py", "moe_step_report.py", "moe_step_combine.py", "step_profile.py",
            "bench_common.py", "timing.py", "bench_fused_mlp.py", "bench_kernels.py", "bench_graphs.py",
            "bench_megatron_settings.py", "megatron_moe_layer.py", "fp8_recipes.py", "megatron_gpt.py",
            "megatron_gpt_model.py", "megatron_gpt_report.py", "megatron_gpt_jobs.py", "megatron_gpt_numerics.py",
            "comm_copy_overlap.py", "teo_budget_check.py", "first_step.py", "bench_fp8_gemm.py",
            "fp8_training_loss.py", "megatron_loss.py", "bench_fp8_wgrad.py", "gpu_clocks.py"}
    assert {p.name for p in BENCH.glob("*.py")} == kept
    readme = (BENCH / "experiments" / "README.md").read_text()
    for script in (BENCH / "experiments").glob("*.py"):
        assert f"- `{script.name}`: " in readme, script.name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_run_runs_the_tests_given_then_the_main_job_and_keeps_the_logs(tmp_path):
    script = BENCH.parent / "scripts" / "gpu_run.sh"
    env = dict(os.environ, OUT=str(tmp_path / "a"), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(script), "--no-bench", "tests/test_policy.py", "-q"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in (tmp_path / "a" / "pytest.log").read_text()
    assert (tmp_path / "a" / "gpu.txt").exists() and not (tmp_path / "a" / "moe_step.log").exists()
    env["OUT"] = str(tmp_path / "b")
    proc = subprocess.run(["bash", str(script), "tests/test_policy.py", "-q"], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 2  # the tests passed; the main job cannot run without a GPU, and says so
    assert "moe_step.py: cannot run: no CUDA GPU" in (tmp_path / "b" / "moe_step.log").read_text()


def test_timing_medians_skip_samples_not_taken_and_interleave_rounds():
    from timing import interleaved, median

    assert median([3.0, float("nan"), 1.0, None, 2.0]) == 2.0
    assert math.isnan(median([float("nan")])) and math.isnan(median([]))
    calls = []
    samples = interleaved({"a": lambda: calls.append("a") or len(calls), "b": lambda: calls.append("b") or -1}, 3)
    assert calls == ["a", "b"] * 3  # one sample of each contender per round, in turn
    assert samples == {"a": [1, 3, 5], "b": [-1, -1, -1]}


def test_kernels_report_has_a_row_per_case_and_marks_failures(tmp_path):
    from bench_kernels import chart, markdown

    rows = [{"case": "fc1 fwd (plain)", "schedule": "pingpong", "ours_ms": 0.25, "ours_tflops": 650.0,
             "cooperative_tflops": 620.0, "pingpong_tflops": 650.0, "bmm_tflops": 640.0, "grouped_mm_tflops": 600.0,
             "ours_vs_bmm": 1.015, "pingpong_host_us": 30.0, "bmm_host_us": 8.0},
            {"case": "fc1 wgrad uneven", "schedule": "cooperative", "error": "RuntimeError('x')"}]
    result = {"gpu": "GPU", "date": "today", "dtype": "bfloat16", "experts": 8, "tokens_per_expert": 2048,
              "hidden": 2688, "ffn": 1856, "reps": 20, "inner": 10, "rows": rows,
              "first_call_seconds": {"fc1 fwd (plain) [pingpong]": 3.5}}
    md = markdown(result)
    assert "| fc1 fwd (plain) | pingpong | 0.250 | 650 | 620 | 650 | 640 | 600 | 1.01 | 30 | 8 |" in md
    assert "| fc1 wgrad uneven | cooperative | - | - |" in md and "Failed: fc1 wgrad uneven: RuntimeError('x')" in md
    assert "fc1 fwd (plain) [pingpong] 3.50" in md
    if chart(result, tmp_path / "k.png"):
        assert (tmp_path / "k.png").stat().st_size > 0


def test_fused_mlp_chart_draws_every_config(tmp_path):
    from bench_fused_mlp import chart

    b = {"ours_gpu_tflops": 600.0, "te_gpu_tflops": 300.0, "bmm_tflops": 650.0}
    result = {"gpu": "GPU", "date": "today", "rows": [{"E": 8, "tokens_per_expert": 2048, "H": 2688, "F": 1856,
                                                        "fwd_bwd": b}] * 2}
    if chart(result, tmp_path / "f.png"):
        assert (tmp_path / "f.png").stat().st_size > 0


def test_graphs_report_names_targets_and_ratios(tmp_path):
    from bench_graphs import markdown, plot

    contenders = {"eager back to back": {"ms": 2.0, "TFLOPs": 500.0}, "eager host-ahead": {"ms": 1.6, "TFLOPs": 640.0},
                  "graphed back to back": {"ms": 1.62, "TFLOPs": 630.0}}
    row = {"config": "1 layer", "contenders": contenders, "graphed_vs_eager_b2b": 2.0 / 1.62,
           "graphed_vs_host_ahead": 1.6 / 1.62, "target_met": True, "capture_s": 0.5, "offloaded_MiB_per_step": 0.0}
    result = {"gpu": "GPU", "date": "today", "experts": 8, "tokens": 2048, "hidden": 2688, "ffn": 1856,
              "rounds": 3, "steps": 5, "rows": [row]}
    text = markdown(result)
    assert "| 1 layer | graphed back to back | 1.620 | 630 |" in text
    assert "| 1 layer | 1.235 | 0.988 | True |" in text
    plot(result, tmp_path / "g.png")
    assert (tmp_path / "g.png").stat().st_size > 0


def test_copy_interference_report(tmp_path):
    from bench_copy_interference import chart, markdown

    rows = [{"direction": "d2h", "chunk_MiB": None, "chunks": 0, "small_wait_ms": 0.01, "small_wait_max_ms": 0.02,
             "big_GBps": None, "big_ms": None, "overlapped": None},
            {"direction": "d2h", "chunk_MiB": 0, "chunks": 1, "small_wait_ms": 8.25, "small_wait_max_ms": 9.0,
             "big_GBps": 54.7, "big_ms": 9.8, "overlapped": True},
            {"direction": "h2d", "chunk_MiB": 4, "chunks": 2, "small_wait_ms": 0.01, "small_wait_max_ms": 0.01,
             "big_GBps": 50.0, "big_ms": 0.17, "overlapped": False},
            {"direction": "d2h", "chunk_MiB": 16, "chunks": 32, "small_wait_ms": 0.31, "small_wait_max_ms": 0.4,
             "big_GBps": 53.9, "big_ms": 9.96},
            {"direction": "d2h", "chunk_MiB": 16, "chunks": 32, "small_wait_ms": 0.6, "small_wait_max_ms": 0.7,
             "big_GBps": 52.0, "big_ms": 10.3, "paced_depth": 2, "overlapped": True}]
    result = {"gpu": "GPU", "date": "today", "mib": 512, "lead_ms": 2.0, "reps": 7, "rows": rows}
    text = markdown(result)
    assert "| d2h | whole | 1 | 8.250 (9.000) | 54.7 | 9.80 |" in text
    assert "| d2h | 16 | 32 | 0.310 (0.400) | 53.9 | 9.96 |" in text
    assert "| d2h | no large copy | 0 | 0.010 (0.020) | - | - |" in text
    assert "| h2d | 4 | 2 | 0.010 (0.010) (large copy already done: not measured) | 50.0 | 0.17 |" in text
    assert "| d2h | 16, fed 2 at a time | 32 | 0.600 (0.700) | 52.0 | 10.30 |" in text
    assert chart(result, tmp_path / "c.png") and (tmp_path / "c.png").stat().st_size > 0


def test_cluster2x2_report_flags_outputs_that_differ(tmp_path):
    from bench_cluster2x2 import chart, markdown

    rows = [{"gemm": "fc1 wgrad", "pair_ms": 0.26, "two_by_two_ms": 0.2, "speedup": 1.3, "pair_TFLOPs": 620.0,
             "two_by_two_TFLOPs": 806.0, "same_bits": True, "host_behind_samples": 0},
            {"gemm": "fc2 fwd", "pair_ms": 0.25, "two_by_two_ms": 0.26, "speedup": 0.96, "pair_TFLOPs": 640.0,
             "two_by_two_TFLOPs": 615.0, "same_bits": False, "host_behind_samples": 0}]
    result = {"gpu": "GPU", "date": "today", "reps": 15, "inner": 10, "rows": rows,
              "shape": {"experts": 8, "tokens_per_expert": 2048, "hidden": 2688, "ffn": 1856, "skew": False}}
    text = markdown(result)
    assert "| fc1 wgrad | 0.260 | 0.200 | 1.300 | 620 | 806 | yes |" in text
    assert "| fc2 fwd | 0.250 | 0.260 | 0.960 | 640 | 615 | **no** |" in text
    if chart(result, tmp_path / "c.png"):
        assert (tmp_path / "c.png").stat().st_size > 0


def test_fp8_gemm_report_gives_ratios_and_names_contenders_that_did_not_run(tmp_path):
    from bench_fp8_gemm import chart, markdown

    def timed(tf):
        return {"ms": 1.0, "TFLOPs": tf, "host_us": 20.0, "host_behind_samples": 0}

    rows = [{"tokens_per_expert": 4096, "n": 2048, "k": 4096, "gflop": 550.0, "fp8_vs_dequant_bf16": 2.3e-3,
             "fp8_bn192_vs_fp8": 1e-3, "fp8_vs_te_fp8": None, "bf16_vs_dequant_bf16": 1e-6,
             "sm_MHz": 1755.0, "sm_MHz_min": 1620.0, "power_W": 688.4,
             "contenders": {"fp8": timed(1100.0), "fp8 overlap": timed(1150.0),
                            "fp8 overlap pair": timed(1120.0), "fp8 BN192": timed(1050.0),
                            "bf16": timed(550.0),
                            "te fp8": {"unavailable": "RuntimeError: no cuBLAS block scaling"}}}]
    rows.append({**rows[0], "tokens_per_expert": 8192})
    for key in ("sm_MHz", "sm_MHz_min", "power_W"):  # a row without clock samples (no nvidia-smi)
        del rows[1][key]
    result = {"gpu": "GPU", "date": "today", "experts": 8, "reps": 10, "inner": 10, "rows": rows,
              "fp8_compile_seconds": [{"n": 2048, "k": 4096, "bn": 128, "promotion": "overlap", "clusters": "2x2",
                                       "seconds": 8.9}]}
    text = markdown(result)
    # ours: the default (overlapped) promotion
    assert ("| 4096 | 2048 | 4096 | 1100 | 1150 | 1120 | 1050 | 550 | n/a | 2.09 | n/a | 2.3e-03 | n/a | "
            "1755 (1620) | 688 |") in text
    assert "| 8192 | 2048 | 4096 | 1100 | 1150 | 1120 | 1050 | 550 | n/a | 2.09 | n/a | 2.3e-03 | n/a | - | - |" in text
    assert "compile seconds (first call): N=2048 K=4096 BN=128 overlap 2x2 8.9" in text
    # an FP8 contender whose bits differ from the serial one's is named with its error
    assert "differs from fp8's (relative error): 4096 x N=2048 K=4096: fp8_bn192_vs_fp8 1.0e-03" in text
    del rows[1]["contenders"]["fp8 overlap"]  # a file without that contender: ours is the serial fp8
    result["fp8_compile_seconds"] = {"('fp8_blockwise', 'a key')": 1.5}  # a file keyed by the cache's key
    text2 = markdown(result)
    assert "| 8192 | 2048 | 4096 | 1100 | n/a | 1120 | 1050 | 550 | n/a | 2.00 |" in text2
    assert "compile seconds (first call): 1.5" in text2
    assert "Not run: RuntimeError: no cuBLAS block scaling" in text
    if chart(result, tmp_path / "c.png"):
        assert (tmp_path / "c.png").stat().st_size > 0


def test_fp8_gemm_shapes_option_checks_shapes_and_names_the_files():
    import argparse

    from bench_fp8_gemm import SHAPES, _shape, shapes_suffix

    assert _shape("2048x7168") == (2048, 7168) and _shape("7168X2048") == (7168, 2048)
    for bad in ("2048", "2048x7170", "0x128", "ax128"):
        with pytest.raises(argparse.ArgumentTypeError):
            _shape(bad)
    assert shapes_suffix(SHAPES) == "" and shapes_suffix([(2048, 7168), (7168, 2048)]) == "N2048K7168_N7168K2048"


def test_fp8_wgrad_report_gives_tflops_ratios_and_the_command_without_paths(tmp_path):
    from bench_common import command_line
    from bench_fp8_wgrad import chart, markdown

    def timed(tf):
        return {"ms": 0.5, "TFLOPs": tf, "host_us": 20.0, "host_behind_samples": 0}

    contenders = {"fp8": timed(900.0), "fp8 main_grad": timed(850.0), "fp8 serial": timed(720.0),
                  "fp8 main_grad serial": timed(700.0), "bf16": timed(600.0), "bf16 main_grad": timed(560.0),
                  "columns": {"ms": 0.031, "host_us": 9.0, "host_behind_samples": 0}}
    rows = [{"tokens_per_expert": 2048, "m": 2688, "n": 1856, "gflop": 163.0, "fp8_vs_dequant_bf16": 1.1e-3,
             "contenders": contenders}]
    command = command_line("benchmarks/bench_fp8_wgrad.py", ["--tokens", "2048", "--out", "/x/y"], env={})
    result = {"gpu": "GPU", "date": "today", "experts": 8, "reps": 10, "inner": 10, "rows": rows, "command": command}
    text = markdown(result)
    assert "| 2048 | 2688 | 1856 | 900 | 850 | 720 | 700 | 600 | 560 | 31 | 1.50 | 1.25 | 1.1e-03 |" in text
    assert "`python benchmarks/bench_fp8_wgrad.py --tokens 2048`" in text and "/x/y" not in text
    if chart(result, tmp_path / "c.png"):
        assert (tmp_path / "c.png").stat().st_size > 0


def test_a_results_pages_command_names_the_settings_that_change_what_ran():
    from bench_common import command_line

    env = {"TEO_FP8_WGRAD": "fp8", "TEO_GEMM_SCHEDULE": "cooperative", "TEO_KERNEL_CACHE_DIR": "/somewhere",
           "TEO_FP8_ROWS": ""}
    assert command_line("benchmarks/fp8_recipes.py", ["--recipes", "none", "--out=/o"], env=env) == \
        "TEO_GEMM_SCHEDULE=cooperative TEO_FP8_WGRAD=fp8 python benchmarks/fp8_recipes.py --recipes none"
    assert command_line("b.py", [], env={}) == "python b.py"


def test_megatron_settings_report_splits_main_grads_extra_time_into_kernels_and_the_rest():
    import bench_megatron_settings as bms

    plain = [{"kernel": "wgrad_bf16", "us_per_step": 500.0}, {"kernel": "dgrad", "us_per_step": 600.0},
             {"kernel": "copy|x", "us_per_step": 5.0}]
    main_grad = [{"kernel": "wgrad_main_grad", "us_per_step": 545.0}, {"kernel": "dgrad", "us_per_step": 300.0},
                 {"kernel": "dgrad", "us_per_step": 310.0},  # two kernels the profiler cut to one name
                 {"kernel": "copy|x", "us_per_step": 5.0}]
    diff = bms.kernel_diff(plain, main_grad)
    assert [(d["kernel"], d["diff_us"]) for d in diff] == [
        ("wgrad_main_grad", 545.0), ("wgrad_bf16", -500.0), ("dgrad", 10.0), ("copy|x", 0.0)]
    variants = {v: {"wall_ms": 1.0, "gpu_ms": g, "wall_vs_plain": 1.0, "gpu_vs_plain": g / 1.5}
                for v, g in (("plain", 1.5), ("main_grad", 1.584))}
    row = {"E": 8, "tokens_per_expert": 2048, "H": 2688, "F": 1856, "paths": {}, "variants": variants,
           "split_check_cost": {"wall": 0.0, "gpu_busy": 0.0}, "main_grad_kernels": diff}
    md = bms.markdown({"gpu": "H100", "date": "today", "rounds": 3, "rows": [row]})
    # 84 us more GPU time; the kernels account for 45 + 10 = 55 of it, 29 us between them
    assert "+84.0 us of GPU time (host ahead), of which kernels +55.0 us (profiler) and the rest (+29.0 us" in md
    assert "| dgrad | 600.0 | 610.0 | +10.0 |" in md and "| copy/x | 5.0 | 5.0 | +0.0 |" in md
    variants["main_grad"]["gpu_ms"] = float("nan")  # no host-ahead time: the kernels alone
    md = bms.markdown({"gpu": "H100", "date": "today", "rounds": 3, "rows": [row]})
    assert "kernels +55.0 us (profiler; no host-ahead GPU time to set it against)" in md and "+nan" not in md
    assert "The same by GEMM" not in md  # a result without the ranges
    name = bms.gemm_row_name
    assert name("te_offload_ops.gemm[wgrad tma_f32 n=2688 k=2048]") == "te_offload_ops.gemm[wgrad n=2688 k=2048]"
    assert name("te_offload_ops.gemm[gemm srelu n=1856 k=2688]") == "te_offload_ops.gemm[gemm srelu n=1856 k=2688]"
    row["main_grad_gemms"] = bms.kernel_diff(
        [{"kernel": name("te_offload_ops.gemm[wgrad store n=2688 k=2048]"), "us_per_step": 250.0},
         {"kernel": name("te_offload_ops.gemm[gemm srelu n=1856 k=2688]"), "us_per_step": 300.0}],
        [{"kernel": name("te_offload_ops.gemm[wgrad tma_f32 n=2688 k=2048]"), "us_per_step": 292.0},
         {"kernel": name("te_offload_ops.gemm[gemm srelu n=1856 k=2688]"), "us_per_step": 301.0}])
    md = bms.markdown({"gpu": "H100", "date": "today", "rounds": 3, "rows": [row]})
    assert "| te_offload_ops.gemm[wgrad n=2688 k=2048] | 250.0 | 292.0 | +42.0 |" in md
    assert "| te_offload_ops.gemm[gemm srelu n=1856 k=2688] | 300.0 | 301.0 | +1.0 |" in md
    row["main_grad_gemms"] = bms.kernel_diff([{"kernel": "te_offload_ops.gemm[a]", "us_per_step": 0.0}],
                                             [{"kernel": "te_offload_ops.gemm[a]", "us_per_step": 0.0}])
    md = bms.markdown({"gpu": "H100", "date": "today", "rounds": 3, "rows": [row]})
    assert "no pairing" in md and "| te_offload_ops.gemm[a]" not in md
    del row["main_grad_gemms"]
    # launch ranges and GEMM kernels paired by start time, whatever order the profiler lists them in
    ranges = [(30.0, "te_offload_ops.gemm[wgrad tma_f32 n=8 k=8]"), (10.0, "te_offload_ops.gemm[gemm srelu n=8 k=8]"),
              (50.0, "te_offload_ops.gemm[gemm srelu n=8 k=8]"), (70.0, "te_offload_ops.gemm[wgrad tma_f32 n=8 k=8]")]
    kernels = [(75.0, 40.0), (12.0, 20.0), (33.0, 30.0), (52.0, 22.0)]
    assert sorted((r["kernel"], r["us_per_step"]) for r in bms.pair_in_order(ranges, kernels, steps=2)) == [
        ("te_offload_ops.gemm[gemm srelu n=8 k=8]", 21.0), ("te_offload_ops.gemm[wgrad n=8 k=8]", 35.0)]
    assert bms.pair_in_order(ranges, kernels[:3], steps=2) == []  # a kernel missing: no guess
    row["gemm_us"] = {"plain": {"g[wgrad n=8 k=0]": 235.0}, "main_grad": {"g[wgrad n=8 k=0]": 282.25},
                      "main_grad(tma,coop)": {"g[wgrad n=8 k=0]": 260.0}}
    md = bms.markdown({"gpu": "H100", "date": "today", "rounds": 3, "rows": [row]})
    assert "| GEMM | plain | main_grad | main_grad(tma,coop) |" in md
    assert "| g[wgrad n=8 k=0] | 235.0 | 282.2 | 260.0 |" in md
    del row["gemm_us"]["main_grad(tma,coop)"]  # the default way alone: the diff table says it all
    assert "by variant" not in bms.markdown({"gpu": "H100", "date": "today", "rounds": 3, "rows": [row]})
    del row["main_grad_kernels"]  # a result without the profile: no such section
    assert "Where main_grad's extra GPU time goes" not in bms.markdown({"gpu": "H100", "date": "today", "rounds": 3,
                                                                        "rows": [row]})


def test_megatron_settings_times_the_main_grad_ways_asked_for():
    import bench_megatron_settings as bms

    assert bms.parse_args(["--ways", "main_grad(tma,coop)", "main_grad(red,ping)"]).ways == [
        "main_grad(tma,coop)", "main_grad(red,ping)"]
    assert bms.parse_args([]).ways is None  # all of them
    with pytest.raises(SystemExit):
        bms.parse_args(["--ways", "main_grad(tma,ping256)"])


def test_fp8_recipes_report_names_each_recipe_and_error():
    import fp8_recipes

    args = fp8_recipes.parse_args(["--recipes", "none,DelayedScaling,Float8BlockScaling"])
    assert args.recipes == ["none", "DelayedScaling", "Float8BlockScaling"]
    with pytest.raises(SystemExit):
        fp8_recipes.parse_args(["--recipes", "Float8Tensorwise"])
    row = {"ms": 2.0, "saved_MiB": {"activations": 129.0, "weight_copies": 76.0, "parameters": 0.0},
           "v2_moved_MiB": 129.0, "plan": ["GroupedLinear", "ScaledSReLU", "GroupedLinear"]}
    result = {"gpu": "GPU", "date": "2026-11-25 00:00 UTC", "command": "python benchmarks/fp8_recipes.py",
              "args": {"experts": 8, "tokens": 2048, "hidden": 2688, "ffn": 1856, "iters": 20},
              "rows": [dict(row, impl="te", recipe="DelayedScaling", host_ahead_ms=None, host_queue_ms=None),
                       dict(row, impl="ours", recipe="DelayedScaling", host_ahead_ms=1.0, host_queue_ms=1.5),
                       dict(row, impl="ours", recipe="none", host_ahead_ms=1.0),  # written before the column
                       {"impl": "te", "recipe": "Float8BlockScaling", "error": "RuntimeError: no algorithm"}]}
    md = fp8_recipes.markdown(result)
    assert "| DelayedScaling | te_offload_ops | 2.00 | 490 | 1.00 | 981 | 1.50 | 129 | 76 | 129 |" in md
    assert "| DelayedScaling | TE ops | 2.00 | 490 | - | - | - | 129 |" in md  # the host never got ahead
    assert "| none | te_offload_ops | 2.00 | 490 | 1.00 | 981 | - | 129 |" in md
    assert "| Float8BlockScaling | TE ops | RuntimeError: no algorithm |" in md
    assert fp8_recipes.command_line(["--out", "/tmp/x", "--recipes", "none"]) == \
        "python benchmarks/fp8_recipes.py --recipes none"
    assert math.isclose(fp8_recipes.tflops(argparse.Namespace(experts=8, tokens=2048, hidden=2688, ffn=1856), 1.0),
                        6 * 2 * 8 * 2048 * 2688 * 1856 / 1e9)


def test_fp8_recipes_main_grad_option_is_recorded_in_its_args_and_header():
    import fp8_recipes

    assert fp8_recipes.parse_args([]).main_grad is False
    assert fp8_recipes.parse_args(["--main-grad"]).main_grad is True
    result = {"gpu": "GPU", "date": "2026-11-25 00:00 UTC", "command": "python benchmarks/fp8_recipes.py --main-grad",
              "args": {"experts": 8, "tokens": 2048, "hidden": 2688, "ffn": 1856, "iters": 20, "main_grad": True},
              "rows": []}
    assert "wgrads added into fp32 main_grad" in fp8_recipes.markdown(result)
    result["args"]["main_grad"] = False
    assert "main_grad" not in fp8_recipes.markdown(result)


def test_fp8_recipes_file_stem_names_the_shape_recipes_and_settings_that_differ():
    import fp8_recipes

    assert fp8_recipes.results_stem("NVIDIA H200", fp8_recipes.parse_args([])) == "fp8_recipes_NVIDIA_H200"
    args = fp8_recipes.parse_args(["--recipes", "none,Float8BlockScaling", "--main-grad", "--later-micro-batch"])
    assert args.later_micro_batch is True
    assert (fp8_recipes.results_stem("NVIDIA H200", args)
            == "fp8_recipes_NVIDIA_H200_bf16_and_block_main_grad_later_micro_batch")
    args = fp8_recipes.parse_args(["--recipes", "Float8BlockScaling,none", "--tokens", "4096", "-H", "7168", "-F", "2048"])
    assert fp8_recipes.results_stem("NVIDIA H200", args) == "fp8_recipes_NVIDIA_H200_E8x4096_H7168_F2048_bf16_and_block"
    args = fp8_recipes.parse_args(["--experts", "16", "--ffn", "1024"])
    assert fp8_recipes.results_stem("G", args) == "fp8_recipes_G_E16x2048_F1024"
    result = {"gpu": "GPU", "date": "2026-11-25 00:00 UTC", "command": "python benchmarks/fp8_recipes.py",
              "args": {"experts": 8, "tokens": 2048, "hidden": 2688, "ffn": 1856, "iters": 20,
                       "later_micro_batch": True}, "rows": []}
    assert "later micro-batch of a step" in fp8_recipes.markdown(result)


def test_attach_main_grads_lays_out_megatrons_buffer_and_drops_grad():
    from bench_common import attach_main_grads

    class Experts(torch.nn.Module):
        def __init__(self, shapes):
            super().__init__()
            self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(*s)) for s in shapes)
            self.bias = torch.nn.Parameter(torch.zeros(3))  # 1-D: no main_grad

        def forward(self, x):
            for w in self.weights:
                x = x @ w.t() if w.dim() == 2 else x @ w[0].t()
            return x

    class Act(torch.nn.Module):
        def forward(self, x):
            return x

    fc1, act, fc2 = Experts([(3, 3), (3, 3)]), Act(), Experts([(2, 3, 3)])
    buffers = attach_main_grads([fc1, act, fc2])
    assert [b.dtype for b in buffers] == [torch.float32, torch.float32]
    assert [b.numel() for b in buffers] == [18, 18]
    w0, w1 = fc1.weights
    # the first expert last in the buffer, as in Megatron's grad buffer
    assert w1.main_grad.data_ptr() == buffers[0].data_ptr()
    assert w0.main_grad.data_ptr() == buffers[0].data_ptr() + 9 * 4
    assert fc2.weights[0].main_grad.shape == (2, 3, 3) and fc2.weights[0].main_grad.data_ptr() == buffers[1].data_ptr()
    assert not hasattr(fc1.bias, "main_grad") and w0.grad_added_to_main_grad is False
    out = fc2(fc1(torch.randn(4, 3)))
    out.sum().backward()
    assert w0.grad is None and w1.grad is None and fc2.weights[0].grad is None  # dropped after accumulation
    assert fc1.bias.grad is None  # unused in forward


def test_first_step_report_compares_each_mode_with_stock(tmp_path):
    import first_step

    def run(w, m, first, compiled=0, loaded=0):
        return {"workload": w, "mode": m, "first_step_s": first, "second_step_s": 0.02, "process_s": first + 8,
                "imports_s": 6.0, "compiled": compiled, "compile_s": 1.5 * compiled, "loaded": loaded,
                "load_s": 0.003 * loaded, "loaded_by": ["shared object"] if loaded else [],
                "dsl_imported": bool(compiled), "dsl_import_s": 0.9 if compiled else 0.0,
                "first_launch_s": 0.01 * (compiled + loaded), "path": "stock TE ops" if m == "stock" else "fused"}

    runs = [run("mlp", "cold", 10.0, compiled=6), run("mlp", "warm", 1.4, loaded=6), run("mlp", "stock", 1.0),
            run("mlp", "cold", 12.0, compiled=6), run("mlp", "warm", 1.6, loaded=6), run("mlp", "stock", 1.2),
            run("model", "cold", 11.0, compiled=6), run("model", "warm", 3.5, loaded=6), run("model", "stock", 1.5)]
    rows = first_step.summarize(runs, ["mlp", "model"], ["cold", "warm", "stock"])
    by = {(r["workload"], r["mode"]): r for r in rows}
    assert by["mlp", "cold"]["first_step_s"] == pytest.approx(11.0) and by["mlp", "cold"]["runs"] == 2
    assert by["mlp", "warm"]["vs_stock_s"] == pytest.approx(1.5 - 1.1)
    assert "vs_stock_s" not in by["mlp", "stock"]
    assert by["model", "warm"]["vs_stock_s"] == pytest.approx(2.0)
    settings = {"experts": 16, "topk": 4, "hidden": 2048, "ffn": 1024, "heads": 16, "layers": 4, "seq": 2048,
                "rounds": 2}
    text = first_step.markdown({"gpu": "GPU", "date": "2026-11-26", "settings": settings, "summary": rows})
    assert "mlp: warm +0.40 s vs stock: meets the target" in text
    assert "model: warm +2.00 s vs stock: misses the target" in text
    assert text.count("\n| ") == 1 + 6  # header and one row per (workload, mode)
    assert by["mlp", "cold"]["dsl_imported"] == 2 and by["mlp", "warm"]["dsl_imported"] == 0
    assert by["mlp", "warm"]["loaded_by"] == ["shared object"] and by["mlp", "stock"]["loaded_by"] == []
    assert "| mlp | warm | 1.50 | +0.40 | 0.020 | 6.00 | 0.00 (0/2) | 0 | 0.00 | 6 | 0.018 | shared object | " in text


def test_fp8_training_loss_report_says_whether_fp8_ends_within_the_bf16_spread():
    import fp8_training_loss as ftl

    args = ftl.parse_args(["--steps", "4", "--tail", "2", "--seeds", "2"])
    runs = [{"precision": p, "seed": s, "losses": [1.0, 0.5, f, f], "final": f, "plan": ["FusedScaledSReLUMLP"]}
            for p, s, f in (("bf16", 0, 0.10), ("fp8-block", 0, 0.13), ("bf16", 1, 0.12), ("fp8-block", 1, 0.11))]
    result = {"gpu": "GPU", "date": "d", "args": vars(args) | {"out": "results"}, "command": "c", "runs": runs,
              "finals": {"bf16": [0.10, 0.12], "fp8-block": [0.13, 0.11]}, "bf16_spread": [0.10, 0.12],
              "fp8_within_bf16_spread": True}
    md = ftl.markdown(result)
    assert "| fp8-block | 0 | 1.0000 | 0.13000 | FusedScaledSReLUMLP |" in md and "within the bf16 spread" in md
    with pytest.raises(SystemExit):
        ftl.parse_args(["--tail", "400"])


def test_clock_samples_parse_and_summarize_and_a_missing_sampler_gives_nothing():
    from gpu_clocks import GpuClocks, parse_samples, summarize

    text = "1980, 312.50\n1755, 688.40\n\n1620, [N/A]\nclocks.sm [MHz], power.draw [W]\n1830, 701.1\n"
    samples = parse_samples(text)
    assert samples == [(1980.0, 312.5), (1755.0, 688.4), (1620.0, None), (1830.0, 701.1)]
    got = summarize(samples)
    assert got == {"sm_MHz": 1792.5, "sm_MHz_min": 1620.0, "clock_samples": 4, "power_W": 688.4}
    assert summarize([]) == {} and summarize([(1500.0, None)]) == {"sm_MHz": 1500.0, "sm_MHz_min": 1500.0,
                                                                     "clock_samples": 1}
    with GpuClocks(command="no-such-sampler-here") as clocks:
        pass
    assert clocks.summary() == {}
    with pytest.raises(ValueError, match="period_ms"):
        GpuClocks(period_ms=1)


def test_clock_sampler_reads_what_its_command_prints_while_the_block_runs(tmp_path, monkeypatch):
    """A stand-in nvidia-smi on PATH prints two samples and waits to be stopped: the block's
    summary holds them, and the stand-in was asked for the clock and power at the period given."""
    import time

    import gpu_clocks
    from gpu_clocks import GpuClocks

    monkeypatch.setattr(gpu_clocks, "nvidia_smi_id", lambda device=None: "GPU-0123")
    seen = tmp_path / "args.txt"
    fake = tmp_path / "fake-smi"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {seen}\necho '1500, 400.0'\necho '1400, 420.0'\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    started = time.monotonic()
    with GpuClocks(command="fake-smi", period_ms=20) as clocks:
        deadline = time.monotonic() + 10
        while not seen.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    assert time.monotonic() - started < 15  # the sampler was stopped, not waited for
    assert clocks.summary() == {"sm_MHz": 1450.0, "sm_MHz_min": 1400.0, "clock_samples": 2, "power_W": 410.0}
    args = seen.read_text().split()
    assert "--id=GPU-0123" in args and "--query-gpu=clocks.sm,power.draw" in args and "--loop-ms=20" in args
    # without the device's id the sampler stays off (every GPU's clocks would be mixed)
    monkeypatch.setattr(gpu_clocks, "nvidia_smi_id", lambda device=None: None)
    seen.unlink()
    with GpuClocks(command="fake-smi", period_ms=20) as clocks:
        time.sleep(0.3)
    assert clocks.summary() == {} and not seen.exists()


def test_host_under_dma_names_the_copies_host_memory_in_its_page():
    import host_under_dma as hud

    rows = [{"work": "python-large", "ms": {"idle": 15.0, "d2h": 16.5, "h2d": 15.5, "both": 19.5},
             "ms_each": {"idle": [15.0, 14.0], "d2h": [16.5, 17.0], "h2d": [15.5, 15.0], "both": [19.5, 19.0]}}]
    result = {"gpu": "GPU", "date": "today", "command": "python benchmarks/experiments/host_under_dma.py",
              "rows": rows, "not_overlapped": [], "host_memory": "write-combined"}
    text = hud.markdown(result)
    assert "The copies' host memory: write-combined." in text
    assert "| python-large | 15.00 [14.00-15.00] | 16.50 [16.50-17.00] (x1.10) |" in text
    del result["host_memory"]  # a page without the field: torch's pinned memory
    assert "The copies' host memory: pinned." in hud.markdown(result)


def test_kernels_under_dma_exits_with_the_reason_where_torch_sees_no_gpu():
    """Even on a GPU machine: with no device visible the script exits 2 and says why, at once."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(BENCH / "experiments" / "kernels_under_dma.py"), "--rounds", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2
    assert "kernels_under_dma.py: cannot run: no CUDA GPU is visible" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_kernels_under_dma_options_are_checked():
    import kernels_under_dma as kud

    args = kud.parse_args(["--workloads", "memory_bound, gemm_bf16", "--modes", "both,idle"])
    assert args.workload_list == ["memory_bound", "gemm_bf16"] and args.mode_list == ["both", "idle"]
    assert args.rounds == 8 and args.chunk_mib == 64 and args.gemm_size == 8192
    assert kud.parse_args(["--modes", "idle,both", "--rounds", "6"]).rounds == 6
    for bad in (["--modes", "d2h,h2d"], ["--workloads", "gemm_bf16,conv"], ["--iters", "0"], ["--modes", ""],
                ["--rounds", "5"]):  # 5 rounds of 4 modes: the places of a round not balanced
        with pytest.raises(SystemExit):
            kud.parse_args(bad)
    assert [kud.rotated(("idle", "d2h", "h2d", "both"), r) for r in (0, 1, 5)] == [
        ["idle", "d2h", "h2d", "both"], ["d2h", "h2d", "both", "idle"], ["d2h", "h2d", "both", "idle"]]
    assert kud.directions("both") == ("d2h", "h2d") and kud.directions("idle") == ()


def test_kernels_under_dma_copy_rate_counts_only_chunks_completed_in_the_span():
    from kernels_under_dma import copies_spanned, window_gbps

    chunk = 64 * MiB
    done = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.5]  # ms after the reference event
    # the span [2.5, 7.0]: chunks done at 3, 4, 5, 6 -> three chunks in 3 ms
    assert window_gbps(done, 2.5, 7.0, chunk) == pytest.approx(3 * chunk / 3e-3 / 1e9)
    assert window_gbps(done, 2.5, 3.5, chunk) is None  # one completion in the span: no rate
    assert window_gbps([], 0.0, 1.0, chunk) is None
    assert copies_spanned(0.5, done, 2.5, 7.0, ran_dry=False)
    assert not copies_spanned(0.5, done, 2.5, 8.0, ran_dry=False)  # the last chunk ended before the span did
    assert not copies_spanned(3.0, done, 2.5, 7.0, ran_dry=False)  # began after the span did
    assert not copies_spanned(0.5, done, 2.5, 7.0, ran_dry=True)  # the queue emptied within it
    assert not copies_spanned(0.5, [], 2.5, 7.0, ran_dry=False)


def test_kernels_under_dma_rows_pair_each_round_with_its_idle_round(tmp_path):
    import kernels_under_dma as kud

    def rec(work, mode, rnd, ms, d2h=None, h2d=None, spanned=None, samples=()):
        return {"work": work, "mode": mode, "round": rnd, "ms": ms, "d2h_GBps": d2h, "h2d_GBps": h2d,
                "spanned": spanned, "clock_samples": [list(s) for s in samples]}

    records = [rec("gemm_bf16", "idle", 1, 2.0, samples=[(1980, 600.0)]),
               rec("gemm_bf16", "idle", 2, 1.0, samples=[(1900, 650.0)]),
               rec("gemm_bf16", "idle", 3, 1.0),
               # against its own round's idle: 2.2/2.0 = 1.1, 1.2/1.0 = 1.2, 1.05/1.0 = 1.05
               rec("gemm_bf16", "both", 3, 1.05, d2h=50.0, h2d=40.0, spanned=True, samples=[(1700, 700.0)]),
               rec("gemm_bf16", "both", 1, 2.2, d2h=54.0, h2d=44.0, spanned=True, samples=[(1755, 690.0)]),
               rec("gemm_bf16", "both", 2, 1.2, d2h=52.0, h2d=42.0, spanned=False),
               rec("memory_bound", "idle", 1, 1.0), rec("memory_bound", "d2h", 1, 1.25, d2h=55.0, spanned=True)]
    works = {"gemm_bf16": {"flop": 2 * 10**12}, "memory_bound": {"bytes": 2 * 10**9}}
    rows = kud.build_rows(records, works, ["idle", "d2h", "both"])
    by = {(r["work"], r["mode"]): r for r in rows}
    assert set(by) == {("gemm_bf16", "idle"), ("gemm_bf16", "both"), ("memory_bound", "idle"), ("memory_bound", "d2h")}
    both = by["gemm_bf16", "both"]
    assert both["ms_each"] == [2.2, 1.2, 1.05] and both["ms"] == 1.2
    assert (both["ms_min"], both["ms_max"]) == (1.05, 2.2)
    # the median of the per-round ratios (1.1), not the ratio of the medians (1.2 / 1.0)
    assert both["x_idle"] == pytest.approx(1.1) and both["x_idle_min"] == pytest.approx(1.05)
    assert both["x_idle_max"] == pytest.approx(1.2)
    assert (both["d2h_GBps"], both["h2d_GBps"]) == (52.0, 42.0)
    assert both["copies_spanned"] is False  # round 2's copies did not run through its span
    assert both["rate_unit"] == "TFLOP/s" and both["rate"] == pytest.approx(2e12 / 1.2e-3 / 1e12)
    assert (both["sm_MHz"], both["sm_MHz_min"], both["power_W"], both["clock_samples"]) == (1727.5, 1700, 695.0, 2)
    idle = by["gemm_bf16", "idle"]
    assert idle["x_idle"] == 1.0 and idle["copies_spanned"] is None and idle["d2h_GBps"] is None
    assert idle["sm_MHz"] == 1940.0
    mem = by["memory_bound", "d2h"]
    assert mem["rate_unit"] == "GB/s" and mem["rate"] == pytest.approx(1600.0)
    assert mem["x_idle"] == pytest.approx(1.25) and mem["copies_spanned"] is True and mem["h2d_GBps"] is None
    assert "sm_MHz" not in mem

    result = {"gpu": "GPU", "date": "today", "torch": "2.x", "command": "python kernels_under_dma.py",
              "rounds": 3, "iters": 200, "chunk_mib": 64, "depth": 4, "rows": rows,
              "copies_alone": {"d2h_GBps": 55.1, "h2d_GBps": 54.2, "bidirectional_each_GBps": 50.3},
              "skipped": {"fp8_gemm": "torch._scaled_mm on float8_e4m3fn failed: no"}}
    text = kud.markdown(result)
    assert ("| gemm_bf16 | both (copies not through the span) | 1.200 [1.050-2.200] | 1.100 [1.050-1.200] "
            "| 1667 TFLOP/s | 52.0 | 42.0 | 1728 (1700) | 695 |") in text
    assert "| memory_bound | d2h | 1.250 [1.250-1.250] | 1.250 [1.250-1.250] | 1600 GB/s | 55.0 | - | - | - |" in text
    assert "d2h 55.1 GB/s, h2d 54.2 GB/s, both at once 50.3 GB/s each way" in text
    assert "fp8_gemm not measured: torch._scaled_mm on float8_e4m3fn failed: no" in text
    assert "some round of: gemm_bf16 both (raise --depth)" in text
    if kud.chart(result, tmp_path / "k.png"):
        assert (tmp_path / "k.png").stat().st_size > 0


def test_fp8_epilogue_page_sets_each_variant_against_the_shipped_kernel_and_flags_other_bits():
    import ablate_fp8_epilogue as afe

    row = {"tokens_per_expert": 2048, "n": 7168, "k": 2048, "promotion": "overlap", "sm_MHz": 1500.0,
           "sm_MHz_min": 1400.0, "tflops": {"shipped": 1000.0, "direct": 1100.0, "no stores": 1200.0},
           "same_bits": {"direct": True}}
    result = {"gpu": "GPU", "date": "today", "experts": 8, "reps": 10, "command": "python ablate_fp8_epilogue.py",
              "variants": ["shipped", "direct", "no stores"], "rows": [row]}
    text = afe.markdown(result)
    assert "| 2048 | 7168 | 2048 | overlap | 1000 | 1100 | 1200 | 1.100 | 1.200 | yes | 1500 (1400) | - |" in text
    row["same_bits"] = {"direct": False}
    assert "| NO: direct |" in afe.markdown(result)
    assert afe.EPILOGUES["shipped"] is None
    assert set(afe.EPILOGUES) == {"shipped", "one barrier", "direct", "no stores"}


@pytest.mark.gpu
def test_clock_sampler_reads_the_real_gpus_clock_while_it_works():
    """nvidia-smi, sampling this process's GPU while it runs matmuls for about a second, gives
    samples with a plausible SM clock (the sampler's flags and its stop by SIGINT work for real)."""
    import shutil
    import time

    from gpu_clocks import GpuClocks, nvidia_smi_id

    if shutil.which("nvidia-smi") is None or nvidia_smi_id() is None:
        pytest.skip("nvidia-smi, or the GPU's UUID through torch, is not available here")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with GpuClocks(period_ms=50) as clocks:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
    got = clocks.summary()
    assert got.get("clock_samples", 0) >= 3, got
    assert 200 <= got["sm_MHz_min"] <= got["sm_MHz"] <= 3000, got
