#!/usr/bin/env python3
"""Megatron-Core GPT-MoE training steps: stock TE experts against ours, Megatron's offloading
against teo, at expert parallelism 1 and 2; and ours' first-step numerics against stock.

The model (``benchmarks/megatron_gpt_model.py``): Megatron's GPTModel from its Transformer Engine
layer spec, every layer an MoE layer (squared-ReLU experts on TE's op fuser, alltoall dispatcher,
fused permute), bf16, Megatron's DDP (fp32 grads, overlapped reduce) with the distributed Adam,
trained by ``get_forward_backward_func()`` over the micro-batches, then ``optimizer.step()``;
random tokens. Defaults: 4 layers, H=2048, 16 heads, 16 experts top-4, F=1408, vocab 32768,
2 micro-batches x 4 x 2048 tokens per rank. Every variant at every EP runs as a job of its own
processes (``torchrun --nproc-per-node EP`` of this script; ``benchmarks/megatron_gpt_jobs.py``),
so no variant's memory, hooks or global state reach another; each starts from the same weights
(a stock model's, initialised from ``--seed``). Variants (``--variants``):

* ``stock``: Megatron's TEGroupedMLP on TE's op fuser (TE's ops; on Hopper in bf16 they run unfused);
* ``ours``: ``use_te_offload_ops`` (the fused Hopper op);
* ``ours+megatron``: ours under Megatron's fine-grained offloading of ``--offload-modules``
  (default expert_fc1,moe_act; Megatron keeps the last layer's group on the GPU);
* ``ours+teo``: ours with the routed experts of the first L-1 layers under teo
  (``use_teo_offload(scope="experts")``: what Megatron's choice moves), ``--teo-budget-gib`` its budget;
* ``ours+teo-ahead``: ``ours+teo`` with its reloads started ``--teo-reload-ahead`` layers (default
  1) before the peak-neutral point (``reload_ahead``: less waiting in backward for a higher peak);
* ``ours+teo-layer``: whole transformer layers 1..L-1 under teo (``scope="layer"``);
* ``stock+megatron``: stock under Megatron's "fused_group_mlp" offloading (the only choice its
  op-fuser path takes; not in the default);
* ``ours+copies``: ours with the bytes ``ours+teo`` moves copied each way on side streams and no
  engine (nothing saved, freed or waited for; two scratch buffers add to its peak): what the
  copies alone cost the step (not in the default); ``ours+copies-paced``: the same copies fed in
  16 MiB pieces by a host thread per direction, one piece queued at a time (what a small copy the
  dispatcher queues behind them waits for is one piece);
* ``--cuda-graphs attn,moe_router,moe_preprocess``: every timed variant with Megatron's per-layer
  CUDA graphs of those modules, captured after the warm-up as Megatron's trainer captures them
  (the experts stay eager); ``--cuda-graphs attn,moe --capacity-factor F`` graphs whole MoE layers,
  experts included, under Megatron's drop-and-pad MoE (each expert's input padded to its capacity:
  static shapes); the numerics and cap jobs run eager, the numerics job with every token kept;
* a ``+kdtoh`` suffix on an offloading variant adds ``use_kernel_dtoh`` (the dispatcher's split
  sizes to the host by kernel, past the copy engine's queue of offload copies);
* a ``+wc`` suffix on a teo or ``ours+copies`` variant puts teo's host buffers in write-combined
  pinned memory (``TEO_HOST_MEMORY=write-combined`` in its processes), e.g. ``ours+teo-ahead+wc``;
  without it they take pinned memory, whatever $TEO_HOST_MEMORY says;
* a last suffix ``+fp8block``, ``+fp8current`` or ``+fp8delayed`` runs the variant under that FP8
  recipe (Megatron's ``fp8="e4m3", fp8_recipe="blockwise"``; ``"hybrid"`` with ``"tensorwise"`` or
  ``"delayed"``; the router pads each expert's tokens for them, unless ``moe_preprocess`` is
  graphed or ``--capacity-factor`` fixes the capacities; not with ``--cuda-graphs moe``), e.g.
  ``ours+fp8block,ours+teo+fp8block,stock+fp8current``; such a row compares with ours (and its
  loss with stock) at the same precision, and a table sets each against its bf16 variant.
  ``stock+fp8block`` needs TE's block-scaled grouped GEMM (cuBLASLt >= 13.6 on Hopper; refused up
  front without it).

``--repeats N`` runs each variant's timing job N times, in rounds through the variants (a slow
spell of the host falls on every variant alike); a row is the run with the median step, and the
report lists every run's step and, round by round, the step against ours' in the same round.

Per variant and EP: median step time (the slowest rank's), tokens/s over all ranks, peak memory
allocated, the floor held between steps (weights, grads, optimizer state) and the peak above it,
memory freed against ours (ours' peak above its floor less the variant's), bytes offloaded per
step per rank, and the first step's loss (offloading variants: equal to ours' bitwise).

Then, per EP, one numerics job (``benchmarks/megatron_gpt_numerics.py``; ``--no-numerics`` skips
it): the first step of ours against stock from the same weights and tokens, with routing set
apart: the first MoE layer's input and routing (the same, bitwise), stock's routing replayed into
ours (our kernels' rounding alone), each with its own routing against a noise floor measured as
stock with noise of ours' size on every MoE layer's output, and per layer the tokens routed
otherwise.

Targets checked: ours at EP=2 at least 1.7x stock's step; each offloading variant at EP=2 within
3% of ours' step; teo freeing at least what Megatron's offloading frees at no more step time, and
fitting more tokens under a cap (predicted from the peaks, and measured with ``--cap-gib``, each
trial a job of its own); the numerics bounds (megatron_gpt_numerics.checks). ``--profile`` adds,
per variant, two steps under torch.profiler: where the offload copies meet NCCL's kernels and the
dispatcher's copies (``benchmarks/comm_copy_overlap.py``), and why the compute stream sat idle
(``benchmarks/step_profile.py``: the host not yet launching, or a wait on another stream). Writes
megatron_gpt_<GPU>.{json,md,png} into ``--out`` (the report: ``benchmarks/megatron_gpt_report.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from bench_common import file_stem, refuse, utc_now, write_reports  # noqa: E402
import megatron_gpt_jobs as jobs  # noqa: E402
from megatron_gpt_model import (EXPERT_OFFLOAD_CHOICES, PRECISIONS, GPTShape, Variant,  # noqa: E402
                                split_precision, worker_env)
from megatron_gpt_report import (  # noqa: E402
    add_comparisons, cap_targets, chart, function_label, markdown, merge_variant, targets,
)

BASE_VARIANTS = ("stock", "ours", "ours+megatron", "ours+teo", "ours+teo-ahead", "ours+teo-layer", "stock+megatron",
                 "ours+copies", "ours+copies-paced")
KERNEL_DTOH_SUFFIX = "+kdtoh"
WRITE_COMBINED_SUFFIX = "+wc"  # teo's host buffers in write-combined pinned memory
PACED_PIECE_MIB = 16  # ours+copies-paced: at ~55 GB/s a piece takes 0.3 ms (copy_interference_NVIDIA_H200*)
DEFAULT_VARIANTS = "stock,ours,ours+megatron,ours+teo"
JOBS = ("time", "numerics", "cap")  # what one job of a worker does
GRAPH_MODULES = ("attn", "moe_router", "moe_preprocess", "moe")  # moe: the whole MoE layer, drop-and-pad only


def variant_for(name: str, layers: int, offload_modules: tuple, teo_budget_gib=None, cuda_graphs: tuple = (),
                teo_reload_ahead: int = 1, capacity_factor: float | None = None) -> Variant:
    """The Variant a variant name stands for (ValueError for unknown names); ``cuda_graphs``: the
    per-layer CUDA graph modules every variant of the run takes; ``capacity_factor``: Megatron's
    drop-and-pad MoE for every variant (None: every routed token kept)."""
    plain, precision = split_precision(name)
    plain, wc = (plain[:-len(WRITE_COMBINED_SUFFIX)], True) if plain.endswith(WRITE_COMBINED_SUFFIX) else (plain, False)
    base, kdtoh = (plain[:-len(KERNEL_DTOH_SUFFIX)], True) if plain.endswith(KERNEL_DTOH_SUFFIX) else (plain, False)
    teo = dict(teo_layers=layers - 1, teo_budget_gib=teo_budget_gib)
    table = {
        "stock": Variant(ours=False),
        "ours": Variant(ours=True),
        "ours+megatron": Variant(ours=True, offload_modules=tuple(offload_modules)),
        "ours+teo": Variant(ours=True, teo_scope="experts", **teo),
        "ours+teo-ahead": Variant(ours=True, teo_scope="experts", teo_reload_ahead=teo_reload_ahead, **teo),
        "ours+teo-layer": Variant(ours=True, teo_scope="layer", **teo),
        "stock+megatron": Variant(ours=False, offload_modules=("fused_group_mlp",)),
        "ours+copies": Variant(ours=True, copy_traffic=True),
        "ours+copies-paced": Variant(ours=True, copy_traffic=True, copy_piece_mib=PACED_PIECE_MIB),
    }
    if base not in table:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(BASE_VARIANTS)} "
                         f"(an offloading one may end in {KERNEL_DTOH_SUFFIX}, then a teo or copies one in "
                         f"{WRITE_COMBINED_SUFFIX}; any may then end in one of "
                         f"{', '.join(PRECISIONS)})")
    found = table[base]
    if kdtoh and not (found.offload_modules or found.teo_scope or found.copy_traffic):
        raise ValueError(f"{name}: {KERNEL_DTOH_SUFFIX} is for variants that offload")
    if wc and not (found.teo_scope or found.copy_traffic):
        raise ValueError(f"{name}: {WRITE_COMBINED_SUFFIX} is for teo's variants and ours+copies (teo's host memory)")
    fp8, fp8_recipe = PRECISIONS.get(precision, (None, None))
    return replace(found, kernel_dtoh=kdtoh, teo_host_memory="write-combined" if wc else "pinned",
                   cuda_graph_modules=tuple(cuda_graphs), fp8=fp8, fp8_recipe=fp8_recipe,
                   capacity_factor=capacity_factor)


def parser() -> argparse.ArgumentParser:
    """The launcher's options; its workers get the same ones (through torchrun at EP > 1, whose own
    parser must not mistake one of them for an abbreviation of its options)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = GPTShape()
    for name, default, help_ in [("layers", d.layers, "transformer layers (each an MoE layer)"),
                                 ("hidden", d.hidden, "hidden size"), ("heads", d.heads, "attention heads"),
                                 ("ffn", d.ffn, "expert FFN size (moe_ffn_hidden_size)"),
                                 ("experts", d.experts, "routed experts"), ("topk", d.topk, "experts per token"),
                                 ("seq", d.seq, "sequence length"), ("micro-batch", d.micro_batch, "sequences per micro-batch"),
                                 ("microbatches", d.microbatches, "micro-batches per step (per rank)"),
                                 ("vocab", d.vocab, "vocabulary")]:
        p.add_argument(f"--{name}", type=int, default=default, help=f"{help_} (default {default})")
    p.add_argument("--ep", default="1,2", help="expert-parallel sizes to run, each on that many GPUs (default 1,2)")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help=f"comma-separated from {', '.join(BASE_VARIANTS)}, offloading ones with an optional "
                        f"{KERNEL_DTOH_SUFFIX} (default {DEFAULT_VARIANTS})")
    p.add_argument("--offload-modules", default="expert_fc1,moe_act",
                   help=f"Megatron's offload_modules for ours+megatron, from {', '.join(EXPERT_OFFLOAD_CHOICES)}")
    p.add_argument("--teo-budget-gib", type=float, default=None, help="teo's memory_budget (default: none)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timing jobs per variant, in rounds through the variants; each row is the run with the "
                        "median step, every run's step listed (default 1)")
    p.add_argument("--teo-reload-ahead", type=int, default=1,
                   help="ours+teo-ahead's reload_ahead: layers before the peak-neutral point its reloads start (default 1)")
    p.add_argument("--cuda-graphs", default="",
                   help="Megatron's per-layer CUDA graphs of these modules in every timed variant, as its trainer "
                        f"captures them (cuda_graph_impl=transformer_engine), e.g. attn,moe_router,moe_preprocess, "
                        f"or attn,moe with --capacity-factor; of {', '.join(GRAPH_MODULES)} (default: none)")
    p.add_argument("--no-capture", action="store_true",
                   help="with --cuda-graphs: Megatron's graphs configured (config, TE's RNG tracker, a side stream) "
                        "but never captured, every step eager: the eager twin of a graphed run, to compare losses")
    p.add_argument("--deterministic", action="store_true",
                   help="timing jobs with TE's deterministic kernels too (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0, as "
                        "the numerics job always runs), so runs can be compared loss by loss")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="Megatron's drop-and-pad MoE in every variant: each expert takes at most this many times "
                        "its even share of the routed tokens, padded to that (static shapes, which the moe CUDA "
                        "graph needs; default: no capacity, every token kept)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the first builds and compiles)")
    p.add_argument("--iters", type=int, default=8, help="timed steps")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cap-gib", type=float, default=None,
                   help="also find, at EP=1, the most sequences per micro-batch each of --cap-variants fits under "
                        "this much GPU memory (the allocator limited to it; out of memory means does not fit)")
    p.add_argument("--cap-variants", default="ours,ours+megatron,ours+teo", help="variants for --cap-gib")
    p.add_argument("--cap-max-micro-batch", type=int, default=None,
                   help="largest micro-batch tried under --cap-gib (default twice --micro-batch)")
    p.add_argument("--host-profile", action="store_true",
                   help="also run three steps of each variant under cProfile: the host's time by Python function")
    p.add_argument("--profile", action="store_true",
                   help="also profile two steps of each variant: offload copies against NCCL kernels, and the "
                        "compute stream's idle time by cause")
    p.add_argument("--trace-dir", type=Path, default=None, help="keep the profiled chrome traces here (gzipped)")
    p.add_argument("--no-numerics", action="store_true",
                   help="skip the first-step numerics of ours against stock (one job per EP)")
    p.add_argument("--job-timeout", type=float, default=300.0,
                   help="seconds one job (a variant at one EP, a numerics job, a cap trial) may run before it is "
                        "stopped (default 300)")
    p.add_argument("--job-logs", type=Path, default=None,
                   help="keep every job's whole output here (default: a failing job's last lines are printed)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for JSON, markdown, PNG")
    # set by the launcher for a worker: one job at one EP
    p.add_argument("--worker-ep", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-job", choices=JOBS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-micro-batch", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what the workers are launched with
    for name in ("layers", "hidden", "heads", "ffn", "experts", "topk", "seq", "micro_batch", "microbatches",
                 "vocab", "iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 1:
        p.error("--warmup must be at least 1 (the first step builds the experts' ops and compiles kernels)")
    if args.layers < 2:
        p.error("--layers must be at least 2: the offloading variants offload layers 1..L-1")
    if args.teo_budget_gib is not None and args.teo_budget_gib <= 0:
        p.error("--teo-budget-gib must be positive")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.teo_reload_ahead < 0:
        p.error("--teo-reload-ahead must be >= 0")
    if not args.job_timeout > 0:
        p.error("--job-timeout must be positive")
    if args.worker_ep is not None:  # a worker's arguments come from job_argv
        needs = {"time": ("worker_variant",), "cap": ("worker_variant", "worker_micro_batch"), "numerics": ()}
        missing = [n for n in ("worker_out", "worker_job", *needs.get(args.worker_job, ())) if getattr(args, n) is None]
        if missing:
            p.error(f"a worker needs {', '.join('--' + n.replace('_', '-') for n in missing)}")
        if args.worker_job == "cap" and args.cap_gib is None:
            p.error("a cap trial needs --cap-gib")
    try:
        args.ep = sorted({int(x) for x in args.ep.split(",") if x.strip()})
    except ValueError:
        p.error(f"--ep takes comma-separated ints, got {args.ep!r}")
    if not args.ep or any(e <= 0 for e in args.ep):
        p.error("--ep needs at least one positive size")
    args.offload_modules = tuple(m.strip() for m in args.offload_modules.split(",") if m.strip())
    bad = [m for m in args.offload_modules if m not in EXPERT_OFFLOAD_CHOICES]
    if bad or not args.offload_modules:
        p.error(f"--offload-modules: {bad or 'none given'}; choose from {', '.join(EXPERT_OFFLOAD_CHOICES)}")
    args.cuda_graphs = tuple(m.strip() for m in args.cuda_graphs.split(",") if m.strip())
    if args.no_capture and not args.cuda_graphs:
        p.error("--no-capture configures the graphs of --cuda-graphs without capturing them: give --cuda-graphs")
    if any(m not in GRAPH_MODULES for m in args.cuda_graphs):
        p.error(f"--cuda-graphs: {list(args.cuda_graphs)}: choose from {', '.join(GRAPH_MODULES)}")
    if "moe_preprocess" in args.cuda_graphs and "moe_router" not in args.cuda_graphs:
        p.error("--cuda-graphs: moe_preprocess needs moe_router (Megatron captures them together)")
    if args.capacity_factor is not None and not 0 < args.capacity_factor <= args.experts / args.topk:
        p.error(f"--capacity-factor must be in (0, experts / topk = {args.experts / args.topk:g}] (at that an "
                f"expert's capacity holds every token), got {args.capacity_factor}")
    if "moe" in args.cuda_graphs:
        if args.capacity_factor is None:
            p.error("--cuda-graphs moe captures whole MoE layers, whose token counts change every step unless "
                    "each expert's input is padded to a capacity: pass --capacity-factor (drop-and-pad)")
        if "moe_router" in args.cuda_graphs:
            p.error("--cuda-graphs: moe already holds the router; take moe or moe_router, not both")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or len(set(args.variants)) != len(args.variants):
        p.error("--variants needs distinct names")
    for v in args.variants:
        try:
            found = variant_for(v, args.layers, args.offload_modules)
        except ValueError as exc:
            p.error(f"--variants: {exc}")
        if found.offload_modules and args.capacity_factor is not None:
            p.error(f"--variants: {v}: Megatron's activation offloading does not take drop-and-pad MoE "
                    "(--capacity-factor); its own check refuses token-drop MoE")
        if found.fp8 is not None and "moe" in args.cuda_graphs:
            p.error(f"--variants: {v}: under FP8 with drop-and-pad, Megatron 0.19.2's experts pad each expert's "
                    "tokens for quantization by copying host counts to the GPU (torch.tensor), which a CUDA graph "
                    "capture refuses; graph attn only, or run FP8 eager")
        if (found.teo_scope or found.copy_traffic) and "moe" in args.cuda_graphs:
            p.error(f"--variants: {v}: the moe CUDA graph captures the experts whose saved tensors it moves (a "
                    "replayed graph runs no saved-tensor hooks); graph attn only, or leave it out")
    args.cap_variants = [v.strip() for v in args.cap_variants.split(",") if v.strip()]
    if args.cap_gib is not None:
        if args.cap_gib <= 0:
            p.error("--cap-gib must be positive")
        if 1 not in args.ep:
            p.error("--cap-gib searches at EP=1 (one rank running out of memory would leave the others waiting "
                    "in an all-to-all): include 1 in --ep")
        for v in args.cap_variants:
            try:
                found = variant_for(v, args.layers, args.offload_modules)
                if found.copy_traffic:
                    raise ValueError(f"{v} frees nothing (it copies scratch buffers): no cap trial for it")
                if found.offload_modules and args.capacity_factor is not None:
                    raise ValueError(f"{v}: Megatron's activation offloading does not take drop-and-pad MoE "
                                     "(--capacity-factor)")
            except ValueError as exc:
                p.error(f"--cap-variants: {exc}")
    args.cap_max_micro_batch = args.cap_max_micro_batch or 2 * args.micro_batch
    if args.cap_max_micro_batch < args.micro_batch:
        p.error("--cap-max-micro-batch must be at least --micro-batch")
    args.shape = shape_of(args)
    for ep in args.ep:
        try:
            args.shape.check(ep)
        except ValueError as exc:
            p.error(f"at --ep {ep}: {exc}")
    return args


def shape_of(args) -> GPTShape:
    return GPTShape(layers=args.layers, hidden=args.hidden, heads=args.heads, ffn=args.ffn, experts=args.experts,
                    topk=args.topk, seq=args.seq, micro_batch=args.micro_batch, microbatches=args.microbatches,
                    vocab=args.vocab)


STOCK_FP8_BLOCK_CUBLASLT = 130600  # TE's block-scaled grouped GEMM on Hopper needs cuBLASLt >= 13.6


def variants_problem(variants: list, capability: tuple, cublaslt: int) -> str | None:
    """Why a chosen variant cannot run on this GPU and cuBLASLt, or None."""
    if "stock+fp8block" in variants and capability < (10, 0) and cublaslt < STOCK_FP8_BLOCK_CUBLASLT:
        major, minor = cublaslt // 10000, cublaslt // 100 % 100
        return (f"stock+fp8block runs TE's block-scaled grouped GEMM, which on Hopper needs cuBLASLt >= 13.6; "
                f"this process has {major}.{minor} (drop that variant; ours+fp8block runs this package's FP8 kernels)")
    return None


def problem(max_ep: int, variants: list = ()) -> str | None:
    """Why this benchmark cannot run here, or None."""
    from bench_common import cuda_problem

    if (found := cuda_problem()) is not None:
        return found
    import torch

    if torch.cuda.device_count() < max_ep:
        return f"--ep {max_ep} needs {max_ep} GPUs of this host, {torch.cuda.device_count()} visible (pass --ep 1)"
    import transformer_engine_torch as tex

    if (found := variants_problem(list(variants), torch.cuda.get_device_capability(),
                                  tex.get_cublasLt_version())) is not None:
        return found
    from te_offload_ops.megatron import require_megatron

    try:
        require_megatron()
    except ImportError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------------------------------------
# One rank of one job (the worker)


def say(rank: int, text: str) -> None:
    if rank == 0:
        jobs.progress(text)


def time_variant(args, rank: int, weights: dict) -> dict:
    """``--worker-variant`` timed: warm-up steps, then ``--iters`` timed ones; peak and floor."""
    import torch

    from megatron_gpt_model import (
        FusedForwardCounter,
        MegatronOffloadCounter,
        apply_copy_traffic,
        apply_layer_graphs,
        apply_teo,
        build_gpt,
        experts_path,
        make_config,
        random_batches,
        train_step,
        wrap_for_training,
    )
    from te_offload_ops.megatron import use_kernel_dtoh

    shape, ep, name = args.shape, args.worker_ep, args.worker_variant
    v = variant_for(name, shape.layers, args.offload_modules, args.teo_budget_gib, args.cuda_graphs,
                    args.teo_reload_ahead, args.capacity_factor)
    config = make_config(shape, v, ep)
    model = build_gpt(shape, config, v.ours, weights)
    teo = apply_teo(model, v)
    traffic = apply_copy_traffic(model, v, shape)
    ddp, optimizer = wrap_for_training(model, config)
    graphs = apply_layer_graphs(ddp, optimizer, config, v, shape, torch.distributed.get_world_size(), rank)
    kdtoh = use_kernel_dtoh() if v.kernel_dtoh else None
    data = [random_batches(shape, seed=args.seed + i + 1000 * rank) for i in range(2)]
    megatron = MegatronOffloadCounter() if v.offload_modules else contextlib.nullcontext()
    try:
        with megatron:
            first_loss = train_step(ddp, optimizer, shape, data[0])
            for i in range(1, args.warmup):
                train_step(ddp, optimizer, shape, data[i % 2])
            say(rank, f"{args.warmup} warm-up steps done ({experts_path(model)})")
            capture_s = None
            if graphs is not None:  # as Megatron's trainer: capture after the warm-up, then a first replay
                if not args.no_capture:
                    capture_s = graphs.capture()
                train_step(ddp, optimizer, shape, data[args.warmup % 2])
                if capture_s is not None:
                    say(rank, f"CUDA graphs of {', '.join(v.cuda_graph_modules)} captured in {capture_s:.1f} s")
            torch.cuda.synchronize()
            floor = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            moved0 = (teo.counter.total if teo is not None else 0, getattr(megatron, "bytes", 0),
                      getattr(traffic, "bytes", 0))
            pinned0 = pinned_allocations()
            times, losses = [], []
            with FusedForwardCounter() as eager_experts:
                for i in range(args.iters):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    losses.append(train_step(ddp, optimizer, shape, data[i % 2]))
                    torch.cuda.synchronize()
                    times.append((time.perf_counter() - t0) * 1e3)
            peak = torch.cuda.max_memory_allocated()
            pinned = [now - before for now, before in zip(pinned_allocations(), pinned0)]
            moved = ((teo.counter.total if teo is not None else 0) - moved0[0]
                     + getattr(megatron, "bytes", 0) - moved0[1] + getattr(traffic, "bytes", 0) - moved0[2]) / args.iters
            host = host_profile(args, ddp, optimizer, data) if args.host_profile else None
            profile = None
            if args.profile:
                profile = profile_steps(args, name, ep, rank, ddp, optimizer, data)
    finally:
        for hooks in (kdtoh, teo, traffic, graphs):
            if hooks is not None:
                hooks.remove()
    return {"variant": name, "ep": ep, "rank": rank, "experts_path": experts_path(model),
            "step_ms": statistics.median(times), "step_ms_min": min(times), "step_ms_max": max(times),
            "floor_GiB": floor / 2**30, "peak_GiB": peak / 2**30, "peak_above_floor_GiB": (peak - floor) / 2**30,
            "offloaded_MiB_per_step": moved / 2**20, "step_ms_each": times,
            "teo_pinned_allocations_timed": pinned[0] if teo is not None else None,
            "teo_pinned_MiB_timed": pinned[1] / 2**20 if teo is not None else None,
            "teo_pinned_ms_timed": pinned[2] * 1e3 if teo is not None else None,
            "teo_oversized_reuses_timed": pinned[3] if teo is not None else None,
            "teo_pinned_timed": latest_pinned_allocations(pinned[0]) if teo is not None else None,
            "first_loss": first_loss, "timed_losses": losses,
            "experts_eager_forwards_timed": eager_experts.calls if v.ours else None,
            "profile": profile, "host_profile": host,
            "cuda_graphs": list(v.cuda_graph_modules), "graph_capture_s": capture_s}


def host_profile(args, ddp, optimizer, data, steps: int = 3, top: int = 25, keep_ms: float = 0.02) -> dict:
    """Three steps under cProfile: the host's wall time per step, the functions that took the most
    of it themselves (ms per step, calls per step), this package's functions by cumulative time,
    and every function above ``keep_ms`` of self time a step (the report compares variants with
    them). cProfile slows Python calls, so the figures rank where the host's time goes rather than
    give it."""
    import cProfile
    import pstats

    import torch

    from megatron_gpt_model import train_step

    prof = cProfile.Profile()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(steps):
        train_step(ddp, optimizer, args.shape, data[i % 2])
    torch.cuda.synchronize()
    prof.disable()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():
        where = f"{Path(path).parent.name}/{Path(path).name}:{line}({func})" if line else function_label(func)
        rows.append({"function": where, "self_ms": tottime * 1e3 / steps, "cum_ms": cumtime * 1e3 / steps,
                     "calls": calls / steps, "path": path})
    rows.sort(key=lambda r: -r["self_ms"])
    import te_offload_ops

    package = str(Path(te_offload_ops.__file__).parent)
    ours = sorted((r for r in rows if r["path"].startswith(package)), key=lambda r: -r["cum_ms"])
    for r in rows:
        r.pop("path")
    return {"wall_ms": wall_ms, "self_ms_total": sum(r["self_ms"] for r in rows), "top": rows[:top],
            "package_self_ms": sum(r["self_ms"] for r in ours), "package_top": ours[:top],
            "functions": [r for r in rows if r["self_ms"] >= keep_ms]}


def pinned_allocations() -> tuple[int, int, float, int]:
    """(pinned buffers, bytes, host seconds spent allocating them, requests served by a free buffer
    far larger than they needed) of teo's shared pool so far."""
    from te_offload_ops.engines.teo import default_pool

    pool = default_pool()
    return pool.allocations, pool.allocated_bytes, pool.allocation_seconds, pool.oversized_reuses


def latest_pinned_allocations(count: int) -> list:
    """The last ``count`` allocations of teo's shared pool (at most the 64 it remembers), each with
    what the pool held when its request found no buffer."""
    from te_offload_ops.engines.teo import default_pool

    recent = list(default_pool().recent_allocations)
    return recent[len(recent) - min(count, len(recent)):]


def profile_steps(args, name, ep, rank, ddp, optimizer, data) -> dict:
    import gzip

    import torch

    import step_profile
    from comm_copy_overlap import analyze
    from megatron_gpt_model import train_step

    steps = 2
    kwargs = {"experimental_config": config} if (config := step_profile.profiler_config()) is not None else {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA], **kwargs) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"{step_profile.STEP_MARK} {i}"):
                train_step(ddp, optimizer, args.shape, data[i % 2])
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
    if args.trace_dir is not None:
        args.trace_dir.mkdir(parents=True, exist_ok=True)
        stem = f"megatron_gpt_ep{ep}_{name.replace('+', '_')}_rank{rank}.trace.json.gz"
        with gzip.open(args.trace_dir / stem, "wt") as f:
            f.write(text)
    trace = json.loads(text)
    summary = analyze(trace["traceEvents"], steps=steps)
    summary["idle"] = compute_idle(step_profile.events_from_trace(trace),
                                   [f"{step_profile.STEP_MARK} {i}" for i in range(steps)])
    say(rank, f"profile: NCCL {summary['nccl_ms']:.1f} ms/step, offload copies {summary['offload_d2h_ms']:.1f} d2h + "
              f"{summary['offload_h2d_ms']:.1f} h2d ms, beside NCCL {summary['overlap_ms']:.1f} ms; dispatcher copies "
              f"waited {summary['small_d2h']['wait_ms']:.2f} ms ({summary['small_d2h']['wait_behind_offload_ms']:.2f} "
              "behind offload copies)")
    return summary


