"""Torch entry points for the Hopper grouped GEMM kernels, and the cache, compile and launch
machinery every entry point shares (the weight gradients' entry points: :mod:`.api_wgrad`; FP8's:
:mod:`.api_fp8`, :mod:`.api_fp8_wgrad`).

All entry points take plain torch tensors, allocate their outputs, never read
``split_sizes`` on the host (no device sync) and launch on the current CUDA
stream.  Compiled kernels are cached per
``(dtype, tile, cluster, epilogue, N, K, E, B major, wgrad M, schedule, call convention)``, with
the main_grad slot stride (``tma`` add) or the weights' layout (padded or reversed experts) before
the call convention where they differ from the default; the first call of a key in a process loads
it from the disk cache (:mod:`.disk_cache`, see :func:`load_times`) or compiles it (see
:func:`compile_times`) and writes it there. A TVM-FFI kernel loaded from a shared object is
launched from its plan (:mod:`.gemm_plan`): such a process never imports the CuTe DSL.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time

import torch

from ..capture import GraphCaptureError, capturing, warm_up_hint
from . import disk_cache, dsl, dsl_settings
from .gemm_plan import MAIN_GRAD_EPILOGUES, GemmPlan

_log = logging.getLogger(__name__)

_CACHE: dict = {}
_COMPILE_SECONDS: dict = {}
_LOAD_SECONDS: dict = {}
_LOADED_BY: dict = {}
_FIRST_LAUNCH_SECONDS: dict = {}
_LOCK = threading.Lock()


def _cutlass():
    cutlass, cute = dsl.load()
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    return cutlass, cute, make_ptr, make_fake_stream


def unavailable_reasons() -> list[str]:
    """Why the kernels cannot be compiled in this process (empty: they can).

    Checks that the CuTe DSL and its CUDA driver bindings import; the GPU
    itself is the fusion selector's business."""
    reasons = []
    try:
        _cutlass()
    except Exception as exc:  # any import failure of the DSL stack
        reasons.append(f"the CuTe DSL (nvidia-cutlass-dsl) does not import: {exc}")
    try:
        import cuda.bindings.driver  # noqa: F401
    except Exception as exc:
        reasons.append(f"cuda-python driver bindings do not import: {exc}")
    return reasons


def loads_without_dsl() -> bool:
    """Whether this process may take the kernels' availability as given without importing the
    CuTe DSL: kernels are called through TVM-FFI (installed), the disk cache is on, the DSL is
    installed, and the cache directory holds the DSL's settings for this process's context, which
    only a process of this context that imported the DSL leaves there. Kernels the cache holds
    as shared objects then load without the DSL; any other is compiled, importing it (as it did
    there)."""
    try:
        if not disk_cache.enabled() or kernel_call_convention() != "tvm-ffi":
            return False
    except (ValueError, RuntimeError):  # a bad setting: the full check (and the call) will say so
        return False
    import importlib.util

    if importlib.util.find_spec("cutlass") is None:
        return False
    return dsl_settings.recall(disk_cache.cache_dir()) is not None


CALL_ENV = "TEO_KERNEL_CALL"  # "tvm-ffi" or "python": how compiled kernels are called
CALLS = ("tvm-ffi", "python")


@functools.lru_cache(maxsize=None)
def _has_tvm_ffi() -> bool:
    import importlib.util

    return importlib.util.find_spec("tvm_ffi") is not None


# why the TVM-FFI convention, picked by default, failed to compile (then "python" is used)
_TVM_FFI_FAILED: list[str] = []


def kernel_call_convention() -> str:
    """How compiled kernels are called: "tvm-ffi" (the CuTe DSL's TVM-FFI convention: raw
    pointers and ints cross one C call) where apache-tvm-ffi is installed and compiles, else
    "python" (the DSL's Python executor, which costs more host time a call);
    $TEO_KERNEL_CALL picks, and then a failure is not papered over."""
    choice = os.environ.get(CALL_ENV)
    if not choice:
        return "tvm-ffi" if _has_tvm_ffi() and not _TVM_FFI_FAILED else "python"
    if choice not in CALLS:
        raise ValueError(f"{CALL_ENV} must be one of {CALLS}, got {choice!r}")
    if choice == "tvm-ffi" and not _has_tvm_ffi():
        raise RuntimeError(f"{CALL_ENV}=tvm-ffi, but apache-tvm-ffi is not installed")
    return choice


