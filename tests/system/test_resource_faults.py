"""Loud on every resource fault (issue 29 item 5): a full disk or a read-only data root ends
``phantora-assets build`` with one line naming the step and the path, exit status 1, no traceback,
and the previous dataset whole. Real small file systems (tmpfs mounts of a few MB: the test needs
root to mount, it is skipped with the reason otherwise), real builds of a one-run matrix; the
classifier (lib/faults.py) on the errors the stores raise."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.paths import ROOT

from phantora_assets.cli.build import HOME_YAML
from phantora_assets.lib.errors import OutputWriteError
from phantora_assets.lib.faults import fault_from_text, resource_fault

MATRIX = '[[run]]\nworkload = "W4"\ngpu = "l40s"\nnodes = 2\ngpus_per_node = 1\nsource = "analytic"\n'


def test_the_classifier_names_the_rule_and_the_path():
    f = resource_fault(OSError(errno.ENOSPC, "No space left on device", "/d/x.parquet"))
    assert (f.rule, f.path, f.detail) == ("disk full", "/d/x.parquet", "No space left on device")
    f = resource_fault(OutputWriteError("/d/checks.json", "write failed", "Read-only file system", errno.EROFS))
    assert (f.rule, f.path) == ("read-only file system", "/d/checks.json")
    try:  # SQLite's error, wrapped as SQLAlchemy wraps it (the cause chain)
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as e:
            raise RuntimeError("(sqlite3.OperationalError) database or disk is full") from e
    except RuntimeError as e:
        f = resource_fault(e)
    assert (f.rule, f.path) == ("disk full", None)
    assert f.line("Dagster instance writes", "/d/dagster_home") == (
        "Dagster instance writes: /d/dagster_home: disk full ((sqlite3.OperationalError) database or disk is full)"
    )
    duck = 'IO Error: Could not write file "/d/phantora.duckdb.wal": No space left on device'
    assert fault_from_text(duck).path == "/d/phantora.duckdb.wal"
    for not_a_fault in (
        ValueError("bad"),
        KeyError("x"),
        OSError(errno.EACCES, "Permission denied"),
        FileNotFoundError(2, "gone", "/d"),
    ):
        assert resource_fault(not_a_fault) is None
    assert fault_from_text("TraceFormatError: /d/t.json: invalid trace (x)") is None


def _mount(where: Path, *opts: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(opts), "tmpfs", str(where)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.decode().strip() or r.returncode}): needs root")


def _umount(where: Path) -> None:
    subprocess.run(["umount", str(where)], capture_output=True)


def _build(data: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "phantora_assets.cli", "build", "--data-dir", str(data), "--quiet", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)


def _dataset(data: Path) -> dict[str, str]:
    d = data / "phantora_v0"
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A complete build of the one-run matrix on the ordinary disk, and the environment."""
    top = tmp_path_factory.mktemp("faults")
    (top / "runs.toml").write_text(MATRIX)
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"}
    env |= {"PHANTORA_ASSETS_RUN_MATRIX": str(top / "runs.toml"), "PYTHONPATH": os.pathsep.join(sys.path)}
    r = _build(top / "data", env)
    assert r.returncode == 0, r.stdout + r.stderr
    return top, env


@pytest.mark.parametrize(
    ("case", "free_kb", "instance_inside", "step", "rule"),
    [
        ("instance on the full disk", 16, True, None, ("disk full", "disk I/O error")),
        ("full at the first stage", 16, False, "step raw_timeline", ("disk full",)),
        ("full at the database", 600, False, "step dataset_duckdb", ("disk full",)),
        ("read-only data root", None, False, "step raw_timeline", ("read-only file system",)),
    ],
)
def test_a_resource_fault_ends_the_build_with_one_line(base, tmp_path, case, free_kb, instance_inside, step, rule):
    top, env = base
    mnt = tmp_path / "mnt"
    _mount(mnt, "size=16m")
    try:
        data = mnt / "data"
        shutil.copytree(top / "data", data, symlinks=True)
        env = dict(env)
        if not instance_inside:  # the instance on the ordinary disk: the data root's own writes fail
            shutil.rmtree(data / "dagster_home")
            env["DAGSTER_HOME"] = str(tmp_path / "home")
            (tmp_path / "home").mkdir()
            (tmp_path / "home" / "dagster.yaml").write_text(HOME_YAML)  # as build writes it
        before = _dataset(data)
        if free_kb is not None:
            st = os.statvfs(mnt)
            fill = st.f_bavail * st.f_frsize - free_kb * 1024
            with open(mnt / "filler", "wb") as f:
                os.posix_fallocate(f.fileno(), 0, fill)
        else:
            r = subprocess.run(["mount", "-o", "remount,ro", str(mnt)], capture_output=True)
            assert r.returncode == 0, r.stderr
        r = _build(data, env, "--force")  # the copy's runs are current: rebuild them (it writes)
        out = r.stdout + r.stderr
        assert r.returncode == 1, out
        assert "Traceback" not in out and "Exception while writing" not in out, out
        last = r.stderr.strip().splitlines()[-1]
        assert r.stderr.count("\nbuild: ") + r.stderr.startswith("build: ") == 1, r.stderr
        assert last.startswith("build: ") and f"{mnt}/data" in last, last
        assert any(f": {x} (" in last for x in rule), last
        if step is not None:
            assert f"{step}: " in last, last
        else:
            assert last.startswith("build: Dagster instance writes: ") or "dagster_home" in last, last
        if step == "step dataset_duckdb":  # said once: the fault's line, not also a "dataset: FAILED" line
            assert "dataset: FAILED" not in out, out
        assert _dataset(data) == before  # the previous dataset, whole
    finally:
        _umount(mnt)
