"""Torch entry point for the Hopper grouped FP8 weight gradient (:mod:`.gemm_fp8_wgrad_sm90`).

:func:`grouped_wgrad_fp8_blockwise` takes the columnwise copies :func:`.fp8_rows.quantize_columns`
makes of the two token matrices (each expert's tokens padded to 128, TE's 128x1 scale blocks per
expert), reads the split sizes on the GPU only and launches on the current CUDA stream. Compiled
kernels are kept in :mod:`.registry` in memory, keyed ``("fp8_wgrad", output dtype, tile, M, N, E,
epilogue, ["overlap"], call convention)``, and on disk (:mod:`.disk_cache`), where a later process loads them,
through TVM-FFI without importing the DSL. The promotion ("overlap" or "serial") is
:func:`.api_fp8.fp8_promotion`'s, as for the forward GEMMs; it keys the variant where not serial.
"""

from __future__ import annotations

import functools

import torch

from ..capture import GraphCaptureError, capturing
from . import availability, disk_cache, dsl, launch, registry
from .api_fp8 import OUT_DTYPES, SCALE_BLOCK, fp8_promotion
from .gemm_plan import PROMOTIONS, GemmPlan
from .main_grads import check_main_grads, main_grad_offsets, vector_aligned
from .operands import INT32_MAX, splits_i32

WGRAD_TILE_NS = (64, 128)  # gemm_fp8_wgrad_sm90.WGRAD_TILE_NS, without the DSL import
_FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def pick_tile_fp8_wgrad(n: int) -> tuple[int, int]:
    return (128, 64) if n <= 64 else (128, 128)


def _compile(out_dtype, m, n, e, tile, epilogue, promotion, call, options=None):
    cutlass, cute, make_ptr, make_fake_stream = dsl.runtime()
    from .gemm_fp8_wgrad_sm90 import GroupedWgradFp8Sm90

    od = dsl.element_type(out_dtype)
    kern = GroupedWgradFp8Sm90(od, m, n, e, tile_mn=tile, epilogue=epilogue, promotion=promotion)
    gmem = cute.AddressSpace.gmem
    fake = 1 << 20  # any aligned address: only the types matter at compile time
    f8, f32 = cutlass.Float8E4M3FN, cutlass.Float32
    c_type, c_align = (od, 16) if epilogue == "plain" else (f32, 4)  # main_grad: any fp32 buffer (8-byte pairs checked)
    args = [
        make_ptr(f8, fake, gmem, assumed_align=16),  # A columnwise data (M, Tp)
        make_ptr(f8, fake, gmem, assumed_align=16),  # B columnwise data (N, Tp)
        make_ptr(c_type, fake, gmem, assumed_align=c_align),  # the (E * M, N) output, or main_grad's base
        make_ptr(cutlass.Int32, fake, gmem, assumed_align=4),  # split sizes
        make_ptr(f32, fake, gmem, assumed_align=16),  # A scales (read by TMA)
        make_ptr(f32, fake, gmem, assumed_align=16),  # B scales (read by TMA)
        make_ptr(cutlass.Int64, fake, gmem, assumed_align=8),  # main_grad offsets per expert
    ]
    args += [cutlass.Int32(128), cutlass.Int32(128), cutlass.Int32(4), cutlass.Int32(4), cutlass.Int32(1),
             make_fake_stream()]
    return registry.compile_timed(kern, args, call, options)


def compile_variant_fp8_wgrad(m: int, n: int, e: int, *, out_dtype=torch.bfloat16, tile=None, epilogue="plain",
                              promotion=None, options=None, call=None):
    """Compile one variant without caching; returns (kernel object, compiled, seconds). Works
    without a GPU when ``CUTE_DSL_ARCH=sm_90a`` is set (CPU compile tests)."""
    tile = tuple(tile) if tile is not None else pick_tile_fp8_wgrad(n)
    return _compile(out_dtype, m, n, e, tile, epilogue, promotion or fp8_promotion(),
                    call or availability.kernel_call_convention(), options)