def _cutlass_dtype(dtype: torch.dtype):
    cutlass = _cutlass()[0]
    if dtype == torch.bfloat16:
        return cutlass.BFloat16
    if dtype == torch.float16:
        return cutlass.Float16
    raise TypeError(f"grouped GEMM supports bf16 and fp16, got {dtype}")


SCHEDULE_ENV = "TEO_GEMM_SCHEDULE"  # "cooperative" or "pingpong": overrides pick_schedule
SCHEDULES = ("cooperative", "pingpong")
# per GEMM kind, the faster schedule on H100 (benchmarks/results/bench_kernels*, both
# schedules timed interleaved): pingpong hides the epilogue behind the other warpgroup's
# MMAs; the wgrads have no epilogue work to hide and keep the wider cooperative tile
_DEFAULT_SCHEDULE = {"plain": "pingpong", "srelu": "pingpong", "dsrelu": "pingpong",
                     "wgrad": "cooperative",
                     # the fp32 main_grad add is epilogue work worth hiding (measured: pingpong
                     # 1.093x / 1.075x the plain fused op with rmw / red, cooperative 1.108x / 1.084x)
                     "wgrad_main_grad": "pingpong"}


def pick_schedule(epilogue: str, wgrad: bool = False, schedule: str | None = None, tile=None) -> str:
    """The argument, else $TEO_GEMM_SCHEDULE, else the measured default for this GEMM kind;
    the latter two give way to cooperative for a given tile wider than pingpong's 128 columns."""
    choice = schedule
    if not choice:  # a preference (env or default) yields to a tile too wide for pingpong
        kind = "wgrad_main_grad" if epilogue in MAIN_GRAD_EPILOGUES else "wgrad" if wgrad else epilogue
        choice = os.environ.get(SCHEDULE_ENV) or _DEFAULT_SCHEDULE[kind]
        if choice == "pingpong" and tile is not None and tile[1] > 128:
            choice = "cooperative"
    if choice not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {choice!r}")
    return choice


