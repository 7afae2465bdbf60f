"""The dataset always catches up (issue 29): under a real ``dagster-daemon run`` with the
project's dagster.yaml, the dataset run that ``dataset_automation`` requests after a run partition
was materialized has its worker killed (SIGKILL, as the OOM killer would); run monitoring marks
it failed, the sensor ``dataset_retry`` says so in its tick (``retry 1/3 in N s``), requests the
dataset again after the back-off, and the dataset ends current. Before, ``dataset_automation``
counted the request as handled and ticked "0 runs" forever: ``phantora_v0/`` was never written."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import dagster as dg
import pytest
from fixtures.dagster_proc import drop_folder, in_dataset, partition_runs, place, running, ticks, wait
from fixtures.run_folders import analytic, deepspeed_log, write_run_folder

from phantora_assets.assets.dataset_retry import ATTEMPT_TAG, RETRY_OF_TAG
from phantora_assets.instance.worker import PID_TAG
from phantora_assets.lib.run.spec import RunSpec

NEW = RunSpec("W4", "h100", 2, 1)
DATASET_KEY = dg.AssetKey("phantora_v0")


def _dataset_runs(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    return [
        r
        for r in instance.get_runs()
        if r.job_name == "dataset" or (r.asset_selection and DATASET_KEY in r.asset_selection)
    ]


@pytest.mark.slow
def test_a_killed_dataset_run_is_requested_again_and_the_dataset_ends_current(tmp_path: Path) -> None:
    p = place(tmp_path)
    spec, raw, its = analytic(NEW)
    folder = write_run_folder(p.staging, spec, raw, run_log=deepspeed_log(its, 2))
    with running(p, "daemon"), dg.DagsterInstance.from_config(str(p.home)) as instance:
        wait("the import_dir sensor's first tick", lambda: ticks(instance, "import_dir"), 120, p.log)
        drop_folder(p, folder, NEW.gpu)
        wait(
            f"a successful run of {NEW.run_id}",
            lambda: partition_runs(instance, NEW.run_id, dg.DagsterRunStatus.SUCCESS),
            60,
            p.log,
        )

        def started_dataset_run() -> dg.DagsterRun | None:
            for r in _dataset_runs(instance):
                if r.status == dg.DagsterRunStatus.STARTED and PID_TAG in r.tags:
                    return r
            return None

        victim = wait("the dataset run's worker", started_dataset_run, 60, p.log, poll_s=0.05)
        os.kill(int(victim.tags[PID_TAG]), signal.SIGKILL)
        failed = wait(
            "run monitoring to fail the killed run",
            lambda: (r := instance.get_run_by_id(victim.run_id)) and r.status == dg.DagsterRunStatus.FAILURE and r,
            30,
            p.log,
        )
        assert not failed.tags.get(ATTEMPT_TAG)
        retry = wait(
            "the retried dataset run's success",
            lambda: [
                r
                for r in _dataset_runs(instance)
                if r.tags.get(RETRY_OF_TAG) == victim.run_id and r.status == dg.DagsterRunStatus.SUCCESS
            ],
            60,
            p.log,
        )[0]
        assert retry.tags[ATTEMPT_TAG] == "1" and retry.tags.get("dagster/sensor_name") == "dataset_retry"
        assert in_dataset(p.data, NEW.run_id)
        # the back-off was visible in the sensor's tick: skip reason and cursor
        reasons = [t.skip_reason or "" for t in ticks(instance, "dataset_retry", limit=200)]
        assert any(f"dataset run {victim.run_id} FAILURE: retry 1/3 in" in r for r in reasons), reasons[:5]
        cursors = [json.loads(t.cursor) for t in ticks(instance, "dataset_retry", limit=200) if t.cursor]
        assert {"failed_run": victim.run_id, "attempt": 1} in [
            {k: c.get(k) for k in ("failed_run", "attempt")} for c in cursors
        ]
