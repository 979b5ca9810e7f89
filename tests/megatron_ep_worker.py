"""One rank of tests/test_megatron_ep_gpu.py: Megatron-Core with expert parallelism over the ranks.

Run by the test as ``torchrun --nproc-per-node 2 tests/megatron_ep_worker.py --out DIR``. Each
case builds stock and our experts from the same weights, runs them, and writes what it measured
(relative errors, bitwise equalities, routing flips, bytes moved, forward plans; or the error) to
``DIR/rank<r>.json`` after every case; the test asserts on those files. Cases:

* ``moe_layer/<choice>``: Megatron's MoELayer (router, alltoall dispatcher, experts) at EP=2 with
  our experts under each ``offload_modules`` choice (none, expert_fc1, moe_act,
  fused_group_mlp) against stock experts without offloading (Megatron's op-fuser path refuses
  expert_fc1 and moe_act) and against ours without offloading (bitwise): outputs, input and
  router grads, experts' main_grads over two micro-batches.
* ``numerics``: a GPTModel's first training step, ours against stock with routing set apart
  (``benchmarks/megatron_gpt_numerics.py``: the first MoE layer's input and routing, stock's
  routing replayed into ours, each with its own routing against a measured noise floor).
* ``ep_overlap``: the GPTModel trained by Megatron's schedule with ``overlap_moe_expert_parallel_comm``
  and ``delay_wgrad_compute`` (the 1F1B A2A-overlap schedule, expert wgrads deferred to
  ``backward_dw``) on our fused experts, against ours on the plain schedule.
* ``teo``: the same GPTModel on the plain schedule under ``use_teo_offload`` (whole layers; routed
  experts with a memory budget) against no offloading: losses and grads bitwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")  # bitwise comparisons need TE's deterministic kernels

from megatron_gpt_model import (  # noqa: E402
    EXPERT_OFFLOAD_CHOICES,
    GPTShape,
    Variant,
    apply_teo,
    build_gpt,
    experts_path,
    init_parallel,
    install_wgrad_accum_standin,
    make_config,
    random_batches,
    reference_weights,
    release,
    train_step,
    wrap_for_training,
)
from megatron_gpt_numerics import compare, measure, summary  # noqa: E402
from megatron_offloading import megatron_offloading  # noqa: E402  (tests/, the script's own folder)

install_wgrad_accum_standin()

EP = 2
MOE = dict(experts=8, hidden=1024, ffn=768, seq=1024, batch=2, topk=2)
GPT = GPTShape(layers=2, hidden=1024, heads=8, ffn=768, experts=8, topk=2, seq=1024, micro_batch=2,
               microbatches=2, vocab=4096)
# stock on the EP-overlap schedule runs last: a CUDA error there ends the process
CASES = ("moe_layer", "numerics", "teo", "ep_overlap")


# -- Megatron's MoE layer at EP=2 ----------------------------------------------------------------


def moe_config(offload_modules=()):
    import torch
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=1, hidden_size=MOE["hidden"], ffn_hidden_size=MOE["ffn"], moe_ffn_hidden_size=MOE["ffn"],
        num_attention_heads=8, num_moe_experts=MOE["experts"], moe_router_topk=MOE["topk"], moe_grouped_gemm=True,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="none", moe_router_dtype="fp32",
        moe_permute_fusion=True, expert_model_parallel_size=EP, activation_func=squared_relu,
        use_fused_weighted_squared_relu=True, add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        hidden_dropout=0.0, attention_dropout=0.0, use_transformer_engine_op_fuser=True,
        gradient_accumulation_fusion=True)
    if offload_modules:
        # size 0: every tensor Megatron may move is moved, so a missing mark shows up as bytes
        kwargs.update(fine_grained_activation_offloading=True, offload_modules=list(offload_modules),
                      min_offloaded_tensor_size=0)
    return TransformerConfig(**kwargs)


def moe_layer(config, ours: bool, like=None):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    from te_offload_ops.megatron import use_te_offload_ops

    spec = get_moe_module_spec(use_te=True, num_experts=MOE["experts"], moe_grouped_gemm=True)
    layer = (use_te_offload_ops(spec) if ours else spec)(config=config).cuda().train()
    if like is not None:
        layer.load_state_dict(like.state_dict())
    return layer


def moe_inputs(layer, rank: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(100 + rank)  # each rank routes its own tokens
    shape = (MOE["seq"], MOE["batch"], MOE["hidden"])
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    prefill = {n: 1e-2 * torch.randn(p.shape, device="cuda", dtype=torch.float32, generator=g)
               for n, p in layer.experts.named_parameters()}
    return x, dy, prefill


def moe_step(layer, inputs, *, fresh: bool, offload=None) -> dict:
    """Forward + backward of ``layer``; main_grad starts from the prefill when ``fresh``, else accumulates."""
    import torch

    x0, dy, prefill = inputs
    for p in layer.parameters():
        p.grad = None
    params = dict(layer.experts.named_parameters())
    for n, p in params.items():
        if fresh:
            p.main_grad = prefill[n].clone()
        if hasattr(p, "grad_added_to_main_grad"):
            del p.grad_added_to_main_grad
    x = x0.clone().requires_grad_()
    with offload if offload is not None else contextlib.nullcontext():
        out, _ = layer(x)
        out.backward(dy)
    torch.cuda.synchronize()
    result = {"out": out.detach(), "x.grad": x.grad, "router.grad": layer.router.weight.grad}
    result.update({f"main_grad.{n}": p.main_grad.clone() for n, p in params.items()})
    return result


def case_moe_layer(rank: int) -> dict:
    import torch

    stock = moe_layer(moe_config(), ours=False)
    plain = moe_layer(moe_config(), ours=True, like=stock)
    inputs = moe_inputs(stock, rank)
    results = {}
    for choice in ("none", *EXPERT_OFFLOAD_CHOICES):
        name = f"moe_layer/{choice}"
        try:
            config = moe_config(() if choice == "none" else (choice,))
            ours = moe_layer(config, ours=True, like=stock)
            moved = [0]
            vs_stock, vs_plain = {}, {}
            for step in range(2):  # the second micro-batch's wgrads add to the first's main_grad
                offload = megatron_offloading(config, moved) if choice != "none" else None
                a = moe_step(ours, inputs, fresh=step == 0, offload=offload)
                b = moe_step(stock, inputs, fresh=step == 0)
                c = moe_step(plain, inputs, fresh=step == 0)
                vs_stock[step], vs_plain[step] = compare(a, b), compare(a, c)
            ops = ours.experts.fused_ops
            results[name] = {
                "vs_stock": summary(vs_stock[1]), "vs_stock_first": summary(vs_stock[0]),
                "vs_ours_without_offload": summary(vs_plain[1]),
                "offloaded_bytes": moved[0],
                "flags": list(ours.experts.expert_offload.as_tuple()),
                "plan": [type(op).__name__ for group in ops._module_groups for op, _ in group._forward_ops],
                "local_experts": ours.experts.num_local_experts,
            }
            del ours
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 (recorded for the test to report)
            results[name] = {"error": traceback.format_exc()}
    return results


# -- GPTModel in Megatron's training loop ---------------------------------------------------------


def train(variant: Variant, weights: dict, steps: int, *, grads: bool = True) -> dict:
    """``steps`` Megatron training steps of a GPTModel built from ``weights``: losses, first step's
    main_grads (after the reduce), experts' forward plan, bytes teo moved."""
    import torch

    config = make_config(GPT, variant, EP)
    model = build_gpt(GPT, config, variant.ours, weights)
    teo = apply_teo(model, variant)
    ddp, optimizer = wrap_for_training(model, config)
    seen = {}

    def read_grads(ddp_model):
        if grads and not seen:
            seen.update({n: p.main_grad.detach().clone() for n, p in ddp_model.module.named_parameters()})

    losses = [train_step(ddp, optimizer, GPT, random_batches(GPT, seed=7 + step + 1000 * torch.distributed.get_rank()),
                         after_backward=read_grads) for step in range(steps)]
    torch.cuda.synchronize()
    out = {"losses": losses, "grads": seen, "plan": experts_path(model),
           "teo_bytes": None if teo is None else teo.counter.total}
    if teo is not None:
        teo.remove()
    del ddp, optimizer, model, teo
    release(config)
    return out


