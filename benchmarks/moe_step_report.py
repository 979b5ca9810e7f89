"""The MoE step benchmark's bookkeeping and reports, from a results dict (no GPU, no torch).

Every row comes from one engine's process (``run``) and is compared with the no-offload row of the
same process and shape: clocks and allocator state differ between processes.

* peak: the most memory allocated at any point of the step (forward, backward, optimizer) above
  the static floor (weights, preallocated grads, optimizer state, workspaces kept between steps);
* freed / offloaded: (no-offload peak - this peak) / bytes the engine offloaded per step;
* PCIe bound: max(fwd, bytes / BW_d2h) + max(bwd, bytes / BW_h2d) + optimizer, from the
  no-offload run's phase times and the bandwidth measured in the same process;
* peak-neutral bound (whole layers, n < L): the PCIe bound of a schedule that never raises the
  step's peak and moves whole layers (teo and TE's engines do). What moved must be off the GPU
  when the backward begins (its peak), so the forward takes at least the copies to the host; no
  whole layer's reload fits before the first layer's backward has freed room, and the last
  offloaded layer's backward follows its reload, so the backward takes at least 2 bwd / L (bwd / L:
  the average layer) + the copies back. A finer schedule (part of a layer reloaded as autograd
  frees the saved tensors of the layer before, or copies to the host running into the backward's
  headroom) could go under it. max(fwd, bytes / BW_d2h) + max(bwd, 2 bwd / L + bytes / BW_h2d)
  + optimizer;
* cap ceiling: the most tokens per step under a cap, x no offload, for a step <= 5% slower whose
  copies to the host happen within the forward (the peak is at the start of the backward):
  1 / (1 - BW_d2h * (fwd + 0.05 step) / no-offload peak).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterable, Optional

import bench_common
from bench_common import pyplot, save_png

MiB = 2**20
GiB = 2**30

TARGETS = {  # the project's targets: name -> (what, bound, "max" or "min")
    # MLP offload, judged apart at n < L and n = L: at n = L the layer whose backward comes first
    # makes its round trip with no compute left to hide it under, and frees nothing at the peak
    "mlp_step": ("MoE-MLP offload, n < L: step / no offload", 1.03, "max"),
    "mlp_step_all": ("MoE-MLP offload, n = L: step / no offload", 1.03, "max"),
    "layer_bound": ("whole layers, any n: step / PCIe bound", 1.10, "max"),
    # n = L is left out: the layer whose backward comes first is back on the GPU when the backward
    # begins, under any schedule, so at most (L-1)/L of its bytes can be freed at that peak
    "freed": ("peak freed / bytes offloaded, n < L", 0.95, "min"),
    "cap_tokens": ("tokens per step under the cap / no offload, at >= 0.95x its tokens/s", 1.5, "min"),
}
CAP_RATE_FLOOR = 0.95  # "at <= 5% lower tokens/s"


def policy_label(scope: str, layers: int, total: int) -> str:
    if scope == "none":
        return "none"
    return f"{'MLP' if scope == 'mlp' else 'layer'} {layers}/{total}"


# ------------------------------------------------------------------------------------------------
# Per-row derivations


def transfer_ms(nbytes: float, gbps: float) -> float:
    return nbytes / (gbps * 1e9) * 1e3


def pcie_bound_ms(ref: dict, offloaded_bytes: float, pcie: dict) -> float:
    """Lower bound on the step: each direction's copies hide at best under that phase's compute."""
    return (max(ref["fwd_ms"], transfer_ms(offloaded_bytes, pcie["d2h_GBps"]))
            + max(ref["bwd_ms"], transfer_ms(offloaded_bytes, pcie["h2d_GBps"]))
            + ref["opt_ms"])


def peak_neutral_bound_ms(ref: dict, offloaded_bytes: float, pcie: dict, model_layers: int) -> float:
    """Lower bound on the step of whole-layer offload (n < L) under a schedule that keeps the
    no-offload peak less what moved (see the module doc)."""
    if model_layers < 1:
        raise ValueError(f"need model_layers >= 1, got {model_layers}")
    layer_bwd = ref["bwd_ms"] / model_layers
    return (max(ref["fwd_ms"], transfer_ms(offloaded_bytes, pcie["d2h_GBps"]))
            + max(ref["bwd_ms"], 2 * layer_bwd + transfer_ms(offloaded_bytes, pcie["h2d_GBps"]))
            + ref["opt_ms"])


def no_offload_row(rows: Iterable[dict]) -> Optional[dict]:
    return next((r for r in rows if r["scope"] == "none" and not r.get("error")), None)


def derive_rows(rows: list[dict], pcie: dict, model_layers: Optional[int] = None) -> None:
    """Adds vs_none, freed_MiB, freed_per_offloaded, bound_ms and vs_bound to each row of one run,
    and, given ``model_layers``, pn_bound_ms and vs_pn_bound to its whole-layer rows with n < L."""
    ref = no_offload_row(rows)
    for r in rows:
        for key in ("vs_none", "freed_MiB", "freed_per_offloaded", "bound_ms", "vs_bound", "rate_vs_none",
                    "pn_bound_ms", "vs_pn_bound"):
            r[key] = None
        if r.get("error") or ref is None:
            continue
        r["vs_none"] = r["step_ms"] / ref["step_ms"]
        r["rate_vs_none"] = r["tokens_per_s"] / ref["tokens_per_s"]
        if r["scope"] == "none":
            continue
        moved = r["offloaded_MiB"] * MiB
        r["freed_MiB"] = ref["peak_above_MiB"] - r["peak_above_MiB"]
        r["freed_per_offloaded"] = r["freed_MiB"] / r["offloaded_MiB"] if moved else None
        r["bound_ms"] = pcie_bound_ms(ref, moved, pcie)
        r["vs_bound"] = r["step_ms"] / r["bound_ms"]
        if model_layers and r["scope"] == "layer" and r["layers"] < model_layers:
            r["pn_bound_ms"] = peak_neutral_bound_ms(ref, moved, pcie, model_layers)
            r["vs_pn_bound"] = r["step_ms"] / r["pn_bound_ms"]


# ------------------------------------------------------------------------------------------------
# Tokens under a memory cap


def predicted_batch(peak_above_MiB: float, batch: int, cap_above_MiB: float) -> int:
    """Sequences per step that fit if the peak above the floor grows in proportion to them."""
    if peak_above_MiB <= 0 or batch <= 0:
        raise ValueError(f"need a positive peak and batch, got peak={peak_above_MiB} MiB, batch={batch}")
    return max(0, math.floor(cap_above_MiB / (peak_above_MiB / batch)))


def _line_guess(points: list[tuple[int, float]], cap_above_MiB: float) -> int:
    # Through the two largest measured batches (nearest the cap); through the origin from one.
    # Of two points of the same batch the later counts (a run under the cap beats the run without).
    points = sorted(dict(points).items())
    b2, p2 = points[-1]
    if len(points) >= 2:
        b1, p1 = points[-2]
        slope = (p2 - p1) / (b2 - b1)
        if slope > 0:
            return b2 + math.floor((cap_above_MiB - p2) / slope)
    return predicted_batch(p2, b2, cap_above_MiB)


def next_cap_batch(trials: list[dict], base: tuple[int, float], cap_above_MiB: float,
                   max_batch: int) -> Optional[int]:
    """The next batch to try under the cap, or None when the search is settled.

    ``trials``: {"batch", "fits", "peak_above_MiB"} of the runs under the cap so far; ``base``:
    (batch, peak above floor) of the run without a cap. Settled: the largest fitting batch is
    next to the smallest failing one, nothing fits at 1, or the largest allowed batch fits.

    Until a batch fails, the next one is the line's guess through the measured peaks. Once one
    has failed the line has been wrong (an allocator that cannot place the peak under the cap fails
    below the line), so the search bisects: the next batch is the line's guess only where it falls
    strictly between the largest batch known to fit and the midpoint to the smallest that failed,
    else that midpoint (a guess at or below what fits would walk up one batch per trial). Known to fit: a trial that fit, or the
    base run when its peak is under the cap (a bound for the search only; the answer counts trials
    under the cap alone, so the base batch itself is tried when nothing above it is left).
    """
    fits = [t["batch"] for t in trials if t["fits"]]
    fails = [t["batch"] for t in trials if not t["fits"]]
    lo = max(fits, default=0)
    hi = min(fails, default=max_batch + 1)
    if hi <= lo + 1:
        return None
    points = [base] + [(t["batch"], t["peak_above_MiB"]) for t in trials if t["fits"]]
    guess = _line_guess(points, cap_above_MiB)
    if not fails:
        return min(max(guess, lo + 1), hi - 1)
    base_batch, base_peak = base
    known = max(lo, base_batch if base_peak <= cap_above_MiB and base_batch < hi else 0)
    low = known + 1 if known + 1 < hi else known  # known > lo here: the base batch, not yet tried under the cap
    mid = (known + hi) // 2
    pick = guess if known < guess < mid else mid
    return min(max(pick, low), hi - 1)


def settled_batch(trials: list[dict]) -> tuple[int, bool]:
    """(largest batch that fit, whether the batch after it was seen not to fit)."""
    lo = max((t["batch"] for t in trials if t["fits"]), default=0)
    return lo, any(t["batch"] == lo + 1 and not t["fits"] for t in trials)


def search_cap(trial, base: tuple[int, float], cap_above_MiB: float, max_batch: int,
               budget: int) -> tuple[list[dict], int, bool]:
    """Runs ``trial(batch) -> {"batch", "fits", "peak_above_MiB", ...}`` at most ``budget`` times,
    each at :func:`next_cap_batch`'s choice; returns (trials, largest batch that fit, whether the
    next batch up was seen not to fit)."""
    trials: list[dict] = []
    for _ in range(budget):
        batch = next_cap_batch(trials, base, cap_above_MiB, max_batch)
        if batch is None:
            break
        trials.append(trial(batch))
    best, bracketed = settled_batch(trials)
    return trials, best, bracketed


def cap_candidates(rows: list[dict], cap_above_MiB: float, batch: int, slowdown: float) -> list[dict]:
    """Rows worth a search under the cap: no offload; the offload policy predicted to fit the most
    tokens among those within ``slowdown`` of the no-offload step; and the one predicted to fit the
    most of all, if different. Ties go to the faster row."""
    ref = no_offload_row(rows)
    if ref is None:
        return []
    ok = [r for r in rows if r["scope"] != "none" and not r.get("error") and r["peak_above_MiB"] > 0]

    def best(pool):
        return max(pool, key=lambda r: (predicted_batch(r["peak_above_MiB"], batch, cap_above_MiB), -r["step_ms"]),
                   default=None)

    picks = [ref, best([r for r in ok if r["step_ms"] <= ref["step_ms"] * (1 + slowdown)]), best(ok)]
    out = []
    for r in picks:
        if r is not None and all(r is not o for o in out):
            out.append(r)
    return out


def derive_cap(searches: list[dict]) -> None:
    """Adds tokens_vs_none and rate_vs_none to each search of one run (against its no-offload search)."""
    ref = next((s for s in searches if s["scope"] == "none"), None)
    for s in searches:
        s["tokens_vs_none"] = s["rate_vs_none"] = None
        if ref and ref["tokens"] and s["tokens"]:
            s["tokens_vs_none"] = s["tokens"] / ref["tokens"]
            if s.get("tokens_per_s") and ref.get("tokens_per_s"):
                s["rate_vs_none"] = s["tokens_per_s"] / ref["tokens_per_s"]


_SIZE = r"(\d+(?:\.\d+)?\s*(?:bytes|[KMGTP]iB))"


def oom_detail(message: str) -> str:
    """The part of a CUDA out-of-memory message that says why: the request, and what the allocator
    held but could not use (fragmentation), e.g. "tried to allocate 2.38 GiB; 3.31 GiB reserved but
    unallocated"; "" when the message has neither."""
    parts = []
    tried = re.search(r"Tried to allocate " + _SIZE, message)
    if tried:
        parts.append(f"tried to allocate {tried.group(1)}")
    unused = re.search(_SIZE + r" is reserved by PyTorch but unallocated", message)
    if unused:
        parts.append(f"{unused.group(1)} reserved but unallocated")
    return "; ".join(parts)


