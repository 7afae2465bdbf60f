"""Group ``flows``: validated network flows with steps, and the 100 ms binned build."""


import dagster as dg

from phantora_assets import pipeline
from phantora_assets.assets.common import check_results, stage_metadata
from phantora_assets.assets.traces import chrome_trace
from phantora_assets.partitions import run_partitions, spec_for
from phantora_assets.resources import DataRoot

TRACE_CHECKS = {
    "flows_exist": "The trace has at least one network flow (src host != dst host).",
    "steps_match": "Every steady step issues the same collectives on every communicator.",
    "ring_bytes_match": "Every flow's bytes follow Phantora's ring rule for its op, with one group size per communicator.",
    "steady_steps_stable": "Steady steps carry identical network bytes and nearly identical durations.",
}

CROSS_CHECK_DESCRIPTION = (
    "Advisory (WARN, non-blocking): network bytes per steady step of the trace versus the workload model "
    "of the same workload and layout, by collective kind (DP, TP, MoE all-to-all, ZeRO-3 gathers); warns "
    "above 1 % and lists the breakdown (e.g. a published MoE trace missing its all-to-all flows)."
)


@dg.asset(
    partitions_def=run_partitions,
    group_name="flows",
    deps=[chrome_trace],
    check_specs=[dg.AssetCheckSpec(name, asset="validated_flows", blocking=True, description=desc)
                 for name, desc in TRACE_CHECKS.items()]
    + [dg.AssetCheckSpec("matches_workload_model", asset="validated_flows", blocking=False,
                         description=CROSS_CHECK_DESCRIPTION)],
    kinds={"parquet"},
    description="One row per network flow (src_node != dst_node) parsed from the run's Chrome JSON: op, "
    "dtype, count, communicator, bytes, start and duration (us), and the step it belongs to. Steady steps "
    "come from each communicator's repeating collective sequence; step time = median steady step.",
)
def validated_flows(context: dg.AssetExecutionContext, data: DataRoot):
    spec = spec_for(context)
    result = pipeline.validate_flows(spec, data.paths)
    yield dg.MaterializeResult(metadata=stage_metadata(result))
    yield from check_results(result, "validated_flows")


@dg.asset(
    partitions_def=run_partitions,
    group_name="flows",
    deps=[validated_flows],
    check_specs=[dg.AssetCheckSpec("bins_conserve_bytes", asset="binned_flows", blocking=True,
                                   description="Sum of binned bytes = placed flow bytes + control bytes, exactly.")],
    kinds={"parquet"},
    description="One row per (t, src_node, dst_node): bytes in each 100 ms bin of a 180 s window built by "
    "repeating one steady step (step time x U[0.98, 1.02] per repetition, random phase, 5 kB/s control "
    "traffic per node, seeded from run_id). int64 bytes.",
)
def binned_flows(context: dg.AssetExecutionContext, data: DataRoot):
    spec = spec_for(context)
    result = pipeline.bin_flows(spec, data.paths)
    yield dg.MaterializeResult(metadata=stage_metadata(result))
    yield from check_results(result, "binned_flows")
