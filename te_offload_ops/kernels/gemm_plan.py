"""The plan of one grouped-GEMM variant: tiles, clusters, pipeline stages and epilogue staging.

Derived from the variant's arguments in plain Python, without the CuTe DSL: a kernel loaded from
the disk cache is launched from its plan alone (grid size, tile counts), and the plan's
parameters are part of the cache key, so a process that only loads kernels never imports the
DSL. :class:`~.gemm_sm90.GroupedGemmSm90` is a plan with the kernel's code.
"""

from __future__ import annotations

EPILOGUES = ("plain", "srelu", "dsrelu", "acc_f32", "red_f32", "tma_f32", "store_f32")
# weight-gradient epilogues that write fp32 main_grad buffers (Megatron's wgrad fusion):
# acc_f32 adds the tile into them (main_grad += dW) by loads and stores, red_f32 by fire-and-forget
# reductions done in L2 (no load round trips in the epilogue; each element still gets exactly one
# addition, so the result is the same), tma_f32 by TMA bulk reduce-adds of 128 x 32 fp32 boxes
# staged in shared memory (whole lines reduced in L2; needs the experts' buffers evenly spaced:
# ``slot_stride``), store_f32 overwrites (overwrite_main_grad)
MAIN_GRAD_EPILOGUES = ("acc_f32", "red_f32", "tma_f32", "store_f32")
_TMA_COLS = 32  # a tma_f32 box is 128 bytes wide: one 128-byte swizzle atom
SCHEDULES = ("cooperative", "pingpong")

# how the grouped FP8 kernel (gemm_fp8_sm90) promotes each 128-K block's partial sums to fp32:
# "serial", each k-block's WGMMAs, then its promotion (the other warpgroup's WGMMAs may run meanwhile);
# "overlap", a k-block's WGMMAs run while the one before is promoted (two fp32 partial-sum fragments)
PROMOTIONS = ("serial", "overlap")


def overlap_fits(bn: int, fp8_epilogue: str) -> bool:
    """Whether the overlapped promotion fits a tile: three BN-wide fp32 fragments a thread fit for
    BN <= 128, and not beside the dsrelu_q epilogue's saved z held through the mainloop (spills)."""
    return bn <= 128 and fp8_epilogue != "dsrelu_q"


def check_overlap_fits(bn: int, fp8_epilogue: str) -> None:
    if not overlap_fits(bn, fp8_epilogue):
        raise ValueError(f"the overlapped promotion takes BN <= 128 and not the dsrelu_q epilogue, got BN={bn}, "
                         f"{fp8_epilogue} (promotion='serial' takes it)")


_WG = 128  # threads per warpgroup
_BK = 64
# The epilogue stages the tile 64 columns at a time, 32 for the two-output epilogues: their
# staging then leaves room for one more mainloop stage (SReLU +7%, dSReLU +4%, same bits;
# benchmarks/experiments/ablate_epilogue.py).  The plain epilogue measured 2-4% slower at 32.
# Staged rows carry 16 bytes of padding: no bank conflicts on the accumulator-layout writes.
_EPI_COLS = 64
_EPI_COLS_TWO_OUTPUTS = 32
_EPI_PAD = 8
# shared memory of one sm_90 CTA (the CuTe DSL's cutlass.memory.get_smem_capacity_in_bytes("sm_90"))
SMEM_BYTES_SM90 = 232448


