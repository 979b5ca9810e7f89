"""The bytes an offload engine chose to move, keyed by what the caller wants to know."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, Hashable, Optional

import torch

__all__ = ["OffloadCounter"]


class OffloadCounter:
    """Bytes an engine chose to offload, keyed by ``classify(tensor)`` (default: one key)."""

    def __init__(self, classify: Optional[Callable[[torch.Tensor], Hashable]] = None):
        if classify is not None and not callable(classify):  # else it fails in an engine's hook, mid-step
            raise TypeError(f"classify must be a function of a tensor (or None), got {type(classify).__name__}")
        self.classify = classify or (lambda t: "all")
        self.bytes: dict[Hashable, int] = defaultdict(int)

    def add(self, t: torch.Tensor) -> None:
        self.bytes[self.classify(t)] += t.numel() * t.element_size()

    @property
    def total(self) -> int:
        return sum(self.bytes.values())
