"""A raw timeline of scope ``one rank a stage`` (issue 37): what a run past the trace bound is emitted as.

A Megatron job of TP 2 (inside each host of 2 GPUs), PP 2 and DP 2 on 4 hosts, simulated twice: with the bound
as shipped (the timeline of every rank) and with the bound lowered below its size (one rank a stage). The
scoped timeline must hold exactly the network traffic of the full one (every row whose source and destination
hosts differ, same bytes and times) and the compute of the first rank of each stage: Megatron puts pp
outermost, so the stages are ranks 0-3 and 4-7 and their first ranks are 0 (host-1, device 0) and 4 (host-3,
device 0). The tensor-parallel rings, inside one host each, are left out whole.
"""

from __future__ import annotations

import pandas as pd
import pytest

import phantora_assets.lib.sim.analytic as analytic
from phantora_assets.lib.sim.analytic import AnalyticSimulator, timeline_scope
from phantora_assets.lib.workload.collectives import (
    EVERY_RANK,
    ONE_RANK_A_STAGE,
    compute_hosts,
    run_spec_of,
    trace_events,
    trace_events_per_step,
)

JOB = {
    "framework": "megatron",
    "model": {"kind": "dense", "layers": 4, "hidden": 256, "ffn_hidden": 512, "heads": 4, "kv_heads": 2, "vocab": 1000},
    "parallel": {"tp": 2, "pp": 2, "dp": 2, "sequence_parallel": True, "zero": 1},
    "train": {"seq_len": 256, "micro_batch": 1, "grad_accumulation": 2, "iterations": 3},
}
COLS = ["kind", "name", "src_host", "dst_host", "bytes", "start_ns", "end_ns", "comm_id_hex", "stream_device"]


def _raw(spec) -> pd.DataFrame:
    result = AnalyticSimulator(spec).run()
    assert result.timeline is not None
    return result.timeline.frame()


@pytest.fixture(scope="module")
def both():
    spec = run_spec_of(JOB, 4, 2, "h100", "scope")
    full = _raw(spec)
    patch = pytest.MonkeyPatch()
    patch.setattr(analytic, "MAX_TRACE_EVENTS", trace_events_per_step(spec) * spec.wl.train.iterations - 1)
    try:
        assert timeline_scope(spec)[0] == ONE_RANK_A_STAGE
        sim = AnalyticSimulator(spec)
        result = sim.run()
    finally:
        patch.undo()
    assert result.scope == ONE_RANK_A_STAGE and sim.scope == ONE_RANK_A_STAGE
    assert result.timeline is not None
    return spec, full, result.timeline.frame()


def _rows(df: pd.DataFrame) -> pd.DataFrame:
    return df[COLS].sort_values(COLS, kind="stable").reset_index(drop=True)


def test_the_network_traffic_is_the_full_timelines(both):
    _, full, scoped = both
    net_full = full[(full["kind"] == "communication") & (full["src_host"] != full["dst_host"])]
    net_scoped = scoped[(scoped["kind"] == "communication") & (scoped["src_host"] != scoped["dst_host"])]
    assert len(net_scoped) > 0
    pd.testing.assert_frame_equal(_rows(net_scoped), _rows(net_full))


def test_the_compute_is_the_first_rank_of_each_stage(both):
    _, full, scoped = both
    comp_full = full[full["kind"] == "computation"]
    first_ranks = comp_full[comp_full["src_host"].isin(["host-1", "host-3"]) & (comp_full["stream_device"] == 0)]
    comp_scoped = scoped[scoped["kind"] == "computation"]
    assert set(zip(comp_scoped["src_host"], comp_scoped["stream_device"])) == {("host-1", 0), ("host-3", 0)}
    pd.testing.assert_frame_equal(_rows(comp_scoped), _rows(first_ranks))


