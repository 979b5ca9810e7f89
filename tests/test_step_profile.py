"""CPU checks of benchmarks/step_profile.py (moe_step.py --profile): interval arithmetic, trace
parsing, copy statistics, overlap, gap attribution and the per-layer mapping on synthetic events,
and the capture's annotations on a real (host-only) torch.profiler trace."""

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import moe_step  # noqa: E402
import step_profile as sp  # noqa: E402
from step_profile import Event  # noqa: E402

COMPUTE, D2H_STREAM, H2D_STREAM, OTHER = 7, 20, 21, 30
MAIN, AUTOGRAD = 1, 2


# ------------------------------------------------------------------------------------------------
# Intervals and names


def test_intervals_merge_overlap_and_gaps():
    assert sp.union([(5, 7), (0, 2), (1, 3), (9, 9)]) == [(0, 3), (5, 7)]
    assert sp.length([(0, 2), (1, 3), (10, 11)]) == 4
    assert sp.overlap([(0, 10)], [(2, 3), (5, 20)]) == 6
    assert sp.overlap([(0, 1)], [(1, 2)]) == 0
    assert sp.gaps([(2, 3), (5, 6)], 0, 10) == [(0, 2), (3, 5), (6, 10)]
    assert sp.gaps([(0, 10)], 2, 8) == []


@pytest.mark.parametrize("name,direction", [
    ("Memcpy DtoH (Device -> Pinned)", "d2h"), ("Memcpy HtoD (Pinned -> Device)", "h2d"),
    ("Memcpy DtoD (Device -> Device)", "d2d"), ("Memcpy DtoH (Device -> Pageable)", "d2h"),
    ("Memcpy PtoP (Device -> Device)", "d2d"), ("Memset (Device)", None),
])
def test_copy_direction_from_cupti_names(name, direction):
    assert sp.copy_direction(name) == direction


def test_chrome_trace_events_are_read_with_streams_bytes_links_and_sequence_numbers():
    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "python"}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 10.5, "dur": 4.0,
         "args": {"stream": 7, "correlation": 42, "device": 0}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "pid": 0, "tid": 20, "ts": 11,
         "dur": 2, "args": {"stream": 20, "correlation": 43, "bytes": 4096}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 9, "tid": 9, "ts": 8, "dur": 1,
         "args": {"correlation": 42, "cbid": 211}},
        {"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernelEx", "pid": 9, "tid": 9, "ts": 9, "dur": 1,
         "args": {"correlation": 44}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 9, "tid": 9, "ts": 7, "dur": 3,
         "args": {"Sequence number": 5, "Fwd thread id": 0}},
        {"ph": "X", "cat": "user_annotation", "name": "teo_step 1", "pid": 9, "tid": 9, "ts": 1, "dur": 30},
        {"ph": "X", "cat": "cuda_sync", "name": "Stream Wait Event", "pid": 0, "tid": 7, "ts": 9, "dur": 0.1,
         "args": {"stream": 7, "wait_on_stream": 20}},
        {"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "pid": 9, "tid": 9, "ts": 7},
        {"ph": "X", "cat": "python_function", "name": "f", "pid": 9, "tid": 9, "ts": 7, "dur": 1},
    ]}
    events = sp.events_from_trace(trace)
    by_kind = {e.kind: e for e in events}
    assert sorted(by_kind) == ["annotation", "cpu_op", "kernel", "memcpy", "runtime", "sync"]
    assert len([e for e in events if e.kind == "runtime"]) == 2  # driver launches count as launches
    k = by_kind["kernel"]
    assert (k.stream, k.corr, k.start, k.end, k.tid) == (7, 42, 10.5, 14.5, None)
    m = by_kind["memcpy"]
    assert (m.nbytes, m.direction, m.stream) == (4096, "d2h", 20)
    assert by_kind["cpu_op"].seq == 5 and by_kind["cpu_op"].tid == 9
    assert by_kind["sync"].wait_on_stream == 20 and by_kind["sync"].stream == 7
    assert [e.start for e in events] == sorted(e.start for e in events)


def test_host_index_finds_the_ops_containing_a_moment_outermost_first():
    ops = [Event("cpu_op", "outer", 0, 100, tid=MAIN), Event("cpu_op", "mid", 10, 50, tid=MAIN),
           Event("cpu_op", "inner", 20, 5, tid=MAIN), Event("cpu_op", "later", 70, 10, tid=MAIN),
           Event("cpu_op", "elsewhere", 0, 100, tid=AUTOGRAD)]
    index = sp.HostIndex(ops)
    assert index.chain(MAIN, 22) == ["outer", "mid", "inner"]
    assert index.chain(MAIN, 30) == ["outer", "mid"]  # inner has ended
    assert index.chain(MAIN, 75) == ["outer", "later"]
    assert index.chain(MAIN, 200) == []
    assert index.chain(AUTOGRAD, 5) == ["elsewhere"]