def compute_idle(events: list, step_names: list[str]) -> dict:
    """Per step (mean over ``step_names``), the compute stream's idle ms by cause (the host had not
    launched the next op yet, busy or blocked in a sync; or it waited on another stream's work,
    named) and the step's longest gaps, from ``step_profile``'s analysis."""
    import step_profile as sp

    compute = sp.default_compute_stream(events)
    steps = [sp.analyze_step(events, name, compute, top_gaps=6) for name in step_names]
    causes: dict[str, float] = {}
    for s in steps:
        for per_cause in s["idle_ms"].values():
            for cause, ms in per_cause.items():
                causes[cause] = causes.get(cause, 0.0) + ms / len(steps)
    return {"gpu_ms": sum(s["gpu_ms"] for s in steps) / len(steps),
            "compute_busy_ms": sum(s["compute_busy_ms"] for s in steps) / len(steps),
            "compute_kernels_ms": sum(s["compute_kernels_ms"] for s in steps) / len(steps),
            "compute_copies_ms": sum(s["compute_copies_ms"] for s in steps) / len(steps),
            "idle_ms_by_cause": dict(sorted(causes.items(), key=lambda kv: -kv[1])),
            "largest_gaps": steps[-1]["largest_gaps"]}


def cap_trial(args, weights: dict) -> dict:
    """``--worker-variant`` at ``--worker-micro-batch`` sequences per micro-batch under ``--cap-gib``
    (the allocator limited to it): three steps' best time and the peak, or fits False where it ran
    out of memory."""
    import torch

    from megatron_gpt_model import apply_teo, build_gpt, make_config, random_batches, train_step, wrap_for_training

    name, mb = args.worker_variant, args.worker_micro_batch
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    shape = replace(args.shape, micro_batch=mb)
    v = variant_for(name, shape.layers, args.offload_modules, args.teo_budget_gib, teo_reload_ahead=args.teo_reload_ahead,
                    capacity_factor=args.capacity_factor)
    found = {"variant": name, "micro_batch": mb, "fits": False}
    try:
        config = make_config(shape, v, 1)
        model = build_gpt(shape, config, v.ours, weights)
        teo = apply_teo(model, v)
        ddp, optimizer = wrap_for_training(model, config)
        data = random_batches(shape, seed=args.seed)
        times = []
        for _ in range(3):  # the first builds the experts' ops
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            train_step(ddp, optimizer, shape, data)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        if teo is not None:
            teo.remove()
        found.update(fits=True, step_ms=min(times[1:]), peak_GiB=torch.cuda.max_memory_allocated() / 2**30)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
        text = str(exc)
        if not (isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower()
                or "ALLOC_FAILED" in text):
            raise
        found["oom"] = text.splitlines()[0][:200] if text else type(exc).__name__
    return found


