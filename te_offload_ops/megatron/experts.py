"""TEOGroupedMLP: Megatron-Core's TEGroupedMLP whose op-fuser path runs this package's ops.

Importing this module imports Megatron-Core, after checking its version.
"""

from __future__ import annotations

from typing import Any, Optional

from .version import require_megatron

require_megatron()

import torch.nn.functional as F  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402
from megatron.core.activations import squared_relu  # noqa: E402
from megatron.core.fusions.fused_bias_geglu import quick_gelu  # noqa: E402
from megatron.core.transformer.moe.experts import TEGroupedMLP  # noqa: E402

from .. import policy  # noqa: E402
from .adopt import adopt  # noqa: E402
from .offload import ExpertOffload, expert_offload  # noqa: E402

__all__ = ["TEGroupedMLP", "TEOGroupedMLP"]


def scaled_activation_name(config: Any) -> Optional[str]:
    """The TE scaled activation op Megatron builds for ``config``'s experts, or None if none fits."""
    glu, func = config.gated_linear_unit, config.activation_func
    if glu and func is F.silu:
        return "ScaledSwiGLU"
    if glu and func is quick_gelu:
        return "ScaledClampedQGeGLU"
    if not glu and func is squared_relu and config.use_fused_weighted_squared_relu:
        return "ScaledSReLU"
    return None


