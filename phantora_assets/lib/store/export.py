"""Streaming writers of the published dataset (``phantora_v0/``): Parquet parts and CSVs, run by run.

Layout under a staging folder (``stages/export.py`` swaps it in whole, ``io.swap_in_dir``)::

    <table>.csv                              every run, appended run by run (the v1 CSV contract)
    <table>/<run_id>/part-0.parquet          per-run tables, one folder per run
    <table>.parquet                          single-file tables (runs)

Each Parquet file carries the ``run_id`` column, so a file read alone is whole. The folders are
named by the bare run_id, not hive-style ``run_id=<run_id>``: a hive folder name makes a partition
column beside the file's own ``run_id``, and pandas' default reader (``pd.read_parquet("<table>")``,
which infers it as a dictionary) and ``pyarrow.dataset(..., partitioning="hive")`` (as a string)
cannot both merge it with the file's string column. Readers skip other runs' row groups by the
column's statistics (``filters=[("run_id", "==", ...)]``, ``WHERE run_id = ...``). Memory is bounded by one batch
(:data:`BATCH_ROWS` rows), whatever the size of a run or of the dataset.

Byte-identical across rebuilds: fixed writer settings (:data:`PARQUET_OPTIONS`, pinned pyarrow),
no timestamps, no pandas metadata, rows in the order they are given. The CSV of a table is byte
for byte what ``io.atomic_write_csv`` writes for the concatenation of its runs (pandas'
``to_csv(index=False, float_format="%.10g", lineterminator="\\n")``).

No Dagster import.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

#: Rows per batch read, validated and written (and per Parquet row group).
BATCH_ROWS = 1 << 20
#: Parquet writer settings of every dataset file (fixed: a rebuild writes the same bytes).
PARQUET_OPTIONS: dict = {
    "compression": "zstd",
    "compression_level": 3,
    "use_dictionary": True,
    "write_statistics": True,
    "data_page_size": 1 << 20,
    "version": "2.6",
}
#: pandas dtype name (columns.py) -> Arrow type.
ARROW_TYPES = {"int64": pa.int64(), "float64": pa.float64(), "str": pa.string(), "bool": pa.bool_()}


def arrow_schema(columns: dict[str, str]) -> pa.Schema:
    """The Arrow schema of a table given as ``{column: pandas dtype name}`` (columns.py)."""
    return pa.schema([(c, ARROW_TYPES[d]) for c, d in columns.items()])


def part_path(root: Path, table: str, run_id: str) -> Path:
    """``root/<table>/<run_id>/part-0.parquet``: the run's file of a per-run table."""
    return root / table / run_id / "part-0.parquet"


