"""Test helpers: training steps through TE's fused grouped MLP under an offload engine, judged by TE's saved slots.

Each step runs ``layers`` stacked MLPs under an MXFP8 or NVFP4 recipe; the bytes an engine moves
are attributed to the slot of TE 2.20's saved tuple they came from (layer, owning op(s), weight or
activation), from what TE's own forward saved (``watch_te_saves``), so the same accounting
serves this package's ops and TE's own. :func:`policy_problems` lists every way a step broke
the policy; the GPU tests assert the list is empty, and the V1 worker sends it back.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch
import transformer_engine.pytorch as te
from transformer_engine.common.recipe import MXFP8BlockScaling, NVFP4BlockScaling
from transformer_engine.pytorch.ops.fuser import OperationFuser

from offload_spy import SpyEngine
from te_fused_standins import TESave, carriers_of, make_ops, te_slot_owners, watch_te_saves
from te_offload_ops.engines import offload_context
from te_offload_ops.fused import fuse_te_grouped_mlp
from te_offload_ops.policy import MIN_OFFLOAD_NUMEL

RECIPES = {"mxfp8": MXFP8BlockScaling, "nvfp4": NVFP4BlockScaling}
OPS = ("fc1", "act", "fc2")
LARGE = MIN_OFFLOAD_NUMEL  # TE V2 offloads tensors of at least this many elements


# per-op offload flags (fc1, activation, fc2) and (activation, recipe) cases the GPU tests run
POLICIES = {
    "all": (True, True, True),
    "keep-fc1": (False, True, True),
    "keep-act": (True, False, True),
    "keep-fc2": (True, True, False),
}
CASES = {"srelu-mxfp8": ("srelu", "mxfp8"), "swiglu-nvfp4": ("swiglu", "nvfp4")}

@dataclass
class StepConfig:
    activation: str = "srelu"
    recipe: str = "mxfp8"
    offload: tuple = (True, True, True)  # fc1, activation, fc2
    stock: bool = False  # TE's own ops instead of this package's
    te_alone: bool = False  # this package's ops, but its Blackwell fusion left out: TE's op takes them
    layers: int = 2
    experts: int = 4
    hidden: int = 1024  # weights of 512 x 1024: large enough for V2 to move them if unmarked
    ffn: int = 512
    splits: tuple = (0, 700, 1329, 19)  # TE's fused MLP needs a multiple of 128 tokens in all
    seed: int = 7
    device: str = "cuda"


def make_stack(cfg: StepConfig) -> list:
    torch.manual_seed(cfg.seed)
    return [te.ops.Sequential(*make_ops(cfg.activation, stock=cfg.stock, experts=cfg.experts, hidden=cfg.hidden,
                                        ffn=cfg.ffn, offload=cfg.offload, device=cfg.device))
            for _ in range(cfg.layers)]


def make_inputs(cfg: StepConfig):
    """Input, per-layer probs, output grad and per-layer split sizes.

    Each layer gets its own split-sizes tensor, as each MoE layer routes its own tokens. They must
    not be one tensor: TE's fused op saves the caller's split sizes as its grouped inputs'
    ``first_dims`` and marks them for offload, and TE's V1 engine, once it has copied an offloaded
    layer's storages to the host, empties their data tensors in place (``.data = torch.Tensor()``),
    so a later layer that is not offloaded would find its split sizes empty in backward (TE's own
    op the same: not this package's routing).
    """
    dev = cfg.device
    g = torch.Generator(device=dev).manual_seed(cfg.seed + 1)
    tokens = sum(cfg.splits)
    x = torch.randn(tokens, cfg.hidden, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    probs = [torch.rand(tokens, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
             for _ in range(cfg.layers)]
    dy = torch.randn(tokens, cfg.hidden, device=dev, dtype=torch.bfloat16, generator=g)
    splits = [torch.tensor(cfg.splits, device=dev, dtype=torch.int64) for _ in range(cfg.layers)]
    return x, probs, dy, splits


class SlotIndex:
    """Labels each data tensor TE saved with its layer, owning op(s) and kind (weight or activation)."""

    def __init__(self, seen: list, num_weights: int):
        self.seen, self.owners = seen, te_slot_owners(num_weights, num_weights)

    def entries(self):
        """(layer, tensor, owners, kind, (elements, bytes) as saved) per data tensor of each slot, in forward order."""
        for layer, save in enumerate(self.seen):
            for carriers, sizes, (kind, owners) in zip(save.carriers, save.sizes, self.owners):
                for t, size in zip(carriers, sizes):
                    yield layer, t, owners, kind, size

    def label(self, t: torch.Tensor) -> tuple:
        owners_of, found_kind, layer = set(), "activation", None
        for at, u, owners, kind, _ in self.entries():
            if u is t:
                layer, owners_of = at, owners_of | owners
                found_kind = "weight" if kind == "weight" else found_kind
        if layer is None:
            return ("unknown", "unknown", "unknown")
        return (layer, "+".join(sorted(owners_of)), found_kind)

    kind_of = label  # what SpyEngine asks


@dataclass
class StepResult:
    plan: list
    seen: list
    moved: dict  # (layer, owners, kind) -> bytes the engine chose to move
    backward_inputs: list = field(default_factory=list)  # what TE's backward was handed, per call
    out: Optional[torch.Tensor] = None
    grads: Optional[dict] = None


def run_step(cfg: StepConfig, engine: str, monkeypatch, backward_recorder=None, spy_cls=SpyEngine) -> StepResult:
    """One forward + backward of a fresh stack; ``engine`` in {"none", "v2", "v1", "spy"} (``spy_cls`` runs "spy")."""
    if cfg.te_alone:
        funcs = [f for f in OperationFuser.forward_backward_fusion_functions if f is not fuse_te_grouped_mlp]
        monkeypatch.setattr(OperationFuser, "forward_backward_fusion_functions", funcs)
    stack, (x, probs, dy, splits) = make_stack(cfg), make_inputs(cfg)
    seen = watch_te_saves(monkeypatch, clone_bytes=True)
    index = SlotIndex(seen, cfg.experts)
    spy = spy_cls(recorder=index) if engine == "spy" else None
    ctx, sync, counter = offload_context("none" if spy else engine, num_layers=cfg.layers - 1,
                                         model_layers=cfg.layers, classify=index.label)
    calls_before = len(backward_recorder.calls) if backward_recorder else 0
    h = x * 1.0
    with spy.hooks() if spy else contextlib.nullcontext():
        with te.autocast(enabled=True, recipe=RECIPES[cfg.recipe]()):
            for i, mlp in enumerate(stack):
                with ctx:
                    h = mlp(h, splits[i], probs[i], splits[i])
                h = sync(h)
        out = h.detach().clone()
        h.backward(dy)
    if out.is_cuda:
        torch.cuda.synchronize()
    moved = dict(spy.bytes_moved if spy else counter.bytes)
    grads = {"x": x.grad, **{f"probs{i}": p.grad for i, p in enumerate(probs)},
             **{f"L{i}.{n}": p.grad for i, mlp in enumerate(stack) for n, p in mlp.named_parameters()}}
    plan = [type(op).__name__ for mlp in stack for group in mlp._module_groups for op, _ in group._forward_ops]
    handed = list(backward_recorder.calls[calls_before:]) if backward_recorder else []
    return StepResult(plan, seen, moved, handed[::-1], out, grads)  # backward runs the last layer first


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def policy_problems(result: StepResult, cfg: StepConfig, offloaded_layers: list) -> list[str]:
    """Every way the step broke the policy (empty: it kept it)."""
    problems = []
    flags = dict(zip(OPS, cfg.offload))
    moved = result.moved
    if moved.get(("unknown", "unknown", "unknown")):
        problems.append(f"moved {moved[('unknown', 'unknown', 'unknown')]} bytes TE's fused op did not save")
    weight_bytes = sum(n for (_, _, kind), n in moved.items() if kind == "weight")
    if weight_bytes:
        problems.append(f"moved {weight_bytes} weight bytes")
    for name, flag in flags.items():
        if not flag:
            kept_moved = sum(n for (_, owners, _), n in moved.items() if name in str(owners).split("+"))
            if kept_moved:
                problems.append(f"moved {kept_moved} bytes of {name}, which has offload=False")
    index = SlotIndex(result.seen, cfg.experts)
    for layer in offloaded_layers:
        for name, flag in flags.items():
            if not flag:
                continue
            # Sizes as saved: V1 has emptied the device tensors it offloaded by now.
            large = {id(t): nbytes for at, t, owners, kind, (numel, nbytes) in index.entries()
                     if at == layer and owners == {name} and kind == "activation" and numel >= LARGE}
            got = moved.get((layer, name, "activation"), 0)
            if not large:
                problems.append(f"layer {layer} {name} saved no large activation: the check would be empty")
            elif got < sum(large.values()):
                problems.append(f"layer {layer} {name} moved {got} bytes, less than its large activations' "
                                f"{sum(large.values())}")
    return problems + round_trip_problems(result, cfg)


def round_trip_problems(result: StepResult, cfg: StepConfig) -> list[str]:
    """What TE's backward was handed must equal what TE's forward saved; weights the very same tensors."""
    if not result.backward_inputs:
        return []
    problems = []
    owners = te_slot_owners(cfg.experts, cfg.experts)
    if len(result.backward_inputs) != len(result.seen):
        return [f"{len(result.backward_inputs)} backward calls for {len(result.seen)} forwards"]
    for layer, (save, handed) in enumerate(zip(result.seen, result.backward_inputs)):
        if len(handed) != len(save.saved):
            problems.append(f"layer {layer}: backward got {len(handed)} slots, forward saved {len(save.saved)}")
            continue
        for slot, (before, after, (kind, _)) in enumerate(zip(save.saved, handed, owners)):
            where = f"layer {layer} slot {slot}"
            if (before is None) != (after is None) or type(before) is not type(after):
                problems.append(f"{where}: {type(before).__name__} came back as {type(after).__name__}")
                continue
            back = carriers_of(after)
            if len(back) != len(save.carriers[slot]):
                problems.append(f"{where}: {len(back)} data tensors came back, {len(save.carriers[slot])} saved")
                continue
            for k, (u, t, data) in enumerate(zip(back, save.carriers[slot], save.bytes[slot])):
                if kind == "weight" and u is not t:
                    problems.append(f"{where}: a weight came back as another tensor (it moved)")
                elif not torch.equal(_bytes(u), data):
                    problems.append(f"{where} tensor {k}: bytes differ after the round trip")
    return problems


def moved_by_kind(moved: dict) -> dict:
    out = defaultdict(int)
    for (_, _, kind), n in moved.items():
        out[kind] += n
    return dict(out)


__all__ = ["RECIPES", "StepConfig", "StepResult", "TESave", "moved_by_kind", "policy_problems", "run_step"]
