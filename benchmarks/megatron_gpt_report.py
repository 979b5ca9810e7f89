"""The report of ``benchmarks/megatron_gpt.py``: each job's ranks merged into a row, rows compared
with stock and ours at the same EP, the targets (see megatron_gpt.py), and the markdown tables
(with the numerics jobs') and chart.

Pure functions over the result dicts (no torch, no GPU): tested on synthetic rows
(tests/test_megatron_gpt_bench.py).
"""

from __future__ import annotations

import re
from pathlib import Path

from bench_common import pyplot, save_png
from megatron_gpt_model import PRECISIONS, split_precision

OFFLOADING = ("ours+megatron", "ours+teo", "ours+teo-ahead", "ours+teo-layer")  # variants (at any precision) that offload

TARGETS = {"speedup_ep2": 1.7, "offload_cost_ep2": 1.03}


def merge_variant(per_rank: list[dict], ep: int, name: str, failure: str | None = None) -> dict:
    """One row for a variant from its job's ranks (each ``{"row": ..., "weights_digest": ...}``):
    the slowest rank's step, the largest peak, floor and offload, every rank's first loss; the
    job's failure makes the row an error."""
    if failure is not None or not per_rank:
        return {"variant": name, "ep": ep, "error": failure or "no rank wrote a result"}
    rows = [r["row"] for r in per_rank]
    row = dict(rows[0])
    row.pop("rank", None)
    row["ranks"] = len(rows)
    for key in ("step_ms", "step_ms_min", "step_ms_max", "peak_GiB", "peak_above_floor_GiB", "floor_GiB",
                "offloaded_MiB_per_step"):
        row[key] = max(r[key] for r in rows)
    row["first_losses"] = [r["first_loss"] for r in rows]
    row["first_loss"] = sum(row["first_losses"]) / len(rows)
    row["weights_digest"] = [r.get("weights_digest") for r in per_rank]
    for key in ("teo_pinned_allocations_timed", "teo_pinned_MiB_timed", "teo_pinned_ms_timed", "teo_pinned_timed",
                "teo_oversized_reuses_timed", "step_ms_each", "host_profile", "timed_losses", "experts_eager_forwards_timed"):
        row[key + "_per_rank"] = [r.get(key) for r in rows]
        row.pop(key, None)
    row["profile_per_rank"] = [r.get("profile") for r in rows] if any(r.get("profile") for r in rows) else None
    row.pop("profile", None)
    return row


def graphs_sentence(rows: list[dict]) -> str:
    """What the timed steps ran under CUDA graphs ("" where none did)."""
    graphed = [r for r in rows if r.get("cuda_graphs")]
    if not graphed:
        return ""
    modules = ", ".join(graphed[0]["cuda_graphs"])
    if all("graph_capture_s" in r and r["graph_capture_s"] is None for r in graphed):
        return (f" Megatron's per-layer CUDA graphs of {modules} configured but never captured (--no-capture): "
                "every step eager, as the graphed run's eager twin.")
    capture = max(r.get("graph_capture_s") or 0.0 for r in graphed)
    experts = "the experts in the MoE layers' graphs" if "moe" in graphed[0]["cuda_graphs"] else "the experts eager"
    return (f" Timed steps with Megatron's per-layer CUDA graphs of {modules} (TE's make_graphed_callables, "
            f"captured after the warm-up in up to {capture:.1f} s; {experts}).")


def capacity_sentence(config: dict) -> str:
    """Megatron's drop-and-pad MoE where the run set a capacity factor ("" where it kept every token)."""
    factor = config.get("capacity_factor")
    if factor is None:
        return ""
    return (f" Drop-and-pad MoE in the timed steps: each expert takes at most {factor:g}x its even share of the "
            "routed tokens, its input padded to that capacity (tokens past it dropped); the numerics job keeps "
            "every token.")