def oom_error(message: str) -> str:
    """A row's error for an out-of-memory failure: "out of memory", then the detail if any."""
    detail = oom_detail(message)
    return f"out of memory ({detail})" if detail else "out of memory"


def movable_MiB(fwd_ms: float, step_ms: float, d2h_GBps: float, slowdown: float) -> float:
    """MiB that cross to the host during a forward of ``fwd_ms`` stretched by ``slowdown`` of the step."""
    return d2h_GBps * 1e9 * (fwd_ms + slowdown * step_ms) / 1e3 / MiB


def cap_tokens_ceiling(fwd_ms: float, step_ms: float, peak_above_MiB: float, d2h_GBps: float,
                       slowdown: float = 1 - CAP_RATE_FLOOR) -> float:
    """Most tokens per step under a cap, as a multiple of no offload's, for a step at most
    ``slowdown`` slower whose copies to the host happen within the forward.

    The step's peak is at the start of the backward, so what is off the GPU there crossed PCIe
    before it: at most B = BW_d2h * (fwd + slowdown * step) bytes. With the memory above the floor
    and the forward's time both proportional to the tokens (so B grows with them too), a cap that
    held the no-offload peak P then holds P / (P - B) times the tokens. Infinite when B >= P (the
    forward could move it all).
    """
    if peak_above_MiB <= 0:
        raise ValueError(f"need a positive peak, got {peak_above_MiB} MiB")
    moved_MiB = movable_MiB(fwd_ms, step_ms, d2h_GBps, slowdown)
    return math.inf if moved_MiB >= peak_above_MiB else 1 / (1 - moved_MiB / peak_above_MiB)