# ------------------------------------------------------------------------------------------------
# A synthetic step with every kind of gap


def _gpu(kind, name, start, end, stream, corr, nbytes=0):
    return Event(kind, name, start, end - start, stream=stream, corr=corr, nbytes=nbytes)


def _launch(at, corr, tid=MAIN, name="cudaLaunchKernel"):
    return Event("runtime", name, at, 1.0, tid=tid, corr=corr)


def synthetic_step(with_wait_record: bool = True, shift: float = 0.0) -> list[Event]:
    """Two layers; times in us. Forward: A, B on the compute stream with layer 0's offload (D2H)
    beside them; C after a host sync; D. Backward: E waits for layer 1's reload (H2D). Optimizer: F
    after a long host stretch, then a last D2H copy the step waits for."""
    MB = 2**20
    ev = [
        Event("annotation", "teo_step 1", 0, 1000, tid=MAIN),
        Event("annotation", "teo_phase forward", 0, 400, tid=MAIN),
        Event("annotation", "teo_phase backward", 400, 500, tid=MAIN),
        Event("annotation", "teo_phase optimizer", 900, 100, tid=MAIN),
        Event("annotation", "teo_layer 0", 5, 145, tid=MAIN),
        Event("annotation", "teo_layer 1", 150, 240, tid=MAIN),
        Event("cpu_op", "layer0_op", 8, 2, tid=MAIN, seq=10),
        Event("cpu_op", "layer1_op", 155, 2, tid=MAIN, seq=20),
        Event("cpu_op", "autograd::engine::evaluate_function: L1Backward", 405, 75, tid=AUTOGRAD, seq=20),
        Event("cpu_op", "autograd::engine::evaluate_function: L0Backward", 481, 409, tid=AUTOGRAD, seq=10),
        Event("cpu_op", "optimizer_op", 880, 40, tid=MAIN),
        # forward
        _launch(10, 1), _gpu("kernel", "A", 20, 100, COMPUTE, 1),
        _launch(30, 2, name="cudaMemcpyAsync"), _gpu("memcpy", "Memcpy DtoH (Device -> Pinned)", 40, 140, D2H_STREAM, 2, 5 * MB),
        _launch(50, 3), _gpu("kernel", "B", 105, 200, COMPUTE, 3),  # 5 us after A: launch latency
        Event("runtime", "cudaStreamSynchronize", 150, 53, tid=MAIN),  # e.g. a .tolist(): the stream drains
        _launch(260, 4), _gpu("kernel", "C", 265, 300, COMPUTE, 4),
        _launch(320, 5), _gpu("kernel", "D", 322, 380, COMPUTE, 5),
        # backward: the reload of layer 1, and a kernel elsewhere that ends later but is not waited on
        _launch(410, 6, tid=AUTOGRAD, name="cudaMemcpyAsync"),
        _gpu("memcpy", "Memcpy HtoD (Pinned -> Device)", 420, 520, H2D_STREAM, 6, 4 * MB),
        _launch(411, 9, tid=AUTOGRAD), _gpu("kernel", "elsewhere", 430, 522, OTHER, 9),
        _launch(415, 7, tid=AUTOGRAD), _gpu("kernel", "E", 523, 600, COMPUTE, 7),
        # optimizer
        _launch(905, 8), _gpu("kernel", "F", 910, 950, COMPUTE, 8),
        _launch(920, 10, name="cudaMemcpyAsync"), _gpu("memcpy", "Memcpy DtoH (Device -> Pinned)", 930, 990, D2H_STREAM, 10, MB),
    ]
    if with_wait_record:
        ev.append(Event("sync", "Stream Wait Event", 412, 0.5, stream=COMPUTE, wait_on_stream=H2D_STREAM))
    if shift:
        ev = [Event(**{**e.__dict__, "start": e.start + shift, "corr": None if e.corr is None else e.corr + 1000})
              for e in ev]  # a later step: correlation ids never repeat within a trace
    return sorted(ev, key=lambda e: (e.start, -e.dur))


