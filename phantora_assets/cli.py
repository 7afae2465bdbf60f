"""``phantora-assets``: build the dataset, import run folders, list runs (the Dagster graph in one process).

    phantora-assets build  [--data-dir DIR] [--run RUN_ID ...] [--no-plots] [--jobs N]
    phantora-assets import FOLDER [FOLDER ...] [--data-dir DIR] [--no-build]
    phantora-assets runs   [--data-dir DIR]
    phantora-assets query  "SQL" [--format table|csv|json] [--data-dir DIR]
    phantora-assets sweep  [--layouts 2x8,4x8,16x8] [--bandwidths 100,200,400,800] [--workloads W1,W4]
                           [--gpu h100] [--out sweep.csv]

``build`` materializes every asset and check of every run (one in-process Dagster run per
partition, split over ``--jobs N`` worker processes: a CLI call per partition would cost ~16 s
each), then the dataset, the DuckDB
database and the dataset plots. Runs that do not fit in GPU memory are reported as such; any
other failure makes the exit code 1.
``import`` registers every run folder found under FOLDER (``traces/<gpu>/<workload>_<N>x<G>/``)
in ``DIR/imports.toml`` and builds those runs, then the dataset. The run matrix of a data root
is ``runs.toml`` merged with its imports (``imported_runs.matrix_for``).
``query`` runs one SQL statement against ``<data-dir>/phantora.duckdb`` (read-only); a bad
statement prints DuckDB's message and exits 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from phantora_assets.checks import blocking_failures, read_checks
from phantora_assets.lib.store.io import sweep_temp_files
from phantora_assets.paths import DATA_DIR_ENV, DataPaths


def _instance():
    import dagster as dg

    if os.environ.get("DAGSTER_HOME"):
        return dg.DagsterInstance.get()
    return dg.DagsterInstance.ephemeral()


QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def _build_defs(data_dir: str, matrix, plots: bool = True):
    """Definitions bound to ``data_dir`` and ``matrix``, with the build's jobs resolved once
    (resolving the asset graph for every partition, as ``dagster.materialize`` does, costs ~0.3 s
    a call): ``build_perf_dbs``, ``build_runs`` (per-run assets) and ``build_dataset`` (the dataset
    assets in one run; Dagster skips the ones below a failed asset or blocking check)."""
    import dagster as dg

    from phantora_assets import assets as a
    from phantora_assets.assets.common import Partitions
    from phantora_assets.resources import DataRoot, simulator_from_env

    assets = a.build_assets(Partitions.of(matrix))
    skip = set(a.PLOT_ASSET_NAMES) if not plots else set()
    run_keys = [assets[n].key for n in a.RUN_ASSET_NAMES if n not in skip]
    dataset_keys = [assets[n].key for n in a.DATASET_ASSET_NAMES if n not in skip]
    jobs = [
        dg.define_asset_job("build_runs", selection=dg.AssetSelection.assets(*run_keys)),
        dg.define_asset_job("build_perf_dbs", selection=dg.AssetSelection.assets(assets["perf_db"].key)),
        dg.define_asset_job("build_dataset", selection=dg.AssetSelection.assets(*dataset_keys)),
    ]
    resources = {"data": DataRoot(data_dir=data_dir), "simulator": simulator_from_env(matrix)}
    return dg.Definitions(assets=list(assets.values()), jobs=jobs, resources=resources)


def _run_partition(job, instance, run_id: str) -> tuple[str, bool, list[str]]:
    """Materialize every asset and check of ``job`` for one run partition: (run_id, success, step errors)."""
    res = job.execute_in_process(partition_key=run_id, instance=instance, raise_on_error=False, run_config=QUIET_LOGS)
    errors = [
        f"{e.step_key}: {_user_error(e.event_specific_data.error)}"
        for e in res.all_events
        if e.is_step_failure and e.event_specific_data and getattr(e.event_specific_data, "error", None)
    ]
    return run_id, res.success, errors


def _user_error(err) -> str:
    """The first line of the outermost error that is not Dagster's wrapper (e.g. ``TraceFormatError:
    <file>: <rule>: ...``): the file and rule the user needs, not "Error occurred while executing op"."""
    while str(getattr(err, "cls_name", "")).startswith("Dagster") and getattr(err, "cause", None) is not None:
        err = err.cause
    lines = str(err.message).strip().splitlines()
    return lines[0] if lines else str(err.cls_name)


#: What a forked build worker inherits from the parent: the resolved run job (set just before the
#: pool forks; resolving it again per worker would redo the work) and its own instance (made lazily).
_WORKER: dict = {}


def _warm_imports() -> None:
    """Import, before the workers fork, what every run imports lazily (plots, Parquet, inflate)."""
    import matplotlib.backends.backend_agg
    import matplotlib.figure
    import matplotlib.lines
    import matplotlib.patches
    import matplotlib.ticker  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    from phantora_assets.lib.phantora import trace_decode  # noqa: F401


def _worker_run(run_id: str) -> tuple[str, bool, list[str]]:
    import dagster as dg

    if "instance" not in _WORKER:
        _WORKER["instance"] = dg.DagsterInstance.ephemeral()
    return _run_partition(_WORKER["job"], _WORKER["instance"], run_id)


def _cost_order(specs) -> list[str]:
    """Run ids, largest world size first, so that a pool handing out one run at a time ends with
    short runs on every worker (the cost of a run grows with its number of ranks)."""
    return [s.run_id for s in sorted(specs, key=lambda s: -s.n_nodes * s.gpus_per_node)]


def cmd_build(args: argparse.Namespace) -> int:
    from phantora_assets.imported_runs import matrix_for

    data_dir = Path(args.data_dir)
    matrix = matrix_for(data_dir)
    unknown = set(args.run or []) - {s.run_id for s in matrix}
    if unknown:
        print(f"unknown run_id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    return _build(data_dir, matrix, args.run, quiet=args.quiet, plots=not args.no_plots, jobs=args.jobs)


def _build(
    data_dir: Path, matrix, only: list[str] | None, quiet: bool = False, plots: bool = True, jobs: int = 1
) -> int:
    """Materialize perf_db, the run assets of ``only`` (default: all of ``matrix``), the dataset assets.

    ``plots=False`` skips the assets that only draw (``definitions.PLOT_ASSETS``). Partitions are
    independent (own files, own run folder): with ``jobs > 1`` they are handed out one at a time,
    largest first, to forked worker processes, each with its own ephemeral Dagster instance (a
    DAGSTER_HOME instance is only used by a sequential build).
    """
    paths = DataPaths(data_dir)
    specs = [s for s in matrix if not only or s.run_id in only]
    t0 = time.perf_counter()
    stale = sweep_temp_files(data_dir)  # left by a build that was killed mid-write
    if stale and not quiet:
        print(f"removed {len(stale)} temporary file(s) left by an interrupted build", flush=True)
    defs = _build_defs(str(data_dir), matrix, plots)
    instance = _instance()
    perf_db_job = defs.resolve_job_def("build_perf_dbs")
    for gpu in sorted({s.gpu for s in specs}):
        perf_db_job.execute_in_process(
            partition_key=gpu, instance=instance, raise_on_error=False, run_config=QUIET_LOGS
        )
    jobs = max(1, min(jobs, len(specs)))
    use_home = bool(os.environ.get("DAGSTER_HOME"))
    run_job = defs.resolve_job_def("build_runs")
    if jobs > 1 and not use_home:
        import gc
        import multiprocessing as mp

        _warm_imports()
        _WORKER.clear()
        _WORKER["job"] = run_job
        # the forked workers share the parent's objects: frozen, their collections skip them
        # (and do not copy their pages), a few % of a build
        gc.freeze()
        try:
            with mp.get_context("fork").Pool(jobs) as pool:
                done = {r[0]: r for r in pool.imap_unordered(_worker_run, _cost_order(specs), chunksize=1)}
                pool.close()
                pool.join()  # let the workers exit normally before the pool is torn down
        finally:
            gc.unfreeze()
            _WORKER.clear()
        results = [done[s.run_id] for s in specs]
    else:
        results = [_run_partition(run_job, instance, s.run_id) for s in specs]
    failures = 0
    rows = []
    for (_run_id, success, errors), spec in zip(results, specs):
        checks = read_checks(paths.run_folder(spec))
        if checks.get("fits_in_memory", {}).get("status") == "failed":
            status = "out of memory: " + checks["fits_in_memory"]["message"]
        elif success:
            status = "ok"
            warn = checks.get("matches_workload_model", {})
            if warn.get("status") == "warning":
                status += " (warning: " + warn["message"][:200] + ")"
        else:
            failures += 1
            failed = [
                f"{k}: {v['message']}"
                for k, v in blocking_failures(paths.run_folder(spec)).items()
                if v["status"] == "failed"
            ]
            status = "FAILED: " + "; ".join(errors + failed)[:300]
        rows.append((spec.run_id, status))
        if not quiet:
            print(f"{spec.run_id:34s} {spec.source:8s} {status}", flush=True)
    res = defs.resolve_job_def("build_dataset").execute_in_process(
        instance=instance, raise_on_error=False, run_config=QUIET_LOGS
    )
    if not res.success:
        failures += 1
        failed = sorted({e.step_key for e in res.all_events if e.is_step_failure})
        print(f"dataset: FAILED at {', '.join(failed) or 'a blocking check'} (see its checks)", file=sys.stderr)
    elapsed = time.perf_counter() - t0
    print(
        f"\nbuilt {len(specs)} runs in {elapsed:.1f} s ({jobs} worker{'s' if jobs > 1 else ''}): "
        f"{sum(r[1].startswith('ok') for r in rows)} ok, "
        f"{sum(r[1].startswith('out of memory') for r in rows)} not fitting, "
        f"{sum(r[1].startswith('FAILED') for r in rows)} failed"
    )
    print(f"dataset:     {paths.dataset_dir.resolve()}")
    print(f'database:    {paths.duckdb_path.resolve()}  (phantora-assets query "SQL")')
    print(f"run folders: {(paths.root / 'traces').resolve()}")
    return 1 if failures else 0


def cmd_import(args: argparse.Namespace) -> int:
    from phantora_assets.imported_runs import matrix_for, register
    from phantora_assets.lib.phantora.run_folder import RunFolder, Skipped, discover

    data_dir = Path(args.data_dir)
    found: list[RunFolder] = []
    skipped: list[Skipped] = []
    for folder in args.folders:
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


def cmd_runs(args: argparse.Namespace) -> int:
    from phantora_assets.imported_runs import matrix_for
    from phantora_assets.lib.sim.memory import estimate_memory
    from phantora_assets.lib.sim.workloads import WorkloadModel

    paths = DataPaths(Path(args.data_dir))
    print(f"{'run_id':34s} {'source':9s} {'parallelism':12s} {'memory GiB':>11s} {'fits':5s} built")
    for spec in matrix_for(paths.root):
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


def cmd_query(args: argparse.Namespace) -> int:
    import duckdb

    db = DataPaths(Path(args.data_dir)).duckdb_path
    if not db.exists():
        print(
            f"error: no database at {db}: run `phantora-assets build` (or materialize dataset_duckdb) first",
            file=sys.stderr,
        )
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phantora-assets", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    default_dir = os.environ.get(DATA_DIR_ENV, "data")
    b = sub.add_parser("build", help="materialize every asset and check of every run, then the dataset")
    b.add_argument("--data-dir", default=default_dir, help="data root (default: $PHANTORA_ASSETS_DATA_DIR or ./data)")
    b.add_argument("--run", action="append", help="only this run_id (repeatable)")
    b.add_argument("--quiet", action="store_true", help="print only the summary")
    b.add_argument("--no-plots", action="store_true", help="skip the plot assets (run_plots, dataset_plots)")
    b.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="worker processes for the runs (default: min(2, CPUs)); 1 = sequential",
    )
    b.set_defaults(func=cmd_build)
    w = sub.add_parser(
        "sweep",
        help="what-if grid (layouts x host bandwidths x workloads) with the analytic "
        "simulator, one table row per point (no Dagster)",
    )
    w.add_argument("--layouts", default="2x8,4x8,16x8", help="comma-separated <nodes>x<gpus_per_node>")
    w.add_argument("--bandwidths", default="100,200,400,800", help="host link bandwidths, Gbps")
    w.add_argument("--workloads", default="W1,W4", help="comma-separated W1..W5")
    w.add_argument("--gpu", default="h100", help="a key of gpus.toml")
    w.add_argument(
        "--uplink-bw",
        type=float,
        default=None,
        help="spine-uplink port bandwidth, Gbps (default: the host bandwidth of the point)",
    )
    w.add_argument("--rack-size", type=int, default=None, help="hosts per rack (default: presets.toml)")
    w.add_argument("--nspines", type=int, default=None, help="spines (default: presets.toml)")
    w.add_argument("--ecmp", choices=["hash", "split", "first"], default=None, help="spine choice (lib/sim/network.py)")
    w.add_argument("--out", default="sweep.csv", help="output table (.csv or .parquet)")
    w.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    w.add_argument("--quiet", action="store_true", help="print only the summary line")
    w.set_defaults(func=cmd_sweep)
    i = sub.add_parser("import", help="register run folders of a Phantora dataset and build them")
    i.add_argument(
        "folders", nargs="+", metavar="FOLDER", help="a dataset root, its traces/ folder, a GPU folder or a run folder"
    )
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
    """Entry point. An invalid run matrix (or another input error of ours) prints its message
    (naming the file, entry and rule) and exits 2, without a traceback."""
    from phantora_assets.lib.errors import RunMatrixError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RunMatrixError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
