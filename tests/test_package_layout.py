"""CPU: the package's layout rules, read from its source: no import cycle among its modules, TE's
private state reached from te_internals alone (which checks the installed TE's version), and no
module outside the engines importing an engine."""

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import te_offload_ops
from te_offload_ops import te_internals

PACKAGE = Path(te_offload_ops.__file__).parent
NAME = "te_offload_ops"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (packages as their __init__)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str) -> set[str]:
    """The package's modules ``module`` imports, at any depth of its code (function-level imports
    count: a cycle through one still ties the modules together)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # a name imported from a module: the module
                name = name.rpartition(".")[0]
            if name.startswith(NAME) and name != module:
                out.add(name)
    return out


def _drop_parents(module: str, imported: set[str]) -> set[str]:
    # importing a.b.c runs a and a.b first: those edges are Python's, not the module's choice
    return {m for m in imported if not module.startswith(m + ".")}


def test_every_module_imports():
    for info in pkgutil.walk_packages(te_offload_ops.__path__, NAME + "."):
        if info.name.startswith(f"{NAME}.megatron.experts") or info.name.startswith(f"{NAME}.kernels."):
            continue  # Megatron-Core and the CuTe DSL are optional (their own tests import them)
        importlib.import_module(info.name)


def test_no_import_cycle_among_the_packages_modules():
    graph = {m: _drop_parents(m, _imports(m)) - {NAME} for m in MODULES}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert len(graph) > 40  # the walk saw the whole package


# Integrations drive an engine through its public surface, as a user's training loop does.
ENGINE_CLIENTS = (f"{NAME}.megatron.",)


def test_ops_reach_engines_through_hints_only():
    engines = f"{NAME}.engines"
    outside = [m for m in MODULES if not m.startswith(engines) and m != NAME]
    for m in outside:
        imported = [n for n in _imports(m) if n.startswith(engines)]
        if m.startswith(ENGINE_CLIENTS):
            assert all(n == engines for n in imported), f"{m} reaches into an engine's internals: {imported}"
        else:
            assert not imported, f"{m} imports an engine"


# TE's private state: attribute names and modules only te_internals may touch
TE_PRIVATE_ATTRIBUTES = {
    "_with_quantized_weight", "_is_distributed_weight", "_accumulate_into_main_grad", "_get_weight_tensors",
    "_parameters", "OFFLOAD_SYNCHRONIZER", "NVTE_CPU_OFFLOAD_V1", "offload_synchronizer", "offload_handler",
    "layer_states", "tensor_tag_to_buf", "push_tensor", "tensor_push", "release_all_memory",
    "mark_activation_offload", "is_cpu_offload_enabled", "is_op_fuser_grouped_tensor_path_supported",
    "mark_not_offload", "start_offload", "_scale_bias", "_scaled_unary_forward",
}
# TE's marks on saved tensors, named as strings
TE_PRIVATE_NAMES = {"_TE_do_not_offload", "activation_offloading", "needs_force_clear", "start_reload_event"}


def _te_private_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        through_accessor = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "te_internals"
        if isinstance(node, ast.Attribute) and node.attr in TE_PRIVATE_ATTRIBUTES and not through_accessor:
            found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.Constant) and node.value in TE_PRIVATE_NAMES:
            found.append(f"line {node.lineno}: {node.value!r}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformer_engine"):
            private = [p for p in node.module.split(".") if p.startswith("_")]
            names = [a.name for a in node.names if a.name.startswith("_") or a.name in TE_PRIVATE_ATTRIBUTES]
            if private or names:
                found.append(f"line {node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
    return found


def test_te_private_state_is_reached_from_te_internals_alone():
    offenders = {m: uses for m, path in MODULES.items() if m != f"{NAME}.te_internals"
                 for uses in [_te_private_uses(path)] if uses}
    assert offenders == {}
    assert _te_private_uses(MODULES[f"{NAME}.te_internals"])  # (the scan finds them where they are)


@pytest.mark.parametrize("version, supported", [((2, 20, 2), True), ((2, 20, 0), True), ((2, 21, 0), False),
                                                ((2, 19, 1), False), ((), False)])
def test_the_installed_te_is_checked_against_the_supported_range(version, supported):
    problem = te_internals.te_supported_problem(version)
    assert (problem is None) == supported
    if not supported:
        assert "TE 2.20.x" in problem and "install TE 2.20.x" in problem


def test_te_versions_read_as_numbers(monkeypatch):
    import transformer_engine

    for raw, expected in (("2.20.2", (2, 20, 2)), ("2.21.0.dev0+abc123", (2, 21, 0)), ("2.20", (2, 20)), ("x", ())):
        monkeypatch.setattr(transformer_engine, "__version__", raw)
        assert te_internals.installed_te_version() == expected


def test_the_kernels_module_map_in_the_docs_names_every_kernels_module():
    """docs/fused-mlp.md tells a maintainer which kernels module does what; a module added,
    renamed or removed without the map fails here."""
    text = (Path(te_offload_ops.__file__).parent.parent / "docs" / "fused-mlp.md").read_text()
    table = text.split("Where the code lives", 1)[1].split("\n\n", 2)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    mapped = {name for row in rows for name in row.split("|")[1].replace("`", "").replace(" ", "").split(",")}
    modules = {name for name in _modules() if name.startswith("te_offload_ops.kernels.")}
    assert mapped == {name.rsplit(".", 1)[1] for name in modules}
