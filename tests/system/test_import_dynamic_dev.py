"""Imports as dynamic partitions under plain ``dagster dev`` (its daemon and webserver share one
long-lived code server, which nothing reloads here): a run folder dropped into the watched folder
($PHANTORA_ASSETS_IMPORT_DIR) becomes a key of the dynamic run partitions, its run of ``all_runs``
succeeds and ``dataset_automation`` puts it in the dataset -- no "Reload definitions", no restart.
Before (static partitions) it stayed "not a partition until the code location reloads" forever."""

from __future__ import annotations

import time
from pathlib import Path

import dagster as dg
import pytest
from fixtures.dagster_proc import drop_folder, in_dataset, partition_runs, place, running, ticks, wait
from fixtures.run_folders import analytic, deepspeed_log, write_run_folder

from phantora_assets.assets.common import RUN_PARTITIONS
from phantora_assets.imported_runs import read_registry
from phantora_assets.lib.run.spec import RunSpec

NEW = RunSpec("W4", "h100", 2, 1)  # not in the test's run matrix (W4 l40s 2x1)
SHIPPED = RunSpec("W4", "l40s", 2, 1)


@pytest.mark.slow
def test_a_folder_dropped_under_plain_dagster_dev_reaches_the_dataset_without_a_reload(tmp_path: Path) -> None:
    p = place(tmp_path)
    spec, raw, its = analytic(NEW)
    folder = write_run_folder(p.staging, spec, raw, run_log=deepspeed_log(its, 2))
    with running(p, "dev"), dg.DagsterInstance.from_config(str(p.home)) as instance:
        # the code location seeds the matrix's run_ids when it loads; the sensor ticks
        wait("the import_dir sensor's first tick", lambda: ticks(instance, "import_dir"), 120, p.log)
        assert instance.get_dynamic_partitions(RUN_PARTITIONS) == [SHIPPED.run_id]
        dropped = drop_folder(p, folder, NEW.gpu)
        ok = wait(
            f"a successful run of {NEW.run_id}",
            lambda: partition_runs(instance, NEW.run_id, dg.DagsterRunStatus.SUCCESS),
            60,
            p.log,
        )
        assert ok[0].job_name == "all_runs" and ok[0].tags.get("dagster/sensor_name") == "import_dir"
        assert NEW.run_id in instance.get_dynamic_partitions(RUN_PARTITIONS)
        wait(f"{NEW.run_id} in the dataset (dataset_automation)", lambda: in_dataset(p.data, NEW.run_id), 60, p.log)
        print(f"dropped -> in the dataset in {time.monotonic() - dropped:.1f} s under dagster dev")
        # the sensor does not request it again, and the watched folder's run is kept in the registry
        assert len(partition_runs(instance, NEW.run_id)) == 1
        assert NEW.run_id in {s.run_id for s in read_registry(p.data)}
