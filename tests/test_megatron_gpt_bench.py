"""CPU: the Megatron GPT benchmark's pure parts, its shared set-up, the overlap analysis, the
dispatcher's split sizes by kernel, and the no-GPU paths of the multi-GPU and FP8 GPU tests.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import comm_copy_overlap as cco  # noqa: E402
import megatron_gpt as mg  # noqa: E402
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
    with pytest.raises(ValueError, match=r"unknown variant 'ours\+fast'"):
        mg.variant_for("ours+fast", 4, ())
    with pytest.raises(ValueError, match=r"\+kdtoh is for variants that offload"):
        mg.variant_for("stock+kdtoh", 4, ())


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
])
def test_bad_arguments_are_refused_with_the_reason(argv, said, capsys):
    with pytest.raises(SystemExit) as exc:
        mg.parse_args(argv)
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_each_ep_runs_as_a_torchrun_of_the_script_with_the_same_settings(tmp_path):
    args = mg.parse_args(["--layers", "3", "--ep", "2", "--variants", "stock,ours"])
    assert args.ep == [2] and args.shape.layers == 3 and args.shape.tokens_per_step == 2 * 4 * 2048
    cmd = mg.worker_command(args, 2, tmp_path)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=2" in cmd
    assert cmd[cmd.index("--layers") + 1] == "3" and cmd[-4:] == ["--worker-ep", "2", "--worker-out", str(tmp_path)]
    worker = mg.parse_args(cmd[cmd.index(str(Path(mg.__file__).resolve())) + 1:])
    assert worker.worker_ep == 2 and worker.variants == ["stock", "ours"]


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


def _row(variant, ep, step, peak, floor=4.0, moved=0.0, loss=10.0, grad=None, rank=0, **extra):
    return {"variant": variant, "ep": ep, "rank": rank, "experts_path": "x", "step_ms": step, "step_ms_min": step,
            "step_ms_max": step, "floor_GiB": floor, "peak_GiB": peak, "peak_above_floor_GiB": peak - floor,
            "offloaded_MiB_per_step": moved, "first_loss": loss, "grad_max_rel_err": grad,
            "grad_worst": None if grad is None else "w", "profile": None, **extra}


def test_ranks_merge_to_the_slowest_step_the_largest_peak_and_any_error():
    r0 = {"rows": [_row("stock", 2, 200.0, 8.0), _row("ours", 2, 110.0, 7.0, grad=0.01),
                   _row("ours+teo", 2, 112.0, 6.0, moved=300)]}
    r1 = {"rows": [_row("stock", 2, 210.0, 7.5, rank=1), _row("ours", 2, 105.0, 7.2, grad=0.02, rank=1),
                   {"variant": "ours+teo", "ep": 2, "rank": 1, "error": "RuntimeError: boom"}]}
    stock, ours, teo = mgr.merge_ranks([r0, r1])
    assert stock["step_ms"] == 210.0 and stock["peak_GiB"] == 8.0 and stock["ranks"] == 2 and "rank" not in stock
    assert ours["grad_max_rel_err"] == 0.02 and ours["step_ms"] == 110.0
    assert teo == {"variant": "ours+teo", "ep": 2, "error": "RuntimeError: boom"}
    (missing,) = mgr.merge_ranks([{"rows": [_row("ours", 1, 1.0, 5.0)]}, {"rows": []}])
    assert "missing on a rank" in missing["error"]


def _rows():
    rows = [_row("stock", 2, 200.0, 8.0), _row("ours", 2, 110.0, 7.0, loss=10.01, grad=0.01),
            _row("ours+megatron", 2, 115.0, 6.5, moved=400, grad=0.01),
            _row("ours+teo", 2, 112.0, 6.0, moved=400, grad=0.01),
            _row("ours", 1, 90.0, 7.0, grad=0.05)]
    for r in rows:
        r["ranks"] = r["ep"]
    return rows


def test_comparisons_and_targets_are_computed_per_ep():
    rows = _rows()
    mgr.add_comparisons(rows, tokens_per_rank=16384)
    stock, ours, megatron, teo, ours1 = rows
    assert ours["speedup_vs_stock"] == pytest.approx(200 / 110) and ours["tokens_per_s"] == pytest.approx(2 * 16384 / 0.11)
    assert teo["step_vs_ours"] == pytest.approx(112 / 110) and teo["freed_vs_ours_GiB"] == pytest.approx(1.0)
    assert ours["loss_rel_err_vs_stock"] == pytest.approx(0.001)
    assert teo["tokens_under_ours_peak_x"] == pytest.approx(3.0 / 2.0)  # room 7-4 over 6-4 per step
    assert ours["tokens_under_ours_peak_x"] == pytest.approx(1.0) and ours1["speedup_vs_stock"] is None
    found = {t["target"]: t for t in mgr.targets(rows)}
    assert found["ours at EP=2 >= 1.7x stock's step"]["met"] is True
    assert found["ours' grads within 0.03 of stock's (EP=2)"]["met"] is True
    assert found["ours' grads within 0.03 of stock's (EP=1)"]["met"] is False
    assert found["ours+megatron at EP=2 costs <= 3% over ours"]["met"] is False  # 1.045
    assert found["ours+teo at EP=2 costs <= 3% over ours"]["met"] is True  # 1.018
    assert found["ours+teo frees >= ours+megatron at no more cost (EP=2)"]["met"] is True
    assert found["ours+teo fits more tokens than ours+megatron under ours' peak (EP=2, predicted)"]["met"] is True


def test_tokens_under_the_cap_compare_each_teo_variant_with_megatrons_offloading():
    def cap_row(name, mb, step=100.0):
        best = None if mb is None else {"micro_batch": mb, "step_ms": step, "peak_GiB": 50.0}
        tokens = None if mb is None else 2 * mb * 2048
        return {"variant": name, "cap_GiB": 60.0, "best": best, "tokens_per_step": tokens,
                "tokens_per_s": None if mb is None else tokens / (step * 1e-3), "hit_max": mb == 8}

    cap = [cap_row("ours", 4), cap_row("ours+megatron", 5), cap_row("ours+teo", 6), cap_row("ours+teo-layer", None)]
    found = {t["target"]: t for t in mgr.cap_targets(cap)}
    assert found["ours+teo fits more tokens than ours+megatron under 60 GiB (EP=1)"]["met"] is True
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
    assert "| ours+teo-layer | none fits |" in text


def test_the_report_has_a_full_line_per_row_and_marks_failures():
    rows = _rows() + [{"variant": "stock+megatron", "ep": 1, "error": "CUDA error: an illegal memory access"}]
    mgr.add_comparisons(rows, 16384)
    result = {"gpu": "NVIDIA H100", "date": "today", "versions": {"megatron-core": "0.19.2",
                                                                   "transformer-engine": "2.20.2", "torch": "2.11"},
              "config": {"layers": 4, "hidden": 2048, "heads": 16, "experts": 16, "topk": 4, "ffn": 1408,
                         "vocab": 32768, "microbatches": 2, "micro_batch": 4, "seq": 2048, "iters": 8, "warmup": 3},
              "rows": rows, "targets": mgr.targets(rows)}
    lines = mgr.markdown(result).splitlines()
    body = [line for line in lines if line.startswith("| 2 |") or line.startswith("| 1 |")]
    assert len(body) == 6 and all(line.count("|") == len(mgr.COLUMNS) + 1 for line in body)
    assert any("failed: CUDA error: an illegal memory access" in line for line in body)
    assert "| ours at EP=2 >= 1.7x stock's step | 1.82 | yes |" in lines


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