def pick_tile(n: int, schedule: str = "cooperative") -> tuple[int, int]:
    """(BM, BN): the BN among 256/192/128 with the least padding of the last
    n-block (ties go to the larger BN); 64 only when N <= 64.  Pingpong keeps
    a whole 128 x BN accumulator per warpgroup: BN 128."""
    if n <= 64:
        return (128, 64)
    if schedule == "pingpong":
        return (128, 128)
    best = max((n / (-(-n // bn) * bn), bn) for bn in (256, 192, 128))
    return (128, best[1])


CLUSTER_ENV = "TEO_GEMM_CLUSTER_N"  # "1" turns off the 2-CTA A multicast (for comparisons)


def pick_cluster(n: int, tile) -> int:
    """2 (A multicast over a CTA pair) when there are at least two n-blocks, else 1 (a pair
    would always straddle two m-blocks and share nothing); TEO_GEMM_CLUSTER_N=1 forces 1.
    With an odd n-block count one pair in n_tiles straddles and loads A unshared."""
    if os.environ.get(CLUSTER_ENV, "") == "1":
        return 1
    return 2 if -(-n // tile[1]) >= 2 else 1


CLUSTER_M_ENV = "TEO_GEMM_CLUSTER_M"  # "2": 2 x 2 clusters for every GEMM that has two n-blocks (opt-in)


def pick_cluster_m(wgrad_m, n: int, tile, cluster_n: int) -> int:
    """2 (2 x 2 clusters: B multicast over m-block pairs as well as A over n-block pairs) when
    TEO_GEMM_CLUSTER_M=2, for GEMMs with at least two n-blocks (and, for a weight gradient, two
    m-blocks), else 1. Opt-in: the GEMMs are bound by L2 sectors (Nsight Compute) and this cuts
    their operand reads by about a quarter, but phantom tiles where a block count is odd (and, in
    the forward form, a whole B load where an m-pair straddles two experts) make it slower than the
    pair in every GEMM on an H100 (benchmarks/results/cluster2x2_*). A value other than 1 or 2
    raises for every GEMM (it names them all)."""
    want = os.environ.get(CLUSTER_M_ENV, "") or "1"
    if want not in ("1", "2"):
        raise ValueError(f"{CLUSTER_M_ENV} must be 1 or 2, got {want!r}")
    if want == "1" or cluster_n != 2:
        return 1
    if wgrad_m is not None and -(-wgrad_m // tile[0]) < 2:  # one m-block: no m-pair to share B
        return 1
    return 2 if -(-n // tile[1]) >= 2 else 1


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
    cutlass_dtype = _cutlass_dtype(dtype)
    from .gemm_sm90 import GroupedGemmSm90

    return (kernel_class or GroupedGemmSm90)(
        cutlass_dtype, n, k, e, **_variant_kwargs(b_n_major, epilogue, tile, cluster_n, wgrad_m, schedule, epi_cols,
                                                  slot_stride, b_layout, cluster_m))


def _make_plan(dtype: torch.dtype, n: int, k: int, e: int, b_n_major: bool, epilogue: str, tile, *,
               cluster_n: int = 1, wgrad_m: int | None = None, schedule: str = "cooperative",
               slot_stride: int | None = None, b_layout: tuple = (None, False), cluster_m: int = 1) -> GemmPlan:
    """The plan of one variant, as its kernel object derives it, without the DSL."""
    if dtype not in _DTYPES:
        raise TypeError(f"grouped GEMM supports bf16 and fp16, got {dtype}")
    return GemmPlan(dtype.itemsize, n, k, e, **_variant_kwargs(b_n_major, epilogue, tile, cluster_n, wgrad_m,
                                                               schedule, None, slot_stride, b_layout, cluster_m))


_RUNTIME_ATTRS = ("call", "launched", "cache_key")  # set on a kernel object after it is built


def _kernel_params(kern) -> tuple:
    """A plan's plain parameters (tile, stages, epilogue chunking, ...), for the disk cache's key:
    what :class:`~.gemm_plan.GemmPlan` derives (a kernel object is a plan), so a variant built
    differently (a constant of the plan module changed at run time, say) never loads another's
    code."""
    plain = (bool, int, float, str, type(None))
    return tuple(sorted(
        (name, value) for name, value in vars(kern).items()
        if name not in _RUNTIME_ATTRS and (isinstance(value, plain) or (
            isinstance(value, tuple) and all(isinstance(v, plain) for v in value)))))


def _compile(
    dtype: torch.dtype, n: int, k: int, e: int, b_n_major: bool, epilogue: str, tile,
    options: str | None = None, cluster_n: int = 1, wgrad_m: int | None = None,
    schedule: str = "cooperative", epi_cols: int | None = None, kernel_class=None,
    call: str = "python", slot_stride: int | None = None, b_layout: tuple = (None, False),
    cluster_m: int = 1,
):
    cutlass, cute, make_ptr, make_fake_stream = _cutlass()

    dt = _cutlass_dtype(dtype)
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
    return compile_timed(kern, [*args, cutlass.Int32(1), cutlass.Int32(1), make_fake_stream()], call, options)


def compile_timed(kern, args: list, call: str, options: str | None):
    """(kernel object, compiled, seconds) of ``cute.compile(kern, *args)`` under the call
    convention ``call`` ("tvm-ffi" adds its compile option), ``options`` passed on; the kernel
    object records the convention, which tells its launch how to pass the arguments."""
    _, cute, _, _ = _cutlass()
    if call == "tvm-ffi":
        options = f"{options} --enable-tvm-ffi" if options else "--enable-tvm-ffi"
    kern.call = call
    extra = {"options": options} if options else {}
    t0 = time.perf_counter()
    compiled = cute.compile(kern, *args, **extra)
    return kern, compiled, time.perf_counter() - t0


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
    return cached_kernel(key, lambda key, call: _load_or_compile(key, call, *variant))


def cached_kernel(key: tuple, load):
    """(kernel, compiled) of the variant ``key`` (its last element the call convention): from the
    in-memory cache, else ``load(key, call)`` (the disk cache or a compile), once per process.

    Where the TVM-FFI call path fails to compile (an apache-tvm-ffi the DSL cannot use) and no
    call convention was asked for, the Python executor compiles the same kernel instead, from then
    on (a broken kernel raises there again). A first call inside a CUDA graph capture raises."""
    hit = _CACHE.get(key)
    if hit is None and capturing():
        raise GraphCaptureError(_first_call_in_capture(key))
    if hit is None:
        with _LOCK:
            hit = _CACHE.get(key)
            if hit is None:
                call = key[-1]
                try:
                    kern, compiled = load(key, call)
                except Exception as exc:
                    if call != "tvm-ffi" or os.environ.get(CALL_ENV):
                        raise
                    key = key[:-1] + ("python",)
                    kern, compiled = load(key, "python")
                    _TVM_FFI_FAILED.append(repr(exc)[:300])
                    _log.warning("the TVM-FFI kernel call path failed to compile (%s); using the "
                                 "CuTe DSL's Python executor", _TVM_FFI_FAILED[-1])
                kern.cache_key = key  # named in errors
                hit = _CACHE[key] = (kern, compiled)
    return hit


def _load_or_compile(key: tuple, call: str, args: tuple, variant: dict):
    """(kernel object, compiled kernel) of one variant: loaded from the disk cache where it holds
    the variant, else compiled (and written there). One process at a time compiles a variant
    that several want at once; the others load what it wrote."""
    if not disk_cache.enabled():
        return _compile_now(key, call, args, variant)
    plan = _make_plan(*args, **variant)
    entry = disk_cache.Entry(key, _kernel_params(plan), call)
    with entry.claim():
        compiled = entry.load()
        if compiled is None:
            kern, compiled = _compile_now(key, call, args, variant)
            # the key again, with the settings the DSL states now that it is imported: where those
            # recalled for this context were stale, the kernel goes under its true key
            disk_cache.Entry(key, _kernel_params(kern), call).store(compiled)
            return kern, compiled
    # the TVM-FFI launch needs the plan alone; the Python executor's, the DSL's types as well
    kern = plan if call == "tvm-ffi" else _make_kernel(*args, **variant)
    kern.call = call  # how _launch passes the arguments
    _LOAD_SECONDS[key] = disk_cache.LOADED[entry.name]
    _LOADED_BY[key] = disk_cache.LOADED_BY[entry.name]
    _log.info("loaded grouped GEMM %s from %s (%s) in %.3f s", key, entry.path, _LOADED_BY[key],
              _LOAD_SECONDS[key])
    return kern, compiled


def _compile_now(key: tuple, call: str, args: tuple, variant: dict):
    kern, compiled, secs = _compile(*args, call=call, **variant)
    _COMPILE_SECONDS[key] = secs
    _log.info("compiled grouped GEMM %s in %.2f s", key, secs)
    return kern, compiled


def _first_call_in_capture(key) -> str:
    return (f"grouped GEMM kernel {key} would be compiled and loaded on its first call, inside a CUDA graph "
            f"capture, where compiling and loading a module are not allowed; {warm_up_hint()}")


def compile_times() -> dict:
    """{cache key: first-call compile seconds} for every kernel this process compiled."""
    return dict(_COMPILE_SECONDS)


def load_times() -> dict:
    """{cache key: seconds} for every kernel this process loaded from the disk cache instead."""
    return dict(_LOAD_SECONDS)


def loaded_by() -> dict:
    """{cache key: "shared object" (through tvm_ffi, no DSL) or "CuTe DSL"} for every kernel this
    process loaded from the disk cache."""
    return dict(_LOADED_BY)


def first_launch_times() -> dict:
    """{cache key: host seconds} of the first launch of each kernel this process launched: the
    launch that loads the kernel's code onto the GPU."""
    return dict(_FIRST_LAUNCH_SECONDS)


def dsl_import_seconds() -> float:
    """Seconds this process spent importing the CuTe DSL for the kernels (0.0: it did not)."""
    return dsl.import_seconds()


def clear_cache() -> None:
    """Forget the kernels of this process (the disk cache stays: see :mod:`.disk_cache`)."""
    with _LOCK:
        _CACHE.clear()
        _COMPILE_SECONDS.clear()
        _LOAD_SECONDS.clear()
        _LOADED_BY.clear()
        _FIRST_LAUNCH_SECONDS.clear()


def _aligned(t: torch.Tensor, align: int = 16) -> torch.Tensor:
    t = t.contiguous()
    if t.data_ptr() % align:
        t = t.clone()
    return t


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def stream_handle(device_index: int) -> int:
    """The current CUDA stream of ``device_index`` as the driver's handle (the capturing stream
    while a graph is captured): the launch goes there. torch's raw-stream query where it has one
    (a launch's host time matters: the fused MLP launches a dozen kernels per step), else the
    public path."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


@functools.lru_cache(maxsize=None)
def _cluster_slots(device_index: int, cluster_size: int) -> int:
    """CTAs of a persistent grid of clusters that all run at once (one CTA per SM). Pairs fit
    every SM pair; a cluster of 4 must sit in one GPC, whose SM count need not divide by 4, so
    the driver's occupancy query decides (a cluster left waiting would run after the others)."""
    sms = _sm_count(device_index)
    if cluster_size <= 2:
        return sms // cluster_size * cluster_size
    dsl.load()
    from cutlass.utils import HardwareInfo

    with _LOCK, torch.cuda.device(device_index):  # the query compiles and loads a probe kernel
        torch.cuda.current_stream(device_index)  # the device's context is current from here
        try:
            clusters = HardwareInfo(device_index).get_max_active_clusters(cluster_size)
        except Exception as exc:  # no answer: the count a GPC-blind grid would take, said so
            _log.warning("could not ask the driver how many clusters of %d fit (%r); using %d",
                         cluster_size, exc, sms // cluster_size)
            clusters = sms // cluster_size
    if clusters < 1:
        raise RuntimeError(f"the driver says no cluster of {cluster_size} CTAs of this kernel's size fits on "
                           f"device {device_index}; unset {CLUSTER_M_ENV}")
    return min(clusters, sms // cluster_size) * cluster_size


PROFILE_LABEL = "te_offload_ops.gemm"


def profile_label(kern) -> str:
    """The profiler range around a launch of ``kern``: the profiler cuts the DSL's kernel names
    to one prefix for every GEMM, so the range names which (epilogue, wgrad, N x K) it was."""
    kind = "wgrad" if getattr(kern, "wgrad_m", None) is not None else "gemm"
    return f"{PROFILE_LABEL}[{kind} {getattr(kern, 'epilogue', '?')} n={kern.n} k={kern.k}]"


def _launch(kern, compiled, tensors, num_tokens):
    if torch.autograd._profiler_enabled():  # a range per launch, only while a profiler records
        with torch.profiler.record_function(profile_label(kern)):
            _launch_now(kern, compiled, tensors, num_tokens)
        return
    _launch_now(kern, compiled, tensors, num_tokens)


def _launch_now(kern, compiled, tensors, num_tokens):
    if not getattr(kern, "launched", False) and capturing():  # the first call loads the module
        raise GraphCaptureError(_first_call_in_capture(getattr(kern, "cache_key", type(kern).__name__)))
    # persistent grid: one CTA per SM at most, and no more CTAs than a bound
    # of the tile count that needs no split sizes on the host
    if kern.wgrad_m is not None:  # static tiles: E times the (M, N) blocks
        tile_bound = kern.num_experts * kern.wgrad_tiles
    else:
        m_bound = -(-num_tokens // kern.bm) + kern.num_experts
        if getattr(kern, "cluster_m", 1) > 1:  # (m-pair, n-pair) groups of four
            tile_bound = -(-m_bound // 2) * kern.n_pairs * kern.cluster_size
        else:
            tile_bound = m_bound * kern.n_tiles
    cn = getattr(kern, "cluster_size", kern.cluster_n)
    num_ctas = min(_cluster_slots(tensors[0][0].device.index, cn), -(-tile_bound // cn) * cn)
    # the capturing stream when a graph is captured: the launch becomes a node of the graph
    stream = stream_handle(tensors[0][0].device.index)
    if getattr(kern, "launched", False):
        _call(kern, compiled, tensors, num_tokens, num_ctas, stream)
        return
    kern.launched = True
    t0 = time.perf_counter()
    _call(kern, compiled, tensors, num_tokens, num_ctas, stream)
    _FIRST_LAUNCH_SECONDS[getattr(kern, "cache_key", None) or type(kern).__name__] = time.perf_counter() - t0


def _call(kern, compiled, tensors, num_tokens: int, num_ctas: int, stream: int) -> None:
    if getattr(kern, "call", "python") == "tvm-ffi":  # addresses, ints and the stream handle
        compiled(*(t.data_ptr() for t, _ in tensors), num_tokens, num_ctas, stream)
        return
    dt = kern.dtype
    cutlass, cute, make_ptr, _ = _cutlass()
    import cuda.bindings.driver as cuda

    gmem = cute.AddressSpace.gmem
    ptrs = []
    for t, kind in tensors:
        if kind == "i32":
            ptrs.append(make_ptr(cutlass.Int32, t.data_ptr(), gmem, assumed_align=4))
        elif kind == "f32":
            ptrs.append(make_ptr(cutlass.Float32, t.data_ptr(), gmem, assumed_align=4))
        elif kind == "i64":
            ptrs.append(make_ptr(cutlass.Int64, t.data_ptr(), gmem, assumed_align=8))
        elif kind == "vec":
            ptrs.append(make_ptr(dt, t.data_ptr(), gmem, assumed_align=2))
        else:
            ptrs.append(make_ptr(dt, t.data_ptr(), gmem, assumed_align=16))
    compiled(*ptrs, cutlass.Int32(num_tokens), cutlass.Int32(num_ctas), cuda.CUstream(stream))


_DTYPES = (torch.bfloat16, torch.float16)


def _check(a, b, split_sizes, b_n_major):
    """Host-side checks only: the split sizes' sum is not checked (that would sync). Rows past
    sum(split_sizes) are left unwritten; a sum past T never writes past T."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError("a and b must be torch tensors")
    if not isinstance(split_sizes, torch.Tensor) or split_sizes.is_floating_point():
        raise TypeError("split_sizes must be an integer torch tensor")
    if not (a.is_cuda and b.is_cuda) or a.device != b.device:
        raise ValueError(f"a and b must be on one CUDA device, got {a.device} and {b.device}")
    if a.dtype not in _DTYPES or b.dtype != a.dtype:
        raise TypeError(f"grouped GEMM takes bf16 or fp16 operands of one dtype, got {a.dtype} and {b.dtype}")
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError("a must be (T, K) and b (E, N, K) / (E, K, N)")
    e = b.shape[0]
    k = a.shape[1]
    kb = b.shape[2] if not b_n_major else b.shape[1]
    if kb != k:
        raise ValueError(f"K mismatch: a has {k}, b has {kb}")
    if split_sizes.numel() != e:
        raise ValueError(f"split_sizes must have one entry per expert: {e} experts, got {split_sizes.numel()} entries")
    n = b.shape[1] if not b_n_major else b.shape[2]
    _check_limits(a.shape[0], n)
    return e, n, k


_INT32_MAX = 2**31 - 1


def _check_limits(tokens: int, n: int) -> None:
    """What the kernels index with 32 bits: token rows, and the dSReLU partial sums (one fp32 per
    token and 128-column block). Element offsets into A, C, z and act are 64-bit, so operands
    past 2^31 elements are fine."""
    if tokens > _INT32_MAX:
        raise ValueError(f"the grouped GEMM takes at most {_INT32_MAX} token rows, got {tokens}")
    if tokens * -(-n // 64) > _INT32_MAX:
        raise ValueError(f"{tokens} tokens x {-(-n // 64)} column blocks of N={n} overflow the kernel's "
                         "32-bit dprobs partial-sum index; split the tokens into smaller calls")


def _splits_i32(split_sizes: torch.Tensor, device) -> torch.Tensor:
    s = split_sizes
    if s.device != device:
        s = s.to(device, non_blocking=True)
    if s.dtype != torch.int32:
        s = s.to(torch.int32)
    return s.contiguous()


def _expert_weights(b: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """``b`` as the kernel reads it, and the elements between experts (None: packed). Each expert's
    matrix must be row-contiguous; the experts may sit any whole number of 16-byte units apart
    (at least one matrix: a padded parameter buffer, as Megatron's), read in place. Anything else
    is copied into one packed tensor."""
    e, rows, cols = b.shape
    if (b.stride(2) == 1 and b.stride(1) == cols and b.stride(0) >= rows * cols and b.stride(0) % 8 == 0
            and b.data_ptr() % 16 == 0):
        return b, (None if b.stride(0) == rows * cols or e == 1 else b.stride(0))
    return _aligned(b), None


def _out(out, t, n, like, name):
    """``out`` checked as a kernel output of (t, n) like ``like`` (a fresh tensor where None)."""
    if out is None:
        return torch.empty(t, n, dtype=like.dtype, device=like.device)
    if not isinstance(out, torch.Tensor) or out.shape != (t, n) or out.dtype != like.dtype \
            or out.device != like.device or not out.is_contiguous() or out.data_ptr() % 16:
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}, contiguous={out.is_contiguous()}, "
               f"address % 16 = {out.data_ptr() % 16}") if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{name} must be a contiguous ({t}, {n}) {like.dtype} tensor on {like.device} at a "
                         f"16-byte aligned address, got {got}")
    return out


def grouped_gemm(a, b, split_sizes, *, trans_b=False, tile=None, schedule=None, reversed_experts=False, out=None):
    """c[rows of e] = a[rows of e] @ b[e].T  (b: (E, N, K)); with ``trans_b``
    b is (E, K, N) and c = a_e @ b[e].  Returns c (T, N) in a.dtype (written into ``out`` if given).

    ``reversed_experts``: b[j] holds expert E - 1 - j's weight (weights laid out in reverse
    expert order, read in place). The experts of b may be any multiple of 8 elements apart."""
    e, n, k = _check(a, b, split_sizes, trans_b)
    t = a.shape[0]
    c = _out(out, t, n, a, "out")
    if t == 0:
        return c
    b, b_stride = _expert_weights(b)
    kern, compiled = get_kernel(a.dtype, n, k, e, b_n_major=trans_b, epilogue="plain", tile=tile,
                                schedule=schedule, b_layout=(b_stride, reversed_experts))
    a = _aligned(a)
    s = _splits_i32(split_sizes, a.device)
    _launch(
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
    e, n, k = _check(x, w1, split_sizes, False)
    t = x.shape[0]
    act_out, z_out = (None, None) if out is None else out
    z = _out(z_out, t, n, x, "out z")
    act = _out(act_out, t, n, x, "out act")
    if t == 0:
        return act, z
    if probs.shape != (t,):
        raise ValueError("probs must be (T,)")
    w1, b_stride = _expert_weights(w1)
    kern, compiled = get_kernel(x.dtype, n, k, e, b_n_major=False, epilogue="srelu", tile=tile,
                                schedule=schedule, b_layout=(b_stride, reversed_experts))
    x = _aligned(x)
    p = probs.to(x.dtype).contiguous()
    s = _splits_i32(split_sizes, x.device)
    _launch(
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
    e, n, k = _check(dy, w2, split_sizes, True)
    t = dy.shape[0]
    dz = torch.empty(t, n, dtype=dy.dtype, device=dy.device)
    if t == 0:
        return dz, torch.zeros(0, dtype=probs.dtype, device=dy.device), torch.empty_like(dz)
    if z.shape != (t, n) or probs.shape != (t,):
        raise ValueError("z must be (T, N) and probs (T,)")
    w2, b_stride = _expert_weights(w2)
    kern, compiled = get_kernel(dy.dtype, n, k, e, b_n_major=True, epilogue="dsrelu", tile=tile,
                                schedule=schedule, b_layout=(b_stride, reversed_experts))
    dy, zc = _aligned(dy), _aligned(z.to(dy.dtype))
    act = zc if act_in_z else torch.empty_like(dz)
    p = probs.to(dy.dtype).contiguous()
    s = _splits_i32(split_sizes, dy.device)
    part = torch.empty(kern.n_tiles, t, dtype=torch.float32, device=dy.device)
    _launch(
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
