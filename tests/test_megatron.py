"""CPU: the Megatron-Core integration's parts that need no GPU (most need no Megatron either).

Lazy import, version refusal, per-op flags from Megatron's config, rewriting layer specs, and
turning Megatron-built TE ops into ours. Tests that need Megatron-Core itself skip without it.
"""

import dataclasses
import functools
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformer_engine.pytorch as te

import te_offload_ops as teo
from te_offload_ops import megatron as teo_megatron
from te_offload_ops.megatron import (
    EXPERT_OFFLOAD_MODULES,
    ExpertOffload,
    UnsupportedMegatronError,
    adopt,
    check_version,
    expert_offload,
    replace_builders,
    require_megatron,
)
from te_offload_ops.megatron import version as version_module

ROOT = Path(__file__).resolve().parent.parent


def megatron_problem() -> str | None:
    try:
        require_megatron()
    except ImportError as exc:
        return str(exc)
    return None


requires_megatron = pytest.mark.skipif(megatron_problem() is not None, reason=megatron_problem() or "")


@pytest.fixture
def no_megatron(monkeypatch):
    """A process in which Megatron-Core is neither importable nor in the package metadata."""
    for name in list(sys.modules):
        if name == "megatron" or name.startswith("megatron.") or name == "te_offload_ops.megatron.experts":
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "megatron", None)  # import megatron -> ImportError
    real_version = importlib.metadata.version

    def version(name):
        if name == "megatron-core":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)


# -- lazy import and versions ------------------------------------------------------------------


def test_importing_the_package_and_the_integration_does_not_import_megatron():
    code = ("import sys, te_offload_ops, te_offload_ops.megatron; "
            "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_without_megatron_the_experts_class_raises_a_clear_import_error(no_megatron):
    assert teo_megatron.installed_version() is None
    with pytest.raises(UnsupportedMegatronError, match=r"needs megatron-core >=0\.19\.2,<0\.20 .*not installed"):
        teo_megatron.TEOGroupedMLP  # noqa: B018
    with pytest.raises(ImportError, match="not installed"):  # an ImportError, for try/except ImportError
        teo_megatron.use_te_offload_ops(object())
    with pytest.raises(AttributeError, match="no_such_name"):
        teo_megatron.no_such_name  # noqa: B018


@pytest.mark.parametrize("version", ["0.19.2", "0.19.3", "0.19.10", "0.19.2rc1", "0.19.2+abc123"])
def test_supported_versions_pass(version):
    check_version(version)


@pytest.mark.parametrize("version", ["0.19.1", "0.19.0", "0.18.5", "0.20.0", "0.20.0rc0", "1.0.0", "0.9"])
def test_other_versions_are_refused_naming_found_and_supported(version):
    with pytest.raises(UnsupportedMegatronError) as info:
        check_version(version)
    message = str(info.value)
    assert f"found megatron-core {version}" in message
    assert ">=0.19.2,<0.20" in message and "tested with 0.19.2" in message


def test_an_unreadable_version_is_refused():
    with pytest.raises(UnsupportedMegatronError, match=r"cannot read the megatron-core version 'dev'"):
        check_version("dev")


def test_an_installed_unsupported_megatron_is_refused_before_megatron_is_imported(monkeypatch):
    monkeypatch.delitem(sys.modules, "te_offload_ops.megatron.experts", raising=False)
    monkeypatch.setattr(version_module, "installed_version", lambda: "0.18.0")
    imported = []
    monkeypatch.setattr("builtins.__import__", _recording_import(imported))
    with pytest.raises(UnsupportedMegatronError, match="found megatron-core 0.18.0"):
        teo_megatron.TEOGroupedMLP  # noqa: B018
    assert not [m for m in imported if m.startswith("megatron")]


def _recording_import(imported, real=__import__):
    def recording(name, *args, **kwargs):
        imported.append(name)
        return real(name, *args, **kwargs)
    return recording


def test_version_read_from_a_source_checkout_without_metadata(no_megatron, monkeypatch, tmp_path):
    # megatron/core/package_info.py alone, as in a checkout on PYTHONPATH (no dist-info).
    pkg = tmp_path / "megatron" / "core"
    pkg.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "package_info.py").write_text("VERSION = (0, 19, 2, 'rc1')\n")
    monkeypatch.delitem(sys.modules, "megatron")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        assert version_module.installed_version() == "0.19.2rc1"
    finally:
        for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
            del sys.modules[name]