class GemmPlan:
    """The parameters of one variant: (element size, BM, BN, cluster, epilogue, N, K, E, B major,
    wgrad M, schedule, weights' layout). Raises ValueError for a variant the kernel cannot run."""

    def __init__(
        self,
        elem_bytes: int,
        n: int,
        k: int,
        num_experts: int,
        *,
        b_n_major: bool,
        epilogue: str = "plain",
        tile_mn: tuple[int, int] = (128, 192),
        cluster_n: int = 1,
        cluster_m: int = 1,
        wgrad_m: int | None = None,
        schedule: str = "cooperative",
        epi_cols: int | None = None,
        slot_stride: int | None = None,
        b_stride: int | None = None,
        b_reversed: bool = False,
    ):
        if epilogue not in EPILOGUES:
            raise ValueError(f"unknown epilogue {epilogue!r}")
        bm, bn = tile_mn
        if bm != 128:
            raise ValueError("BM must be 128 (two 64-row consumer warpgroups)")
        if bn % 64 != 0 or not 64 <= bn <= 256:
            raise ValueError("BN must be 64, 128, 192 or 256")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.pingpong = schedule == "pingpong"
        if self.pingpong and bn > 128:
            # a warpgroup then holds the whole 128 x BN fp32 accumulator: BN registers a thread
            raise ValueError("the pingpong schedule takes BN <= 128")
        self.schedule = schedule
        # threads that share one tile (and its epilogue staging buffer)
        self.tile_threads = _WG if self.pingpong else 2 * _WG
        if epilogue in MAIN_GRAD_EPILOGUES and wgrad_m is None:
            raise ValueError(f"the {epilogue} epilogue belongs to the weight-gradient form (wgrad_m)")
        if (epilogue == "tma_f32") != (slot_stride is not None):
            raise ValueError("slot_stride (elements between the experts' main_grad buffers) goes with the "
                             f"tma_f32 epilogue and only with it, got {slot_stride!r} for {epilogue!r}")
        if slot_stride is not None and (slot_stride % 4 or wgrad_m is None or slot_stride < wgrad_m * n):
            raise ValueError(f"slot_stride must be a multiple of 4 elements (16 bytes) and at least M * N, "
                             f"got {slot_stride} for M={wgrad_m}, N={n}")
        self.slot_stride = slot_stride
        # the experts' weights (B) as the caller lays them out: b_stride elements apart (default
        # N * K, one packed tensor), in reverse expert order where b_reversed (Megatron's DDP
        # buffer puts later parameters first): expert e reads slot E - 1 - e
        if (b_stride is not None or b_reversed) and wgrad_m is not None:
            raise ValueError("b_stride and b_reversed describe the weights of the forward/dgrad form, not wgrad")
        self.b_stride = n * k if b_stride is None else b_stride
        if self.b_stride < n * k or self.b_stride % 8:
            raise ValueError(f"b_stride must be at least N * K = {n * k} and a multiple of 8 (16 bytes), got {b_stride}")
        self.b_reversed = bool(b_reversed)
        if wgrad_m is not None:
            # K is each expert's token count, read on the GPU
            if epilogue not in ("plain", *MAIN_GRAD_EPILOGUES) or not b_n_major or k != 0:
                raise ValueError("the weight-gradient form takes a plain or main-grad epilogue, N-major B and k=0")
            if wgrad_m <= 0 or wgrad_m % 8:
                raise ValueError("M must be a positive multiple of 8 (16-byte TMA rows)")
        if n % 8 or k % 8:
            raise ValueError("N and K must be multiples of 8 (16-byte TMA rows)")
        self.wgrad_m = wgrad_m
        self.m_tiles = (wgrad_m + bm - 1) // bm if wgrad_m is not None else 0
        self.n, self.k, self.num_experts = n, k, num_experts
        self.b_n_major = b_n_major
        self.epilogue = epilogue
        self.bm, self.bn, self.bk = bm, bn, _BK
        self.k_tiles = (k + _BK - 1) // _BK
        self.n_tiles = (n + bn - 1) // bn
        # cluster_n == 2: two CTAs on consecutive tiles share the A tile where
        # they sit in one m-block, each loading half of it and multicasting to
        # both (half the A traffic out of L2)
        if cluster_n not in (1, 2):
            raise ValueError(f"cluster_n must be 1 or 2, got {cluster_n}")
        self.cluster_n = cluster_n
        # cluster_m == 2: 2 x 2 clusters, the n-pair sharing A as above and the m-pair sharing B
        # (weight gradient: two m-blocks of one expert, the same tokens; forward / dgrad: two
        # m-blocks of token rows, sharing the expert's weight tile where both are of one expert),
        # each CTA loading half of both tiles; a quarter less operand traffic out of L2 per tile
        # than the pair (the GEMMs are bound by L2 sectors, benchmarks/results/ncu/README.md)
        if cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {cluster_m}")
        if cluster_m == 2 and cluster_n != 2:
            raise ValueError(f"cluster_m=2 (2 x 2 clusters) goes with cluster_n=2, got cluster_n={cluster_n}")
        self.cluster_m = cluster_m
        self.cluster_size = cluster_m * cluster_n
        # weight-gradient form: tile groups per expert (a group never spans two experts: its
        # tiles share the expert's tokens, i.e. k-tiles); pairs: the (M, N) blocks n-fastest,
        # padded to even; 2 x 2: (m-pair, n-pair) blocks, a block past M or N a phantom
        per_expert = self.m_tiles * self.n_tiles
        self.n_pairs = -(-self.n_tiles // 2) if cluster_m == 2 else 0
        if cluster_m == 2:
            self.wgrad_groups = -(-self.m_tiles // 2) * self.n_pairs
        else:
            self.wgrad_groups = -(-per_expert // cluster_n)
        self.wgrad_tiles = self.wgrad_groups * self.cluster_size
        stage_bytes = (bm + bn) * _BK * elem_bytes
        # epilogue staging: one (BM, epi_cols + pad) chunk per output tensor, per
        # warpgroup under pingpong (their epilogues may overlap)
        # main-grad epilogues go from registers straight to global memory: no staging
        self.n_out = {"plain": 1, "srelu": 2, "dsrelu": 2}.get(epilogue, 0)
        if epilogue == "tma_f32":
            epi_cols = _TMA_COLS
        elif epi_cols is None:  # main-grad epilogues: 64 columns = two load rounds per pingpong tile
            epi_cols = _EPI_COLS if self.n_out in (0, 1) else _EPI_COLS_TWO_OUTPUTS
        if epi_cols not in (32, 64) or bn % epi_cols:
            raise ValueError(f"epilogue chunks must be 32 or 64 columns and tile BN={bn}, got {epi_cols}")
        self.epi_cols = epi_cols
        self.epi_row = epi_cols + _EPI_PAD
        self.epi_elems = bm * self.epi_row
        self.epi_bufs = 2 if self.pingpong else 1
        budget = SMEM_BYTES_SM90 - 2048
        budget -= self.epi_bufs * self.n_out * self.epi_elems * elem_bytes
        # tma_f32: one fp32 (BM, 32) box per warpgroup sharing a tile, staged for the TMA unit
        self.box_elems = bm * _TMA_COLS if epilogue == "tma_f32" else 0
        budget -= self.epi_bufs * self.box_elems * 4 + (1024 if self.box_elems else 0)  # + alignment
        self.stages = max(2, min(8, budget // stage_bytes))
