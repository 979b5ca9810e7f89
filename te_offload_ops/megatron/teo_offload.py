"""teo, this package's offload schedule, inside Megatron-Core's training loop.

:func:`use_teo_offload` puts each of a Megatron model's transformer layers (``scope="layer"``),
MoE layers (``"moe"``) or routed experts (``"experts"``) under ``offload_context("teo", ...)``,
as Megatron's ``TransformerBlock`` puts layers under TE's ``get_cpu_offload_context``: the
layer's forward runs inside the context and its output goes through the sync function. It does
so by wrapping each module's ``forward`` on the instance, so Megatron's own schedule
(``get_forward_backward_func()``, DDP, the distributed optimizer) runs unchanged::

    model = GPTModel(config, use_te_offload_ops(layer_spec), ...)
    offload = use_teo_offload(model, scope="layer", memory_budget=60 << 30)
    ... train as usual; offload.counter.total is the bytes moved so far; offload.remove() undoes it

teo counts one forward then one backward per step (each micro-batch of gradient accumulation is
a step to it), so the wrapped modules must run once each per forward, in model order. What
breaks that is refused with the reason: pipeline parallelism, the EP-overlap schedule
(``overlap_moe_expert_parallel_comm`` runs layers in pieces, one micro-batch's forward inside
another's backward), full recomputation (and "moe" recomputation for ``scope="experts"``),
CUDA graphs that capture what teo wraps (with ``scope="experts"``, Megatron's per-layer graphs of
``attn``, ``moe_router`` and ``moe_preprocess`` run around it), and Megatron's or TE's own
offloading on the same model. Forwards without grad
(evaluation) run outside teo. With expert parallelism, the dispatcher's split sizes reach the
host through the copy engine that carries teo's copies: :func:`use_kernel_dtoh` keeps them out of
that queue.

Megatron-Core is not imported here: the modules to wrap are found by class name, so this module
is tested with stand-ins (tests/test_megatron_teo.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Optional

import torch

__all__ = ["SCOPE_CLASSES", "TeoOffload", "find_offload_modules", "teo_offload_problems", "use_teo_offload"]

_WRAPPED = "_teo_offload_forward"  # set on the forwards this module installs

# What each scope wraps: Megatron-Core classes, by name, subclasses included.
SCOPE_CLASSES = {
    "layer": ("TransformerLayer",),
    "moe": ("MoELayer",),
    "experts": ("TEGroupedMLP", "GroupedMLP", "SequentialMLP"),
}


def _is_instance_by_name(module: torch.nn.Module, names: tuple[str, ...]) -> bool:
    return any(cls.__name__ in names for cls in type(module).__mro__)


def _unwrap(model: Any) -> torch.nn.Module:
    """The model inside Megatron's wrappers (DDP, Float16Module: each keeps it in ``.module``)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"use_teo_offload takes one model chunk; got {len(model)} (virtual pipeline "
                             "parallelism interleaves forwards of several chunks, which teo's step does not)")
        model = model[0]
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"use_teo_offload needs a torch.nn.Module (a Megatron model), got {type(model).__name__}")
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and \
            not _is_instance_by_name(model, SCOPE_CLASSES["layer"]):
        model = model.module
    return model


def find_offload_modules(model: Any, scope: str) -> list[torch.nn.Module]:
    """The modules of ``model`` that ``scope`` wraps, outermost only, in registration (= forward) order."""
    if scope not in SCOPE_CLASSES:
        raise ValueError(f"scope must be one of {tuple(SCOPE_CLASSES)}, got {scope!r}")
    names = SCOPE_CLASSES[scope]
    found: list[torch.nn.Module] = []

    def walk(module: torch.nn.Module) -> None:
        for child in module.children():
            if _is_instance_by_name(child, names):
                found.append(child)  # not below it: a match inside a match would nest two contexts
            else:
                walk(child)

    root = _unwrap(model)
    if _is_instance_by_name(root, names):
        return [root]
    walk(root)
    return found