# -- per-op offload flags ----------------------------------------------------------------------


def config(*modules, fine_grained=True):
    return SimpleNamespace(fine_grained_activation_offloading=fine_grained, offload_modules=list(modules))


@pytest.mark.parametrize("modules, flags", [
    (("expert_fc1",), (True, False, False)),
    (("moe_act",), (False, True, False)),
    (("fused_group_mlp",), (True, True, True)),
    (("expert_fc1", "moe_act"), (True, True, False)),
    (("core_attn", "attn_proj"), (False, False, False)),  # offloading elsewhere: the experts keep theirs
])
def test_flags_follow_offload_modules(modules, flags):
    assert expert_offload(config(*modules)).as_tuple() == flags


def test_without_fine_grained_offloading_every_op_keeps_the_package_default():
    assert expert_offload(config("expert_fc1", fine_grained=False)) == ExpertOffload(True, True, True)
    assert expert_offload(SimpleNamespace()) == ExpertOffload(True, True, True)  # a config without the fields


def test_constructor_flags_win_over_the_config():
    flags = expert_offload(config("fused_group_mlp"), activation=False)
    assert flags == ExpertOffload(fc1=True, activation=False, fc2=True)
    flags = expert_offload(config("moe_act"), fc1=True, fc2=False)
    assert flags == ExpertOffload(fc1=True, activation=True, fc2=False)
    assert not expert_offload(config("core_attn")).any() and expert_offload(config("moe_act")).any()


@pytest.mark.parametrize("bad", [1, 0, "yes", torch.tensor(True)])
def test_a_non_bool_flag_is_refused_naming_it(bad):
    with pytest.raises(TypeError, match="offload_activation must be None"):
        expert_offload(config("moe_act"), activation=bad)


def test_the_modules_that_touch_the_experts_are_megatrons_names():
    assert EXPERT_OFFLOAD_MODULES == ("expert_fc1", "moe_act", "fused_group_mlp")


# -- rewriting layer specs ---------------------------------------------------------------------


class Stock:
    pass


class Ours(Stock):
    pass


class InferenceStock(Stock):
    pass


@dataclasses.dataclass
class FakeModuleSpec:  # the shape of Megatron's ModuleSpec
    module: object
    params: dict = dataclasses.field(default_factory=dict)
    submodules: object = None


@dataclasses.dataclass
class Submodules:
    experts: object
    router: object = None
    note: int = dataclasses.field(default=0, init=False)


def test_partial_builders_are_replaced_keeping_their_arguments_and_adding_params():
    shared_router = object()
    moe = functools.partial(dict, submodules=Submodules(experts=functools.partial(Stock, 1, submodules="s"),
                                                        router=shared_router))
    layer = FakeModuleSpec(module=object, submodules=SimpleNamespace(), params={"mlp": moe})
    block = [layer, layer, FakeModuleSpec(module=object)]
    new, count = replace_builders(block, Stock, Ours, {"offload_fc1": False})
    assert count == 1  # the shared layer spec is rebuilt once, and stays shared
    assert new[0] is new[1] and new[2] is block[2]
    experts = new[0].params["mlp"].keywords["submodules"].experts
    assert experts.func is Ours and experts.args == (1,)
    assert experts.keywords == {"submodules": "s", "offload_fc1": False}
    assert new[0].params["mlp"].keywords["submodules"].router is shared_router
    # The original is untouched.
    assert block[0].params["mlp"].keywords["submodules"].experts.func is Stock


