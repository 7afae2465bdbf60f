"""Step detection on synthetic runs built the way Phantora's ring model issues flows.

Synthetic run (``build_run``): 4 ranks on 2 hosts (ranks 0,1 on node 0; 2,3 on node 1).
Communicators: TP groups {0,1} and {2,3} (loopback only), DP groups {0,2} and {1,3}
(network), a world ring {0,1,2,3}, and an ``init`` communicator used once at start-up.
20 iterations; iteration 0 is a 3T warm-up that also broadcasts parameters (on the DP
groups and on the world ring, before its first step call). Steady iteration lengths
alternate T+5 and T-5 us, so the median step time is exactly T.

Steady-step counting (the documented decision): 20 steps, step 0 warm-up, steps 1..19
steady (19 steady steps, the last one included); ``step_time_us`` is the median of steps
1..18 because the last step's end is the end of its last flow, not a next step's start.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pandas as pd
import pytest
from fixtures.step_runs import (
    COMMS,
    DP_COUNT,
    FLOWS_PER_STEP,
    N_ITER,
    NET_BYTES_PER_STEP,
    TP_COUNT,
    FlowBuilder,
    T,
    build_run,
    iteration_lengths,
)

from phantora_assets.lib.columns import FLOW_COLUMNS, STEP_COLUMNS, STEP_FLOW_COLUMNS
from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.ring import hop_bytes
from phantora_assets.lib.traffic.steps import StepResult, detect_steps


@pytest.fixture(scope="module")
def clean_run():
    flows = build_run()
    return flows, detect_steps(flows, source="synthetic-run")


def test_clean_run_steps(clean_run):
    flows, sr = clean_run
    assert isinstance(sr, StepResult)
    assert list(sr.steps.columns) == list(STEP_COLUMNS)
    assert {c: str(t) for c, t in sr.steps.dtypes.items()} == {
        k: ("object" if v == "str" else v) for k, v in STEP_COLUMNS.items()
    }
    assert len(sr.steps) == 20
    assert sr.steady_steps == list(range(1, 20))  # 19 steady steps
    assert sr.timed_steps == list(range(1, 19))  # the last one is untimed
    assert sr.steps["steady"].tolist() == [False] + [True] * 19
    # the step table says which steps are timed (issue 38 item 3.3): the last ends at its last flow, not at
    # the next step's start (its calls are complete, its time is not: it stays steady, it is not timed)
    assert sr.steps["timed"].tolist() == [False] + [True] * 18 + [False]
    last = sr.steps.iloc[-1]
    assert last["end_us"] == flows["ts_us"].add(flows["dur_us"]).max() and last["duration_us"] < T
    assert sr.step_time_us == T
    assert sr.network_bytes_per_step == NET_BYTES_PER_STEP == 16_777_228
    assert (sr.steps.loc[sr.steps.steady, "network_bytes"] == NET_BYTES_PER_STEP).all()
    assert (sr.steps["n_flows"] == FLOWS_PER_STEP).all()
    # TP rank 0 issues [bcast, AR, AR] per step; rank 1 [AR, AR] (sub-period 1, reconciled to 2)
    assert sr.periods == {
        COMMS["tp0"][0]: 3,
        COMMS["tp1"][0]: 3,
        COMMS["dp0"][0]: 1,
        COMMS["dp1"][0]: 1,
        COMMS["world"][0]: 1,
    }
    # step boundaries: iteration starts + 500 us (first call, the TP batch broadcast)
    starts = np.cumsum([0.0] + iteration_lengths()[:-1]) + 500
    assert sr.steps["start_us"].tolist() == starts.tolist()
    d = sr.steps["duration_us"].to_numpy()
    assert d[0] == 3 * T and d[1] == T + 5 and d[2] == T - 5
    # last step: ends at the end of its last flow (world all-reduce, dur 0, at 8500 + jitter)
    last = sr.steps.iloc[-1]
    assert 8000 <= last.duration_us <= 8000 + 20
    assert last.end_us == pytest.approx(last.start_us + last.duration_us)


def test_flows_output_keeps_rows_and_marks_warmup(clean_run):
    flows, sr = clean_run
    out = sr.flows
    assert len(out) == len(flows)
    assert out.index.equals(flows.index)
    assert out["flow_id"].tolist() == flows["flow_id"].tolist()
    assert out["step"].dtype == np.int64
    warm = out[out.step == -1]
    # warm-up: init barrier (4) + world bcast (3) + 6 dp broadcasts + iteration 0 (18 flows)
    assert len(warm) == 4 + 3 + 6 + FLOWS_PER_STEP
    assert (warm["ts_us"] < 3 * T).all()
    assert sorted(out.loc[out.step >= 0, "step"].unique()) == list(range(1, 20))
    assert (out.groupby("step").size().drop(-1) == FLOWS_PER_STEP).all()


def test_input_flows_are_left_as_they_were():
    """The result shares the input's columns (not copied: issue 14, memory) and adds ``step`` to its
    own frame only."""
    flows = build_run()
    before = flows.copy()
    sr = detect_steps(flows, source="synthetic-run")
    assert "step" not in flows.columns and "step" in sr.flows.columns
    pd.testing.assert_frame_equal(flows, before)
    pd.testing.assert_frame_equal(sr.flows.drop(columns="step"), before)


def test_step_flows(clean_run):
    _, sr = clean_run
    f = sr.step_flows(5)
    assert list(f.columns) == list(STEP_FLOW_COLUMNS)
    assert (f["src_node"] != f["dst_node"]).all()
    assert int(f["bytes"].sum()) == NET_BYTES_PER_STEP
    assert len(f) == 2 * 2 + 2
    assert f["offset_us"].min() >= 6000 - 500 and f["offset_us"].max() <= 8500 - 500 + 20
    assert f["offset_us"].is_monotonic_increasing
    allf = sr.step_flows(5, network_only=False)
    assert len(allf) == FLOWS_PER_STEP and allf["offset_us"].min() == 0.0
    assert len(sr.step_flows(0, network_only=False)) == FLOWS_PER_STEP  # warm-up steps too
    with pytest.raises(KeyError):
        sr.step_flows(20)


def test_order_of_rows_does_not_matter(clean_run):
    _, sr = clean_run
    sr2 = detect_steps(build_run(shuffle_seed=123))
    pd.testing.assert_frame_equal(sr.steps, sr2.steps)
    assert sr2.periods == sr.periods and sr2.step_time_us == sr.step_time_us


def test_without_warmup_broadcasts_same_steps():
    sr = detect_steps(build_run(warmup_bcast=False))
    assert sr.steady_steps == list(range(1, 20)) and sr.step_time_us == T


def test_warmup_steps_zero_and_two():
    flows = build_run()
    sr0 = detect_steps(flows, warmup_steps=0)
    assert sr0.steady_steps == list(range(0, 20))
    assert sr0.timed_steps == list(range(0, 19))
    sr2 = detect_steps(flows, warmup_steps=2)
    assert sr2.steady_steps == list(range(2, 20))
    assert sr2.step_time_us == T - 5  # steps 2..18: nine of T-5, eight of T+5


def test_different_first_collective_drops_one_more_step():
    # the DP groups' first all-reduce differs in iteration 0: their periodic tail covers
    # 19 iterations, the part before it is warm-up, and one more full period is dropped
    sr = detect_steps(build_run(first_dp_count=12345))
    assert len(sr.steps) == 20
    assert sr.steady_steps == list(range(2, 20))  # 18 steady steps
    assert sr.timed_steps == list(range(2, 19))
    assert sr.step_time_us == T - 5  # steps 2..18: nine of T-5, eight of T+5
    assert sr.network_bytes_per_step == NET_BYTES_PER_STEP


def test_never_repeating_sequence_raises():
    fb = FlowBuilder()
    comm = "00000000000000ee"
    for i in range(30):
        fb.ring(comm, [0, 2], "all_reduce", 1000 + i, "Bf16", 100.0 * i, 1)
    with pytest.raises(StepDetectionError) as ei:
        detect_steps(fb.frame(), source="runs/x/timeline.json.gz")
    assert ei.value.rule == "steps never repeat"
    assert comm in ei.value.detail
    assert ei.value.path == "runs/x/timeline.json.gz"
    assert "runs/x/timeline.json.gz: steps never repeat" in str(ei.value)


def test_non_repeating_communicator_inside_steady_steps_raises():
    flows = build_run()
    fb = FlowBuilder()
    comm = "00000000000000ff"
    for i in range(5):  # one-off calls in the middle of the run
        fb.ring(comm, [0, 2], "all_reduce", 77 + i, "Bf16", 100_000.0 + 1000 * i, 1)
    extra = fb.frame()
    extra["flow_id"] += 10_000
    with pytest.raises(StepDetectionError) as ei:
        detect_steps(pd.concat([flows, extra], ignore_index=True))
    assert ei.value.rule == "steps never repeat" and comm in ei.value.detail


def test_empty_flows_raise():
    empty = pd.DataFrame({k: pd.Series(dtype=("object" if v == "str" else v)) for k, v in FLOW_COLUMNS.items()})
    with pytest.raises(StepDetectionError):
        detect_steps(empty)


def test_a_communicator_that_starts_late_leaves_the_steps_before_it_unsteady():
    """Issue 28: a communicator that repeats only in the last 7 of 20 iterations (as after a ramp-up) does
    not refuse the run: the steps are the 20 iterations, those before its first call unsteady (they issue
    other calls than the steady ones, rule.py)."""
    fb = FlowBuilder()
    a, b = "000000000000000a", "000000000000000b"
    for it in range(20):
        fb.ring(a, [0, 2], "all_reduce", 100, "Bf16", it * 1000.0, 1)
        fb.ring(a, [0, 2], "all_reduce", 200, "Bf16", it * 1000.0 + 100, 1)
    for it in range(7):  # repeats, but only in the last 7 iterations
        fb.ring(b, [1, 3], "all_gather", 100, "Bf16", (13 + it) * 1000.0 + 500, 1)
    sr = detect_steps(fb.frame())
    assert len(sr.steps) == 20 and sr.steady_steps == list(range(14, 20))
    assert sr.step_time_us == 1000.0


def test_step_ending_with_identical_calls_keeps_full_period():
    # each step = [A, x, x, x]: "smallest p with 3 repeats" would be p=1 on the x's
    fb = FlowBuilder()
    comm = "0000000000000011"
    for it in range(12):
        t = it * 1000.0
        fb.ring(comm, [0, 2], "all_reduce", 4096, "Bf16", t + 10, 5)
        for k in range(3):
            fb.ring(comm, [0, 2], "all_reduce", 1, "F32", t + 100 + 10 * k, 0)
    sr = detect_steps(fb.frame())
    assert sr.periods == {comm: 4}
    assert len(sr.steps) == 12 and sr.steady_steps == list(range(1, 12))
    assert sr.step_time_us == 1000.0


def test_alltoall_send_flows():
    # MoE all-to-all: one send per ordered rank pair, twice per step, plus a DP all-reduce
    fb = FlowBuilder()
    ep, dp = "0000000000000e01", "0000000000000d01"
    ranks = [0, 1, 2, 3]
    for it in range(20):
        t = it * 5000.0 + (2000.0 if it else 0.0)
        for phase in (100, 900):
            for s in range(4):
                for d in range(4):
                    if s != d:
                        fb.send(ep, ranks, s, d, 512, "Bf16", t + phase, 3)
        fb.ring(dp, [0, 2], "all_reduce", 2048, "Bf16", t + 2000, 10)
    sr = detect_steps(fb.frame())
    assert sr.periods == {dp: 1, ep: 6}
    assert sr.steady_steps == list(range(1, 20))
    assert sr.step_time_us == 5000.0
    # network sends: pairs on different hosts: 8 of 12, x 2 phases x 1024 B; DP: 2 x 4096 B
    assert sr.network_bytes_per_step == 8 * 2 * 1024 + 2 * 4096


def test_large_run_is_fast():
    # 16 hosts x 8 GPUs: 8-rank TP rings per host, 16-rank DP rings: ~100k flows
    rank_node = {r: r // 8 for r in range(128)}
    fb = FlowBuilder(rank_node)
    tp = [(f"{0xA00 + h:016x}", list(range(8 * h, 8 * h + 8))) for h in range(16)]
    dp = [(f"{0xB00 + g:016x}", list(range(g, 128, 8))) for g in range(8)]
    for it in range(130):
        t = it * T
        for k in range(4):
            for cid, rk in tp:
                fb.ring(cid, rk, "all_reduce", 4096 * (k + 1), "Bf16", t + 100 * k, 5)
        for k in range(2):
            for cid, rk in dp:
                fb.ring(cid, rk, "reduce_scatter", 8192, "Bf16", t + 5000 + 100 * k, 50)
    flows = fb.frame()
    assert len(flows) >= 99_000
    t0 = time.perf_counter()
    sr = detect_steps(flows)
    elapsed = time.perf_counter() - t0
    assert len(sr.steady_steps) == 129 and sr.step_time_us == T
    assert elapsed < 10.0, f"detect_steps took {elapsed:.1f} s on {len(flows)} flows"


def test_repetitions_beyond_the_search_bound_are_refused_with_the_reason():
    """Every communicator issues 100 equal calls per step: the fallback does not search steps of
    more than MAX_REPETITIONS (64) periods, so the run is refused with that reason (quickly), not
    cut wrongly or searched for minutes."""
    from phantora_assets.lib.traffic.steps.coarse import MAX_REPETITIONS

    fb = FlowBuilder()
    tp, dp = "0000000000000f11", "0000000000000f12"
    for it in range(N_ITER):
        t = it * T
        for k in range(100):
            fb.ring(tp, [0, 1], "all_reduce", TP_COUNT, "Bf16", t + 10 + 40 * k, 5)
        for k in range(100):
            fb.ring(dp, [0, 2], "all_reduce", DP_COUNT, "Bf16", t + 5000 + 40 * k, 5)
    with pytest.raises(StepDetectionError) as ei:
        detect_steps(fb.frame())
    assert ei.value.rule == "steps disagree"
    assert f"steps of more than {MAX_REPETITIONS} are not searched" in ei.value.detail


def test_every_communicator_repeating_within_a_step():
    # TP: two equal all-reduces per step; DP: two equal gradient buckets, the first one of
    # iteration 0 smaller. No sequence has the step as its primitive period (all are 1 call):
    # the time tells the step (module docstring, "Several repetitions per step ...").
    fb = FlowBuilder()
    tp, dp = "0000000000000f01", "0000000000000f02"
    for it in range(N_ITER):
        t = it * T
        for k in range(2):
            fb.ring(tp, [0, 1], "all_reduce", TP_COUNT, "Bf16", t + 100 + 2000 * k, 40)
        for k in range(2):
            count = 1000 if (it == 0 and k == 0) else DP_COUNT
            fb.ring(dp, [0, 2], "all_reduce", count, "Bf16", t + 5000 + 1500 * k, 1000)
    sr = detect_steps(fb.frame())
    assert sr.periods == {tp: 2, dp: 2}
    assert len(sr.steps) == N_ITER
    assert sr.steady_steps == list(range(2, N_ITER))  # DP's tail covers 19 iterations
    assert sr.step_time_us == T
    assert sr.steps["start_us"].tolist() == [it * T + 100 for it in range(N_ITER)]
    assert sr.network_bytes_per_step == 2 * 2 * hop_bytes("all_reduce", DP_COUNT, 2, 2)


def test_one_late_call_is_not_read_as_longer_steps():
    # two communicators with one call per step; in step 10 the second one starts after step 11
    # began. Steps of two iterations would hide it: refused (the late call changes its place).
    fb = FlowBuilder()
    a, b = "0000000000000f11", "0000000000000f12"
    for it in range(N_ITER):
        fb.ring(a, [0, 2], "all_reduce", 100, "Bf16", it * T, 1)
        fb.ring(b, [1, 3], "all_reduce", 200, "Bf16", it * T + (T + 200 if it == 10 else 500), 1)
    with pytest.raises(StepDetectionError) as ei:
        detect_steps(fb.frame())
    assert ei.value.rule == "steps disagree"
    assert "starts its step 10" in ei.value.detail
    assert "no step of several periods on every communicator fits either" in ei.value.detail


def test_steps_of_incompatible_lengths_raise_ambiguous():
    # per 1000 us: A at 183 and 354, B at 354 and 390 (B's first call starts when A's second
    # does). Cut at every call, B's step would start at A's next one. Steps of 2 calls (one
    # repetition) and of 3 calls (one and a half, cut at the shared instant) both hold, and
    # neither groups the other: refused rather than one of them chosen.
    fb = FlowBuilder()
    a, b = "0000000000000f21", "0000000000000f22"
    for rep in range(6):
        for dt_a, dt_b in ((183, 354), (354, 390)):
            fb.ring(a, [0, 2], "all_gather", 10, "F32", 1000.0 * rep + dt_a, 1)
            fb.ring(b, [1, 3], "all_gather", 20, "F32", 1000.0 * rep + dt_b, 1)
    with pytest.raises(StepDetectionError) as ei:
        detect_steps(fb.frame())
    assert ei.value.rule == "steps ambiguous"
    assert f"6 steps of 2 calls and 4 steps of 3 calls of communicator {a} rank 0" in ei.value.detail


# ---- property: random periodic token sequences with a noisy warm-up -------------------


def test_result_is_frozen(clean_run):
    _, sr = clean_run
    with pytest.raises(dataclasses.FrozenInstanceError):
        sr.step_time_us = 1.0  # type: ignore[misc]


# a step's calls on one communicator: any, or a few calls repeated 2-3 times (equal buckets)


def test_a_collective_every_fifth_step_on_its_own_communicator_is_refused_by_run_log():
    """A 1-element logging all-reduce every 5th iteration on its own communicator: by the rule (rule.py) the
    finest partition every communicator repeats is 5 iterations (4 steps; the communicators alone cannot
    tell an occasional collective from a step of 5 iterations, docs/STEPS.md "Limits"); run.log's 20
    iterations select no candidate: refused, named."""
    flows = build_run(shuffle_seed=None)
    starts = np.cumsum([0.0] + iteration_lengths()[:-1])
    fb = FlowBuilder()
    for it in range(N_ITER):
        if it % 5 == 0:
            fb.ring("00000000000000f9", [0, 1, 2, 3], "all_reduce", 1, "F32", starts[it] + 9000, 0)
    extra = fb.frame()
    extra["flow_id"] += 100_000
    g = pd.concat([flows, extra], ignore_index=True)
    sr = detect_steps(g)
    assert len(sr.steps) == 4 and sr.periods["00000000000000f9"] == 1
    with pytest.raises(StepDetectionError) as ei:
        detect_steps(g, iteration_s=[x / 1e6 for x in iteration_lengths()])
    assert ei.value.rule == "steps disagree with run.log"
    assert "run.log reports 20 iterations" in ei.value.detail