def derive_cap_ceiling(rows: list[dict], pcie: dict, slowdown: float = 1 - CAP_RATE_FLOOR) -> Optional[dict]:
    """:func:`cap_tokens_ceiling` from the no-offload row of one run and its process's d2h bandwidth,
    with its inputs; None without a no-offload row or a bandwidth. "ceiling" is None when unbounded."""
    ref = no_offload_row(rows)
    d2h = (pcie or {}).get("d2h_GBps")
    if ref is None or not d2h or not ref.get("peak_above_MiB") or ref["peak_above_MiB"] <= 0:
        return None
    ceiling = cap_tokens_ceiling(ref["fwd_ms"], ref["step_ms"], ref["peak_above_MiB"], d2h, slowdown)
    moved_MiB = movable_MiB(ref["fwd_ms"], ref["step_ms"], d2h, slowdown)
    return {"ceiling": None if math.isinf(ceiling) else ceiling, "unbounded": math.isinf(ceiling),
            "movable_MiB": moved_MiB, "fwd_ms": ref["fwd_ms"], "step_ms": ref["step_ms"],
            "peak_above_MiB": ref["peak_above_MiB"], "d2h_GBps": d2h, "slowdown": slowdown}


def ceiling_text(c: Optional[dict]) -> str:
    """"x1.23 tokens" (or why there is none) for the line under the cap table."""
    if not c:
        return "-"
    if c.get("unbounded"):
        return "none: the forward could move the whole no-offload peak"
    return "-" if c.get("ceiling") is None else f"x{c['ceiling']:.2f} tokens"


