"""What the asset modules share: the partitions of a run matrix, the RunSpec of a partition,
check specs from the registry (``checks.py``), and StageResult -> Dagster metadata and checks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

from phantora_assets.checks import checks_of
from phantora_assets.matrix import RunSpec, gpu_specs, runs_by_id
from phantora_assets.stages.common import StageResult


@dataclass(frozen=True)
class Partitions:
    """The partitions of one run matrix: ``runs`` (one key per run_id), ``gpus`` (one per GPU of
    ``gpus.toml``) and ``gpu_to_runs`` (each run depends on the perf DB of its own GPU)."""

    specs: tuple[RunSpec, ...]
    runs: dg.StaticPartitionsDefinition
    gpus: dg.StaticPartitionsDefinition
    gpu_to_runs: dg.StaticPartitionMapping

    @classmethod
    def of(cls, specs: Sequence[RunSpec]) -> Partitions:
        mapping = {gpu: {s.run_id for s in specs if s.gpu == gpu} for gpu in sorted({s.gpu for s in specs})}
        return cls(
            tuple(specs),
            dg.StaticPartitionsDefinition([s.run_id for s in specs]),
            dg.StaticPartitionsDefinition(sorted(gpu_specs())),
            dg.StaticPartitionMapping(mapping),
        )

    def spec_for(self, context: dg.AssetExecutionContext) -> RunSpec:
        """The RunSpec of the partition being materialized.

        Resolved against the ``data`` resource's data root (its imports may differ from the
        matrix these definitions were built with, e.g. a test or CLI call that imports into another
        root in the same process; :func:`~phantora_assets.matrix.matrix_for` parses once per input
        state), then against the matrix of the definitions.

        Raises:
            KeyError: the partition is in neither.
        """
        key = context.partition_key
        data = getattr(context.resources, "data", None)
        if data is not None:
            spec = runs_by_id(data.data_dir).get(key)
            if spec is not None:
                return spec
        for spec in self.specs:
            if spec.run_id == key:
                return spec
        raise KeyError(f"partition {key!r} is not a run of the run matrix")


def check_specs(asset: str) -> list[dg.AssetCheckSpec]:
    """The Dagster check specs of ``asset``, from the registry (``checks.CHECKS``)."""
    return [
        dg.AssetCheckSpec(c.name, asset=asset, blocking=c.blocking, description=c.description) for c in checks_of(asset)
    ]


def stage_metadata(result: StageResult, **extra: Any) -> dict[str, Any]:
    """Metadata of a stage: its numbers, plus the output path when there is one."""
    meta: dict[str, Any] = {**result.metadata, **extra}
    if result.path is not None:
        meta["path"] = dg.MetadataValue.path(str(result.path))
    return {k: v for k, v in meta.items() if v is not None}


def check_results(result: StageResult, asset: str) -> Iterator[dg.AssetCheckResult]:
    """One AssetCheckResult per outcome (ERROR, or WARN for advisory outcomes; blocking is set on
    the spec). Metadata keys ending in ``_md`` are rendered as Markdown."""
    for o in result.outcomes:
        meta: dict[str, Any] = {"message": o.message}
        for k, v in o.metadata.items():
            if v is None:
                continue
            meta[k] = dg.MetadataValue.md(v) if k.endswith("_md") else v
        yield dg.AssetCheckResult(
            asset_key=asset,
            check_name=o.name,
            passed=o.passed,
            severity=dg.AssetCheckSeverity.WARN if o.severity == "warn" else dg.AssetCheckSeverity.ERROR,
            metadata=meta,
            description=o.message,
        )
