"""How many clusters of several CTAs a GPU runs at once, one CTA per SM.

A cluster of four must sit inside one GPC, and a chip's GPCs hold different SM counts (which SMs
are fused off differs from die to die), so only the driver knows: its occupancy query, which the
CuTe DSL answers by compiling and loading a probe kernel. A process that loads its kernels from
the disk cache never imports the DSL otherwise, so the answer is kept in the cache directory, one
entry per physical GPU (its UUID) and cluster size, in ``cluster_fit.json``.
"""

from __future__ import annotations

import json
import logging

import torch

from . import disk_cache
from .atomic_file import write_atomic

_log = logging.getLogger(__name__)
FILE_NAME = "cluster_fit.json"


def _key(device_index: int, cluster_size: int) -> str:
    return f"{torch.cuda.get_device_properties(device_index).uuid}/{cluster_size}"


def _read(path) -> dict:
    try:
        answers = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: asked again
        return {}
    return answers if isinstance(answers, dict) else {}


def max_active_clusters(device_index: int, cluster_size: int, probe) -> int:
    """Clusters of ``cluster_size`` CTAs that run at once on ``device_index``: the stored answer
    where the disk cache holds one for this GPU, else ``probe(device_index, cluster_size)`` (the
    driver's), stored for the next process."""
    path = disk_cache.cache_dir() / FILE_NAME if disk_cache.enabled() else None
    key = _key(device_index, cluster_size)
    if path is not None:
        stored = _read(path).get(key)
        if isinstance(stored, int) and stored >= 0:
            return stored
    clusters = int(probe(device_index, cluster_size))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            answers = _read(path)  # another process may have added its GPU meanwhile
            answers[key] = clusters
            write_atomic(path, json.dumps(answers, indent=1, sort_keys=True).encode())
        except OSError as exc:  # a read-only cache: asked again next time
            _log.warning("could not keep the cluster occupancy answer in %s (%s)", path, exc)
    return clusters


__all__ = ["max_active_clusters", "FILE_NAME"]