class TEOGroupedMLP(TEGroupedMLP):
    """Megatron-Core's ``TEGroupedMLP`` whose op-fuser path runs te_offload_ops' ops.

    Megatron builds the experts' ``te.ops.Sequential`` (GroupedLinear, scaled activation,
    GroupedLinear, with its parameters, main_grad accumulation and delayed wgrad) exactly as it
    does for TE's ops; each op then becomes this package's op of the same kind with its
    ``offload`` flag. The squared-ReLU MLP then runs as the fused Hopper op where it can
    (:func:`te_offload_ops.fused.explain_fusion` on :attr:`fused_ops` says why not); other
    activations run TE's ops unfused.

    Offload flags: ``offload_fc1``, ``offload_activation``, ``offload_fc2`` (None: from
    ``config.offload_modules``, see :mod:`te_offload_ops.megatron.offload`). Under Megatron's
    fine-grained offloading the ops run inside one offload group ("fused_group_mlp") whenever
    some op may offload, whichever of "expert_fc1", "moe_act", "fused_group_mlp" was chosen; the
    flags decide which of their saved tensors move. Weights never move.

    Needs ``use_transformer_engine_op_fuser=True``. Unlike ``TEGroupedMLP``, "expert_fc1" and
    "moe_act" offloading work on this path, and gated activations do not need
    ``NVTE_CUTEDSL_FUSED_GROUPED_MLP``.
    """

    def __init__(self, num_local_experts: int, config: Any, submodules: Any, pg_collection: Any = None,
                 name: Optional[str] = None, *, offload_fc1: Optional[bool] = None,
                 offload_activation: Optional[bool] = None, offload_fc2: Optional[bool] = None):
        if not getattr(config, "use_transformer_engine_op_fuser", False):
            raise ValueError("TEOGroupedMLP runs the experts through TE's op fuser: set "
                             "use_transformer_engine_op_fuser=True in the TransformerConfig (it is False)")
        # Checked before Megatron allocates anything.
        flags = expert_offload(config, fc1=offload_fc1, activation=offload_activation, fc2=offload_fc2)
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, name=name)
        self.expert_offload: ExpertOffload = flags
        # Megatron opens its offload group around the ops only for "fused_group_mlp"; here the
        # group opens for any choice that lets an op offload, and the ops' flags pick the tensors.
        self.offload_fused_group_mlp = bool(config.fine_grained_activation_offloading) and flags.any()

    @property
    def fused_ops(self) -> Optional[te.ops.Sequential]:
        """The ``te.ops.Sequential`` the experts run (built at the first forward), or None before."""
        return None if self._fused_ops is None else self._fused_ops[0]

    def op_path_blockers(self) -> list[str]:
        """Why these experts cannot run as TE ops through the op fuser ([] if they can)."""
        reasons = []
        tp = self.tp_group.size()
        if tp > 1:
            reasons.append(f"expert tensor parallelism of {tp}: TE's op fuser runs unsharded experts")
        if self.config.moe_apply_probs_on_input:
            reasons.append("moe_apply_probs_on_input=True: the scaled activation applies the router probs after fc1")
        for name in ("linear_fc1", "linear_fc2"):
            module = getattr(self, name)
            if not isinstance(module, te.GroupedLinear):
                reasons.append(f"{name} is a {type(module).__name__}, not a TE GroupedLinear module")
        if scaled_activation_name(self.config) is None:
            func = getattr(self.config.activation_func, "__name__", self.config.activation_func)
            reasons.append(
                f"activation_func={func} with gated_linear_unit={self.config.gated_linear_unit} and "
                f"use_fused_weighted_squared_relu={self.config.use_fused_weighted_squared_relu} has no scaled TE op "
                "(supported: silu or quick_gelu gated; squared_relu ungated with use_fused_weighted_squared_relu)"
            )
        return reasons

    def _is_fused_impl_supported(self) -> bool:
        # Megatron asserts this in its constructor: raising names the reasons instead. Unlike
        # TEGroupedMLP's check, offload_modules and NVTE_CUTEDSL_FUSED_GROUPED_MLP play no part:
        # each op offloads by its own flag, and ops that do not fuse run as TE's own.
        reasons = self.op_path_blockers()
        if reasons:
            raise ValueError("TEOGroupedMLP cannot run these experts as TE ops: " + "; ".join(reasons))
        return True

    def _fused_forward(self, *args: Any, **kwargs: Any):
        if self._fused_ops is None:  # built here rather than in Megatron's forward: the flags below need it
            self._fused_ops = (self._make_fused_ops(),)
        self._pass_first_microbatch()
        return super()._fused_forward(*args, **kwargs)

    def _pass_first_microbatch(self) -> None:
        """Megatron's per-step FP8 weight caching, for the ops that run instead of its modules.

        ``set_is_first_microbatch`` marks each step's first micro-batch (when the config quantizes)
        on the modules that have ``is_first_microbatch``: here ``linear_fc1`` and ``linear_fc2``,
        which the op-fuser path never calls. The ops it runs are not submodules (Megatron keeps
        them in a tuple) and are built after that list is made, so the flag is handed to them
        here, and cleared on the modules as their own forward would. Without quantization the
        modules' flag is never reset by Megatron, so the ops get None (quantize every call)."""
        ops = self._fused_ops[0]
        config = self.config
        quantized = (getattr(config, "fp8", None) is not None or getattr(config, "fp4", None) is not None
                     or getattr(config, "quant_recipe", None) is not None or getattr(config, "use_kitchen", False))
        for linear, op in ((self.linear_fc1, ops[0]), (self.linear_fc2, ops[2])):
            cache = quantized and not getattr(linear, "disable_parameter_transpose_cache", False)
            op.is_first_microbatch = getattr(linear, "is_first_microbatch", None) if cache else None
            if quantized:
                linear.is_first_microbatch = False

    def _make_fused_ops(self) -> te.ops.Sequential:
        ops = super()._make_fused_ops()
        if len(ops) != 3:
            raise RuntimeError(f"expected Megatron to build (GroupedLinear, activation, GroupedLinear), got {ops}")
        for op, offload in zip(ops, self.expert_offload.as_tuple()):
            adopt(op, offload=offload)
        ops.register_forward_pre_hook(_keep_input_of_kept_fc1)
        return ops

    def extra_repr(self) -> str:
        f = self.expert_offload
        return f"offload(fc1={f.fc1}, activation={f.activation}, fc2={f.fc2})"


def _keep_input_of_kept_fc1(ops: te.ops.Sequential, args: tuple) -> None:
    # Megatron frees the experts' input once its offload group is committed, unless that very
    # tensor is marked to stay. An fc1 that keeps its input needs it in backward; TE's unfused
    # GroupedLinear saves it inside a storage, whose marks are not on this tensor, so mark it too.
    if args and not ops[0].offload:
        policy.mark_saved_tensors(args[:1], offload=False)
