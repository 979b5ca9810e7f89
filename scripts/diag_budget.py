"""Diagnostic: teo's layer schedule against its memory budget at one batch under a memory cap, in one
process (one model), with where each budget wait fell and how long the compute stream stalled there.

    python3 scripts/diag_budget.py --batch 12 --cap 67 --margins 2,1,0.5 [--shape big-ffn --layers 4]
    python3 scripts/diag_budget.py --shape base --layers 8 --batch 8 --scope mlp --offload 7 --cap 0 \
        --margins "" --no-layer-schedule --target-freed 1,0.96      (moe_step.py's teo-t budgets, no cap)

Each variant: a context reused over --warmup + --iters steps under the cap (the allocator limited
to it, as moe_step.py's cap search does); prints step / forward / backward ms (median), the
allocated peak, and for the last step every look of the budget engine that waited: where (layer
entry, save, use in backward, reload, make_room), the memory then, what was announced, and per
copy waited for its layer, size, bytes it freed and the stall it cost (timing events around the
wait on the compute stream). ``--history`` records the allocator's events over the last step of
each variant and prints where it gave memory back and mapped it again (``alloc_history.py``).
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("NVTE_CPU_OFFLOAD_V1", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

GiB, MiB = 2**30, 2**20


def run_variant(torch, bench, a, policy, options, x, dy):
    """One context over --warmup + --iters steps: (engine, step samples, the allocator's retries /
    syncs / maps / unmaps per timed step, allocated peak GiB, the last step's allocator history or
    None); the last step's budget waits traced."""
    from te_offload_ops.engines import offload_context

    context = offload_context("teo", num_layers=a.offload, model_layers=a.layers, **options)
    engine = context[0].engine
    a.last_engine = engine  # for the report of an out-of-memory error
    engine.room_asked = [0, 0.0]  # calls, host seconds: what the fit's snapshot reads cost
    schedule = engine.schedule
    if engine.memory_budget is not None:
        ask = schedule.short_of

        def timed_room(sizes, stream=None):
            t = time.perf_counter()
            try:
                return ask(sizes, stream)
            finally:
                engine.room_asked[0] += 1
                engine.room_asked[1] += time.perf_counter() - t

        schedule.short_of = timed_room
    if a.history_all:  # from the first step: an out-of-memory error in warm-up is shown with its frames
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        schedule.trace = []
    for _ in range(a.warmup):
        bench._step(x, dy, a.batch, policy, context)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    samples, allocator, history = [], [], None
    for i in range(a.iters):
        last = i == a.iters - 1
        if last and options:
            schedule.trace = []
        if last and a.history and not a.history_all:  # its step runs a little slower: the allocator records Python stacks
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
        before = torch.cuda.memory_stats()
        samples.append(bench._step(x, dy, a.batch, policy, context))
        after = torch.cuda.memory_stats()
        if last and (a.history or a.history_all):
            history = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        # the allocator's own work that step: retries after freeing its cache (a device sync),
        # syncs of every stream, memory mapped and unmapped
        allocator.append("/".join(str(after.get(k, 0) - before.get(k, 0)) for k in
                                  ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")))
    return engine, samples, allocator, torch.cuda.max_memory_allocated() / GiB, history


def _fractions(text: str) -> list[float]:
    """--target-freed: "1,0.96" -> [1.0, 0.96], each a share of the bytes moved in (0, 1]."""
    try:
        values = [float(f) for f in text.split(",") if f.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"fractions separated by commas, e.g. 1,0.96; got {text!r}") from None
    bad = [v for v in values if not 0 < v <= 1]  # (nan fails both comparisons)
    if bad:
        raise argparse.ArgumentTypeError(f"each fraction must be in (0, 1], got {bad}")
    return values


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="big-ffn")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--offload", type=int, default=2, help="layers offloaded")
    p.add_argument("--scope", choices=("layer", "mlp"), default="layer", help="what of each layer is offloaded")
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--cap", type=float, default=67.0, help="GiB (0: no cap)")
    p.add_argument("--margins", default="2,1,0.5", help="GiB under the cap for teo's memory_budget (\"\": none)")
    p.add_argument("--target-freed", type=_fractions, default=[],
                   help="fractions: budgets as moe_step.py's teo-t sets them (no offload's peak less this share "
                        "of the bytes the policy moves), e.g. 1,0.96")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--history", action="store_true", help="the allocator's maps and unmaps in the last step")
    p.add_argument("--history-all", action="store_true",
                   help="the allocator's events from the first step (with the frames of an out-of-memory error)")
    p.add_argument("--no-layer-schedule", action="store_true", help="only the budgets")
    a = p.parse_args()

    if not 0 <= a.offload <= a.layers:
        p.error(f"--offload must be in 0..--layers={a.layers}, got {a.offload}")
    from bench_common import moe_step_bench

    bench = moe_step_bench("diag_budget.py", a.shape, a.layers, a.batch, "teo")
    if bench is None:
        return 2
    import torch

    import moe_step
    policy = moe_step.Policy(a.scope, a.offload)
    cap = a.cap or None
    print(f"{torch.cuda.get_device_name()}: {a.shape}, L={a.layers}, {policy.label(a.layers)}, {a.batch} sequences, "
          f"cap {cap} GiB, static floor {bench.floor_MiB / 1024:.1f} GiB", flush=True)
    variants = ([] if a.no_layer_schedule else [("layer schedule", {})]) + [
        (f"budget: cap - {m} GiB", {"memory_budget": int((a.cap - float(m)) * GiB)}) for m in a.margins.split(",") if m]
    for freed in a.target_freed:
        bench.args.target_freed = freed
        budget = bench.target_budget(policy, a.batch)
        variants.append((f"teo-t freeing {freed:g} of the bytes moved: budget {budget / GiB:.2f} GiB",
                         {"memory_budget": budget}))
    x, dy = bench._inputs(a.batch)
    for name, options in variants:
        torch.cuda.empty_cache()
        moe_step._empty_host_cache()
        try:
            with bench.under_cap(cap):  # the allocator limited as moe_step.py's cap search limits it
                from te_offload_ops.engines.teo import allocator_room

                dev = torch.device("cuda", torch.cuda.current_device())
                print(f"   under the cap: reserved {torch.cuda.memory_reserved() / GiB:.2f} GiB, the room sees "
                      f"{allocator_room.mappable_bytes(dev) / GiB:.2f} GiB to map "
                      f"(torch tells the fraction: {hasattr(torch.cuda, 'get_per_process_memory_fraction')})", flush=True)
                engine, samples, allocator, peak, history = run_variant(torch, bench, a, policy, options, x, dy)
        except torch.cuda.OutOfMemoryError as exc:
            print(f"{name}: out of memory ({moe_step.oom_error(str(exc))})", flush=True)
            if a.history_all:
                from alloc_history import summarize

                snap = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                for line in summarize(snap, torch.cuda.current_device())[-12:]:
                    print("   " + line, flush=True)
                for r in (getattr(a.last_engine.schedule, "trace", None) or [])[-6:]:
                    print(f"   budget look {r['where']} fwd layer {r['layer']} step {r['step']}: memory "
                          f"{r['memory'] / GiB:.2f} GiB + {r['incoming'] / GiB:.2f}, waits {len(r['waits'])}", flush=True)
            bench._recover()
            continue
        med = {k: statistics.median(s[k] for s in samples) for k in ("step_ms", "fwd_ms", "bwd_ms")}
        steps = ", ".join(f"{s['step_ms']:.0f}" for s in samples)
        print(f"{name}: step {med['step_ms']:.1f} ms (fwd {med['fwd_ms']:.1f}, bwd {med['bwd_ms']:.1f}; steps "
              f"{steps}), peak {peak:.2f} GiB; allocator retries/syncs/maps/unmaps per step: {', '.join(allocator)}",
              flush=True)
        for r in getattr(engine.schedule, "trace", None) or []:
            stalls = [w["events"][0].elapsed_time(w["events"][1]) for w in r["waits"]]
            print(f"   {r['where']:9s} fwd layer {r['layer']}, bwd layer {r.get('bwd_layer')}: memory {r['memory'] / GiB:.2f} GiB + {r['incoming'] / GiB:.2f}"
                  f" announced, room kept {r['margin'] / GiB:.2f}, {r['over'] / GiB:.2f} over; waited for "
                  + "; ".join(f"L{w['copy_of_layer']} {w['nbytes'] / MiB:.0f} MiB ({w['why']}, freed {w['freed'] / MiB:.0f}) "
                              f"{t:.1f} ms" for w, t in zip(r["waits"], stalls)), flush=True)
        if options:
            print(f"   prefetches put off for room: {engine.reloads_deferred} over {a.warmup + a.iters} steps", flush=True)
        calls, secs = engine.room_asked
        print(f"   the allocator's room asked {calls} times over {a.warmup + a.iters} steps, {secs * 1e3:.1f} ms host in all",
              flush=True)
        if history is not None:
            from alloc_history import summarize

            print("   allocator, last step (recording):", flush=True)
            for line in summarize(history, torch.cuda.current_device()):
                print("   " + line, flush=True)
        engine.schedule.trace = None
        del engine, history
    return 0


if __name__ == "__main__":
    sys.exit(main())
