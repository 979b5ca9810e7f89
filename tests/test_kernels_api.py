"""CPU: the kernel entry points reject bad input on the host, before compiling or launching."""

import types

import pytest
import torch

from conftest import requires_gpu
from te_offload_ops import kernels


def _args(dtype=torch.bfloat16, device="cpu"):
    a = torch.zeros(16, 32, dtype=dtype, device=device)
    b = torch.zeros(2, 64, 32, dtype=dtype, device=device)
    return a, b, torch.tensor([8, 8])


def test_cpu_tensors_are_refused():
    a, b, s = _args()
    with pytest.raises(ValueError, match="CUDA"):
        kernels.grouped_gemm(a, b, s)


def test_bad_types_are_refused():
    a, b, s = _args()
    with pytest.raises(TypeError, match="split_sizes"):
        kernels.grouped_gemm(a, b, [8, 8])
    with pytest.raises(TypeError, match="torch tensors"):
        kernels.grouped_gemm(object(), b, s)


@requires_gpu  # to build CUDA tensors
def test_unsupported_dtype_is_refused():
    a, b, s = _args(torch.float32, "cuda")
    with pytest.raises(TypeError, match="bf16 or fp16"):
        kernels.grouped_gemm(a, b, s)
    assert kernels.compile_times() == {} or all(k[0] != torch.float32 for k in kernels.compile_times())


def test_wgrad_refuses_bad_input_on_the_host():
    dy, x, s = torch.zeros(16, 64), torch.zeros(16, 32), torch.tensor([8, 8])
    with pytest.raises(ValueError, match="CUDA"):
        kernels.grouped_wgrad(dy.bfloat16(), x.bfloat16(), s)
    with pytest.raises(TypeError, match="split_sizes"):
        kernels.grouped_wgrad(dy, x, [8, 8])
    with pytest.raises(TypeError, match="torch tensors"):
        kernels.grouped_wgrad(dy.numpy(), x, s)


def test_wgrad_backend_choice(monkeypatch):
    monkeypatch.delenv(kernels.api_wgrad.WGRAD_BACKEND_ENV, raising=False)
    assert kernels.wgrad_backend() == kernels.api_wgrad.DEFAULT_WGRAD_BACKEND
    assert kernels.wgrad_backend("torch") == "torch"
    monkeypatch.setenv(kernels.api_wgrad.WGRAD_BACKEND_ENV, "torch")
    assert kernels.wgrad_backend() == "torch"
    assert kernels.wgrad_backend("cute") == "cute"  # the argument wins
    with pytest.raises(ValueError, match="wgrad backend"):
        kernels.wgrad_backend("cublas")


def test_schedule_choice(monkeypatch):
    from te_offload_ops.kernels import tiling

    monkeypatch.delenv(tiling.SCHEDULE_ENV, raising=False)
    for kind in ("plain", "srelu", "dsrelu"):
        assert tiling.pick_schedule(kind) in tiling.SCHEDULES
    assert tiling.pick_schedule("plain", wgrad=True) == tiling.pick_schedule("wgrad")
    assert tiling.pick_schedule("srelu", tile=(128, 192)) == "cooperative"  # too wide for pingpong
    monkeypatch.setenv(tiling.SCHEDULE_ENV, "pingpong")
    assert tiling.pick_schedule("plain", tile=(128, 192)) == "cooperative"
    monkeypatch.setenv(tiling.SCHEDULE_ENV, "cooperative")
    assert tiling.pick_schedule("srelu") == "cooperative"
    assert tiling.pick_schedule("srelu", schedule="pingpong") == "pingpong"  # the argument wins
    monkeypatch.setenv(tiling.SCHEDULE_ENV, "stream-k")
    with pytest.raises(ValueError, match="schedule"):
        tiling.pick_schedule("plain")


