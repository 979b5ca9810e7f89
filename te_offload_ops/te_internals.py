"""The one module that reaches into Transformer Engine's private state.

Everything here is TE's own implementation, not its API: the CPU-offload module's globals, the
marks its engines read on saved tensors and its synchronizer's and handler's internals, private
attributes of TE's ``GroupedLinear`` and scaled-activation ops, and the private module
``transformer_engine.pytorch.ops._common`` (and torch's ``Module._parameters``, read where TE's
ops register theirs); with them the few public calls of TE's offload module
the package makes, so that one module speaks to TE's engines. The rest of the package calls these
accessors, so a TE release that changes them breaks here, in one place, with a clear message.

The accessors are written against TE :data:`SUPPORTED_TE` (2.20.x). Importing this module checks
the installed TE once and warns where it lies outside that range.
"""

from __future__ import annotations

import gc
import re
import warnings
from typing import Any, Callable, Optional

import torch
import transformer_engine
from transformer_engine.pytorch import cpu_offload
from transformer_engine.pytorch.ops import _common as te_ops_common

__all__ = [
    "SUPPORTED_TE",
    "KEEP_MARK",
    "V1_MARKS",
    "accumulates_into_main_grad",
    "clear_keep_mark",
    "clear_v1_marks",
    "count_v1_offloads",
    "count_v2_offloads",
    "get_accumulate_flag_in_param",
    "get_main_grad_from_param",
    "grouped_tensor_path_supported",
    "has_keep_mark",
    "has_v1_marks",
    "installed_te_version",
    "is_cpu_offload_enabled",
    "is_distributed_weight",
    "mark_activation_offload",
    "mark_not_offload",
    "offload_ready_event",
    "release_offload_synchronizers",
    "registered_parameters",
    "same_scaled_activation",
    "scales_bias",
    "set_keep_mark",
    "start_offload",
    "swap_offload_synchronizer",
    "te_supported_problem",
    "uses_te_v1_offload",
    "v2_current_layer_without_buffers",
    "v2_layers_without_retained_buffers",
    "view_main_grad_as_grouped_buffer",
    "weight_tensors",
    "with_quantized_weight",
]

SUPPORTED_TE = ((2, 20), (2, 20))  # (major, minor) range, inclusive: the releases read for this module


