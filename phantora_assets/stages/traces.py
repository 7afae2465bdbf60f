"""Stage of group ``traces``: the run's Chrome trace, by its source (no Dagster import).

chrome_trace -> run folder timeline.json.gz (Phantora visualizer schema; ``sources/``)
"""

from __future__ import annotations

from phantora_assets.matrix import RunSpec
from phantora_assets.paths import DataPaths
from phantora_assets.sources import get_source
from phantora_assets.sources.base import SourceContext
from phantora_assets.stages.common import StageResult


def chrome_trace(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The run folder's ``timeline.json.gz``, by the run's source (``sources.REGISTRY[spec.source]``)."""
    return get_source(spec.source).chrome_trace(spec, paths, ctx)
