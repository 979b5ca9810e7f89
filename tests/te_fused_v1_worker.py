"""Runs TE's fused grouped MLP (sm_100 pieces stood in) under TE's V1 engine and writes what broke the policy.

TE chooses V1 when it is imported, so this runs in its own process:
    NVTE_CPU_OFFLOAD_V1=1 python tests/te_fused_v1_worker.py OUT.txt
One line per (case, policy): "<case> <policy> <plan> moved {...} problems: [...]", then one for TE's
fused op taking this package's ops without our fusion (keep-fc1).
"""

import sys

import pytest
import torch

from te_fused_steps import CASES, POLICIES, StepConfig, moved_by_kind, policy_problems, run_step
from te_fused_standins import blackwell_standins, clear_te_caches
from te_offload_ops.engines import active_engine



def one_step(cfg: StepConfig, offloaded_layers: list) -> str:
    with pytest.MonkeyPatch.context() as monkeypatch:
        recorder = blackwell_standins(monkeypatch)
        try:
            result = run_step(cfg, "v1", monkeypatch, recorder)
            problems = policy_problems(result, cfg, offloaded_layers)
            return f"{result.plan} moved {moved_by_kind(result.moved)} problems: {problems}"
        finally:
            clear_te_caches()


def main(out_path: str) -> None:
    assert active_engine() == "v1", "run with NVTE_CPU_OFFLOAD_V1=1"
    assert torch.cuda.is_available()
    lines = []
    for case, (activation, recipe) in CASES.items():
        for policy, offload in POLICIES.items():
            cfg = StepConfig(activation=activation, recipe=recipe, offload=offload)
            lines.append(f"{case} {policy} {one_step(cfg, [0])}")
    alone = StepConfig(offload=POLICIES["keep-fc1"], te_alone=True)
    lines.append(f"TE's op alone keep-fc1 {one_step(alone, [0])}")
    with open(out_path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
