"""``phantora-assets``: build the dataset, list runs (the Dagster graph in one process).

    phantora-assets build [--data-dir DIR] [--run RUN_ID ...] [--jobs N]
    phantora-assets sweep [--layouts 2x8,4x8,16x8] [--bandwidths 100,200,400,800] [--workloads W1,W4]
                          [--gpu h100] [--out sweep.csv]
    phantora-assets runs  [--data-dir DIR]

``build`` materializes every asset and check of every run (one in-process Dagster run per
partition: a CLI call per partition would cost ~16 s each; ``--jobs N`` splits the partitions
over N worker processes), then the dataset. Runs that do
not fit in GPU memory are reported as such; any other failure makes the exit code 1.
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


QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def _run_defs(data_dir: str):
    """Definitions bound to ``data_dir`` and the per-run job resolved once (resolving the asset
    graph for every partition, as ``dagster.materialize`` does, costs ~0.3 s a call)."""
    import dagster as dg

    from phantora_assets import definitions as d
    from phantora_assets.resources import AnalyticSimulatorResource, DataRoot

    from phantora_assets.assets.simulation import perf_db
    from phantora_assets.partitions import gpu_partitions

    resources = {"data": DataRoot(data_dir=data_dir), "simulator": AnalyticSimulatorResource()}
    perf_db_job = dg.define_asset_job("perf_dbs", selection=[perf_db], partitions_def=gpu_partitions)
    defs = dg.Definitions(assets=d.ALL_ASSETS, jobs=[d.all_runs_job, d.dataset_job, perf_db_job], resources=resources)
    return defs, defs.resolve_job_def(d.all_runs_job.name), resources


def _build_runs(data_dir: str, run_ids: list[str], use_home: bool) -> list[tuple[str, bool, list[str]]]:
    """Materialize every per-run asset and check of ``run_ids`` (one in-process Dagster run per
    partition, one instance for all). Returns (run_id, success, step errors) per run."""
    import dagster as dg

    _, job, _ = _run_defs(data_dir)
    instance = _instance() if use_home else dg.DagsterInstance.ephemeral()
    out = []
    for run_id in run_ids:
        res = job.execute_in_process(partition_key=run_id, instance=instance, raise_on_error=False,
                                     run_config=QUIET_LOGS)
        errors = [str(e.event_specific_data.error.message).strip().splitlines()[0]
                  for e in res.all_events if e.is_step_failure and e.event_specific_data and
                  getattr(e.event_specific_data, "error", None)]
        out.append((run_id, res.success, errors))
    return out


def _build_runs_worker(job: tuple[str, list[str]]) -> list[tuple[str, bool, list[str]]]:
    return _build_runs(job[0], job[1], use_home=False)


def cmd_build(args: argparse.Namespace) -> int:
    from phantora_assets import definitions as d
    from phantora_assets.partitions import RUN_MATRIX

    data_dir = Path(args.data_dir)
    paths = DataPaths(data_dir)
    specs = [s for s in RUN_MATRIX if not args.run or s.run_id in args.run]
    unknown = set(args.run or []) - {s.run_id for s in RUN_MATRIX}
    if unknown:
        print(f"unknown run_id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    defs, _, resources = _run_defs(str(data_dir))
    instance = _instance()
    perf_db_job = defs.resolve_job_def("perf_dbs")
    for gpu in sorted({s.gpu for s in specs}):
        perf_db_job.execute_in_process(partition_key=gpu, instance=instance, raise_on_error=False, run_config=QUIET_LOGS)
    # Partitions are independent (own files, own run folder): with --jobs N > 1 they are split
    # round-robin over N worker processes, each with its own ephemeral Dagster instance (a
    # DAGSTER_HOME instance is only used by a sequential build).
    jobs = max(1, min(args.jobs, len(specs)))
    use_home = bool(os.environ.get("DAGSTER_HOME"))
    ids = [s.run_id for s in specs]
    if jobs > 1 and not use_home:
        import multiprocessing as mp

        chunks = [(str(data_dir), ids[i::jobs]) for i in range(jobs)]
        with mp.get_context("fork").Pool(jobs) as pool:
            parts = pool.map(_build_runs_worker, chunks)
            pool.close()
            pool.join()  # let the workers exit normally before the pool is torn down
        results = [r for part in parts for r in part]
        order = {rid: i for i, rid in enumerate(ids)}
        results.sort(key=lambda r: order[r[0]])
    else:
        results = _build_runs(str(data_dir), ids, use_home)
    failures = 0
    rows = []
    for (run_id, success, errors), spec in zip(results, specs):
        checks = read_checks(paths.run_folder(spec))
        if checks.get("fits_in_memory", {}).get("status") == "failed":
            status = "out of memory: " + checks["fits_in_memory"]["message"]
        elif success:
            status = "ok"
        else:
            failures += 1
            failed = [f"{k}: {v['message']}" for k, v in checks.items() if v["status"] != "passed"]
            status = "FAILED: " + "; ".join(errors + failed)[:300]
        rows.append((spec.run_id, status))
        if not args.quiet:
            print(f"{spec.run_id:34s} {status}", flush=True)
    res = defs.resolve_job_def(d.dataset_job.name).execute_in_process(instance=instance, raise_on_error=False,
                                                                 run_config=QUIET_LOGS)
    if not res.success:
        failures += 1
        print("dataset: FAILED (see the phantora_v0 check)", file=sys.stderr)
    elapsed = time.perf_counter() - t0
    print(f"\nbuilt {len(specs)} runs in {elapsed:.1f} s ({jobs} worker{'s' if jobs > 1 else ''}): "
          f"{sum(r[1] == 'ok' for r in rows)} ok, {sum(r[1].startswith('out of memory') for r in rows)} not fitting, "
          f"{sum(r[1].startswith('FAILED') for r in rows)} failed")
    print(f"dataset:     {paths.dataset_dir.resolve()}")
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


def cmd_sweep(args: argparse.Namespace) -> int:
    from phantora_assets.runs import gpu_specs, presets
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
        points = grid([x for x in args.layouts.split(",") if x.strip()], bandwidths, workloads, args.gpu,
                      uplink_bw_gbps=args.uplink_bw, rack_size=args.rack_size, nspines=args.nspines, ecmp=args.ecmp)
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
        show = df[["workload", "layout", "host_bw_gbps", "status", "step_time_ms", "compute_ms", "exposed_comm_ms",
                   "inter_node_bytes_per_step"]].copy()
        show["status"] = show["status"].str.slice(0, 40)
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
    b.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="worker processes for the runs (default: min(2, CPUs)); 1 = sequential")
    b.set_defaults(func=cmd_build)
    w = sub.add_parser("sweep", help="what-if grid (layouts x host bandwidths x workloads) with the analytic "
                                      "simulator, one table row per point (no Dagster)")
    w.add_argument("--layouts", default="2x8,4x8,16x8", help="comma-separated <nodes>x<gpus_per_node>")
    w.add_argument("--bandwidths", default="100,200,400,800", help="host link bandwidths, Gbps")
    w.add_argument("--workloads", default="W1,W4", help="comma-separated W1..W5")
    w.add_argument("--gpu", default="h100", help="a key of gpus.toml")
    w.add_argument("--uplink-bw", type=float, default=None,
                   help="spine-uplink port bandwidth, Gbps (default: the host bandwidth of the point)")
    w.add_argument("--rack-size", type=int, default=None, help="hosts per rack (default: presets.toml)")
    w.add_argument("--nspines", type=int, default=None, help="spines (default: presets.toml)")
    w.add_argument("--ecmp", choices=["hash", "split", "first"], default=None, help="spine choice (lib/network.py)")
    w.add_argument("--out", default="sweep.csv", help="output table (.csv or .parquet)")
    w.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    w.add_argument("--quiet", action="store_true", help="print only the summary line")
    w.set_defaults(func=cmd_sweep)
    r = sub.add_parser("runs", help="list the run matrix with memory verdicts and check status")
    r.add_argument("--data-dir", default=default_dir)
    r.set_defaults(func=cmd_runs)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
