"""Parquet files of the per-run tables, written atomically (zstd), whole or a chunk at a time.

No Dagster, nothing of the application: a table and a path in, a file out
(:func:`~phantora_assets.lib.store.io.atomic_path`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from phantora_assets.lib.store.io import atomic_path

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
