"""Issue 13: steps that are right, or a refusal -- never a silent multiple or fraction of the step.

Traces with a known ground truth: the analytic a100_40g W4 2x1 trace with a logging all-reduce
every 5th iteration, a start-up barrier that repeats, half-steps every communicator agrees on,
two equal buckets on one communicator, and generated runs (several communicators with their own
patterns, repeated identical calls, occasional extras, jitter, warm-up, few steps) with the
Computation events of every host (``detect_steps(..., compute=...)``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from fixtures.run_folders import analytic
from fixtures.step_runs import COMMS, DP_COUNT, N_ITER, TP_COUNT, FlowBuilder, build_run, iteration_lengths
from hypothesis import strategies as st

from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.phantora.chrome_trace import read_trace, write_chrome_trace
from phantora_assets.lib.traffic.steps import detect_steps
from phantora_assets.lib.traffic.trace_checks import run_trace_checks

T = 10_000.0


def compute_events(starts, pattern, hosts=("host-1", "host-2")) -> pd.DataFrame:
    """Computation events: at every iteration start ``s``, ``(offset_us, dur_us)`` of ``pattern``."""
    rows = [(h, s + off, dur) for s in starts for off, dur in pattern for h in hosts]
    return pd.DataFrame(rows, columns=["host", "ts_us", "dur_us"])


@pytest.fixture(scope="module")
def w4_trace(tmp_path_factory):
    _spec, raw, iters = analytic("phantora_a100_40g_W4_2x1")
    path = tmp_path_factory.mktemp("w4") / "timeline.json.gz"
    write_chrome_trace(raw, path)
    return read_trace(path, compute_events=True), float(np.median(iters[1:])) * 1e6


def test_logging_all_reduce_every_fifth_step_is_refused_by_run_log(w4_trace):
    """Finding 1 of issue 13, under issue 28's rule: one extra 1-element all-reduce every 5th iteration
    (8 events added to 1,199) makes the finest partition every communicator repeats 5 iterations (the
    flows alone cannot tell it from an occasional collective: docs/STEPS.md, "Limits"); the compute
    rhythm never re-cuts it; run.log's 20 iterations refuse it, named."""
    trace, steady_us = w4_trace
    f, ce = trace.flows, trace.compute_events
    clean = detect_steps(f, compute=ce)
    assert len(clean.steps) == 20 and len(clean.steady_steps) == 19
    assert clean.step_time_us == pytest.approx(steady_us, rel=2e-3)  # the simulator's iterations
    loss = f[(f["op"] == "all_reduce") & (f["count"] == 1)].sort_values("ts_us")
    extra = loss.groupby("comm_rank").nth([0, 5, 10, 15]).copy()
    extra["ts_us"] += 1.0
    extra["flow_id"] += 10**6
    assert len(extra) == 8
    g = pd.concat([f, extra], ignore_index=True)
    iterations_s = [clean.step_time_us / 1e6] * 20
    with pytest.raises(StepDetectionError) as ei:
        detect_steps(g, compute=ce, iteration_s=iterations_s)
    assert ei.value.rule == "steps disagree with run.log"
    assert "run.log reports 20 iterations" in ei.value.detail


def test_start_up_barrier_repeating_is_not_the_step():
    """Finding: a communicator that repeats 3+ times during start-up only gave 1-us steps."""
    flows = build_run(shuffle_seed=None)
    fb = FlowBuilder()
    for k in range(4):
        fb.ring(COMMS["init"][0], COMMS["init"][1], "all_reduce", 1, "F32", 1.0 + k, 0)
    extra = fb.frame()
    extra["flow_id"] += 100_000
    sr = detect_steps(pd.concat([flows, extra], ignore_index=True))
    assert len(sr.steps) == N_ITER and sr.step_time_us == T
    assert sr.steady_steps == list(range(1, N_ITER))


# ---- property: generated runs with a known truth -------------------------------------------------

_PATTERN = st.one_of(
    st.lists(st.integers(0, 3), min_size=1, max_size=4),
    st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=2), st.integers(2, 3)).map(lambda bm: bm[0] * bm[1]),
)
_NO_JITTER = [0.0] * 8
_PLAIN = {"cut": None, "with_compute": True}
_FLOWS_ONLY = {"cut": None, "with_compute": False}
_CUT_FLOWS_ONLY = {"cut": 0.3, "with_compute": False}


# ---- a trace cut short inside its last iteration; time-assigned sequences (ground truth) ---------


def _megatron_cut(cut_us=None):
    """TP groups [batch broadcast, 2 equal all-reduces], DP groups 2 equal buckets, a world
    all-reduce, per iteration of test_steps.iteration_lengths(); flows from ``cut_us`` on dropped.
    Returns (flows, iteration of every flow)."""
    rng = np.random.default_rng(0)
    fb, starts, t0 = FlowBuilder(), [], 0.0
    for length in iteration_lengths():
        starts.append(t0)
        for name in ("tp0", "tp1"):
            fb.bcast(*COMMS[name], 0, 1024, "I64", t0 + 500, 2)
            for off in (1000, 3000):
                fb.ring(*COMMS[name], "all_reduce", TP_COUNT, "Bf16", t0 + off + rng.uniform(0, 20), 40)
        for name in ("dp0", "dp1"):
            for off in (6000, 7500):
                fb.ring(*COMMS[name], "all_reduce", DP_COUNT, "Bf16", t0 + off + rng.uniform(0, 20), 1000)
        fb.ring(*COMMS["world"], "all_reduce", 1, "F32", t0 + 8500 + rng.uniform(0, 20), 0)
        t0 += length
    f = fb.frame()
    if cut_us is not None:
        f = f[f["ts_us"] < cut_us].reset_index(drop=True)
    return f, np.searchsorted(np.asarray(starts), f["ts_us"].to_numpy(), side="right") - 1


