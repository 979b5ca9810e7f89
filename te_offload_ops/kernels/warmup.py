"""Compile ahead of a job the kernels the fused SReLU grouped MLP will use, into the disk cache.

    python -m te_offload_ops.kernels.warmup --num-experts 16 --hidden-size 2048 \\
        --ffn-hidden-size 1024 [--expert-model-parallel-size 2] [--megatron] [--tokens 8192] [--fp8] [--jobs 4]

Each variant is loaded if the disk cache holds it and compiled (and written there) if not; the
job's ranks then load every kernel in milliseconds. The variants are those the fused op launches
for these shapes: fc1 forward with SReLU, fc2 forward, fc2 dgrad with dSReLU, fc1 dgrad, and both
weight gradients (plain, or added into main_grad the way :func:`~.main_grads.main_grad_way` picks for the
tokens, or every way it can pick where ``tokens`` is not given); with ``--fp8``, those of the
``Float8BlockScaling`` path instead (the grouped FP8 GEMMs, the same wgrads, or the FP8 wgrad
kernels where ``TEO_FP8_WGRAD=fp8``).
``delay_wgrad_compute`` runs the same kernels later, so it needs nothing here. Without a GPU the
kernels compile for sm_90a (``CUTE_DSL_ARCH``); the entries then serve GPU machines whose CuTe DSL
is installed at the same path and picks the same CUDA flavour (the newest installed where no
driver is found; ``CUTE_DSL_LIBS`` sets it): the DSL's runtime library is part of the key.

Any process that runs the kernels also fills the cache: one step of the job itself warms exactly
what it uses, whatever its weight layout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import settings
from . import api, api_wgrad, availability, disk_cache, main_grads, registry

LAYOUTS = ("te", "megatron")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Variant:
    """One kernel of the fused MLP: what it computes, and :func:`~.api.get_kernel`'s arguments."""

    label: str
    kwargs: dict

    def describe(self, kern=None) -> str:
        """One line; with the kernel object, its schedule (picked where not given) too."""
        kw = self.kwargs
        n, k, e = kw["n"], kw["k"], kw["e"]
        if kw.get("fp8_wgrad"):
            return f"{self.label} (M={kw['m']} N={n}, {e} experts, FP8 e4m3 with 128-token scales, {kw['epilogue']})"
        if kw.get("fp8"):
            scales = ", power-of-two scales" if kw.get("pow2") else ""
            return f"{self.label} (N={n} K={k}, {e} experts, FP8 e4m3 with 1x128 / 128x128 scales{scales})"
        shape = f"M={kw['wgrad_m']} N={n}" if kw.get("wgrad_m") is not None else f"N={n} K={k}"
        schedule = getattr(kern, "schedule", None) or kw.get("schedule")
        return f"{self.label} ({shape}, {e} experts, {kw['epilogue']}{', ' + schedule if schedule else ''})"


def _b_layout(n: int, k: int, e: int, layout: str, stride: Optional[int]) -> tuple:
    """(stride or None, reversed) as the fused op passes an (E, N, K) weight to the kernels: read in
    place where the experts sit a multiple of 8 elements apart, else a packed copy (stride None);
    Megatron's DDP buffer holds a module's parameters last first."""
    reversed_experts = layout == "megatron" and e > 1
    step = n * k if stride is None else stride
    packed = e == 1 or step == n * k or step % 8 != 0
    return (None if packed else step), reversed_experts


