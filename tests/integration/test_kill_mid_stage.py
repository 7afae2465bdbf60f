"""A stage killed (SIGKILL) before any of its file-system changes keeps every previous output of
the run whole (issue 39 item 13: ``test_kill_9_mid_build...`` lost ``nic_phases.parquet`` about one
run in four, because ``reconfig`` unlinked its four tables before computing them). Each writer that
replaces a run's outputs, killed at every point (``tests/fixtures/kill_points.py``), on a copy of a
real build's run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from fixtures.builds import FITS
from fixtures.kill_points import every_kill_point

from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store.io import TEMP_NAME, sweep_temp_files
from phantora_assets.paths import DataPaths
from phantora_assets.sources import phantora_import
from phantora_assets.stages import reconfig

SPEC = RunSpec("W1", "a100_40g", 2, 1)


@pytest.fixture
def root(small_build, tmp_path) -> Path:
    assert SPEC.run_id == FITS
    root = tmp_path / "data"
    shutil.copytree(small_build / "partitions" / FITS, root / "partitions" / FITS)
    shutil.copytree(DataPaths(small_build).run_folder(SPEC), DataPaths(root).run_folder(SPEC))
    return root


def test_reconfig_killed_anywhere_keeps_its_four_tables(root):
    paths = DataPaths(root)
    tables = {n: paths.table(FITS, n) for n in reconfig.OUTPUTS}
    before = {n: p.read_bytes() for n, p in tables.items()}  # a rebuild from the same flows: the same bytes

    def check(k: int) -> None:
        for n, p in tables.items():
            assert p.is_file(), f"reconfig killed before file-system change {k}: {p.name} is gone"
            assert p.read_bytes() == before[n]

    n = every_kill_point(lambda: reconfig.reconfig_stage(SPEC, paths), check)
    assert n >= len(reconfig.OUTPUTS)  # each table's rename was a kill point


def test_import_copy_killed_anywhere_keeps_config_whole(root, tmp_path):
    """``phantora_import``'s copy of a registered folder's ``config/`` over the previous copy."""
    folder = DataPaths(root).run_folder(SPEC)
    src = tmp_path / "registered"
    (src / "config").mkdir(parents=True)
    (src / "config" / "netconfig.toml").write_text("[cluster]\nnew = 1\n")
    (src / "run.log").write_text("new log\n")
    old = {"netconfig.toml": b"[cluster]\nold = 1\n", "hostfile": b"host-1 slots=1\n"}

    def reset() -> None:
        shutil.rmtree(folder / "config", ignore_errors=True)
        (folder / "config").mkdir()
        for name, data in old.items():
            (folder / "config" / name).write_bytes(data)

    def check(k: int) -> None:
        got = {p.name: p.read_bytes() for p in (folder / "config").iterdir()} if (folder / "config").is_dir() else None
        assert got in (old, {"netconfig.toml": b"[cluster]\nnew = 1\n"}), f"killed before change {k}: config/ {got}"
        sweep_temp_files(folder)
        assert not [p for p in os.listdir(folder) if TEMP_NAME.match(p) or p.endswith(".tmp")]
        reset()

    reset()
    assert every_kill_point(lambda: phantora_import._copy_in(src, folder), check) >= 2
