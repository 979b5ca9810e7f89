"""The bf16/fp16 grouped GEMMs of the fused SReLU MLP, from torch: plain, SReLU x probs forward and
dSReLU backward entry points, and the kernel variant each call needs, built, compiled or loaded
once per process (the weight gradients' entry points: :mod:`.api_wgrad`; FP8's: :mod:`.api_fp8`,
:mod:`.api_fp8_wgrad`).

All entry points take plain torch tensors, allocate their outputs, never read
``split_sizes`` on the host (no device sync) and launch on the current CUDA
stream (:mod:`.launch`). Compiled kernels are kept per
``(dtype, tile, cluster, epilogue, N, K, E, B major, wgrad M, schedule, call convention)``
(:mod:`.registry`), with the main_grad slot stride (``tma`` add) or the weights' layout (padded or
reversed experts) before the call convention where they differ from the default; the first call
of a key in a process loads it from the disk cache (:mod:`.disk_cache`) or compiles it and writes
it there. A TVM-FFI kernel loaded from a shared object is launched from its plan
(:mod:`.gemm_plan`): such a process never imports the CuTe DSL.
"""

from __future__ import annotations

import torch

from . import disk_cache, dsl, registry
from .availability import CALLS, kernel_call_convention
from .gemm_plan import MAIN_GRAD_EPILOGUES, GemmPlan
from .launch import launch_gemm
from .operands import DTYPES, aligned, check_operands, expert_weights, out_buffer, splits_i32
from .tiling import pick_cluster, pick_cluster_m, pick_schedule, pick_tile


def _variant_kwargs(b_n_major: bool, epilogue: str, tile, cluster_n: int, wgrad_m, schedule: str, epi_cols,
                    slot_stride, b_layout: tuple, cluster_m: int) -> dict:
    return dict(
        b_n_major=b_n_major, epilogue=epilogue, tile_mn=tile, cluster_n=cluster_n, wgrad_m=wgrad_m,
        schedule=schedule, epi_cols=epi_cols,
        **({"cluster_m": cluster_m} if cluster_m != 1 else {}),
        **({"slot_stride": slot_stride} if slot_stride is not None else {}),
        **({"b_stride": b_layout[0], "b_reversed": b_layout[1]} if b_layout != (None, False) else {}),
    )


def _make_kernel(dtype: torch.dtype, n: int, k: int, e: int, b_n_major: bool, epilogue: str, tile, *,
                 cluster_n: int = 1, wgrad_m: int | None = None, schedule: str = "cooperative",
                 epi_cols: int | None = None, kernel_class=None, slot_stride: int | None = None,
                 b_layout: tuple = (None, False), cluster_m: int = 1):
    """The kernel object of one variant (its plan and code; nothing compiled). Imports the DSL."""
    cutlass_dtype = dsl.element_type(dtype)
    from .gemm_sm90 import GroupedGemmSm90

    return (kernel_class or GroupedGemmSm90)(
        cutlass_dtype, n, k, e, **_variant_kwargs(b_n_major, epilogue, tile, cluster_n, wgrad_m, schedule, epi_cols,
                                                  slot_stride, b_layout, cluster_m))


def _make_plan(dtype: torch.dtype, n: int, k: int, e: int, b_n_major: bool, epilogue: str, tile, *,
               cluster_n: int = 1, wgrad_m: int | None = None, schedule: str = "cooperative",
               slot_stride: int | None = None, b_layout: tuple = (None, False), cluster_m: int = 1) -> GemmPlan:
    """The plan of one variant, as its kernel object derives it, without the DSL."""
    if dtype not in DTYPES:
        raise TypeError(f"grouped GEMM supports bf16 and fp16, got {dtype}")
    return GemmPlan(dtype.itemsize, n, k, e, **_variant_kwargs(b_n_major, epilogue, tile, cluster_n, wgrad_m,
                                                               schedule, None, slot_stride, b_layout, cluster_m))