def test_module_spec_builders_by_class_or_by_import_path_are_replaced():
    by_class = FakeModuleSpec(module=Stock, params={"a": 1})
    by_path = FakeModuleSpec(module=(Stock.__module__, "Stock"))
    new, count = replace_builders((by_class, by_path), Stock, Ours, {"offload_fc2": True})
    assert count == 2
    assert all(s.module is Ours for s in new)
    assert new[0].params == {"a": 1, "offload_fc2": True} and by_class.params == {"a": 1}


def test_subclasses_and_specs_without_the_experts_are_left_as_they_are():
    spec = Submodules(experts=functools.partial(InferenceStock), router=[FakeModuleSpec(module=dict)])
    new, count = replace_builders(spec, Stock, Ours)
    assert count == 0 and new is spec


# -- Megatron-built TE ops become ours ---------------------------------------------------------


TE_OPS = [
    (te.ops.GroupedLinear, dict(num_groups=3, in_features=16, out_features=8, bias=False, device="meta",
                                accumulate_into_main_grad=True, delay_wgrad_compute=True)),
    (te.ops.GroupedLinear, dict(num_groups=2, in_features=16, out_features=8, bias=True, device="meta",
                                single_grouped_weight=True, scale_bias=True)),
    (te.ops.ScaledSReLU, {}),
    (te.ops.ScaledSwiGLU, dict(glu_interleave_size=32)),
    (te.ops.ScaledClampedQGeGLU, dict(limit=7.0)),
]


@pytest.mark.parametrize("te_cls, kwargs", TE_OPS, ids=lambda v: getattr(v, "__name__", ""))
@pytest.mark.parametrize("offload", [True, False])
def test_an_adopted_op_equals_ours_built_with_the_same_arguments(te_cls, kwargs, offload, monkeypatch):
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")  # TE honours single_grouped_weight only then
    built_by_megatron = te_cls(**kwargs)
    ours = getattr(teo, te_cls.__name__)(**kwargs, offload=offload)
    op = adopt(built_by_megatron, offload=offload)
    assert op is built_by_megatron and type(op) is type(ours)
    assert isinstance(op, te_cls) and op.offload is offload
    # Same instance state: adopting is constructing (no attribute of ours is left unset).
    assert vars(op).keys() == vars(ours).keys()
    assert repr(op) == repr(ours)


def test_adopting_an_op_without_a_counterpart_is_refused():
    with pytest.raises(TypeError, match="te_offload_ops has no op for .*SReLU"):
        adopt(te.ops.SReLU(), offload=True)  # the unscaled activation: no op of ours extends it
    with pytest.raises(TypeError, match="offload must be a bool"):
        adopt(te.ops.ScaledSReLU(), offload="yes")


# -- with Megatron-Core installed (the GPU machine; CI has none) ------------------------------


def _python_block_with(path: Path, marker: str) -> str:
    import re

    blocks = re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{path.name}: {len(found)} python blocks with {marker!r}"
    return found[0]


@requires_megatron
@pytest.mark.parametrize("page", ["README.md", "docs/megatron.md"])
def test_the_megatron_snippet_of_the_docs_builds_experts_that_fuse(page):
    """The snippet as a reader copies it, a ``...`` filled with a model's sizes: its config gives the
    experts a scaled TE op the fused path takes (squared ReLU, no bias) and its spec our experts."""
    from te_offload_ops.megatron.experts import scaled_activation_name

    code = _python_block_with(ROOT / page, "config = TransformerConfig(")
    assert code.count("...") <= 1  # a page may leave the model's sizes to the reader
    code = code.replace("...", "num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128")
    scope: dict = {}
    exec(compile(code, page, "exec"), scope)  # noqa: S102 (the docs' own code)
    spec = scope.get("spec", scope.get("layer_spec"))
    config = scope["config"]
    assert scaled_activation_name(config) == "ScaledSReLU" and not config.add_bias_linear
    assert config.use_transformer_engine_op_fuser
    experts = spec.submodules.mlp.keywords["submodules"].experts
    assert experts.func is teo_megatron.TEOGroupedMLP


