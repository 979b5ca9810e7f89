"""Run under ``TRITON_INTERPRET=1`` by tests/test_fp8_columns.py: :func:`fp8_rows.quantize_columns`
executed by Triton's CPU interpreter on one split, against the row kernel applied to each expert's
transposed tokens (the same conversion: the interpreter's e4m3 rounding and division are not the
GPU's, so bytes and scales are compared kernel to kernel here, and against TE on a GPU), and the
power-of-two scales against the oracle's.
Prints ``ok`` or what differs."""

from __future__ import annotations

import sys

import torch

from fp8_blockwise_ref import quantize_rows_1x128
from te_offload_ops.kernels import fp8_rows


def main(splits: list, k: int, pow2: bool) -> list:
    torch.manual_seed(0)
    sizes = torch.tensor(splits)
    t = int(sizes.sum())
    x = (torch.randn(t, k) * 3).bfloat16()
    if t:
        x[0] = 0  # an all-zero token row
    data, scales = fp8_rows.quantize_columns(x, sizes, 0.0, pow2)
    _, poff = fp8_rows.expert_offsets(sizes)
    tp = fp8_rows.padded_tokens(t, len(splits))
    problems = []
    if tuple(data.shape) != (k, tp) or tuple(scales.shape) != (tp // 128, -(-k // 4) * 4):
        problems.append(f"shapes {tuple(data.shape)} {tuple(scales.shape)}")
    off = [0] + torch.cumsum(sizes, 0).tolist()
    want_poff = [0] + torch.cumsum((sizes + 127) // 128 * 128, 0).tolist()
    if poff.tolist() != want_poff:
        problems.append(f"poff {poff.tolist()} != {want_poff}")
    for e, te in enumerate(splits):
        p0, p1 = want_poff[e], want_poff[e + 1]
        if te:
            xe = x[off[e]:off[e + 1]].t().contiguous()  # (K, T_e): each feature's tokens as a row
            rows, row_scales = fp8_rows.quantize(xe, 0.0, pow2)
            if not torch.equal(data[:, p0:p0 + te], rows):
                problems.append(f"expert {e}: data")
            if not torch.equal(scales[p0 // 128:p1 // 128, :k], row_scales[:, :k]):
                problems.append(f"expert {e}: scales")
            if pow2:  # power-of-two scales are exact: the oracle's too
                _, ref_scales = quantize_rows_1x128(xe.float(), pow2=True)
                if not torch.equal(scales[p0 // 128:p1 // 128, :k], ref_scales[:, :k]):
                    problems.append(f"expert {e}: scales against the oracle")
        if not bool((data[:, p0 + te:p1] == 0).all()):
            problems.append(f"expert {e}: padding not zero")
    if not bool((data[:, want_poff[-1]:] == 0).all()) or not bool((scales[want_poff[-1] // 128:, :k] == 1).all()):
        problems.append("blocks past the last expert: not zero data with unit scales")
    return problems


def both(splits: list, k: int, pow2: bool) -> list:
    """quantize_both against quantize and quantize_columns run apart: every byte and scale."""
    torch.manual_seed(1)
    sizes = torch.tensor(splits)
    t = int(sizes.sum())
    x = (torch.randn(t, k) * 2).bfloat16()
    rows, row_scales, data, scales = fp8_rows.quantize_both(x, sizes, 0.0, pow2)
    want_rows, want_row_scales = fp8_rows.quantize(x, 0.0, pow2)
    want_data, want_scales = fp8_rows.quantize_columns(x, sizes, 0.0, pow2)
    problems = []
    if not torch.equal(rows, want_rows):
        problems.append("rows")
    if not torch.equal(row_scales[:, :t], want_row_scales[:, :t]):
        problems.append("row scales")
    if not torch.equal(data, want_data) or not torch.equal(scales, want_scales):
        problems.append("columns")
    return problems


if __name__ == "__main__":
    check = both if len(sys.argv) > 4 and sys.argv[4] == "both" else main
    found = check(eval(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "pow2")
    print("ok" if not found else "; ".join(found))
