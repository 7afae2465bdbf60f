"""Crash safety and reproducibility (issue 6): kill -9 mid-build, killed writers, byte-identical
re-materialization."""

from __future__ import annotations

import filecmp
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from fixtures.materialize import ephemeral_with_runs
from fixtures.paths import ROOT

from phantora_assets import definitions as d
from phantora_assets.lib.store.io import TEMP_NAME, atomic_path, sweep_temp_files
from phantora_assets.resources import AnalyticSimulatorResource, DataRoot

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
RUNS = [
    "phantora_l40s_W4_2x1",
    "phantora_a100_40g_W1_2x1",
    "phantora_l40s_W1_2x1",
    "phantora_a100_40g_W4_2x1",
    "phantora_l40s_W5_2x1",
]  # the last one does not fit


def _build_cmd(root: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "phantora_assets.cli", "build", "--data-dir", str(root), *extra]
    for r in RUNS:
        cmd += ["--run", r]
    return cmd


def _files(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``folder`` (a DuckDB file holds the same
    tables after a rebuild but not the same bytes: it is left out, see ``_database_readable``; so
    is the build's Dagster instance, ``dagster_home/``: run history, not outputs, and ``build_state/``,
    what the build knows it built: stages/build_state.py). The dataset is
    the generation ``phantora_v0`` links to, under that name (the replaced generations that
    ``.phantora_v0.gens/`` keeps for a grace period are left out: lib/store/generations.py)."""
    out = {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and p.suffix != ".duckdb"
        and p.relative_to(folder).parts[0] not in ("dagster_home", ".phantora_v0.gens", "build_state")
    }
    dataset = folder / "phantora_v0"
    out.update(
        {
            f"phantora_v0/{p.relative_to(dataset)}": hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(dataset.rglob("*"))
            if p.is_file()
        }
    )
    return out


def _database_readable(root: Path) -> None:
    import duckdb

    for db in root.rglob("*.duckdb"):
        with duckdb.connect(str(db), read_only=True) as con:
            assert con.execute("SHOW TABLES").fetchall()


def test_kill_9_mid_build_keeps_previous_outputs_and_rerun_completes(tmp_path: Path) -> None:
    root = tmp_path / "data"
    first = subprocess.run(_build_cmd(root), capture_output=True, text=True, cwd=ROOT)
    assert first.returncode == 0, first.stdout + first.stderr
    dataset = root / "phantora_v0"
    csvs = {p.name: p.read_bytes() for p in dataset.glob("*.csv")}
    assert set(csvs) == {"runs.csv", "flows_100ms.csv", "windows.csv", "run_status.csv"}
    before = _files(root)
    parquet = sorted(p for p in before if p.endswith(".parquet"))

    # rebuild over the complete build and kill it (SIGKILL, whole process group: the build's
    # worker processes too) once two partitions have been rebuilt, mid-run (--force: every run is current)
    start = time.time()
    proc = subprocess.Popen(
        _build_cmd(root, "--force"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        while proc.poll() is None:
            rebuilt = [
                r
                for r in RUNS[:-1]
                if (root / "partitions" / r / "run_summary.parquet").exists()
                and (root / "partitions" / r / "run_summary.parquet").stat().st_mtime >= start
            ]
            if len(rebuilt) >= 2:
                time.sleep(0.3)  # well into the next partitions
                break
            time.sleep(0.02)
    finally:
        alive = proc.poll() is None
        if alive:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert alive, "the build ended before it could be killed"
    assert proc.returncode == -signal.SIGKILL

    # previous outputs intact: CSVs byte-identical, every Parquet file there and readable,
    # nothing partial; a writer killed mid-write can only have left its own hidden temp file
    assert {p.name: p.read_bytes() for p in dataset.glob("*.csv")} == csvs
    for rel in parquet:
        pd.read_parquet(root / rel)
    _database_readable(root)
    after = _files(root)
    assert sorted(p for p in after if p.endswith(".parquet")) == parquet
    stray = [p for p in root.rglob("*.tmp") if not TEMP_NAME.match(p.name)]
    assert not stray
    assert set(after) - set(before) <= {str(p.relative_to(root)) for p in root.rglob("*.tmp")}

    # rerunning completes and gives byte-identical files
    again = subprocess.run(_build_cmd(root), capture_output=True, text=True, cwd=ROOT)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not list(root.rglob("*.tmp"))
    assert {p.name: p.read_bytes() for p in dataset.glob("*.csv")} == csvs
    assert _files(root) == before
    _database_readable(root)


def test_writer_killed_mid_write_leaves_target_intact(tmp_path: Path) -> None:
    """A process SIGKILLed inside atomic_path: the target keeps its old bytes; the only trace is
    a hidden temporary file, which sweep_temp_files removes."""
    target = tmp_path / "out" / "flows.parquet"
    pd.DataFrame({"x": [1, 2, 3]}).to_parquet(target.parent.mkdir() or target)
    old = target.read_bytes()
    pid = os.fork()
    if pid == 0:  # child: half-write a new version, then die without any cleanup
        try:
            with atomic_path(target) as tmp, open(tmp, "wb") as fh:
                fh.write(b"PAR1" + b"\0" * 1000)
                fh.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert target.read_bytes() == old
    left = list(target.parent.glob("*.tmp"))
    assert len(left) == 1 and TEMP_NAME.match(left[0].name) and left[0].name.startswith(".flows.parquet.")
    assert sweep_temp_files(tmp_path) == left
    assert sorted(p.name for p in target.parent.iterdir()) == ["flows.parquet"]


def _materialize(root: Path, instance: dg.DagsterInstance) -> None:
    res = dg.materialize(
        d.ALL_ASSETS,
        selection=d.RUN_ASSETS,
        partition_key=RUNS[0],
        instance=instance,
        run_config=QUIET,
        resources={"data": DataRoot(data_dir=str(root)), "simulator": AnalyticSimulatorResource()},
    )
    assert res.success
    res = dg.materialize(
        d.ALL_ASSETS,
        selection=[d.ASSETS["phantora_v0"]],
        instance=instance,
        run_config=QUIET,
        resources={"data": DataRoot(data_dir=str(root)), "simulator": AnalyticSimulatorResource()},
    )
    assert res.success


def test_rematerializing_gives_byte_identical_files(tmp_path: Path) -> None:
    """Every asset of a run, then the dataset, materialized twice in one data root and once in
    another: every file (Parquet, json.gz, CSV, JSON, text) is byte-identical."""
    instance = ephemeral_with_runs(RUNS)
    a, b = tmp_path / "a", tmp_path / "b"
    _materialize(a, instance)
    first = _files(a)
    exts = {Path(k).suffix for k in first}
    assert {".parquet", ".gz", ".csv", ".json"} <= exts
    assert any(k.endswith("timeline.json.gz") for k in first)
    _materialize(a, instance)
    assert _files(a) == first
    _materialize(b, ephemeral_with_runs(RUNS))
    assert _files(b) == first
    for name in ("runs.csv", "flows_100ms.csv", "windows.csv"):
        assert filecmp.cmp(a / "phantora_v0" / name, b / "phantora_v0" / name, shallow=False)


@pytest.mark.parametrize("workers", [0, 1])
def test_trace_reader_is_deterministic_across_workers_and_batches(tmp_path: Path, workers: int) -> None:
    """The parsed tables do not depend on the helper process or the batch size."""
    from phantora_assets.lib.phantora.chrome_trace import read_trace

    root = tmp_path / "data"
    _materialize(root, ephemeral_with_runs(RUNS))
    trace = next(root.rglob("timeline.json.gz"))
    ref = read_trace(trace, workers=0)
    for chunk in (1 << 20, 4096, 777):
        got = read_trace(trace, chunk_bytes=chunk, workers=workers)
        pd.testing.assert_frame_equal(got.flows, ref.flows, check_exact=True)
        pd.testing.assert_frame_equal(got.compute, ref.compute, check_exact=True)


def test_sweep_keeps_live_writers_temp_files(tmp_path: Path) -> None:
    """A sweep while another writer is mid-write (same or another live process) removes nothing of
    it; the write completes. (The sweep used to remove every temp file: 14 of 30 partitions failed
    with a sweep every 50 ms during a build.)"""
    target = tmp_path / "out" / "runs.csv"
    with atomic_path(target) as tmp:
        tmp.write_text("a,b\n1,2\n")
        assert sweep_temp_files(tmp_path) == []  # our own pid: live
        assert tmp.exists()
    assert target.read_text() == "a,b\n1,2\n"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live = tmp_path / "out" / f".windows.csv.p{sleeper.pid}.abcdefgh.tmp"
        live.write_text("partial")
        assert sweep_temp_files(tmp_path) == [] and live.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    # the writer is gone now: its file and a temp folder of a dead writer are swept, others kept
    dead_dir = tmp_path / "run" / f".config.p{sleeper.pid}.dir.tmp"
    (dead_dir / "sub").mkdir(parents=True)
    (dead_dir / "sub" / "x.toml").write_text("x")
    young_legacy = tmp_path / "out" / ".flows.parquet.abcdefgh.tmp"
    young_legacy.write_text("old format, recent")
    assert sorted(sweep_temp_files(tmp_path)) == sorted([live, dead_dir])
    assert young_legacy.exists() and not dead_dir.exists()
    old = time.time() - 2 * 3600
    os.utime(young_legacy, (old, old))
    assert sweep_temp_files(tmp_path) == [young_legacy]
    # a writer killed but not yet reaped (a zombie still answers kill(pid, 0)) is gone too
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        for _ in range(200):  # until it has exited (state Z)
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.01)
        zombie = tmp_path / "out" / f".cross_check.json.p{pid}.abcdefgh.tmp"
        zombie.write_text("partial")
        assert sweep_temp_files(tmp_path) == [zombie]
    finally:
        os.waitpid(pid, 0)