def add_comparisons(rows: list[dict], tokens_per_rank: int) -> None:
    """Per row: tokens/s over all ranks, speed against stock (bf16) and ours at the same EP and
    precision, memory freed against that ours (from each one's peak above its own floor), the
    first step's loss against stock's and (variants of ours) whether it equals that ours' bitwise,
    and the tokens that fit under its peak (predicted). Losses are compared only between jobs that
    started from the same weights."""
    for row in rows:
        if "error" in row:
            continue
        same = {r["variant"]: r for r in rows if r.get("ep") == row["ep"] and "error" not in r}
        row["tokens_per_s"] = tokens_per_rank * row["ranks"] / (row["step_ms"] * 1e-3)
        stock, ours = same.get("stock"), same.get(_ours_of(row["variant"]))
        row["speedup_vs_stock"] = stock["step_ms"] / row["step_ms"] if stock else None
        row["step_vs_ours"] = row["step_ms"] / ours["step_ms"] if ours else None
        row["freed_vs_ours_GiB"] = ours["peak_above_floor_GiB"] - row["peak_above_floor_GiB"] if ours else None

        def alike(other):
            return other is not None and other.get("weights_digest") == row.get("weights_digest")

        stock_alike = same.get("stock" + split_precision(row["variant"])[1])  # the loss at the same precision
        row["loss_rel_err_vs_stock"] = abs(row["first_loss"] - stock_alike["first_loss"]) / abs(stock_alike["first_loss"]) \
            if alike(stock_alike) else None
        row["loss_equal_to_ours"] = row["first_losses"] == ours["first_losses"] \
            if alike(ours) and row is not ours and row["variant"].startswith("ours") else None
        # activations grow with the tokens of a micro-batch: under ours' peak as a cap, the tokens
        # this variant fits, predicted from its peak above its floor
        if ours and row["peak_above_floor_GiB"] > 0:
            room = ours["peak_GiB"] - row["floor_GiB"]
            row["tokens_under_ours_peak_x"] = room / row["peak_above_floor_GiB"]
        else:
            row["tokens_under_ours_peak_x"] = None


def _ours_of(name: str) -> str:
    """The no-offload variant of ours at ``name``'s precision: what its costs are measured against."""
    return "ours" + split_precision(name)[1]


def _possessive(name: str) -> str:
    return "ours'" if name == "ours" else f"{name}'s"


def targets(rows: list[dict]) -> list[dict]:
    """The targets, each with the figure reached (None where its rows were not run)."""
    def get(ep, name):
        return next((r for r in rows if r.get("ep") == ep and r["variant"] == name and "error" not in r), None)

    out = []
    ours2, stock2 = get(2, "ours"), get(2, "stock")
    out.append({"target": "ours at EP=2 >= 1.7x stock's step", "value": ours2 and ours2["speedup_vs_stock"],
                "met": None if not (ours2 and stock2) else ours2["speedup_vs_stock"] >= TARGETS["speedup_ep2"]})
    for row in rows:
        if row.get("loss_equal_to_ours") is not None:
            out.append({"target": f"{row['variant']}'s first loss equals {_possessive(_ours_of(row['variant']))} "
                                  f"bitwise (EP={row['ep']})",
                        "value": f"{row['first_loss']:.6f}", "met": row["loss_equal_to_ours"]})
    # the offloading choices at any precision (ours+copies is a diagnostic: copies with no engine)
    for name in [r["variant"] for r in rows if r.get("ep") == 2 and split_precision(r["variant"])[0]
                 .removesuffix("+wc").removesuffix("+kdtoh") in OFFLOADING]:
        row = get(2, name)
        cost = row and row.get("step_vs_ours")  # None without ours' row at EP=2
        out.append({"target": f"{name} at EP=2 costs <= 3% over {_ours_of(name)}", "value": cost,
                    "met": None if cost is None else cost <= TARGETS["offload_cost_ep2"]})
    for ep in (1, 2):
        for name in [r["variant"] for r in rows if r.get("ep") == ep and r["variant"].startswith("ours+teo")]:
            teo, megatron = get(ep, name), get(ep, "ours+megatron" + split_precision(name)[1])
            if megatron and teo and None not in (teo["freed_vs_ours_GiB"], megatron["freed_vs_ours_GiB"]):
                frees = teo["freed_vs_ours_GiB"] >= megatron["freed_vs_ours_GiB"] - 1 / 64
                cheaper = teo["step_ms"] <= megatron["step_ms"]
                out.append({"target": f"{name} frees >= {megatron['variant']} at no more cost (EP={ep})",
                            "value": f"freed {teo['freed_vs_ours_GiB']:.2f} vs {megatron['freed_vs_ours_GiB']:.2f} GiB, "
                                     f"step {teo['step_ms']:.1f} vs {megatron['step_ms']:.1f} ms",
                            "met": frees and cheaper})
                more = (teo["tokens_under_ours_peak_x"] or 0) > (megatron["tokens_under_ours_peak_x"] or 0)
                out.append({"target": f"{name} fits more tokens than {megatron['variant']} under ours' peak (EP={ep}, "
                                      "predicted)",
                            "value": f"x{teo['tokens_under_ours_peak_x']:.2f} vs x{megatron['tokens_under_ours_peak_x']:.2f}",
                            "met": more})
    return out


