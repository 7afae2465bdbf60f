"""Issue 28, item 2: run.log's iteration records (``run_log.json``: run.log parsed, or the analytic
simulator's own iteration marks) are passed into the step detector by the ``validated_flows`` stage, where
they select among the communicators' candidates (docs/STEPS.md, evidence 1). Real files: an analytic W1
trace written by the project's writer, a run.log in Megatron's own format parsed by ``read_run_log``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures.run_folders import analytic, megatron_log

from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.phantora.chrome_trace import write_chrome_trace
from phantora_assets.lib.phantora.run_log import read_run_log
from phantora_assets.paths import DataPaths
from phantora_assets.records import RunLogRecord, write_record
from phantora_assets.stages.flows import validate_flows

W1 = "phantora_a100_40g_W1_2x2"  # 2 hosts, 20 iterations of ~67 ms


def _every_kth_extra_collective(raw: pd.DataFrame, iteration_s: list[float], k: int) -> pd.DataFrame:
    """Edit: in every ``k``-th iteration, the first 1-element all-reduce (all its events) is issued once more
    with 2 elements, 1 us later: an occasional collective (a logging all-reduce every ``k`` iterations)."""
    ends = np.cumsum(np.asarray(iteration_s) * 1e9)
    it = np.searchsorted(ends, raw["start_ns"].to_numpy(), side="right")
    small = (raw["kind"] == "communication").to_numpy() & (raw["count"].to_numpy() == 1)
    extra = []
    for i in range(k - 1, len(iteration_s), k):
        m = small & (it == i)
        first = raw["start_ns"].to_numpy()[m].min()
        e = raw[m & (raw["start_ns"].to_numpy() == first)].copy()
        e["start_ns"] += 1000
        e["end_ns"] += 1000
        e["count"] *= 2
        e["bytes"] *= 2
        extra.append(e)
    out = pd.concat([raw, *extra], ignore_index=True)
    out["event_id"] = np.arange(len(out))
    return out.sort_values(["start_ns", "event_id"], kind="stable").reset_index(drop=True)


def _run(tmp_path: Path, iteration_s_log: list[float] | None, edit=None):
    """The W1 trace (edited by ``edit``) on disk and, when ``iteration_s_log`` is given, run.log in
    Megatron's format parsed into ``run_log.json`` as an import writes it; then the validated_flows stage."""
    spec, raw, iteration_s = analytic(W1)
    if edit is not None:
        raw = edit(raw, iteration_s)
    trace = tmp_path / "timeline.json.gz"
    write_chrome_trace(raw, trace)
    paths = DataPaths(tmp_path / "data")
    if iteration_s_log is not None:
        log = tmp_path / "run.log"
        log.write_text(megatron_log(iteration_s_log, ranks=4, peak_mib=30000.0))
        parsed = read_run_log(log)
        pdir = paths.partition_dir(spec.run_id)
        pdir.mkdir(parents=True, exist_ok=True)
        write_record(pdir / "run_log.json", RunLogRecord(run_id=spec.run_id, present=True, **parsed.as_dict()))
    return spec, paths, trace, iteration_s


def test_the_runs_own_run_log_agrees_and_its_steps_are_its_iterations(tmp_path):
    spec, paths, trace, iteration_s = _run(tmp_path, None)
    _, paths, trace, _ = _run(tmp_path, iteration_s)
    result = validate_flows(spec, paths, trace)
    assert all(o.passed for o in result.outcomes if o.severity != "warn"), [o.message for o in result.outcomes]
    summary = json.loads((paths.partition_dir(spec.run_id) / "trace_summary.json").read_text())
    med_us = float(np.median(iteration_s[1:])) * 1e6
    assert abs(summary["step_time_us"] / med_us - 1.0) < 0.01
    steps = pd.read_parquet(paths.partition_dir(spec.run_id) / "steps.parquet")
    assert len(iteration_s) - 2 <= len(steps) <= len(iteration_s)


def test_run_log_iterations_reach_the_detector_and_refuse_k_iteration_steps(tmp_path):
    """An all-reduce every 4th iteration makes 4-iteration steps by the communicators alone; run.log's
    20 iterations contradict them inside the detector (rule ``steps disagree with run.log``, naming both),
    before the compute rhythm or the check after detection is asked."""
    edit = lambda raw, it: _every_kth_extra_collective(raw, it, 4)
    spec, paths, trace, iteration_s = _run(tmp_path, None)
    _, paths, trace, _ = _run(tmp_path, iteration_s, edit)
    with pytest.raises(StepDetectionError) as ei:
        validate_flows(spec, paths, trace)
    assert ei.value.rule == "steps disagree with run.log", str(ei.value)
    assert "run.log reports 20 iterations" in str(ei.value)
    assert not (paths.partition_dir(spec.run_id) / "flows.parquet").exists()


def test_without_run_log_the_compute_rhythm_refuses_them(tmp_path):
    """The same trace without run.log: the Computation events (4 compute periods a step) refuse it."""
    edit = lambda raw, it: _every_kth_extra_collective(raw, it, 4)
    spec, paths, trace, _ = _run(tmp_path, None, edit)
    with pytest.raises(StepDetectionError) as ei:
        validate_flows(spec, paths, trace)
    assert ei.value.rule == "steps disagree with compute", str(ei.value)