# ------------------------------------------------------------------------------------------------
# Selection and targets


def fastest_within(rows: Iterable[dict], target_MiB: float) -> tuple[Optional[dict], Optional[dict]]:
    """(fastest row whose whole-step peak, floor included, is <= target_MiB; the row of least peak)."""
    ok = [r for r in rows if not r.get("error")]
    total = lambda r: r["floor_MiB"] + r["peak_above_MiB"]  # noqa: E731
    meeting = [r for r in ok if total(r) <= target_MiB]
    return (min(meeting, key=lambda r: r["step_ms"], default=None), min(ok, key=total, default=None))


def target_summary(shape_result: dict) -> list[dict]:
    """Per engine and target: the measured value (worst case over the policies it covers) and whether it is met."""
    out = []
    for run in shape_result["runs"]:
        rows = [r for r in run["rows"] if not r.get("error") and r["scope"] != "none"]
        every = shape_result.get("layers", math.inf)
        offload_searches = [s for s in run.get("cap", {}).get("searches", [])
                            if s["scope"] != "none" and s.get("tokens_vs_none") is not None]
        mlp = [r for r in rows if r["scope"] == "mlp" and r["vs_none"] is not None]
        values = {
            "mlp_step": max((r["vs_none"] for r in mlp if r["layers"] < every), default=None),
            "mlp_step_all": max((r["vs_none"] for r in mlp if r["layers"] >= every), default=None),
            "layer_bound": max((r["vs_bound"] for r in rows if r["scope"] == "layer" and r["vs_bound"] is not None), default=None),
            "freed": min((r["freed_per_offloaded"] for r in rows if r["freed_per_offloaded"] is not None
                          and r["layers"] < shape_result.get("layers", math.inf)), default=None),
            "cap_tokens": _cap_tokens_within_rate(offload_searches),
        }
        failed_mlp = [r["layers"] for r in run["rows"] if r.get("error") and r["scope"] == "mlp"]
        ceiling = run.get("cap_ceiling")
        for key, value in values.items():
            what, bound, kind = TARGETS[key]
            met = None if value is None else (value <= bound if kind == "max" else value >= bound)
            if ((key == "mlp_step" and any(n < every for n in failed_mlp))
                    or (key == "mlp_step_all" and any(n >= every for n in failed_mlp))):
                met = False  # a number of layers the engine could not offload at all
            entry = {"engine": run["engine"], "target": key, "what": what, "bound": bound, "kind": kind,
                     "value": value, "met": met}
            if key == "cap_tokens":
                entry["ceiling"] = (ceiling or {}).get("ceiling")
                entry["note"] = "; ".join(n for n in (_ceiling_note(ceiling, bound),
                                                     _best_below_rate_note(offload_searches)) if n)
            out.append(entry)
    return out


