"""teo's context and synchronization function, used as TE's offload pair is.

``with context: y = layer(x)`` then ``y = sync(y)`` per layer: entering counts layers (layer 0
again begins a step) and puts the engine's saved-tensor hooks on; ``sync`` marks where the layer's
backward begins (a prehook on the output's grad_fn) and watches its region's end (:mod:`.region`).
While inside, TE's modules see the engine as their offload synchronizer, so they mark their
weights and start offloads as under TE's own V2 context.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from ... import capture, te_internals
from .engine import CAPTURE_MESSAGE, TeoEngine
from .pool import PinnedBufferPool
from .region import next_sequence_nr, watch_region

__all__ = ["TeoContext", "make_teo_context"]

_log = logging.getLogger(__package__)  # teo's messages, one logger


class _BackwardBoundary:
    """The prehook on a layer output's grad_fn that starts the layer's backward in the engine; it
    lives as long as that autograd graph, which the engine watches through a weak reference."""

    __slots__ = ("engine", "layer", "__weakref__")

    def __init__(self, engine: TeoEngine, layer: int):
        self.engine, self.layer = engine, layer

    def __call__(self, _grads):
        self.engine.backward_boundary(self.layer)


class TeoContext:
    """The context and synchronization function of one teo engine, used as TE's pair is."""

    def __init__(self, engine: TeoEngine):
        self.engine = engine
        self._layer: Optional[int] = None
        self._inside = False
        self._hooks = None
        self._previous_te_sync = None
        self._since: Optional[int] = None  # autograd nodes after this one ran in the context

    def __enter__(self):
        if capture.capturing():
            raise capture.GraphCaptureError(CAPTURE_MESSAGE)
        current_node = getattr(torch._C, "_current_autograd_node", None)
        if current_node is not None and current_node() is not None:
            raise RuntimeError(
                "teo offload context entered during a backward pass (activation recomputation?): teo counts "
                "one forward then one backward per step and cannot offload a recomputed layer; keep "
                "recomputed layers outside its context or use TE's V2 engine")
        if self._inside:
            raise RuntimeError("teo offload context entered again before its sync function was called")
        self._inside = True
        self._layer = self.engine.enter_layer()
        self._since = next_sequence_nr() if self.engine.num_layers else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.engine.pack, self.engine.unpack)
        self._hooks.__enter__()
        # TE's modules mark their weights and start offloads only while an engine is on: show
        # them this one (V2 semantics), as TE's own context does.
        self._previous_te_sync = te_internals.swap_offload_synchronizer(self.engine)
        return self

    def __exit__(self, *exc):
        te_internals.swap_offload_synchronizer(self._previous_te_sync)
        self._hooks.__exit__(*exc)
        self._hooks = None
        self._inside = False
        if exc[0] is not None:  # e.g. an op's error for bad input: the process goes on with a new step
            self.engine.abandon_step()
        return False

    def sync(self, tensor: torch.Tensor) -> torch.Tensor:
        """Marks the end of the layer just run: its backward begins where ``tensor``'s grad arrives."""
        if self._inside:
            raise RuntimeError("teo offload sync function called inside its context; call it after the layer")
        if self._layer is None:
            raise RuntimeError("teo offload sync function called before the context was ever entered")
        if isinstance(tensor, torch.Tensor) and not tensor.requires_grad:
            self.engine.layer_done(self._layer)
            self.engine.note_layer_graph(None)
            return tensor  # a frozen layer: nothing of it was saved for a backward
        if not isinstance(tensor, torch.Tensor) or tensor.grad_fn is None:
            raise ValueError(
                "teo offload sync function needs the layer's output, a tensor with a grad_fn (requires_grad "
                f"and not a leaf); got {type(tensor).__name__} with requires_grad="
                f"{getattr(tensor, 'requires_grad', None)}")
        layer, engine = self._layer, self.engine
        engine.layer_done(layer)
        boundary = _BackwardBoundary(engine, layer)
        tensor.grad_fn.register_prehook(boundary)
        engine.note_layer_graph(boundary)
        if self._since is not None:
            _, after = watch_region(tensor.grad_fn, self._since, lambda: engine.region_backward_done(layer))
            if not after and layer > 0 and not engine.told_no_region_end:
                engine.told_no_region_end = True
                _log.info("teo: nothing in autograd follows layer %d's region (its inputs are leaves?): its "
                          "backward's end is not seen, and reloads start only at layer starts", layer)
        return tensor


def make_teo_context(num_layers: int, model_layers: int, *, counter: Any = None,
                     pool: Optional[PinnedBufferPool] = None, memory_budget: Optional[int] = None,
                     reload_ahead: int = 0):
    """``(context, sync_function)`` of a new teo engine over ``model_layers`` layers, the first
    ``num_layers`` offloaded; ``memory_budget``, ``reload_ahead``: see
    ``te_offload_ops.engines.offload_context``."""
    ctx = TeoContext(TeoEngine(num_layers, model_layers, counter=counter, pool=pool, memory_budget=memory_budget,
                               reload_ahead=reload_ahead))
    return ctx, ctx.sync