def teo_offload_problems(config: Any, scope: str) -> list[str]:
    """What in Megatron's ``config`` keeps teo from wrapping ``scope``'s modules ([] if nothing)."""
    problems = []
    get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
    if (get("pipeline_model_parallel_size", 1) or 1) > 1:
        problems.append(f"pipeline_model_parallel_size={get('pipeline_model_parallel_size')}: a pipeline runs "
                        "several micro-batches' forwards before their backwards; teo's step is one forward then "
                        "its backward")
    if get("overlap_moe_expert_parallel_comm", False):
        problems.append("overlap_moe_expert_parallel_comm=True: the EP-overlap schedule runs layers in pieces, one "
                        "micro-batch's forward inside another's backward")
    if get("recompute_granularity") == "full":
        problems.append("recompute_granularity='full': recomputed layers run their forward again during the "
                        "backward, which teo cannot offload")
    if scope == "experts" and get("recompute_granularity") == "selective" and \
            "moe" in (get("recompute_modules") or ()):
        problems.append("recompute_modules has 'moe': the experts' forward runs again during the backward")
    if get("fine_grained_activation_offloading", False):
        problems.append("fine_grained_activation_offloading=True: Megatron's own offloading is on; use one engine")
    if get("cpu_offloading", False):
        problems.append("cpu_offloading=True: TE's offloading is on in the TransformerBlock; use one engine")
    graphed = _graphed_inside(get("cuda_graph_impl", "none") or "none", get("cuda_graph_modules"), scope)
    if graphed:
        problems.append(f"cuda_graph_impl={get('cuda_graph_impl')!r}: its CUDA graphs capture {graphed}, which "
                        f"holds what teo wraps (scope={scope!r}): a replayed graph runs no saved-tensor hooks. "
                        f"Graph only modules outside it ({', '.join(_GRAPHABLE_AROUND[scope]) or 'none'} for this "
                        "scope)")
    return problems


# Megatron's per-layer CUDA graph modules that leave each scope's modules eager
_GRAPHABLE_AROUND = {"experts": ("attn", "mlp", "moe_router", "moe_preprocess"), "moe": ("attn", "mlp"), "layer": ()}


def _graphed_inside(impl: str, modules: Any, scope: str) -> Optional[str]:
    """What of ``scope``'s modules Megatron's CUDA graphs would capture (None: nothing)."""
    if impl == "none":
        return None
    if impl == "full_iteration":
        return "the whole iteration"
    if isinstance(modules, str):
        modules = [m for m in modules.split(",") if m]
    elif modules is not None and not isinstance(modules, (list, tuple)):
        modules = [modules]  # one CudaGraphModule
    names = [getattr(m, "name", m) for m in (modules or [])]
    if not names or names == ["full"]:
        return "whole transformer layers"
    inside = [n for n in names if n not in _GRAPHABLE_AROUND[scope]]
    return ", ".join(inside) if inside else None


