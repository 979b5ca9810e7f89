"""CPU: what the package refuses or does differently under CUDA graph capture, with capture patched on.

The GPU side (real captures, replays bitwise equal to eager steps, bytes moved under offload) is
tests/test_gpu_graphs.py.
"""

import pytest
import torch
from transformer_engine.pytorch import cpu_offload
from transformer_engine.pytorch.ops.basic.grouped_linear import GroupedLinear as TEGroupedLinear
from transformer_engine.pytorch.ops.op import OperationContext

import te_offload_ops as teo
from te_offload_ops import capture, policy
from te_offload_ops.capture import GraphCaptureError
from te_offload_ops.fused import split_check, srelu_mlp
from te_offload_ops.kernels import api, launch, main_grads, registry


@pytest.fixture
def capture_on(monkeypatch):
    """Every module of the package sees a capturing stream."""
    for module in (capture, split_check, srelu_mlp, registry, launch):
        monkeypatch.setattr(module, "capturing", lambda: True)


def test_capturing_is_false_where_cuda_was_never_initialized():
    if torch.cuda.is_initialized():
        pytest.skip("CUDA is initialized in this process")
    assert capture.capturing() is False  # and does not touch the CUDA runtime


# -- the unfused path -------------------------------------------------------------------------

def _call_unfused_forward(op, monkeypatch):
    reached_te = []
    monkeypatch.setattr(TEGroupedLinear, "fuser_forward", lambda *a, **k: reached_te.append(True))
    ctx = OperationContext()
    splits = torch.tensor([3, 0, 5])
    op.fuser_forward([ctx], torch.zeros(8, 16), basic_op_extra_inputs=[(splits,)],
                     prev_op_grad_output_quantizer=None, next_op_input_quantizer=None, basic_op_kwargs=[{}])
    return reached_te


def test_unfused_grouped_linear_on_te_split_path_is_refused_before_te_runs(capture_on, monkeypatch):
    monkeypatch.setattr(capture, "_te_takes_split_path", lambda op: True)
    op = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu")
    reached = []
    with pytest.raises(GraphCaptureError) as err:
        reached = _call_unfused_forward(op, monkeypatch)
    assert reached == []
    text = str(err.value)
    assert "GroupedLinear(num_groups=3, in_features=16, out_features=8)" in text
    assert "split_sizes.tolist()" in text and "explain_fusion" in text


def test_unfused_grouped_linear_on_te_graph_safe_path_is_left_to_te(capture_on, monkeypatch):
    monkeypatch.setattr(capture, "_te_takes_split_path", lambda op: False)
    op = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu")
    assert _call_unfused_forward(op, monkeypatch) == [True]


def test_unfused_grouped_linear_without_capture_runs_te(monkeypatch):
    monkeypatch.setattr(capture, "_te_takes_split_path", lambda op: pytest.fail("asked without a capture"))
    op = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu")
    assert _call_unfused_forward(op, monkeypatch) == [True]


# -- the fused op ---------------------------------------------------------------------------------

def _fused_op():
    fc1 = teo.GroupedLinear(3, 16, 8, bias=False, device="cpu")
    fc2 = teo.GroupedLinear(3, 8, 16, bias=False, device="cpu")
    return srelu_mlp.FusedScaledSReLUMLP(fc1=fc1, activation=teo.ScaledSReLU(), fc2=fc2)


def test_cpu_split_sizes_are_checked_then_filled_not_copied_in_a_capture(capture_on, monkeypatch):
    checked = []
    monkeypatch.setattr(srelu_mlp, "check_now", lambda sizes, tokens, where: checked.append((sizes.tolist(), tokens)))
    monkeypatch.setattr(torch.Tensor, "to", lambda *a, **k: pytest.fail("copied host sizes in a capture"))
    sizes, check = _fused_op()._device_split_sizes(torch.zeros(8, 16), torch.tensor([3, 0, 5]))
    assert checked == [([3, 0, 5], 8)] and check is None
    assert sizes.dtype == torch.int32 and sizes.tolist() == [3, 0, 5]


