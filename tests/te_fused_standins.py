"""Run TE's own fused grouped MLP (``ops/fused/grouped_mlp.py``) where its sm_100 pieces cannot run.

TE fuses GroupedLinear, a scaled activation and GroupedLinear only on sm_100 with an MXFP8 or
NVFP4 recipe. To test what its forward really saves on the GPUs we have (H100) and on CPU,
:func:`blackwell_standins` makes TE's own checks pass and replaces only the pieces that need
sm_100; TE's Python (fusion, quantizer set-up, metadata, storage wrapping, its offload marks,
its ``save_for_backward`` call) runs unchanged. Every stand-in returns what TE's code reads
back, in the shapes and dtypes of the real thing, filled with random bytes (not real results):

* cuDNN frontend kernels (``grouped_gemm_*_wrapper_sm100``): fc1 GEMM + activation, fc2 GEMM
  (MXFP8), and for NVFP4 TE's fc2 grouped GEMM (``general_grouped_gemm_for_grouped_tensor``,
  cuBLASLt NVFP4). The NVFP4 hadamard (RHT amax) fc1 kernel is reported absent, so TE takes
  its plain NVFP4 path.
* MXFP8 and NVFP4 quantization (``MXFP8Quantizer.quantize_impl``, ``NVFP4Quantizer.quantize_impl``,
  ``tex.group_quantize``): TE's MXFP8 quantize kernels, single and grouped, have their body
  only for sm_100 and newer (``#if __CUDA_ARCH__ >= 1000``), and TE treats MXFP8 and NVFP4 as
  sm_100+ formats (``check_mxfp8_support``, ``check_nvfp4_support``). The stand-ins allocate as TE's C++ does (TE's own
  ``make_empty`` for single tensors; a grouped storage of TE's class with the C++ sizes) and
  keep ``first_dims`` and ``tensor_offsets`` the very tensors TE passed.
* ``tex.grouped_mlp_experimental.swizzle_scales_and_pack_ptrs_for_discrete_weights`` and, for a
  single grouped weight, ``tex.grouped_swizzle_for_gemm`` (their output only feeds the stood-in
  GEMMs).
* TE's fused backward (all sm_100 GEMMs and quantization) is replaced by a recorder of what it
  would be handed (:class:`BackwardRecorder`); it returns no gradients.
* TE's availability checks: ``NVTE_CUTEDSL_FUSED_GROUPED_MLP=1``, compute capability (10, 0) (TE's
  and this package's selection alike), the cuDNN frontend's sm100 dSReLU backward wrapper,
  MXFP8/NVFP4 support for ``te.autocast``. The cuDNN frontend version checks stay real (the
  frontend is installed here and on the GPU machine; its kernels are never called).

For CPU tensors (``cpu=True``, the ``te_fused`` fixture) CUDA-only helpers are stood in too, whether
or not a GPU is visible (the CPU tests run on the GPU machine as well): ``tex.splits_to_offsets_multi``
(asserts a CUDA device), ``torch.cuda.current_stream``, ``torch.cuda.is_current_stream_capturing``
and ``torch.cuda.current_device`` (NVFP4Quantizer builds its RHT matrix there, which would put a
CUDA tensor among the CPU ones).
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch
from transformer_engine.pytorch import quantization  # loads the extension that registers tex
import transformer_engine_torch as tex  # noqa: E402
from transformer_engine.pytorch.ops.fused import grouped_mlp as te_mlp
from transformer_engine.pytorch.ops.fuser import OperationFuser
from transformer_engine.pytorch.tensor import GroupedTensorStorage
from transformer_engine.pytorch.tensor.grouped_tensor import GroupedTensor
from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
from transformer_engine.pytorch.tensor.nvfp4_tensor import NVFP4Quantizer

from te_offload_ops.fused import selection as fused_selection
from te_offload_ops.fused.te_grouped_mlp import fuse_te_grouped_mlp

ENABLE_ENV = "NVTE_CUTEDSL_FUSED_GROUPED_MLP"
TE_FUSIONS = (te_mlp.fuse_glu_ops, te_mlp.fuse_unary_activation_ops)


def clear_te_caches() -> None:
    """Forget TE's cached answers (is_supported, kernel look-ups, frontend features)."""
    for obj in vars(te_mlp).values():
        if callable(getattr(obj, "cache_clear", None)):
            obj.cache_clear()
        elif isinstance(obj, type) and obj.__module__ == te_mlp.__name__:
            for attr in vars(obj).values():
                if isinstance(attr, classmethod) and hasattr(attr.__func__, "cache_clear"):
                    attr.__func__.cache_clear()


