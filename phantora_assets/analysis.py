"""Stages of the analysis layer as plain functions (no Dagster import), like ``pipeline``.

    step_anatomy_stage  -> partitions/<run_id>/{step_anatomy,step_spans}.parquet
    run_plots_stage     -> run folder plots/{pair_heatmap,timeseries,step_anatomy}.png
    dataset_duckdb_stage-> phantora.duckdb (rebuilt from the partitions of the runs that passed)
    dataset_plots_stage -> phantora_v0/plots/{bytes_vs_published,step_time_by_layout}.png

None of them gates the dataset: the runs' checks do (``checks_log.RUN_CHECKS``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from phantora_assets import schemas
from phantora_assets.lib import anatomy, database, plots
from phantora_assets.lib.checks_log import RUN_CHECKS, read_checks, record_check, reset_checks, run_passed
from phantora_assets.lib.tables import BIN_COLUMNS, FLOW_COLUMNS, STEP_COLUMNS
from phantora_assets.lib.window_features import FEATURES, WINDOW_FEATURE_COLUMNS
from phantora_assets.paths import DataPaths
from phantora_assets.pipeline import BIN_S, Outcome, StageResult, _write_parquet, read_trace_summary
from phantora_assets.runs import RunSpec

PUBLISHED_RUNS = Path(__file__).parent / "published_runs.csv"
RUN_PLOTS = ("pair_heatmap", "timeseries", "step_anatomy")
DATASET_PLOTS = ("bytes_vs_published", "step_time_by_layout")


@dataclass
class PlotsResult:
    """PNG files written by a plotting stage (name -> path) and what it took."""

    files: dict[str, Path]
    seconds: float
    metadata: dict[str, Any] = field(default_factory=dict)


def published_runs() -> pd.DataFrame:
    """The published phantora_v0 figures shipped with the package (``published_runs.csv``)."""
    return pd.read_csv(PUBLISHED_RUNS)


# --------------------------------------------------------------------------- step anatomy
def step_anatomy_stage(spec: RunSpec, paths: DataPaths) -> StageResult:
    """Compute vs exposed communication per (step, host) and the spans of the chosen steady step."""
    pdir = paths.partition_dir(spec.run_id)
    folder = paths.run_folder(spec)
    reset_checks(folder, "step_anatomy", ("anatomy_adds_up",))
    summary = read_trace_summary(paths, spec.run_id)
    steps = pd.read_parquet(pdir / "steps.parquet")
    flows = pd.read_parquet(pdir / "flows.parquet")
    events = pdir / "compute_events.parquet"   # written with flows.parquet by validated_flows
    compute = (pd.read_parquet(events) if events.exists()
               else anatomy.read_compute_events(paths.chrome_trace(spec)))
    hosts = anatomy.hosts_of(flows, compute, spec.n_nodes)
    intervals = anatomy.host_intervals(flows, compute, hosts)
    table = anatomy.step_anatomy(steps, flows, compute, hosts, intervals)
    chosen = int(summary["chosen_step"])
    spans = anatomy.step_spans(steps[steps["step"] == chosen].iloc[0], flows, compute, hosts, intervals)
    _write_parquet(table, pdir / "step_anatomy.parquet")
    _write_parquet(spans, pdir / "step_spans.parquet")
    steady = table[table["steady"]]
    meta: dict[str, Any] = {"rows": len(table), "hosts": len(hosts), "chosen_step": chosen}
    if len(steady):
        meta.update({
            "compute_ms": round(float(steady["compute_us"].mean()) / 1000, 3),
            "exposed_comm_ms": round(float(steady["exposed_comm_us"].mean()) / 1000, 3),
            "overlapped_comm_ms": round(float(steady["overlap_us"].mean()) / 1000, 3),
            "idle_ms": round(float(steady["idle_us"].mean()) / 1000, 3),
            "exposed_comm_share": round(float((steady["exposed_comm_us"] / steady["step_time_us"]).mean()), 4),
        })
    outcome = anatomy_outcome(table, len(hosts))
    record_check(folder, "step_anatomy", outcome.name, outcome.passed, outcome.message)
    return StageResult(pdir / "step_anatomy.parquet", meta, [outcome])


def anatomy_outcome(table: pd.DataFrame, n_hosts: int) -> Outcome:
    """``anatomy_adds_up``: compute + exposed + idle = step time per row; every host in every step."""
    resid = (table["compute_us"] + table["exposed_comm_us"] + table["idle_us"] - table["step_time_us"]).abs()
    worst = float(resid.max()) if len(table) else 0.0
    sums_ok = bool((resid <= 1e-6 * table["step_time_us"].clip(lower=1.0)).all())
    per_step = table.groupby("step")["host"].nunique()
    hosts_ok = bool((per_step == n_hosts).all())
    ok = sums_ok and hosts_ok and len(table) > 0
    if ok:
        msg = f"{len(table)} (step, host) rows: compute + exposed communication + idle = step time (max residual {worst:.3g} us)"
    elif not len(table):
        msg = "no (step, host) rows"
    elif not sums_ok:
        msg = f"compute + exposed communication + idle differs from the step time by up to {worst:.3g} us"
    else:
        msg = f"steps with fewer than {n_hosts} hosts: {per_step[per_step != n_hosts].index.tolist()[:10]}"
    return Outcome("anatomy_adds_up", ok, msg, {"rows": int(len(table)), "max_residual_us": worst})


# --------------------------------------------------------------------------- plots
def run_plots_stage(spec: RunSpec, paths: DataPaths) -> PlotsResult:
    """The three per-run PNGs, in the run folder's ``plots/``."""
    t0 = time.perf_counter()
    pdir = paths.partition_dir(spec.run_id)
    out = paths.plots_dir(spec)
    summary = read_trace_summary(paths, spec.run_id)
    steps = pd.read_parquet(pdir / "steps.parquet")
    flows = pd.read_parquet(pdir / "flows.parquet")
    bins = pd.read_parquet(pdir / "flows_100ms.parquet")
    table = pd.read_parquet(pdir / "step_anatomy.parquet")
    spans = pd.read_parquet(pdir / "step_spans.parquet")
    chosen = int(summary["chosen_step"])
    step_row = steps[steps["step"] == chosen].iloc[0]
    files = {name: out / f"{name}.png" for name in RUN_PLOTS}
    plots.pair_heatmap(plots.pair_matrix(flows, steps, spec.n_nodes), spec.run_id, files["pair_heatmap"])
    plots.timeseries(bins, spec.run_id, BIN_S, summary["step_time_us"] / 1e6, path=files["timeseries"])
    plots.step_anatomy_chart(spans, table[table["step"] == chosen], spec.run_id, chosen,
                             float(step_row["end_us"] - step_row["start_us"]), path=files["step_anatomy"])
    return PlotsResult(files, time.perf_counter() - t0)


