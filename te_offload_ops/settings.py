"""Settings read from the environment that more than one module shares the rules of."""

from __future__ import annotations

import os


def mib_from_env(name: str, default: int, zero_means: str) -> int:
    """``$name`` as a whole number of MiB >= 0 (``default`` when unset or empty); anything else
    raises ValueError naming the variable, what 0 means and the value given."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name} must be a whole number of MiB >= 0 (0: {zero_means}), got {raw!r}")
    return value
