"""CPU: the Megatron GPT benchmark's pure parts, its shared set-up, the overlap analysis, the
dispatcher's split sizes by kernel, and the no-GPU paths of the multi-GPU and FP8 GPU tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import comm_copy_overlap as cco  # noqa: E402
import megatron_gpt as mg  # noqa: E402
import megatron_gpt_jobs as mgj  # noqa: E402
import megatron_gpt_model as mgm  # noqa: E402
import megatron_gpt_report as mgr  # noqa: E402

from te_offload_ops.megatron import dispatch_sync  # noqa: E402

# -- variants and arguments ----------------------------------------------------------------------


def test_variant_names_map_to_what_each_runs():
    v = mg.variant_for("ours+teo+kdtoh", 4, ("expert_fc1", "moe_act"), 40.0)
    assert (v.ours, v.teo_scope, v.teo_layers, v.teo_budget_gib, v.kernel_dtoh) == (True, "experts", 3, 40.0, True)
    assert mg.variant_for("ours+megatron", 4, ("moe_act",)).offload_modules == ("moe_act",)
    assert mg.variant_for("stock+megatron", 4, ()).offload_modules == ("fused_group_mlp",)
    assert mg.variant_for("ours+teo-layer", 6, ()).teo_scope == "layer" and not mg.variant_for("stock", 4, ()).ours
    assert mg.variant_for("ours+copies", 4, ()).copy_traffic and not mg.variant_for("ours+teo", 4, ()).copy_traffic
    paced = mg.variant_for("ours+copies-paced", 4, ())
    assert paced.copy_traffic and paced.copy_piece_mib == mg.PACED_PIECE_MIB
    assert mg.variant_for("ours+copies", 4, ()).copy_piece_mib is None
    ahead = mg.variant_for("ours+teo-ahead", 4, (), teo_reload_ahead=2)
    assert (ahead.teo_scope, ahead.teo_layers, ahead.teo_reload_ahead) == ("experts", 3, 2)
    assert mg.variant_for("ours+teo", 4, (), teo_reload_ahead=2).teo_reload_ahead == 0
    with pytest.raises(ValueError, match=r"unknown variant 'ours\+fast'"):
        mg.variant_for("ours+fast", 4, ())
    with pytest.raises(ValueError, match=r"\+kdtoh is for variants that offload"):
        mg.variant_for("stock+kdtoh", 4, ())


def test_write_combined_suffix_sets_teos_host_memory_in_the_worker(monkeypatch):
    wc = mg.variant_for("ours+teo-ahead+kdtoh+wc+fp8block", 4, ())
    assert (wc.teo_scope, wc.kernel_dtoh, wc.teo_host_memory, wc.fp8_recipe) == ("experts", True, "write-combined",
                                                                                "blockwise")
    assert mg.variant_for("ours+copies+wc", 4, ()).teo_host_memory == "write-combined"
    assert mg.variant_for("ours+teo", 4, ()).teo_host_memory == "pinned"
    for name in ("ours+wc", "ours+megatron+wc", "stock+wc"):
        with pytest.raises(ValueError, match=r"\+wc is for teo's variants and ours\+copies"):
            mg.variant_for(name, 4, ())
    pool = pytest.importorskip("te_offload_ops.engines.teo.pool")
    monkeypatch.setenv(pool.HOST_MEMORY_ENV, "pinned")
    mgm.use_host_memory(wc)
    assert pool._default_allocator() is pool.write_combined_bytes
    mgm.use_host_memory(mg.variant_for("ours+copies", 4, ()))
    assert pool._default_allocator() is not pool.write_combined_bytes


@pytest.mark.parametrize("argv, said", [
    (["--layers", "1"], "--layers must be at least 2"),
    (["--warmup", "0"], "--warmup must be at least 1"),
    (["--iters", "0"], "--iters must be positive"),
    (["--ep", "1,x"], "--ep takes comma-separated ints"),
    (["--ep", "0"], "--ep needs at least one positive size"),
    (["--offload-modules", "core_attn"], "--offload-modules: ['core_attn']"),
    (["--variants", "ours,ours"], "--variants needs distinct names"),
    (["--experts", "6", "--ep", "4"], "at --ep 4: experts (6) must be a multiple"),
    (["--heads", "3"], "hidden (2048) must be a multiple of heads (3)"),
    (["--teo-budget-gib", "-1"], "--teo-budget-gib must be positive"),
    (["--cap-gib", "60", "--ep", "2"], "--cap-gib searches at EP=1"),
    (["--cap-gib", "0"], "--cap-gib must be positive"),
    (["--cap-gib", "60", "--cap-variants", "ours,odd"], "--cap-variants: unknown variant 'odd'"),
    (["--cap-max-micro-batch", "2"], "--cap-max-micro-batch must be at least --micro-batch"),
    (["--job-timeout", "0"], "--job-timeout must be positive"),
    (["--worker-ep", "1"], "a worker needs --worker-out, --worker-job"),
    (["--worker-ep", "1", "--worker-out", "/tmp", "--worker-job", "time"], "a worker needs --worker-variant"),
    (["--worker-ep", "1", "--worker-out", "/tmp", "--worker-job", "cap", "--worker-variant", "ours",
      "--worker-micro-batch", "4"], "a cap trial needs --cap-gib"),
    (["--worker-ep", "1", "--worker-out", "/tmp", "--worker-job", "bench"], "invalid choice: 'bench'"),
    (["--cuda-graphs", "attn,mlp"], "--cuda-graphs: ['attn', 'mlp']: choose from attn, moe_router, moe_preprocess, moe"),
    (["--cuda-graphs", "moe_preprocess"], "moe_preprocess needs moe_router"),
    (["--no-capture"], "--no-capture configures the graphs of --cuda-graphs without capturing them"),
    (["--cap-gib", "60", "--ep", "1", "--cap-variants", "ours,ours+copies"], "ours+copies frees nothing"),
])
def test_bad_arguments_are_refused_with_the_reason(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        mg.parse_args(argv)
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_each_job_runs_in_processes_of_its_own_with_the_same_settings(tmp_path):
    args = mg.parse_args(["--layers", "3", "--ep", "1,2", "--variants", "stock,ours"])
    assert args.ep == [1, 2] and args.shape.layers == 3 and args.shape.tokens_per_step == 2 * 4 * 2048
    script = Path(mg.__file__).resolve()
    argv = mg.job_argv(args, 2, tmp_path, "time", variant="ours")
    cmd = mgj.command(script, argv, 2)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=2" in cmd
    assert cmd[cmd.index("--layers") + 1] == "3"
    assert cmd[-8:] == ["--worker-ep", "2", "--worker-out", str(tmp_path), "--worker-job", "time", "--worker-variant",
                        "ours"]
    worker = mg.parse_args(cmd[cmd.index(str(script)) + 1:])
    assert (worker.worker_ep, worker.worker_job, worker.worker_variant) == (2, "time", "ours")
    one = mgj.command(script, mg.job_argv(args, 1, tmp_path, "numerics"), 1)
    assert one[:2] == [sys.executable, str(script)]  # one rank: no torchrun
    assert mg.parse_args(one[2:]).worker_job == "numerics"
    cap = mg.parse_args(["--cap-gib", "60", *mg.job_argv(args, 1, tmp_path, "cap", variant="ours+teo", micro_batch=6)])
    assert (cap.worker_variant, cap.worker_micro_batch, cap.cap_gib) == ("ours+teo", 6, 60.0)


def test_the_ranks_environment_keeps_nvlink_multicast_off():
    env = mgm.worker_env({"NCCL_NVLS_ENABLE": "1", "PATH": "/bin"})
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["PATH"] == "/bin"


def test_shapes_are_checked_for_the_expert_parallelism():
    mgm.GPTShape().check(2)
    with pytest.raises(ValueError, match="topk \\(9\\) must be at most experts \\(8\\)"):
        mgm.GPTShape(experts=8, topk=9).check(1)
    with pytest.raises(ValueError, match="seq must be a positive int"):
        mgm.GPTShape(seq=0).check(1)


# -- results across ranks and the report ---------------------------------------------------------


def _row(variant, ep, step, peak, floor=4.0, moved=0.0, loss=10.0, rank=0, **extra):
    return {"variant": variant, "ep": ep, "rank": rank, "experts_path": "x", "step_ms": step, "step_ms_min": step,
            "step_ms_max": step, "floor_GiB": floor, "peak_GiB": peak, "peak_above_floor_GiB": peak - floor,
            "offloaded_MiB_per_step": moved, "first_loss": loss, "profile": None, **extra}


def _job(*rows, digest=1.5):
    return [{"rank": r["rank"], "row": r, "weights_digest": digest} for r in rows]


def test_a_jobs_ranks_merge_to_the_slowest_step_the_largest_peak_and_every_loss():
    stock = mgr.merge_variant(_job(_row("stock", 2, 200.0, 8.0, loss=10.0), _row("stock", 2, 210.0, 7.5, rank=1,
                                                                                    loss=10.2)), 2, "stock")
    assert stock["step_ms"] == 210.0 and stock["peak_GiB"] == 8.0 and stock["ranks"] == 2 and "rank" not in stock
    assert stock["first_losses"] == [10.0, 10.2] and stock["first_loss"] == pytest.approx(10.1)
    assert stock["weights_digest"] == [1.5, 1.5] and stock["profile_per_rank"] is None
    failed = mgr.merge_variant(_job(_row("ours", 2, 1.0, 5.0)), 2, "ours", "1 of 2 ranks wrote results")
    assert failed == {"variant": "ours", "ep": 2, "error": "1 of 2 ranks wrote results"}
    assert "no rank" in mgr.merge_variant([], 1, "ours")["error"]


def test_the_report_shows_idle_causes_and_pinned_allocations_per_rank():
    idle = lambda host, nccl: {"gpu_ms": 120.0, "compute_busy_ms": 90.0, "compute_kernels_ms": 80.0,  # noqa: E731
                               "compute_copies_ms": 10.5, "largest_gaps": [],
                               "idle_ms_by_cause": {"host: busy": host, "wait: kernel on stream 21": nccl,
                                                    "wait: H2D copy": 2.0, "host: blocked in cudaStreamSynchronize": 1.5,
                                                    "launch latency": 0.5}}
    prof = lambda host, nccl: {"nccl_ms": 1.0, "offload_d2h_ms": 1.0, "offload_h2d_ms": 1.0, "overlap_ms": 0.0,  # noqa: E731
                               "small_d2h": {"count": 3, "wait_ms": 0.1, "wait_behind_offload_ms": 0.0},
                               "kernel_dtoh": {"count": 0, "wait_ms": 0.0}, "idle": idle(host, nccl)}
    teo = mgr.merge_variant(_job(
        _row("ours+teo", 2, 150.0, 6.0, profile=prof(20.0, 3.0), teo_pinned_allocations_timed=4,
             teo_pinned_MiB_timed=512.0, teo_pinned_ms_timed=42.5, teo_oversized_reuses_timed=3,
             step_ms_each=[150.0, 140.0],
             teo_pinned_timed=[{"requested": 100 << 20, "allocated": 128 << 20, "seconds": 0.0125, "in_use": 5,
                                "free": 2, "largest_free": 64 << 20}],
             host_profile={"wall_ms": 180.0, "self_ms_total": 170.0,
                           "top": [{"function": "teo/engine.py:203(pack)", "self_ms": 4.25, "cum_ms": 9.5,
                                    "calls": 48}]}),
        _row("ours+teo", 2, 140.0, 6.0, rank=1, profile=prof(2.0, 25.0), teo_pinned_allocations_timed=0,
             teo_pinned_MiB_timed=0.0, step_ms_each=[140.0, 150.0])), 2, "ours+teo")
    assert teo["teo_pinned_allocations_timed_per_rank"] == [4, 0] and "teo_pinned_MiB_timed" not in teo
    result = {"gpu": "g", "date": "d", "versions": {"megatron-core": "0.19.2", "transformer-engine": "2.20.2",
                                                     "torch": "2.11"},
              "config": {"layers": 4, "hidden": 2048, "heads": 16, "experts": 16, "topk": 4, "ffn": 1408,
                         "vocab": 32768, "microbatches": 2, "micro_batch": 4, "seq": 2048, "iters": 8, "warmup": 3},
              "rows": [teo], "targets": []}
    mgr.add_comparisons(result["rows"], 16384)
    lines = mgr.markdown(result).splitlines()
    # per rank: host busy, blocked, another stream's kernel, copies, the rest
    assert "| 2 | ours+teo | 0 | 120.0 | 90.0 | 80.0 | 10.5 | 20.0 | 1.5 | 3.0 | 2.0 | 0.5 |" in lines
    assert "| 2 | ours+teo | 1 | 120.0 | 90.0 | 80.0 | 10.5 | 2.0 | 1.5 | 25.0 | 2.0 | 0.5 |" in lines
    assert "| 2 | ours+teo | 4 / 0 | 512 / 0 | 42.5 / - | 3 / - |" in lines
    assert "| 2 | ours+teo | 0 | 100.0 | 128.0 | 12.5 | 5 | 2 | 64.0 |" in lines
    assert mg.command_line(["--ep", "2", "--out", "/tmp/r", "--job-logs=/tmp/l", "--profile"]) == \
        "python benchmarks/megatron_gpt.py --ep 2 --profile"
    assert "| `teo/engine.py:203(pack)` | 4.25 | 9.50 | 48 |" in lines  # rank 0's host time by function


def test_the_host_growth_table_compares_each_offloading_variant_with_ours_by_function():
    fn = lambda name, ms, calls: {"function": name, "self_ms": ms, "cum_ms": ms, "calls": calls}  # noqa: E731
    ours = {"wall_ms": 100.0, "functions": [fn("a", 10.0, 64), fn("b", 5.0, 10), fn("gone", 1.0, 2)]}
    teo = {"wall_ms": 120.0, "functions": [fn("a", 13.0, 64), fn("b", 4.5, 10), fn("pack", 2.0, 32)]}
    grown = mgr.host_growth(ours, teo)
    assert [(r["function"], r["self_ms"], r["calls"]) for r in grown] == \
        [("a", 3.0, 0.0), ("pack", 2.0, 32.0), ("b", -0.5, 0.0), ("gone", -1.0, -2.0)]
    rows = [{"ep": 1, "variant": "ours", "host_profile_per_rank": [ours]},
            {"ep": 1, "variant": "ours+teo", "host_profile_per_rank": [teo]},
            {"ep": 2, "variant": "ours+teo", "host_profile_per_rank": [teo]}]  # no ours at EP=2: no table
    lines = mgr.host_growth_lines(rows)
    assert any(line.startswith("Host time under cProfile, EP=1 ours+teo against ours (rank 0): +20.0 ms per step; "
                               "functions that grew add 5.0 ms, those that shrank -1.5") for line in lines)
    assert "| `pack` | 0.00 | 2.00 | +2.00 | +32 |" in lines
    assert not any("EP=2" in line for line in lines)


def test_a_function_cprofile_names_by_address_is_one_function_in_every_process():
    fn = lambda name, ms, calls: {"function": name, "self_ms": ms, "cum_ms": ms, "calls": calls}  # noqa: E731
    ours = {"wall_ms": 100.0, "functions": [fn("<function Event.synchronize at 0x7fc0c67411c0>", 0.5, 8)]}
    teo = {"wall_ms": 105.0, "functions": [fn("<function Event.synchronize at 0x7f79cb5391c0>", 5.0, 8)]}
    assert [(r["function"], r["self_ms"], r["calls"]) for r in mgr.host_growth(ours, teo)] == \
        [("<function Event.synchronize>", 4.5, 0.0)]
    assert mgr.function_label("teo/engine.py:210(pack)") == "teo/engine.py:210(pack)"


def test_cuda_graphs_reach_every_variants_config_as_megatrons_trainer_sets_them():
    from te_offload_ops.megatron.teo_offload import teo_offload_problems

    graphs = ("attn", "moe_router", "moe_preprocess")
    args = mg.parse_args(["--cuda-graphs", ",".join(graphs), "--ep", "1"])
    assert args.cuda_graphs == graphs
    assert mgm.apply_layer_graphs(None, None, None, mg.variant_for("ours", 4, ("moe_act",)), mgm.GPTShape(), 1, 0) \
        is None
    pytest.importorskip("megatron.core", reason="Megatron-Core validates the configs (not installed here)")
    shape = mgm.GPTShape()
    for name in ("stock", "ours", "ours+megatron", "ours+teo"):
        v = mg.variant_for(name, shape.layers, ("expert_fc1", "moe_act"), None, args.cuda_graphs)
        config = mgm.make_config(shape, v, 1)  # Megatron's own validation runs here
        assert config.cuda_graph_impl == "transformer_engine" and config.use_te_rng_tracker
        assert [m.name for m in config.cuda_graph_modules] == list(graphs)
        assert config.delay_offload_until_cuda_graph == bool(v.offload_modules)
        if v.teo_scope:  # the experts stay eager: teo may wrap them
            assert teo_offload_problems(config, v.teo_scope) == []
    assert mgm.make_config(shape, mg.variant_for("ours", 4, ("moe_act",)), 1).cuda_graph_impl == "none"


@pytest.mark.parametrize("argv, said", [
    (["--cuda-graphs", "attn,moe"], "pass --capacity-factor"),
    (["--cuda-graphs", "moe,moe_router", "--capacity-factor", "1"], "moe or moe_router, not both"),
    (["--capacity-factor", "0"], "--capacity-factor must be in (0, experts / topk = 4]"),
    (["--capacity-factor", "inf"], "--capacity-factor must be in"),
    (["--capacity-factor", "1", "--cap-gib", "60"], "does not take drop-and-pad"),
    (["--cuda-graphs", "attn,moe", "--capacity-factor", "1", "--variants", "ours,ours+copies"],
     "captures the experts whose saved tensors it moves"),
    (["--capacity-factor", "1.25", "--variants", "ours,ours+megatron"], "does not take drop-and-pad"),
    (["--cuda-graphs", "attn,moe", "--capacity-factor", "1.25", "--variants", "ours,ours+teo"],
     "captures the experts whose saved tensors it moves"),
    (["--cuda-graphs", "attn,moe", "--capacity-factor", "1", "--variants", "ours,ours+fp8block"],
     "which a CUDA graph capture refuses"),
    (["--cuda-graphs", "attn,moe", "--capacity-factor", "1", "--variants", "stock+fp8current"],
     "which a CUDA graph capture refuses"),
])
def test_whole_moe_graphs_need_drop_and_pad_and_no_offloading_inside(argv, said, capsys):
    with pytest.raises(SystemExit):
        mg.parse_args(["--ep", "1", *argv])
    assert said in capsys.readouterr().err


def test_the_eager_twin_of_a_graphed_run_is_named_apart():
    common = ["--ep", "1", "--variants", "ours", "--cuda-graphs", "attn,moe", "--capacity-factor", "1"]
    graphed = mg.parse_args([*common, "--deterministic"])
    twin = mg.parse_args([*common, "--no-capture"])
    assert not graphed.no_capture and graphed.deterministic and twin.no_capture and not twin.deterministic
    assert mg.report_stem(graphed, "GPU") != mg.report_stem(twin, "GPU")
    assert "graphs_uncaptured" in mg.report_stem(twin, "GPU")
    rows = [{"cuda_graphs": ["attn", "moe"], "graph_capture_s": None}]
    assert "never captured" in mgr.graphs_sentence(rows)
    rows[0]["graph_capture_s"] = 2.5
    assert "captured after the warm-up in up to 2.5 s" in mgr.graphs_sentence(rows)


def test_drop_and_pad_with_whole_moe_graphs_reaches_every_variants_config():
    args = mg.parse_args(["--ep", "1", "--cuda-graphs", "attn,moe", "--capacity-factor", "1.25",
                          "--variants", "stock,ours"])
    pytest.importorskip("megatron.core", reason="Megatron-Core validates the configs (not installed here)")
    shape = mgm.GPTShape()
    for name in args.variants:
        v = mg.variant_for(name, shape.layers, args.offload_modules, None, args.cuda_graphs, 1, args.capacity_factor)
        config = mgm.make_config(shape, v, 1)  # Megatron's own validation runs here
        assert [m.name for m in config.cuda_graph_modules] == ["attn", "moe"]
        assert config.moe_expert_capacity_factor == 1.25 and config.moe_pad_expert_input_to_capacity
        assert not config.moe_router_padding_for_quantization
    # FP8 under drop-and-pad (eager): capacities fixed, so the router does not pad them again
    v = mg.variant_for("ours+fp8block", shape.layers, (), None, ("attn",), 1, 1.25)
    assert not mgm.make_config(shape, v, 1).moe_router_padding_for_quantization
    result = {"config": {"capacity_factor": 1.25}}
    assert "at most 1.25x its even share" in mgr.capacity_sentence(result["config"])
    assert mgr.capacity_sentence({"capacity_factor": None}) == ""
    assert "the experts in the MoE layers' graphs" in mgr.graphs_sentence([{"cuda_graphs": ["attn", "moe"]}])


def test_the_fused_forward_counter_counts_python_forwards_and_puts_the_op_back(monkeypatch):
    from te_offload_ops.fused.srelu_mlp import FusedScaledSReLUMLP

    monkeypatch.setattr(FusedScaledSReLUMLP, "fuser_forward", lambda op, *args, **kwargs: ("ran", args, kwargs))
    stub = FusedScaledSReLUMLP.fuser_forward
    with mgm.FusedForwardCounter() as counter:
        assert FusedScaledSReLUMLP.fuser_forward(object(), 1, x=2) == ("ran", (1,), {"x": 2})
        FusedScaledSReLUMLP.fuser_forward(object())
    assert counter.calls == 2 and FusedScaledSReLUMLP.fuser_forward is stub
    FusedScaledSReLUMLP.fuser_forward(object())  # not counted once out
    assert counter.calls == 2


def test_the_copy_traffic_moves_what_teo_moved_at_the_default_shape():
    # ours+copies stands for teo's copies: (H + F) bf16 values per routed token, layers 1..L-1,
    # each micro-batch; teo's counter at the default shape (a committed run) says the same bytes
    shape = mgm.GPTShape()
    assert mgm.apply_copy_traffic(None, mgm.Variant(ours=True), shape) is None
    per_layer = shape.micro_batch * shape.seq * shape.topk * (shape.hidden + shape.ffn) * 2
    from bench_common import read_result

    run = read_result(BENCH / "results" / "megatron_gpt_NVIDIA_H200_ep1_host_growth.json.gz")
    teo = next(r for r in run["rows"] if r["variant"] == "ours+teo")
    assert per_layer * (shape.layers - 1) * shape.microbatches / 2**20 == pytest.approx(teo["offloaded_MiB_per_step"])


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (pinned memory, streams)")
def test_paced_copies_move_every_byte_in_pieces_after_the_event_they_wait_for():
    import torch

    n = 10_000_003  # not a multiple of the piece
    src = torch.arange(n, device="cuda", dtype=torch.float32).bfloat16()
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    back = torch.empty_like(src)
    d2h, h2d = torch.cuda.Stream(), torch.cuda.Stream()
    out, into = mgm.PacedCopies(torch.cuda.current_device(), d2h, 1 << 20), \
        mgm.PacedCopies(torch.cuda.current_device(), h2d, 3 << 19)
    torch.cuda._sleep(20_000_000)  # the compute stream busy: the copy must start after it
    src.add_(1)
    ready = torch.cuda.Event()
    ready.record()
    out.submit(host, src, ready)
    out.close()  # every piece queued and the last one ended
    copied = torch.cuda.Event()
    copied.record(d2h)
    into.submit(back, host, copied)
    into.close()
    torch.cuda.synchronize()
    assert torch.equal(back, src)


def _rows(ep2_digest=1.5):
    rows = [mgr.merge_variant(_job(_row("stock", 2, 200.0, 8.0), digest=ep2_digest), 2, "stock"),
            mgr.merge_variant(_job(_row("ours", 2, 110.0, 7.0, loss=10.01)), 2, "ours"),
            mgr.merge_variant(_job(_row("ours+megatron", 2, 115.0, 6.5, moved=400, loss=10.01)), 2, "ours+megatron"),
            mgr.merge_variant(_job(_row("ours+teo", 2, 112.0, 6.2, floor=4.2, moved=400, loss=10.02)), 2, "ours+teo"),
            mgr.merge_variant(_job(_row("ours", 1, 90.0, 7.0)), 1, "ours")]
    return rows


def test_comparisons_and_targets_are_computed_per_ep():
    rows = _rows()
    mgr.add_comparisons(rows, tokens_per_rank=16384)
    stock, ours, megatron, teo, ours1 = rows
    assert ours["speedup_vs_stock"] == pytest.approx(200 / 110) and ours["tokens_per_s"] == pytest.approx(16384 / 0.11)
    # freed: ours' 3.0 GiB above its floor less teo's 2.0 above its own (higher) floor
    assert teo["step_vs_ours"] == pytest.approx(112 / 110) and teo["freed_vs_ours_GiB"] == pytest.approx(1.0)
    assert megatron["freed_vs_ours_GiB"] == pytest.approx(0.5)
    assert ours["loss_rel_err_vs_stock"] == pytest.approx(0.001)
    assert megatron["loss_equal_to_ours"] is True and teo["loss_equal_to_ours"] is False
    assert ours["loss_equal_to_ours"] is None and stock["loss_equal_to_ours"] is None
    assert teo["tokens_under_ours_peak_x"] == pytest.approx((7.0 - 4.2) / 2.0)  # room under ours' peak over its own
    assert ours["tokens_under_ours_peak_x"] == pytest.approx(1.0) and ours1["speedup_vs_stock"] is None
    found = {t["target"]: t for t in mgr.targets(rows)}
    assert found["ours at EP=2 >= 1.7x stock's step"]["met"] is True
    assert found["ours+megatron at EP=2 costs <= 3% over ours"]["met"] is False  # 1.045
    assert found["ours+teo at EP=2 costs <= 3% over ours"]["met"] is True  # 1.018
    assert found["ours+teo frees >= ours+megatron at no more cost (EP=2)"]["met"] is True
    assert found["ours+teo fits more tokens than ours+megatron under ours' peak (EP=2, predicted)"]["met"] is True
    assert found["ours+megatron's first loss equals ours' bitwise (EP=2)"]["met"] is True
    assert found["ours+teo's first loss equals ours' bitwise (EP=2)"]["met"] is False
    alone = [r for r in _rows() if r["variant"] == "ours+teo"]  # --variants ours+teo: nothing to compare with
    mgr.add_comparisons(alone, 16384)
    assert {t["target"]: t["met"] for t in mgr.targets(alone)}["ours+teo at EP=2 costs <= 3% over ours"] is None


def test_fp8_variants_compare_with_ours_at_their_precision_and_with_their_bf16_variant():
    v = mg.variant_for("ours+teo+kdtoh+fp8block", 4, ("moe_act",))
    assert (v.teo_scope, v.kernel_dtoh, v.fp8, v.fp8_recipe) == ("experts", True, "e4m3", "blockwise")
    assert (mg.variant_for("stock+fp8current", 4, ()).fp8_recipe, mg.variant_for("ours", 4, ()).fp8) == \
        ("tensorwise", None)
    assert mg.variant_for("ours+fp8delayed", 4, ()).fp8 == "hybrid"
    with pytest.raises(ValueError, match="unknown variant 'ours\\+fp8'"):
        mg.variant_for("ours+fp8", 4, ())
    rows = _rows() + [mgr.merge_variant(_job(_row("ours+fp8block", 2, 80.0, 6.0, loss=10.05)), 2, "ours+fp8block"),
                      mgr.merge_variant(_job(_row("ours+teo+fp8block", 2, 88.0, 5.5, moved=200, loss=10.05)), 2,
                                        "ours+teo+fp8block"),
                      mgr.merge_variant(_job(_row("ours+megatron+fp8block", 2, 84.0, 5.5, moved=200, loss=10.05)), 2,
                                        "ours+megatron+fp8block")]
    mgr.add_comparisons(rows, tokens_per_rank=16384)
    by = {r["variant"]: r for r in rows if r["ep"] == 2}
    fp8, teo8 = by["ours+fp8block"], by["ours+teo+fp8block"]
    assert fp8["speedup_vs_stock"] == pytest.approx(200 / 80) and fp8["step_vs_ours"] == 1.0  # against itself
    assert teo8["step_vs_ours"] == pytest.approx(88 / 80) and teo8["freed_vs_ours_GiB"] == pytest.approx(0.5)
    assert teo8["loss_equal_to_ours"] is True and fp8["loss_equal_to_ours"] is None
    assert fp8["loss_rel_err_vs_stock"] is None  # no stock+fp8block row: FP8 loss not set against bf16's
    found = {t["target"]: t["met"] for t in mgr.targets(rows)}
    assert found["ours+teo+fp8block at EP=2 costs <= 3% over ours+fp8block"] is False  # 1.10
    assert found["ours+teo+fp8block's first loss equals ours+fp8block's bitwise (EP=2)"] is True
    assert found["ours+teo+fp8block frees >= ours+megatron+fp8block at no more cost (EP=2)"] is False  # slower
    assert not any(t.startswith("ours+fp8block at EP=2 costs") for t in found)  # not an offloading variant
    cmp = {c["variant"]: c for c in mgr.precision_comparisons(rows)}
    assert set(cmp) == {"ours+fp8block", "ours+teo+fp8block", "ours+megatron+fp8block"}
    assert cmp["ours+fp8block"]["speedup"] == pytest.approx(110 / 80)
    assert cmp["ours+fp8block"]["tokens_under_bf16_peak_x"] == pytest.approx((7.0 - 4.0) / 2.0)
    assert "| 2 | ours+fp8block | 80.0 | 110.0 | 1.375 | 2.00 | 3.00 | x1.50 |" in mgr.precision_lines(rows)


def test_the_reports_header_names_the_precision_the_variants_ran_in():
    assert mgr.precision_phrase(["ours", "ours+teo-ahead"]) == "bf16"
    fp8 = mgr.precision_phrase(["ours+fp8block", "ours+teo-ahead+fp8block"])
    assert fp8.startswith("FP8 (") and "fp8_recipe='blockwise'" in fp8 and "bf16" not in fp8
    mixed = mgr.precision_phrase(["ours", "ours+fp8block", "stock+fp8current"])
    assert mixed.startswith("bf16, and FP8 in the variants that name a recipe")
    assert "fp8_recipe='blockwise'" in mixed and "fp8_recipe='tensorwise'" in mixed


def test_fp8_variants_configure_megatrons_recipe_with_the_router_padding_the_tokens():
    pytest.importorskip("megatron.core", reason="Megatron-Core validates the configs (not installed here)")
    shape = mgm.GPTShape()
    config = mgm.make_config(shape, mg.variant_for("ours+teo+fp8block", 4, ("moe_act",)), 1)
    assert (config.fp8, config.fp8_recipe, config.moe_router_padding_for_quantization) == ("e4m3", "blockwise", True)
    graphed = mg.variant_for("ours+fp8current", 4, ("moe_act",), None, ("attn", "moe_router", "moe_preprocess"))
    config = mgm.make_config(shape, graphed, 1)  # Megatron refuses the padding with moe_preprocess graphs
    assert (config.fp8_recipe, config.moe_router_padding_for_quantization) == ("tensorwise", False)
    assert not mgm.make_config(shape, mg.variant_for("ours", 4, ("moe_act",)), 1).moe_router_padding_for_quantization


def test_losses_are_compared_only_between_jobs_from_the_same_weights():
    rows = _rows(ep2_digest=2.5)  # stock's job started from other weights
    mgr.add_comparisons(rows, tokens_per_rank=16384)
    stock, ours = rows[:2]
    assert stock["loss_rel_err_vs_stock"] == 0.0 and ours["loss_rel_err_vs_stock"] is None
    assert ours["speedup_vs_stock"] == pytest.approx(200 / 110)  # times compare all the same


def test_tokens_under_the_cap_compare_each_teo_variant_with_megatrons_offloading():
    def cap_row(name, mb, step=100.0):
        best = None if mb is None else {"micro_batch": mb, "step_ms": step, "peak_GiB": 50.0}
        tokens = None if mb is None else 2 * mb * 2048
        return {"variant": name, "cap_GiB": 60.0, "best": best, "tokens_per_step": tokens,
                "tokens_per_s": None if mb is None else tokens / (step * 1e-3), "hit_max": mb == 8}

    cap = [cap_row("ours", 4), cap_row("ours+megatron", 5), cap_row("ours+teo", 6), cap_row("ours+teo-layer", None),
           {**cap_row("ours+teo+kdtoh", None), "error": "RuntimeError: boom"},
           cap_row("ours+megatron+fp8block", 7), cap_row("ours+teo+fp8block", 6)]
    found = {t["target"]: t for t in mgr.cap_targets(cap)}
    assert found["ours+teo fits more tokens than ours+megatron under 60 GiB (EP=1)"]["met"] is True
    # an FP8 variant against Megatron's offloading in FP8, not in bf16
    assert found["ours+teo+fp8block fits more tokens than ours+megatron+fp8block under 60 GiB (EP=1)"]["met"] is False
    assert found["ours+teo-layer fits more tokens than ours+megatron under 60 GiB (EP=1)"]["met"] is False
    assert mgr.cap_targets(None) == []
    rows = _rows()
    mgr.add_comparisons(rows, 16384)
    result = {"gpu": "g", "date": "d", "versions": {"megatron-core": "0.19.2", "transformer-engine": "2.20.2",
                                                      "torch": "2.11"},
              "config": {"layers": 4, "hidden": 2048, "heads": 16, "experts": 16, "topk": 4, "ffn": 1408,
                         "vocab": 32768, "microbatches": 2, "micro_batch": 4, "seq": 2048, "iters": 8, "warmup": 3,
                         "cap_gib": 60.0, "cap_max_micro_batch": 8},
              "rows": rows, "cap": cap, "targets": []}
    text = mgr.markdown(result)
    assert "Under a 60 GiB cap (EP=1" in text and "| ours+teo | 6 | 24576 | 100.0 | 245,760 | 50.00 |" in text
    assert "| ours+teo-layer | none fits |" in text and "| ours+teo+kdtoh | failed: RuntimeError: boom |" in text


def _numerics_rank(flips_ours=(0, 30, 60)):
    runs = ("stock_replay", "ours", "noise", "ours_replay", "noise_replay")
    errs = {"stock_replay": 0.0, "ours": 0.2, "noise": 0.15, "ours_replay": 0.012, "noise_replay": 0.006}
    return {"tokens": [16384] * 3, "moe0_input_equal": True, "moe0_output_rel_err": 5.1e-3,
            "noise_rel_achieved": 5.3e-3,
            "flips": {r: list(flips_ours) if r == "ours" else [0, 20, 40] if r == "noise" else [0, 0, 0] for r in runs},
            "losses": {}, "loss_rel_err": {r: 0.0 if r == "stock_replay" else 4e-5 for r in runs},
            "grads": {r: {"max_rel_err": e, "worst": "decoder.layers.2.mlp.experts.linear_fc1.weight3",
                          "all_equal": r == "stock_replay", "keys": 120} for r, e in errs.items()}}


def test_the_report_has_a_full_line_per_row_the_numerics_and_marks_failures():
    import megatron_gpt_numerics as mn

    rows = _rows() + [{"variant": "stock+megatron", "ep": 1, "error": "CUDA error: an illegal memory access"}]
    mgr.add_comparisons(rows, 16384)
    numerics = {"1": {"error": "2 of 1 ranks wrote results"},
                "2": mn.merge_ranks([_numerics_rank(), _numerics_rank(flips_ours=(0, 34, 50))])}
    result = {"gpu": "NVIDIA H100", "date": "today", "versions": {"megatron-core": "0.19.2",
                                                                   "transformer-engine": "2.20.2", "torch": "2.11"},
              "config": {"layers": 4, "hidden": 2048, "heads": 16, "experts": 16, "topk": 4, "ffn": 1408,
                         "vocab": 32768, "microbatches": 2, "micro_batch": 4, "seq": 2048, "iters": 8, "warmup": 3},
              "rows": rows, "numerics": numerics, "targets": mgr.targets(rows)}
    lines = mgr.markdown(result).splitlines()
    head = lines.index("| " + " | ".join(h for h, _, _ in mgr.COLUMNS) + " |")
    body = lines[head + 2:lines.index("", head)]
    assert len(body) == 6 and all(line.count("|") == len(mgr.COLUMNS) + 1 for line in body)
    assert any("failed: CUDA error: an illegal memory access" in line for line in body)
    assert "| ours at EP=2 >= 1.7x stock's step | 1.82 | yes |" in lines
    # per EP: what matched, ours' and the floor's worst errors; per layer: tokens routed otherwise
    assert "| 1 | failed: 2 of 1 ranks wrote results |" + " |" * 7 in lines
    assert ("| 2 | yes, 0 tokens routed otherwise | 5.10e-03 | 5.30e-03 | bitwise equal | 4.0e-05 | 1.20e-02 / "
            "6.00e-03 | 2.00e-01 / 1.50e-01 | decoder.layers.2.mlp.experts.linear_fc1.weight3 |") in lines
    assert "| 2 | 2 | 32768 | 110 (0.34%) | 80 (0.24%) | 0 |" in lines


# -- jobs in processes of their own ---------------------------------------------------------------


def _script(tmp_path, body: str) -> Path:
    path = tmp_path / "standin.py"
    path.write_text("import json, subprocess, sys, time\nfrom pathlib import Path\nout = Path(sys.argv[1])\n" + body)
    return path


def test_a_job_shows_its_progress_lines_keeps_its_output_and_reads_every_rank_in_order(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, """
print("a warning nobody needs to see")
print("[progress] 3 warm-up steps done", flush=True)
for r in (10, 0, 2):
    (out / f"rank{r}.json").write_text(json.dumps({"rank": r, "row": {"step_ms": r}}))
