"""CPU-only: the grouped FP8 GEMM compiles for sm_90a, and its entry point refuses bad input.

``CUTE_DSL_ARCH=sm_90a`` lets the CuTe DSL compile Hopper kernels without a GPU (set here, at
collection, before anything imports the DSL). Each variant's PTX is checked for what the design
relies on: FP8 WGMMAs (four m64nBNk32 per 128-K block), the per-k-block wait before the
promotion, one fused multiply-add per accumulator element per k-block, TMA loads of A, B and the A
scales (A multicast in cluster pairs) and 16-byte stores; where ``cuobjdump`` is found, the cubin
is checked for register spills.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ.setdefault("CUTE_DSL_DUMP_DIR", tempfile.mkdtemp(prefix="teo-ptx-"))

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from te_offload_ops import kernels  # noqa: E402

_HAVE_DSL = importlib.util.find_spec("cutlass") is not None
_WHY = "CuTe DSL (nvidia-cutlass-dsl) is not installed"
if _HAVE_DSL:
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the install
        _HAVE_DSL, _WHY = False, f"CuTe DSL (nvidia-cutlass-dsl) failed to import: {exc}"
needs_dsl = pytest.mark.skipif(not _HAVE_DSL, reason=_WHY)


def _cuobjdump() -> str | None:
    """cuobjdump from the PATH or from Triton's wheel (the venv has one), or None."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        cand = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        if cand.exists():
            return str(cand)
    return None


def _resource_usage(compiled, max_stack: int = 0) -> str | None:
    """The cubin's "REG:.. STACK:.. SHARED:.. LOCAL:.." line, asserting no local memory and at most
    ``max_stack`` bytes of stack (register spills); None where no cuobjdump is at hand."""
    tool = _cuobjdump()
    if not tool:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.artifacts.CUBIN)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    assert m, out
    assert int(m.group(2)) <= max_stack and m.group(3) == "0", f"register spills: {m.group(0)}"
    return m.group(0)


# (N, K, E, tile or None, cluster_n or None, output dtype): the MLP's GEMMs at H=2688, F=1792
# (aligned) and F=1856 (a partial 128-block in N for fc1 and in K for fc2), the benchmark's
# shapes, and the tile extremes
VARIANTS = [
    (1792, 2688, 8, None, None, torch.bfloat16),  # fc1, F=1792
    (2688, 1792, 8, None, None, torch.bfloat16),  # fc2, F=1792
    (1856, 2688, 8, None, None, torch.bfloat16),  # fc1, F=1856: last n-block half full
    (2688, 1856, 8, None, None, torch.bfloat16),  # fc2, F=1856: last k-block half full
    (2048, 4096, 8, None, 1, torch.bfloat16),  # no cluster
    (4096, 2048, 4, (128, 192), None, torch.bfloat16),  # BN=192: two scale blocks per tile
    (64, 128, 3, None, None, torch.float16),  # BN=64, one k-block, fp16 output
]


def _check_promotion(ptx: str, bn: int, promotion: str, k_tiles: int) -> None:
    """One 128-K block = four k32 WGMMAs into a k-block's partial sums. Serial: one issue site in
    the k-block loop and one full wait before each promotion. Overlap: the k-blocks unrolled (with
    a loop, ptxas serializes the WGMMAs), each promotion after a wait that leaves the next
    k-block's group in flight, the last one's after a full wait."""
    wgmmas = len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k32\.f32\.e4m3\.e4m3", ptx))
    waits = {n: len(re.findall(rf"wgmma\.wait_group\.sync\.aligned\s+{n};", ptx)) for n in (0, 1)}
    if promotion == "serial":
        assert (wgmmas, waits[0], waits[1]) == (4, 1, 0), (wgmmas, waits)
    else:
        assert (wgmmas, waits[0], waits[1]) == (4 * k_tiles, 1, k_tiles - 1), (wgmmas, waits)


def _vid(v):
    tile = f"-BN{v[3][1]}" if v[3] else ""
    return f"N{v[0]}-K{v[1]}-E{v[2]}{tile}-c{v[4] or 'auto'}-{str(v[5])[6:]}"