def test_call_convention_choice(monkeypatch):
    from te_offload_ops.kernels import availability

    monkeypatch.delenv(availability.CALL_ENV, raising=False)
    assert kernels.kernel_call_convention() == ("tvm-ffi" if availability.has_tvm_ffi() else "python")
    monkeypatch.setenv(availability.CALL_ENV, "python")
    assert kernels.kernel_call_convention() == "python"
    monkeypatch.setenv(availability.CALL_ENV, "ctypes")
    with pytest.raises(ValueError, match=availability.CALL_ENV):
        kernels.kernel_call_convention()
    monkeypatch.setattr(availability, "has_tvm_ffi", lambda: False)
    monkeypatch.setenv(availability.CALL_ENV, "tvm-ffi")
    with pytest.raises(RuntimeError, match="apache-tvm-ffi"):
        kernels.kernel_call_convention()
    monkeypatch.delenv(availability.CALL_ENV)
    assert kernels.kernel_call_convention() == "python"


def test_tvm_ffi_compile_failure_falls_back_to_the_python_executor(monkeypatch):
    """Picked by default, a TVM-FFI path that does not compile gives way to the Python executor
    for the rest of the process; named in $TEO_KERNEL_CALL, its failure is raised."""
    from te_offload_ops.kernels import api, availability, registry

    calls = []

    def fake_compile(*args, call="python", **kw):
        calls.append(call)
        if call == "tvm-ffi":
            raise RuntimeError("tvm-ffi ABI mismatch")
        return types.SimpleNamespace(call=call), object(), 0.1

    monkeypatch.setattr(api, "_compile", fake_compile)
    monkeypatch.setattr(availability, "has_tvm_ffi", lambda: True)
    monkeypatch.setattr(availability, "TVM_FFI_FAILED", [])
    monkeypatch.setenv(availability.CALL_ENV, "tvm-ffi")
    registry.clear_cache()
    try:
        with pytest.raises(RuntimeError, match="ABI mismatch"):
            api.get_kernel(torch.bfloat16, 256, 128, 2, b_n_major=False, epilogue="plain")
        assert registry.CACHE == {}
        monkeypatch.delenv(availability.CALL_ENV)
        kern, _ = api.get_kernel(torch.bfloat16, 256, 128, 2, b_n_major=False, epilogue="plain")
        assert kern.call == "python" and calls == ["tvm-ffi", "tvm-ffi", "python"]
        assert kernels.kernel_call_convention() == "python" and "ABI mismatch" in availability.TVM_FFI_FAILED[0]
        api.get_kernel(torch.bfloat16, 256, 128, 2, b_n_major=False, epilogue="plain")
        assert len(calls) == 3  # cached under the Python executor's key
    finally:
        registry.clear_cache()