(out / "rank11.json").write_text("{not json")
print("done")
""")
    shown = []
    job = mgj.run(mgj.command(script, [str(out)], 1), out, env=dict(os.environ), cwd=tmp_path, timeout=60,
                  show=shown.append, log_path=tmp_path / "job.log")
    assert shown == ["3 warm-up steps done"] and job["rc"] == 0 and not job["timed_out"]
    assert [r["rank"] for r in job["per_rank"]] == [0, 2, 10, 11] and "unreadable" in job["per_rank"][3]["error"]
    assert "a warning nobody needs to see" in job["tail"] and "done" in (tmp_path / "job.log").read_text()
    assert mgj.failure(job, 4) == job["per_rank"][3]["error"]
    assert mgj.failure({**job, "per_rank": job["per_rank"][:3]}, 3) is None
    assert mgj.failure({**job, "per_rank": job["per_rank"][:3]}, 5) == "3 of 5 ranks wrote results (exit status 0)"
    assert mgj.failure({**job, "per_rank": job["per_rank"][:1], "rc": 1}, 1) == \
        "the processes ended with exit status 1"
    # the rank that failed, not the ranks torchrun stopped after it
    assert mgj.failure({**job, "per_rank": [{"rank": 1, "error": "OutOfMemoryError: ..."}], "rc": 1}, 2) == \
        "OutOfMemoryError: ..."


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


def test_a_job_past_its_time_limit_is_stopped_with_its_child_processes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, """
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
(out.parent / "child.pid").write_text(str(child.pid))
print("[progress] waiting", flush=True)
time.sleep(120)
""")
    t0 = time.monotonic()
    job = mgj.run(mgj.command(script, [str(out)], 1), out, env=dict(os.environ), cwd=tmp_path, timeout=3,
                  show=lambda text: None)
    assert job["timed_out"] and time.monotonic() - t0 < 30
    assert mgj.failure(job, 2).startswith("ran past the time limit and was stopped (0 of 2 ranks")
    pid = int((tmp_path / "child.pid").read_text())
    deadline = time.monotonic() + 10
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid)


def test_a_torchrun_job_past_its_time_limit_is_stopped_with_its_ranks(tmp_path):
    # torchrun runs each rank in a process group of its own (setsid): killing torchrun's group leaves them
    out = tmp_path / "out"
    out.mkdir()
    script = _script(tmp_path, """
