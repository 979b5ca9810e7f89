"""A Megatron-Core GPT-MoE model in Megatron's own training loop, one or more GPUs.

What ``benchmarks/megatron_gpt.py`` times and the multi-GPU and FP8 tests check: Megatron's
``GPTModel`` from its Transformer Engine layer spec (``use_te_offload_ops`` on it for our
experts), the alltoall token dispatcher with expert parallelism ``ep``, wrapped in Megatron's
``DistributedDataParallel`` with the distributed optimizer, trained by
``get_forward_backward_func()`` over ``microbatches`` micro-batches then ``optimizer.step()``,
on random tokens. Megatron's parallel state must be set up first (:func:`init_parallel`).

Megatron's non-TE linear layers (the output layer) call APEX's ``fused_weight_gradient_mlp_cuda``
under ``gradient_accumulation_fusion``; where APEX is missing, :func:`install_wgrad_accum_standin`
registers a torch stand-in before Megatron is imported.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
import sys
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Optional

WGRAD_ACCUM_MODULE = "fused_weight_gradient_mlp_cuda"
# Megatron's fine-grained offloading names; the three that touch the routed experts are ours too.
EXPERT_OFFLOAD_CHOICES = ("expert_fc1", "moe_act", "fused_group_mlp")


def install_wgrad_accum_standin() -> bool:
    """Make ``import fused_weight_gradient_mlp_cuda`` work (APEX's, or a torch stand-in); True if
    the stand-in was installed. Megatron's linear layers look for it when imported; one imported
    already is given the module too."""
    if sys.modules.get(WGRAD_ACCUM_MODULE) is None:
        try:
            importlib.import_module(WGRAD_ACCUM_MODULE)
        except ImportError:
            sys.modules[WGRAD_ACCUM_MODULE] = _wgrad_accum_standin()
    installed = getattr(sys.modules[WGRAD_ACCUM_MODULE], "__doc__", "") == _STANDIN_DOC
    layers = sys.modules.get("megatron.core.tensor_parallel.layers")
    if layers is not None and not getattr(layers, "_grad_accum_fusion_available", True):
        layers.fused_weight_gradient_mlp_cuda = sys.modules[WGRAD_ACCUM_MODULE]
        layers._grad_accum_fusion_available = True
    return installed


_STANDIN_DOC = "torch stand-in for APEX's fused_weight_gradient_mlp_cuda (te_offload_ops benchmarks and tests)"


def _wgrad_accum_standin() -> types.ModuleType:
    import torch

    def wgrad_gemm_accum(total_input: "torch.Tensor", grad_output: "torch.Tensor", main_grad: "torch.Tensor"):
        # main_grad (out x in) += grad_output^T (out x tokens) @ input (tokens x in): APEX's contract
        main_grad.add_(torch.matmul(grad_output.t(), total_input))

    module = types.ModuleType(WGRAD_ACCUM_MODULE, _STANDIN_DOC)
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum
    return module


@dataclass(frozen=True)
class GPTShape:
    """The model and the tokens one rank trains per step (``microbatches`` x ``micro_batch`` x ``seq``)."""

    layers: int = 4
    hidden: int = 2048
    heads: int = 16
    ffn: int = 1408  # moe_ffn_hidden_size
    experts: int = 16
    topk: int = 4
    seq: int = 2048
    micro_batch: int = 4
    microbatches: int = 2
    vocab: int = 32768

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches * self.micro_batch * self.seq

    def check(self, ep: int) -> None:
        """ValueError naming the first field that cannot build a model at expert parallelism ``ep``."""
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.topk > self.experts:
            raise ValueError(f"topk ({self.topk}) must be at most experts ({self.experts})")
        if isinstance(ep, bool) or not isinstance(ep, int) or ep <= 0 or self.experts % ep:
            raise ValueError(f"experts ({self.experts}) must be a multiple of the expert parallelism ({ep!r})")


# A variant name may end in a precision: the step then runs under that FP8 recipe, as Megatron's
# fp8 and fp8_recipe settings ask (Float8BlockScaling, current scaling, delayed scaling)
PRECISIONS = {"+fp8block": ("e4m3", "blockwise"), "+fp8current": ("hybrid", "tensorwise"),
              "+fp8delayed": ("hybrid", "delayed")}


def split_precision(name: str) -> tuple[str, str]:
    """(the variant name without its precision suffix, the suffix; "" for bf16)."""
    for suffix in PRECISIONS:
        if name.endswith(suffix):
            return name[: -len(suffix)], suffix
    return name, ""


@dataclass(frozen=True)
class Variant:
    """How the experts run and what offloads: one row of the benchmark, one side of a test."""

    ours: bool = True
    offload_modules: tuple = ()  # Megatron's fine-grained offloading (empty: off)
    teo_scope: Optional[str] = None  # use_teo_offload's scope (None: teo off)
    teo_layers: Optional[int] = None  # use_teo_offload's num_layers (None: all)
    teo_budget_gib: Optional[float] = None  # use_teo_offload's memory_budget, GiB
    teo_reload_ahead: int = 0  # use_teo_offload's reload_ahead
    teo_host_memory: str = "pinned"  # teo's host buffers: "pinned" | "write-combined" (TEO_HOST_MEMORY)
    kernel_dtoh: bool = False  # use_kernel_dtoh: the dispatcher's split sizes to the host by kernel
    copy_traffic: bool = False  # the offload copies' bytes moved with no engine (CopyTraffic)
    copy_piece_mib: Optional[int] = None  # CopyTraffic's copies fed in pieces of this size, one queued at a time
    cuda_graph_modules: tuple = ()  # Megatron's per-layer CUDA graphs (TE's make_graphed_callables) of these
    capacity_factor: Optional[float] = None  # Megatron's drop-and-pad MoE: each expert gets this x its even share
    ep_overlap: bool = False  # overlap_moe_expert_parallel_comm + delay_wgrad_compute
    fp8: Optional[str] = None  # "hybrid" | "e4m3"
    fp8_recipe: Optional[str] = None  # "delayed" | "tensorwise" | "blockwise"
    extra: dict = field(default_factory=dict)  # more TransformerConfig fields


# ------------------------------------------------------------------------------------------------
# Process and parallel state


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(base: Optional[dict] = None) -> dict:
    """The environment for ranks on this host: NVLink multicast off (the GPU host requires it)."""
    env = dict(os.environ if base is None else base)
    env["NCCL_NVLS_ENABLE"] = "0"
    env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    env["NVSHMEM_DISABLE_NVLS"] = "1"
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a rank that fails ends its peers' waits
    return env


def init_parallel(ep: int, seed: int, timeout_minutes: int = 5) -> tuple[int, int]:
    """torch.distributed (from torchrun's environment, or one rank) and Megatron's parallel state
    with expert parallelism ``ep``, Megatron's RNG tracker seeded; returns (rank, world size)."""
    import random

    import numpy
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    for name, value in worker_env({}).items():
        os.environ[name] = value
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        if "TORCHELASTIC_RUN_ID" not in os.environ:  # not under torchrun (whose store it must join): its own
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(free_port())
        torch.distributed.init_process_group("nccl", rank=rank, world_size=world,
                                             timeout=datetime.timedelta(minutes=timeout_minutes))
    if world % ep:
        raise ValueError(f"expert parallelism {ep} does not divide the {world} ranks")
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=ep, create_gloo_process_groups=False)
    # every generator, as Megatron's trainer seeds them: some weights (the router's) are drawn on the host
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return rank, world


def use_graphable_rng(seed: int) -> None:
    """TE's RNG tracker, which CUDA graph capture needs, in place of Megatron's (models built from
    here on use it), and a stream off the legacy default one, which capture refuses (as Megatron's
    trainer). Called after the reference weights are made: the trackers draw different weights."""
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.cuda.set_stream(torch.cuda.Stream())
    model_parallel_cuda_manual_seed(seed, te_rng_tracker=True, use_cudagraphable_rng=True, force_reset_rng=True)


def run_rank(out_dir, ep: int, seed: int, body, *, result: dict) -> int:
    """One rank of a benchmark job: Megatron's parallel state (:func:`init_parallel`), then
    ``body(rank)`` (a dict merged into the result), written to ``out_dir/rank<r>.json`` with the
    GPU's name, or the error and its traceback. Exits non-zero on an error, so torchrun stops the
    other ranks rather than leave them waiting in a collective."""
    import json
    import traceback

    import torch

    install_wgrad_accum_standin()
    rank = int(os.environ.get("RANK", "0"))
    result = {"rank": rank, **result}
    ok, started = True, False
    try:
        rank, result["world"] = init_parallel(ep, seed, timeout_minutes=3)
        started = True
        result["gpu"] = torch.cuda.get_device_name()
        result.update(body(rank))
    except Exception as exc:  # noqa: BLE001 (reported in the result; the launcher goes on with the next job)
        ok = False
        result.update(error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc())
        print(f"rank {rank}: {result['error']}\n{result['traceback']}", flush=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
    if started:
        if ok:
            torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0 if ok else 1


# ------------------------------------------------------------------------------------------------
# Model, DDP, optimizer


def make_config(shape: GPTShape, variant: Variant, ep: int):
    """Megatron's TransformerConfig for ``shape`` under ``variant`` (squared-ReLU experts, bf16)."""
    import torch
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        ffn_hidden_size=shape.ffn, moe_ffn_hidden_size=shape.ffn, num_moe_experts=shape.experts,
        moe_router_topk=shape.topk, moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", moe_router_dtype="fp32", moe_permute_fusion=True,
        expert_model_parallel_size=ep, activation_func=squared_relu, use_fused_weighted_squared_relu=True,
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, use_transformer_engine_op_fuser=True,
        gradient_accumulation_fusion=True,
    )
    if variant.offload_modules:
        kwargs.update(fine_grained_activation_offloading=True, offload_modules=list(variant.offload_modules))
    if variant.ep_overlap:
        kwargs.update(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True)
    if variant.capacity_factor is not None:  # static shapes: every expert's tokens padded to its capacity
        kwargs.update(moe_expert_capacity_factor=variant.capacity_factor, moe_pad_expert_input_to_capacity=True)
    if variant.fp8 is not None:
        kwargs.update(fp8=variant.fp8, fp8_recipe=variant.fp8_recipe or "delayed")
        # not with drop-and-pad, whose capacities are already fixed (padding them again would shift
        # every expert's rows past the dispatcher's count), nor with moe_preprocess graphed (Megatron
        # refuses the two together)
        if "moe_preprocess" not in variant.cuda_graph_modules and variant.capacity_factor is None:
            # the router pads each expert's tokens for the quantized GEMMs, as Megatron's FP8
            # recipes advise: else the experts pad them after reading the counts on the host
            kwargs.update(moe_router_padding_for_quantization=True)
    if variant.cuda_graph_modules:
        kwargs.update(cuda_graph_impl="transformer_engine", cuda_graph_modules=list(variant.cuda_graph_modules),
                      cuda_graph_warmup_steps=1, use_te_rng_tracker=True)
        if variant.offload_modules:  # Megatron's copies wait for the next layer's replay, as its trainer runs them
            kwargs.update(delay_offload_until_cuda_graph=True)
    kwargs.update(variant.extra)
    return TransformerConfig(**kwargs)


def layer_spec(config, ours: bool):
    """Megatron's TE layer spec with grouped-GEMM MoE (every layer an MoE layer); ours: with
    use_te_offload_ops."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from te_offload_ops.megatron import use_te_offload_ops

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=True)
    return use_te_offload_ops(spec) if ours else spec


def build_gpt(shape: GPTShape, config, ours: bool, weights: Optional[dict] = None):
    """GPTModel on this rank's GPU (rope, untied output layer); ``weights``: a state dict to load."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    model = GPTModel(config=config, transformer_layer_spec=layer_spec(config, ours), vocab_size=shape.vocab,
                     max_sequence_length=shape.seq, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False).cuda()
    if weights is not None:
        model.load_state_dict(weights)
    return model