def dataset_plots_stage(paths: DataPaths) -> PlotsResult:
    """The two dataset PNGs, from ``phantora_v0/runs.parquet`` and the published figures."""
    t0 = time.perf_counter()
    runs = pd.read_parquet(paths.dataset_dir / "runs.parquet")
    pub = published_runs()
    out = paths.dataset_plots_dir
    files = {name: out / f"{name}.png" for name in DATASET_PLOTS}
    plots.bytes_vs_published(runs, pub, files["bytes_vs_published"])
    plots.step_time_by_layout(runs, pub, files["step_time_by_layout"])
    return PlotsResult(files, time.perf_counter() - t0, {"runs": len(runs)})


# --------------------------------------------------------------------------- database
def _dtypes(schema) -> dict[str, str]:
    return {c: str(col.dtype) for c, col in schema.columns.items()}


def database_tables() -> list[database.Table]:
    """The base tables of ``phantora.duckdb`` and the per-run file each is read from."""
    runs_docs = {c: col.description for c, col in schemas.RUNS.columns.items() if col.description}
    win_docs = {f.name: f"{f.formula} [{f.unit}]; {f.edge_cases}" for f in FEATURES}
    flow_docs = {
        "ts_us": "flow start, simulated us since the trace start", "dur_us": "flow duration, us",
        "src_node": "source host-k is node k-1", "dst_node": "destination node (!= src_node: network flows only)",
        "bytes": "flow bytes", "op": "all_reduce | all_gather | reduce_scatter | broadcast | send | recv",
        "comm_id": "communicator: 16 hex chars of blake2b of the NCCL id", "step": "step index (-1: before the first step)",
    }
    return [
        database.Table("runs", _dtypes(schemas.RUNS), "run_summary.parquet",
                       "One row per run that passed every check (the runs.csv contract).", runs_docs),
        database.Table("flows_100ms", dict(BIN_COLUMNS), "flows_100ms.parquet",
                       "Bytes sent src_node -> dst_node in the 100 ms bin starting at t (0 <= t < 180 s), "
                       "control traffic included.", {"t": "bin start, s", "bytes": "bytes in the bin"}),
        database.Table("windows", dict(WINDOW_FEATURE_COLUMNS), "windows.parquet",
                       "Detector features per 1 s and 15 s window of each run (README: window features).", win_docs),
        database.Table("flows", {**FLOW_COLUMNS, "step": "int64"}, "flows.parquet",
                       "The validated per-flow table: one row per network flow (src_node != dst_node) of the "
                       "run's trace, with op, communicator and step.", flow_docs, add_run_id=True),
        database.Table("steps", dict(STEP_COLUMNS), "steps.parquet",
                       "One row per step detected in the run's trace (steady = false: warm-up).", {},
                       add_run_id=True),
        database.Table("step_anatomy", dict(anatomy.ANATOMY_COLUMNS), "step_anatomy.parquet",
                       "Per (step, host): compute, network, overlapped, exposed communication and idle time "
                       "(compute_us + exposed_comm_us + idle_us = step_time_us).", anatomy.ANATOMY_DOCS,
                       add_run_id=True, optional=True),
    ]