def _first_tensor(output: Any) -> Optional[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _with_first(output: Any, tensor: torch.Tensor) -> Any:
    if isinstance(output, torch.Tensor):
        return tensor
    return type(output)((tensor, *output[1:])) if isinstance(output, tuple) else [tensor, *output[1:]]


@dataclass
class TeoOffload:
    """Megatron modules under one teo engine; see :func:`use_teo_offload`."""

    modules: list
    scope: str
    num_layers: int
    context: Any
    sync: Callable
    counter: Any
    _originals: list = field(default_factory=list)
    _next: int = 0

    @property
    def model_layers(self) -> int:
        return len(self.modules)

    def _run(self, index: int, forward: Callable, args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is saved for a backward, teo's step is not counted
            return forward(*args, **kwargs)
        if index == 0:
            self._next = 0
        elif index != self._next:
            raise RuntimeError(
                f"teo (use_teo_offload, scope={self.scope!r}) saw {self.scope} {index} of {self.model_layers} start "
                f"where {self.scope} {self._next} was due: the wrapped modules must run once each per forward, in "
                "model order (a module called twice, skipped, or run in pieces by another schedule)")
        self._next = (index + 1) % self.model_layers
        with self.context:
            output = forward(*args, **kwargs)
        first = _first_tensor(output)
        if first is None:
            raise TypeError(f"teo (use_teo_offload) needs the {self.scope}'s output to be a tensor or a tuple "
                            f"starting with one; {type(self.modules[index]).__name__} returned "
                            f"{type(output).__name__}")
        return _with_first(output, self.sync(first))

    def remove(self) -> None:
        """Give the modules back the forward they had (the engine's pinned buffers stay in teo's pool)."""
        for module, own in self._originals:
            if own is None:
                del module.forward  # the class's forward shows again
            else:
                module.forward = own
        self._originals = []


def use_teo_offload(model: Any, *, scope: str = "layer", num_layers: Optional[int] = None,
                    memory_budget: Optional[int] = None, reload_ahead: int = 0,
                    classify: Optional[Callable[[torch.Tensor], Hashable]] = None,
                    config: Any = None, modules: Optional[Iterable[torch.nn.Module]] = None) -> TeoOffload:
    """Put ``model``'s Megatron modules of ``scope`` under one teo engine; returns a :class:`TeoOffload`.

    ``model``: a Megatron model (``GPTModel``, also inside Megatron's DDP or Float16Module, or a
    one-chunk list). ``scope``: "layer" (each ``TransformerLayer``: attention and MLP), "moe"
    (each ``MoELayer``: router, dispatch, experts, combine) or "experts" (each routed experts
    module: its activations only; copies start after the dispatch all-to-all). ``num_layers``:
    offload the first n of them (default all; the rest run inside the context without moving
    anything, as teo counts every layer). ``memory_budget``: bytes of
    ``torch.cuda.memory_allocated`` the step may reach (teo then waits for copies only where
    memory would pass it; e.g. a memory cap less a GiB or two). ``reload_ahead``: start reloads
    that many layers before the peak-neutral point (hides reloads slower than the backward between
    layers, for up to one offloaded layer's bytes more at the peak each; see
    ``te_offload_ops.engines.offload_context``). ``classify``: key for the byte counter.
    ``config``: Megatron's TransformerConfig (default: ``model.config``), checked for settings
    teo cannot follow. ``modules``: the modules to wrap, in forward order, instead of finding them.
    """
    from ..engines import offload_context

    if scope not in SCOPE_CLASSES:
        raise ValueError(f"scope must be one of {tuple(SCOPE_CLASSES)}, got {scope!r}")
    found = list(modules) if modules is not None else find_offload_modules(model, scope)
    if not found:
        raise ValueError(f"use_teo_offload: no {' / '.join(SCOPE_CLASSES[scope])} modules in "
                         f"{type(model).__name__} for scope={scope!r}")
    if len({id(m) for m in found}) != len(found):
        raise ValueError("use_teo_offload: a module is listed twice; each runs once per forward")
    if any(getattr(vars(m).get("forward"), _WRAPPED, False) for m in found):
        raise RuntimeError("use_teo_offload: a module runs under teo already (use_teo_offload called twice on it? "
                           "call remove() on the first handle)")
    config = config if config is not None else getattr(_unwrap(model), "config", None)
    if config is not None:
        problems = teo_offload_problems(config, scope)
        if problems:
            raise ValueError("use_teo_offload cannot run teo in this configuration: " + "; ".join(problems))
    n = len(found) if num_layers is None else num_layers
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(found):
        raise ValueError(f"num_layers must be an int in [0, {len(found)}] (the {scope} modules found), got {n!r}")
    if memory_budget is not None and (isinstance(memory_budget, bool) or not isinstance(memory_budget, int)
                                      or memory_budget <= 0):
        raise ValueError(f"memory_budget must be a positive int (bytes), got {memory_budget!r}")
    context, sync, counter = offload_context("teo", num_layers=n, model_layers=len(found),
                                             memory_budget=memory_budget, reload_ahead=reload_ahead,
                                             classify=classify)
    handle = TeoOffload(modules=found, scope=scope, num_layers=n, context=context, sync=sync, counter=counter)
    for index, module in enumerate(found):
        own = vars(module).get("forward")  # a forward set on the instance by someone else, kept under ours
        forward = module.forward

        def wrapped(*args, _index=index, _forward=forward, **kwargs):
            return handle._run(_index, _forward, args, kwargs)

        setattr(wrapped, _WRAPPED, True)
        module.forward = wrapped
        handle._originals.append((module, own))
    return handle