def cpu_state(model) -> dict:
    """``model``'s state dict on the host (tensors copied), to build another model from."""
    import torch

    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}


def reference_weights(shape: GPTShape, ep: int) -> tuple[dict, float]:
    """The weights every variant starts from: a stock GPTModel's, initialised from the seed
    :func:`init_parallel` set (so alike in every process with the same seed and EP), on the host;
    and their digest (the sum of every weight, in fp64) to tell processes' weights apart."""
    import torch

    config = make_config(shape, Variant(ours=False), ep)
    model = build_gpt(shape, config, ours=False)
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    weights = cpu_state(model)
    del model
    release(config)
    torch.cuda.reset_peak_memory_stats()
    return weights, digest


def wrap_for_training(model, config, *, lr: float = 1e-4, optimizer: bool = True):
    """Megatron's DDP (fp32 grads, overlapped reduce) and distributed Adam; sets the config hooks
    Megatron's training loop sets. Returns (ddp_model, optimizer); the optimizer is None where
    ``optimizer`` is False (grads only: no fp32 main weights or Adam state allocated)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # delay_wgrad_compute: DDP then reduces a deferred wgrad when backward_dw has added it, as Megatron's
    # training script sets it from the same flag
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=True,
                                               use_distributed_optimizer=True,
                                               delay_wgrad_compute=bool(getattr(config, "delay_wgrad_compute", False)))
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func = ddp.no_sync
    config.grad_sync_func = ddp.start_grad_sync
    config.finalize_model_grads_func = finalize_model_grads
    if not optimizer:
        return ddp, None
    opt_config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, bf16=True,
                                 params_dtype=config.params_dtype, use_distributed_optimizer=True, clip_grad=1.0)
    return ddp, get_megatron_optimizer(opt_config, [ddp], use_gloo_process_groups=False)


def release(config) -> None:
    """Free a trained model's GPU memory once the caller dropped its references: the config's hooks
    hold the DDP wrapper (a reference cycle, so gc must run before the allocator can give it back)."""
    import gc

    import torch

    config.no_sync_func = config.grad_sync_func = config.finalize_model_grads_func = None
    gc.collect()
    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# Data and one training step


def random_batches(shape: GPTShape, seed: int, device: Any = "cuda") -> list[dict]:
    """One step's micro-batches of random tokens (the same on every call with the same seed)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    batches = []
    for _ in range(shape.microbatches):
        tokens = torch.randint(0, shape.vocab, (shape.micro_batch, shape.seq + 1), generator=g)
        batches.append({
            "tokens": tokens[:, :-1].contiguous().to(device),
            "labels": tokens[:, 1:].contiguous().to(device),
            "position_ids": torch.arange(shape.seq).unsqueeze(0).expand(shape.micro_batch, -1).contiguous().to(device),
            "loss_mask": torch.ones(shape.micro_batch, shape.seq, device=device),
        })
    return batches


