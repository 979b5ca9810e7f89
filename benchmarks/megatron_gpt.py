#!/usr/bin/env python3
"""Megatron-Core GPT-MoE training steps: stock TE experts against ours, Megatron's offloading
against teo, at expert parallelism 1 and 2.

The model (``benchmarks/megatron_gpt_model.py``): Megatron's GPTModel from its Transformer Engine
layer spec, every layer an MoE layer (squared-ReLU experts on TE's op fuser, alltoall dispatcher,
fused permute), bf16, Megatron's DDP (fp32 grads, overlapped reduce) with the distributed Adam,
trained by ``get_forward_backward_func()`` over the micro-batches, then ``optimizer.step()``;
random tokens. Defaults: 4 layers, H=2048, 16 heads, 16 experts top-4, F=1408, vocab 32768,
2 micro-batches x 4 x 2048 tokens per rank. Each EP setting runs in its own processes
(``torchrun --nproc-per-node EP`` of this script with ``--worker-ep``), the variants one after
another from the same weights. Variants (``--variants``):

* ``stock``: Megatron's TEGroupedMLP on TE's op fuser (TE's ops; on Hopper in bf16 they run unfused);
* ``ours``: ``use_te_offload_ops`` (the fused Hopper op);
* ``ours+megatron``: ours under Megatron's fine-grained offloading of ``--offload-modules``
  (default expert_fc1,moe_act; Megatron keeps the last layer's group on the GPU);
* ``ours+teo``: ours with the routed experts of the first L-1 layers under teo
  (``use_teo_offload(scope="experts")``: what Megatron's choice moves), ``--teo-budget-gib`` its budget;
* ``ours+teo-layer``: whole transformer layers 1..L-1 under teo (``scope="layer"``);
* ``stock+megatron``: stock under Megatron's "fused_group_mlp" offloading (the only choice its
  op-fuser path takes; not in the default: where it fails on the GPU the process ends);
* a ``+kdtoh`` suffix on an offloading variant adds ``use_kernel_dtoh`` (the dispatcher's split
  sizes to the host by kernel, past the copy engine's queue of offload copies).

Targets checked: ours at EP=2 at least 1.7x stock's step with grads within 3e-2 of stock's;
each offloading variant at EP=2 within 3% of ours' step; teo freeing at least what Megatron's
offloading frees at no more step time, and fitting more tokens under a cap (predicted from the
peaks, and measured with ``--cap-gib``).

Per variant and EP: median step time (the slowest rank's), tokens/s over all ranks, peak memory
allocated (and above the floor held between steps: weights, grads, optimizer state), bytes
offloaded per step per rank, the first step's loss and grads against stock's (same weights and
tokens), and the targets below (megatron_gpt_report.targets). ``--profile`` adds, per offloading variant, two steps under
torch.profiler and where the offload copies meet NCCL's kernels and the dispatcher's copies
(``benchmarks/comm_copy_overlap.py``). Writes megatron_gpt_<GPU>.{json,md,png} into ``--out``
(the report: ``benchmarks/megatron_gpt_report.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from bench_common import file_stem, refuse, utc_now, write_reports  # noqa: E402
from megatron_gpt_model import EXPERT_OFFLOAD_CHOICES, GPTShape, Variant, worker_env  # noqa: E402
from megatron_gpt_report import add_comparisons, cap_targets, chart, markdown, merge_ranks, targets  # noqa: E402

BASE_VARIANTS = ("stock", "ours", "ours+megatron", "ours+teo", "ours+teo-layer", "stock+megatron")
KERNEL_DTOH_SUFFIX = "+kdtoh"
DEFAULT_VARIANTS = "stock,ours,ours+megatron,ours+teo,ours+teo+kdtoh"


def variant_for(name: str, layers: int, offload_modules: tuple, teo_budget_gib=None) -> Variant:
    """The Variant a variant name stands for (ValueError for unknown names)."""
    base, kdtoh = (name[:-len(KERNEL_DTOH_SUFFIX)], True) if name.endswith(KERNEL_DTOH_SUFFIX) else (name, False)
    teo = dict(teo_layers=layers - 1, teo_budget_gib=teo_budget_gib)
    table = {
        "stock": Variant(ours=False),
        "ours": Variant(ours=True),
        "ours+megatron": Variant(ours=True, offload_modules=tuple(offload_modules)),
        "ours+teo": Variant(ours=True, teo_scope="experts", **teo),
        "ours+teo-layer": Variant(ours=True, teo_scope="layer", **teo),
        "stock+megatron": Variant(ours=False, offload_modules=("fused_group_mlp",)),
    }
    if base not in table:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(BASE_VARIANTS)} "
                         f"(an offloading one may end in {KERNEL_DTOH_SUFFIX})")
    found = table[base]
    if kdtoh and not (found.offload_modules or found.teo_scope):
        raise ValueError(f"{name}: {KERNEL_DTOH_SUFFIX} is for variants that offload")
    return replace(found, kernel_dtoh=kdtoh)


def offloads(v: Variant) -> bool:
    return bool(v.offload_modules) or v.teo_scope is not None


def parse_args(argv=None) -> argparse.Namespace:
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
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the first builds and compiles)")
    p.add_argument("--iters", type=int, default=8, help="timed steps")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--cap-gib", type=float, default=None,
                   help="also find, at EP=1, the most sequences per micro-batch each of --cap-variants fits under "
                        "this much GPU memory (the allocator limited to it; out of memory means does not fit)")
    p.add_argument("--cap-variants", default="ours,ours+megatron,ours+teo", help="variants for --cap-gib")
    p.add_argument("--cap-max-micro-batch", type=int, default=None,
                   help="largest micro-batch tried under --cap-gib (default twice --micro-batch)")
    p.add_argument("--profile", action="store_true",
                   help="also profile two steps of each offloading variant: offload copies against NCCL kernels")
    p.add_argument("--trace-dir", type=Path, default=None, help="keep the profiled chrome traces here (gzipped)")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for JSON, markdown, PNG")
    p.add_argument("--worker-ep", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
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
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or len(set(args.variants)) != len(args.variants):
        p.error("--variants needs distinct names")
    for v in args.variants:
        try:
            variant_for(v, args.layers, args.offload_modules)
        except ValueError as exc:
            p.error(f"--variants: {exc}")
    args.cap_variants = [v.strip() for v in args.cap_variants.split(",") if v.strip()]
    if args.cap_gib is not None:
        if args.cap_gib <= 0:
            p.error("--cap-gib must be positive")
        if 1 not in args.ep:
            p.error("--cap-gib searches at EP=1 (one rank running out of memory would leave the others waiting "
                    "in an all-to-all): include 1 in --ep")
        for v in args.cap_variants:
            try:
                variant_for(v, args.layers, args.offload_modules)
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


def problem(max_ep: int) -> str | None:
    """Why this benchmark cannot run here, or None."""
    from bench_common import cuda_problem

    if (found := cuda_problem()) is not None:
        return found
    import torch

    if torch.cuda.device_count() < max_ep:
        return f"--ep {max_ep} needs {max_ep} GPUs of this host, {torch.cuda.device_count()} visible (pass --ep 1)"
    from te_offload_ops.megatron import require_megatron

    try:
        require_megatron()
    except ImportError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------------------------------------
# One rank of one EP setting (the worker)


START = time.monotonic()


def log(rank: int, text: str) -> None:
    """A progress line from rank 0, with the seconds since this process started."""
    if rank == 0:
        print(f"[{time.monotonic() - START:6.0f} s] {text}", flush=True)


def measure(args, name: str, ep: int, rank: int, weights: dict, stock_grads: dict | None) -> dict:
    import torch

    from megatron_gpt_model import (
        MegatronOffloadCounter,
        apply_teo,
        build_gpt,
        experts_path,
        make_config,
        random_batches,
        release,
        train_step,
        wrap_for_training,
    )
    from te_offload_ops.megatron import use_kernel_dtoh

    shape = args.shape
    v = variant_for(name, shape.layers, args.offload_modules, args.teo_budget_gib)
    config = make_config(shape, v, ep)
    model = build_gpt(shape, config, v.ours, weights)
    teo = apply_teo(model, v)
    ddp, optimizer = wrap_for_training(model, config)
    kdtoh = use_kernel_dtoh() if v.kernel_dtoh else None
    data = [random_batches(shape, seed=args.seed + i + 1000 * rank) for i in range(2)]
    megatron = MegatronOffloadCounter() if v.offload_modules else contextlib.nullcontext()
    first = {}

    def read_grads(ddp_model):
        if not first:
            first.update({n: p.main_grad.detach().to("cpu", torch.bfloat16)
                          for n, p in ddp_model.module.named_parameters()})

    try:
        with megatron:
            first_loss = train_step(ddp, optimizer, shape, data[0], after_backward=read_grads)
            for i in range(1, args.warmup):
                train_step(ddp, optimizer, shape, data[i % 2])
            log(rank, f"  [ep={ep}] {name}: {args.warmup} warmup steps done ({experts_path(model)})")
            torch.cuda.synchronize()
            floor = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            moved0 = (teo.counter.total if teo is not None else 0, getattr(megatron, "bytes", 0))
            times = []
            for i in range(args.iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                train_step(ddp, optimizer, shape, data[i % 2])
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
            peak = torch.cuda.max_memory_allocated()
            moved = ((teo.counter.total if teo is not None else 0) - moved0[0]
                     + getattr(megatron, "bytes", 0) - moved0[1]) / args.iters
            profile = profile_steps(args, name, ep, rank, ddp, optimizer, data) if args.profile and offloads(v) else None
    finally:
        if kdtoh is not None:
            kdtoh.remove()
        if teo is not None:
            teo.remove()
    row = {"variant": name, "ep": ep, "rank": rank, "experts_path": experts_path(model),
           "step_ms": statistics.median(times), "step_ms_min": min(times), "step_ms_max": max(times),
           "floor_GiB": floor / 2**30, "peak_GiB": peak / 2**30, "peak_above_floor_GiB": (peak - floor) / 2**30,
           "offloaded_MiB_per_step": moved / 2**20, "first_loss": first_loss, "profile": profile}
    if stock_grads is not None:
        errs = {n: rel_err(first[n], g) for n, g in stock_grads.items() if n in first}
        worst = max(errs, key=errs.get) if errs else None
        row.update(grad_max_rel_err=errs.get(worst), grad_worst=worst, grads_compared=len(errs))
    del ddp, optimizer, model, teo
    release(config)
    return row if name != "stock" else {**row, "_grads": first}


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def profile_steps(args, name, ep, rank, ddp, optimizer, data) -> dict:
    import gzip

    import torch

    from comm_copy_overlap import analyze
    from megatron_gpt_model import train_step

    steps = 2
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
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
    summary = analyze(json.loads(text)["traceEvents"], steps=steps)
    log(rank, f"  [ep={ep}] {name}: profile: NCCL {summary['nccl_ms']:.1f} ms/step, offload copies "
              f"{summary['offload_d2h_ms']:.1f} d2h + {summary['offload_h2d_ms']:.1f} h2d ms, beside NCCL "
              f"{summary['overlap_ms']:.1f} ms; dispatcher copies waited {summary['small_d2h']['wait_ms']:.2f} ms "
              f"({summary['small_d2h']['wait_behind_offload_ms']:.2f} behind offload copies)")
    return summary


def fits(args, name: str, micro_batch: int, weights: dict) -> dict | None:
    """A few steps of ``name`` at ``micro_batch`` under the memory cap set by the caller: its step
    time, or None where it ran out of memory."""
    import torch

    from megatron_gpt_model import apply_teo, build_gpt, make_config, random_batches, release, train_step
    from megatron_gpt_model import wrap_for_training
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off,
    )

    shape = replace(args.shape, micro_batch=micro_batch)
    v = variant_for(name, shape.layers, args.offload_modules, args.teo_budget_gib)
    config = make_config(shape, v, 1)
    model = ddp = optimizer = teo = None
    try:
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
        return {"step_ms": min(times[1:]), "peak_GiB": torch.cuda.max_memory_allocated() / 2**30}
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower() \
                or "ALLOC_FAILED" in str(exc):
            return None
        raise
    finally:
        if teo is not None:
            teo.remove()
        off.reset_instance()  # Megatron's offload manager may hold a step cut short
        del model, ddp, optimizer, teo
        release(config)
        torch.cuda.reset_peak_memory_stats()


def cap_search(args, weights: dict) -> list[dict]:
    """Per --cap-variants: the most sequences per micro-batch that fit under --cap-gib, trying
    --micro-batch upward until one does not fit."""
    import torch

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    rows = []
    try:
        for name in args.cap_variants:
            best = None
            for mb in range(args.micro_batch, args.cap_max_micro_batch + 1):
                got = fits(args, name, mb, weights)
                print(f"  [cap {args.cap_gib:g} GiB] {name}: micro-batch {mb} "
                      + ("does not fit" if got is None else f"fits, step {got['step_ms']:.1f} ms"), flush=True)
                if got is None:
                    break
                best = {"micro_batch": mb, **got}
            tokens = None if best is None else args.shape.microbatches * best["micro_batch"] * args.shape.seq
            rows.append({"variant": name, "cap_GiB": args.cap_gib, "best": best, "tokens_per_step": tokens,
                         "tokens_per_s": None if best is None else tokens / (best["step_ms"] * 1e-3),
                         "hit_max": best is not None and best["micro_batch"] == args.cap_max_micro_batch})
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    return rows


def worker(args) -> int:
    import torch

    from megatron_gpt_model import (
        build_gpt,
        cpu_state,
        init_parallel,
        install_wgrad_accum_standin,
        make_config,
        release,
    )

    install_wgrad_accum_standin()
    ep = args.worker_ep
    rank, world = init_parallel(ep, args.seed, timeout_minutes=3)  # a rank that fails ends the others' waits
    shape = args.shape
    log(rank, f"[ep={ep}] {world} rank(s) on {torch.cuda.get_device_name()}: L={shape.layers} H={shape.hidden} "
              f"E={shape.experts} top-{shape.topk} F={shape.ffn}, {shape.microbatches} x {shape.micro_batch} x "
              f"{shape.seq} tokens per rank")
    config = make_config(shape, Variant(ours=False), ep)
    weights = cpu_state(build_gpt(shape, config, ours=False))
    release(config)
    rows, stock_grads = [], None
    out = args.worker_out / f"rank{rank}.json"
    for i, name in enumerate(args.variants, 1):
        log(rank, f"[ep={ep}] [{i}/{len(args.variants)}] {name} ...")
        try:
            row = measure(args, name, ep, rank, weights, stock_grads)
        except Exception as exc:  # noqa: BLE001 (a variant that fails is reported, the others still run)
            import traceback

            row = {"variant": name, "ep": ep, "rank": rank, "error": f"{type(exc).__name__}: {exc}",
                   "traceback": traceback.format_exc()}
            print(f"[ep={ep}] rank {rank} {name} failed: {row['error']}", flush=True)
        if "_grads" in row:
            stock_grads = row.pop("_grads")
        rows.append(row)
        out.write_text(json.dumps({"rank": rank, "world": world, "gpu": torch.cuda.get_device_name(), "rows": rows},
                                  indent=1))
        if "error" not in row:
            log(rank, f"[ep={ep}] [{i}/{len(args.variants)}] {name:22s} step {row['step_ms']:7.1f} ms  peak "
                      f"{row['peak_GiB']:5.2f} GiB  offloaded {row['offloaded_MiB_per_step']:6.0f} MiB/step")
    if args.cap_gib is not None and ep == 1:
        cap = cap_search(args, weights)
        out.write_text(json.dumps({"rank": rank, "world": world, "gpu": torch.cuda.get_device_name(), "rows": rows,
                                   "cap": cap}, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------------
# The launcher: one torchrun per EP setting, then the report


def worker_command(args, ep: int, out: Path) -> list[str]:
    """torchrun of this script as the worker for ``ep`` ranks, with the same settings."""
    argv = list(args.argv)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ep}",
            str(Path(__file__).resolve()), *argv, "--worker-ep", str(ep), "--worker-out", str(out)]


def launch(args) -> int:
    import torch
    import transformer_engine

    from te_offload_ops.megatron import installed_version

    rows, gpu, cap = [], None, None  # the GPU's name comes from the workers: this process makes no CUDA context
    for ep in args.ep:
        with tempfile.TemporaryDirectory() as tmp:
            log(0, f"== EP={ep}: torchrun --nproc-per-node {ep} ({len(args.variants)} variants"
                   + (f", then the cap search over {len(args.cap_variants)}" if args.cap_gib and ep == 1 else "")
                   + ")")
            proc = subprocess.run(worker_command(args, ep, Path(tmp)), env=worker_env(), cwd=HERE.parent)
            files = sorted(Path(tmp).glob("rank*.json"))
            per_rank = [json.loads(f.read_text()) for f in files]
        gpu = gpu or next((r["gpu"] for r in per_rank), None)
        cap = cap or next((r["cap"] for r in per_rank if r.get("cap")), None)
        if proc.returncode != 0:
            log(0, f"== EP={ep}: the workers ended with exit status {proc.returncode}")
        if len(per_rank) < ep:
            rows.append({"variant": "(all)", "ep": ep, "error": f"{len(per_rank)} of {ep} ranks wrote results "
                                                               f"(exit status {proc.returncode})"})
        rows += merge_ranks(per_rank) if per_rank else []
    add_comparisons(rows, args.shape.tokens_per_step)
    result = {
        "benchmark": "megatron_gpt", "gpu": gpu,
        "date": utc_now(),
        "versions": {"megatron-core": installed_version(), "transformer-engine": transformer_engine.__version__,
                     "torch": torch.__version__},
        "config": {**{k: getattr(args.shape, k) for k in ("layers", "hidden", "heads", "ffn", "experts", "topk",
                                                          "seq", "micro_batch", "microbatches", "vocab")},
                   "ep": args.ep, "variants": args.variants, "offload_modules": list(args.offload_modules),
                   "teo_budget_gib": args.teo_budget_gib, "warmup": args.warmup, "iters": args.iters,
                   "profile": args.profile, "cap_gib": args.cap_gib, "cap_max_micro_batch": args.cap_max_micro_batch},
        "rows": rows, "cap": cap,
    }
    result["targets"] = targets(rows) + cap_targets(cap)
    result["gpu"] = gpu = gpu or "unknown GPU"
    suffixes = () if args.ep == [1, 2] else ("ep" + "-".join(map(str, args.ep)),)
    paths = write_reports(args.out, file_stem("megatron_gpt", gpu, *suffixes), result, markdown, chart)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all("error" not in r for r in rows) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker_ep is not None:
        return worker(args)
    reason = problem(max(args.ep))
    if reason:
        return refuse("megatron_gpt.py", reason)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
