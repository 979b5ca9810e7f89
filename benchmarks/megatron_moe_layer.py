#!/usr/bin/env python3
"""Megatron-Core MoE layers, forward + backward: Megatron's stock TE experts against te_offload_ops'
(TEOGroupedMLP through use_te_offload_ops), with and without Megatron's fine-grained offloading.

A stack of L Megatron MoELayers (router, alltoall dispatcher, experts; residual between layers)
on one GPU, bf16, squared ReLU (use_fused_weighted_squared_relu), wgrads accumulated into fp32
main_grad (gradient_accumulation_fusion) and deferred to backward_dw
(overlap_dispatch_backward_with_experts_wgrad). Every variant starts from the same weights and
inputs. Variants:

- stock-fuser: TEGroupedMLP on TE's op fuser (TE's ops; on Hopper in bf16 they run unfused);
  Megatron allows only "fused_group_mlp" offloading there.
- stock-modules: TEGroupedMLP on TE's GroupedLinear modules (use_transformer_engine_op_fuser=False),
  where Megatron offers "expert_fc1" and "moe_act".
- ours: TEOGroupedMLP (the fused Hopper op where it applies), with each offload choice.

Per variant: median step time (host clock, synchronized at both ends; also GPU time from CUDA
events: timing.PhaseTimer), peak memory in use and memory held at the end of forward, both above the
static floor (weights, main_grads, inputs: what is in use before a step; timing.active_bytes), and
the bytes Megatron moved to the CPU per step. Megatron's offload manager keeps the last layer's
group on the GPU after its warm-up step (so that backward need not wait for it): L-1 layers are
offloaded. Writes megatron_moe_layer_<GPU>.{json,md,png} into --out.

    python3 benchmarks/megatron_moe_layer.py [--layers 4 --variants stock-fuser,ours] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

from bench_common import cuda_problem, file_stem, pyplot, refuse, save_png, utc_now  # noqa: E402
from bench_common import write_reports as bench_common_write_reports  # noqa: E402
from timing import PhaseTimer, active_bytes, median  # noqa: E402

VARIANTS = {  # name -> (experts, use_transformer_engine_op_fuser, offload_modules)
    "stock-fuser": ("stock", True, ()),
    "stock-fuser/fused_group_mlp": ("stock", True, ("fused_group_mlp",)),
    "stock-modules": ("stock", False, ()),
    "stock-modules/expert_fc1": ("stock", False, ("expert_fc1",)),
    "stock-modules/moe_act": ("stock", False, ("moe_act",)),
    "ours": ("ours", True, ()),
    "ours/expert_fc1": ("ours", True, ("expert_fc1",)),
    "ours/moe_act": ("ours", True, ("moe_act",)),
    "ours/fused_group_mlp": ("ours", True, ("fused_group_mlp",)),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", "-E", type=int, default=8)
    p.add_argument("--hidden", "-H", type=int, default=2688)
    p.add_argument("--ffn", "-F", type=int, default=1856, help="moe_ffn_hidden_size")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--layers", "-L", type=int, default=4)
    p.add_argument("--min-offload-size", type=int, default=1024 * 1024,
                   help="Megatron's min_offloaded_tensor_size (elements; its default)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the first is Megatron's offload warmup)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for JSON, markdown, PNG")
    args = p.parse_args(argv)
    for name in ("experts", "hidden", "ffn", "seq", "batch", "topk", "layers", "warmup", "iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.layers < 2:
        p.error("--layers must be at least 2: Megatron keeps the last layer's offload group on the GPU")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    return args


def problem() -> str | None:
    """Why this benchmark cannot run here, or None."""
    if (found := cuda_problem()) is not None:
        return found
    from te_offload_ops.megatron import require_megatron

    try:
        require_megatron()
    except ImportError as exc:
        return str(exc)
    return None


# ------------------------------------------------------------------------------------------------
# Megatron set-up


def init_model_parallel(seed: int) -> bool:
    """torch.distributed with one rank (unless one is up already) and Megatron's model-parallel
    state of size 1. Returns whether it created the process group (the caller then destroys it)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.cuda.set_device(0)
    own_group = not torch.distributed.is_initialized()
    if own_group:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port)
        torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)  # nothing here uses gloo groups
    torch.manual_seed(seed)  # the router's weights are drawn on the host
    model_parallel_cuda_manual_seed(seed)
    return own_group