@pytest.mark.parametrize("values", [[4, 4, 4, 4], [3, 0, 5], [0], [7, 7, 0, 0, 7], []])
def test_sizes_filled_on_device_keep_every_value(values):
    out = capture.sizes_filled_on_device(torch.tensor(values, dtype=torch.int64), "cpu")
    assert out.dtype == torch.int32 and out.tolist() == values


def test_bad_cpu_split_sizes_still_raise_in_a_capture(capture_on):
    with pytest.raises(ValueError):
        _fused_op()._device_split_sizes(torch.zeros(8, 16), torch.tensor([3, 0, 9]))


class _UnqueryableCheck:
    @property
    def landed(self):
        raise AssertionError("an event was queried during a capture")


def test_pending_split_checks_are_not_queried_in_a_capture(capture_on):
    op = _fused_op()
    op._pending_checks = [_UnqueryableCheck()]
    op._resolve_landed_checks()
    assert len(op._pending_checks) == 1  # left for the first call after the capture


def test_split_check_queues_nothing_in_a_capture(capture_on, monkeypatch):
    monkeypatch.setattr(split_check, "SplitSizesCheck", lambda *a: pytest.fail("queued a copy in a capture"))
    for mode in ("deferred", "sync"):
        monkeypatch.setenv(split_check.CHECK_ENV, mode)
        assert split_check.start_check(torch.tensor([1, 2]), 3, "test") is None


# -- kernels ----------------------------------------------------------------------------------------

def test_kernel_cache_miss_in_a_capture_raises_without_compiling(capture_on, monkeypatch):
    monkeypatch.setattr(api, "_compile", lambda *a, **k: pytest.fail("compiled during a capture"))
    monkeypatch.setattr(registry, "CACHE", {})
    with pytest.raises(GraphCaptureError, match=r"first call, inside a CUDA graph capture.*eager forward and backward"):
        api.get_kernel(torch.bfloat16, 1856, 2688, 8, b_n_major=False, epilogue="srelu")


def test_kernel_cache_hit_in_a_capture_is_returned(capture_on, monkeypatch):
    monkeypatch.setattr(registry, "CACHE", {})
    monkeypatch.setattr(api, "_compile", lambda *a, **k: (type("K", (), {})(), "compiled", 0.0))
    monkeypatch.setattr(registry, "capturing", lambda: False)
    first = api.get_kernel(torch.bfloat16, 256, 512, 4, b_n_major=False, epilogue="plain")
    monkeypatch.setattr(registry, "capturing", lambda: True)
    assert api.get_kernel(torch.bfloat16, 256, 512, 4, b_n_major=False, epilogue="plain") is first


def test_first_launch_of_a_kernel_in_a_capture_raises(capture_on):
    kern = type("K", (), {"cache_key": ("bf16", "plain")})()
    with pytest.raises(GraphCaptureError, match=r"\('bf16', 'plain'\) would be compiled and loaded"):
        launch.launch_gemm(kern, lambda *a: pytest.fail("launched"), [(torch.zeros(1), "m")], 1)


def test_main_grad_offsets_need_an_eager_step_and_stay_cached_once_captured(monkeypatch):
    built = []

    def build(offsets, device):
        built.append(offsets)
        t = torch.tensor(offsets)
        return t, t

    monkeypatch.setattr(main_grads, "_build_offsets", build)
    monkeypatch.setattr(main_grads, "_OFFSETS_CACHE", {})
    monkeypatch.setattr(main_grads, "_OFFSETS_CAPTURED", set())
    monkeypatch.setattr(main_grads, "_OFFSETS_CACHE_MAX", 2)
    store = torch.zeros(4, 6)
    bufs_a, bufs_b, bufs_c = list(store[:2]), list(store[2:]), [store[1], store[0]]
    dev = torch.device("cpu")

    monkeypatch.setattr(main_grads, "capturing", lambda: True)
    with pytest.raises(GraphCaptureError, match="not used by an eager step.*same main_grad buffers"):
        main_grads.main_grad_offsets(bufs_a, dev)
    assert built == []

    monkeypatch.setattr(main_grads, "capturing", lambda: False)
    base, offsets = main_grads.main_grad_offsets(bufs_a, dev)  # eager step
    assert base is bufs_a[0] and offsets.tolist() == [0, 6]
    monkeypatch.setattr(main_grads, "capturing", lambda: True)
    _, captured = main_grads.main_grad_offsets(bufs_a, dev)  # the capture reads the cached table
    assert captured is offsets and len(built) == 1

    monkeypatch.setattr(main_grads, "capturing", lambda: False)
    main_grads.main_grad_offsets(bufs_b, dev)
    main_grads.main_grad_offsets(bufs_c, dev)  # the cache is full: evicts bufs_b's entry, not the captured one
    keys = [k[1] for k in main_grads._OFFSETS_CACHE]
    assert tuple(b.data_ptr() for b in bufs_a) in keys and tuple(b.data_ptr() for b in bufs_b) not in keys