def _loss(loss_mask, output_tensor):
    losses = output_tensor.float().reshape(-1)  # GPTModel's per-token losses, [batch, seq]
    mask = loss_mask.reshape(-1).float()
    loss = (losses * mask).sum() / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator: Iterator, model, return_schedule_plan: bool = False):
    """Megatron's forward_step_func: the GPT forward with labels, or its schedule plan (EP overlap)."""
    from functools import partial

    batch = next(data_iterator)
    inputs = dict(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                  labels=batch["labels"])
    if return_schedule_plan:
        return model.build_schedule_plan(**inputs, loss_mask=batch["loss_mask"]), partial(_loss, batch["loss_mask"])
    return model(**inputs), partial(_loss, batch["loss_mask"])


def train_step(ddp, optimizer, shape: GPTShape, batches: list[dict], *, step_optimizer: bool = True,
               after_backward=None) -> float:
    """One Megatron training step (zeroed grads, forward/backward over the micro-batches, grads
    reduced, then the optimizer unless ``step_optimizer`` is False or ``optimizer`` None); the mean
    loss of the step. ``after_backward(ddp)`` runs between the backward and the optimizer (e.g. to
    read grads)."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    if optimizer is not None:
        optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
        num_microbatches=len(batches), seq_length=shape.seq, micro_batch_size=shape.micro_batch,
        decoder_seq_length=shape.seq, forward_only=False)
    if after_backward is not None:
        after_backward(ddp)
    if step_optimizer and optimizer is not None:
        optimizer.step()
    return float(torch.stack([d["lm loss"] for d in losses]).mean())


# ------------------------------------------------------------------------------------------------
# What moved


class MegatronOffloadCounter:
    """Counts the bytes Megatron's fine-grained offloading copies to the host, while installed."""

    def __init__(self):
        self.bytes = 0
        self._real = None

    def __enter__(self):
        from megatron.core.pipeline_parallel import fine_grained_activation_offload as fgo

        self._fgo = fgo
        self._real = real = fgo.ChunkOffloadHandler.offload
        counter = self

        def counting(handler, src_tensor, *args, **kwargs):
            counter.bytes += src_tensor.numel() * src_tensor.element_size()
            return real(handler, src_tensor, *args, **kwargs)

        fgo.ChunkOffloadHandler.offload = counting
        return self

    def __exit__(self, *exc):
        self._fgo.ChunkOffloadHandler.offload = self._real
        return False