@needs_dsl
@pytest.mark.parametrize("n,k,e,tile,cluster_n,out_dtype", VARIANTS, ids=map(_vid, VARIANTS))
def test_fp8_variant_compiles_for_sm90a(n, k, e, tile, cluster_n, out_dtype, monkeypatch):
    from te_offload_ops.kernels import api_fp8

    monkeypatch.delenv(api_fp8.PROMOTION_ENV, raising=False)  # the default promotion is asserted below
    kern, compiled, secs = kernels.compile_variant_fp8(
        n, k, e, out_dtype=out_dtype, tile=tile, cluster_n=cluster_n, options="--keep-ptx --keep-cubin",
    )
    ptx = str(compiled.artifacts.PTX)
    bn = kern.bn
    assert bn == (tile[1] if tile else (64 if n <= 64 else 128))
    assert kern.bk == 128 and kern.k_tiles == -(-k // 128) and kern.stages >= 4
    assert ".target sm_90a" in ptx
    assert kern.promotion == ("serial" if bn > 128 or k > api_fp8.OVERLAP_MAX_K else "overlap")  # the default
    _check_promotion(ptx, bn, kern.promotion, kern.k_tiles)
    # promotion: one fma per accumulator element a thread holds (64 x BN per 128 threads)
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) >= bn // 2
    assert "cp.async.bulk.tensor.2d" in ptx  # A and its scales: (T, K) and (T, K/128) views
    assert "cp.async.bulk.tensor.3d" in ptx  # B: (N, K, E), indexed by expert
    assert ("multicast::cluster" in ptx) == (kern.cluster_n == 2)
    assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx
    assert "st.global.v4.b32" in ptx  # the staged epilogue's 16-byte stores
    # A's scales: tokens are that tensor's innermost dimension, and TMA faults on an innermost start
    # that is not 16-byte aligned: the box's first token is rounded down to a multiple of 4
    firsts = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.\S* \[[^\]]*\], \[%rd\d+, \{(%r\d+)[,}]", ptx)
    assert any(re.search(rf"and\.b32\s+{re.escape(r)}, %r\d+, -4;", ptx) for r in firsts), firsts
    if kern.straddles:  # BN=192: a scale chosen per column group
        assert "selp.f32" in ptx
    found = _resource_usage(compiled)
    usage = f", {found}" if found else ""
    print(f"compile fp8 N={n} K={k} E={e} BN={bn} cluster={kern.cluster_n} stages={kern.stages}: "
          f"{secs:.2f} s{usage}")


@needs_dsl
def test_fp8_kernel_refuses_unsupported_tiles():
    from te_offload_ops.kernels.gemm_fp8_sm90 import GroupedGemmFp8Sm90

    with pytest.raises(ValueError, match="BN in"):
        GroupedGemmFp8Sm90(cutlass.BFloat16, 512, 256, 2, tile_mn=(128, 256))
    with pytest.raises(ValueError, match="multiple of 16"):
        GroupedGemmFp8Sm90(cutlass.BFloat16, 512, 200, 2)
    with pytest.raises(ValueError, match="k-blocks"):
        GroupedGemmFp8Sm90(cutlass.BFloat16, 512, 1024, 2, sb_cols=4)


# (N, K, E, output dtype, pow2): fc1's shapes with the quantizing SReLU epilogue
SRELU_Q_VARIANTS = [
    (1856, 2688, 8, torch.bfloat16, False),  # the last 128-column block half full
    (1792, 2688, 8, torch.bfloat16, True),  # power-of-two scales
    (64, 128, 3, torch.float16, False),  # BN=64 (N <= 64), fp16 rounding
]


@needs_dsl
@pytest.mark.parametrize("n,k,e,out_dtype,pow2", SRELU_Q_VARIANTS,
                         ids=[f"N{v[0]}-K{v[1]}-{str(v[3])[6:]}{'-pow2' if v[4] else ''}" for v in SRELU_Q_VARIANTS])
def test_srelu_quantize_epilogue_compiles_to_te_quantizers_arithmetic(n, k, e, out_dtype, pow2):
    """z and act leave as FP8 bytes and scales computed as TE's quantizer computes them: values
    rounded to the output dtype first, scales by round-to-nearest division (no approximate
    division), power-of-two rounding by clearing the mantissa where asked, the row's amax over its
    quad by two butterfly shuffles; no C stored, no register spills, as many stages as C's form."""
    kern, compiled, secs = kernels.compile_variant_fp8(n, k, e, out_dtype=out_dtype, epilogue="srelu_q", pow2=pow2,
                                                       options="--keep-ptx --keep-cubin")
    plain, _, _ = kernels.compile_variant_fp8(n, k, e, out_dtype=out_dtype)
    ptx = str(compiled.artifacts.PTX)
    bn = kern.bn
    per_thread = 64 * bn // 128  # accumulator values a consumer thread holds
    cvt_round = "cvt.rn.bf16.f32" if out_dtype == torch.bfloat16 else "cvt.rn.f16.f32"
    assert len(re.findall(re.escape(cvt_round), ptx)) == 2 * per_thread  # z, and act from it
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) >= per_thread  # both outputs, pairs or not
    assert len(re.findall(r"\bdiv\.rn\.f32\b", ptx)) == 4  # 448 / amax: two rows, two outputs
    assert len(re.findall(r"\brcp\.rn\.f32\b", ptx)) == 4  # the scale-inverses
    assert "div.approx" not in ptx and "div.full" not in ptx and "max.NaN" not in ptx
    assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == 8  # 2 rows x 2 outputs x 2 butterflies
    assert len(re.findall(r"and\.b32\s+%r\d+, %r\d+, -8388608;", ptx)) == (4 if pow2 else 0)
    # 16-byte FP8 row vectors: 128 rows x BN bytes per output over 256 threads
    assert len(re.findall(r"st\.global\.v4", ptx)) == 2 * (128 * bn // 16) // 256
    assert kern.stages == plain.stages
    _resource_usage(compiled)


@needs_dsl
@pytest.mark.parametrize("n,k,e,out_dtype,pow2", SRELU_Q_VARIANTS,
                         ids=[f"N{v[0]}-K{v[1]}-{str(v[3])[6:]}{'-pow2' if v[4] else ''}" for v in SRELU_Q_VARIANTS])
def test_dsrelu_quantize_epilogue_compiles_to_the_row_pass_arithmetic(n, k, e, out_dtype, pow2):
    """fc2's dgrad with the SReLU backward: z read as FP8 (converted exactly), dact, act and dz
    rounded to the output dtype, dz's scales by round-to-nearest division, four butterflies per row
    (dz's amax and the dprob partial), dz and act staged out in the output dtype and dz's FP8 rows;
    no register spills."""
    kern, compiled, _ = kernels.compile_variant_fp8(n, k, e, out_dtype=out_dtype, epilogue="dsrelu_q", pow2=pow2,
                                                    options="--keep-ptx --keep-cubin")
    ptx = str(compiled.artifacts.PTX)
    bn = kern.bn
    per_thread = 64 * bn // 128
    half = "bf16" if out_dtype == torch.bfloat16 else "f16"
    # round to nearest, one value at a time or two packed (the compiler's choice)
    rounded = len(re.findall(rf"cvt\.rn\.{half}\.f32", ptx)) + 2 * len(re.findall(rf"cvt\.rn\.{half}x2\.f32", ptx))
    assert rounded >= 3 * per_thread  # dact, act, dz
    assert len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)) >= per_thread // 2
    assert len(re.findall(r"\bdiv\.rn\.f32\b", ptx)) == 2 and len(re.findall(r"\brcp\.rn\.f32\b", ptx)) == 2
    assert "div.approx" not in ptx and "div.full" not in ptx and "max.NaN" not in ptx
    assert len(re.findall(r"shfl\.sync\.bfly", ptx)) == 8
    assert len(re.findall(r"and\.b32\s+%r\d+, %r\d+, -8388608;", ptx)) == (2 if pow2 else 0)
    # dz and act: 128 x BN x 2 bytes each, dz's FP8 rows 128 x BN, in 16-byte vectors over 256 threads
    assert len(re.findall(r"st\.global\.v4", ptx)) == (2 * 128 * bn * 2 + 128 * bn) // 16 // 256
    # dz and act staged behind each warpgroup's own barrier (128 threads, its id in a register); the
    # tile's 256 threads meet only at the tile-wide id
    from te_offload_ops.kernels.gemm_fp8_sm90 import _TILE_EPI_BARRIER

    assert re.search(r"bar\.sync\s+%r\d+,\s*128;", ptx)
    assert set(re.findall(r"bar\.sync\s+(\S+),\s*256;", ptx)) == {str(_TILE_EPI_BARRIER)}
    _resource_usage(compiled)


