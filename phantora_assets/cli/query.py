"""``phantora-assets query``: one read-only SQL statement against the dataset's DuckDB database, in a
sandbox (:func:`sandboxed_connection`), its result printed as a table, CSV or JSON (:func:`format_rows`)."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from phantora_assets.paths import DataPaths

if TYPE_CHECKING:
    import duckdb


def _cell(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.10g}"
    return str(v)


def _jsonable(v):
    import math
    from datetime import date, datetime
    from datetime import time as dtime
    from decimal import Decimal

    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, Decimal):
        return float(v)
    if isinstance(v, (datetime, date, dtime)):
        return v.isoformat()
    if isinstance(v, (bytes, bytearray)):
        return v.hex()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def _csv_cells(rows: list[tuple]) -> list[list[str]]:
    return [["" if v is None else _cell(v) for v in r] for r in rows]


#: The most a table or JSON result may hold, estimated as its rows are fetched (:func:`_size`); a larger one
#: is refused (exit 2) before anything is printed. A CSV result is streamed batch by batch: no limit.
QUERY_RESULT_BYTES = 256 << 20
_BATCH_ROWS = 10_000


def _size(v) -> int:
    """About the bytes ``v`` takes once fetched and formatted: 16 a value, plus a string's or blob's length."""
    if isinstance(v, (str, bytes, bytearray)):
        return 16 + len(v)
    if isinstance(v, (list, tuple)):
        return 16 + sum(_size(x) for x in v)
    if isinstance(v, dict):
        return 16 + sum(_size(k) + _size(x) for k, x in v.items())
    return 16


def _print_result(cur: duckdb.DuckDBPyConnection, fmt: str) -> str | None:
    """Fetch the result of the query run on ``cur`` in batches and print it in ``fmt``; why it was not
    printed (None: it was). CSV is written as it comes; a table or JSON is held until the end (its
    widths need every row), up to :data:`QUERY_RESULT_BYTES`. Was: every row fetched at once, then
    formatted (30 M rows: 111 s and 8.6 GiB RSS under the sandbox's 1 GB memory_limit)."""
    import csv

    columns = [d[0] for d in cur.description] if cur.description else []
    if fmt == "csv":
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(columns)
        while columns and (batch := cur.fetchmany(_BATCH_ROWS)):
            w.writerows(_csv_cells(batch))
        return None
    rows: list[tuple] = []
    size = 0
    while columns and (batch := cur.fetchmany(_BATCH_ROWS)):
        rows += batch
        size += sum(48 + _size(r) for r in batch)
        if size > QUERY_RESULT_BYTES:
            return (
                f"the result is larger than {QUERY_RESULT_BYTES >> 20} MiB ({len(rows):,} rows so far): "
                "aggregate, add a LIMIT, or use --format csv (streamed)"
            )
    sys.stdout.write(format_rows(columns, rows, fmt))
    return None


def format_rows(columns: list[str], rows: list[tuple], fmt: str) -> str:
    """Rows as an aligned text table, CSV (header + rows) or JSON (a list of objects)."""
    import csv
    import io
    import json

    if fmt == "json":
        return json.dumps([{c: _jsonable(v) for c, v in zip(columns, r)} for r in rows], indent=1) + "\n"
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(columns)
        w.writerows(_csv_cells(rows))
        return buf.getvalue()
    cells = [[_cell(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [
        all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) and rows != [] for i in range(len(columns))
    ]

    def line(vals):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    out = [line(columns), "  ".join("-" * w for w in widths)] + [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out) + "\n"


# The DuckDB settings of `phantora-assets query` (names as listed by `duckdb_settings()` in duckdb 2.0.1; DuckDB's
# "Securing DuckDB" page): given when the connection opens ...
QUERY_SANDBOX: dict[str, str | bool] = {
    "autoinstall_known_extensions": False,  # no download of an extension a query names
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "allow_unsigned_extensions": False,
    "allow_persistent_secrets": False,  # no secret written to ~/.duckdb
    "python_enable_replacements": False,  # no scan of a Python variable named in the query
    "temp_directory": "",  # no spill files: a query that does not fit in the memory_limit fails instead
    "memory_limit": "1GB",
}
# ... and set once the database is attached: no file or URL but the database (COPY, ATTACH, read_*(), glob(),
# INSTALL fail), then the configuration is locked, so no statement can SET or RESET any of it back.
QUERY_LOCK = ("SET enable_external_access = false", "SET lock_configuration = true")


def sandboxed_connection(db: Path) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection that reads ``db`` and nothing else: :data:`QUERY_SANDBOX`, then :data:`QUERY_LOCK`.

    An in-memory DuckDB that ATTACHes the file ``READ_ONLY`` (as the default database ``phantora``), not
    ``duckdb.connect(db, config=...)``: DuckDB's Python client keeps one instance per file and process, and a
    second connection with other settings fails while any connection to the file is open in the process.
    """
    import duckdb

    con = duckdb.connect(":memory:", config=dict(QUERY_SANDBOX))
    try:
        con.execute("ATTACH '" + str(db).replace("'", "''") + "' AS phantora (READ_ONLY)")
        con.execute("USE phantora")
        for statement in QUERY_LOCK:
            con.execute(statement)
    except BaseException:
        con.close()
        raise
    return con


# PRAGMAs that only read (each has a `pragma_<name>()` or `duckdb_*()` table function twin).
QUERY_PRAGMAS = frozenset(
    {
        "collations",
        "database_list",
        "database_size",
        "functions",
        "metadata_info",
        "platform",
        "show",
        "show_databases",
        "show_tables",
        "show_tables_expanded",
        "storage_info",
        "table_info",
        "user_agent",
        "version",
    }
)
QUERY_STATEMENTS = "SELECT / WITH / VALUES / FROM / TABLE / DESCRIBE / SHOW / SUMMARIZE / PIVOT / EXPLAIN / PRAGMA"


def _words(sql: str) -> list[tuple[int, str, bool]]:
    """``(offset, text, is_operator)`` of each token of ``sql`` but comments (DuckDB's own tokenizer)."""
    import duckdb

    tokens = duckdb.tokenize(sql)
    out = []
    for i, (offset, kind) in enumerate(tokens):
        end = tokens[i + 1][0] if i + 1 < len(tokens) else len(sql)
        if kind != duckdb.token_type.comment:
            out.append((offset, sql[offset:end].strip(), kind == duckdb.token_type.operator))
    return out


def _explained(sql: str, words: list[tuple[int, str, bool]]) -> str:
    """The statement an ``EXPLAIN [ANALYZE] [(options)] <statement>`` explains."""
    i = 1
    if i < len(words) and words[i][1].lower() in ("analyze", "analyse"):
        i += 1
    if i < len(words) and words[i][2] and words[i][1].startswith("("):
        depth = 0
        while i < len(words):
            if words[i][2]:
                depth += words[i][1].count("(") - words[i][1].count(")")
            i += 1
            if depth <= 0:
                break
    return sql[words[i][0] :] if i < len(words) else ""


def _not_a_query(con: duckdb.DuckDBPyConnection, statement: duckdb.Statement) -> str | None:
    """Why ``statement`` is not a read-only query (None: it is one)."""
    kind = statement.type.name
    words = _words(statement.query)
    first = words[0][1].upper() if words else ""
    if kind == "SELECT":  # also WITH, VALUES, FROM, DESCRIBE, SHOW, SUMMARIZE, UNPIVOT, PIVOT ... IN (...)
        return None
    if kind == "MULTI":  # [EXPLAIN] PIVOT without IN: a temporary ENUM of the values, then the query
        head = _words(_explained(statement.query, words))[:1] if first == "EXPLAIN" else words[:1]
        if head and head[0][1].upper() in ("PIVOT", "PIVOT_WIDER"):
            return None
    if kind == "PRAGMA" and first == "PRAGMA" and len(words) > 1:
        name = words[1][1].lower()
        if name in QUERY_PRAGMAS:
            return None
        return f"PRAGMA {name} (the PRAGMAs that only read: {', '.join(sorted(QUERY_PRAGMAS))})"
    if kind == "EXPLAIN":
        inner = con.extract_statements(_explained(statement.query, words))
        if len(inner) != 1:
            return "EXPLAIN of no statement or of several"
        why = _not_a_query(con, inner[0])
        return None if why is None else f"EXPLAIN of a {why}"
    return f"{kind} statement" + (f" ({first} ...)" if first and first != kind else "")


def cmd_query(args: argparse.Namespace) -> int:
    """Run exactly one read-only query (:data:`QUERY_STATEMENTS`) on a :func:`sandboxed_connection`."""
    import duckdb

    db = DataPaths(Path(args.data_dir)).duckdb_path
    timeout = float(getattr(args, "timeout", 600.0))
    if not db.exists():
        hint = "run `phantora-assets build` (or materialize dataset_duckdb) first"
        print(f"error: no database at {db}: {hint}", file=sys.stderr)
        return 2
    try:
        with sandboxed_connection(db) as con:
            statements = con.extract_statements(args.sql)
            if len(statements) != 1:
                given = "no SQL statement" if not statements else f"{len(statements)} SQL statements"
                print(f"error: {given} given: `phantora-assets query` runs exactly one", file=sys.stderr)
                return 2
            why = _not_a_query(con, statements[0])
            if why is not None:
                runs = f"`phantora-assets query` runs one read-only query ({QUERY_STATEMENTS})"
                print(f"error: refused: {why}: {runs}", file=sys.stderr)
                return 2
            timer = threading.Timer(timeout, con.interrupt)  # a cross join of two ranges never ended
            timer.start()
            try:
                why = _print_result(con.execute(statements[0]), args.format)
            finally:
                timer.cancel()
    except duckdb.InterruptException:
        print(f"error: the query ran longer than {timeout:g} s (--timeout) and was interrupted", file=sys.stderr)
        return 2
    except duckdb.Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    return 0
