"""CPU: the kernels' disk cache: where it lives, what its keys hold, its file format, atomic
writes under many writers, bad entries (one warning, a recompile, the file replaced), and real
sm_90a kernels compiled in one process and loaded in the next (``CUTE_DSL_ARCH=sm_90a``: the
DSL compiles Hopper kernels without a GPU). GPU execution of loaded kernels:
test_kernel_cache_gpu.py."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from te_offload_ops.kernels import atomic_file, disk_cache
from te_offload_ops.kernels.disk_cache import BadEntry, decode, encode

ROOT = Path(__file__).resolve().parent.parent
_HAVE_DSL = importlib.util.find_spec("cutlass") is not None
needs_dsl = pytest.mark.skipif(not _HAVE_DSL, reason="the CuTe DSL (nvidia-cutlass-dsl) is not installed")


# -- where --------------------------------------------------------------------------------------------

def test_location_follows_the_conventions(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(disk_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert disk_cache.cache_dir() == tmp_path / "home" / ".cache" / "te_offload_ops" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert disk_cache.cache_dir() == tmp_path / "xdg" / "te_offload_ops" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG convention: ignored
    assert disk_cache.cache_dir() == tmp_path / "home" / ".cache" / "te_offload_ops" / "kernels"
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, "~/kernels")
    assert disk_cache.cache_dir() == tmp_path / "home" / "kernels"
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(tmp_path / "given"))
    assert disk_cache.cache_dir() == tmp_path / "given"


def test_switch(monkeypatch):
    for raw, on in (("", True), ("1", True), ("0", False), (" 0 ", False)):
        monkeypatch.setenv(disk_cache.CACHE_ENV, raw)
        assert disk_cache.enabled() is on
    monkeypatch.delenv(disk_cache.CACHE_ENV)
    assert disk_cache.enabled()
    monkeypatch.setenv(disk_cache.CACHE_ENV, "off")
    with pytest.raises(ValueError, match=r"TEO_KERNEL_CACHE must be 1 .* or 0 .*, got 'off'"):
        disk_cache.enabled()


# -- the key ------------------------------------------------------------------------------------------

KEY = ("torch.bfloat16", (128, 128), 2, "srelu", 512, 256, 4, False, None, "pingpong", "tvm-ffi")
PARAMS = (("bn", 128), ("epi_cols", 32), ("stages", 7))


@pytest.fixture
def fixed_key_inputs(monkeypatch):
    """The key's environment parts pinned, so each test below changes exactly one."""
    monkeypatch.setattr(disk_cache, "source_digest", lambda: "s" * 64)
    monkeypatch.setattr(disk_cache, "dsl_settings", lambda directory: "arch='sm_90a';lineinfo=False;")
    monkeypatch.setattr(disk_cache, "_version", lambda dist: {"apache-tvm-ffi": "0.1"}.get(dist, "4.8.1"))
    monkeypatch.setattr(disk_cache, "_package_version", lambda: "0.1.0")
    monkeypatch.setattr(disk_cache.platform, "machine", lambda: "x86_64")


CHANGES = {
    "kernel sources": lambda mp: mp.setattr(disk_cache, "source_digest", lambda: "t" * 64),
    "gpu arch": lambda mp: mp.setattr(disk_cache, "dsl_settings", lambda d: "arch='sm_100a';lineinfo=False;"),
    "dsl compile setting": lambda mp: mp.setattr(disk_cache, "dsl_settings", lambda d: "arch='sm_90a';lineinfo=True;"),
    "dsl version": lambda mp: mp.setattr(disk_cache, "_version",
                                         lambda d: {"apache-tvm-ffi": "0.1"}.get(d, "4.9.0")),
    "tvm-ffi version": lambda mp: mp.setattr(disk_cache, "_version",
                                             lambda d: {"apache-tvm-ffi": "0.2"}.get(d, "4.8.1")),
    "package version": lambda mp: mp.setattr(disk_cache, "_package_version", lambda: "0.2.0"),
    "host": lambda mp: mp.setattr(disk_cache.platform, "machine", lambda: "aarch64"),
}


