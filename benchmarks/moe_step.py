#!/usr/bin/env python3
"""The main job: what activation offload costs in a training step of MoE transformer layers, per
policy, and how many more tokens per step it fits under a GPU memory cap.

Each layer is built from Transformer Engine's parts and this package's grouped MLP
(benchmarks/moe_model.py): LayerNormLinear qkv, causal attention, Linear proj, LayerNorm, a top-k
softmax router, TE's moe_permute_with_probs / moe_unpermute, and
te.ops.Sequential(GroupedLinear, ScaledSReLU, GroupedLinear). A step is forward, backward and an
AdamW step, with grads kept in preallocated buffers.

Each engine runs in a process of its own (TE picks its offload engine when it is imported): TE V2
(``v2``), TE V1 (``v1``) and this package's ``teo``, with variants of teo by name. Policies: "MLP
n/L" offloads the grouped MLP of the first n layers, "layer n/L" whole layers. Per engine and
policy it reports

* what offload costs: step time and tokens/s against no offload in the same process, peak memory
  above the static floor over the whole step, bytes moved to the host, peak freed per byte moved,
  and the PCIe bound from the bandwidth measured in the same process;
* tokens under a cap: the most sequences per step that fit under a memory cap without offload
  and with the policies predicted to fit the most (at most 5% slower, and of all), predicted from
  the measured peak per sequence and confirmed by runs with the allocator limited to the cap.

It prints a progress line per step (elapsed time and an estimate of the time left) and writes
JSON, markdown and a PNG (step time against peak memory; tokens per step under the cap) into
--out. --memory-target names the fastest measured policy whose peak meets it.

    python3 benchmarks/moe_step.py            # the default: shape base, engines teo and v2,
                                              # MLP L/2, L-1, L and layer L/2, a short cap search;
                                              # made to end within 5 minutes on one H100
    python3 benchmarks/moe_step.py --full     # shapes base and moe-heavy, engines v2, v1, teo,
                                              # eight policies, a longer cap search
    python3 benchmarks/moe_step.py --quick    # a small smoke run of every engine and policy

With --profile POLICY[,...] it measures nothing of the above: for each engine and the policies
named it runs a few steps after warm-up under torch.profiler and writes where the time goes
(benchmarks/step_profile.py: phases, compute-stream busy and idle time with causes, copies by
direction with their overlap, per-layer offload and reload against compute) into
moe_step_profile_<GPU>[_unfused].{json,md,png}; --trace keeps the chrome traces.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

import step_profile  # noqa: E402
from bench_common import cuda_problem, file_stem, refuse, utc_now  # noqa: E402
from bench_common import write_reports as write_profile_reports  # noqa: E402
from timing import PhaseTimer, active_bytes, median, pcie_bandwidth  # noqa: E402
from moe_step_report import (  # noqa: E402
    GiB, MiB, cap_candidates, finish, oom_error, policy_label, predicted_batch, search_cap, write_reports,
)

# Shapes (per layer). "base": a mid-size MoE layer, the default. "moe-heavy": MoE activations
# dominate (many small experts, large top-k), as in Qwen3-30B-A3B or DeepSeek-V2-Lite. "wide": a
# 4096-wide model (Mixtral's width, eight experts, top-2): the forward's FLOPs per token grow with
# H^2, the MLP's saved bytes with H + F (2 x (H + F) per routed token), so more compute hides each
# byte moved. "big-ffn": Mixtral's width and FFN (H=4096, F=14336, eight experts) with top-4: MoE
# activations are about 65% of what a layer saves (saved bytes per token: about 19 H outside the MoE
# MLP, 2 top-k (H + F) in it), with about 2.8x base's forward FLOPs per saved byte (FLOPs per token
# 8 H^2 + 2 seq H + 4 top-k H F): the shape where offload buys the most tokens under a cap. Run it
# with --layers 4 on an 80 GB GPU (4.0 B parameters: about 32 GB of weights, grads and optimizer
# state). "wide" and "big-ffn" run only when named.
SHAPES = {
    "base": {"hidden": 2688, "heads": 21, "ffn": 1856, "experts": 8, "topk": 2},
    "moe-heavy": {"hidden": 2048, "heads": 16, "ffn": 1024, "experts": 64, "topk": 8},
    "wide": {"hidden": 4096, "heads": 32, "ffn": 2048, "experts": 8, "topk": 2},
    "big-ffn": {"hidden": 4096, "heads": 32, "ffn": 14336, "experts": 8, "topk": 4},
}
SHAPE_KEYS = ("hidden", "heads", "ffn", "experts", "topk")

# The environment each engine's process needs before TE is imported: "teo" and its variants read
# TE's marks with V2's semantics, so their processes run TE in V2 mode.
ENGINE_ENV = {
    "v2": {"NVTE_CPU_OFFLOAD_V1": "0"},
    "v1": {"NVTE_CPU_OFFLOAD_V1": "1"},
    # teo's copies whole unless named otherwise (a value exported in the shell would change them)
    "teo": {"NVTE_CPU_OFFLOAD_V1": "0", "TEO_OFFLOAD_COPY_CHUNK_MIB": "0"},
    "teo-p1": {"NVTE_CPU_OFFLOAD_V1": "0", "TEO_OFFLOAD_COPY_CHUNK_MIB": "0"},  # a fixed one-layer prefetch
    "teo-c16": {"NVTE_CPU_OFFLOAD_V1": "0", "TEO_OFFLOAD_COPY_CHUNK_MIB": "16"},  # teo copying in 16 MiB pieces
    "teo-m": {"NVTE_CPU_OFFLOAD_V1": "0", "TEO_OFFLOAD_COPY_CHUNK_MIB": "0"},  # teo releasing by memory
    # teo holding up to 2 / 4 GiB of uncopied bytes past their layer's release (max_held_bytes)
    "teo-h2": {"NVTE_CPU_OFFLOAD_V1": "0", "TEO_OFFLOAD_COPY_CHUNK_MIB": "0"},
    "teo-h4": {"NVTE_CPU_OFFLOAD_V1": "0", "TEO_OFFLOAD_COPY_CHUNK_MIB": "0"},
    # teo with a memory budget (memory_budget): the cap (or the GPU's memory) less --budget-margin
    "teo-b": {"NVTE_CPU_OFFLOAD_V1": "0", "TEO_OFFLOAD_COPY_CHUNK_MIB": "0"},
    # teo with the budget of a target peak: no offload's peak less --target-freed (all, by default)
    # of the bytes the policy moves, plus --target-slack; bytes go back (waited for) only where
    # memory would pass it, reloads start as it allows: the waits fall where they must
    "teo-t": {"NVTE_CPU_OFFLOAD_V1": "0", "TEO_OFFLOAD_COPY_CHUNK_MIB": "0"},
}
# benchmark names -> offload_context's engine, options
ENGINE_OPTIONS = {"teo-p1": ("teo", {"prefetch": 1}), "teo-c16": ("teo", {}), "teo-m": ("teo", {"release": "memory"}),
                  "teo-h2": ("teo", {"max_held_bytes": 2 << 30}), "teo-h4": ("teo", {"max_held_bytes": 4 << 30})}
TE_ENGINES = ("v2", "v1")
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
FUSION_ENV = "TEO_FUSED_SRELU_MLP"
ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"  # read by torch when it initialises CUDA: set before each child starts
ALLOC_ENV_NEW = "PYTORCH_ALLOC_CONF"  # its newer name; some torch versions read it first

# Presets; an explicit flag wins over any. 8 x 4096 tokens: 65 Ki routed tokens per step in the
# base shape (top-2), 256 Ki in moe-heavy (top-8), in the 10^5-10^6 a GPU trains on; with fewer the
# forward runs host-bound. The default's policies are a function of L (default_policies); --full's
# too (full_policies). Timed steps: a step's outliers are single slow steps, so the median of three
# holds where the default needs it.
DEFAULT = {"shapes": "base", "engines": "teo,v2", "layers": 8, "batch": 8, "warmup": 2, "iters": 3,
           "cap_seqs": 8, "cap_trials": 3, "cap_max_batch": 24}
FULL = {"shapes": "base,moe-heavy", "engines": "v2,v1,teo", "layers": 8, "batch": 8, "warmup": 2, "iters": 5,
        "cap_seqs": 8, "cap_trials": 4, "cap_max_batch": 32}
QUICK = {"shapes": "base", "engines": "v2,v1,teo", "layers": 4, "batch": 1, "warmup": 1, "iters": 3,
         "cap_seqs": 2, "cap_trials": 2, "cap_max_batch": 4}
PRESETS = {"default": DEFAULT, "full": FULL, "quick": QUICK}
CAP_TRIAL_STEPS = (1, 2)  # warm-up and timed steps of each run under the cap
CAP_SEARCHES = 3  # policies searched under the cap at most: no offload, the best fast one, the best overall


@dataclass(frozen=True)
class Policy:
    scope: str  # "none", "mlp" or "layer"
    layers: int  # how many layers, the first ones, are offloaded

    def label(self, total: int) -> str:
        return policy_label(self.scope, self.layers, total)


NO_OFFLOAD = Policy("none", 0)


def default_policies(layers: int) -> list[Policy]:
    """The default's: the MLP of half, all but one and all layers; whole layers, half."""
    mlp = sorted({n for n in (layers // 2, layers - 1, layers) if n > 0})
    return [Policy("mlp", n) for n in mlp] + [Policy("layer", max(1, layers // 2))]


def full_policies(layers: int) -> list[Policy]:
    """--full's and --quick's: the MLP of a quarter, half, three quarters, all but one and all
    layers; whole layers, a quarter to three quarters."""
    mlp = sorted({n for n in (layers // 4, layers // 2, 3 * layers // 4, layers - 1, layers) if n > 0})
    whole = sorted({n for n in (layers // 4, layers // 2, 3 * layers // 4) if n > 0}) or [1]
    return [Policy("mlp", n) for n in mlp] + [Policy("layer", n) for n in whole]


def parse_policies(text: str, layers: int) -> list[Policy]:
    """ "mlp:2,layer:4,mlp:all" -> policies; n is 1..L or "all"."""
    out = []
    for item in (s.strip() for s in text.split(",") if s.strip()):
        scope, _, n = item.partition(":")
        if scope not in ("mlp", "layer") or not n:
            raise ValueError(f"policy {item!r}: expected mlp:N or layer:N (N in 1..{layers} or 'all')")
        count = layers if n == "all" else int(n) if n.isdigit() else -1
        if not 1 <= count <= layers:
            raise ValueError(f"policy {item!r}: N must be in 1..{layers} or 'all'")
        if Policy(scope, count) not in out:
            out.append(Policy(scope, count))
    if not out:
        raise ValueError("no policies given")
    return out


def parse_profile_policies(text: str, layers: int) -> list[Policy]:
    """ "none,mlp:2" -> policies to profile: those of --policies, and "none" (no offload)."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    rest = [s for s in items if s != "none"]
    out = [NO_OFFLOAD] if "none" in items else []
    if rest:
        out += parse_policies(",".join(rest), layers)
    if not out:
        raise ValueError("--profile: no policies given (none, mlp:N or layer:N)")
    return out


def parse_caps(text: Optional[str], shapes: list[str]) -> dict[str, float]:
    """ "30" (every shape) or "base=24,moe-heavy=30" -> {shape: GiB}; shapes left out get an automatic cap."""
    if not text:
        return {}
    if "=" not in text:
        return dict.fromkeys(shapes, gib_value("--memory-cap", text))
    caps = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in shapes:
            raise ValueError(f"--memory-cap for {name!r}: not one of the shapes run ({', '.join(shapes)})")
        caps[name] = gib_value(f"--memory-cap for {name!r}", value)
    return caps


def gib_value(what: str, text) -> float:
    """A positive, finite number of GiB, or a ValueError naming ``what`` and the text given."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: {str(text).strip()!r} is not a number of GiB") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive, finite number of GiB, got {str(text).strip()!r}")
    return value


def check_alloc_conf(text: str) -> None:
    """The form of PYTORCH_CUDA_ALLOC_CONF (option:value, comma-separated; as PyTorch's parser,
    blanks do not count and empty parts are skipped): a typo in the form fails here, not in a child.
    (Option names and values are PyTorch's to check: they vary by version.)"""
    depth, item, items = 0, "", []
    for ch in "".join(text.split()):  # commas inside [...] (roundup_power2_divisions:[256:1,512:2]) do not separate
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    items.append(item)
    bad = [i for i in items if i and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*:\S+", i)]
    if depth or bad:
        raise ValueError(f"--alloc-conf: {text!r} is not option:value[,option:value...] "
                         f"(e.g. expandable_segments:True); bad part(s): {bad or [text]}")


def check_caps_fit(caps: dict[str, float], device_GiB: float, gpu: str) -> None:
    """Refuses caps above the GPU (exit status BAD_ARGS_EXIT): the allocator's fraction stops at
    1.0, so such a cap would be reported, not enforced."""
    over = {name: cap for name, cap in caps.items() if cap > device_GiB}
    if over:
        print(f"moe_step.py: --memory-cap {format_caps(over)} is above this GPU's {device_GiB:.3f} GiB ({gpu})",
              file=sys.stderr)
        raise SystemExit(BAD_ARGS_EXIT)


BAD_ARGS_EXIT = 3  # a child found the arguments unusable on this GPU: the other engines' would too


def format_caps(caps: dict[str, float]) -> str:
    return ",".join(f"{name}={value:g}" for name, value in caps.items())


def schedule_notes(engine: str, layers: int, total: int) -> list[str]:
    """What to know about a row beyond its numbers: where TE's own schedules are out of their depth."""
    notes = []
    if engine == "v2" and total > 1 and layers == total - 1:
        notes.append("TE V2 at n = L-1: each layer's offload must end when the next layer starts")
    if engine in TE_ENGINES and layers == total:
        notes.append("n = L: TE's default schedule does not offload every layer")
    elif layers == total:
        notes.append("n = L: the layer whose backward comes first is back on the GPU when the backward begins "
                     "(under any schedule), so at most (L-1)/L of the bytes are freed at that peak")
    return notes


def auto_cap_GiB(floor_MiB: float, none_peak_above_MiB: float, batch: int, seqs: int, device_GiB: float) -> float:
    """Room for ``seqs`` sequences at the no-offload peak per sequence, rounded up to 0.5 GiB, below the device's size."""
    want = (floor_MiB + none_peak_above_MiB / batch * seqs) / 1024
    return min(math.ceil(want * 2) / 2, math.floor(device_GiB) - 1)


def _preset_help(preset: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in preset.items())


FULL_POLICIES_HELP = "the MLP of L/4, L/2, 3L/4, L-1 and L layers; L/4, L/2 and 3L/4 whole layers"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--full", action="store_true",
                        help=f"the whole sweep: {_preset_help(FULL)}; policies: {FULL_POLICIES_HELP}")
    preset.add_argument("--quick", action="store_true",
                        help=f"a small smoke run: {_preset_help(QUICK)}; policies: {FULL_POLICIES_HELP}")
    p.add_argument("--shapes", help=f"comma-separated, from {', '.join(SHAPES)} (default {DEFAULT['shapes']})")
    for key in SHAPE_KEYS:
        p.add_argument(f"--{key}", type=int, help=f"{key} for every shape run (default: the shape's)")
    p.add_argument("--layers", "-L", type=int, help=f"layers (default {DEFAULT['layers']})")
    p.add_argument("--batch", type=int, help=f"sequences per step (default {DEFAULT['batch']})")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--attention", choices=["sdpa", "te"], default="sdpa",
                   help="torch SDPA on contiguous q, k, v, or TE's DotProductAttention")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--engines", help=f"comma-separated, from {', '.join(ENGINE_ENV)} (default {DEFAULT['engines']})")
    p.add_argument("--policies", help="comma-separated mlp:N / layer:N (N = layers offloaded, or 'all'); default: "
                                      "the MLP of L/2, L-1 and L layers and L/2 whole layers")
    p.add_argument("--unfused", action="store_true",
                   help=f"run this package's MLP ops unfused, through TE's path ({FUSION_ENV}=0)")
    p.add_argument("--warmup", type=int, help=f"untimed steps per policy (default {DEFAULT['warmup']})")
    p.add_argument("--iters", type=int, help=f"timed steps per policy (default {DEFAULT['iters']})")
    p.add_argument("--memory-cap", help="GiB of GPU memory for the tokens-under-a-cap search: one number, or "
                                        "shape=GiB,...; default per shape: the static floor plus --cap-seqs "
                                        "sequences at the no-offload peak (found by the first engine's process)")
    p.add_argument("--cap-seqs", type=int,
                   help=f"sequences the automatic cap leaves room for (default {DEFAULT['cap_seqs']})")
    p.add_argument("--cap-slowdown", type=float, default=0.05,
                   help="also search the policy fitting the most tokens among those at most this much slower")
    p.add_argument("--cap-trials", type=int,
                   help=f"runs under the cap per policy searched (default {DEFAULT['cap_trials']})")
    p.add_argument("--cap-max-batch", type=int,
                   help=f"most sequences per step tried (default {DEFAULT['cap_max_batch']})")
    p.add_argument("--no-cap", action="store_true", help="skip the tokens-under-a-cap search")
    p.add_argument("--budget-margin", type=float, default=2.0,
                   help="GiB: engine teo-b's memory_budget is the cap (under the cap search; else the GPU's "
                        "memory) less this much, the room left for what ops allocate between the engine's looks")
    p.add_argument("--target-slack", type=float, default=0.0,
                   help="GiB: engine teo-t's memory_budget is the static floor plus no offload's peak less the "
                        "bytes the policy moves (times --target-freed), plus this much")
    p.add_argument("--target-freed", type=float, default=1.0,
                   help="fraction of the bytes the policy moves that engine teo-t's budget frees at the peak "
                        "(default 1: all): the rest may still be copying there, which spares the step waits "
                        "where copies are as slow as the forward")
    p.add_argument("--alloc-conf", default="",
                   help=f"{ALLOC_ENV} for each engine's process, e.g. expandable_segments:True (as Megatron-Core "
                        "runs commonly use: it avoids the fragmentation that can fail a run under a cap well "
                        "above its active peak); default: as in the environment")
    p.add_argument("--memory-target", type=float, help="GiB: name the fastest measured policy whose peak meets it")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for JSON, markdown, PNG")
    p.add_argument("--profile", metavar="POLICY[,POLICY...]",
                   help="instead of the measurements: profile these policies (none, mlp:N, layer:N) of each "
                        "engine under torch.profiler and write moe_step_profile_<GPU>[_unfused].{json,md,png}")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps per engine and policy (after warm-up)")
    p.add_argument("--trace", action="store_true", help="with --profile: keep each chrome trace (.json.gz) in --out")
    p.add_argument("--child", choices=list(ENGINE_ENV), help=argparse.SUPPRESS)
    p.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--clock", help=argparse.SUPPRESS)  # the parent's start and this child's launch (epoch s)
    args = p.parse_args(argv)

    args.preset = "full" if args.full else "quick" if args.quick else "default"
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    names = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in names if s not in SHAPES]
    if unknown or not names:
        p.error(f"--shapes: {unknown or 'none given'}; choose from {', '.join(SHAPES)}")
    args.shapes = {name: {k: getattr(args, k) or SHAPES[name][k] for k in SHAPE_KEYS} for name in names}
    for name, shape in args.shapes.items():
        if shape["hidden"] % shape["heads"]:
            p.error(f"shape {name}: hidden={shape['hidden']} is not a multiple of heads={shape['heads']}")
        if not 0 < shape["topk"] <= shape["experts"]:
            p.error(f"shape {name}: topk={shape['topk']} must be in 1..experts={shape['experts']}")
        if any(v <= 0 for v in shape.values()):
            p.error(f"shape {name}: every dimension must be positive, got {shape}")
    for key in ("layers", "batch", "seq", "iters", "cap_seqs", "cap_trials", "cap_max_batch"):
        if getattr(args, key) <= 0:
            p.error(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if not (math.isfinite(args.budget_margin) and args.budget_margin >= 0):
        p.error(f"--budget-margin must be a finite number of GiB >= 0, got {args.budget_margin}")
    if not (math.isfinite(args.target_slack) and args.target_slack >= 0):
        p.error(f"--target-slack must be a finite number of GiB >= 0, got {args.target_slack}")
    if not (math.isfinite(args.target_freed) and 0 < args.target_freed <= 1):
        p.error(f"--target-freed must be a fraction in (0, 1] of the bytes moved, got {args.target_freed}")
    if not (math.isfinite(args.cap_slowdown) and args.cap_slowdown >= 0):
        p.error(f"--cap-slowdown must be a finite fraction >= 0 (0.05: up to 5% slower), got {args.cap_slowdown}")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not args.engines or any(e not in ENGINE_ENV for e in args.engines):
        p.error(f"--engines takes {', '.join(ENGINE_ENV)}, got {args.engines}")
    if args.profile_steps <= 0:
        p.error(f"--profile-steps must be positive, got {args.profile_steps}")
    if args.trace and not args.profile:
        p.error("--trace needs --profile")
    try:
        args.clock = [float(x) for x in args.clock.split(",")] if args.clock else None
    except ValueError:
        p.error(f"--clock: {args.clock!r}")
    try:
        args.profile = parse_profile_policies(args.profile, args.layers) if args.profile else None
        preset_policies = default_policies if args.preset == "default" else full_policies
        args.policies = parse_policies(args.policies, args.layers) if args.policies else preset_policies(args.layers)
        args.caps = parse_caps(args.memory_cap, list(args.shapes))
        if args.memory_target is not None:
            args.memory_target = gib_value("--memory-target", args.memory_target)
        if args.alloc_conf:
            check_alloc_conf(args.alloc_conf)
    except ValueError as exc:
        p.error(str(exc))
    return args


# ------------------------------------------------------------------------------------------------
# Child: one engine, every shape


def _empty_host_cache() -> None:
    import torch

    if "te_offload_ops.engines_teo" in sys.modules:  # teo's pool holds its pinned buffers for reuse
        sys.modules["te_offload_ops.engines_teo"].free_pinned_buffers()

    empty = getattr(torch._C, "_host_emptyCache", None)  # torch's pinned-memory cache
    if empty is not None:
        empty()


def release_te_offload_state() -> int:
    """After a failed step: TE V2's offload synchronizers let go of the tensors they hold. A step
    that fails mid-forward leaves its synchronizer holding the saved GPU tensors, and its autograd
    graph holds the synchronizer (the unpack hooks, the layer-output prehook): a cycle through C++
    graph nodes, which gc cannot break, so that the next runs (a cap search's larger batches) would
    fail for want of that memory. Returns how many synchronizers were found."""
    te_offload = sys.modules.get("transformer_engine.pytorch.cpu_offload")
    kind = getattr(te_offload, "OffloadSynchronizer", None)
    if kind is None:
        return 0
    found = [o for o in gc.get_objects() if issubclass(type(o), kind)]  # (isinstance would wake lazy modules)
    for sync in found:
        for state in getattr(sync, "layer_states", {}).values():
            state.release_all_memory()
    return len(found)


def target_budget(*, floor_bytes: int, no_offload_peak_bytes: int, moved_bytes: int, num_layers: int,
                  model_layers: int, freed: float, slack_bytes: int = 0) -> int:
    """teo's memory_budget for a target peak: the static floor plus no offload's peak above it, less
    ``freed`` of the bytes the policy moves, plus ``slack_bytes``; at n = L, of (L - 1) / L of them
    (the layer whose backward comes first is back on the GPU at the peak under any schedule). The
    package's ``te_offload_ops.engines.target_budget`` where it has one, else the same formula."""
    try:
        from te_offload_ops.engines import target_budget as package_target_budget
    except ImportError:
        if num_layers == model_layers:
            moved_bytes = moved_bytes * (model_layers - 1) // model_layers
        return int(floor_bytes + no_offload_peak_bytes - moved_bytes * freed + slack_bytes)
    return package_target_budget(floor_bytes=floor_bytes, no_offload_peak_bytes=no_offload_peak_bytes,
                                 moved_bytes=moved_bytes, num_layers=num_layers, model_layers=model_layers,
                                 freed=freed, slack_bytes=slack_bytes)


FIRST_STEP = "first step (kernels compile, the optimizer state is allocated)"


class StepBench:
    """One model of one shape, its optimizer and preallocated grads, and the runs of its policies."""

    progress: Optional["Progress"] = None
    ticks = 0
    where = ""

    def __init__(self, name: str, shape: dict, args, engine: str, progress: Optional["Progress"] = None):
        import torch

        from moe_model import LayerShape, build_stack, compute_path

        self.torch, self.args, self.engine, self.name = torch, args, engine, name
        self.cap_bytes = None  # bytes: the allocator's limit while a run under the cap is on
        self.budget_waits = None  # teo-b / teo-t: the budget's counts per timed step in the last run (_steps)
        self.none_peak_MiB: dict[int, float] = {}  # batch -> no offload's peak above the floor (teo-t's target)
        self.moved_bytes: dict[tuple, int] = {}  # (scope, layers, batch) -> bytes plain teo moves in a step
        self.mark = lambda phase: contextlib.nullcontext()  # step_profile.phase_mark while profiling
        self.progress: Optional[Progress] = progress
        self.where, self.ticks = FIRST_STEP, 0  # what the progress lines say is running; steps done
        self.L, self.seq = args.layers, args.seq
        self.hidden = shape["hidden"]
        self.dtype = getattr(torch, DTYPES[args.dtype])
        self.stack = build_stack(LayerShape(**shape), args.layers, self.dtype, args.attention)
        self.params = [p for p in self.stack.parameters() if p.requires_grad]
        for p in self.params:  # grads live in buffers of their own for the whole run, as main_grad would
            p.grad = torch.zeros_like(p)
        self.opt = torch.optim.AdamW(self.params, lr=1e-6, fused=True)
        # one step allocates the optimizer state and the workspaces that stay between steps
        self._steps(NO_OFFLOAD, args.batch, count=1)
        self.path = compute_path(self.stack)
        torch.cuda.synchronize()
        gc.collect()
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts) / MiB  # noqa: E731
        state = [t for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.is_cuda]
        self.floor_MiB = active_bytes() / MiB
        parts = {"params_MiB": nbytes(self.params), "grads_MiB": nbytes([p.grad for p in self.params]),
                 "optimizer_MiB": nbytes(state)}
        self.floor = {"floor_MiB": self.floor_MiB, **parts, "other_MiB": self.floor_MiB - sum(parts.values())}

    def _inputs(self, batch: int):
        torch = self.torch
        g = torch.Generator(device="cuda").manual_seed(batch)
        shape = (batch * self.seq, self.hidden)
        x = torch.randn(shape, device="cuda", dtype=self.dtype, generator=g)  # the embedding's output
        dy = torch.randn(shape, device="cuda", dtype=self.dtype, generator=g)  # what the head sends back
        return x, dy

    def _context(self, policy: Policy, batch: Optional[int] = None):
        from te_offload_ops.engines import offload_context

        if policy.scope == "none":
            return offload_context("none", num_layers=0, model_layers=self.L)
        engine, options = ENGINE_OPTIONS.get(self.engine, (self.engine, {}))
        if self.engine == "teo-b":
            engine, options = "teo", {"memory_budget": self.memory_budget()}
        if self.engine == "teo-t":
            engine, options = "teo", {"memory_budget": self.target_budget(policy, batch or self.args.batch)}
        return offload_context(engine, num_layers=policy.layers, model_layers=self.L, **options)

    def target_budget(self, policy: Policy, batch: int) -> int:
        """teo-t's budget (:func:`target_budget`): the floor, no offload's peak at ``batch``
        (measured in this process, else scaled by sequences from the batch measured; one step of it
        first where none ran), the bytes plain teo moves in a step of this policy, --target-freed
        and --target-slack."""
        if not self.none_peak_MiB:  # (the measurements run no offload first; a profile may not)
            _, peak, _ = self._steps(NO_OFFLOAD, batch, count=1, warmup=1)
            self.none_peak_MiB[batch] = peak - self.floor_MiB
        measured = min(self.none_peak_MiB, key=lambda b: abs(b - batch))
        none_peak = self.none_peak_MiB[measured] * batch / measured
        key = (policy.scope, policy.layers, batch)
        if key not in self.moved_bytes:
            self.moved_bytes[key] = self._moved(policy, batch)
        return target_budget(floor_bytes=round(self.floor_MiB * MiB), no_offload_peak_bytes=round(none_peak * MiB),
                             moved_bytes=self.moved_bytes[key], num_layers=policy.layers, model_layers=self.L,
                             freed=self.args.target_freed, slack_bytes=round(self.args.target_slack * GiB))

    def _moved(self, policy: Policy, batch: int) -> int:
        """Bytes plain teo moves to the host in one step of ``policy`` at ``batch``: a step outside
        any cap in force (plain teo's peak is above teo-t's target), before the peak is measured."""
        from te_offload_ops.engines import offload_context

        torch = self.torch
        x, dy = self._inputs(batch)
        context = offload_context("teo", num_layers=policy.layers, model_layers=self.L)
        if self.cap_bytes is not None:
            self._limit_allocator(None)
        try:
            return self._step(x, dy, batch, policy, context)["offloaded"]
        finally:
            if self.cap_bytes is not None:
                self._limit_allocator(self.cap_bytes)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def under_cap(self, cap_GiB: Optional[float]):
        """Inside: the allocator refuses what would pass ``cap_GiB`` (None: no cap), and teo-b's
        budget comes from it; restored on the way out, whatever happened inside."""
        if cap_GiB is None:
            yield
            return
        torch = self.torch
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        self._limit_allocator(cap_GiB * GiB)
        self.cap_bytes = min(total, int(cap_GiB * GiB))
        try:
            yield
        finally:
            self._limit_allocator(None)
            self.cap_bytes = None

    def _limit_allocator(self, cap_bytes: Optional[float]) -> None:
        """The allocator refuses what would pass ``cap_bytes`` (None: the GPU's memory)."""
        torch = self.torch
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(1.0 if cap_bytes is None else min(1.0, cap_bytes / total))

    def memory_budget(self) -> int:
        """teo-b's budget: the cap in force (else the GPU's memory) less --budget-margin."""
        torch = self.torch
        limit = self.cap_bytes or torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return max(1, limit - int(self.args.budget_margin * GiB))

    def _step(self, x, dy, batch: int, policy: Policy, context) -> dict:
        from moe_model import forward_stack

        ctx, sync, counter = context
        counter.bytes.clear()
        timer = PhaseTimer()
        with self.mark("forward"):
            # a copy, so that the engine can free what it offloads: the model does not keep the embedding's output
            out = forward_stack(self.stack, x.clone(), batch, "layer" if policy.scope == "none" else policy.scope,
                                ctx, sync)
        timer.mark("fwd")
        with self.mark("backward"):
            out.backward(dy)
            del out
        timer.mark("bwd")
        with self.mark("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
        timer.mark("opt")
        t = timer.finish()
        return {"fwd_ms": t["fwd_ms"], "bwd_ms": t["bwd_ms"], "opt_ms": t["opt_ms"], "step_ms": t["gpu_ms"],
                "offloaded": counter.total}

    def _steps(self, policy: Policy, batch: int, count: int, warmup: int = 0, reuse: bool = True):
        """``warmup`` untimed then ``count`` timed steps; returns (samples, peak above floor MiB, held MiB)."""
        torch = self.torch
        x, dy = self._inputs(batch)
        held = self._context(policy, batch) if reuse else None
        steps = warmup + count
        for i in range(1, warmup + 1):
            sample = self._step(x, dy, batch, policy, held or self._context(policy, batch))
            self._tick(f"step {i}/{steps} (warm-up)", sample)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        engine = getattr(held[0], "engine", None) if held else None
        waits = (engine.budget_waits, engine.budget_wait_bytes, engine.reloads_deferred, engine.fits_given_up,
                 engine.reloads_started_early) if getattr(engine, "memory_budget", None) else None
        samples = []
        for i in range(warmup + 1, steps + 1):
            samples.append(self._step(x, dy, batch, policy, held or self._context(policy, batch)))
            self._tick(f"step {i}/{steps}", samples[-1])
        # teo-b / teo-t, per timed step: copies waited for to stay under the budget (count, MiB),
        # prefetches put off, the budget itself, fits given up, copies of put-off prefetches started
        self.budget_waits = None if waits is None else (
            (engine.budget_waits - waits[0]) / count, (engine.budget_wait_bytes - waits[1]) / count / MiB,
            (engine.reloads_deferred - waits[2]) / count, engine.memory_budget,
            (engine.fits_given_up - waits[3]) / count, (engine.reloads_started_early - waits[4]) / count)
        # active, not allocated: memory an engine handed back while its copy still reads it counts
        peak = active_bytes(peak=True) / MiB
        inputs_MiB = 2 * x.numel() * x.element_size() / MiB
        left = active_bytes() / MiB - inputs_MiB  # what the engine keeps between steps
        return samples, peak, left

    def _tick(self, what: str, sample: dict) -> None:
        """One step done: a progress line (where a Progress is attached)."""
        self.ticks += 1
        if self.progress is not None:
            self.progress.step(f"shape={self.name} {self.where} {what}: {sample['step_ms']:.1f} ms",
                               counted=self.where != FIRST_STEP)

    def _recover(self) -> None:
        torch = self.torch
        self.opt.zero_grad(set_to_none=False)
        torch.cuda.synchronize()  # the failed step's copies may still run
        released = release_te_offload_state()
        if released:
            print(f"[{self.engine} {self.name}] after the failed step: {released} of TE's offload synchronizers "
                  "let go of their tensors", flush=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        _empty_host_cache()

    def run(self, policy: Policy, batch: int, *, warmup: int, iters: int, reuse: bool = True) -> dict:
        """One policy at one batch; a row with the error instead of numbers where it failed."""
        torch = self.torch
        row = {"engine": self.engine, "scope": policy.scope, "layers": policy.layers,
               "policy": policy.label(self.L), "batch": batch, "tokens": batch * self.seq,
               "context": "reused" if reuse else "one per step", "floor_MiB": self.floor_MiB,
               "notes": schedule_notes(self.engine, policy.layers, self.L) if policy.scope != "none" else []}
        ticks = self.ticks
        try:
            samples, peak, left = self._steps(policy, batch, iters, warmup, reuse)
        except torch.cuda.OutOfMemoryError as exc:  # "out of memory (tried to allocate ...; ...)"
            row["error"], row["oom"] = oom_error(str(exc)), True
        except Exception as exc:  # noqa: BLE001 (an engine that cannot run a policy is a result)
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if self.progress is not None:  # the steps a failed run did not take
            self.progress.drop(warmup + iters - (self.ticks - ticks))
        if "error" in row:
            self._recover()
            return row
        med = lambda k: median(s[k] for s in samples)  # noqa: E731
        row.update({k: med(k) for k in ("step_ms", "fwd_ms", "bwd_ms", "opt_ms")})
        row.update({"step_ms_min": min(s["step_ms"] for s in samples), "step_ms_max": max(s["step_ms"] for s in samples),
                    "tokens_per_s": row["tokens"] / (row["step_ms"] / 1e3),
                    "peak_above_MiB": peak - self.floor_MiB, "offloaded_MiB": samples[-1]["offloaded"] / MiB,
                    "held_between_steps_MiB": left - self.floor_MiB})
        if self.budget_waits is not None:
            (row["budget_waits_per_step"], row["budget_wait_MiB_per_step"],
             row["budget_reloads_deferred_per_step"], budget, row["budget_fits_given_up_per_step"],
             row["budget_copies_reloaded_early_per_step"]) = self.budget_waits
            row["budget_GiB"] = budget / GiB
            row["notes"].append(f"budget {budget / GiB:.1f} GiB: waited for {self.budget_waits[0]:.0f} "
                                f"copies ({self.budget_waits[1]:.0f} MiB) per step to stay under it, put off "
                                f"{self.budget_waits[2]:.1f} prefetches, started {self.budget_waits[5]:.1f} copies "
                                f"of put-off prefetches in the room there was, gave up {self.budget_waits[4]:.1f} fits")
        if policy.scope == "none":
            self.none_peak_MiB[batch] = row["peak_above_MiB"]  # teo-t's target is against it
        if row["held_between_steps_MiB"] > 1:
            row["notes"].append(f"the engine holds {row['held_between_steps_MiB']:.0f} MiB between steps")
        return row

    def run_policy(self, policy: Policy) -> dict:
        """A reused context first (as in training); if that fails other than by OOM, one context per step."""
        a = self.args
        row = self.run(policy, a.batch, warmup=a.warmup, iters=a.iters)
        if row.get("error") and not row.get("oom") and policy.scope != "none":
            if self.progress is not None:
                self.progress.plan(a.warmup + a.iters)
            retry = self.run(policy, a.batch, warmup=a.warmup, iters=a.iters, reuse=False)
            if not retry.get("error"):
                retry["notes"].append(f"a reused context failed ({row['error']})")
                return retry
        return row

    def profile(self, policy: Policy, trace_path: Path) -> dict:
        """Warm-up steps, then --profile-steps steps under torch.profiler; their breakdown (or the error)."""
        a, torch = self.args, self.torch
        entry = {"engine": self.engine, "policy": policy.label(self.L), "scope": policy.scope, "layers": policy.layers}
        cap_GiB = a.caps.get(self.name)  # --memory-cap with --profile: profiled under it (the allocator limited)
        if cap_GiB is not None:
            entry["policy"] += f", under a {cap_GiB:g} GiB cap"
        with self.under_cap(cap_GiB):
            self._profile_into(entry, policy, trace_path)
        if "error" not in entry:
            entry["trace"] = trace_path.name if a.trace else None
        torch.cuda.synchronize()
        return entry

    def _profile_into(self, entry: dict, policy: Policy, trace_path: Path) -> None:
        a = self.args
        try:
            x, dy = self._inputs(a.batch)
            context = self._context(policy)
            step = lambda: self._step(x, dy, a.batch, policy, context)  # noqa: E731
            for _ in range(a.warmup):
                step()
            self.mark = step_profile.phase_mark
            try:
                names = step_profile.profile_steps(step, list(self.stack), a.profile_steps, trace_path)
            finally:
                self.mark = lambda phase: contextlib.nullcontext()
            entry.update(step_profile.analyze_trace(trace_path, names))
        except Exception as exc:  # noqa: BLE001 (an engine that cannot run a policy is a result)
            entry["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            self._recover()
        finally:
            if not a.trace:
                trace_path.unlink(missing_ok=True)

    def cap_trial(self, policy: Policy, batch: int, cap_GiB: float, reuse: bool) -> dict:
        torch = self.torch
        torch.cuda.empty_cache()
        _empty_host_cache()  # pinned buffers of other batch sizes would pile up on the host
        with self.under_cap(cap_GiB):  # the allocator refuses what would pass the cap: an OOM means it does not fit
            row = self.run(policy, batch, warmup=CAP_TRIAL_STEPS[0], iters=CAP_TRIAL_STEPS[1], reuse=reuse)
            # what the allocator held at most since the timed steps began (blocks the warm-up left
            # cached included): above the active peak by what fragmentation cost; None where the
            # run failed before it was read
            reserved = None if row.get("error") else torch.cuda.max_memory_reserved() / MiB
        fits = not row.get("error") and self.floor_MiB + row["peak_above_MiB"] <= cap_GiB * 1024
        return {"batch": batch, "fits": fits, "peak_above_MiB": row.get("peak_above_MiB") if fits else None,
                "reserved_peak_MiB": reserved, "step_ms": row.get("step_ms"), "tokens_per_s": row.get("tokens_per_s"),
                "fwd_ms": row.get("fwd_ms"), "bwd_ms": row.get("bwd_ms"), "error": row.get("error"),
                **{k: row[k] for k in ("budget_waits_per_step", "budget_wait_MiB_per_step",
                                       "budget_reloads_deferred_per_step", "budget_GiB",
                                       "budget_fits_given_up_per_step", "budget_copies_reloaded_early_per_step")
                   if k in row}}

    def cap_search(self, row: dict, cap_GiB: float) -> dict:
        a = self.args
        policy = Policy(row["scope"], row["layers"])
        cap_above = cap_GiB * 1024 - self.floor_MiB
        base = (row["batch"], row["peak_above_MiB"])

        def trial(batch: int) -> dict:
            self.where = (f"cap {cap_GiB:.1f} GiB policy={row['policy']} batch {batch} "
                          f"(trial {len(done) + 1}/{a.cap_trials})")
            t = self.cap_trial(policy, batch, cap_GiB, reuse=row["context"] == "reused")
            done.append(t)
            say(f"{self.where}: {batch} x {self.seq} tokens "
                + (f"fit, peak {(self.floor_MiB + t['peak_above_MiB']) / 1024:.1f} GiB "
                   f"(reserved {t['reserved_peak_MiB'] / 1024:.1f} GiB), {t['step_ms']:.0f} ms "
                   f"(fwd {t['fwd_ms']:.0f}, bwd {t['bwd_ms']:.0f})"
                   + (f", budget waits {t['budget_waits_per_step']:.0f} ({t['budget_wait_MiB_per_step']:.0f} MiB), "
                      f"prefetches put off {t.get('budget_reloads_deferred_per_step', 0):.1f}"
                      if "budget_waits_per_step" in t else "")
                   if t["fits"] else f"do not fit ({t['error'] or 'over the cap'})"), self)
            return t

        done: list[dict] = []
        trials, best, bracketed = search_cap(trial, base, cap_above, a.cap_max_batch, a.cap_trials)
        if self.progress is not None:  # the trials the search did not need
            self.progress.drop((a.cap_trials - len(trials)) * sum(CAP_TRIAL_STEPS))
        at = next((t for t in trials if t["fits"] and t["batch"] == best), {})
        return {"engine": self.engine, "scope": row["scope"], "layers": row["layers"], "policy": row["policy"],
                "predicted_batch": predicted_batch(row["peak_above_MiB"], row["batch"], cap_above),
                "batch": best, "bracketed": bracketed, "tokens": best * self.seq,
                "tokens_per_s": at.get("tokens_per_s"), "step_ms": at.get("step_ms"),
                "peak_above_MiB": at.get("peak_above_MiB"), "reserved_peak_MiB": at.get("reserved_peak_MiB"),
                "trials": trials}


def say(text: str, bench: Optional["StepBench"] = None, engine: Optional[str] = None) -> None:
    """A line of this job's output: ``[moe_step] engine=E shape=S text``."""
    who = f"engine={bench.engine} shape={bench.name} " if bench is not None else f"engine={engine} " if engine else ""
    print(f"[moe_step] {who}{text}", flush=True)


def clock_text(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """Progress lines of one engine's process: each step, the time since the job started, and an
    estimate of the time left: this process's steps still planned at the pace of those done
    (building the model apart), and each engine still to come as long as this one."""

    def __init__(self, engine: str, engines: list, started: float, launched: float):
        self.engine, self.index, self.count = engine, engines.index(engine), len(engines)
        self.started, self.launched = started, launched
        self.total = self.done = 0
        self.began: Optional[float] = None  # when the first planned step started

    def plan(self, steps: int) -> None:
        """``steps`` more steps to come."""
        self.total += steps

    def drop(self, steps: int) -> None:
        """``steps`` planned that will not run (a failed run, a search that settled early)."""
        self.total -= max(0, steps)

    def begin(self) -> None:
        """The planned steps start now: the time before is set-up (process start, model build)."""
        if self.began is None:
            self.began = time.time()

    def left_s(self, now: float) -> Optional[float]:
        """Seconds left by estimate, or None before a planned step is done."""
        if self.began is None or not self.done:
            return None
        pace = (now - self.began) / self.done
        setup = self.began - self.launched
        return (max(0, self.total - self.done) * pace
                + (self.count - self.index - 1) * (setup + self.total * pace))

    def step(self, text: str, counted: bool = True) -> None:
        """A line for a step just done; ``counted``: one of the steps planned."""
        now = time.time()
        if self.began is not None and counted:
            self.done += 1
        left = self.left_s(now)
        print(f"[moe_step] engine={self.engine} ({self.index + 1}/{self.count}) {text} | elapsed "
              f"{clock_text(now - self.started)}, left {'?' if left is None else '~' + clock_text(left)}", flush=True)


def steps_planned(args) -> int:
    """Steps one engine's process plans per shape: each policy's (no offload's too) and, unless
    --no-cap, every trial the cap searches may run."""
    if args.profile:
        return 0
    runs = (1 + len(args.policies)) * (args.warmup + args.iters)
    cap = 0 if args.no_cap else min(CAP_SEARCHES, 1 + len(args.policies)) * args.cap_trials * sum(CAP_TRIAL_STEPS)
    return runs + cap


def _row_line(bench: "StepBench", i: int, n: int, row: dict, ref: dict) -> None:
    head = f"policy={row['policy']} ({i}/{n})"
    if row.get("error"):
        say(f"{head} did not run: {row['error']}", bench)
        return
    vs = f", x{row['step_ms'] / ref['step_ms']:.3f} of no offload" if row is not ref and not ref.get("error") else ""
    say(f"{head}: step {row['step_ms']:.1f} ms{vs}, {row['tokens_per_s']:,.0f} tok/s, peak above floor "
        f"{row['peak_above_MiB']:.0f} MiB, offloaded {row['offloaded_MiB']:.0f} MiB"
        + (f" ({'; '.join(row['notes'])})" if row["notes"] else ""), bench)


def profile_stem(gpu: str, unfused: bool) -> str:
    return file_stem("moe_step_profile", gpu, "unfused" if unfused else "")


def profile_policy(bench: StepBench, args, policy: Policy) -> dict:
    import torch

    label = policy.label(args.layers)
    trace = args.out / (f"{profile_stem(torch.cuda.get_device_name(), args.unfused)}_{bench.name}_{bench.engine}_"
                        f"{label.replace(' ', '').replace('/', 'of')}.trace.json.gz")
    t0 = time.perf_counter()
    entry = bench.profile(policy, trace)
    head = f"profile policy={label}"
    if entry.get("error"):
        say(f"{head} did not run: {entry['error']}", bench)
        return entry
    m = entry["mean"]
    idle = ", ".join(f"{p} {v:.2f}" for p, v in m.get("idle_total_ms", {}).items())
    say(f"{head}: GPU {m['gpu_ms']:.1f} ms, compute busy {m['compute_busy_ms']:.1f} ms; idle ms: {idle} "
        f"({time.perf_counter() - t0:.0f} s)", bench)
    return entry


def run_child(args) -> None:
    import torch

    engine = args.child
    started, launched = args.clock or (time.time(), time.time())
    progress = Progress(engine, args.engines, started, launched)
    progress.plan(steps_planned(args) * len(args.shapes))
    alloc = allocator_setting()
    device_GiB = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB
    if (not args.no_cap and not args.profile) or (args.profile and args.caps):  # caps: the search, or a profile under one
        check_caps_fit(args.caps, device_GiB, torch.cuda.get_device_name())
    out = {"engine": engine, "gpu": torch.cuda.get_device_name(), "alloc_conf": alloc,
           "pcie": pcie_bandwidth(), "shapes": {}}
    p = out["pcie"]
    say(f"PCIe d2h {p['d2h_GBps']:.1f} GB/s, h2d {p['h2d_GBps']:.1f} GB/s, both {p['bidirectional_each_GBps']:.1f} "
        f"GB/s each", engine=engine)
    for name, shape in args.shapes.items():
        t0 = time.perf_counter()
        say(f"shape={name}: building the model and running its first step (kernels compile)", engine=engine)
        try:
            bench = StepBench(name, shape, args, engine, progress)
        except Exception as exc:  # noqa: BLE001 (one shape that does not fit must not cost the others)
            out["shapes"][name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            say(f"shape={name}: could not build and run the model: {out['shapes'][name]['error']}", engine=engine)
            progress.drop(steps_planned(args))
            gc.collect()
            torch.cuda.empty_cache()
            continue
        say(f"built in {time.perf_counter() - t0:.0f} s: MLP {bench.path}, static floor {bench.floor_MiB:.0f} MiB",
            bench)
        progress.begin()
        if args.profile:
            out["shapes"][name] = {"path": bench.path, "profiles": [profile_policy(bench, args, p) for p in args.profile]}
            del bench
            gc.collect()
            torch.cuda.empty_cache()
            continue
        plan = [NO_OFFLOAD] + args.policies
        rows = []
        for i, policy in enumerate(plan, 1):
            bench.where = f"policy={policy.label(args.layers)} ({i}/{len(plan)})"
            rows.append(bench.run_policy(policy))
            _row_line(bench, i, len(plan), rows[-1], rows[0])
        result = {"floor": bench.floor, "path": bench.path, "rows": rows}
        ref = rows[0]
        if not args.no_cap and not ref.get("error"):
            if name in args.caps:
                cap, how = args.caps[name], "given"
            else:
                cap = auto_cap_GiB(bench.floor_MiB, ref["peak_above_MiB"], args.batch, args.cap_seqs, device_GiB)
                how = (f"automatic: static floor + {args.cap_seqs} sequences at the no-offload peak per "
                       "sequence, rounded up to 0.5 GiB")
            cap_above = cap * 1024 - bench.floor_MiB
            picks = cap_candidates(rows, cap_above, args.batch, args.cap_slowdown)
            progress.drop((min(CAP_SEARCHES, len(plan)) - len(picks)) * args.cap_trials * sum(CAP_TRIAL_STEPS))
            say(f"tokens under a {cap:.1f} GiB cap ({how}): searching {', '.join(r['policy'] for r in picks)}", bench)
            result["cap"] = {"cap_GiB": cap, "how": how, "searches": [bench.cap_search(r, cap) for r in picks]}
        elif not args.no_cap:
            progress.drop(min(CAP_SEARCHES, len(plan)) * args.cap_trials * sum(CAP_TRIAL_STEPS))
        out["shapes"][name] = result
        del bench
        gc.collect()
        torch.cuda.empty_cache()
    args.child_out.write_text(json.dumps(out))


# ------------------------------------------------------------------------------------------------
# Parent: one process per engine, merged


def merge(args, children: list[dict]) -> dict:
    shapes = []
    for name, shape in args.shapes.items():
        runs = [{"engine": c["engine"], **c["shapes"][name]} for c in children if name in c["shapes"]]
        failed = {r["engine"]: r["error"] for r in runs if "error" in r}
        runs = [r for r in runs if "error" not in r]
        shapes.append({"name": name, "shape": shape, "layers": args.layers, "batch": args.batch, "seq": args.seq,
                       "dtype": args.dtype, "attention": args.attention,
                       "path": runs[0]["path"] if runs else None, "runs": runs, "failed": failed})
    return {
        "benchmark": "moe_step", "gpu": children[0]["gpu"],
        "date": utc_now(),
        "alloc_conf": alloc_conf(args, children),
        "config": {"engines": args.engines, "policies": [p.label(args.layers) for p in args.policies],
                   "warmup": args.warmup, "iters": args.iters, "unfused": args.unfused, "quick": args.quick,
                   "preset": args.preset, "cap_slowdown": args.cap_slowdown, "memory_target_GiB": args.memory_target,
                   "budget_margin_GiB": args.budget_margin, "target_slack_GiB": args.target_slack,
                   "target_freed": args.target_freed},
        "pcie": {c["engine"]: c["pcie"] for c in children},
        "shapes": shapes,
    }


def alloc_conf(args, children: list[dict]) -> str:
    """The PYTORCH_CUDA_ALLOC_CONF the engine processes ran under ("" when unset), as they saw it."""
    seen = [c["alloc_conf"] for c in children if "alloc_conf" in c]
    return seen[0] if seen else (args.alloc_conf or allocator_setting())


def allocator_setting() -> str:
    """The allocator setting this process's environment gives ("" when unset): the newer name wins where set."""
    return os.environ.get(ALLOC_ENV_NEW) or os.environ.get(ALLOC_ENV, "")


def child_env(args, engine: str) -> dict:
    """The environment of one engine's process: the engine's TE settings, and the allocator's if given."""
    env = dict(os.environ, **ENGINE_ENV[engine], PYTHONUNBUFFERED="1")
    if args.unfused:
        env[FUSION_ENV] = "0"
    if args.alloc_conf:
        env[ALLOC_ENV] = args.alloc_conf
        if ALLOC_ENV_NEW in env:  # would take precedence over the value given in some torch versions
            env[ALLOC_ENV_NEW] = args.alloc_conf
    return env


def merge_profiles(args, children: list[dict]) -> dict:
    shapes = []
    for name, shape in args.shapes.items():
        runs = [c["shapes"][name] for c in children if name in c["shapes"]]
        profiles = [p for r in runs for p in r.get("profiles", [])]
        failed = {c["engine"]: c["shapes"][name]["error"] for c in children if "error" in c["shapes"].get(name, {})}
        shapes.append({"name": name, "shape": shape, "layers": args.layers, "batch": args.batch, "seq": args.seq,
                       "dtype": args.dtype, "path": next((r["path"] for r in runs if "path" in r), None),
                       "profiles": profiles, "failed": failed})
    return {
        "benchmark": "moe_step_profile", "gpu": children[0]["gpu"],
        "date": utc_now(),
        "alloc_conf": alloc_conf(args, children),
        "config": {"engines": args.engines, "policies": [p.label(args.layers) for p in args.profile],
                   "warmup": args.warmup, "profile_steps": args.profile_steps, "unfused": args.unfused,
                   "quick": args.quick, "preset": args.preset, "trace": args.trace},
        "pcie": {c["engine"]: c["pcie"] for c in children},
        "shapes": shapes,
    }


def main(argv=None) -> int:
    started = time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    problem = cuda_problem()
    if problem:
        return refuse("moe_step.py", f"{problem}; it measures GPU memory, time and PCIe traffic")
    if args.child:
        run_child(args)
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    say(f"{args.preset} run: shapes {', '.join(args.shapes)}, L={args.layers}, {args.batch} x {args.seq} tokens, "
        f"engines {', '.join(args.engines)} (a process each), "
        f"policies {', '.join(p.label(args.layers) for p in args.policies)}"
        + (", MLP unfused" if args.unfused else "")
        + (f", {ALLOC_ENV}={args.alloc_conf}" if args.alloc_conf else "")
        + (f"; profiling {', '.join(p.label(args.layers) for p in args.profile)}" if args.profile else "")
        + ("" if args.profile or args.no_cap else f"; then the tokens-under-a-cap search, {args.cap_trials} trials "
           f"per policy searched"))
    children, failed, caps, how = [], [], dict(args.caps), {}
    for i, engine in enumerate(args.engines, 1):
        child_out = args.out / f".moe_step_child_{engine}.json"
        env = child_env(args, engine)
        extra = ["--memory-cap", format_caps(caps)] if caps and caps != args.caps else []
        say(f"engine {engine} ({i}/{len(args.engines)}): starting its process | elapsed "
            f"{clock_text(time.time() - started)}")
        cmd = [sys.executable, __file__, *argv, *extra, "--child", engine, "--child-out", str(child_out),
               "--clock", f"{started},{time.time()}"]
        code = subprocess.run(cmd, env=env).returncode
        if code == BAD_ARGS_EXIT:  # the same arguments would fail every engine's process
            return 2
        if code != 0 or not child_out.exists():
            print(f"moe_step.py: the {engine} process failed (output above)", file=sys.stderr)
            failed.append(engine)
            continue
        child = json.loads(child_out.read_text())
        child_out.unlink()
        for name, shape in child["shapes"].items():  # later engines run under the first one's caps
            if "cap" in shape:
                caps.setdefault(name, shape["cap"]["cap_GiB"])
                how.setdefault(name, shape["cap"]["how"])
                shape["cap"]["how"] = how[name]
        children.append(child)
    if not children:
        return 1
    if args.profile:
        result = merge_profiles(args, children)
        paths = write_profile_reports(args.out, profile_stem(result["gpu"], args.unfused), result,
                                      step_profile.markdown, step_profile.chart)
    else:
        result = merge(args, children)
        finish(result, args.memory_target)
        paths = write_reports(result, args.out, result_stem(result["gpu"], args))
    say(f"wrote {', '.join(str(p) for p in paths)} in {clock_text(time.time() - started)}")
    return 1 if failed else 0


def result_stem(gpu: str, args) -> str:
    """``moe_step_<GPU>_<shapes>``, then what sets the run apart: the MLP unfused, the preset
    (``full``, ``quick``), engines other than the preset's."""
    preset = PRESETS[args.preset]
    engines = "" if args.engines == preset["engines"].split(",") else "_".join(args.engines)
    return file_stem("moe_step", gpu, *args.shapes, "unfused" if args.unfused else "",
                     "" if args.preset == "default" else args.preset, engines)


if __name__ == "__main__":
    sys.exit(main())