def numerics_job(args, rank: int, weights: dict) -> dict:
    from megatron_gpt_model import random_batches
    from megatron_gpt_numerics import measure

    batches = random_batches(args.shape, seed=args.seed + 1000 * rank)  # the time jobs' first step
    return measure(args.shape, args.worker_ep, weights, batches, seed=args.seed, log=lambda text: say(rank, text))


def worker(args) -> int:
    """One rank of one job: writes ``rank<r>.json`` into ``--worker-out`` (its result, or the error)."""
    from megatron_gpt_model import reference_weights, run_rank, use_graphable_rng

    def body(rank: int) -> dict:
        weights, digest = reference_weights(args.shape, args.worker_ep)
        if args.cuda_graphs and args.worker_job == "time":
            use_graphable_rng(args.seed)
        if args.worker_job == "time":
            return {"weights_digest": digest, "row": time_variant(args, rank, weights)}
        if args.worker_job == "cap":
            return {"weights_digest": digest, "cap": cap_trial(args, weights)}
        return {"weights_digest": digest, "numerics": numerics_job(args, rank, weights)}

    return run_rank(args.worker_out, args.worker_ep, args.seed, body, result={"job": args.worker_job})


# ------------------------------------------------------------------------------------------------
# The launcher: one job per variant and EP (then numerics, cap trials), then the report


