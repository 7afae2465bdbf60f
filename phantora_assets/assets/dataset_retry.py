"""The sensor ``dataset_retry``: the dataset always catches up.

``dataset_automation`` (``definitions.DATASET_AUTOMATION``) requests the dataset once per change
of the run partitions it reads; Dagster then counts the request as handled whatever became of the
run. A dataset run that failed or was cancelled -- its worker killed (the OOM killer, ``kill -9``:
run monitoring marks the run failed), a full disk, Ctrl-C in the UI -- left ``phantora_v0/`` and
``phantora.duckdb`` stale until another partition changed (issue 29). This sensor requests the job
``dataset`` again after such a run, with a bounded retry and an exponential back-off:

* attempt ``k`` (1 .. :data:`MAX_ATTEMPTS`) of a failed run is requested :func:`backoff_s` ``(k)``
  seconds after the failed run ended (10 s, 20 s, 40 s), once no run and no backfill is in progress
  (a backfill still running ends in a dataset run of its own);
* the attempt number travels in the run's tag :data:`ATTEMPT_TAG` (the failed run of
  ``dataset_automation``, of ``phantora-assets build`` or of the UI has none: attempt 0), its run key
  is ``retry-of-<failed run id>``, so a failed run is retried once, and a failed retry is the
  next attempt's failed run;
* after :data:`MAX_ATTEMPTS` failed attempts it stops and says so; the next materialization of a
  run partition starts over (``dataset_automation`` requests the dataset again).

Every tick says what it waits for in its skip reason (``dataset run <id> FAILURE: retry 2/3 in
14 s``, ``gave up after 3 attempts ...``, ``the latest dataset run <id> succeeded``) and the cursor
holds the last decision as JSON (``{"failed_run": ..., "attempt": ..., "due": ...}``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import dagster as dg

#: Attempts after a failed dataset run (then the sensor gives up until a run partition changes).
MAX_ATTEMPTS = 3
#: Back-off of the first attempt, s; attempt k waits BASE_BACKOFF_S * 2 ** (k - 1).
BASE_BACKOFF_S = 10.0
#: Run tag: which attempt a run of ``dataset_retry`` is (1 .. MAX_ATTEMPTS).
ATTEMPT_TAG = "phantora/dataset_attempt"
#: Run tag: the run id of the failed run a retry replaces.
RETRY_OF_TAG = "phantora/dataset_retry_of"
_FAILED = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
_IN_PROGRESS = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]


def backoff_s(attempt: int) -> float:
    """Seconds between the end of a failed dataset run and the request of ``attempt`` (1-based)."""
    return BASE_BACKOFF_S * 2 ** (attempt - 1)


def _latest_dataset_run(instance: dg.DagsterInstance, keys: Sequence[dg.AssetKey]) -> str | None:
    """The run that last planned to materialize one of the dataset assets (any job: the sensor's,
    ``dataset_automation``'s, the build's, the UI's)."""
    best: tuple[int, str] | None = None
    for key in keys:
        info = instance.get_latest_planned_materialization_info(key)
        if info is not None and (best is None or info.storage_id > best[0]):
            best = (info.storage_id, info.run_id)
    return best[1] if best else None


def _busy(instance: dg.DagsterInstance) -> str | None:
    """What is in progress (a run or a backfill), or None."""
    runs = instance.get_runs(dg.RunsFilter(statuses=_IN_PROGRESS), limit=1)
    if runs:
        return f"run {runs[0].run_id} ({runs[0].job_name}) is {runs[0].status.value}"
    from dagster._core.execution.backfill import BulkActionStatus

    backfills = instance.get_backfills(status=BulkActionStatus.REQUESTED, limit=1)
    if backfills:
        return f"backfill {backfills[0].backfill_id} is in progress"
    return None


def dataset_retry_sensor(dataset_keys: Sequence[dg.AssetKey]) -> dg.SensorDefinition:
    """The sensor ``dataset_retry`` (module docstring) for the dataset assets ``dataset_keys``;
    it requests the job ``dataset``."""
    keys = list(dataset_keys)

    @dg.sensor(
        name="dataset_retry",
        job_name="dataset",
        minimum_interval_seconds=2,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Requests the dataset again after its run failed or was cancelled (a killed worker, a full "
        f"disk): at most {MAX_ATTEMPTS} attempts, {BASE_BACKOFF_S:g} s back-off doubling per attempt, once "
        "nothing is in progress. The tick's skip reason says what it waits for.",
    )
    def dataset_retry(context: dg.SensorEvaluationContext):
        instance = context.instance
        run_id = _latest_dataset_run(instance, keys)
        if run_id is None:
            return dg.SkipReason("the dataset was never requested")
        record = instance.get_run_record_by_id(run_id)
        if record is None:
            return dg.SkipReason(f"the latest dataset run {run_id} is not on this instance")
        run = record.dagster_run
        if run.status not in _FAILED:
            return dg.SkipReason(f"the latest dataset run {run_id} is {run.status.value}: nothing to retry")
        failed_attempt = int(run.tags.get(ATTEMPT_TAG, "0") or 0)
        attempt = failed_attempt + 1
        what = f"dataset run {run_id} {run.status.value}"
        if attempt > MAX_ATTEMPTS:
            context.update_cursor(json.dumps({"failed_run": run_id, "attempt": failed_attempt, "gave_up": True}))
            return dg.SkipReason(
                f"{what}: gave up after {MAX_ATTEMPTS} attempts; the next run partition materialization "
                "requests the dataset again (dataset_automation), or materialize it by hand"
            )
        ended = record.end_time or record.update_timestamp.timestamp()
        due = ended + backoff_s(attempt)
        context.update_cursor(json.dumps({"failed_run": run_id, "attempt": attempt, "due": round(due, 1)}))
        wait = due - time.time()
        if wait > 0:
            return dg.SkipReason(f"{what}: retry {attempt}/{MAX_ATTEMPTS} in {wait:.0f} s (back-off)")
        busy = _busy(instance)
        if busy:
            return dg.SkipReason(f"{what}: retry {attempt}/{MAX_ATTEMPTS} waits: {busy}")
        return dg.RunRequest(
            run_key=f"retry-of-{run_id}",
            tags={ATTEMPT_TAG: str(attempt), RETRY_OF_TAG: run_id},
        )

    return dataset_retry