@requires_megatron
def test_use_te_offload_ops_on_megatron_specs():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=8, moe_grouped_gemm=True)
    new = teo_megatron.use_te_offload_ops(spec, offload_activation=False)
    experts = new.submodules.mlp.keywords["submodules"].experts
    assert experts.func is teo_megatron.TEOGroupedMLP and issubclass(experts.func, TEGroupedMLP)
    assert experts.keywords["offload_activation"] is False and "offload_fc1" not in experts.keywords
    assert new.submodules.self_attention is spec.submodules.self_attention
    assert spec.submodules.mlp.keywords["submodules"].experts.func is TEGroupedMLP
    with pytest.raises(ValueError, match="builds no TEGroupedMLP experts"):
        teo_megatron.use_te_offload_ops(get_gpt_layer_with_transformer_engine_spec(num_experts=8))
    with pytest.raises(TypeError, match="offload_fc1 must be None"):
        teo_megatron.use_te_offload_ops(spec, offload_fc1=1)


@requires_megatron
def test_the_classes_each_teo_scope_wraps_are_megatrons():
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for scope, cls in (("layer", TransformerLayer), ("moe", MoELayer), ("experts", TEGroupedMLP),
                       ("experts", teo_megatron.TEOGroupedMLP)):
        assert any(c.__name__ in teo_megatron.SCOPE_CLASSES[scope] for c in cls.__mro__), (scope, cls)
    assert not any(c.__name__ in teo_megatron.SCOPE_CLASSES["layer"] for c in MoELayer.__mro__)


@requires_megatron
def test_the_dispatcher_function_use_kernel_dtoh_replaces_is_megatrons_and_comes_back():
    import inspect

    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu
    assert original is moe_utils.maybe_move_tensor_to_cpu
    assert list(inspect.signature(original).parameters) == ["tensor", "as_numpy", "record_stream"]
    handle = teo_megatron.use_kernel_dtoh()
    try:
        assert token_dispatcher.maybe_move_tensor_to_cpu is not original
        # the alltoall dispatcher reads the module's name at each call, so the patch reaches it
        source = inspect.getsource(token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize)
        assert "maybe_move_tensor_to_cpu(" in source
    finally:
        handle.remove()
    assert token_dispatcher.maybe_move_tensor_to_cpu is original


def test_use_kernel_dtoh_refuses_what_it_cannot_patch(monkeypatch):
    import types

    with pytest.raises(TypeError, match="maybe_move_tensor_to_cpu.*'fake_dispatcher' has no such function"):
        teo_megatron.use_kernel_dtoh(types.ModuleType("fake_dispatcher"))
    # Megatron's own dispatcher is patched only in the releases whose function it knows
    monkeypatch.setattr(version_module, "installed_version", lambda: "0.18.0")
    with pytest.raises(UnsupportedMegatronError, match="found megatron-core 0.18.0"):
        teo_megatron.use_kernel_dtoh()


# -- the benchmark -----------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_benchmark_exits_clearly_without_a_gpu():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "megatron_moe_layer.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "cannot run" in proc.stderr and "Traceback" not in proc.stderr


def test_the_find_spec_probe_handles_a_blocked_megatron(no_megatron):
    # find_spec raises for a package set to None in sys.modules; installed_version treats it as absent.
    with pytest.raises(ImportError):
        importlib.util.find_spec("megatron.core")
    assert version_module.installed_version() is None