def _compile(
    dtype: torch.dtype, n: int, k: int, e: int, b_n_major: bool, epilogue: str, tile,
    options: str | None = None, cluster_n: int = 1, wgrad_m: int | None = None,
    schedule: str = "cooperative", epi_cols: int | None = None, kernel_class=None,
    call: str = "python", slot_stride: int | None = None, b_layout: tuple = (None, False),
    cluster_m: int = 1,
):
    cutlass, cute, make_ptr, make_fake_stream = dsl.runtime()

    dt = dsl.element_type(dtype)
    kern = _make_kernel(dtype, n, k, e, b_n_major, epilogue, tile, cluster_n=cluster_n, wgrad_m=wgrad_m,
                        schedule=schedule, epi_cols=epi_cols, kernel_class=kernel_class, slot_stride=slot_stride,
                        b_layout=b_layout, cluster_m=cluster_m)
    gmem = cute.AddressSpace.gmem
    fake = 1 << 20  # any aligned address: only the types matter at compile time
    main_grad = epilogue in MAIN_GRAD_EPILOGUES
    args = [
        make_ptr(dt, fake, gmem, assumed_align=16),  # A
        make_ptr(dt, fake, gmem, assumed_align=16),  # B
        # C / Z / dZ, or the fp32 main_grad base (16-byte aligned for TMA's reduce-adds)
        make_ptr(cutlass.Float32, fake, gmem, assumed_align=16 if epilogue == "tma_f32" else 4) if main_grad
        else make_ptr(dt, fake, gmem, assumed_align=16),
        make_ptr(cutlass.Int32, fake, gmem, assumed_align=4),  # split sizes
        make_ptr(dt, fake, gmem, assumed_align=2),  # probs
        make_ptr(dt, fake, gmem, assumed_align=16),  # z (dsrelu input)
        make_ptr(dt, fake, gmem, assumed_align=16),  # act
        # dprobs partials, or each expert's main_grad offset from the base (elements)
        make_ptr(cutlass.Int64, fake, gmem, assumed_align=8) if main_grad else make_ptr(cutlass.Float32, fake, gmem, assumed_align=4),
    ]
    return registry.compile_timed(kern, [*args, cutlass.Int32(1), cutlass.Int32(1), make_fake_stream()], call, options)


def compile_variant(dtype, n, k, e, *, b_n_major, epilogue, tile=None, options=None, cluster_n=None,
                    wgrad_m=None, schedule=None, epi_cols=None, kernel_class=None, call=None, slot_stride=None,
                    b_layout=(None, False), cluster_m=None):
    """Compile one variant without caching; returns (kernel object, compiled, seconds).

    Works without a GPU when ``CUTE_DSL_ARCH=sm_90a`` is set (CPU compile
    tests); ``options`` is passed to ``cute.compile`` (e.g. ``"--keep-ptx"``).
    ``wgrad_m`` selects the weight-gradient form (``k`` must then be 0);
    ``epi_cols`` the epilogue chunk width (32 or 64; default: the kernel's
    choice for the epilogue) and ``kernel_class`` a subclass of the kernel,
    both for comparisons (``benchmarks/experiments/ablate_epilogue.py``); ``call`` the call
    convention (default: :func:`kernel_call_convention`)."""
    schedule = pick_schedule(epilogue, wgrad_m is not None, schedule, tile)
    tile = tuple(tile) if tile is not None else pick_tile(n, schedule)
    cluster_n = cluster_n or pick_cluster(n, tile)
    cluster_m = cluster_m or pick_cluster_m(wgrad_m, n, tile, cluster_n)
    call = call or kernel_call_convention()
    if call not in CALLS:
        raise ValueError(f"call must be one of {CALLS}, got {call!r}")
    return _compile(dtype, n, k, e, bool(b_n_major), epilogue, tile, options, cluster_n, wgrad_m,
                    schedule, epi_cols, kernel_class, call, slot_stride, tuple(b_layout), cluster_m)


