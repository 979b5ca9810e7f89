#!/usr/bin/env python3
"""The tokens-under-a-cap searches of several ``moe_step.py`` runs in one picture.

Each run under the cap that fit is a point: tokens per step against the same process's no-offload
search (x) and tokens/s against that search's (y); one line per engine and policy through its
batches. The issue's target is the corner at x >= 1.5 and y >= 0.95, shaded.

    python3 benchmarks/moe_step_cap_chart.py RUN.json[=TAG] [...] [--shape big-ffn] [--out DIR] [--stem NAME]

``=TAG`` names a run's points apart (e.g. runs of the same engine on different code).

Writes NAME.{md,png} (default ``moe_step_cap_<shape>``): the table of points and the chart.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import pyplot, read_result, save_png  # noqa: E402

TOKENS_TARGET, RATE_TARGET = 1.5, 0.95


def engine_label(run: dict, config: dict) -> str:
    """The engine's name, with teo-b's budget margin (a setting of the whole run)."""
    if run["engine"] == "teo-b" and config.get("budget_margin_GiB") is not None:
        return f"teo-b (cap - {config['budget_margin_GiB']:g} GiB)"
    return run["engine"]


def cap_points(result: dict, shape: str, tag: str = "") -> list[dict]:
    """Every run under the cap that fit, per engine and policy searched, against the same process's
    no-offload search: {"engine", "policy", "batch", "tokens_x", "rate_x", "cap_GiB"}, by batch
    (``tag``, if any, after the engine's name)."""
    out = []
    for s in result["shapes"]:
        if s["name"] != shape:
            continue
        for run in s["runs"]:
            cap = run.get("cap") or {}
            searches = cap.get("searches", [])
            ref = next((x for x in searches if x["scope"] == "none"), None)
            if ref is None or not ref.get("batch") or not ref.get("tokens_per_s"):
                continue
            for search in searches:
                if search["scope"] == "none":
                    continue
                for t in sorted(search["trials"], key=lambda t: t["batch"]):
                    if t["fits"] and t.get("tokens_per_s"):
                        label = engine_label(run, result.get("config", {})) + (f" [{tag}]" if tag else "")
                        out.append({"engine": label, "policy": search["policy"],
                                    "batch": t["batch"], "tokens_x": t["batch"] / ref["batch"],
                                    "rate_x": t["tokens_per_s"] / ref["tokens_per_s"], "cap_GiB": cap.get("cap_GiB")})
    return out


def markdown(points: list[dict], shape: str, sources: list[str]) -> str:
    lines = [f"# Tokens per step under a memory cap, {shape}", "",
             "Each run under the cap that fit, against the same process's no-offload search (most sequences that "
             f"fit, its tokens/s). Target: x{TOKENS_TARGET} tokens at >= {RATE_TARGET} of the tokens/s.", ""]
    lines += [f"- {src}" for src in sources]
    lines += ["", "| engine | policy | cap GiB | sequences | tokens x none | tokens/s x none | target |",
              "|---|---|---|---|---|---|---|"]
    for p in points:
        met = "met" if p["tokens_x"] >= TOKENS_TARGET and p["rate_x"] >= RATE_TARGET else ""
        lines.append(f"| {p['engine']} | {p['policy']} | {p['cap_GiB']} | {p['batch']} | {p['tokens_x']:.3f} | "
                     f"{p['rate_x']:.3f} | {met} |")
    return "\n".join(lines) + "\n"


def chart(points: list[dict], shape: str, path: Path) -> bool:
    plt = pyplot()
    if plt is None or not points:
        return False
    fig, ax = plt.subplots(figsize=(8, 6))
    lines: dict = {}
    for p in points:
        lines.setdefault((p["engine"], p["policy"]), []).append(p)
    colors = plt.get_cmap("tab20").colors  # more series than the default cycle's 10 colours
    markers = "oDsP^vX<>*ph"
    engines = list(dict.fromkeys(engine for engine, _ in lines))
    for i, ((engine, policy), pts) in enumerate(lines.items()):
        ax.plot([p["tokens_x"] for p in pts], [p["rate_x"] for p in pts], marker=markers[engines.index(engine) % len(markers)],
                ms=5, lw=1, color=colors[i % len(colors)], label=f"{engine}, {policy}")
    ax.axvline(TOKENS_TARGET, color="grey", ls="--", lw=0.8)
    ax.axhline(RATE_TARGET, color="grey", ls="--", lw=0.8)
    top = max(1.02, max(p["rate_x"] for p in points) + 0.01)
    right = max(TOKENS_TARGET + 0.1, max(p["tokens_x"] for p in points) + 0.05)
    ax.fill_between([TOKENS_TARGET, right], RATE_TARGET, top, color="green", alpha=0.08, label="target")
    ax.set_xlim(right=right)
    ax.set_ylim(top=top)
    ax.set_xlabel("tokens per step under the cap / no offload's")
    ax.set_ylabel("tokens/s / no offload's (under the cap)")
    ax.set_title(f"Tokens under a memory cap: {shape}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="moe_step JSON results, each with an optional =TAG")
    p.add_argument("--shape", default="big-ffn")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--stem")
    a = p.parse_args(argv)
    points, sources = [], []
    for spec in a.runs:
        name, _, tag = spec.partition("=") if not Path(spec).exists() else (spec, "", "")
        path = Path(name)
        try:
            result = read_result(path)
        except (OSError, EOFError, ValueError) as exc:  # missing, not gzip, not JSON
            print(f"moe_step_cap_chart.py: cannot read {path}: {exc}", file=sys.stderr)
            return 2
        found = cap_points(result, a.shape, tag)
        points += found
        sources.append(f"{path.name}{f' [{tag}]' if tag else ''} ({result.get('gpu')}, {result.get('date')}): "
                       f"{len(found)} runs under the cap")
    if not points:
        print(f"moe_step_cap_chart.py: no run under a cap of shape {a.shape!r} in {[str(r) for r in a.runs]}",
              file=sys.stderr)
        return 1
    stem = a.stem or f"moe_step_cap_{a.shape}"
    a.out.mkdir(parents=True, exist_ok=True)
    text = markdown(points, a.shape, sources)
    (a.out / f"{stem}.md").write_text(text)
    print(text)
    drew = chart(points, a.shape, a.out / f"{stem}.png")
    print(f"wrote {a.out / (stem + '.md')}" + (f", {a.out / (stem + '.png')}" if drew else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
