"""Stage of group ``traces``: the run's Chrome trace, by its source (no Dagster import).

chrome_trace -> run folder timeline.json.gz (Phantora visualizer schema; ``sources/``)

A run that does not fit in GPU memory has no trace to make (:func:`not_applicable`): the asset
then materializes nothing and the run's assets below it do not apply.
"""

from __future__ import annotations

from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.outcomes import StageResult
from phantora_assets.paths import DataPaths
from phantora_assets.sources import get_source
from phantora_assets.sources.base import SourceContext
from phantora_assets.stages.simulation import memory_verdict


def not_applicable(spec: RunSpec, paths: DataPaths) -> str | None:
    """Why ``chrome_trace`` (and everything below it) does not apply to the run, or None when it
    does: ``<run_id> does not fit in GPU memory (<estimate> GiB > <card> GiB)`` when
    ``raw_timeline`` recorded ``fits_in_memory`` as failed. Writes nothing.

    Raises:
        RecordError: the run folder's ``checks.json`` (or ``run_log.json``) is malformed.
    """
    verdict = memory_verdict(spec, paths)
    if verdict is None or verdict.fits:
        return None
    return verdict.words(spec.run_id)


def chrome_trace(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The run folder's ``timeline.json.gz``, by the run's source (``sources.REGISTRY[spec.source]``)."""
    return get_source(spec.source).chrome_trace(spec, paths, ctx)