def make_config(args, *, op_fuser: bool, offload_modules: tuple[str, ...]):
    import torch
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    offload = dict(fine_grained_activation_offloading=True, offload_modules=list(offload_modules),
                   min_offloaded_tensor_size=args.min_offload_size) if offload_modules else {}
    return TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn, moe_ffn_hidden_size=args.ffn,
        num_attention_heads=8, num_moe_experts=args.experts, moe_router_topk=args.topk, moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_router_dtype="fp32",
        activation_func=squared_relu, use_fused_weighted_squared_relu=True, add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16, hidden_dropout=0.0, attention_dropout=0.0,
        use_transformer_engine_op_fuser=op_fuser, gradient_accumulation_fusion=True,
        overlap_dispatch_backward_with_experts_wgrad=True, **offload)


def build_layers(args, config, *, ours: bool, weights: list | None):
    """L MoE layers from Megatron's MoE spec (ours: with use_te_offload_ops), main_grads allocated."""
    import torch
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from te_offload_ops.megatron import use_te_offload_ops

    spec = get_moe_module_spec(use_te=True, num_experts=args.experts, moe_grouped_gemm=True)
    if ours:
        spec = use_te_offload_ops(spec)
    layers = []
    for i in range(args.layers):
        layer = spec(config=config, layer_number=i + 1).cuda().train()
        if weights is not None:
            layer.load_state_dict(weights[i])
        for p in layer.experts.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        layers.append(layer)
    return layers


def experts_path(layer) -> str:
    """What the experts ran: the op fuser's forward plan, or Megatron's module path."""
    ops = layer.experts._fused_ops
    if not layer.experts._with_fused_impl:
        return "TE modules"
    if ops is None:
        return "not run"
    return "+".join(type(op).__name__ for group in ops[0]._module_groups for op, _ in group._forward_ops)


