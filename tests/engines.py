"""Test helpers: build grouped SReLU MLP stacks and run one training step under an offload engine.

Engines: "none", "v2" (TE's default), "v1" (needs NVTE_CPU_OFFLOAD_V1=1 before TE is imported,
so tests run it in a subprocess through engine_worker.py), "teo" (this package's schedule,
te_offload_ops.engines_teo) and "spy" (offload_spy.SpyEngine).
Each step reports the bytes the engine moved per (op name, tensor kind).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import transformer_engine.pytorch as te

import te_offload_ops as teo
from te_offload_ops.engines import offload_context
from te_offload_ops.policy import MIN_OFFLOAD_NUMEL
from te_offload_ops.fused.selection import kernel_problem
from offload_spy import SaveRecorder, SpyEngine

OP_NAMES = ("fc1", "act", "fc2")

# Megatron-Core's settings for TE's grouped-MLP ops, by short name
MEGATRON_KWARGS = {
    "main_grad": {"accumulate_into_main_grad": True},
    "delay": {"delay_wgrad_compute": True},
    "single": {"single_grouped_weight": True},  # needs NVTE_GROUPED_LINEAR_SINGLE_PARAM=1
}


# TE's quantization recipes by short name (the forward runs under te.autocast(recipe=...))
RECIPES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "block": "Float8BlockScaling",
    "mxfp8": "MXFP8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}


def make_recipe(name: str | None):
    """TE's recipe object for a key of RECIPES (None: no quantization)."""
    if name is None:
        return None
    from transformer_engine.common import recipe

    return getattr(recipe, RECIPES[name])()


def recipe_problem(name: str | None) -> str | None:
    """Why TE says this GPU cannot run the recipe, or None."""
    if name is None:
        return None
    check = {"delayed": te.is_fp8_available, "current": te.is_fp8_available,
             "block": te.is_fp8_block_scaling_available, "mxfp8": te.is_mxfp8_available,
             "nvfp4": te.is_nvfp4_available}[name]
    ok, reason = check(return_reason=True)
    return None if ok else f"TE cannot run the {RECIPES[name]} recipe here: {reason}"


def quantized(recipe_name: str | None):
    """The autocast context a forward of this recipe runs in."""
    if recipe_name is None:
        return contextlib.nullcontext()
    return te.autocast(enabled=True, recipe=make_recipe(recipe_name))


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
    megatron: tuple[str, ...] = ()  # keys of MEGATRON_KWARGS for both GroupedLinears
    recipe: str | None = None  # a key of RECIPES: the forward runs under te.autocast with it

    @property
    def linear_kwargs(self) -> dict:
        return {k: v for name in self.megatron for k, v in MEGATRON_KWARGS[name].items()}

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
    kw = dict(bias=False, device="cuda", dtype=dt, **cfg.linear_kwargs)
    if cfg.stock_te:
        ops = (te.ops.GroupedLinear(E, H, F, **kw), te.ops.ScaledSReLU(), te.ops.GroupedLinear(E, F, H, **kw))
    else:
        fc1, act, fc2 = cfg.offload
        ops = (teo.GroupedLinear(E, H, F, offload=fc1, **kw), teo.ScaledSReLU(offload=act),
               teo.GroupedLinear(E, F, H, offload=fc2, **kw))
    return te.ops.Sequential(*ops)


def linears(stack) -> list:
    return [op for mlp in stack for op in mlp if isinstance(op, te.ops.GroupedLinear)]


def expert_weights_of(op) -> list[torch.Tensor]:
    """Per-expert weight values of a GroupedLinear, however TE stores them."""
    from te_offload_ops.fused.expert_weights import stacked_weight

    return list(stacked_weight(op).unbind(0))


def copy_weights(src_stack, dst_stack) -> None:
    """Same weight values in two stacks whose ops may store them differently (single grouped or not)."""
    with torch.no_grad():
        for a, b in zip(linears(src_stack), linears(dst_stack)):
            for wa, wb in zip(expert_weights_of(a), expert_weights_of(b)):
                wb.copy_(wa)


