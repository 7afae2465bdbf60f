"""The code location's only Definitions. Picks resources from the environment (here only)."""

from __future__ import annotations

import os

import dagster as dg

from phantora_assets.assets import analysis, export, features, flows, simulation, traces
from phantora_assets.partitions import RUN_MATRIX, gpu_to_runs_for, run_partitions, run_partitions_for
from phantora_assets.paths import DATA_DIR_ENV
from phantora_assets.resources import DOCKER_MAX_CONCURRENT_ENV, AnalyticSimulatorResource, DataRoot, PhantoraDocker
from phantora_assets.runs import RunSpec

SIMULATOR_ENV = "PHANTORA_ASSETS_SIMULATOR"
DOCKER_IMAGE_ENV = "PHANTORA_ASSETS_DOCKER_IMAGE"
PHANTORA_TESTS_ENV = "PHANTORA_ASSETS_PHANTORA_TESTS_DIR"
#: Run tag of Docker simulations; dagster.yaml limits concurrent runs with it (tag_concurrency_limits).
DOCKER_TAG = {"phantora/simulator": "docker"}

RUN_ASSETS = [
    simulation.raw_timeline, traces.chrome_trace, flows.validated_flows, flows.binned_flows,
    features.window_features, features.run_summary, analysis.step_anatomy, analysis.run_plots,
]
#: Per-run assets that only draw (``phantora-assets build --no-plots`` skips them).
PLOT_ASSETS = [analysis.run_plots, analysis.dataset_plots]
#: Unpartitioned assets materialized after every run, in order.
DATASET_ASSETS = [export.phantora_v0, analysis.dataset_duckdb, analysis.dataset_plots]
ALL_ASSETS = [simulation.perf_db, *RUN_ASSETS, *DATASET_ASSETS]


def simulator_from_env(specs: list[RunSpec] | None = None):
    """``PhantoraDocker`` when ``$PHANTORA_ASSETS_SIMULATOR=docker`` or a run of ``specs`` has
    ``source = "docker"`` (image from ``$PHANTORA_ASSETS_DOCKER_IMAGE``, training scripts from
    ``$PHANTORA_ASSETS_PHANTORA_TESTS_DIR``, slots from ``$PHANTORA_ASSETS_DOCKER_MAX_CONCURRENT``);
    else the analytic simulator."""
    choice = os.environ.get(SIMULATOR_ENV, "")
    if choice == "docker" or (choice != "analytic" and any(s.source == "docker" for s in specs or RUN_MATRIX)):
        return PhantoraDocker(
            image=os.environ.get(DOCKER_IMAGE_ENV, "phantora:latest"),
            phantora_tests_dir=os.environ.get(PHANTORA_TESTS_ENV) or None,
            max_concurrent=int(os.environ.get(DOCKER_MAX_CONCURRENT_ENV, "1")),
        )
    return AnalyticSimulatorResource()


def resources_from_env() -> dict:
    """Resources for this process: data root from PHANTORA_ASSETS_DATA_DIR (default ./data)."""
    return {
        "data": DataRoot(data_dir=os.environ.get(DATA_DIR_ENV, "data")),
        "simulator": simulator_from_env(),
    }


def assets_for(specs: list[RunSpec]) -> tuple[list[dg.AssetsDefinition], list[dg.AssetsDefinition]]:
    """``(ALL_ASSETS, RUN_ASSETS)`` partitioned by the run_ids of ``specs``.

    The module-level assets are partitioned by the matrix seen when the code location loaded;
    a process that builds another data root (whose imports differ) rebinds the run partitions
    and the perf_db -> run mapping here instead of reloading modules.
    """
    if [s.run_id for s in specs] == run_partitions.get_partition_keys():
        return ALL_ASSETS, RUN_ASSETS
    parts = run_partitions_for(specs)
    mapping = gpu_to_runs_for(specs)
    run_keys = {a.key for a in RUN_ASSETS}

    def rebind(spec: dg.AssetSpec) -> dg.AssetSpec:
        if spec.key not in run_keys:
            return spec
        deps = [dg.AssetDep(d.asset_key, partition_mapping=mapping) if d.asset_key == simulation.perf_db.key else d
                for d in spec.deps]
        return spec.replace_attributes(partitions_def=parts, deps=deps)

    mapped = dg.map_asset_specs(rebind, ALL_ASSETS)
    return mapped, [a for a in mapped if a.key in run_keys]


all_runs_job = dg.define_asset_job(
    "all_runs", selection=dg.AssetSelection.assets(*RUN_ASSETS), partitions_def=run_partitions,
    description="Every per-run asset and check for the selected run partitions (use for backfills).",
)
docker_runs_job = dg.define_asset_job(
    "docker_runs", selection=dg.AssetSelection.assets(*RUN_ASSETS), partitions_def=run_partitions, tags=DOCKER_TAG,
    description="Like all_runs, for partitions simulated with Phantora in Docker: runs carry the tag "
    "phantora/simulator=docker, which dagster.yaml limits (tag_concurrency_limits).",
)
dataset_job = dg.define_asset_job(
    "dataset", selection=dg.AssetSelection.assets(*DATASET_ASSETS),
    description="Assemble data/phantora_v0 from every run that passed its checks, rebuild "
    "data/phantora.duckdb from the same runs, and draw the dataset plots.",
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
    jobs=[all_runs_job, docker_runs_job, dataset_job],
    schedules=[weekly_runs_backfill, weekly_dataset],
    resources=resources_from_env(),
)
