"""A stack of MoE transformer layers built from Transformer Engine's parts, for benchmarks and tests.

Each layer (pre-norm):

    x = x + proj(attention(LayerNormLinear qkv (x)))            TE LayerNormLinear, causal SDPA, TE Linear
    h = LayerNorm(x)                                              TE LayerNorm
    probs, routing_map = top-k softmax router(Linear(h))          TE Linear, TE fused_topk_with_score_function
    xp, pp, row_id_map = moe_permute_with_probs(h, probs, map)    TE permutation
    y = grouped SReLU MLP(xp, splits, pp, splits)                 this package's GroupedLinear/ScaledSReLU
    x = x + moe_unpermute(y, row_id_map)                          TE permutation

Tokens are rows of a (batch * seq, hidden) tensor, sequence by sequence. Where the offload context
goes is the caller's choice (``scope``): around each whole layer, or only around its grouped MLP.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
import transformer_engine.pytorch as te
from transformer_engine.pytorch.permutation import moe_permute_with_probs, moe_unpermute
from transformer_engine.pytorch.router import fused_topk_with_score_function

import te_offload_ops as teo
from te_offload_ops import policy

from bench_common import mlp_path

ATTENTION_KINDS = ("sdpa", "te")
SCOPES = ("layer", "mlp")  # what runs inside the offload context


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    heads: int
    ffn: int
    experts: int
    topk: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class MoETransformerLayer(torch.nn.Module):
    def __init__(self, shape: LayerShape, dtype: torch.dtype, attention: str = "sdpa"):
        super().__init__()
        if shape.hidden % shape.heads:
            raise ValueError(f"hidden={shape.hidden} is not a multiple of heads={shape.heads}")
        if not 0 < shape.topk <= shape.experts:
            raise ValueError(f"topk={shape.topk} must be in 1..experts={shape.experts}")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        H, E, Fd = shape.hidden, shape.experts, shape.ffn
        self.shape, self.attention = shape, attention
        kw = dict(bias=False, params_dtype=dtype, device="cuda")
        self.qkv = te.LayerNormLinear(H, 3 * H, **kw)
        self.proj = te.Linear(H, H, **kw)
        self.norm = te.LayerNorm(H, dtype=dtype, device="cuda")
        self.router = te.Linear(H, E, **kw)
        self.mlp = te.ops.Sequential(
            teo.GroupedLinear(E, H, Fd, bias=False, device="cuda", dtype=dtype),
            teo.ScaledSReLU(),
            teo.GroupedLinear(E, Fd, H, bias=False, device="cuda", dtype=dtype),
        )
        if attention == "te":
            self.dpa = te.DotProductAttention(shape.heads, shape.head_dim, attn_mask_type="causal",
                                              qkv_format="bshd", attention_dropout=0.0)

    def attend(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        T, H = x.shape
        nh, d = self.shape.heads, self.shape.head_dim
        qkv = self.qkv(x).view(batch, T // batch, 3, nh, d)
        if self.attention == "te":
            o = self.dpa(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
            return self.proj(o.reshape(T, H))
        # SDPA saves its inputs as given: contiguous (batch, heads, seq, dim) copies can be offloaded,
        # strided views of qkv cannot (TE V2 skips them). Marked through the policy, as TE's own
        # attention marks its q, k, v, so that TE V1 offloads them as well.
        q, k, v = (qkv[:, :, i].transpose(1, 2).contiguous() for i in range(3))
        policy.mark_saved_tensors((q, k, v), offload=True)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(o.transpose(1, 2).reshape(T, H))

    def moe(self, h: torch.Tensor, mlp_region: Optional[tuple]) -> torch.Tensor:
        T = h.shape[0]
        k = self.shape.topk
        probs, routing_map = fused_topk_with_score_function(
            self.router(h), k, use_pre_softmax=False, num_groups=None, group_topk=None,
            scaling_factor=None, score_function="softmax", expert_bias=None)
        splits = routing_map.sum(dim=0)  # tokens per expert, kept on the GPU
        xp, pp, row_id_map = moe_permute_with_probs(h, probs.to(h.dtype), routing_map, num_out_tokens=T * k)
        ctx, sync = mlp_region or (contextlib.nullcontext(), None)
        with ctx:
            y = self.mlp(xp, splits, pp, splits)
        if sync is not None:
            y = sync(y)
        return moe_unpermute(y, row_id_map, restore_shape=h.shape)

    def forward(self, x: torch.Tensor, batch: int, mlp_region: Optional[tuple] = None) -> torch.Tensor:
        x = x + self.attend(x, batch)
        return x + self.moe(self.norm(x), mlp_region)


def build_stack(shape: LayerShape, layers: int, dtype: torch.dtype, attention: str = "sdpa",
                seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(MoETransformerLayer(shape, dtype, attention) for _ in range(layers))


def forward_stack(stack: torch.nn.ModuleList, x: torch.Tensor, batch: int, scope: str,
                  context=None, sync: Optional[Callable] = None) -> torch.Tensor:
    """Runs the stack with ``context``/``sync`` (TE's offload pair) around each layer or each MLP.

    The context is entered once per layer either way, as TE's engines count layers by entries.
    """
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    context = context if context is not None else contextlib.nullcontext()
    h = x
    for layer in stack:
        if scope == "layer":
            with context:
                h = layer(h, batch)
            h = sync(h) if sync is not None else h
        else:
            h = layer(h, batch, mlp_region=(context, sync))
    return h


def compute_path(stack: torch.nn.ModuleList) -> str:
    """ "fused" when every layer's MLP ran this package's Hopper fused op (after a forward), else "unfused"."""
    return "fused" if all(mlp_path(layer.mlp) == "fused" for layer in stack) else "unfused"
