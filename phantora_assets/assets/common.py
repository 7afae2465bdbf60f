"""Helpers shared by the asset modules: StageResult -> Dagster metadata and check results."""


from collections.abc import Iterator
from typing import Any

import dagster as dg

from phantora_assets.pipeline import StageResult


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
