"""Group ``flows``: validated network flows with steps, and the 100 ms binned build (``stages/flows.py``)."""

import dagster as dg

from phantora_assets.assets.common import Partitions, check_results, check_specs, failure_recorded, stage_metadata
from phantora_assets.resources import DataRoot
from phantora_assets.stages import flows as stage


def build(p: Partitions) -> list[dg.AssetsDefinition]:
    """``validated_flows`` and ``binned_flows`` (by run)."""

    @dg.asset(
        partitions_def=p.runs,
        group_name="flows",
        deps=["chrome_trace"],
        check_specs=check_specs("validated_flows", p.runs),
        kinds={"parquet"},
        description="One row per network flow (src_node != dst_node) parsed from the run's Chrome JSON: op, "
        "dtype, count, communicator, bytes, start and duration (us), and the step it belongs to. Steady steps "
        "come from each communicator's repeating collective sequence; step time = median steady step.",
    )
    def validated_flows(context: dg.AssetExecutionContext, data: DataRoot):
        with failure_recorded(p, context, data, "validated_flows") as spec:
            result = stage.validate_flows(spec, data.paths)
        yield dg.MaterializeResult(metadata=stage_metadata(result))
        yield from check_results(result, "validated_flows")

    @dg.asset(
        partitions_def=p.runs,
        group_name="flows",
        deps=[validated_flows],
        check_specs=check_specs("binned_flows", p.runs),
        kinds={"parquet"},
        description="One row per (t, src_node, dst_node): bytes in each 100 ms bin of a 180 s window built by "
        "repeating one steady step (step time x U[0.98, 1.02] per repetition, random phase, 5 kB/s control "
        "traffic per node, seeded from run_id). int64 bytes.",
    )
    def binned_flows(context: dg.AssetExecutionContext, data: DataRoot):
        with failure_recorded(p, context, data, "binned_flows") as spec:
            result = stage.bin_flows(spec, data.paths)
        yield dg.MaterializeResult(metadata=stage_metadata(result))
        yield from check_results(result, "binned_flows")

    return [validated_flows, binned_flows]
