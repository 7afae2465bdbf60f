"""What every stage returns, and the helpers stages share (no Dagster import).

A stage is a plain function ``(spec, paths, ...) -> StageResult``: it reads the files of the
stages before it under a :class:`~phantora_assets.paths.DataPaths` root, writes its own files
atomically, records its check outcomes in the run folder (``checks.json``/``checks.txt``) and
returns the metadata and outcomes for the asset to report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phantora_assets.checks import record_checks
from phantora_assets.lib.bins.width import DEFAULT_BIN_S
from phantora_assets.lib.store.io import atomic_path
from phantora_assets.matrix import RunSpec
from phantora_assets.paths import DataPaths

#: The 180 s window of the build (docs/DATASET.md, "How a trace becomes the dataset", step 4),
#: v1's 100 ms bins (the width of ``flows_100ms``; a run's own is ``RunSpec.bin_s``) and the
#: control traffic each node sends, bytes/s.

WINDOW_S = 180.0
BIN_S = DEFAULT_BIN_S
CONTROL_BYTES_PER_S = 5000


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


def write_parquet(df: pd.DataFrame, path: Path, durable: bool = False) -> None:
    with atomic_path(path, durable) as tmp:
        df.to_parquet(tmp, index=False, engine="pyarrow", compression="zstd")


def record(paths: DataPaths, spec: RunSpec, asset: str, outcomes: list[Outcome]) -> None:
    record_checks(
        paths.run_folder(spec), asset, [(o.name, o.passed, o.message, o.severity == "warn") for o in outcomes]
    )


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, (np.integer,)):
            v = int(v)
        elif isinstance(v, (np.floating,)):
            v = float(v)
        elif not isinstance(v, (int, float, str, bool)) and v is not None:
            v = json.dumps(v, default=str)[:2000]
        out[k] = v
    return out
