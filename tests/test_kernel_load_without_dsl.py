"""CPU: kernels the disk cache holds as shared objects load through TVM-FFI in a process that never
imports the CuTe DSL (``CUTE_DSL_ARCH=sm_90a``: the DSL compiles Hopper kernels without a GPU).

The key of an entry holds the DSL's compile settings; such a process recalls them from the cache
directory for its context (what a process that imported the DSL there left), and launches each
kernel from its plan (the parameters ``gemm_plan`` derives in plain Python, equal to the kernel
object's). A new context, a stale record, an entry without a shared object (no C compiler where it
was compiled) or one whose shared object does not load all still work, importing the DSL. GPU
execution (the same bits as the compiling process): test_kernel_cache_gpu.py."""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from te_offload_ops.kernels import api, availability, disk_cache, dsl, dsl_settings, gemm_plan, registry, shared_object

ROOT = Path(__file__).resolve().parent.parent
_HAVE = (importlib.util.find_spec("cutlass") is not None and importlib.util.find_spec("tvm_ffi") is not None
         and shared_object.compiler() is not None)
needs_dsl_and_linker = pytest.mark.skipif(
    not _HAVE, reason="needs the CuTe DSL, apache-tvm-ffi and a C compiler to link shared objects")
needs_dsl = pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="needs the CuTe DSL")

SHAPES = {"num_experts": 4, "hidden_size": 128, "ffn_hidden_size": 64}
LAYOUTS = {"te": {}, "megatron": {"main_grad": True, "weight_layout": "megatron"}}

