"""Group ``dataset``: the published-layout dataset assembled from every run that passed its checks."""


import dagster as dg

from phantora_assets import pipeline
from phantora_assets.assets.features import run_summary
from phantora_assets.partitions import matrix_for
from phantora_assets.resources import DataRoot


@dg.asset(
    group_name="dataset",
    deps=[run_summary],
    check_specs=[dg.AssetCheckSpec("dataset_contract", asset="phantora_v0", blocking=True,
                                   description="runs, flows_100ms and windows satisfy the v1 pandera contract.")],
    kinds={"csv", "parquet", "pandera"},
    description="data/phantora_v0/{runs,flows_100ms,windows}.csv (+ Parquet): every run whose checks all "
    "passed. runs: one row per run_id; flows_100ms: one row per run_id, t, src_node, dst_node; windows: one "
    "row per run_id, window_s, window_start_s. run_status.csv lists included and excluded runs with reasons.",
)
def phantora_v0(context: dg.AssetExecutionContext, data: DataRoot):
    result = pipeline.export_dataset(matrix_for(data.data_dir), data.paths)
    excluded_md = "\n".join(f"| {r} | {why} |" for r, why in result.excluded.items()) or "| (none) | |"
    yield dg.MaterializeResult(metadata={
        "path": dg.MetadataValue.path(str(result.dir)),
        "runs_included": len(result.included),
        "runs_excluded": len(result.excluded),
        "excluded": dg.MetadataValue.md("| run_id | reason |\n|---|---|\n" + excluded_md),
    })
    o = result.outcome
    yield dg.AssetCheckResult(asset_key="phantora_v0", check_name=o.name, passed=o.passed,
                              severity=dg.AssetCheckSeverity.ERROR, metadata={"message": o.message, **o.metadata})
