#!/usr/bin/env python3
"""Training loss of Megatron-Core's GPT-MoE model on this package's experts: bf16 against FP8 block
scaling, several seeds, in Megatron's own training step (GPTModel, DDP, distributed Adam).

The model learns a synthetic corpus it can learn: token sequences drawn from a fixed random Markov
chain over the first ``--corpus-vocab`` tokens, each token followed by one of ``--successors``
tokens with falling probabilities (the chain's entropy is the loss floor, printed). Each seed sets
the initial weights (a stock GPTModel's, loaded into every variant alike) and the token stream;
every variant (stock or ours, bf16 or an FP8 recipe) trains ``--steps`` steps from the same
weights on the same tokens as the first variant with that seed, each run in processes of its own,
in rounds through the seeds.

Reported per run: the first loss, the final loss (mean of the last ``--tail`` steps), the median
step time and the peak memory; per seed, each variant's final loss against the first variant's
(the same weights and tokens); and whether their mean difference lies within the first variant's
run-to-run spread (the standard deviation of its final losses over the seeds). Writes
``megatron_loss_<GPU>[_ep<N>].{json,md,png}`` into ``--out``; the JSON after every run, so a run
stopped early keeps what finished.

    python3 benchmarks/megatron_loss.py [--steps 300 --seeds 3 --variants ours,ours+fp8block --ep 1]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_common import command_line, file_stem, pyplot, refuse, save_png, utc_now, write_reports  # noqa: E402
import megatron_gpt_jobs as jobs  # noqa: E402
from megatron_gpt_model import GPTShape, worker_env  # noqa: E402

CHAIN_SEED = 20261126  # the corpus' Markov chain: one for every run
MAX_SUCCESSORS = 64


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = GPTShape()
    for name, default in [("layers", d.layers), ("hidden", d.hidden), ("heads", d.heads), ("ffn", d.ffn),
                          ("experts", d.experts), ("topk", d.topk), ("seq", d.seq),
                          ("micro-batch", d.micro_batch), ("microbatches", d.microbatches), ("vocab", d.vocab)]:
        p.add_argument(f"--{name}", type=int, default=default, help=f"(default {default}; as megatron_gpt.py)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size, one GPU per rank (default 1)")
    p.add_argument("--variants", default="ours,ours+fp8block",
                   help="megatron_gpt.py's variant names; the first is the reference (default ours,ours+fp8block)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4, help="Adam's learning rate, constant (default 3e-4)")
    p.add_argument("--tail", type=int, default=20, help="steps averaged for the final loss (default 20)")
    p.add_argument("--corpus-vocab", type=int, default=4096, help="tokens the corpus uses (default 4096)")
    p.add_argument("--successors", type=int, default=4, help="tokens that may follow each token (default 4)")
    p.add_argument("--job-timeout", type=float, default=600.0, help="seconds one run may take (default 600)")
    p.add_argument("--job-logs", type=Path, default=None, help="keep every run's whole output here")
    p.add_argument("--out", type=Path, default=HERE / "results", help="folder for JSON, markdown, PNG")
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-seed", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    from megatron_gpt import variant_for

    p = parser()
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for name in ("layers", "hidden", "heads", "ffn", "experts", "topk", "seq", "micro_batch", "microbatches",
                 "vocab", "ep", "steps", "seeds", "tail", "corpus_vocab", "successors"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.tail > args.steps:
        p.error(f"--tail ({args.tail}) must not exceed --steps ({args.steps})")
    if not args.lr > 0:
        p.error("--lr must be positive")
    if not args.job_timeout > 0:
        p.error("--job-timeout must be positive")
    if args.successors > MAX_SUCCESSORS:
        p.error(f"--successors must be at most {MAX_SUCCESSORS}, got {args.successors}")
    if args.worker_out is not None and (args.worker_variant is None or args.worker_seed is None):
        p.error("a worker needs --worker-variant and --worker-seed")
    if args.corpus_vocab > args.vocab:
        p.error(f"--corpus-vocab ({args.corpus_vocab}) must not exceed --vocab ({args.vocab})")
    if args.successors > args.corpus_vocab:
        p.error(f"--successors ({args.successors}) must not exceed --corpus-vocab ({args.corpus_vocab})")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if len(args.variants) < 2 or len(set(args.variants)) != len(args.variants):
        p.error("--variants needs at least two distinct names: a reference and what it is compared with")
    for v in args.variants:
        try:
            found = variant_for(v, args.layers, ("expert_fc1",))
        except ValueError as exc:
            p.error(f"--variants: {exc}")
        if found.offload_modules or found.teo_scope or found.copy_traffic or found.kernel_dtoh:
            p.error(f"--variants: {v}: this benchmark trains stock or ours, each in bf16 or with +fp8block, "
                    "+fp8current or +fp8delayed; offloading variants move bytes, not the numbers trained")
    args.shape = GPTShape(**{k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "experts", "topk",
                                                           "seq", "micro_batch", "microbatches", "vocab")})
    try:
        args.shape.check(args.ep)
    except ValueError as exc:
        p.error(str(exc))
    return args


# ------------------------------------------------------------------------------------------------
# The corpus


def successor_probs(successors: int) -> list:
    """The chance of a token's k-th successor: halving from the first (normalised)."""
    weights = [0.5 ** k for k in range(successors)]
    return [w / sum(weights) for w in weights]


