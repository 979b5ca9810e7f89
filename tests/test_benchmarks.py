"""CPU checks of the benchmark scripts: their bookkeeping, and a clear exit without a GPU."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

MiB = 2**20
BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))


def _row(engine, ops, peak, moved, fwd=5.0, bwd=10.0, step=15.0):
    return {"engine": engine, "ops": ops, "peak_MiB": peak, "act_MiB": peak / 2, "offloaded_MiB": moved,
            "fwd_ms": fwd, "bwd_ms": bwd, "step_ms": step}


def test_r_is_the_step_peak_freed_against_the_no_offload_run_of_its_own_ops():
    from offload_policies import derive

    rows = [_row("none", "teo", 1200, 0), _row("none", "te", 1700, 0, fwd=6.0, bwd=12.0),
            _row("v2", "teo", 200, 1000, step=40.0), _row("v2", "te", 300, 1400, step=80.0),
            _row("v1", "teo", 700, 1000, step=30.0)]
    pcie = {"d2h_GBps": 50.0, "h2d_GBps": 50.0}
    derive(rows, pcie)
    assert rows[2]["R"] == pytest.approx(1.0) and rows[3]["R"] == pytest.approx(1.0)
    assert rows[4]["R"] == pytest.approx(0.5)  # offloaded 1000 MiB, the peak fell by 500
    moved_ms = 1400 * 2**20 / 50e9 * 1e3  # > the stock run's fwd and bwd: the bound is PCIe
    assert rows[3]["bound_ms"] == pytest.approx(2 * moved_ms)
    assert rows[0]["R"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("script", ["moe_step.py", "offload_policies.py", "bench_fused_mlp.py", "bench_kernels.py",
                                    "ablate_epilogue.py", "bench_graphs.py", "bench_copy_interference.py",
                                    "bench_cluster2x2.py", "bench_megatron_settings.py", "profile_host.py",
                                    "bench_fp8_gemm.py"])
def test_benchmarks_exit_clearly_without_a_gpu(script):
    proc = subprocess.run([sys.executable, str(BENCH / script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "cannot run" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_diag_scripts_refuse_bad_arguments_and_exit_clearly_without_a_gpu():
    script = str(BENCH.parent / "scripts" / "diag_budget.py")
    args = ["--shape", "base", "--layers", "8", "--batch", "8", "--scope", "mlp", "--offload", "7", "--cap", "0",
            "--margins", "", "--no-layer-schedule", "--target-freed", "1,0.96"]
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "diag_budget.py needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr
    for bad, said in ((["--scope", "experts"], "invalid choice: 'experts'"),
                      (["--target-freed", "1,1.2"], "each fraction must be in (0, 1], got [1.2]"),
                      (["--target-freed", "half"], "fractions separated by commas"),
                      (["--layers", "8", "--offload", "9"], "--offload must be in 0..--layers=8, got 9")):
        proc = subprocess.run([sys.executable, script, *bad], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    peak = str(BENCH.parent / "scripts" / "diag_peak.py")  # the same set-up (bench_common.moe_step_bench)
    proc = subprocess.run([sys.executable, peak, "--policy", "mlp:7"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "diag_peak.py needs a CUDA GPU" in proc.stderr and "Traceback" not in proc.stderr


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
             "big_GBps": 53.9, "big_ms": 9.96}]
    result = {"gpu": "GPU", "date": "today", "mib": 512, "lead_ms": 2.0, "reps": 7, "rows": rows}
    text = markdown(result)
    assert "| d2h | whole | 1 | 8.250 (9.000) | 54.7 | 9.80 |" in text
    assert "| d2h | 16 | 32 | 0.310 (0.400) | 53.9 | 9.96 |" in text
    assert "| d2h | no large copy | 0 | 0.010 (0.020) | - | - |" in text
    assert "| h2d | 4 | 2 | 0.010 (0.010) (large copy already done: not measured) | 50.0 | 0.17 |" in text
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
             "contenders": {"fp8": timed(1100.0), "fp8 BN192": timed(1050.0), "bf16": timed(550.0),
                            "te fp8": {"unavailable": "RuntimeError: no cuBLAS block scaling"}}}]
    result = {"gpu": "GPU", "date": "today", "experts": 8, "reps": 10, "inner": 10, "rows": rows,
              "fp8_compile_seconds": {"k": 1.5}}
    text = markdown(result)
    assert "| 4096 | 2048 | 4096 | 1100 | 1050 | 550 | n/a | 2.00 | n/a | 2.3e-03 | n/a |" in text
    assert "Not run: RuntimeError: no cuBLAS block scaling" in text
    if chart(result, tmp_path / "c.png"):
        assert (tmp_path / "c.png").stat().st_size > 0


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
    assert "The same by GEMM" not in md  # a run without the ranges (older JSON)
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
    del row["main_grad_kernels"]  # a run without the profile (older JSON): no such section
    assert "Where main_grad's extra GPU time goes" not in bms.markdown({"gpu": "H100", "date": "today", "rounds": 3,
                                                                        "rows": [row]})


def test_megatron_settings_times_the_main_grad_ways_asked_for():
    import bench_megatron_settings as bms

    assert bms.parse_args(["--ways", "main_grad(tma,coop)", "main_grad(red,ping)"]).ways == [
        "main_grad(tma,coop)", "main_grad(red,ping)"]
    assert bms.parse_args([]).ways is None  # all of them
    with pytest.raises(SystemExit):
        bms.parse_args(["--ways", "main_grad(tma,ping256)"])


def test_alloc_history_names_each_unmap_burst_with_the_allocation_that_asked():
    sys.path.insert(0, str(BENCH.parent / "scripts"))
    from alloc_history import summarize

    frame = [{"filename": "/x/te_offload_ops/fused/srelu_mlp.py", "line": 130, "name": "_forward_fused"},
             {"filename": "/usr/lib/python3/threading.py", "line": 1, "name": "run"}]
    trace = [
        {"action": "alloc", "size": 4 * MiB, "stream": 0, "time_us": 1000},
        {"action": "segment_unmap", "size": 100 * MiB, "stream": 0, "time_us": 2000},
        {"action": "segment_unmap", "size": 60 * MiB, "stream": 0, "time_us": 2100},
        {"action": "free_completed", "size": 4 * MiB, "stream": 0, "time_us": 2200},
        {"action": "segment_map", "size": 200 * MiB, "stream": 0, "time_us": 2500},
        {"action": "alloc", "size": 200 * MiB, "stream": 7, "time_us": 4000, "frames": frame},
        {"action": "segment_unmap", "size": 20 * MiB, "stream": 0, "time_us": 9000},
    ]
    lines = summarize({"device_traces": [trace]})
    assert lines[0] == "events: alloc 2, free_completed 1, segment_map 1, segment_unmap 3"
    assert lines[1] == ("  at 1.0 ms: 2 unmaps, 160 MiB (stream 0), for 200.0 MiB on stream 7, served 2.0 ms "
                        "after the first unmap: _forward_fused:130")
    assert lines[2] == "  at 8.0 ms: 1 unmaps, 20 MiB; no allocation after"
    assert lines[3] == "  maps: 1 bursts, 200 MiB in all"
    assert summarize({"device_traces": []}) == ["no allocator events recorded"]


def test_diag_peak_finds_the_peak_its_phase_and_the_budget_look_before_it():
    """The allocated memory rebuilt event by event (allocs up, requested frees down, marker
    allocations counted as they are): the peak, the phase marker before it, the allocations just
    before it and the engine's last look (the look markers counted in order)."""
    sys.path.insert(0, str(BENCH.parent / "scripts"))
    import diag_peak as dp

    def alloc(size, **kw):
        return {"action": "alloc", "size": size, "stream": 0, **kw}

    def free(size):
        return {"action": "free_requested", "size": size, "stream": 0}

    fwd, bwd, look = dp._PHASE_MARK["forward"], dp._PHASE_MARK["backward"], dp._LOOK_MARK
    frame = [{"filename": "/x/te_offload_ops/fused/srelu_mlp.py", "line": 228, "name": "_backward_fused"}]
    trace = [alloc(fwd), free(fwd), alloc(100 * MiB), alloc(look), free(look),  # look 0
             alloc(50 * MiB), alloc(look), free(look),  # look 1
             alloc(bwd), free(bwd), free(100 * MiB), alloc(look), free(look),  # look 2
             alloc(120 * MiB, frames=frame), free(120 * MiB), alloc(10 * MiB)]
    looks = [{"where": w, "layer": 1, "bwd": b, "memory": m, "held": h, "reloaded": 0, "incoming": i}
             for w, b, m, h, i in (("save", None, 1100 * MiB, 80 * MiB, 0), ("enter", None, 1150 * MiB, 0, 0),
                                   ("use", 1, 1050 * MiB, 0, 0))]
    lines = dp.analyse(trace, start=1000 * MiB, floor=1000 * MiB, looks=looks)
    assert lines[0].startswith("peak 170 MiB above the floor, in the backward (event 13 of 16)")
    assert "alloc     120.0 MiB stream 0: srelu_mlp.py:228 _backward_fused" in lines[-5]
    assert any(">" in line and "use " in line and "backward layer 1" in line for line in lines)
    assert not any(">" in line and "save" in line for line in lines)
