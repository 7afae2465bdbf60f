"""Resources: where data lives, and the simulation source behind one interface.

``simulator`` is the key every environment binds: :class:`AnalyticSimulatorResource`
(default, pure Python) or, for runs whose ``source`` is ``docker``, the Docker-backed Phantora
simulator. Both return a :class:`~phantora_assets.pipeline.StageResult` for ``raw_timeline``
and write the same run-folder layout.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from phantora_assets import pipeline
from phantora_assets.paths import DataPaths, default_data_dir
from phantora_assets.runs import RunSpec


class DataRoot(dg.ConfigurableResource):
    """The data root (``data/`` by default): run folders, partition tables, the dataset."""

    data_dir: str = str(default_data_dir())

    @property
    def paths(self) -> DataPaths:
        return DataPaths(Path(self.data_dir))


class AnalyticSimulatorResource(dg.ConfigurableResource):
    """The embedded analytic simulator (``phantora_assets.lib.analytic``); no Docker, no GPU."""

    def simulate(self, spec: RunSpec, paths: DataPaths, perfdb_status: str = "unknown") -> pipeline.StageResult:
        """Simulate ``spec``: raw timeline, run.log and config/ under ``paths``."""
        if spec.source not in ("analytic",):
            raise ValueError(
                f"{spec.run_id}: source {spec.source!r} needs the Phantora Docker simulator; "
                "bind it under the 'simulator' resource key"
            )
        return pipeline.simulate_run(spec, paths, perfdb_status)

    def write_trace(self, spec: RunSpec, paths: DataPaths) -> pipeline.StageResult:
        """Raw timeline -> timeline.json.gz (Phantora visualizer schema)."""
        return pipeline.write_trace(spec, paths)
