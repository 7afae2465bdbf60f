"""Group ``traces``: the Chrome / Perfetto trace of each run (``stages/traces.py``)."""

import dagster as dg

from phantora_assets.assets.common import Partitions, stage_metadata
from phantora_assets.resources import DataRoot, SimulatorResource
from phantora_assets.stages import traces as stage


def build(p: Partitions) -> list[dg.AssetsDefinition]:
    """``chrome_trace`` (by run)."""

    @dg.asset(
        partitions_def=p.runs,
        group_name="traces",
        deps=["raw_timeline"],
        kinds={"json"},
        description="timeline.json.gz in the Phantora visualizer schema (Communication and Computation "
        "complete events, hosts host-1..., microseconds), openable in ui.perfetto.dev. Written into the "
        "run folder data/traces/<gpu>/<workload>_<nodes>x<gpus>/: from the analytic raw timeline, by "
        "phantora_visualizer from timeline.bin (Docker), or copied from the imported folder (converted and "
        "imported traces are parsed before they replace the previous file).",
    )
    def chrome_trace(context: dg.AssetExecutionContext, data: DataRoot, simulator: SimulatorResource):
        result = stage.chrome_trace(p.spec_for(context), data.paths, simulator.context())
        return dg.MaterializeResult(metadata=stage_metadata(result))

    return [chrome_trace]