@contextlib.contextmanager
def counting_offloads(moved: list):
    """Adds to moved[0] the bytes Megatron's fine-grained offloading copies to the CPU."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

    real = fgo.ChunkOffloadHandler.offload

    def counting(handler, src_tensor, *args, **kwargs):
        moved[0] += src_tensor.numel() * src_tensor.element_size()
        return real(handler, src_tensor, *args, **kwargs)

    fgo.ChunkOffloadHandler.offload = counting
    try:
        yield
    finally:
        fgo.ChunkOffloadHandler.offload = real


# ------------------------------------------------------------------------------------------------
# One variant


def measure(args, name: str, weights: list, inputs) -> dict:
    import torch
    from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
        FineGrainedActivationOffloadingInterface as off,
    )

    experts, op_fuser, modules = VARIANTS[name]
    config = make_config(args, op_fuser=op_fuser, offload_modules=modules)
    layers = build_layers(args, config, ours=experts == "ours", weights=weights)
    x, dy = inputs
    params = [p for layer in layers for p in layer.parameters()]
    off.reset_instance()
    moved = [0]

    def step(sync_after_forward: bool = False):
        for p in params:
            p.grad = None
        if modules:
            off.init_chunk_handler(pp_rank=0, vp_size=None, vp_stage=None,
                                   min_offloaded_tensor_size=config.min_offloaded_tensor_size,
                                   delta_offload_bytes_across_pp_ranks=0, activation_offload_fraction=1.0)
        torch.cuda.synchronize()
        timer = PhaseTimer()
        h = x
        for layer in layers:
            out, _ = layer(h)
            h = h + out
        timer.mark("fwd")
        held = None
        if sync_after_forward:
            held = active_bytes()  # (synchronizes)
        h.backward(dy)
        timer.mark("bwd")
        del h, out
        times = timer.finish()
        if modules:
            off.reset()
        return {"wall_ms": times["wall_ms"], "gpu_ms": times["gpu_ms"], "fwd_ms": times["fwd_ms"], "held": held}

    with counting_offloads(moved):
        for i in range(args.warmup):
            step()
            print(f"[megatron_moe_layer] {name}: warm-up step {i + 1}/{args.warmup}", flush=True)
        for p in params:  # the floor holds weights, main_grads and inputs only
            p.grad = None
        floor = active_bytes()
        torch.cuda.reset_peak_memory_stats()
        first = step(sync_after_forward=True)  # memory only: its sync after forward would skew the time
        peak = active_bytes(peak=True)
        moved[0] = 0
        times = []
        for i in range(args.iters):
            times.append(step())
            print(f"[megatron_moe_layer] {name}: step {i + 1}/{args.iters}: {times[-1]['wall_ms']:.2f} ms", flush=True)
        moved_per_step = moved[0] / args.iters
    path = experts_path(layers[0])
    fallback = None
    if path == "FusedScaledSReLUMLP":
        fallback = layers[0].experts.fused_ops._module_groups[0]._forward_ops[0][0].last_fallback_reasons
    del layers, params
    off.reset_instance()
    torch.cuda.empty_cache()
    wall = [t["wall_ms"] for t in times]
    return {
        "variant": name, "experts": experts, "op_fuser": op_fuser, "offload_modules": list(modules),
        "experts_path": path, "fallback_reasons": fallback,
        "step_ms": median(wall), "step_ms_min": min(wall), "step_ms_max": max(wall),
        "gpu_step_ms": median(t["gpu_ms"] for t in times),
        "fwd_ms": median(t["fwd_ms"] for t in times),
        "floor_MiB": floor / 2**20, "peak_above_floor_MiB": (peak - floor) / 2**20,
        "held_after_fwd_MiB": (first["held"] - floor) / 2**20, "offloaded_MiB_per_step": moved_per_step / 2**20,
    }


# ------------------------------------------------------------------------------------------------
# Reports


COLUMNS = [  # header, key, format
    ("variant", "variant", "{}"),
    ("experts ran as", "experts_path", "{}"),
    ("step ms", "step_ms", "{:.2f}"),
    ("GPU ms", "gpu_step_ms", "{:.2f}"),
    ("fwd ms", "fwd_ms", "{:.2f}"),
    ("peak MiB above floor", "peak_above_floor_MiB", "{:.0f}"),
    ("held MiB @fwd end", "held_after_fwd_MiB", "{:.0f}"),
    ("offloaded MiB/step", "offloaded_MiB_per_step", "{:.0f}"),
    ("vs stock-fuser", "speedup", "{:.2f}x"),
]


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# Megatron MoE layers on {result['gpu']} ({result['date']})",
        "",
        f"megatron-core {result['versions']['megatron-core']}, TE {result['versions']['transformer-engine']}, "
        f"torch {result['versions']['torch']}. {c['layers']} MoELayers (residual between them), E={c['experts']}, "
        f"top-{c['topk']}, H={c['hidden']}, F={c['ffn']}, {c['seq']}x{c['batch']} tokens, bf16, squared ReLU, "
        "main_grad accumulation, deferred wgrad; median of "
        f"{c['iters']} steps after {c['warmup']} warmup steps. Floor: memory allocated before a step "
        "(weights, main_grads, inputs). Megatron keeps the last layer's offload group on the GPU.",
        "",
        "| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for row in result["rows"]:
        lines.append("| " + " | ".join("-" if row.get(k) is None else f.format(row[k]) for _, k, f in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = result["rows"]
    xs = range(len(rows))
    colors = ["#dd8452" if r["experts"] == "ours" else "#888888" if r["op_fuser"] else "#4c72b0" for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(max(9, len(rows) * 1.1), 8), sharex=True)
    ax_t.bar(xs, [r["step_ms"] for r in rows], color=colors)
    ax_t.set_ylabel("step time (ms)")
    ax_m.bar(xs, [r["peak_above_floor_MiB"] for r in rows], color=colors, label="peak above floor")
    ax_m.bar(xs, [r["held_after_fwd_MiB"] for r in rows], color="none", edgecolor="black", hatch="//",
             label="held at end of forward")
    ax_m.set_ylabel("memory above floor (MiB)")
    ax_m.legend(loc="upper left")
    ax_m.set_xticks(list(xs), [r["variant"] for r in rows], rotation=35, ha="right", fontsize=8)
    c = result["config"]
    fig.suptitle(f"Megatron MoE layers, {result['gpu']}: {c['layers']} layers, E={c['experts']}, H={c['hidden']}, "
                 f"F={c['ffn']}, {c['seq'] * c['batch']} tokens top-{c['topk']} (grey: stock op fuser, "
                 "blue: stock modules, orange: ours)", fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return True


def write_reports(result: dict, folder: Path) -> list[Path]:
    return bench_common_write_reports(folder, file_stem("megatron_moe_layer", result["gpu"]), result, markdown, chart)


def add_speedups(rows: list[dict]) -> None:
    """Each row's step time against stock-fuser without offloading, where that row was run."""
    ref = next((r for r in rows if r["variant"] == "stock-fuser"), None)
    for r in rows:
        r["speedup"] = ref["step_ms"] / r["step_ms"] if ref else None


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    reason = problem()
    if reason:
        return refuse("megatron_moe_layer.py", reason)

    import torch
    import transformer_engine
    from importlib.metadata import version

    from te_offload_ops.megatron import installed_version

    init_model_parallel(args.seed)
    gpu = torch.cuda.get_device_name()
    tokens = args.seq * args.batch
    print(f"Megatron MoE layers on {gpu}: L={args.layers} E={args.experts} H={args.hidden} F={args.ffn} "
          f"tokens={tokens} top-{args.topk} ({tokens * args.topk // args.experts} rows per expert on average)",
          flush=True)
    # One set of weights and inputs for every variant, from stock layers.
    reference = build_layers(args, make_config(args, op_fuser=True, offload_modules=()), ours=False, weights=None)
    weights = [{k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in layer.state_dict().items()}
               for layer in reference]  # on the CPU: not part of any variant's memory
    del reference
    torch.cuda.empty_cache()
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    x = torch.randn(args.seq, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g,
                    requires_grad=True)
    dy = torch.randn(args.seq, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)

    rows, start = [], time.perf_counter()
    for i, name in enumerate(args.variants, 1):
        print(f"[megatron_moe_layer] variant {i}/{len(args.variants)}: {name} | elapsed "
              f"{time.perf_counter() - start:.0f} s", flush=True)
        row = measure(args, name, weights, (x, dy))
        rows.append(row)
        print(f"[megatron_moe_layer] variant {i}/{len(args.variants)}: {name:28s} {row['experts_path']:20s} step {row['step_ms']:8.2f} ms  "
              f"peak+{row['peak_above_floor_MiB']:7.0f} MiB  held+{row['held_after_fwd_MiB']:7.0f} MiB  "
              f"offloaded {row['offloaded_MiB_per_step']:7.0f} MiB/step", flush=True)
    add_speedups(rows)
    result = {
        "benchmark": "megatron_moe_layer", "gpu": gpu,
        "date": utc_now(),
        "versions": {"megatron-core": installed_version(), "transformer-engine": transformer_engine.__version__,
                     "torch": torch.__version__, "te-offload-ops": _package_version(version)},
        "config": {k: getattr(args, k) for k in ("experts", "hidden", "ffn", "seq", "batch", "topk", "layers",
                                                 "min_offload_size", "warmup", "iters", "seed")},
        "rows": rows,
    }
    paths = write_reports(result, args.out)
    print("\nwrote " + ", ".join(str(p) for p in paths))
    torch.distributed.destroy_process_group()
    return 0


def _package_version(version) -> str:
    try:
        return version("te-offload-ops")
    except Exception:  # noqa: BLE001 (a checkout that is not installed)
        import te_offload_ops

        return te_offload_ops.__version__


if __name__ == "__main__":
    sys.exit(main())
