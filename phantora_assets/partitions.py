"""Dagster partitions: one key per run_id (the run matrix) and one per GPU model."""

from __future__ import annotations

import dagster as dg

from phantora_assets.runs import RunSpec, gpu_specs, load_run_matrix

RUN_MATRIX: list[RunSpec] = load_run_matrix()
RUNS_BY_ID: dict[str, RunSpec] = {s.run_id: s for s in RUN_MATRIX}

run_partitions = dg.StaticPartitionsDefinition([s.run_id for s in RUN_MATRIX])
gpu_partitions = dg.StaticPartitionsDefinition(sorted(gpu_specs()))

#: Each run depends on the perf DB of its own GPU.
gpu_to_runs = dg.StaticPartitionMapping(
    {gpu: {s.run_id for s in RUN_MATRIX if s.gpu == gpu} for gpu in sorted({s.gpu for s in RUN_MATRIX})}
)


def spec_for(context: dg.AssetExecutionContext) -> RunSpec:
    """The RunSpec of the partition being materialized."""
    return RUNS_BY_ID[context.partition_key]
