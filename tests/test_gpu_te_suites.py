"""GPU: TE's own tests of the grouped-MLP ops and of CPU offloading, with TE's ops replaced by this
package's (``te_ops_swap``), against the same tests on TE's ops, in one run.

TE's test files are not part of its wheel: point ``TEO_TE_TESTS`` at ``tests/pytorch`` of a TE source
checkout of the installed version. Each file runs twice in a subprocess (stock, swapped); every test
that passes on TE's ops must pass on ours, and none may fail on ours that passes on TE's. Counts per
quantization recipe are printed (and written to ``$TEO_TE_SUITE_OUT`` as JSON when set).
"""

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

from conftest import requires_gpu

SUITES = {
    "test_grouped_mlp.py": os.environ.get("TEO_TE_TESTS_GROUPED_MLP_K", ""),
    "test_cpu_offloading.py": os.environ.get("TEO_TE_TESTS_OFFLOAD_K", ""),
}
RECIPE_IDS = ("fp8_delayed_scaling", "fp8_current_scaling", "fp8_block_scaling", "mxfp8", "nvfp4")


def _te_tests() -> Path | None:
    where = os.environ.get("TEO_TE_TESTS")
    return Path(where) if where and (Path(where) / "test_grouped_mlp.py").exists() else None


pytestmark = pytest.mark.skipif(
    _te_tests() is None,
    reason="TE's test files are not installed with TE: set TEO_TE_TESTS to tests/pytorch of a TE source "
           "checkout of the installed version")


def recipe_of(test_id: str) -> str:
    """The quantization recipe a TE test id names ("none" for unquantized cases)."""
    for name in RECIPE_IDS:
        if re.search(rf"(^|[\[\-_]){name}($|[\]\-])", test_id):
            return name
    return "none"


def outcomes(junit_xml: Path) -> dict[str, str]:
    """test id -> passed | failed | skipped, from pytest's JUnit XML."""
    result = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        result[test_id] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed")
    return result


def _run(test_file: Path, swapped: bool, selection: str, junit: Path) -> subprocess.CompletedProcess:
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(here), str(here.parent),
                                                                     str(test_file.parent),
                                                                     os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           "--rootdir", str(test_file.parent), str(test_file)]
    if swapped:
        cmd[3:3] = ["-p", "te_ops_swap"]
    if selection:
        cmd += ["-k", selection]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=test_file.parent)


def _counts(results: dict[str, str]) -> dict[str, dict[str, int]]:
    by_recipe: dict[str, Counter] = {}
    for test_id, outcome in results.items():
        by_recipe.setdefault(recipe_of(test_id), Counter())[outcome] += 1
    return {recipe: dict(c) for recipe, c in sorted(by_recipe.items())}


@requires_gpu
@pytest.mark.parametrize("suite", list(SUITES))
def test_te_suite_passes_with_our_ops(suite, tmp_path):
    test_file = _te_tests() / suite
    runs = {}
    for name in ("stock", "swapped"):
        junit = tmp_path / f"{name}.xml"
        proc = _run(test_file, name == "swapped", SUITES[suite], junit)
        assert junit.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
        runs[name] = outcomes(junit)
    stock, ours = runs["stock"], runs["swapped"]
    summary = {"suite": suite, "stock": _counts(stock), "swapped": _counts(ours)}
    print(json.dumps(summary, indent=1))
    if out := os.environ.get("TEO_TE_SUITE_OUT"):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"te_suite_{Path(suite).stem}.json").write_text(json.dumps(summary, indent=1))
    assert stock.keys() == ours.keys()
    lost = sorted(t for t, o in stock.items() if o == "passed" and ours[t] != "passed")
    assert not lost, f"{len(lost)} of TE's tests pass on TE's ops but not on ours, e.g. {lost[:5]}"
    assert sum(o == "passed" for o in ours.values()) > 0
