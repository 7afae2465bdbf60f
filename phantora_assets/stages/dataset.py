"""Stages of group ``dataset`` (no Dagster import).

window_features -> partitions/<run_id>/windows.parquet
summarize_run   -> partitions/<run_id>/run_summary.parquet (the run's runs.csv row)
export_dataset  -> phantora_v0/ (stages/export.py: CSVs, per-run Parquet, run_status.csv, README.md)
dataset_duckdb  -> phantora.duckdb (rebuilt from the partitions of the runs that passed)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from phantora_assets import contracts
from phantora_assets.checks import DUCKDB_MATCHES_DATASET, RUNS_CONTRACT, WINDOWS_CONTRACT, reset_checks
from phantora_assets.lib.columns import BIN_COLUMNS, FLOW_COLUMNS, STEP_COLUMNS
from phantora_assets.lib.net.fabric import host_nic_bw
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store import bin_table, database
from phantora_assets.lib.store.parquet import write_parquet
from phantora_assets.lib.traffic import anatomy, binning
from phantora_assets.lib.traffic import window_features as wf
from phantora_assets.lib.traffic.window_features import FEATURES, WINDOW_FEATURE_COLUMNS
from phantora_assets.outcomes import Outcome, StageResult, record
from phantora_assets.paths import DataPaths
from phantora_assets.records import RunLogRecord, SimulationRecord, read_record, read_record_or_none
from phantora_assets.sources import get_source
from phantora_assets.stages import card, export, links, reconfig
from phantora_assets.stages.common import WINDOW_S
from phantora_assets.stages.export import DatasetResult, contract_outcome, schema_dtypes
from phantora_assets.stages.flows import read_trace_summary


def window_features(spec: RunSpec, paths: DataPaths) -> StageResult:
    """Detector features per 1 s and 15 s window, validated by the windows.csv schema."""
    reset_checks(paths.run_folder(spec), "window_features")
    n_total = int(round(WINDOW_S / spec.bin_s))  # the matrix, read one row group at a time (bounded memory)
    binned = bin_table.read_bins(paths.table(spec.run_id, "flows_100ms"), spec.bin_s, n_total)
    if isinstance(binned, bin_table.SparseBins):  # a sparse run: from its rows, never its dense matrix
        feats = wf.sparse_window_features(binned, spec.run_id)
    else:
        feats = wf.matrix_window_features(*binned, spec.run_id, bin_s=spec.bin_s)
    outcome = contract_outcome(WINDOWS_CONTRACT, contracts.windows_schema(), feats)
    out = paths.table(spec.run_id, "windows")
    if outcome.passed:  # a failed blocking check writes no data file
        write_parquet(feats, out)
    record(paths, spec, "window_features", [outcome])
    return StageResult(out if outcome.passed else None, {"rows": len(feats)}, [outcome])


def summarize_run(spec: RunSpec, paths: DataPaths, source: str | None = None) -> StageResult:
    """The run's ``runs.csv`` row, validated by the runs.csv contract.

    Reads ``trace_summary.json`` (validated_flows) and, from raw_timeline, ``simulation.json``
    (sources with ``ROOFLINE_TIMING``: FLOPs, memory, compute) or ``run_log.json`` (Phantora
    runs: peak memory). The ``source`` column is the run's source's ``DATASET_SOURCE``; a source
    with ``run_fields(spec, paths)`` (``kineto``) gives the descriptive columns (workload, gpu, ...).

    Raises:
        RecordError: a sidecar record this run needs is missing or malformed (names the file).
    """
    reset_checks(paths.run_folder(spec), "run_summary")
    summary = read_trace_summary(paths, spec.run_id)
    step_time_s = summary.step_time_us / 1e6
    gpu = spec.gpu_spec
    pdir = paths.partition_dir(spec.run_id)
    src = get_source(spec.source)
    analytic = src.ROOFLINE_TIMING
    sim = read_record(pdir / "simulation.json", SimulationRecord) if analytic else None
    flops = sim.flops_per_step if sim is not None else None
    peak_memory_gib: float | None
    if sim is not None:
        peak_memory_gib = sim.peak_memory_gib
    else:
        run_log = read_record_or_none(pdir / "run_log.json", RunLogRecord)
        peak_memory_gib = run_log.peak_memory_gib if run_log is not None else None
    row: dict[str, Any] = {
        "run_id": spec.run_id,
        "source": source or src.DATASET_SOURCE,
        "layout": spec.layout,
        "n_nodes": spec.n_nodes,
        "step_time_s": step_time_s,
        "inter_node_bytes_per_step": int(summary.network_bytes_per_step),
        "nic_bw": host_nic_bw(spec.cluster, spec.n_nodes, spec.gpus_per_node),
        "flops_per_step": flops,
        "mfu": (flops / (step_time_s * spec.world_size * gpu["peak_bf16_flops"])) if flops is not None else None,
        "peak_flops": gpu["peak_bf16_flops"] if analytic else None,
        "alpha": gpu["matmul_efficiency"] if analytic else None,
        "workload": spec.workload,
        "framework": {"megatron": "Megatron", "deepspeed": "DeepSpeed", "torchtitan": "TorchTitan"}.get(
            spec.framework, spec.framework
        ),
        "model": spec.model_name,
        "parallelism": spec.parallelism,
        "gpu": spec.gpu,
        "gpus_per_node": spec.gpus_per_node,
        "world_size": spec.world_size,
        "simulator": spec.source,
        "n_steady_steps": int(summary.n_steady_steps),
        "peak_memory_gib": peak_memory_gib,
        "perf_db_fraction": sim.perf_db_fraction if sim is not None else None,
        "exposed_comm_s": sim.exposed_comm_ms_per_step / 1e3 if sim is not None else None,
        "window_s": WINDOW_S,
        "bin_s": spec.bin_s,
        "seed": binning.seed_from_run_id(spec.run_id),
    }
    describe = getattr(src, "run_fields", None)  # a source whose runs have no workload preset describes them
    if describe is not None:
        row.update(describe(spec, paths))
    df = runs_frame([row])
    outcome = contract_outcome(RUNS_CONTRACT, contracts.RUNS, df)
    out = paths.table(spec.run_id, "run_summary")
    if outcome.passed:  # a failed blocking check writes no data file
        write_parquet(df, out)
    record(paths, spec, "run_summary", [outcome])
    meta = {
        "step_time_ms": round(step_time_s * 1000, 3),
        "inter_node_gb_per_step": round(row["inter_node_bytes_per_step"] / 1e9, 4),
    }
    return StageResult(out if outcome.passed else None, meta, [outcome])


def runs_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """runs.csv rows as a DataFrame with the contract's column order and dtypes."""
    cols = list(contracts.RUNS.columns)
    df = pd.DataFrame(rows, columns=cols)
    for c, col in contracts.RUNS.columns.items():
        if str(col.dtype) == "int64":
            df[c] = df[c].astype("int64")
        elif str(col.dtype) == "float64":
            df[c] = df[c].astype("float64")
    return df


