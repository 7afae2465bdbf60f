"""Group ``links``: per-link traffic of the run's leaf-spine (``stages/links.py``)."""

import dagster as dg

from phantora_assets.assets.common import Partitions, check_results, check_specs, failure_recorded, stage_metadata
from phantora_assets.resources import DataRoot
from phantora_assets.stages import links as stage
from phantora_assets.stages import reconfig as reconfig_stage


def build(p: Partitions) -> list[dg.AssetsDefinition]:
    """``link_bins`` and ``reconfig`` (by run)."""

    @dg.asset(
        partitions_def=p.runs,
        group_name="links",
        deps=["validated_flows"],
        check_specs=check_specs("link_bins", p.runs),
        kinds={"parquet"},
        description="One row per (t, directed link) of the run's leaf-spine (host_up, leaf_spine, spine_leaf, "
        "host_down): bytes on the link in each bin of the 180 s window, the flows placed as binned_flows places "
        "them and routed by the network model (ECMP as configured); capacity in bit/s; routes = simulated | "
        "modelled. Control traffic is on no link.",
    )
    def link_bins(context: dg.AssetExecutionContext, data: DataRoot):
        with failure_recorded(p, context, data, "link_bins") as spec:
            result = stage.link_bins_stage(spec, data.paths)
        yield dg.MaterializeResult(metadata=stage_metadata(result))
        yield from check_results(result, "link_bins")

    @dg.asset(
        partitions_def=p.runs,
        group_name="links",
        deps=["validated_flows", "step_anatomy"],
        kinds={"parquet"},
        description="NIC-level traffic and the reconfigurable-network analysis (docs/FABRIC.md): nic_pairs "
        "(bytes per sending NIC x receiving NIC per steady step); per NIC the communication phases by "
        "parallelism group, the transition windows between them, and the sweep of step time and GPU "
        "utilisation over reconfiguration delays of 0-1000 ms, on demand and provisioned; two plots.",
    )
    def reconfig(context: dg.AssetExecutionContext, data: DataRoot):
        with failure_recorded(p, context, data, "reconfig") as spec:
            result = reconfig_stage.reconfig_stage(spec, data.paths)
        yield dg.MaterializeResult(metadata=stage_metadata(result))

    return [link_bins, reconfig]