def launch_plan_fp8_wgrad(out_dtype, m, n, e, tile, epilogue, promotion="serial") -> GemmPlan:
    """What launching a compiled variant reads (its static walk: experts, tile groups), as its
    kernel object derives it, without the DSL; its parameters key the disk cache, with the kernel
    sources' digest covering what the FP8 kernel derives beyond them (stages, scale boxes)."""
    plan = GemmPlan(out_dtype.itemsize, n, 0, e, b_n_major=True, epilogue=epilogue, tile_mn=tile, wgrad_m=m,
                    schedule="cooperative")
    plan.fp8_wgrad = True  # apart from the bf16 weight-gradient form of the same plan
    if promotion != "serial":  # set only off it: a serial plan keys as the bare FP8 weight gradient
        plan.fp8_promotion = promotion
    return plan


def _load_or_compile(key, out_dtype, m, n, e, tile, epilogue, promotion, call):
    """(kernel or launch plan, compiled): from the disk cache where it holds the variant, else
    compiled (and stored there), one process at a time per variant, as the bf16 kernels are."""
    if not disk_cache.enabled():
        return _compile_now(key, out_dtype, m, n, e, tile, epilogue, promotion, call)
    plan = launch_plan_fp8_wgrad(out_dtype, m, n, e, tile, epilogue, promotion)
    entry = disk_cache.Entry(key, registry.kernel_params(plan), call)
    with entry.claim():
        compiled = entry.load()
        if compiled is None:
            kern, compiled = _compile_now(key, out_dtype, m, n, e, tile, epilogue, promotion, call)
            disk_cache.Entry(key, registry.kernel_params(plan), call).store(compiled)
            return kern, compiled
    if call == "tvm-ffi":  # addresses and ints: the plan's walk is all the launch needs
        kern = plan
    else:  # the Python executor's launch takes the DSL's types from the kernel object
        dsl.runtime()
        from .gemm_fp8_wgrad_sm90 import GroupedWgradFp8Sm90

        kern = GroupedWgradFp8Sm90(dsl.element_type(out_dtype), m, n, e, tile_mn=tile, epilogue=epilogue,
                                   promotion=promotion)
    kern.call = call
    registry.note_loaded(key, entry, "grouped FP8 weight gradient")
    return kern, compiled


def _compile_now(key, out_dtype, m, n, e, tile, epilogue, promotion, call):
    kern, compiled, secs = _compile(out_dtype, m, n, e, tile, epilogue, promotion, call)
    registry.note_compiled(key, secs, "grouped FP8 weight gradient")
    return kern, compiled


def _get_kernel(out_dtype, m, n, e, tile, epilogue, promotion=None):
    call = availability.kernel_call_convention()
    promotion = promotion or fp8_promotion()
    form = () if promotion == "serial" else (promotion,)
    key = ("fp8_wgrad", out_dtype, tile, m, n, e, epilogue, *form, call)
    return registry.cached_kernel(
        key, lambda key, call: _load_or_compile(key, out_dtype, m, n, e, tile, epilogue, promotion, call))


