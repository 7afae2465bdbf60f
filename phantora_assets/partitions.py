"""Dagster partitions: one key per run_id (the run matrix) and one per GPU model.

The run partitions are the run matrix merged with the imported run folders of the data root
(``<data root>/imports.toml``, written by ``phantora-assets import``) and of
``$PHANTORA_ASSETS_IMPORT_DIR`` (see ``lib/run_folder.py``), read when the code location loads:
after importing, reload the code location in the UI. The shipped matrix alone gives the same
static partitions as before.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from phantora_assets.lib.run_folder import effective_matrix
from phantora_assets.paths import default_data_dir
from phantora_assets.runs import RunSpec, gpu_specs

RUN_MATRIX: list[RunSpec] = effective_matrix(default_data_dir())
RUNS_BY_ID: dict[str, RunSpec] = {s.run_id: s for s in RUN_MATRIX}


def run_partitions_for(specs: list[RunSpec]) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition([s.run_id for s in specs])


def gpu_to_runs_for(specs: list[RunSpec]) -> dg.StaticPartitionMapping:
    """Each run depends on the perf DB of its own GPU."""
    return dg.StaticPartitionMapping(
        {gpu: {s.run_id for s in specs if s.gpu == gpu} for gpu in sorted({s.gpu for s in specs})}
    )


run_partitions = run_partitions_for(RUN_MATRIX)
gpu_partitions = dg.StaticPartitionsDefinition(sorted(gpu_specs()))
gpu_to_runs = gpu_to_runs_for(RUN_MATRIX)


def matrix_for(data_dir: str | Path) -> list[RunSpec]:
    """The run matrix as seen from ``data_dir`` (its imports merged in), read now."""
    return effective_matrix(Path(data_dir))


def spec_for(context: dg.AssetExecutionContext) -> RunSpec:
    """The RunSpec of the partition being materialized.

    Resolved against the ``data`` resource's data root first (its imports registry may have
    changed since the code location loaded, e.g. ``phantora-assets import`` into another data
    root in the same process), then against the matrix loaded with the code location.
    """
    key = context.partition_key
    data = getattr(context.resources, "data", None)
    if data is not None:
        for spec in matrix_for(data.data_dir):
            if spec.run_id == key:
                return spec
    return RUNS_BY_ID[key]