def loss_errors(a: list, b: list) -> list:
    return [abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)]


def case_numerics(rank: int) -> dict:
    weights, _ = reference_weights(GPT, EP)
    batches = random_batches(GPT, seed=7 + 1000 * rank)
    try:
        return {"numerics": measure(GPT, EP, weights, batches, seed=11)}
    except Exception:  # noqa: BLE001
        return {"numerics": {"error": traceback.format_exc()}}


def case_ep_overlap(rank: int) -> dict:
    weights, _ = reference_weights(GPT, EP)
    results = {}
    ours_plain = train(Variant(ours=True), weights, 3)
    try:
        ours = train(Variant(ours=True, ep_overlap=True), weights, 3)
        results["ep_overlap/ours"] = {
            "vs_ours_plain": summary(compare(ours["grads"], ours_plain["grads"])),
            "loss_rel_err_vs_ours_plain": loss_errors(ours["losses"], ours_plain["losses"]),
            "expert_grads_nonzero": all(bool(g.abs().sum() > 0) for n, g in ours["grads"].items() if ".experts." in n),
            "expert_grads": sum(1 for n in ours["grads"] if ".experts." in n),
            "plan": ours["plan"], "losses": ours["losses"]}
    except Exception:  # noqa: BLE001
        results["ep_overlap/ours"] = {"error": traceback.format_exc()}
    try:  # Megatron's stock experts on the same schedule, for the record
        stock = train(Variant(ours=False, ep_overlap=True), weights, 3)
        results["ep_overlap/stock"] = {"loss_rel_err_vs_ours_plain": loss_errors(stock["losses"], ours_plain["losses"]),
                                       "plan": stock["plan"]}
    except Exception:  # noqa: BLE001
        results["ep_overlap/stock"] = {"error": traceback.format_exc()}
    return results


