"""Which tile, schedule and cluster shape each grouped GEMM runs with: measured defaults per GEMM
kind, overridden by an argument or by $TEO_GEMM_SCHEDULE, $TEO_GEMM_CLUSTER_N, $TEO_GEMM_CLUSTER_M."""

from __future__ import annotations

import os

from .gemm_plan import MAIN_GRAD_EPILOGUES

SCHEDULE_ENV = "TEO_GEMM_SCHEDULE"  # "cooperative" or "pingpong": overrides pick_schedule
SCHEDULES = ("cooperative", "pingpong")
# per GEMM kind, the faster schedule on H100 (benchmarks/results/bench_kernels*, both
# schedules timed interleaved): pingpong hides the epilogue behind the other warpgroup's
# MMAs; the wgrads have no epilogue work to hide and keep the wider cooperative tile
DEFAULT_SCHEDULE = {"plain": "pingpong", "srelu": "pingpong", "dsrelu": "pingpong",
                    "wgrad": "cooperative",
                    # the fp32 main_grad add is epilogue work worth hiding (measured: pingpong
                    # 1.093x / 1.075x the plain fused op with rmw / red, cooperative 1.108x / 1.084x)
                    "wgrad_main_grad": "pingpong"}


def pick_schedule(epilogue: str, wgrad: bool = False, schedule: str | None = None, tile=None) -> str:
    """The argument, else $TEO_GEMM_SCHEDULE, else the measured default for this GEMM kind;
    the latter two give way to cooperative for a given tile wider than pingpong's 128 columns."""
    choice = schedule
    if not choice:  # a preference (env or default) yields to a tile too wide for pingpong
        kind = "wgrad_main_grad" if epilogue in MAIN_GRAD_EPILOGUES else "wgrad" if wgrad else epilogue
        choice = os.environ.get(SCHEDULE_ENV) or DEFAULT_SCHEDULE[kind]
        if choice == "pingpong" and tile is not None and tile[1] > 128:
            choice = "cooperative"
    if choice not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {choice!r}")
    return choice


def pick_tile(n: int, schedule: str = "cooperative") -> tuple[int, int]:
    """(BM, BN): the BN among 256/192/128 with the least padding of the last
    n-block (ties go to the larger BN); 64 only when N <= 64.  Pingpong keeps
    a whole 128 x BN accumulator per warpgroup: BN 128."""
    if n <= 64:
        return (128, 64)
    if schedule == "pingpong":
        return (128, 128)
    best = max((n / (-(-n // bn) * bn), bn) for bn in (256, 192, 128))
    return (128, best[1])


CLUSTER_ENV = "TEO_GEMM_CLUSTER_N"  # "1" turns off the 2-CTA A multicast (for comparisons)


def pick_cluster(n: int, tile) -> int:
    """2 (A multicast over a CTA pair) when there are at least two n-blocks, else 1 (a pair
    would always straddle two m-blocks and share nothing); TEO_GEMM_CLUSTER_N=1 forces 1.
    With an odd n-block count one pair in n_tiles straddles and loads A unshared."""
    if os.environ.get(CLUSTER_ENV, "") == "1":
        return 1
    return 2 if -(-n // tile[1]) >= 2 else 1


CLUSTER_M_ENV = "TEO_GEMM_CLUSTER_M"  # "1": CTA pairs only; "2": 2 x 2 clusters for every GEMM that has two n-blocks


def pick_cluster_m(wgrad_m, n: int, tile, cluster_n: int) -> int:
    """The bf16 GEMMs' cluster rows: 2 (2 x 2 clusters: B multicast over m-block pairs as well as A
    over n-block pairs) when TEO_GEMM_CLUSTER_M=2, for GEMMs with at least two n-blocks (and, for a
    weight gradient, two m-blocks), else 1. Opt-in: the GEMMs are bound by L2 sectors (Nsight
    Compute) and this cuts their operand reads by about a quarter, but phantom tiles where a block
    count is odd (and, in the forward form, a whole B load where an m-pair straddles two experts)
    make it slower than the pair in every GEMM on an H100 (benchmarks/results/cluster2x2_*). A
    value other than 1 or 2 raises for every GEMM (it names them all). The FP8 GEMMs:
    :func:`pick_cluster_m_fp8`."""
    want = os.environ.get(CLUSTER_M_ENV, "") or "1"
    if want not in ("1", "2"):
        raise ValueError(f"{CLUSTER_M_ENV} must be 1 or 2, got {want!r}")
    if want == "1" or cluster_n != 2:
        return 1
    if wgrad_m is not None and -(-wgrad_m // tile[0]) < 2:  # one m-block: no m-pair to share B
        return 1
    return 2 if -(-n // tile[1]) >= 2 else 1


# the FP8 forms that take 2 x 2 clusters by default, where the n-block count is even: on an H200
# at H=7168, F=2048 the plain forms ran 1.04-1.06x and fc1's with the quantizing SReLU epilogue
# 1.17-1.19x the pair's speed, the dSReLU form 0.99-1.00x; with an odd n-block count (H=2688,
# F=1856: a phantom tile per cluster row) 0.83-0.95x (benchmarks/results/cluster2x2_NVIDIA_H200_fp8*)
FP8_2X2_EPILOGUES = ("plain", "srelu_q")


def pick_cluster_m_fp8(n: int, tile, cluster_n: int, epilogue: str, fits_four) -> int:
    """The FP8 forward / dgrad GEMM's cluster rows: TEO_GEMM_CLUSTER_M where set (as
    :func:`pick_cluster_m`), else 2 (2 x 2 clusters) for the forms of :data:`FP8_2X2_EPILOGUES`
    with an even n-block count where the GPU fits clusters of four (``fits_four()``, asked only
    then), else 1."""
    if os.environ.get(CLUSTER_M_ENV, ""):
        return pick_cluster_m(None, n, tile, cluster_n)
    n_tiles = -(-n // tile[1])
    if cluster_n != 2 or n_tiles % 2 or epilogue not in FP8_2X2_EPILOGUES:
        return 1
    return 2 if fits_four() else 1