def installed_te_version() -> tuple[int, ...]:
    """The installed Transformer Engine's release numbers (``2.20.2+abc`` -> ``(2, 20, 2)``; () if unreadable)."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(getattr(transformer_engine, "__version__", "")))
    return tuple(int(g) for g in found.groups() if g is not None) if found else ()


def te_supported_problem(version: Optional[tuple[int, ...]] = None) -> Optional[str]:
    """Why the installed TE (or ``version``) lies outside :data:`SUPPORTED_TE`, or None."""
    version = installed_te_version() if version is None else version
    low, high = SUPPORTED_TE
    if low <= tuple(version[:2]) <= high:
        return None
    shown = ".".join(map(str, version)) or "unknown"
    return (f"te_offload_ops reads Transformer Engine's private state as TE {low[0]}.{low[1]}.x lays it out; "
            f"the installed TE is {shown}. Offload engines, the fused MLP's weight grads and graph-capture checks "
            "may fail or misbehave: install TE 2.20.x (scripts/setup_env.sh does)")


_PROBLEM = te_supported_problem()
if _PROBLEM is not None:
    warnings.warn(_PROBLEM, RuntimeWarning, stacklevel=2)


def _missing(what: str, exc: Exception) -> RuntimeError:
    return RuntimeError(f"Transformer Engine {'.'.join(map(str, installed_te_version()))} has no {what} "
                        f"({type(exc).__name__}: {exc}); te_offload_ops supports TE 2.20.x")


# -- CPU offload: which engine TE runs, and its module-level state --------------------------------


def uses_te_v1_offload() -> bool:
    """Whether TE chose its V1 offload engine at import (``NVTE_CPU_OFFLOAD_V1=1``)."""
    return bool(cpu_offload.NVTE_CPU_OFFLOAD_V1)


def is_cpu_offload_enabled() -> bool:
    """Whether a TE offload engine (or one shown to TE's modules as one) is on."""
    return cpu_offload.is_cpu_offload_enabled()


def mark_activation_offload(obj: Any) -> None:
    """TE's V1 mark on an activation (a no-op under V2)."""
    cpu_offload.mark_activation_offload(obj)


def mark_not_offload(obj: Any) -> None:
    """TE's call that tells its engines to leave ``obj`` where it is."""
    cpu_offload.mark_not_offload(obj)


def start_offload(obj: Any) -> None:
    """TE's call that hands ``obj`` to the engine on (its copy may start now)."""
    cpu_offload.start_offload(obj)


def offload_ready_event(t: Any) -> Optional[torch.cuda.Event]:
    """The event TE's ``start_offload`` recorded on ``t`` (its producer's work done), or None."""
    return getattr(t, "start_reload_event", None)


# TE's marks on saved tensors, its protocol with its engines (cpu_offload*.py): V2 leaves a tensor
# that carries KEEP_MARK where it is; V1 offloads one that carries a V1 mark
KEEP_MARK = "_TE_do_not_offload"
V1_MARKS = ("activation_offloading", "needs_force_clear")


# TE V2 leaves smaller saved tensors where they are (cpu_offload.py, _check_if_offload)
V2_MIN_OFFLOAD_NUMEL = 256 * 1024


def wants_base_offloaded(t: Any) -> bool:
    """TE's ``start_offload`` mark on a view whose whole base is to be offloaded."""
    return bool(getattr(t, "offload_base_tensor", False))


def has_keep_mark(t: Any) -> bool:
    return bool(getattr(t, KEEP_MARK, False))


def set_keep_mark(t: Any) -> None:
    setattr(t, KEEP_MARK, True)


def clear_keep_mark(t: Any) -> None:
    if hasattr(t, KEEP_MARK):
        delattr(t, KEEP_MARK)


def has_v1_marks(t: Any) -> bool:
    return any(hasattr(t, attr) for attr in V1_MARKS)


def clear_v1_marks(t: Any) -> None:
    """Takes V1's marks off ``t`` (``mark_not_offload`` does not undo them)."""
    for attr in V1_MARKS:
        if hasattr(t, attr):
            delattr(t, attr)


def swap_offload_synchronizer(synchronizer: Any) -> Any:
    """Makes ``synchronizer`` the offload engine TE's modules see (their marks and ``start_offload``
    follow it as they follow V2's); returns the one it replaced."""
    previous = cpu_offload.OFFLOAD_SYNCHRONIZER
    cpu_offload.OFFLOAD_SYNCHRONIZER = synchronizer
    return previous


def count_v2_offloads(context: Any, on_offload: Callable[[torch.Tensor], None]) -> None:
    """Calls ``on_offload(tensor)`` for each tensor TE V2's context decides to offload (its
    synchronizer's push returns a handle, not the tensor itself)."""
    try:
        sync = context.offload_synchronizer
        push = sync.push_tensor
    except AttributeError as exc:
        raise _missing("V2 offload synchronizer with push_tensor", exc) from exc

    def counting_push(t):
        handle = push(t)
        if not isinstance(handle, torch.Tensor):  # an index (or a tuple for quantized): offloaded
            on_offload(t)
        return handle

    sync.push_tensor = counting_push


def count_v1_offloads(context: Any, on_offload: Callable[[torch.Tensor], None]) -> None:
    """Calls ``on_offload(part)`` for each tensor TE V1's context will offload: V1 keeps a GPU
    reference in ``tensor_tag_to_buf`` for exactly those (a list of data tensors for a quantized one)."""
    try:
        handler = context.offload_handler
        push = handler.tensor_push
        handler.tensor_tag_to_buf  # noqa: B018 (checked here, read at each push)
    except AttributeError as exc:
        raise _missing("V1 offload handler with tensor_push and tensor_tag_to_buf", exc) from exc

    def counting_push(t, **kwargs):
        tag = push(t, **kwargs)
        buf = handler.tensor_tag_to_buf.get(tag)
        for part in buf if isinstance(buf, list) else [buf]:
            if part is not None:
                on_offload(part)
        return tag

    handler.tensor_push = counting_push


def v2_layers_without_retained_buffers() -> bool:
    """Whether the V2 synchronizer in force has a layer created without ``retain_pinned_cpu_buffers``."""
    states = getattr(cpu_offload.OFFLOAD_SYNCHRONIZER, "layer_states", {})
    return any(not getattr(s, "retain_pinned_cpu_buffers", True) for s in states.values())


def v2_current_layer_without_buffers() -> Optional[int]:
    """The V2 layer now in its forward if the schedule offloads it and it has no pinned host
    buffers yet (no warm-up step made them), else None."""
    sync = cpu_offload.OFFLOAD_SYNCHRONIZER
    layer = getattr(sync, "num_of_fwds", None)
    if sync is None or layer is None:
        return None
    if not getattr(sync, "offload_layer_map", {}).get(layer, True):
        return None  # not offloaded by the schedule: nothing is copied
    state = sync.layer_states.get(layer)
    if state is not None and not state.cpu_tensor_group.tensor_list:
        return layer
    return None


def release_offload_synchronizers() -> int:
    """Every live TE V2 offload synchronizer lets go of the tensors its layers hold. A step that
    fails mid-forward leaves its synchronizer holding the saved GPU tensors, and that step's
    autograd graph holds the synchronizer: a cycle through C++ graph nodes that gc cannot break.
    Returns how many synchronizers were found."""
    kind = getattr(cpu_offload, "OffloadSynchronizer", None)
    if kind is None:
        return 0
    found = [o for o in gc.get_objects() if issubclass(type(o), kind)]  # (isinstance would wake lazy modules)
    for sync in found:
        for state in getattr(sync, "layer_states", {}).values():
            state.release_all_memory()
    return len(found)


# -- TE's GroupedLinear op: private attributes -----------------------------------------------------


def with_quantized_weight(op: Any) -> bool:
    """Whether TE's op keeps its weights quantized (FP8 parameters)."""
    return bool(op._with_quantized_weight)


def is_distributed_weight(op: Any) -> bool:
    """Whether TE's op has sharded weights it gathers per call."""
    return bool(op._is_distributed_weight())


def scales_bias(op: Any) -> bool:
    """Whether TE's op scales its bias per token (it then saves one more tensor)."""
    return bool(op._scale_bias)


def accumulates_into_main_grad(op: Any) -> bool:
    """Whether TE's op adds its weight grads into each weight's ``main_grad``."""
    return bool(op._accumulate_into_main_grad)


def weight_tensors(op: Any) -> list:
    """TE's op's weight tensors, as its forward reads them."""
    return op._get_weight_tensors()


def same_scaled_activation(op: Any, reference: type) -> bool:
    """Whether TE scaled-activation op ``op`` computes what ``reference``'s class does (its
    subclass may change the activation by overriding TE's private unary forward)."""
    return type(op)._scaled_unary_forward is reference._scaled_unary_forward


def registered_parameters(module: torch.nn.Module) -> dict:
    """``module``'s own registered parameters by name (no ``Module.__getattr__`` per lookup)."""
    return module._parameters


def grouped_tensor_path_supported(recipe: Any, dtype: torch.dtype) -> bool:
    """Whether TE's GroupedLinear takes its grouped-tensor path (no host split sizes) for this recipe and dtype."""
    from transformer_engine.pytorch.ops.basic.grouped_linear import is_op_fuser_grouped_tensor_path_supported

    return is_op_fuser_grouped_tensor_path_supported(recipe, dtype)


# -- transformer_engine.pytorch.ops._common: main_grad helpers --------------------------------------

get_accumulate_flag_in_param = te_ops_common.get_accumulate_flag_in_param
get_main_grad_from_param = te_ops_common.get_main_grad_from_param
view_main_grad_as_grouped_buffer = te_ops_common.view_main_grad_as_grouped_buffer