START = time.monotonic()


def log(text: str) -> None:
    """A progress line with the seconds since the launcher started."""
    print(f"[{time.monotonic() - START:6.0f} s] {text}", flush=True)


def job_argv(args, ep: int, out: Path, job: str, variant: str | None = None, micro_batch: int | None = None) -> list:
    """The worker's arguments: the launcher's own, then which job at which EP."""
    argv = [*args.argv, "--worker-ep", str(ep), "--worker-out", str(out), "--worker-job", job]
    if variant is not None:
        argv += ["--worker-variant", variant]
    if micro_batch is not None:
        argv += ["--worker-micro-batch", str(micro_batch)]
    return argv


def run_job(args, ep: int, label: str, job: str, **what) -> dict:
    """One job in its own processes; its progress lines under ``label``. Returns jobs.run's dict
    with ``failure`` (None where every rank wrote a result)."""
    stem = "_".join(["ep" + str(ep), job, *(str(v).replace("+", "_") for v in what.values())])
    env = worker_env()
    if job == "numerics" or args.deterministic:  # bitwise comparisons need TE's deterministic kernels
        env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    if args.job_logs is not None:
        args.job_logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = jobs.command(Path(__file__).resolve(), job_argv(args, ep, Path(tmp), job, **what), ep)
        found = jobs.run(cmd, Path(tmp), env=env, cwd=HERE.parent, timeout=args.job_timeout,
                         show=lambda text: log(f"    {label}: {text}"),
                         log_path=None if args.job_logs is None else args.job_logs / f"{stem}.log")
    found["failure"] = jobs.failure(found, ep)
    if found["failure"] is not None:
        log(f"{label} failed: {found['failure']}; its output ends:\n{found['tail']}")
    return found


