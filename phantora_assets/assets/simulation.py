"""Group ``simulation``: the perf DB of each GPU and the raw timeline of each run (``stages/simulation.py``)."""

from typing import Any

import dagster as dg
import msgspec

from phantora_assets.assets.common import Partitions, check_results, check_specs, failure_recorded, stage_metadata
from phantora_assets.checks import FITS_IN_MEMORY
from phantora_assets.outcomes import StageResult
from phantora_assets.resources import DataRoot, SimulatorResource
from phantora_assets.stages import simulation as stage


def memory_metadata(result: StageResult) -> dict[str, Any]:
    """``fits_in_memory`` (bool), ``peak_memory_gib`` (the analytic estimate, or the peak run.log
    reports; absent when it reports none), ``card_gib`` and ``outcome`` (plain words: ``fits: ...``
    or ``does not fit: ...; not applicable: ...``) from the stage's fits_in_memory outcome."""
    fits = next((o for o in result.outcomes if o.name == FITS_IN_MEMORY), None)
    if fits is None:
        return {}
    words = fits.message
    if not fits.passed:
        words += "; the run's assets from chrome_trace on are not applicable (skipped) and it is not in the dataset"
    return {
        FITS_IN_MEMORY: fits.passed,
        "peak_memory_gib": fits.metadata.get("peak_gib"),
        "card_gib": fits.metadata.get("card_gib"),
        "outcome": words,
    }


def build(p: Partitions) -> list[dg.AssetsDefinition]:
    """``perf_db`` (partitioned by GPU) and ``raw_timeline`` (by run)."""

    @dg.asset(
        partitions_def=p.gpus,
        group_name="simulation",
        kinds={"csv", "pandera"},
        description="One Phantora performance database per GPU (perfdb/<gpu>/): compute and memcpy kernel "
        "timings in ns, validated (keys parse, nanos >= 0, manifest GPU name). A GPU without a database "
        "materializes as 'absent'; its runs use the roofline.",
    )
    def perf_db(context: dg.AssetExecutionContext, data: DataRoot) -> dg.MaterializeResult:
        rec, present = stage.perf_db(context.partition_key, data.paths)
        if not present and rec.message:
            context.log.warning(rec.message)
        meta = {k: v for k, v in msgspec.to_builtins(rec).items() if k != "gpu"}
        out = data.paths.perfdb_summary(context.partition_key)
        return dg.MaterializeResult(metadata={**meta, "path": dg.MetadataValue.path(str(out))})

    @dg.asset(
        partitions_def=p.runs,
        group_name="simulation",
        deps=[dg.AssetDep(perf_db, partition_mapping=p.gpu_to_runs)],
        check_specs=check_specs("raw_timeline", p.runs),
        kinds={"python", "parquet", "docker"},
        pool="phantora_simulation",
        description="The simulator's output for one run, 20 iterations (the first is warm-up). Analytic: "
        "raw_timeline.parquet, one row per computation event and per ring flow (simulated ns). Docker "
        "(Phantora): timeline.bin, run.log and config/ in the run folder. Import: the registered run "
        "folder's timeline.bin, run.log and config/ copied in. run.log's per-iteration time and peak "
        "memory become metadata. A run that does not fit in GPU memory is an outcome, not an error: the "
        "asset materializes with fits_in_memory false, the memory estimate and the card in its metadata, "
        "the fits_in_memory check fails with WARN severity (the Dagster run succeeds; the run is kept out "
        "of the dataset), and the run's assets from chrome_trace on are skipped as not applicable.",
    )
    def raw_timeline(context: dg.AssetExecutionContext, data: DataRoot, simulator: SimulatorResource):
        with failure_recorded(p, context, data, "raw_timeline") as spec:
            result = stage.raw_timeline(spec, data.paths, simulator.context())
        status = stage.perfdb_status(spec, data.paths)
        yield dg.MaterializeResult(
            metadata=stage_metadata(
                result, run_id=spec.run_id, source=spec.source, perf_db=status, **memory_metadata(result)
            )
        )
        yield from check_results(result, "raw_timeline")

    return [perf_db, raw_timeline]
