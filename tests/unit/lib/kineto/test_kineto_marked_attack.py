"""Issue 39, the fresh attack on the routed all-to-all and 10 % jitter rule (d65bc4c): marked (``ProfilerStep#N``)
Kineto runs whose numbers were accepted although the step rule's own conditions say otherwise.

* A marked run with no typical step (durations 10, 11, ..., 18 ms: at most 4 of the 9 steady steps within
  any 20 % window, a hand count) passed every trace rule with a step time of 14 ms: ``steps_from_spans`` flags
  the steps > 10 % off as outliers and ``steady_steps_stable`` times only the others, so its duration clause
  could no longer fail, while the step rule refuses such steps (``steps irregular``, no typical step).
* A routed MoE run's 180 s series repeated the step nearest the step time, whatever bytes it carried; runs.csv
  states the (lower) median step's: ``chosen_step`` carries the reported bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.kineto_traces import MOE_GPUS_PER_NODE, Coll, moe_profile, rank_trace, write_traces

from phantora_assets.lib.kineto.run import convert, read_folder
from phantora_assets.lib.kineto.step_spans import steps_from_spans
from phantora_assets.lib.phantora.raw_tables import read_raw_timeline
from phantora_assets.lib.traffic.trace_checks import run_trace_checks
from phantora_assets.stages.flows import chosen_step

GROUP = (0, 1, 2, 3)


def _marked(tmp_path: Path, traces: dict[int, dict]):
    run = read_folder(write_traces(tmp_path / "traces", traces), MOE_GPUS_PER_NODE)
    conv = convert(run)
    conv.raw.to_parquet(tmp_path / "raw.parquet")
    parsed = read_raw_timeline(tmp_path / "raw.parquet", compute_events=True)
    sr = steps_from_spans(parsed.flows, conv.step_starts_us, conv.step_last_end_us, compute=parsed.compute_events)
    return sr, {o.name: o for o in run_trace_checks(parsed.flows, sr)}


def test_a_marked_run_with_no_typical_step_is_refused(tmp_path):
    # warm-up 10 ms, then steady steps of 10, 11, ..., 18 ms (the last ends 10 us before its successor would)
    lengths = [10_000.0] + [10_000.0 + 1000.0 * k for k in range(9)]
    colls = [Coll("allreduce", 1000, 1000, "BFloat16", GROUP)]
    sr, checks = _marked(tmp_path, {r: rank_trace(r, 4, colls, steps=10, step_us=lengths) for r in GROUP})
    # by hand: a window [d, 1.2 d] holds at most 4 of them (15, 16, 17, 17.99 ms): 4 <= 9 / 2, no typical step
    stable = checks["steady_steps_stable"]
    assert not stable.passed
    assert "no typical step: 4 of the 9 timed steady steps" in stable.message
    assert stable.observed["typical_timed_steps"] == 4


def test_a_marked_run_with_one_checkpoint_step_still_passes(tmp_path):
    """The exception stays one: 1 step of 9 at +60 % is an outlier, 8 typical (> 9 / 2)."""
    lengths = [10_000.0] * 5 + [16_000.0] + [10_000.0] * 4
    colls = [Coll("allreduce", 1000, 1000, "BFloat16", GROUP)]
    sr, checks = _marked(tmp_path, {r: rank_trace(r, 4, colls, steps=10, step_us=lengths) for r in GROUP})
    assert all(o.passed for o in checks.values()), [o.message for o in checks.values() if not o.passed]
    assert sr.step_time_us == pytest.approx(10_000.0)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_repeated_step_carries_the_runs_bytes_per_step(tmp_path, seed):
    prof = moe_profile(10, seed=seed, jitter=0.10)
    sr, checks = _marked(tmp_path, prof.traces)
    assert all(o.passed for o in checks.values()), [o.message for o in checks.values() if not o.passed]
    median = sorted(prof.net_per_step[1:])[(9 - 1) // 2]  # the lower median steady step, by hand
    assert sr.network_bytes_per_step == median
    k = chosen_step(sr)
    assert k in sr.steady_steps
    assert int(sr.steps.set_index("step").loc[k, "network_bytes"]) == median
    assert int(sr.step_flows(k, network_only=True)["bytes"].sum()) == median