def _cap_tokens_within_rate(offload_searches: list) -> Optional[float]:
    """The most tokens (x no offload) an offload policy fit under the cap at >= CAP_RATE_FLOOR of
    no offload's tokens/s; 1.0 where policies were searched and none kept that rate (no gain at
    that rate: no offload's own count), None where none was searched."""
    within = [s["tokens_vs_none"] for s in offload_searches if (s.get("rate_vs_none") or 0) >= CAP_RATE_FLOOR]
    if within:
        return max(within)
    return 1.0 if offload_searches else None


def _best_below_rate_note(offload_searches: list) -> str:
    """Where the policy fitting the most tokens fell under the rate floor, what it fit and at what rate."""
    best = max(offload_searches, key=lambda s: (s["tokens_vs_none"], s.get("rate_vs_none") or 0), default=None)
    if best is None or (best.get("rate_vs_none") or 0) >= CAP_RATE_FLOOR or best["tokens_vs_none"] <= 1.0:
        return ""
    rate = best.get("rate_vs_none")
    return (f"most tokens: x{best['tokens_vs_none']:.2f} ({best.get('policy', best['scope'])}) at "
            + (f"{rate:.3f}x the tokens/s" if rate is not None else "an unmeasured rate"))


def _ceiling_note(c: Optional[dict], bound: float) -> str:
    if not c or (c.get("ceiling") is None and not c.get("unbounded")):
        return ""
    pct = f"{c.get('slowdown', 1 - CAP_RATE_FLOOR):.0%}"
    if c.get("unbounded"):
        return f"ceiling at <= {pct} slower, copies within the forward: none"
    reach = "out of reach" if c["ceiling"] < bound else "within reach"
    return f"ceiling at <= {pct} slower, copies within the forward: x{c['ceiling']:.2f} ({bound} {reach})"


# ------------------------------------------------------------------------------------------------
# Reports

ROW_COLUMNS = [  # header, key, format
    ("engine", "engine", "{}"),
    ("policy", "policy", "{}"),
    ("step ms", "step_ms", "{:.1f}"),
    ("x none", "vs_none", "{:.3f}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("fwd / bwd / opt ms", None, None),
    ("peak above floor MiB", "peak_above_MiB", "{:.0f}"),
    ("offloaded MiB", "offloaded_MiB", "{:.0f}"),
    ("freed MiB", "freed_MiB", "{:.0f}"),
    ("freed / offloaded", "freed_per_offloaded", "{:.1%}"),
    ("PCIe bound ms", "bound_ms", "{:.1f}"),
    ("x bound", "vs_bound", "{:.2f}"),
    ("notes", None, None),
]
CAP_COLUMNS = [
    ("engine", "engine", "{}"),
    ("policy", "policy", "{}"),
    ("predicted seqs", "predicted_batch", "{}"),
    ("max seqs", None, None),
    ("tokens/step", "tokens", "{:,}"),
    ("x none", "tokens_vs_none", "{:.2f}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("tokens/s x none", "rate_vs_none", "{:.3f}"),
    ("peak GiB", None, None),
    ("reserved GiB", "reserved_peak_MiB", None),
]


def _cell(row: dict, key: Optional[str], fmt: Optional[str]) -> str:
    value = row.get(key) if key else None
    return "-" if value is None else fmt.format(value)


def _row_cells(row: dict) -> list[str]:
    cells = []
    for header, key, fmt in ROW_COLUMNS:
        if header.startswith("fwd"):
            cells.append("-" if row.get("error") else f"{row['fwd_ms']:.1f} / {row['bwd_ms']:.1f} / {row['opt_ms']:.1f}")
        elif header == "notes":
            notes = list(row.get("notes", []))
            if row.get("error"):
                notes.insert(0, f"did not run: {row['error']}")
            cells.append("; ".join(notes).replace("|", "/") or "")
        else:
            cells.append(_cell(row, key, fmt))
    return cells


def _max_batch_cell(s: dict) -> str:
    """The search's answer: exact when the next batch up failed, a bound otherwise."""
    if s["bracketed"]:
        return f"{s['batch']}"
    if s["batch"] > 0:
        return f"{s['batch']} (at least)"
    fails = [t["batch"] for t in s.get("trials", []) if not t["fits"]]
    tried = len(s.get("trials", []))
    return (f"< {min(fails)} (none fit in {tried} trials)" if fails else "- (not searched)")


def _cap_cells(s: dict, floor_MiB: float) -> list[str]:
    cells = []
    for header, key, fmt in CAP_COLUMNS:
        if header == "max seqs":
            cells.append(_max_batch_cell(s))
        elif header == "peak GiB":
            cells.append("-" if s.get("peak_above_MiB") is None else f"{(floor_MiB + s['peak_above_MiB']) / 1024:.1f}")
        elif header == "reserved GiB":  # the allocator's reserved peak, floor included: fragmentation shows here
            cells.append("-" if s.get("reserved_peak_MiB") is None else f"{s['reserved_peak_MiB'] / 1024:.1f}")
        else:
            cells.append(_cell(s, key, fmt))
    return cells


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)] + ["| " + " | ".join(r) + " |" for r in rows]


