"""Issue 39, the fresh attack on d65bc4c (durations within 10 %, was 5 %): an evaluation pass every second
iteration under +-10 % iteration jitter. The generator (``fixtures.training_runs``, its own judge) knows the
truth: 11 of the 22 timable iterations are regular, so the trace has no typical step and the run is
undecidable; the regular iteration lasts 9681 us (the median of the regular ones, the judge's). The step
rule takes a 20 % window holding both populations' overlapping tails as typical (15 of 22) and reports
11,257 us (1.16x); every trace rule passes (at 5 % ``steady_steps_stable`` refused it: 9.7 % off)."""

from __future__ import annotations

import pytest
from fixtures.training_runs import make_run

from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.steps import detect_steps
from phantora_assets.lib.traffic.trace_checks import run_trace_checks

CLEAN = {"n_warm": 1, "ramp": 0, "ckpt_k": 0, "n_strag": 0, "cut": "none", "n_iter": 24}


@pytest.mark.xfail(
    strict=True,
    reason="OPEN (issue 39): an eval pass every 2nd iteration whose extra length is within +-10 % jitter's reach "
    "(the parities overlap, so evidence.duration_cycle's full separation fails) is timed as one typical step "
    "of both populations; refusing it needs an alternation test that tolerates overlap (parity medians apart "
    "beyond what the jitter explains), or the 10 % duration clause back at 5 % for unmarked runs",
)
@pytest.mark.parametrize("family", ["moe", "grad_accum"])
def test_eval_every_second_iteration_under_ten_percent_jitter_is_refused(family):
    run = make_run(1, family, **{**CLEAN, "eval_k": 2, "jitter": 0.10, "with_compute": False, "with_log": False})
    assert not run.decidable and "no typical step" in run.why_undecidable  # the generator's own judgement
    try:
        sr = detect_steps(run.flows, compute=run.compute)
    except StepDetectionError:
        return  # refused by the step rule: correct
    checks = run_trace_checks(run.flows, sr)
    assert not all(o.passed for o in checks), f"accepted with step time {sr.step_time_us:.0f} us"
