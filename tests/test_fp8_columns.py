"""CPU: the per-expert columnwise FP8 quantization (the operands of an FP8 weight gradient) run by
Triton's interpreter: layout, expert offsets, padding and scales (the e4m3 bytes against the row
kernel's on each expert's transposed tokens; against TE on a GPU in tests/test_gpu_fp8_columns.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="Triton is not installed (torch's CUDA wheels bring it)")

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("splits, k, pow2", [
    ([0, 1, 127, 128, 129, 300, 5, 0], 200, True),  # empty, partial, whole and straddling 128-token blocks
    ([64], 128, False),
    ([0, 0, 3], 16, True),
])
def test_columns_per_expert_padded_as_the_row_kernel_writes_each_experts_transpose(splits, k, pow2):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    proc = subprocess.run([sys.executable, str(HERE / "fp8_columns_check.py"), repr(splits), str(k),
                           "pow2" if pow2 else "fp32"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok", proc.stdout[-2000:]


@pytest.mark.parametrize("splits, k, pow2", [([0, 1, 127, 128, 129, 300, 5, 0], 200, False), ([3, 0, 130], 256, True)])
def test_rows_and_columns_from_one_read_are_the_bytes_of_the_two_passes(splits, k, pow2):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    proc = subprocess.run([sys.executable, str(HERE / "fp8_columns_check.py"), repr(splits), str(k),
                           "pow2" if pow2 else "fp32", "both"], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "ok", proc.stdout[-2000:]


def test_the_padded_width_and_offsets_need_no_host_read_of_the_split():
    import torch

    from te_offload_ops.kernels import fp8_rows

    assert fp8_rows.padded_tokens(0, 4) == 0 and fp8_rows.padded_tokens(300, 2) == 512  # no tokens: no columns
    assert fp8_rows.padded_tokens(1, 1) == 128 and fp8_rows.padded_tokens(0, 1) == 0
    for splits in ([0, 1, 127, 128, 129], [300, 0], [5], [1, 299], [299, 1], [129, 129, 129]):  # every split fits
        sizes = torch.tensor(splits)
        off, poff = fp8_rows.expert_offsets(sizes)
        assert off.dtype == poff.dtype == torch.int32
        assert int(poff[-1]) <= fp8_rows.padded_tokens(int(sizes.sum()), len(splits))
        assert all(int(poff[i + 1] - poff[i]) % 128 == 0 and int(poff[i + 1] - poff[i]) >= s
                   for i, s in enumerate(splits))


@pytest.mark.parametrize("x_shape, x_dtype, sizes, match", [
    ((4, 8, 2), "bfloat16", [4], "2-D"),
    ((4, 8), "float32", [4], "bf16/fp16"),
    ((4, 8), "bfloat16", [], "at least one expert"),
    ((4, 8), "bfloat16", [1.0, 3.0], "int32/int64"),
])
def test_column_quantizers_refuse_bad_operands_before_any_launch(x_shape, x_dtype, sizes, match):
    import torch

    from te_offload_ops.kernels import fp8_rows

    x = torch.zeros(x_shape, dtype=getattr(torch, x_dtype))
    split = torch.tensor(sizes, dtype=torch.float32 if match == "int32/int64" else torch.int64)
    for fn in (fp8_rows.quantize_columns, fp8_rows.quantize_both):
        with pytest.raises(ValueError, match=match):
            fn(x, split, 0.0, False)