class FusedForwardCounter:
    """While entered: how many forwards of this package's fused MLP ran in Python. Experts that a
    CUDA graph replays run none (their kernels replay without the op being called)."""

    def __enter__(self):
        from te_offload_ops.fused.srelu_mlp import FusedScaledSReLUMLP

        self.calls, self._cls = 0, FusedScaledSReLUMLP
        self._original = original = FusedScaledSReLUMLP.fuser_forward

        def counted(op, *args, **kwargs):
            self.calls += 1
            return original(op, *args, **kwargs)

        FusedScaledSReLUMLP.fuser_forward = counted
        return self

    def __exit__(self, *exc) -> None:
        self._cls.fuser_forward = self._original


def experts_path(model) -> str:
    """What the first MoE layer's experts ran (after a forward): the op fuser's forward plan."""
    for module in model.modules():
        ops = getattr(module, "_fused_ops", None)
        if ops is not None and hasattr(module, "_with_fused_impl"):
            return "+".join(type(op).__name__ for group in ops[0]._module_groups for op, _ in group._forward_ops)
    return "not run"


def use_host_memory(variant: Variant) -> None:
    """teo's host memory as ``variant`` asks: $TEO_HOST_MEMORY, read where teo's shared pool is
    made (after this, in this process)."""
    from te_offload_ops.engines.teo.pool import HOST_MEMORY_ENV

    os.environ[HOST_MEMORY_ENV] = variant.teo_host_memory