def chain_entropy(successors: int) -> float:
    """The corpus' loss floor in nats: the entropy of the next token given the current one."""
    return max(0.0, -sum(q * math.log(q) for q in successor_probs(successors)))


def markov_chain(corpus_vocab: int, successors: int):
    """Each token's successors, a (corpus_vocab, successors) int64 table drawn once for all runs."""
    import torch

    g = torch.Generator().manual_seed(CHAIN_SEED)
    return torch.stack([torch.randperm(corpus_vocab, generator=g)[:successors] for _ in range(corpus_vocab)])


def corpus(chain, successors: int, sequences: int, length: int, seed: int):
    """``sequences`` token sequences of ``length`` from the chain (a random first token each), CPU int64."""
    import torch

    g = torch.Generator().manual_seed(seed)
    probs = torch.tensor(successor_probs(successors))
    picks = torch.multinomial(probs, sequences * length, replacement=True, generator=g).view(sequences, length)
    tokens = torch.empty(sequences, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(0, chain.shape[0], (sequences,), generator=g)
    for t in range(1, length):
        tokens[:, t] = chain[tokens[:, t - 1], picks[:, t]]
    return tokens


def step_batches(shape: GPTShape, tokens, device="cuda") -> list:
    """One step's micro-batches from ``tokens`` (microbatches * micro_batch, seq + 1), labels shifted."""
    import torch

    batches = []
    for mb in tokens.view(shape.microbatches, shape.micro_batch, shape.seq + 1):
        batches.append({
            "tokens": mb[:, :-1].contiguous().to(device), "labels": mb[:, 1:].contiguous().to(device),
            "position_ids": torch.arange(shape.seq).unsqueeze(0).expand(shape.micro_batch, -1).contiguous().to(device),
            "loss_mask": torch.ones(shape.micro_batch, shape.seq, device=device),
        })
    return batches


def rank_tokens(args, seed: int, rank: int):
    """A rank's token sequences for the whole run, (steps * microbatches * micro_batch, seq + 1):
    each rank a stream of its own (data parallelism gives ranks different tokens), the same for
    every variant with that seed."""
    shape = args.shape
    return corpus(markov_chain(args.corpus_vocab, args.successors), args.successors,
                  args.steps * shape.microbatches * shape.micro_batch, shape.seq + 1, seed * 1000 + rank)


# ------------------------------------------------------------------------------------------------
# One run (a worker: every rank of one job)


def train_run(args, rank: int) -> dict:
    import torch

    from megatron_gpt import variant_for
    from megatron_gpt_model import build_gpt, experts_path, make_config, reference_weights, train_step, \
        wrap_for_training

    shape, seed = args.shape, args.worker_seed
    torch.manual_seed(seed)
    weights, digest = reference_weights(shape, args.ep)
    v = variant_for(args.worker_variant, shape.layers, ("expert_fc1",))
    config = make_config(shape, v, args.ep)
    model = build_gpt(shape, config, v.ours, weights)
    ddp, optimizer = wrap_for_training(model, config, lr=args.lr)
    per_step = shape.microbatches * shape.micro_batch
    tokens = rank_tokens(args, seed, rank)
    losses, times = [], []
    for step in range(args.steps):
        batches = step_batches(shape, tokens[step * per_step:(step + 1) * per_step])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(train_step(ddp, optimizer, shape, batches))  # the loss read on the host syncs
        times.append((time.perf_counter() - t0) * 1e3)
        if rank == 0 and (step + 1) % 50 == 0:
            jobs.progress(f"step {step + 1}/{args.steps}: loss {losses[-1]:.4f}")
    return {"variant": args.worker_variant, "seed": seed, "rank": rank, "losses": losses,
            "tokens_digest": int(tokens.sum()),
            "step_ms": statistics.median(times[1:] or times), "peak_GiB": torch.cuda.max_memory_allocated() / 2**30,
            "experts_path": experts_path(model), "weights_digest": digest}


def worker(args) -> int:
    from megatron_gpt_model import run_rank

    return run_rank(args.worker_out, args.ep, args.worker_seed, lambda rank: {"run": train_run(args, rank)},
                    result={})


# ------------------------------------------------------------------------------------------------
# The launcher and the report

START = time.monotonic()


def log(text: str) -> None:
    print(f"[{time.monotonic() - START:6.0f} s] {text}", flush=True)


def run_one(args, variant: str, seed: int) -> dict:
    """One run in processes of its own: the ranks' losses averaged step by step."""
    label = f"seed {seed}: {variant}"
    if args.job_logs is not None:
        args.job_logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        argv = [*args.argv, "--worker-out", tmp, "--worker-variant", variant, "--worker-seed", str(seed)]
        cmd = jobs.command(Path(__file__).resolve(), argv, args.ep)
        found = jobs.run(cmd, Path(tmp), env=worker_env(), cwd=HERE.parent, timeout=args.job_timeout,
                         show=lambda text: log(f"    {label}: {text}"),
                         log_path=None if args.job_logs is None else
                         args.job_logs / f"seed{seed}_{variant.replace('+', '_')}.log")
    why = jobs.failure(found, args.ep)
    if why is not None:
        log(f"{label} failed: {why}; its output ends:\n{found['tail']}")
        return {"variant": variant, "seed": seed, "error": why}
    ranks = [r["run"] for r in found["per_rank"]]
    losses = [statistics.fmean(step) for step in zip(*(r["losses"] for r in ranks))]
    return {"variant": variant, "seed": seed, "gpu": found["per_rank"][0]["gpu"], "losses": losses,
            "tokens_digest": [r["tokens_digest"] for r in ranks],
            "final": statistics.fmean(losses[-args.tail:]), "step_ms": max(r["step_ms"] for r in ranks),
            "peak_GiB": max(r["peak_GiB"] for r in ranks), "experts_path": ranks[0]["experts_path"],
            "weights_digest": ranks[0]["weights_digest"], "seconds": found["seconds"]}


def compare(runs: list, variants: list) -> dict:
    """Per variant after the first: its final loss minus the first's with the same seed (the same
    weights and tokens), and whether their mean lies within the first variant's run-to-run spread:
    the standard deviation of its final losses over the seeds (None with fewer than two)."""
    ok = [r for r in runs if "error" not in r]
    ref = {r["seed"]: r["final"] for r in ok if r["variant"] == variants[0]}
    spread = statistics.stdev(ref.values()) if len(ref) > 1 else None
    out = {"reference": variants[0], "reference_range": [min(ref.values()), max(ref.values())] if ref else None,
           "reference_spread": spread}
    for name in variants[1:]:
        mine = {r["seed"]: r["final"] for r in ok if r["variant"] == name}
        paired = {s: mine[s] - ref[s] for s in mine if s in ref}
        mean = statistics.fmean(paired.values()) if paired else None
        out[name] = {"minus_reference": paired, "mean_minus_reference": mean,
                     "within_reference_spread": None if mean is None or spread is None else abs(mean) <= spread}
    return out


def build_result(args, runs: list, complete: bool) -> dict:
    import torch
    import transformer_engine

    from te_offload_ops.megatron import installed_version

    gpus = [r["gpu"] for r in runs if "gpu" in r]
    return {"benchmark": "megatron_loss", "gpu": gpus[0] if gpus else "unknown GPU", "date": utc_now(),
            "versions": {"megatron-core": installed_version(), "transformer-engine": transformer_engine.__version__,
                         "torch": torch.__version__},
            "complete": complete, "command": command_line("benchmarks/megatron_loss.py", args.argv,
                                                          ("--out", "--job-logs")),
            "config": {**{k: getattr(args.shape, k) for k in ("layers", "hidden", "heads", "ffn", "experts", "topk",
                                                              "seq", "micro_batch", "microbatches", "vocab")},
                       "ep": args.ep, "variants": args.variants, "steps": args.steps, "seeds": args.seeds,
                       "lr": args.lr, "tail": args.tail, "corpus_vocab": args.corpus_vocab,
                       "successors": args.successors, "loss_floor": chain_entropy(args.successors)},
            "runs": runs, "comparison": compare(runs, args.variants)}


def stem(args, gpu: str) -> str:
    return file_stem("megatron_loss", gpu, *(("ep" + str(args.ep),) if args.ep > 1 else ()))


def markdown(result: dict) -> str:
    c, cmp_ = result["config"], result["comparison"]
    lines = [f"# Megatron-Core GPT-MoE training loss on {result['gpu']} ({result['date']})", "",
             f"GPTModel (TE layer spec), {c['layers']} MoE layers, H={c['hidden']}, E={c['experts']} top-{c['topk']}, "
             f"F={c['ffn']}, EP={c['ep']}, {c['microbatches']} x {c['micro_batch']} x {c['seq']} tokens per rank a "
             f"step, Megatron DDP + distributed Adam at lr {c['lr']} (gradients clipped at norm 1.0), {c['steps']} steps. Corpus: a fixed Markov chain "
             f"over {c['corpus_vocab']} tokens with {c['successors']} successors each (loss floor "
             f"{c['loss_floor']:.3f} nats). Each seed sets the initial weights and the tokens, alike for every "
             f"variant. Final: mean loss of the last {c['tail']} steps. Command: `{result['command']}`"
             + ("" if result.get("complete", True) else " The run was stopped before its last runs."), "",
             "| variant | seed | first loss | final loss | vs the reference's, same seed | step ms | peak GiB | experts ran as |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        if "error" in r:
            why = " ".join(r["error"][:120].replace("|", "/").split())
            lines.append(f"| {r['variant']} | {r['seed']} | failed: {why} | | | | | |")
            continue
        diff = (cmp_.get(r["variant"]) or {}).get("minus_reference", {})
        d = diff.get(r["seed"], diff.get(str(r["seed"])))
        lines.append(f"| {r['variant']} | {r['seed']} | {r['losses'][0]:.4f} | {r['final']:.4f} | "
                     f"{'-' if d is None else f'{d:+.4f}'} | {r['step_ms']:.1f} | {r['peak_GiB']:.2f} | "
                     f"{r['experts_path']} |")
    lines.append("")
    if cmp_["reference_range"]:
        lo, hi = cmp_["reference_range"]
        spread = cmp_.get("reference_spread")
        lines.append(f"{cmp_['reference']}: final losses {lo:.4f}-{hi:.4f} over the seeds, run-to-run spread "
                     + ("-" if spread is None else f"{spread:.4f}") + " (their standard deviation).")
        for name in result["config"]["variants"][1:]:
            got = cmp_.get(name) or {}
            within, mean = got.get("within_reference_spread"), got.get("mean_minus_reference")
            lines.append(f"{name}: {'-' if mean is None else f'{mean:+.4f}'} against {cmp_['reference']} on average "
                         "over the same seeds: " + {True: "within", False: "outside",
                                                     None: "too few runs to say whether within"}[within]
                         + " that spread.")
    return "\n".join(lines) + "\n"


def chart(result: dict, path) -> bool:
    plt = pyplot()
    ok = [r for r in result["runs"] if "error" not in r]
    if plt is None or not ok:
        return False
    variants = result["config"]["variants"]
    colors = dict(zip(variants, ("tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple")))
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(11, 4))
    for r in ok:
        first = min(x["seed"] for x in ok if x["variant"] == r["variant"])
        ax.plot(r["losses"], color=colors.get(r["variant"], "gray"), alpha=0.7, lw=1,
                label=r["variant"] if r["seed"] == first else None)
    ax.axhline(result["config"]["loss_floor"], color="black", lw=0.8, ls=":", label="corpus entropy")
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="loss (nats)", title=f"GPT-MoE training loss, {result['gpu']}")
    ax.legend()
    ref = {r["seed"]: r["losses"] for r in ok if r["variant"] == variants[0]}
    window = result["config"]["tail"]
    for r in ok:
        if r["variant"] == variants[0] or r["seed"] not in ref:
            continue
        diff = [a - b for a, b in zip(r["losses"], ref[r["seed"]])]
        smooth = [statistics.fmean(diff[max(0, i - window + 1):i + 1]) for i in range(len(diff))]
        dx.plot(smooth, color=colors.get(r["variant"], "gray"), alpha=0.8, lw=1)
    dx.axhline(0, color="black", lw=0.8)
    dx.set(xlabel="step", ylabel=f"loss minus {variants[0]}'s, same seed ({window}-step mean)",
           title="difference")
    save_png(fig, path)
    plt.close(fig)
    return True


