"""Writes the offload-policy benchmark's results: JSON, a markdown table and a PNG chart."""

from __future__ import annotations

import re
from pathlib import Path

import bench_common
from bench_common import pyplot, save_png

COLUMNS = [  # header, key, format
    ("engine", "engine", "{}"),
    ("policy", "policy", "{}"),
    ("path", "path", "{}"),
    ("step ms", "step_ms", "{:.2f}"),
    ("fwd ms", "fwd_ms", "{:.2f}"),
    ("peak above floor MiB", "peak_MiB", "{:.0f}"),
    ("act MiB @fwd end", "act_MiB", "{:.0f}"),
    ("offloaded MiB", "offloaded_MiB", "{:.0f}"),
    ("R", "R", "{:.2%}"),
    ("PCIe bound ms", "bound_ms", "{:.2f}"),
    ("step / bound", "vs_bound", "{:.2f}x"),
]


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    return "-" if value is None else fmt.format(value)


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# Offload policies on {result['gpu']} ({result['date']})",
        "",
        f"E={c['experts']} experts x {c['tokens']} tokens ({c['routing']} routing: {c['split_sizes']}), H={c['hidden']}, F={c['ffn']}, {c['dtype']}, "
        f"{c['layers']} layers, {c['offload_layers']} offloaded; median of {c['iters']} steps.",
        f"PCIe bound = {result['bound_formula']}; peak: most memory allocated during the step (forward and "
        "backward) above the static floor (weights, their grads kept across steps, the inputs); "
        "R = peak freed / bytes offloaded, against the no-offload run of the same ops.",
        "",
    ]
    for run in result["runs"]:
        p = run["pcie"]
        lines.append(f"- {run['engine']} run: PCIe d2h {p['d2h_GBps']:.1f} GB/s, h2d {p['h2d_GBps']:.1f} GB/s, "
                     f"both directions {p['bidirectional_each_GBps']:.1f} GB/s each")
    lines += ["", "| " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for run in result["runs"]:
        for row in run["rows"]:
            lines.append("| " + " | ".join(_cell(row, k, f) for _, k, f in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def chart(result: dict, path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for run in result["runs"] for r in run["rows"]]
    labels = [f"{r['engine']}\n{r['policy']}" for r in rows]
    xs = range(len(rows))
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(max(10, len(rows) * 0.9), 8), sharex=True)
    colors = ["#888888" if r["engine"] == "none" else "#4c72b0" if r["engine"] == "v2" else "#dd8452" for r in rows]
    ax_t.bar(xs, [r["step_ms"] for r in rows], color=colors)
    ax_t.scatter(xs, [r["bound_ms"] for r in rows], marker="_", s=900, color="black", zorder=3,
                 label="PCIe lower bound")
    ax_t.set_ylabel("step time (ms)")
    ax_t.legend(loc="upper left")
    ax_m.bar(xs, [r["peak_MiB"] for r in rows], color=colors, label="step peak above the static floor")
    ax_m.bar(xs, [r["act_MiB"] for r in rows], color="none", edgecolor="black", hatch="//",
             label="activations at end of forward")
    ax_m.set_ylabel("memory (MiB)")
    ax_m.legend(loc="upper left")
    ax_m.set_xticks(list(xs), labels, rotation=45, ha="right", fontsize=8)
    c = result["config"]
    fig.suptitle(f"Offload policies, {result['gpu']}: {c['layers']} layers ({c['offload_layers']} offloaded), "
                 f"E={c['experts']}x{c['tokens']} ({c['routing']}), H={c['hidden']}, F={c['ffn']}, {c['dtype']}")
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return True


def write_reports(result: dict, folder: Path) -> list[Path]:
    stem = "offload_policies_" + re.sub(r"[^A-Za-z0-9]+", "_", result["gpu"]).strip("_")
    if result["config"]["routing"] != "uniform":
        stem += "_" + result["config"]["routing"]
    return bench_common.write_reports(folder, stem, result, markdown, chart)
