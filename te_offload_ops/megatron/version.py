"""Which Megatron-Core versions the integration supports, and the check that refuses the others.

The integration builds on Megatron-Core internals that change between minor releases
(``TEGroupedMLP._make_fused_ops``, its fine-grained offloading groups), so it accepts one
minor series, from the release it was tested with.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from typing import Optional

MIN_VERSION = (0, 19, 2)  # inclusive
END_VERSION = (0, 20)  # exclusive
SUPPORTED = "megatron-core >=0.19.2,<0.20"
TESTED = "0.19.2"

__all__ = ["END_VERSION", "MIN_VERSION", "SUPPORTED", "TESTED", "UnsupportedMegatronError", "check_version",
           "installed_version", "parse_version", "require_megatron"]


class UnsupportedMegatronError(ImportError):
    """Megatron-Core is missing, or its version is not one te_offload_ops.megatron supports."""


def parse_version(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string: "0.19.2rc1+abc" -> (0, 19, 2)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    if match is None:
        raise UnsupportedMegatronError(f"cannot read the megatron-core version {text!r}; te_offload_ops.megatron "
                                       f"supports {SUPPORTED} (tested with {TESTED})")
    return tuple(int(part) for part in match.group(1).split("."))


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedMegatronError` unless ``version`` is in the supported range."""
    release = parse_version(version)
    if not MIN_VERSION <= release < END_VERSION:
        raise UnsupportedMegatronError(
            f"te_offload_ops.megatron supports {SUPPORTED} (tested with {TESTED}), found megatron-core {version}: "
            "it builds on TEGroupedMLP internals that differ between minor releases"
        )


def installed_version() -> Optional[str]:
    """The installed megatron-core version, or None when there is no Megatron-Core.

    Read from the package metadata, else (a source checkout on the path) from
    ``megatron.core.package_info``, which imports Megatron-Core.
    """
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        if importlib.util.find_spec("megatron.core") is None:
            return None
    except ImportError:  # no "megatron" package at all (or a stand-in that is not one)
        return None
    try:
        info = importlib.import_module("megatron.core.package_info")
    except ImportError as exc:
        raise UnsupportedMegatronError(f"megatron-core is on the path but does not import: {exc}") from exc
    return ".".join(str(part) for part in info.VERSION[:3]) + "".join(str(part) for part in info.VERSION[3:])


def require_megatron() -> str:
    """The installed megatron-core version, checked; raises :class:`UnsupportedMegatronError`."""
    version = installed_version()
    if version is None:
        raise UnsupportedMegatronError(
            f"te_offload_ops.megatron needs {SUPPORTED} (tested with {TESTED}), which is not installed; "
            "the rest of te_offload_ops works without it"
        )
    check_version(version)
    return version