def iter_batches(path: Path, schema: pa.Schema, batch_rows: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """The rows of the Parquet file ``path`` in batches, cast to ``schema`` (its columns, in order).

    Raises:
        KeyError: a column of ``schema`` is missing from the file.
        pyarrow.ArrowInvalid: a value does not cast (e.g. a float column into int64).
    """
    pf = pq.ParquetFile(path)
    names = schema.names
    have = set(pf.schema_arrow.names)
    missing = [c for c in names if c not in have]
    if missing:
        raise KeyError(f"{path}: no column(s) {', '.join(missing)}")
    for batch in pf.iter_batches(batch_size=batch_rows, columns=names):
        yield pa.RecordBatch.from_arrays([batch.column(c) for c in names], schema=batch.schema).cast(schema)


def csv_header(schema: pa.Schema) -> bytes:
    """The CSV header line pandas writes for these (plain) column names."""
    for c in schema.names:
        if any(ch in c for ch in ',"\r\n'):
            raise ValueError(f"column name {c!r} would need quoting")
    return (",".join(schema.names) + "\n").encode()


def csv_rows(batch: pa.RecordBatch, float_format: str = "%.10g") -> bytes:
    """The CSV lines (no header) of ``batch``, as pandas writes them (see the module docstring).

    Floats are formatted once per distinct bit pattern (NaN and null as an empty field); int and
    string columns go to pyarrow's writer as they are. A batch pyarrow cannot write the way pandas
    does (a string needing quotes, a null in an int or string column, booleans, one column) is
    written by pandas itself.
    """
    if batch.num_rows == 0:
        return b""
    columns = _arrow_csv_columns(batch, float_format)
    if columns is not None:
        sink = pa.BufferOutputStream()
        try:
            pacsv.write_csv(pa.table(columns), sink, pacsv.WriteOptions(include_header=False, quoting_style="none"))
            return sink.getvalue().to_pybytes()
        except pa.ArrowInvalid:  # a value that needs quoting: pandas quotes it
            pass
    text = batch.to_pandas().to_csv(None, index=False, header=False, float_format=float_format, lineterminator="\n")
    return text.encode("utf-8")


def _arrow_csv_columns(batch: pa.RecordBatch, float_format: str) -> dict | None:
    if batch.num_columns < 2:
        return None
    columns = {}
    for name, col in zip(batch.schema.names, batch.columns, strict=True):
        if pa.types.is_floating(col.type):
            values = np.ascontiguousarray(col.to_numpy(zero_copy_only=False).astype(np.float64))
            bits, index = np.unique(values.view(np.int64), return_inverse=True)  # -0.0 keeps its own text
            text = np.array(["" if v != v else float_format % v for v in bits.view(np.float64)], dtype=object)
            columns[name] = pa.array(text[index.reshape(-1)], type=pa.string())
        elif (pa.types.is_integer(col.type) or pa.types.is_string(col.type)) and col.null_count == 0:
            columns[name] = col
        else:
            return None
    return columns


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TableWriter:
    """One table of the dataset in a staging folder: its CSV and its Parquet file(s), written batch
    by batch. ``per_run``: one Parquet file per run (:func:`part_path`), else one ``<name>.parquet``.

    Use as a context manager; :meth:`close` fsyncs every file and folder it wrote (the dataset is
    published durably). The staging folder is the unit of atomicity: on an error the caller removes it.
    """

    def __init__(self, staging: Path, name: str, schema: pa.Schema, per_run: bool, float_format: str = "%.10g"):
        self.staging, self.name, self.schema, self.per_run = Path(staging), name, schema, per_run
        self.float_format = float_format
        self.rows = 0
        self.files: list[Path] = []
        self.staging.mkdir(parents=True, exist_ok=True)
        self._csv_path = self.staging / f"{name}.csv"
        self._csv = open(self._csv_path, "wb")
        self._csv.write(csv_header(schema))
        self._single: pq.ParquetWriter | None = None
        if per_run:
            (self.staging / name).mkdir(exist_ok=True)
        else:
            self._single = self._writer(self.staging / f"{name}.parquet")

    def _writer(self, path: Path) -> pq.ParquetWriter:
        self.files.append(path)
        return pq.ParquetWriter(path, self.schema, **PARQUET_OPTIONS)

    def add_run(self, run_id: str, batches: Iterable[pa.RecordBatch]) -> int:
        """Append one run's rows (batches of :attr:`schema`); returns the run's row count.

        A per-run table gets the run's Parquet file even when it has no rows."""
        writer = self._single
        if self.per_run:
            path = part_path(self.staging, self.name, run_id)
            path.parent.mkdir(parents=True, exist_ok=True)
            writer = self._writer(path)
        assert writer is not None
        n = 0
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                writer.write_batch(batch, row_group_size=BATCH_ROWS)
                self._csv.write(csv_rows(batch, self.float_format))
                n += batch.num_rows
        finally:
            if self.per_run:
                writer.close()
        self.rows += n
        return n

    def close(self, durable: bool = True) -> None:
        """Close (and with ``durable``, fsync) every file and folder of the table."""
        if self._single is not None:
            self._single.close()
            self._single = None
        if not self._csv.closed:
            self._csv.flush()
            if durable:
                os.fsync(self._csv.fileno())
            self._csv.close()
        if durable:
            for f in self.files:
                _fsync(f)
            folders = {f.parent for f in self.files} | {self.staging / self.name}
            for d in sorted(folders - {self.staging}):
                if d.is_dir():
                    _fsync(d)

    def abort(self) -> None:
        """Close the open files without syncing (the caller removes the staging folder)."""
        if self._single is not None:
            self._single.close()
            self._single = None
        if not self._csv.closed:
            self._csv.close()

    def __enter__(self) -> TableWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
