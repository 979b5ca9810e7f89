"""GPU: the settings Megatron-Core passes to TE's grouped-MLP ops, on the fused and unfused paths
and under every offload engine: accumulate_into_main_grad (fp32 main_grad, grad_added_to_main_grad),
delay_wgrad_compute + backward_dw(), single_grouped_weight."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import requires_gpu
from mlp_steps import (Config, attach_main_grads, copy_weights, forward_plan, linears, make_inputs,
                     make_stack, run_step)
from te_offload_ops.fused.selection import DISABLE_ENV

FUSED = ["FusedScaledSReLUMLP"]
UNFUSED = ["GroupedLinear", "ScaledSReLU", "GroupedLinear"]
SETTINGS = {
    "delay": ("delay",),
    "main_grad": ("main_grad",),
    "main_grad+delay": ("main_grad", "delay"),
    "single": ("single",),
    "single+main_grad+delay": ("single", "main_grad", "delay"),
}
SPLITS = (0, 700, 1329, 19)  # uneven, one expert without tokens


@pytest.fixture(autouse=True)
def single_param(monkeypatch):
    """TE builds single grouped weights only with this switch on (Megatron sets it)."""
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")


def _stock_te_runs(megatron):
    """Whether stock TE's unfused ops run these settings on this GPU (single grouped weights need
    TE's grouped-tensor GEMM path, i.e. cuBLASLt >= 13.4 on Hopper)."""
    if "single" not in megatron:
        return True
    from transformer_engine.pytorch.ops.basic.grouped_linear import is_op_fuser_grouped_tensor_path_supported

    return is_op_fuser_grouped_tensor_path_supported(None, torch.bfloat16)


def _build(megatron, path, **cfg_kw):
    cfg = Config(layers=2, splits=SPLITS, megatron=megatron, **cfg_kw)
    if "single" in megatron and path == "unfused" and not _stock_te_runs(megatron):
        pytest.skip("TE's unfused GroupedLinear takes single_grouped_weight only on its grouped-tensor "
                    "GEMM path, which needs cuBLASLt >= 13.4 on Hopper; this GPU's cuBLASLt is older")
    ours = make_stack(cfg)
    # reference: stock TE, unfused, same settings (per-expert weights where TE cannot run single)
    ref_megatron = megatron if _stock_te_runs(megatron) else tuple(m for m in megatron if m != "single")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(DISABLE_ENV, "0")
        stock = make_stack(Config(layers=2, splits=SPLITS, megatron=ref_megatron, stock_te=True, **cfg_kw))
    copy_weights(ours, stock)
    if "main_grad" in megatron:
        attach_main_grads(ours)
        attach_main_grads(stock)
    return cfg, ours, stock


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@requires_gpu
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_megatron_settings_match_stock_te(setting, path):
    megatron = SETTINGS[setting]
    cfg, ours, stock = _build(megatron, path)
    inputs = make_inputs(cfg)
    a = run_step(ours, inputs, "none")
    b = run_step(stock, inputs, "none")
    assert forward_plan(ours[0]) == (FUSED if path == "fused" else UNFUSED)
    assert a["grads"].keys() == b["grads"].keys()
    for name, g in a["grads"].items():
        ref = b["grads"][name]
        assert g is not None and ref is not None and g.shape == ref.shape, name
        if path == "unfused":
            assert torch.equal(g, ref), name  # TE's own code, our policy around it
        elif ref.abs().max() == 0:
            assert torch.count_nonzero(g) == 0, name  # the expert without tokens
        else:
            assert _rel(g, ref) < 1e-2, (name, _rel(g, ref))
    for op in linears(ours):
        params = list(op.parameters())
        if "main_grad" in megatron:  # what TE sets for Megatron's DDP
            assert all(p.grad_added_to_main_grad for p in params)
            assert all(p.main_grad.dtype == torch.float32 for p in params)
        if "delay" in megatron:  # nothing landed before backward_dw()
            before = [a["grads_before_dw"][id(p)] for p in params]
            if "main_grad" in megatron:
                assert all(g is not None and g.numel() == p.numel() for g, p in zip(before, params))  # dummies
            else:
                assert all(g is None for g in before)


