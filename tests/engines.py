"""Test helpers: build grouped SReLU MLP stacks and run one training step under an offload engine.

Engines: "none", "v2" (TE's default), "v1" (needs NVTE_CPU_OFFLOAD_V1=1 before TE is imported,
so tests run it in a subprocess through engine_worker.py), and "spy" (offload_spy.SpyEngine).
Each step reports the bytes the engine moved per (op name, tensor kind).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import transformer_engine.pytorch as te

import te_offload_ops as teo
from te_offload_ops.engines import offload_context
from te_offload_ops.fused.selection import kernel_problem
from offload_spy import SaveRecorder, SpyEngine

OP_NAMES = ("fc1", "act", "fc2")


@dataclass
class Config:
    layers: int = 2
    experts: int = 4
    hidden: int = 512
    ffn: int = 384
    splits: tuple[int, ...] = (0, 700, 1329, 19)  # uneven, one expert without tokens
    dtype: torch.dtype = torch.bfloat16
    offload: tuple[bool, bool, bool] = (True, True, True)  # fc1, act, fc2
    stock_te: bool = False  # build TE's own ops instead of ours
    seed: int = 1234

    @property
    def tokens(self) -> int:
        return sum(self.splits)


def fused_path_problem() -> str | None:
    """Why the CuTe DSL fused path cannot run here, or None."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return "the fused SReLU grouped MLP needs an sm_90 GPU"
    return kernel_problem()


def forward_plan(mlp: te.ops.Sequential) -> list[str]:
    """Names of the ops TE's fuser ran forward for ``mlp`` (after its first call)."""
    return [type(op).__name__ for group in mlp._module_groups for op, _ in group._forward_ops]


def make_mlp(cfg: Config) -> te.ops.Sequential:
    E, H, F, dt = cfg.experts, cfg.hidden, cfg.ffn, cfg.dtype
    if cfg.stock_te:
        ops = (te.ops.GroupedLinear(E, H, F, bias=False, device="cuda", dtype=dt), te.ops.ScaledSReLU(),
               te.ops.GroupedLinear(E, F, H, bias=False, device="cuda", dtype=dt))
    else:
        fc1, act, fc2 = cfg.offload
        ops = (teo.GroupedLinear(E, H, F, bias=False, device="cuda", dtype=dt, offload=fc1),
               teo.ScaledSReLU(offload=act),
               teo.GroupedLinear(E, F, H, bias=False, device="cuda", dtype=dt, offload=fc2))
    return te.ops.Sequential(*ops)


def make_stack(cfg: Config) -> list[te.ops.Sequential]:
    torch.manual_seed(cfg.seed)
    return [make_mlp(cfg) for _ in range(cfg.layers)]


def make_inputs(cfg: Config):
    g = torch.Generator(device="cuda").manual_seed(cfg.seed + 1)
    x = torch.randn(cfg.tokens, cfg.hidden, device="cuda", dtype=cfg.dtype, generator=g, requires_grad=True)
    probs = [torch.rand(cfg.tokens, device="cuda", dtype=cfg.dtype, generator=g).requires_grad_()
             for _ in range(cfg.layers)]
    dy = torch.randn(cfg.tokens, cfg.hidden, device="cuda", dtype=cfg.dtype, generator=g)
    splits = torch.tensor(cfg.splits, device="cuda", dtype=torch.int64)
    return x, probs, dy, splits


def named_ops(stack) -> dict[str, torch.nn.Module]:
    return {f"L{i}.{name}": op for i, mlp in enumerate(stack) for name, op in zip(OP_NAMES, mlp)}


def run_step(stack, inputs, engine: str, offload_layers: int | None = None) -> dict:
    """Forward + backward of the whole stack; returns output, grads, memory and bytes moved."""
    x, probs, dy, splits = inputs
    for p in [x, *probs, *(q for mlp in stack for q in mlp.parameters())]:
        p.grad = None
    recorder = SaveRecorder()
    layers = len(stack)
    offload_layers = layers - 1 if offload_layers is None else offload_layers
    spy = SpyEngine(recorder) if engine == "spy" else None
    ctx, sync, counter = offload_context("none" if spy else engine, num_layers=offload_layers,
                                         model_layers=layers, classify=recorder.kind_of)

    torch.cuda.synchronize()
    base_mem = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    h = x * 1.0  # a non-leaf input, so offloading its slices really frees it
    with recorder.watch(named_ops(stack)), (spy.hooks() if spy else contextlib.nullcontext()):
        for i, mlp in enumerate(stack):
            with ctx:
                h = mlp(h, splits, probs[i], splits)
            h = sync(h)
        torch.cuda.synchronize()
        fwd_mem = torch.cuda.memory_allocated() - base_mem
        fwd_peak = torch.cuda.max_memory_allocated() - base_mem
        out = h.detach().clone()
        h.backward(dy)
        torch.cuda.synchronize()
    moved = spy.bytes_moved if spy else counter.bytes
    grads = {"x": x.grad, **{f"probs{i}": p.grad for i, p in enumerate(probs)}}
    for i, mlp in enumerate(stack):
        for name, p in mlp.named_parameters():
            grads[f"L{i}.{name}"] = p.grad
    return {"out": out, "grads": grads, "moved": dict(moved), "fwd_mem": fwd_mem, "fwd_peak": fwd_peak,
            "recorder": recorder}


def offloadable_activation_bytes(recorder, layer: int, min_numel: int = 256 * 1024) -> int:
    """Bytes of the activations ``layer`` saved that an engine honouring the marks may offload.

    Views of one buffer (the per-expert slices) count once per distinct byte range.
    """
    ranges = {(e.data_ptr, e.nbytes) for e in recorder.entries
              if e.op.startswith(f"L{layer}.") and e.kind == "activation" and e.numel >= min_numel and not e.kept}
    return sum(n for _, n in ranges)
