"""What the benchmarks share besides timing (``timing.py``): what stops a GPU run, result file
names, the date stamp, and writing JSON, markdown and PNG reports.

Importing this module needs neither torch nor a GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
from pathlib import Path


def cuda_problem() -> str | None:
    """Why this machine cannot run the GPU benchmarks, or None."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed (run: bash scripts/setup_env.sh)"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (report any import failure plainly)
        return f"Transformer Engine does not import ({exc}); run: bash scripts/setup_env.sh"
    return None


def sm90_kernel_problem() -> str | None:
    """Why this machine cannot run this package's Hopper kernels: :func:`cuda_problem`'s reasons, a
    GPU other than sm_90, no CuTe DSL; or None."""
    import importlib.util

    if (problem := cuda_problem()):
        return problem
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        return f"the kernels need an sm_90 GPU (H100/H200), found {torch.cuda.get_device_name()}"
    if importlib.util.find_spec("cutlass") is None:
        return "the CuTe DSL (nvidia-cutlass-dsl) is not installed"
    return None


def refuse(script: str, problem: str) -> int:
    """Says on stderr why ``script`` cannot run here; returns the exit status for it (2)."""
    import sys

    print(f"{script}: cannot run: {problem}", file=sys.stderr)
    return 2


def mlp_path(mlp) -> str:
    """ "fused" when a ``te.ops.Sequential`` grouped MLP ran this package's Hopper fused op in its
    last forward, else "unfused"."""
    ran = [op for group in mlp._module_groups for op, _ in group._forward_ops]
    fused = [op for op in ran if type(op).__name__ == "FusedScaledSReLUMLP"]
    return "fused" if fused and not any(op.last_fallback_reasons for op in fused) else "unfused"


# the package's settings that change what a benchmark runs (README's table, less where kernels
# are kept): a results page's command names those set, so that it reruns the same code
SETTINGS_SHOWN = ("TEO_FUSED_SRELU_MLP", "TEO_FUSED_ACT_CHUNK_MIB", "TEO_CHECK_SPLIT_SIZES", "TEO_KERNEL_CALL",
                  "TEO_GEMM_SCHEDULE", "TEO_GEMM_CLUSTER_N", "TEO_GEMM_CLUSTER_M", "TEO_WGRAD_BACKEND",
                  "TEO_MAIN_GRAD_ADD", "TEO_FP8_ROWS", "TEO_FP8_WGRAD", "TEO_FP8_PROMOTION",
                  "TEO_HOST_MEMORY")


def command_line(script: str, argv: list, paths: tuple = ("--out",), env=None) -> str:
    """``[SETTING=value ...] python <script> <argv>`` as a results page names it: the settings of
    :data:`SETTINGS_SHOWN` set in ``env`` (the process's by default), and the arguments without
    the options in ``paths`` (where its files and logs went) and their values."""
    env = os.environ if env is None else env
    shown, skip = [f"{name}={env[name]}" for name in SETTINGS_SHOWN if env.get(name)], False
    shown.append(f"python {script}")
    for a in argv:
        if skip:
            skip = False
        elif a in paths:
            skip = True
        elif not a.startswith(tuple(p + "=" for p in paths)):
            shown.append(a)
    return " ".join(shown)


@contextlib.contextmanager
def split_check_off():
    """The fused op's deferred split-size check off for a host-ahead measurement: it reads the
    sizes on the host at the end of a backward, which would wait for a GPU held back on purpose."""
    import os

    from te_offload_ops.fused.split_check import CHECK_ENV

    before = os.environ.get(CHECK_ENV)
    os.environ[CHECK_ENV] = "off"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CHECK_ENV)
        else:
            os.environ[CHECK_ENV] = before


