"""Issue 13, third adversarial round: hostile import folders and hostile queries.

Real files on disk (tmp_path), no mocks. Each test failed before its fix (the commit says how)."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from pathlib import Path

import pytest
from run_folders import analytic, megatron_log, write_run_folder

from phantora_assets.imported_runs import discover_imports
from phantora_assets.lib.errors import FileRuleError
from phantora_assets.lib.phantora.run_folder import discover
from phantora_assets.paths import DataPaths
from phantora_assets.sources import phantora_import
from phantora_assets.stages.simulation import run_spec_record

W4 = "phantora_a100_40g_W4_2x1"
DEPTH = 300  # deeper than _shallow_stack allows: Python 3.11's os.walk recursed once per level


def _deep(top: Path, depth: int = DEPTH, leaf: str | None = None) -> None:
    """``top/d/d/.../d`` ``depth`` levels (made relative to an open directory: the full path
    stays below PATH_MAX for the walk, 2 bytes a level), with file ``leaf`` at the bottom."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        if leaf is not None:
            os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


@contextlib.contextmanager
def _shallow_stack(frames: int = 150):
    """Python's recursion limit at ``frames`` above the caller's depth: a walk that takes a frame a
    level fails on a ``DEPTH``-deep tree here as it does on a 1,000-deep one at the default limit
    (a tree that deep could not be removed by pytest's own cleanup, whose rmtree recurses too)."""
    was = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(was)


@pytest.fixture
def run_folder(tmp_path) -> Path:
    spec, raw, its = analytic(W4)
    return write_run_folder(tmp_path / "src", spec, raw, run_log=megatron_log(its, 2, 16000.0))


# ---- deep directories ---------------------------------------------------------------------------
def test_a_deep_tree_beside_run_folders_is_walked_without_recursion_error(tmp_path, run_folder):
    # was: RecursionError from os.walk (Python 3.11 recurses a level a frame), a traceback from
    # `phantora-assets import` and, under $PHANTORA_ASSETS_IMPORT_DIR, a code location that cannot load
    _deep(tmp_path / "src" / "junk")
    with _shallow_stack():
        found, _ = discover(tmp_path / "src")
        assert [f.spec.run_id for f in found] == [W4]
        found, _ = discover_imports(tmp_path / "src")
        assert [f.spec.run_id for f in found] == [W4]


def test_a_deep_config_tree_is_refused_by_name_and_nothing_is_copied(tmp_path, run_folder):
    _deep(run_folder / "config" / "sub", leaf="hostfile")
    spec = discover(run_folder)[0][0].spec
    paths = DataPaths(tmp_path / "data")
    with _shallow_stack():
        leaf = "/".join(["config", "sub", *["d"] * DEPTH, "hostfile"])
        assert leaf in run_spec_record(spec).inputs["source_files"]  # the fingerprint walks config/ to its bottom
        with pytest.raises(FileRuleError) as ei:
            phantora_import.import_run_folder(spec, paths)
    assert ei.value.rule == "too deep"
    assert ei.value.path.startswith(str(run_folder / "config" / "sub" / "d"))
    assert "levels" in ei.value.detail
    run = paths.run_folder(spec)
    assert not (run / "config").exists() and not (run / "run.log").exists()
    assert [p.name for p in run.parent.iterdir() if p.name.startswith(".")] == []