@pytest.mark.parametrize("what", list(CHANGES))
def test_the_key_changes_with_everything_that_changes_the_code(what, fixed_key_inputs, monkeypatch):
    before = disk_cache.Entry(KEY, PARAMS, "tvm-ffi", directory=Path("/nonexistent"))
    CHANGES[what](monkeypatch)
    after = disk_cache.Entry(KEY, PARAMS, "tvm-ffi", directory=Path("/nonexistent"))
    assert after.description != before.description
    assert after.name != before.name and after.prefix != before.prefix


def test_the_key_changes_with_the_variant_and_call(fixed_key_inputs):
    def name(key=KEY, params=PARAMS, call="tvm-ffi"):
        return disk_cache.Entry(key, params, call, directory=Path("/nonexistent")).name

    base = name()
    assert name() == base  # deterministic
    others = [name(key=KEY[:1] + ((128, 64),) + KEY[2:]), name(key=KEY[:-2] + ("cooperative", "tvm-ffi")),
              name(key=KEY[:-1] + (("b", None, True), "tvm-ffi")), name(params=(("bn", 128), ("epi_cols", 64))),
              name(call="python")]
    assert len({base, *others}) == 1 + len(others)


def test_tvm_ffi_version_counts_only_for_its_call(fixed_key_inputs, monkeypatch):
    before = disk_cache.Entry(KEY, PARAMS, "python", directory=Path("/x")).name
    CHANGES["tvm-ffi version"](monkeypatch)
    assert disk_cache.Entry(KEY, PARAMS, "python", directory=Path("/x")).name == before


def test_source_digest_covers_every_kernel_source(tmp_path):
    for f in disk_cache.KERNEL_SOURCES.glob("*.py"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    first = disk_cache.source_digest(tmp_path)
    assert first == disk_cache.source_digest(disk_cache.KERNEL_SOURCES)  # the same bytes, the same digest
    gemm = tmp_path / "gemm_sm90.py"
    gemm.write_bytes(gemm.read_bytes() + b"\n# one more line\n")
    edited = disk_cache.source_digest.__wrapped__(tmp_path)
    assert edited != first
    (tmp_path / "helper.py").write_text("X = 1\n")  # a new module of the kernels
    assert disk_cache.source_digest.__wrapped__(tmp_path) not in (first, edited)


@needs_dsl
def test_kernel_parameters_in_the_key_follow_the_plan_module(monkeypatch):
    """A kernel built differently under the same variant key (a module constant changed at run
    time, as a test may) gets other parameters, so it never loads another's code; the plan a
    loading process derives without the DSL and the compiled kernel object agree."""
    from te_offload_ops.kernels import api, gemm_plan, registry

    import torch

    args = (torch.bfloat16, 512, 256, 4, False, "srelu", (128, 128))
    variant = dict(cluster_n=2, schedule="pingpong")
    narrow = registry.kernel_params(api._make_kernel(*args, **variant))
    assert registry.kernel_params(api._make_plan(*args, **variant)) == narrow
    monkeypatch.setattr(gemm_plan, "_EPI_COLS_TWO_OUTPUTS", 64)
    wide = registry.kernel_params(api._make_kernel(*args, **variant))
    assert registry.kernel_params(api._make_plan(*args, **variant)) == wide
    assert dict(narrow)["epi_cols"] == 32 and dict(wide)["epi_cols"] == 64
    assert all(isinstance(v, (bool, int, float, str, type(None), tuple)) for _, v in narrow)


# -- the file -----------------------------------------------------------------------------------------

SHARED = b"\x7fELF shared" + bytes(range(255, -1, -1)) * 30


def _blob(payload=b"\x7fELF" + bytes(range(256)) * 40, key="the key", call="tvm-ffi", prefix="teo_gemm_x",
          shared=SHARED):
    return encode(key, call, prefix, payload, shared), payload


def test_an_entry_round_trips():
    blob, payload = _blob()
    header, got, shared = decode(blob, "the key")
    assert got == payload and shared == SHARED and header["call"] == "tvm-ffi" and header["prefix"] == "teo_gemm_x"
    header, got, shared = decode(_blob(shared=None)[0], "the key")  # no shared object: the object alone
    assert got == payload and shared is None


def _flip(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x01]) + blob[at + 1:]


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[: len(b) // 2], "truncated"),
    (lambda b: b + b"\0", "padded"),
    (lambda b: _flip(b, len(b) - 10), "checksum mismatch"),  # in the shared object
    (lambda b: _flip(b, len(b) - len(SHARED) - 10), "checksum mismatch"),  # in the object
    (lambda b: b"GARBAGE!" + b[8:], "no header"),
    (lambda b: b[:5], "no header"),
    (lambda b: b"", "no header"),
    (lambda b: b[:12] + b"{not json" + b[21:], "unreadable header"),
])
def test_damaged_entries_are_refused(damage, why):
    blob, _ = _blob()
    with pytest.raises(BadEntry, match=why):
        decode(damage(blob), "the key")


