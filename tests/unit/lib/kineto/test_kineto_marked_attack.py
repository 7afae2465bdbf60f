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

import numpy as np
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


def test_a_peer_routed_no_token_is_still_the_same_all_to_all(tmp_path):
    """Step 5's dispatch routes no row from rank 0 to rank 3 (and its combine none back): the all-to-all is
    issued as in every step, its 0-byte parts are no flows (``lib/kineto/collectives.py``). By hand: every
    step issues 4 all-reduce hops and 2 all-to-alls of 4 ranks, 8 calls of 3 sends each, 24 send flows; step 5
    24 - 2 = 22 (0 -> 3 in the dispatch, 3 -> 0 in the combine). Was refused: 'send of routed counts U8 has
    22 flows, the other steps have 24'."""
    rng = np.random.default_rng(0)
    m = rng.integers(80, 120, size=(10, 4, 4))
    m[5][0][3] = 0

    def colls(rank):
        def step(s):
            ins, outs = tuple(int(x) for x in m[s][rank]), tuple(int(x) for x in m[s][:, rank])
            a, b = sum(ins) * 64, sum(outs) * 64
            return [
                Coll("allreduce", 1000, 1000, "BFloat16", GROUP),
                Coll("all_to_all_single", a, b, "BFloat16", GROUP, in_split=ins, out_split=outs),
                Coll("all_to_all_single", b, a, "BFloat16", GROUP, in_split=outs, out_split=ins),
            ]

        return step

    sr, checks = _marked(tmp_path, {r: rank_trace(r, 4, colls(r), steps=10, step_us=10_000.0) for r in GROUP})
    sends = sr.flows[(sr.flows["op"] == "send") & (sr.flows["step"] >= 1)].groupby("step").size()
    assert sends.to_dict() == {k: 22 if k == 5 else 24 for k in range(1, 10)}
    assert all(o.passed for o in checks.values()), [o.message for o in checks.values() if not o.passed]
    assert checks["steps_match"].observed["collectives_per_step"] == 4 + 8


def test_a_routed_all_to_all_missing_in_one_step_is_refused(tmp_path):
    """Counting calls, not flows, still sees a whole all-to-all missing: step 5 issues only the dispatch."""
    prof = moe_profile(10, seed=1, jitter=0.0)
    for t in prof.traces.values():  # drop step 5's combine (each rank's second all_to_all_single in step 5)
        ev = t["traceEvents"]
        a2a = [e for e in ev if e.get("args", {}).get("Collective name") == "all_to_all_single"]
        drop = a2a[2 * 5 + 1]
        corr = [e for e in ev if e.get("name") == "cudaLaunchKernel" and e["ts"] == drop["ts"] + 10]
        kid = corr[0]["args"]["correlation"]
        t["traceEvents"] = [
            e for e in ev if e is not drop and e is not corr[0] and e.get("args", {}).get("correlation") != kid
        ]
    sr, checks = _marked(tmp_path, prof.traces)
    assert not checks["steps_match"].passed
    assert "step 5, communicator" in checks["steps_match"].message
    assert "has 4 calls, the other steps have 8" in checks["steps_match"].message


def test_a_pipeline_send_that_changes_size_is_not_taken_for_routing(tmp_path):
    """PP = 2 x DP = 2 on 2 hosts: stage 0 (ranks 0, 1) sends 4096 BFloat16 activations to stage 1 (ranks 2, 3)
    and receives as many gradients, every step; in step 5 the sends carry 3276 elements. A pipeline message is
    micro-batch x sequence x hidden (Megatron-LM ``core/pipeline_parallel/p2p_communication.py``: the
    ``tensor_shape`` the schedule passes, fixed for the run unless ``variable_seq_lengths``): not routed, so the
    run is refused by ``steps_match`` (it passed, 'vary with routing (an all-to-all's splits ...)'). The Kineto
    reader names each point-to-point flow by the collective that issued it (``ring.P2P_NAME_SEND_RECV`` here),
    and only an all-to-all's parts are routed (``trace_checks.routed_p2p``)."""

    def colls(rank):
        stage, pp, pg = rank // 2, (rank % 2, rank % 2 + 2), {"Process Group Name": f"pp{rank % 2}"}
        dp = (0, 1) if stage == 0 else (2, 3)

        def step(s):
            n = 3276 if s == 5 else 4096
            p2p = [Coll("send", n, n, "BFloat16", pp, extra=pg), Coll("recv", n, n, "BFloat16", pp, extra=pg)]
            ar = Coll("allreduce", 1000, 1000, "BFloat16", dp, extra={"Process Group Name": f"dp{stage}"})
            return [*(p2p if stage == 0 else p2p[::-1]), ar]

        return step

    sr, checks = _marked(tmp_path, {r: rank_trace(r, 4, colls(r), steps=10, step_us=10_000.0) for r in range(4)})
    assert not checks["steps_match"].passed
    assert "step 5" in checks["steps_match"].message
    assert checks["steps_match"].observed["routed_p2p"] == []


def test_an_ep2_all_to_all_that_changes_size_is_routing(tmp_path):
    """The control: the same 2-rank groups issuing an all-to-all (EP = 2: one send to the one peer, the same
    flows as a pipeline pair) whose size changes in step 5 (3276 rows of 1 element instead of 4096, routing)
    is an MoE dispatch, named ``all_to_all`` by the reader: routed, accepted."""

    def colls(rank):
        ep, pg = (rank % 2, rank % 2 + 2), {"Process Group Name": f"ep{rank % 2}"}
        dp = (0, 1) if rank < 2 else (2, 3)

        def step(s):
            n = 3276 if s == 5 else 4096
            a2a = Coll("all_to_all_single", 2 * n, 2 * n, "BFloat16", ep, extra=pg, in_split=(n, n), out_split=(n, n))
            ar = Coll("allreduce", 1000, 1000, "BFloat16", dp, extra={"Process Group Name": f"dp{rank // 2}"})
            return [a2a, ar]

        return step

    sr, checks = _marked(tmp_path, {r: rank_trace(r, 4, colls(r), steps=10, step_us=10_000.0) for r in range(4)})
    assert set(sr.flows.loc[sr.flows["op"].isin(["send", "recv"]), "name"]) == {"all_to_all"}
    assert checks["steps_match"].passed, checks["steps_match"].message
    assert len(checks["steps_match"].observed["routed_p2p"]) > 0
