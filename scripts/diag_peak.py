"""Diagnostic: where in one training step the allocated memory peaks, and what teo held there.

    python3 scripts/diag_peak.py --shape base --policy mlp:7 [--engine teo-t] [--slack 0] [--batch 8]

Runs no offload, then the policy under the engine (moe_step.py's names: teo, teo-b, teo-t), in
one process (one model). For each: warm-up steps, then one step with the allocator's history
recorded (Python frames only with --frames: recording them slows the host, and copies that
would still run end in time). From the history it rebuilds the memory allocated event by event and
prints the step's peak above the static floor, its phase (forward, backward, optimizer), the
allocations just before it (size, stream, the frames of this package, TE and the model), and,
for a budget engine, its last look before the peak: where, which forward layer, the memory then
and the GPU bytes it still held for copies in flight. Marker allocations of odd sizes (well
under 1 MiB, in the small pool) delimit the phases and the engine's looks in the history.
"""

import argparse
import contextlib
import os
import sys
from pathlib import Path

os.environ.setdefault("NVTE_CPU_OFFLOAD_V1", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

MiB = 2**20
_PHASE_MARK = {"forward": 997 * 512, "backward": 998 * 512, "optimizer": 999 * 512}
_LOOK_MARK = 1001 * 512
_OWN_FRAMES = ("te_offload_ops", "transformer_engine", "moe_model", "moe_step")


def _frames(entry: dict, limit: int = 5) -> str:
    names = [f"{Path(f.get('filename') or '?').name}:{f.get('line', '?')} {f.get('name', '?')}"
             for f in entry.get("frames") or [] if any(k in (f.get("filename") or "") for k in _OWN_FRAMES)]
    return " < ".join(names[:limit]) or "-"


def _mark(torch, nbytes: int) -> None:
    torch.empty(nbytes, dtype=torch.uint8, device="cuda")  # allocated and freed at once: two history events


def instrument(torch, bench, engine, looks: list) -> None:
    """Phase markers around the step's parts; for a budget engine, a record and a marker per look."""
    mark = bench.mark

    @contextlib.contextmanager
    def marked(name):
        _mark(torch, _PHASE_MARK[name])
        with mark(name):
            yield

    bench.mark = marked
    if engine is None or getattr(engine, "memory_budget", None) is None:
        return
    budget = engine.schedule
    fit, boundary = budget.look, engine.backward_boundary
    state = {"bwd": None}

    def looked(*args, **kwargs):
        fit(*args, **kwargs)
        held = sum(c.nbytes for c in engine.copies.in_flight if c.source is not None)
        back = sum(c.nbytes for lc in engine.copies.layers.values() for c in lc.copies
                   if c.gpu is not None and c.source is None)
        looks.append({"where": kwargs.get("where", "?"), "layer": engine.fwd_layer, "bwd": state["bwd"],
                      "memory": torch.cuda.memory_allocated(), "held": held, "reloaded": back,
                      "incoming": kwargs.get("incoming", args[0] if args else 0)})
        _mark(torch, _LOOK_MARK)

    def entered_backward(layer):
        state["bwd"] = layer
        boundary(layer)

    budget.look, engine.backward_boundary = looked, entered_backward


def analyse(trace: list, start: int, floor: int, looks: list) -> list[str]:
    """Lines: the peak, its phase, the allocations before it, the engine's last look before it."""
    total, peak, at = start, start, -1
    phase, phase_at_peak, look_i, look_at_peak = "before the step", None, -1, None
    for i, e in enumerate(trace):
        act, size = e.get("action"), e.get("size", 0)
        if act == "alloc":
            for name, n in _PHASE_MARK.items():
                if size == n:
                    phase = name
            if size == _LOOK_MARK:
                look_i += 1
            total += size
            if total > peak:
                peak, at, phase_at_peak, look_at_peak = total, i, phase, look_i
        elif act == "free_requested":
            total -= size
    lines = [f"peak {(peak - floor) / MiB:.0f} MiB above the floor, in the {phase_at_peak} (event {at} of {len(trace)})"]
    if at < 0:
        return lines
    before = [e for e in trace[max(0, at - 60):at + 1] if e.get("action") == "alloc"
              and e.get("size") not in (*_PHASE_MARK.values(), _LOOK_MARK)][-6:]
    for e in before:
        lines.append(f"   alloc {e.get('size', 0) / MiB:9.1f} MiB stream {e.get('stream')}: {_frames(e)}")
    if looks and look_at_peak is not None and 0 <= look_at_peak < len(looks):
        lines.append("   the engine's last looks before it (after each look's waits):")
        for r in looks[max(0, look_at_peak - 3):look_at_peak + 2]:
            lines.append(f"     {'>' if r is looks[look_at_peak] else ' '} {r['where']:9s} forward layer {r['layer']}, "
                         f"backward layer {r['bwd']}: memory {(r['memory'] - floor) / MiB:.0f} MiB above the floor + "
                         f"{r['incoming'] / MiB:.0f} announced; {r['held'] / MiB:.0f} MiB held for copies in flight, "
                         f"{r['reloaded'] / MiB:.0f} MiB reloaded")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="base")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--engine", default="teo-t")
    p.add_argument("--policy", default="mlp:7", help="SCOPE:N as moe_step.py --policies takes it")
    p.add_argument("--slack", type=float, default=0.0, help="GiB, teo-t's --target-slack")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--frames", action="store_true", help="record Python frames (slows the host: timing changes)")
    a = p.parse_args()

    from bench_common import moe_step_bench

    bench = moe_step_bench("diag_peak.py", a.shape, a.layers, a.batch, a.engine,
                           ("--target-slack", str(a.slack), "--policies", a.policy))
    if bench is None:
        return 2
    import torch

    import moe_step
    floor = int(bench.floor_MiB * MiB)
    print(f"{torch.cuda.get_device_name()}: {a.shape}, L={a.layers}, {a.batch} sequences, engine {a.engine}, "
          f"static floor {bench.floor_MiB:.0f} MiB", flush=True)
    x, dy = bench._inputs(a.batch)
    plain_mark = bench.mark
    for policy in (moe_step.NO_OFFLOAD, *bench.args.policies):
        bench.mark = plain_mark
        context = bench._context(policy, a.batch)
        engine = getattr(context[0], "engine", None)
        for _ in range(a.warmup):
            bench._step(x, dy, a.batch, policy, context)
        looks: list = []
        instrument(torch, bench, engine, looks)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        # without --frames no stacks are recorded: the host keeps its real lead over the GPU (with
        # Python stacks a base step's forward ran 196 ms instead of 77, every copy ended in time)
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, context="all" if a.frames else None,
                                                 stacks="python")
        sample = bench._step(x, dy, a.batch, policy, context)
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snap["device_traces"][torch.cuda.current_device()]
        budget = getattr(engine, "memory_budget", None)
        head = f"{policy.label(a.layers)}: step {sample['step_ms']:.1f} ms (fwd {sample['fwd_ms']:.1f}, bwd " \
               f"{sample['bwd_ms']:.1f}), allocator peak {(torch.cuda.max_memory_allocated() - floor) / MiB:.0f} MiB"
        if budget is not None:
            head += f"; budget {(budget - floor) / MiB:.0f} MiB above the floor, {len(looks)} looks"
        print(head, flush=True)
        for line in analyse(trace, start, floor, looks):
            print("   " + line, flush=True)
        if looks:  # each layer's entry: the memory and the bytes held for copies in flight then
            print("   layer entries: " + ", ".join(f"L{r['layer']} {(r['memory'] - floor) / MiB:.0f}"
                                                  f" (held {r['held'] / MiB:.0f})" for r in looks
                                                  if r["where"] == "enter"), flush=True)
            over = sum(r["memory"] > budget for r in looks)
            print(f"   looks still above the budget after their waits: {over} of {len(looks)}", flush=True)
        del context, engine, snap, trace
    return 0


if __name__ == "__main__":
    sys.exit(main())