def export_dataset(specs: list[RunSpec], paths: DataPaths) -> DatasetResult:
    """``phantora_v0/`` with its card: :func:`stages.export.export_dataset` (layout, atomicity,
    validation) with ``README.md`` from :func:`stages.card.dataset_card`."""
    return export.export_dataset(specs, paths, card=card.dataset_card)


def database_tables() -> list[database.Table]:
    """The base tables of ``phantora.duckdb`` and the per-run file each is read from."""
    runs_docs = {c: col.description for c, col in contracts.RUNS.columns.items() if col.description}
    win_docs = {f.name: f"{f.formula} [{f.unit}]; {f.edge_cases}" for f in FEATURES}
    flow_docs = {
        "ts_us": "flow start, simulated us since the trace start",
        "dur_us": "flow duration, us",
        "src_node": "source host-k is node k-1",
        "dst_node": "destination node (!= src_node: network flows only)",
        "bytes": "flow bytes",
        "op": "all_reduce | all_gather | reduce_scatter | broadcast | send | recv",
        "comm_id": "communicator: 16 hex chars of blake2b of the NCCL id",
        "step": "step index (-1: before the first step)",
        "group": "parallelism group of the flow's communicator: tp | cp | ep | dp | pp | other "
        '(docs/WORKLOADS.md "Groups": dp covers dp x cp, expert-data-parallel and HSDP replicas)',
    }
    return [
        database.Table(
            "runs",
            schema_dtypes(contracts.RUNS),
            "run_summary.parquet",
            "One row per run that passed every check (the runs.csv contract).",
            runs_docs,
        ),
        database.Table(
            "flows_100ms",
            dict(BIN_COLUMNS),
            "flows_100ms.parquet",
            "Bytes sent src_node -> dst_node in the 100 ms bin starting at t (0 <= t < 180 s), "
            "control traffic included; the runs of 100 ms bins (v1; every width: flows_binned).",
            {"t": "bin start, s", "bytes": "bytes in the bin"},
            run_filter="round(r.bin_s * 1000) = 100",
        ),
        database.Table(
            "flows_binned",
            {"run_id": "str", "bin_s": "float64", **{c: d for c, d in BIN_COLUMNS.items() if c != "run_id"}},
            "flows_100ms.parquet",  # the per-run file keeps v1's name at any width
            "Bytes sent src_node -> dst_node in the bin of bin_s seconds starting at t (0 <= t < 180 s), "
            "control traffic included: every run at its own bin width (runs.bin_s).",
            {"bin_s": "bin width of the run, s (runs.bin_s)", "t": "bin start, s", "bytes": "bytes in the bin"},
            from_runs=("bin_s",),
        ),
        database.Table(
            "windows",
            dict(WINDOW_FEATURE_COLUMNS),
            "windows.parquet",
            "Detector features per 1 s and 15 s window of each run (README: window features).",
            win_docs,
        ),
        database.Table(
            "flows",
            {**FLOW_COLUMNS, "step": "int64", "group": "str"},
            "flows.parquet",
            "The validated per-flow table: one row per network flow (src_node != dst_node) of the "
            "run's trace, with op, communicator and step.",
            flow_docs,
            add_run_id=True,
        ),
        database.Table(
            "steps",
            dict(STEP_COLUMNS),
            "steps.parquet",
            "One row per step detected in the run's trace (steady = false: warm-up).",
            {
                "steady": "false for warm-up steps (and for steps after the last complete one); its bytes are a step's",
                "timed": "steady and ending at its own end: the last step of a trace that ends with its last flow is "
                "not (cut by the trace's end); average step times over timed steps",
            },
            add_run_id=True,
        ),
        database.Table(
            "step_anatomy",
            dict(anatomy.ANATOMY_COLUMNS),
            "step_anatomy.parquet",
            "Per (step, host): compute, network, overlapped, exposed communication and idle time "
            "(compute_us + exposed_comm_us + idle_us = duration_us).",
            anatomy.ANATOMY_DOCS,
            add_run_id=True,
            optional=True,
        ),
        links.link_bins_table(),
        *reconfig.database_tables(),
    ]


