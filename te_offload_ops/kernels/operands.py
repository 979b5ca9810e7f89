"""What every grouped GEMM entry point checks and prepares on the host before a launch: operand
types, shapes and the 32-bit limits, output buffers, split sizes as the kernels read them, operands
aligned for TMA, and expert weights read in place where their layout allows. Nothing here reads
``split_sizes`` on the host (that would sync)."""

from __future__ import annotations

import torch

DTYPES = (torch.bfloat16, torch.float16)
INT32_MAX = 2**31 - 1


def check_pair(a, b, split_sizes, names: tuple[str, str], what: str) -> None:
    """Two 16-bit operands of one dtype on one CUDA device, and integer split sizes; ``names``
    and ``what`` (the GEMM) say which in the errors."""
    first, second = names
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise TypeError(f"{first} and {second} must be torch tensors")
    if not isinstance(split_sizes, torch.Tensor) or split_sizes.is_floating_point():
        raise TypeError("split_sizes must be an integer torch tensor")
    if not (a.is_cuda and b.is_cuda) or a.device != b.device:
        raise ValueError(f"{first} and {second} must be on one CUDA device, got {a.device} and {b.device}")
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        raise TypeError(f"{what} takes bf16 or fp16 operands of one dtype, got {a.dtype} and {b.dtype}")


def check_operands(a, b, split_sizes, b_n_major):
    """(E, N, K) of a bf16/fp16 grouped GEMM's ``a`` (T, K) and ``b`` (E, N, K), or (E, K, N) where
    ``b_n_major``. Host-side checks only: the split sizes' sum is not checked (that would sync).
    Rows past sum(split_sizes) are left unwritten; a sum past T never writes past T."""
    check_pair(a, b, split_sizes, ("a", "b"), "grouped GEMM")
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError("a must be (T, K) and b (E, N, K) / (E, K, N)")
    e = b.shape[0]
    k = a.shape[1]
    kb = b.shape[2] if not b_n_major else b.shape[1]
    if kb != k:
        raise ValueError(f"K mismatch: a has {k}, b has {kb}")
    if split_sizes.numel() != e:
        raise ValueError(f"split_sizes must have one entry per expert: {e} experts, got {split_sizes.numel()} entries")
    n = b.shape[1] if not b_n_major else b.shape[2]
    check_limits(a.shape[0], n)
    return e, n, k


def check_limits(tokens: int, n: int) -> None:
    """What the kernels index with 32 bits: token rows, and the dSReLU partial sums (one fp32 per
    token and 128-column block). Element offsets into A, C, z and act are 64-bit, so operands
    past 2^31 elements are fine."""
    if tokens > INT32_MAX:
        raise ValueError(f"the grouped GEMM takes at most {INT32_MAX} token rows, got {tokens}")
    if tokens * -(-n // 64) > INT32_MAX:
        raise ValueError(f"{tokens} tokens x {-(-n // 64)} column blocks of N={n} overflow the kernel's "
                         "32-bit dprobs partial-sum index; split the tokens into smaller calls")


def splits_i32(split_sizes: torch.Tensor, device) -> torch.Tensor:
    """The split sizes as the kernels read them: contiguous int32 on ``device`` (copied there
    without a sync)."""
    s = split_sizes
    if s.device != device:
        s = s.to(device, non_blocking=True)
    if s.dtype != torch.int32:
        s = s.to(torch.int32)
    return s.contiguous()


def expert_weights(b: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """``b`` as the kernel reads it, and the elements between experts (None: packed). Each expert's
    matrix must be row-contiguous; the experts may sit any whole number of 16-byte units apart
    (at least one matrix: a padded parameter buffer, as Megatron's), read in place. Anything else
    is copied into one packed tensor."""
    e, rows, cols = b.shape
    if (b.stride(2) == 1 and b.stride(1) == cols and b.stride(0) >= rows * cols and b.stride(0) % 8 == 0
            and b.data_ptr() % 16 == 0):
        return b, (None if b.stride(0) == rows * cols or e == 1 else b.stride(0))
    return aligned(b), None


def out_buffer(out, t, n, like, name):
    """``out`` checked as a kernel output of (t, n) like ``like`` (a fresh tensor where None)."""
    if out is None:
        return torch.empty(t, n, dtype=like.dtype, device=like.device)
    if not isinstance(out, torch.Tensor) or out.shape != (t, n) or out.dtype != like.dtype \
            or out.device != like.device or not out.is_contiguous() or out.data_ptr() % 16:
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}, contiguous={out.is_contiguous()}, "
               f"address % 16 = {out.data_ptr() % 16}") if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{name} must be a contiguous ({t}, {n}) {like.dtype} tensor on {like.device} at a "
                         f"16-byte aligned address, got {got}")
    return out


def aligned(t: torch.Tensor, align: int = 16) -> torch.Tensor:
    """``t`` contiguous at an ``align``-byte aligned address (TMA's), copied only where it is not."""
    t = t.contiguous()
    if t.data_ptr() % align:
        t = t.clone()
    return t
