"""The rule of the sensor ``dataset_retry`` on a real (temporary) instance: runs of the code
location's ``dataset`` job created and ended as a daemon would record them; the sensor's tick
evaluated at chosen times (its clock moved on, not waited for). A killed worker under a real
daemon: tests/system/test_dataset_catches_up.py."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest

from phantora_assets.assets import dataset_retry as dr
from phantora_assets.definitions import build_defs
from phantora_assets.lib.run.spec import RunSpec

SPEC = RunSpec("W4", "l40s", 2, 1)


@pytest.fixture
def setup(tmp_path: Path, monkeypatch):
    defs = build_defs(tmp_path / "data", [SPEC])
    clock = [0.0]
    monkeypatch.setattr(dr.time, "time", lambda: clock[0])
    with dg.instance_for_test() as instance:
        yield defs, instance, clock


def _tick(defs: dg.Definitions, instance: dg.DagsterInstance):
    ctx = dg.build_sensor_context(instance=instance, instance_ref=instance.get_ref(), definitions=defs)
    result = defs.get_sensor_def("dataset_retry").evaluate_tick(ctx)
    return result, json.loads(ctx.cursor) if ctx.cursor else None


def _dataset_run(
    defs: dg.Definitions, instance: dg.DagsterInstance, tags: dict[str, str] | None = None
) -> dg.DagsterRun:
    job = defs.resolve_job_def("dataset")
    return instance.create_run_for_job(job_def=job, tags=tags or {})


def _ours(tags: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in tags.items() if k in (dr.ATTEMPT_TAG, dr.RETRY_OF_TAG)}


def _fail(instance: dg.DagsterInstance, run: dg.DagsterRun) -> float:
    instance.report_run_failed(run)
    record = instance.get_run_record_by_id(run.run_id)
    assert record is not None and record.end_time is not None
    return record.end_time


def test_a_failed_dataset_run_is_retried_after_a_back_off_at_most_three_times(setup) -> None:
    defs, instance, clock = setup
    assert _tick(defs, instance)[0].skip_message == "the dataset was never requested"
    first = _dataset_run(defs, instance)
    ended = _fail(instance, first)
    clock[0] = ended + 3
    result, cursor = _tick(defs, instance)
    assert result.run_requests == []
    assert result.skip_message == f"dataset run {first.run_id} FAILURE: retry 1/3 in 7 s (back-off)"
    assert cursor == {"failed_run": first.run_id, "attempt": 1, "due": round(ended + 10, 1)}
    # due, but a run is in progress (created, not started): it waits
    other = instance.create_run_for_job(
        job_def=defs.resolve_job_def("all_runs"), tags={"dagster/partition": SPEC.run_id}
    )
    clock[0] = ended + 10.5
    result, _ = _tick(defs, instance)
    assert result.run_requests == []
    assert result.skip_message.startswith(f"dataset run {first.run_id} FAILURE: retry 1/3 waits: run {other.run_id}")
    instance.report_run_canceled(other)
    (req,) = _tick(defs, instance)[0].run_requests
    assert req.run_key == f"retry-of-{first.run_id}"
    assert _ours(req.tags) == {dr.ATTEMPT_TAG: "1", dr.RETRY_OF_TAG: first.run_id}
    # the retry fails too: attempt 2 waits 20 s after its end, attempt 3 40 s
    for attempt, wait_s in ((2, 20), (3, 40)):
        retry = _dataset_run(defs, instance, {dr.ATTEMPT_TAG: str(attempt - 1)})
        ended = _fail(instance, retry)
        clock[0] = ended + wait_s - 1
        assert _tick(defs, instance)[0].skip_message == (
            f"dataset run {retry.run_id} FAILURE: retry {attempt}/3 in 1 s (back-off)"
        )
        clock[0] = ended + wait_s
        (req,) = _tick(defs, instance)[0].run_requests
        assert _ours(req.tags) == {dr.ATTEMPT_TAG: str(attempt), dr.RETRY_OF_TAG: retry.run_id}
    last = _dataset_run(defs, instance, {dr.ATTEMPT_TAG: "3"})
    clock[0] = _fail(instance, last) + 1000
    result, cursor = _tick(defs, instance)
    assert result.run_requests == [] and result.skip_message.startswith(
        f"dataset run {last.run_id} FAILURE: gave up after 3 attempts"
    )
    assert cursor == {"failed_run": last.run_id, "attempt": 3, "gave_up": True}


def test_a_cancelled_dataset_run_is_retried_and_a_successful_one_is_not(setup) -> None:
    defs, instance, clock = setup
    run = _dataset_run(defs, instance)
    instance.report_run_canceled(run)
    record = instance.get_run_record_by_id(run.run_id)
    assert record is not None and record.end_time is not None
    clock[0] = record.end_time + 10
    (req,) = _tick(defs, instance)[0].run_requests
    assert req.tags[dr.RETRY_OF_TAG] == run.run_id
    ok = _dataset_run(defs, instance)
    instance.handle_new_event(
        dg.EventLogEntry(
            error_info=None,
            level="debug",
            user_message="",
            run_id=ok.run_id,
            timestamp=clock[0],
            dagster_event=dg.DagsterEvent(dg.DagsterEventType.RUN_SUCCESS.value, job_name="dataset"),
        )
    )
    result, _ = _tick(defs, instance)
    assert result.run_requests == []
    assert result.skip_message == f"the latest dataset run {ok.run_id} is SUCCESS: nothing to retry"
