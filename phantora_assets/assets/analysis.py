"""Group ``analysis``: step anatomy and plots per run; the DuckDB database and plots of the dataset."""


import base64

import dagster as dg

from phantora_assets import analysis
from phantora_assets.assets.common import check_results, stage_metadata
from phantora_assets.assets.export import phantora_v0
from phantora_assets.assets.flows import binned_flows, validated_flows
from phantora_assets.lib.database import views_markdown
from phantora_assets.partitions import matrix_for, run_partitions, spec_for
from phantora_assets.resources import DataRoot


def png_markdown(title: str, data: bytes) -> dg.MetadataValue:
    """A Markdown metadata value the Dagster UI renders as the image (PNG embedded as base64)."""
    b64 = base64.b64encode(data).decode("ascii")
    return dg.MetadataValue.md(f"**{title}**\n\n![{title}](data:image/png;base64,{b64})")


def plots_metadata(result: analysis.PlotsResult) -> dict:
    meta: dict = {"render_seconds": round(result.seconds, 3), **result.metadata}
    for name, path in result.files.items():
        meta[name] = png_markdown(name.replace("_", " "), path.read_bytes())
        meta[f"{name}_path"] = dg.MetadataValue.path(str(path))
    return meta


@dg.asset(
    partitions_def=run_partitions,
    group_name="analysis",
    deps=[validated_flows],
    check_specs=[dg.AssetCheckSpec("anatomy_adds_up", asset="step_anatomy",
                                   description="Every (step, host) row: compute + exposed communication + idle "
                                   "= step time, and every host has a row for every step.")],
    kinds={"parquet"},
    description="One row per (step, host): compute time (union of the host's Computation events), network "
    "time (union of its network flows), the part of it overlapped by compute, exposed communication "
    "(network time no compute hides) and idle time, in us; plus the spans of the chosen steady step.",
)
def step_anatomy(context: dg.AssetExecutionContext, data: DataRoot):
    result = analysis.step_anatomy_stage(spec_for(context), data.paths)
    yield dg.MaterializeResult(metadata=stage_metadata(result))
    yield from check_results(result, "step_anatomy")


@dg.asset(
    partitions_def=run_partitions,
    group_name="analysis",
    deps=[step_anatomy, binned_flows],
    kinds={"png"},
    description="Plots of the run, shown on each materialization and saved in the run folder's plots/: "
    "a node-pair heatmap of bytes per steady step, the 100 ms traffic over the 180 s window (total and "
    "top pairs), and the anatomy of one steady step (per host: compute and network spans).",
)
def run_plots(context: dg.AssetExecutionContext, data: DataRoot) -> dg.MaterializeResult:
    result = analysis.run_plots_stage(spec_for(context), data.paths)
    return dg.MaterializeResult(metadata=plots_metadata(result))


@dg.asset(
    group_name="dataset",
    deps=[phantora_v0, step_anatomy],
    check_specs=[dg.AssetCheckSpec("duckdb_matches_dataset", asset="dataset_duckdb",
                                   description="The database holds exactly the runs and rows of phantora_v0.")],
    kinds={"duckdb"},
    description="data/phantora.duckdb, rebuilt atomically from the per-run Parquet files of every run that "
    "passed its checks: tables runs, flows_100ms, windows, flows, steps, step_anatomy, run_status and the "
    "documented views below. Query it with `phantora-assets query \"SQL\"`.\n\n" + views_markdown(),
)
def dataset_duckdb(context: dg.AssetExecutionContext, data: DataRoot):
    res = analysis.dataset_duckdb_stage(matrix_for(data.data_dir), data.paths)
    b = res.build
    yield dg.MaterializeResult(metadata={
        "path": dg.MetadataValue.path(str(b.path)),
        "runs_included": len(b.included),
        "runs_excluded": len(b.excluded),
        "build_seconds": round(res.seconds, 3),
        "rows": dg.MetadataValue.md("| table | rows |\n|---|---|\n"
                                    + "\n".join(f"| {k} | {v} |" for k, v in b.rows.items())),
        **({"missing": dg.MetadataValue.json(b.missing)} if b.missing else {}),
    })
    o = res.outcome
    yield dg.AssetCheckResult(check_name=o.name, passed=o.passed, severity=dg.AssetCheckSeverity.ERROR,
                              metadata={"message": o.message, **o.metadata}, description=o.message)


@dg.asset(
    group_name="analysis",
    deps=[phantora_v0],
    kinds={"png"},
    description="Plots of the dataset, shown on each materialization and saved in phantora_v0/plots/: "
    "inter-node bytes per step against the published figures, and step time by layout per GPU.",
)
def dataset_plots(context: dg.AssetExecutionContext, data: DataRoot) -> dg.MaterializeResult:
    return dg.MaterializeResult(metadata=plots_metadata(analysis.dataset_plots_stage(data.paths)))
