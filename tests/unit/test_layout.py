"""The tree stays the one the README's Layout section describes: every module named there with its
job. Modules follow ideas, not counts: no cap on a folder's modules (issue 41).
(A function's size and complexity: ruff's C901 and PLR09xx
limits in pyproject.toml, run by .ci/run; dead code: vulture, also there.)"""

from __future__ import annotations

import re
from pathlib import Path

from fixtures.paths import ROOT

PKG = ROOT / "phantora_assets"


def _layout_block() -> str:
    text = (ROOT / "docs" / "LAYOUT.md").read_text()
    m = re.search(r"# Layout\n.*?```\n(phantora_assets/\n.*?)```", text, re.S)
    assert m, "docs/LAYOUT.md has no Layout tree"
    return m.group(1)


def _modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_is_in_the_readme_layout():
    block = _layout_block()
    missing = [
        str(p.relative_to(ROOT))
        for p in _modules()
        if p.name not in ("__init__.py", "__main__.py") and not re.search(rf"\b{re.escape(p.name)}\b", block)
    ]
    assert missing == []
    for d in sorted({p.parent for p in _modules()} - {PKG}):
        assert f"{d.name}/" in block, d


TESTS = ROOT / "tests"
TEST_FOLDERS = ("unit", "integration", "system", "properties")


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_test_files_are_filed_by_subject():
    """Every test file is in tests/unit/<package path>/ (a folder of phantora_assets/), tests/integration/,
    tests/system/ or tests/properties/; none at the top of tests/ or in tests/fixtures/."""
    misfiled = []
    for p in _test_files():
        parts = p.relative_to(TESTS).parts
        if len(parts) < 2 or parts[0] not in TEST_FOLDERS:
            misfiled.append(str(p.relative_to(ROOT)))
        elif parts[0] == "unit" and not (PKG / Path(*parts[1:-1])).is_dir():
            misfiled.append(f"{p.relative_to(ROOT)} (no phantora_assets/{Path(*parts[1:-1])}/)")
        elif parts[0] != "unit" and len(parts) != 2:
            misfiled.append(str(p.relative_to(ROOT)))
    assert misfiled == []


def test_no_test_file_imports_another_test_file():
    """Shared builders live in tests/fixtures/; a test module is never imported (``from test_steps import``)."""
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0).strip()}"
        for p in [
            *_test_files(),
            *sorted((TESTS / "fixtures").glob("*.py")),
            *sorted((ROOT / "benchmarks").glob("*.py")),
        ]
        for m in re.finditer(r"^\s*(?:from|import)\s+(?:tests\.)?(?:[\w.]+\.)?test_\w+", p.read_text(), re.M)
    ]
    assert found == []