import os
(out.parent / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
print("[progress] waiting", flush=True)
time.sleep(90)
""")
    t0 = time.monotonic()
    job = mgj.run(mgj.command(script, [str(out)], 2), out, env=mgm.worker_env(), cwd=tmp_path, timeout=15,
                  show=lambda text: None)
    assert job["timed_out"] and time.monotonic() - t0 < 45
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)


def test_the_ep_tests_worker_past_its_time_limit_is_stopped_with_its_ranks(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    import test_megatron_ep_gpu as ep

    out = tmp_path / "out"
    out.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text("""import json, os, sys, time
from pathlib import Path
out, rank = Path(sys.argv[2]), os.environ["RANK"]
(out.parent / f"rank{rank}.pid").write_text(str(os.getpid()))
(out / f"rank{rank}.json").write_text(json.dumps({"cases": {"a": {"rank": int(rank)}}}))
print(f"[rank {rank}] a done", flush=True)
time.sleep(90)
""")
    t0 = time.monotonic()
    results, log = ep.run_worker(out, worker=worker, timeout=15)
    assert time.monotonic() - t0 < 45
    assert results == [{"a": {"rank": 0}}, {"a": {"rank": 1}}]
    assert "[rank 1] a done" in log and "(stopped: ran past 15 s)" in log
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)


def test_the_ep_test_names_the_error_of_a_case_that_failed_as_a_whole():
    sys.path.insert(0, str(ROOT / "tests"))
    import test_megatron_ep_gpu as ep

    results = [{"ep_overlap": {"error": "Traceback ...\nValueError: no schedule"}},
               {"ep_overlap/ours": {"plan": "FusedScaledSReLUMLP"}}]
    with pytest.raises(pytest.fail.Exception, match="rank 0: case ep_overlap failed before it measured "
                                                    "ep_overlap/ours:\nTraceback ...\nValueError: no schedule"):
        ep.case((results, "log"), "ep_overlap/ours")
    with pytest.raises(pytest.fail.Exception, match="case numerics is missing"):
        ep.case((results, "log"), "numerics")
    ok = [{"teo/layer": {"plan": "p"}}] * 2
    assert ep.case((ok, "log"), "teo/layer") == [{"plan": "p"}] * 2


def test_the_processes_below_one_are_found_and_the_callers_group_is_spared(monkeypatch):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # in this test's group
    try:
        assert child.pid in mgj.descendants(os.getpid())
        killed = []
        monkeypatch.setattr(mgj.os, "killpg", lambda group, sig: killed.append(("group", group)))
        monkeypatch.setattr(mgj.os, "kill", lambda pid, sig: killed.append(("pid", pid)))
        mgj.kill_tree(child.pid)
        assert killed == [("pid", child.pid)]  # its group is the caller's: not killed as a group
    finally:
        monkeypatch.undo()
        child.kill()
        child.wait()


def test_the_launcher_runs_a_job_per_variant_and_ep_then_numerics_and_cap_trials_and_reports(tmp_path, monkeypatch,
                                                                                              capsys):
    calls = []

    def fake_job(args, ep, label, job, variant=None, micro_batch=None):
        calls.append((ep, job, variant, micro_batch))
        base = {"rc": 0, "seconds": 1.0, "timed_out": False, "tail": "", "failure": None}
        if job == "time" and variant == "ours+teo" and ep == 2:
            return {**base, "per_rank": [], "rc": 1, "failure": "0 of 2 ranks wrote results (exit status 1)"}
        if job == "time":
            peak = {"stock": 9.0, "ours": 8.0, "ours+megatron": 7.0, "ours+teo": 6.5}[variant]
            return {**base, "per_rank": [{"rank": r, "gpu": "NVIDIA H100 80GB HBM3", "weights_digest": 1.0,
                                          "row": _row(variant, ep, 100.0 + r, peak, rank=r)} for r in range(ep)]}
        if job == "numerics":
            return {**base, "per_rank": [{"rank": r, "gpu": "NVIDIA H100 80GB HBM3", "numerics": _numerics_rank()}
                                         for r in range(ep)]}
        fits = micro_batch <= {"ours": 4, "ours+megatron": 4, "ours+teo": 5}[variant]
        found = {"variant": variant, "micro_batch": micro_batch, "fits": fits}
        if fits:
            found.update(step_ms=100.0, peak_GiB=50.0)
        return {**base, "per_rank": [{"rank": 0, "gpu": "NVIDIA H100 80GB HBM3", "cap": found}]}

    monkeypatch.setattr(mg, "run_job", fake_job)
    monkeypatch.setattr(mg, "problem", lambda max_ep, variants=(): None)
    rc = mg.main(["--out", str(tmp_path), "--cap-gib", "60", "--cap-max-micro-batch", "5"])
    assert rc == 1  # the failed variant
    variants = ["stock", "ours", "ours+megatron", "ours+teo"]
    assert calls[:5] == [(1, "time", v, None) for v in variants] + [(1, "numerics", None, None)]
    assert calls[5:11] == [(1, "cap", "ours", 4), (1, "cap", "ours", 5), (1, "cap", "ours+megatron", 4),
                           (1, "cap", "ours+megatron", 5), (1, "cap", "ours+teo", 4), (1, "cap", "ours+teo", 5)]
    assert calls[11:] == [(2, "time", v, None) for v in variants] + [(2, "numerics", None, None)]
    result = json.loads((tmp_path / "megatron_gpt_NVIDIA_H100_80GB_HBM3.json").read_text())
    assert [(r["ep"], r["variant"], "error" in r) for r in result["rows"]] == \
        [(1, v, False) for v in variants] + [(2, v, v == "ours+teo") for v in variants]
    assert result["rows"][2]["freed_vs_ours_GiB"] == pytest.approx(1.0) and result["numerics"]["2"]["ranks"] == 2
    targets = {t["target"]: t["met"] for t in result["targets"]}
    assert targets["ours' grads with its own routing within max(0.03, 3x noise floor) of stock's (EP=2)"] is True
    assert targets["ours+teo fits more tokens than ours+megatron under 60 GiB (EP=1)"] is True
    assert [c["best"]["micro_batch"] for c in result["cap"]] == [4, 4, 5]
    out = capsys.readouterr().out
    assert "EP=2 [4/4] ours+teo ..." in out and "EP=1 numerics: 5 of 5 bounds met" in out
    assert "cap 60 GiB: ours+teo at micro-batch 5: fits, step 100.0 ms" in out


def test_stock_block_fp8_is_refused_up_front_where_cublaslt_lacks_its_grouped_gemm():
    said = mg.variants_problem(["ours", "stock+fp8block"], (9, 0), 130100)
    assert "cuBLASLt >= 13.6" in said and "13.1" in said and "ours+fp8block" in said
    assert mg.variants_problem(["ours", "stock+fp8block"], (9, 0), 130600) is None
    assert mg.variants_problem(["stock+fp8block"], (10, 0), 130100) is None  # Blackwell: another path
    assert mg.variants_problem(["ours+fp8block", "stock+fp8current"], (9, 0), 130100) is None


def test_repeats_run_in_rounds_and_each_row_is_the_median_run(tmp_path, monkeypatch):
    calls, steps = [], {"ours": iter([103.0, 99.0, 101.0]), "ours+teo": iter([140.0, 110.0, None])}

    def fake_job(args, ep, label, job, variant=None, micro_batch=None):
        calls.append(variant)
        base = {"rc": 0, "seconds": 1.0, "timed_out": False, "tail": "", "failure": None}
        step = next(steps[variant])
        if step is None:
            return {**base, "per_rank": [], "rc": 1, "failure": "0 of 1 ranks wrote results (exit status 1)"}
        return {**base, "per_rank": [{"rank": 0, "gpu": "NVIDIA H100 80GB HBM3", "weights_digest": 1.0,
                                      "row": _row(variant, ep, step, 8.0, rank=0)}]}

    monkeypatch.setattr(mg, "run_job", fake_job)
    monkeypatch.setattr(mg, "problem", lambda max_ep, variants=(): None)
    mg.main(["--out", str(tmp_path), "--ep", "1", "--variants", "ours,ours+teo", "--repeats", "3", "--no-numerics"])
    assert calls == ["ours", "ours+teo"] * 3  # rounds, not one variant's runs back to back
    result = json.loads((tmp_path / "megatron_gpt_NVIDIA_H100_80GB_HBM3_ep1.json").read_text())
    ours, teo = result["rows"]
    assert ours["step_ms"] == 101.0 and ours["step_ms_runs"] == [103.0, 99.0, 101.0]
    assert teo["step_ms"] == 110.0 and teo["step_ms_runs"] == [140.0, 110.0, None]  # lower middle of two that ran
    assert teo["step_vs_ours"] == pytest.approx(110.0 / 101.0)
    md = (tmp_path / "megatron_gpt_NVIDIA_H100_80GB_HBM3_ep1.md").read_text()
    assert "Each variant ran 3 times" in md
    assert "| 103.0 / 99.0 / 101.0 | 1.000 / 1.000 / 1.000 |" in md  # ours against itself, round by round
    assert "| 140.0 / 110.0 / failed | 1.359 / 1.111 / - |" in md
    with pytest.raises(SystemExit):
        mg.parse_args(["--repeats", "0"])


def test_a_run_stopped_part_way_leaves_the_jobs_it_finished_in_its_json(tmp_path, monkeypatch):
    seen = []

    def fake_job(args, ep, label, job, variant=None, micro_batch=None):
        if variant == "ours+teo" and len(seen) == 3:  # the launcher is stopped during the fourth job
            raise KeyboardInterrupt
        seen.append(variant)
        if len(seen) > 1:  # what the previous jobs measured is on disk before this one runs
            partial = json.loads((tmp_path / "megatron_gpt_NVIDIA_H100_80GB_HBM3_ep2.json").read_text())
            assert partial["complete"] is False and len(partial["rows"]) == min(len(seen) - 1, 2)
        base = {"rc": 0, "seconds": 1.0, "timed_out": False, "tail": "", "failure": None}
        return {**base, "per_rank": [{"rank": r, "gpu": "NVIDIA H100 80GB HBM3", "weights_digest": 1.0,
                                      "row": _row(variant, 2, 100.0 + len(seen), 8.0, rank=r)} for r in range(2)]}

    monkeypatch.setattr(mg, "run_job", fake_job)
    monkeypatch.setattr(mg, "problem", lambda max_ep, variants=(): None)
    with pytest.raises(KeyboardInterrupt):
        mg.main(["--out", str(tmp_path), "--ep", "2", "--variants", "ours,ours+teo", "--repeats", "2",
                 "--no-numerics"])
    partial = json.loads((tmp_path / "megatron_gpt_NVIDIA_H100_80GB_HBM3_ep2.json").read_text())
    assert partial["complete"] is False and not (tmp_path / "megatron_gpt_NVIDIA_H100_80GB_HBM3_ep2.md").exists()
    ours, teo = partial["rows"]
    assert ours["step_ms_runs"] == [101.0, 103.0] and teo["step_ms_runs"] == [102.0]
    assert teo["step_vs_ours"] == pytest.approx(102.0 / 101.0)  # the lower middle of ours' two runs
    assert "stopped before its last jobs" in mgr.markdown(partial)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the worker's failure path without a GPU")
def test_a_worker_that_cannot_start_writes_why_and_exits_non_zero(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "megatron_gpt.py"), "--worker-ep", "1", "--worker-out",
                           str(tmp_path), "--worker-job", "numerics"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    found = json.loads((tmp_path / "rank0.json").read_text())
    # No GPU here: the worker fails at its start (no CUDA, or no Megatron-Core installed) and says which.
    assert found["rank"] == 0 and found["job"] == "numerics"
    assert re.match(r"(RuntimeError|ModuleNotFoundError): \S", found["error"]), found["error"]
    assert mgj.failure({"per_rank": [found], "rc": 1, "timed_out": False}, 1) == found["error"]


# -- the overlap analysis -------------------------------------------------------------------------


def _ev(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_overlap_of_offload_copies_with_nccl_and_the_dispatchers_waits():
    events = [
        _ev("kernel", "ncclDevKernel_SendRecv", 100, 100, correlation=1),
        _ev("kernel", "ncclDevKernel_ReduceScatter", 900, 100, correlation=2),
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50, 200, bytes=64 << 20, correlation=3),  # 50..250
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 950, 100, bytes=64 << 20, correlation=4),  # 950..1050
        _ev("cuda_runtime", "cudaMemcpyAsync", 55, 5, correlation=5),  # the dispatcher's copy, launched by 60
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 250, 2, bytes=64, correlation=5),  # waited 190
        _ev("cuda_runtime", "cudaMemcpyAsync", 400, 10, correlation=6),
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 420, 2, bytes=64, correlation=6),  # waited 10, CE idle
        _ev("cuda_driver", "cuLaunchKernelEx", 70, 5, correlation=7),
        _ev("kernel", "_splits_to_host_0d1d2", 80, 3, correlation=7),  # by kernel: waited 5
        {"ph": "i", "cat": "kernel", "name": "ncclX", "ts": 0},  # instant events are not spans
    ]
    got = cco.analyze(events, steps=2)
    assert got["nccl_ms"] == pytest.approx(200e-3 / 2) and got["offload_d2h_ms"] == pytest.approx(200e-3 / 2)
    assert got["offload_h2d_ms"] == pytest.approx(100e-3 / 2)
    assert got["overlap_ms"] == pytest.approx((100 + 50) * 1e-3 / 2)  # 100..200 with d2h, 950..1000 with h2d
    assert got["overlap_share_of_nccl"] == pytest.approx(150 / 200)
    small = got["small_d2h"]
    assert small["count"] == 1.0 and small["wait_ms"] == pytest.approx(200e-3 / 2)
    assert small["wait_behind_offload_ms"] == pytest.approx(190e-3 / 2) and small["max_wait_ms"] == pytest.approx(0.19)
    assert got["kernel_dtoh"]["count"] == 0.5 and got["kernel_dtoh"]["wait_ms"] == pytest.approx(5e-3 / 2)
    with pytest.raises(ValueError, match="steps must be positive"):
        cco.analyze(events, steps=0)


def test_interval_arithmetic():
    assert cco.union([(5, 6), (0, 2), (1, 3), (4, 4)]) == [(0, 3), (5, 6)]
    assert cco.intersection([(0, 3), (5, 9)], [(2, 6), (8, 10)]) == [(2, 3), (5, 6), (8, 9)]
    assert cco.copy_direction("Memcpy DtoD (Device -> Device)") is None


# -- shared set-up -------------------------------------------------------------------------------


def test_the_wgrad_stand_in_adds_grad_output_t_times_input_into_main_grad(monkeypatch):
    monkeypatch.delitem(sys.modules, mgm.WGRAD_ACCUM_MODULE, raising=False)
    fake_layers = types.SimpleNamespace(_grad_accum_fusion_available=False)
    monkeypatch.setitem(sys.modules, "megatron.core.tensor_parallel.layers", fake_layers)
    assert mgm.install_wgrad_accum_standin() is True
    module = sys.modules[mgm.WGRAD_ACCUM_MODULE]
    assert fake_layers._grad_accum_fusion_available and fake_layers.fused_weight_gradient_mlp_cuda is module
    x, dy = torch.randn(6, 3), torch.randn(6, 4)
    main_grad = torch.ones(4, 3)
    module.wgrad_gemm_accum_fp32(x, dy, main_grad)
    torch.testing.assert_close(main_grad, 1 + dy.t() @ x)
    assert mgm.install_wgrad_accum_standin() is True  # again: the same stand-in stays


def test_random_batches_repeat_with_the_seed_and_shift_labels():
    shape = mgm.GPTShape(seq=8, micro_batch=2, microbatches=3, vocab=50)
    a, b = mgm.random_batches(shape, 3, device="cpu"), mgm.random_batches(shape, 3, device="cpu")
    assert len(a) == 3 and all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))
    assert a[0]["tokens"].shape == (2, 8) and torch.equal(a[0]["tokens"][:, 1:], a[0]["labels"][:, :-1])
    loss, reported = mgm._loss(torch.ones(2, 8), torch.full((2, 8), 3.0).t())  # non-contiguous losses
    assert loss.item() == 3.0 and reported["lm loss"].item() == 3.0


# -- split sizes by kernel -----------------------------------------------------------------------


def test_the_dispatcher_patch_keeps_megatrons_copy_for_what_the_kernel_does_not_take(monkeypatch):
    calls = []

    def original(tensor, as_numpy=False, record_stream=False):
        calls.append((tensor, as_numpy, record_stream))
        return tensor

    fake = types.SimpleNamespace(maybe_move_tensor_to_cpu=original)
    handle = dispatch_sync.use_kernel_dtoh(fake)
    patched = fake.maybe_move_tensor_to_cpu
    assert patched is not original and dispatch_sync.use_kernel_dtoh(fake).original is original
    t = torch.arange(4)
    assert patched(t, as_numpy=True) is t and calls == [(t, True, False)]  # a CPU tensor: Megatron's path
    assert patched(None) is None
    handle.remove()
    assert fake.maybe_move_tensor_to_cpu is original
    assert not dispatch_sync._eligible(torch.zeros(3, dtype=torch.bool))
    assert not dispatch_sync._eligible(torch.zeros(3))  # on the CPU


# -- no-GPU paths ---------------------------------------------------------------------------------


def test_the_ep_worker_refuses_unknown_cases():
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "megatron_ep_worker.py"), "--out", "/tmp",
                           "--cases", "moe_layer,bogus"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown cases ['bogus']" in proc.stderr


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the skip where two GPUs are not visible")
def test_the_multi_gpu_and_fp8_tests_skip_with_their_reasons_here():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/test_megatron_ep_gpu.py", "tests/test_megatron_fp8_gpu.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "needs 2 GPUs of one host" in proc.stdout
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in proc.stdout
    assert " passed" not in proc.stdout and " failed" not in proc.stdout


def test_torchrun_passes_every_launcher_option_through_to_the_ranks(tmp_path):
    # torchrun's parser rejects an option of the script that abbreviates two of its own
    from torch.distributed.run import get_args_parser

    options = [a.option_strings[0] for a in mg.parser()._actions if a.option_strings and a.option_strings[0] != "-h"]
    assert "--job-logs" in options and len(options) > 20
    cmd = mgj.command(Path(mg.__file__).resolve(), [*options, "--worker-job", "time"], 2)
    launched = get_args_parser().parse_args(cmd[3:])
    assert launched.training_script == str(Path(mg.__file__).resolve())
    assert launched.training_script_args == [*options, "--worker-job", "time"]


def test_idle_causes_are_summed_over_phases_and_averaged_over_steps():
    from test_step_profile import synthetic_step

    events = sorted(synthetic_step() + synthetic_step(shift=2000.0), key=lambda e: (e.start, -e.dur))
    renamed = [e if e.name != "teo_step 1" or e.start < 1000 else type(e)(**{**e.__dict__, "name": "teo_step 2"})
               for e in events]
    idle = mg.compute_idle(renamed, ["teo_step 1", "teo_step 2"])
    # per step: host busy 20 (forward) + 35 (backward) + 305 (optimizer) us, the H2D wait 108 us
    assert idle["idle_ms_by_cause"]["host: busy"] == pytest.approx(0.36)
    assert idle["idle_ms_by_cause"]["wait: H2D copy"] == pytest.approx(0.108)
    assert idle["gpu_ms"] == pytest.approx(0.97) and idle["largest_gaps"][0]["next"] == "F"
    assert list(idle["idle_ms_by_cause"].values()) == sorted(idle["idle_ms_by_cause"].values(), reverse=True)


def test_the_report_says_when_variants_started_from_different_weights():
    rows = [{"variant": "stock", "ep": 1, "weights_digest": [2541.18]},
            {"variant": "ours", "ep": 1, "weights_digest": [2541.18]},
            {"variant": "ours+teo", "ep": 1, "weights_digest": [2543.62]},
            {"variant": "stock", "ep": 2, "weights_digest": [7.0, 7.0]},
            {"variant": "ours", "ep": 2, "weights_digest": [7.0, 7.0]},
            {"variant": "ours+megatron", "ep": 2, "error": "failed"}]
    lines = mgr.weights_lines(rows)
    assert lines == ["", "Weights at EP=1: the variants' processes started from different weights (stock, ours; "
                         "ours+teo); the loss columns compare only variants that started alike."]
    assert mgr.weights_lines(rows[3:]) == []
    unknown = [{**rows[0], "weights_digest": [None]}, rows[1]]  # a job that recorded no digest
    assert mgr.weights_lines(unknown) == []


def test_reports_of_other_shapes_are_named_after_what_differs():
    def stem(*argv):
        args = mg.parser().parse_args(["--variants", "ours", *argv])
        args.ep = [int(e) for e in args.ep.split(",")]
        args.shape = mg.shape_of(args)
        args.variants = args.variants.split(",")
        return mg.report_stem(args, "NVIDIA H200")

    assert stem() == "megatron_gpt_NVIDIA_H200"
    assert stem("--ep", "2", "--seq", "4096") == "megatron_gpt_NVIDIA_H200_ep2_seq4096"
    assert stem("--hidden", "4096", "--micro-batch", "8") == "megatron_gpt_NVIDIA_H200_hidden4096_micro_batch8"
