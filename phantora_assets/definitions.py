"""The code location's only Definitions. Picks resources from the environment (here only)."""

from __future__ import annotations

import os

import dagster as dg

from phantora_assets.assets import export, features, flows, simulation, traces
from phantora_assets.paths import DATA_DIR_ENV
from phantora_assets.resources import AnalyticSimulatorResource, DataRoot

RUN_ASSETS = [
    simulation.raw_timeline, traces.chrome_trace, flows.validated_flows, flows.binned_flows,
    features.window_features, features.run_summary,
]
ALL_ASSETS = [simulation.perf_db, *RUN_ASSETS, export.phantora_v0]


def resources_from_env() -> dict:
    """Resources for this process: data root from PHANTORA_ASSETS_DATA_DIR (default ./data)."""
    return {
        "data": DataRoot(data_dir=os.environ.get(DATA_DIR_ENV, "data")),
        "simulator": AnalyticSimulatorResource(),
    }


all_runs_job = dg.define_asset_job(
    "all_runs", selection=dg.AssetSelection.assets(*RUN_ASSETS), partitions_def=RUN_ASSETS[0].partitions_def,
    description="Every per-run asset and check for the selected run partitions (use for backfills).",
)
dataset_job = dg.define_asset_job(
    "dataset", selection=dg.AssetSelection.assets(export.phantora_v0),
    description="Assemble data/phantora_v0 from every run that passed its checks.",
)



@dg.schedule(cron_schedule="0 2 * * 0", job=all_runs_job, default_status=dg.DefaultScheduleStatus.STOPPED,
             description="Weekly backfill: one run request per run partition (every run of the matrix).")
def weekly_runs_backfill(context: dg.ScheduleEvaluationContext):
    for key in all_runs_job.partitions_def.get_partition_keys():
        yield dg.RunRequest(run_key=f"{context.scheduled_execution_time:%Y%m%d}-{key}", partition_key=key)


@dg.schedule(cron_schedule="0 6 * * 0", job=dataset_job, default_status=dg.DefaultScheduleStatus.STOPPED,
             description="Weekly dataset assembly, after the runs backfill.")
def weekly_dataset(context: dg.ScheduleEvaluationContext):
    return dg.RunRequest(run_key=f"{context.scheduled_execution_time:%Y%m%d}")


defs = dg.Definitions(
    assets=ALL_ASSETS,
    jobs=[all_runs_job, dataset_job],
    schedules=[weekly_runs_backfill, weekly_dataset],
    resources=resources_from_env(),
)