def launch(args) -> int:
    runs = []
    log(f"{len(args.variants) * args.seeds} runs of {args.steps} steps, each in processes of its own: seeds "
        f"0..{args.seeds - 1}, each through {', '.join(args.variants)}; loss floor "
        f"{chain_entropy(args.successors):.3f} nats")
    for seed in range(args.seeds):
        for name in args.variants:
            log(f"seed {seed}: {name} ...")
            run = run_one(args, name, seed)
            runs.append(run)
            if "error" not in run:
                log(f"seed {seed}: {name}: loss {run['losses'][0]:.4f} -> {run['final']:.4f}, "
                    f"{run['step_ms']:.1f} ms a step ({run['seconds']:.0f} s)")
            partial = build_result(args, runs, complete=False)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{stem(args, partial['gpu'])}.json").write_text(json.dumps(partial, indent=2) + "\n")
    result = build_result(args, runs, complete=True)
    paths = write_reports(args.out, stem(args, result["gpu"]), result, markdown, chart)
    log("wrote " + ", ".join(str(p) for p in paths))
    return 0 if all("error" not in r for r in runs) else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker_out is not None:
        return worker(args)
    from megatron_gpt import problem

    reason = problem(args.ep, args.variants)
    if reason:
        return refuse("megatron_loss.py", reason)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
