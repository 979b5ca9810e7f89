"""Helpers the offload benchmarks share: what stops a GPU run, PCIe bandwidth, file names.

Importing this module needs neither torch nor a GPU; the functions that measure import torch.
"""

from __future__ import annotations

import re
import statistics
import sys


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


def moe_step_bench(script: str, shape: str, layers: int, batch: int, engine: str, extra: tuple = ()):
    """For a diagnostic script: ``moe_step``'s model and step at ``shape`` for ``engine`` (no cap
    search; ``extra``: more of moe_step.py's arguments), or None after saying on stderr why this
    machine cannot run it (the script then exits 2)."""
    problem = cuda_problem()
    if problem:
        print(f"{script} needs a CUDA GPU with Transformer Engine: {problem}", file=sys.stderr)
        return None
    import moe_step

    args = moe_step.parse_args(["--shapes", shape, "--layers", str(layers), "--batch", str(batch),
                                "--engines", engine, "--no-cap", *extra])
    return moe_step.StepBench(shape, args.shapes[shape], args, engine)


def file_stem(benchmark: str, gpu: str, *suffixes: str) -> str:
    """``benchmark_<GPU name>[_suffix...]`` with only letters, digits and underscores."""
    parts = [benchmark, re.sub(r"[^A-Za-z0-9]+", "_", gpu).strip("_"), *(s for s in suffixes if s)]
    return "_".join(parts)


def active_bytes(peak: bool = False) -> int:
    """GPU memory in use as the caching allocator sees it: blocks held by tensors plus blocks freed
    while a side stream still uses them (``record_stream``: an offload copy in flight), which
    ``memory_allocated`` already counts as free. For engines whose copies the compute stream
    waits for (TE V2, V1, teo since its backpressure) the two agree; for one that hands memory back
    under ``record_stream`` before its copy is done (teo's first version did) only this
    is honest. ``peak``: the most since ``torch.cuda.reset_peak_memory_stats()``."""
    import torch

    if not peak:
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # an allocation makes the allocator retire finished stream uses
    return torch.cuda.memory_stats()["active_bytes.all." + ("peak" if peak else "current")]


def measure_pcie(nbytes: int = 1 << 29, reps: int = 5) -> dict:
    """GB/s host<->device with pinned memory: each direction alone, then both at once."""
    import torch

    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty_like(dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty_like(host, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)

    def both():
        main = torch.cuda.current_stream()
        for s in (s1, s2):
            s.wait_stream(main)
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)
        for s in (s1, s2):
            main.wait_stream(s)

    d2h = nbytes / timed(lambda: host.copy_(dev, non_blocking=True)) / 1e9
    h2d = nbytes / timed(lambda: dev.copy_(host, non_blocking=True)) / 1e9
    both_gbs = nbytes / timed(both) / 1e9
    del dev, dev2, host, host2
    torch.cuda.empty_cache()
    return {"d2h_GBps": d2h, "h2d_GBps": h2d, "bidirectional_each_GBps": both_gbs}


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