def _check(a, sa, b, sb, split_sizes, num_tokens):
    def bad(msg):
        raise ValueError(f"grouped_wgrad_fp8_blockwise: {msg}")

    for name, t in (("a_data", a), ("b_data", b)):
        if t.dtype not in _FP8_DTYPES or t.dim() != 2 or not t.is_contiguous() or not t.is_cuda:
            bad(f"{name} must be a contiguous 2-D e4m3/uint8 CUDA tensor (features, padded tokens), got "
                f"{t.dtype} {tuple(t.shape)}")
    tp = a.shape[1]
    if b.shape[1] != tp or tp % SCALE_BLOCK:
        bad(f"a_data and b_data must share their padded token count, a multiple of {SCALE_BLOCK}: "
            f"{tuple(a.shape)}, {tuple(b.shape)}")
    for name, s, rows in (("a_scale_inv", sa, a.shape[0]), ("b_scale_inv", sb, b.shape[0])):
        if (s.dtype != torch.float32 or s.dim() != 2 or s.shape[0] != tp // SCALE_BLOCK or s.shape[1] < rows
                or s.shape[1] % 4 or not s.is_contiguous() or s.device != a.device):
            bad(f"{name} must be contiguous fp32 ({tp // SCALE_BLOCK}, roundup({rows}, 4)) on {a.device}, got "
                f"{s.dtype} {tuple(s.shape)}")
    if (split_sizes.dim() != 1 or split_sizes.dtype not in (torch.int32, torch.int64)
            or split_sizes.device != a.device):
        bad(f"split_sizes must be a 1-D int32/int64 tensor on {a.device}, got {split_sizes.dtype} "
            f"{tuple(split_sizes.shape)} on {split_sizes.device}")
    if b.device != a.device:
        bad(f"a_data is on {a.device} and b_data on {b.device}; both must be on one GPU")
    if not 0 <= num_tokens <= INT32_MAX or tp > INT32_MAX:
        bad(f"{num_tokens} tokens ({tp} padded) overflow the kernel's 32-bit token counts")
    e = split_sizes.numel()
    # fp8_rows.padded_tokens (not imported: it brings Triton)
    padded = (num_tokens + (SCALE_BLOCK - 1) * e) // SCALE_BLOCK * SCALE_BLOCK if num_tokens else 0
    if num_tokens < 0 or tp != padded:
        bad(f"the padded token count must be fp8_rows.padded_tokens({num_tokens}, {e}) = {padded}, got {tp}")
    for name, rows in (("M", a.shape[0]), ("N", b.shape[0])):
        if rows % 8 or rows == 0:
            bad(f"{name} = {rows} must be a positive multiple of 8")
    for name, t in (("a_data", a), ("b_data", b), ("a_scale_inv", sa), ("b_scale_inv", sb)):
        if t.data_ptr() % 16:
            bad(f"{name} must start on a 16-byte boundary (TMA reads it)")


def _check_promotion(promotion) -> None:
    if promotion is not None and promotion not in PROMOTIONS:
        raise ValueError(f"promotion must be one of {PROMOTIONS}, got {promotion!r}")


@functools.lru_cache(maxsize=None)
def _unread_offsets(e: int, device: torch.device) -> torch.Tensor:
    """The main_grad offsets argument of the plain epilogue, which reads none: one constant
    tensor per (E, device), not a fill per call."""
    return torch.zeros(e, dtype=torch.int64, device=device)


def grouped_wgrad_fp8_blockwise(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes, num_tokens: int, *,
                                out_dtype=torch.bfloat16, tile=None, promotion=None):
    """``dW[e] = A_e^T B_e`` as an (E, M, N) tensor of ``out_dtype``: ``a_data`` (M, Tp) and
    ``b_data`` (N, Tp) the columnwise FP8 copies of the (T, M) and (T, N) token matrices, with
    their (Tp / 128, roundup(rows, 4)) fp32 scale-inverses; ``num_tokens`` T. An expert with no
    tokens gets zeros. ``promotion``: "overlap" or "serial" (default :func:`.api_fp8.fp8_promotion`'s)."""
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    _check_promotion(promotion)
    _check(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes, num_tokens)
    m, n, e = a_data.shape[0], b_data.shape[0], split_sizes.numel()
    tile = tuple(tile) if tile is not None else pick_tile_fp8_wgrad(n)
    if a_data.shape[1] == 0:  # no tokens (TMA takes no empty tensor)
        return torch.zeros((e, m, n), dtype=out_dtype, device=a_data.device)
    kern, compiled = _get_kernel(out_dtype, m, n, e, tile, "plain", promotion)
    out = torch.empty((e, m, n), dtype=out_dtype, device=a_data.device)
    split = splits_i32(split_sizes, a_data.device)  # contiguous: the kernel reads it with stride 1
    offsets = _unread_offsets(e, a_data.device)
    _launch(kern, compiled, a_data, b_data, out, split, a_scale_inv, b_scale_inv, offsets, num_tokens)
    return out