def utc_now() -> str:
    """The date and time a result is stamped with."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# the shape every results page compares at: E=8 experts x 2048 tokens each, H=2688, F=1856
MLP_SHAPE = {"experts": 8, "tokens": 2048, "hidden": 2688, "ffn": 1856}


def mlp_shape_suffix(args) -> str:
    """A results-file suffix naming the shape where it is not :data:`MLP_SHAPE`:
    ``E<experts>x<tokens per expert>`` where either differs, ``H<hidden>``, ``F<ffn>``, e.g.
    ``E8x4096_H7168_F2048`` (empty at the default shape)."""
    parts = []
    if (args.experts, args.tokens) != (MLP_SHAPE["experts"], MLP_SHAPE["tokens"]):
        parts.append(f"E{args.experts}x{args.tokens}")
    parts += [f"{letter}{getattr(args, name)}" for name, letter in (("hidden", "H"), ("ffn", "F"))
              if getattr(args, name) != MLP_SHAPE[name]]
    return "_".join(parts)


def add_mlp_shape_args(parser, tokens_help: str = "tokens per expert") -> None:
    """The expert MLP's shape options the benchmarks share: E experts x tokens, H, F (default the
    shape every results page compares at: E=8 x 2048 tokens, H=2688, F=1856)."""
    parser.add_argument("--experts", "-E", type=int, default=MLP_SHAPE["experts"])
    parser.add_argument("--tokens", type=int, default=MLP_SHAPE["tokens"], help=tokens_help)
    parser.add_argument("--hidden", "-H", type=int, default=MLP_SHAPE["hidden"])
    parser.add_argument("--ffn", "-F", type=int, default=MLP_SHAPE["ffn"])


def attach_main_grads(mlp) -> list:
    """Megatron's gradient buffers on an expert MLP built with ``accumulate_into_main_grad=True``:
    per GroupedLinear one fp32 buffer holding its weights' ``main_grad`` one after another, in
    reverse order (as Megatron's grad buffer lays out a layer's experts), and ``.grad`` dropped once
    autograd has it, as Megatron's DDP hook drops it (TE hands autograd a placeholder there: the
    wgrads went into ``main_grad``; kept, autograd would add the placeholder into ``.grad`` every
    step). Returns the buffers."""
    import torch

    buffers = []
    for op in mlp:
        weights = [p for p in op.parameters() if p.dim() >= 2]
        if not weights:
            continue
        buffer = torch.zeros(sum(p.numel() for p in weights), device=weights[0].device, dtype=torch.float32)
        end = buffer.numel()
        for p in weights:  # the first weight last
            p.main_grad = buffer[end - p.numel():end].view(p.shape)
            end -= p.numel()
            p.grad_added_to_main_grad = False
            p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
        buffers.append(buffer)
    return buffers


def add_gemm_timing_args(parser, tokens: tuple) -> None:
    """The options the grouped-GEMM benchmarks share: experts, tokens per expert (several), timing
    rounds and calls per round, the output folder and the per-case watchdog."""
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=list(tokens), help="tokens per expert")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--inner", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--watchdog", type=float, default=120.0,
                        help="seconds one case may take before the stacks are dumped and the run exits")


def check_gemm_timing_args(parser, args) -> None:
    for name in ("experts", "reps", "inner"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(t < 1 for t in args.tokens):
        parser.error(f"--tokens must be >= 1, got {args.tokens}")


def bar_chart(path, title: str, labels: list, series: dict, size=(10, 4.5), line=None, **tick_style) -> bool:
    """One group of bars per label, one bar per series (name -> values), TFLOP/s on the y axis; an
    optional ``(value, label)`` reference line. False where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=size)
    width = 0.8 / len(series)
    for j, (name, ys) in enumerate(series.items()):
        ax.bar([i + (j - (len(series) - 1) / 2) * width for i in range(len(labels))], ys, width, label=name)
    if line is not None:
        ax.axhline(line[0], color="grey", linestyle="--", linewidth=1, label=line[1])
    ax.set_xticks(range(len(labels)), labels, **(tick_style or {"fontsize": 7}))
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=max(1, min(3, len(series) // 2 + 1)))
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    plt.close(fig)
    return True


def file_stem(benchmark: str, gpu: str, *suffixes: str) -> str:
    """``benchmark_<GPU name>[_suffix...]`` with only letters, digits and underscores."""
    parts = [benchmark, re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_"), *(s for s in suffixes if s)]
    return "_".join(parts)


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (saying so) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG chart")
        return None
    return plt


def save_png(fig, path, dpi: int = 110, colors: int = 64) -> None:
    """``fig`` as a PNG of at most ``colors`` colours: charts of lines and markers lose nothing
    visible and take about a third of the bytes, which keeps the results folder small enough to
    travel to the GPU machine with the CuTe DSL libraries (64 MiB in all)."""
    fig.savefig(path, dpi=dpi)
    shrink_png(path, colors)


def shrink_png(path, colors: int = 64) -> None:
    """Rewrites the PNG at ``path`` with a palette of ``colors`` colours (Pillow comes with matplotlib)."""
    from PIL import Image

    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    small.save(path, format="PNG", optimize=True)


def read_result(path) -> dict:
    """A benchmark's JSON result, plain or gzipped (``.json.gz``: how results are committed, to keep
    the checkout small enough to travel to the device machine with the CuTe DSL)."""
    import gzip
    import json

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def write_reports(folder, stem: str, result: dict, markdown, chart) -> list:
    """``folder/stem.{json,md,png}`` from ``result``: ``markdown(result)`` -> text (also printed),
    ``chart(result, path)`` -> whether it drew the PNG. Returns the paths written."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"{stem}.json", folder / f"{stem}.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    paths[1].write_text(table)
    print("\n" + table)
    if chart(result, folder / f"{stem}.png") is not False:
        paths.append(folder / f"{stem}.png")
    return paths