def get_kernel(dtype, n, k, e, *, b_n_major, epilogue, tile=None, wgrad_m=None, schedule=None,
               slot_stride=None, b_layout=(None, False)):
    """Compiled kernel for one variant (compiles and caches on first use). ``b_layout``: (elements
    between the experts' weights or None for N * K, whether they lie in reverse expert order)."""
    schedule = pick_schedule(epilogue, wgrad_m is not None, schedule, tile)
    tile = tuple(tile) if tile is not None else pick_tile(n, schedule)
    cluster_n = pick_cluster(n, tile)
    cluster_m = pick_cluster_m(wgrad_m, n, tile, cluster_n)
    call = kernel_call_convention()
    key = (dtype, tile, cluster_n, epilogue, n, k, e, bool(b_n_major), wgrad_m, schedule, call)
    if cluster_m != 1:  # 2 x 2 clusters (opt-in)
        key = key[:-1] + (("cluster_m", cluster_m), call)
    if slot_stride is not None:  # tma_f32: the buffers' spacing is part of the compiled layout
        key = key[:-1] + (slot_stride, call)
    b_layout = tuple(b_layout)
    if b_layout != (None, False):  # weights laid out other than one packed (E, N, K) tensor
        key = key[:-1] + (("b", *b_layout), call)
    variant = ((dtype, n, k, e, bool(b_n_major), epilogue, tile),
               dict(cluster_n=cluster_n, wgrad_m=wgrad_m, schedule=schedule, slot_stride=slot_stride,
                    b_layout=b_layout, cluster_m=cluster_m))
    return registry.cached_kernel(key, lambda key, call: _load_or_compile(key, call, *variant))


def _load_or_compile(key: tuple, call: str, args: tuple, variant: dict):
    """(kernel object, compiled kernel) of one variant: loaded from the disk cache where it holds
    the variant, else compiled (and written there). One process at a time compiles a variant
    that several want at once; the others load what it wrote."""
    if not disk_cache.enabled():
        return _compile_now(key, call, args, variant)
    plan = _make_plan(*args, **variant)
    entry = disk_cache.Entry(key, registry.kernel_params(plan), call)
    with entry.claim():
        compiled = entry.load()
        if compiled is None:
            kern, compiled = _compile_now(key, call, args, variant)
            # the key again, with the settings the DSL states now that it is imported: where those
            # recalled for this context were stale, the kernel goes under its true key
            disk_cache.Entry(key, registry.kernel_params(kern), call).store(compiled)
            return kern, compiled
    # the TVM-FFI launch needs the plan alone; the Python executor's, the DSL's types as well
    kern = plan if call == "tvm-ffi" else _make_kernel(*args, **variant)
    kern.call = call  # how the launch passes the arguments
    registry.note_loaded(key, entry, "grouped GEMM")
    return kern, compiled


def _compile_now(key: tuple, call: str, args: tuple, variant: dict):
    kern, compiled, secs = _compile(*args, call=call, **variant)
    registry.note_compiled(key, secs, "grouped GEMM")
    return kern, compiled


def grouped_gemm(a, b, split_sizes, *, trans_b=False, tile=None, schedule=None, reversed_experts=False, out=None):
    """c[rows of e] = a[rows of e] @ b[e].T  (b: (E, N, K)); with ``trans_b``
    b is (E, K, N) and c = a_e @ b[e].  Returns c (T, N) in a.dtype (written into ``out`` if given).

    ``reversed_experts``: b[j] holds expert E - 1 - j's weight (weights laid out in reverse
    expert order, read in place). The experts of b may be any multiple of 8 elements apart."""
    e, n, k = check_operands(a, b, split_sizes, trans_b)
    t = a.shape[0]
    c = out_buffer(out, t, n, a, "out")
    if t == 0:
        return c
    b, b_stride = expert_weights(b)
    kern, compiled = get_kernel(a.dtype, n, k, e, b_n_major=trans_b, epilogue="plain", tile=tile,
                                schedule=schedule, b_layout=(b_stride, reversed_experts))
    a = aligned(a)
    s = splits_i32(split_sizes, a.device)
    launch_gemm(
        kern, compiled,
        [(a, "m"), (b, "m"), (c, "m"), (s, "i32"), (a, "vec"), (c, "m"), (c, "m"),
         (s, "f32")],
        t,
    )
    return c