def _shape_line(s: dict) -> str:
    sh = s["shape"]
    return (f"{s['layers']} layers, {s['batch']} x {s['seq']} tokens, H={sh['hidden']}, {sh['heads']} heads, "
            f"F={sh['ffn']}, {sh['experts']} experts, top-{sh['topk']}, {s['dtype']}, attention {s['attention']}, "
            f"MLP path {s.get('path', '?')}")


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# MoE transformer training step with activation offload, {result['gpu']} ({result['date']})",
        "",
        f"Median of {c['iters']} steps after {c['warmup']} warm-up steps, one offload context per policy. "
        "Step = forward + backward + AdamW step, grads in preallocated buffers. Peak: most memory allocated "
        "during the step above the static floor (weights, grads, optimizer state, workspaces). "
        "Freed: no-offload peak minus this peak. PCIe bound: max(fwd, bytes/BW_d2h) + max(bwd, bytes/BW_h2d) + opt, "
        "from the no-offload run of the same process. \"MLP n/L\": the grouped MLP of the first n layers offloaded; "
        "\"layer n/L\": whole layers.",
        "",
    ]
    for engine, p in result["pcie"].items():
        lines.append(f"- {engine} process: PCIe d2h {p['d2h_GBps']:.1f} GB/s, h2d {p['h2d_GBps']:.1f} GB/s, "
                     f"both at once {p['bidirectional_each_GBps']:.1f} GB/s each")
    lines.append(f"- allocator: PYTORCH_CUDA_ALLOC_CONF {alloc_conf_text(result.get('alloc_conf'))}")
    if "teo-b" in c.get("engines", []) and c.get("budget_margin_GiB") is not None:
        lines.append(f"- teo-b: teo with memory_budget = the cap in force (the GPU's memory where none is) less "
                     f"{c['budget_margin_GiB']:g} GiB")
    if "teo-t" in c.get("engines", []):
        freed = c.get("target_freed") or 1.0
        share = "the bytes" if freed == 1 else f"{freed:g} of the bytes"
        lines.append(f"- teo-t: teo with memory_budget = the static floor plus no offload's peak less {share} "
                     f"the policy moves, plus {c.get('target_slack_GiB') or 0:g} GiB")
    for part in result.get("combined_from", []):  # moe_step_combine.py: runs made apart
        lines.append(f"- from {Path(part['source']).name} ({part['date']}): {', '.join(part['engines'])}")
    for s in result["shapes"]:
        lines += ["", f"## {s['name']}: {_shape_line(s)}", ""]
        for engine, error in s.get("failed", {}).items():
            lines.append(f"- {engine} process: could not build and run the model: {error}")
        for run in s["runs"]:
            f = run["floor"]
            lines.append(f"- {run['engine']} process: static floor {f['floor_MiB']:.0f} MiB (weights {f['params_MiB']:.0f}, "
                         f"grads {f['grads_MiB']:.0f}, optimizer {f['optimizer_MiB']:.0f}, other {f['other_MiB']:.0f})")
        lines += ["", "### In short", ""] + summary_lines(s) + ["", "### Every policy", ""]
        lines += _table([h for h, _, _ in ROW_COLUMNS],
                        [_row_cells(r) for run in s["runs"] for r in run["rows"]])
        pn = [r for run in s["runs"] for r in run["rows"] if r.get("pn_bound_ms")]
        if pn:
            lines += ["", "Whole layers against the peak-neutral bound (a schedule that moves whole layers and never "
                      "raises the peak: "
                      "max(fwd, bytes/BW_d2h) + max(bwd, 2 bwd/L + bytes/BW_h2d) + opt; the target is against "
                      "the PCIe bound):", ""]
            lines += _table(["engine", "policy", "step ms", "PCIe bound ms", "peak-neutral bound ms",
                             "x peak-neutral bound"],
                            [[r["engine"], r["policy"], f"{r['step_ms']:.1f}", f"{r['bound_ms']:.1f}",
                              f"{r['pn_bound_ms']:.1f}", f"{r['vs_pn_bound']:.2f}"] for r in pn])
        caps = [(run, sr) for run in s["runs"] for sr in run.get("cap", {}).get("searches", [])]
        if caps:
            cap = s["runs"][0]["cap"]
            lines += ["", f"### Most tokens per step under {cap['cap_GiB']:.1f} GiB ({cap['how']})", ""]
            lines += _table([h for h, _, _ in CAP_COLUMNS],
                            [_cap_cells(sr, run["floor"]["floor_MiB"]) for run, sr in caps])
            lines.append("")
            for run in s["runs"]:
                if run.get("cap", {}).get("searches"):
                    lines.append(f"- {run['engine']} process: {_ceiling_line(run.get('cap_ceiling'))}")
        lines += ["", "### Targets", ""]
        lines += _table(["engine", "target", "bound", "measured", "met", "notes"],
                        [[t["engine"], t["what"], f"{'<=' if t['kind'] == 'max' else '>='} {t['bound']}",
                          "-" if t["value"] is None else f"{t['value']:.3f}",
                          {True: "yes", False: "no", None: "-"}[t["met"]], t.get("note") or ""]
                         for t in s["targets"]])
        if s.get("memory_target"):
            lines += ["", s["memory_target"]["text"]]
    return "\n".join(lines) + "\n"


