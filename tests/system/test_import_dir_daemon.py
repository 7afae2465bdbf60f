"""A run folder dropped into the watched directory ($PHANTORA_ASSETS_IMPORT_DIR) under a real
``dagster-daemon run`` with the project's dagster.yaml: the ``import_dir`` sensor adds it to the
dynamic run partitions and requests its run in the same tick (no reload of the code location: the
daemon's own 60 s reload is not waited for), the run succeeds, and the ``dataset_automation``
sensor brings the dataset up to date with it. Nobody launches anything by hand. Plain ``dagster
dev``: tests/system/test_import_dynamic_dev.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from fixtures.paths import ROOT
from fixtures.run_folders import analytic, deepspeed_log, write_run_folder

from phantora_assets.lib.run.spec import RunSpec

NEW = RunSpec("W4", "h100", 2, 1)  # not in the test's run matrix
TIMEOUT_S = 120


def _wait(what: str, pred, timeout: float, log: Path):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(1.0)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}\n--- daemon log ---\n{tail}")


@pytest.mark.slow
def test_a_run_folder_dropped_into_the_import_dir_is_materialized_by_the_daemon(tmp_path: Path) -> None:
    home, data, drop, staging = (tmp_path / n for n in ("home", "data", "drop", "staging"))
    for d in (home, drop, staging):
        d.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    matrix = tmp_path / "runs.toml"
    matrix.write_text('[[run]]\nworkload = "W4"\ngpu = "l40s"\nnodes = 2\ngpus_per_node = 1\n')
    env = {
        **os.environ,
        "DAGSTER_HOME": str(home),
        "PHANTORA_ASSETS_DATA_DIR": str(data),
        "PHANTORA_ASSETS_RUN_MATRIX": str(matrix),
        "PHANTORA_ASSETS_IMPORT_DIR": str(drop),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    with dg.DagsterInstance.from_config(str(home)) as instance:  # created before the daemon (SQLite races)
        instance.get_runs()
    log = tmp_path / "daemon.log"
    daemon_bin = Path(sys.executable).parent / "dagster-daemon"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(daemon_bin), "run", "-w", str(ROOT / "workspace.yaml")],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        with dg.DagsterInstance.from_config(str(home)) as instance:

            def sensor_ticks(name: str) -> list:
                return [
                    t
                    for s in instance.all_instigator_state()
                    if s.name == name
                    for t in instance.get_ticks(s.instigator_origin_id, s.selector_id, limit=5)
                ]

            _wait("the import_dir sensor's first tick", lambda: sensor_ticks("import_dir"), 120, log)
            # the folder appears whole (written aside, then renamed in), as a copy tool would leave it
            spec, raw, its = analytic(NEW)
            folder = write_run_folder(staging, spec, raw, run_log=deepspeed_log(its, 2))
            target = drop / "traces" / NEW.gpu
            target.mkdir(parents=True)
            folder.rename(target / folder.name)
            dropped = time.monotonic()

            def succeeded() -> list[dg.DagsterRun]:
                return [
                    r
                    for r in instance.get_runs(dg.RunsFilter(tags={"dagster/partition": NEW.run_id}))
                    if r.status == dg.DagsterRunStatus.SUCCESS
                ]

            runs = _wait(f"a successful run of {NEW.run_id}", succeeded, TIMEOUT_S, log)
            seconds = time.monotonic() - dropped
            assert runs[0].job_name == "all_runs"
            assert runs[0].tags.get("dagster/sensor_name") == "import_dir"
            runs_csv = data / "phantora_v0" / "runs.csv"

            def in_dataset() -> bool:
                return runs_csv.is_file() and NEW.run_id in set(pd.read_csv(runs_csv)["run_id"])

            _wait(f"{NEW.run_id} in the dataset (dataset_automation)", in_dataset, 120, log)
            # exactly one run for the partition: the sensor does not request it again
            time.sleep(12)
            assert len(instance.get_runs(dg.RunsFilter(tags={"dagster/partition": NEW.run_id}))) == 1
            print(f"dropped -> materialized in {seconds:.1f} s")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
