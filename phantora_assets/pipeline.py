"""The per-run stages of the asset graph as plain functions (no Dagster import).

Each stage reads the previous stage's files under a :class:`~phantora_assets.paths.DataPaths`
root, writes its own files atomically and returns a :class:`StageResult` with metadata and
check outcomes. Dagster assets (``phantora_assets.assets``) are thin wrappers around these,
and so are the CLI and tests that run without Dagster.

    simulate_run     -> partitions/<run_id>/raw_timeline.parquet, run folder run.log, config/
    write_trace      -> run folder timeline.json.gz
    validate_flows   -> partitions/<run_id>/{flows,steps,step_flows}.parquet, trace_summary.json
    bin_flows        -> partitions/<run_id>/flows_100ms.parquet
    window_features  -> partitions/<run_id>/windows.parquet
    summarize_run    -> partitions/<run_id>/run_summary.parquet
    export_dataset   -> phantora_v0/{runs,flows_100ms,windows}.{csv,parquet}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pandera.errors as pa_errors

from phantora_assets import schemas
from phantora_assets.lib import binning, chrome_trace, steps, trace_checks
from phantora_assets.lib import window_features as wf
from phantora_assets.lib.analytic import simulate
from phantora_assets.lib.checks_log import RUN_CHECKS, record_check, reset_checks, run_passed
from phantora_assets.lib.io import atomic_path, atomic_write_text
from phantora_assets.lib.netconfig import dumps_netconfig, netconfig_for
from phantora_assets.lib.workloads import Compute, workload_model
from phantora_assets.paths import DataPaths
from phantora_assets.runs import RunSpec

WINDOW_S = 180.0
BIN_S = 0.1
CONTROL_BYTES_PER_S = 5000


@dataclass(frozen=True)
class Outcome:
    """One check outcome: ``passed``, a plain-words ``message`` and metadata values."""

    name: str
    passed: bool
    message: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class StageResult:
    """What a stage produced: output ``path``, ``metadata`` for the UI, check ``outcomes``."""

    path: Path | None
    metadata: dict[str, Any] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)


def _write_parquet(df: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        df.to_parquet(tmp, index=False, engine="pyarrow", compression="zstd")


def _record(paths: DataPaths, spec: RunSpec, asset: str, outcomes: list[Outcome]) -> None:
    folder = paths.run_folder(spec)
    for o in outcomes:
        record_check(folder, asset, o.name, o.passed, o.message)


# --------------------------------------------------------------------------- simulation
def simulate_run(spec: RunSpec, paths: DataPaths, perfdb_status: str = "unknown") -> StageResult:
    """Run the analytic simulator; write the raw timeline, ``run.log`` and ``config/``.

    A run that does not fit in GPU memory writes ``run.log`` with the estimate, no timeline,
    and a failed ``fits_in_memory`` outcome; it never raises for that.
    """
    folder = paths.run_folder(spec)
    reset_checks(folder, "raw_timeline")
    result = simulate(spec)
    mem = result.memory.as_dict()
    config = folder / "config"
    atomic_write_text(config / "netconfig.toml", dumps_netconfig(netconfig_for(spec)))
    atomic_write_text(config / "run.toml", "\n".join([
        f'run_id = "{spec.run_id}"', f'workload = "{spec.workload}"', f'gpu = "{spec.gpu}"',
        f"nodes = {spec.n_nodes}", f"gpus_per_node = {spec.gpus_per_node}", f'source = "{spec.source}"',
        f'parallelism = "{spec.parallelism}"', "",
    ]))
    log = [f"# analytic simulation of {spec.run_id} ({spec.framework} {spec.preset['model']}, {spec.parallelism})",
           f"# perf DB: {perfdb_status}",
           f"peak memory estimate: {mem['peak_gib']:.2f} GiB of {mem['card_gib']:.2f} GiB"]
    meta: dict[str, Any] = {"fits": result.fits, **{f"memory_{k}": v for k, v in mem.items() if k != "fits"}}
    if not result.fits:
        log.append(f"OUT OF MEMORY: estimated peak {mem['peak_gib']:.2f} GiB exceeds the card ({mem['card_gib']:.2f} GiB)")
        atomic_write_text(folder / "run.log", "\n".join(log) + "\n")
        outcome = Outcome("fits_in_memory", False,
                          f"does not fit: estimated peak {mem['peak_gib']:.2f} GiB > card {mem['card_gib']:.2f} GiB",
                          {"peak_gib": mem["peak_gib"], "card_gib": mem["card_gib"]})
        _record(paths, spec, "raw_timeline", [outcome])
        return StageResult(None, {**meta, "status": "out_of_memory"}, [outcome])
    log.append(f"# compute per steady step (rank 0): {result.compute_ns_per_step / 1e6:.3f} ms, "
               f"{result.db_fraction:.1%} of it from the perf DB ({result.kernels_from_db}/{result.kernels_per_step} "
               f"intercepted calls found), the rest from the {spec.gpu} roofline")
    log.append(f"# exposed communication per steady step (rank 0): {result.exposed_comm_ns / 1e6:.3f} ms")
    for i, ns in enumerate(result.iteration_ns):
        log.append(f"iteration {i + 1:3d}/{len(result.iteration_ns)} | simulated time (ms): {ns / 1e6:.3f} "
                   f"| peak memory (GiB): {mem['peak_gib']:.2f}")
    out = paths.table(spec.run_id, "raw_timeline")
    _write_parquet(result.raw, out)
    sim = {"step_ms": round(result.step_ns / 1e6, 6), "compute_ms_per_step": round(result.compute_ns_per_step / 1e6, 6),
           "exposed_comm_ms_per_step": round(result.exposed_comm_ns / 1e6, 6),
           "perf_db_fraction": round(result.db_fraction, 6), "kernels_per_step": result.kernels_per_step,
           "kernels_from_perf_db": result.kernels_from_db}
    atomic_write_text(paths.partition_dir(spec.run_id) / "simulation.json", json.dumps(sim, indent=1, sort_keys=True) + "\n")
    atomic_write_text(folder / "run.log", "\n".join(log) + "\n")
    outcome = Outcome("fits_in_memory", True,
                      f"fits: estimated peak {mem['peak_gib']:.2f} GiB <= card {mem['card_gib']:.2f} GiB",
                      {"peak_gib": mem["peak_gib"], "card_gib": mem["card_gib"]})
    _record(paths, spec, "raw_timeline", [outcome])
    meta.update({"status": "simulated", "n_events": len(result.raw), "iterations": len(result.iteration_ns), **sim})
    return StageResult(out, meta, [outcome])


def write_trace(spec: RunSpec, paths: DataPaths) -> StageResult:
    """Convert the raw timeline into ``timeline.json.gz`` (Phantora visualizer schema)."""
    raw = pd.read_parquet(paths.table(spec.run_id, "raw_timeline"))
    out = paths.chrome_trace(spec)
    stats = chrome_trace.write_chrome_trace(raw, out)
    return StageResult(out, {k: int(v) for k, v in stats.items()})


# --------------------------------------------------------------------------- flows
def _outcome(o: trace_checks.CheckOutcome) -> Outcome:
    meta = {f"observed_{k}": v for k, v in o.observed.items()}
    meta.update({f"expected_{k}": v for k, v in o.expected.items()})
    return Outcome(o.name, bool(o.passed), o.message, _jsonable(meta))


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, (np.integer,)):
            v = int(v)
        elif isinstance(v, (np.floating,)):
            v = float(v)
        elif not isinstance(v, (int, float, str, bool)) and v is not None:
            v = json.dumps(v, default=str)[:2000]
        out[k] = v
    return out


def validate_flows(spec: RunSpec, paths: DataPaths, trace_path: Path | None = None) -> StageResult:
    """Parse the Chrome JSON, detect steps, run the four trace rules.

    Writes ``flows.parquet`` (network flows, src_node != dst_node, with ``step``),
    ``steps.parquet``, ``step_flows.parquet`` (the chosen steady step's network flows, the
    input of the build) and ``trace_summary.json``.

    Raises:
        TraceFormatError / StepDetectionError: the trace breaks a format rule (names the file).
    """
    reset_checks(paths.run_folder(spec), "validated_flows")
    src = trace_path or paths.chrome_trace(spec)
    parsed = chrome_trace.read_trace(src)
    flows = parsed.flows
    try:
        result = steps.detect_steps(flows, source=str(src))
    except Exception:
        exists = trace_checks.flows_exist(flows)
        if not exists.passed:  # report the rule the user cares about, then fail the partition
            _record(paths, spec, "validated_flows", [_outcome(exists)])
        raise
    outcomes = [_outcome(o) for o in trace_checks.run_trace_checks(flows, result)]
    _record(paths, spec, "validated_flows", outcomes)

    net = result.flows[result.flows["src_node"] != result.flows["dst_node"]].reset_index(drop=True)
    steady = result.steps[result.steps["steady"]]
    timed = steady[steady["step"].isin(getattr(result, "timed_steps", steady["step"]))]
    chosen = int(timed.iloc[(timed["duration_us"] - result.step_time_us).abs().argsort(kind="stable").iloc[0]]["step"])
    step_flows = result.step_flows(chosen, network_only=True)
    pdir = paths.partition_dir(spec.run_id)
    _write_parquet(net, pdir / "flows.parquet")
    _write_parquet(result.steps, pdir / "steps.parquet")
    _write_parquet(step_flows, pdir / "step_flows.parquet")
    summary = {
        "run_id": spec.run_id,
        "trace": str(src.name),
        "step_time_us": float(result.step_time_us),
        "network_bytes_per_step": int(result.network_bytes_per_step),
        "n_steady_steps": len(result.steady_steps),
        "chosen_step": chosen,
        "n_flows": int(len(flows)),
        "n_network_flows": int(len(net)),
        "periods": {k: int(v) for k, v in result.periods.items()},
        "compute_busy_us": {r.host: float(r.busy_us) for r in parsed.compute.itertuples()},
    }
    atomic_write_text(pdir / "trace_summary.json", json.dumps(summary, indent=1, sort_keys=True) + "\n")
    meta = {
        "step_time_ms": round(result.step_time_us / 1000, 3),
        "network_bytes_per_step": int(result.network_bytes_per_step),
        "n_steady_steps": len(result.steady_steps),
        "n_network_flows": int(len(net)),
        "n_communicators": int(flows["comm_id"].nunique()),
    }
    return StageResult(pdir / "flows.parquet", meta, outcomes)


def read_trace_summary(paths: DataPaths, run_id: str) -> dict[str, Any]:
    return json.loads((paths.partition_dir(run_id) / "trace_summary.json").read_text())


# --------------------------------------------------------------------------- bins
def bin_flows(spec: RunSpec, paths: DataPaths) -> StageResult:
    """The 180 s / 100 ms build of DATASET.md section 4; checks exact conservation."""
    reset_checks(paths.run_folder(spec), "binned_flows")
    summary = read_trace_summary(paths, spec.run_id)
    step_flows = pd.read_parquet(paths.table(spec.run_id, "step_flows"))
    built = binning.build_bins(
        step_flows, step_time_s=summary["step_time_us"] / 1e6, n_nodes=spec.n_nodes, run_id=spec.run_id,
        window_s=WINDOW_S, bin_s=BIN_S, control_bytes_per_s=CONTROL_BYTES_PER_S,
    )
    bins = built.bins
    total = int(bins["bytes"].sum())
    expected = int(built.placed_flow_bytes + built.control_bytes)
    ok = total == expected
    outcome = Outcome(
        "bins_conserve_bytes", ok,
        (f"sum of flows_100ms bytes {total} equals placed flow bytes {built.placed_flow_bytes} + control bytes "
         f"{built.control_bytes}" if ok else
         f"sum of flows_100ms bytes {total} differs from placed {built.placed_flow_bytes} + control "
         f"{built.control_bytes} = {expected} by {total - expected}"),
        {"binned_bytes": total, "placed_flow_bytes": int(built.placed_flow_bytes),
         "control_bytes": int(built.control_bytes)},
    )
    out = paths.table(spec.run_id, "flows_100ms")
    _write_parquet(bins, out)
    _record(paths, spec, "binned_flows", [outcome])
    meta = {"rows": len(bins), "bytes": total, "n_repetitions": int(built.n_repetitions),
            "phase_s": float(built.phase_s), "seed": int(built.seed)}
    return StageResult(out, meta, [outcome])


def window_features(spec: RunSpec, paths: DataPaths) -> StageResult:
    """Detector features per 1 s and 15 s window, validated by the windows.csv schema."""
    reset_checks(paths.run_folder(spec), "window_features")
    bins = pd.read_parquet(paths.table(spec.run_id, "flows_100ms"))
    feats = wf.compute_window_features(bins, run_id=spec.run_id, bin_s=BIN_S, window_s=WINDOW_S)
    outcome = _contract_outcome("windows_contract", schemas.windows_schema(), feats)
    out = paths.table(spec.run_id, "windows")
    _write_parquet(feats, out)
    _record(paths, spec, "window_features", [outcome])
    return StageResult(out, {"rows": len(feats)}, [outcome])


def _contract_outcome(name: str, schema, df: pd.DataFrame) -> Outcome:
    try:
        schema.validate(df, lazy=True)
    except pa_errors.SchemaErrors as exc:
        cases = exc.failure_cases
        head = "; ".join(f"{r.column}: {r.check}" for r in cases.head(5).itertuples())
        return Outcome(name, False, f"{len(cases)} violation(s) of the {schema.name} contract: {head}",
                       {"violations": int(len(cases))})
    return Outcome(name, True, f"{len(df)} rows satisfy the {schema.name} contract", {"rows": int(len(df))})


# --------------------------------------------------------------------------- summary
def model_flops_per_step(spec: RunSpec) -> float:
    """FLOP of one step summed over all ranks (the GEMMs of the analytic model's compute items)."""
    model = workload_model(spec)
    per_rank = sum(i.flops for i in model.step_program() if isinstance(i, Compute) and i.phase != "opt")
    return per_rank * spec.world_size


def summarize_run(spec: RunSpec, paths: DataPaths, source: str | None = None) -> StageResult:
    """The run's ``runs.csv`` row, validated by the runs.csv contract."""
    reset_checks(paths.run_folder(spec), "run_summary")
    summary = read_trace_summary(paths, spec.run_id)
    step_time_s = summary["step_time_us"] / 1e6
    gpu = spec.gpu_spec
    sim_file = paths.partition_dir(spec.run_id) / "simulation.json"
    sim = json.loads(sim_file.read_text()) if sim_file.exists() and spec.source == "analytic" else {}
    analytic = spec.source == "analytic"
    flops = model_flops_per_step(spec) if analytic else None
    from phantora_assets.lib.memory import estimate_memory
    row = {
        "run_id": spec.run_id,
        "source": source or ("phantora_analytic" if analytic else "phantora_v0"),
        "layout": spec.layout,
        "n_nodes": spec.n_nodes,
        "step_time_s": step_time_s,
        "inter_node_bytes_per_step": int(summary["network_bytes_per_step"]),
        "nic_bw": spec.cluster["host_bw_gbps"] * 1e9 / 8,
        "flops_per_step": flops,
        "mfu": (flops / (step_time_s * spec.world_size * gpu["peak_bf16_flops"])) if analytic else None,
        "peak_flops": gpu["peak_bf16_flops"] if analytic else None,
        "alpha": gpu["matmul_efficiency"] if analytic else None,
        "workload": spec.workload,
        "framework": {"megatron": "Megatron", "deepspeed": "DeepSpeed"}.get(spec.framework, spec.framework),
        "model": spec.preset["model"],
        "parallelism": spec.parallelism,
        "gpu": spec.gpu,
        "gpus_per_node": spec.gpus_per_node,
        "world_size": spec.world_size,
        "simulator": spec.source,
        "n_steady_steps": int(summary["n_steady_steps"]),
        "peak_memory_gib": estimate_memory(workload_model(spec)).as_dict()["peak_gib"] if analytic else None,
        "perf_db_fraction": sim.get("perf_db_fraction"),
        "exposed_comm_s": (sim["exposed_comm_ms_per_step"] / 1e3) if "exposed_comm_ms_per_step" in sim else None,
        "window_s": WINDOW_S,
        "bin_s": BIN_S,
        "seed": binning.seed_from_run_id(spec.run_id),
    }
    df = runs_frame([row])
    outcome = _contract_outcome("runs_contract", schemas.RUNS, df)
    out = paths.table(spec.run_id, "run_summary")
    _write_parquet(df, out)
    _record(paths, spec, "run_summary", [outcome])
    meta = {"step_time_ms": round(step_time_s * 1000, 3), "inter_node_gb_per_step": round(row["inter_node_bytes_per_step"] / 1e9, 4)}
    return StageResult(out, meta, [outcome])


def runs_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """runs.csv rows as a DataFrame with the contract's column order and dtypes."""
    cols = list(schemas.RUNS.columns)
    df = pd.DataFrame(rows, columns=cols)
    for c, col in schemas.RUNS.columns.items():
        if str(col.dtype) == "int64":
            df[c] = df[c].astype("int64")
        elif str(col.dtype) == "float64":
            df[c] = df[c].astype("float64")
    return df


# --------------------------------------------------------------------------- dataset
@dataclass
class DatasetResult:
    dir: Path
    included: list[str]
    excluded: dict[str, str]
    outcome: Outcome


def export_dataset(specs: list[RunSpec], paths: DataPaths) -> DatasetResult:
    """Assemble ``phantora_v0/`` from every run whose checks all passed.

    Writes runs.csv, flows_100ms.csv, windows.csv and a Parquet copy of each, atomically;
    validates the three tables with the v1 pandera contract first (nothing is written if a
    table breaks it). Rows are sorted, so a rebuild is byte-identical.
    """
    included, excluded = [], {}
    runs, bins, wins = [], [], []
    for spec in sorted(specs, key=lambda s: s.run_id):
        folder = paths.run_folder(spec)
        if not run_passed(folder):
            from phantora_assets.lib.checks_log import read_checks
            bad = {k: v.get("status", "missing") for k, v in read_checks(folder).items() if v.get("status") != "passed"}
            missing = [k for k in RUN_CHECKS if k not in read_checks(folder)]
            excluded[spec.run_id] = ", ".join([f"{k}: {v}" for k, v in bad.items()] + [f"{k}: missing" for k in missing])
            continue
        included.append(spec.run_id)
        runs.append(pd.read_parquet(paths.table(spec.run_id, "run_summary")))
        b = pd.read_parquet(paths.table(spec.run_id, "flows_100ms"))
        bins.append(b)
        wins.append(pd.read_parquet(paths.table(spec.run_id, "windows")))
    runs_df = runs_frame([]) if not runs else pd.concat(runs, ignore_index=True)
    bins_df = pd.concat(bins, ignore_index=True) if bins else pd.DataFrame({c: [] for c in schemas.FLOWS_100MS.columns})
    wins_df = pd.concat(wins, ignore_index=True) if wins else None
    outcomes = [
        _contract_outcome("runs", schemas.RUNS, runs_df),
        _contract_outcome("flows_100ms", schemas.FLOWS_100MS, bins_df),
    ]
    if wins_df is not None:
        outcomes.append(_contract_outcome("windows", schemas.windows_schema(), wins_df))
    ok = all(o.passed for o in outcomes)
    msg = "; ".join(o.message for o in outcomes)
    outcome = Outcome("dataset_contract", ok, msg, {"runs": len(included), "excluded": len(excluded)})
    d = paths.dataset_dir
    if ok:
        tables = {"runs": runs_df, "flows_100ms": bins_df}
        if wins_df is not None:
            tables["windows"] = wins_df
        for name, df in tables.items():
            with atomic_path(d / f"{name}.csv") as tmp:
                df.to_csv(tmp, index=False, float_format="%.10g", lineterminator="\n")
            _write_parquet(df, d / f"{name}.parquet")
        listing = ["run_id,status,reason"] + [f"{r},included," for r in included] + \
                  [f'{r},excluded,"{why}"' for r, why in excluded.items()]
        atomic_write_text(d / "run_status.csv", "\n".join(listing) + "\n")
    return DatasetResult(d, included, excluded, outcome)
