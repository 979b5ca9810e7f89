"""Mixin that turns a TE basic op into one with an ``offload`` switch under the package policy."""

from __future__ import annotations

import inspect
from typing import Any, Optional, Sequence

from .. import policy

_OFFLOAD_PARAM = inspect.Parameter("offload", inspect.Parameter.KEYWORD_ONLY, default=True, annotation=bool)


def _check_offload(op_name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{op_name}: offload must be a bool (True or False), got {type(value).__name__} {value!r}")
    return value


def _signature_with_offload(te_init) -> inspect.Signature:
    sig = inspect.signature(te_init)
    params = list(sig.parameters.values())
    # Keyword-only parameters must precede **kwargs.
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    return sig.replace(parameters=params[:at] + [_OFFLOAD_PARAM] + params[at:])


class OffloadableOp:
    """Base for this package's ops: the TE op's constructor plus keyword ``offload: bool = True``.

    ``offload=False`` keeps the op's saved activations on the GPU; weights are never offloaded.
    The TE op runs unchanged; what it saved for backward is re-saved through
    :func:`te_offload_ops.policy.save_for_backward`, which marks each tensor for the engines.
    """

    te_op: type  # the TE op this class extends, set for each subclass

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        te_bases = [b for b in cls.__mro__ if b.__module__.startswith("transformer_engine.")]
        if not te_bases:  # a shared base of ours, not an op yet
            return
        cls.te_op = te_bases[0]
        if "__init__" in cls.__dict__:  # a user subclass with its own constructor
            return

        def __init__(self, *args: Any, offload: bool = True, **kw: Any) -> None:
            # Validate before TE allocates anything, so bad input leaves nothing behind.
            _check_offload(type(self).__name__, offload)
            super(OffloadableOp, self).__init__(*args, **kw)
            self._offload = offload

        __init__.__signature__ = _signature_with_offload(cls.te_op.__init__)
        __init__.__doc__ = f"See ``{cls.te_op.__module__}.{cls.te_op.__name__}``; plus ``offload``."
        __init__.__qualname__ = f"{cls.__qualname__}.__init__"
        cls.__init__ = __init__

    @property
    def offload(self) -> bool:
        """Whether this op's saved activations may be offloaded to CPU."""
        return self._offload

    @offload.setter
    def offload(self, value: bool) -> None:
        self._offload = _check_offload(type(self).__name__, value)

    def saved_weights(self, saved: Sequence[Optional[Any]]) -> Sequence[Optional[Any]]:
        """The entries of what this op saved that are weights. Activation ops have none."""
        del saved
        return ()

    def repack_saved(self, ctx, saved: tuple, input_) -> tuple:
        """Hook to change how what TE saved is stored (undone in backward). Default: as is."""
        del ctx, input_
        return saved

    def check_inputs(self, input_, extra_inputs) -> None:
        """Raise a clear error for inputs TE would reject or crash on (before any kernel)."""
        del input_, extra_inputs

    def fuser_forward(self, basic_op_ctxs, input_, **kwargs):  # noqa: D102 (TE's signature)
        self.check_inputs(input_, kwargs["basic_op_extra_inputs"][0])
        out = super().fuser_forward(basic_op_ctxs, input_, **kwargs)
        ctx = basic_op_ctxs[0]
        if ctx.to_save is not None:
            saved = self.repack_saved(ctx, tuple(ctx.to_save), input_)
            policy.save_for_backward(ctx, *saved, offload=self.offload, weights=self.saved_weights(saved),
                                    owner=self)
        return out

    def _config_repr(self) -> list[str]:
        return []

    def extra_repr(self) -> str:
        return ", ".join([*self._config_repr(), f"offload={self.offload}"])