def test_an_entry_of_another_key_is_refused():
    blob, _ = _blob(key="another kernel")
    with pytest.raises(BadEntry, match="its key differs"):
        decode(blob, "the key")


def test_write_is_atomic_and_leaves_no_temporaries(tmp_path, monkeypatch):
    path = tmp_path / "e.kernel"
    disk_cache.write_atomic(path, b"first")
    assert path.read_bytes() == b"first"
    assert oct(path.stat().st_mode & 0o777) == oct(atomic_file.file_mode())  # not mkstemp's 0600

    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(disk_cache.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        disk_cache.write_atomic(path, b"second")
    assert path.read_bytes() == b"first"  # the old entry, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.kernel"]  # the temporary is gone


_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from te_offload_ops.kernels.disk_cache import encode, write_atomic
    path, me, rounds = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    for i in range(rounds):
        payload = bytes([(me * 31 + i) % 256]) * (1 << 20) + i.to_bytes(4, "little")  # 1 MiB, distinct
        write_atomic(path, encode("the key", "tvm-ffi", "teo_gemm_x", payload))
""")


def test_many_writers_at_once_readers_see_whole_entries(tmp_path):
    """Four processes write the same entry over and over (1 MiB each time) while this one reads it
    as fast as it can: every read is a whole entry of one writer (or, before the first, none)."""
    path = tmp_path / "e.kernel"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    writers = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(w), "60"], env=env)
               for w in range(4)]
    reads = bad = 0
    try:
        while any(w.poll() is None for w in writers):
            try:
                blob = path.read_bytes()
            except FileNotFoundError:
                continue
            reads += 1
            try:
                decode(blob, "the key")
            except BadEntry:
                bad += 1
    finally:
        for w in writers:
            w.wait(timeout=120)
    assert [w.returncode for w in writers] == [0] * 4
    assert reads > 0 and bad == 0, (reads, bad)
    decode(path.read_bytes(), "the key")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.kernel"]


# -- entries of one kernel (no compile) ---------------------------------------------------------------

@pytest.fixture
def entry(tmp_path, fixed_key_inputs):
    return disk_cache.Entry(KEY, PARAMS, "tvm-ffi", directory=tmp_path / "cache")


def test_a_missing_entry_loads_nothing_and_says_nothing(entry, caplog):
    with caplog.at_level(logging.INFO, logger=disk_cache.__name__):
        assert entry.load() is None
    assert caplog.records == []


@pytest.mark.parametrize("damage", ["torn", "foreign", "other key", "refused by the DSL"])
def test_a_bad_entry_costs_one_warning_line(entry, caplog, monkeypatch, damage):
    blob = encode(entry.description, "tvm-ffi", entry.prefix, b"object bytes")  # no shared object
    entry.directory.mkdir(parents=True)
    entry.path.write_bytes({"torn": blob[:-3], "foreign": b"\x7fELF" + blob,
                            "other key": encode("another", "tvm-ffi", entry.prefix, b"object bytes"),
                            "refused by the DSL": blob}[damage])

    def refuse(payload, call, prefix):
        raise RuntimeError("Incompatible version: 9.9\nmore detail")

    monkeypatch.setattr(disk_cache, "load_object", refuse)
    with caplog.at_level(logging.INFO, logger=disk_cache.__name__):
        assert entry.load() is None
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    line = caplog.records[0].getMessage()
    assert "\n" not in line and str(entry.path) in line and "compiling the kernel again" in line


def test_an_unusable_directory_costs_one_warning_per_process(tmp_path, fixed_key_inputs, caplog, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(disk_cache, "_WARNED_DIRS", set())
    with caplog.at_level(logging.INFO, logger=disk_cache.__name__):
        for params in (PARAMS, PARAMS[:1]):
            e = disk_cache.Entry(KEY, params, "tvm-ffi", directory=blocker / "cache")
            with e.claim():
                assert e.load() is None
            e.store(object())
    assert len(caplog.records) == 1 and "is not usable" in caplog.records[0].getMessage()


def test_a_store_removes_temporaries_that_dead_writers_left(entry, monkeypatch):
    """A writer killed mid-write leaves its temporary file; the next store of the entry removes it
    once it is old, and leaves a young one (a live writer's) alone."""
    entry.directory.mkdir(parents=True)
    old, young = (entry.directory / f".{entry.name}.{tag}.tmp" for tag in ("dead", "live"))
    for f in (old, young):
        f.write_bytes(b"half an entry")
    os.utime(old, (time.time() - 2 * disk_cache.ORPHAN_AGE_S,) * 2)
    monkeypatch.setattr(disk_cache, "export_object", lambda compiled, call, prefix: b"object bytes")
    entry.store("compiled")
    assert entry.path.exists() and not old.exists() and young.exists()


def test_a_failed_export_costs_one_warning_and_no_file(entry, caplog):
    with caplog.at_level(logging.INFO, logger=disk_cache.__name__):
        entry.store(object())  # not a compiled kernel: the export raises
    assert len(caplog.records) == 1 and "could not write kernel cache entry" in caplog.records[0].getMessage()
    assert not entry.path.exists()


# -- real kernels, process to process (sm_90a, no GPU) ------------------------------------------------

_RUN = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(name)s: %(message)s")
    import torch
    from te_offload_ops.kernels import api, registry
    kern, compiled = api.get_kernel(torch.bfloat16, 256, 128, 2, b_n_major=False, epilogue="srelu")
    print("RESULT " + json.dumps({"compiled": len(registry.compile_times()), "loaded": len(registry.load_times()),
                                  "type": type(compiled).__name__, "callable": callable(compiled),
                                  "call": kern.call, "n_tiles": kern.n_tiles}))
""")


def _run(cache: Path, script: str = _RUN, **env) -> tuple[dict, list[str]]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "CUTE_DSL_ARCH": "sm_90a", "TEO_KERNEL_CACHE": "1",
            "TEO_KERNEL_CACHE_DIR": str(cache), **env}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=full, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    logs = [ln for ln in proc.stderr.splitlines() if ln.startswith("LOG ")]
    return result, logs


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*" + disk_cache.SUFFIX))


def _compiled_then_loaded(cache: Path, call: str, script: str = _RUN):
    """Two processes running ``script``: the first compiles one kernel into ``cache``, the second
    loads it, both quietly, with ``call``; returns (first's result, second's, the entry's path)."""
    if call == "tvm-ffi" and importlib.util.find_spec("tvm_ffi") is None:
        pytest.skip("apache-tvm-ffi is not installed")
    first, logs = _run(cache, script, TEO_KERNEL_CALL=call)
    assert (first["compiled"], first["loaded"], first["call"]) == (1, 0, call) and logs == []
    [path] = _entries(cache)
    second, logs = _run(cache, script, TEO_KERNEL_CALL=call)
    assert (second["compiled"], second["loaded"], second["call"]) == (0, 1, call) and logs == []
    return first, second, path


@needs_dsl
@pytest.mark.parametrize("call", ["tvm-ffi", "python"])
def test_a_kernel_compiled_in_one_process_loads_in_the_next(tmp_path, call):
    cache = tmp_path / "cache"
    t0 = time.perf_counter()
    first, second, path = _compiled_then_loaded(cache, call)
    assert second["callable"] and second["n_tiles"] == first["n_tiles"]
    assert second["type"] == ("Function" if call == "tvm-ffi" else first["type"])
    assert _entries(cache) == [path]
    print(f"{call}: two processes in {time.perf_counter() - t0:.1f} s")


_RUN_FP8 = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(name)s: %(message)s")
    import torch
    from te_offload_ops.kernels import api_fp8, registry
    kern, compiled = api_fp8.get_kernel_fp8(torch.bfloat16, 384, 256, 3, 4)
    print("RESULT " + json.dumps({"compiled": len(registry.compile_times()), "loaded": len(registry.load_times()),
                                  "type": type(compiled).__name__, "call": kern.call, "n_tiles": kern.n_tiles,
                                  "bm": kern.bm, "cluster_n": kern.cluster_n, "experts": kern.num_experts,
                                  "dsl_imported": "cutlass" in sys.modules}))
""")


@needs_dsl
@pytest.mark.parametrize("call", ["tvm-ffi", "python"])
def test_an_fp8_kernel_compiled_in_one_process_loads_in_the_next(tmp_path, call):
    cache = tmp_path / "cache"
    first, second, path = _compiled_then_loaded(cache, call, _RUN_FP8)
    # the launch reads the same tile walk from the DSL-free plan as from the kernel object
    from te_offload_ops.kernels import shared_object, tiling

    walk = ("n_tiles", "bm", "cluster_n", "experts")
    assert [second[w] for w in walk] == [first[w] for w in walk] == [3, 128, tiling.pick_cluster(384, (128, 128)), 3]
    assert _entries(cache) == [path]
    if call == "python":
        assert second["type"] == first["type"] and second["dsl_imported"]
    elif shared_object.compiler() is not None:  # a linked shared object: loaded through tvm_ffi alone
        assert not second["dsl_imported"]


@needs_dsl
def test_a_corrupt_entry_is_compiled_again_with_one_warning_and_replaced(tmp_path):
    cache = tmp_path / "cache"
    _run(cache)
    [path] = _entries(cache)
    good = path.read_bytes()
    path.write_bytes(_flip(good, len(good) - 100))  # one bit of the object
    result, logs = _run(cache)
    assert (result["compiled"], result["loaded"]) == (1, 0)
    assert len(logs) == 1 and "WARNING" in logs[0] and "checksum mismatch" in logs[0] and str(path) in logs[0]
    decode(path.read_bytes(), json.loads(good[12:12 + int.from_bytes(good[8:12], "little")])["key"])
    result, logs = _run(cache)  # the replacement loads
    assert (result["compiled"], result["loaded"]) == (0, 1) and logs == []


@needs_dsl
def test_the_switch_turns_the_disk_off(tmp_path):
    cache = tmp_path / "cache"
    result, logs = _run(cache, TEO_KERNEL_CACHE="0")
    assert (result["compiled"], result["loaded"]) == (1, 0) and logs == [] and not cache.exists()


@needs_dsl
def test_processes_starting_together_compile_a_variant_once(tmp_path):
    """Two processes want the same kernel at once: one compiles it, the other waits and loads it."""
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUTE_DSL_ARCH="sm_90a", TEO_KERNEL_CACHE="1",
               TEO_KERNEL_CACHE_DIR=str(cache))
    procs = [subprocess.Popen([sys.executable, "-c", _RUN], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(next(ln for ln in out.splitlines() if ln.startswith("RESULT "))[7:]))
    assert sorted((r["compiled"], r["loaded"]) for r in results) == [(0, 1), (1, 0)]
    assert len(_entries(cache)) == 1


# -- warm-up ------------------------------------------------------------------------------------------

def test_the_fused_mlp_variants(monkeypatch):
    from te_offload_ops.kernels import api_wgrad, main_grads, mlp_variants, tiling

    for env in (api_wgrad.WGRAD_BACKEND_ENV, main_grads.MAIN_GRAD_ADD_ENV, tiling.SCHEDULE_ENV):
        monkeypatch.delenv(env, raising=False)
    te = mlp_variants(8, 1024, 512)
    assert [v.label for v in te] == ["fc1 forward + SReLU", "fc2 forward", "fc2 dgrad + dSReLU", "fc1 dgrad",
                                     "fc2 wgrad", "fc1 wgrad"]
    assert all(v.kwargs.get("b_layout", (None, False)) == (None, False) for v in te)
    assert [(v.kwargs["n"], v.kwargs["k"], v.kwargs.get("wgrad_m")) for v in te] == [
        (512, 1024, None), (1024, 512, None), (512, 1024, None), (1024, 512, None), (512, 0, 1024), (1024, 0, 512)]
    mg = mlp_variants(8, 1024, 512, main_grad=True, weight_layout="megatron")
    assert all(v.kwargs["b_layout"] == (None, True) for v in mg[:4])  # the DDP buffer: experts last first
    ways = [(v.kwargs["epilogue"], v.kwargs["schedule"], v.kwargs["slot_stride"]) for v in mg[4:]]
    assert ways == [("tma_f32", None, 1024 * 512), ("acc_f32", None, None), ("acc_f32", "cooperative", None)] * 2
    # a token count picks one way, as the op would at run time
    many = mlp_variants(8, 1024, 512, main_grad=True, tokens=8 * 4096)
    assert [v.kwargs["epilogue"] for v in many[4:]] == ["tma_f32", "tma_f32"]
    padded = mlp_variants(8, 1024, 512, main_grad=True, weight_layout="megatron", expert_stride=1024 * 512 + 64,
                          tokens=8 * 4096)
    assert padded[0].kwargs["b_layout"] == (1024 * 512 + 64, True) and padded[4].kwargs["slot_stride"] == 1024 * 512 + 64
    assert [v.kwargs["epilogue"] for v in mlp_variants(8, 1024, 512, main_grad=True, overwrite_main_grad=True)[4:]] \
        == ["store_f32", "store_f32"]
    monkeypatch.setenv(api_wgrad.WGRAD_BACKEND_ENV, "torch")
    assert len(mlp_variants(8, 1024, 512)) == 4  # torch's grouped mm does the wgrads
    for bad, said in ((dict(hidden_size=1020), "multiples of 8"), (dict(weight_layout="fsdp"), "weight_layout"),
                      (dict(num_experts=0), "num_experts"), (dict(tokens=0), "tokens")):
        kw = {"num_experts": 8, "hidden_size": 1024, "ffn_hidden_size": 512, **bad}
        with pytest.raises(ValueError, match=said):
            mlp_variants(**kw)


@pytest.mark.parametrize("bad, said", [
    (dict(expert_stride=1024 * 512 + 0.5), r"expert_stride must be an integer .*got 524288.5"),
    (dict(expert_stride=1024), "expert_stride must be an integer of at least hidden_size \\* ffn_hidden_size"),
    (dict(num_experts=True), "num_experts must be a positive integer, got True"),
    (dict(tokens=4096.0), "tokens must be a positive integer or None, got 4096.0"),
])
def test_the_fused_mlp_variants_refuse_counts_that_are_not_whole_numbers(bad, said):
    from te_offload_ops.kernels import mlp_variants

    kw = {"num_experts": 8, "hidden_size": 1024, "ffn_hidden_size": 512, "main_grad": True, **bad}
    with pytest.raises(ValueError, match=said):
        mlp_variants(**kw)


def _warmup(cache: Path, *args: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "CUTE_DSL_ARCH": "sm_90a", "TEO_KERNEL_CACHE": "1",
            "TEO_KERNEL_CACHE_DIR": str(cache), **env}
    return subprocess.run([sys.executable, "-m", "te_offload_ops.kernels.warmup", *args], capture_output=True,
                          text=True, env=full, timeout=900)


@needs_dsl
def test_warm_up_command_compiles_then_loads_every_variant(tmp_path):
    cache = tmp_path / "cache"
    args = ("--num-experts", "4", "--hidden-size", "128", "--ffn-hidden-size", "64", "--expert-model-parallel-size", "2")
    first = _warmup(cache, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [ln for ln in first.stdout.splitlines() if ln.startswith("[")]
    assert len(lines) == 6 and all(": compiled in " in ln and ", 2 experts," in ln for ln in lines), first.stdout
    assert "6 kernels in" in first.stdout and "6 compiled and written" in first.stdout
    assert len(_entries(cache)) == 6
    second = _warmup(cache, *args)
    assert second.returncode == 0, second.stderr[-3000:]
    lines = [ln for ln in second.stdout.splitlines() if ln.startswith("[")]
    assert len(lines) == 6 and all(": loaded in " in ln for ln in lines), second.stdout
    assert "0 compiled and written, 6 already in" in second.stdout


@needs_dsl
def test_warm_up_command_compiles_in_parallel_processes_then_loads(tmp_path):
    cache = tmp_path / "cache"
    args = ("--num-experts", "2", "--hidden-size", "128", "--ffn-hidden-size", "64")
    first = _warmup(cache, *args, "--jobs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "; 2 processes" in first.stdout
    lines = [ln for ln in first.stdout.splitlines() if ln.startswith("[")]
    assert sorted(ln.split("]")[0] for ln in lines) == [f"[{i}/6" for i in range(1, 7)], first.stdout
    assert all(": compiled in " in ln for ln in lines) and "6 compiled and written" in first.stdout
    assert len(_entries(cache)) == 6
    second = _warmup(cache, *args, "--jobs", "1")
    assert second.returncode == 0 and "; 1 process" in second.stdout, second.stderr[-3000:]
    assert "0 compiled and written, 6 already in" in second.stdout, second.stdout


def test_warm_up_takes_a_positive_number_of_jobs():
    from te_offload_ops.kernels import warm_up
    from te_offload_ops.kernels.warmup import _parse

    assert _parse(["--num-experts", "4", "--hidden-size", "128", "--ffn-hidden-size", "64"])[1].jobs == 1
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="jobs must be a positive integer"):
            warm_up(2, 128, 64, jobs=bad)


@pytest.mark.parametrize("args, env, said", [
    (["--num-experts", "4", "--hidden-size", "128", "--ffn-hidden-size", "64", "--jobs", "0"], {},
     "--jobs must be positive"),
    (["--num-experts", "6", "--hidden-size", "128", "--ffn-hidden-size", "64", "--expert-model-parallel-size", "4"],
     {}, "is not a multiple of --expert-model-parallel-size=4"),
    (["--num-experts", "4", "--hidden-size", "0", "--ffn-hidden-size", "64"], {}, "--hidden-size must be positive"),
    (["--num-experts", "4", "--hidden-size", "130", "--ffn-hidden-size", "64"], {}, "multiples of 8"),
    (["--num-experts", "4", "--hidden-size", "128", "--ffn-hidden-size", "64", "--overwrite-main-grad"], {},
     "--overwrite-main-grad goes with --main-grad"),
    (["--num-experts", "4", "--hidden-size", "128", "--ffn-hidden-size", "64"], {"TEO_KERNEL_CACHE": "0"},
     "the disk cache is off"),
    (["--num-experts", "4", "--hidden-size", "128", "--ffn-hidden-size", "64"], {"TEO_KERNEL_CACHE": "yes"},
     "TEO_KERNEL_CACHE must be 1"),
])
def test_warm_up_command_refuses_bad_arguments_clearly(tmp_path, args, env, said):
    proc = _warmup(tmp_path / "cache", *args, **env)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "cache").exists()


def test_the_fp8_path_variants_are_the_fp8_gemms_and_the_same_wgrads(monkeypatch):
    from te_offload_ops.kernels import api_wgrad, main_grads, mlp_variants, tiling

    for env in (api_wgrad.WGRAD_BACKEND_ENV, main_grads.MAIN_GRAD_ADD_ENV, tiling.SCHEDULE_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("TEO_FP8_ROWS", "triton")  # SReLU and its backward as row passes: the plain FP8 GEMMs
    fp8 = mlp_variants(8, 2688, 1856, fp8=True)
    # fc1's forward and fc2's dgrad read (N=F, K=H) weights, fc2's forward and fc1's dgrad (N=H, K=F);
    # B's scale rows hold ceil(K / 128) blocks padded to 4, as TE's quantizer pads them
    assert [(v.kwargs["n"], v.kwargs["k"], v.kwargs["sb_cols"]) for v in fp8[:2]] == [(1856, 2688, 24),
                                                                                    (2688, 1856, 16)]
    assert all(v.kwargs["fp8"] and "FP8" in v.describe() for v in fp8[:2])
    assert fp8[2:] == mlp_variants(8, 2688, 1856)[4:]  # the wgrads run in bf16 either way
    megatron = mlp_variants(8, 2688, 1856, fp8=True, main_grad=True, tokens=8 * 4096)
    assert megatron[2:] == mlp_variants(8, 2688, 1856, main_grad=True, tokens=8 * 4096)[4:]
    with pytest.raises(ValueError, match="multiples of 16"):
        mlp_variants(8, 2688, 1864, fp8=True)
    # by default SReLU and its backward run in the GEMMs' epilogues: fc1's forward and fc2's dgrad
    # kernels of their own, with the recipe's default scale rounding
    monkeypatch.delenv("TEO_FP8_ROWS")
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    gemm = mlp_variants(8, 2688, 1856, fp8=True)
    assert [(v.kwargs["n"], v.kwargs.get("fp8_epilogue", "plain"), v.kwargs.get("pow2")) for v in gemm[:3]] == \
        [(2688, "plain", None), (1856, "srelu_q", True), (1856, "dsrelu_q", True)]
    assert gemm[3:] == fp8[2:] and "power-of-two" in gemm[1].describe()
    monkeypatch.setenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")
    assert [v.kwargs.get("pow2") for v in mlp_variants(8, 2688, 1856, fp8=True)[1:3]] == [False, False]


def test_the_fp8_wgrad_setting_warms_the_fp8_wgrad_kernels(monkeypatch):
    from te_offload_ops.kernels import mlp_variants

    monkeypatch.setenv("TEO_FP8_WGRAD", "fp8")
    plain = mlp_variants(8, 2688, 1856, fp8=True)
    # dW2 = dy^T act (M=H, N=F), dW1 = dz^T x (M=F, N=H), each in FP8 on columnwise copies
    assert [(v.kwargs.get("fp8_wgrad"), v.kwargs["m"], v.kwargs["n"], v.kwargs["epilogue"]) for v in plain[3:]] == \
        [(True, 2688, 1856, "plain"), (True, 1856, 2688, "plain")]
    assert all("128-token scales" in v.describe() for v in plain[3:])
    into = mlp_variants(8, 2688, 1856, fp8=True, main_grad=True, tokens=8 * 4096)
    assert [v.kwargs["epilogue"] for v in into[3:]] == ["red_f32", "red_f32"]
    over = mlp_variants(8, 2688, 1856, fp8=True, main_grad=True, overwrite_main_grad=True)
    assert [v.kwargs["epilogue"] for v in over[3:]] == ["store_f32", "store_f32"]
    assert plain[:3] == into[:3] == over[:3]  # the forward and dgrad GEMMs do not change
    monkeypatch.setenv("TEO_FP8_WGRAD", "bf16")
    assert not any(v.kwargs.get("fp8_wgrad") for v in mlp_variants(8, 2688, 1856, fp8=True))


@needs_dsl
def test_warm_up_command_compiles_and_loads_the_fp8_wgrad_kernels(tmp_path):
    cache = tmp_path / "cache"
    args = ("--num-experts", "2", "--hidden-size", "256", "--ffn-hidden-size", "128", "--fp8")
    first = _warmup(cache, *args, TEO_FP8_WGRAD="fp8")
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [ln for ln in first.stdout.splitlines() if ln.startswith("[")]
    assert len(lines) == 5 and all(": compiled in " in ln for ln in lines), first.stdout
    assert sum("128-token scales" in ln for ln in lines) == 2
    second = _warmup(cache, *args, TEO_FP8_WGRAD="fp8")
    assert second.returncode == 0 and "0 compiled and written, 5 already in" in second.stdout, second.stdout


@needs_dsl
def test_warm_up_command_compiles_then_loads_the_fp8_path(tmp_path):
    cache = tmp_path / "cache"
    args = ("--num-experts", "2", "--hidden-size", "256", "--ffn-hidden-size", "128", "--fp8")
    first = _warmup(cache, *args)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [ln for ln in first.stdout.splitlines() if ln.startswith("[")]
    # fc2's forward / fc1's dgrad, fc1's forward with the SReLU epilogue, fc2's dgrad with its
    # backward (all three FP8), and the two bf16 wgrads
    assert len(lines) == 5 and all(": compiled in " in ln for ln in lines), first.stdout
    assert sum("FP8 e4m3" in ln for ln in lines) == 3 and "FP8 block scaling" in first.stdout
    assert sum("quantized" in ln for ln in lines) == 2
    assert len(_entries(cache)) == 5
    second = _warmup(cache, *args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "0 compiled and written, 5 already in" in second.stdout, second.stdout