def test_no_host_local_communicator_and_the_count_is_what_was_emitted(both):
    spec, full, scoped = both
    comm = scoped[scoped["kind"] == "communication"]
    # every communicator left has a flow between hosts; the tensor-parallel rings (one host each) are gone
    spans = comm.groupby("comm_id_hex").apply(lambda g: bool((g["src_host"] != g["dst_host"]).any()))
    assert spans.all()
    local = full[(full["kind"] == "communication")].groupby("comm_id_hex")
    local_ids = {cid for cid, g in local if (g["src_host"] == g["dst_host"]).all()}
    assert local_ids and not local_ids & set(comm["comm_id_hex"])
    # the counter the bound uses is what the simulator emitted, row for row (3 iterations, the first with the
    # init broadcasts of the parameters over each DP pair: one flow each, 4 pairs)
    it = spec.wl.train.iterations
    assert trace_events(spec, EVERY_RANK) == len(full) == trace_events_per_step(spec, EVERY_RANK) * it + 4
    assert trace_events(spec, ONE_RANK_A_STAGE) == len(scoped) < len(full)


DS_ZERO1 = {
    "framework": "deepspeed",
    "model": {"kind": "dense", "layers": 2, "hidden": 256, "ffn_hidden": 512, "heads": 4, "kv_heads": 2, "vocab": 1000},
    "parallel": {"zero": 1},
    "train": {"seq_len": 256, "micro_batch": 1, "grad_accumulation": 2, "iterations": 3},
}


def test_the_counter_holds_deepspeeds_init_broadcasts_one_a_parameter_tensor():
    # DeepSpeed broadcasts every parameter tensor from DP rank 0 before the first step (engine
    # ``_broadcast_model``: ``for p in self.module.parameters(): dist.broadcast(p.data, ...)``): 2 layers x 9
    # tensors + embedding, final norm and head = 21 broadcasts of 7 flows over the 8 ranks of 2 hosts. The
    # counter took steady steps only: 147 events short, which at 4,096 GPUs of an 8B model is 1.2 M events
    # (a run counted within the bound emitted past it).
    spec = run_spec_of(DS_ZERO1, 2, 4, "h100", "dsinit")
    full = _raw(spec)
    it = spec.wl.train.iterations
    assert len(full) == trace_events(spec, EVERY_RANK) == trace_events_per_step(spec, EVERY_RANK) * it + 21 * 7
    patch = pytest.MonkeyPatch()
    patch.setattr(analytic, "MAX_TRACE_EVENTS", len(full) - 1)
    try:
        result = AnalyticSimulator(spec).run()
    finally:
        patch.undo()
    assert result.scope == ONE_RANK_A_STAGE and result.timeline is not None
    scoped = result.timeline.frame()
    assert (
        len(scoped)
        == trace_events(spec, ONE_RANK_A_STAGE)
        == trace_events_per_step(spec, ONE_RANK_A_STAGE) * it + 21 * 7
    )


def _busy_ns(frame: pd.DataFrame, host: str) -> int:
    """|union of the host's computation intervals| (ns): step_anatomy's C summed over the run."""
    comp = frame[(frame["kind"] == "computation") & (frame["src_host"] == host)]
    total, cur_a, cur_b = 0, None, None
    for a, b in sorted(zip(comp["start_ns"].tolist(), comp["end_ns"].tolist())):
        if cur_b is None or a > cur_b:
            total += 0 if cur_b is None else cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (0 if cur_b is None else cur_b - cur_a)


TWO_STAGE_HOSTS = {
    "framework": "megatron",
    "model": {"kind": "dense", "layers": 4, "hidden": 256, "ffn_hidden": 512, "heads": 4, "kv_heads": 2, "vocab": 1000},
    "parallel": {"tp": 1, "pp": 2},
    "train": {"seq_len": 256, "micro_batch": 1, "grad_accumulation": 3, "iterations": 3},
}
FOUR_STAGES = {**TWO_STAGE_HOSTS, "parallel": {"tp": 1, "pp": 4}}


