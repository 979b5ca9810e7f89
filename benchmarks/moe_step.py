#!/usr/bin/env python3
"""The main job: a training step of N MoE transformer layers with activations offloaded to CPU.

Each layer is built from Transformer Engine's parts and this package's grouped MLP
(benchmarks/moe_model.py): LayerNormLinear qkv, causal attention, Linear proj, LayerNorm, a top-k
softmax router, TE's moe_permute_with_probs / moe_unpermute, and
te.ops.Sequential(GroupedLinear, ScaledSReLU, GroupedLinear). A step is forward, backward and an
AdamW step, with grads kept in preallocated buffers.

For each engine (TE V2, TE V1, and this package's "teo" schedule on TE's marks; one process each,
as TE picks its engine at import) and policy
("MLP n/L": only the grouped MLP of the first n layers inside the offload context; "layer n/L":
whole layers) it reports step time and tokens/s, peak memory above the static floor over the whole
step, bytes offloaded, peak freed / bytes offloaded, the PCIe bound from bandwidth measured in the
same process, and the most tokens per step that fit under a memory cap with and without offload
(predicted from the measured peak per sequence, then confirmed by runs under the cap). It writes
JSON, markdown and a PNG (step time against peak memory) into --out; --memory-target names the
fastest measured policy whose peak meets it.

With --profile POLICY[,...] it measures nothing of the above: for each engine and the policies
named it runs a few steps after warm-up under torch.profiler and writes where the time goes
(benchmarks/step_profile.py: phases, compute-stream busy and idle time with causes, copies by
direction with their overlap, per-layer offload and reload against compute) into
moe_step_profile_<GPU>[_unfused].{json,md,png}; --trace keeps the chrome traces.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import re
import statistics
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
from bench_common import active_bytes, cuda_problem, file_stem, measure_pcie  # noqa: E402
from bench_common import write_reports as write_profile_reports  # noqa: E402
from moe_step_report import (  # noqa: E402
    GiB, MiB, cap_candidates, finish, oom_error, policy_label, predicted_batch, search_cap, write_reports,
)

# Shapes (per layer). "base": the step measured in issue 12 on an H100. "moe-heavy": MoE activations
# dominate (many small experts, large top-k), as in Qwen3-30B-A3B or DeepSeek-V2-Lite. "wide": a
# 4096-wide model (Mixtral's width, eight experts, top-2), more compute per byte saved: the forward's
# FLOPs per token grow with H^2, the MLP's saved bytes with H + F (2 x (H + F) per routed token), so
# by estimate from the base run (FLOPs scaled at base's speed) its 7 MLP copies take about 0.7 of
# the forward at 55 GB/s where base's take 1.0 (base: n = L-1 cannot reach 1.03x on PCIe; here it
# could). Named only: not in the default run. "big-ffn": Mixtral's width and FFN (H=4096, F=14336,
# eight experts) with top-4: MoE activations about 65% of what a layer saves, and about 2.8x
# base's forward FLOPs per saved byte (FLOPs per token 8 H^2 + 2 seq H + 4 top-k H F; saved bytes
# about 19 H (measured at base) + 2 top-k (H + F)), so by estimate the copies hidden in a forward
# 5% longer hold about 70% of its peak where base's hold a quarter: the shape where the
# tokens-under-a-cap target (1.5x at <= 5% slower) could be in reach. Run it with --layers 4 on an
# 80 GB GPU (4.0 B parameters: about 32 GB of weights, grads and optimizer state). Named only.
SHAPES = {
    "base": {"hidden": 2688, "heads": 21, "ffn": 1856, "experts": 8, "topk": 2},
    "moe-heavy": {"hidden": 2048, "heads": 16, "ffn": 1024, "experts": 64, "topk": 8},
    "wide": {"hidden": 4096, "heads": 32, "ffn": 2048, "experts": 8, "topk": 2},
    "big-ffn": {"hidden": 4096, "heads": 32, "ffn": 14336, "experts": 8, "topk": 4},
}
SHAPE_KEYS = ("hidden", "heads", "ffn", "experts", "topk")

# The environment each engine's process needs before TE is imported. An engine of this package
# (te_offload_ops.engines.offload_context) is one more entry here: "teo" reads TE's marks with
# V2's semantics, so its process runs TE in V2 mode.
ENGINE_ENV = {
    "v2": {"NVTE_CPU_OFFLOAD_V1": "0"},
    "v1": {"NVTE_CPU_OFFLOAD_V1": "1"},
    "teo": {"NVTE_CPU_OFFLOAD_V1": "0"},
    # teo with a memory budget (memory_budget): the cap (or the GPU's memory) less --budget-margin
    "teo-b": {"NVTE_CPU_OFFLOAD_V1": "0"},
    # teo with the budget of a target peak: no offload's peak less --target-freed (all, by default)
    # of the bytes the policy moves, plus --target-slack; bytes go back (waited for) only where
    # memory would pass it, reloads start as it allows: the waits fall where they must
    "teo-t": {"NVTE_CPU_OFFLOAD_V1": "0"},
}
# benchmark names -> offload_context's engine, options
ENGINE_OPTIONS: dict = {}
TE_ENGINES = ("v2", "v1")
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
FUSION_ENV = "TEO_FUSED_SRELU_MLP"
ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"  # read by torch when it initialises CUDA: set before each child starts
ALLOC_ENV_NEW = "PYTORCH_ALLOC_CONF"  # its newer name; some torch versions read it first

# Defaults of a full run and of --quick; an explicit flag wins over either.
# 8 x 4096 tokens: 65 Ki routed tokens per step in the base shape (top-2), 256 Ki in moe-heavy
# (top-8), in the 10^5-10^6 a GPU trains on; at 2 x 4096 the forward ran host-bound (its GPU
# span varied 25-35 ms between processes for the same work while the backward held at 47 ms).
FULL = {"shapes": "base,moe-heavy", "layers": 8, "batch": 8, "warmup": 2, "iters": 5,
        "cap_seqs": 8, "cap_trials": 4, "cap_max_batch": 32}
QUICK = {"shapes": "base", "layers": 4, "batch": 1, "warmup": 1, "iters": 3,
         "cap_seqs": 2, "cap_trials": 2, "cap_max_batch": 4}


@dataclass(frozen=True)
class Policy:
    scope: str  # "none", "mlp" or "layer"
    layers: int  # how many layers, the first ones, are offloaded

    def label(self, total: int) -> str:
        return policy_label(self.scope, self.layers, total)


NO_OFFLOAD = Policy("none", 0)


def default_policies(layers: int) -> list[Policy]:
    """MLP only: a quarter, half, three quarters, all but one, all; whole layers: a quarter to three quarters."""
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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"a short run: {', '.join(f'{k}={v}' for k, v in QUICK.items())}")
    p.add_argument("--shapes", help=f"comma-separated, from {', '.join(SHAPES)} (default {FULL['shapes']})")
    for key in SHAPE_KEYS:
        p.add_argument(f"--{key}", type=int, help=f"{key} for every shape run (default: the shape's)")
    p.add_argument("--layers", "-L", type=int, help=f"layers (default {FULL['layers']})")
    p.add_argument("--batch", type=int, help=f"sequences per step (default {FULL['batch']})")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--attention", choices=["sdpa", "te"], default="sdpa",
                   help="torch SDPA on contiguous q, k, v, or TE's DotProductAttention")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--engines", default="v2,v1,teo", help=f"comma-separated, from {', '.join(ENGINE_ENV)}")
    p.add_argument("--policies", help="comma-separated mlp:N / layer:N (N = layers offloaded, or 'all'); "
                                      "default: a quarter, half, three quarters, L-1 and L for the MLP, "
                                      "a quarter to three quarters for whole layers")
    p.add_argument("--unfused", action="store_true",
                   help=f"run this package's MLP ops unfused, through TE's path ({FUSION_ENV}=0)")
    p.add_argument("--warmup", type=int, help=f"untimed steps per policy (default {FULL['warmup']})")
    p.add_argument("--iters", type=int, help=f"timed steps per policy (default {FULL['iters']})")
    p.add_argument("--memory-cap", help="GiB of GPU memory for the tokens-under-a-cap search: one number, or "
                                        "shape=GiB,...; default per shape: the static floor plus --cap-seqs "
                                        "sequences at the no-offload peak (found by the first engine's process)")
    p.add_argument("--cap-seqs", type=int, help=f"sequences the automatic cap leaves room for (default {FULL['cap_seqs']})")
    p.add_argument("--cap-slowdown", type=float, default=0.05,
                   help="also search the policy fitting the most tokens among those at most this much slower")
    p.add_argument("--cap-trials", type=int, help=f"runs under the cap per policy searched (default {FULL['cap_trials']})")
    p.add_argument("--cap-max-batch", type=int, help=f"most sequences per step tried (default {FULL['cap_max_batch']})")
    p.add_argument("--no-cap", action="store_true", help="skip the tokens-under-a-cap search")
    p.add_argument("--budget-margin", type=float, default=2.0,
                   help="GiB: engine teo-b's memory_budget is the cap (under the cap search; else the GPU's "
                        "memory) less this much, the room left for what ops allocate between the engine's looks")
    p.add_argument("--target-slack", type=float, default=0.0,
                   help="GiB: engine teo-t's memory_budget is the static floor plus no offload's peak less the "
                        "bytes the policy moves (times --target-freed), plus this much")
    p.add_argument("--target-freed", type=float, default=1.0,
                   help="fraction of the bytes the policy moves that engine teo-t's budget frees at the peak "
                        "(default 1: all; issue 12's target is 0.95): the rest may still be copying there, "
                        "which spares the step waits where copies are as slow as the forward")
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
    args = p.parse_args(argv)

    for key, value in (QUICK if args.quick else FULL).items():
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
        args.profile = parse_profile_policies(args.profile, args.layers) if args.profile else None
        args.policies = parse_policies(args.policies, args.layers) if args.policies else default_policies(args.layers)
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

    if "te_offload_ops.engines" in sys.modules:  # teo's pool holds its pinned buffers for reuse
        sys.modules["te_offload_ops.engines"].free_pinned_buffers()

    empty = getattr(torch._C, "_host_emptyCache", None)  # torch's pinned-memory cache
    if empty is not None:
        empty()


def release_te_offload_state() -> int:
    """After a failed step: TE V2's offload synchronizers let go of the tensors they hold
    (``te_offload_ops.te_internals.release_offload_synchronizers``). A step that fails mid-forward
    leaves its synchronizer holding the saved GPU tensors, and its autograd graph holds the
    synchronizer: a cycle through C++ graph nodes, which gc cannot break. Returns how many
    synchronizers were found (none where TE's offload module was never imported)."""
    if "transformer_engine.pytorch.cpu_offload" not in sys.modules:
        return 0
    from te_offload_ops import te_internals

    return te_internals.release_offload_synchronizers()


class StepBench:
    """One model of one shape, its optimizer and preallocated grads, and the runs of its policies."""

    def __init__(self, name: str, shape: dict, args, engine: str):
        import torch

        from moe_model import LayerShape, build_stack, compute_path

        self.torch, self.args, self.engine, self.name = torch, args, engine, name
        self.cap_bytes = None  # bytes: the allocator's limit while a run under the cap is on
        self.budget_waits = None  # teo-b / teo-t: the budget's counts per timed step in the last run (_steps)
        self.none_peak_MiB: dict[int, float] = {}  # batch -> no offload's peak above the floor (teo-t's target)
        self.moved_bytes: dict[tuple, int] = {}  # (scope, layers, batch) -> bytes plain teo moves in a step
        self.mark = lambda phase: contextlib.nullcontext()  # step_profile.phase_mark while profiling
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
        """teo-t's budget: the floor plus no offload's peak at ``batch`` (measured in this process,
        else scaled by sequences from the batch measured; one step of it first where none ran) less
        --target-freed of what plain teo moves in a step of this policy (at n = L, of (L - 1) / L of
        it), plus --target-slack."""
        if not self.none_peak_MiB:  # (the measurements run no offload first; a profile may not)
            _, peak, _ = self._steps(NO_OFFLOAD, batch, count=1, warmup=1)
            self.none_peak_MiB[batch] = peak - self.floor_MiB
        measured = min(self.none_peak_MiB, key=lambda b: abs(b - batch))
        none_peak = self.none_peak_MiB[measured] * batch / measured
        key = (policy.scope, policy.layers, batch)
        if key not in self.moved_bytes:
            self.moved_bytes[key] = self._moved(policy, batch)
        from te_offload_ops.engines import target_budget

        return target_budget(floor_bytes=int(self.floor_MiB * MiB), no_offload_peak_bytes=int(none_peak * MiB),
                             moved_bytes=self.moved_bytes[key], num_layers=policy.layers, model_layers=self.L,
                             freed=self.args.target_freed, slack_bytes=int(self.args.target_slack * GiB))

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

        torch = self.torch
        ctx, sync, counter = context
        counter.bytes.clear()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record()
        with self.mark("forward"):
            # a copy, so that the engine can free what it offloads: the model does not keep the embedding's output
            out = forward_stack(self.stack, x.clone(), batch, "layer" if policy.scope == "none" else policy.scope,
                                ctx, sync)
        ev[1].record()
        with self.mark("backward"):
            out.backward(dy)
            del out
        ev[2].record()
        with self.mark("optimizer"):
            self.opt.step()
            self.opt.zero_grad(set_to_none=False)
        ev[3].record()
        torch.cuda.synchronize()
        fwd, bwd, opt = (ev[i].elapsed_time(ev[i + 1]) for i in range(3))
        return {"fwd_ms": fwd, "bwd_ms": bwd, "opt_ms": opt, "step_ms": fwd + bwd + opt, "offloaded": counter.total}

    def _steps(self, policy: Policy, batch: int, count: int, warmup: int = 0, reuse: bool = True):
        """``warmup`` untimed then ``count`` timed steps; returns (samples, peak above floor MiB, held MiB)."""
        torch = self.torch
        x, dy = self._inputs(batch)
        held = self._context(policy, batch) if reuse else None
        for _ in range(warmup):
            self._step(x, dy, batch, policy, held or self._context(policy, batch))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        engine = getattr(held[0], "engine", None) if held else None
        waits = (engine.budget_waits, engine.budget_wait_bytes, engine.reloads_deferred, engine.fits_given_up,
                 engine.reloads_started_early) if getattr(engine, "memory_budget", None) else None
        samples = [self._step(x, dy, batch, policy, held or self._context(policy, batch)) for _ in range(count)]
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
        try:
            samples, peak, left = self._steps(policy, batch, iters, warmup, reuse)
        except torch.cuda.OutOfMemoryError as exc:  # "out of memory (tried to allocate ...; ...)"
            row["error"], row["oom"] = oom_error(str(exc)), True
        except Exception as exc:  # noqa: BLE001 (an engine that cannot run a policy is a result)
            row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if "error" in row:
            self._recover()
            return row
        med = lambda k: statistics.median(s[k] for s in samples)  # noqa: E731
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
            row = self.run(policy, batch, warmup=1, iters=2, reuse=reuse)
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
            t = self.cap_trial(policy, batch, cap_GiB, reuse=row["context"] == "reused")
            print(f"[{self.engine} {self.name} cap {cap_GiB:.1f} GiB] {row['policy']:10s} {batch:3d} x {self.seq} tokens: "
                  + (f"fits, peak {(self.floor_MiB + t['peak_above_MiB']) / 1024:.1f} GiB "
                     f"(reserved {t['reserved_peak_MiB'] / 1024:.1f} GiB), {t['step_ms']:.0f} ms "
                     f"(fwd {t['fwd_ms']:.0f}, bwd {t['bwd_ms']:.0f})"
                     + (f", budget waits {t['budget_waits_per_step']:.0f} ({t['budget_wait_MiB_per_step']:.0f} MiB), "
                        f"prefetches put off {t.get('budget_reloads_deferred_per_step', 0):.1f}"
                        if "budget_waits_per_step" in t else "")
                     if t["fits"] else f"does not fit ({t['error'] or 'over the cap'})"), flush=True)
            return t

        trials, best, bracketed = search_cap(trial, base, cap_above, a.cap_max_batch, a.cap_trials)
        at = next((t for t in trials if t["fits"] and t["batch"] == best), {})
        return {"engine": self.engine, "scope": row["scope"], "layers": row["layers"], "policy": row["policy"],
                "predicted_batch": predicted_batch(row["peak_above_MiB"], row["batch"], cap_above),
                "batch": best, "bracketed": bracketed, "tokens": best * self.seq,
                "tokens_per_s": at.get("tokens_per_s"), "step_ms": at.get("step_ms"),
                "peak_above_MiB": at.get("peak_above_MiB"), "reserved_peak_MiB": at.get("reserved_peak_MiB"),
                "trials": trials}


def _progress(engine: str, name: str, i: int, n: int, row: dict) -> None:
    head = f"[{engine} {name} {i}/{n}] {row['policy']:10s}"
    if row.get("error"):
        print(f"{head} did not run: {row['error']}", flush=True)
        return
    print(f"{head} step {row['step_ms']:7.1f} ms  {row['tokens_per_s']:9,.0f} tok/s  "
          f"peak above floor {row['peak_above_MiB']:7.0f} MiB  offloaded {row['offloaded_MiB']:6.0f} MiB"
          + (f"  ({'; '.join(row['notes'])})" if row["notes"] else ""), flush=True)


def profile_stem(gpu: str, unfused: bool) -> str:
    return file_stem("moe_step_profile", gpu, "unfused" if unfused else "")


def profile_policy(bench: StepBench, args, policy: Policy) -> dict:
    import torch

    label = policy.label(args.layers)
    trace = args.out / (f"{profile_stem(torch.cuda.get_device_name(), args.unfused)}_{bench.name}_{bench.engine}_"
                        f"{label.replace(' ', '').replace('/', 'of')}.trace.json.gz")
    t0 = time.perf_counter()
    entry = bench.profile(policy, trace)
    head = f"[{bench.engine} {bench.name} profile] {label:10s}"
    if entry.get("error"):
        print(f"{head} did not run: {entry['error']}", flush=True)
        return entry
    m = entry["mean"]
    idle = ", ".join(f"{p} {v:.2f}" for p, v in m.get("idle_total_ms", {}).items())
    print(f"{head} GPU {m['gpu_ms']:.1f} ms, compute busy {m['compute_busy_ms']:.1f} ms; idle ms: {idle} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return entry


def run_child(args) -> None:
    import torch

    engine = args.child
    alloc = allocator_setting()
    device_GiB = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GiB
    if (not args.no_cap and not args.profile) or (args.profile and args.caps):  # caps: the search, or a profile under one
        check_caps_fit(args.caps, device_GiB, torch.cuda.get_device_name())
    out = {"engine": engine, "gpu": torch.cuda.get_device_name(), "alloc_conf": alloc,
           "pcie": measure_pcie(), "shapes": {}}
    p = out["pcie"]
    print(f"[{engine}] PCIe d2h {p['d2h_GBps']:.1f} GB/s, h2d {p['h2d_GBps']:.1f} GB/s, "
          f"both {p['bidirectional_each_GBps']:.1f} GB/s each", flush=True)
    for name, shape in args.shapes.items():
        t0 = time.perf_counter()
        try:
            bench = StepBench(name, shape, args, engine)
        except Exception as exc:  # noqa: BLE001 (one shape that does not fit must not cost the others)
            out["shapes"][name] = {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
            print(f"[{engine} {name}] could not build and run the model: {out['shapes'][name]['error']}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        print(f"[{engine} {name}] built in {time.perf_counter() - t0:.0f} s: MLP {bench.path}, "
              f"static floor {bench.floor_MiB:.0f} MiB", flush=True)
        if args.profile:
            out["shapes"][name] = {"path": bench.path, "profiles": [profile_policy(bench, args, p) for p in args.profile]}
            del bench
            gc.collect()
            torch.cuda.empty_cache()
            continue
        plan = [NO_OFFLOAD] + args.policies
        rows = []
        for i, policy in enumerate(plan, 1):
            rows.append(bench.run_policy(policy))
            _progress(engine, name, i, len(plan), rows[-1])
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
            result["cap"] = {"cap_GiB": cap, "how": how, "searches": [bench.cap_search(r, cap) for r in picks]}
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
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "alloc_conf": alloc_conf(args, children),
        "config": {"engines": args.engines, "policies": [p.label(args.layers) for p in args.policies],
                   "warmup": args.warmup, "iters": args.iters, "unfused": args.unfused, "quick": args.quick,
                   "cap_slowdown": args.cap_slowdown, "memory_target_GiB": args.memory_target,
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
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "alloc_conf": alloc_conf(args, children),
        "config": {"engines": args.engines, "policies": [p.label(args.layers) for p in args.profile],
                   "warmup": args.warmup, "profile_steps": args.profile_steps, "unfused": args.unfused,
                   "quick": args.quick, "trace": args.trace},
        "pcie": {c["engine"]: c["pcie"] for c in children},
        "shapes": shapes,
    }


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    problem = cuda_problem()
    if problem:
        print(f"moe_step.py: cannot run: {problem}; it measures GPU memory, time and PCIe traffic", file=sys.stderr)
        return 2
    if args.child:
        run_child(args)
        return 0

    args.out.mkdir(parents=True, exist_ok=True)
    print(f"MoE step: shapes {', '.join(args.shapes)}, L={args.layers}, {args.batch} x {args.seq} tokens, "
          f"engines {', '.join(args.engines)}, policies {', '.join(p.label(args.layers) for p in args.policies)}"
          + (", MLP unfused" if args.unfused else "")
          + (f", {ALLOC_ENV}={args.alloc_conf}" if args.alloc_conf else "")
          + (f"; profiling {', '.join(p.label(args.layers) for p in args.profile)}" if args.profile else ""), flush=True)
    start = time.perf_counter()
    children, failed, caps, how = [], [], dict(args.caps), {}
    for engine in args.engines:
        child_out = args.out / f".moe_step_child_{engine}.json"
        env = child_env(args, engine)
        extra = ["--memory-cap", format_caps(caps)] if caps and caps != args.caps else []
        cmd = [sys.executable, __file__, *argv, *extra, "--child", engine, "--child-out", str(child_out)]
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
        print(f"\nwrote {', '.join(str(p) for p in paths)} in {time.perf_counter() - start:.0f} s")
        return 1 if failed else 0
    result = merge(args, children)
    finish(result, args.memory_target)
    stem = file_stem("moe_step", result["gpu"], "unfused" if args.unfused else "", "quick" if args.quick else "")
    paths = write_reports(result, args.out, stem)
    print(f"\nwrote {', '.join(str(p) for p in paths)} in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
