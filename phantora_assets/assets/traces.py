"""Group ``traces``: the Chrome / Perfetto trace of each run."""


import dagster as dg

from phantora_assets.assets.common import stage_metadata
from phantora_assets.assets.simulation import raw_timeline
from phantora_assets.partitions import run_partitions, spec_for
from phantora_assets.resources import DataRoot, SimulatorResource


@dg.asset(
    partitions_def=run_partitions,
    group_name="traces",
    deps=[raw_timeline],
    kinds={"json"},
    description="timeline.json.gz in the Phantora visualizer schema (Communication and Computation "
    "complete events, hosts host-1..., microseconds), openable in ui.perfetto.dev. Written into the "
    "run folder data/traces/<gpu>/<workload>_<nodes>x<gpus>/: from the analytic raw timeline, by "
    "phantora_visualizer from timeline.bin (Docker), or copied from the imported folder (converted and "
    "imported traces are parsed before they replace the previous file).",
)
def chrome_trace(context: dg.AssetExecutionContext, data: DataRoot, simulator: SimulatorResource):
    spec = spec_for(context)
    result = simulator.write_trace(spec, data.paths)
    return dg.MaterializeResult(metadata=stage_metadata(result))