def test_phases_busy_time_and_copies_come_from_the_events():
    r = sp.analyze_step(synthetic_step(), "teo_step 1")
    assert r["compute_stream"] == COMPUTE
    assert r["gpu_ms"] == pytest.approx((990 - 20) / 1e3)
    busy = (100 - 20) + (200 - 105) + (300 - 265) + (380 - 322) + (600 - 523) + (950 - 910)
    assert r["compute_busy_ms"] == pytest.approx(busy / 1e3)
    # all of it kernels: the step's copies run on side streams
    assert r["compute_kernels_ms"] == pytest.approx(busy / 1e3) and r["compute_copies_ms"] == 0
    fwd, bwd, opt = (r["phases"][p] for p in sp.PHASES)
    assert (fwd["gpu_start_ms"], fwd["gpu_end_ms"]) == pytest.approx((0.0, 0.36))  # A's start to D's end
    assert bwd["gpu_ms"] == pytest.approx((600 - 420) / 1e3)
    assert opt["compute_busy_ms"] == pytest.approx(0.04) and opt["host_ms"] == pytest.approx(0.1)

    d2h, h2d = r["copies"]["d2h"], r["copies"]["h2d"]
    assert d2h["count"] == 2 and d2h["MiB"] == pytest.approx(6)
    assert d2h["busy_ms"] == pytest.approx(0.16)
    assert d2h["GBps"] == pytest.approx(6 * 2**20 / 160e-6 / 1e9)
    # D2H [40,140] runs beside A [20,100] and B [105,200]: 60 + 35 us; [930,990] beside F [910,950]: 20 us
    assert d2h["overlap_compute_ms"] == pytest.approx(0.115)
    assert d2h["overlap_fraction"] == pytest.approx(115 / 160)
    assert d2h["by_phase_MiB"] == pytest.approx({"forward": 5, "backward": 0, "optimizer": 1})
    assert h2d["overlap_compute_ms"] == 0 and h2d["GBps"] == pytest.approx(4 * 2**20 / 100e-6 / 1e9)
    assert "d2d" not in r["copies"]


def test_idle_gaps_are_attributed_to_host_sync_copy_waits_and_latency():
    r = sp.analyze_step(synthetic_step(), "teo_step 1", min_gap_us=3)
    idle = r["idle_ms"]
    assert idle["forward"] == pytest.approx({
        "launch latency": (5 + 5 + 2) / 1e3,  # A->B, then the device parts before C and D
        "host: blocked in cudaStreamSynchronize": 60 / 1e3,  # B ends at 200, C launched at 260
        "host: busy": 20 / 1e3,  # C ends at 300, D launched at 320
    })
    # D ends at 380; E launched at 415 on the autograd thread, then waited for the reload that ended at 520
    assert idle["backward"] == pytest.approx({"host: busy": 35 / 1e3, "wait: H2D copy": 108 / 1e3})
    assert idle["optimizer"] == pytest.approx({"host: busy": 305 / 1e3, "launch latency": 5 / 1e3})
    assert idle["tail"] == pytest.approx({"tail: D2H copy": 40 / 1e3})
    total_idle = sum(r["idle_total_ms"].values())
    assert total_idle == pytest.approx(r["gpu_ms"] - r["compute_busy_ms"])  # every idle microsecond has a cause

    [largest] = r["largest_gaps"][:1]
    assert largest["phase"] == "optimizer" and largest["next"] == "F"
    assert largest["launched_from"] == "optimizer_op"
    host_groups = [g for g in r["gap_groups"] if g["cause"] == "host: busy"]
    assert {g["phase"] for g in host_groups} == {"forward", "backward", "optimizer"}
    assert r["gap_groups"] == sorted(r["gap_groups"], key=lambda g: -g["ms"])


def test_a_stream_wait_record_picks_the_stream_waited_on():
    # without CUPTI's record the later kernel on another stream looks like the cause
    without = sp.analyze_step(synthetic_step(with_wait_record=False), "teo_step 1")
    assert "wait: kernel on stream 30" in without["idle_ms"]["backward"]
    with_record = sp.analyze_step(synthetic_step(), "teo_step 1")
    assert "wait: H2D copy" in with_record["idle_ms"]["backward"]


def test_short_gaps_are_summed_not_listed():
    r = sp.analyze_step(synthetic_step(), "teo_step 1", min_gap_us=10)
    assert r["idle_ms"]["forward"]["gaps < 10 us"] == pytest.approx(5 / 1e3)  # A->B
    assert r["idle_ms"]["forward"]["host: busy"] == pytest.approx(20 / 1e3)  # C->D (22 us) stays listed
    assert all(g["ms"] >= 0.01 for g in r["largest_gaps"])