def _slot_stride(n: int, k: int, e: int, stride: Optional[int]) -> Optional[int]:
    """The TMA add's main_grad slot stride for buffers laid out as the weights are, as
    :func:`~.main_grads.main_grad_slots` finds it from their addresses (None: not evenly spaced in 16 bytes)."""
    step = n * k if stride is None else stride
    base = 1 << 20
    found = main_grads.main_grad_slots([base + 4 * step * i for i in range(e)], n * k)
    return None if found is None else found[0]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def mlp_variants(num_experts: int, hidden_size: int, ffn_hidden_size: int, params_dtype=torch.bfloat16, *,
                 tokens: Optional[int] = None, main_grad: bool = False, overwrite_main_grad: bool = False,
                 weight_layout: str = "te", expert_stride: Optional[int] = None, fp8: bool = False) -> list[Variant]:
    """The kernel variants one fused SReLU MLP of these shapes launches in a forward and backward.

    ``num_experts``: experts of this rank's GroupedLinear. ``main_grad``: Megatron's gradient
    accumulation fusion (wgrads added into fp32 ``main_grad``; ``overwrite_main_grad`` stores
    instead). ``weight_layout``: "te" (TE's own parameters, or one grouped weight) or "megatron"
    (the DDP buffer: experts last first); ``expert_stride``: elements from one expert's weight to
    the next where the buffer pads them apart (default: packed). ``tokens``: rows the MLP sees per
    call on a rank (picks the main_grad add; None: every add it could pick). ``fp8``: under TE's
    ``Float8BlockScaling`` (:mod:`..fused.block_fp8`): the forward and dgrad GEMMs are the grouped
    FP8 kernel (three variants: fc1's forward with the quantizing SReLU epilogue, fc2's dgrad with
    the SReLU backward, and the plain one fc2's forward and fc1's dgrad share), the wgrads as in bf16."""
    if weight_layout not in LAYOUTS:
        raise ValueError(f"weight_layout must be one of {LAYOUTS}, got {weight_layout!r}")
    if params_dtype not in DTYPES.values():
        raise ValueError(f"params_dtype must be torch.bfloat16 or torch.float16, got {params_dtype}")
    for name, value in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("ffn_hidden_size", ffn_hidden_size)):
        if not _is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if hidden_size % 8 or ffn_hidden_size % 8:
        raise ValueError(f"hidden_size and ffn_hidden_size must be multiples of 8 (16-byte rows), got "
                         f"{hidden_size} and {ffn_hidden_size}")
    if fp8 and (hidden_size % 16 or ffn_hidden_size % 16):
        raise ValueError(f"the FP8 path needs hidden_size and ffn_hidden_size multiples of 16 (16-byte FP8 rows), "
                         f"got {hidden_size} and {ffn_hidden_size}")
    if tokens is not None and (not _is_int(tokens) or tokens <= 0):
        raise ValueError(f"tokens must be a positive integer or None, got {tokens!r}")
    if expert_stride is not None and (not _is_int(expert_stride) or expert_stride < hidden_size * ffn_hidden_size):
        raise ValueError(f"expert_stride must be an integer of at least hidden_size * ffn_hidden_size = "
                         f"{hidden_size * ffn_hidden_size} elements, or None, got {expert_stride!r}")
    e, h, f = num_experts, hidden_size, ffn_hidden_size
    base = dict(dtype=params_dtype, e=e)
    w1 = _b_layout(f, h, e, weight_layout, expert_stride)  # fc1 weight: (E, F, H)
    w2 = _b_layout(h, f, e, weight_layout, expert_stride)  # fc2 weight: (E, H, F)
    if fp8:  # B: each expert's FP8 weight (E, N, K), its 128x128 scales' rows padded to 4 as TE's
        out = [Variant(label, dict(base, fp8=True, n=n, k=k, sb_cols=-(-(-(-k // 128)) // 4) * 4))
               for label, n, k in (("fc1 forward, fc2 dgrad", f, h), ("fc2 forward, fc1 dgrad", h, f))]
        if settings.fp8_rows() == "gemm":  # SReLU and its backward in those GEMMs' epilogues
            # the scales' rounding of Float8BlockScaling's defaults (power-of-two unless TE is told otherwise)
            pow2 = os.environ.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") != "1"
            sb_cols = out[0].kwargs["sb_cols"]
            out[0] = Variant("fc2 forward, fc1 dgrad", out[1].kwargs)
            out[1:] = [Variant(label, dict(base, fp8=True, n=f, k=h, sb_cols=sb_cols, fp8_epilogue=epi, pow2=pow2))
                       for label, epi in (("fc1 forward + SReLU, quantized", "srelu_q"),
                                          ("fc2 dgrad + dSReLU, quantized", "dsrelu_q"))]
    else:
        out = [  # srelu_mlp's forward and backward, in launch order
            Variant("fc1 forward + SReLU", dict(base, n=f, k=h, b_n_major=False, epilogue="srelu", b_layout=w1)),
            Variant("fc2 forward", dict(base, n=h, k=f, b_n_major=False, epilogue="plain", b_layout=w2)),
            Variant("fc2 dgrad + dSReLU", dict(base, n=f, k=h, b_n_major=True, epilogue="dsrelu", b_layout=w2)),
            Variant("fc1 dgrad", dict(base, n=h, k=f, b_n_major=True, epilogue="plain", b_layout=w1)),
        ]
    # weight gradients dW = dy^T x: fc2's over (dy: H, act: F), fc1's over (dz: F, x: H)
    wgrads = [("fc2 wgrad", h, f), ("fc1 wgrad", f, h)]
    if fp8 and settings.fp8_wgrad() == "fp8":  # FP8 GEMMs on per-expert columnwise copies
        epilogue = "plain" if not main_grad else "store_f32" if overwrite_main_grad else "red_f32"
        return out + [Variant(label + (" into main_grad" if main_grad else ""),
                              dict(base, fp8_wgrad=True, m=rows, n=cols, k=0, epilogue=epilogue))
                      for label, rows, cols in wgrads]
    if not main_grad:
        if api_wgrad.wgrad_backend() == "cute":
            out += [Variant(label, dict(base, n=cols, k=0, b_n_major=True, epilogue="plain", wgrad_m=rows))
                    for label, rows, cols in wgrads]
        return out
    if overwrite_main_grad:
        ways = [("store_f32", None)]
    else:
        counts = [tokens] if tokens is not None else [
            e * main_grads.RMW_BELOW_TOKENS, e * main_grads.COOPERATIVE_BELOW_TOKENS, e]  # one per way it can pick
        ways = []
        for t in counts:
            add, schedule = main_grads.main_grad_way(t, e)
            if (main_grads.MAIN_GRAD_ADDS[add], schedule) not in ways:
                ways.append((main_grads.MAIN_GRAD_ADDS[add], schedule))
    for label, rows, cols in wgrads:
        slot = _slot_stride(rows, cols, e, expert_stride)
        for epilogue, schedule in ways:
            if epilogue == "tma_f32" and slot is None:  # buffers TMA cannot address as one array
                epilogue = main_grads.MAIN_GRAD_ADDS["red"]
            kw = dict(base, n=cols, k=0, b_n_major=True, epilogue=epilogue, wgrad_m=rows, schedule=schedule,
                      slot_stride=slot if epilogue == "tma_f32" else None)
            variant = Variant(f"{label} into main_grad", kw)
            if variant not in out:
                out.append(variant)
    return out


def _get(kwargs: dict):
    kw = dict(kwargs)
    if kw.pop("fp8_wgrad", False):
        from .api_fp8_wgrad import _get_kernel, pick_tile_fp8_wgrad

        out_dtype = kw["dtype"] if kw["epilogue"] == "plain" else torch.bfloat16  # as the launchers ask
        return _get_kernel(out_dtype, kw["m"], kw["n"], kw["e"], pick_tile_fp8_wgrad(kw["n"]), kw["epilogue"])
    if kw.pop("fp8", False):
        from .api_fp8 import get_kernel_fp8

        return get_kernel_fp8(kw["dtype"], kw["n"], kw["k"], kw["e"], kw["sb_cols"], None,
                              kw.get("fp8_epilogue", "plain"), kw.get("pow2", False))
    return api.get_kernel(kw.pop("dtype"), kw.pop("n"), kw.pop("k"), kw.pop("e"), **kw)


def _warm_one(variant: Variant) -> tuple[dict, str]:
    """(record, progress line's text) of one variant, loaded or compiled in this process."""
    t0 = time.perf_counter()
    kern, _ = _get(variant.kwargs)
    secs = time.perf_counter() - t0
    key = kern.cache_key
    how, took = registry.how_obtained(key)
    took = secs if took is None else took
    said = f"{variant.describe(kern)}: {how} in " + (f"{took:.2f} s" if took >= 0.1 else f"{took * 1e3:.1f} ms")
    return {"label": variant.label, "key": key, "how": how, "seconds": took}, said


def warm_up(num_experts: int, hidden_size: int, ffn_hidden_size: int, params_dtype=torch.bfloat16, *,
            tokens: Optional[int] = None, main_grad: bool = False, overwrite_main_grad: bool = False,
            weight_layout: str = "te", expert_stride: Optional[int] = None, fp8: bool = False,
            jobs: int = 1, progress: Optional[Callable[[str], None]] = print) -> list[dict]:
    """Load or compile (and write to the disk cache) every kernel :func:`mlp_variants` lists for
    these shapes and settings; ``progress`` gets one line per kernel. ``jobs`` > 1 compiles the
    variants in that many fresh processes at once (the disk cache lets one process at a time
    compile a variant; this process then holds none of them in memory). Returns one record per
    kernel, in :func:`mlp_variants`' order: its label, cache key, how it was had ("compiled",
    "loaded", or "in memory": the process had it already) and the seconds that took."""
    variants = mlp_variants(num_experts, hidden_size, ffn_hidden_size, params_dtype, tokens=tokens,
                            main_grad=main_grad, overwrite_main_grad=overwrite_main_grad,
                            weight_layout=weight_layout, expert_stride=expert_stride, fp8=fp8)
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    say = progress or (lambda line: None)
    n = len(variants)
    if jobs == 1 or n < 2:
        records = []
        for i, variant in enumerate(variants, 1):
            record, said = _warm_one(variant)
            records.append(record)
            say(f"[{i}/{n}] {said}")
        return records
    import concurrent.futures
    import multiprocessing

    # fresh interpreters: a fork would copy this process's CUDA and DSL state
    context = multiprocessing.get_context("spawn")
    records = [None] * n
    with concurrent.futures.ProcessPoolExecutor(min(jobs, n), mp_context=context) as pool:
        pending = {pool.submit(_warm_one, variant): i for i, variant in enumerate(variants)}
        for done, future in enumerate(concurrent.futures.as_completed(pending), 1):
            records[pending[future]], said = future.result()
            say(f"[{done}/{n}] {said}")
    return records


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m te_offload_ops.kernels.warmup", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-experts", type=int, required=True, help="experts of the MoE layer (all ranks together)")
    p.add_argument("--hidden-size", type=int, required=True)
    p.add_argument("--ffn-hidden-size", "--moe-ffn-hidden-size", dest="ffn_hidden_size", type=int, required=True,
                   help="each expert's FFN width")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks the experts are spread over (each runs num_experts / this)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="the experts' parameter dtype")
    p.add_argument("--tokens", type=int, default=None,
                   help="rows the experts of one rank see per micro-batch (about seq_length x micro_batch_size "
                        "x topk); picks the main_grad add. Default: every add it could pick")
    p.add_argument("--megatron", action="store_true",
                   help="Megatron-Core's settings: weights in its DDP buffer (--weight-layout megatron) and "
                        "gradient accumulation fusion (--main-grad) unless --no-main-grad")
    p.add_argument("--main-grad", action=argparse.BooleanOptionalAction, default=None,
                   help="weight gradients added into fp32 main_grad (Megatron's gradient_accumulation_fusion)")
    p.add_argument("--overwrite-main-grad", action="store_true", help="main_grad overwritten, not added to")
    p.add_argument("--weight-layout", choices=LAYOUTS, default=None,
                   help="te: TE's own parameters (default); megatron: Megatron's DDP buffer, experts last first")
    p.add_argument("--expert-stride", type=int, default=None,
                   help="elements between consecutive experts' weights where a buffer pads them apart")
    p.add_argument("--jobs", "-j", type=int, default=1,
                   help="processes compiling at once (default 1: each extra process spends seconds importing "
                        "torch, TE and the DSL and starting CUDA; at E=8, H=2688, F=1856 --fp8 on an H200 "
                        "machine five processes took longer than one)")
    p.add_argument("--fp8", action="store_true",
                   help="the kernels of the Float8BlockScaling path (Megatron's --fp8-recipe blockwise): the "
                        "grouped FP8 GEMMs and the wgrads")
    args = p.parse_args(argv)
    for name in ("num_experts", "hidden_size", "ffn_hidden_size", "expert_model_parallel_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.num_experts % args.expert_model_parallel_size:
        p.error(f"--num-experts={args.num_experts} is not a multiple of "
                f"--expert-model-parallel-size={args.expert_model_parallel_size}")
    if args.jobs < 1:
        p.error(f"--jobs must be positive, got {args.jobs}")
    if args.main_grad is None:
        args.main_grad = args.megatron
    if args.weight_layout is None:
        args.weight_layout = "megatron" if args.megatron else "te"
    if args.overwrite_main_grad and not args.main_grad:
        p.error("--overwrite-main-grad goes with --main-grad")
    return p, args


def main(argv=None) -> int:
    p, args = _parse(argv)
    local = args.num_experts // args.expert_model_parallel_size
    settings = dict(tokens=args.tokens, main_grad=args.main_grad, overwrite_main_grad=args.overwrite_main_grad,
                    weight_layout=args.weight_layout, expert_stride=args.expert_stride, fp8=args.fp8)
    try:
        n_kernels = len(mlp_variants(local, args.hidden_size, args.ffn_hidden_size, DTYPES[args.dtype],
                                     **settings))  # checks them
        if not disk_cache.enabled():
            print(f"{disk_cache.CACHE_ENV}=0: the disk cache is off, so nothing compiled here would be kept; "
                  f"unset it (or set it to 1) to warm up", file=sys.stderr)
            return 2
    except ValueError as exc:
        p.error(str(exc))
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        if cap != (9, 0):
            print(f"the fused kernels run on sm_90 GPUs (H100/H200); this GPU is sm_{cap[0]}{cap[1]}",
                  file=sys.stderr)
            return 2
    elif not os.environ.get("CUTE_DSL_ARCH"):
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"  # read when the DSL is imported, below
        print("no GPU: compiling for sm_90a (CUTE_DSL_ARCH=sm_90a)")
    reasons = availability.unavailable_reasons()
    if reasons:
        print("cannot compile the kernels: " + "; ".join(reasons), file=sys.stderr)
        return 2
    where = disk_cache.cache_dir()
    print(f"warming up the fused SReLU MLP's kernels: {local} experts per rank, hidden {args.hidden_size}, "
          f"ffn {args.ffn_hidden_size}, {args.dtype}, weights {args.weight_layout}, "
          f"main_grad {'overwrite' if args.overwrite_main_grad else 'add' if args.main_grad else 'off'}"
          f"{', FP8 block scaling' if args.fp8 else ''}; "
          f"cache {where}; {min(args.jobs, n_kernels)} process{'es' if min(args.jobs, n_kernels) > 1 else ''}",
          flush=True)
    t0 = time.perf_counter()
    records = warm_up(local, args.hidden_size, args.ffn_hidden_size, DTYPES[args.dtype], **settings,
                      jobs=args.jobs, progress=lambda line: print(line, flush=True))
    counts = {how: sum(r["how"] == how for r in records) for how in ("compiled", "loaded")}
    print(f"{len(records)} kernels in {time.perf_counter() - t0:.1f} s: {counts['compiled']} compiled and written, "
          f"{counts['loaded']} already in {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
