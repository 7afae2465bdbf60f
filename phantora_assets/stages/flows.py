"""Stages of group ``flows``: validated network flows with steps, and the binned build at the run's
``bin_s`` (no Dagster import; the per-run file keeps v1's name at any width).

    validate_flows -> partitions/<run_id>/{flows,steps,step_flows,compute_events}.parquet,
                      trace_summary.json, cross_check.json
    bin_flows      -> partitions/<run_id>/flows_100ms.parquet
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from phantora_assets.checks import BINS_CONSERVE_BYTES, MATCHES_WORKLOAD_MODEL, TRACE_CHECKS, reset_checks
from phantora_assets.lib.errors import RunMatrixError, TraceFormatError
from phantora_assets.lib.kineto.step_spans import steps_from_spans
from phantora_assets.lib.net import nics
from phantora_assets.lib.phantora import chrome_trace
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store import bin_table
from phantora_assets.lib.store.parquet import write_parquet, write_parquet_frames
from phantora_assets.lib.traffic import binning, steps, trace_checks
from phantora_assets.lib.traffic.cross_check import cross_check
from phantora_assets.lib.workload.collectives import comm_groups
from phantora_assets.outcomes import Outcome, StageResult, record
from phantora_assets.paths import DataPaths
from phantora_assets.records import (
    CrossCheckRecord,
    RunLogRecord,
    TraceSummary,
    read_record,
    read_record_or_none,
    write_record,
)
from phantora_assets.sources import get_source
from phantora_assets.stages.common import CONTROL_BYTES_PER_S, WINDOW_S, jsonable, release_memory


def read_input(spec: RunSpec, paths: DataPaths, trace_path: Path | None = None) -> chrome_trace.ParsedTrace:
    """The run's flows and compute as tables: the source's own (``flow_tables(spec, paths)``: the analytic
    simulator's raw timeline, ``lib/phantora/raw_tables.py``, equal to what its Chrome JSON parses to), else
    its Chrome trace parsed (``trace_path``, default the run folder's ``timeline.json.gz``), with every
    Computation event.

    Raises:
        TraceFormatError: the input breaks a rule of the trace format (names the file and the rule).
    """
    tables = getattr(get_source(spec.source), "flow_tables", None) if trace_path is None else None
    if tables is not None:
        return tables(spec, paths)
    return chrome_trace.read_trace(trace_path or paths.chrome_trace(spec), compute_events=True)


def _outcome(o: trace_checks.CheckOutcome, trace: Path | None = None) -> Outcome:
    """A trace rule's outcome; a failed one's message starts with the trace file."""
    meta = {f"observed_{k}": v for k, v in o.observed.items()}
    meta.update({f"expected_{k}": v for k, v in o.expected.items()})
    message = o.message if o.passed or trace is None else f"{trace}: {o.message}"
    return Outcome(o.name, bool(o.passed), message, jsonable(meta))


def validate_flows(spec: RunSpec, paths: DataPaths, trace_path: Path | None = None) -> StageResult:
    """Read the run's flows (:func:`read_input`: the source's tables, else its Chrome JSON), detect steps,
    run the four trace rules.

    Writes ``flows.parquet`` (network flows, src_node != dst_node, with ``step``),
    ``steps.parquet``, ``step_flows.parquet`` (the chosen steady step's network flows, the
    input of the build), ``compute_events.parquet`` (host, ts_us, dur_us of every Computation
    event: the step anatomy's input) and ``trace_summary.json`` -- only when every trace rule holds. A
    broken trace rule (e.g. no network flow, two group sizes on one communicator) is a failed
    blocking check whose message names the trace file; nothing is written then (files of an
    earlier materialization stay as they were) and nothing downstream runs.

    Raises:
        TraceFormatError / StepDetectionError: the trace breaks a format rule (names the file
            and the rule); nothing is written.
    """
    reset_checks(paths.run_folder(spec), "validated_flows")
    parsed = read_input(spec, paths, trace_path)
    src = parsed.path
    flows = parsed.flows
    release_memory()  # the decoder's batches: the step detector's temporaries come on top of what is left
    _refuse_flows_longer_than_the_window(flows, src)
    exists = trace_checks.flows_exist(flows)
    if not exists.passed:  # nothing to detect steps on: report the rule, evaluate no other
        why = f"flows_exist failed: {exists.message}"
        outcomes = [_outcome(exists, src)] + [
            Outcome(name, False, f"{src}: not evaluated: {why}") for name in TRACE_CHECKS if name != exists.name
        ]
        outcomes.append(_not_cross_checked(why))
        record(paths, spec, "validated_flows", outcomes)
        return StageResult(None, {"status": "failed checks", "n_flows": int(len(flows))}, outcomes)
    run_log = read_record_or_none(paths.partition_dir(spec.run_id) / "run_log.json", RunLogRecord)
    result = _detect_steps(spec, paths, flows, src, parsed.compute_events, run_log)
    logged = trace_checks.steps_match_run_log(
        result, run_log.iteration_s if run_log else [], run_log.precise if run_log else False
    )
    outcomes = [_outcome(o, src) for o in [*trace_checks.run_trace_checks(flows, result), logged]]
    if not all(o.passed for o in outcomes):
        outcomes.append(_not_cross_checked("a trace rule failed"))
        record(paths, spec, "validated_flows", outcomes)
        return StageResult(None, {"status": "failed checks", "n_flows": int(len(flows))}, outcomes)
    groups = comm_groups(spec, result.flows)
    outcomes.append(_cross_check_outcome(spec, paths, result, groups))

    is_net = (result.flows["src_node"] != result.flows["dst_node"]).to_numpy()
    chosen = chosen_step(result)
    step_flows = result.step_flows(chosen, network_only=True)
    pdir = paths.partition_dir(spec.run_id)
    frames = _network_frames(result.flows, is_net, groups)
    write_parquet_frames(frames, pdir / "flows.parquet", chunk_rows=FLOW_CHUNK_ROWS)
    write_parquet(result.steps, pdir / "steps.parquet")
    write_parquet(step_flows, pdir / "step_flows.parquet")
    write_parquet(parsed.compute_events, pdir / "compute_events.parquet")
    write_parquet(nics.members(result.flows), pdir / "comm_members.parquet")  # all flows, loopback ones too
    summary = TraceSummary(
        run_id=spec.run_id,
        trace=str(src.name),
        step_time_us=float(result.step_time_us),
        network_bytes_per_step=int(result.network_bytes_per_step),
        n_steady_steps=len(result.steady_steps),
        chosen_step=chosen,
        n_flows=int(len(flows)),
        n_network_flows=int(is_net.sum()),
        periods={k: int(v) for k, v in result.periods.items()},
        compute_busy_us={r.host: float(r.busy_us) for r in parsed.compute.itertuples()},
        network_bytes_by_group=_bytes_by_group(result, is_net, groups),
    )
    write_record(pdir / "trace_summary.json", summary)
    record(paths, spec, "validated_flows", outcomes)
    meta = {
        "step_time_ms": round(result.step_time_us / 1000, 3),
        "network_bytes_per_step": int(result.network_bytes_per_step),
        "n_steady_steps": len(result.steady_steps),
        "n_network_flows": int(is_net.sum()),
        "n_communicators": int(flows["comm_id"].nunique()),
    }
    return StageResult(pdir / "flows.parquet", meta, outcomes)


#: How finely a run.log that is not ``precise`` prints its iteration times (two decimals, seconds).
LOG_RESOLUTION_S = 0.01

#: Rows of ``flows.parquet`` converted to Arrow at a time (one row group each beyond it).
FLOW_CHUNK_ROWS = 500_000


def _network_frames(flows: pd.DataFrame, is_net, groups: dict[str, str]) -> Iterator[pd.DataFrame]:
    """The rows of ``flows`` where ``is_net`` holds, a chunk at a time, with their communicator's
    parallelism ``group`` (``comm_groups``): the network-flow table is never copied whole (4.9 M
    flows of W3 16x8 at ep 128: three 713 MB copies before, for the boolean take, ``reset_index``
    and its block consolidation)."""
    for a in range(0, max(len(flows), 1), FLOW_CHUNK_ROWS):  # one frame at least: the columns
        part, keep = flows.iloc[a : a + FLOW_CHUNK_ROWS], is_net[a : a + FLOW_CHUNK_ROWS]
        part = part if keep.all() else part[keep]
        yield part.assign(group=part["comm_id"].map(groups).fillna("other").astype(object))


def _bytes_by_group(result: steps.StepResult, is_net, groups: dict[str, str]) -> dict[str, int]:
    """Network bytes of one steady step (mean over the steady steps) per parallelism group."""
    flows = result.flows
    steady = flows["step"].isin(list(result.steady_steps)).to_numpy() & is_net
    n = max(len(result.steady_steps), 1)
    per = flows.loc[steady, ["comm_id", "bytes"]].groupby("comm_id", sort=False)["bytes"].sum()
    out: dict[str, int] = {}
    for cid, b in per.items():
        g = groups.get(str(cid), "other")
        out[g] = out.get(g, 0) + int(b)
    return {g: out[g] // n for g in sorted(out)}


def _detect_steps(
    spec: RunSpec,
    paths: DataPaths,
    flows: pd.DataFrame,
    src: Path,
    compute: pd.DataFrame,
    run_log: RunLogRecord | None = None,
) -> steps.StepResult:
    """Steps from the explicit iteration boundaries the input has, strongest first (docs/STEPS.md): a
    Kineto run's ``ProfilerStep#N`` spans (the source's ``profiler_steps``, ``lib/kineto/step_spans.py``)
    cut them; else the communicator rule (``lib/traffic/steps/``) with the iteration records of
    ``run_log`` (``run_log.json``: run.log's iterations, or the analytic simulator's own iteration marks)
    selecting among its candidates, and the compute rhythm of ``compute``."""
    marks = getattr(get_source(spec.source), "profiler_steps", None)
    spans = marks(paths, spec) if marks is not None else None
    if spans is None:
        iteration_s = list(run_log.iteration_s) if run_log is not None and run_log.present else None
        resolution_s = 0.0 if run_log is None or run_log.precise else LOG_RESOLUTION_S
        return steps.detect_steps(
            flows,
            source=str(src),
            compute=compute,
            iteration_s=iteration_s or None,
            iteration_resolution_s=resolution_s,
        )
    return steps_from_spans(flows, spans[0], spans[1], source=str(src), compute=compute)


def _refuse_flows_longer_than_the_window(flows, src: Path) -> None:
    """A flow cannot outlast the 180 s window it would be binned into (a ``dur`` of 1e11 us passed
    every check, then the build spread it over millions of bins for minutes).

    Raises:
        TraceFormatError: rule ``flow longer than the window``, naming the trace and the longest flow.
    """
    limit_us = WINDOW_S * 1e6
    dur = flows["dur_us"].to_numpy()
    if len(dur) and dur.max() > limit_us:
        i = int(dur.argmax())
        n = int((dur > limit_us).sum())
        raise TraceFormatError(
            src,
            "flow longer than the window",
            f"{n} flow(s) last longer than the {WINDOW_S:.0f} s window of the build; the longest, flow id "
            f"{int(flows['flow_id'].iloc[i])}, lasts {dur[i]:.6g} us",
        )


def _not_cross_checked(why: str) -> Outcome:
    return Outcome(MATCHES_WORKLOAD_MODEL, False, f"not evaluated: {why}", severity="warn")


def _cross_check_outcome(
    spec: RunSpec, paths: DataPaths, result: steps.StepResult, groups: dict[str, str] | None = None
) -> Outcome:
    """Advisory ``matches_workload_model`` (lib/traffic/cross_check.py); writes cross_check.json.
    ``groups``: ``comm_id -> group`` of the flows' communicators (``comm_groups``; None: computed)."""
    name = MATCHES_WORKLOAD_MODEL
    if not spec.workload:
        why = f"not applicable: a profiled run (source {spec.source}) has no workload model to compare with"
        return Outcome(name, True, why, severity="warn")
    try:
        cc = cross_check(spec, result.flows, list(result.steady_steps), groups=groups)
    except Exception as exc:  # the check is advisory: report, never fail the asset
        return Outcome(name, False, f"cross-check against the workload model could not run: {exc}", severity="warn")
    write_record(paths.partition_dir(spec.run_id) / "cross_check.json", CrossCheckRecord(**cc.as_dict()))
    meta = jsonable(cc.metadata())
    meta["breakdown_md"] = cc.markdown()
    return Outcome(name, cc.passed, cc.message, meta, severity="warn")


def chosen_step(result: steps.StepResult) -> int:
    """The steady step the 180 s build repeats (``trace_summary.json`` ``chosen_step``): one that carries the
    run's ``network_bytes_per_step`` (runs.csv ``inter_node_bytes_per_step``), timed and not an outlier when
    one such is, the nearest the step time, the first of equals. Where every steady step carries the same
    bytes, that is the timed step nearest the step time. Where an MoE all-to-all's routed sizes vary them
    (``trace_checks.routed_p2p``) it is the (lower) median step: the series then repeats the bytes runs.csv
    states (was the step nearest the step time whatever it carried: a routed Kineto MoE run's series
    repeated 220,528 B a step beside runs.csv's 216,432 B)."""
    st = result.steps[result.steps["steady"]]
    st = st[st["network_bytes"].to_numpy(dtype=np.int64) == int(result.network_bytes_per_step)]
    timed = set(getattr(result, "timed_steps", st["step"]))
    outlier = st["outlier"].to_numpy() != "" if "outlier" in st.columns else np.zeros(len(st), dtype=bool)
    key = pd.DataFrame(
        {
            "untimed": ~st["step"].isin(timed).to_numpy(),
            "outlier": outlier,
            "off": np.abs(st["duration_us"].to_numpy(dtype=np.float64) - float(result.step_time_us)),
            "step": st["step"].to_numpy(dtype=np.int64),
        }
    )
    return int(key.sort_values(["untimed", "outlier", "off", "step"], kind="mergesort")["step"].iloc[0])


def read_trace_summary(paths: DataPaths, run_id: str) -> TraceSummary:
    """The run's ``trace_summary.json`` (written by :func:`validate_flows`).

    Raises:
        RecordError: the file is missing or malformed (names it).
    """
    return read_record(paths.partition_dir(run_id) / "trace_summary.json", TraceSummary)


def bin_flows(spec: RunSpec, paths: DataPaths) -> StageResult:
    """The 180 s build at the run's ``bin_s`` of docs/DATASET.md ("How a trace becomes the dataset", steps 4-5);
    checks exact conservation (``bins_conserve_bytes``)."""
    reset_checks(paths.run_folder(spec), "binned_flows")
    summary = read_trace_summary(paths, spec.run_id)
    step_flows = pd.read_parquet(paths.table(spec.run_id, "step_flows"))
    if bin_table.is_sparse(spec.n_nodes, WINDOW_S, spec.bin_s):  # rows <= bins x the pairs that carry flows
        keys = step_flows["src_node"].to_numpy(np.int64) * spec.n_nodes + step_flows["dst_node"].to_numpy(np.int64)
        n_bins = int(round(WINDOW_S / spec.bin_s))
        if (why := bin_table.sparse_rows_rule(n_bins, len(np.unique(keys)))) is not None:
            raise RunMatrixError(f"run {spec.run_id} ({spec.layout}): bin table too large: {why}")
    built = binning.build_bins(
        step_flows,
        step_time_s=summary.step_time_us / 1e6,
        n_nodes=spec.n_nodes,
        run_id=spec.run_id,
        window_s=WINDOW_S,
        bin_s=spec.bin_s,
        control_bytes_per_s=CONTROL_BYTES_PER_S,
    )
    # exact sums (Python ints): an int64 sum of wrapped bins would equal a wrapped expected sum; a sparse
    # build's rows plus the control bytes of the rows it omits (bin_table.OMITTED_ROWS)
    total = built.binned_bytes()
    expected = int(built.placed_flow_bytes + built.control_bytes)
    fits = expected < trace_checks.INT64_LIMIT  # then no bin (nor any sum of bins) wrapped either
    ok = fits and total == expected
    outcome = Outcome(
        BINS_CONSERVE_BYTES,
        ok,
        (
            f"sum of flows_100ms bytes {total} equals placed flow bytes {built.placed_flow_bytes} + control bytes "
            f"{built.control_bytes}"
            if ok
            else f"bytes beyond int64: the window's placed flow bytes {built.placed_flow_bytes} + control bytes "
            f"{built.control_bytes} = {expected} exceed what an int64 holds ({trace_checks.INT64_LIMIT - 1}); "
            f"flows_100ms (int64 bytes) cannot hold them (its bins sum to {total})"
            if not fits
            else f"sum of flows_100ms bytes {total} differs from placed {built.placed_flow_bytes} + control "
            f"{built.control_bytes} = {expected} by {total - expected}"
        ),
        {
            "binned_bytes": total,
            "placed_flow_bytes": int(built.placed_flow_bytes),
            "control_bytes": int(built.control_bytes),
        },
    )
    out = paths.table(spec.run_id, "flows_100ms")
    if ok:  # a failed blocking check writes no data file; the table is written in chunks of bins
        if built.sparse is not None:
            bin_table.write_sparse_bins(built.sparse, spec.run_id, out)
        else:
            assert built.matrix is not None
            bin_table.write_bins(built.matrix, spec.run_id, spec.bin_s, spec.n_nodes, out)
    record(paths, spec, "binned_flows", [outcome])
    meta = {
        "rows": int(len(built.sparse.bytes) if built.sparse is not None else built.matrix.size),  # type: ignore[union-attr]
        "sparse": built.sparse is not None,
        "bytes": total,
        "n_repetitions": int(built.n_repetitions),
        "phase_s": float(built.phase_s),
        "seed": int(built.seed),
    }
    return StageResult(out if ok else None, meta, [outcome])
