"""Put this package's experts into the layer specs users already build with Megatron-Core.

Megatron-Core 0.19 describes a model as nested builders: ``ModuleSpec`` dataclasses,
``functools.partial`` objects (its MoE spec is ``partial(MoELayer, submodules=MoESubmodules(
experts=partial(TEGroupedMLP, submodules=...)))``), submodule dataclasses and lists of layer
specs. :func:`replace_builders` walks that tree without importing Megatron, so it is tested on
any machine; :func:`use_te_offload_ops` applies it to the experts.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

__all__ = ["replace_builders", "use_te_offload_ops"]


def _names(target: Any, cls: type) -> bool:
    """Whether a builder's target is ``cls``: the class itself or ModuleSpec's (module path, name)."""
    if target is cls:
        return True
    return isinstance(target, tuple) and len(target) == 2 and tuple(target) == (cls.__module__, cls.__name__)


class _Replacer:
    def __init__(self, old: type, new: type, params: dict[str, Any]):
        self.old, self.new, self.params = old, new, params
        self.count = 0
        self._done: dict[int, Any] = {}  # a spec shared by many layers is rebuilt once, and stays shared

    def __call__(self, node: Any) -> Any:
        key = id(node)
        if key not in self._done:
            self._done[key] = self._rebuild(node)
        return self._done[key]

    def _rebuild(self, node: Any) -> Any:
        if isinstance(node, functools.partial):
            if _names(node.func, self.old):
                self.count += 1
                return functools.partial(self.new, *node.args, **{**node.keywords, **self.params})
            func, args = self(node.func), tuple(self(a) for a in node.args)
            keywords = {k: self(v) for k, v in node.keywords.items()}
            if func is node.func and all(a is b for a, b in zip(args, node.args)) and all(
                    keywords[k] is node.keywords[k] for k in keywords):
                return node
            return functools.partial(func, *args, **keywords)
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            if hasattr(node, "module") and isinstance(getattr(node, "params", None), dict) \
                    and _names(node.module, self.old):  # a ModuleSpec of the experts
                self.count += 1
                return dataclasses.replace(node, module=self.new, params={**node.params, **self.params})
            changed = {}
            for f in dataclasses.fields(node):
                if f.init:
                    value = getattr(node, f.name)
                    rebuilt = self(value)
                    if rebuilt is not value:
                        changed[f.name] = rebuilt
            return dataclasses.replace(node, **changed) if changed else node
        if isinstance(node, (list, tuple)):
            items = [self(item) for item in node]
            if all(a is b for a, b in zip(items, node)):
                return node
            return type(node)(items) if isinstance(node, list) else tuple(items)
        if isinstance(node, dict):
            items = {k: self(v) for k, v in node.items()}
            return node if all(items[k] is node[k] for k in node) else items
        return node


def replace_builders(spec: Any, old: type, new: type, params: Optional[dict[str, Any]] = None) -> tuple[Any, int]:
    """A copy of ``spec`` in which every builder of exactly ``old`` builds ``new``, with ``params``
    added to its keyword arguments; and how many builders were replaced.

    Parts of the spec that hold no such builder are reused, not copied.
    """
    replacer = _Replacer(old, new, dict(params or {}))
    return replacer(spec), replacer.count


def use_te_offload_ops(spec: Any, *, offload_fc1: Optional[bool] = None, offload_activation: Optional[bool] = None,
                       offload_fc2: Optional[bool] = None) -> Any:
    """``spec`` with its MoE experts (``TEGroupedMLP``) built as :class:`TEOGroupedMLP`.

    ``spec`` is anything Megatron-Core builds layers from: a GPT layer spec
    (``get_gpt_layer_with_transformer_engine_spec(num_experts=..., moe_grouped_gemm=True)``), a
    decoder block spec, an MoE module spec. The ``offload_*`` flags, where given, fix the ops'
    ``offload`` flags; otherwise each follows ``config.offload_modules``
    (see :mod:`te_offload_ops.megatron.offload`). Subclasses of ``TEGroupedMLP`` (e.g. Megatron's
    inference experts) are left as they are. Raises ValueError when the spec has no such experts.
    """
    from .experts import TEGroupedMLP, TEOGroupedMLP  # checks the Megatron-Core version first

    flags = {"offload_fc1": offload_fc1, "offload_activation": offload_activation, "offload_fc2": offload_fc2}
    params = {name: value for name, value in flags.items() if value is not None}
    for name, value in params.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be None (from the config) or a bool, got {type(value).__name__} {value!r}")
    rebuilt, count = replace_builders(spec, TEGroupedMLP, TEOGroupedMLP, params)
    if count == 0:
        raise ValueError(
            "use_te_offload_ops: the spec builds no TEGroupedMLP experts (build it with num_experts and "
            f"moe_grouped_gemm=True, and the Transformer Engine backend); got {type(spec).__name__}"
        )
    return rebuilt