def _scoped(spec):
    """(the full raw timeline, the result of the run with the bound one event below it: one rank a stage)."""
    full = _raw(spec)
    patch = pytest.MonkeyPatch()
    patch.setattr(analytic, "MAX_TRACE_EVENTS", len(full) - 1)
    try:
        result = AnalyticSimulator(spec).run()
    finally:
        patch.undo()
    assert result.timeline is not None and result.scope == ONE_RANK_A_STAGE
    return full, result


def test_the_hosts_step_anatomy_reports_hold_every_ranks_compute():
    # PP 2 x DP 3 on 3 hosts of 2 GPUs (Megatron: pp outermost): stage 0 = ranks 0-2, stage 1 = ranks 3-5; first
    # ranks 0 (host-1) and 3 (host-2). The ranks of a stage differ here (the simulator falls back to every rank: a
    # pipeline pair inside host-2, the others across hosts), so each host has a rank that is no first rank and
    # runs its own compute (host-1: rank 1; host-2: rank 2, of stage 0 besides; host-3: ranks 4, 5): no host's
    # compute is whole in the scoped timeline. step_anatomy's C is the union over the host's GPUs
    # (lib/traffic/anatomy.py): the hosts of the first ranks, which it reported before, read another C.
    spec = run_spec_of(TWO_STAGE_HOSTS, 3, 2, "h100", "twostage")
    full, result = _scoped(spec)
    scoped = result.timeline.frame()
    assert result.symmetry.startswith("every rank (the ranks of a stage differ")
    assert result.compute_hosts == {}
    first_hosts = ["host-1", "host-2"]  # the hosts of the first ranks: what was reported
    assert sorted(set(scoped.loc[scoped["kind"] == "computation", "src_host"])) == first_hosts
    assert [_busy_ns(scoped, h) for h in first_hosts] != [_busy_ns(full, h) for h in first_hosts]


@pytest.mark.parametrize(
    ("table", "nodes", "gpus", "alike", "expected"),
    [
        # TP 2 x DP 2 x PP 2 on 4 hosts of 2 (JOB): stage 0 = ranks 0-3 (hosts 1-2), stage 1 = ranks 4-7
        # (hosts 3-4), run alike: host-1 (ranks 0, 1 of stage 0, first rank 0) stands for hosts 1-2, host-3 for 3-4
        (JOB, 4, 2, True, {0: 2, 2: 2}),
        # PP 4 x DP 2 on 2 hosts of 4: stages {0, 1}, {2, 3}, {4, 5}, {6, 7}; host-1 holds two stages and both
        # their first ranks (0, 2), host-2 those of stages 2 and 3 (4, 6): every host whole, each itself
        (FOUR_STAGES, 2, 4, True, {0: 1, 1: 1}),
        # PP 2 x DP 3 on 6 hosts of 1 GPU, the ranks of a stage not alike: the first ranks' hosts (ranks 0, 3)
        # are whole, each standing for itself only (the other hosts' compute is their own)
        (TWO_STAGE_HOSTS, 6, 1, False, {0: 1, 3: 1}),
    ],
    ids=["tp2-dp2-pp2-4x2", "pp4-dp2-2x4", "pp2-dp3-6x1"],
)
def test_the_whole_hosts_hold_their_hosts_compute_and_stand_for_the_hosts_counted(table, nodes, gpus, alike, expected):
    spec = run_spec_of(table, nodes, gpus, "h100", "whole")
    full, result = _scoped(spec)
    scoped = result.timeline.frame()
    assert result.symmetry.startswith("one rank a stage" if alike else "every rank (the ranks of a stage differ")
    assert result.compute_hosts == expected
    for h in expected:  # step_anatomy's C of a reported host is the full timeline's
        assert _busy_ns(scoped, f"host-{h + 1}") == _busy_ns(full, f"host-{h + 1}")
    if sum(expected.values()) == nodes:  # the counts: every host's C is a reported host's, that many times
        reported = sorted(b for h, n in expected.items() for b in [_busy_ns(scoped, f"host-{h + 1}")] * n)
        assert reported == sorted(_busy_ns(full, f"host-{h + 1}") for h in range(nodes))


