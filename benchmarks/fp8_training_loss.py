#!/usr/bin/env python3
"""Training loss of the fused grouped MLP under Float8BlockScaling against bf16, several seeds each.

A student MoE expert layer (this package's GroupedLinear -> ScaledSReLU -> GroupedLinear, the fused
op) learns a teacher of the same shape with fixed random weights: each step draws fresh tokens,
routes each to the expert its fixed random router scores highest (tokens sorted by expert, probs
the softmax score), and takes an Adam step on the mean squared error to the teacher's output,
normalised by the teacher's. The student runs in bf16 or under ``te.autocast(recipe=
Float8BlockScaling())``; each precision runs ``--seeds`` seeds (the student's initialisation and
the token stream). Reported: per run the loss over the last ``--tail`` steps, and whether every FP8
run ends within the spread of the bf16 runs (widened by the spread's own width on each side).
Writes ``fp8_training_loss_<GPU>.{json,md,png}`` into ``--out``.

    python3 benchmarks/fp8_training_loss.py [--steps 300 --seeds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_common import cuda_problem, file_stem, pyplot, refuse, save_png, utc_now, write_reports  # noqa: E402

PRECISIONS = ("bf16", "fp8-block")


def _command(argv: list) -> str:
    from bench_common import command_line

    return command_line("benchmarks/fp8_training_loss.py", argv)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", "-E", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step")
    p.add_argument("--hidden", "-H", type=int, default=2688)
    p.add_argument("--ffn", "-F", type=int, default=1856)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--tail", type=int, default=20, help="steps averaged for the final loss")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args(argv)
    for name in ("experts", "tokens", "hidden", "ffn", "steps", "seeds", "tail"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    if args.tail > args.steps:
        p.error("--tail must not exceed --steps")
    return args


def make_mlp(args, seed: int):
    import torch
    import transformer_engine.pytorch as te

    import te_offload_ops as teo

    torch.manual_seed(seed)
    kw = dict(bias=False, device="cuda", dtype=torch.bfloat16)
    return te.ops.Sequential(teo.GroupedLinear(args.experts, args.hidden, args.ffn, **kw), teo.ScaledSReLU(),
                             teo.GroupedLinear(args.experts, args.ffn, args.hidden, **kw))


def batch(args, router, gen):
    """Fresh tokens sorted by the expert the router picks: (x, split sizes, probs)."""
    import torch

    x = torch.randn(args.tokens, args.hidden, device="cuda", generator=gen).bfloat16()
    scores = torch.softmax(x.float() @ router, dim=1)
    prob, expert = scores.max(dim=1)
    order = torch.argsort(expert, stable=True)
    splits = torch.bincount(expert, minlength=args.experts)
    return x[order], splits, prob[order].bfloat16()


def train(args, precision: str, seed: int, teacher, router) -> dict:
    import contextlib

    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8BlockScaling

    student = make_mlp(args, 1000 + seed)
    opt = torch.optim.Adam(student.parameters(), lr=args.lr)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    autocast = (lambda: te.autocast(enabled=True, recipe=Float8BlockScaling())) if precision == "fp8-block" \
        else contextlib.nullcontext
    losses = []
    for _ in range(args.steps):
        x, splits, probs = batch(args, router, gen)
        with torch.no_grad():
            target = teacher(x, splits, probs, splits).float()
            target = target / target.pow(2).mean().sqrt().clamp_min(1e-12)
        with autocast():
            y = student(x, splits, probs, splits)
        loss = (y.float() - target).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    losses = [float(v) for v in torch.stack(losses).cpu()]
    plan = [type(op).__name__ for group in student._module_groups for op, _ in group._forward_ops]
    return {"precision": precision, "seed": seed, "losses": losses, "plan": plan,
            "final": statistics.fmean(losses[-args.tail:])}


def measure(args) -> dict:
    import torch

    teacher = make_mlp(args, 7)
    with torch.no_grad():
        for p in teacher.parameters():  # a teacher whose output does not vanish through SReLU
            p.mul_(4.0)
    router_gen = torch.Generator(device="cuda").manual_seed(11)
    router = torch.randn(args.hidden, args.experts, device="cuda", generator=router_gen)
    runs = []
    for seed in range(args.seeds):
        for precision in PRECISIONS:
            run = train(args, precision, seed, teacher, router)
            print(f"{precision:10s} seed {seed}: loss {run['losses'][0]:.4f} -> {run['final']:.4f} "
                  f"(mean of the last {args.tail} steps; ran as {'+'.join(run['plan'])})", flush=True)
            runs.append(run)
    finals = {p: [r["final"] for r in runs if r["precision"] == p] for p in PRECISIONS}
    lo, hi = min(finals["bf16"]), max(finals["bf16"])
    width = hi - lo
    within = all(lo - width <= v <= hi + width for v in finals["fp8-block"])
    return {"gpu": torch.cuda.get_device_name(), "date": utc_now(), "args": {k: str(v) if isinstance(v, Path) else v
                                                                              for k, v in vars(args).items()},
            "command": _command(sys.argv[1:]),
            "runs": runs, "finals": finals, "bf16_spread": [lo, hi], "fp8_within_bf16_spread": within}


def markdown(result: dict) -> str:
    a = result["args"]
    lines = [f"# Training loss, Float8BlockScaling against bf16 ({result['gpu']}, {result['date']})", "",
             f"Fused grouped MLP, E={a['experts']}, H={a['hidden']}, F={a['ffn']}, {a['tokens']} tokens a step, "
             f"Adam lr {a['lr']}, {a['steps']} steps; final loss: mean of the last {a['tail']} steps. "
             f"Command: `{result['command']}`", "",
             "| precision | seed | first loss | final loss | ran as |", "|---|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['precision']} | {r['seed']} | {r['losses'][0]:.4f} | {r['final']:.5f} | "
                     f"{'+'.join(r['plan'])} |")
    lo, hi = result["bf16_spread"]
    fp8 = result["finals"]["fp8-block"]
    lines += ["", f"bf16 final losses span {lo:.5f}-{hi:.5f}; FP8 {min(fp8):.5f}-{max(fp8):.5f}: "
              f"{'within' if result['fp8_within_bf16_spread'] else 'outside'} the bf16 spread widened by its width "
              "on each side.", ""]
    return "\n".join(lines)


def chart(result: dict, path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    colors = {"bf16": "tab:blue", "fp8-block": "tab:red"}
    for r in result["runs"]:
        ax.plot(r["losses"], color=colors[r["precision"]], alpha=0.7, lw=1,
                label=r["precision"] if r["seed"] == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("normalised MSE")
    ax.set_title(f"Fused grouped MLP training loss, {result['gpu']}")
    ax.legend()
    save_png(fig, path)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    if (problem := cuda_problem()):
        return refuse("fp8_training_loss.py", problem)
    result = measure(args)
    write_reports(args.out, file_stem("fp8_training_loss", result["gpu"]), result, markdown, chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())
