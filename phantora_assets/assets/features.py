"""Group ``dataset``: per-run window features and the run's summary row."""


import dagster as dg

from phantora_assets import pipeline
from phantora_assets.assets.common import check_results, stage_metadata
from phantora_assets.assets.flows import binned_flows, validated_flows
from phantora_assets.partitions import run_partitions, spec_for
from phantora_assets.resources import DataRoot


@dg.asset(
    partitions_def=run_partitions,
    group_name="dataset",
    deps=[binned_flows],
    check_specs=[dg.AssetCheckSpec("windows_contract", asset="window_features", blocking=True,
                                   description="The rows satisfy the windows.csv pandera model.")],
    kinds={"parquet", "pandera"},
    description="One row per (window_s, window_start_s): detector features of each 1 s and 15 s window "
    "(aligned to t = 0) computed from the run's 100 ms bins.",
)
def window_features(context: dg.AssetExecutionContext, data: DataRoot):
    spec = spec_for(context)
    result = pipeline.window_features(spec, data.paths)
    yield dg.MaterializeResult(metadata=stage_metadata(result))
    yield from check_results(result, "window_features")


@dg.asset(
    partitions_def=run_partitions,
    group_name="dataset",
    deps=[validated_flows, window_features],
    check_specs=[dg.AssetCheckSpec("runs_contract", asset="run_summary", blocking=True,
                                   description="The row satisfies the runs.csv (v1) pandera model.")],
    kinds={"parquet", "pandera"},
    description="The run's runs.csv row: step time (s), inter-node bytes per steady step, layout, "
    "parallelism, NIC bandwidth (bytes/s), roofline figures where timing is a roofline.",
)
def run_summary(context: dg.AssetExecutionContext, data: DataRoot):
    spec = spec_for(context)
    result = pipeline.summarize_run(spec, data.paths)
    yield dg.MaterializeResult(metadata=stage_metadata(result))
    yield from check_results(result, "run_summary")