def apply_teo(model, variant: Variant):
    """use_teo_offload for ``variant`` (None where teo is off)."""
    if variant.teo_scope is None:
        return None
    from te_offload_ops.megatron import use_teo_offload

    use_host_memory(variant)

    budget = None if variant.teo_budget_gib is None else int(variant.teo_budget_gib * 2**30)
    return use_teo_offload(model, scope=variant.teo_scope, num_layers=variant.teo_layers, memory_budget=budget,
                           reload_ahead=variant.teo_reload_ahead)


class LayerGraphs:
    """Megatron's per-layer CUDA graphs as its trainer makes them (``cuda_graph_impl=
    "transformer_engine"``): :meth:`capture` after the warm-up steps, replays from then on.
    The experts stay eager (their token counts change every step) unless ``moe`` is graphed, which
    Megatron takes only with drop-and-pad MoE (static shapes). Graphing
    ``moe_preprocess`` also moves the dispatcher's device-to-host sync to before its all-to-all,
    so a graphed step differs from an eager one in that as well as in its launches."""

    def __init__(self, ddp, optimizer, config, shape: "GPTShape", data_parallel: int, rank: int):
        from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        init_num_microbatches_calculator(rank, None, shape.micro_batch * shape.microbatches * data_parallel,
                                         shape.micro_batch, data_parallel)
        self.ddp = ddp
        self.helper = TECudaGraphHelper(model=[ddp], config=config, seq_length=shape.seq,
                                        micro_batch_size=shape.micro_batch,
                                        optimizers=[optimizer] if optimizer is not None else [])

    def capture(self) -> float:
        """Captures the graphs; returns the seconds it took. DDP's forward pre-hooks (there only
        with overlap_param_gather) are off during the capture and run by the graphs' manual hooks
        after it, as Megatron's trainer does."""
        import time

        t0 = time.perf_counter()
        pre_hooks = bool(getattr(self.ddp, "use_forward_hook", False))
        if pre_hooks:
            self.ddp.disable_forward_pre_hook(param_sync=False)
        self.helper.create_cudagraphs()
        if pre_hooks:
            self.ddp.enable_forward_pre_hook()
            self.helper.cuda_graph_set_manual_hooks()
        return time.perf_counter() - t0

    def remove(self) -> None:
        from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

        try:
            if self.helper.graphs_created():  # not after a failed warm-up or capture
                self.helper.delete_cuda_graphs()
        finally:
            destroy_num_microbatches_calculator()


def apply_layer_graphs(ddp, optimizer, config, variant: Variant, shape: "GPTShape", data_parallel: int, rank: int):
    """LayerGraphs for ``variant`` (None where it graphs nothing)."""
    if not variant.cuda_graph_modules:
        return None
    return LayerGraphs(ddp, optimizer, config, shape, data_parallel, rank)


