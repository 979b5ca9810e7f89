"""Per-op offload flags of the experts, from Megatron's config or the experts' constructor.

Megatron-Core's fine-grained offloading names what to offload in ``config.offload_modules``.
Three names touch the routed experts; on this package's ops they become per-op flags:

| offload_modules     | fc1 (its input) | activation (fc1's output, probs) | fc2 (its input) |
|---------------------|-----------------|----------------------------------|-----------------|
| "expert_fc1"        | offload         | keep                             | keep            |
| "moe_act"           | keep            | offload                          | keep            |
| "fused_group_mlp"   | offload         | offload                          | offload         |

(fc2's input is offloaded only with "fused_group_mlp", as in Megatron's own experts; the fused
Hopper path recomputes it in backward and saves nothing for fc2 but weights.) Without
fine-grained offloading every op keeps the package default, ``offload=True``, so an engine
such as Megatron's ``cpu_offloading`` (TE's) sees what it sees with TE's ops. A flag given to
the constructor wins over the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

EXPERT_OFFLOAD_MODULES = ("expert_fc1", "moe_act", "fused_group_mlp")

__all__ = ["EXPERT_OFFLOAD_MODULES", "ExpertOffload", "expert_offload"]


@dataclass(frozen=True)
class ExpertOffload:
    """The ``offload`` flag of each op of the experts' ``te.ops.Sequential``."""

    fc1: bool = True
    activation: bool = True
    fc2: bool = True

    def as_tuple(self) -> tuple[bool, bool, bool]:
        """(fc1, activation, fc2), the order of the ops."""
        return (self.fc1, self.activation, self.fc2)

    def any(self) -> bool:
        """Whether some op may offload its activations."""
        return any(self.as_tuple())


def _from_config(config: Any) -> ExpertOffload:
    if not getattr(config, "fine_grained_activation_offloading", False):
        return ExpertOffload()
    modules = set(getattr(config, "offload_modules", None) or ())
    whole = "fused_group_mlp" in modules
    return ExpertOffload(fc1=whole or "expert_fc1" in modules, activation=whole or "moe_act" in modules, fc2=whole)


def expert_offload(config: Any, *, fc1: Optional[bool] = None, activation: Optional[bool] = None,
                   fc2: Optional[bool] = None) -> ExpertOffload:
    """The flags for ``config``, each replaced by the matching argument that is not None."""
    given = {"fc1": fc1, "activation": activation, "fc2": fc2}
    for name, value in given.items():
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"offload_{name} must be None (from the config) or a bool, "
                            f"got {type(value).__name__} {value!r}")
    derived = _from_config(config)
    return ExpertOffload(**{name: getattr(derived, name) if value is None else value
                            for name, value in given.items()})
