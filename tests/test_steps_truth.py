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
from hypothesis import example, given, settings
from hypothesis import strategies as st
from run_folders import analytic
from test_steps import COMMS, DP_COUNT, N_ITER, TP_COUNT, FlowBuilder, build_run, iteration_lengths

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
    _spec, raw, _iters = analytic("phantora_a100_40g_W4_2x1")
    path = tmp_path_factory.mktemp("w4") / "timeline.json.gz"
    write_chrome_trace(raw, path)
    return read_trace(path, compute_events=True)


def test_logging_all_reduce_every_fifth_step_without_run_log(w4_trace):
    """Finding 1: one extra 1-element all-reduce every 5th iteration (8 events added to 1,199) made
    the steps 5 iterations long (0.8235 s, 3 steady steps). The compute rhythm re-cuts them: the
    20 iterations, the step time of the clean trace, and the blocking steps_match check names
    the steps that carry the extra call."""
    f, ce = w4_trace.flows, w4_trace.compute_events
    clean = detect_steps(f, compute=ce)
    assert len(clean.steps) == 20 and len(clean.steady_steps) == 19
    assert clean.step_time_us == pytest.approx(164653.185, abs=1e-3)
    loss = f[(f["op"] == "all_reduce") & (f["count"] == 1)].sort_values("ts_us")
    extra = loss.groupby("comm_rank").nth([0, 5, 10, 15]).copy()
    extra["ts_us"] += 1.0
    extra["flow_id"] += 10**6
    assert len(extra) == 8
    g = pd.concat([f, extra], ignore_index=True)
    with pytest.raises(StepDetectionError) as ei:  # flows alone: 5x before; now refused, named
        detect_steps(g)
    assert ei.value.rule == "steps ambiguous"
    assert "period of 36 calls" in ei.value.detail and "block of 7 calls" in ei.value.detail
    sr = detect_steps(g, compute=ce)
    assert len(sr.steps) == 20 and sr.steady_steps == list(range(1, 20))
    assert sr.step_time_us == clean.step_time_us
    assert sr.network_bytes_per_step == clean.network_bytes_per_step == 11_538_751_496
    by_name = {o.name: o for o in run_trace_checks(g, sr)}
    assert not by_name["steps_match"].passed
    assert by_name["steps_match"].observed["mismatched_steps"] == [5, 10, 15]
    assert "step 5, communicator" in by_name["steps_match"].message
    assert "all_reduce count=1 F32 has 4 flows, the other steps have 2" in by_name["steps_match"].message
    assert by_name["steady_steps_stable"].observed["steps_with_other_bytes"] == [5, 10, 15]


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


def _half_step_run(n_iter=N_ITER):
    """TP and DP each issue 2 equal all-reduces per iteration, in the order TP DP TP DP: the
    half-steps are ordered in time and every communicator agrees on them."""
    fb = FlowBuilder()
    tp, dp = "0000000000000f31", "0000000000000f32"
    for it in range(n_iter):
        t = it * T
        for k in range(2):
            fb.ring(tp, [0, 1], "all_reduce", TP_COUNT, "Bf16", t + 100 + 5000 * k, 40)
            fb.ring(dp, [0, 2], "all_reduce", DP_COUNT, "Bf16", t + 2000 + 5000 * k, 1000)
    # forward, backward, optimizer: the iteration is the compute period
    ce = compute_events([it * T for it in range(n_iter)], [(0, 1500), (2500, 2000), (5200, 1500), (8000, 900)])
    return fb.frame(), ce


def test_ordered_half_steps_take_the_compute_rhythm():
    flows, ce = _half_step_run()
    assert len(detect_steps(flows).steps) == 2 * N_ITER  # flows alone cannot tell
    sr = detect_steps(flows, compute=ce)
    assert len(sr.steps) == N_ITER and sr.step_time_us == T
    assert sr.steps["start_us"].tolist() == [it * T + 100 for it in range(N_ITER)]
    assert all(o.passed for o in run_trace_checks(flows, sr))


def test_two_equal_buckets_on_one_communicator_take_the_compute_rhythm():
    fb = FlowBuilder()
    dp = "0000000000000f41"
    for it in range(N_ITER):
        for k in range(2):
            fb.ring(dp, [0, 2], "all_reduce", DP_COUNT, "Bf16", it * T + 4000 + 3000 * k, 500)
    flows = fb.frame()
    ce = compute_events([it * T for it in range(N_ITER)], [(0, 3000), (3100, 2000), (8000, 700)])
    for sr in (detect_steps(flows), detect_steps(flows, compute=ce)):
        # flows alone: buckets 3000 us apart in a 10000 us iteration make no rhythm of steps of 1 call
        assert len(sr.steps) == N_ITER and sr.step_time_us == T and sr.periods == {dp: 2}