def cap_targets(cap: list[dict] | None) -> list[dict]:
    """Tokens per step under the cap: each teo variant against Megatron's offloading and ours."""
    if not cap:
        return []
    found = {r["variant"]: r for r in cap}
    out = []
    for name, row in found.items():
        megatron = found.get("ours+megatron" + split_precision(name)[1])  # at the same precision
        if name.startswith("ours+teo") and megatron is not None:
            a, b = row["tokens_per_step"] or 0, megatron["tokens_per_step"] or 0
            out.append({"target": f"{name} fits more tokens than {megatron['variant']} under {row['cap_GiB']:g} GiB "
                                  "(EP=1)",
                        "value": f"{a} vs {b} tokens per step", "met": a > b})
    return out


COLUMNS = [  # header, key, format
    ("EP", "ep", "{}"), ("variant", "variant", "{}"), ("experts ran as", "experts_path", "{}"),
    ("step ms", "step_ms", "{:.1f}"), ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("vs stock", "speedup_vs_stock", "{:.2f}x"), ("vs ours", "step_vs_ours", "{:.3f}"),
    ("peak GiB", "peak_GiB", "{:.2f}"), ("above floor GiB", "peak_above_floor_GiB", "{:.2f}"),
    ("freed vs ours GiB", "freed_vs_ours_GiB", "{:.2f}"), ("offloaded MiB/step", "offloaded_MiB_per_step", "{:.0f}"),
    ("tokens under ours' peak", "tokens_under_ours_peak_x", "x{:.2f}"),
    ("loss vs stock", "loss_rel_err_vs_stock", "{:.1e}"), ("loss = ours'", "loss_equal_to_ours", "{}"),
]


def cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return fmt.format(value)


def weights_lines(rows: list) -> list:
    """A warning where the variants of one EP started from different weights (their processes' digests
    differ): the loss columns then compare only the rows with equal digests."""
    out = []
    for ep in sorted({r.get("ep") for r in rows if "error" not in r and r.get("ep") is not None}):
        digests = {}
        for r in rows:
            digest = r.get("weights_digest")
            if r.get("ep") == ep and "error" not in r and digest is not None and digest != [None] * len(digest):
                digests.setdefault(repr(r["weights_digest"]), []).append(r["variant"])
        if len(digests) > 1:
            groups = "; ".join(", ".join(names) for names in digests.values())
            out.append(f"Weights at EP={ep}: the variants' processes started from different weights ({groups}); "
                       "the loss columns compare only variants that started alike.")
    return ["", *out] if out else []


