#!/usr/bin/env python3
"""One report from several ``moe_step.py`` runs of the same shapes on the same GPU.

Engines can run in separate calls (``--engines v2``, then ``--engines teo``, ...: where a machine's
calls are limited in time, say); this puts their results side by side as one run would (rows, cap
searches, targets per engine), after checking that they are comparable: the same GPU, path (fused
or unfused), steps timed and allocator setting, and per shape the same dimensions, layers,
sequences and tokens. Each engine's rows stay against its own process's no-offload step.

    python3 benchmarks/moe_step_combine.py A.json B.json [--out DIR] [--stem NAME]

Writes NAME.{json,md,png} (default: the first input's name with "_combined").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_common import read_result  # noqa: E402
from moe_step_report import finish, write_reports  # noqa: E402

# what must agree for rows of two runs to be compared
RUN_KEYS = ("gpu", "alloc_conf")
CONFIG_KEYS = ("unfused", "quick", "warmup", "iters", "cap_slowdown")
SHAPE_KEYS = ("shape", "layers", "batch", "seq", "dtype", "attention", "path")


class NotComparable(ValueError):
    pass


def _same(what: str, values: list, sources: list[str]) -> None:
    if any(v != values[0] for v in values[1:]):
        shown = ", ".join(f"{s}: {v!r}" for s, v in zip(sources, values))
        raise NotComparable(f"{what} differs between the runs ({shown})")


def combine(results: list[dict], sources: list[str]) -> dict:
    """The runs of ``results`` (moe_step JSON, before or after ``finish``) as one result, derived
    again; ``sources`` name them in errors and in the result."""
    if len(results) < 2:
        raise ValueError(f"need at least two results to combine, got {len(results)}")
    for r, src in zip(results, sources):
        if r.get("benchmark") != "moe_step":
            raise NotComparable(f"{src} is not a moe_step result (benchmark={r.get('benchmark')!r})")
    for key in RUN_KEYS:
        _same(key, [r.get(key) for r in results], sources)
    for key in CONFIG_KEYS:
        _same(f"config.{key}", [r["config"].get(key) for r in results], sources)
    pcie, engines, policies = {}, [], []
    for r, src in zip(results, sources):
        for engine, bw in r["pcie"].items():
            if engine in pcie:
                raise NotComparable(f"engine {engine!r} is in more than one run ({src} and an earlier one)")
            pcie[engine] = bw
        engines += r["config"]["engines"]
        policies += [p for p in r["config"]["policies"] if p not in policies]
    shapes: dict[str, dict] = {}
    for r, src in zip(results, sources):
        for s in r["shapes"]:
            if s["name"] not in shapes:
                shapes[s["name"]] = {**{k: s.get(k) for k in ("name", *SHAPE_KEYS)}, "runs": [], "failed": {}}
            into = shapes[s["name"]]
            for key in SHAPE_KEYS:
                if s.get(key) != into[key] and not (key == "path" and None in (s.get(key), into[key])):
                    raise NotComparable(f"shape {s['name']!r}: {key} is {into[key]!r} in an earlier run, "
                                        f"{s.get(key)!r} in {src}")
            into["path"] = into["path"] or s.get("path")
            into["runs"] += [{k: v for k, v in run.items() if k != "cap_ceiling"} for run in s["runs"]]
            into["failed"].update(s.get("failed", {}))
    target = next((r["config"].get("memory_target_GiB") for r in results
                   if r["config"].get("memory_target_GiB") is not None), None)
    # the margin sets teo-b's budget only, the slack teo-t's: each from the run with that engine
    # (an engine is in one run at most)
    margin = next((r["config"].get("budget_margin_GiB") for r in results if "teo-b" in r["config"]["engines"]),
                  results[0]["config"].get("budget_margin_GiB"))
    slack = next((r["config"].get("target_slack_GiB") for r in results if "teo-t" in r["config"]["engines"]), None)
    freed = next((r["config"].get("target_freed") for r in results if "teo-t" in r["config"]["engines"]), None)
    out = {
        "benchmark": "moe_step", "gpu": results[0]["gpu"],
        "date": " / ".join(dict.fromkeys(r["date"] for r in results)),
        "alloc_conf": results[0].get("alloc_conf"),
        "config": {**results[0]["config"], "engines": engines, "policies": policies, "memory_target_GiB": target,
                   "budget_margin_GiB": margin, "target_slack_GiB": slack, "target_freed": freed},
        "pcie": pcie,
        "shapes": list(shapes.values()),
        "combined_from": [{"source": src, "date": r["date"], "engines": r["config"]["engines"]}
                          for r, src in zip(results, sources)],
    }
    finish(out, target)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", type=Path, help="moe_step JSON files (.json or .json.gz), two or more")
    p.add_argument("--out", type=Path, help="folder for the report (default: the first input's)")
    p.add_argument("--stem", help="file name without extension (default: the first input's + '_combined')")
    args = p.parse_args(argv)
    try:
        results = [read_result(path) for path in args.inputs]
        result = combine(results, [str(path) for path in args.inputs])
    except (OSError, EOFError, json.JSONDecodeError, ValueError) as exc:
        print(f"moe_step_combine.py: {exc}", file=sys.stderr)
        return 2
    out = args.out or args.inputs[0].parent
    stem = args.stem or Path(args.inputs[0].name.removesuffix(".gz")).stem + "_combined"
    paths = write_reports(result, out, stem)
    print(f"wrote {', '.join(str(x) for x in paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
