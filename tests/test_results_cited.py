"""The results pages and the result files agree: every file the docs cite is in benchmarks/results,
and every file there is cited (by name, by a ``{a,b}`` pattern, or by a ``..._suffix`` the pages
use inside a section that names the GPU; the test takes a suffix as citing every file that ends
with it, whichever GPU), so no figure is quoted without its file and no file sits unexplained."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", RESULTS / "ncu" / "README.md"]


def _expand(name: str) -> list[str]:
    """``a{,_b}{c,d}`` -> every name it stands for."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[:m.start()] + alt + name[m.end():])]


def _stem(path: Path) -> str:
    return path.name.split(".")[0]


def _result_stems() -> set[str]:
    return {_stem(p) for p in RESULTS.rglob("*") if p.is_file() and p.name != "README.md"}


def _cited() -> tuple[set[str], set[str]]:
    """(full names cited, suffixes cited as ``..._suffix``) across the docs."""
    names, suffixes = set(), set()
    for page in PAGES:
        for token in re.findall(r"`([^`\s]+)`", page.read_text()):
            base = token.split("/")[-1]
            if base.startswith("..."):
                suffixes.update(n.split(".")[0] for n in _expand(base[3:]))
            else:
                names.update(n.split(".")[0] for n in _expand(base))
    return names, suffixes


def test_every_result_file_the_docs_name_exists():
    names, _ = _cited()
    stems = _result_stems()
    named = {n for n in names if "_NVIDIA_" in n and "*" not in n}
    assert len(named) > 50
    assert sorted(named - stems) == []


def test_every_result_file_is_cited_in_the_docs():
    names, suffixes = _cited()
    uncited = sorted(s for s in _result_stems()
                     if s not in names and not any(s.endswith(suffix) for suffix in suffixes))
    assert uncited == []


def test_the_pattern_reader_expands_and_strips():
    assert _expand("a{,_b}{c,d}") == ["ac", "ad", "a_bc", "a_bd"]
    assert _stem(Path("x/fp8_gemm_NVIDIA_H200.json.gz")) == "fp8_gemm_NVIDIA_H200"