def precision_phrase(variants) -> str:
    """How the variants compute: bf16, FP8 under the recipes their names end in, or both."""
    suffixes = sorted({split_precision(v)[1] for v in variants} - {""})
    if not suffixes:
        return "bf16"
    named = "; ".join(f"`{s}`: Megatron's fp8={PRECISIONS[s][0]!r}, fp8_recipe={PRECISIONS[s][1]!r}" for s in suffixes)
    if all(split_precision(v)[1] for v in variants):
        return f"FP8 ({named})"
    return f"bf16, and FP8 in the variants that name a recipe ({named})"


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# Megatron-Core GPT-MoE training step on {result['gpu']} ({result['date']})", "",
        f"megatron-core {result['versions']['megatron-core']}, TE {result['versions']['transformer-engine']}, "
        f"torch {result['versions']['torch']}. GPTModel (TE layer spec), {c['layers']} MoE layers, H={c['hidden']}, "
        f"{c['heads']} heads, E={c['experts']} top-{c['topk']}, F={c['ffn']}, vocab {c['vocab']}, "
        f"{c['microbatches']} x {c['micro_batch']} x {c['seq']} tokens per rank per step, "
        f"{precision_phrase(c.get('variants', []))}, alltoall dispatcher, "
        "Megatron DDP + distributed Adam; median of "
        f"{c['iters']} steps after {c['warmup']} (the slowest rank's); each variant at each EP in processes of its "
        "own. Peak: memory allocated; floor: allocated between steps; freed vs ours: ours' peak above its floor "
        "less this one's. Offloaded: per rank per step. Tokens under ours' peak: predicted from the peak above the "
        "floor (activations scale with tokens). Loss: the first step against stock's and ours' (same weights and "
        "tokens)." + graphs_sentence(result["rows"]) + capacity_sentence(c)
        + (f" Command: `{result['command']}`" if result.get("command") else ""),
        "",
    ]
    repeats = c.get("repeats", 1) > 1
    columns = COLUMNS + ([("step ms of each run", "step_ms_runs_text", "{}"),
                          ("vs ours in each round", "step_vs_ours_runs_text", "{}")] if repeats else [])
    if repeats:
        lines[-2] += (f" Each variant ran {c['repeats']} times, in rounds through the variants; its row is the run "
                      "with the median step.")
    if result.get("complete") is False:
        lines[-2] += (" The run was stopped before its last jobs: the rows hold the runs that finished, the "
                      "runs column how many.")
    lines += ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row.get('ep')} | {row['variant']} | failed: {row['error'][:120]} |"
                         + " |" * (len(columns) - 3))
            continue
        runs = row.get("step_ms_runs") or []
        ratios = round_ratios(row, result["rows"])
        row = {**row, "step_ms_runs_text": " / ".join("failed" if x is None else f"{x:.1f}" for x in runs) or None,
               "step_vs_ours_runs_text": " / ".join("-" if x is None else f"{x:.3f}" for x in ratios) or None}
        lines.append("| " + " | ".join(cell(row.get(k), f) for _, k, f in columns) + " |")
    lines += weights_lines(result["rows"])
    lines += numerics_lines(result.get("numerics") or {})
    if result.get("targets"):
        lines += ["", "| target | reached | met |", "|---|---|---|"]
        for t in result["targets"]:
            value = t["value"]
            value = "-" if value is None else (f"{value:.3g}" if isinstance(value, float) else value)
            lines.append(f"| {t['target']} | {value} | {'-' if t['met'] is None else 'yes' if t['met'] else 'no'} |")
    if result.get("cap"):
        c = result["config"]
        lines += ["", f"Under a {c['cap_gib']:g} GiB cap (EP=1; the allocator limited to it; micro-batches "
                      f"{c['micro_batch']}..{c['cap_max_micro_batch']} tried upward):", "",
                  "| variant | most sequences per micro-batch | tokens per step | step ms | tokens/s | peak GiB |",
                  "|---|---|---|---|---|---|"]
        for r in result["cap"]:
            b = r["best"]
            if r.get("error"):
                lines.append(f"| {r['variant']} | failed: {r['error'][:120]} | - | - | - | - |")
            elif b is None:
                lines.append(f"| {r['variant']} | none fits | - | - | - | - |")
            else:
                lines.append(f"| {r['variant']} | {b['micro_batch']}{' (the most tried)' if r['hit_max'] else ''} | "
                             f"{r['tokens_per_step']} | {b['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
                             f"{b['peak_GiB']:.2f} |")
    profiled = [r for r in result["rows"] if r.get("profile_per_rank")]
    if profiled:
        lines += ["", "Offload copies against NCCL (per step, rank 0 .. n; `--profile`):", "",
                  "| EP | variant | rank | NCCL ms | offload d2h ms | offload h2d ms | beside NCCL ms | dispatcher "
                  "copies | their wait ms | of it behind offload copies ms | by kernel: count, wait ms |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in profiled:
            for rank, p in enumerate(row["profile_per_rank"]):
                if p is None:
                    continue
                s, k = p["small_d2h"], p["kernel_dtoh"]
                lines.append(f"| {row['ep']} | {row['variant']} | {rank} | {p['nccl_ms']:.1f} | {p['offload_d2h_ms']:.1f} | "
                             f"{p['offload_h2d_ms']:.1f} | {p['overlap_ms']:.1f} | {s['count']:.0f} | {s['wait_ms']:.2f} | "
                             f"{s['wait_behind_offload_ms']:.2f} | {k['count']:.0f}, {k['wait_ms']:.2f} |")
        lines += idle_lines(profiled)
    lines += precision_lines(result["rows"])
    lines += host_lines(result["rows"])
    lines += host_growth_lines(result["rows"])
    pinned = [r for r in result["rows"]
              if any(n is not None for n in r.get("teo_pinned_allocations_timed_per_rank") or [])]
    if pinned:
        lines += ["", "Pinned host buffers teo allocated during the timed steps (per rank; host ms: the time "
                      "the host spent pinning them; larger reused: requests served by a free buffer far larger "
                      "than they needed instead):", "",
                  "| EP | variant | buffers | MiB | host ms | larger reused |", "|---|---|---|---|---|---|"]
        for r in pinned:
            ranks = len(r["teo_pinned_MiB_timed_per_rank"])
            buffers = " / ".join(str(n) for n in r["teo_pinned_allocations_timed_per_rank"])
            mib = " / ".join(f"{m:.0f}" for m in r["teo_pinned_MiB_timed_per_rank"])
            ms = " / ".join("-" if m is None else f"{m:.1f}" for m in
                            r.get("teo_pinned_ms_timed_per_rank") or [None] * ranks)
            larger = " / ".join("-" if m is None else str(m) for m in
                                r.get("teo_oversized_reuses_timed_per_rank") or [None] * ranks)
            lines.append(f"| {r['ep']} | {r['variant']} | {buffers} | {mib} | {ms} | {larger} |")
        allocations = [(r, rank, a) for r in pinned for rank, found in enumerate(r.get("teo_pinned_timed_per_rank") or [])
                       for a in found or []]
        if allocations:
            lines += ["", "Each of those allocations: the request that found no free buffer, and what the pool "
                          "held then:", "",
                      "| EP | variant | rank | requested MiB | allocated MiB | host ms | buffers in use | free "
                      "buffers | largest free MiB |", "|---|---|---|---|---|---|---|---|---|"]
            for r, rank, a in allocations:
                lines.append(f"| {r['ep']} | {r['variant']} | {rank} | {a['requested'] / 2**20:.1f} | "
                             f"{a['allocated'] / 2**20:.1f} | {a['seconds'] * 1e3:.1f} | {a['in_use']} | {a['free']} | "
                             f"{a['largest_free'] / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


def round_ratios(row: dict, rows: list[dict]) -> list:
    """Each round's step of a variant run ``--repeats`` times against ours' (same EP and precision)
    in the same round: ours ran minutes before it at most, so slow spells of the host cancel."""
    ours = next((r for r in rows if r.get("ep") == row.get("ep") and "error" not in r
                 and r["variant"] == "ours" + split_precision(row["variant"])[1]), None)
    if ours is None:
        return []
    return [None if a is None or b is None else a / b
            for a, b in zip(row.get("step_ms_runs") or [], ours.get("step_ms_runs") or [])]


def precision_comparisons(rows: list[dict]) -> list[dict]:
    """Each FP8 row against its bf16 variant at the same EP: step time, peak above the floor, and
    the tokens it would fit under the bf16 variant's peak (predicted as for ours' peak)."""
    found = {(r["ep"], r["variant"]): r for r in rows if "error" not in r}
    out = []
    for (ep, name), row in found.items():
        plain, precision = split_precision(name)
        bf16 = found.get((ep, plain))
        if not precision or bf16 is None:
            continue
        tokens = (bf16["peak_GiB"] - row["floor_GiB"]) / row["peak_above_floor_GiB"] \
            if row["peak_above_floor_GiB"] > 0 else None
        out.append({"ep": ep, "variant": name, "bf16": plain, "step_ms": row["step_ms"], "bf16_step_ms": bf16["step_ms"],
                    "speedup": bf16["step_ms"] / row["step_ms"], "above_floor_GiB": row["peak_above_floor_GiB"],
                    "bf16_above_floor_GiB": bf16["peak_above_floor_GiB"], "tokens_under_bf16_peak_x": tokens})
    return out


def precision_lines(rows: list[dict]) -> list[str]:
    found = precision_comparisons(rows)
    if not found:
        return []
    out = ["", "FP8 against bf16 (each FP8 variant against the same variant in bf16, same EP; in FP8 the router "
               "pads each expert's tokens for the quantized GEMMs unless moe_preprocess is graphed or the experts drop and pad to a capacity; tokens: predicted "
               "under the bf16 variant's peak):", "",
           "| EP | variant | step ms | bf16 step ms | speed-up | above floor GiB | bf16 above floor GiB | tokens x |",
           "|---|---|---|---|---|---|---|---|"]
    for c in found:
        tokens = "-" if c["tokens_under_bf16_peak_x"] is None else f"x{c['tokens_under_bf16_peak_x']:.2f}"
        out.append(f"| {c['ep']} | {c['variant']} | {c['step_ms']:.1f} | {c['bf16_step_ms']:.1f} | {c['speedup']:.3f} | "
                   f"{c['above_floor_GiB']:.2f} | {c['bf16_above_floor_GiB']:.2f} | {tokens} |")
    return out


def host_lines(rows: list[dict], top: int = 12) -> list[str]:
    """Per variant, rank 0's host time per step under cProfile and the functions that took most of
    it themselves (``--host-profile``)."""
    out = []
    for row in rows:
        host = (row.get("host_profile_per_rank") or [None])[0]
        if not host:
            continue
        out += ["", f"Host time under cProfile, EP={row['ep']} {row['variant']} (rank 0): {host['wall_ms']:.1f} ms "
                    "per step; the functions that took most of it themselves:", "",
                "| function | self ms/step | cumulative ms/step | calls/step |", "|---|---|---|---|"]
        out += [f"| `{function_label(r['function'])}` | {r['self_ms']:.2f} | {r['cum_ms']:.2f} | {r['calls']:.0f} |"
                for r in host["top"][:top]]
        if host.get("package_top"):
            out += ["", f"Of it, te_offload_ops' own functions: {host['package_self_ms']:.1f} ms per step; by "
                        "cumulative time:", "", "| function | self ms/step | cumulative ms/step | calls/step |",
                    "|---|---|---|---|"]
            out += [f"| `{r['function']}` | {r['self_ms']:.2f} | {r['cum_ms']:.2f} | {r['calls']:.0f} |"
                    for r in host["package_top"][:top]]
    return out


def function_label(name: str) -> str:
    """A profiled function's name without the object address cProfile gives some
    (``<function Event.synchronize at 0x7f...>``): the same function in two processes, one name."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", name)


def host_growth(base: dict, other: dict) -> list[dict]:
    """Per function, how much more self time a step ``other``'s host profile spent than ``base``'s
    (functions kept in either; a function absent from one counts as zero there), largest first."""
    def by_name(host):
        named: dict = {}
        for r in host.get("functions", []):
            into = named.setdefault(function_label(r["function"]), {"self_ms": 0.0, "calls": 0.0})
            into["self_ms"] += r.get("self_ms", 0.0)
            into["calls"] += r.get("calls", 0.0)
        return named

    a, b = by_name(base), by_name(other)
    grown = []
    for name in a.keys() | b.keys():
        ra, rb = a.get(name, {}), b.get(name, {})
        grown.append({"function": name, "self_ms": rb.get("self_ms", 0.0) - ra.get("self_ms", 0.0),
                      "calls": rb.get("calls", 0.0) - ra.get("calls", 0.0),
                      "self_ms_base": ra.get("self_ms", 0.0), "self_ms_other": rb.get("self_ms", 0.0)})
    return sorted(grown, key=lambda r: -r["self_ms"])


def host_growth_lines(rows: list[dict], top: int = 15) -> list[str]:
    """Where each offloading variant's host time went beyond ours' at the same EP (rank 0), by
    function: the step's extra host time is spread over many functions or sits in a few."""
    base = {(row["ep"], row["variant"]): (row.get("host_profile_per_rank") or [None])[0] for row in rows}
    out = []
    for row in rows:
        ours = _ours_of(row["variant"])  # at the same precision
        host, ref = (row.get("host_profile_per_rank") or [None])[0], base.get((row["ep"], ours))
        if row["variant"] == ours or not host or not ref or "functions" not in host or "functions" not in ref:
            continue
        grown = host_growth(ref, host)
        more = sum(r["self_ms"] for r in grown if r["self_ms"] > 0)
        less = sum(r["self_ms"] for r in grown if r["self_ms"] < 0)
        out += ["", f"Host time under cProfile, EP={row['ep']} {row['variant']} against {ours} (rank 0): "
                    f"{host['wall_ms'] - ref['wall_ms']:+.1f} ms per step; functions that grew add {more:.1f} ms, "
                    f"those that shrank {less:.1f}; the {top} that grew most:", "",
                f"| function | {ours} self ms/step | this self ms/step | grew ms | calls/step more |", "|---|---|---|---|---|"]
        out += [f"| `{r['function']}` | {r['self_ms_base']:.2f} | {r['self_ms_other']:.2f} | {r['self_ms']:+.2f} | "
                f"{r['calls']:+.0f} |" for r in grown[:top]]
    return out


IDLE_GROUPS = (("host busy", ("host: busy",)), ("host blocked in a sync", ("host: blocked",)),
               ("waiting on another stream's kernel (NCCL's, a side stream's)", ("wait: kernel",)),
               ("waiting on a copy", ("wait: D2H", "wait: H2D", "wait: D2D")))


def idle_lines(profiled: list[dict]) -> list[str]:
    """The compute stream's idle time per step by cause, per rank (``--profile``)."""
    rows = []
    for row in profiled:
        for rank, p in enumerate(row["profile_per_rank"]):
            idle = (p or {}).get("idle")
            if not idle:
                continue
            grouped = {name: 0.0 for name, _ in IDLE_GROUPS}
            other = 0.0
            for cause, ms in idle["idle_ms_by_cause"].items():
                group = next((name for name, prefixes in IDLE_GROUPS if cause.startswith(prefixes)), None)
                if group is None:
                    other += ms
                else:
                    grouped[group] += ms
            split = " | ".join(f"{idle[k]:.1f}" if k in idle else "-" for k in ("compute_kernels_ms", "compute_copies_ms"))
            rows.append(f"| {row['ep']} | {row['variant']} | {rank} | {idle['gpu_ms']:.1f} | "
                        f"{idle['compute_busy_ms']:.1f} | {split} | "
                        + " | ".join(f"{grouped[name]:.1f}" for name, _ in IDLE_GROUPS) + f" | {other:.1f} |")
    if not rows:
        return []
    return ["", "The compute stream's busy and idle time per step (mean of the profiled steps; busy: its kernels "
            "and its own copies, each from its recorded start to its end; "
            "host: the next op not yet launched; waiting: launched, held by another stream's work):", "",
            "| EP | variant | rank | step on GPU ms | compute busy ms | of it kernels ms | of it copies ms | "
            + " | ".join(n for n, _ in IDLE_GROUPS) + " | other ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows]


def numerics_lines(numerics: dict) -> list[str]:
    """The numerics jobs' tables (megatron_gpt_numerics): per EP, what matched and the worst grad
    errors against stock; per EP and layer, the tokens routed otherwise than stock routes them."""
    if not numerics:
        return []

    def err(m, name):
        g = m["grads"][name]
        return "-" if g["max_rel_err"] is None else f"{g['max_rel_err']:.2e}"

    lines = ["", "First step of ours against stock, same weights and tokens (TE's deterministic kernels). Routing "
                 "held: stock's top-k replayed. Noise floor: stock with random noise of the size of ours' difference "
                 "at the first MoE layer on every MoE layer's output. Grads: the worst relative error over every "
                 "parameter's main_grad.", "",
             "| EP | first MoE layer: same input, same routing | its output, ours vs stock | noise reached | stock "
             "replaying its routing | loss, ours vs stock | grads, routing held: ours / floor | grads, own routing: "
             "ours / floor | worst (own routing) |", "|---|---|---|---|---|---|---|---|---|"]
    for ep, m in numerics.items():
        if "error" in m:
            lines.append(f"| {ep} | failed: {m['error'][:160]} |" + " |" * 7)
            continue
        replay_ok = m["grads"]["stock_replay"]["all_equal"] and m["loss_rel_err"]["stock_replay"] == 0
        lines.append(
            f"| {ep} | {'yes' if m['moe0_input_equal'] else 'no'}, {m['flips']['ours'][0]} tokens routed otherwise | "
            f"{m['moe0_output_rel_err']:.2e} | {m['noise_rel_achieved']:.2e} | "
            f"{'bitwise equal' if replay_ok else 'differs'} | {m['loss_rel_err']['ours']:.1e} | "
            f"{err(m, 'ours_replay')} / {err(m, 'noise_replay')} | {err(m, 'ours')} / {err(m, 'noise')} | "
            f"{m['grads']['ours']['worst']} |")
    lines += ["", "Tokens routed to another set of experts than stock's, per layer (all ranks):", "",
              "| EP | layer | tokens | ours | noise floor | ours, routing held |", "|---|---|---|---|---|---|"]
    for ep, m in numerics.items():
        if "error" in m:
            continue
        for layer, tokens in enumerate(m["tokens"]):
            f = m["flips"]
            lines.append(f"| {ep} | {layer} | {tokens} | {f['ours'][layer]} ({f['ours'][layer] / tokens:.2%}) | "
                         f"{f['noise'][layer]} ({f['noise'][layer] / tokens:.2%}) | {f['ours_replay'][layer]} |")
    return lines


def chart(result: dict, path: Path) -> bool:
    plt = pyplot()
    rows = [r for r in result["rows"] if "error" not in r]
    if plt is None or not rows:
        return False
    labels = [f"EP{r['ep']} {r['variant']}" for r in rows]
    colors = ["#888888" if r["variant"].startswith("stock") else "#dd8452" if r["variant"] == "ours"
              else "#4c72b0" if "megatron" in r["variant"] else "#55a868" for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(2, 1, figsize=(max(8, len(rows) * 0.9), 7.5), sharex=True)
    xs = range(len(rows))
    ax_t.bar(xs, [r["step_ms"] for r in rows], color=colors)
    ax_t.set_ylabel("step time (ms)")
    ax_m.bar(xs, [r["peak_GiB"] for r in rows], color=colors)
    ax_m.bar(xs, [r["floor_GiB"] for r in rows], color="none", edgecolor="black", hatch="//", label="floor")
    ax_m.set_ylabel("peak memory allocated (GiB)")
    ax_m.legend(loc="upper left")
    ax_m.set_xticks(list(xs), labels, rotation=35, ha="right", fontsize=8)
    c = result["config"]
    fig.suptitle(f"Megatron GPT-MoE on {result['gpu']}: {c['layers']} layers, H={c['hidden']}, E={c['experts']} "
                 f"top-{c['topk']}, F={c['ffn']} (grey stock, orange ours, blue Megatron offload, green teo)",
                 fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=110)
    plt.close(fig)
    return True
