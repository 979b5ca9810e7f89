"""CPU: the Triton kernels of the FP8 fused path compile for sm_90 without a GPU, and their PTX
does what TE's quantizer does: round to nearest with saturation into e4m3, IEEE division for the
scale, and the power-of-two scale made by clearing the mantissa (0xFF800000)."""

import pytest

triton = pytest.importorskip("triton", reason="Triton is not installed (torch's CUDA wheels bring it)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from te_offload_ops.kernels import fp8_rows  # noqa: E402

BF16_MAX = 3.3895313892515355e38
ROWS = {"ROWS": fp8_rows.ROWS}
KERNELS = {  # name -> (signature without constexprs, constexprs)
    "quantize_kernel": ({"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "T": "i32", "K": "i32",
                         "scale_stride": "i32", "eps": "fp32"}, ROWS),
    "srelu_quantize_kernel": ({"z_ptr": "*bf16", "p_ptr": "*bf16", "act_ptr": "*u8", "act_s_ptr": "*fp32",
                               "zq_ptr": "*u8", "zq_s_ptr": "*fp32", "T": "i32", "F": "i32", "scale_stride": "i32",
                               "eps": "fp32"}, ROWS),
    "dsrelu_quantize_kernel": ({"dact_ptr": "*bf16", "zq_ptr": "*u8", "zq_s_ptr": "*fp32", "p_ptr": "*bf16",
                                "act_ptr": "*bf16", "dzq_ptr": "*u8", "dzq_s_ptr": "*fp32", "dp_ptr": "*fp32",
                                "T": "i32", "F": "i32", "scale_stride": "i32", "eps": "fp32"},
                               {"K_BLOCKS": 15, **ROWS}),
    "quantize_columns_kernel": ({"x_ptr": "*bf16", "split_ptr": "*i64", "q_ptr": "*u8",
                                 "s_ptr": "*fp32", "E": "i32", "T": "i32", "K": "i32", "TP": "i32", "KP": "i32", "eps": "fp32"},
                                {"E_P2": 8}),
    "quantize_both_kernel": ({"x_ptr": "*bf16", "split_ptr": "*i64", "q_ptr": "*u8",
                              "s_ptr": "*fp32", "r_ptr": "*u8", "rs_ptr": "*fp32", "E": "i32", "T": "i32", "K": "i32",
                              "TP": "i32", "KP": "i32", "row_stride": "i32", "eps": "fp32"}, {"E_P2": 8}),
    "quantize_weights_kernel": ({"w_ptr": "*bf16", "expert_stride": "i64", "rows_ptr": "*u8", "row_s_ptr": "*fp32",
                                 "cols_ptr": "*u8", "col_s_ptr": "*fp32", "E": "i32", "N": "i32", "K": "i32",
                                 "NBP": "i32", "KBP": "i32", "eps": "fp32"}, {"REVERSED": True}),
}


def _ptx(name: str, pow2: bool) -> str:
    signature, constexprs = KERNELS[name]
    constexprs = {**constexprs, "POW2": pow2, "INF_VALUE": BF16_MAX}
    fn = getattr(fp8_rows, name)
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    sig = {a: sig[a] for a in fn.arg_names}  # the kernel's own argument order
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2-scales", "fp32-scales"])
def test_kernels_compile_for_sm90_and_quantize_as_te(name, pow2):
    ptx = _ptx(name, pow2)
    assert ".target sm_90" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx  # TE's conversion: nearest, saturating
    assert "div.rn.f32" in ptx  # 448 / amax and 1 / scale as IEEE divisions (TE: __fdiv_rn)
    assert ("-8388608" in ptx) == pow2  # scale_bits &= 0xFF800000 only for power-of-two scales


def test_dequantize_kernel_compiles_for_sm90():
    fn = fp8_rows.dequantize_kernel
    sig = {"q_ptr": "*u8", "s_ptr": "*fp32", "out_ptr": "*bf16", "T": "i32", "K": "i32", "scale_stride": "i32",
           "ROWS": "constexpr"}
    ptx = triton.compile(ASTSource(fn=fn, signature={a: sig[a] for a in fn.arg_names}, constexprs=ROWS),
                         target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert ".target sm_90" in ptx
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "cvt.rn.bf16.f32" in ptx  # e4m3 in (exact), bf16 out (nearest)
