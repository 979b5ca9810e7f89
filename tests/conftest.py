"""Shared pytest setup: one GPU marker and the one rule that skips what it marks, with the reason.

``@pytest.mark.gpu`` needs a CUDA GPU; ``@pytest.mark.gpu("sm_90")`` one of that architecture;
``free_gib=N`` that much free GPU memory besides. ``requires_gpu`` and ``requires_sm90`` are the
first two marks under the names the GPU tests import.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Tests count and compare compiles, so the kernels' disk cache is off unless a test (or the
# caller, TEO_KERNEL_CACHE=1) turns it on; where on, it is a directory of this run's own.
os.environ.setdefault("TEO_KERNEL_CACHE", "0")
if "TEO_KERNEL_CACHE_DIR" not in os.environ:
    os.environ["TEO_KERNEL_CACHE_DIR"] = tempfile.mkdtemp(prefix="teo-kernel-cache-")
    atexit.register(shutil.rmtree, os.environ["TEO_KERNEL_CACHE_DIR"], True)

requires_gpu = pytest.mark.gpu
requires_sm90 = pytest.mark.gpu("sm_90")


def gpu_skip_reason(arch: str | None = None, free_gib: float = 0) -> str | None:
    """Why this machine cannot run a test marked ``gpu(arch, free_gib=...)``, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none visible on this machine)"
    found = "sm_" + "".join(map(str, torch.cuda.get_device_capability()))
    if arch is not None and found != arch:
        return f"needs an {arch} GPU, found {found}"
    if free_gib:
        free, _ = torch.cuda.mem_get_info()
        if free < free_gib * 2**30:
            return f"needs {free_gib:g} GiB of free GPU memory, {free / 2**30:.0f} GiB free"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(arch=None, free_gib=0): needs a CUDA GPU (of that architecture, with "
                                       "that much free memory); skipped with the reason elsewhere")


def pytest_collection_modifyitems(config, items):
    reasons = {}
    for item in items:
        mark = item.get_closest_marker("gpu")
        if mark is None:
            continue
        key = (mark.args[0] if mark.args else mark.kwargs.get("arch"), mark.kwargs.get("free_gib", 0))
        if key not in reasons:
            reasons[key] = gpu_skip_reason(*key)
        if reasons[key] is not None:
            item.add_marker(pytest.mark.skip(reason=reasons[key]))


@pytest.fixture(params=["unfused", "fused"])
def path(request, monkeypatch):
    """Run a test on our ops unfused and on the Hopper fused op (skipped where it cannot run)."""
    from mlp_steps import fused_path_problem
    from te_offload_ops.fused.selection import DISABLE_ENV

    if request.param == "fused" and (problem := fused_path_problem()):
        pytest.skip(problem)
    monkeypatch.setenv(DISABLE_ENV, "1" if request.param == "fused" else "0")
    return request.param
