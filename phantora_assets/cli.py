"""``phantora-assets``: build the dataset, import run folders, list runs (the Dagster graph in one process).

    phantora-assets build  [--data-dir DIR] [--run RUN_ID ...] [--no-plots]
    phantora-assets import FOLDER [FOLDER ...] [--data-dir DIR] [--no-build]
    phantora-assets runs   [--data-dir DIR]
    phantora-assets query  "SQL" [--format table|csv|json] [--data-dir DIR]

``build`` materializes every asset and check of every run (one in-process Dagster run per
partition: a CLI call per partition would cost ~16 s each), then the dataset, the DuckDB
database and the dataset plots. Runs that do not fit in GPU memory are reported as such; any
other failure makes the exit code 1.
``import`` registers every run folder found under FOLDER (``traces/<gpu>/<workload>_<N>x<G>/``)
in ``DIR/imports.toml`` and builds those runs, then the dataset. The run matrix of a data root
is ``runs.toml`` merged with its imports (``lib/run_folder.py``).
``query`` runs one SQL statement against ``<data-dir>/phantora.duckdb`` (read-only); a bad
statement prints DuckDB's message and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from phantora_assets.lib.checks_log import blocking_failures, read_checks
from phantora_assets.lib.io import sweep_temp_files
from phantora_assets.paths import DATA_DIR_ENV, DataPaths


def _instance():
    import dagster as dg

    if os.environ.get("DAGSTER_HOME"):
        return dg.DagsterInstance.get()
    return dg.DagsterInstance.ephemeral()


def cmd_build(args: argparse.Namespace) -> int:
    from phantora_assets.partitions import matrix_for

    data_dir = Path(args.data_dir)
    matrix = matrix_for(data_dir)
    unknown = set(args.run or []) - {s.run_id for s in matrix}
    if unknown:
        print(f"unknown run_id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    return _build(data_dir, matrix, args.run, quiet=args.quiet, plots=not args.no_plots)


def _build(data_dir: Path, matrix, only: list[str] | None, quiet: bool = False, plots: bool = True) -> int:
    """Materialize perf_db, the run assets of ``only`` (default: all of ``matrix``), the dataset assets.

    ``plots=False`` skips the assets that only draw (``definitions.PLOT_ASSETS``).
    """
    import dagster as dg

    from phantora_assets import definitions as d
    from phantora_assets.resources import DataRoot

    paths = DataPaths(data_dir)
    all_assets, run_assets = d.assets_for(matrix)
    perf_db = next(a for a in all_assets if a.key == d.simulation.perf_db.key)
    skip = {a.key for a in d.PLOT_ASSETS} if not plots else set()
    run_assets = [a for a in run_assets if a.key not in skip]
    by_key = {a.key: a for a in all_assets}
    dataset_assets = [by_key[a.key] for a in d.DATASET_ASSETS if a.key not in skip]
    resources = {"data": DataRoot(data_dir=str(data_dir)), "simulator": d.simulator_from_env(matrix)}
    instance = _instance()
    quiet_logs = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
    specs = [s for s in matrix if not only or s.run_id in only]
    t0 = time.perf_counter()
    stale = sweep_temp_files(data_dir)  # left by a build that was killed mid-write
    if stale and not args.quiet:
        print(f"removed {len(stale)} temporary file(s) left by an interrupted build", flush=True)
    for gpu in sorted({s.gpu for s in specs}):
        dg.materialize([perf_db], partition_key=gpu, resources=resources, instance=instance, raise_on_error=False,
                       run_config=quiet_logs)
    failures = 0
    rows = []
    for spec in specs:
        res = dg.materialize(all_assets, selection=run_assets, partition_key=spec.run_id,
                             resources=resources, instance=instance, raise_on_error=False, run_config=quiet_logs)
        checks = read_checks(paths.run_folder(spec))
        if checks.get("fits_in_memory", {}).get("status") == "failed":
            status = "out of memory: " + checks["fits_in_memory"]["message"]
        elif res.success:
            status = "ok"
            warn = checks.get("matches_workload_model", {})
            if warn.get("status") == "warning":
                status += " (warning: " + warn["message"][:200] + ")"
        else:
            failures += 1
            failed = [f"{k}: {v['message']}" for k, v in blocking_failures(paths.run_folder(spec)).items()
                      if v["status"] == "failed"]
            errors = [str(e.event_specific_data.error.message).strip().splitlines()[0]
                      for e in res.all_events if e.is_step_failure and e.event_specific_data and
                      getattr(e.event_specific_data, "error", None)]
            status = "FAILED: " + "; ".join(errors + failed)[:300]
        rows.append((spec.run_id, status))
        if not quiet:
            print(f"{spec.run_id:34s} {spec.source:8s} {status}", flush=True)
    for asset in dataset_assets:
        res = dg.materialize(all_assets, selection=[asset], resources=resources, instance=instance,
                             raise_on_error=False, run_config=quiet_logs)
        if not res.success:
            failures += 1
            print(f"{asset.key.to_user_string()}: FAILED (see its checks)", file=sys.stderr)
            break
    elapsed = time.perf_counter() - t0
    print(f"\nbuilt {len(specs)} runs in {elapsed:.1f} s: "
          f"{sum(r[1].startswith('ok') for r in rows)} ok, "
          f"{sum(r[1].startswith('out of memory') for r in rows)} not fitting, "
          f"{sum(r[1].startswith('FAILED') for r in rows)} failed")
    print(f"dataset:     {paths.dataset_dir.resolve()}")
    print(f"database:    {paths.duckdb_path.resolve()}  (phantora-assets query \"SQL\")")
    print(f"run folders: {(paths.root / 'traces').resolve()}")
    return 1 if failures else 0


def cmd_import(args: argparse.Namespace) -> int:
    from phantora_assets.lib.run_folder import discover, register
    from phantora_assets.partitions import matrix_for

    data_dir = Path(args.data_dir)
    found, skipped = [], []
    for folder in args.folders:
        try:
            f, s = discover(folder)
        except FileNotFoundError as exc:
            print(f"import: {exc}", file=sys.stderr)
            return 2
        found += f
        skipped += s
    for s in skipped:
        print(f"skipped {s.path}: {s.reason}", file=sys.stderr)
    if not found:
        print("import: no run folder (traces/<gpu>/<workload>_<nodes>x<gpus>/ with timeline.json.gz) found",
              file=sys.stderr)
        return 2
    registry = register(data_dir, [f.spec for f in found])
    for f in found:
        print(f"registered {f.spec.run_id:34s} <- {f.path}")
    print(f"imports registry: {registry.resolve()}")
    if args.no_build:
        return 0
    matrix = matrix_for(data_dir)
    return _build(data_dir, matrix, [f.spec.run_id for f in found], quiet=args.quiet)


def cmd_runs(args: argparse.Namespace) -> int:
    from phantora_assets.lib.memory import estimate_memory
    from phantora_assets.lib.run_folder import effective_matrix
    from phantora_assets.lib.workloads import WorkloadModel

    paths = DataPaths(Path(args.data_dir))
    print(f"{'run_id':34s} {'source':9s} {'parallelism':12s} {'memory GiB':>11s} {'fits':5s} built")
    for spec in effective_matrix(paths.root):
        mem = estimate_memory(WorkloadModel(spec)).as_dict()
        checks = read_checks(paths.run_folder(spec))
        if not checks:
            built = "-"
        else:
            bad = list(blocking_failures(paths.run_folder(spec)))
            warned = [k for k, v in checks.items() if v["status"] == "warning"]
            built = "all checks passed" if not bad else "not passed: " + ", ".join(bad)
            if warned:
                built += " (warning: " + ", ".join(warned) + ")"
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
    i = sub.add_parser("import", help="register run folders of a Phantora dataset and build them")
    i.add_argument("folders", nargs="+", metavar="FOLDER",
                   help="a dataset root, its traces/ folder, a GPU folder or a run folder")
    i.add_argument("--data-dir", default=default_dir, help="data root (default: $PHANTORA_ASSETS_DATA_DIR or ./data)")
    i.add_argument("--no-build", action="store_true", help="only register the folders in DIR/imports.toml")
    i.add_argument("--quiet", action="store_true", help="print only the summary")
    i.set_defaults(func=cmd_import)
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
