"""CPU: the Megatron GPT-MoE loss benchmark's corpus, arguments, launcher and report (its runs
stood in for); the training itself runs on a GPU (tests/test_megatron_loss_gpu.py)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import megatron_loss as ml  # noqa: E402


def test_the_corpus_follows_its_chain_and_repeats_with_its_seed():
    chain = ml.markov_chain(64, 4)
    assert chain.shape == (64, 4) and all(len(set(row.tolist())) == 4 for row in chain)
    assert torch.equal(chain, ml.markov_chain(64, 4))  # one chain for every run
    tokens = ml.corpus(chain, 4, sequences=50, length=200, seed=3)
    assert tokens.shape == (50, 200) and int(tokens.max()) < 64
    for seq in tokens[:5]:  # every token one of its predecessor's successors
        assert all(int(b) in chain[int(a)].tolist() for a, b in zip(seq[:-1], seq[1:]))
    assert torch.equal(tokens, ml.corpus(chain, 4, 50, 200, seed=3))
    assert not torch.equal(tokens, ml.corpus(chain, 4, 50, 200, seed=4))
    # the successors' frequencies follow their halving probabilities; the entropy is the loss floor
    picks = torch.tensor([chain[int(a)].tolist().index(int(b)) for seq in tokens for a, b in zip(seq[:-1], seq[1:])])
    share = torch.bincount(picks, minlength=4).double() / picks.numel()
    assert torch.allclose(share, torch.tensor(ml.successor_probs(4), dtype=torch.double), atol=0.02)
    assert ml.chain_entropy(1) == 0.0 and ml.chain_entropy(4) == pytest.approx(
        -sum(q * math.log(q) for q in (8 / 15, 4 / 15, 2 / 15, 1 / 15)))


def test_a_steps_batches_split_the_tokens_into_micro_batches_with_labels_shifted():
    shape = ml.GPTShape(seq=8, micro_batch=2, microbatches=3)
    tokens = torch.arange(6 * 9).view(6, 9)
    batches = ml.step_batches(shape, tokens, device="cpu")
    assert len(batches) == 3
    assert torch.equal(batches[1]["tokens"], tokens[2:4, :-1]) and torch.equal(batches[1]["labels"], tokens[2:4, 1:])
    assert batches[0]["position_ids"].tolist() == [list(range(8))] * 2 and batches[2]["loss_mask"].shape == (2, 8)


@pytest.mark.parametrize("argv, said", [
    (["--variants", "ours"], "at least two distinct"),
    (["--variants", "ours,ours"], "at least two distinct"),
    (["--variants", "ours,nonsense"], "unknown variant"),
    (["--tail", "400"], "must not exceed --steps"),
    (["--corpus-vocab", "40000"], "must not exceed --vocab"),
    (["--steps", "0"], "--steps must be positive"),
    (["--ep", "3"], "multiple of the expert parallelism"),
    (["--lr", "0"], "--lr must be positive"),
    (["--variants", "ours,ours+teo"], "offloading variants move bytes"),
    (["--variants", "ours,ours+copies"], "offloading variants move bytes"),
    (["--successors", "100", "--corpus-vocab", "200"], "--successors must be at most 64"),
    (["--job-timeout", "nan"], "--job-timeout must be positive"),
])
def test_bad_arguments_are_refused_with_the_reason(argv, said, capsys):
    with pytest.raises(SystemExit):
        ml.parse_args(argv)
    assert said in capsys.readouterr().err


def _fake_run(finals: dict):
    def run(args, variant, seed):
        if finals.get((variant, seed)) is None:
            return {"variant": variant, "seed": seed, "error": "0 of 1 ranks wrote results (exit status 1)"}
        final = finals[(variant, seed)]
        losses = [10.0] * (args.steps - args.tail) + [final] * args.tail
        return {"variant": variant, "seed": seed, "gpu": "NVIDIA H100 80GB HBM3", "losses": losses, "final": final,
                "step_ms": 100.0, "peak_GiB": 12.0, "experts_path": "FusedScaledSReLUMLP", "weights_digest": 1.0,
                "tokens_digest": [7], "seconds": 30.0}
    return run


def test_the_launcher_runs_rounds_of_seeds_and_compares_each_variant_with_the_reference(tmp_path, monkeypatch):
    finals = {("ours", 0): 2.00, ("ours+fp8block", 0): 2.01, ("ours", 1): 2.04, ("ours+fp8block", 1): 2.03,
              ("ours", 2): 2.02, ("ours+fp8block", 2): 2.05}
    calls = []
    fake = _fake_run(finals)
    path = tmp_path / "megatron_loss_NVIDIA_H100_80GB_HBM3.json"

    def run_one(args, variant, seed):
        if calls:  # what the runs before this one measured is on disk already
            partial = json.loads(path.read_text())
            assert partial["complete"] is False and len(partial["runs"]) == len(calls)
        calls.append((seed, variant))
        return fake(args, variant, seed)

    monkeypatch.setattr(ml, "run_one", run_one)
    monkeypatch.setattr("megatron_gpt.problem", lambda ep, variants=(): None)
    assert ml.main(["--out", str(tmp_path), "--steps", "40", "--tail", "10"]) == 0
    assert calls == [(s, v) for s in range(3) for v in ("ours", "ours+fp8block")]  # rounds through the seeds
    result = json.loads(path.read_text())
    cmp_ = result["comparison"]
    assert result["complete"] is True and cmp_["reference_range"] == [2.00, 2.04]
    assert cmp_["reference_spread"] == pytest.approx(0.02)  # the standard deviation of 2.00, 2.04, 2.02
    fp8 = cmp_["ours+fp8block"]
    assert fp8["minus_reference"] == {"0": pytest.approx(0.01), "1": pytest.approx(-0.01), "2": pytest.approx(0.03)}
    assert fp8["mean_minus_reference"] == pytest.approx(0.01) and fp8["within_reference_spread"] is True
    md = (tmp_path / "megatron_loss_NVIDIA_H100_80GB_HBM3.md").read_text()
    assert "| ours+fp8block | 2 | 10.0000 | 2.0500 | +0.0300 |" in md
    assert "run-to-run spread 0.0200" in md and "+0.0100 against ours on average over the same seeds: within" in md
    assert (tmp_path / "megatron_loss_NVIDIA_H100_80GB_HBM3.png").exists()


def test_a_variant_consistently_worse_than_the_spread_is_outside_it():
    runs = [{"variant": v, "seed": s, "final": f} for (v, s), f in {
        ("ours", 0): 2.00, ("ours", 1): 2.04, ("ours", 2): 2.02,
        ("ours+fp8block", 0): 2.03, ("ours+fp8block", 1): 2.07, ("ours+fp8block", 2): 2.05}.items()]
    got = ml.compare(runs, ["ours", "ours+fp8block"])["ours+fp8block"]
    assert got["mean_minus_reference"] == pytest.approx(0.03) and got["within_reference_spread"] is False
    one_seed = ml.compare(runs[:1] + runs[3:4], ["ours", "ours+fp8block"])
    assert one_seed["reference_spread"] is None and one_seed["ours+fp8block"]["within_reference_spread"] is None


def test_a_failed_run_is_reported_and_the_rest_still_compared(tmp_path, monkeypatch):
    finals = {("ours", 0): 2.00, ("ours+fp8block", 0): 2.01, ("ours", 1): 2.04, ("ours+fp8block", 1): None}
    monkeypatch.setattr(ml, "run_one", _fake_run(finals))
    monkeypatch.setattr("megatron_gpt.problem", lambda ep, variants=(): None)
    assert ml.main(["--out", str(tmp_path), "--steps", "40", "--tail", "10", "--seeds", "2"]) == 1
    result = json.loads((tmp_path / "megatron_loss_NVIDIA_H100_80GB_HBM3.json").read_text())
    assert result["comparison"]["ours+fp8block"]["within_reference_spread"] is True  # +0.01 within sd 0.028
    assert "failed: 0 of 1 ranks" in (tmp_path / "megatron_loss_NVIDIA_H100_80GB_HBM3.md").read_text()


def test_a_worker_runs_this_script_with_its_options_and_its_ranks_losses_are_averaged(tmp_path, monkeypatch):
    seen = {}

    def fake_jobs_run(cmd, out, **kw):
        seen["cmd"] = cmd
        args = ml.parse_args(cmd[cmd.index(str(Path(ml.__file__).resolve())) + 1:])  # what the launcher passed
        seen["args"] = args
        per_rank = [{"rank": r, "gpu": "G", "run": {"losses": losses, "step_ms": 90.0 + r, "peak_GiB": 9.0 + r,
                                                   "experts_path": "X", "weights_digest": 2.0, "tokens_digest": r}}
                    for r, losses in enumerate(([3.0, 2.0, 1.0], [5.0, 4.0, 3.0]))]
        return {"per_rank": per_rank, "rc": 0, "seconds": 1.0, "timed_out": False, "tail": ""}

    monkeypatch.setattr(ml.jobs, "run", fake_jobs_run)
    args = ml.parse_args(["--steps", "3", "--tail", "2", "--lr", "1e-3", "--ep", "2"])
    run = ml.run_one(args, "ours+fp8block", 2)
    assert "torch.distributed.run" in seen["cmd"] and "--nproc-per-node=2" in seen["cmd"]  # a rank per GPU
    assert (seen["args"].worker_variant, seen["args"].worker_seed, seen["args"].lr) == ("ours+fp8block", 2, 1e-3)
    assert run["losses"] == [4.0, 3.0, 2.0] and run["final"] == pytest.approx(2.5)  # the ranks' mean, step by step
    assert (run["step_ms"], run["peak_GiB"], run["tokens_digest"]) == (91.0, 10.0, [0, 1])  # the slowest, largest


def test_each_rank_and_seed_trains_a_stream_of_its_own_alike_for_every_variant():
    args = ml.parse_args(["--steps", "2", "--tail", "1", "--seq", "16", "--micro-batch", "2", "--microbatches", "2",
                          "--corpus-vocab", "64"])
    a = ml.rank_tokens(args, seed=1, rank=0)
    assert a.shape == (2 * 2 * 2, 17) and torch.equal(a, ml.rank_tokens(args, seed=1, rank=0))
    assert not torch.equal(a, ml.rank_tokens(args, seed=1, rank=1))
    assert not torch.equal(a, ml.rank_tokens(args, seed=2, rank=0))