def case_teo(rank: int) -> dict:
    weights, _ = reference_weights(GPT, EP)
    base = train(Variant(ours=True), weights, 2)
    results = {}
    for name, variant in {"teo/layer": Variant(ours=True, teo_scope="layer"),
                          "teo/experts_budget": Variant(ours=True, teo_scope="experts", teo_budget_gib=60.0)}.items():
        try:
            got = train(variant, weights, 2)
            results[name] = {"grads": summary(compare(got["grads"], base["grads"])),
                             "losses_equal": got["losses"] == base["losses"], "losses": got["losses"],
                             "base_losses": base["losses"], "teo_bytes": got["teo_bytes"], "plan": got["plan"]}
        except Exception:  # noqa: BLE001
            results[name] = {"error": traceback.format_exc()}
    return results


CASE_FUNCS = {"moe_layer": case_moe_layer, "numerics": case_numerics, "ep_overlap": case_ep_overlap, "teo": case_teo}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="folder for rank<r>.json")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {CASES}")
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASE_FUNCS]
    if unknown:
        p.error(f"unknown cases {unknown}; choose from {CASES}")

    import torch

    rank, world = init_parallel(EP, seed=1234)
    out = {"rank": rank, "world": world, "gpu": torch.cuda.get_device_name(), "cases": {}}
    path = args.out / f"rank{rank}.json"
    for case in cases:
        print(f"[rank {rank}] {case} ...", flush=True)
        try:
            out["cases"].update(CASE_FUNCS[case](rank))
        except Exception:  # noqa: BLE001
            out["cases"][case] = {"error": traceback.format_exc()}
            print(f"[rank {rank}] {case} failed:\n{out['cases'][case]['error']}", flush=True)
        path.write_text(json.dumps(out, indent=1, default=str))
        print(f"[rank {rank}] {case} done", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
