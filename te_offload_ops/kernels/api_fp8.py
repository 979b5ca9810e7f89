"""Torch entry point for the Hopper grouped FP8 GEMM with Transformer Engine's block scaling.

:func:`grouped_gemm_fp8_blockwise` takes the raw pieces of TE's ``Float8BlockwiseQTensor``
(data and ``scale_inv``; see :mod:`.gemm_fp8_sm90` for the scale layouts), never reads
``split_sizes`` on the host (no device sync) and launches on the current CUDA stream. Compiled
kernels are kept with every other GEMM's in :mod:`.registry` (so :func:`.registry.compile_times`,
:func:`.registry.load_times` and :func:`.registry.clear_cache` cover them), keyed by
``("fp8_blockwise", output dtype, tile, cluster_n, N, K, E, scale row length of B, [epilogue form],
[promotion], [("cluster_m", 2)], call convention)`` (the bracketed parts only off their defaults),
and on disk (:mod:`.disk_cache`), where a later process loads them, through TVM-FFI without
importing the DSL.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from ..capture import GraphCaptureError, capturing
from . import availability, disk_cache, dsl, launch, registry, tiling
from .gemm_plan import PROMOTIONS, GemmPlan, check_overlap_fits, overlap_fits
from .operands import INT32_MAX, out_buffer, splits_i32

_log = logging.getLogger(__name__)
SCALE_BLOCK = 128  # gemm_fp8_sm90.SCALE_BLOCK, without the DSL import
TILE_NS = (64, 128, 192)  # gemm_fp8_sm90.TILE_NS, likewise
OUT_DTYPES = (torch.bfloat16, torch.float16)
PROMOTION_ENV = "TEO_FP8_PROMOTION"  # "overlap" (the default) or "serial": fp8_promotion()
# the FP8 storage dtypes read as e4m3: TE keeps its FP8 data as uint8
_FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)


def pick_tile_fp8(n: int) -> tuple[int, int]:
    """(128, 128), or (128, 64) when N <= 64. BN=192 (a quarter fewer shared-memory operand reads
    per FLOP, scale blocks straddled) is taken only when asked for."""
    return (128, 64) if n <= 64 else (128, 128)


def fp8_promotion() -> str:
    """How the FP8 GEMMs (forward and dgrads) promote each k-block's partial sums, as
    $TEO_FP8_PROMOTION says:
    "overlap" (the default: the next k-block's WGMMAs run meanwhile; the k-blocks unrolled, two
    partial-sum fragments in registers; the same bits, faster, longer to compile)
    or "serial" (after the k-block's WGMMAs; a warpgroup's tensor-core work waits meanwhile)."""
    found = os.environ.get(PROMOTION_ENV, "") or "overlap"
    if found not in PROMOTIONS:
        raise ValueError(f"{PROMOTION_ENV} must be one of {PROMOTIONS}, got {found!r}")
    return found


# the overlapped promotion unrolls every k-block: the longest K it is timed at (docs/results.md,
# 1.11x the serial promotion at K=7168); longer K's grow the code and its compile time with it,
# and at K=16384 ptxas serializes the WGMMAs again (advisory C7514)
OVERLAP_MAX_K = 7168


def _promotion_for(tile, epilogue, k: int) -> str:
    """$TEO_FP8_PROMOTION's choice where the kernel takes it (:func:`.gemm_plan.overlap_fits`),
    serial elsewhere and for K beyond :data:`OVERLAP_MAX_K`."""
    if not overlap_fits(tile[1], epilogue) or k > OVERLAP_MAX_K:
        return "serial"
    return fp8_promotion()


def _check_tile(tile) -> tuple[int, int]:
    tile = tuple(tile)
    if len(tile) != 2 or tile[0] != 128 or tile[1] not in TILE_NS:
        raise ValueError(f"FP8 tiles are (128, BN) with BN in {TILE_NS}, got {tile}")
    return tile


def _compile_fp8(out_dtype, n, k, e, tile, cluster_n, sb_cols, call="python", options=None, epilogue="plain",
                 pow2=False, promotion="serial", cluster_m=1):
    cutlass, cute, make_ptr, make_fake_stream = dsl.runtime()
    from .gemm_fp8_sm90 import GroupedGemmFp8Sm90

    od = dsl.element_type(out_dtype)
    kern = GroupedGemmFp8Sm90(od, n, k, e, tile_mn=tile, cluster_n=cluster_n, cluster_m=cluster_m, sb_cols=sb_cols,
                              epilogue=epilogue, pow2=pow2, promotion=promotion)
    gmem = cute.AddressSpace.gmem
    fake = 1 << 20  # any aligned address: only the types matter at compile time
    f8 = cutlass.Float8E4M3FN
    args = [
        make_ptr(f8, fake, gmem, assumed_align=16),  # A data
        make_ptr(f8, fake, gmem, assumed_align=16),  # B data
        make_ptr(od, fake, gmem, assumed_align=16),  # C
        make_ptr(cutlass.Int32, fake, gmem, assumed_align=4),  # split sizes
        make_ptr(cutlass.Float32, fake, gmem, assumed_align=16),  # A scales (read by TMA)
        make_ptr(cutlass.Float32, fake, gmem, assumed_align=4),  # B scales
        make_ptr(cutlass.Float32, fake, gmem, assumed_align=4),  # probs
        make_ptr(f8, fake, gmem, assumed_align=16),  # the next GEMM's FP8 rows: act (srelu_q), dz (dsrelu_q)
        make_ptr(cutlass.Float32, fake, gmem, assumed_align=4),  # their scales
        make_ptr(f8, fake, gmem, assumed_align=16),  # z in FP8: written (srelu_q), read (dsrelu_q)
        make_ptr(cutlass.Float32, fake, gmem, assumed_align=4),  # its scales
        make_ptr(od, fake, gmem, assumed_align=16),  # act in the output dtype (dsrelu_q)
        make_ptr(cutlass.Float32, fake, gmem, assumed_align=4),  # dprob partials (dsrelu_q)
    ]
    args += [cutlass.Int32(1), cutlass.Int32(4), cutlass.Int32(1), cutlass.Int32(4), cutlass.Float32(0.0),
             make_fake_stream()]
    return registry.compile_timed(kern, args, call, options)


def compile_variant_fp8(n: int, k: int, e: int, *, out_dtype=torch.bfloat16, tile=None, cluster_n=None,
                        sb_cols=None, options=None, call=None, epilogue="plain", pow2=False, promotion=None,
                        cluster_m=None):
    """Compile one FP8 variant without caching; returns (kernel object, compiled, seconds).

    Works without a GPU when ``CUTE_DSL_ARCH=sm_90a`` is set (CPU compile tests); ``sb_cols`` is
    the row length of B's scales (default ``roundup(ceil(K / 128), 4)``, TE's padding);
    ``epilogue``: "plain" (C) or "srelu_q" (z and act quantized; ``pow2`` its scale rounding);
    ``promotion``: "overlap" or "serial" (default: :func:`fp8_promotion`'s; BN=192 tiles, the
    dsrelu_q epilogue and K > :data:`OVERLAP_MAX_K` promote serially); ``cluster_m``: 2 for 2 x 2
    clusters (default: :func:`.tiling.pick_cluster_m_fp8`'s, as if the GPU fits clusters of four)."""
    tile = _check_tile(tile) if tile is not None else pick_tile_fp8(n)
    cluster_n = cluster_n or tiling.pick_cluster(n, tile)
    cluster_m = cluster_m or tiling.pick_cluster_m_fp8(n, tile, cluster_n, epilogue, lambda: True)
    sb_cols = sb_cols if sb_cols is not None else -(-(-(-k // SCALE_BLOCK)) // 4) * 4
    call = call or availability.kernel_call_convention()
    promotion = promotion or _promotion_for(tile, epilogue, k)
    return _compile_fp8(out_dtype, n, k, e, tile, cluster_n, sb_cols, call, options, epilogue, pow2, promotion,
                        cluster_m)


def launch_plan_fp8(out_dtype, n, k, e, tile, cluster_n, sb_cols, epilogue="plain", pow2=False,
                    promotion="serial", cluster_m=1) -> GemmPlan:
    """What launching a compiled FP8 variant reads (its tile walk: BM, N tiles, experts, cluster),
    as its kernel object derives it, without the DSL. Its parameters key the disk cache; what the
    FP8 kernel derives beyond them (stages, scale blocks) comes from its module's constants, which
    the key's digest of the kernel sources covers."""
    plan = GemmPlan(out_dtype.itemsize, n, k, e, b_n_major=False, epilogue="plain", tile_mn=tile,
                    cluster_n=cluster_n, cluster_m=cluster_m, schedule="cooperative")
    plan.sb_cols = sb_cols  # part of the disk cache's key, with the plan's own parameters
    if epilogue != "plain":  # set only off the defaults: a plain, serial plan keys as the bare FP8 GEMM
        plan.fp8_epilogue, plan.pow2 = epilogue, bool(pow2)
    if promotion != "serial":  # likewise
        plan.fp8_promotion = promotion
    return plan


def _load_or_compile_fp8(key, out_dtype, n, k, e, tile, cluster_n, sb_cols, call, epilogue="plain", pow2=False,
                         promotion="serial", cluster_m=1):
    """(kernel or launch plan, compiled) of one FP8 variant: from the disk cache where it holds it,
    else compiled (and written there), one process at a time per variant, as the bf16 kernels are."""
    if not disk_cache.enabled():
        return _compile_fp8_now(key, out_dtype, n, k, e, tile, cluster_n, sb_cols, call, epilogue, pow2, promotion,
                                cluster_m)
    plan = launch_plan_fp8(out_dtype, n, k, e, tile, cluster_n, sb_cols, epilogue, pow2, promotion, cluster_m)
    entry = disk_cache.Entry(key, registry.kernel_params(plan), call)
    with entry.claim():
        compiled = entry.load()
        if compiled is None:
            kern, compiled = _compile_fp8_now(key, out_dtype, n, k, e, tile, cluster_n, sb_cols, call, epilogue,
                                              pow2, promotion, cluster_m)
            # the key again, with the DSL's settings as it states them now that it is imported (those
            # recalled for this context may be stale)
            disk_cache.Entry(key, registry.kernel_params(plan), call).store(compiled)
            return kern, compiled
    if call == "tvm-ffi":  # addresses and ints: the plan's tile walk is all the launch needs
        kern = plan
    else:  # the Python executor's launch takes the DSL's types from the kernel object
        dsl.runtime()
        from .gemm_fp8_sm90 import GroupedGemmFp8Sm90

        kern = GroupedGemmFp8Sm90(dsl.element_type(out_dtype), n, k, e, tile_mn=tile, cluster_n=cluster_n,
                                  cluster_m=cluster_m, sb_cols=sb_cols, epilogue=epilogue, pow2=pow2,
                                  promotion=promotion)
    kern.call = call
    registry.note_loaded(key, entry, "grouped FP8 GEMM")
    return kern, compiled


def _compile_fp8_now(key, out_dtype, n, k, e, tile, cluster_n, sb_cols, call, epilogue="plain", pow2=False,
                     promotion="serial", cluster_m=1):
    kern, compiled, secs = _compile_fp8(out_dtype, n, k, e, tile, cluster_n, sb_cols, call, epilogue=epilogue,
                                        pow2=pow2, promotion=promotion, cluster_m=cluster_m)
    registry.note_compiled(key, secs, "grouped FP8 GEMM")
    return kern, compiled


def _fits_four(device_index) -> bool:
    """Whether the GPU runs clusters of four; without a GPU (kernels compiled for sm_90a ahead of a
    job) as the Hopper GPUs they serve do."""
    if not torch.cuda.is_available():
        return True
    return _device_fits_four(torch.cuda.current_device() if device_index is None else device_index)


@functools.lru_cache(maxsize=None)
def _device_fits_four(device_index: int) -> bool:
    try:
        return launch.cluster_slots(device_index, 4) >= 4
    except Exception as exc:  # no answer (no CuTe DSL for the probe, say): CTA pairs, said once
        _log.warning("could not learn whether clusters of four fit on device %d (%s); the FP8 GEMMs run in CTA "
                     "pairs", device_index, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return False


def get_kernel_fp8(out_dtype, n, k, e, sb_cols, tile=None, epilogue="plain", pow2=False, promotion=None,
                   device_index=None):
    """Compiled FP8 kernel for one variant (compiles and caches on first use); ``promotion``
    default: $TEO_FP8_PROMOTION's where the kernel takes it; 2 x 2 clusters as
    :func:`.tiling.pick_cluster_m_fp8` chooses for the GPU ``device_index`` (default: current)."""
    tile = _check_tile(tile) if tile is not None else pick_tile_fp8(n)
    if promotion == "overlap":  # refused before any cache is touched
        check_overlap_fits(tile[1], epilogue)
    cluster_n = tiling.pick_cluster(n, tile)
    cluster_m = tiling.pick_cluster_m_fp8(n, tile, cluster_n, epilogue, lambda: _fits_four(device_index))
    call = availability.kernel_call_convention()
    form = () if epilogue == "plain" else (epilogue, bool(pow2))
    promotion = promotion or _promotion_for(tile, epilogue, k)
    form += () if promotion == "serial" else (promotion,)
    form += () if cluster_m == 1 else (("cluster_m", cluster_m),)
    key = ("fp8_blockwise", out_dtype, tile, cluster_n, n, k, e, sb_cols, *form, call)
    return registry.cached_kernel(key, lambda key, call: _load_or_compile_fp8(key, out_dtype, n, k, e, tile, cluster_n,
                                                                         sb_cols, call, epilogue, pow2, promotion,
                                                                         cluster_m))


def _shape(t) -> str:
    return f"{tuple(t.shape)} {t.dtype} with stride {tuple(t.stride())}"


def _check_fp8(a, sa, b, sb, split_sizes, out_dtype, more=None):
    """Host checks, device last (so that every other check can be exercised without a GPU);
    ``more(T, N)``: an entry point's own checks, run before the device's. Returns (E, N, K, B's
    scales as (E, ceil(N / 128), Kp))."""
    named = {"a_data": a, "a_scale_inv": sa, "b_data": b, "b_scale_inv": sb}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch tensor, got {type(t).__name__}")
    if not isinstance(split_sizes, torch.Tensor) or split_sizes.is_floating_point() or split_sizes.is_complex():
        raise TypeError("split_sizes must be an integer torch tensor")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    for name in ("a_data", "b_data"):
        if named[name].dtype not in _FP8_DTYPES:
            raise TypeError(f"{name} must hold FP8 e4m3 (torch.float8_e4m3fn, or uint8 as TE stores it), "
                            f"got {named[name].dtype}")
    for name in ("a_scale_inv", "b_scale_inv"):
        if named[name].dtype != torch.float32:
            raise TypeError(f"{name} must be fp32 (TE's Float8BlockScaling scales), got {named[name].dtype}")
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"a_data must be (T, K) and b_data (E, N, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    t, k = a.shape
    e, n, kb = b.shape
    if kb != k:
        raise ValueError(f"K mismatch: a_data has K={k}, b_data has K={kb}")
    if split_sizes.dim() != 1 or split_sizes.numel() != e:
        raise ValueError(f"split_sizes must be 1-D with one entry per expert: {e} experts, got shape "
                         f"{tuple(split_sizes.shape)}")
    if e == 0:
        raise ValueError("b_data must hold at least one expert")
    if k == 0 or k % 16:
        raise ValueError(f"K must be a positive multiple of 16 (16-byte FP8 rows for TMA), got {k}")
    if n == 0 or n % 8:
        raise ValueError(f"N must be a positive multiple of 8 (16-byte output rows), got {n}")
    if t > INT32_MAX:
        raise ValueError(f"the grouped GEMM takes at most {INT32_MAX} token rows, got {t}")
    k_blocks, n_blocks = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
    # A's scales: TE's 1 x 128 rowwise layout, (k-blocks, tokens padded), read by TMA
    if sa.dim() != 2 or sa.shape[0] != k_blocks or sa.shape[1] < t:
        raise ValueError(f"a_scale_inv must be ({k_blocks}, >= {t}): (ceil(K / 128), tokens) as TE's 1D "
                         f"Float8BlockQuantizer lays out rowwise scales (transposed, tokens padded to a "
                         f"multiple of 4), got {_shape(sa)}")
    if sa.stride(1) != 1 or (k_blocks > 1 and (sa.stride(0) < t or sa.stride(0) % 4)) or sa.data_ptr() % 16:
        raise ValueError(f"a_scale_inv must have unit stride along tokens, a row stride that is a multiple of 4 "
                         f"elements (16 bytes) and a 16-byte aligned address (TMA reads it), got {_shape(sa)} at "
                         f"address % 16 = {sa.data_ptr() % 16}")
    # B's scales: TE's 128 x 128 layout per expert, stacked; (E * n-blocks, Kp) accepted as well
    if sb.dim() == 2 and sb.shape[0] == e * n_blocks:
        sb = sb.view(e, n_blocks, sb.shape[1]) if sb.is_contiguous() else sb.reshape(e, n_blocks, sb.shape[1])
    if sb.dim() != 3 or tuple(sb.shape[:2]) != (e, n_blocks) or sb.shape[2] < k_blocks:
        raise ValueError(f"b_scale_inv must be ({e}, {n_blocks}, >= {k_blocks}): each expert's 2D "
                         f"Float8BlockQuantizer rowwise scales (ceil(N / 128), ceil(K / 128) padded to a multiple "
                         f"of 4) stacked, or ({e * n_blocks}, >= {k_blocks}), got {_shape(sb)}")
    if more is not None:
        more(t, n)
    devices = {x.device for x in (a, sa, b, sb)}
    if len(devices) != 1 or not a.is_cuda:
        raise ValueError(f"a_data, a_scale_inv, b_data and b_scale_inv must be on one CUDA device, got "
                         f"{', '.join(str(x.device) for x in (a, sa, b, sb))}")
    return e, n, k, sb.contiguous()


def _as_e4m3(t: torch.Tensor) -> torch.Tensor:
    """Row-contiguous, 16-byte aligned e4m3 view (a copy only where the tensor is not)."""
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t


def grouped_gemm_fp8_blockwise(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes,
                               out_dtype=torch.bfloat16, *, tile=None, out=None, promotion=None):
    """``out[rows of e] = dequant(a)[rows of e] @ dequant(b[e])^T`` under ``Float8BlockScaling``.

    ``a_data`` (T, K) e4m3 tokens concatenated by expert with ``a_scale_inv`` TE's 1x128 rowwise
    scales, shape ``(ceil(K / 128), roundup(T, 4))`` (``Float8BlockwiseQTensor._rowwise_data`` and
    ``._rowwise_scale_inv`` of a ``Float8BlockQuantizer(block_scaling_dim=1)``); ``b_data``
    (E, N, K) e4m3 weights with ``b_scale_inv`` each expert's 128x128 scales stacked,
    ``(E, ceil(N / 128), roundup(ceil(K / 128), 4))`` (``block_scaling_dim=2``). uint8 data is
    read as e4m3. ``split_sizes``: E token counts (an integer tensor; never read on the host).
    Returns (T, N) in ``out_dtype`` (bf16 or fp16), written into ``out`` if given; rows past
    ``sum(split_sizes)`` are left unwritten. K must be a multiple of 16 and N of 8; a partial
    128-block at the end of K or N takes its own scale, as TE quantizes it. ``tile``: (128, BN)
    with BN in 64, 128, 192 (default :func:`pick_tile_fp8`); ``promotion``: "serial" or "overlap"
    (default :func:`fp8_promotion`'s)."""
    if tile is not None:
        tile = _check_tile(tile)
    if promotion is not None and promotion not in PROMOTIONS:
        raise ValueError(f"promotion must be one of {PROMOTIONS}, got {promotion!r}")
    e, n, k, sb = _check_fp8(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes, out_dtype)
    t = a_data.shape[0]
    c = out_buffer(out, t, n, torch.empty(0, dtype=out_dtype, device=a_data.device), "out")
    if t == 0:
        return c
    kern, compiled = get_kernel_fp8(out_dtype, n, k, e, sb.shape[2], tile, promotion=promotion,
                                    device_index=a_data.device.index)
    a, b = _as_e4m3(a_data), _as_e4m3(b_data)
    s = splits_i32(split_sizes, a.device)
    _launch_fp8(kern, compiled, a, b, c, s, a_scale_inv, sb, t)
    return c


def _check_quantizing_epilogue(probs, t: int, n: int, tile) -> None:
    """What both quantizing epilogues need: one float prob per token, 16-byte FP8 output rows, and
    a row's 128-column scale block inside one tile."""
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() or probs.numel() != t:
        raise ValueError(f"probs must be a float tensor of one value per token ({t}), got "
                         f"{_shape(probs) if isinstance(probs, torch.Tensor) else type(probs).__name__}")
    if n % 16:
        raise ValueError(f"N must be a multiple of 16 (16-byte FP8 output rows), got {n}")
    if (tile or pick_tile_fp8(n))[1] != SCALE_BLOCK and n > 64:
        raise ValueError(f"the quantizing epilogue needs 128-column tiles where N > 64, got {tile}")


def grouped_gemm_fp8_srelu_quantize(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes, probs, *,
                                    eps: float = 0.0, pow2: bool = False, out_dtype=torch.bfloat16, tile=None):
    """fc1 of the MLP under ``Float8BlockScaling`` with its activation, quantized for what reads it:
    ``z = round(dequant(a) @ dequant(b[e])^T)`` per expert (rounded to ``out_dtype``) and
    ``act = round(relu(z)^2 * probs[:, None])``, each quantized in 1x128 blocks by TE's rule with the
    recipe's ``eps`` (amax floor) and ``pow2`` (power-of-two scales). Returns ``(act data, act
    scales, z data, z scales)``: uint8 (T, N) and fp32 ``(ceil(N / 128), roundup(T, 4))``, the
    bytes :func:`.fp8_rows.srelu_quantize` writes from the bf16 output of
    :func:`grouped_gemm_fp8_blockwise`, with no bf16 z in between. Operands as there; ``probs``
    (T,) in any float dtype (read as fp32). Rows past ``sum(split_sizes)`` are left unwritten."""
    if tile is not None:
        tile = _check_tile(tile)

    def epilogue_checks(t, n):
        _check_quantizing_epilogue(probs, t, n, tile)
        if probs.device != a_data.device:
            raise ValueError(f"probs must be on a_data's device ({a_data.device}), got {probs.device}")

    e, n, k, sb = _check_fp8(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes, out_dtype, epilogue_checks)
    t = a_data.shape[0]
    device = a_data.device
    act, zq = (torch.empty((t, n), dtype=torch.uint8, device=device) for _ in range(2))
    act_s, zq_s = (torch.empty((-(-n // SCALE_BLOCK), -(-t // 4) * 4), dtype=torch.float32, device=device)
                   for _ in range(2))
    if t == 0:
        return act, act_s, zq, zq_s
    kern, compiled = get_kernel_fp8(out_dtype, n, k, e, sb.shape[2], tile, "srelu_q", pow2,
                                    device_index=a_data.device.index)
    a, b = _as_e4m3(a_data), _as_e4m3(b_data)
    s = splits_i32(split_sizes, a.device)
    p = probs.reshape(t).to(torch.float32).contiguous()
    _launch_fp8(kern, compiled, a, b, a, s, a_scale_inv, sb, t,
                q=(p, act.view(torch.float8_e4m3fn), act_s, zq.view(torch.float8_e4m3fn), zq_s, a, act_s, act_s.stride(0),
                   float(eps)))
    return act, act_s, zq, zq_s


def grouped_gemm_fp8_dsrelu_quantize(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes, z_data, z_scale_inv,
                                     probs, *, eps: float = 0.0, pow2: bool = False, out_dtype=torch.bfloat16,
                                     tile=None):
    """fc2's dgrad of the MLP under ``Float8BlockScaling`` with the SReLU backward in its epilogue:
    from ``dact = round(dequant(a) @ dequant(b[e])^T)`` (a: dy's FP8 rows, b: fc2's weights
    transposed) and the saved FP8 z (``z_data`` (T, N), ``z_scale_inv`` TE's 1x128 layout, as
    :func:`grouped_gemm_fp8_srelu_quantize` or :func:`.fp8_rows.srelu_quantize` write them), with
    ``r = relu(z)``: ``dz = round(dact * r * prob * 2)``, dz's FP8 rows (1x128 blocks, the recipe's
    ``eps`` and ``pow2``), ``dprobs = sum(dact * r^2)`` per row (fp32) and ``act = round(r^2 *
    prob)``. Returns ``(dz, dz data, dz scales, dprobs, act)`` as :func:`.fp8_rows.dsrelu_quantize`
    does (the same bytes; dprobs summed in another order), without dact in memory."""
    if tile is not None:
        tile = _check_tile(tile)

    def epilogue_checks(t, n):
        _check_quantizing_epilogue(probs, t, n, tile)
        if not isinstance(z_data, torch.Tensor) or z_data.dtype not in _FP8_DTYPES or tuple(z_data.shape) != (t, n):
            raise ValueError(f"z_data must be FP8 e4m3 (T, N) = ({t}, {n}), got "
                             f"{_shape(z_data) if isinstance(z_data, torch.Tensor) else type(z_data).__name__}")
        want = (-(-n // SCALE_BLOCK), -(-t // 4) * 4)
        if (not isinstance(z_scale_inv, torch.Tensor) or z_scale_inv.dtype != torch.float32
                or tuple(z_scale_inv.shape) != want or z_scale_inv.stride() != (want[1], 1)):
            raise ValueError(f"z_scale_inv must be fp32 {want} and contiguous (TE's 1x128 layout of z), got "
                             f"{_shape(z_scale_inv) if isinstance(z_scale_inv, torch.Tensor) else z_scale_inv}")
        for name, x in (("probs", probs), ("z_data", z_data), ("z_scale_inv", z_scale_inv)):
            if x.device != a_data.device:
                raise ValueError(f"{name} must be on a_data's device ({a_data.device}), got {x.device}")

    e, n, k, sb = _check_fp8(a_data, a_scale_inv, b_data, b_scale_inv, split_sizes, out_dtype, epilogue_checks)
    t = a_data.shape[0]
    device = a_data.device
    dz, act = (torch.empty((t, n), dtype=out_dtype, device=device) for _ in range(2))
    dzq = torch.empty((t, n), dtype=torch.uint8, device=device)
    dzq_s = torch.empty((-(-n // SCALE_BLOCK), -(-t // 4) * 4), dtype=torch.float32, device=device)
    if t == 0:
        return dz, dzq, dzq_s, torch.empty(0, dtype=torch.float32, device=device), act
    kern, compiled = get_kernel_fp8(out_dtype, n, k, e, sb.shape[2], tile, "dsrelu_q", pow2)
    part = torch.empty((t, kern.n_tiles), dtype=torch.float32, device=device)
    a, b = _as_e4m3(a_data), _as_e4m3(b_data)
    s = splits_i32(split_sizes, a.device)
    p = probs.reshape(t).to(torch.float32).contiguous()
    _launch_fp8(kern, compiled, a, b, dz, s, a_scale_inv, sb, t,
                q=(p, dzq.view(torch.float8_e4m3fn), dzq_s, _as_e4m3(z_data), z_scale_inv, act, part,
                   dzq_s.stride(0), float(eps)))
    return dz, dzq, dzq_s, part.sum(dim=1), act


def _launch_fp8(kern, compiled, a, b, c, s, sa, sb, num_tokens, q=None):
    if not getattr(kern, "launched", False) and capturing():  # the first call loads the module
        raise GraphCaptureError(registry.first_call_in_capture(getattr(kern, "cache_key", type(kern).__name__)))
    num_ctas = launch.persistent_grid(kern, num_tokens, a.device.index)
    # one k-block: the row stride addresses nothing, but TMA wants a 16-byte multiple
    sa_stride = sa.stride(0)
    if sa.shape[0] == 1 and (sa_stride % 4 or sa_stride < num_tokens):
        sa_stride = -(-num_tokens // 4) * 4
    stream = launch.stream_handle(a.device.index)
    # the other epilogue's pointers are not read: any valid address of the right alignment serves
    prob, qd, qs, zd, zs, c2, part, q_stride, eps = q if q is not None else (sb, a, sb, a, sb, c, sb, 4, 0.0)
    tensors = (a, b, c, s, sa, sb, prob, qd, qs, zd, zs, c2, part)
    launch.timing_the_first(kern, _call_fp8, kern, compiled, tensors, num_tokens, sa_stride, num_ctas, q_stride,
                            eps, stream)


def _call_fp8(kern, compiled, tensors, num_tokens, sa_stride, num_ctas, q_stride, eps, stream):
    if getattr(kern, "call", "python") == "tvm-ffi":
        compiled(*(x.data_ptr() for x in tensors), num_tokens, sa_stride, num_ctas, q_stride, eps, stream)
        return
    cutlass, cute, make_ptr, _ = dsl.runtime()
    import cuda.bindings.driver as cuda

    gmem = cute.AddressSpace.gmem
    f8, f32 = cutlass.Float8E4M3FN, cutlass.Float32
    kinds = ((f8, 16), (f8, 16), (kern.dtype, 16), (cutlass.Int32, 4), (f32, 16), (f32, 4),
             (f32, 4), (f8, 16), (f32, 4), (f8, 16), (f32, 4), (kern.dtype, 16), (f32, 4))
    ptrs = [make_ptr(dt, x.data_ptr(), gmem, assumed_align=al) for x, (dt, al) in zip(tensors, kinds)]
    compiled(*ptrs, cutlass.Int32(num_tokens), cutlass.Int32(sa_stride), cutlass.Int32(num_ctas),
             cutlass.Int32(q_stride), f32(eps), cuda.CUstream(stream))


__all__ = ["grouped_gemm_fp8_blockwise", "grouped_gemm_fp8_dsrelu_quantize", "grouped_gemm_fp8_srelu_quantize",
           "compile_variant_fp8", "get_kernel_fp8", "launch_plan_fp8", "fp8_promotion", "PROMOTION_ENV",
           "OVERLAP_MAX_K",
           "pick_tile_fp8", "SCALE_BLOCK", "TILE_NS", "OUT_DTYPES"]