def run_status_rows(specs: Sequence[RunSpec], paths: DataPaths) -> tuple[dict[str, Path], list[tuple[str, str, str]]]:
    """Partition folders of the runs that passed every check, and a ``(run_id, status, reason)`` row for
    every run: ``included`` with no reason, or ``excluded`` with the reason of ``run_status.csv``
    (``export.run_exclusion``)."""
    included: dict[str, Path] = {}
    rows: list[tuple[str, str, str]] = []
    for spec in sorted(specs, key=lambda s: s.run_id):
        why = export.run_exclusion(spec, paths)
        if why:
            rows.append((spec.run_id, "excluded", why))
        else:
            included[spec.run_id] = paths.partition_dir(spec.run_id)
            rows.append((spec.run_id, "included", ""))
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
        for t in export.EXPORT_TABLES:
            if t.per_run:
                exists = (paths.dataset_dir / t.name).is_dir()
                files = sorted((paths.dataset_dir / t.name).glob("*/part-*.parquet"))
            else:
                files = [paths.dataset_dir / f"{t.name}.parquet"]
                exists = files[0].exists()
            if not exists:
                problems.append(f"{t.name}: phantora_v0/{t.name} is missing (materialize phantora_v0)")
                continue
            want = (0, 0)
            if files:  # DuckDB over the published files: no table is held in memory
                want = con.execute(
                    "SELECT count(*), count(DISTINCT run_id) FROM read_parquet(?)", [[str(p) for p in files]]
                ).fetchone() or (0, 0)
            got = con.execute(f"SELECT count(*), count(DISTINCT run_id) FROM {t.name}").fetchone() or (0, 0)
            if tuple(got) != tuple(want):
                problems.append(
                    f"{t.name}: database {got[0]} rows of {got[1]} runs, phantora_v0 {want[0]} rows of {want[1]} runs"
                )
    msg = (
        f"runs, flows_100ms and windows hold the rows of phantora_v0 ({len(result.included)} runs)"
        if not problems
        else "; ".join(problems)
    )
    return DatabaseStageResult(
        result, seconds, Outcome(DUCKDB_MATCHES_DATASET, not problems, msg, {"runs": len(result.included)})
    )
