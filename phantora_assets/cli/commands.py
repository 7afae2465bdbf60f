"""``phantora-assets import | runs | query | sweep``: the commands that are not the Dagster build."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from phantora_assets.checks import NOT_EVALUATED, RUN_CHECKS, read_checks, step_errors
from phantora_assets.cli.build import _build
from phantora_assets.paths import DataPaths

if TYPE_CHECKING:
    import duckdb


def cmd_import(args: argparse.Namespace) -> int:
    from phantora_assets.imported_runs import matrix_for, register
    from phantora_assets.lib.errors import FileRuleError
    from phantora_assets.lib.phantora.run_folder import RunFolder, Skipped, discover
    from phantora_assets.sources import chakra, kineto

    data_dir = Path(args.data_dir)
    found: list[RunFolder] = []
    skipped: list[Skipped] = []
    profiled = [f for f in args.folders if kineto.is_trace_folder(f) or chakra.is_et_folder(f)]
    if (args.run_id or args.world_size is not None or args.rank is not None) and len(profiled) != 1:
        print(
            "import: --run-id, --world-size and --rank name one folder of profiler traces or Chakra ETs",
            file=sys.stderr,
        )
        return 2
    for folder in profiled:
        try:
            spec = _profiled_spec(Path(folder), args)
        except FileRuleError as exc:
            print(f"import: declined {exc}", file=sys.stderr)
            return 2
        found.append(RunFolder(Path(spec.path), spec, None))
    for folder in [f for f in args.folders if f not in profiled]:
        try:
            got, missed = discover(folder)
        except FileNotFoundError as exc:
            print(f"import: {exc}", file=sys.stderr)
            return 2
        found += got
        skipped += missed
    for s in skipped:
        print(f"skipped {s.path}: {s.reason}", file=sys.stderr)
    if not found:
        print(
            "import: no run folder (traces/<gpu>/<workload>_<nodes>x<gpus>/ with timeline.json.gz) found",
            file=sys.stderr,
        )
        return 2
    registry = register(data_dir, [f.spec for f in found])
    for f in found:
        print(f"registered {f.spec.run_id:34s} <- {f.path}")
    print(f"imports registry: {registry.resolve()}")
    if args.no_build:
        return 0
    matrix = matrix_for(data_dir)
    return _build(data_dir, matrix, [f.spec.run_id for f in found], quiet=args.quiet)


def _profiled_spec(folder: Path, args: argparse.Namespace):
    """The RunSpec of a folder of profiler traces or Chakra ETs: the options, else its
    ``import.toml`` (``sources/profiled.read_sidecar``), else the defaults."""
    from phantora_assets.lib.errors import FileRuleError
    from phantora_assets.sources import chakra, kineto
    from phantora_assets.sources.profiled import read_sidecar

    opts = {k: v for k, v in (read_sidecar(folder) or {}).items()}
    for key in ("gpus_per_node", "run_id", "world_size", "rank"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    gpn, run_id, world = opts.get("gpus_per_node", 1), opts.get("run_id"), opts.get("world_size")
    if not chakra.is_et_folder(folder):
        return kineto.spec_for(folder, gpn, run_id, world, opts.get("rank"))
    if "rank" in opts:
        raise FileRuleError(
            folder, "placement", "a Chakra ET's rank is in its file name: --rank is for profiler traces"
        )
    return chakra.spec_for(folder, gpn, run_id, world)


def check_status(checks: dict[str, dict]) -> str:
    """One phrase for a run's ``checks.json`` (``read_checks``): ``all checks passed``, or the
    gating checks that ``failed`` and those ``not run`` (never evaluated: their asset did not run
    or did not apply, e.g. every check below a run that does not fit in GPU memory), then the
    advisory ``warning``s; a step that raised comes first (``error: <asset>: <type>: <file>: <rule>...``)."""
    failed = [n for n in RUN_CHECKS if checks.get(n, {}).get("status") == "failed"]
    not_run = [n for n in RUN_CHECKS if checks.get(n, {}).get("status", NOT_EVALUATED) == NOT_EVALUATED]
    other = [
        f"{n} ({checks[n]['status']})"
        for n in RUN_CHECKS
        if n in checks and checks[n]["status"] not in ("passed", "failed", NOT_EVALUATED)
    ]
    parts = []
    if failed or other:
        parts.append("failed: " + ", ".join(failed + other))
    if not_run:
        parts.append("not run: " + ", ".join(not_run))
    errors = step_errors(checks)
    if errors:
        parts.insert(0, "error: " + "; ".join(e[:300] for e in errors))
    out = "; ".join(parts) or "all checks passed"
    warned = [k for k, v in checks.items() if v["status"] == "warning"]
    if warned:
        out += " (warning: " + ", ".join(warned) + ")"
    return out


def cmd_runs(args: argparse.Namespace) -> int:
    from phantora_assets.imported_runs import matrix_for
    from phantora_assets.lib.sim.memory import estimate_memory
    from phantora_assets.lib.sim.workloads import WorkloadModel

    paths = DataPaths(Path(args.data_dir))
    print(f"{'run_id':34s} {'source':9s} {'parallelism':12s} {'memory GiB':>11s} {'fits':5s} built")
    for spec in matrix_for(paths.root):
        checks = read_checks(paths.run_folder(spec))
        built = check_status(checks) if checks else "-"
        if not spec.workload:  # a profiled run: no memory model (it ran on real GPUs)
            print(f"{spec.run_id:34s} {spec.source:9s} {spec.parallelism:12s} {'profiled':>11s} {'yes':5s} {built}")
            continue
        mem = estimate_memory(WorkloadModel(spec)).as_dict()
        fits = "yes" if mem["fits"] else "NO"
        print(
            f"{spec.run_id:34s} {spec.source:9s} {spec.parallelism:12s} "
            f"{mem['peak_gib']:5.1f}/{mem['card_gib']:<5.0f} {fits:5s} {built}"
        )
    return 0


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
        w.writerows([["" if v is None else _cell(v) for v in r] for r in rows])
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
                cur = con.execute(statements[0])
                columns, rows = ([d[0] for d in cur.description], cur.fetchall()) if cur.description else ([], [])
            finally:
                timer.cancel()
    except duckdb.InterruptException:
        print(f"error: the query ran longer than {timeout:g} s (--timeout) and was interrupted", file=sys.stderr)
        return 2
    except duckdb.Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(format_rows(columns, rows, args.format))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from phantora_assets.matrix import gpu_specs, presets
    from phantora_assets.sweep import grid, run_sweep

    if args.gpu not in gpu_specs():
        print(f"unknown GPU {args.gpu!r} (known: {', '.join(sorted(gpu_specs()))})", file=sys.stderr)
        return 2
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in presets()["workloads"]]
    if unknown:
        print(f"unknown workload(s) {unknown} (known: {', '.join(sorted(presets()['workloads']))})", file=sys.stderr)
        return 2
    try:
        bandwidths = [float(b) for b in args.bandwidths.split(",") if b.strip()]
        points = grid(
            [x for x in args.layouts.split(",") if x.strip()],
            bandwidths,
            workloads,
            args.gpu,
            uplink_bw_gbps=args.uplink_bw,
            rack_size=args.rack_size,
            nspines=args.nspines,
            ecmp=args.ecmp,
        )
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    df = run_sweep(points, jobs=args.jobs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        df.to_parquet(out, index=False)
    else:
        df.to_csv(out, index=False, float_format="%.6g", lineterminator="\n")
    if not args.quiet:
        show = df[
            [
                "workload",
                "layout",
                "host_bw_gbps",
                "status",
                "step_time_ms",
                "compute_ms",
                "exposed_comm_ms",
                "inter_node_bytes_per_step",
            ]
        ].copy()
        show["status"] = show["status"].str.slice(0, 120)
        print(show.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    print(f"\n{len(df)} points ({(df['status'] == 'ok').sum()} ok) in {time.perf_counter() - t0:.1f} s -> {out}")
    return 0
