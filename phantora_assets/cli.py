"""``phantora-assets``: build the dataset, list runs (the Dagster graph in one process).

    phantora-assets build [--data-dir DIR] [--run RUN_ID ...] [--no-plots]
    phantora-assets runs  [--data-dir DIR]
    phantora-assets query "SQL" [--format table|csv|json] [--data-dir DIR]

``build`` materializes every asset and check of every run (one in-process Dagster run per
partition: a CLI call per partition would cost ~16 s each), then the dataset, the DuckDB
database and the dataset plots. Runs that do not fit in GPU memory are reported as such; any
other failure makes the exit code 1. ``query`` runs one SQL statement against
``<data-dir>/phantora.duckdb`` (read-only); a bad statement prints DuckDB's message and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from phantora_assets.lib.checks_log import read_checks
from phantora_assets.paths import DATA_DIR_ENV, DataPaths


def _instance():
    import dagster as dg

    if os.environ.get("DAGSTER_HOME"):
        return dg.DagsterInstance.get()
    return dg.DagsterInstance.ephemeral()


def cmd_build(args: argparse.Namespace) -> int:
    import dagster as dg

    from phantora_assets import definitions as d
    from phantora_assets.assets.simulation import perf_db
    from phantora_assets.partitions import RUN_MATRIX
    from phantora_assets.resources import AnalyticSimulatorResource, DataRoot

    data_dir = Path(args.data_dir)
    paths = DataPaths(data_dir)
    resources = {"data": DataRoot(data_dir=str(data_dir)), "simulator": AnalyticSimulatorResource()}
    instance = _instance()
    quiet_logs = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
    run_assets = [a for a in d.RUN_ASSETS if not (args.no_plots and a in d.PLOT_ASSETS)]
    specs = [s for s in RUN_MATRIX if not args.run or s.run_id in args.run]
    unknown = set(args.run or []) - {s.run_id for s in RUN_MATRIX}
    if unknown:
        print(f"unknown run_id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    for gpu in sorted({s.gpu for s in specs}):
        dg.materialize([perf_db], partition_key=gpu, resources=resources, instance=instance, raise_on_error=False, run_config=quiet_logs)
    failures = 0
    rows = []
    for spec in specs:
        res = dg.materialize(d.ALL_ASSETS, selection=run_assets, partition_key=spec.run_id,
                             resources=resources, instance=instance, raise_on_error=False, run_config=quiet_logs)
        checks = read_checks(paths.run_folder(spec))
        if checks.get("fits_in_memory", {}).get("status") == "failed":
            status = "out of memory: " + checks["fits_in_memory"]["message"]
        elif res.success:
            status = "ok"
        else:
            failures += 1
            failed = [f"{k}: {v['message']}" for k, v in checks.items() if v["status"] != "passed"]
            errors = [str(e.event_specific_data.error.message).strip().splitlines()[0]
                      for e in res.all_events if e.is_step_failure and e.event_specific_data and
                      getattr(e.event_specific_data, "error", None)]
            status = "FAILED: " + "; ".join(errors + failed)[:300]
        rows.append((spec.run_id, status))
        if not args.quiet:
            print(f"{spec.run_id:34s} {status}", flush=True)
    for asset in d.DATASET_ASSETS:
        if args.no_plots and asset in d.PLOT_ASSETS:
            continue
        res = dg.materialize(d.ALL_ASSETS, selection=[asset], resources=resources, instance=instance,
                             raise_on_error=False, run_config=quiet_logs)
        if not res.success:
            failures += 1
            print(f"{asset.key.to_user_string()}: FAILED (see its checks)", file=sys.stderr)
            break
    elapsed = time.perf_counter() - t0
    print(f"\nbuilt {len(specs)} runs in {elapsed:.1f} s: "
          f"{sum(r[1] == 'ok' for r in rows)} ok, {sum(r[1].startswith('out of memory') for r in rows)} not fitting, "
          f"{sum(r[1].startswith('FAILED') for r in rows)} failed")
    print(f"dataset:     {paths.dataset_dir.resolve()}")
    print(f"database:    {paths.duckdb_path.resolve()}  (phantora-assets query \"SQL\")")
    print(f"run folders: {(paths.root / 'traces').resolve()}")
    return 1 if failures else 0


def cmd_runs(args: argparse.Namespace) -> int:
    from phantora_assets.lib.memory import estimate_memory
    from phantora_assets.lib.workloads import WorkloadModel
    from phantora_assets.runs import load_run_matrix

    paths = DataPaths(Path(args.data_dir))
    print(f"{'run_id':34s} {'source':9s} {'parallelism':12s} {'memory GiB':>11s} {'fits':5s} built")
    for spec in load_run_matrix():
        mem = estimate_memory(WorkloadModel(spec)).as_dict()
        checks = read_checks(paths.run_folder(spec))
        if not checks:
            built = "-"
        else:
            bad = [k for k, v in checks.items() if v["status"] != "passed"]
            built = "all checks passed" if not bad else "not passed: " + ", ".join(bad)
        fits = "yes" if mem["fits"] else "NO"
        print(f"{spec.run_id:34s} {spec.source:9s} {spec.parallelism:12s} "
              f"{mem['peak_gib']:5.1f}/{mem['card_gib']:<5.0f} {fits:5s} {built}")
    return 0


def _cell(v) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, float):
        return f"{v:.10g}"
    return str(v)


def _jsonable(v):
    import math
    from datetime import date, datetime, time as dtime
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
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) and rows != []
               for i in range(len(columns))]

    def line(vals):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    out = [line(columns), "  ".join("-" * w for w in widths)] + [line(r) for r in cells]
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out) + "\n"


def cmd_query(args: argparse.Namespace) -> int:
    import duckdb

    db = DataPaths(Path(args.data_dir)).duckdb_path
    if not db.exists():
        print(f"error: no database at {db}: run `phantora-assets build` (or materialize dataset_duckdb) first",
              file=sys.stderr)
        return 2
    try:
        with duckdb.connect(str(db), read_only=True) as con:
            cur = con.execute(args.sql)
            columns = [d[0] for d in cur.description] if cur.description else []
            rows = cur.fetchall() if columns else []
    except duckdb.Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(format_rows(columns, rows, args.format))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phantora-assets", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    default_dir = os.environ.get(DATA_DIR_ENV, "data")
    b = sub.add_parser("build", help="materialize every asset and check of every run, then the dataset")
    b.add_argument("--data-dir", default=default_dir, help="data root (default: $PHANTORA_ASSETS_DATA_DIR or ./data)")
    b.add_argument("--run", action="append", help="only this run_id (repeatable)")
    b.add_argument("--quiet", action="store_true", help="print only the summary")
    b.add_argument("--no-plots", action="store_true", help="skip the plot assets (run_plots, dataset_plots)")
    b.set_defaults(func=cmd_build)
    r = sub.add_parser("runs", help="list the run matrix with memory verdicts and check status")
    r.add_argument("--data-dir", default=default_dir)
    r.set_defaults(func=cmd_runs)
    q = sub.add_parser("query", help="run one SQL statement against the DuckDB database and print the result")
    q.add_argument("sql", help='e.g. "select run_id, sum(bytes) from flows_100ms group by 1"')
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.add_argument("--data-dir", default=default_dir)
    q.set_defaults(func=cmd_query)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