def grouped_gemm_srelu_fwd(x, w1, split_sizes, probs, *, tile=None, schedule=None, reversed_experts=False,
                           out=None):
    """z = x_e @ w1[e].T (w1: (E, N, K)), act = relu(z)^2 * probs[:, None].

    Returns (act, z), both (T, N) in x.dtype (written into ``out = (act, z)`` if given).  act is
    computed from the fp32 accumulator (not from the rounded z). ``reversed_experts``: see
    :func:`grouped_gemm`."""
    e, n, k = check_operands(x, w1, split_sizes, False)
    t = x.shape[0]
    act_out, z_out = (None, None) if out is None else out
    z = out_buffer(z_out, t, n, x, "out z")
    act = out_buffer(act_out, t, n, x, "out act")
    if t == 0:
        return act, z
    if probs.shape != (t,):
        raise ValueError("probs must be (T,)")
    w1, b_stride = expert_weights(w1)
    kern, compiled = get_kernel(x.dtype, n, k, e, b_n_major=False, epilogue="srelu", tile=tile,
                                schedule=schedule, b_layout=(b_stride, reversed_experts))
    x = aligned(x)
    p = probs.to(x.dtype).contiguous()
    s = splits_i32(split_sizes, x.device)
    launch_gemm(
        kern, compiled,
        [(x, "m"), (w1, "m"), (z, "m"), (s, "i32"), (p, "vec"), (z, "m"), (act, "m"),
         (s, "f32")],
        t,
    )
    return act, z


def grouped_gemm_dsrelu_bwd(dy, w2, split_sizes, z, probs, *, tile=None, schedule=None, reversed_experts=False,
                            act_in_z=False):
    """dact = dy_e @ w2[e] (w2: (E, H, F), i.e. (E, K, N)); then
    dz = dact * probs * 2 relu(z), dprobs[t] = sum_f dact[t, f] relu(z[t, f])^2,
    act = relu(z)^2 * probs.  Returns (dz, dprobs, act); dprobs has probs.dtype.

    dprobs is reduced in fp32 deterministically: each n-block writes its own
    partial row sum and the partials are added by one torch reduction. ``reversed_experts``: see
    :func:`grouped_gemm`. ``act_in_z``: act is written over z (z is gone afterwards; where z is
    not contiguous, aligned and of dy's dtype, over the copy made of it): one (T, N) buffer less.
    Safe because each tile's z is read into registers before its act is stored, by the same
    threads at the same addresses, and no other tile touches them."""
    e, n, k = check_operands(dy, w2, split_sizes, True)
    t = dy.shape[0]
    dz = torch.empty(t, n, dtype=dy.dtype, device=dy.device)
    if t == 0:
        return dz, torch.zeros(0, dtype=probs.dtype, device=dy.device), torch.empty_like(dz)
    if z.shape != (t, n) or probs.shape != (t,):
        raise ValueError("z must be (T, N) and probs (T,)")
    w2, b_stride = expert_weights(w2)
    kern, compiled = get_kernel(dy.dtype, n, k, e, b_n_major=True, epilogue="dsrelu", tile=tile,
                                schedule=schedule, b_layout=(b_stride, reversed_experts))
    dy, zc = aligned(dy), aligned(z.to(dy.dtype))
    act = zc if act_in_z else torch.empty_like(dz)
    p = probs.to(dy.dtype).contiguous()
    s = splits_i32(split_sizes, dy.device)
    part = torch.empty(kern.n_tiles, t, dtype=torch.float32, device=dy.device)
    launch_gemm(
        kern, compiled,
        [(dy, "m"), (w2, "m"), (dz, "m"), (s, "i32"), (p, "vec"), (zc, "m"), (act, "m"),
         (part, "f32")],
        t,
    )
    dprobs = part.sum(0).to(probs.dtype)
    return dz, dprobs, act


def dsrelu_bwd_bytes(t: int, n: int, itemsize: int, *, tile=None, schedule=None) -> list[int]:
    """What :func:`grouped_gemm_dsrelu_bwd` with ``act_in_z`` allocates for T tokens and N columns,
    in its order: dz, then dprobs' fp32 partial sums (one row per n-block). For an offload engine's
    memory budget; the same tile choice as the launch, nothing compiled. Left out: the vectors of T
    elements (probs in dy's dtype, the partials' sum and its cast), 2-4 bytes a token."""
    if t == 0:
        return [0]
    schedule = pick_schedule("dsrelu", False, schedule, tile)
    bn = (tuple(tile) if tile is not None else pick_tile(n, schedule))[1]
    return [t * n * itemsize, -(-n // bn) * t * 4]
