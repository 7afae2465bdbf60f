"""Third pass over step detection (issue 13): flows-only runs found silently wrong by
``benchmarks/steps_fuzz.py`` (seeds 300-599), each reduced to a run with a known ground truth
(iterations ``T`` apart). Each test's "was:" comment says what ``detect_steps`` returned before."""

from __future__ import annotations

import numpy as np
from fixtures.step_runs import FlowBuilder

from phantora_assets.lib.traffic.steps import detect_steps

T = 1000.0
RING = [0, 1, 2, 3]


# was (fuzz seed 301): "a logging all-reduce on its own communicator at iterations 0, 5 and 10 of 12: its
#    3 calls (2 gaps; occasional() left out the first, so 1 remained and no rhythm was found) set the
#    step: 3 steps of 5000 us, every check passing"


# was (fuzz seed 573, once the rule above let its logging communicator be occasional): "the call a
#    time-assigned sequence issues before the anchors' first step opens each step only when it precedes
#    every anchor call; a warm-up call of an anchor before it (its first full period comes later) sent
#    every such call to the previous step: steps right in time, each holding the next iteration's call"
def test_warm_up_call_of_an_anchor_does_not_hide_the_head_of_a_sequence_assigned_by_time():
    fb, ep, dp, step_us = FlowBuilder(), "0000000000000e01", "0000000000000d01", 5000.0
    fb.ring(dp, [0, 2], "all_reduce", 99, "Bf16", 50.0, 1)  # a warm-up call on the anchor
    for it in range(20):
        for k in range(16):
            fb.send(ep, [0, 1, 2, 3], 0, 2, 512, "Bf16", it * step_us + 100 + 50 * k, 3)
        fb.ring(dp, [0, 2], "all_reduce", 2048, "Bf16", it * step_us + 2000, 10)
    f = fb.frame()
    sr = detect_steps(f)
    assert sr.periods == {dp: 1, ep: 16} and len(sr.steps) == 20 and sr.step_time_us == step_us
    it = (f["ts_us"].to_numpy() // step_us).astype(np.int64)
    ok = f["count"].to_numpy() != 99
    assert (sr._period_step[ok] == it[ok]).all()  # observed: every send in the previous step
    assert sr.steps["start_us"].tolist() == [it * step_us + 100 for it in range(20)]


# was (fuzz seeds 317, 543): "three identical all-gathers per iteration (every 1000 us as a block) and a
#    1-element all-reduce on its own communicator every 4th iteration: the all-reduce set the step, 12
#    all-gathers a step: 6 steps of 4000 us, every check passing" -- a step of 4 iterations (gradient
#    accumulation) or an occasional collective: nothing in the flows tells, so refused


def test_parts_told_apart_by_their_gaps_keep_the_step():
    """Two equal blocks 547 and 453 us apart (every iteration alike) are one step's two parts, not
    an occasional collective's steps: the step of the communicator that calls once an iteration."""
    fb = FlowBuilder({r: r % 2 for r in range(4)})
    for it in range(17):
        s = 100.0 + it * T
        for op, count, off in (("all_gather", 8, 380.0), ("all_gather", 8, 448.0), ("all_reduce", 4096, 838.0)):
            fb.ring("00000000000000a0", [0, 2], op, count, "F32", s + off, 1)
        for off in (314.0, 861.0):
            fb.ring("00000000000000b0", [0, 2], "all_gather", 4096, "F32", s + off, 1)
            fb.ring("00000000000000b0", [0, 2], "all_gather", 8, "F32", s + off + 50.0, 1)
    sr = detect_steps(fb.frame())
    assert len(sr.steps) == 17 and sr.step_time_us == T