def test_benchmark_report_compares_each_variant_with_stock_fuser_and_fills_every_column():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from megatron_moe_layer import COLUMNS, add_speedups, markdown

    def row(variant, step_ms, experts="stock", op_fuser=True):
        return {"variant": variant, "experts": experts, "op_fuser": op_fuser, "experts_path": "x", "step_ms": step_ms,
                "gpu_step_ms": step_ms, "fwd_ms": 1.0, "peak_above_floor_MiB": 100.0, "held_after_fwd_MiB": 50.0,
                "offloaded_MiB_per_step": 0.0}

    rows = [row("stock-fuser", 10.0), row("ours", 5.0, "ours"), row("ours/moe_act", 8.0, "ours")]
    add_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 2.0, 1.25]
    result = {"gpu": "GPU", "date": "today", "rows": rows,
              "versions": {"megatron-core": "0.19.2", "transformer-engine": "2.20.2", "torch": "2"},
              "config": dict(layers=4, experts=8, topk=2, hidden=64, ffn=32, seq=16, batch=2, iters=3, warmup=1)}
    table = markdown(result).splitlines()
    assert table[-1] == "| ours/moe_act | x | 8.00 | 8.00 | 1.00 | 100 | 50 | 0 | 1.25x |"
    assert len(COLUMNS) == table[-1].count("|") - 1
    no_ref = [row("ours", 5.0, "ours")]
    add_speedups(no_ref)
    assert no_ref[0]["speedup"] is None and "| - |" in markdown({**result, "rows": no_ref})


# -- TEOGroupedMLP against a stand-in for Megatron-Core (CI has none) --------------------------
#
# The stand-in has what experts.py uses of Megatron 0.19's TEGroupedMLP: its constructor asks
# _is_fused_impl_supported() when the op fuser is on and sets offload_fused_group_mlp from
# offload_modules; _make_fused_ops() builds TE's ops (here on the meta device).

STUB_EXPERTS = '''
import torch
import transformer_engine.pytorch as te
import torch.nn.functional as F

from megatron.core.activations import squared_relu

built = []


class TEGroupedMLP(torch.nn.Module):
    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        super().__init__()
        built.append(name)
        self.config = config
        self.num_local_experts = num_local_experts
        self.tp_group = pg_collection.expt_tp
        self.linear_fc1 = submodules.linear_fc1.__new__(submodules.linear_fc1)  # no CUDA on CI
        self.linear_fc2 = submodules.linear_fc2.__new__(submodules.linear_fc2)
        if config.use_transformer_engine_op_fuser:
            assert self._is_fused_impl_supported(), "Fused GroupedMLP is not supported for this configuration."
        self._fused_ops = None
        self.offload_fused_group_mlp = (config.fine_grained_activation_offloading
                                        and "fused_group_mlp" in config.offload_modules)

    def _is_fused_impl_supported(self):
        return False  # the stock check refuses what the subclass must accept

    def _make_fused_ops(self):
        E, H, F_ = self.num_local_experts, self.config.hidden_size, self.config.moe_ffn_hidden_size
        glu = self.config.gated_linear_unit
        act = te.ops.ScaledSwiGLU() if glu else te.ops.ScaledSReLU()
        return te.ops.Sequential(
            te.ops.GroupedLinear(E, H, F_ * (2 if glu else 1), bias=False, device="meta",
                                 accumulate_into_main_grad=True, delay_wgrad_compute=True),
            act,
            te.ops.GroupedLinear(E, F_, H, bias=False, device="meta", accumulate_into_main_grad=True,
                                 delay_wgrad_compute=True),
        )
'''

STUB_FILES = {
    "megatron/__init__.py": "",
    "megatron/core/__init__.py": "",
    "megatron/core/package_info.py": "VERSION = (0, 19, 2, '')\n",
    "megatron/core/activations.py": "def squared_relu(x):\n    return x.relu() ** 2\n",
    "megatron/core/fusions/__init__.py": "",
    "megatron/core/fusions/fused_bias_geglu.py": "def quick_gelu(x):\n    return x\n",
    "megatron/core/transformer/__init__.py": "",
    "megatron/core/transformer/moe/__init__.py": "",
    "megatron/core/transformer/moe/experts.py": STUB_EXPERTS,
}


