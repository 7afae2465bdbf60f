"""What the asset modules share: the partitions of a run matrix, the RunSpec of a partition,
check specs from the registry (``checks.py``), and StageResult -> Dagster metadata and checks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import dagster as dg

from phantora_assets.checks import checks_of
from phantora_assets.matrix import RunSpec, gpu_specs
from phantora_assets.stages.common import StageResult


@dataclass(frozen=True)
class Partitions:
    """The partitions of one run matrix: ``runs`` (one key per run_id), ``gpus`` (one per GPU of
    ``gpus.toml``) and ``gpu_to_runs`` (each run depends on the perf DB of its own GPU)."""

    specs: tuple[RunSpec, ...]
    runs: dg.StaticPartitionsDefinition
    gpus: dg.StaticPartitionsDefinition
    gpu_to_runs: dg.StaticPartitionMapping
    by_id: dict[str, RunSpec]

    @classmethod
    def of(cls, specs: Sequence[RunSpec]) -> Partitions:
        mapping = {gpu: {s.run_id for s in specs if s.gpu == gpu} for gpu in sorted({s.gpu for s in specs})}
        return cls(
            tuple(specs),
            dg.StaticPartitionsDefinition([s.run_id for s in specs]),
            dg.StaticPartitionsDefinition(sorted(gpu_specs())),
            dg.StaticPartitionMapping(mapping),
            {s.run_id: s for s in specs},
        )

    def spec_for(self, context: dg.AssetExecutionContext) -> RunSpec:
        """The RunSpec of the partition being materialized: a lookup in the run matrix these
        definitions were built with (parsed once, when ``build_defs`` ran).

        Raises:
            KeyError: the partition is not a run of that matrix.
        """
        spec = self.by_id.get(context.partition_key)
        if spec is None:
            raise KeyError(f"partition {context.partition_key!r} is not a run of the run matrix")
        return spec


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
