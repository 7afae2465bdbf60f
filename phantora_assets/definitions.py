"""The code location's only Definitions. Picks resources from the environment (here only)."""

from __future__ import annotations

import os

import dagster as dg

from phantora_assets.assets import analysis, export, features, flows, simulation, traces
from phantora_assets.paths import DATA_DIR_ENV
from phantora_assets.resources import AnalyticSimulatorResource, DataRoot

RUN_ASSETS = [
    simulation.raw_timeline, traces.chrome_trace, flows.validated_flows, flows.binned_flows,
    features.window_features, features.run_summary, analysis.step_anatomy, analysis.run_plots,
]
#: Per-run assets that only draw (``phantora-assets build --no-plots`` skips them).
PLOT_ASSETS = [analysis.run_plots, analysis.dataset_plots]
#: Unpartitioned assets materialized after every run, in order.
DATASET_ASSETS = [export.phantora_v0, analysis.dataset_duckdb, analysis.dataset_plots]
ALL_ASSETS = [simulation.perf_db, *RUN_ASSETS, *DATASET_ASSETS]


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
    "dataset", selection=dg.AssetSelection.assets(*DATASET_ASSETS),
    description="Assemble data/phantora_v0 from every run that passed its checks, rebuild "
    "data/phantora.duckdb from the same runs, and draw the dataset plots.",
)

defs = dg.Definitions(
    assets=ALL_ASSETS,
    jobs=[all_runs_job, dataset_job],
    resources=resources_from_env(),
)
