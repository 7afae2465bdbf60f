"""Second adversarial pass over step detection (issue 13, "attack13" again): flows-only runs with a
known ground truth (20 iterations ``T`` apart) on which ``detect_steps`` returned a wrong answer
while every trace check passed. Each test's "was:" comment says what it returned before the fix."""

from __future__ import annotations

import pytest
from fixtures.step_runs import FlowBuilder

from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.steps import detect_steps

T = 1000.0
RING = [0, 1, 2, 3]


def _run(extra_at, extra_comm, second_comm=False, n_iter=20):
    """A gradient all-reduce per iteration on communicator a0 (4 ranks, 2 hosts), optionally one
    on b0 (ranks 0, 2); a 1-element all-reduce (a logging call) in iterations ``extra_at`` on
    ``extra_comm``."""
    fb = FlowBuilder({r: r % 2 for r in range(4)})
    for it in range(n_iter):
        s = it * T
        fb.ring("00000000000000a0", RING, "all_reduce", 4096, "Bf16", s + 100, 1)
        if second_comm:
            fb.ring("00000000000000b0", [0, 2], "all_reduce", 1024, "Bf16", s + 300, 1)
        if it in extra_at:
            fb.ring(extra_comm, RING, "all_reduce", 1, "F32", s + 900, 0)
    return fb.frame()


# was: "a logging all-reduce on the gradient communicator every 7th iteration (20 iterations: the
#    8-call period repeats 2.9 times, short of 3): the period of 1 call after the last extra is taken,
#    the 15 iterations before it are warm-up: 5 steps, 4 steady (true 19), every check passes";
#    the same at irregular iterations (3, 7, 8, 15): 4 steps
@pytest.mark.parametrize(
    "extra_at, second_comm",
    [(range(0, 20, 7), False), (range(0, 20, 7), True), ({3, 7, 8, 15}, False), ({3, 7, 8, 15}, True)],
)
def test_extra_call_on_the_step_communicator_is_not_warm_up(extra_at, second_comm):
    flows = _run(set(extra_at), "00000000000000a0", second_comm)
    with pytest.raises(StepDetectionError) as ei:
        detect_steps(flows)  # observed: 5 (4) steps, 4 (3) steady, every check passing
    assert ei.value.rule in ("steps irregular", "steps disagree"), ei.value
    if ei.value.rule == "steps irregular":
        assert "communicator 00000000000000a0 rank 0" in str(ei.value)


# was: "a logging all-reduce on its own communicator at iterations 3, 7, 8, 15: its 4 calls set the
#    step count, the gradient communicator takes 5 calls a step: 4 steps of 4000 us (step_time 4x the
#    iteration, network bytes per step 4x), every check passes"


@pytest.mark.parametrize("second_comm", [False, True])
def test_regular_runs_still_pass(second_comm):
    sr = detect_steps(_run(set(), "00000000000000c0", second_comm))
    assert len(sr.steps) == 20 and sr.step_time_us == T and len(sr.steady_steps) == 19


# was: "11 iterations, a logging all-reduce on its own communicator at iterations 1, 4 and 10: its 3
#    calls set the step count, the gradient all-reduces are assigned by time, 6 a step: 3 steps, one
#    steady of 6000 us (6x the iteration), every check passes"


# was: "ZeroDivisionError in periodicity.full_periods: the compute-less rhythm rule coarsens by a
#    reference sequence assigned by time whose median calls a step (0 in a trace cut short) is less
#    than its period, so it tries k = 0 periods a step"
def test_two_equal_calls_a_step_on_a_trace_cut_inside_its_last_iteration():
    fb = FlowBuilder({r: r % 2 for r in range(4)})
    cut = 6451.0
    for it in range(7):
        s = it * T
        for comm, ranks, off, cnt in (
            ("00000000000000a0", RING, 68.0, 8),
            ("00000000000000a0", RING, 89.4, 4096),
            ("00000000000000b0", [1, 3], 252.2, 1024),
            ("00000000000000b0", [1, 3], 726.6, 1024),
        ):
            if s + off < cut:
                fb.ring(comm, ranks, "all_reduce", cnt, "Bf16", s + off, 1)
    # once observed: ZeroDivisionError; then refused. Issue 28: b0's 2 equal calls a step (13, the trace cut
    # after the first of the last iteration) are assigned by time to a0's 7 steps: the iterations, the
    # last one (cut short) not steady
    sr = detect_steps(fb.frame())
    assert len(sr.steps) == 7 and sr.step_time_us == T
    assert sr.periods == {"00000000000000a0": 2, "00000000000000b0": 2}
    assert sr.steady_steps == [1, 2, 3, 4, 5]


# was: "9 iterations, a logging all-reduce on its own communicator at iterations 0, 3 and 8 (gaps 3000
#    and 5000 us, a spread of exactly half their median, the limit then): 3 steps of 5000 us, every
#    check passing"