def test_compute_rhythm_that_fits_no_cut_is_refused():
    """Compute periods of 1.5 steps: neither a multiple nor a fraction -- refused, named."""
    flows = build_run()
    ce = compute_events([k * 1.5 * T for k in range(14)], [(0, 100), (300, 250)])
    with pytest.raises(StepDetectionError) as ei:
        detect_steps(flows, compute=ce)
    assert ei.value.rule == "steps disagree with compute"
    assert "compute periods of 15000.000 us" in ei.value.detail


# ---- property: generated runs with a known truth -------------------------------------------------

_PATTERN = st.one_of(
    st.lists(st.integers(0, 3), min_size=1, max_size=4),
    st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=2), st.integers(2, 3)).map(lambda bm: bm[0] * bm[1]),
)
_NO_JITTER = [0.0] * 8
_PLAIN = {"cut": None, "with_compute": True}
_FLOWS_ONLY = {"cut": None, "with_compute": False}
_CUT_FLOWS_ONLY = {"cut": 0.3, "with_compute": False}


def _generated_run(patterns, reps, warmup_noise, extra, jitter, seed, extra_at=950.0):
    """The property's run (its docstring): ``(flows, compute events, iteration starts, end)``; the
    extra call ``extra_at`` us into its iteration, 50 us before the next one's first call by default."""
    fb = FlowBuilder({r: r % 2 for r in range(4)})
    comms = [f"00000000000d{i:04x}" for i in range(len(patterns))]
    ranks = [0, 1, 2, 3]
    for k, tok in enumerate(warmup_noise):
        fb.ring(comms[0], ranks, "all_reduce", tok + 1, "Bf16", 5.0 * k, 0)
    starts, t = [], 500.0
    for it in range(reps):
        starts.append(t)
        for c, (comm, pattern) in enumerate(zip(comms, patterns)):
            for k, tok in enumerate(pattern):
                fb.ring(comm, ranks, "all_gather", 10 * (c + 1) + tok, "F32", t + 40 * c + 120 * k, 1)
        if extra is not None and extra[0] < len(comms) and it % extra[1] == 0:
            fb.ring(comms[extra[0]], ranks, "all_reduce", 1, "F32", t + extra_at, 0)
        t += 1000.0 * (1 + jitter[it % len(jitter)])
    flows = fb.frame(shuffle_seed=seed)
    ce = compute_events([s - 400 for s in starts], [(0, 150), (170, 60), (800, 90)], hosts=("host-1", "host-2"))
    return flows, ce, starts, t