# -- offload engines --------------------------------------------------------------------------------

@pytest.fixture
def no_start_offload(monkeypatch):
    monkeypatch.setattr(cpu_offload, "start_offload", lambda *ts: None)


def _v2_engine(monkeypatch, *, retain: bool, layers: int = 2, offloaded: int = 1):
    monkeypatch.setattr(cpu_offload, "NVTE_CPU_OFFLOAD_V1", False)
    sync = cpu_offload.DefaultOffloadSynchronizer(layers, offloaded, retain, offload_stream=object())
    sync.fwd_step()  # layer 0, as the context's __enter__ does
    monkeypatch.setattr(cpu_offload, "OFFLOAD_SYNCHRONIZER", sync)
    return sync


def _save(offload: bool = True):
    ctx = OperationContext()
    policy.save_for_backward(ctx, torch.zeros(1024, 512), offload=offload)
    return ctx


def test_v1_engine_is_refused_in_a_capture(capture_on, monkeypatch):
    monkeypatch.setattr(cpu_offload, "NVTE_CPU_OFFLOAD_V1", True)
    monkeypatch.setattr(cpu_offload, "is_cpu_offload_enabled", lambda: True)
    with pytest.raises(GraphCaptureError, match="V1 CPU-offload engine.*retain_pinned_cpu_buffers=True"):
        _save()


def test_v2_without_retained_pinned_buffers_is_refused_in_a_capture(capture_on, monkeypatch, no_start_offload):
    _v2_engine(monkeypatch, retain=False)
    with pytest.raises(GraphCaptureError, match="without retain_pinned_cpu_buffers=True"):
        _save(offload=False)  # whatever our ops keep, the engine would offload other tensors


def test_v2_offloaded_layer_needs_a_warm_up_step_before_capture(capture_on, monkeypatch, no_start_offload):
    sync = _v2_engine(monkeypatch, retain=True)
    with pytest.raises(GraphCaptureError, match="layer 0 has no pinned host buffers yet.*eager forward and backward"):
        _save()
    _save(offload=False)  # nothing of ours to offload: nothing to refuse
    sync.layer_states[0].cpu_tensor_group.tensor_list.append(torch.zeros(1024, 512))  # what a warm-up leaves
    assert len(_save().to_save) == 1


def test_v2_layer_the_schedule_does_not_offload_needs_no_buffers(capture_on, monkeypatch, no_start_offload):
    sync = _v2_engine(monkeypatch, retain=True, layers=3, offloaded=1)
    sync.fwd_step()  # layer 1: not offloaded with 1 of 3 layers
    _save()


def test_without_an_engine_nothing_is_checked(capture_on, monkeypatch):
    monkeypatch.setattr(cpu_offload, "NVTE_CPU_OFFLOAD_V1", False)
    monkeypatch.setattr(cpu_offload, "OFFLOAD_SYNCHRONIZER", None)
    _save()


def test_offload_context_rejects_retained_buffers_for_v1():
    from te_offload_ops.engines import offload_context

    with pytest.raises(ValueError, match="retain_pinned_cpu_buffers is an option of TE's V2 engine"):
        offload_context("v1", num_layers=1, model_layers=2, retain_pinned_cpu_buffers=True)