@needs_dsl
def test_srelu_quantize_epilogue_refuses_tiles_that_split_a_scale_block():
    from te_offload_ops.kernels.gemm_fp8_sm90 import GroupedGemmFp8Sm90

    with pytest.raises(ValueError, match="inside one tile"):
        GroupedGemmFp8Sm90(cutlass.BFloat16, 512, 256, 2, tile_mn=(128, 192), epilogue="srelu_q")
    with pytest.raises(ValueError, match="inside one tile"):
        GroupedGemmFp8Sm90(cutlass.BFloat16, 512, 256, 2, tile_mn=(128, 64), epilogue="srelu_q")
    with pytest.raises(ValueError, match="multiple of 16"):
        GroupedGemmFp8Sm90(cutlass.BFloat16, 520, 256, 2, epilogue="srelu_q")
    with pytest.raises(ValueError, match="epilogues are"):
        GroupedGemmFp8Sm90(cutlass.BFloat16, 512, 256, 2, epilogue="srelu")
    GroupedGemmFp8Sm90(cutlass.BFloat16, 64, 256, 2, tile_mn=(128, 64), epilogue="srelu_q")


def test_srelu_quantize_entry_point_refuses_bad_probs_and_widths():
    a, sa, b, sb, splits = _ok_args()
    with pytest.raises(ValueError, match="one value per token"):
        kernels.grouped_gemm_fp8_srelu_quantize(a, sa, b, sb, splits, torch.ones(T + 1))
    with pytest.raises(ValueError, match="one value per token"):
        kernels.grouped_gemm_fp8_srelu_quantize(a, sa, b, sb, splits, torch.ones(T, dtype=torch.int32))
    b8 = torch.zeros(E, 392, K, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.grouped_gemm_fp8_srelu_quantize(a, sa, b8, torch.ones(E, 4, 4), splits, torch.ones(T))
    with pytest.raises(ValueError, match="128-column tiles"):
        kernels.grouped_gemm_fp8_srelu_quantize(a, sa, b, sb, splits, torch.ones(T), tile=(128, 192))
    with pytest.raises(ValueError, match="CUDA device"):  # well-formed: only the device is wrong
        kernels.grouped_gemm_fp8_srelu_quantize(a, sa, b, sb, splits, torch.ones(T))


def test_dsrelu_quantize_entry_point_refuses_bad_z_and_probs():
    a, sa, b, sb, splits = _ok_args()
    z = torch.zeros(T, N, dtype=torch.uint8)
    zs = torch.ones(N // 128, (T + 3) // 4 * 4)
    call = kernels.grouped_gemm_fp8_dsrelu_quantize
    with pytest.raises(ValueError, match="one value per token"):
        call(a, sa, b, sb, splits, z, zs, torch.ones(T - 1))
    with pytest.raises(ValueError, match="z_data must be FP8"):
        call(a, sa, b, sb, splits, z[:, :128], zs, torch.ones(T))
    with pytest.raises(ValueError, match="z_data must be FP8"):
        call(a, sa, b, sb, splits, z.float(), zs, torch.ones(T))
    with pytest.raises(ValueError, match="z_scale_inv must be fp32"):
        call(a, sa, b, sb, splits, z, zs[:, :T - 4], torch.ones(T))
    with pytest.raises(ValueError, match="z_scale_inv must be fp32"):
        call(a, sa, b, sb, splits, z, zs.t().contiguous().t(), torch.ones(T))
    with pytest.raises(ValueError, match="CUDA device"):  # well-formed: only the device is wrong
        call(a, sa, b, sb, splits, z, zs, torch.ones(T))


# ------------------------------------------------------------------ entry point checks (no GPU)
T, K, N, E = 200, 256, 384, 3


def _ok_args():
    """Well-formed CPU operands in TE's layouts: everything but the device is right."""
    a = torch.zeros(T, K, dtype=torch.uint8)
    sa = torch.ones(K // 128, (T + 3) // 4 * 4)
    b = torch.zeros(E, N, K, dtype=torch.float8_e4m3fn)
    sb = torch.ones(E, N // 128, 4)
    return [a, sa, b, sb, torch.tensor([100, 0, 100])]


def _call(args, **kw):
    return kernels.grouped_gemm_fp8_blockwise(*args, **kw)


def _with(i, value):
    args = _ok_args()
    args[i] = value
    return args


BAD = [
    ("a_data not a tensor", _with(0, [[0]]), {}, TypeError, "a_data must be a torch tensor"),
    ("split sizes a list", _with(4, [100, 0, 100]), {}, TypeError, "split_sizes must be an integer torch tensor"),
    ("split sizes float", _with(4, torch.tensor([100.0, 0, 100])), {}, TypeError, "integer torch tensor"),
    ("a_data bf16", _with(0, torch.zeros(T, K, dtype=torch.bfloat16)), {}, TypeError, "a_data must hold FP8 e4m3"),
    ("b_data e5m2", _with(2, torch.zeros(E, N, K, dtype=torch.float8_e5m2)), {}, TypeError,
     "b_data must hold FP8 e4m3"),
    ("a scales bf16", _with(1, torch.ones(2, 200, dtype=torch.bfloat16)), {}, TypeError, "a_scale_inv must be fp32"),
    ("fp32 output", _ok_args(), {"out_dtype": torch.float32}, TypeError, "out_dtype must be"),
    ("a_data 3-D", _with(0, torch.zeros(1, T, K, dtype=torch.uint8)), {}, ValueError, r"a_data must be \(T, K\)"),
    ("K mismatch", _with(2, torch.zeros(E, N, 128, dtype=torch.uint8)), {}, ValueError, "K mismatch"),
    ("wrong expert count", _with(4, torch.tensor([100, 100])), {}, ValueError, "one entry per expert"),
    ("K not a multiple of 16", None, {}, ValueError, "K must be a positive multiple of 16"),
    ("N not a multiple of 8", None, {}, ValueError, "N must be a positive multiple of 8"),
    ("a scales not transposed", _with(1, torch.ones(T, K // 128)), {}, ValueError,
     r"a_scale_inv must be \(2, >= 200\)"),
    ("a scales too few tokens", _with(1, torch.ones(K // 128, 196)), {}, ValueError, r"a_scale_inv must be"),
    ("a scales odd row stride", _with(1, torch.ones(K // 128, 201)), {}, ValueError, "multiple of 4"),
    ("a scales column-major", _with(1, torch.ones(T, K // 128).t()), {}, ValueError, "unit stride along tokens"),
    ("b scales one expert short", _with(3, torch.ones(E - 1, N // 128, 4)), {}, ValueError,
     r"b_scale_inv must be \(3, 3, >= 2\)"),
    ("b scales missing k-blocks", _with(3, torch.ones(E, N // 128, 1)), {}, ValueError, "b_scale_inv must be"),
    ("bad tile", _ok_args(), {"tile": (128, 256)}, ValueError, "BN in"),
]


def _bad_case(case):
    name, args, kw, exc, match = case
    if name == "K not a multiple of 16":
        args = _ok_args()
        args[0] = torch.zeros(T, 200, dtype=torch.uint8)
        args[2] = torch.zeros(E, N, 200, dtype=torch.uint8)
    if name == "N not a multiple of 8":
        args = _ok_args()
        args[2] = torch.zeros(E, 380, K, dtype=torch.uint8)
    return args, kw, exc, match


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_fp8_entry_point_refuses_bad_input_clearly(case):
    args, kw, exc, match = _bad_case(case)
    with pytest.raises(exc, match=match):
        _call(args, **kw)


def test_fp8_entry_point_takes_te_layouts_and_wants_a_gpu():
    """Well-formed operands pass every check but the device one (these are CPU tensors); the 2-D
    stacked form of B's scales, (E * ceil(N/128), Kp), is accepted as well."""
    with pytest.raises(ValueError, match="on one CUDA device"):
        _call(_ok_args())
    args = _ok_args()
    args[3] = torch.ones(E * (N // 128), 4)
    with pytest.raises(ValueError, match="on one CUDA device"):
        _call(args)
    args = _ok_args()
    args[1] = torch.ones(K // 128, 256)[:, :T]  # a view of a wider buffer: the row stride is 256
    with pytest.raises(ValueError, match="on one CUDA device"):
        _call(args)
    with pytest.raises(ValueError, match=r"promotion must be one of \('serial', 'overlap'\), got 'eager'"):
        kernels.grouped_gemm_fp8_blockwise(*_ok_args(), promotion="eager")


def _ptxas_advisories(ptx: str) -> list[str] | None:
    """ptxas's performance advisories (C75xx) for ``ptx``, from a ptxas on the PATH or in
    $CUDA_HOME; None where there is none that assembles it. An older ptxas gets the PTX with its
    ``.version`` lowered to the newest it reads (the kernels use nothing newer)."""
    for tool in filter(None, [shutil.which("ptxas"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                                   "bin", "ptxas")]):
        if not os.path.exists(tool):
            continue
        text = ptx
        for _ in range(2):
            with tempfile.TemporaryDirectory() as tmp:
                src = Path(tmp) / "k.ptx"
                src.write_text(text)
                run = subprocess.run([tool, "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                                     capture_output=True, text=True)
            said = run.stdout + run.stderr
            if run.returncode == 0:
                return re.findall(r"\((C75\d\d)\)", said)
            newest = re.search(r"Unsupported \.version \S+; current version is '(\d+\.\d+)'", said)
            if not newest:
                break
            text = re.sub(r"^\.version \S+", f".version {newest.group(1)}", ptx, count=1, flags=re.M)
    return None


@needs_dsl
@pytest.mark.parametrize("epilogue", ["plain", "srelu_q"])
def test_overlapped_promotion_unrolls_the_k_blocks_without_spills(epilogue):
    """TEO_FP8_PROMOTION=overlap's kernels: every k-block's WGMMAs issued before the previous one's
    promotion, with one group left in flight; no register spills; where a ptxas that reads the
    DSL's PTX is at hand, no advisory that it serialized the WGMMAs or injected waits."""
    _check_overlapped_compile(1856, 2688, epilogue, promotion="overlap")


def _check_overlapped_compile(n: int, k: int, epilogue: str, promotion=None) -> None:
    """Compile (N, K) with ``promotion`` (None: the default plan's), which must overlap: the unrolled
    k-blocks' PTX, no spills, and no serialization advisory where a ptxas is at hand."""
    kern, compiled, _ = kernels.compile_variant_fp8(n, k, 8, epilogue=epilogue, promotion=promotion,
                                                    options="--keep-ptx --keep-cubin")
    assert kern.promotion == "overlap" and kern.k_tiles == -(-k // 128)
    ptx = str(compiled.artifacts.PTX)
    _check_promotion(ptx, kern.bn, "overlap", kern.k_tiles)
    _resource_usage(compiled)
    advisories = _ptxas_advisories(ptx)
    if advisories is not None:
        assert not advisories, advisories


@needs_dsl
def test_overlap_at_overlap_max_k_compiles_without_spills(monkeypatch):
    """At ``OVERLAP_MAX_K`` (fc1 of an H=7168 expert) the default plan overlaps the promotion, and its
    56 unrolled k-blocks compile without spills or a serialization advisory from ptxas."""
    from te_offload_ops.kernels import api_fp8

    monkeypatch.delenv(api_fp8.PROMOTION_ENV, raising=False)
    _check_overlapped_compile(2048, api_fp8.OVERLAP_MAX_K, "srelu_q")


def test_fp8_promotion_comes_from_the_environment_and_keys_the_cache(monkeypatch):
    from te_offload_ops.kernels import api_fp8

    monkeypatch.delenv(api_fp8.PROMOTION_ENV, raising=False)
    assert api_fp8.fp8_promotion() == "overlap"
    assert api_fp8._promotion_for((128, 128), "srelu_q", 2688) == "overlap"
    assert api_fp8._promotion_for((128, 64), "plain", api_fp8.OVERLAP_MAX_K) == "overlap"
    # where it does not fit or is not timed: wide tiles, the dsrelu_q epilogue, long K
    assert api_fp8._promotion_for((128, 192), "plain", 2688) == "serial"
    assert api_fp8._promotion_for((128, 128), "dsrelu_q", 2688) == "serial"
    assert api_fp8._promotion_for((128, 128), "plain", api_fp8.OVERLAP_MAX_K + 128) == "serial"
    monkeypatch.setenv(api_fp8.PROMOTION_ENV, "serial")
    assert api_fp8.fp8_promotion() == "serial" and api_fp8._promotion_for((128, 128), "srelu_q", 2688) == "serial"
    monkeypatch.setenv(api_fp8.PROMOTION_ENV, "sometimes")
    with pytest.raises(ValueError, match="TEO_FP8_PROMOTION must be one of"):
        api_fp8.fp8_promotion()
    # the disk cache's key: the overlapped plan differs from the serial one
    args = (torch.bfloat16, 1856, 2688, 8, (128, 128), 2, 24)
    serial, overlap = (api_fp8.launch_plan_fp8(*args, promotion=p) for p in ("serial", "overlap"))
    from te_offload_ops.kernels import registry

    assert not hasattr(serial, "fp8_promotion") and registry.kernel_params(serial) != registry.kernel_params(overlap)

@needs_dsl
def test_fp8_kernel_refuses_unknown_promotions_and_overlap_on_wide_tiles():
    with pytest.raises(ValueError, match="FP8 promotions are"):
        kernels.compile_variant_fp8(256, 256, 2, promotion="sometimes")
    with pytest.raises(ValueError, match="not the dsrelu_q epilogue, got BN=128, dsrelu_q"):
        kernels.compile_variant_fp8(1856, 2688, 8, epilogue="dsrelu_q", promotion="overlap")
    with pytest.raises(ValueError, match="BN <= 128 and not the dsrelu_q epilogue, got BN=192"):
        kernels.compile_variant_fp8(4096, 2048, 4, tile=(128, 192), promotion="overlap")


def test_an_overlap_that_does_not_fit_is_refused_before_the_kernel_cache(monkeypatch):
    """The entry points' kernel lookup refuses it up front: no cache entry claimed, nothing compiled."""
    from te_offload_ops.kernels import api_fp8, registry

    def untouched(*args, **kwargs):
        raise AssertionError("the kernel cache was reached")

    monkeypatch.setattr(registry, "cached_kernel", untouched)
    with pytest.raises(ValueError, match="not the dsrelu_q epilogue, got BN=128, dsrelu_q"):
        api_fp8.get_kernel_fp8(torch.bfloat16, 1856, 2688, 8, 24, epilogue="dsrelu_q", promotion="overlap")
    with pytest.raises(ValueError, match="got BN=192"):
        api_fp8.get_kernel_fp8(torch.bfloat16, 4096, 2048, 4, 16, tile=(128, 192), promotion="overlap")


def test_fp8_tile_choice():
    assert kernels.pick_tile_fp8(1856) == (128, 128)
    assert kernels.pick_tile_fp8(64) == (128, 64)


@needs_dsl
def test_fp8_fault_isolation_variant_drops_only_the_scale_copy(monkeypatch):
    """The A-scale box is BM + 4 rows (it starts at the tile row rounded down to 16 bytes); LOAD_A_SCALES=False
    (diagnose_fp8_gemm.py's case) compiles without that TMA and its bytes."""
    from te_offload_ops.kernels.gemm_fp8_sm90 import GroupedGemmFp8Sm90

    def ptx(load):
        monkeypatch.setattr(GroupedGemmFp8Sm90, "LOAD_A_SCALES", load)
        _, compiled, _ = kernels.compile_variant_fp8(256, 256, 2, cluster_n=1, options="--keep-ptx")
        return str(compiled.artifacts.PTX)

    full, bare = ptx(True), ptx(False)
    copies = re.compile(r"cp\.async\.bulk\.tensor\.\dd")
    assert len(copies.findall(full)) == 3 and len(copies.findall(bare)) == 2
    tx = re.compile(r"mov\.b32\s+%r\d+,\s*(\d+);\s*\n\s*mbarrier\.arrive\.expect_tx")
    assert [int(x) for x in tx.findall(full)] == [2 * 128 * 128 + (128 + 4) * 4]  # A, B (BN=128), A scales from an aligned row
    assert [int(x) for x in tx.findall(bare)] == [2 * 128 * 128]


@needs_dsl
def test_the_warpgroups_staging_barriers_are_not_the_tile_wide_one():
    """A named barrier id takes one thread count at a time: in the dsrelu_q epilogue one warpgroup
    reaches the tile-wide barrier (256 threads) while the other may still stage behind its own
    (128), so the tile-wide id must be neither warpgroup's."""
    from te_offload_ops.kernels.gemm_fp8_sm90 import _TILE_EPI_BARRIER, _WG_EPI_BARRIER

    own = {_WG_EPI_BARRIER + wg for wg in (0, 1)}
    assert _TILE_EPI_BARRIER not in own
    assert 0 not in own | {_TILE_EPI_BARRIER} and max(own | {_TILE_EPI_BARRIER}) < 16  # 0: __syncthreads


@needs_dsl
def test_the_plain_epilogue_stores_per_warpgroup_and_the_experiments_variants_leave_the_kernel_as_it_was(
        monkeypatch):
    """The FP8 GEMM's plain epilogue stores 16-byte row vectors behind barriers of one warpgroup's
    128 threads (neither math warpgroup waits for the other at a tile's end); the storing variants of
    benchmarks/experiments/ablate_fp8_epilogue.py compile for sm_90a at an MLP shape without spills,
    each storing as it says: ``one barrier`` the same vectors behind the tile's 256-thread barriers,
    ``direct`` 4-byte column pairs with no barrier."""
    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    monkeypatch.syspath_prepend(str(bench / "experiments"))
    import ablate_fp8_epilogue as afe
    from te_offload_ops.kernels.gemm_fp8_sm90 import GroupedGemmFp8Sm90

    shipped = GroupedGemmFp8Sm90._epilogue_plain
    made = afe._kernels(2688, 1856, 8, ["shipped", "one barrier", "direct"], options="--keep-ptx --keep-cubin")
    assert GroupedGemmFp8Sm90._epilogue_plain is shipped
    ptx = {name: str(compiled.artifacts.PTX) for name, (_, compiled, _) in made.items()}
    for _, compiled, _ in made.values():
        _resource_usage(compiled)
    barriers = {name: re.findall(r"bar\.sync\s+\S+,\s*(\d+);", text) for name, text in ptx.items()}
    assert re.search(r"st\.global\.v4\.b32", ptx["shipped"]) and set(barriers["shipped"]) == {"128"}
    assert re.search(r"st\.global\.v4\.b32", ptx["one barrier"]) and set(barriers["one barrier"]) == {"256"}
    assert re.search(r"st\.global\.v2\.b16", ptx["direct"]) and barriers["direct"] == []


# (M, N, E, epilogue, tile or None, output dtype): the FP8 weight gradient's forms at the MLP's
# shapes (fc1's dW: M=F, N=H; fc2's: M=H, N=F; F=1856 leaves a partial 128-block), main_grad
# accumulation, and the small tile
WGRAD_VARIANTS = [
    (1856, 2688, 8, "plain", None, torch.bfloat16),
    (2688, 1856, 8, "plain", None, torch.bfloat16),
    (1856, 2688, 8, "acc_f32", None, torch.bfloat16),
    (2688, 1856, 8, "store_f32", None, torch.bfloat16),
    (2688, 1856, 8, "red_f32", None, torch.bfloat16),
    (64, 64, 3, "plain", (128, 64), torch.float16),
]


@needs_dsl
@pytest.mark.parametrize("m,n,e,epilogue,tile,out_dtype", WGRAD_VARIANTS,
                         ids=[f"M{v[0]}-N{v[1]}-E{v[2]}-{v[3]}" for v in WGRAD_VARIANTS])
def test_fp8_wgrad_compiles_to_token_major_e4m3_wgmma_with_per_column_promotion(m, n, e, epilogue, tile, out_dtype,
                                                                                 monkeypatch):
    """Both operands token-major e4m3 WGMMA (k32 steps), four 2-D TMA loads per stage (A, B and
    their scale vectors), the promotion one multiply (row scale x column scale) and one fma per
    accumulator element a thread holds per k-block, overlapped with the next k-block's WGMMAs by
    default (chunks of unrolled k-blocks, then the serial tail), and no register spills or
    serialization advisory from ptxas."""
    from te_offload_ops.kernels import api_fp8
    from te_offload_ops.kernels.api_fp8_wgrad import compile_variant_fp8_wgrad
    from te_offload_ops.kernels.gemm_fp8_wgrad_sm90 import OVERLAP_CHUNK

    monkeypatch.delenv(api_fp8.PROMOTION_ENV, raising=False)  # the default promotion is asserted below
    kern, compiled, secs = compile_variant_fp8_wgrad(m, n, e, out_dtype=out_dtype, tile=tile, epilogue=epilogue,
                                                     options="--keep-ptx --keep-cubin")
    assert kern.promotion == "overlap"
    ptx = str(compiled.artifacts.PTX)
    bn = kern.bn
    per_thread = 64 * bn // 128
    kblocks = OVERLAP_CHUNK + 1  # issue sites: a chunk's k-blocks and the tail's
    wgmmas = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{bn}k32\.f32\.e4m3\.e4m3", ptx)
    assert len(wgmmas) == 4 * kblocks
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", ptx)) == 4
    assert "cp.async.bulk.tensor.3d" not in ptx  # no expert dimension: experts are token ranges
    assert len(re.findall(r"\bfma\.rn\.f32\b", ptx)) >= per_thread * kblocks
    assert len(re.findall(r"\bmul(?:\.rn)?\.f32\b", ptx)) >= per_thread * kblocks
    # in a chunk each promotion but the last waits with the next k-block in flight
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == OVERLAP_CHUNK - 1
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)) == 2
    if epilogue == "acc_f32":
        assert "ld.global" in ptx  # main_grad read, added to, written back
    assert kern.stages >= 4
    found = _resource_usage(compiled)
    advisories = _ptxas_advisories(ptx)
    if advisories is not None:
        assert not advisories, advisories
    print(f"compile fp8 wgrad M={m} N={n} E={e} BN={bn} {epilogue}: {secs:.2f} s, {kern.stages} stages"
          f"{', ' + found if found else ''}")


@needs_dsl
def test_fp8_wgrad_kernel_refuses_what_it_cannot_run():
    from te_offload_ops.kernels.gemm_fp8_wgrad_sm90 import GroupedWgradFp8Sm90

    with pytest.raises(ValueError, match="BN in"):
        GroupedWgradFp8Sm90(cutlass.BFloat16, 256, 256, 2, tile_mn=(128, 192))
    with pytest.raises(ValueError, match="epilogues are"):
        GroupedWgradFp8Sm90(cutlass.BFloat16, 256, 256, 2, epilogue="tma_f32")
    with pytest.raises(ValueError, match="multiple of 8"):
        GroupedWgradFp8Sm90(cutlass.BFloat16, 100, 256, 2)
    with pytest.raises(ValueError, match="promotion must be one of"):
        GroupedWgradFp8Sm90(cutlass.BFloat16, 256, 256, 2, promotion="eager")


@needs_dsl
def test_fp8_wgrad_serial_promotion_waits_for_each_k_block(monkeypatch):
    """TEO_FP8_PROMOTION=serial: one issue site, each promotion after a full wait."""
    from te_offload_ops.kernels import api_fp8
    from te_offload_ops.kernels.api_fp8_wgrad import compile_variant_fp8_wgrad

    monkeypatch.setenv(api_fp8.PROMOTION_ENV, "serial")
    kern, compiled, _ = compile_variant_fp8_wgrad(2688, 1856, 8, epilogue="red_f32", options="--keep-ptx")
    ptx = str(compiled.artifacts.PTX)
    assert kern.promotion == "serial"
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx)) == 4
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)) == 0
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0;", ptx)) == 1


def test_fp8_wgrad_entry_point_refuses_bad_operands_clearly():
    from te_offload_ops.kernels.api_fp8_wgrad import _check

    t, e = 300, 3
    tp = (t + 127 * e) // 128 * 128
    a = torch.zeros(256, tp, dtype=torch.uint8)
    b = torch.zeros(128, tp, dtype=torch.uint8)
    sa = torch.zeros(tp // 128, 256)
    sb = torch.zeros(tp // 128, 128)
    split = torch.tensor([100, 0, 200], dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA tensor"):
        _check(a, sa, b, sb, split, t)  # on the CPU
    from te_offload_ops.kernels.api_fp8_wgrad import grouped_wgrad_fp8_blockwise, grouped_wgrad_fp8_main_grad

    with pytest.raises(ValueError, match=r"promotion must be one of \('serial', 'overlap'\), got 'eager'"):
        grouped_wgrad_fp8_blockwise(a, sa, b, sb, split, t, promotion="eager")
    with pytest.raises(ValueError, match="promotion must be one of"):
        grouped_wgrad_fp8_main_grad(a, sa, b, sb, split, t, torch.zeros(3, 256, 128), promotion="eager")
    if not torch.cuda.is_available():
        return
    a, b, sa, sb, split = (x.cuda() for x in (a, b, sa, sb, split))
    _check(a, sa, b, sb, split, t)
    with pytest.raises(ValueError, match="padded_tokens"):
        _check(a, sa, b, sb, split, t + 200)
    with pytest.raises(ValueError, match="a_scale_inv"):
        _check(a, sa[:, :128], b, sb, split, t)


def test_fp8_wgrad_launch_plan_matches_the_kernel_and_keys_apart_from_the_bf16_form():
    """A kernel loaded from the disk cache launches from its plan: the plan's walk (experts, tile
    groups) is the kernel object's, and its cache key differs from the bf16 weight gradient's."""
    from te_offload_ops.kernels import registry
    from te_offload_ops.kernels.api_fp8_wgrad import launch_plan_fp8_wgrad

    plan = launch_plan_fp8_wgrad(torch.bfloat16, 1856, 2688, 8, (128, 128), "red_f32")
    assert (plan.num_experts, plan.wgrad_groups, plan.n_tiles, plan.m_tiles) == (8, 15 * 21, 21, 15)
    from te_offload_ops.kernels.gemm_plan import GemmPlan

    bf16 = GemmPlan(2, 2688, 0, 8, b_n_major=True, epilogue="red_f32", tile_mn=(128, 128), wgrad_m=1856)
    assert registry.kernel_params(plan) != registry.kernel_params(bf16)
    overlap = launch_plan_fp8_wgrad(torch.bfloat16, 1856, 2688, 8, (128, 128), "red_f32", "overlap")
    assert registry.kernel_params(overlap) != registry.kernel_params(plan)  # the promotion keys the variant
    if _HAVE_DSL:
        from te_offload_ops.kernels.gemm_fp8_wgrad_sm90 import GroupedWgradFp8Sm90

        kern = GroupedWgradFp8Sm90(cutlass.BFloat16, 1856, 2688, 8, tile_mn=(128, 128), epilogue="red_f32")
        assert (kern.num_experts, kern.wgrad_groups) == (plan.num_experts, plan.wgrad_groups)


# 2 x 2 clusters (TEO_GEMM_CLUSTER_M=2, opt-in): the n-pair multicasts A, the m-pair B where both
# m-blocks are of one expert (else each CTA loads B whole); every FP8 epilogue
@needs_dsl
@pytest.mark.parametrize("epilogue", ["plain", "srelu_q", "dsrelu_q"])
def test_fp8_two_by_two_clusters_compile_and_multicast_both_operands(epilogue, monkeypatch):
    from te_offload_ops.kernels import api_fp8, tiling

    monkeypatch.setenv(tiling.CLUSTER_M_ENV, "2")
    n, k, e = 1856, 2688, 8  # 15 n-blocks: an odd count, phantoms past N
    kern, compiled, _ = kernels.compile_variant_fp8(n, k, e, epilogue=epilogue, options="--keep-ptx --keep-cubin")
    pair, _, _ = kernels.compile_variant_fp8(n, k, e, epilogue=epilogue, cluster_m=1)
    assert (kern.cluster_m, kern.cluster_n, kern.cluster_size, kern.n_pairs) == (2, 2, 4, 8)
    assert kern.stages == pair.stages  # the same shared memory: no stage lost
    ptx = str(compiled.artifacts.PTX)
    loads = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln and "global" in ln]
    a_loads = [ln for ln in loads if ".2d" in ln and "multicast::cluster" in ln]
    b_mcast = [ln for ln in loads if ".3d" in ln and "multicast::cluster" in ln]
    b_whole = [ln for ln in loads if ".3d" in ln and "multicast::cluster" not in ln]
    assert a_loads and b_mcast and b_whole, loads  # A shared, B shared or whole
    assert len(re.findall(r"\bmapa\b", ptx)) >= 1  # consumers release peers' stages
    # dsrelu_q (serial promotion, the saved z in registers): ptxas keeps one word on the stack
    # across the warp-role split, reloaded once a tile (SASS: one STL, three LDL outside the k-loop)
    _resource_usage(compiled, max_stack=8 if epilogue == "dsrelu_q" else 0)
    # the plan a cached kernel launches from holds the same walk
    plan = api_fp8.launch_plan_fp8(torch.bfloat16, n, k, e, (128, 128), 2, kern.sb_cols, cluster_m=2)
    assert (plan.cluster_size, plan.n_pairs) == (4, 8)


def test_fp8_two_by_two_clusters_default_where_measured_faster_and_key_apart(monkeypatch):
    """Unset, TEO_GEMM_CLUSTER_M leaves the choice to the measured rule: 2 x 2 for the plain and
    srelu_q forms with an even n-block count on a GPU that fits clusters of four; "1" and "2"
    force it (the dsrelu_q form and odd counts included). The two never share a disk entry."""
    from te_offload_ops.kernels import api_fp8, registry, tiling

    monkeypatch.delenv(tiling.CLUSTER_M_ENV, raising=False)
    pick = tiling.pick_cluster_m_fp8
    asked = []

    def fits():
        asked.append(1)
        return True

    t = (128, 128)
    assert pick(7168, t, 2, "plain", fits) == 2 and pick(2048, t, 2, "srelu_q", fits) == 2  # 56, 16 n-blocks
    assert len(asked) == 2
    assert pick(2048, t, 2, "dsrelu_q", fits) == 1  # measured slower with the dSReLU epilogue
    assert pick(2688, t, 2, "plain", fits) == 1 and pick(1856, t, 2, "srelu_q", fits) == 1  # 21, 15: phantoms
    assert pick(7168, t, 1, "plain", fits) == 1  # TEO_GEMM_CLUSTER_N=1: no pairs, no 2 x 2
    assert len(asked) == 2  # the GPU is asked only where the shape would take 2 x 2
    assert pick(7168, t, 2, "plain", lambda: False) == 1  # no cluster of four fits
    monkeypatch.setenv(tiling.CLUSTER_M_ENV, "1")
    assert pick(7168, t, 2, "plain", fits) == 1
    monkeypatch.setenv(tiling.CLUSTER_M_ENV, "2")
    assert pick(2688, t, 2, "dsrelu_q", fits) == 2
    monkeypatch.setenv(tiling.CLUSTER_M_ENV, "4")
    with pytest.raises(ValueError, match="1 or 2"):
        pick(7168, t, 2, "plain", fits)
    pair = api_fp8.launch_plan_fp8(torch.bfloat16, 7168, 2048, 8, t, 2, 16)
    four = api_fp8.launch_plan_fp8(torch.bfloat16, 7168, 2048, 8, t, 2, 16, cluster_m=2)
    assert (pair.cluster_m, four.cluster_m, four.cluster_size) == (1, 2, 4)
    assert registry.kernel_params(pair) != registry.kernel_params(four)  # never one another's disk entry


def test_cluster_fit_asks_the_driver_once_per_gpu_and_keeps_the_answer(tmp_path, monkeypatch):
    """The occupancy of clusters of four (a probe kernel the DSL compiles) is asked once per GPU and
    cluster size, then read from the cache directory, by a later process too; each GPU its own
    entry; a broken file is asked again; with the disk cache off nothing is written."""
    from te_offload_ops.kernels import cluster_fit, disk_cache

    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(disk_cache.CACHE_ENV, raising=False)
    monkeypatch.setattr(cluster_fit, "_key", lambda dev, size: f"GPU-{dev}/{size}")
    probes = []

    def probe(dev, size):
        probes.append((dev, size))
        return 30 + dev

    assert cluster_fit.max_active_clusters(0, 4, probe) == 30
    assert cluster_fit.max_active_clusters(0, 4, probe) == 30
    assert cluster_fit.max_active_clusters(1, 4, probe) == 31
    assert probes == [(0, 4), (1, 4)]
    path = tmp_path / cluster_fit.FILE_NAME
    assert json.loads(path.read_text()) == {"GPU-0/4": 30, "GPU-1/4": 31}
    path.write_text("{not json")
    assert cluster_fit.max_active_clusters(0, 4, probe) == 30 and probes[-1] == (0, 4)
    monkeypatch.setenv(disk_cache.CACHE_ENV, "0")
    path.unlink()
    assert cluster_fit.max_active_clusters(0, 4, probe) == 30 and not path.exists()


def test_fp8_gemms_keep_the_pair_where_the_cluster_question_gets_no_answer(monkeypatch, caplog):
    """A GPU whose cluster occupancy cannot be learned (the probe needs the CuTe DSL) runs the FP8
    GEMMs in CTA pairs, said once, instead of failing the GEMM; asked once per device."""
    from te_offload_ops.kernels import api_fp8, launch

    asked = []

    def no_answer(device, size):
        asked.append((device, size))
        raise ImportError("no module named cutlass")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch, "cluster_slots", no_answer)
    api_fp8._device_fits_four.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert api_fp8._fits_four(0) is False and api_fp8._fits_four(0) is False
        assert asked == [(0, 4)]
        assert "CTA pairs" in caplog.text and "no module named cutlass" in caplog.text
        monkeypatch.setattr(launch, "cluster_slots", lambda device, size: 120)
        assert api_fp8._fits_four(1) is True
    finally:
        api_fp8._device_fits_four.cache_clear()
