"""TE tensor storages built on the CPU for tests: a grouped storage and FP8 storages/tensors."""

import torch
from transformer_engine.pytorch import cpu_offload  # noqa: F401  (loads the extension that registers tex)
import transformer_engine_torch as tex  # noqa: E402
from transformer_engine.pytorch.tensor import GroupedTensorStorage
from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import Float8TensorStorage


def grouped_storage(tokens=(3, 0, 5), hidden=4):
    total = sum(tokens)
    first_dims = torch.tensor(tokens, dtype=torch.int64)
    offsets = torch.tensor([0, *torch.tensor(tokens).cumsum(0).tolist()], dtype=torch.int64) * hidden
    return GroupedTensorStorage(
        shape=(total, hidden), dtype=torch.bfloat16, num_tensors=len(tokens), quantizer=None,
        data=torch.randn(total * hidden, dtype=torch.bfloat16), first_dims=first_dims, tensor_offsets=offsets,
    )


def fp8_storage(cls=Float8TensorStorage, shape=(16, 8)):
    kwargs = dict(data=torch.zeros(shape, dtype=torch.uint8), fp8_scale_inv=torch.ones(1),
                  fp8_dtype=tex.DType.kFloat8E4M3, data_transpose=torch.zeros(shape[::-1], dtype=torch.uint8))
    if cls is Float8Tensor:
        return Float8Tensor(shape=shape, dtype=torch.bfloat16, requires_grad=False, device="cpu", **kwargs)
    return cls(fake_dtype=torch.bfloat16, **kwargs)