@pytest.fixture
def stub_megatron(no_megatron, monkeypatch, tmp_path):
    """Megatron-Core 0.19.2 as the stand-in above, found on sys.path (no package metadata)."""
    for rel, text in STUB_FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.delitem(sys.modules, "megatron")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield importlib.import_module("megatron.core.transformer.moe.experts")
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")
                 or m == "te_offload_ops.megatron.experts"]:
        del sys.modules[name]


def stub_config(**overrides):
    from megatron.core.activations import squared_relu

    fields = dict(hidden_size=64, moe_ffn_hidden_size=32, gated_linear_unit=False, activation_func=squared_relu,
                  use_fused_weighted_squared_relu=True, moe_apply_probs_on_input=False,
                  use_transformer_engine_op_fuser=True, fine_grained_activation_offloading=False, offload_modules=[])
    fields.update(overrides)
    return SimpleNamespace(**fields)


def stub_experts(config, tp=1, **flags):
    submodules = SimpleNamespace(linear_fc1=te.GroupedLinear, linear_fc2=te.GroupedLinear)
    groups = SimpleNamespace(expt_tp=SimpleNamespace(size=lambda: tp))
    return teo_megatron.TEOGroupedMLP(4, config, submodules, pg_collection=groups, name="experts", **flags)


@pytest.mark.parametrize("modules, flags, group_opens", [
    ((), (True, True, True), False),
    (("expert_fc1",), (True, False, False), True),
    (("moe_act",), (False, True, False), True),
    (("fused_group_mlp",), (True, True, True), True),
    (("core_attn",), (False, False, False), False),
])
def test_experts_build_our_ops_with_flags_from_offload_modules(stub_megatron, modules, flags, group_opens):
    config = stub_config(fine_grained_activation_offloading=bool(modules), offload_modules=list(modules))
    experts = stub_experts(config)
    assert isinstance(experts, stub_megatron.TEGroupedMLP) and experts.fused_ops is None
    assert experts.expert_offload.as_tuple() == flags
    assert experts.offload_fused_group_mlp is group_opens  # Megatron's group around the ops
    experts._fused_ops = (experts._make_fused_ops(),)
    ops = experts.fused_ops
    assert [type(op) for op in ops] == [teo.GroupedLinear, teo.ScaledSReLU, teo.GroupedLinear]
    assert tuple(op.offload for op in ops) == flags
    assert ops[0]._accumulate_into_main_grad and ops[2].wgrad_store.delay_wgrad_compute()  # Megatron's arguments kept
    assert experts.extra_repr() == f"offload(fc1={flags[0]}, activation={flags[1]}, fc2={flags[2]})"


@pytest.mark.parametrize("offload_fc1", [True, False])
def test_the_experts_input_is_marked_to_stay_exactly_when_fc1_keeps_it(stub_megatron, offload_fc1):
    from te_offload_ops.policy import KEEP_ATTR

    experts = stub_experts(stub_config(gated_linear_unit=True, activation_func=torch.nn.functional.silu),
                           offload_fc1=offload_fc1)
    ops = experts._make_fused_ops()
    assert type(ops[1]) is teo.ScaledSwiGLU
    x = torch.randn(6, 64)
    for hook in ops._forward_pre_hooks.values():  # what runs when Megatron calls the ops
        hook(ops, (x, torch.tensor([6, 0, 0, 0]), torch.rand(6)))
    assert getattr(x, KEEP_ATTR, False) is (not offload_fc1)


