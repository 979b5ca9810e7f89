"""The kernels of the fused SReLU MoE MLP: Hopper (sm_90a) grouped GEMMs in the CuTe DSL (bf16/fp16,
and FP8 with Transformer Engine's block scaling), the FP8 path's token-row and weight
quantization passes in Triton (:mod:`.fp8_rows`), and the machinery that compiles, caches and
launches them.

Importing this package does not import the CuTe DSL; a kernel call imports it where it compiles
the kernel (or calls it through the DSL's Python executor). Compiled kernels are kept on disk
(:mod:`.disk_cache`) and loaded by later processes, through TVM-FFI without the DSL where the cache
holds them as shared objects; :mod:`.warmup` fills the cache ahead of a job.
"""

from .api import (compile_variant, dsrelu_bwd_bytes, get_kernel, grouped_gemm, grouped_gemm_dsrelu_bwd,
                  grouped_gemm_srelu_fwd)
from .availability import kernel_call_convention, loads_without_dsl, unavailable_reasons
from .registry import clear_cache, compile_times, dsl_import_seconds, first_launch_times, load_times, loaded_by
from .tiling import pick_schedule, pick_tile
from .api_wgrad import grouped_wgrad, grouped_wgrad_main_grad, wgrad_backend
from .main_grads import main_grad_add, main_grad_way
from .api_fp8 import (compile_variant_fp8, grouped_gemm_fp8_blockwise, grouped_gemm_fp8_dsrelu_quantize,
                      grouped_gemm_fp8_srelu_quantize, pick_tile_fp8)

__all__ = [
    "clear_cache",
    "compile_times",
    "compile_variant",
    "compile_variant_fp8",
    "dsl_import_seconds",
    "dsrelu_bwd_bytes",
    "first_launch_times",
    "get_kernel",
    "grouped_gemm",
    "grouped_gemm_dsrelu_bwd",
    "grouped_gemm_fp8_blockwise",
    "grouped_gemm_fp8_dsrelu_quantize",
    "grouped_gemm_fp8_srelu_quantize",
    "grouped_gemm_srelu_fwd",
    "grouped_wgrad",
    "grouped_wgrad_main_grad",
    "kernel_call_convention",
    "load_times",
    "loaded_by",
    "loads_without_dsl",
    "main_grad_add",
    "main_grad_way",
    "mlp_variants",
    "pick_schedule",
    "pick_tile_fp8",
    "pick_tile",
    "unavailable_reasons",
    "warm_up",
    "wgrad_backend",
]


def __getattr__(name):
    # imported on use: ``python -m te_offload_ops.kernels.warmup`` must find the module not yet run
    if name in ("warm_up", "mlp_variants"):
        from . import warmup

        return getattr(warmup, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