@requires_gpu
def test_overwrite_main_grad_stores_instead_of_adding(path):
    """Megatron-FSDP's overwrite_main_grad: main_grad = dW, as stock TE does. Start values as large
    as the gradients, so adding instead of storing could not pass for rounding noise."""
    cfg, ours, stock = _build(("main_grad",), path)
    for op in linears(ours) + linears(stock):
        for p in op.parameters():
            p.overwrite_main_grad = True
            p.teo_main_grad_init.mul_(1000.0)
    inputs = make_inputs(cfg)
    run_step(ours, inputs, "none")
    run_step(stock, inputs, "none")
    for a, b in zip(linears(ours), linears(stock)):
        for e, (pa, pb) in enumerate(zip(a.parameters(), b.parameters())):
            if SPLITS[e] == 0:  # dW = 0; (TE may leave an empty expert's buffer untouched)
                assert torch.count_nonzero(pa.main_grad) == 0 or path == "unfused"
            else:
                assert _rel(pa.main_grad, pb.main_grad) < 1e-2, (e, _rel(pa.main_grad, pb.main_grad))


@requires_gpu
@pytest.mark.parametrize("engine", ["v2", "spy"])
def test_megatron_settings_under_in_process_engines(engine, path):
    if engine == "v2" and os.environ.get("NVTE_CPU_OFFLOAD_V1") == "1":
        pytest.skip("this process runs TE's V1 engine (NVTE_CPU_OFFLOAD_V1=1)")
    megatron = ("main_grad", "delay") if path == "unfused" else ("single", "main_grad", "delay")
    cfg, ours, _ = _build(megatron, path, offload=(True, False, True))
    inputs = make_inputs(cfg)
    base = run_step(ours, inputs, "none")
    run = run_step(ours, inputs, engine)
    assert torch.equal(base["out"], run["out"])
    for name, g in base["grads"].items():
        assert torch.equal(g, run["grads"][name]), name
    moved = {tuple(k.split("|")) if isinstance(k, str) else k: n for k, n in run["moved"].items()}
    assert sum(n for (_, kind), n in moved.items() if kind == "weight") == 0, moved
    assert sum(n for (op, _), n in moved.items() if op.endswith(".act")) == 0, moved  # offload=False
    assert sum(moved.values()) > 0, moved


