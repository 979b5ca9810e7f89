"""Hopper (sm_90a) grouped FP8 weight gradient under Transformer Engine's block scaling.

``dW[e] = A_e^T B_e`` over expert ``e``'s tokens, with ``A`` (T, M) and ``B`` (T, N) the token
matrices (dy and act for fc2, dz and x for fc1). FP8 WGMMA reads both operands K-major, here
token-major, so the kernel reads the columnwise copies :func:`..fp8_rows.quantize_columns`
makes: ``A`` as (M, Tp) e4m3 with (Tp / 128, roundup(M, 4)) fp32 scale-inverses, ``B`` as
(N, Tp) with (Tp / 128, roundup(N, 4)); each expert's tokens padded with zeros to a multiple of
128 (its own 128x1 scale blocks, as TE's quantizer makes them per expert), so no k-tile holds two
experts' tokens and no tail needs masking.

Each 128-token k-block has its own scale per output row (A's) and per output column (B's): the
k-block's WGMMA sums land in a fresh fp32 fragment and are promoted into the accumulator as
``acc += tmp * sa[row] * sb[col]``, both scale vectors loaded by TMA into shared memory with the
stage's operands. That is two floating-point operations per element per k-block, half of the
tensor cores' time for the k-block's WGMMAs, so the promotion overlaps them
(``promotion="overlap"``, the default): k-block ``kb + 1`` is issued into a second fragment
before ``kb``'s is promoted, a wait leaving one group in flight, and ``kb``'s stage is released
after its promotion, which reads the scales from it. The token count is known only on the GPU,
so the k-blocks run in chunks of :data:`OVERLAP_CHUNK` unrolled k-blocks, nothing in flight
across the loop's edge (where a fragment is written by a WGMMA in flight across it, ptxas
serializes the WGMMAs), the last of a chunk promoted after a full wait, and the k-blocks past
the last whole chunk serially. ``promotion="serial"`` promotes each k-block after its WGMMAs
(the other warpgroup's may run meanwhile); both give the same bits.

The tile walk is the weight-gradient form of :class:`~.gemm_sm90.GroupedGemmSm90`: static,
expert-major (E x M-blocks x N-blocks tiles), each tile's k-tiles read from the split sizes on the
GPU (expert e's padded range starts at the sum of the earlier experts' sizes rounded up to 128),
so the launch needs no host sync. An expert with no tokens gets a zero tile. Its epilogues are
that class's: the output dtype ("plain", the (E * M, N) stack) or fp32 main_grad buffers
("acc_f32", "red_f32", "store_f32").
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .gemm_fp8_sm90 import SCALE_BLOCK, _fragment_dims
from .gemm_plan import MAIN_GRAD_EPILOGUES, PROMOTIONS
from .gemm_sm90 import _CONSUMER_REGS, _PRODUCER_REGS, _THREADS, _WG, GroupedGemmSm90

WGRAD_EPILOGUES = ("plain", "acc_f32", "red_f32", "store_f32")
WGRAD_TILE_NS = (64, 128)  # acc and two k-blocks' sums (BN / 2 fp32 each) stay in registers
OVERLAP_CHUNK = 4  # k-blocks per unrolled chunk of the overlapped promotion: one in four waits in full


class GroupedWgradFp8Sm90(GroupedGemmSm90):
    """One compiled variant: (output dtype, M, N, E, BN, epilogue, promotion)."""

    def __init__(self, out_dtype, m: int, n: int, num_experts: int, *, tile_mn: tuple[int, int] = (128, 128),
                 epilogue: str = "plain", promotion: str = "overlap"):
        bm, bn = tile_mn
        if promotion not in PROMOTIONS:
            raise ValueError(f"promotion must be one of {PROMOTIONS}, got {promotion!r}")
        if bn not in WGRAD_TILE_NS:
            raise ValueError(f"FP8 weight-gradient tiles take BN in {WGRAD_TILE_NS}, got {bn}")
        if epilogue not in WGRAD_EPILOGUES:
            raise ValueError(f"FP8 weight-gradient epilogues are {WGRAD_EPILOGUES}, got {epilogue!r}")
        # the weight-gradient plan (static walk, epilogue staging); its B-major flag describes the
        # bf16 form's operands and is not read here (FP8 operands are token-major)
        super().__init__(out_dtype, n, 0, num_experts, b_n_major=True, epilogue=epilogue, tile_mn=(bm, bn),
                         cluster_n=1, wgrad_m=m, schedule="cooperative")
        self.ab_dtype = cutlass.Float8E4M3FN
        self.bk = SCALE_BLOCK  # one k-tile per scale block
        self.promotion = promotion
        stage_bytes = (bm + bn) * self.bk + (bm + bn) * 4  # operands (1-byte) and their scales
        budget = cutlass.memory.get_smem_capacity_in_bytes("sm_90") - 2048
        budget -= max(8, self.n_out * self.epi_elems) * (out_dtype.width // 8)
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
        p_off: cute.Pointer,
        num_tokens: cutlass.Int32,
        padded_tokens: cutlass.Int32,
        sa_stride: cutlass.Int32,
        sb_stride: cutlass.Int32,
        num_ctas: cutlass.Int32,
        stream,
    ):
        """``p_a`` (M, Tp) and ``p_b`` (N, Tp) e4m3, ``p_sa`` (Tp / 128, ``sa_stride``) and ``p_sb``
        (Tp / 128, ``sb_stride``) fp32 scale-inverses; ``p_c`` the (E * M, N) output ("plain") or
        the fp32 main_grad base with ``p_off`` its experts' Int64 element offsets; ``num_tokens``
        T (the split sizes are clamped to it), ``padded_tokens`` Tp."""
        m, n, e = self.wgrad_m, self.n, self.num_experts
        bm, bn, bk = self.bm, self.bn, self.bk
        ab = self.ab_dtype
        k_blocks = padded_tokens // bk
        m_a = cute.make_tensor(p_a, cute.make_layout((m, padded_tokens), stride=(padded_tokens, 1)))
        m_b = cute.make_tensor(p_b, cute.make_layout((n, padded_tokens), stride=(padded_tokens, 1)))
        # scales as (rows, k-blocks): a tile's BM (BN) scales of one k-block are contiguous, one box
        m_sa = cute.make_tensor(p_sa, cute.make_layout((m, k_blocks), stride=(1, cute.assume(sa_stride, divby=4))))
        m_sb = cute.make_tensor(p_sb, cute.make_layout((n, k_blocks), stride=(1, cute.assume(sb_stride, divby=4))))
        if cutlass.const_expr(self.epilogue in MAIN_GRAD_EPILOGUES):
            m_c = cute.make_tensor(p_c, cute.make_layout((m, n), stride=(n, 1)))
        else:
            m_c = cute.make_tensor(p_c, cute.make_layout((e * m, n), stride=(n, 1)))
        m_split = cute.make_tensor(p_split, cute.make_layout((e,)))
        m_off = cute.make_tensor(p_off, cute.make_layout((e,)))

        k_major = LayoutEnum.ROW_MAJOR
        tiled_mma = self._tiled_mma()
        tile_mnk = (bm, bn, bk)
        sa_layout = sm90_utils.make_smem_layout_a(k_major, tile_mnk, ab, self.stages)
        sb_layout = sm90_utils.make_smem_layout_b(k_major, tile_mnk, ab, self.stages)
        ssa_layout = cute.make_layout((bm, 1, self.stages), stride=(1, bm, bm))
        ssb_layout = cute.make_layout((bn, 1, self.stages), stride=(1, bn, bn))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, g_a = cpasync.make_tiled_tma_atom(g2s, m_a, cute.slice_(sa_layout, (None, None, 0)), (bm, bk))
        tma_b, g_b = cpasync.make_tiled_tma_atom(g2s, m_b, cute.slice_(sb_layout, (None, None, 0)), (bn, bk))
        tma_sa, g_sa = cpasync.make_tiled_tma_atom(g2s, m_sa, cute.slice_(ssa_layout, (None, None, 0)), (bm, 1))
        tma_sb, g_sb = cpasync.make_tiled_tma_atom(g2s, m_sb, cute.slice_(ssb_layout, (None, None, 0)), (bn, 1))

        @cute.struct
        class Smem:
            bars: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sa: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sa_layout)], 1024]
            sb: cute.struct.Align[cute.struct.MemRange[ab, cute.cosize(sb_layout)], 1024]
            ssa: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(ssa_layout)], 128]
            ssb: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(ssb_layout)], 128]
            epi: cute.struct.Align[cute.struct.MemRange[self.dtype, max(8, self.n_out * self.epi_elems)], 128]

        self.smem_struct = Smem
        self.kernel(
            tma_a, g_a, tma_b, g_b, tma_sa, g_sa, tma_sb, g_sb, m_c, m_split, m_off, num_tokens,
            tiled_mma, sa_layout, sb_layout, ssa_layout, ssb_layout,
        ).launch(grid=[num_ctas, 1, 1], block=[_THREADS, 1, 1], cluster=[1, 1, 1], min_blocks_per_mp=1,
                 stream=stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        g_a: cute.Tensor,
        tma_b: cute.CopyAtom,
        g_b: cute.Tensor,
        tma_sa: cute.CopyAtom,
        g_sa: cute.Tensor,
        tma_sb: cute.CopyAtom,
        g_sb: cute.Tensor,
        m_c: cute.Tensor,
        m_split: cute.Tensor,
        m_off: cute.Tensor,
        num_tokens: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        sa_layout: cute.ComposedLayout,
        sb_layout: cute.ComposedLayout,
        ssa_layout: cute.Layout,
        ssb_layout: cute.Layout,
    ):
        ab = self.ab_dtype
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = cute.arch.make_warp_uniform(tidx // _WG)
        if warp == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_sa)
            cpasync.prefetch_descriptor(tma_sb)
        n_work = self.num_experts * self.wgrad_groups  # static: no split sizes needed to size the walk

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_struct)
        sa = st.sa.get_tensor(sa_layout.outer, swizzle=sa_layout.inner)
        sb = st.sb.get_tensor(sb_layout.outer, swizzle=sb_layout.inner)
        ssa = st.ssa.get_tensor(ssa_layout)
        ssb = st.ssb.get_tensor(ssb_layout)
        stage_bytes = (
            cute.size_in_bytes(ab, cute.slice_(sa_layout, (None, None, 0)))
            + cute.size_in_bytes(ab, cute.slice_(sb_layout, (None, None, 0)))
            + cute.size_in_bytes(cutlass.Float32, cute.slice_(ssa_layout, (None, None, 0)))
            + cute.size_in_bytes(cutlass.Float32, cute.slice_(ssb_layout, (None, None, 0)))
        )
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * _WG // 32),
            tx_count=stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if wg == 0:
            cute.arch.setmaxregister_decrease(_PRODUCER_REGS)
            if warp == 0:
                self._produce(cta, num_ctas, n_work, m_split, num_tokens, pipe,
                              (tma_a, g_a, sa), (tma_b, g_b, sb), (tma_sa, g_sa, ssa), (tma_sb, g_sb, ssb))
        else:
            cute.arch.setmaxregister_increase(_CONSUMER_REGS)
            self._consume(tidx - _WG, wg - 1, cta, num_ctas, n_work, m_split, num_tokens, pipe, sa, sb, ssa, ssb,
                          st, tiled_mma, m_c, m_off)

    @cute.jit
    def _tile(self, m_split, tile, num_tokens):
        """(expert, m-block, n-block, first k-block, k-tiles) of tile ``tile``: expert-major, the
        n-block fastest; the expert's k-blocks start past the earlier experts' sizes rounded up to
        128 (sizes clamped as :meth:`_rows_of` clamps them)."""
        expert = tile // self.wgrad_groups
        local = tile - expert * self.wgrad_groups
        m_blk = local // self.n_tiles
        n_blk = local - m_blk * self.n_tiles
        k0 = cutlass.Int32(0)
        cnt = cutlass.Int32(0)
        rows_before = cutlass.Int32(0)
        for ei in cutlass.range_constexpr(self.num_experts):
            here = self._rows_of(m_split, ei, rows_before, num_tokens)
            if ei == expert:
                cnt = here
            if ei < expert:
                k0 = k0 + (here + self.bk - 1) // self.bk
            rows_before = rows_before + here
        return expert, m_blk, n_blk, k0, (cnt + self.bk - 1) // self.bk

    @cute.jit
    def _produce(self, cta, num_ctas, n_work, m_split, num_tokens, pipe, a_ops, b_ops, sa_ops, sb_ops):
        bm, bn, bk = self.bm, self.bn, self.bk
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        tile = cta
        while tile < n_work:
            _, m_blk, n_blk, k0, k_tiles = self._tile(m_split, tile, num_tokens)
            t_sa, t_ga = self._tma_part(a_ops, (bm, bk), m_blk)
            t_sb, t_gb = self._tma_part(b_ops, (bn, bk), n_blk)
            t_ssa, t_gsa = self._tma_part(sa_ops, (bm, 1), m_blk)
            t_ssb, t_gsb = self._tma_part(sb_ops, (bn, 1), n_blk)
            for kt in cutlass.range(k_tiles, unroll=1):
                pipe.producer_acquire(prod)
                bar = pipe.producer_get_barrier(prod)
                kb = k0 + kt
                cute.copy(a_ops[0], t_ga[None, kb], t_sa[None, prod.index], tma_bar_ptr=bar)
                cute.copy(b_ops[0], t_gb[None, kb], t_sb[None, prod.index], tma_bar_ptr=bar)
                cute.copy(sa_ops[0], t_gsa[None, kb], t_ssa[None, prod.index], tma_bar_ptr=bar)
                cute.copy(sb_ops[0], t_gsb[None, kb], t_ssb[None, prod.index], tma_bar_ptr=bar)
                pipe.producer_commit(prod)
                prod.advance()
            tile = tile + num_ctas
        pipe.producer_tail(prod)

    @cute.jit
    def _tma_part(self, ops, box, blk):
        """(shared, global) TMA partitions of one operand's tile ``blk`` in every k-block."""
        atom, g, s = ops
        g_tile = cute.local_tile(g, box, (blk, None))
        return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                     cute.group_modes(g_tile, 0, 2))

    @cute.jit
    def _consume(self, ctid, cwg, cta, num_ctas, n_work, m_split, num_tokens, pipe, sa, sb, ssa, ssb, st, tiled_mma,
                 m_c, m_off):
        bm, bn = self.bm, self.bn
        etid = ctid
        wg_mma = tiled_mma.get_slice(cute.make_layout(2, stride=_WG)(cwg))
        frag_a = tiled_mma.make_fragment_A(wg_mma.partition_A(sa))
        frag_b = tiled_mma.make_fragment_B(wg_mma.partition_B(sb))
        thr_mma = tiled_mma.get_slice(etid)
        c_id = thr_mma.partition_C(cute.make_identity_tensor((bm, bn)))
        acc = cute.make_rmem_tensor(c_id.shape, cutlass.Float32)  # promoted fp32 sums
        tmp = cute.make_rmem_tensor(c_id.shape, cutlass.Float32)  # one k-block's WGMMA sums
        tmp2 = tmp  # the overlapped promotion's second k-block
        if cutlass.const_expr(self.promotion == "overlap"):
            tmp2 = cute.make_rmem_tensor(c_id.shape, cutlass.Float32)
        if cutlass.const_expr(cute.size(acc.shape[2]) != 1):
            raise ValueError("the promotion expects one WGMMA atom across BN")
        thr_cp = self._staging_copy().get_slice(etid)
        cp_id = thr_cp.partition_S(cute.make_identity_tensor((bm, self.epi_cols)))
        prob_r = cute.make_rmem_tensor(cute.make_layout(1), cutlass.Float32)  # the plain epilogue reads none

        # the k-block's first WGMMA overwrites its fragment, the rest add into it: two MMAs whose
        # flags are set here, outside every loop and branch
        mma_first = self._tiled_mma()
        mma_first.set(warpgroup.Field.ACCUMULATE, False)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)  # next to release
        tile = cta
        while tile < n_work:
            expert, m_blk, n_blk, _, k_tiles = self._tile(m_split, tile, num_tokens)
            m_row0 = m_blk * bm
            rows_here = self.wgrad_m - m_row0
            cols_here = self.n - n_blk * bn
            acc.fill(0.0)
            k_serial = k_tiles
            if cutlass.const_expr(self.promotion == "overlap"):
                chunk = OVERLAP_CHUNK
                k_serial = k_tiles % chunk
                bufs = (tmp, tmp2)
                for _ in cutlass.range(k_tiles // chunk, unroll=1):
                    # k-block j of the chunk sits in bufs[j % 2]: issue j + 1 into the other, wait
                    # for j alone, promote it, release its stage; the last after a full wait
                    pipe.consumer_wait(cons)
                    self._mma_kblock(mma_first, tiled_mma, tmp, frag_a, frag_b, cons.index)
                    cons.advance()
                    for j in cutlass.range_constexpr(chunk):
                        if cutlass.const_expr(j + 1 < chunk):
                            pipe.consumer_wait(cons)
                            self._mma_kblock(mma_first, tiled_mma, bufs[(j + 1) % 2], frag_a, frag_b, cons.index)
                            cons.advance()
                            warpgroup.wait_group(1)
                        else:
                            warpgroup.wait_group(0)
                        self._promote(acc, bufs[j % 2], ssa, ssb, c_id, rel.index)
                        pipe.consumer_release(rel)
                        rel.advance()
            for _ in cutlass.range(k_serial, unroll=1):
                pipe.consumer_wait(cons)
                self._mma_kblock(mma_first, tiled_mma, tmp, frag_a, frag_b, cons.index)
                cons.advance()
                warpgroup.wait_group(0)
                self._promote(acc, tmp, ssa, ssb, c_id, rel.index)
                pipe.consumer_release(rel)
                rel.advance()
            if cutlass.const_expr(self.epilogue in MAIN_GRAD_EPILOGUES):
                self._epilogue_main_grad(expert, m_row0, n_blk, rows_here, cols_here, acc, c_id, thr_mma, m_c, m_off)
            else:
                self._epilogue(etid, cwg, n_blk, expert * self.wgrad_m + m_row0, rows_here, cols_here, acc, prob_r,
                               [], thr_mma, c_id, thr_cp, cp_id, st, m_c, m_c, m_c, m_c)
            tile = tile + num_ctas

    @cute.jit
    def _mma_kblock(self, mma_first, tiled_mma, frag, frag_a, frag_b, stage):
        """One k-block's WGMMAs into ``frag`` as one group: the first overwrites it."""
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(frag_a, mode=[2])):
            cute.gemm(mma_first if kb == 0 else tiled_mma, frag, frag_a[None, None, kb, stage],
                      frag_b[None, None, kb, stage], frag)
        warpgroup.commit_group()

    @cute.jit
    def _promote(self, acc, part, ssa, ssb, c_id, stage):
        """acc += part * sa[row] * sb[column], the scales read from the k-block's stage (not yet
        released): this thread's two rows per 64-row slab, a column pair per 8-column group."""
        n_pair, n_half, n_grp, n_m = _fragment_dims(acc)
        for mm in cutlass.range_constexpr(n_m):
            s_rows = [ssa[c_id[(0, h, 0), mm, 0][0], 0, stage] for h in range(n_half)]
            for g in cutlass.range_constexpr(n_grp):
                for pr in cutlass.range_constexpr(n_pair):
                    s_col = ssb[c_id[(pr, 0, g), 0, 0][1], 0, stage]
                    for h in cutlass.range_constexpr(n_half):
                        crd = ((pr, h, g), mm, 0)
                        acc[crd] = acc[crd] + part[crd] * (s_rows[h] * s_col)

    def _tiled_mma(self):
        """The kernel's MMA: 64 x BN e4m3 WGMMAs, both operands token-major, fp32 sums, two warpgroups."""
        k_major = LayoutEnum.ROW_MAJOR
        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, k_major.sm90_mma_major_mode(), k_major.sm90_mma_major_mode(),
            cutlass.Float32, (2, 1, 1), tiler_mn=(64, self.bn),
        )

__all__ = ["GroupedWgradFp8Sm90", "OVERLAP_CHUNK", "WGRAD_EPILOGUES", "WGRAD_TILE_NS"]
