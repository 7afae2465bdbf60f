"""Group ``traces``: the Chrome / Perfetto trace of each run (``stages/traces.py``)."""

import dagster as dg

from phantora_assets.assets.common import Partitions, failure_recorded, not_applicable_materializations, stage_metadata
from phantora_assets.resources import DataRoot, SimulatorResource
from phantora_assets.stages import traces as stage


def build(p: Partitions) -> list[dg.AssetsDefinition]:
    """``chrome_trace`` (by run)."""

    @dg.asset(
        partitions_def=p.runs,
        group_name="traces",
        deps=["raw_timeline"],
        kinds={"json"},
        # a run that does not fit in GPU memory has no trace: nothing is materialized, and Dagster
        # skips every step below this one in the run (their inputs were not produced)
        output_required=False,
        description="timeline.json.gz in the Phantora visualizer schema (Communication and Computation "
        "complete events, hosts host-1..., microseconds), openable in ui.perfetto.dev. Written into the "
        "run folder data/traces/<gpu>/<workload>_<nodes>x<gpus>/: from the analytic raw timeline, by "
        "phantora_visualizer from timeline.bin (Docker), or copied from the imported folder (converted and "
        "imported traces are parsed before they replace the previous file). Not applicable to a run that "
        "does not fit in GPU memory (raw_timeline's fits_in_memory failed): no trace is written, Dagster "
        "skips the steps below this one, and this asset and the run's assets below it are recorded as "
        "materialized with metadata status = not_applicable and the reason (nothing written, not Missing).",
    )
    def chrome_trace(context: dg.AssetExecutionContext, data: DataRoot, simulator: SimulatorResource):
        spec = p.spec_for(context, data.paths.root)
        why = stage.not_applicable(spec, data.paths)
        if why is not None:
            context.log.info(f"not applicable: {why}")
            for event in not_applicable_materializations(context, why):
                context.log_event(event)
            return
        with failure_recorded(p, context, data, "chrome_trace"):
            result = stage.chrome_trace(spec, data.paths, simulator.context())
        yield dg.MaterializeResult(metadata=stage_metadata(result))

    return [chrome_trace]