def summary_lines(shape_result: dict) -> list[str]:
    """The two answers per engine, in words: what each policy costs (step time against no offload,
    peak memory freed, bytes moved) and how many sequences per step fit under the cap."""
    lines = []
    for run in shape_result["runs"]:
        ref = no_offload_row(run["rows"])
        if ref is None:
            lines.append(f"- {run['engine']}: no offload did not run, nothing to compare with")
            continue
        costs = []
        for r in run["rows"]:
            if r["scope"] == "none":
                continue
            if r.get("error"):
                costs.append(f"{r['policy']} did not run")
                continue
            costs.append(f"{r['policy']} x{r['vs_none']:.3f} the step, peak -{(r['freed_MiB'] or 0) / 1024:.1f} GiB "
                         f"({r['offloaded_MiB'] / 1024:.1f} GiB moved)")
        lines.append(f"- {run['engine']}, cost against no offload ({ref['step_ms']:.1f} ms, peak "
                     f"{ref['peak_above_MiB'] / 1024:.1f} GiB above the floor): " + "; ".join(costs))
        cap = run.get("cap") or {}
        searches = cap.get("searches", [])
        none = next((x for x in searches if x["scope"] == "none"), None)
        if none is None:
            continue
        fits = [f"no offload {_max_batch_cell(none)}"]
        for x in searches:
            if x is none:
                continue
            gain = "" if x.get("tokens_vs_none") is None else f" (x{x['tokens_vs_none']:.2f} tokens"
            rate = "" if x.get("rate_vs_none") is None else f", x{x['rate_vs_none']:.2f} tokens/s"
            fits.append(f"{x['policy']} {_max_batch_cell(x)}{gain}{rate}{')' if gain else ''}")
        lines.append(f"- {run['engine']}, sequences of {shape_result['seq']} tokens per step under "
                     f"{cap['cap_GiB']:.1f} GiB (runs under the cap): " + "; ".join(fits))
    return lines


def alloc_conf_text(value: Optional[str]) -> str:
    """None: not in the result; "": unset, PyTorch's default."""
    if value is None:
        return "-"
    return f"`{value}`" if value else "unset (PyTorch's default)"


def _ceiling_line(c: Optional[dict]) -> str:
    pct = f"{(c or {}).get('slowdown', 1 - CAP_RATE_FLOOR):.0%}"
    head = f"ceiling at <= {pct} slower, copies within the forward: {ceiling_text(c)}"
    if not c:
        return head
    return (f"{head} (by the peak at most {c['movable_MiB']:.0f} MiB crosses PCIe: d2h {c['d2h_GBps']:.1f} GB/s "
            f"x (fwd {c['fwd_ms']:.1f} ms + {pct} of the {c['step_ms']:.1f} ms step), of a no-offload peak of "
            f"{c['peak_above_MiB']:.0f} MiB above the floor)")


def memory_target_text(shape_result: dict, target_GiB: float) -> dict:
    rows = [r for run in shape_result["runs"] for r in run["rows"]]
    best, least = fastest_within(rows, target_GiB * 1024)
    if best is not None:
        text = (f"Memory target {target_GiB:.1f} GiB: fastest measured policy is {best['engine']} {best['policy']}, "
                f"{best['step_ms']:.1f} ms, peak {(best['floor_MiB'] + best['peak_above_MiB']) / 1024:.2f} GiB.")
    elif least is not None:
        text = (f"Memory target {target_GiB:.1f} GiB: no measured policy meets it; the least peak is "
                f"{least['engine']} {least['policy']} at {(least['floor_MiB'] + least['peak_above_MiB']) / 1024:.2f} GiB.")
    else:
        text = f"Memory target {target_GiB:.1f} GiB: no policy ran."
    return {"target_GiB": target_GiB, "engine": best and best["engine"], "policy": best and best["policy"], "text": text}