@requires_gpu
def test_megatron_settings_under_v1(path, tmp_path):
    out = tmp_path / "v1.pt"
    worker = Path(__file__).with_name("v1_step_worker.py")
    root = str(worker.parent.parent)
    env = dict(os.environ, NVTE_CPU_OFFLOAD_V1="1", TEO_TEST_MEGATRON="main_grad,delay",
               **{DISABLE_ENV: "1" if path == "fused" else "0"},
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(worker), str(out), "v1", "1", "1", "1"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = torch.load(out)
    assert all(plan == (FUSED if path == "fused" else UNFUSED) for plan in res["plans"])
    assert torch.equal(res["none"]["out"], res["v1"]["out"])
    for name, g in res["none"]["grads"].items():
        assert torch.equal(g, res["v1"]["grads"][name]), name
    moved = res["v1"]["moved"]
    assert sum(n for k, n in moved.items() if k.endswith("|weight")) == 0 and sum(moved.values()) > 0, moved


def _wgrad_operands(seed: int):
    """dy (T, 256) and x (T, 192) over experts of 300, 0, 1000 and 77 tokens, their split sizes,
    and a starting fp32 main_grad per expert (skips where the fused path cannot run)."""
    from mlp_steps import fused_path_problem

    if (problem := fused_path_problem()):
        pytest.skip(problem)
    g = torch.Generator(device="cuda").manual_seed(seed)
    splits = [300, 0, 1000, 77]
    dy = torch.randn(sum(splits), 256, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(sum(splits), 192, device="cuda", dtype=torch.bfloat16, generator=g)
    start = [torch.randn(256, 192, device="cuda", generator=g) for _ in splits]
    return dy, x, torch.tensor(splits, device="cuda"), start


@requires_gpu
def test_main_grad_adds_by_loads_and_by_reductions_give_the_same_bits():
    """Each main_grad element gets exactly one fp32 addition either way (read-modify-write in the
    epilogue, or a reduction done in L2), so the results are equal bit for bit; experts' buffers
    allocated separately, in reverse order, and an empty expert."""
    from te_offload_ops.kernels import grouped_wgrad_main_grad

    dy, x, s, start = _wgrad_operands(seed=5)
    start = start[::-1]
    got = {}
    for add in ("rmw", "red", "tma"):  # separate buffers: "tma" uses "red" unless they happen to be evenly spaced
        bufs = [b.clone() for b in start]
        grouped_wgrad_main_grad(dy, x, s, bufs, add=add)
        got[add] = bufs
    for e, (a, b, c) in enumerate(zip(got["rmw"], got["red"], got["tma"])):
        assert torch.equal(a, b) and torch.equal(a, c), e
    assert torch.equal(got["rmw"][1], start[1])  # the empty expert adds nothing
    ref = start[2] + dy[300:1300].float().t() @ x[300:1300].float()
    assert ((got["rmw"][2] - ref).norm() / ref.norm()).item() < 1e-3


@requires_gpu
@pytest.mark.parametrize("schedule", ["pingpong", "cooperative"])
def test_main_grad_by_tma_reduce_adds_gives_the_same_bits(schedule):
    """TMA's bulk reduce-adds into the experts' slots of one evenly spaced array (here one
    (E, M, N) tensor handed over in reverse order, as Megatron's grad buffer lays experts out),
    with M and N not multiples of the (128, 32) box, so TMA clips every edge tile (N=936: the last
    n-block holds a partial box and, at BN=128, boxes wholly past N, which are skipped): the same
    bits as the load-add-store epilogue, and nothing outside the slots changes."""
    from mlp_steps import fused_path_problem

    if (problem := fused_path_problem()):
        pytest.skip(problem)
    from te_offload_ops.kernels import grouped_wgrad_main_grad, main_grads, registry

    g = torch.Generator(device="cuda").manual_seed(6)
    splits = [300, 0, 1000, 77, 129]
    m, n = 200, 936
    dy = torch.randn(sum(splits), m, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(sum(splits), n, device="cuda", dtype=torch.bfloat16, generator=g)
    s = torch.tensor(splits, device="cuda")
    # slots with a guard slot on each side: a write past a slot's edge would show there
    start = torch.randn(len(splits) + 2, m, n, device="cuda", generator=g)
    got = {}
    for add in ("rmw", "tma"):
        arr = start.clone()
        bufs = list(arr[1:-1].unbind(0))[::-1]
        assert add != "tma" or main_grads.main_grad_slots([b.data_ptr() for b in bufs], m * n) is not None
        grouped_wgrad_main_grad(dy, x, s, bufs, add=add, schedule=schedule)
        got[add] = arr
    assert any(key[3] == "tma_f32" and key[9] == schedule for key in registry.compile_times()), "the TMA kernel did not run"
    assert torch.equal(got["tma"], got["rmw"])
    assert torch.equal(got["tma"][0], start[0]) and torch.equal(got["tma"][-1], start[-1])
    assert torch.equal(got["tma"][1 + len(splits) - 1 - 1], start[1 + len(splits) - 1 - 1])  # the empty expert 1


@requires_gpu
@pytest.mark.parametrize("accumulate", [True, False])
def test_main_grad_off_8_bytes_and_by_torch_add_what_aligned_buffers_get(accumulate):
    """Buffers 4 bytes past an 8-byte boundary (the kernel adds fp32 pairs) get the aligned
    buffers' bits; the torch backend (bf16 grouped GEMM, fp32 add) gets them within bf16's
    rounding of each expert's wgrad."""
    from te_offload_ops.kernels import grouped_wgrad_main_grad

    dy, x, s, start = _wgrad_operands(seed=7)
    aligned = [b.clone() for b in start]
    grouped_wgrad_main_grad(dy, x, s, aligned, accumulate=accumulate, backend="cute")
    odd = []
    for b in start:
        moved = torch.empty(b.numel() + 1, device="cuda")[1:]
        moved.copy_(b.reshape(-1))
        odd.append(moved.view(b.shape))
    assert all(b.data_ptr() % 8 == 4 for b in odd)
    grouped_wgrad_main_grad(dy, x, s, odd, accumulate=accumulate, backend="cute")
    by_torch = [b.clone() for b in start]
    grouped_wgrad_main_grad(dy, x, s, by_torch, accumulate=accumulate, backend="torch")
    for e, (a, b, c) in enumerate(zip(aligned, odd, by_torch)):
        assert torch.equal(a, b), e
        assert ((c - a).norm() / a.norm().clamp_min(1e-30)).item() < 1e-2, e
    assert not accumulate or torch.equal(aligned[1], start[1])  # the empty expert adds nothing
    assert accumulate or torch.count_nonzero(aligned[1]).item() == 0  # ... or stores zeros