def test_gap_attribution_parts_split_host_and_device_time():
    copy = _gpu("memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 95, H2D_STREAM, 1)
    nxt = _gpu("kernel", "K", 100, 110, COMPUTE, 2)
    g = sp.attribute_gap(50, 100, nxt, _launch(60, 2), others=[copy], host_syncs=[], stream_waits=[], prev_launch=40)
    assert g["parts"] == {"host: busy": 10, "wait: H2D copy": 40}
    far = _gpu("memcpy", "Memcpy HtoD (Pinned -> Device)", 0, 60, H2D_STREAM, 1)  # ended 40 us before K
    g = sp.attribute_gap(50, 100, nxt, _launch(10, 2), others=[far], host_syncs=[], stream_waits=[], prev_launch=5)
    assert g["parts"] == {"device: unexplained": 50}
    g = sp.attribute_gap(50, 100, nxt, None, others=[], host_syncs=[], stream_waits=[], prev_launch=None)
    assert g["parts"] == {"unknown (no launch record)": 50}


def test_layers_get_their_forward_backward_and_the_copies_they_queued():
    r = sp.analyze_step(synthetic_step(), "teo_step 1")
    l0, l1 = r["layers"]
    assert (l0["layer"], l1["layer"]) == (0, 1)
    assert (l0["fwd"]["start_ms"], l0["fwd"]["end_ms"]) == pytest.approx((0.0, 0.18))  # A and B
    assert l0["fwd"]["idle_ms"] == pytest.approx(0.005)
    assert l0["fwd"]["d2h"]["MiB"] == pytest.approx(5)
    assert l0["fwd"]["d2h"]["overlap_compute_ms"] == pytest.approx(0.095)
    assert (l1["fwd"]["start_ms"], l1["fwd"]["end_ms"]) == pytest.approx((0.245, 0.36))  # C and D
    assert "d2h" not in l1["fwd"]
    # layer 1's backward ran first (autograd numbered it from layer 1's forward) and queued the reload
    assert (l1["bwd"]["start_ms"], l1["bwd"]["end_ms"]) == pytest.approx((0.503, 0.58))
    assert l1["bwd"]["h2d"]["MiB"] == pytest.approx(4) and l1["bwd"]["h2d"]["start_ms"] == pytest.approx(0.4)
    assert l0["bwd"] == {}  # it launched nothing


def test_timeline_rows_and_the_mean_over_steps():
    a = sp.analyze_step(synthetic_step(), "teo_step 1")
    assert a["timeline"]["D2H"] == [[0.02, 0.1], [0.91, 0.06]]
    assert a["timeline"]["H2D"] == [[0.4, 0.1]]
    assert len(a["timeline"]["compute"]) == 6
    events = synthetic_step() + [Event(**{**e.__dict__, "name": "teo_step 2"}) if e.name == "teo_step 1" else e
                                 for e in synthetic_step(shift=2000)]
    b = sp.analyze_step(sorted(events, key=lambda e: e.start), "teo_step 2")
    assert b["gpu_ms"] == pytest.approx(a["gpu_ms"])
    mean = sp.summarize([a, {**b, "gpu_ms": b["gpu_ms"] + 1.0}])
    assert mean["gpu_ms"] == pytest.approx(a["gpu_ms"] + 0.5)
    assert mean["copies"]["d2h"]["bytes"] == a["copies"]["d2h"]["bytes"]
    assert mean["idle_ms"]["backward"]["wait: H2D copy"] == pytest.approx(0.108)
    assert "layers" not in mean and "timeline" not in mean


def test_a_number_missing_in_every_step_stays_missing_in_the_mean_and_the_report():
    # copies only on the compute stream have no overlap fraction (None) in any step
    step = sp.analyze_step(synthetic_step(), "teo_step 1")
    step["copies"]["d2h"]["overlap_fraction"] = None
    mean = sp.summarize([step, step])
    assert mean["copies"]["d2h"]["overlap_fraction"] is None
    text = "\n".join(sp.profile_markdown({"engine": "v2", "policy": "none", "steps": [step], "mean": mean}))
    assert "ms (-%)" in text


def test_missing_step_or_gpu_work_is_an_error_that_says_which():
    with pytest.raises(ValueError, match="teo_step 9"):
        sp.analyze_step(synthetic_step(), "teo_step 9")
    host_only = [e for e in synthetic_step() if e.kind not in sp.GPU_KINDS]
    with pytest.raises(ValueError, match="no GPU work"):
        sp.analyze_step(host_only, "teo_step 1")


def test_reports_from_a_profile(tmp_path):
    step = sp.analyze_step(synthetic_step(), "teo_step 1")
    result = {"gpu": "Test GPU", "date": "today", "pcie": {"v2": {"d2h_GBps": 50.0, "h2d_GBps": 51.0,
                                                                  "bidirectional_each_GBps": 45.0}},
              "shapes": [{"name": "base", "layers": 2, "batch": 1, "seq": 64, "path": "unfused", "profiles": [
                  {"engine": "v2", "policy": "MLP 1/2", "steps": [step], "mean": sp.summarize([step])},
                  {"engine": "v2", "policy": "MLP 2/2", "error": "ValueError: Cannot offload all layers"}]}]}
    text = sp.markdown(result)
    assert "### v2, MLP 1/2" in text and "did not run: ValueError" in text
    assert "| backward | wait: H2D copy | 0.108 |" in text
    assert "| D2H | 2 | 6.0 | 0.16 |" in text
    pytest.importorskip("matplotlib")
    assert sp.chart(result, tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------------
# The capture, host side only (a real torch.profiler trace)


def test_capture_annotates_steps_phases_layers_and_maps_backward_to_layers(tmp_path):
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3))
    x = torch.randn(4, 16)

    def step():
        with sp.phase_mark("forward"):
            h = x
            for layer in layers:
                h = layer(h)
        with sp.phase_mark("backward"):
            h.sum().backward()
        with sp.phase_mark("optimizer"):
            for p in layers.parameters():
                p.grad = None

    path = tmp_path / "trace.json.gz"
    names = sp.profile_steps(step, list(layers), 2, path, cuda=False)
    assert names == ["teo_step 1", "teo_step 2"]
    with gzip.open(path, "rt") as f:
        events = sp.events_from_trace(json.load(f))
    notes = {e.name for e in events if e.kind == "annotation"}
    assert {"teo_step 1", "teo_step 2", "teo_phase forward", "teo_phase backward", "teo_layer 0", "teo_layer 2"} <= notes
    assert "teo_step 0" not in notes  # the profiler's warm-up step is not recorded
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in layers)  # hooks removed
    [s1] = [e for e in events if e.name == "teo_step 1"]
    fwd, bwd = sp._layer_runs(events, s1, s1.tid)
    assert sorted(fwd) == [0, 1, 2]
    assert sorted(bwd) == [0, 1, 2]
    for i in range(3):  # each layer's backward: its linear and tanh, after the later layers' backward
        kinds = {e.name.split(": ")[1] for e in bwd[i]}
        assert {"AddmmBackward0", "TanhBackward0"} <= kinds, kinds
    assert min(e.start for e in bwd[2]) < min(e.start for e in bwd[1]) < min(e.start for e in bwd[0])
    assert all(e.start > fwd[2].end for e in bwd[0])


