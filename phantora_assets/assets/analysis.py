"""Group ``analysis``: step anatomy and plots per run, plots of the dataset (``stages/analysis.py``)."""

import base64

import dagster as dg

from phantora_assets.assets.common import Partitions, check_results, check_specs, failure_recorded, stage_metadata
from phantora_assets.resources import DataRoot
from phantora_assets.stages import analysis as stage


def png_markdown(title: str, data: bytes) -> dg.MetadataValue:
    """A Markdown metadata value the Dagster UI renders as the image (PNG embedded as base64)."""
    b64 = base64.b64encode(data).decode("ascii")
    return dg.MetadataValue.md(f"**{title}**\n\n![{title}](data:image/png;base64,{b64})")


def plots_metadata(result: stage.PlotsResult) -> dict:
    meta: dict = {"render_seconds": round(result.seconds, 3), **result.metadata}
    for name, path in result.files.items():
        meta[name] = png_markdown(name.replace("_", " "), path.read_bytes())
        meta[f"{name}_path"] = dg.MetadataValue.path(str(path))
    return meta


def build(p: Partitions) -> list[dg.AssetsDefinition]:
    """``step_anatomy`` and ``run_plots`` (by run), ``dataset_plots`` (all runs)."""

    @dg.asset(
        partitions_def=p.runs,
        group_name="analysis",
        deps=["validated_flows"],
        check_specs=check_specs("step_anatomy", p.runs),
        kinds={"parquet"},
        description="One row per (step, host): compute time (union of the host's Computation events), network "
        "time (union of its network flows), the part of it overlapped by compute, exposed communication "
        "(network time no compute hides) and idle time, in us; plus the spans of the chosen steady step.",
    )
    def step_anatomy(context: dg.AssetExecutionContext, data: DataRoot):
        with failure_recorded(p, context, data, "step_anatomy") as spec:
            result = stage.step_anatomy_stage(spec, data.paths)
        yield dg.MaterializeResult(metadata=stage_metadata(result))
        yield from check_results(result, "step_anatomy")

    @dg.asset(
        partitions_def=p.runs,
        group_name="analysis",
        # reads trace_summary, steps and flows (validated_flows), flows_100ms, the anatomy tables, link_bins
        deps=["validated_flows", step_anatomy, "binned_flows", "link_bins"],
        kinds={"png"},
        description="Plots of the run, shown on each materialization and saved in the run folder's plots/: "
        "a node-pair heatmap of bytes per steady step, the 100 ms traffic over the 180 s window (total and "
        "top pairs), the anatomy of one steady step (per host: compute and network spans), and the busiest link's "
        "utilisation per link class over the window (link_bins).",
    )
    def run_plots(context: dg.AssetExecutionContext, data: DataRoot) -> dg.MaterializeResult:
        with failure_recorded(p, context, data, "run_plots") as spec:
            return dg.MaterializeResult(metadata=plots_metadata(stage.run_plots_stage(spec, data.paths)))

    @dg.asset(
        group_name="analysis",
        deps=["phantora_v0"],
        kinds={"png"},
        description="Plots of the dataset, shown on each materialization and saved in phantora_v0/plots/: "
        "inter-node bytes per step against the published figures, and step time by layout per GPU.",
    )
    def dataset_plots(context: dg.AssetExecutionContext, data: DataRoot) -> dg.MaterializeResult:
        return dg.MaterializeResult(metadata=plots_metadata(stage.dataset_plots_stage(data.paths)))

    return [step_anatomy, run_plots, dataset_plots]
