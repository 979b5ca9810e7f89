"""Hopper (sm_90a) grouped GEMM kernels written with the CuTe DSL.

Layout contract
---------------
* ``A`` is the token matrix ``(T, K)`` (row-major), tokens concatenated by
  expert: expert ``e`` owns rows ``[off[e], off[e+1])`` with ``off`` the
  exclusive cumulative sum of ``split_sizes`` (an int32 tensor on the GPU).
* ``B`` holds one weight per expert, viewed by the kernel as ``(N, K, E)``:
  K-major when it comes from a ``(E, N, K)`` tensor (``C_e = A_e @ B_e^T``)
  and N-major when it comes from a ``(E, K, N)`` tensor (``C_e = A_e @ B_e``).
* ``C`` is ``(T, N)`` row-major.

Weight-gradient form (``wgrad_m=M``): ``C[e] = A_e^T @ B_e`` with ``A`` the
``(T, M)`` and ``B`` the ``(T, N)`` token matrices (both row-major, so both
reach WGMMA MN-major) and ``C`` the ``(E, M, N)`` stack.  Here the experts'
token ranges are the reduction: the tiles are static (``E`` times the
``(M, N)`` blocks), each runs ``ceil(split_e / BK)`` k-tiles from row
``off[e]``, and the last k-tile, which TMA reads past the expert's end, has
its foreign rows zeroed in shared memory before WGMMA reads it.  An expert
with no tokens gets a zero block.

Schedule: persistent and warp-specialized
-----------------------------------------
One CTA per SM (the host caps the grid at the SM count and at a bound of the
tile count that needs no split sizes).  Each CTA reads the ``E`` split sizes
on the GPU, counts the real tiles (``sum_e ceil(split_e / BM)`` m-blocks times
the n-blocks) and walks them in groups of ``cluster_n`` consecutive tiles:
cluster ``c`` takes groups ``c, c + clusters, ...``; the n-block index runs
fastest, so the CTAs in flight share A rows and one expert's weights in L2.

* warpgroup 0 is the producer: it gives up registers and its warp 0 issues
  the TMA loads of A and B into a ``stages``-deep mbarrier pipeline.  It runs
  ahead across tile boundaries, so the next tile's first k-tiles land while
  the consumers are still in the previous tile's epilogue.
* warpgroups 1 and 2 are the consumers: each owns 64 rows of the 128-row tile,
  runs WGMMA over the pipeline and then the epilogue, which stages the tile
  through shared memory 64 columns at a time (32 for the two-output
  epilogues) and stores 16-byte vectors.

``schedule="pingpong"`` gives each consumer warpgroup tiles of its own
instead (the CTA's tiles alternate between them) with a whole 128 x BN
accumulator (BN <= 128), so one warpgroup's epilogue runs while the other
one's WGMMAs keep the tensor cores busy.  The warpgroups take turns on the
mainloop through two named barriers; besides ordering the MMAs, the turns
keep the mbarrier phase waits sound: a warpgroup that skips the other's tile
advances its pipeline state past stages it never waits on, and may only
wait on the next round of a stage once that stage's previous round landed.

With ``cluster_n == 2`` two CTAs form a cluster on consecutive tiles of the
n-fastest order.  Where both tiles sit in one m-block (all but one pair in
``n_tiles`` when ``n_tiles`` is odd) each CTA loads half of the shared A tile
and multicasts it to both; a pair that straddles two m-blocks loads each A
whole, through a second, plain TMA descriptor.  Either way every CTA receives
a full A and B tile per stage, so the pipeline's byte counts do not change.
An odd tile count leaves a phantom partner for the last tile: it runs the
stages (the pair's barriers count on it) but stores nothing.  In the
weight-gradient form each expert's tile count is padded to even, so that a
pair never spans two experts (their token counts, i.e. k-tiles, differ).

With ``cluster_m == 2`` as well (opt-in) four CTAs form a 2 x 2 cluster on
(m-pair, n-pair) blocks: the n-pair shares A and the m-pair shares B, each
CTA loading half of both and multicasting them.  Weight gradient: the blocks
of one expert (the same tokens).  Forward / dgrad: m-blocks numbered across
experts; an m-pair of two experts loads each B whole instead.  A block past
the last m-block (M) or past N is a phantom that still loads its halves for
its partners and skips its epilogue.

A tile may start in the middle of the token matrix (rows are not aligned to
BM), so the A tile is read through a shifted TMA coordinate space; rows past
the expert's end are read (they belong to the next expert or are zero-filled
past ``T``) but never written: the epilogue predicates every store on
``row < off[e+1]`` and ``col < N``.

Epilogues
---------
``plain``   C = acc
``srelu``   Z = acc, ACT = relu(acc)^2 * prob[row]  (ACT from the fp32 acc)
``dsrelu``  with dact = acc and z read from global memory:
            DZ = dact * prob * 2 relu(z),  ACT = relu(z)^2 * prob,
            PART[n_block, row] = sum over the tile's columns of
            dact * relu(z)^2 (fp32, one writer per element: the host adds the
            n-block partial sums, so dprobs is deterministic).
``acc_f32``, ``red_f32``, ``tma_f32``, ``store_f32``
            the weight gradient into Megatron's fp32 main_grad buffers: added by
            loads and stores, by L2 reductions or by TMA bulk reduce-adds, or
            overwritten (:data:`.gemm_plan.MAIN_GRAD_EPILOGUES`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .gemm_plan import _TMA_COLS, _WG, EPILOGUES, MAIN_GRAD_EPILOGUES, GemmPlan

_THREADS = 3 * _WG  # producer warpgroup + two consumer warpgroups
_PRODUCER_REGS = 40  # the TMA warp needs few registers ...
_CONSUMER_REGS = 232  # ... so the accumulators get more (40*128 + 232*256 <= 64 Ki)
# named barriers (0 is __syncthreads); pingpong uses id + warpgroup, one per warpgroup
_EPI_BARRIER = 1  # the threads sharing an epilogue staging buffer
_MASK_BARRIER = 3  # the threads of a tile meet here after zeroing a wgrad tail k-tile
_ORDER_BARRIER = 5  # pingpong: "your turn on the mainloop", id + the warpgroup waiting


class GroupedGemmSm90(GemmPlan):
    """One variant's code: its plan (:class:`~.gemm_plan.GemmPlan`: BM, BN, cluster, epilogue, N,
    K, E, B major, wgrad M, schedule, ...) for the CuTe DSL ``dtype``."""

    def __init__(self, dtype, n: int, k: int, num_experts: int, **variant):
        super().__init__(dtype.width // 8, n, k, num_experts, **variant)
        self.dtype = dtype

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(
        self,
        p_a: cute.Pointer,
        p_b: cute.Pointer,
        p_c: cute.Pointer,
        p_split: cute.Pointer,
        p_prob: cute.Pointer,
        p_z: cute.Pointer,
        p_act: cute.Pointer,
        p_part: cute.Pointer,
        num_tokens: cutlass.Int32,
        num_ctas: cutlass.Int32,
        stream,
    ):
        n, k, e = self.n, self.k, self.num_experts
        bm, bn, bk = self.bm, self.bn, self.bk
        if cutlass.const_expr(self.wgrad_m is not None):
            m = self.wgrad_m
            # (M, T) and (N, T) views of the row-major token matrices: MN-major
            m_a = cute.make_tensor(p_a, cute.make_layout((m, num_tokens), stride=(1, m)))
            m_b = cute.make_tensor(p_b, cute.make_layout((n, num_tokens), stride=(1, n)))
            if cutlass.const_expr(self.epilogue == "tma_f32"):
                # p_c: the fp32 buffer of slot 0; expert e's (M, N) main_grad is slot p_off[e]
                m_c = cute.make_tensor(p_c, cute.make_layout((m, n, e), stride=(n, 1, self.slot_stride)))
            elif cutlass.const_expr(self.epilogue in MAIN_GRAD_EPILOGUES):
                # p_c: fp32 base; expert e's (M, N) main_grad starts p_off[e] elements past it
                m_c = cute.make_tensor(p_c, cute.make_layout((m, n), stride=(n, 1)))
            else:
                m_c = cute.make_tensor(p_c, cute.make_layout((e * m, n), stride=(n, 1)))
        else:
            m_a = cute.make_tensor(p_a, cute.make_layout((num_tokens, k), stride=(k, 1)))
            if cutlass.const_expr(self.b_n_major):
                m_b = cute.make_tensor(p_b, cute.make_layout((n, k, e), stride=(1, n, self.b_stride)))
            else:
                m_b = cute.make_tensor(p_b, cute.make_layout((n, k, e), stride=(k, 1, self.b_stride)))
            m_c = cute.make_tensor(p_c, cute.make_layout((num_tokens, n), stride=(n, 1)))
        m_split = cute.make_tensor(p_split, cute.make_layout((e,)))
        m_prob = cute.make_tensor(p_prob, cute.make_layout((num_tokens,)))
        m_z = cute.make_tensor(p_z, cute.make_layout((num_tokens, n), stride=(n, 1)))
        m_act = cute.make_tensor(p_act, cute.make_layout((num_tokens, n), stride=(n, 1)))
        if cutlass.const_expr(self.epilogue in MAIN_GRAD_EPILOGUES):
            m_part = cute.make_tensor(p_part, cute.make_layout((e,)))  # Int64 element offsets
        else:
            m_part = cute.make_tensor(
                p_part, cute.make_layout((num_tokens, self.n_tiles), stride=(1, num_tokens))
            )

        a_major = LayoutEnum.COL_MAJOR if self.wgrad_m is not None else LayoutEnum.ROW_MAJOR
        b_major = LayoutEnum.COL_MAJOR if self.b_n_major else LayoutEnum.ROW_MAJOR
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            a_major.sm90_mma_major_mode(),
            b_major.sm90_mma_major_mode(),
            cutlass.Float32,
            (1, 1, 1) if self.pingpong else (2, 1, 1),
            tiler_mn=(64, bn),
        )
        tile_mnk = (bm, bn, bk)
        sa_layout = sm90_utils.make_smem_layout_a(a_major, tile_mnk, self.dtype, self.stages)
        sb_layout = sm90_utils.make_smem_layout_b(b_major, tile_mnk, self.dtype, self.stages)
        tma_a, g_a = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp()
            if cutlass.const_expr(self.cluster_n > 1) else cpasync.CopyBulkTensorTileG2SOp(),
            m_a,
            cute.slice_(sa_layout, (None, None, 0)),
            (bm, bk),
            num_multicast=self.cluster_n,
        )
        # for a cluster pair that straddles two m-blocks: each CTA loads its whole A
        tma_a1, g_a1 = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), m_a, cute.slice_(sa_layout, (None, None, 0)), (bm, bk),
        )
        tma_b, g_b = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp()
            if cutlass.const_expr(self.cluster_m > 1) else cpasync.CopyBulkTensorTileG2SOp(),
            m_b,
            cute.slice_(sb_layout, (None, None, 0)),
            (bn, bk),
            num_multicast=self.cluster_m,
        )
        # the operand a straddling group loads whole goes in the tma_a1 slot: A for a pair (two
        # m-blocks), B for 2 x 2 in the forward / dgrad form (an m-pair of two experts); 2 x 2
        # groups always share A
        if cutlass.const_expr(self.cluster_m > 1 and self.wgrad_m is None):
            tma_a1, g_a1 = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), m_b, cute.slice_(sb_layout, (None, None, 0)), (bn, bk),
            )

        if cutlass.const_expr(self.epilogue == "tma_f32"):
            # the staged box in TMA's 128-byte swizzle: bank-conflict-free writes, whole-line reads
            box_layout = sm90_utils.make_smem_layout_epi(
                cutlass.Float32, LayoutEnum.ROW_MAJOR, (bm, _TMA_COLS), self.epi_bufs
            )
            tma_c, g_c = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), m_c, cute.slice_(box_layout, (None, None, 0)),
                (bm, _TMA_COLS),
            )
            box_cosize = cute.cosize(box_layout)
        else:  # unused stand-ins of the same kinds
            box_layout, tma_c, g_c, box_cosize = sb_layout, tma_b, g_b, 8

        @cute.struct
        class Smem:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sa: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sa_layout)], 1024
            ]
            sb: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sb_layout)], 1024
            ]
            epi: cute.struct.Align[
                cute.struct.MemRange[self.dtype, max(8, self.epi_bufs * self.n_out * self.epi_elems)], 128
            ]
            # 1024-byte aligned for the swizzle only where used: elsewhere that padding would cost a stage
            box: cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, box_cosize], 1024 if self.epilogue == "tma_f32" else 16
            ]

        self.smem_struct = Smem
        self.kernel(
            tma_a, g_a, tma_a1, g_a1, tma_b, g_b, m_c, m_split, m_prob, m_z, m_act, m_part,
            tiled_mma, sa_layout, sb_layout, tma_c, g_c, box_layout,
        ).launch(
            grid=[num_ctas, 1, 1], block=[_THREADS, 1, 1], cluster=[self.cluster_size, 1, 1],
            min_blocks_per_mp=1, stream=stream,
        )

    # ---------------------------------------------------------------- device
    @cute.jit
    def _tile_coords(self, group, rank):
        """(m-block, n-block, shares A) of this CTA in tile group ``group``.

        Pairs: tiles run n-fastest; group g holds tiles g * cluster_n + rank.  The
        pair shares its A tile when both tiles sit in one m-block.  2 x 2 (the m-blocks
        of one expert in the weight-gradient form, of all experts in the forward form):
        group g is m-pair g // n_pairs and n-pair g % n_pairs; the rank is
        rm + 2 * rn (the pipeline's (1, 2, 2, 1) cluster layout), and A is always shared
        (a block past M or N is a phantom that still loads its halves for its partners)."""
        if cutlass.const_expr(self.cluster_m > 1):
            rm = rank % self.cluster_m
            rn = rank // self.cluster_m
            mp = group // self.n_pairs
            m_blk = mp * self.cluster_m + rm
            n_blk = (group - mp * self.n_pairs) * self.cluster_n + rn
            return m_blk, n_blk, True
        first = group * self.cluster_n
        lin = first + rank
        m_blk = lin // self.n_tiles
        shares_a = first // self.n_tiles == (first + self.cluster_n - 1) // self.n_tiles
        return m_blk, lin - m_blk * self.n_tiles, shares_a

    @cute.jit
    def _pair_shares_b(self, m_split, group, num_tokens):
        """Forward / dgrad under 2 x 2: whether the m-pair of tile group ``group`` shares its B
        tile: both m-blocks real and of one expert (the same for both CTAs of the pair, so they
        agree on multicasting). Else each loads its own B whole."""
        mp = group // self.n_pairs
        e0, r0, end0 = self._locate(m_split, mp * 2, num_tokens)
        e1, r1, end1 = self._locate(m_split, mp * 2 + 1, num_tokens)
        same = cutlass.Int32(0)
        if e0 == e1:
            if end0 > r0:
                if end1 > r1:
                    same = cutlass.Int32(1)
        return same == 1

    @cute.jit
    def _m_blocks(self, m_split, num_tokens):
        """The real work's m-blocks: sum over experts of ceil(rows / BM), rows as :meth:`_rows_of`."""
        m_total = cutlass.Int32(0)
        rows_before = cutlass.Int32(0)
        for ei in cutlass.range_constexpr(self.num_experts):
            cnt = self._rows_of(m_split, ei, rows_before, num_tokens)
            m_total = m_total + (cnt + self.bm - 1) // self.bm
            rows_before = rows_before + cnt
        return m_total

    @cute.jit
    def _rows_of(self, m_split, ei, rows_before, num_tokens):
        """Expert ``ei``'s token count as the kernel uses it: clamped to [0, T - rows_before].

        Split sizes are checked on the host only later (reading them now would sync), so bad
        ones must stay harmless here: a negative count would move later experts' rows below
        row 0 and a huge one would queue work far past T. Valid split sizes pass unchanged."""
        cnt = m_split[ei]
        room = num_tokens - rows_before
        if cnt > room:
            cnt = room
        if cnt < 0:
            cnt = cutlass.Int32(0)
        return cnt

    @cute.jit
    def _locate(self, m_split, m_blk, num_tokens):
        """(expert, first row, end row) of m-block ``m_blk``; split sizes read on the GPU."""
        bm = self.bm
        expert = cutlass.Int32(0)
        row0 = cutlass.Int32(0)
        row_end = cutlass.Int32(0)
        tiles_before = cutlass.Int32(0)
        rows_before = cutlass.Int32(0)
        for ei in cutlass.range_constexpr(self.num_experts):
            cnt = self._rows_of(m_split, ei, rows_before, num_tokens)
            ntile = (cnt + bm - 1) // bm
            local = m_blk - tiles_before
            if local >= 0:
                if local < ntile:
                    expert = cutlass.Int32(ei)
                    row0 = rows_before + local * bm
                    row_end = rows_before + cnt
            tiles_before = tiles_before + ntile
            rows_before = rows_before + cnt
        return expert, row0, row_end

    @cute.jit
    def _work(self, m_split, tile, rank, num_tokens):
        """Everything a CTA needs of tile group ``tile``.

        Returns (expert, n_blk, a_row, a_col, k_tiles, k_rem, c_row, rows_here,
        shares_a): the A tile's origin in A's (rows, K) view, the k-tile count,
        the valid K of the last k-tile, the first output row, the valid rows
        (<= 0 for a phantom tile) and whether the CTAs of its m-block share A."""
        bm, bk = self.bm, self.bk
        if cutlass.const_expr(self.wgrad_m is None):
            m_blk, n_blk, shares_a = self._tile_coords(tile, rank)
            # clamped counts: split sizes summing past T never reach past T
            expert, row0, row_end = self._locate(m_split, m_blk, num_tokens)
            a_row, a_col = row0, cutlass.Int32(0)
            k_tiles, k_rem = cutlass.Int32(self.k_tiles), cutlass.Int32(bk)
            c_row, rows_here = row0, row_end - row0
            if cutlass.const_expr(self.cluster_m > 1):
                if n_blk >= self.n_tiles:  # a phantom past N: no rows, like one past the last m-block
                    rows_here = cutlass.Int32(0)
        else:
            per_expert = self.wgrad_groups
            expert = tile // per_expert
            m_blk, n_blk, shares_a = self._tile_coords(tile - expert * per_expert, rank)
            a_col = cutlass.Int32(0)  # the expert's first token
            cnt = cutlass.Int32(0)
            for ei in cutlass.range_constexpr(self.num_experts):
                here = self._rows_of(m_split, ei, a_col, num_tokens)
                if ei == expert:
                    cnt = here
                if ei < expert:
                    a_col = a_col + here
            a_row = m_blk * bm
            k_tiles = (cnt + bk - 1) // bk
            k_rem = cnt - (k_tiles - 1) * bk
            c_row, rows_here = expert * self.wgrad_m + a_row, self.wgrad_m - a_row
            if cutlass.const_expr(self.cluster_m > 1):
                if n_blk >= self.n_tiles:  # a phantom past N: no rows, like one past M
                    rows_here = cutlass.Int32(0)
        return expert, n_blk, a_row, a_col, k_tiles, k_rem, c_row, rows_here, shares_a

    def _bar(self, base, cwg):
        """(named barrier id, thread count) of the threads sharing this warpgroup's tile."""
        return (base + cwg if self.pingpong else base), self.tile_threads

    @cute.jit
    def _mask_k_tail(self, sa, sb, stage, k_rem, etid, cwg):
        """Zero the k columns >= k_rem of this stage's A and B tiles.

        TMA read the last k-tile of an expert past its token range: those
        rows belong to the next expert.  The threads of the tile split the
        A and B rows among warpgroups (cooperative: each clears its own 64 A
        rows and half of B; pingpong: the one warpgroup clears all), then
        make the generic-proxy writes visible to WGMMA (async proxy) before
        anyone reads."""
        bk = self.bk
        share = self.tile_threads // _WG
        part = 0 if self.pingpong else cwg
        a_rows, b_rows = self.bm // share, self.bn // share
        t = etid - part * _WG  # thread within its warpgroup
        # consecutive threads walk the contiguous (M / N) mode; the two halves
        # of the warpgroup take alternate k columns
        r = t % 64
        for kk in cutlass.range(k_rem + t // 64, bk, 2, unroll=1):
            for q in cutlass.range_constexpr(a_rows // 64):
                sa[part * a_rows + q * 64 + r, kk, stage] = self.dtype(0.0)
            for q in cutlass.range_constexpr((b_rows + 63) // 64):
                if q * 64 + r < b_rows:
                    sb[part * b_rows + q * 64 + r, kk, stage] = self.dtype(0.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        bar_id, n_threads = self._bar(_MASK_BARRIER, cwg)
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=n_threads)

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        g_a: cute.Tensor,
        tma_a1: cute.CopyAtom,
        g_a1: cute.Tensor,
        tma_b: cute.CopyAtom,
        g_b: cute.Tensor,
        m_c: cute.Tensor,
        m_split: cute.Tensor,
        m_prob: cute.Tensor,
        m_z: cute.Tensor,
        m_act: cute.Tensor,
        m_part: cute.Tensor,
        tiled_mma: cute.TiledMma,
        sa_layout: cute.ComposedLayout,
        sb_layout: cute.ComposedLayout,
        tma_c: cute.CopyAtom,
        g_c: cute.Tensor,
        box_layout: cute.ComposedLayout,
    ):
        dtype = self.dtype
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // _WG)
        # CTAs walk the tiles as clusters: cluster c takes tile groups c, c + clusters, ...;
        # a group is one tile per CTA rank (see _tile_coords)
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster = cta // self.cluster_size
        num_clusters = num_ctas // self.cluster_size

        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            if cutlass.const_expr(self.cluster_n > 1 and (self.cluster_m == 1 or self.wgrad_m is None)):
                cpasync.prefetch_descriptor(tma_a1)  # the whole-tile descriptor, where one is used
            cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(self.epilogue == "tma_f32"):
                cpasync.prefetch_descriptor(tma_c)

        if cutlass.const_expr(self.wgrad_m is not None):
            n_work = cutlass.Int32(self.num_experts * self.wgrad_groups)
        else:
            # real work: the m-blocks, each with n_tiles n-blocks
            m_total = self._m_blocks(m_split, cute.size(m_prob))
            # tile groups; an odd tile count leaves the last group a phantom partner
            n_work = (m_total * self.n_tiles + self.cluster_n - 1) // self.cluster_n
            if cutlass.const_expr(self.cluster_m > 1):  # (m-pair, n-pair) groups
                n_work = (m_total + 1) // 2 * self.n_pairs
        cluster_mn = (self.cluster_m, self.cluster_n)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_struct)
        sa = st.sa.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sb = st.sb.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)
        stage_bytes = cute.size_in_bytes(
            dtype, cute.slice_(sa_layout, (None, None, 0))
        ) + cute.size_in_bytes(dtype, cute.slice_(sb_layout, (None, None, 0)))
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # one arrive per consuming warp of every CTA that writes into this one: itself and
            # the CTAs of its m-row (A) and n-column (B) of the cluster
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, (self.cluster_m + self.cluster_n - 1) * self.tile_threads // 32
            ),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, self.cluster_n, 1)),
            defer_sync=True,
        )
        # peers multicast into this CTA's buffers and arrive on its barriers:
        # initialise all barriers of the cluster before anyone starts
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_mn, is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_mn)

        if wg == 0:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp == 0:
                self._produce(
                    rank, cluster, num_clusters, n_work, m_split, pipe, tma_a, g_a, tma_a1, g_a1,
                    tma_b, g_b, sa, sb,
                )
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            self._consume(
                tidx - _WG, wg - 1, rank, cluster, num_clusters, n_work, m_split, pipe, sa, sb, st,
                tiled_mma, m_c, m_prob, m_z, m_act, m_part, tma_c, g_c, box_layout,
            )

    @cute.jit
    def _stage_extras(self, a_row, extras):
        """A tile's partitions of what a subclass loads into each stage beside A and B (``extras``:
        its descriptors and buffers); this kernel loads nothing more."""
        return None

    @cute.jit
    def _load_extras(self, parts, kt, stage, bar):
        """Load k-tile ``kt`` of the tile's extras (:meth:`_stage_extras`) into ``stage``."""
        pass

    @cute.jit
    def _produce(self, rank, cluster, num_clusters, n_work, m_split, pipe, tma_a, g_a, tma_a1, g_a1,
                 tma_b, g_b, sa, sb, extras=None):
        bm, bn, bk = self.bm, self.bn, self.bk
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        # rank = rm + cluster_m * rn: A goes to the CTAs of this m-row (same rm), B to those of
        # this n-column (same rn); each CTA loads slice rn of A and slice rm of B
        rm = rank % self.cluster_m
        rn = rank // self.cluster_m
        cluster_mn = cute.make_layout((self.cluster_m, self.cluster_n))
        mcast = cute.make_layout_image_mask(cluster_mn, (rm, rn), 1)  # A: across the n-pair
        mcast_b = cute.make_layout_image_mask(cluster_mn, (rm, rn), 0)  # B: across the m-pair
        num_tokens = cute.size(g_a, mode=[1] if self.wgrad_m is not None else [0])
        tile = cluster
        while tile < n_work:
            expert, n_blk, a_row, a_col, k_tiles, _, _, _, shares_a = self._work(
                m_split, tile, rank, num_tokens
            )
            # the A tile starts at any row (forward) or any token (wgrad)
            g_a_tile = cute.local_tile(cute.domain_offset((a_row, a_col), g_a), (bm, bk), (0, None))
            if cutlass.const_expr(self.wgrad_m is not None):
                g_b_tile = cute.local_tile(cute.domain_offset((0, a_col), g_b), (bn, bk), (n_blk, None))
            else:
                slot = (self.num_experts - 1 - expert) if cutlass.const_expr(self.b_reversed) else expert
                g_b_tile = cute.local_tile(g_b[None, None, slot], (bn, bk), (n_blk, None))
            t_sa, t_ga = cpasync.tma_partition(
                tma_a, rn, cute.make_layout(self.cluster_n),
                cute.group_modes(sa, 0, 2), cute.group_modes(g_a_tile, 0, 2),
            )
            t_sb, t_gb = cpasync.tma_partition(
                tma_b, rm, cute.make_layout(self.cluster_m),
                cute.group_modes(sb, 0, 2), cute.group_modes(g_b_tile, 0, 2),
            )
            if cutlass.const_expr(self.cluster_m > 1):
                # forward / dgrad: the m-pair shares B only within one expert; else the whole B
                # tile, this CTA only, through the plain descriptor (in the tma_a1 slot)
                if cutlass.const_expr(self.wgrad_m is None):
                    shares_b = self._pair_shares_b(m_split, tile, num_tokens)
                    g_b1_tile = cute.local_tile(g_a1[None, None, slot], (bn, bk), (n_blk, None))
                    t_sb1, t_gb1 = cpasync.tma_partition(
                        tma_a1, 0, cute.make_layout(1),
                        cute.group_modes(sb, 0, 2), cute.group_modes(g_b1_tile, 0, 2),
                    )
            elif cutlass.const_expr(self.cluster_n > 1):  # the whole A tile, this CTA only
                g_a1_tile = cute.local_tile(cute.domain_offset((a_row, a_col), g_a1), (bm, bk), (0, None))
                t_sa1, t_ga1 = cpasync.tma_partition(
                    tma_a1, 0, cute.make_layout(1),
                    cute.group_modes(sa, 0, 2), cute.group_modes(g_a1_tile, 0, 2),
                )
            parts = self._stage_extras(a_row, extras)
            for kt in cutlass.range(k_tiles, unroll=1):
                pipe.producer_acquire(prod)
                bar = pipe.producer_get_barrier(prod)
                if cutlass.const_expr(self.cluster_m > 1):  # 2 x 2: the n-pair always shares A
                    cute.copy(tma_a, t_ga[None, kt], t_sa[None, prod.index], tma_bar_ptr=bar,
                              mcast_mask=mcast)
                elif cutlass.const_expr(self.cluster_n > 1):
                    if shares_a:
                        cute.copy(tma_a, t_ga[None, kt], t_sa[None, prod.index], tma_bar_ptr=bar,
                                  mcast_mask=mcast)
                    else:
                        cute.copy(tma_a1, t_ga1[None, kt], t_sa1[None, prod.index], tma_bar_ptr=bar)
                else:
                    cute.copy(tma_a, t_ga[None, kt], t_sa[None, prod.index], tma_bar_ptr=bar)
                if cutlass.const_expr(self.cluster_m > 1 and self.wgrad_m is not None):
                    cute.copy(tma_b, t_gb[None, kt], t_sb[None, prod.index], tma_bar_ptr=bar,
                              mcast_mask=mcast_b)
                elif cutlass.const_expr(self.cluster_m > 1):
                    if shares_b:
                        cute.copy(tma_b, t_gb[None, kt], t_sb[None, prod.index], tma_bar_ptr=bar,
                                  mcast_mask=mcast_b)
                    else:
                        cute.copy(tma_a1, t_gb1[None, kt], t_sb1[None, prod.index], tma_bar_ptr=bar)
                else:
                    cute.copy(tma_b, t_gb[None, kt], t_sb[None, prod.index], tma_bar_ptr=bar)
                self._load_extras(parts, kt, prod.index, bar)
                pipe.producer_commit(prod)
                prod.advance()
            tile = tile + num_clusters
        # stay until every consumer of the cluster has released every stage
        pipe.producer_tail(prod)

    @cute.jit
    def _consume(
        self, ctid, cwg, rank, cluster, num_clusters, n_work, m_split, pipe, sa, sb, st,
        tiled_mma, m_c, m_prob, m_z, m_act, m_part, tma_c, g_c, box_layout,
    ):
        bm, bn = self.bm, self.bn
        dtype = self.dtype
        # etid: this thread among those sharing its tile (both consumer
        # warpgroups, or under pingpong its own warpgroup)
        etid = ctid - cwg * _WG if self.pingpong else ctid
        # A/B operands are smem descriptors shared by a whole warpgroup: slice
        # by warpgroup.  Accumulator elements differ per thread: the epilogue
        # partitions C with the slice of this very thread.
        if cutlass.const_expr(self.pingpong):
            wg_mma = tiled_mma.get_slice(0)
        else:
            wg_mma = tiled_mma.get_slice(cute.make_layout(2, stride=_WG)(cwg))
        frag_a = tiled_mma.make_fragment_A(wg_mma.partition_A(sa))
        frag_b = tiled_mma.make_fragment_B(wg_mma.partition_B(sb))
        thr_mma = tiled_mma.get_slice(etid)
        c_id = thr_mma.partition_C(cute.make_identity_tensor((bm, bn)))
        acc = cute.make_rmem_tensor(c_id.shape, cutlass.Float32)
        num_kb = cute.size(frag_a, mode=[2])
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        thr_cp = self._staging_copy().get_slice(etid)
        cp_id = thr_cp.partition_S(cute.make_identity_tensor((bm, self.epi_cols)))
        # epilogue inputs (prob per row; z as coalesced 16-byte vectors, one
        # register tensor per epilogue chunk), loaded before the mainloop so
        # their latency hides under it.  Pingpong has no registers to spare
        # for z: it loads one chunk at a time in the epilogue, which the other
        # warpgroup's mainloop hides.
        n_rows = cute.size(acc.shape[0][1]) * cute.size(acc.shape[1])
        prob_r = cute.make_rmem_tensor(cute.make_layout(n_rows), cutlass.Float32)
        z_chunks = 1 if self.pingpong else bn // self.epi_cols
        z_r = [cute.make_rmem_tensor(cp_id.shape, dtype) for _ in range(z_chunks)]

        num_tokens = cute.size(m_prob)  # T in every form (m_c is the (E*M, N) stack in wgrad)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        tile = cluster
        turn = cutlass.Int32(0)  # the cluster's tile count so far (pingpong: whose turn)
        while tile < n_work:
            expert, n_blk, _, _, k_tiles, k_rem, row0, rows_here, _ = self._work(
                m_split, tile, rank, num_tokens
            )
            mine = True
            if cutlass.const_expr(self.pingpong):
                mine = turn % 2 == cwg
            if mine:
                cols_here = self.n - n_blk * bn
                if cutlass.const_expr(self.epilogue in ("srelu", "dsrelu")):
                    self._load_epilogue_inputs(
                        c_id, row0, rows_here, cols_here, n_blk, prob_r, z_r, m_prob, m_z, thr_cp,
                        cp_id,
                    )
                if cutlass.const_expr(self.pingpong):
                    if turn > 0:  # wait until the other warpgroup's mainloop has passed
                        cute.arch.barrier(barrier_id=_ORDER_BARRIER + cwg, number_of_threads=2 * _WG)

                acc.fill(0.0)
                # a phantom tile (the odd partner of a cluster pair) only passes its stages
                live = rows_here > 0
                for kt in cutlass.range(k_tiles, unroll=1):
                    pipe.consumer_wait(cons)
                    if live:
                        if cutlass.const_expr(self.wgrad_m is not None):
                            if kt == k_tiles - 1:
                                if k_rem < self.bk:
                                    self._mask_k_tail(sa, sb, cons.index, k_rem, etid, cwg)
                        warpgroup.fence()
                        for kb in cutlass.range_constexpr(num_kb):
                            cute.gemm(
                                tiled_mma, acc,
                                frag_a[None, None, kb, cons.index],
                                frag_b[None, None, kb, cons.index],
                                acc,
                            )
                        warpgroup.commit_group()
                    # keep one wgmma batch in flight; the stage before it is read
                    warpgroup.wait_group(1)
                    if kt > 0:
                        pipe.consumer_release(rel)
                        rel.advance()
                    cons.advance()
                if cutlass.const_expr(self.pingpong):
                    if tile + num_clusters < n_work:  # hand the mainloop over
                        cute.arch.barrier_arrive(
                            barrier_id=_ORDER_BARRIER + 1 - cwg, number_of_threads=2 * _WG
                        )
                warpgroup.wait_group(0)
                if k_tiles > 0:  # an expert with no tokens consumed no stage
                    pipe.consumer_release(rel)
                    rel.advance()

                if cutlass.const_expr(self.epilogue == "tma_f32"):
                    if rows_here > 0:  # a phantom tile (padding of a cluster pair) adds nothing
                        self._epilogue_main_grad_tma(expert, row0 - expert * self.wgrad_m, n_blk, acc, c_id,
                                                     etid, cwg, st, tma_c, g_c, box_layout, m_part)
                elif cutlass.const_expr(self.epilogue in MAIN_GRAD_EPILOGUES):
                    self._epilogue_main_grad(expert, row0 - expert * self.wgrad_m, n_blk, rows_here,
                                             cols_here, acc, c_id, thr_mma, m_c, m_part)
                elif cutlass.const_expr(self.cluster_m > 1):
                    if rows_here > 0:  # a phantom (uniform over the tile's threads) stores nothing
                        self._epilogue(etid, cwg, n_blk, row0, rows_here, cols_here, acc, prob_r, z_r,
                                       thr_mma, c_id, thr_cp, cp_id, st, m_c, m_z, m_act, m_part)
                else:
                    self._epilogue(etid, cwg, n_blk, row0, rows_here, cols_here, acc, prob_r, z_r,
                                   thr_mma, c_id, thr_cp, cp_id, st, m_c, m_z, m_act, m_part)
            else:
                # the other warpgroup's tile: skip its stages
                if k_tiles > 0:
                    cons.advance(k_tiles)
                    rel.advance(k_tiles)
            tile = tile + num_clusters
            turn = turn + 1

    def _staging_copy(self):
        """Tiled copy of a (BM, epi_cols) chunk as 16-byte vectors, one thread per 16 bytes of a row."""
        vec = 128 // self.dtype.width
        per_row = self.epi_cols // vec
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        return cute.make_tiled_copy_tv(
            atom,
            cute.make_layout((self.tile_threads // per_row, per_row), stride=(per_row, 1)),
            cute.make_layout((1, vec)),
        )

    @cute.jit
    def _load_epilogue_inputs(self, c_id, row0, rows_here, cols_here, n_blk, prob_r, z_r,
                              m_prob, m_z, thr_cp, cp_id):
        shp = c_id.shape
        n_half = cute.size(shp[0][1])
        for mm in cutlass.range_constexpr(cute.size(shp[1])):
            for h in cutlass.range_constexpr(n_half):
                row = c_id[(0, h, 0), mm, 0][0]
                prob_r[mm * n_half + h] = cutlass.Float32(0.0)
                if row < rows_here:
                    prob_r[mm * n_half + h] = m_prob[row0 + row].to(cutlass.Float32)
        if cutlass.const_expr(self.epilogue == "dsrelu" and not self.pingpong):
            for ch in cutlass.range_constexpr(len(z_r)):
                self._load_z_chunk(ch, z_r[ch], row0, rows_here, cols_here, n_blk, m_z, thr_cp, cp_id)

    @cute.jit
    def _load_z_chunk(self, ch, z_reg, row0, rows_here, cols_here, n_blk, m_z, thr_cp, cp_id):
        """z of epilogue chunk ``ch`` of the tile -> registers (zeros outside the valid rows/cols)."""
        g_z = thr_cp.partition_S(self._chunk(m_z, row0, n_blk * self.bn + ch * self.epi_cols))
        z_reg.fill(0.0)
        for i in cutlass.range_constexpr(cute.size(cp_id, mode=[1])):
            for j in cutlass.range_constexpr(cute.size(cp_id, mode=[2])):
                crd = cp_id[0, i, j]
                if crd[0] < rows_here:
                    if crd[1] + ch * self.epi_cols < cols_here:
                        cute.autovec_copy(g_z[None, i, j], z_reg[None, i, j])

    @cute.jit
    def _epilogue(self, etid, cwg, n_blk, row0, rows_here, cols_here, acc, prob_r, z_r, thr_mma,
                  c_id, thr_cp, cp_id, st, m_c, m_z, m_act, m_part):
        """Accumulators -> shared memory -> global memory, ``epi_cols`` columns at a time.

        Hopper 64xN warpgroup accumulators hold, per thread, elements
        ((column pair, row half, column group of 8), m, n); the four lanes of
        a quad share their rows, so a per-thread sum over the column modes plus
        a 4-lane butterfly gives a row total (the dprobs partials).  The staged
        chunk leaves shared memory as 16-byte vectors, one thread per 16 bytes
        of a row segment, each predicated on ``row < rows_here`` and ``col < N``.
        """
        bm, bn = self.bm, self.bn
        dtype = self.dtype
        n_chunks = bn // self.epi_cols
        # (BM, (epi_cols, chunks)) views with stride 0 over the chunk index:
        # column c of the tile lands in staged column c % epi_cols
        stage_layout = cute.make_layout((bm, (self.epi_cols, n_chunks)), stride=(self.epi_row, (1, 0)))
        chunk_layout = cute.make_layout((bm, self.epi_cols), stride=(self.epi_row, 1))
        base = st.epi.data_ptr()
        if cutlass.const_expr(self.pingpong):  # each warpgroup stages in its own buffer
            base = base + cwg * (self.n_out * self.epi_elems)
        bar_id, n_threads = self._bar(_EPI_BARRIER, cwg)
        s_out0 = cute.make_tensor(base, stage_layout)
        c_s0 = thr_mma.partition_C(s_out0)
        s_chunk0 = cute.make_tensor(base, chunk_layout)
        if cutlass.const_expr(self.n_out == 2):
            s_out1 = cute.make_tensor(base + self.epi_elems, stage_layout)
            c_s1 = thr_mma.partition_C(s_out1)
            s_chunk1 = cute.make_tensor(base + self.epi_elems, chunk_layout)

        cp_s0 = thr_cp.partition_S(s_chunk0)
        if cutlass.const_expr(self.n_out == 2):
            cp_s1 = thr_cp.partition_S(s_chunk1)
        n_i = cute.size(cp_id, mode=[1])
        n_j = cute.size(cp_id, mode=[2])

        shp = acc.shape
        n_pair = cute.size(shp[0][0])
        n_half = cute.size(shp[0][1])
        grp_per_chunk = self.epi_cols // 8
        row_sum = cute.make_rmem_tensor(cute.make_layout(cute.size(prob_r)), cutlass.Float32)
        row_sum.fill(0.0)
        for ch in cutlass.range_constexpr(n_chunks):
            if cutlass.const_expr(self.epilogue == "dsrelu"):
                # z of this chunk -> the ACT staging buffer, read back below in
                # the accumulator layout and overwritten in place with ACT
                z_ch = z_r[0 if self.pingpong else ch]
                if cutlass.const_expr(self.pingpong):
                    self._load_z_chunk(ch, z_ch, row0, rows_here, cols_here, n_blk, m_z, thr_cp, cp_id)
                for i in cutlass.range_constexpr(n_i):
                    for j in cutlass.range_constexpr(n_j):
                        cute.autovec_copy(z_ch[None, i, j], cp_s1[None, i, j])
                cute.arch.barrier(barrier_id=bar_id, number_of_threads=n_threads)
            # 1) this chunk's accumulator elements -> shared memory
            for mm in cutlass.range_constexpr(cute.size(shp[1])):
                for h in cutlass.range_constexpr(n_half):
                    p = prob_r[mm * n_half + h]
                    s = row_sum[mm * n_half + h]
                    for nn in cutlass.range_constexpr(cute.size(shp[2])):
                        for g in cutlass.range_constexpr(ch * grp_per_chunk, (ch + 1) * grp_per_chunk):
                            for pr in cutlass.range_constexpr(n_pair):
                                crd = ((pr, h, g), mm, nn)
                                d = acc[crd]
                                if cutlass.const_expr(self.epilogue == "plain"):
                                    c_s0[crd] = d.to(dtype)
                                elif cutlass.const_expr(self.epilogue == "srelu"):
                                    r = cute.arch.fmax(d, cutlass.Float32(0.0))
                                    c_s0[crd] = d.to(dtype)
                                    c_s1[crd] = (r * r * p).to(dtype)
                                else:
                                    r = cute.arch.fmax(c_s1[crd].to(cutlass.Float32), cutlass.Float32(0.0))
                                    rr = r * r
                                    c_s0[crd] = (d * p * (r + r)).to(dtype)
                                    c_s1[crd] = (rr * p).to(dtype)
                                    s = s + d * rr
                    row_sum[mm * n_half + h] = s
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=n_threads)
            # 2) shared memory -> global memory, coalesced, predicated
            col0 = n_blk * bn + ch * self.epi_cols
            cp_g0 = thr_cp.partition_D(self._chunk(m_c, row0, col0))
            if cutlass.const_expr(self.n_out == 2):
                cp_g1 = thr_cp.partition_D(self._chunk(m_act, row0, col0))
            for i in cutlass.range_constexpr(n_i):
                for j in cutlass.range_constexpr(n_j):
                    crd = cp_id[0, i, j]
                    if crd[0] < rows_here:
                        if crd[1] + ch * self.epi_cols < cols_here:
                            cute.autovec_copy(cp_s0[None, i, j], cp_g0[None, i, j])
                            if cutlass.const_expr(self.n_out == 2):
                                cute.autovec_copy(cp_s1[None, i, j], cp_g1[None, i, j])
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=n_threads)

        if cutlass.const_expr(self.epilogue == "dsrelu"):
            for mm in cutlass.range_constexpr(cute.size(shp[1])):
                for h in cutlass.range_constexpr(n_half):
                    self._store_row_partial(row_sum[mm * n_half + h], c_id[(0, h, 0), mm, 0][0], etid, row0,
                                            rows_here, n_blk, m_part)

    @cute.jit
    def _store_row_partial(self, s, row, etid, row0, rows_here, n_blk, m_part):
        """A row's partial dprob: the quad's four lanes summed (every lane takes part in the
        shuffles, valid row or not), stored by the quad's first lane for its n-tile."""
        s = s + cute.arch.shuffle_sync_bfly(s, offset=1)
        s = s + cute.arch.shuffle_sync_bfly(s, offset=2)
        if etid % 4 == 0:
            if row < rows_here:
                m_part[row0 + row, n_blk] = s

    @cute.jit
    def _epilogue_main_grad(self, expert, m_row0, n_blk, rows_here, cols_here, acc, c_id, thr_mma,
                            m_c, m_off):
        """Weight-gradient tile -> expert ``expert``'s fp32 main_grad, added (acc_f32) or stored.

        Straight from the accumulator layout: each thread holds column pairs, and the four lanes
        of a quad hold 8 consecutive columns of a row, so 8-byte accesses cover whole 32-byte
        sectors with no staging. The read-modify-write goes ``epi_cols`` columns at a time: all
        loads of a chunk are in flight together, then the sums are stored. Offsets are 64-bit
        (main_grad buffers are large flat allocations); the host checks 8-byte alignment."""
        bm, bn = self.bm, self.bn
        origin = m_off[expert] + cutlass.Int64(m_row0) * self.n + n_blk * bn
        ptr = (m_c.iterator + origin).align(8)
        t_g = thr_mma.partition_C(cute.make_tensor(ptr, cute.make_layout((bm, bn), stride=(self.n, 1))))
        shp = acc.shape
        n_half = cute.size(shp[0][1])
        n_m, n_n = cute.size(shp[1]), cute.size(shp[2])
        grp_per_chunk = self.epi_cols // 8
        pairs = n_half * grp_per_chunk * n_m * n_n
        old = cute.make_rmem_tensor(cute.make_layout((2, pairs), stride=(1, 2)), cutlass.Float32)
        new = cute.make_rmem_tensor(cute.make_layout((2, pairs), stride=(1, 2)), cutlass.Float32)
        for ch in cutlass.range_constexpr(bn // self.epi_cols):
            if cutlass.const_expr(self.epilogue == "acc_f32"):
                i = 0
                for mm in cutlass.range_constexpr(n_m):
                    for h in cutlass.range_constexpr(n_half):
                        for nn in cutlass.range_constexpr(n_n):
                            for g in cutlass.range_constexpr(ch * grp_per_chunk, (ch + 1) * grp_per_chunk):
                                old[0, i] = cutlass.Float32(0.0)
                                old[1, i] = cutlass.Float32(0.0)
                                rc = c_id[(0, h, g), mm, nn]
                                if rc[0] < rows_here:
                                    if rc[1] < cols_here:  # N % 8 == 0: a pair is in or out whole
                                        cute.autovec_copy(t_g[(None, h, g), mm, nn], old[None, i])
                                i += 1
            i = 0
            for mm in cutlass.range_constexpr(n_m):
                for h in cutlass.range_constexpr(n_half):
                    for nn in cutlass.range_constexpr(n_n):
                        for g in cutlass.range_constexpr(ch * grp_per_chunk, (ch + 1) * grp_per_chunk):
                            rc = c_id[(0, h, g), mm, nn]
                            if rc[0] < rows_here:
                                if rc[1] < cols_here:
                                    if cutlass.const_expr(self.epilogue == "red_f32"):
                                        # one 8-byte reduction per column pair (red.global.add.v2.f32)
                                        pair = vector.from_elements(
                                            ir.VectorType.get([2], cutlass.Float32.mlir_type),
                                            [acc[(pr, h, g), mm, nn].ir_value() for pr in range(2)],
                                        )
                                        cute.arch.red(t_g[(None, h, g), mm, nn].iterator, pair, op="add",
                                                      dtype="f32", sem="relaxed", scope="gpu")
                                    else:
                                        for pr in cutlass.range_constexpr(2):
                                            if cutlass.const_expr(self.epilogue == "acc_f32"):
                                                new[pr, i] = acc[(pr, h, g), mm, nn] + old[pr, i]
                                            else:
                                                new[pr, i] = acc[(pr, h, g), mm, nn]
                                        cute.autovec_copy(new[None, i], t_g[(None, h, g), mm, nn])
                            i += 1

    @cute.jit
    def _epilogue_main_grad_tma(self, expert, m_row0, n_blk, acc, c_id, etid, cwg, st, tma_c, g_c,
                                box_layout, m_slot):
        """Weight-gradient tile -> expert ``expert``'s fp32 main_grad by TMA reduce-adds.

        32 columns at a time: the threads write their accumulator elements into the staged
        (BM, 32) box at their (row, col) (the layout's swizzle places them), then one warp hands
        the box to the TMA unit, which adds it into main_grad line by line in L2. The box's global
        tensor is the experts' buffers as (M, N, slots), so TMA clips the tile at M and N; the
        warp waits until TMA has read the box before anyone writes the next chunk into it."""
        bm, bn, cols = self.bm, self.bn, self.epi_cols
        shp = acc.shape
        if cutlass.const_expr(cute.size(shp[2]) != 1):
            raise ValueError("the tma_f32 epilogue expects one MMA tile across BN")
        buf = cwg if cutlass.const_expr(self.pingpong) else 0
        boxes = st.box.get_tensor(box_layout.outer, swizzle=box_layout.inner)  # (BM, 32, buffers)
        box = boxes[None, None, buf]
        slot = cutlass.Int32(m_slot[expert])
        # this tile's row of (BM, 32) boxes in the expert's (M, N) slot
        g_boxes = cute.local_tile(g_c[None, None, slot], (bm, cols), (m_row0 // bm, None))
        t_s, t_g = cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(boxes, 0, 2), cute.group_modes(g_boxes, 0, 2),
        )
        bar_id, n_threads = self._bar(_EPI_BARRIER, cwg)
        n_half = cute.size(shp[0][1])
        grp_per_chunk = cols // 8
        for ch in cutlass.range_constexpr(bn // cols):
            # a box wholly past N (the last n-block's tail) has nothing to add: the same for every
            # thread of the tile, so the barriers stay balanced
            if n_blk * bn + ch * cols < self.n:
                for mm in cutlass.range_constexpr(cute.size(shp[1])):
                    for h in cutlass.range_constexpr(n_half):
                        for g in cutlass.range_constexpr(ch * grp_per_chunk, (ch + 1) * grp_per_chunk):
                            for pr in cutlass.range_constexpr(2):
                                crd = ((pr, h, g), mm, 0)
                                rc = c_id[crd]
                                box[rc[0], rc[1] - ch * cols] = acc[crd]
                cute.arch.fence_proxy("async.shared", space="cta")  # visible to the TMA unit
                cute.arch.barrier(barrier_id=bar_id, number_of_threads=n_threads)
                if etid < 32:  # one warp (the DSL elects its issuing thread)
                    cute.copy(tma_c, t_s[None, buf], t_g[None, n_blk * (bn // cols) + ch])
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(barrier_id=bar_id, number_of_threads=n_threads)

    @cute.jit
    def _chunk(self, t, row0, col0):
        """(BM, epi_cols) global tile at (row0, col0), its pointer marked 16-byte aligned.

        It is: rows are N elements apart with N % 8 == 0, and col0 is a multiple of epi_cols (>= 32).
        Without the mark the copies fall back to 2-byte stores."""
        # 64-bit: row0 * N passes 2^31 for operands past 2^31 elements
        ptr = (t.iterator + (cutlass.Int64(row0) * self.n + col0)).align(16)
        return cute.make_tensor(ptr, cute.make_layout((self.bm, self.epi_cols), stride=(self.n, 1)))


__all__ = ["GroupedGemmSm90", "EPILOGUES", "MAIN_GRAD_EPILOGUES"]