def median_run(runs: list[dict]) -> dict:
    """A variant's row from its runs: the run with the median step (the lower of the two middle ones
    for an even count; the first failure where none ran), with every run's step in ``step_ms_runs``."""
    ran = sorted((r for r in runs if "error" not in r), key=lambda r: r["step_ms"])
    if not ran:
        return runs[0]
    return {**ran[(len(ran) - 1) // 2], "step_ms_runs": [r.get("step_ms") for r in runs]}


def cap_search(args) -> list:
    """Per --cap-variants at EP=1: the most sequences per micro-batch that fit under --cap-gib,
    trying --micro-batch upward until one does not fit (each trial a job of its own)."""
    rows = []
    for name in args.cap_variants:
        best, error = None, None
        for mb in range(args.micro_batch, args.cap_max_micro_batch + 1):
            label = f"cap {args.cap_gib:g} GiB: {name} at micro-batch {mb}"
            job = run_job(args, 1, label, "cap", variant=name, micro_batch=mb)
            if job["failure"] is not None:
                error = job["failure"]
                break
            got = job["per_rank"][0]["cap"]
            log(f"{label}: " + (f"fits, step {got['step_ms']:.1f} ms, peak {got['peak_GiB']:.2f} GiB" if got["fits"]
                                else "does not fit"))
            if not got["fits"]:
                break
            best = {"micro_batch": mb, "step_ms": got["step_ms"], "peak_GiB": got["peak_GiB"]}
        tokens = None if best is None else args.shape.microbatches * best["micro_batch"] * args.shape.seq
        rows.append({"variant": name, "cap_GiB": args.cap_gib, "best": best, "tokens_per_step": tokens,
                     "tokens_per_s": None if best is None else tokens / (best["step_ms"] * 1e-3),
                     "hit_max": best is not None and best["micro_batch"] == args.cap_max_micro_batch,
                     **({"error": error} if error else {})})
    return rows


def command_line(argv: list) -> str:
    from bench_common import command_line as named

    return named("benchmarks/megatron_gpt.py", argv, ("--out", "--job-logs", "--trace-dir"))


def build_result(args, rows: list, numerics: dict, cap, gpus: list, complete: bool) -> dict:
    """The results file's content from the rows so far (``complete``: every job has run)."""
    import torch
    import transformer_engine

    from megatron_gpt_numerics import checks
    from te_offload_ops.megatron import installed_version

    rows = copy.deepcopy(rows)
    add_comparisons(rows, args.shape.tokens_per_step)
    result = {
        "benchmark": "megatron_gpt", "gpu": gpus[0] if gpus else "unknown GPU", "complete": complete,
        "date": utc_now(), "command": command_line(args.argv),
        "versions": {"megatron-core": installed_version(), "transformer-engine": transformer_engine.__version__,
                     "torch": torch.__version__},
        "config": {**{k: getattr(args.shape, k) for k in ("layers", "hidden", "heads", "ffn", "experts", "topk",
                                                          "seq", "micro_batch", "microbatches", "vocab")},
                   "ep": args.ep, "variants": args.variants, "offload_modules": list(args.offload_modules),
                   "teo_budget_gib": args.teo_budget_gib, "teo_reload_ahead": args.teo_reload_ahead,
                   "repeats": args.repeats, "warmup": args.warmup, "iters": args.iters,
                   "seed": args.seed, "profile": args.profile, "numerics": not args.no_numerics,
                   "cap_gib": args.cap_gib, "cap_max_micro_batch": args.cap_max_micro_batch,
                   "cuda_graphs": list(args.cuda_graphs),
                   "graphs_captured": bool(args.cuda_graphs) and not args.no_capture,
                   "deterministic": args.deterministic, "capacity_factor": args.capacity_factor},
        "rows": rows, "numerics": numerics, "cap": cap,
    }
    result["targets"] = (targets(rows) + [dict(target=c["check"], value=c["value"], met=c["met"])
                                          for ep, merged in numerics.items() for c in checks(merged, int(ep))]
                         + cap_targets(cap))
    return result


def shape_suffixes(shape) -> tuple:
    """``<field><value>`` for each field of ``shape`` off :class:`GPTShape`'s defaults (``seq4096``):
    runs of other shapes never write over the default shape's reports."""
    default = GPTShape()
    return tuple(f"{f.name}{getattr(shape, f.name)}" for f in fields(shape)
                 if getattr(shape, f.name) != getattr(default, f.name))


def report_stem(args, gpu: str) -> str:
    suffixes = (() if args.ep == [1, 2] else ("ep" + "-".join(map(str, args.ep)),)) + shape_suffixes(args.shape) + \
        (("graphs" if not args.no_capture else "graphs_uncaptured",) if args.cuda_graphs else ()) + \
        (("fp8",) if any(split_precision(v)[1] for v in args.variants) else ())
    return file_stem("megatron_gpt", gpu, *suffixes)


def write_partial(args, rows: list, numerics: dict, gpus: list) -> None:
    """The JSON of the jobs run so far, ``"complete": false``, so that a run stopped early (a time
    limit, a failed machine) keeps what it measured; the full reports replace it at the end."""
    result = build_result(args, rows, numerics, None, gpus, complete=False)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{report_stem(args, result['gpu'])}.json").write_text(json.dumps(result, indent=2) + "\n")


def launch(args) -> int:
    from megatron_gpt_numerics import checks, merge_ranks as merge_numerics

    s = args.shape
    per_ep = len(args.variants) * args.repeats + (0 if args.no_numerics else 1)
    log(f"L={s.layers} H={s.hidden} E={s.experts} top-{s.topk} F={s.ffn}, {s.microbatches} x {s.micro_batch} x "
        f"{s.seq} tokens per rank; {per_ep * len(args.ep)} jobs, each in processes of its own: per EP in "
        f"{args.ep}, the variants {', '.join(args.variants)}" + ("" if args.no_numerics else ", then the numerics")
        + ("; then the cap trials at EP=1" if args.cap_gib is not None else ""))
    rows, numerics, cap, gpus = [], {}, None, []  # the GPU's name comes from the workers
    for ep in args.ep:
        runs = {name: [] for name in args.variants}
        for round_ in range(1, args.repeats + 1):  # rounds through the variants: a slow spell hits all alike
            for i, name in enumerate(args.variants, 1):
                label = f"EP={ep} [{i}/{len(args.variants)}] {name}" + \
                    (f" (run {round_}/{args.repeats})" if args.repeats > 1 else "")
                log(f"{label} ...")
                job = run_job(args, ep, label, "time", variant=name)
                gpus += [r["gpu"] for r in job["per_rank"] if "gpu" in r]
                row = merge_variant(job["per_rank"], ep, name, job["failure"])
                runs[name].append(row)
                if "error" not in row:
                    log(f"{label}: step {row['step_ms']:.1f} ms, peak {row['peak_GiB']:.2f} GiB "
                        f"({row['peak_above_floor_GiB']:.2f} above the floor of {row['floor_GiB']:.2f}), offloaded "
                        f"{row['offloaded_MiB_per_step']:.0f} MiB/step ({job['seconds']:.0f} s)")
                write_partial(args, rows + [median_run(r) for r in runs.values() if r], numerics, gpus)
        rows += [median_run(runs[name]) for name in args.variants]
        if not args.no_numerics:
            label = f"EP={ep} numerics"
            log(f"{label} ...")
            job = run_job(args, ep, label, "numerics")
            gpus += [r["gpu"] for r in job["per_rank"] if "gpu" in r]
            merged = {"error": job["failure"]} if job["failure"] else merge_numerics([r["numerics"] for r in
                                                                                     job["per_rank"]])
            numerics[str(ep)] = merged
            write_partial(args, rows, numerics, gpus)
            found = checks(merged, ep)
            log(f"{label}: {sum(bool(c['met']) for c in found)} of {len(found)} bounds met ({job['seconds']:.0f} s)")
        if args.cap_gib is not None and ep == 1:
            cap = cap_search(args)
    result = build_result(args, rows, numerics, cap, gpus, complete=True)
    paths = write_reports(args.out, report_stem(args, result["gpu"]), result, markdown, chart)
    log("wrote " + ", ".join(str(p) for p in paths))
    failed = [r for r in rows if "error" in r] + [m for m in numerics.values() if "error" in m] \
        + [c for c in cap or [] if "error" in c]
    return 0 if not failed else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker_ep is not None:
        return worker(args)
    reason = problem(max(args.ep), args.variants)
    if reason:
        return refuse("megatron_gpt.py", reason)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