@settings(max_examples=25, deadline=None)
@given(
    patterns=st.lists(_PATTERN, min_size=1, max_size=3),
    reps=st.integers(2, 12),
    warmup_noise=st.lists(st.integers(200, 203), min_size=0, max_size=3),
    extra=st.one_of(st.none(), st.tuples(st.integers(0, 2), st.integers(2, 5))),
    jitter=st.lists(st.floats(-0.02, 0.02), min_size=8, max_size=8),
    seed=st.integers(0, 2**16),
    cut=st.one_of(st.none(), st.floats(0.05, 0.95)),
    with_compute=st.booleans(),
)
# the patterns: an extra call every 5th step; repeated identical calls on every communicator
@example(patterns=[[0], [1]], reps=12, warmup_noise=[], extra=(0, 5), jitter=_NO_JITTER, seed=0, **_PLAIN)
@example(patterns=[[0, 0], [1, 1]], reps=10, warmup_noise=[], extra=None, jitter=_NO_JITTER, seed=0, **_PLAIN)
@example(patterns=[[0, 0]], reps=10, warmup_noise=[200], extra=None, jitter=_NO_JITTER, seed=0, **_PLAIN)
@example(patterns=[[0, 1, 2]], reps=2, warmup_noise=[], extra=None, jitter=_NO_JITTER, seed=0, **_PLAIN)
# found by this test: half-steps of a 2-iteration run; a 3-iteration run timed by its last step (500.5 us)
@example(patterns=[[0, 0]], reps=2, warmup_noise=[], extra=None, jitter=_NO_JITTER, seed=0, **_PLAIN)
@example(patterns=[[0]], reps=3, warmup_noise=[], extra=None, jitter=_NO_JITTER, seed=0, **_PLAIN)
# issue 13: cut inside the last iteration; flows only
@example(patterns=[[0, 1], [2]], reps=8, warmup_noise=[], extra=None, jitter=_NO_JITTER, seed=0, **_CUT_FLOWS_ONLY)
# issue 13 (attack13f): cut inside a pattern (two of three calls kept; two of four equal calls), the steps
# at the iteration starts
@example(
    patterns=[[0, 1, 2], [3]],
    reps=8,
    warmup_noise=[],
    extra=None,
    jitter=_NO_JITTER,
    seed=0,
    cut=0.2,
    with_compute=False,
)
@example(
    patterns=[[0, 1, 2], [3]],
    reps=8,
    warmup_noise=[],
    extra=None,
    jitter=_NO_JITTER,
    seed=0,
    cut=0.2,
    with_compute=True,
)
@example(
    patterns=[[0, 0, 0, 0]], reps=8, warmup_noise=[], extra=None, jitter=_NO_JITTER, seed=0, cut=0.2, with_compute=False
)
@example(patterns=[[0], [1]], reps=12, warmup_noise=[], extra=(1, 5), jitter=_NO_JITTER, seed=0, **_FLOWS_ONLY)
# found by the random profile (seed 3): 6 equal calls 120 us apart, 2 iterations, flows only: not 12 steps
@example(patterns=[[0] * 6], reps=2, warmup_noise=[], extra=None, jitter=_NO_JITTER, seed=0, **_FLOWS_ONLY)
# found by the random profile (seeds 3, 4, 6): an extra call every 2nd / 3rd iteration 50 us before the
# next one (test_occasional_call_before_the_next_step_stays_in_its_own, ..._recut_by_compute_...)
@example(patterns=[[0], [0]], reps=12, warmup_noise=[], extra=(0, 3), jitter=_NO_JITTER, seed=0, **_FLOWS_ONLY)
@example(patterns=[[0], [0]], reps=9, warmup_noise=[], extra=(0, 2), jitter=_NO_JITTER, seed=0, **_FLOWS_ONLY)
@example(patterns=[[0]], reps=9, warmup_noise=[], extra=(0, 3), jitter=_NO_JITTER, seed=0, **_PLAIN)
def test_property_steps_are_right_or_refused(patterns, reps, warmup_noise, extra, jitter, seed, cut, with_compute):
    """1-3 communicators with their own per-step patterns (a pattern may repeat identical calls),
    a noisy warm-up, optionally one extra 1-element call every k-th iteration on one of them,
    iteration lengths jittered by up to 2 %, and per host a compute pattern of three kernels per
    iteration. Truth: the iterations. The detector returns steps whose step time is the median
    iteration (within 3 %), at most one step per iteration, and when extra calls fall in steady
    steps the blocking steps_match check fails naming exactly those steps -- or it refuses
    (StepDetectionError). It never returns a multiple or a fraction of the step. Optionally the trace
    is cut inside its last iteration (``cut``: the share of it kept), and the Computation events
    are left out (``with_compute``): flows-only traces and cut-short ones must be right or refused
    too, every flow of a steady step in its own iteration."""
    flows, ce, starts, t = _generated_run(patterns, reps, warmup_noise, extra, jitter, seed)
    lengths = np.diff(starts + [t])
    primitive = [min(d for d in range(1, len(p) + 1) if p == p[:d] * (len(p) // d)) for p in patterns]
    if cut is not None and any(d < len(p) for d, p in zip(primitive, patterns)) and (warmup_noise or extra is not None):
        return  # left open: a cut inside a pattern repeated within the step, with warm-up (or extra) calls
    if cut is not None:  # the trace ends inside its last iteration
        end = starts[-1] + cut * (t - starts[-1])
        last = [sum(starts[-1] + 40 * c + 120 * k < end for k in range(len(p))) for c, p in enumerate(patterns)]
        if any(0 < n < len(p) for n, p in zip(last, patterns)) and (warmup_noise or extra is not None):
            return  # left open: a cut inside the pattern of a communicator with warm-up (or extra) calls
        flows = flows[flows["ts_us"] < end].reset_index(drop=True)
        ce = ce[ce["ts_us"] < end]
        lengths = lengths[:-1]
    try:
        sr = detect_steps(flows, compute=ce if with_compute else None)
    except StepDetectionError:
        return  # a refusal is allowed; a wrong answer is not
    assert len(sr.steps) <= reps
    iteration = np.searchsorted(np.asarray(starts), flows["ts_us"].to_numpy(), side="right") - 1
    step = sr.flows["step"].to_numpy()
    in_steady = step >= 0
    if cut is not None and extra is None:  # one step per iteration: each steady flow in its own
        offset = np.unique(step[in_steady] - iteration[in_steady])
        assert len(offset) <= 1, offset
        assert len(sr.steps) < reps or not len(offset) or offset[0] == 0, offset
    timed = sorted(lengths[1:-1]) if len(lengths) > 2 else sorted(lengths)
    lo, hi = timed[0], timed[-1]
    assert lo * 0.97 <= sr.step_time_us <= hi * 1.03, (sr.step_time_us, lo, hi)
    if extra is not None and extra[0] < len(patterns):
        # which iteration each steady step is (by its start), and which of them carry the extra call
        it_of = np.searchsorted(np.asarray(starts) - 1.0, sr.steps["start_us"].to_numpy(), side="right") - 1
        with_extra = [int(s) for s, i in zip(sr.steps["step"], it_of) if i % extra[1] == 0 and s in sr.steady_steps]
        without = [s for s in sr.steady_steps if s not in with_extra]
        by_name = {o.name: o for o in run_trace_checks(flows, sr)}
        if with_extra and without:
            assert not by_name["steps_match"].passed
            mism = set(by_name["steps_match"].observed["mismatched_steps"])
            assert mism in (set(with_extra), set(without))


@pytest.mark.parametrize(("reps", "every"), [(9, 2), (12, 3)])
def test_occasional_call_before_the_next_step_stays_in_its_own(reps, every):
    """Found by the random profile (seeds 4 and 6: every 2nd iteration; seed 3: every 3rd): two
    communicators with one call per iteration, 40 us apart, and an extra 1-element all-reduce on the
    first one at 950 us of every ``every``-th iteration of 1000 us, flows only. The first communicator
    is assigned by time and its calls open the steps; the extra call, 50 us before the next
    iteration's first call, opened that step: steps of 1050 and 950 us, a step time of 1050 us (every
    2nd iteration) -- silently wrong. It repeats no call that opens a step, so it ends its own."""
    patterns, extra = [[0], [0]], (0, every)
    flows, _ce, starts, _t = _generated_run(patterns, reps, [], extra, _NO_JITTER, 0)
    sr = detect_steps(flows)
    assert sr.steps["start_us"].tolist() == starts and sr.step_time_us == 1000.0
    assert sr.steady_steps == list(range(1, reps - 1))  # time-assigned: the last step is cut short
    extra_flows = (sr.flows["op"] == "all_reduce") & (sr.flows["count"] == 1)
    it = (sr.flows.loc[extra_flows, "ts_us"].to_numpy() - 500.0) // 1000.0
    assert (sr._period_step[extra_flows.to_numpy()] == it).all()  # in its own iteration's step
    by_name = {o.name: o for o in run_trace_checks(flows, sr)}
    assert by_name["steps_match"].observed["mismatched_steps"] == list(range(every, reps - 1, every))


@pytest.mark.parametrize("extra_at", [950.0, 500.0])
def test_occasional_call_between_iterations_stays_in_its_own_when_recut_by_compute(extra_at):
    """Found by the random profile (seeds 4 and 6): one communicator, one call per iteration and an
    extra one every 3rd: a 3-iteration period, re-cut at the compute rhythm. The boundaries were half
    the quiet time before the 3-iteration steps' first calls (500 us) ahead of every iteration: the
    extra call at 950 us (50 us before the next iteration) went to the next step; at 500 us (after
    the iteration's last kernel, before the next one's first) the boundary fell on it: steps of 500
    and 1500 us. The quiet time before every iteration's first call sets the boundaries now."""
    flows, ce, starts, _t = _generated_run([[0]], 9, [], (0, 3), _NO_JITTER, 0, extra_at=extra_at)
    sr = detect_steps(flows, compute=ce)
    assert sr.steps["start_us"].tolist() == starts and sr.step_time_us == 1000.0
    assert sr.steps["duration_us"].tolist()[:-1] == [1000.0] * 8 and sr.steady_steps == list(range(1, 9))
    by_name = {o.name: o for o in run_trace_checks(flows, sr)}
    assert by_name["steps_match"].observed["mismatched_steps"] == [3, 6]


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