def run_status_rows(specs: Sequence[RunSpec], paths: DataPaths) -> tuple[dict[str, Path], list[tuple[str, str, str]]]:
    """Partition folders of the runs that passed every check, and a status row for every run."""
    included: dict[str, Path] = {}
    rows: list[tuple[str, str, str]] = []
    for spec in sorted(specs, key=lambda s: s.run_id):
        folder = paths.run_folder(spec)
        checks = read_checks(folder)
        pdir = paths.partition_dir(spec.run_id)
        if run_passed(folder):
            included[spec.run_id] = pdir
            rows.append((spec.run_id, "included", ""))
        elif not checks:
            rows.append((spec.run_id, "not built", "no checks recorded"))
        else:
            bad = [f"{k}: {checks.get(k, {}).get('status', 'missing')}" for k in RUN_CHECKS
                   if checks.get(k, {}).get("status") != "passed"]
            rows.append((spec.run_id, "excluded", "; ".join(bad)))
    return included, rows


@dataclass
class DatabaseStageResult:
    """The database build, its duration and the ``duckdb_matches_dataset`` outcome."""

    build: database.BuildResult
    seconds: float
    outcome: Outcome


def dataset_duckdb_stage(specs: Sequence[RunSpec], paths: DataPaths) -> DatabaseStageResult:
    """Rebuild ``phantora.duckdb`` from the partitions of the runs that passed every check.

    The outcome compares the database with ``phantora_v0/`` (same runs, same rows in runs,
    flows_100ms and windows): both are assembled from the same partition files.
    """
    import duckdb

    t0 = time.perf_counter()
    included, rows = run_status_rows(specs, paths)
    result = database.build_database(paths.duckdb_path, database_tables(), included, rows)
    seconds = time.perf_counter() - t0
    problems = []
    with duckdb.connect(str(result.path), read_only=True) as con:
        for table in ("runs", "flows_100ms", "windows"):
            f = paths.dataset_dir / f"{table}.parquet"
            if not f.exists():
                problems.append(f"{table}: phantora_v0/{table}.parquet is missing (materialize phantora_v0)")
                continue
            want = pd.read_parquet(f, columns=["run_id"])["run_id"]
            got = con.execute(f"SELECT count(*), count(DISTINCT run_id) FROM {table}").fetchone()
            if tuple(got) != (len(want), want.nunique()):
                problems.append(f"{table}: database {got[0]} rows of {got[1]} runs, phantora_v0 "
                                f"{len(want)} rows of {want.nunique()} runs")
    msg = ("runs, flows_100ms and windows hold the rows of phantora_v0 "
           f"({len(result.included)} runs)" if not problems else "; ".join(problems))
    return DatabaseStageResult(result, seconds, Outcome("duckdb_matches_dataset", not problems, msg,
                                                        {"runs": len(result.included)}))


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; ValueError if ``data`` is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


__all__ = ["PlotsResult", "DatabaseStageResult", "anatomy_outcome", "published_runs", "step_anatomy_stage", "run_plots_stage", "dataset_plots_stage",
           "dataset_duckdb_stage", "database_tables", "run_status_rows", "png_size"]