# -- filling -------------------------------------------------------------------------------

def _fill(t: Optional[torch.Tensor], gen: dict) -> Optional[torch.Tensor]:
    """Random content (normal values for float types, random bytes otherwise), in place."""
    if t is None or t.numel() == 0:
        return t
    key = t.device
    if key not in gen:
        gen[key] = torch.Generator(device=t.device).manual_seed(1234)
    if t.dtype in (torch.float32, torch.bfloat16, torch.float16):
        t.copy_(torch.randn(t.shape, generator=gen[key], device=t.device, dtype=torch.float32))
    else:
        raw = t.view(torch.uint8) if t.element_size() == 1 else t.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen[key], device=t.device, dtype=torch.uint8))
    return t


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


# -- quantization stand-ins ------------------------------------------------------------------

def _quantize_impl(gen: dict):
    def quantize_impl(self, tensor: torch.Tensor):
        out = self.make_empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        for name in ("_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv"):
            _fill(getattr(out, name, None), gen)
        for name in ("_amax_rowwise", "_amax_columnwise"):
            amax = getattr(out, name, None)
            if amax is not None:
                amax.fill_(1.0)
        return out
    return quantize_impl


def _grouped_sizes(quantizer: Any, rows: int, cols: int) -> dict:
    """Buffer sizes (elements) of a grouped MXFP8/NVFP4 tensor as TE's C++ allocates them."""
    if isinstance(quantizer, MXFP8Quantizer):
        return dict(data=rows * cols, scale_inv=_round_up(rows, 128) * _round_up(cols // 32, 4),
                    columnwise_scale_inv=_round_up(rows // 32, 4) * _round_up(cols, 128), amax=0)
    if isinstance(quantizer, NVFP4Quantizer):
        return dict(data=rows * cols // 2, scale_inv=_round_up(rows, 128) * _round_up(cols // 16, 4),
                    columnwise_scale_inv=_round_up(cols, 128) * _round_up(rows // 16, 4), amax=1)
    raise TypeError(f"no grouped stand-in for {type(quantizer).__name__}")


def _group_quantize(gen: dict):
    def group_quantize(tensor, quantizer, num_tensors, first_dims=None, tensor_offsets=None):
        rows, cols = tensor.shape[0], tensor.shape[-1]
        sizes = _grouped_sizes(quantizer, rows, cols)
        dev = tensor.device

        def buf(n, dtype=torch.uint8):
            return _fill(torch.empty(n, dtype=dtype, device=dev), gen)

        row, col = quantizer.rowwise_usage, quantizer.columnwise_usage
        amax = torch.ones(num_tensors, dtype=torch.float32, device=dev) if sizes["amax"] else None
        cls = GroupedTensorStorage if quantizer.internal else GroupedTensor
        return cls(
            shape=(rows, cols), dtype=tensor.dtype, num_tensors=num_tensors, quantizer=quantizer,
            data=buf(sizes["data"]) if row else None,
            columnwise_data=buf(sizes["data"]) if col else None,
            scale_inv=buf(sizes["scale_inv"]) if row else None,
            columnwise_scale_inv=buf(sizes["columnwise_scale_inv"]) if col else None,
            amax=amax if row else None,
            columnwise_amax=amax.clone() if (col and amax is not None) else None,
            first_dims=first_dims, tensor_offsets=tensor_offsets,
            with_gemm_swizzled_scales=quantizer.optimize_for_gemm,
        )
    return group_quantize


def _pack_weight_ptrs(data, scales, mode, device):
    del mode
    ptrs = torch.tensor([t.data_ptr() for t in data], dtype=torch.int64, device=device)
    scale_buf = torch.cat([s.reshape(-1) for s in scales])
    step = scale_buf.numel() // max(len(scales), 1)
    scale_ptrs = torch.tensor([scale_buf.data_ptr() + i * step for i in range(len(scales))],
                              dtype=torch.int64, device=device)
    return ptrs, scale_ptrs, scale_buf


# -- GEMM stand-ins --------------------------------------------------------------------------

def _fc1_kernel(gen: dict, *, glu: bool):
    def fc1_activation(**kw):
        a = kw["a_tensor"]
        tokens, dev = a.shape[0], a.device
        n = kw["n"] if "n" in kw else kw["b_tensor"].shape[0]
        n_out = n // 2 if glu else n
        out = {"c_tensor": _fill(torch.empty(tokens, n, 1, dtype=kw["c_dtype"], device=dev), gen),
               "d_tensor": _fill(torch.empty(tokens, n_out, 1, dtype=kw["d_dtype"], device=dev), gen)}
        if kw["d_dtype"] == torch.float8_e4m3fn:  # MXFP8: columnwise copy and both scale layouts
            out["d_col_tensor"] = _fill(torch.empty(tokens, n_out, 1, dtype=kw["d_dtype"], device=dev), gen)
            row = torch.empty(1, math.ceil(tokens / 128), math.ceil(n_out / 128), 32, 4, 4,
                              dtype=torch.float8_e8m0fnu, device=dev)
            col = torch.empty(1, math.ceil(n_out / 128), math.ceil(tokens / 128), 32, 4, 4,
                              dtype=torch.float8_e8m0fnu, device=dev)
            out["sfd_row_tensor"] = _fill(row, gen).permute(3, 4, 1, 5, 2, 0)
            out["sfd_col_tensor"] = _fill(col, gen).permute(3, 4, 1, 5, 2, 0)
        return out
    return fc1_activation


def _fc2_kernel(gen: dict):
    def fc2_quant(**kw):
        _fill(kw["d_tensor"], gen)
    return fc2_quant


def _fc2_grouped_gemm(gen: dict):
    def general_grouped_gemm_for_grouped_tensor(weight, x, out, **kw):
        del weight, x, kw
        _fill(out.rowwise_data, gen)
    return general_grouped_gemm_for_grouped_tensor


def _not_run(name: str):
    def kernel(**kw):
        raise AssertionError(f"{name} is sm_100 only and is not stood in; TE's backward is replaced")
    return kernel


# -- backward recorder ------------------------------------------------------------------------

@dataclass
class BackwardRecorder:
    """Stands in for TE's fused backward: keeps what TE's backward would be handed."""

    calls: list = field(default_factory=list)

    def fuser_backward(self, op, basic_op_ctxs, grad_output, **unused):
        del unused
        self.calls.append(tuple(basic_op_ctxs[0].saved_tensors))
        fc1, _, fc2 = op.basic_ops
        dx = torch.zeros(grad_output.shape[0], fc1.in_features, dtype=grad_output.dtype,
                         device=grad_output.device)
        grads = [[None] * len(list(fc1.parameters())), (), [None] * len(list(fc2.parameters()))]
        extras = [(None,) * op.basic_ops[i].num_extra_inputs for i in range(3)]
        return dx, grads, extras


class _Tex:
    """``tex`` as TE's grouped_mlp module sees it, with some entry points replaced."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(tex, name)


def _splits_to_offsets_multi(split_sizes, device, *, strides, include_leading_zero, dtypes, bulk_allocate=True):
    del bulk_allocate
    splits = split_sizes.to(device=device, dtype=torch.int64)
    outs = []
    for stride, lead, dtype in zip(strides, include_leading_zero, dtypes):
        cum = torch.cumsum(splits * stride, 0)
        if lead:
            cum = torch.cat([torch.zeros(1, dtype=cum.dtype, device=cum.device), cum])
        outs.append(cum.to(dtype))
    return splits, tuple(outs)


def _register_te_fusions_behind_ours(monkeypatch) -> None:
    """As on Blackwell: TE registered its fusions (at import, prepended), ours were prepended later."""
    funcs = [f for f in OperationFuser.forward_backward_fusion_functions if f not in TE_FUSIONS]
    at = funcs.index(fuse_te_grouped_mlp) + 1
    monkeypatch.setattr(OperationFuser, "forward_backward_fusion_functions", funcs[:at] + list(TE_FUSIONS) + funcs[at:])


def blackwell_standins(monkeypatch, *, cpu: bool = False) -> BackwardRecorder:
    """Make TE's fused grouped MLP select and run forward here (see the module docstring).

    Call :func:`clear_te_caches` when done (the ``te_fused`` fixtures do).
    """
    gen: dict = {}
    monkeypatch.setenv(ENABLE_ENV, "1")
    monkeypatch.setattr(te_mlp, "get_device_compute_capability", lambda: (10, 0))
    # our selection asks torch for the capability; on a GPU machine with current_device stood in
    # (below) torch cannot answer, and either way the stand-ins play a Blackwell GPU
    monkeypatch.setattr(fused_selection, "_cuda_capability", lambda: (10, 0))
    # whether the frontend's sm100 dSReLU wrapper imports differs between machines (it does on the
    # CPU machine, not on the H100's); the recompute choice it feeds must not
    monkeypatch.setattr(te_mlp, "_grouped_gemm_dsrelu_backward_supported", lambda: True)
    monkeypatch.setattr(quantization, "_FP8_SUPPORT", (True, ""))
    monkeypatch.setattr(quantization, "_MXFP8_SUPPORT", (True, ""))
    monkeypatch.setattr(quantization, "_NVFP4_SUPPORT", (True, ""))
    base, unary, glu = te_mlp._GroupedMLP_CuTeGEMMBase, te_mlp.GroupedMLP_CuTeGEMMUnary, te_mlp.GroupedMLP_CuTeGEMMGLU

    def const(value):
        return classmethod(lambda cls: value)

    monkeypatch.setattr(base, "grouped_gemm_quant_kernel", const(_fc2_kernel(gen)))
    monkeypatch.setattr(base, "grouped_gemm_wgrad_kernel", const(_not_run("grouped_gemm_wgrad_wrapper_sm100")))
    for cls, is_glu in ((unary, False), (glu, True)):
        monkeypatch.setattr(cls, "grouped_gemm_activation_kernel", const(_fc1_kernel(gen, glu=is_glu)))
        monkeypatch.setattr(cls, "grouped_gemm_dactivation_kernel", const(_not_run("the dactivation kernel")))
        monkeypatch.setattr(cls, "grouped_gemm_act_hadamard_kernel", const(None))
    replaced = dict(group_quantize=_group_quantize(gen),
                    grouped_swizzle_for_gemm=lambda *args, **kwargs: None,
                    grouped_mlp_experimental=types.SimpleNamespace(
                        swizzle_scales_and_pack_ptrs_for_discrete_weights=_pack_weight_ptrs))
    if cpu:
        replaced["splits_to_offsets_multi"] = _splits_to_offsets_multi
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(cuda_stream=0))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")  # NVFP4Quantizer builds its RHT matrix there
    monkeypatch.setattr(te_mlp, "tex", _Tex(**replaced))
    monkeypatch.setattr(te_mlp, "general_grouped_gemm_for_grouped_tensor", _fc2_grouped_gemm(gen))
    monkeypatch.setattr(MXFP8Quantizer, "quantize_impl", _quantize_impl(gen))
    monkeypatch.setattr(NVFP4Quantizer, "quantize_impl", _quantize_impl(gen))

    recorder = BackwardRecorder()
    monkeypatch.setattr(base, "fuser_backward",
                        lambda self, ctxs, dy, **kw: recorder.fuser_backward(self, ctxs, dy, **kw))
    _register_te_fusions_behind_ours(monkeypatch)
    clear_te_caches()
    return recorder


def frontend_problem() -> Optional[str]:
    """Why TE's fusion cannot be selected here even with the stand-ins, or None."""
    if not te_mlp._cudnn_frontend_supports_grouped_gemm_srelu():
        return "TE's fused grouped MLP needs nvidia-cudnn-frontend >= 1.24 installed (its version is checked)"
    return None


@pytest.fixture
def te_fused(monkeypatch):
    """TE's fused grouped MLP selectable and runnable forward on CPU tensors, with or without a GPU visible."""
    recorder = blackwell_standins(monkeypatch, cpu=True)
    yield recorder
    clear_te_caches()



# -- building MLPs and reading what TE saved ---------------------------------------------------

# name -> (class name in te.ops and te_offload_ops, constructor kwargs, whether fc1 feeds a GLU (2x wide))
ACTIVATIONS = {
    "srelu": ("ScaledSReLU", {}, False),
    "tanh-srelu": ("ScaledTanhSReLU", {"tanh_clamp_scale": 4.0}, False),
    "swiglu": ("ScaledSwiGLU", {"glu_interleave_size": 32}, True),
    "situglu": ("ScaledSiTUGLU", {"glu_interleave_size": 32}, True),
    "qgeglu": ("ScaledClampedQGeGLU", {"glu_interleave_size": 32}, True),
}


def make_ops(activation: str = "srelu", *, stock: bool = False, experts: int = 4, hidden: int = 256,
             ffn: int = 128, offload=(True, True, True), device="cpu", dtype=torch.bfloat16,
             activation_kwargs=None, **fc_kwargs) -> list:
    """fc1, activation, fc2 of this package (or TE's own with ``stock``), bias-free."""
    import transformer_engine.pytorch as te
    import te_offload_ops as teo

    name, kwargs, glu = ACTIVATIONS[activation]
    kwargs = {**kwargs, **(activation_kwargs or {})}
    ns = te.ops if stock else teo
    flags = [{} if stock else {"offload": flag} for flag in offload]
    fc1_out = 2 * ffn if glu else ffn
    return [ns.GroupedLinear(experts, hidden, fc1_out, bias=False, device=device, dtype=dtype, **fc_kwargs, **flags[0]),
            getattr(ns, name)(**kwargs, **flags[1]),
            ns.GroupedLinear(experts, ffn, hidden, bias=False, device=device, dtype=dtype, **fc_kwargs, **flags[2])]


@dataclass
class TESave:
    """One fused forward's saved tuple, and each slot's data tensors as they were when TE saved them.

    (The fuser empties storages once it has handed their data to autograd; backward refills them.
    TE's V1 engine swaps the data tensors of storages it offloaded for empty ones: hence ``sizes``.)
    """

    saved: tuple
    carriers: list
    sizes: list  # (elements, bytes) of each carrier when TE saved it
    bytes: Optional[list] = None  # CPU copies of each carrier's bytes, when asked for


def carriers_of(obj) -> tuple:
    """The tensors autograd and the engines get for one saved entry.

    A tensor (subclass or not) goes whole; a storage as every tensor its prepare_for_saving()
    hands over (data, scales, split metadata), which is what TE's fuser saves.
    """
    if obj is None:
        return ()
    if isinstance(obj, torch.Tensor):
        return (obj,)
    tensors, _ = obj.prepare_for_saving()
    obj.restore_from_saved(tensors)
    unique = {id(t): t for t in tensors if t is not None}
    return tuple(unique.values())


def watch_te_saves(monkeypatch, *, clone_bytes: bool = False) -> list:
    """A list that gets a :class:`TESave` per fused forward: what TE's own forward saved, before anyone re-saves it."""
    seen = []
    te_forward = te_mlp._GroupedMLP_CuTeGEMMBase.fuser_forward

    def recording_forward(self, basic_op_ctxs, *args, **kwargs):
        out = te_forward(self, basic_op_ctxs, *args, **kwargs)
        saved = basic_op_ctxs[0].to_save
        if saved is not None:
            carriers = [carriers_of(obj) for obj in saved]
            data = ([tuple(t.detach().reshape(-1).view(torch.uint8).cpu() for t in c) for c in carriers]
                    if clone_bytes else None)
            sizes = [tuple((t.numel(), t.numel() * t.element_size()) for t in c) for c in carriers]
            seen.append(TESave(tuple(saved), carriers, sizes, data))
        return out

    monkeypatch.setattr(te_mlp._GroupedMLP_CuTeGEMMBase, "fuser_forward", recording_forward)
    return seen


def te_slot_owners(num_fc1_weights: int, num_fc2_weights: int) -> list[tuple[str, frozenset]]:
    """(kind, owning ops) for each slot of TE 2.20's saved tuple, as this package's policy assigns them."""
    fc1, act, fc2, both = frozenset({"fc1"}), frozenset({"act"}), frozenset({"fc2"}), frozenset({"fc1", "fc2"})
    return ([("activation", both)] * 3 + [("activation", fc1)] * 2 + [("activation", fc2)] * 2
            + [("activation", fc1)] + [("weight", fc1)] * num_fc1_weights
            + [("activation", act)] * 2
            + [("activation", fc2)] + [("weight", fc2)] * num_fc2_weights)
