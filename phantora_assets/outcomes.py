"""What a stage returns: its check outcomes and its result (no Dagster import).

A stage is a plain function ``(spec, paths, ...) -> StageResult`` (``stages/``, and the sources'
``raw_timeline`` / ``chrome_trace`` in ``sources/``): it reads the files of the stages before it under
a :class:`~phantora_assets.paths.DataPaths` root, writes its own files atomically, records its check
outcomes in the run folder (``checks.json``/``checks.txt``, :func:`record`) and returns the metadata
and outcomes for the asset to report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phantora_assets.checks import record_checks
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.paths import DataPaths


@dataclass(frozen=True)
class Outcome:
    """One check outcome: ``passed``, a plain-words ``message`` and metadata values."""

    name: str
    passed: bool
    message: str
    metadata: dict[str, Any] = field(default_factory=dict)
    severity: str = "error"  # "warn" for advisory checks (never block the dataset)


@dataclass
class StageResult:
    """What a stage produced: output ``path``, ``metadata`` for the UI, check ``outcomes``."""

    path: Path | None
    metadata: dict[str, Any] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)


def record(paths: DataPaths, spec: RunSpec, asset: str, outcomes: list[Outcome]) -> None:
    """Write ``outcomes`` of ``asset`` into the run folder's ``checks.json`` / ``checks.txt``."""
    record_checks(
        paths.run_folder(spec), asset, [(o.name, o.passed, o.message, o.severity == "warn") for o in outcomes]
    )