class CopyTraffic:
    """The bytes an engine offloading the routed experts of the first ``layers`` MoE layers would
    move, moved with no engine: after each experts' forward a device-to-host copy of
    ``bytes_per_layer`` from a scratch buffer, and when its backward begins the copy back, each on
    a side stream after the compute stream's work so far. Nothing is saved, freed or waited for:
    a step that slows under it slows from the copies themselves, not from an engine's hooks.
    The compute stream never waits for a copy back (an engine's reload must land before its use),
    so this is a lower bound on what the copies cost. ``bytes``: moved so far, device to host (as
    the engines' counters count)."""

    def __init__(self, model, layers: int, bytes_per_layer: int, piece_bytes: Optional[int] = None):
        from te_offload_ops.engines.teo.pool import host_bytes
        from te_offload_ops.megatron.teo_offload import find_offload_modules

        import torch

        modules = find_offload_modules(model, "experts")[:layers]
        self.bytes = 0
        self._numel = bytes_per_layer // 2
        device = torch.cuda.current_device()
        self._src = torch.empty(self._numel, dtype=torch.bfloat16, device=device)
        self._dst = torch.empty_like(self._src)
        self._host = host_bytes(self._numel * 2).view(torch.bfloat16)  # the host memory teo would use
        self._d2h, self._h2d = torch.cuda.Stream(), torch.cuda.Stream()
        # paced: each direction's copies fed in pieces by a host thread of its own, one piece queued
        # at a time, so that a small copy the compute stream queues in the same direction (the
        # dispatcher's split sizes to the host) waits behind one piece, not a whole layer's copy
        self._feeders = None
        if piece_bytes:
            self._feeders = {s: PacedCopies(device, s, piece_bytes // 2) for s in (self._d2h, self._h2d)}
        self._handles = [m.register_forward_hook(self._after_forward) for m in modules]

    def _copy(self, stream, dst, src):
        import torch

        if self._feeders is not None:
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream())
            self._feeders[stream].submit(dst, src, after)
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def _after_forward(self, module, args, output):
        import torch

        if not torch.is_grad_enabled():
            return
        self._copy(self._d2h, self._host, self._src)
        self.bytes += self._numel * 2
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: self._copy(self._h2d, self._dst, self._host))

    def remove(self):
        for h in self._handles:
            h.remove()
        for feeder in (self._feeders or {}).values():
            feeder.close()


class PacedCopies:
    """Copies fed to one stream from a host thread in pieces of ``piece_numel`` elements, each queued
    once the one before has ended: the stream's copy engine never holds more than one piece of them
    ahead of another stream's copy in the same direction. A copy starts after the event it was
    submitted with (the compute stream's work when it was asked for). As a diagnostic it keeps
    CopyTraffic's looseness: a copy back is not ordered after the copy out of the same scratch
    buffer, and a step's closing synchronize does not wait for pieces the thread has not queued
    yet (they run in the next step: the same bytes a step in steady state). The thread takes the
    GIL back for every piece and spins on a host core while one runs (a default CUDA event)."""

    def __init__(self, device: int, stream, piece_numel: int):
        import queue
        import threading

        self._stream, self._piece = stream, max(1, piece_numel)
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, args=(device,), daemon=True, name="paced-copies")
        self._thread.start()

    def submit(self, dst, src, after) -> None:
        self._jobs.put((dst, src, after))

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()

    def _run(self, device: int) -> None:
        import torch

        torch.cuda.set_device(device)
        done = torch.cuda.Event()
        while (job := self._jobs.get()) is not None:
            dst, src, after = job
            self._stream.wait_event(after)
            for i in range(0, src.numel(), self._piece):
                with torch.cuda.stream(self._stream):
                    dst[i:i + self._piece].copy_(src[i:i + self._piece], non_blocking=True)
                done.record(self._stream)
                done.synchronize()  # releases the GIL while the piece runs


def apply_copy_traffic(model, variant: Variant, shape: "GPTShape"):
    """CopyTraffic for ``variant`` (None where it is off): teo's "experts" scope over the first
    L - 1 layers moves each routed token's fc1 input and fc1 output, (H + F) bf16 values."""
    if not variant.copy_traffic:
        return None
    use_host_memory(variant)
    routed = shape.micro_batch * shape.seq * shape.topk  # per rank at any EP, on average
    piece = variant.copy_piece_mib << 20 if variant.copy_piece_mib else None
    return CopyTraffic(model, shape.layers - 1, routed * (shape.hidden + shape.ffn) * 2, piece_bytes=piece)
