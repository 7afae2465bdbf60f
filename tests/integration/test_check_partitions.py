"""Check results read per partition: a run that does not fit in GPU memory, built after one that fits,
must not hide the fitting run's check results, and its own assets below ``raw_timeline`` read "not
applicable" with the reason instead of "Missing".

Real Dagster runs of ``all_runs`` on one instance (fits first, then the one that does not fit, so that
its executions are the latest), read back through the instance's asset-check execution records (what
the UI's Checks tab and its partition statuses are built from) and materialization records.
"""

from __future__ import annotations

import dagster as dg
import pytest
from fixtures.memory import peak_gib

from phantora_assets.assets import RUN_ASSET_NAMES
from phantora_assets.assets.common import NOT_APPLICABLE_ASSETS
from phantora_assets.definitions import build_defs, seed_run_partitions
from phantora_assets.matrix import load_run_matrix
from phantora_assets.resources import AnalyticSimulatorResource

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
OOM = "phantora_l40s_W5_2x1"  # estimated peak above the L40S card (46.00 GiB)
FITS = "phantora_l40s_W1_2x1"
REASON = f"phantora_l40s_W5_2x1 does not fit in GPU memory ({peak_gib(OOM)} GiB > 46.00 GiB)"
Status = dg._core.storage.asset_check_execution_record.AssetCheckExecutionRecordStatus


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    data = tmp_path_factory.mktemp("check_partitions") / "data"
    specs = [s for s in load_run_matrix() if s.run_id in (OOM, FITS)]
    defs = build_defs(data, specs, simulator=AnalyticSimulatorResource())
    instance = dg.DagsterInstance.ephemeral()
    seed_run_partitions(instance, [FITS, OOM])
    job = defs.resolve_job_def("all_runs")
    for rid in (FITS, OOM):
        res = job.execute_in_process(partition_key=rid, instance=instance, raise_on_error=False, run_config=QUIET)
        assert res.success, rid
    return defs, instance


def _check_keys(defs: dg.Definitions) -> list[dg.AssetCheckKey]:
    return [key for name in RUN_ASSET_NAMES for key in defs.resolve_assets_def(name).check_keys]


def test_the_not_applicable_assets_are_those_below_raw_timeline() -> None:
    assert NOT_APPLICABLE_ASSETS == RUN_ASSET_NAMES[RUN_ASSET_NAMES.index("chrome_trace") :]


def test_every_check_execution_is_recorded_with_its_partition(built) -> None:
    defs, instance = built
    keys = _check_keys(defs)
    assert len(keys) >= 10
    for key in keys:
        recs = instance.event_log_storage.get_asset_check_execution_history(key, limit=10)
        assert recs and all(r.partition in (FITS, OOM) for r in recs), (key, [(r.partition, r.status) for r in recs])


def test_a_not_fitting_partition_does_not_hide_the_others_results(built) -> None:
    defs, instance = built
    below = 0
    for key in _check_keys(defs):
        by_partition: dict[str, list] = {}
        for r in instance.event_log_storage.get_asset_check_execution_history(key, limit=10):
            by_partition.setdefault(r.partition, []).append(r.status)
        # the fitting run's result stays readable as its partition's latest, whatever ran after it
        assert by_partition[FITS][0] == Status.SUCCEEDED, (key, by_partition)
        if key.asset_key.to_user_string() != "raw_timeline":
            below += 1
            # the not-fitting run executed none of them: planned only (Dagster resolves it "Skipped"),
            # for that partition alone
            assert by_partition[OOM] == [Status.PLANNED], (key, by_partition)
    assert below >= 8


def test_not_fitting_partitions_downstream_read_not_applicable_with_the_reason(built) -> None:
    defs, instance = built
    for name in NOT_APPLICABLE_ASSETS:
        key = defs.resolve_assets_def(name).key
        assert instance.get_materialized_partitions(key) == {FITS, OOM}, name
        recs = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=key, asset_partitions=[OOM]), limit=5
        ).records
        assert len(recs) == 1, name
        meta = {k: v.value for k, v in recs[0].asset_materialization.metadata.items()}
        assert meta == {"status": "not_applicable", "reason": REASON}, name
        fits = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=key, asset_partitions=[FITS]), limit=1)
        assert fits.records[0].asset_materialization.metadata.get("status") is None, name