def test_constructor_flags_win_and_bad_ones_fail_before_megatron_builds(stub_megatron):
    config = stub_config(fine_grained_activation_offloading=True, offload_modules=["fused_group_mlp"])
    experts = stub_experts(config, offload_fc1=False, offload_fc2=False)
    assert experts.expert_offload == ExpertOffload(fc1=False, activation=True, fc2=False)
    all_kept = stub_experts(config, offload_fc1=False, offload_activation=False, offload_fc2=False)
    assert not all_kept.offload_fused_group_mlp  # no op may offload: Megatron opens no group
    stub_megatron.built.clear()
    with pytest.raises(TypeError, match="offload_fc2 must be None"):
        stub_experts(config, offload_fc2="no")
    with pytest.raises(ValueError, match="set use_transformer_engine_op_fuser=True"):
        stub_experts(stub_config(use_transformer_engine_op_fuser=False))
    assert stub_megatron.built == []


def test_configs_the_op_path_cannot_run_raise_with_every_reason(stub_megatron):
    config = stub_config(activation_func=torch.nn.functional.gelu, moe_apply_probs_on_input=True)
    with pytest.raises(ValueError) as info:
        stub_experts(config, tp=2)
    message = str(info.value)
    assert message.startswith("TEOGroupedMLP cannot run these experts as TE ops: ")
    assert "expert tensor parallelism of 2" in message and "moe_apply_probs_on_input=True" in message
    assert "activation_func=gelu with gated_linear_unit=False" in message


def test_use_te_offload_ops_puts_the_flags_on_the_experts_builder(stub_megatron):
    submodules = SimpleNamespace(linear_fc1=te.GroupedLinear, linear_fc2=te.GroupedLinear)
    moe_spec = functools.partial(dict, submodules=Submodules(
        experts=functools.partial(stub_megatron.TEGroupedMLP, submodules=submodules)))
    new = teo_megatron.use_te_offload_ops(moe_spec, offload_activation=False)
    builder = new.keywords["submodules"].experts
    groups = SimpleNamespace(expt_tp=SimpleNamespace(size=lambda: 1))
    experts = builder(4, stub_config(), pg_collection=groups, name="layer.experts")
    assert type(experts) is teo_megatron.TEOGroupedMLP
    assert experts.expert_offload == ExpertOffload(fc1=True, activation=False, fc2=True)


@requires_megatron
def test_teo_experts_hand_megatrons_first_microbatch_flag_to_their_ops():
    from te_offload_ops.megatron.experts import TEOGroupedMLP

    def experts(**config):
        ops = (teo.GroupedLinear(2, 8, 8, bias=False, device="cpu"), teo.ScaledSReLU(),
               teo.GroupedLinear(2, 8, 8, bias=False, device="cpu"))
        return SimpleNamespace(config=SimpleNamespace(**config), _fused_ops=(ops,),
                               linear_fc1=SimpleNamespace(is_first_microbatch=True, disable_parameter_transpose_cache=False),
                               linear_fc2=SimpleNamespace(is_first_microbatch=True, disable_parameter_transpose_cache=False))

    fp8 = experts(fp8="e4m3")  # set_is_first_microbatch marked the modules at the step's first micro-batch
    TEOGroupedMLP._pass_first_microbatch(fp8)
    fc1, _, fc2 = fp8._fused_ops[0]
    assert fc1.is_first_microbatch is True and fc2.is_first_microbatch is True
    assert fp8.linear_fc1.is_first_microbatch is False  # cleared, as the module's own forward would
    TEOGroupedMLP._pass_first_microbatch(fp8)  # the step's next micro-batch
    assert fc1.is_first_microbatch is False and fc2.is_first_microbatch is False
    bf16 = experts(fp8=None)  # Megatron never resets the modules' flag: the ops must not cache
    TEOGroupedMLP._pass_first_microbatch(bf16)
    assert bf16._fused_ops[0][0].is_first_microbatch is None and bf16.linear_fc1.is_first_microbatch is True
    no_cache = experts(fp8="e4m3")
    no_cache.linear_fc2.disable_parameter_transpose_cache = True
    TEOGroupedMLP._pass_first_microbatch(no_cache)
    assert no_cache._fused_ops[0][0].is_first_microbatch is True and no_cache._fused_ops[0][2].is_first_microbatch is None
