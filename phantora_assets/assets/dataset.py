"""Group ``dataset``: per-run window features and summary row, then the published-layout dataset and
the DuckDB database assembled from every run that passed its checks (``stages/dataset.py``)."""

import dagster as dg

from phantora_assets.assets.common import Partitions, check_results, check_specs, failure_recorded, stage_metadata
from phantora_assets.lib.store.database import views_markdown
from phantora_assets.resources import DataRoot
from phantora_assets.stages import dataset as stage


def build(p: Partitions) -> list[dg.AssetsDefinition]:
    """``window_features`` and ``run_summary`` (by run), ``phantora_v0`` and ``dataset_duckdb`` (all runs)."""

    @dg.asset(
        partitions_def=p.runs,
        group_name="dataset",
        deps=["binned_flows"],
        check_specs=check_specs("window_features", p.runs),
        kinds={"parquet", "pandera"},
        description="One row per (window_s, window_start_s): detector features of each 1 s and 15 s window "
        "(aligned to t = 0) computed from the run's 100 ms bins.",
    )
    def window_features(context: dg.AssetExecutionContext, data: DataRoot):
        with failure_recorded(p, context, data, "window_features") as spec:
            result = stage.window_features(spec, data.paths)
        yield dg.MaterializeResult(metadata=stage_metadata(result))
        yield from check_results(result, "window_features")

    @dg.asset(
        partitions_def=p.runs,
        group_name="dataset",
        # raw_timeline: simulation.json / run_log.json (FLOPs, memory); validated_flows: trace_summary.json
        deps=["raw_timeline", "validated_flows", window_features],
        check_specs=check_specs("run_summary", p.runs),
        kinds={"parquet", "pandera"},
        description="The run's runs.csv row: step time (s), inter-node bytes per steady step, layout, "
        "parallelism, NIC bandwidth (bytes/s), roofline figures where timing is a roofline.",
    )
    def run_summary(context: dg.AssetExecutionContext, data: DataRoot):
        with failure_recorded(p, context, data, "run_summary") as spec:
            result = stage.summarize_run(spec, data.paths)
        yield dg.MaterializeResult(metadata=stage_metadata(result))
        yield from check_results(result, "run_summary")

    @dg.asset(
        group_name="dataset",
        # reads every run's checks.json, run_summary, flows_100ms and windows tables
        deps=["binned_flows", window_features, run_summary],
        check_specs=check_specs("phantora_v0"),
        kinds={"csv", "parquet", "pandera"},
        description="data/phantora_v0/: every run whose checks all passed, as Parquet (runs.parquet; "
        "flows_100ms/ and windows/ one file per run, <table>/<run_id>/part-0.parquet) and the v1 CSVs "
        "{runs,flows_100ms,windows}.csv. runs: one row per run_id; flows_100ms: one row per run_id, t, src_node, "
        "dst_node; windows: one row per run_id, window_s, window_start_s. run_status.csv lists included and "
        "excluded runs with reasons; README.md is the dataset card (data dictionary, build, limits, license).",
    )
    def phantora_v0(context: dg.AssetExecutionContext, data: DataRoot):
        result = stage.export_dataset(list(p.specs), data.paths)
        excluded_md = "\n".join(f"| {r} | {why} |" for r, why in result.excluded.items()) or "| (none) | |"
        yield dg.MaterializeResult(
            metadata={
                "path": dg.MetadataValue.path(str(result.dir)),
                "runs_included": len(result.included),
                "runs_excluded": len(result.excluded),
                "excluded": dg.MetadataValue.md("| run_id | reason |\n|---|---|\n" + excluded_md),
            }
        )
        o = result.outcome
        yield dg.AssetCheckResult(
            asset_key="phantora_v0",
            check_name=o.name,
            passed=o.passed,
            severity=dg.AssetCheckSeverity.ERROR,
            metadata={"message": o.message, **o.metadata},
        )

    @dg.asset(
        group_name="dataset",
        # rebuilt from the per-run tables of validated_flows, binned_flows, window_features, run_summary and
        # step_anatomy (and link_bins), and compared with phantora_v0
        deps=[
            phantora_v0,
            "validated_flows",
            "binned_flows",
            window_features,
            run_summary,
            "step_anatomy",
            "link_bins",
        ],
        check_specs=check_specs("dataset_duckdb"),
        kinds={"duckdb"},
        description="data/phantora.duckdb, rebuilt atomically from the per-run Parquet files of every run that "
        "passed its checks: tables runs, flows_100ms, windows, flows, steps, step_anatomy, link_bins, run_status "
        'and the documented views below. Query it with `phantora-assets query "SQL"`.\n\n' + views_markdown(),
    )
    def dataset_duckdb(context: dg.AssetExecutionContext, data: DataRoot):
        res = stage.dataset_duckdb_stage(list(p.specs), data.paths)
        b = res.build
        yield dg.MaterializeResult(
            metadata={
                "path": dg.MetadataValue.path(str(b.path)),
                "runs_included": len(b.included),
                "runs_excluded": len(b.excluded),
                "build_seconds": round(res.seconds, 3),
                "rows": dg.MetadataValue.md(
                    "| table | rows |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in b.rows.items())
                ),
                **({"missing": dg.MetadataValue.json(b.missing)} if b.missing else {}),
            }
        )
        o = res.outcome
        yield dg.AssetCheckResult(
            check_name=o.name,
            passed=o.passed,
            severity=dg.AssetCheckSeverity.ERROR,
            metadata={"message": o.message, **o.metadata},
            description=o.message,
        )

    return [window_features, run_summary, phantora_v0, dataset_duckdb]
