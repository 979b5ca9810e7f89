"""Shared pytest setup: GPU tests skip with a reason that names what is missing."""

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


def gpu_skip_reason(need_sm90: bool = False) -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none visible on this machine)"
    if need_sm90 and torch.cuda.get_device_capability() != (9, 0):
        return f"needs an sm_90 GPU (H100/H200), found sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    return None


requires_gpu = pytest.mark.skipif(gpu_skip_reason() is not None, reason=gpu_skip_reason() or "")
requires_sm90 = pytest.mark.skipif(gpu_skip_reason(True) is not None, reason=gpu_skip_reason(True) or "")


@pytest.fixture(params=["unfused", "fused"])
def path(request, monkeypatch):
    """Run a test on our ops unfused and on the Hopper fused op (skipped where it cannot run)."""
    from engines import fused_path_problem
    from te_offload_ops.fused.selection import DISABLE_ENV

    if request.param == "fused" and (problem := fused_path_problem()):
        pytest.skip(problem)
    monkeypatch.setenv(DISABLE_ENV, "1" if request.param == "fused" else "0")
    return request.param
