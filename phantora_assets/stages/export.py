"""The ``phantora_v0`` export: every run that passed its checks, streamed run by run into one staged
folder that is swapped in whole (no Dagster import; the asset is ``assets/dataset.py``'s).

Layout (``lib/store/export.py``)::

    phantora_v0/README.md                                 the dataset card (stages/card.py)
    phantora_v0/runs.csv, runs.parquet                    one row per run
    phantora_v0/flows_100ms.csv, windows.csv              the v1 CSVs, every run
    phantora_v0/flows_100ms/<run_id>/part-<h>.parquet     one Parquet file per run (<h>: 16 hex of
    phantora_v0/windows/<run_id>/part-<h>.parquet         the file's sha256)
    phantora_v0/run_status.csv                            every run of the matrix, included or not
    phantora_v0/plots/                                    kept from the previous export (dataset_plots)

Memory is bounded by ``lib/store/export.BATCH_ROWS`` rows: each run's per-run file is read and
written to the staging folder batch by batch, and the batches are validated with the v1 pandera
contract up to ``BATCH_ROWS`` rows at a time (several small runs in one call), before anything is
swapped in.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pandera.errors as pa_errors
import pyarrow as pa
import pyarrow.compute as pc

from phantora_assets import contracts
from phantora_assets.checks import DATASET_CONTRACT, exclusion_reason, read_checks
from phantora_assets.lib.bins.width import DEFAULT_BIN_S
from phantora_assets.lib.columns import BIN_COLUMNS
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store import export as ex
from phantora_assets.lib.store import generations
from phantora_assets.lib.store.io import atomic_write_text, link_or_copy
from phantora_assets.lib.traffic.window_features import WINDOW_FEATURE_COLUMNS
from phantora_assets.outcomes import Outcome
from phantora_assets.paths import DataPaths
from phantora_assets.records import RecordError
from phantora_assets.stages.simulation import stale_reason


def contract_outcome(name: str, schema, df: pd.DataFrame) -> Outcome:
    """The outcome of validating ``df`` with the pandera ``schema`` (lazy: every violation counted)."""
    try:
        schema.validate(df, lazy=True)
    except pa_errors.SchemaErrors as exc:
        cases = exc.failure_cases
        head = "; ".join(f"{r.column}: {r.check}" for r in cases.head(5).itertuples())
        return Outcome(
            name,
            False,
            f"{len(cases)} violation(s) of the {schema.name} contract: {head}",
            {"violations": int(len(cases))},
        )
    return Outcome(name, True, f"{len(df)} rows satisfy the {schema.name} contract", {"rows": int(len(df))})


def schema_dtypes(schema) -> dict[str, str]:
    """``{column: dtype name}`` of a pandera DataFrame ``schema`` (the dtypes the CSV is read with)."""
    return {c: str(col.dtype) for c, col in schema.columns.items()}


@dataclass(frozen=True)
class ExportTable:
    """A table of the dataset: the per-run file it is read from, its columns and its pandera contract."""

    name: str
    source: str  # paths.table(run_id, source)
    columns: dict[str, str]
    schema: Callable[[], object]  # -> pandera DataFrameSchema
    per_run: bool  # one Parquet file per run (<name>/<run_id>/part-0.parquet), else one <name>.parquet
    config_doc: str = ""  # the dataset card's line for it
    v1_width_only: bool = False  # v1's 100 ms runs only (flows_100ms; every width: DuckDB's flows_binned)


EXPORT_TABLES: tuple[ExportTable, ...] = (
    ExportTable("runs", "run_summary", schema_dtypes(contracts.RUNS), lambda: contracts.RUNS, False, "one row per run"),
    ExportTable(
        "flows_100ms",
        "flows_100ms",
        dict(BIN_COLUMNS),
        lambda: contracts.FLOWS_100MS,
        True,
        "bytes per (run_id, 100 ms bin t, src_node, dst_node)",
        v1_width_only=True,
    ),
    ExportTable(
        "windows",
        "windows",
        dict(WINDOW_FEATURE_COLUMNS),
        contracts.windows_schema,
        True,
        "detector features per (run_id, window_s, window_start_s)",
    ),
)


@dataclass
class DatasetResult:
    dir: Path
    included: list[str]
    excluded: dict[str, str]
    outcome: Outcome
    rows: dict[str, int] = field(default_factory=dict)


class _ContractBroken(Exception):
    def __init__(self, outcome: Outcome):
        self.outcome = outcome


class _RunValidator:
    """Validates one table's rows: the contract without its run_id column (per-run tables) or regex, and
    uniqueness, over up to ``BATCH_ROWS`` rows at a time (of one run or several, at :meth:`flush`);
    the run_id (regex once, every row equal to the run's) and the unique keys across the run
    (strictly increasing keys in one pass, else a DuckDB count) per run."""

    def __init__(self, table: ExportTable):
        full = table.schema()
        self.table, self.full = table, full
        self.keys = [k for k in (full.unique or []) if k != "run_id"]  # type: ignore[attr-defined]
        batch = full.update_column("run_id", checks=[])  # type: ignore[attr-defined]
        # per run: run_id is compared with the run's as Arrow, so the batch is validated without it
        # (as a pandas column it was a Python string per row and a quarter of the export's time)
        self.drop = ["run_id"] if table.per_run else []
        if table.per_run:
            batch = batch.remove_columns(self.drop)
            batch.unique = None
        self.batch = batch
        self._held: list[tuple[Path, pa.RecordBatch]] = []  # validated at flush(), before the table is published
        self._held_rows = 0

    def batches(self, run_id: str, path: Path) -> Iterator[pa.RecordBatch]:
        one = self.full.columns["run_id"]  # type: ignore[attr-defined]
        try:
            one.validate(pd.DataFrame({"run_id": [run_id]}))
        except pa_errors.SchemaError as exc:
            raise _ContractBroken(Outcome(self.table.name, False, f"{path}: run_id {run_id!r}: {exc}")) from exc
        last: tuple | None = None
        ordered = True
        for batch in ex.iter_batches(path, ex.arrow_schema(self.table.columns)):
            rid = batch.column("run_id")
            if rid.null_count or not pc.all(pc.equal(rid, run_id)).as_py():  # in Arrow: no str per row
                raise _ContractBroken(Outcome(self.table.name, False, f"{path}: a row's run_id is not {run_id}"))
            self._hold(path, batch.select([c for c in batch.schema.names if c not in self.drop]))
            if self.keys and ordered:
                ordered, last = _increasing([batch.column(k).to_numpy(zero_copy_only=False) for k in self.keys], last)
            yield batch
        if self.keys and not ordered and _duplicate_keys(path, self.keys):
            raise _ContractBroken(
                Outcome(self.table.name, False, f"{path}: rows repeat the key ({', '.join(['run_id', *self.keys])})")
            )

    def _hold(self, path: Path, batch: pa.RecordBatch) -> None:
        if self._held and self._held_rows + batch.num_rows > ex.BATCH_ROWS:
            self.flush()
        self._held.append((path, batch))
        self._held_rows += batch.num_rows

    def flush(self) -> None:
        """Validate the batches held so far with the contract in one pandera call (at most
        ``BATCH_ROWS`` rows: many small runs at once; a call costs ~25 ms whatever its rows). On a
        violation the first batch that breaks it alone is named by its file; raises _ContractBroken."""
        held, self._held, self._held_rows = self._held, [], 0
        if not held:
            return
        both = pa.Table.from_batches([b for _, b in held]).to_pandas()
        outcome = contract_outcome(self.table.name, self.batch, both)
        if outcome.passed:
            return
        for path, b in held:
            one = contract_outcome(self.table.name, self.batch, b.to_pandas())
            if not one.passed:
                raise _ContractBroken(Outcome(one.name, False, f"{path}: {one.message}", one.metadata))
        files = ", ".join(sorted({str(p) for p, _ in held}))  # only together (e.g. a key in two files)
        raise _ContractBroken(Outcome(outcome.name, False, f"{files}: {outcome.message}", outcome.metadata))


def _increasing(cols: list[np.ndarray], last: tuple | None) -> tuple[bool, tuple | None]:
    """Whether the rows of ``cols`` (after the row ``last``) are in strictly increasing key order,
    and the batch's last row."""
    n = len(cols[0])
    if n == 0:
        return True, last
    if last is not None:
        cols = [np.concatenate([np.asarray([v], dtype=c.dtype), c]) for v, c in zip(last, cols, strict=True)]
    greater = np.zeros(len(cols[0]) - 1, dtype=bool)
    equal = np.ones(len(cols[0]) - 1, dtype=bool)
    for c in cols:
        a, b = c[:-1], c[1:]
        greater |= equal & (b > a)
        equal &= b == a
    return bool(greater.all()), tuple(c[-1] for c in cols)


def _duplicate_keys(path: Path, keys: list[str]) -> bool:
    """Whether two rows of the Parquet file share ``keys`` (DuckDB, bounded memory)."""
    import duckdb

    con = duckdb.connect(config={"memory_limit": "512MB", "threads": 2})
    try:
        cols = ", ".join(f'"{k}"' for k in keys)
        sql = f"SELECT count(*) FROM (SELECT {cols} FROM read_parquet(?) GROUP BY ALL HAVING count(*) > 1)"
        (n,) = con.execute(sql, [str(path)]).fetchone() or (0,)
    finally:
        con.close()
    return int(n) > 0


def run_exclusion(spec: RunSpec, paths: DataPaths) -> str | None:
    """Why run ``spec`` is out of the dataset, or None when it is in: the one reason ``run_status.csv``
    and the database's ``run_status`` give. A malformed record (``checks.json``, ``run_spec.json``):
    its error, naming the file; else ``checks.exclusion_reason`` (``not built``, or each gating check
    not passed with its status); else a run built from other inputs than the matrix now gives:
    ``stale: ...`` (``stages/simulation.stale_reason``)."""
    try:
        return exclusion_reason(read_checks(paths.run_folder(spec))) or stale_reason(spec, paths)
    except RecordError as exc:  # that run is out, with the reason; the others are not affected
        return str(exc)


def included_runs(specs: list[RunSpec], paths: DataPaths) -> tuple[list[str], dict[str, str]]:
    """The runs whose checks all passed and that are current (sorted), and why each other run is out
    (:func:`run_exclusion`)."""
    included, excluded = [], {}
    for spec in sorted(specs, key=lambda s: s.run_id):
        why = run_exclusion(spec, paths)
        if why:
            excluded[spec.run_id] = why
        else:
            included.append(spec.run_id)
    return included, excluded


def export_dataset(
    specs: list[RunSpec],
    paths: DataPaths,
    card: Callable[[dict[str, int], list[str], dict[str, float], dict[str, str]], str] | None = None,
) -> DatasetResult:
    """Assemble ``phantora_v0/`` from every run whose checks all passed (layout: module docstring).

    Every table (an empty one too) and ``run_status.csv`` go to a staging folder, fsynced, which is
    published at once as the new generation ``phantora_v0`` links to (``lib/store/generations``):
    a reader or a crash sees the previous dataset or this one, whole, and the previous generation
    stays for the readers that resolved it (``generations.GRACE_S``). Rows are validated with the
    v1 pandera contract as they are streamed; a row that breaks it fails ``dataset_contract``
    (naming the run's file and the rule) and nothing is published. A run that passed its checks
    but was built from another run-matrix entry or perf DB than the current one is excluded as
    stale (``stages/simulation.stale_reason``). Runs in run_id order, rows in their per-run file's
    order: a rebuild is byte-identical.
    ``card(rows per table, included run_ids, their bin_s, sha256 per table) -> text``, when given, writes
    ``README.md`` (the dataset card; the digests are of each table's Parquet bytes, :func:`parquet_digest`).
    """
    included, excluded = included_runs(specs, paths)
    width = {s.run_id: s.bin_s for s in specs}
    d = paths.dataset_dir
    staging = generations.staging_dir(d)
    rows: dict[str, int] = {}
    try:
        try:
            for table in EXPORT_TABLES:
                check = _RunValidator(table)
                with ex.TableWriter(staging, table.name, ex.arrow_schema(table.columns), table.per_run) as w:
                    for run_id in included:
                        if table.v1_width_only and width[run_id] != DEFAULT_BIN_S:
                            continue
                        w.add_run(run_id, check.batches(run_id, paths.table(run_id, table.source)))
                    check.flush()
                rows[table.name] = w.rows
        except _ContractBroken as broken:
            shutil.rmtree(staging, ignore_errors=True)
            counts = {"runs": len(included), "excluded": len(excluded)}
            outcome = Outcome(DATASET_CONTRACT, False, broken.outcome.message, counts)
            return DatasetResult(d, included, excluded, outcome)
        listing = (
            ["run_id,status,reason"]
            + [f"{r},included," for r in included]
            + [f'{r},excluded,"{_csv_text(why)}"' for r, why in excluded.items()]
        )
        atomic_write_text(staging / "run_status.csv", "\n".join(listing) + "\n", durable=True)
        if card is not None:
            digests = {t.name: parquet_digest(staging, t.name) for t in EXPORT_TABLES}
            text = card(rows, included, {r: width[r] for r in included}, digests)
            atomic_write_text(staging / "README.md", text, durable=True)
        if (d / "plots").is_dir():  # the dataset plots stay until dataset_plots draws new ones
            plots = d / "plots"
            shutil.copytree(plots, staging / "plots", copy_function=lambda a, b: link_or_copy(Path(a), Path(b)))
        generations.publish(staging, d)
    except BaseException:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging, ignore_errors=True)
        raise
    msg = "; ".join(f"{rows[t.name]} rows satisfy the {t.name} contract" for t in EXPORT_TABLES)
    counts = {"runs": len(included), "excluded": len(excluded)}
    return DatasetResult(d, included, excluded, Outcome(DATASET_CONTRACT, True, msg, counts), rows)


def parquet_digest(folder: Path, table: str) -> str:
    """sha256 over a table's Parquet files in ``folder`` (each one's relative path and bytes, in path
    order): it changes whenever the table's data does, and only then."""
    h = hashlib.sha256()
    files = [folder / f"{table}.parquet"] if (folder / f"{table}.parquet").is_file() else []
    for f in files + sorted((folder / table).glob("*/*.parquet")):
        h.update(f.relative_to(folder).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _csv_text(text: str) -> str:
    """``text`` for a double-quoted CSV field: quotes doubled, line breaks as spaces."""
    return text.replace('"', '""').replace("\r", " ").replace("\n", " ")
