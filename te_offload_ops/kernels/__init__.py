"""Hopper (sm_90a) grouped-GEMM kernels (CuTe DSL) for the fused SReLU MoE MLP.

Importing this package does not import the CuTe DSL; it is imported on the
first kernel call (or by :func:`get_kernel`). Compiled kernels are kept on disk
(:mod:`.disk_cache`) and loaded by later processes; :mod:`.warmup` fills the cache ahead of a job.
"""

from .api import (
    clear_cache,
    compile_times,
    compile_variant,
    dsrelu_bwd_bytes,
    get_kernel,
    grouped_gemm,
    grouped_gemm_dsrelu_bwd,
    grouped_gemm_srelu_fwd,
    grouped_wgrad,
    grouped_wgrad_main_grad,
    kernel_call_convention,
    load_times,
    main_grad_add,
    main_grad_way,
    pick_schedule,
    pick_tile,
    unavailable_reasons,
    wgrad_backend,
)

__all__ = [
    "clear_cache",
    "compile_times",
    "compile_variant",
    "dsrelu_bwd_bytes",
    "get_kernel",
    "grouped_gemm",
    "grouped_gemm_dsrelu_bwd",
    "grouped_gemm_srelu_fwd",
    "grouped_wgrad",
    "grouped_wgrad_main_grad",
    "kernel_call_convention",
    "load_times",
    "main_grad_add",
    "main_grad_way",
    "mlp_variants",
    "pick_schedule",
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
