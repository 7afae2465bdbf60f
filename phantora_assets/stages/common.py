"""What every stage returns, and the helpers stages share (no Dagster import).

A stage is a plain function ``(spec, paths, ...) -> StageResult``: it reads the files of the
stages before it under a :class:`~phantora_assets.paths.DataPaths` root, writes its own files
atomically, records its check outcomes in the run folder (``checks.json``/``checks.txt``) and
returns the metadata and outcomes for the asset to report.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

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


#: Arrow type of each dtype name of the column contracts (``columns.py``, ``*_COLUMNS`` dicts).
ARROW_TYPES: dict[str, pa.DataType] = {
    "str": pa.string(),
    "int64": pa.int64(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
}


def contract_schema(columns: dict[str, str]) -> pa.Schema:
    """The Arrow schema of a column contract (name -> dtype name of :data:`ARROW_TYPES`).

    Raises:
        KeyError: a dtype name without an Arrow type here.
    """
    return pa.schema([(name, ARROW_TYPES[dtype]) for name, dtype in columns.items()])


def write_parquet(
    df: pd.DataFrame, path: Path, durable: bool = False, chunk_rows: int = 0, columns: dict[str, str] | None = None
) -> None:
    """``df`` as zstd Parquet, atomically; with ``chunk_rows``, converted to Arrow and written that
    many rows at a time (one row group each: a large table is not copied whole into Arrow). With
    ``columns`` (a column contract), the file has exactly the contract's columns and types, also when
    ``df`` is empty (pandas would write an empty object column as Arrow's ``null`` type, which a
    reader cannot cast to the column's type)."""
    with atomic_path(path, durable) as tmp:
        if columns is not None:
            table = pa.Table.from_pandas(df[list(columns)], contract_schema(columns), preserve_index=False)
            pq.write_table(table, tmp, compression="zstd")
            return
        if not chunk_rows or len(df) <= chunk_rows:
            df.to_parquet(tmp, index=False, engine="pyarrow", compression="zstd")
            return
        schema = pa.Schema.from_pandas(df.iloc[:chunk_rows], preserve_index=False)
        with pq.ParquetWriter(tmp, schema, compression="zstd") as writer:
            for a in range(0, len(df), chunk_rows):
                writer.write_table(pa.Table.from_pandas(df.iloc[a : a + chunk_rows], schema, preserve_index=False))


def write_parquet_frames(frames: Iterable[pd.DataFrame], path: Path, chunk_rows: int, durable: bool = False) -> None:
    """The concatenation of ``frames`` written as :func:`write_parquet` (``chunk_rows``) writes it --
    the same file -- holding at most about ``chunk_rows`` rows plus one frame at a time (a table
    made piece by piece is never whole in memory)."""
    buf: list[pd.DataFrame] = []
    have = 0
    writer: pq.ParquetWriter | None = None
    schema: pa.Schema | None = None
    with atomic_path(path, durable) as tmp:
        try:
            for f in frames:
                buf.append(f)
                have += len(f)
                # more than one chunk in all: write whole chunks as write_parquet's ParquetWriter does
                while have > chunk_rows or (writer is not None and have >= chunk_rows):
                    df = pd.concat(buf, ignore_index=True) if len(buf) > 1 else buf[0]
                    chunk, rest = df.iloc[:chunk_rows], df.iloc[chunk_rows:]
                    if writer is None:
                        schema = pa.Schema.from_pandas(chunk, preserve_index=False)
                        writer = pq.ParquetWriter(tmp, schema, compression="zstd")
                    writer.write_table(pa.Table.from_pandas(chunk, schema, preserve_index=False))
                    buf = [rest.reset_index(drop=True).copy()] if len(rest) else []
                    have = len(rest)
                    del df, chunk, rest
            rest = pd.concat(buf, ignore_index=True) if len(buf) > 1 else (buf[0] if buf else pd.DataFrame())
            if writer is None:  # one chunk or less in all: write_parquet's single write
                rest.to_parquet(tmp, index=False, engine="pyarrow", compression="zstd")
            elif len(rest):
                writer.write_table(pa.Table.from_pandas(rest, schema, preserve_index=False))
        finally:
            if writer is not None:
                writer.close()


#: Resident size above which :func:`release_memory` returns freed memory to the system.
RELEASE_ABOVE_BYTES = 512 << 20


def release_memory(above: int = RELEASE_ABOVE_BYTES) -> None:
    """Give the memory a finished stage freed back to the system when the process holds more than
    ``above`` bytes: collect garbage, empty Arrow's pool (mimalloc keeps freed pages: ~400 MiB
    after the 128x8 Chrome trace) and trim the C heap (glibc keeps freed arenas), so the next stage
    of a run -- all of them run in one process -- starts from what is still in use, not from the
    last stage's peak. Below ``above`` nothing is done (the interpreter's own collections go on):
    returning the pages after every step of the 30 shipped runs doubled the build's page faults
    (~1.2 s of system time), and a full collection after each of their 264 steps cost 1.8 s of CPU."""
    if _resident_bytes() <= above:
        return
    gc.collect()
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: nothing to trim
        pass


def _resident_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; where it cannot be read, a
    size above any threshold, so that memory is always released)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 1 << 62


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
