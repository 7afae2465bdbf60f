"""``phantora-assets build``: the in-process Dagster build (one run per partition, forked workers)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from phantora_assets.checks import blocking_failures, read_checks
from phantora_assets.lib.store.io import sweep_temp_files
from phantora_assets.paths import DataPaths


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