def test_trace_cut_inside_its_last_iteration_keeps_every_flow_in_its_step():
    """Cut at 213.1 ms, inside iteration 19 (after its TP calls): each communicator's sequence was
    aligned to its own end, so the DP and world calls (12 flows per step) went to the next step,
    silently. The sequences that lack the last step and have no warm-up call are numbered from the
    first step: every flow is in its iteration, and the cut-short last step is not steady."""
    f, it = _megatron_cut(213_100.0)
    sr = detect_steps(f)
    assert len(sr.steps) == N_ITER and sr.steady_steps == list(range(1, N_ITER - 1))
    assert not sr.steps["steady"].iloc[-1]
    step = sr._period_step
    assert (step == it).all()
    assert (sr.flows["step"].to_numpy() == np.where((it >= 1) & (it < N_ITER - 1), it, -1)).all()
    assert sr.step_time_us == pytest.approx(T, abs=10)
    assert sr.timed_steps == sr.steady_steps  # the cut-short step's start ends the last steady one
    assert all(o.passed for o in run_trace_checks(f, sr))


def test_time_assigned_sequence_before_the_anchor_keeps_its_iteration():
    """16 identical sends per iteration (a MoE all-to-all: assigned to steps by time), issued before
    the DP all-reduce that cuts the steps: they went to the previous step (and the first iteration's
    to none). Calls before the anchors' first call open a step: each send is in its iteration."""
    fb, ep, dp, step_us = FlowBuilder(), "0000000000000e01", "0000000000000d01", 5000.0
    for it in range(N_ITER):
        for k in range(16):
            fb.send(ep, [0, 1, 2, 3], 0, 2, 512, "Bf16", it * step_us + 100 + 50 * k, 3)
        fb.ring(dp, [0, 2], "all_reduce", 2048, "Bf16", it * step_us + 2000, 10)
    f = fb.frame()
    sr = detect_steps(f)
    assert sr.periods == {dp: 1, ep: 16} and len(sr.steps) == N_ITER and sr.step_time_us == step_us
    assert (sr._period_step == (f["ts_us"].to_numpy() // step_us).astype(np.int64)).all()
    assert sr.steps["start_us"].tolist() == [it * step_us + 100 for it in range(N_ITER)]


def test_eval_kernel_every_fifth_iteration_keeps_the_20_steps(w4_trace):
    """Issue 28, first finding: an evaluation pass every 5th iteration (a 1 ms extra kernel on every host,
    the later iterations 1 ms later, no extra collective) was read as 5-iteration steps (5x the time and
    the bytes). The communicators repeat every iteration exactly: 20 steps, the eval steps outliers."""
    f, ce = w4_trace[0].flows.copy(), w4_trace[0].compute_events.copy()
    clean = detect_steps(f, compute=ce)
    starts = clean.steps["start_us"].to_numpy()
    evals = starts[[5, 10, 15]] - 1000.0  # the eval pass ends each 5th iteration (before steps 5, 10, 15)
    shift = lambda ts: ts + 1000.0 * np.searchsorted(evals, ts, side="right")
    f["ts_us"] = shift(f["ts_us"].to_numpy())
    ce["ts_us"] = shift(ce["ts_us"].to_numpy())
    extra = pd.DataFrame(
        [(h, t + 1000.0 * k, 1000.0) for k, t in enumerate(evals) for h in ce["host"].unique()], columns=ce.columns
    )
    ce = pd.concat([ce, extra], ignore_index=True)
    sr = detect_steps(f, compute=ce)
    assert len(sr.steps) == 20 and sr.steady_steps == list(range(1, 20))
    assert sr.network_bytes_per_step == clean.network_bytes_per_step
    assert sr.step_time_us == pytest.approx(clean.step_time_us, rel=1e-3)  # 3 of 18 timed steps 1 ms longer
    assert sr.steps.loc[[4, 9, 14], "duration_us"].tolist() == pytest.approx(
        (clean.steps.loc[[4, 9, 14], "duration_us"] + 1000.0).tolist()
    )


def test_logging_all_reduce_every_fifth_step_with_compute_is_refused(w4_trace):
    """The same 5-iteration steps with the Computation events: they last 5 compute periods, refused
    (``steps disagree with compute``), never re-cut at the compute rhythm."""
    f, ce = w4_trace[0].flows, w4_trace[0].compute_events
    loss = f[(f["op"] == "all_reduce") & (f["count"] == 1)].sort_values("ts_us")
    extra = loss.groupby("comm_rank").nth([0, 5, 10, 15]).copy()
    extra["ts_us"] += 1.0
    extra["flow_id"] += 10**6
    g = pd.concat([f, extra], ignore_index=True)
    assert len(detect_steps(g).steps) == 4  # flows alone: the rule's answer (docs/STEPS.md, "Limits")
    with pytest.raises(StepDetectionError) as ei:
        detect_steps(g, compute=ce)
    assert ei.value.rule == "steps disagree with compute"
    assert "last 5.00 compute periods" in ei.value.detail