def grouped_wgrad_fp8_main_grad(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes, num_tokens: int, main_grads,
                                *, accumulate: bool = True, tile=None, promotion=None) -> None:
    """Megatron's wgrad fusion in FP8: ``main_grads[e] += A_e^T B_e`` in fp32 (``=`` with
    ``accumulate=False``, Megatron's ``overwrite_main_grad``), operands as
    :func:`grouped_wgrad_fp8_blockwise` takes them; ``main_grads`` one (E, M, N) fp32 tensor or E
    fp32 (M, N) tensors, each found through :mod:`.api_wgrad`'s table of offsets (built once per set of
    addresses). The kernel adds by 8-byte reductions in L2 (each element one addition, so the bits
    do not depend on the order of tiles); experts with no tokens add nothing, or store zeros."""
    _check_promotion(promotion)
    _check(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes, num_tokens)
    m, n, e = a_data.shape[0], b_data.shape[0], split_sizes.numel()
    bufs = check_main_grads(main_grads, e, m, n, a_data.device)
    if not vector_aligned(bufs):
        raise ValueError("grouped_wgrad_fp8_main_grad: main_grad buffers must be 8-byte aligned (the kernel adds "
                         "fp32 pairs)")
    if a_data.shape[1] == 0:  # no tokens: nothing to add (TMA takes no empty tensor)
        if not accumulate:
            for g in bufs:
                g.zero_()
        return
    tile = tuple(tile) if tile is not None else pick_tile_fp8_wgrad(n)
    kern, compiled = _get_kernel(torch.bfloat16, m, n, e, tile, "red_f32" if accumulate else "store_f32", promotion)
    base, offsets = main_grad_offsets(bufs, a_data.device)
    _launch(kern, compiled, a_data, b_data, base, splits_i32(split_sizes, a_data.device), a_scale_inv,
            b_scale_inv, offsets, num_tokens)


def _launch(kern, compiled, a, b, c, split, sa, sb, offsets, num_tokens):
    if not getattr(kern, "launched", False) and capturing():  # the first call loads the module
        raise GraphCaptureError(registry.first_call_in_capture(getattr(kern, "cache_key", type(kern).__name__)))
    n_work = kern.num_experts * kern.wgrad_groups
    num_ctas = min(launch.cluster_slots(a.device.index, 1), n_work)
    stream = launch.stream_handle(a.device.index)
    # one k-block: the row stride addresses nothing, but TMA wants a 16-byte multiple
    ints = (num_tokens, a.shape[1], sa.shape[1] if sa.shape[0] == 1 else sa.stride(0),
            sb.shape[1] if sb.shape[0] == 1 else sb.stride(0), num_ctas)
    launch.timing_the_first(kern, _call, kern, compiled, (a, b, c, split, sa, sb, offsets), ints, stream)


def _call(kern, compiled, tensors, ints, stream):
    if getattr(kern, "call", "python") == "tvm-ffi":
        compiled(*(x.data_ptr() for x in tensors), *ints, stream)
        return
    cutlass, cute, make_ptr, _ = dsl.runtime()
    import cuda.bindings.driver as cuda

    gmem = cute.AddressSpace.gmem
    f8, f32 = cutlass.Float8E4M3FN, cutlass.Float32
    c_kind = (kern.dtype, 16) if kern.epilogue == "plain" else (f32, 4)  # as _compile declares them
    kinds = ((f8, 16), (f8, 16), c_kind, (cutlass.Int32, 4), (f32, 16), (f32, 16), (cutlass.Int64, 8))
    ptrs = [make_ptr(dt, x.data_ptr(), gmem, assumed_align=al) for x, (dt, al) in zip(tensors, kinds)]
    compiled(*ptrs, *(cutlass.Int32(v) for v in ints), cuda.CUstream(stream))


__all__ = ["grouped_wgrad_fp8_blockwise", "grouped_wgrad_fp8_main_grad", "compile_variant_fp8_wgrad", "pick_tile_fp8_wgrad", "WGRAD_TILE_NS"]