@pytest.mark.parametrize(
    ("table", "nodes", "gpus", "alike", "expected"),
    [
        # (a) PP 2 x DP 3 on 3 hosts of 2, alike: host-1 = ranks 0, 1 (stage 0, its first rank 0 there) is whole;
        # host-2 = ranks 2 (stage 0, first rank on host-1) and 3 (stage 1's first): not; host-3 = 4, 5 (stage 1,
        # first rank on host-2): not. Only host-1's set of stages {0}: it stands for itself
        (TWO_STAGE_HOSTS, 3, 2, True, {0: 1}),
        # (b) the same, not alike: every host has a rank that is no first rank
        (TWO_STAGE_HOSTS, 3, 2, False, {}),
        (JOB, 4, 2, False, {}),  # hosts 1, 3 hold the first ranks 0, 4 and ranks 1, 5 of their own
        (FOUR_STAGES, 2, 4, False, {}),  # host-1 holds ranks 1, 3, host-2 ranks 5, 7: no first ranks
        (TWO_STAGE_HOSTS, 6, 1, True, {0: 3, 3: 3}),  # one GPU a host, alike: hosts 1-3 have stage 0's compute
        # one stage (PP 1, DP 4 on 2 hosts of 2): the first rank 0 is on host-1, whose rank 1 is alike; host-2 too
        ({**TWO_STAGE_HOSTS, "parallel": {"tp": 1, "pp": 1}}, 2, 2, True, {0: 2}),
    ],
    ids=["a-pp2-dp3-3x2-alike", "b-pp2-dp3-3x2", "tp2-dp2-pp2-4x2", "pp4-dp2-2x4", "pp2-dp3-6x1-alike", "pp1-2x2"],
)
def test_the_whole_hosts_from_the_layout(table, nodes, gpus, alike, expected):
    assert compute_hosts(run_spec_of(table, nodes, gpus, "h100", "rule"), alike) == expected


def test_the_scoped_simulation_holds_no_host_local_flows_and_emits_the_full_rows_in_order(both):
    # TP 32 in a host (the photonic-rail strong-scaling job): the simulated DAG held every TP call's flow ends on
    # each TP communicator of the stage, 16 M of them against 129 K emitted at a twentieth of its batch, about
    # 1 KB a row emitted, though the scoped timeline drops them. Held no more; the simulation is the same DAG
    # (step times equal the every-rank run's) and the rows are the full timeline's, filtered, in its order.
    spec, full, _ = both
    patch = pytest.MonkeyPatch()
    patch.setattr(analytic, "MAX_TRACE_EVENTS", trace_events_per_step(spec) * spec.wl.train.iterations - 1)
    try:
        sim = AnalyticSimulator(spec, keep_schedule=True)
        result = sim.run()
    finally:
        patch.undo()
    assert result.scope == ONE_RANK_A_STAGE and sim.simulated is not None and result.timeline is not None
    dag = sim.simulated[0]
    G = spec.gpus_per_node
    held = {ci for groups in dag.flow_groups.values() for ci, _ in groups}
    assert held and all(len({r // G for r in dag.comm_list[ci].ranks}) > 1 for ci in held)
    assert result.iteration_ns == AnalyticSimulator(spec).run().iteration_ns
    # the full timeline's rows the scope keeps: flows of communicators with a flow between hosts, compute of
    # ranks 0 and 4 (host-1 and host-3, device 0), in the full timeline's order
    comm = full["kind"] == "communication"
    spanning = set(full.loc[comm & (full["src_host"] != full["dst_host"]), "comm_id_hex"])
    first = (full["kind"] == "computation") & full["src_host"].isin(["host-1", "host-3"]) & (full["stream_device"] == 0)
    expected = full[(comm & full["comm_id_hex"].isin(spanning)) | first].drop(columns="event_id")
    scoped = result.timeline.frame().drop(columns="event_id")
    pd.testing.assert_frame_equal(scoped.reset_index(drop=True), expected.reset_index(drop=True))
