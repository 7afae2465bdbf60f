"""Stages of group ``analysis``: step anatomy and plots (no Dagster import).

    step_anatomy_stage  -> partitions/<run_id>/{step_anatomy,step_spans}.parquet
    run_plots_stage     -> run folder plots/{pair_heatmap,timeseries,step_anatomy,link_utilisation}.png
    dataset_plots_stage -> phantora_v0/plots/{bytes_vs_published,step_time_by_layout}.png

None of them gates the dataset (``checks.CHECKS``: ``gates_dataset``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from phantora_assets.checks import ANATOMY_ADDS_UP, record_check, reset_checks
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store import bin_table, plots
from phantora_assets.lib.store.parquet import write_parquet
from phantora_assets.lib.traffic import anatomy
from phantora_assets.outcomes import Outcome, StageResult
from phantora_assets.paths import DataPaths
from phantora_assets.stages.common import WINDOW_S
from phantora_assets.stages.flows import read_trace_summary
from phantora_assets.stages.simulation import compute_hosts_of, timeline_scope_of

PUBLISHED_RUNS = Path(__file__).resolve().parent.parent / "published_runs.csv"
RUN_PLOTS = ("pair_heatmap", "timeseries", "step_anatomy", "link_utilisation")
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


#: Why a run's step_anatomy has no rows: its raw timeline holds no host's compute whole.
NO_COMPUTE_HOST = (
    "the raw timeline is of scope one rank a stage and holds no host's compute whole (simulation.json "
    "compute_hosts is empty: each host has a GPU that is not its stage's first rank and, the ranks of a stage "
    "not running alike or that first rank on another host, whose compute is not in it; docs/WORKLOADS.md "
    "'Scale'): no (step, host) rows"
)


def step_anatomy_stage(spec: RunSpec, paths: DataPaths) -> StageResult:
    """Compute vs exposed communication per (step, host) and the spans of the chosen steady step: every host,
    or for a run whose raw timeline is of scope ``one rank a stage`` (``simulation.json``) exactly the hosts
    whose compute it holds whole (``compute_hosts``, ``lib/workload/collectives.compute_hosts``): a host with a
    GPU whose compute is not in the timeline would read a C short of its own. None such: no rows, and the
    metadata's ``skipped`` says why (:data:`NO_COMPUTE_HOST`; the check passes, nothing to add up).

    Raises:
        RecordError: ``simulation.json`` is malformed, or scoped without ``compute_hosts`` (rebuild raw_timeline).
    """
    pdir = paths.partition_dir(spec.run_id)
    folder = paths.run_folder(spec)
    reset_checks(folder, "step_anatomy", (ANATOMY_ADDS_UP,))
    summary = read_trace_summary(paths, spec.run_id)
    steps = pd.read_parquet(pdir / "steps.parquet")
    flows = pd.read_parquet(pdir / "flows.parquet", columns=["ts_us", "dur_us", "src_node", "dst_node"])
    events = pdir / "compute_events.parquet"  # written with flows.parquet by validated_flows
    compute = pd.read_parquet(events) if events.exists() else anatomy.read_compute_events(paths.chrome_trace(spec))
    scope = timeline_scope_of(spec, paths)
    whole = compute_hosts_of(spec, paths)
    if whole is None:
        hosts = anatomy.hosts_of(flows, compute, spec.n_nodes)
    else:  # one rank a stage: the hosts whose compute the timeline holds whole (host order)
        hosts = sorted(whole, key=anatomy.node_of)
    intervals = anatomy.host_intervals(flows, compute, hosts)
    table = anatomy.step_anatomy(steps, flows, compute, hosts, intervals)
    chosen = int(summary.chosen_step)
    spans = anatomy.step_spans(steps[steps["step"] == chosen].iloc[0], flows, compute, hosts, intervals)
    write_parquet(table, pdir / "step_anatomy.parquet")
    write_parquet(spans, pdir / "step_spans.parquet")
    steady = table[table["timed"]]  # times: the steady steps whose end is their own (not cut by the trace's end)
    meta: dict[str, Any] = {"rows": len(table), "hosts": len(hosts), "chosen_step": chosen, "timeline_scope": scope}
    if whole is not None:
        meta["compute_hosts"] = ", ".join(hosts) or "none"
    if len(steady):
        meta.update(
            {
                "compute_ms": round(float(steady["compute_us"].mean()) / 1000, 3),
                "exposed_comm_ms": round(float(steady["exposed_comm_us"].mean()) / 1000, 3),
                "overlapped_comm_ms": round(float(steady["overlap_us"].mean()) / 1000, 3),
                "idle_ms": round(float(steady["idle_us"].mean()) / 1000, 3),
                "exposed_comm_share": round(float((steady["exposed_comm_us"] / steady["duration_us"]).mean()), 4),
            }
        )
    if hosts:
        outcome = anatomy_outcome(table, len(hosts))
    else:
        meta["skipped"] = NO_COMPUTE_HOST
        outcome = Outcome(ANATOMY_ADDS_UP, True, NO_COMPUTE_HOST, {"rows": 0, "max_residual_us": 0.0})
    record_check(folder, "step_anatomy", outcome.name, outcome.passed, outcome.message)
    return StageResult(pdir / "step_anatomy.parquet", meta, [outcome])


def anatomy_outcome(table: pd.DataFrame, n_hosts: int) -> Outcome:
    """``anatomy_adds_up``: compute + exposed + idle = step time per row; every host in every step."""
    resid = (table["compute_us"] + table["exposed_comm_us"] + table["idle_us"] - table["duration_us"]).abs()
    worst = float(resid.max()) if len(table) else 0.0
    sums_ok = bool((resid <= 1e-6 * table["duration_us"].clip(lower=1.0)).all())
    per_step = table.groupby("step")["host"].nunique()
    hosts_ok = bool((per_step == n_hosts).all())
    ok = sums_ok and hosts_ok and len(table) > 0
    if ok:
        msg = (
            f"{len(table)} (step, host) rows: compute + exposed communication + idle = step time "
            f"(max residual {worst:.3g} us)"
        )
    elif not len(table):
        msg = "no (step, host) rows"
    elif not sums_ok:
        msg = f"compute + exposed communication + idle differs from the step time by up to {worst:.3g} us"
    else:
        msg = f"steps with fewer than {n_hosts} hosts: {per_step[per_step != n_hosts].index.tolist()[:10]}"
    return Outcome(ANATOMY_ADDS_UP, ok, msg, {"rows": int(len(table)), "max_residual_us": worst})


def run_plots_stage(spec: RunSpec, paths: DataPaths, out: Path | None = None) -> PlotsResult:
    """The four per-run PNGs, in the run folder's ``plots/`` (or ``out``; ``link_utilisation`` from
    link_bins)."""
    t0 = time.perf_counter()
    pdir = paths.partition_dir(spec.run_id)
    out = paths.plots_dir(spec) if out is None else out
    summary = read_trace_summary(paths, spec.run_id)
    steps = pd.read_parquet(pdir / "steps.parquet")
    flows = pd.read_parquet(pdir / "flows.parquet", columns=["step", "src_node", "dst_node", "bytes"])  # pair_matrix's
    bins = bin_table.read_bins(pdir / "flows_100ms.parquet", spec.bin_s, int(round(WINDOW_S / spec.bin_s)))
    table = pd.read_parquet(pdir / "step_anatomy.parquet")
    spans = pd.read_parquet(pdir / "step_spans.parquet")
    chosen = int(summary.chosen_step)
    step_row = steps[steps["step"] == chosen].iloc[0]
    files = {name: out / f"{name}.png" for name in RUN_PLOTS}
    plots.pair_heatmap(plots.pair_matrix(flows, steps, spec.n_nodes), spec.run_id, files["pair_heatmap"])
    plots.timeseries(bins, spec.run_id, spec.bin_s, summary.step_time_us / 1e6, path=files["timeseries"])
    plots.step_anatomy_chart(
        spans,
        table[table["step"] == chosen],
        spec.run_id,
        chosen,
        float(step_row["end_us"] - step_row["start_us"]),
        path=files["step_anatomy"],
    )
    plots.link_utilisation(pdir / "link_bins.parquet", spec.run_id, path=files["link_utilisation"])  # by row group
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


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk; ValueError if ``data`` is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG file")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