# every kernel of the fused MLP's variant sets, through get_kernel as the fused op asks for them
_LOAD = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(name)s: %(message)s")
    import torch
    import te_offload_ops
    from te_offload_ops.fused.selection import kernel_problem
    from te_offload_ops.kernels import api, mlp_variants, registry
    problem = kernel_problem()
    kinds = []
    for settings in json.loads(sys.argv[1]):
        for v in mlp_variants(**settings):
            kw = dict(v.kwargs)
            kern, compiled = api.get_kernel(kw.pop("dtype"), kw.pop("n"), kw.pop("k"), kw.pop("e"), **kw)
            kinds.append([type(kern).__name__, type(compiled).__name__, kern.call])
    print("RESULT " + json.dumps({
        "problem": problem, "kinds": kinds, "compiled": len(registry.compile_times()),
        "loaded": len(registry.load_times()), "by": sorted(set(registry.loaded_by().values())),
        "dsl_modules": sorted(m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")),
        "dsl_import_s": registry.dsl_import_seconds()}))
""")


def _env(cache: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUTE_DSL_")}
    env.pop("TEO_KERNEL_CALL", None)
    return {**env, "PYTHONPATH": str(ROOT), "CUTE_DSL_ARCH": "sm_90a", "TEO_KERNEL_CACHE": "1",
            "TEO_KERNEL_CACHE_DIR": str(cache), **extra}


def _python(code: str, cache: Path, *args: str, **env) -> tuple[dict, list[str]]:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=_env(cache, **env), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    return result, [ln for ln in proc.stderr.splitlines() if ln.startswith("LOG ")]


def _load_mlp(cache: Path, **env) -> tuple[dict, list[str]]:
    settings = [{**SHAPES, **extra} for extra in LAYOUTS.values()]
    return _python(_LOAD, cache, json.dumps(settings), **env)


def _warnings(logs: list[str]) -> list[str]:
    return [ln for ln in logs if ln.startswith("LOG WARNING")]


@pytest.fixture(scope="module")
def mlp_cache(tmp_path_factory):
    """A cache directory the warm-up command filled with both layouts' kernels (compiled here)."""
    if not _HAVE:
        pytest.skip("needs the CuTe DSL, apache-tvm-ffi and a C compiler")
    cache = tmp_path_factory.mktemp("mlp") / "cache"
    base = ["--num-experts", "4", "--hidden-size", "128", "--ffn-hidden-size", "64"]
    for extra in ([], ["--megatron"]):
        proc = subprocess.run([sys.executable, "-m", "te_offload_ops.kernels.warmup", *base, *extra],
                              capture_output=True, text=True, env=_env(cache), timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return cache


@needs_dsl_and_linker
def test_a_warm_process_loads_every_kernel_of_the_fused_mlp_without_the_dsl(mlp_cache, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(mlp_cache, cache)
    entries = sorted(cache.glob("*" + disk_cache.SUFFIX))
    result, logs = _load_mlp(cache)
    assert result["problem"] is None  # the fusion's check, answered without importing the DSL
    assert result["dsl_modules"] == [] and result["dsl_import_s"] == 0.0
    assert result["compiled"] == 0 and result["loaded"] == len(entries) >= 14, result
    assert result["by"] == [disk_cache.BY_SHARED_OBJECT]
    assert {tuple(k) for k in result["kinds"]} == {("GemmPlan", "Function", "tvm-ffi")}
    assert _warnings(logs) == []
    assert sorted(cache.glob("*" + disk_cache.SUFFIX)) == entries  # nothing rewritten


@needs_dsl_and_linker
def test_a_new_context_imports_the_dsl_once_and_is_remembered(mlp_cache, tmp_path):
    """Another DSL variable (one that changes no compile setting) is another context: its first
    process imports the DSL to read the settings, finds every entry under them and files them;
    the next process of that context loads without the DSL."""
    cache = tmp_path / "cache"
    shutil.copytree(mlp_cache, cache)
    memos = sorted(cache.glob(dsl_settings.PREFIX + "*"))
    env = {"CUTE_DSL_JIT_TIME_PROFILING": "0"}
    first, logs = _load_mlp(cache, **env)
    assert first["dsl_modules"] != [] and first["dsl_import_s"] > 0 and _warnings(logs) == []
    assert first["compiled"] == 0 and first["by"] == [disk_cache.BY_SHARED_OBJECT]
    assert len(sorted(cache.glob(dsl_settings.PREFIX + "*"))) == len(memos) + 1
    second, logs = _load_mlp(cache, **env)
    assert second["dsl_modules"] == [] and second["compiled"] == 0 and second["loaded"] == first["loaded"]


# -- one kernel, process to process -------------------------------------------------------------------

_ONE = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(name)s: %(message)s")
    import torch
    from te_offload_ops.kernels import api, registry
    kern, compiled = api.get_kernel(torch.bfloat16, 256, 128, 2, b_n_major=False, epilogue="srelu")
    print("RESULT " + json.dumps({
        "compiled": len(registry.compile_times()), "loaded": len(registry.load_times()),
        "by": sorted(set(registry.loaded_by().values())), "type": type(compiled).__name__,
        "dsl": "cutlass" in sys.modules}))
""")


def _one(cache: Path, **env) -> tuple[dict, list[str]]:
    return _python(_ONE, cache, **env)


def _entry(cache: Path) -> Path:
    [path] = sorted(cache.glob("*" + disk_cache.SUFFIX))
    return path


def _header(blob: bytes) -> dict:
    return json.loads(blob[12:12 + int.from_bytes(blob[8:12], "little")])


@needs_dsl_and_linker
def test_a_stale_record_of_the_settings_costs_a_compile_and_is_corrected(tmp_path):
    cache = tmp_path / "cache"
    first, _ = _one(cache)
    assert (first["compiled"], first["loaded"]) == (1, 0)
    [memo] = cache.glob(dsl_settings.PREFIX + "*")
    record = json.loads(memo.read_text())
    true_settings = record["settings"]
    record["settings"] = true_settings.replace("lineinfo=False", "lineinfo=True")
    assert record["settings"] != true_settings
    memo.write_text(json.dumps(record))
    second, logs = _one(cache)  # its key names settings no entry was compiled under: it compiles
    assert (second["compiled"], second["loaded"]) == (1, 0)
    warned = _warnings(logs)
    assert len(warned) == 1 and "settings differ from those recalled" in warned[0], logs
    assert json.loads(memo.read_text())["settings"] == true_settings
    assert len(list(cache.glob("*" + disk_cache.SUFFIX))) == 1  # stored under its true key: the first process's entry
    third, logs = _one(cache)
    assert (third["compiled"], third["loaded"], third["dsl"]) == (0, 1, False) and _warnings(logs) == []


@needs_dsl_and_linker
def test_without_a_c_compiler_entries_hold_the_object_and_load_through_the_dsl(tmp_path):
    cache = tmp_path / "cache"
    first, logs = _one(cache, CC="false")  # a compiler driver that fails
    assert (first["compiled"], first["loaded"]) == (1, 0) and _warnings(logs) == []
    said = [ln for ln in logs if "without a shared object" in ln]
    assert len(said) == 1 and said[0].startswith("LOG INFO"), logs
    blob = _entry(cache).read_bytes()
    _, payload, shared = disk_cache.decode(blob, _header(blob)["key"])
    assert shared is None and payload.startswith(b"\x7fELF")
    second, logs = _one(cache)
    assert (second["compiled"], second["loaded"], second["dsl"]) == (0, 1, True) and _warnings(logs) == []
    assert second["by"] == [disk_cache.BY_DSL] and second["type"] == "Function"


@needs_dsl_and_linker
def test_a_shared_object_that_does_not_load_falls_back_to_the_object(tmp_path):
    cache = tmp_path / "cache"
    _one(cache)
    path = _entry(cache)
    blob = path.read_bytes()
    header = _header(blob)
    _, payload, shared = disk_cache.decode(blob, header["key"])
    assert shared is not None and shared.startswith(b"\x7fELF")
    # whole and checksummed, but no library the loader takes
    path.write_bytes(disk_cache.encode(header["key"], header["call"], header["prefix"], payload, b"not an ELF file"))
    second, logs = _one(cache)
    assert (second["compiled"], second["loaded"], second["by"]) == (0, 1, [disk_cache.BY_DSL])
    assert _warnings(logs) == [] and any("its shared object did not load" in ln for ln in logs), logs


# -- the plan -----------------------------------------------------------------------------------------

@needs_dsl
def test_the_plan_derives_what_the_kernel_object_derives():
    """Every parameter of the cache key, for variants across dtypes, tiles, schedules, clusters,
    epilogues and weight layouts: the plan (no DSL) and the kernel object (the DSL's) agree."""
    import cutlass.memory

    assert gemm_plan.SMEM_BYTES_SM90 == cutlass.memory.get_smem_capacity_in_bytes("sm_90")
    checked = 0
    forward = itertools.product((torch.bfloat16, torch.float16), ((128, 64), (128, 128), (128, 192), (128, 256)),
                                ("plain", "srelu", "dsrelu"), ("cooperative", "pingpong"), (1, 2),
                                ((None, False), (4096 * 256 + 64, True)))
    for dtype, tile, epilogue, schedule, cluster_m, b_layout in forward:
        if schedule == "pingpong" and tile[1] > 128:
            continue
        args = (dtype, 4096, 256, 8, epilogue == "dsrelu", epilogue, tile)
        variant = dict(cluster_n=2, schedule=schedule, b_layout=b_layout, cluster_m=cluster_m)
        plan = api._make_plan(*args, **variant)
        assert registry.kernel_params(plan) == registry.kernel_params(api._make_kernel(*args, **variant)), (args, variant)
        checked += 1
    for epilogue, tile in itertools.product(("plain", "acc_f32", "red_f32", "tma_f32", "store_f32"),
                                            ((128, 128), (128, 256))):
        args = (torch.bfloat16, 1024, 0, 8, True, epilogue, tile)
        variant = dict(cluster_n=2, wgrad_m=2048, schedule="cooperative",
                       slot_stride=2048 * 1024 if epilogue == "tma_f32" else None)
        plan = api._make_plan(*args, **variant)
        assert registry.kernel_params(plan) == registry.kernel_params(api._make_kernel(*args, **variant)), (args, variant)
        checked += 1
    assert checked > 100


def test_the_plan_refuses_what_the_kernel_refuses():
    with pytest.raises(ValueError, match="pingpong schedule takes BN <= 128"):
        api._make_plan(torch.bfloat16, 512, 256, 4, False, "plain", (128, 256), schedule="pingpong")
    with pytest.raises(ValueError, match="multiples of 8"):
        api._make_plan(torch.bfloat16, 500, 256, 4, False, "plain", (128, 128))
    with pytest.raises(TypeError, match="bf16 and fp16"):
        api._make_plan(torch.float32, 512, 256, 4, False, "plain", (128, 128))


def test_a_plan_has_what_a_launch_reads():
    plan = api._make_plan(torch.bfloat16, 1024, 0, 8, True, "plain", (128, 256), cluster_n=2, wgrad_m=2048)
    for name in ("wgrad_m", "num_experts", "wgrad_tiles", "bm", "n_tiles", "cluster_size", "cluster_n",
                 "cluster_m", "n_pairs", "epilogue", "n", "k"):
        assert hasattr(plan, name), name
    assert (plan.n_tiles, plan.m_tiles, plan.wgrad_tiles) == (4, 16, 64)


# -- the DSL's settings, recalled per context ---------------------------------------------------------

@pytest.fixture
def known_context(monkeypatch):
    """No GPU, a fixed installation, the DSL not imported and not importable (a test that reaches
    for it fails)."""
    monkeypatch.setattr(dsl_settings, "_gpu", lambda: None)
    monkeypatch.setattr(dsl_settings, "_installation", lambda: {"package": "/dsl", "versions": {"dsl": "1"}})
    for name in [k for k in os.environ if k.startswith(dsl_settings.ENV_PREFIX)]:
        monkeypatch.delenv(name)
    monkeypatch.setattr(dsl, "imported", lambda: False)

    def no_dsl():
        raise AssertionError("the DSL was asked")

    monkeypatch.setattr(dsl_settings, "read_from_dsl", no_dsl)


def test_settings_are_recalled_for_their_context(known_context, monkeypatch, tmp_path):
    assert dsl_settings.recall(tmp_path / "absent") is None
    dsl_settings.remember(tmp_path, "arch='sm_90a';")
    assert dsl_settings.recall(tmp_path) == "arch='sm_90a';"
    assert dsl_settings.current(tmp_path) == "arch='sm_90a';"  # without the DSL
    monkeypatch.setenv("OTHER_VARIABLE", "x")  # not the DSL's: the same context
    assert dsl_settings.recall(tmp_path) == "arch='sm_90a';"


CONTEXT_CHANGES = {
    "a DSL variable": lambda mp: mp.setenv("CUTE_DSL_LINEINFO", "1"),
    "a GPU": lambda mp: mp.setattr(dsl_settings, "_gpu", lambda: {"device 0": [9, 0], "driver": 13000}),
    "the DSL's installation": lambda mp: mp.setattr(dsl_settings, "_installation",
                                                    lambda: {"package": "/dsl", "versions": {"dsl": "2"}}),
}


@pytest.mark.parametrize("change", list(CONTEXT_CHANGES))
def test_another_context_recalls_nothing_and_asks_the_dsl(known_context, monkeypatch, tmp_path, change):
    dsl_settings.remember(tmp_path, "arch='sm_90a';")
    CONTEXT_CHANGES[change](monkeypatch)
    assert dsl_settings.recall(tmp_path) is None
    with pytest.raises(AssertionError, match="the DSL was asked"):
        dsl_settings.current(tmp_path)


def test_a_record_not_of_this_context_is_not_recalled(known_context, tmp_path):
    dsl_settings.remember(tmp_path, "arch='sm_90a';")
    [memo] = tmp_path.glob(dsl_settings.PREFIX + "*")
    record = json.loads(memo.read_text())
    record["context"]["environment"] = {"CUTE_DSL_ARCH": "sm_100a"}  # another context, this file name
    memo.write_text(json.dumps(record))
    assert dsl_settings.recall(tmp_path) is None
    for garbage in ("{not json", "[]", json.dumps({"context": dsl_settings.context(), "settings": 7})):
        memo.write_text(garbage)
        assert dsl_settings.recall(tmp_path) is None


def test_settings_read_from_the_dsl_are_filed_and_a_difference_is_said(known_context, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(dsl, "imported", lambda: True)
    monkeypatch.setattr(dsl, "environment_at_import", lambda: {})
    monkeypatch.setattr(dsl_settings, "read_from_dsl", lambda: "arch='sm_90a';")
    with caplog.at_level(logging.INFO, logger=dsl_settings.__name__):
        assert dsl_settings.current(tmp_path) == "arch='sm_90a';"
        assert caplog.records == []
        monkeypatch.setattr(dsl_settings, "read_from_dsl", lambda: "arch='sm_90a';lineinfo=True;")
        assert dsl_settings.current(tmp_path) == "arch='sm_90a';lineinfo=True;"  # the DSL's word wins
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    assert "differ from those recalled" in caplog.records[0].getMessage()
    assert dsl_settings.recall(tmp_path) == "arch='sm_90a';lineinfo=True;"


def test_settings_of_a_dsl_imported_under_other_variables_are_not_filed(known_context, monkeypatch, tmp_path):
    """The DSL reads its variables once: after one changes, its settings are not this context's."""
    monkeypatch.setattr(dsl, "imported", lambda: True)
    monkeypatch.setattr(dsl, "environment_at_import", lambda: {"CUTE_DSL_LINEINFO": "1"})
    monkeypatch.setattr(dsl_settings, "read_from_dsl", lambda: "arch='sm_90a';lineinfo=True;")
    assert dsl_settings.current(tmp_path) == "arch='sm_90a';lineinfo=True;"
    assert list(tmp_path.glob(dsl_settings.PREFIX + "*")) == []
    monkeypatch.setattr(dsl, "environment_at_import", lambda: None)  # imported by someone else
    dsl_settings.current(tmp_path)
    assert list(tmp_path.glob(dsl_settings.PREFIX + "*")) == []


def test_the_fusion_check_takes_the_recalled_settings_for_the_dsl(known_context, monkeypatch, tmp_path):
    monkeypatch.setenv(disk_cache.CACHE_ENV, "1")
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(availability.CALL_ENV, raising=False)
    monkeypatch.setattr(availability, "has_tvm_ffi", lambda: True)
    monkeypatch.setattr(availability, "TVM_FFI_FAILED", [])
    if importlib.util.find_spec("cutlass") is None:
        pytest.skip("needs the CuTe DSL installed")
    assert not availability.loads_without_dsl()  # no process of this context imported the DSL here
    dsl_settings.remember(tmp_path, "arch='sm_90a';")
    assert availability.loads_without_dsl()
    monkeypatch.setenv(availability.CALL_ENV, "python")  # the Python executor needs the DSL anyway
    assert not availability.loads_without_dsl()
    monkeypatch.delenv(availability.CALL_ENV)
    monkeypatch.setenv(disk_cache.CACHE_ENV, "0")
    assert not availability.loads_without_dsl()


# -- linking ------------------------------------------------------------------------------------------

def test_no_c_compiler_costs_one_info_line_per_process(monkeypatch, caplog):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shared_object.shutil, "which", lambda name: None)
    monkeypatch.setattr(shared_object, "_SAID", set())
    assert shared_object.compiler() is None
    with caplog.at_level(logging.INFO, logger=shared_object.__name__):
        assert shared_object.link(b"\x7fELF", ["/lib/libx.so"]) is None
        assert shared_object.link(b"\x7fELF", ["/lib/libx.so"]) is None
    assert len(caplog.records) == 1 and "no C compiler" in caplog.records[0].getMessage()
    assert caplog.records[0].levelno == logging.INFO


def test_a_failing_link_costs_one_info_line(monkeypatch, caplog):
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(shared_object, "_SAID", set())
    with caplog.at_level(logging.INFO, logger=shared_object.__name__):
        assert shared_object.link(b"not an object", []) is None
    assert len(caplog.records) == 1 and "could not link it" in caplog.records[0].getMessage()
