"""Hopper (sm_90a) grouped FP8 GEMM with Transformer Engine's block scaling, in the CuTe DSL.

What it computes
----------------
For every expert ``e`` (rows ``[off[e], off[e+1])`` of the token matrix, ``off`` the exclusive
cumulative sum of ``split_sizes``, an int32 tensor read on the GPU)::

    C[r, n] = sum_kb  sa[kb, r] * sb[e, n // 128, kb] * sum_{k in block kb} A[r, k] * B[e, n, k]

with ``A`` (T, K) and ``B`` (E, N, K) FP8 e4m3, both K-major (the only operand majorness FP8
WGMMA takes), ``kb`` the 128-wide blocks of K and ``C`` (T, N) row-major in bf16 or fp16. This is
``dequant(A_e) @ dequant(B_e)^T`` under ``Float8BlockScaling``, with the scales laid out as below.

Scale layouts (Transformer Engine 2.x, ``Float8BlockQuantizer``, ``Float8BlockwiseQTensor``)
--------------------------------------------------------------------------------------------
* ``sa``: the ``_rowwise_scale_inv`` of A quantized with ``block_scaling_dim=1`` (1 x 128
  blocks). TE stores it *transposed*: shape ``(ceil(K / 128), roundup(T, 4))``, fp32, row-major,
  so ``A_real[r, k] = A[r, k] * sa[k // 128, r]``. The token dimension is padded to a multiple of
  4 (16 bytes, so TMA can read it); the padding entries are never initialised by TE and never
  used here. The kernel reads ``sa`` through any row stride that is a multiple of 4 elements.
* ``sb``: the ``_rowwise_scale_inv`` of each expert's ``(N, K)`` weight quantized with
  ``block_scaling_dim=2`` (128 x 128 blocks): shape ``(ceil(N / 128), roundup(ceil(K / 128), 4))``,
  fp32, *not* transposed, the k-block dimension padded to a multiple of 4 (padding unused), so
  ``B_real[n, k] = B[n, k] * sb[n // 128, k // 128]``. The experts' scales are stacked:
  ``(E, ceil(N / 128), Kp)``.

A K or N that is not a multiple of 128 ends in a partial block with its own scale, as TE
quantizes it; TMA reads zeros past K, so the last k-block's partial sum holds only real columns.

Promotion to fp32 (as DeepGEMM's sm_90 1D2D kernels promote)
------------------------------------------------------------
The tensor cores accumulate FP8 products in a reduced-precision fp32 sum, so partial sums must
not run long. Per 128-K block each consumer warpgroup runs its four ``m64nBNk32`` WGMMAs into a
fresh register tile ``tmp`` (the first with the accumulate flag off), waits for them, releases the
stage, and adds ``tmp * (sa[kb, row] * sb[e, nblk, kb])`` into the fp32 accumulator: one FFMA per
element per k-block. The two consumer warpgroups run independently, so one warpgroup's promotion
overlaps the other's WGMMAs (``promotion="serial"``). ``promotion="overlap"`` also overlaps a
warpgroup's promotion with its own next WGMMAs: k-block ``kb + 1`` goes into a second register
tile before ``kb``'s is promoted (a wait that leaves one group in flight); the sums are the same
bits. Its k-blocks are unrolled when compiling: in a loop, the registers the promotion reads
become loop-carried values and ptxas serializes the WGMMAs (advisory C7514). Three BN-wide fp32
tiles a thread fit for BN <= 128 without the dsrelu_q epilogue's saved z; the entry points
(:mod:`.api_fp8`) take "overlap" wherever it fits and K <= ``OVERLAP_MAX_K``, "serial" elsewhere.

Scale loads
-----------
* ``sa``: the producer's TMA brings the scales of the tile's rows for k-block ``kb`` (one box
  of the transposed scale tensor) into the stage with the A and B tiles, on the same mbarrier.
  Tokens are that tensor's innermost dimension, and TMA faults (illegal instruction) on a box
  whose innermost start is not 16-byte aligned; a tile starts at any row (experts' counts are
  arbitrary), so the box starts at the tile's first row rounded down to a multiple of 4 and holds
  ``BM + 4`` scales; the consumers index it with the tile's offset from that row. They read their
  two rows' scales from shared memory before issuing the WGMMAs (the stage is released before the
  promotion).
* ``sb``: one value per (expert, 128-column block, k-block), the same for every thread; the
  consumers load it from global memory one k-block ahead, so its latency hides under the WGMMAs.
  A BN=192 tile straddles two 128-column scale blocks: it loads both and picks per column group.

The SReLU x prob epilogue, quantized (``epilogue="srelu_q"``)
--------------------------------------------------------------
For fc1 the tile can leave as the two FP8 tensors the next steps read instead of bf16 ``C``:
``z = bf16(C)`` and ``act = bf16(relu(z)^2 * prob[r])``, each quantized in TE's 1x128 blocks
(e4m3, scale from the block's amax by TE's rule: the recipe's epsilon floor, power-of-two rounding
if asked, 1 where the amax is 0, inf or NaN) with its fp32 scale-inverses in TE's
``(ceil(N / 128), tokens)`` layout: the bytes :func:`..fp8_rows.srelu_quantize` writes from the
bf16 ``C``, without ``C`` ever reaching global memory. A 128-column block of a row lies in one
128-column tile, held by the four lanes of a quad (32 values each): a local max and two butterfly
shuffles give the row's amax, so the tile's BN must be 128 (or 64 where N <= 64). Each output goes
through the staging buffer as FP8 bytes and leaves in 16-byte row vectors, predicated as ``C``'s.

The SReLU backward in fc2's dgrad epilogue (``epilogue="dsrelu_q"``)
-------------------------------------------------------------------
For fc2's dgrad (``C = dact``) the tile instead reads the saved FP8 z of its rows and columns
(loaded before the mainloop) and writes what :func:`..fp8_rows.dsrelu_quantize` writes from the
bf16 ``dact``: ``dz = round(dact * relu(z) * prob * 2)`` and ``act = round(relu(z)^2 * prob)`` in
the output dtype, dz's FP8 rows with their scales, and per row and n-tile the partial sum of
``dact * relu(z)^2`` (the host sums the tiles' partials in a fixed order: dprob, deterministic but
summed in another order than the row pass's).

Schedule
--------
Persistent and warp-specialized like :mod:`.gemm_sm90` (whose tile scheduling, split-size
handling and cluster pairs this class inherits; its bf16 outputs leave staged and predicated as
that kernel's do, but each math warpgroup stages its own 64 rows behind its own barrier, so
neither waits for the other at a tile's end): warpgroup 0's first
warp issues TMA loads of A, B and the A scales into a ``stages``-deep pipeline and runs ahead
across tiles; warpgroups 1 and 2 each own 64 rows of the 128 x BN tile (cooperative). Tiles may
start mid-matrix (rows are not aligned to 128 per expert): rows of the next expert are read into
the tile but every store is predicated on ``row < off[e+1]`` and ``col < N``; as the scales
multiply whole rows, a foreign row (or a padding scale past T) never touches a kept row. With
``cluster_n == 2`` two CTAs on neighbouring n-blocks of one m-block share the A tile by TMA
multicast (each loads its own 512 bytes of A scales). With ``cluster_m == 2`` (2 x 2 clusters,
the walk and phantoms of :mod:`.gemm_sm90`'s) the m-pair also shares its B tile where both m-blocks
are of one expert (else each CTA loads B whole), and a phantom tile past N reads the last block of
B's scales (it stores nothing).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .gemm_plan import PROMOTIONS, check_overlap_fits
from .gemm_sm90 import _CONSUMER_REGS, _EPI_BARRIER, _PRODUCER_REGS, _THREADS, _WG, GroupedGemmSm90

SCALE_BLOCK = 128  # Float8BlockScaling's block length (1 x 128 and 128 x 128)
_BK = SCALE_BLOCK  # one k-tile per scale block: the promotion happens once per k-tile
TILE_NS = (64, 128, 192)  # tmp and acc stay in registers: BN fp32 registers a consumer thread
# A's scales are read from the tile's first row rounded down to 16 bytes (TMA's innermost start
# must be 16-byte aligned): 4 fp32 more than the tile's rows, each stage's box 128-byte aligned
_SA_ALIGN = 4
_SA_STAGE_FLOATS = 32 * -(-(128 + _SA_ALIGN) // 32)
# C in bf16/fp16; fc1's z and act quantized; fc2's dgrad with the SReLU backward (see the module's docstring)
FP8_EPILOGUES = ("plain", "srelu_q", "dsrelu_q")
# Named barriers of the epilogues. Each math warpgroup stages behind its own (ids 1 and 2: the
# warpgroup's index, already in a register); the tile-wide one (256 threads) has an id of its own,
# as one warpgroup may reach it while the other still stages (an id takes one thread count)
_WG_EPI_BARRIER = _EPI_BARRIER
_TILE_EPI_BARRIER = 4
_Q_PAD = 16  # bytes past each staged FP8 row: rows 16-byte aligned, quads' stores spread over banks
_E4M3_MAX = 448.0
_F32_MAX = 3.4028234663852886e38
_OUT_MAX = {"BFloat16": 3.3895313892515355e38, "Float16": 65504.0}  # TE's scale where 448 / amax overflows


class GroupedGemmFp8Sm90(GroupedGemmSm90):
    """One compiled variant: (output dtype, BN, cluster_n, N, K, E, scale row length of sb, epilogue,
    power-of-two scales)."""

    # False only for fault isolation (benchmarks/experiments/diagnose_fp8_gemm.py): no TMA of A's
    # scales, every A scale read as 1
    LOAD_A_SCALES = True

    def __init__(
        self,
        out_dtype,
        n: int,
        k: int,
        num_experts: int,
        *,
        tile_mn: tuple[int, int] = (128, 128),
        cluster_n: int = 1,
        cluster_m: int = 1,
        sb_cols: int | None = None,
        epilogue: str = "plain",
        pow2: bool = False,
        promotion: str = "serial",
    ):
        bm, bn = tile_mn
        if promotion not in PROMOTIONS:
            raise ValueError(f"FP8 promotions are {PROMOTIONS}, got {promotion!r}")
        if epilogue not in FP8_EPILOGUES:
            raise ValueError(f"FP8 epilogues are {FP8_EPILOGUES}, got {epilogue!r}")
        if epilogue != "plain":
            if not (bn == SCALE_BLOCK or (bn == 64 and n <= 64)):
                raise ValueError(f"the {epilogue} epilogue needs a row's 128-column scale block inside one tile: BN=128 "
                                 f"(or 64 where N <= 64), got BN={bn} for N={n}")
            if n % 16:
                raise ValueError(f"the {epilogue} epilogue writes 16-byte FP8 row vectors: N must be a multiple of 16, "
                                 f"got {n}")
        if bn not in TILE_NS:
            raise ValueError(f"FP8 tiles take BN in {TILE_NS} (the fp32 partial sums and the "
                             f"accumulator both stay in registers), got {bn}")
        if k <= 0 or k % 16:
            raise ValueError(f"K must be a positive multiple of 16 (16-byte FP8 rows for TMA), got {k}")
        if n <= 0:
            raise ValueError(f"N must be positive, got {n}")
        # the shared forward-form machinery: tile walk, split sizes, cluster pairs, epilogue
        super().__init__(out_dtype, n, k, num_experts, b_n_major=False, epilogue="plain",
                         tile_mn=(bm, bn), cluster_n=cluster_n, cluster_m=cluster_m, schedule="cooperative")
        self.ab_dtype = cutlass.Float8E4M3FN
        self.bk = _BK
        self.k_tiles = (k + _BK - 1) // _BK
        self.n_sblocks = (n + SCALE_BLOCK - 1) // SCALE_BLOCK
        self.sb_cols = self.k_tiles if sb_cols is None else sb_cols
        self.fp8_epilogue = epilogue  # the base class's epilogue stays "plain" (its staging sizes C's)
        self.pow2 = bool(pow2)
        if promotion == "overlap":
            check_overlap_fits(bn, epilogue)
        self.promotion = promotion
        self.q_row = bn + _Q_PAD  # bytes per staged FP8 row
        unit = out_dtype.width // 8
        self.epi_units = max(self.n_out * self.epi_elems, -(-(bm * self.q_row) // unit))
        if self.sb_cols < self.k_tiles:
            raise ValueError(f"B's scale rows must hold ceil(K / 128) = {self.k_tiles} k-blocks, got {sb_cols}")
        # a BN=192 tile covers parts of two 128-column scale blocks; 64 and 128 lie inside one
        self.straddles = SCALE_BLOCK % bn != 0
        if bm + _SA_ALIGN > _SA_STAGE_FLOATS:
            raise ValueError(f"FP8 tiles take BM <= {_SA_STAGE_FLOATS - _SA_ALIGN}, got {bm}")
        stage_bytes = (bm + bn) * _BK + _SA_STAGE_FLOATS * 4  # A and B tiles (1-byte elements), A's scales
        budget = cutlass.memory.get_smem_capacity_in_bytes("sm_90") - 2048
        # epilogue staging: C's chunks, or one tile of FP8 bytes at a time
        budget -= max(self.n_out * self.epi_elems * (out_dtype.width // 8), bm * (bn + _Q_PAD))
        budget -= 1024  # alignment of the A-scale buffers
        self.stages = max(2, min(8, budget // stage_bytes))

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        p_a: cute.Pointer,
        p_b: cute.Pointer,
        p_c: cute.Pointer,
        p_split: cute.Pointer,
        p_sa: cute.Pointer,
        p_sb: cute.Pointer,
        p_prob: cute.Pointer,
        p_q: cute.Pointer,
        p_q_s: cute.Pointer,
        p_z: cute.Pointer,
        p_z_s: cute.Pointer,
        p_c2: cute.Pointer,
        p_part: cute.Pointer,
        num_tokens: cutlass.Int32,
        sa_stride: cutlass.Int32,
        num_ctas: cutlass.Int32,
        q_stride: cutlass.Int32,
        eps: cutlass.Float32,
        stream,
    ):
        """``p_c``: C ("plain"), or dz ("dsrelu_q"). The quantizing epilogues: ``p_prob`` (fp32, per
        token); ``p_q`` (e4m3, (T, N)) the rows the next GEMM reads (act for "srelu_q", dz for
        "dsrelu_q") and ``p_z`` z in FP8 (written by "srelu_q", read by "dsrelu_q"), each with its
        scale-inverses (``p_q_s``, ``p_z_s``: fp32, (ceil(N / 128), T) with row stride
        ``q_stride``); ``p_c2`` act in the output dtype and ``p_part`` the per-n-tile partial sums of
        dprob (fp32, (T, ceil(N / BN))) for "dsrelu_q"; ``eps``: the recipe's amax floor. A form
        does not read the others' pointers."""
        n, k, e = self.n, self.k, self.num_experts
        bm, bn, bk = self.bm, self.bn, self.bk
        ab = self.ab_dtype
        m_a = cute.make_tensor(p_a, cute.make_layout((num_tokens, k), stride=(k, 1)))
        m_b = cute.make_tensor(p_b, cute.make_layout((n, k, e), stride=(k, 1, n * k)))
        m_c = cute.make_tensor(p_c, cute.make_layout((num_tokens, n), stride=(n, 1)))
        m_split = cute.make_tensor(p_split, cute.make_layout((e,)))
        # A's scales as TE lays them out, (k-blocks, tokens) row-major, seen as (tokens, k-blocks):
        # the 128 scales of a tile's rows in one k-block are contiguous, one TMA box
        m_sa = cute.make_tensor(
            p_sa, cute.make_layout((num_tokens, self.k_tiles), stride=(1, cute.assume(sa_stride, divby=4)))
        )
        m_sb = cute.make_tensor(
            p_sb, cute.make_layout((e, self.n_sblocks, self.sb_cols),
                                   stride=(self.n_sblocks * self.sb_cols, self.sb_cols, 1))
        )
        m_prob = cute.make_tensor(p_prob, cute.make_layout((num_tokens,)))
        m_q = cute.make_tensor(p_q, cute.make_layout((num_tokens, n), stride=(n, 1)))
        m_z = cute.make_tensor(p_z, cute.make_layout((num_tokens, n), stride=(n, 1)))
        m_q_s = cute.make_tensor(p_q_s, cute.make_layout((self.n_sblocks, num_tokens), stride=(q_stride, 1)))
        m_z_s = cute.make_tensor(p_z_s, cute.make_layout((self.n_sblocks, num_tokens), stride=(q_stride, 1)))
        m_c2 = cute.make_tensor(p_c2, cute.make_layout((num_tokens, n), stride=(n, 1)))
        m_part = cute.make_tensor(p_part, cute.make_layout((num_tokens, self.n_tiles), stride=(self.n_tiles, 1)))

        k_major = LayoutEnum.ROW_MAJOR
        tiled_mma = self._tiled_mma()
        tile_mnk = (bm, bn, bk)
        sa_layout = sm90_utils.make_smem_layout_a(k_major, tile_mnk, ab, self.stages)
        sb_layout = sm90_utils.make_smem_layout_b(k_major, tile_mnk, ab, self.stages)
        sa_box = bm + _SA_ALIGN
        ssa_layout = cute.make_layout((sa_box, 1, self.stages), stride=(1, sa_box, _SA_STAGE_FLOATS))
        tma_a, g_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp()
            if cutlass.const_expr(self.cluster_n > 1) else cpasync.CopyBulkTensorTileG2SOp(),
            m_a, cute.slice_(sa_layout, (None, None, 0)), (bm, bk), num_multicast=self.cluster_n,
        )
        # a cluster pair that straddles two m-blocks loads each A whole
        tma_a1, g_a1 = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_a, cute.slice_(sa_layout, (None, None, 0)), (bm, bk),
        )
        tma_b, g_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp()
            if cutlass.const_expr(self.cluster_m > 1) else cpasync.CopyBulkTensorTileG2SOp(),
            m_b, cute.slice_(sb_layout, (None, None, 0)), (bn, bk), num_multicast=self.cluster_m,
        )
        if cutlass.const_expr(self.cluster_m > 1):
            # 2 x 2: the n-pair always shares A; an m-pair of two experts loads each B whole
            # (this descriptor, in the slot the pair's whole-A one takes otherwise)
            tma_a1, g_a1 = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), m_b, cute.slice_(sb_layout, (None, None, 0)), (bn, bk),
            )
        tma_sa, g_sa = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_sa, cute.slice_(ssa_layout, (None, None, 0)), (sa_box, 1),
        )

        @cute.struct
        class Smem:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sa: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sa_layout)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sb_layout)], 1024]
            ssa: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(ssa_layout)], 128]
            epi: cute.struct.Align[cute.struct.MemRange[self.dtype, self.epi_units], 128]

        self.smem_struct = Smem
        self.kernel(
            tma_a, g_a, tma_a1, g_a1, tma_b, g_b, tma_sa, g_sa, m_c, m_split, m_sb,
            m_prob, m_q, m_q_s, m_z, m_z_s, m_c2, m_part, eps,
            tiled_mma, sa_layout, sb_layout, ssa_layout,
        ).launch(
            grid=[num_ctas, 1, 1], block=[_THREADS, 1, 1], cluster=[self.cluster_size, 1, 1],
            min_blocks_per_mp=1, stream=stream,
        )

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        g_a: cute.Tensor,
        tma_a1: cute.CopyAtom,
        g_a1: cute.Tensor,
        tma_b: cute.CopyAtom,
        g_b: cute.Tensor,
        tma_sa: cute.CopyAtom,
        g_sa: cute.Tensor,
        m_c: cute.Tensor,
        m_split: cute.Tensor,
        m_sb: cute.Tensor,
        m_prob: cute.Tensor,
        m_q: cute.Tensor,
        m_q_s: cute.Tensor,
        m_z: cute.Tensor,
        m_z_s: cute.Tensor,
        m_c2: cute.Tensor,
        m_part: cute.Tensor,
        eps: cutlass.Float32,
        tiled_mma: cute.TiledMma,
        sa_layout: cute.ComposedLayout,
        sb_layout: cute.ComposedLayout,
        ssa_layout: cute.Layout,
    ):
        ab = self.ab_dtype
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // _WG)
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster = cta // self.cluster_size
        num_clusters = num_ctas // self.cluster_size

        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            if cutlass.const_expr(self.cluster_n > 1):
                cpasync.prefetch_descriptor(tma_a1)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_sa)

        # real work: sum_e ceil(split_e / BM) m-blocks, each with n_tiles n-blocks, in groups of
        # cluster_n tiles (an odd tile count leaves the last group a phantom partner), or of
        # (m-pair, n-pair) under 2 x 2 (a block past the last m-block or past N a phantom)
        num_tokens = cute.size(g_a, mode=[0])
        m_total = self._m_blocks(m_split, num_tokens)
        n_work = (m_total * self.n_tiles + self.cluster_n - 1) // self.cluster_n
        if cutlass.const_expr(self.cluster_m > 1):
            n_work = (m_total + 1) // 2 * self.n_pairs
        cluster_mn = (self.cluster_m, self.cluster_n)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_struct)
        sa = st.sa.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sb = st.sb.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)
        ssa = st.ssa.get_tensor(ssa_layout)
        stage_bytes = (
            cute.size_in_bytes(ab, cute.slice_(sa_layout, (None, None, 0)))
            + cute.size_in_bytes(ab, cute.slice_(sb_layout, (None, None, 0)))
        )
        if cutlass.const_expr(self.LOAD_A_SCALES):
            stage_bytes += cute.size_in_bytes(cutlass.Float32, cute.slice_(ssa_layout, (None, None, 0)))
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # one arrive per consuming warp of every CTA that writes into this one: itself and the
            # CTAs of its m-row (A) and n-column (B) of the cluster
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, (self.cluster_m + self.cluster_n - 1) * 2 * _WG // 32
            ),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_mn, is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_mn)

        if wg == 0:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp == 0:
                self._produce(rank, cluster, num_clusters, n_work, m_split, pipe, tma_a, g_a, tma_a1, g_a1,
                              tma_b, g_b, sa, sb, (tma_sa, g_sa, ssa))
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            self._consume_fp8(tidx - _WG, wg - 1, rank, cluster, num_clusters, n_work, m_split, pipe,
                              sa, sb, ssa, st, tiled_mma, m_c, m_sb, num_tokens,
                              (m_prob, m_q, m_q_s, m_z, m_z_s, eps, m_c2, m_part))

    @cute.jit
    def _stage_extras(self, a_row, extras):
        """A's scales of the tile's rows in every k-block, each stage's box from an aligned row
        (BM + 4, 1, k-blocks): loaded with A and B, on their barrier."""
        tma_sa, g_sa, ssa = extras
        sa_row = a_row - a_row % _SA_ALIGN  # a 16-byte aligned start for TMA
        g_sa_tile = cute.local_tile(cute.domain_offset((sa_row, 0), g_sa), (self.bm + _SA_ALIGN, 1), (0, None))
        t_ssa, t_gsa = cpasync.tma_partition(
            tma_sa, 0, cute.make_layout(1), cute.group_modes(ssa, 0, 2), cute.group_modes(g_sa_tile, 0, 2),
        )
        return tma_sa, t_ssa, t_gsa

    @cute.jit
    def _load_extras(self, parts, kt, stage, bar):
        if cutlass.const_expr(self.LOAD_A_SCALES):
            tma_sa, t_ssa, t_gsa = parts
            cute.copy(tma_sa, t_gsa[None, kt], t_ssa[None, stage], tma_bar_ptr=bar)

    @cute.jit
    def _consume_fp8(self, ctid, cwg, rank, cluster, num_clusters, n_work, m_split, pipe, sa, sb, ssa, st,
                     tiled_mma, m_c, m_sb, num_tokens, q_args):
        bm, bn = self.bm, self.bn
        etid = ctid  # cooperative: the tile's threads are both consumer warpgroups
        wg_mma = tiled_mma.get_slice(cute.make_layout(2, stride=_WG)(cwg))
        frag_a = tiled_mma.make_fragment_A(wg_mma.partition_A(sa))
        frag_b = tiled_mma.make_fragment_B(wg_mma.partition_B(sb))
        thr_mma = tiled_mma.get_slice(etid)
        c_id = thr_mma.partition_C(cute.make_identity_tensor((bm, bn)))
        acc = cute.make_rmem_tensor(c_id.shape, cutlass.Float32)  # promoted fp32 sums
        tmp = cute.make_rmem_tensor(c_id.shape, cutlass.Float32)  # one k-block's WGMMA sums
        tmp2 = tmp  # the overlapped promotion's second buffer
        if cutlass.const_expr(self.promotion == "overlap"):
            tmp2 = cute.make_rmem_tensor(c_id.shape, cutlass.Float32)
        shp = acc.shape
        n_pair, n_half, n_grp, n_m = _fragment_dims(acc)
        if cutlass.const_expr(cute.size(shp[2]) != 1):
            raise ValueError("the promotion expects one WGMMA atom across BN")
        # this thread's rows of the tile (two per 64-row WGMMA slab) and their A scales
        n_rows = n_half * n_m
        rows = cute.make_rmem_tensor(cute.make_layout(n_rows), cutlass.Int32)
        for mm in cutlass.range_constexpr(n_m):
            for h in cutlass.range_constexpr(n_half):
                rows[mm * n_half + h] = c_id[(0, h, 0), mm, 0][0]
        sa_r = cute.make_rmem_tensor(cute.make_layout(n_rows), cutlass.Float32)
        sa_r2 = cute.make_rmem_tensor(cute.make_layout(n_rows), cutlass.Float32)
        prob_r = cute.make_rmem_tensor(cute.make_layout(n_rows), cutlass.Float32)  # the plain epilogue reads none
        m_prob = q_args[0]
        z_r = cute.make_rmem_tensor(c_id.shape, cutlass.Float8E4M3FN)  # dsrelu_q: the tile's saved z
        zs_r = cute.make_rmem_tensor(cute.make_layout(n_rows), cutlass.Float32)

        mma_first = tiled_mma  # overlap: the k-block's first WGMMA, which overwrites its buffer
        if cutlass.const_expr(self.promotion == "overlap"):
            # two MMAs with their accumulate flags set here, outside every loop and branch: a flag
            # changed inside the branches or loops that alternate the buffers cannot leave them
            mma_first = self._tiled_mma()
            mma_first.set(warpgroup.Field.ACCUMULATE, False)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)  # overlap: next to release
        tile = cluster
        while tile < n_work:
            expert, n_blk, _, _, k_tiles, _, row0, rows_here, _ = self._work(m_split, tile, rank, num_tokens)
            cols_here = self.n - n_blk * bn
            sa_shift = row0 % _SA_ALIGN  # the tile's first row in the stage's scale box
            # B's scale block(s) of this tile's columns
            sblk0 = (n_blk * bn) // 128
            if cutlass.const_expr(self.cluster_m > 1):  # a phantom n-block past N reads the last block's
                if sblk0 >= self.n_sblocks:
                    sblk0 = cutlass.Int32(self.n_sblocks - 1)
            sblk1 = sblk0
            split_col = cutlass.Int32(bn)  # tile columns >= split_col use block sblk1
            if cutlass.const_expr(self.straddles):
                split_col = (sblk0 + 1) * 128 - n_blk * bn
                if sblk0 + 1 < self.n_sblocks:
                    sblk1 = sblk0 + 1
            sb0 = m_sb[expert, sblk0, 0]
            sb1 = sb0
            if cutlass.const_expr(self.fp8_epilogue != "plain"):  # in flight during the mainloop
                for i in cutlass.range_constexpr(n_rows):
                    prob_r[i] = cutlass.Float32(0.0)
                    if rows[i] < rows_here:
                        prob_r[i] = m_prob[row0 + rows[i]]
            if cutlass.const_expr(self.fp8_epilogue == "dsrelu_q"):
                self._load_z_fp8(z_r, zs_r, rows, n_blk, row0, rows_here, cols_here, c_id, q_args[3], q_args[4])
            if cutlass.const_expr(self.straddles):
                sb1 = m_sb[expert, sblk1, 0]

            acc.fill(0.0)
            if cutlass.const_expr(self.promotion == "serial"):
                for kt in cutlass.range(k_tiles, unroll=1):
                    # next k-block's B scales, in flight during this k-block's WGMMAs
                    kn = kt + 1
                    if kn >= k_tiles:
                        kn = k_tiles - 1
                    sb0_next = m_sb[expert, sblk0, kn]
                    sb1_next = sb0_next
                    if cutlass.const_expr(self.straddles):
                        sb1_next = m_sb[expert, sblk1, kn]
                    pipe.consumer_wait(cons)
                    self._read_a_scales(sa_r, ssa, rows, sa_shift, cons.index)
                    # inline: the tracer carries tiled_mma's accumulate flag only where it is set
                    # in the loop's own body
                    warpgroup.fence()
                    for kb in cutlass.range_constexpr(cute.size(frag_a, mode=[2])):
                        # the first WGMMA of the k-block overwrites tmp, the rest add into it
                        tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                        cute.gemm(tiled_mma, tmp, frag_a[None, None, kb, cons.index],
                                  frag_b[None, None, kb, cons.index], tmp)
                    warpgroup.commit_group()
                    warpgroup.wait_group(0)
                    pipe.consumer_release(cons)
                    cons.advance()
                    self._promote(acc, tmp, sa_r, sb0, sb1, split_col, c_id)
                    sb0 = sb0_next
                    sb1 = sb1_next
            else:
                # k-block kt sits in buffer kt % 2: issue kt + 1 into the other, wait for kt alone,
                # promote it. Unrolled (the forward's k-block count is known when compiling): in a
                # loop the buffers become loop-carried values and ptxas serializes the WGMMAs
                nk = self.k_tiles
                bufs = ((tmp, sa_r), (tmp2, sa_r2))
                sbs = [(sb0, sb1), (sb0, sb1)]  # each buffer's B scales (sblk0's, sblk1's)
                pipe.consumer_wait(cons)
                self._read_a_scales(sa_r, ssa, rows, sa_shift, cons.index)
                self._mma_kblock(mma_first, tiled_mma, tmp, frag_a, frag_b, cons.index)
                cons.advance()
                for kt in cutlass.range_constexpr(nk):
                    cur, nxt = kt % 2, (kt + 1) % 2
                    if cutlass.const_expr(kt + 1 < nk):
                        nb0 = m_sb[expert, sblk0, kt + 1]
                        nb1 = nb0
                        if cutlass.const_expr(self.straddles):
                            nb1 = m_sb[expert, sblk1, kt + 1]
                        sbs[nxt] = (nb0, nb1)
                        pipe.consumer_wait(cons)
                        self._read_a_scales(bufs[nxt][1], ssa, rows, sa_shift, cons.index)
                        self._mma_kblock(mma_first, tiled_mma, bufs[nxt][0], frag_a, frag_b, cons.index)
                        cons.advance()
                        warpgroup.wait_group(1)  # k-block kt done, kt + 1 in flight
                    else:
                        warpgroup.wait_group(0)
                    pipe.consumer_release(rel)
                    rel.advance()
                    self._promote(acc, bufs[cur][0], bufs[cur][1], sbs[cur][0], sbs[cur][1], split_col, c_id)

            if cutlass.const_expr(self.fp8_epilogue == "srelu_q"):
                self._epilogue_srelu_q(etid, cwg, n_blk, row0, rows_here, cols_here, acc, tmp, prob_r, thr_mma,
                                       c_id, st, q_args)
            elif cutlass.const_expr(self.fp8_epilogue == "dsrelu_q"):
                self._epilogue_dsrelu_q(etid, cwg, n_blk, row0, rows_here, cols_here, acc, tmp, prob_r, z_r, zs_r,
                                        thr_mma, c_id, st, m_c, q_args)
            else:
                self._epilogue_plain(etid, cwg, n_blk, row0, rows_here, cols_here, acc, thr_mma, c_id, st, m_c)
            tile = tile + num_clusters

    @cute.jit
    def _read_a_scales(self, sa_r, ssa, rows, sa_shift, stage):
        """This thread's rows' A scales of one stage (read before the stage is released)."""
        for i in cutlass.range_constexpr(cute.size(sa_r)):
            if cutlass.const_expr(self.LOAD_A_SCALES):
                sa_r[i] = ssa[rows[i] + sa_shift, 0, stage]
            else:
                sa_r[i] = cutlass.Float32(1.0)

    @cute.jit
    def _mma_kblock(self, mma_first, tiled_mma, tmp, frag_a, frag_b, stage):
        """Issue one k-block's WGMMAs into ``tmp`` as one group (the overlapped loop's): the first
        overwrites tmp (``mma_first``), the rest add into it."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(frag_a, mode=[2])):
            cute.gemm(mma_first if kb == 0 else tiled_mma, tmp, frag_a[None, None, kb, stage],
                      frag_b[None, None, kb, stage], tmp)
        warpgroup.commit_group()

    def _tiled_mma(self):
        """The kernel's MMA: 64 x BN e4m3 WGMMAs, K-major A and B, fp32 sums, two warpgroups."""
        k_major = LayoutEnum.ROW_MAJOR
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            cutlass.Float32, (2, 1, 1), tiler_mn=(64, self.bn),
        )

    @cute.jit
    def _promote(self, acc, tmp, sa_r, sb0, sb1, split_col, c_id):
        """acc += tmp * sa[row] * sb[column block] (sb1: the second block a BN=192 tile straddles)."""
        n_pair, n_half, n_grp, n_m = _fragment_dims(acc)
        for mm in cutlass.range_constexpr(n_m):
            for h in cutlass.range_constexpr(n_half):
                s0 = sa_r[mm * n_half + h] * sb0
                s1 = s0
                if cutlass.const_expr(self.straddles):
                    s1 = sa_r[mm * n_half + h] * sb1
                for g in cutlass.range_constexpr(n_grp):
                    s = s0
                    if cutlass.const_expr(self.straddles):
                        # a group of 8 columns lies in one scale block (split_col % 64 == 0)
                        if c_id[(0, h, g), mm, 0][1] >= split_col:
                            s = s1
                    for pr in cutlass.range_constexpr(n_pair):
                        crd = ((pr, h, g), mm, 0)
                        acc[crd] = acc[crd] + tmp[crd] * s

    @cute.jit
    def _block_scale(self, amax, eps):
        """TE's scale of a 1x128 block from its amax (``compute_scale_from_amax``), as
        :func:`..fp8_rows.block_scale` computes it: division and its rounding included."""
        a = cute.arch.fmax(amax, eps)
        scale = cutlass.Float32(_E4M3_MAX) / a
        if scale > cutlass.Float32(_F32_MAX):
            scale = cutlass.Float32(_OUT_MAX[self.dtype.__name__])
        if cutlass.const_expr(self.pow2):
            scale = (scale.bitcast(cutlass.Uint32) & cutlass.Uint32(0xFF800000)).bitcast(cutlass.Float32)
        if a == cutlass.Float32(0.0) or a > cutlass.Float32(_F32_MAX) or a != a:
            scale = cutlass.Float32(1.0)
        return scale

    @cute.jit
    def _row_amax_scale(self, amax, eps):
        """The scale of a row's 128-column block from this thread's amax: the quad's max by two
        butterflies (every lane takes part, valid row or not), then TE's rule."""
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1))
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=2))
        return self._block_scale(amax, eps)

    @cute.jit
    def _abs(self, x):
        return (x.bitcast(cutlass.Uint32) & cutlass.Uint32(0x7FFFFFFF)).bitcast(cutlass.Float32)

    @cute.jit
    def _epilogue_srelu_q(self, etid, cwg, n_blk, row0, rows_here, cols_here, acc, tmp, prob_r, thr_mma, c_id,
                          st, q_args):
        """The tile's z and act, each quantized by row in its 128-column block, -> FP8 data and scales.

        Per element ``z = f32(round(acc))`` (the output dtype's rounding, as C would be stored) and
        ``act = f32(round(relu(z)^2 * prob))``, z kept in ``acc`` and act in ``tmp`` (dead after the
        mainloop); masked to 0 past N, as the row kernel reads zeros there."""
        m_q, m_q_s, m_z, m_z_s, eps = q_args[1], q_args[2], q_args[3], q_args[4], q_args[5]
        dt = self.dtype
        n_pair, n_half, n_grp, n_m = _fragment_dims(acc)
        n_rows = n_half * n_m
        z_scale = cute.make_rmem_tensor(cute.make_layout(n_rows), cutlass.Float32)
        a_scale = cute.make_rmem_tensor(cute.make_layout(n_rows), cutlass.Float32)
        for mm in cutlass.range_constexpr(n_m):
            for h in cutlass.range_constexpr(n_half):
                p = prob_r[mm * n_half + h]
                z_max = cutlass.Float32(0.0)
                a_max = cutlass.Float32(0.0)
                for g in cutlass.range_constexpr(n_grp):
                    for pr in cutlass.range_constexpr(n_pair):
                        crd = ((pr, h, g), mm, 0)
                        z = acc[crd].to(dt).to(cutlass.Float32)
                        if c_id[crd][1] >= cols_here:
                            z = cutlass.Float32(0.0)
                        r = cute.arch.fmax(z, cutlass.Float32(0.0))
                        a = (r * r * p).to(dt).to(cutlass.Float32)
                        acc[crd] = z
                        tmp[crd] = a
                        z_max = cute.arch.fmax(z_max, self._abs(z))
                        a_max = cute.arch.fmax(a_max, self._abs(a))
                z_scale[mm * n_half + h] = self._row_amax_scale(z_max, eps)
                a_scale[mm * n_half + h] = self._row_amax_scale(a_max, eps)
        # act (fc2's input), then z (saved for backward)
        self._store_fp8(etid, cwg, n_blk, row0, rows_here, cols_here, tmp, a_scale, m_q, m_q_s, thr_mma, c_id, st)
        self._store_fp8(etid, cwg, n_blk, row0, rows_here, cols_here, acc, z_scale, m_z, m_z_s, thr_mma, c_id, st)

    @cute.jit
    def _load_z_fp8(self, z_r, zs_r, rows, n_blk, row0, rows_here, cols_here, c_id, m_z, m_z_s):
        """This thread's elements of the tile's z (FP8, zero outside the tile's rows and N) and its
        rows' scale-inverses, issued before the mainloop so the loads land under it."""
        n_pair, n_half, n_grp, n_m = _fragment_dims(z_r)
        sblk = (n_blk * self.bn) // SCALE_BLOCK
        # the tile from a 64-bit offset (row0 * N passes 2^31 for operands past 2^31 elements)
        tile_z = cute.make_tensor(m_z.iterator + (cutlass.Int64(row0) * self.n + n_blk * self.bn),
                                  cute.make_layout((self.bm, self.bn), stride=(self.n, 1)))
        for mm in cutlass.range_constexpr(n_m):
            for h in cutlass.range_constexpr(n_half):
                i = mm * n_half + h
                zs_r[i] = cutlass.Float32(0.0)
                if rows[i] < rows_here:
                    zs_r[i] = m_z_s[sblk, row0 + rows[i]]
                for g in cutlass.range_constexpr(n_grp):
                    for pr in cutlass.range_constexpr(n_pair):
                        crd = ((pr, h, g), mm, 0)
                        rc = c_id[crd]
                        z_r[crd] = cutlass.Float8E4M3FN(0.0)
                        if rc[0] < rows_here:
                            if rc[1] < cols_here:
                                z_r[crd] = tile_z[rc[0], rc[1]]

    @cute.jit
    def _epilogue_dsrelu_q(self, etid, cwg, n_blk, row0, rows_here, cols_here, acc, tmp, prob_r, z_r, zs_r,
                           thr_mma, c_id, st, m_c, q_args):
        """fc2's dgrad tile -> the SReLU backward, as :func:`..fp8_rows.dsrelu_quantize` computes it.

        Per element, from ``dact = f32(round(acc))`` and the saved FP8 z: ``r = relu(z * zs)``,
        ``act = round(r^2 * prob)`` (fc2's wgrad reads it), ``dz = round(dact * r * prob * 2)``
        (fc1's wgrad reads it; its FP8 rows, quantized by row in the 128-column block, fc1's dgrad)
        and the row's partial ``sum(dact * r^2)`` over the tile's columns (dprob: the quad's sum,
        stored per n-tile for a deterministic sum over the tiles). dz and act leave in the output
        dtype through C's staged chunks, dz's FP8 rows as z's do in the forward."""
        m_q, m_q_s, eps, m_c2, m_part = q_args[1], q_args[2], q_args[5], q_args[6], q_args[7]
        dt = self.dtype
        n_pair, n_half, n_grp, n_m = _fragment_dims(acc)
        n_rows = n_half * n_m
        dz_scale = cute.make_rmem_tensor(cute.make_layout(n_rows), cutlass.Float32)
        for mm in cutlass.range_constexpr(n_m):
            for h in cutlass.range_constexpr(n_half):
                i = mm * n_half + h
                p = prob_r[i]
                zs = zs_r[i]
                dz_max = cutlass.Float32(0.0)
                s = cutlass.Float32(0.0)
                for g in cutlass.range_constexpr(n_grp):
                    for pr in cutlass.range_constexpr(n_pair):
                        crd = ((pr, h, g), mm, 0)
                        d = acc[crd].to(dt).to(cutlass.Float32)
                        r = cute.arch.fmax(z_r[crd].to(cutlass.Float32) * zs, cutlass.Float32(0.0))
                        r2 = r * r
                        s = s + d * r2
                        tmp[crd] = (r2 * p).to(dt).to(cutlass.Float32)
                        dz = (d * r * p * cutlass.Float32(2.0)).to(dt).to(cutlass.Float32)
                        acc[crd] = dz
                        dz_max = cute.arch.fmax(dz_max, self._abs(dz))
                dz_scale[i] = self._row_amax_scale(dz_max, eps)
                self._store_row_partial(s, c_id[(0, h, 0), mm, 0][0], etid, row0, rows_here, n_blk, m_part)
        self._store_staged(etid, cwg, n_blk, row0, rows_here, cols_here, acc, m_c, thr_mma, st)
        self._store_staged(etid, cwg, n_blk, row0, rows_here, cols_here, tmp, m_c2, thr_mma, st)
        # the FP8 rows' staging spans both warpgroups' halves of the bf16 staging: both must be done
        cute.arch.barrier(barrier_id=_TILE_EPI_BARRIER, number_of_threads=self.tile_threads)
        self._store_fp8(etid, cwg, n_blk, row0, rows_here, cols_here, acc, dz_scale, m_q, m_q_s, thr_mma, c_id, st)

    @cute.jit
    def _epilogue_plain(self, etid, cwg, n_blk, row0, rows_here, cols_here, acc, thr_mma, c_id, st, m_c):
        """C: the tile's sums in the output dtype (``c_id`` unused here; an epilogue that stores
        from the accumulator layout needs it)."""
        self._store_staged(etid, cwg, n_blk, row0, rows_here, cols_here, acc, m_c, thr_mma, st)

    @cute.jit
    def _store_staged(self, etid, cwg, n_blk, row0, rows_here, cols_here, vals, m_out, thr_mma, st):
        """Values already in the output dtype's range -> ``m_out`` in that dtype, through the staging
        buffer ``epi_cols`` columns at a time, as C leaves. Each math warpgroup stages and stores the
        64 rows its WGMMAs hold, meeting only its own 128 threads at a named barrier: neither waits
        for the other at a tile's end (docs/fp8.md)."""
        bm, bn, cols = self.bm, self.bn, self.epi_cols
        half = bm // 2  # a warpgroup's rows: its 64-row WGMMA slab
        n_chunks = bn // cols
        shp = vals.shape
        n_pair, n_half, n_m = cute.size(shp[0][0]), cute.size(shp[0][1]), cute.size(shp[1])
        grp_per_chunk = cols // 8
        base = st.epi.data_ptr()
        # column c of the tile lands in staged column c % epi_cols
        c_s = thr_mma.partition_C(cute.make_tensor(base, cute.make_layout((bm, (cols, n_chunks)),
                                                                          stride=(self.epi_row, (1, 0)))))
        thr_cp = self._warpgroup_copy().get_slice(etid - cwg * _WG)
        cp_s = thr_cp.partition_S(cute.make_tensor(base + cwg * half * self.epi_row,
                                                   cute.make_layout((half, cols), stride=(self.epi_row, 1))))
        cp_id = thr_cp.partition_S(cute.make_identity_tensor((half, cols)))
        bar_id = _WG_EPI_BARRIER + cwg
        for ch in cutlass.range_constexpr(n_chunks):
            for mm in cutlass.range_constexpr(n_m):
                for h in cutlass.range_constexpr(n_half):
                    for g in cutlass.range_constexpr(ch * grp_per_chunk, (ch + 1) * grp_per_chunk):
                        for pr in cutlass.range_constexpr(n_pair):
                            crd = ((pr, h, g), mm, 0)
                            c_s[crd] = vals[crd].to(self.dtype)
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=_WG)
            # the warpgroup's rows: the top (half, cols) of a chunk that starts at its first row
            chunk = self._chunk(m_out, row0 + cwg * half, n_blk * bn + ch * cols)
            cp_g = thr_cp.partition_D(cute.local_tile(chunk, (half, cols), (0, 0)))
            for i in cutlass.range_constexpr(cute.size(cp_id, mode=[1])):
                for j in cutlass.range_constexpr(cute.size(cp_id, mode=[2])):
                    crd = cp_id[0, i, j]
                    if crd[0] + cwg * half < rows_here:
                        if crd[1] + ch * cols < cols_here:
                            cute.autovec_copy(cp_s[None, i, j], cp_g[None, i, j])
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=_WG)

    def _warpgroup_copy(self):
        """Tiled copy of one warpgroup's (BM / 2, epi_cols) rows as 16-byte vectors, one thread per
        16 bytes of a row."""
        vec = 128 // self.dtype.width
        per_row = self.epi_cols // vec
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(atom, cute.make_layout((_WG // per_row, per_row), stride=(per_row, 1)),
                                       cute.make_layout((1, vec)))

    @cute.jit
    def _store_fp8(self, etid, cwg, n_blk, row0, rows_here, cols_here, vals, scales, m_data, m_s, thr_mma, c_id, st):
        """``vals`` times each row's scale -> e4m3 bytes staged in shared memory, then 16-byte row
        vectors into ``m_data`` predicated on the tile's rows and N; the quad's first lane stores the
        row's scale-inverse into ``m_s`` (its 128-column block's row)."""
        bm, bn = self.bm, self.bn
        f8 = cutlass.Float8E4M3FN
        n_pair, n_half, n_grp, n_m = _fragment_dims(vals)
        bar_id, n_threads = _TILE_EPI_BARRIER, self.tile_threads
        staged = cute.make_tensor(cute.recast_ptr(st.epi.data_ptr(), dtype=f8),
                                  cute.make_layout((bm, bn), stride=(self.q_row, 1)))
        c_staged = thr_mma.partition_C(staged)
        per_row = bn // 16  # 16-byte vectors per tile row
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), f8, num_bits_per_copy=128)
        tiled_cp = cute.make_tiled_copy_tv(
            atom, cute.make_layout((self.tile_threads // per_row, per_row), stride=(per_row, 1)),
            cute.make_layout((1, 16)),
        )
        thr_cp = tiled_cp.get_slice(etid)
        cp_s = thr_cp.partition_S(staged)
        cp_id = thr_cp.partition_S(cute.make_identity_tensor((bm, bn)))
        for mm in cutlass.range_constexpr(n_m):
            for h in cutlass.range_constexpr(n_half):
                sc = scales[mm * n_half + h]
                for g in cutlass.range_constexpr(n_grp):
                    for pr in cutlass.range_constexpr(n_pair):
                        crd = ((pr, h, g), mm, 0)
                        c_staged[crd] = (vals[crd] * sc).to(f8)
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=n_threads)
        # 64-bit: row0 * N passes 2^31 for operands past 2^31 elements
        ptr = (m_data.iterator + (cutlass.Int64(row0) * self.n + n_blk * bn)).align(16)
        cp_g = thr_cp.partition_D(cute.make_tensor(ptr, cute.make_layout((bm, bn), stride=(self.n, 1))))
        for i in cutlass.range_constexpr(cute.size(cp_id, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(cp_id, mode=[2])):
                crd = cp_id[0, i, j]
                if crd[0] < rows_here:
                    if crd[1] < cols_here:
                        cute.autovec_copy(cp_s[None, i, j], cp_g[None, i, j])
        if etid % 4 == 0:
            sblk = (n_blk * bn) // SCALE_BLOCK
            for mm in cutlass.range_constexpr(n_m):
                for h in cutlass.range_constexpr(n_half):
                    row = c_id[(0, h, 0), mm, 0][0]
                    if row < rows_here:
                        m_s[sblk, row0 + row] = cutlass.Float32(1.0) / scales[mm * n_half + h]
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=n_threads)

def _fragment_dims(frag):
    """(value pairs, row halves, 8-column groups, m-repeats): the modes of a thread's accumulator
    fragment, indexed ((pair, half, group), m, 0)."""
    shp = frag.shape
    return cute.size(shp[0][0]), cute.size(shp[0][1]), cute.size(shp[0][2]), cute.size(shp[1])


__all__ = ["GroupedGemmFp8Sm90", "FP8_EPILOGUES", "SCALE_BLOCK", "TILE_NS"]