def test_main_grad_slots_accepts_evenly_spaced_buffers_in_any_order():
    """TMA's reduce-adds address the experts' main_grads as slots of one array: one (E, M, N)
    tensor, or Megatron's experts laid out one after another (its grad buffer reverses order)."""
    from te_offload_ops.kernels.main_grads import main_grad_slots

    mn, base = 200 * 1000, 1 << 30
    step = 4 * mn  # bytes
    assert main_grad_slots([base + i * step for i in range(4)], mn) == (mn, [0, 1, 2, 3])
    assert main_grad_slots([base + i * step for i in range(4)][::-1], mn) == (mn, [3, 2, 1, 0])
    # padding between buffers: the stride grows, still whole 16-byte units
    assert main_grad_slots([base + i * (step + 256) for i in (2, 0, 1)], mn) == ((step + 256) // 4, [2, 0, 1])
    assert main_grad_slots([base], 6) == (8, [0])  # one expert: its size rounded to 16 bytes


@pytest.mark.parametrize("why, ptrs", [
    ("not 16-byte aligned", [(1 << 30) + 8 + i * 800_000 for i in range(3)]),
    ("uneven gaps", [(1 << 30), (1 << 30) + 800_000, (1 << 30) + 2_400_000]),
    ("overlapping slots", [(1 << 30) + i * 400_000 for i in range(3)]),
    ("one buffer twice", [(1 << 30), (1 << 30), (1 << 30) + 800_000]),
])
def test_main_grad_slots_refuses_what_one_tensor_map_cannot_address(why, ptrs):
    from te_offload_ops.kernels.main_grads import main_grad_slots

    assert main_grad_slots(ptrs, 200_000) is None, why


@pytest.mark.parametrize("stride0, offset, expect", [
    (32 * 64, 0, None),            # TE's packed buffer: as is
    (32 * 64 + 8, 0, 32 * 64 + 8),  # padded by 16 bytes: read in place with that stride
    (32 * 64 + 4, 0, "copy"),       # padding not whole 16-byte units: packed copy
    (32 * 64, 4, "copy"),           # start 8 bytes off a 16-byte boundary: packed copy
])
def test_expert_weights_read_in_place_or_packed(stride0, offset, expect):
    from te_offload_ops.kernels.operands import expert_weights

    buf = torch.randn(4 * stride0 + offset + 64, dtype=torch.bfloat16)
    buf = buf[(-buf.data_ptr() // 2) % 8:]  # start the test's buffer on a 16-byte boundary
    b = buf.as_strided((4, 32, 64), (stride0, 64, 1), offset)
    got, b_stride = expert_weights(b)
    if expect == "copy":
        assert b_stride is None and got.is_contiguous() and got.data_ptr() != b.data_ptr()
    else:
        assert b_stride == expect and got.data_ptr() == b.data_ptr()
    assert torch.equal(got, b)


def test_launches_run_in_a_named_profiler_range_only_while_a_profiler_records(monkeypatch):
    """The profiler gives every GEMM kernel of the DSL one cut name; each launch runs inside a
    range naming its kind, epilogue and N x K, so benchmarks can split GPU time by GEMM."""
    from torch.profiler import ProfilerActivity, profile

    from te_offload_ops.kernels import launch

    launched = []
    monkeypatch.setattr(launch, "_launch_now", lambda kern, *rest: launched.append(torch.autograd._profiler_enabled()))
    wgrad = types.SimpleNamespace(wgrad_m=1856, epilogue="tma_f32", n=2688, k=2048)
    fprop = types.SimpleNamespace(wgrad_m=None, epilogue="srelu", n=1856, k=2688)
    assert launch.profile_label(wgrad) == "te_offload_ops.gemm[wgrad tma_f32 n=2688 k=2048]"
    assert launch.profile_label(fprop) == "te_offload_ops.gemm[gemm srelu n=1856 k=2688]"
    launch.launch_gemm(fprop, None, [], 0)  # no profiler: launched, no range
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        launch.launch_gemm(wgrad, None, [], 0)
        launch.launch_gemm(fprop, None, [], 0)
    assert launched == [False, True, True]
    names = [e.name for e in prof.events() if e.name.startswith(launch.PROFILE_LABEL)]
    assert names == [launch.profile_label(wgrad), launch.profile_label(fprop)]


def test_the_first_launch_of_every_gemm_family_is_timed_once(monkeypatch):
    """first_launch_times (first-step reports) holds one entry per kernel, whichever entry point
    launched it: the bf16 GEMMs' launch and the FP8 GEMM's and FP8 wgrad's own; later launches
    are not timed again. The launches run on CPU tensors here, with a compiled kernel that
    records its arguments (the TVM-FFI convention: addresses, ints, the stream)."""
    from te_offload_ops.kernels import api_fp8, api_fp8_wgrad, launch, registry

    monkeypatch.setattr(registry, "_FIRST_LAUNCH_SECONDS", {})
    monkeypatch.setattr(launch, "cluster_slots", lambda device, size: 132)
    monkeypatch.setattr(launch, "stream_handle", lambda device: 7)
    calls = {}

    def compiled(name):
        return lambda *args: calls.setdefault(name, []).append(args)

    bf16 = types.SimpleNamespace(cache_key=("bf16",), call="tvm-ffi", wgrad_m=None, bm=128, num_experts=2,
                                 n_tiles=3, cluster_n=1, epilogue="plain", n=384, k=256)
    fp8 = types.SimpleNamespace(cache_key=("fp8_blockwise",), call="tvm-ffi", wgrad_m=None, bm=128, num_experts=2,
                                n_tiles=3, cluster_n=1)
    wgrad = types.SimpleNamespace(cache_key=("fp8_wgrad",), call="tvm-ffi", num_experts=2, wgrad_groups=4)
    a, s = torch.zeros(256, 128), torch.zeros(2, dtype=torch.int32)
    sa = torch.zeros(1, 256)
    for _ in range(3):
        launch.launch_gemm(bf16, compiled("bf16"), [(a, "m"), (s, "i32")], 256)
        api_fp8._launch_fp8(fp8, compiled("fp8"), a, a, a, s, sa, sa, 256)
        api_fp8_wgrad._launch(wgrad, compiled("wgrad"), a, a, a, s, sa, sa, s, 256)
    assert {name: len(args) for name, args in calls.items()} == {"bf16": 3, "fp8": 3, "wgrad": 3}
    assert sorted(registry.first_launch_times()) == [("bf16",), ("fp8_blockwise",), ("fp8_wgrad",)]
    assert calls["bf16"][0][-2:] == (min(132, (256 // 128 + 2) * 3), 7)  # CTAs bounded by tiles; the stream


def test_main_grad_way_follows_tokens_per_expert_unless_told(monkeypatch):
    """The add into main_grad (and, for short wgrads, the schedule) by the mean tokens per
    expert, as measured; an add given by argument or environment is used as given."""
    from te_offload_ops.kernels import main_grads, tiling

    monkeypatch.delenv(main_grads.MAIN_GRAD_ADD_ENV, raising=False)
    monkeypatch.delenv(tiling.SCHEDULE_ENV, raising=False)
    assert main_grads.main_grad_way(8 * 2048, 8) == ("tma", None)
    assert main_grads.main_grad_way(8 * 1536, 8) == ("tma", None)
    assert main_grads.main_grad_way(32 * 1024, 32) == ("rmw", None)  # pick_schedule's pingpong
    assert main_grads.main_grad_way(64 * 512, 64) == ("rmw", "cooperative")
    assert main_grads.main_grad_way(64 * 512, 64, schedule="pingpong") == ("rmw", "pingpong")
    assert main_grads.main_grad_way(64 * 512, 64, add="tma") == ("tma", None)
    monkeypatch.setenv(tiling.SCHEDULE_ENV, "pingpong")  # a schedule asked for everywhere stays
    assert main_grads.main_grad_way(64 * 512, 64) == ("rmw", None)
    monkeypatch.setenv(main_grads.MAIN_GRAD_ADD_ENV, "red")
    assert main_grads.main_grad_way(64 * 512, 64) == ("red", None)
    monkeypatch.setenv(main_grads.MAIN_GRAD_ADD_ENV, "fast")
    with pytest.raises(ValueError, match="TEO_MAIN_GRAD_ADD must be one of"):
        main_grads.main_grad_way(8 * 2048, 8)


def test_an_output_buffer_of_the_wrong_kind_is_refused_with_what_it_is():
    from te_offload_ops.kernels.operands import out_buffer

    like = torch.empty(4, 8, dtype=torch.bfloat16)
    good = torch.empty(10, 8, dtype=torch.bfloat16)[2:6]  # a row block of a larger buffer
    assert out_buffer(good, 4, 8, like, "out") is good
    assert out_buffer(None, 4, 8, like, "out").shape == (4, 8)
    for bad, what in [(torch.empty(4, 9, dtype=torch.bfloat16), r"\(4, 9\) torch.bfloat16"),
                      (torch.empty(4, 8, dtype=torch.float16), r"\(4, 8\) torch.float16"),
                      (torch.empty(8, 4, dtype=torch.bfloat16).t(), "contiguous=False"),
                      (torch.empty(33, dtype=torch.bfloat16)[1:].view(4, 8), "address % 16 = 2"),
                      ("z", "got str")]:
        with pytest.raises(ValueError, match=r"out must be a contiguous \(4, 8\) torch.bfloat16 tensor on cpu.*" + what):
            out_buffer(bad, 4, 8, like, "out")
