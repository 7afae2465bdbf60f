"""The cross-run DuckDB database (``data/phantora.duckdb``), rebuilt from per-run Parquet files.

Each run keeps its tables in its own partition folder (``partitions/<run_id>/*.parquet``),
so runs materialized in parallel never contend on one file; :func:`build_database` reads
the files of the runs that passed every check into a *new* database file beside the old
one and renames it into place, so readers see the previous database or the new one, never
a half-built one. The database holds copies (not views over the Parquet paths), so it can
be moved or queried from any working directory.

Tables (one row per ...): ``runs`` (run), ``flows_100ms`` (run of 100 ms bins, bin, directed pair),
``flows_binned`` (run at its ``bin_s``, bin, directed pair),
``windows`` (run, window), ``flows`` (network flow), ``steps`` (step), ``step_anatomy``
(step, host), ``link_bins`` (run, bin, directed link), ``run_status`` (run of the matrix, included or
not, with the reason).
Views: :data:`VIEWS`. Every table, view and documented column carries a ``COMMENT``
(``select * from duckdb_views()``, ``duckdb_columns()``).

No Dagster import.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: DuckDB's memory limit while building (beyond it, sorts and joins spill to a temporary folder beside
#: the database; appends are written to the file as they go): the build of a 50 M-row flows_100ms
#: stays within 2 GB of RSS (benchmarks/dataset_scale.py).
MEMORY_LIMIT = "1GB"
#: pandas dtype name -> DuckDB type.
_SQL_TYPES = {"int64": "BIGINT", "float64": "DOUBLE", "str": "VARCHAR", "bool": "BOOLEAN"}


@dataclass(frozen=True)
class Table:
    """A base table: its columns (name -> dtype), the per-run file it is read from, its docs."""

    name: str
    columns: Mapping[str, str]
    source: str | None  # per-partition file name (None: built here)
    description: str
    column_docs: Mapping[str, str] = field(default_factory=dict)
    add_run_id: bool = False  # the file has no run_id column: prepend it
    optional: bool = False  # a run without the file adds no rows (else: error)
    from_runs: tuple[str, ...] = ()  # columns taken from the run's row of ``runs`` (r), not the file
    run_filter: str | None = None  # SQL on ``runs`` (r): only the runs it holds for add rows


@dataclass(frozen=True)
class View:
    """A documented view: its SQL, what one row is, and what each column means."""

    name: str
    sql: str
    description: str
    column_docs: Mapping[str, str]


VIEWS: tuple[View, ...] = (
    View(
        "pair_bytes",
        """
        WITH n AS (SELECT run_id, count(*) AS n_steady FROM steps WHERE steady GROUP BY run_id),
        step_pairs AS (
            SELECT f.run_id, f.src_node, f.dst_node, sum(f.bytes) AS steady_bytes, count(*) AS steady_flows
            FROM flows f JOIN steps s ON s.run_id = f.run_id AND s.step = f.step
            WHERE s.steady GROUP BY ALL),
        window_pairs AS (
            SELECT run_id, src_node, dst_node, sum(bytes) AS window_bytes FROM flows_binned GROUP BY ALL)
        SELECT w.run_id, w.src_node, w.dst_node,
               coalesce(p.steady_bytes, 0) / n.n_steady AS bytes_per_step,
               coalesce(p.steady_flows, 0) / n.n_steady AS flows_per_step,
               coalesce(coalesce(p.steady_bytes, 0) / nullif(sum(coalesce(p.steady_bytes, 0))
                   OVER (PARTITION BY w.run_id), 0), 0) AS share_of_step,
               w.window_bytes
        FROM window_pairs w
        JOIN n USING (run_id)
        LEFT JOIN step_pairs p USING (run_id, src_node, dst_node)
        ORDER BY run_id, src_node, dst_node
        """,
        "Bytes per directed node pair per run: one row per (run_id, src_node, dst_node) of flows_binned.",
        {
            "bytes_per_step": "network bytes of the pair in one steady step (mean over the steady steps), bytes",
            "flows_per_step": "network flows of the pair per steady step",
            "share_of_step": "bytes_per_step / the run's network bytes per step (0..1)",
            "window_bytes": "bytes of the pair over the 180 s window (flows_binned), control traffic included",
        },
    ),
    View(
        "collective_bytes",
        """
        WITH n AS (SELECT run_id, count(*) AS n_steady FROM steps WHERE steady GROUP BY run_id),
        per AS (
            SELECT f.run_id,
                   CASE WHEN f.op IN ('send', 'recv') AND f."group" IN ('pp', 'cp') THEN 'send_recv'
                        WHEN f.op IN ('send', 'recv') THEN 'all_to_all' ELSE f.op END AS collective,
                   sum(f.bytes) AS steady_bytes, count(*) AS steady_flows,
                   count(DISTINCT f.comm_id) AS communicators
            FROM flows f JOIN steps s ON s.run_id = f.run_id AND s.step = f.step
            WHERE s.steady GROUP BY ALL)
        SELECT run_id, collective,
               steady_bytes / n_steady AS bytes_per_step,
               steady_flows / n_steady AS flows_per_step,
               communicators,
               steady_bytes / sum(steady_bytes) OVER (PARTITION BY run_id) AS share_of_step
        FROM per JOIN n USING (run_id)
        ORDER BY run_id, bytes_per_step DESC, collective
        """,
        "Network traffic by collective type per run: one row per (run_id, collective) present in the "
        "run's steady steps.",
        {
            "collective": "all_reduce | all_gather | reduce_scatter | all_to_all | send_recv | broadcast; "
            "all_to_all is the NcclSend/NcclRecv flows of an MoE all-to-all (issued as grouped "
            "send/recv), send_recv those of pipeline (pp) and context-parallel ring (cp) communicators",
            "bytes_per_step": "network bytes of that collective type in one steady step (mean), bytes",
            "flows_per_step": "network flows (ring hops) of that type per steady step",
            "communicators": "distinct communicators issuing it",
            "share_of_step": "bytes_per_step / the run's network bytes per step (0..1)",
        },
    ),
    View(
        "group_bytes",
        """
        WITH n AS (SELECT run_id, count(*) AS n_steady FROM steps WHERE steady GROUP BY run_id),
        per AS (
            SELECT f.run_id, f."group" AS "group", sum(f.bytes) AS steady_bytes, count(*) AS steady_flows,
                   count(DISTINCT f.comm_id) AS communicators
            FROM flows f JOIN steps s ON s.run_id = f.run_id AND s.step = f.step
            WHERE s.steady GROUP BY ALL)
        SELECT run_id, "group",
               steady_bytes / n_steady AS bytes_per_step,
               steady_flows / n_steady AS flows_per_step,
               communicators,
               steady_bytes / sum(steady_bytes) OVER (PARTITION BY run_id) AS share_of_step
        FROM per JOIN n USING (run_id)
        ORDER BY run_id, bytes_per_step DESC, "group"
        """,
        "Network traffic by parallelism group per run: one row per (run_id, group) present in the run's "
        'steady steps (flows.group; docs/WORKLOADS.md "Groups").',
        {
            "group": "tp | cp | ep | dp | pp | other: the parallelism dimension the flows' communicator spans",
            "bytes_per_step": "network bytes of that group in one steady step (mean), bytes",
            "flows_per_step": "network flows of that group per steady step",
            "communicators": "distinct communicators of the group",
            "share_of_step": "bytes_per_step / the run's network bytes per step (0..1)",
        },
    ),
    View(
        "run_anatomy",
        """
        SELECT a.run_id,
               count(DISTINCT step) AS n_steady_steps,
               count(DISTINCT step) FILTER (WHERE timed) AS n_timed_steps,
               count(DISTINCT host) AS n_hosts,
               any_value(r.step_time_s) * 1e3 AS step_time_ms,
               avg(compute_us) FILTER (WHERE timed) / 1e3 AS compute_ms,
               avg(comm_us) FILTER (WHERE timed) / 1e3 AS comm_ms,
               avg(overlap_us) FILTER (WHERE timed) / 1e3 AS overlapped_comm_ms,
               avg(exposed_comm_us) FILTER (WHERE timed) / 1e3 AS exposed_comm_ms,
               avg(idle_us) FILTER (WHERE timed) / 1e3 AS idle_ms,
               avg(compute_us / duration_us) FILTER (WHERE timed) AS compute_share,
               avg(exposed_comm_us / duration_us) FILTER (WHERE timed) AS exposed_comm_share
        FROM step_anatomy a JOIN runs r ON r.run_id = a.run_id WHERE steady GROUP BY a.run_id
        ORDER BY a.run_id
        """,
        "Step anatomy per run: the step_anatomy rows of the timed steady steps (not the last step when the "
        "trace's end cuts it) averaged over steps and hosts; step_time_ms is the run's step time (runs.step_time_s: "
        "the median of its typical timed steady steps).",
        {
            "n_timed_steps": "steady steps whose end is their own, the ones the times are averaged over",
            "compute_ms": "mean per-host compute time per steady step, ms",
            "comm_ms": "mean per-host network time per steady step, ms",
            "overlapped_comm_ms": "mean network time hidden behind compute, ms",
            "exposed_comm_ms": "mean network time not overlapped by compute, ms",
            "idle_ms": "mean time with neither compute nor network, ms",
            "step_time_ms": "the run's step time, runs.step_time_s in ms (one definition: lib/traffic/steps)",
            "compute_share": "mean compute_us / duration_us",
            "exposed_comm_share": "mean exposed_comm_us / duration_us",
        },
    ),
    View(
        "step_period",
        """
        WITH w AS (
            SELECT run_id, median(dominant_period_s) AS median_period_s,
                   median(periodicity) AS median_periodicity, count(*) AS n_windows
            FROM windows WHERE window_s = 15 GROUP BY run_id)
        SELECT r.run_id, r.step_time_s, r.bin_s,
               r.step_time_s < 2 * b.s AS period_aliased,
               CASE WHEN r.step_time_s >= 2 * b.s THEN r.step_time_s
                    ELSE 1 / nullif(abs(1 / r.step_time_s - round(b.s / r.step_time_s) / b.s), 0)
               END AS expected_period_s,
               w.median_period_s, w.median_periodicity, w.n_windows
        FROM runs r LEFT JOIN w USING (run_id), LATERAL (SELECT greatest(r.bin_s, 0.01) AS s) b
        ORDER BY run_id
        """,
        "The dominant_period_s feature against the step time, per run (15 s windows).",
        {
            "period_aliased": "true when the step is shorter than two bins (of bin_s, at least 10 ms: finer bins "
            "are folded in 10 ms sums): dominant_period_s then reads the step's alias, not the step time",
            "expected_period_s": "what dominant_period_s reads for this step: the step time, or its alias "
            "1/|1/step - k/b| with b = max(bin_s, 10 ms) (NULL: the step is a whole fraction of a bin)",
            "median_period_s": "median of dominant_period_s over the run's 15 s windows",
            "median_periodicity": "median of periodicity over the run's 15 s windows",
        },
    ),
)


#: Views over ``link_bins`` (per-link traffic, ``lib/net/``): added to :data:`VIEWS`.
LINK_VIEWS: tuple[View, ...] = (
    View(
        "link_utilisation",
        """
        SELECT run_id, t, bin_s, link_id, link_class, src, dst, bytes, capacity_bps,
               bytes * 8 / bin_s / capacity_bps AS utilisation, routes
        FROM link_bins
        ORDER BY run_id, t, link_id
        """,
        "Utilisation of every directed link in every bin: one row per (run_id, t, link_id) of link_bins.",
        {
            "utilisation": "bytes * 8 / bin_s / capacity_bps: the link's mean load in the bin as a share of its "
            "capacity (above 1 where the window's repetitions overlap a step's flows, or modelled routes stack "
            "connections the simulator timed on other spines)",
            "routes": "simulated (the paths the run's simulation used) | modelled (the same routing model, "
            "ECMP as configured, assigned them: imported traces, or hash ECMP between racks)",
        },
    ),
    View(
        "hottest_links",
        """
        WITH per AS (
            SELECT run_id, link_id, link_class, src, dst, capacity_bps, any_value(routes) AS routes,
                   max(utilisation) AS peak_utilisation, arg_max(t, [utilisation, -t]) AS peak_t,
                   sum(bytes)::HUGEINT * 8 / max(bin_s) / max(capacity_bps) / count(*) AS mean_utilisation,
                   sum(bytes)::BIGINT AS window_bytes
            FROM link_utilisation GROUP BY ALL)
        SELECT row_number() OVER (PARTITION BY run_id ORDER BY peak_utilisation DESC, link_id) AS rank, *
        FROM per
        QUALIFY rank <= 10
        ORDER BY run_id, rank
        """,
        "The 10 links of each run with the highest peak utilisation: one row per (run_id, rank).",
        {
            "rank": "1 = the link with the highest peak utilisation in the run (ties: lower link_id first)",
            "peak_utilisation": "largest utilisation of the link over the window's bins",
            "peak_t": "start of the (first) bin where the peak is reached, s",
            "mean_utilisation": "mean utilisation of the link over the window (from the exact byte sum: the same "
            "on every rebuild, where a parallel float average is not)",
            "window_bytes": "bytes on the link over the window",
        },
    ),
)
VIEWS += LINK_VIEWS

RUN_STATUS_DOC = (
    "Every run of the run matrix: included in the dataset tables (all checks passed) or not, with the reason."
)
RUN_STATUS_COLUMNS = {
    "status": "included | excluded",
    "reason": "why excluded, as in run_status.csv: 'not built', each gating check not passed with its status "
    "('<check>: failed', '<check>: not evaluated'), a stale build or a malformed record (empty when included)",
}


@dataclass(frozen=True)
class BuildResult:
    """What :func:`build_database` wrote: the file, rows per table, included and excluded runs."""

    path: Path
    rows: dict[str, int]
    included: list[str]
    excluded: dict[str, str]
    missing: dict[str, list[str]] = field(default_factory=dict)  # optional table -> runs without its file


def _sql_type(dtype: str) -> str:
    return _SQL_TYPES[dtype]


def _quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def _ident(s: str) -> str:
    return '"' + s.replace('"', '""') + '"'


def build_database(
    out: Path,
    tables: Sequence[Table],
    partition_dir: Mapping[str, Path],
    run_status: Sequence[tuple[str, str, str]],
    views: Sequence[View] = VIEWS,
) -> BuildResult:
    """Write a DuckDB database at ``out`` atomically (temporary file, then rename).

    Args:
        out: the database file.
        tables: the base tables; each with a ``source`` is filled from
            ``partition_dir[run_id] / source`` for every included run, files in run_id order, by
            ``INSERT ... SELECT FROM read_parquet([files])`` (DuckDB streams them: no table is
            held in memory).
        partition_dir: included run_id -> its partition folder (a folder named run_id).
        run_status: ``(run_id, status, reason)`` for every run of the matrix (the
            ``run_status`` table).
        views: the views to create over the tables.

    Raises:
        duckdb.Error, OSError: the old database (if any) is left untouched; ValueError: a
            partition folder not named after its run.
    """
    import duckdb

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    spill = out.with_name(f".{out.name}.p{os.getpid()}.dir.tmp")
    rows: dict[str, int] = {}
    missing: dict[str, list[str]] = {}
    try:
        con = duckdb.connect(str(tmp))
        try:
            con.execute("SET threads TO 2")
            con.execute(f"SET memory_limit = {_quote(MEMORY_LIMIT)}")
            con.execute(f"SET temp_directory = {_quote(str(spill))}")  # spills there beyond the limit
            for t in tables:
                cols = {"run_id": "str", **t.columns} if t.add_run_id else dict(t.columns)
                ddl = ", ".join(f"{_ident(c)} {_sql_type(d)}" for c, d in cols.items())
                con.execute(f"CREATE TABLE {_ident(t.name)} ({ddl})")
                if t.source is not None:
                    _fill(con, t, partition_dir, missing)
                _comment(con, "TABLE", t.name, t.description, t.column_docs)
            con.execute("CREATE TABLE run_status (run_id VARCHAR, status VARCHAR, reason VARCHAR)")
            con.executemany("INSERT INTO run_status VALUES (?, ?, ?)", [list(r) for r in run_status])
            _comment(con, "TABLE", "run_status", RUN_STATUS_DOC, RUN_STATUS_COLUMNS)
            for v in views:
                con.execute(f"CREATE VIEW {_ident(v.name)} AS {v.sql}")
                _comment(con, "VIEW", v.name, v.description, v.column_docs)
            for name in [t.name for t in tables] + ["run_status"]:
                (count,) = con.execute(f"SELECT count(*) FROM {_ident(name)}").fetchone() or (0,)
                rows[name] = int(count)
            con.execute("CHECKPOINT")
        finally:
            con.close()
        os.replace(tmp, out)
    finally:
        for p in (tmp, tmp.with_name(tmp.name + ".wal")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        shutil.rmtree(spill, ignore_errors=True)
    included = sorted(partition_dir)
    excluded = {r: why for r, status, why in run_status if status != "included"}
    return BuildResult(out, rows, included, excluded, missing)


def _fill(con, t: Table, partition_dir: Mapping[str, Path], missing: dict[str, list[str]]) -> None:
    """Fill table ``t`` from its per-run files: one ``INSERT ... SELECT FROM read_parquet([files])``
    per distinct value of its ``from_runs`` columns (one in all for most tables: a statement per run
    cost 15-20 ms each), files in run_id order. The run_id of an added column is the name of the
    file's folder (``partition_dir[run_id].name == run_id``, checked)."""
    assert t.source is not None
    want = sorted(partition_dir)
    groups: dict[tuple, list[str]] = {(): want}
    if t.from_runs or t.run_filter:  # after ``runs``, the first table: the runs it holds for, their values
        cols = "".join(f", r.{_ident(c)}" for c in t.from_runs)
        where = f" WHERE {t.run_filter}" if t.run_filter else ""
        held = {r[0]: tuple(r[1:]) for r in con.execute(f"SELECT r.run_id{cols} FROM runs r{where}").fetchall()}
        groups = {}
        for run_id in want:
            if run_id in held:
                groups.setdefault(held[run_id], []).append(run_id)
    for values, run_ids in groups.items():
        files = []
        for run_id in run_ids:
            folder = Path(partition_dir[run_id])
            if folder.name != run_id:
                raise ValueError(f"partition folder {folder} of run {run_id} is not named after it")
            f = folder / t.source
            if t.optional and not f.exists():
                missing.setdefault(t.name, []).append(run_id)
                continue
            files.append(str(f))
        if not files:
            continue
        given = dict(zip(t.from_runs, values, strict=True))
        sel = ", ".join(
            f"CAST(? AS {_sql_type(t.columns[c])}) AS {_ident(c)}" if c in given else f"p.{_ident(c)}"
            for c in t.columns
        )
        prefix = "parse_filename(parse_dirpath(p.filename)) AS run_id, " if t.add_run_id else ""
        args = [given[c] for c in t.columns if c in given] + [files]
        source = "read_parquet(?, filename = true)" if t.add_run_id else "read_parquet(?)"
        con.execute(f"INSERT INTO {_ident(t.name)} SELECT {prefix}{sel} FROM {source} p", args)


def _comment(con, kind: str, name: str, text: str, columns: Mapping[str, str]) -> None:
    con.execute(f"COMMENT ON {kind} {_ident(name)} IS {_quote(text)}")
    for col, doc in columns.items():
        con.execute(f"COMMENT ON COLUMN {_ident(name)}.{_ident(col)} IS {_quote(doc)}")


def views_markdown(views: Sequence[View] = VIEWS) -> str:
    """The views as Markdown: name, what a row is, and the documented columns."""
    out = []
    for v in views:
        out.append(f"- **`{v.name}`**: {v.description}")
        for c, d in v.column_docs.items():
            out.append(f"  - `{c}`: {d}")
    return "\n".join(out) + "\n"