# ------------------------------------------------------------------------------------------------
# moe_step.py's options


def test_profile_option_takes_none_and_policies():
    args = moe_step.parse_args(["--quick", "--profile", "none,mlp:2,layer:all", "--engines", "v2", "--trace"])
    assert args.profile == [moe_step.NO_OFFLOAD, moe_step.Policy("mlp", 2), moe_step.Policy("layer", 4)]
    assert args.trace and args.profile_steps == 3
    assert moe_step.parse_args(["--quick"]).profile is None
    assert moe_step.profile_stem("NVIDIA H100 80GB HBM3", True) == "moe_step_profile_NVIDIA_H100_80GB_HBM3_unfused"


@pytest.mark.parametrize("argv", [["--trace"], ["--profile", "mlp:9"], ["--profile", ","], ["--profile", "none",
                                                                                             "--profile-steps", "0"]])
def test_bad_profile_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        moe_step.parse_args(["--quick", *argv])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_a_copy_on_the_compute_stream_is_busy_time_split_from_its_kernels():
    """A device-to-host copy on the compute stream is busy time from its start to its end, though no
    kernel runs; the split shows it apart from the kernels."""
    ev = synthetic_step()
    ev.append(_launch(383, 11, name="cudaMemcpyAsync"))
    ev.append(_gpu("memcpy", "Memcpy DtoH (Device -> Pinned)", 385, 420, COMPUTE, 11, 512))
    r = sp.analyze_step(sorted(ev, key=lambda e: (e.start, -e.dur)), "teo_step 1")
    kernels = (100 - 20) + (200 - 105) + (300 - 265) + (380 - 322) + (600 - 523) + (950 - 910)
    assert r["compute_kernels_ms"] == pytest.approx(kernels / 1e3)
    assert r["compute_copies_ms"] == pytest.approx(0.035)
    assert r["compute_busy_ms"] == pytest.approx((kernels + 35) / 1e3)