def chart(result: dict, path: Path) -> bool:
    """Per shape: step time against peak memory, one point per policy with its PCIe bound below it
    (what offload costs); and the most sequences per step that fit under the cap, per engine and
    policy searched (what it buys)."""
    plt = pyplot()
    if plt is None:
        return False
    shapes = result["shapes"]
    fig, axes = plt.subplots(len(shapes), 2, figsize=(15, 6.5 * len(shapes)), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]})
    for (ax, ax_cap), s in zip(axes, shapes):
        _cost_panel(ax, s)
        _cap_panel(ax_cap, s)
    fig.suptitle(f"MoE training step with activation offload, {result['gpu']} ({result['date']})")
    fig.tight_layout()
    save_png(fig, path, dpi=100)
    plt.close(fig)
    return True


_MARKERS = {"v2": "o", "v1": "s", "teo": "D", "teo-m": "P", "teo-h2": "X", "teo-h4": "^", "teo-b": "v", "teo-t": "<"}
_COLORS = {"none": "black", "mlp": "#4c72b0", "layer": "#dd8452"}


def _cost_panel(ax, s: dict) -> None:
    seen = set()
    for run in s["runs"]:
        for r in run["rows"]:
            if r.get("error"):
                continue
            x, y = r["peak_above_MiB"] / 1024, r["step_ms"]
            label = f"{r['engine']} {r['scope']}"
            ax.scatter([x], [y], marker="*" if r["scope"] == "none" else _MARKERS.get(r["engine"], "D"),
                       color=_COLORS[r["scope"]], s=60, label=None if label in seen else label, zorder=3)
            seen.add(label)
            ax.annotate(r["policy"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
            if r.get("bound_ms") is not None:
                ax.plot([x, x], [r["bound_ms"], y], color=_COLORS[r["scope"]], lw=0.8, ls=":")
                ax.scatter([x], [r["bound_ms"]], marker="_", color=_COLORS[r["scope"]], s=200,
                           label=None if "bound" in seen else "PCIe bound", zorder=2)
                seen.add("bound")
    ax.set_xlabel("peak memory above the static floor (GiB)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"{s['name']}: {_shape_line(s)}", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _cap_panel(ax, s: dict) -> None:
    bars = [(run["engine"], x) for run in s["runs"] for x in (run.get("cap") or {}).get("searches", [])]
    if not bars:
        ax.axis("off")
        ax.text(0.5, 0.5, "no tokens-under-a-cap search", ha="center", va="center")
        return
    cap = next(run["cap"] for run in s["runs"] if run.get("cap"))
    ys = range(len(bars))
    ax.barh(list(ys), [x["batch"] for _, x in bars], color=[_COLORS[x["scope"]] for _, x in bars])
    for y, (_, x) in zip(ys, bars):
        rate = "" if x.get("rate_vs_none") is None else f", x{x['rate_vs_none']:.2f} tok/s"
        gain = "" if x.get("tokens_vs_none") is None else f" (x{x['tokens_vs_none']:.2f} tokens{rate})"
        ax.annotate(f"{_max_batch_cell(x)}{gain}", (x["batch"], y), textcoords="offset points", xytext=(3, -3),
                    fontsize=7)
    ax.set_yticks(list(ys), [f"{engine} {x['policy']}" for engine, x in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"sequences of {s['seq']} tokens per step that fit")
    ax.set_title(f"under a {cap['cap_GiB']:.1f} GiB cap (runs with the allocator limited to it)", fontsize=8)
    ax.grid(alpha=0.3, axis="x")
    ax.set_xlim(right=max(x["batch"] for _, x in bars) * 1.45 + 1)


def finish(result: dict, memory_target_GiB: Optional[float] = None) -> None:
    """Derives every row, cap search, target and the memory-target choice in place."""
    for s in result["shapes"]:
        for run in s["runs"]:
            derive_rows(run["rows"], result["pcie"][run["engine"]], s.get("layers"))
            derive_cap(run.get("cap", {}).get("searches", []))
            run["cap_ceiling"] = derive_cap_ceiling(run["rows"], result["pcie"].get(run["engine"]))
        s["targets"] = target_summary(s)
        if memory_target_GiB is not None:
            s["memory_target"] = memory_target_text(s, memory_target_GiB)


def write_reports(result: dict, folder: Path, stem: str) -> list[Path]:
    return bench_common.write_reports(folder, stem, result, markdown, chart)