def attach_main_grads(stack, seed: int = 7) -> None:
    """fp32 main_grad buffers as Megatron's DDP gives them, filled with known values.

    Allocated one by one in reverse order (so the experts' buffers are not one tensor), with
    grad_added_to_main_grad as Megatron sets it. Values depend only on (layer, op, shape)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    for op in reversed(linears(stack)):
        for p in reversed(list(op.parameters())):
            p.main_grad = 0.01 * torch.randn(p.shape, device="cuda", dtype=torch.float32, generator=g)
            p.grad_added_to_main_grad = False
    for op in linears(stack):
        for p in op.parameters():
            p.teo_main_grad_init = p.main_grad.clone()


def relay_expert_weights(op, order, pad: int = 0) -> torch.Tensor:
    """Moves op's expert weights into one new buffer on their device, expert ``order[j]`` at slot j,
    ``pad`` elements between slots, as Megatron's distributed optimizer does (``param.data`` = a
    view of its buffer). Returns the buffer."""
    ws = [getattr(op, f"weight{i}") for i in range(op.num_groups)]
    n, k = ws[0].shape
    buf = torch.zeros(len(ws) * (n * k + pad), dtype=ws[0].dtype, device=ws[0].device)
    for slot, e in enumerate(order):
        view = buf[slot * (n * k + pad): slot * (n * k + pad) + n * k].view(n, k)
        view.copy_(ws[e].data)
        ws[e].data = view
    return buf


class Stack(list):
    """The MLPs of a test model, with the recipe their forward runs under."""

    recipe: str | None = None


def make_stack(cfg: Config) -> Stack:
    torch.manual_seed(cfg.seed)
    stack = Stack(make_mlp(cfg) for _ in range(cfg.layers))
    stack.recipe = cfg.recipe
    return stack


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


def run_step(stack, inputs, engine: str, offload_layers: int | None = None, keep_grads: bool = False,
             context=None) -> dict:
    """Forward + backward of the whole stack; returns output, grads, memory and bytes moved.

    ``keep_grads``: grads from an earlier step stay allocated and are zeroed (as Megatron's
    main_grad buffers stay), so the step's peak is about activations, not grads being allocated;
    the output's grad is then made inside the step too (``(out * dy).sum()``, exactly ``dy``), as
    a model's loss makes it, so that it counts at the peak as every later grad does.
    ``context``: an ``offload_context(...)`` triple to use (reused across steps) instead of a new one;
    its counter then counts every step so far."""
    x, probs, dy, splits = inputs
    for p in [x, *probs, *(q for mlp in stack for q in mlp.parameters())]:
        if keep_grads and p.grad is not None:
            p.grad.zero_()
        else:
            p.grad = None
        if hasattr(p, "teo_main_grad_init"):
            p.main_grad.copy_(p.teo_main_grad_init)
            p.grad_added_to_main_grad = False
    recorder = SaveRecorder()
    layers = len(stack)
    offload_layers = layers - 1 if offload_layers is None else offload_layers
    spy = SpyEngine(recorder) if engine == "spy" else None
    if context is not None:
        ctx, sync, counter = context
    else:
        ctx, sync, counter = offload_context("none" if spy else engine, num_layers=offload_layers,
                                             model_layers=layers, classify=recorder.kind_of)

    torch.cuda.synchronize()
    base_mem = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    h = x * 1.0  # a non-leaf input, so offloading its slices really frees it
    with recorder.watch(named_ops(stack)), (spy.hooks() if spy else contextlib.nullcontext()):
        recipe = getattr(stack, "recipe", None)
        for i, mlp in enumerate(stack):
            with ctx, quantized(recipe):
                h = mlp(h, splits, probs[i], splits)
            h = sync(h)
        torch.cuda.synchronize()
        fwd_mem = torch.cuda.memory_allocated() - base_mem
        fwd_peak = torch.cuda.max_memory_allocated() - base_mem
        # also counts blocks freed while an offload copy still reads them (record_stream)
        fwd_active_peak = torch.cuda.memory_stats()["active_bytes.all.peak"] - base_mem
        out = h.detach().clone()
        if keep_grads:
            (h * dy).sum().backward()
        else:
            h.backward(dy)
        delayed = [op for op in linears(stack) if op.need_backward_dw()]
        grads_before_dw = {id(p): p.grad for op in delayed for p in op.parameters()}
        for op in delayed:  # as Megatron does after the backward (or overlapped with comms)
            op.backward_dw()
        torch.cuda.synchronize()
    step_active_peak = torch.cuda.memory_stats()["active_bytes.all.peak"] - base_mem  # forward and backward
    moved = spy.bytes_moved if spy else counter.bytes
    grads = {"x": x.grad, **{f"probs{i}": p.grad for i, p in enumerate(probs)}}
    for i, mlp in enumerate(stack):
        for j, op in enumerate(mlp):
            if not isinstance(op, te.ops.GroupedLinear):
                continue
            for e, w in enumerate(_expert_grads(op)):
                grads[f"L{i}.{j}.weight{e}"] = w
    return {"out": out, "grads": grads, "moved": dict(moved), "fwd_mem": fwd_mem, "fwd_peak": fwd_peak,
            "fwd_active_peak": fwd_active_peak, "step_active_peak": step_active_peak,
            "recorder": recorder, "grads_before_dw": grads_before_dw}


def _expert_grads(op) -> list:
    """Per-expert weight gradients: what main_grad gained when Megatron's wgrad fusion is on,
    else ``.grad`` (one (E, out, in) grad for a single grouped weight)."""
    params = list(op.parameters())
    if getattr(op, "_accumulate_into_main_grad", False):
        deltas = [p.main_grad - p.teo_main_grad_init for p in params]
    else:
        deltas = [p.grad for p in params]
    if len(params) == 1 and op.num_groups > 1:
        return [None] * op.num_groups if deltas[0] is None else list(deltas[0].reshape(op.num_groups, op.out_features, op.in_features).unbind(0))
    return deltas


def offloadable_activation_bytes(recorder, layer: int, min_numel: int = MIN_OFFLOAD_NUMEL) -> int:
    """Bytes of the activations ``layer`` saved that an engine honouring the marks may offload.

    Views of one buffer (the per-expert slices) count once per distinct byte range.
    """
    ranges = {(e.data_ptr, e.nbytes) for e in recorder.entries
              if e.op.startswith(f"L{layer}.") and e.kind == "activation" and e.numel >= min_numel and not e.kept}
    return sum(n for _, n in ranges)
