"""The analytic simulator's streams, overlap rules and network timing, on real run specs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.analytic import AnalyticSimulator
from phantora_assets.matrix import load_run_matrix

SPECS = {s.run_id: s for s in load_run_matrix()}


def _run(run_id: str, **kw):
    sim = AnalyticSimulator(SPECS[run_id], **kw)
    return sim, sim.run()


def _steady(res, k: int = 3) -> pd.DataFrame:
    """Rows of steady iteration k (0-based) of the raw timeline."""
    starts = np.concatenate([[0], np.cumsum(res.iteration_ns)])
    raw = res.raw
    return raw[(raw["start_ns"] >= starts[k]) & (raw["start_ns"] < starts[k + 1])]


def _net(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["kind"] == "communication") & (df["src_host"] != df["dst_host"]) & (df["end_ns"] > df["start_ns"])]


def _overlap(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """Some interval of a overlaps some interval of b (open intervals)."""
    for s, e in zip(a["start_ns"], a["end_ns"]):
        if ((b["start_ns"] < e) & (b["end_ns"] > s)).any():
            return True
    return False


def test_megatron_grad_reduce_scatter_overlaps_the_backward():
    """overlap_grad_reduce (Phantora's test_megatron.py): a bucket's reduce-scatter runs while
    later layers' backward computes; the optimizer starts after every reduce-scatter."""
    _, res = _run("phantora_a100_40g_W1_2x2")
    step = _steady(res)
    comp0 = step[(step["kind"] == "computation") & (step["os_pid"] == 4000)]
    rs = _net(step[step["call"] == "NcclReduceScatter"])
    bwd = comp0[comp0["name"].str.endswith(".bwd")]
    assert len(rs) and _overlap(rs, bwd)
    opt = comp0[comp0["name"] == "optimizer.step"]
    assert opt["start_ns"].min() >= rs["end_ns"].max()


def test_megatron_param_all_gather_overlaps_the_forward():
    """overlap_param_gather: the first bucket's all-gather starts the step, the next ones run
    under the forward; a layer's forward waits for its bucket."""
    _, res = _run("phantora_a100_40g_W1_2x2")
    step = _steady(res)
    comp0 = step[(step["kind"] == "computation") & (step["os_pid"] == 4000)]
    ag = _net(step[step["call"] == "NcclAllGather"])
    fwd = comp0[comp0["name"].str.endswith(".fwd")]
    assert ag["start_ns"].min() <= fwd["start_ns"].min()
    assert _overlap(ag, fwd)


def test_tp_all_reduce_is_on_the_critical_path():
    """With dp = 1 there is no DP traffic: every activation all-reduce sits between two computes."""
    _, res = _run("phantora_a100_40g_W1_2x1")
    step = _steady(res)
    comp0 = step[(step["kind"] == "computation") & (step["os_pid"] == 4000)].sort_values("start_ns")
    ar = _net(step[(step["call"] == "NcclAllReduce") & (step["dtype"] == "Bf16")])
    assert len(ar) == 2 * 18
    assert not _overlap(ar, comp0)


def test_deepspeed_zero0_does_not_overlap():
    """bf16 optimizer path: all-reduce after the backward, all-gather after the step, both
    synchronous: exposed communication = all network time."""
    _, res = _run("phantora_a100_40g_W4_2x1")
    step = _steady(res)
    comp = step[step["kind"] == "computation"]
    net = _net(step)
    assert not _overlap(net, comp)
    busy = net.groupby("start_ns")["end_ns"].max() - net.groupby("start_ns")["start_ns"].min()
    assert res.exposed_comm_ns == pytest.approx(busy.sum(), rel=0.01)


def test_zero3_prefetch_overlaps_gathers_with_compute():
    _, res = _run("phantora_a100_40g_W5_2x2")
    step = _steady(res)
    comp0 = step[(step["kind"] == "computation") & (step["os_pid"] == 4000)]
    ag = _net(step[step["call"] == "NcclAllGather"])
    rs = _net(step[step["call"] == "NcclReduceScatter"])
    assert _overlap(ag, comp0) and _overlap(rs, comp0)
    # overlap hides part of the communication: exposed < all network time of the step
    net = pd.concat([ag, rs])
    assert res.exposed_comm_ns < (net["end_ns"].max() - net["start_ns"].min())


def test_flow_durations_come_from_the_network():
    """W4 2x1: one all-reduce hop per direction on an 800 Gbps link -> bytes / 100 GB/s.
    W1 2x4: two DP rings share the host links -> each network hop gets half."""
    _, res = _run("phantora_a100_40g_W4_2x1")
    net = _net(_steady(res))
    big = net[net["bytes"] > 1e8]
    assert np.allclose(
        (big["end_ns"] - big["start_ns"]) / (big["bytes"] / 100.0), 1.0, rtol=5e-3
    )  # replicated steps carry the +-0.1 % jitter
    _, res = _run("phantora_a100_40g_W1_2x4")
    ag = _net(_steady(res))
    ag = ag[(ag["call"] == "NcclAllGather") & (ag["bytes"] > 1e8)]
    per_start = ag.groupby("start_ns")
    assert (per_start.size() == 4).all()  # both rings, both directions start together
    assert np.allclose(
        (ag["end_ns"] - ag["start_ns"]) / (ag["bytes"] / 50.0), 1.0, rtol=5e-3
    )  # replicated steps carry the +-0.1 % jitter


def test_tiny_collectives_take_zero_time():
    _, res = _run("phantora_a100_40g_W1_2x2")
    raw = res.raw
    tiny = raw[
        (raw["kind"] == "communication") & (raw["count"] * 4 <= 4096) & (raw["dtype"] == "F32") & (raw["count"] == 1)
    ]
    assert len(tiny) and (tiny["end_ns"] == tiny["start_ns"]).all()


@pytest.mark.parametrize("run_id", ["phantora_a100_40g_W1_4x2", "phantora_a100_40g_W5_2x2", "phantora_l40s_W3_2x1"])
def test_replicated_steady_steps_match_a_full_simulation(run_id):
    """Steps after the first steady one are replicated with their jitter factor: same events and
    bytes as simulating all 20 iterations, iteration times within 0.5 %."""
    _, a = _run(run_id)
    _, b = _run(run_id, replicate=False)
    assert len(a.raw) == len(b.raw)
    assert a.raw["bytes"].sum() == b.raw["bytes"].sum()
    ia, ib = np.array(a.iteration_ns), np.array(b.iteration_ns)
    assert np.max(np.abs(ia - ib) / ib) < 0.005


def test_perf_db_fraction_is_reported():
    _, l40s = _run("phantora_l40s_W1_2x1", emit=False)
    _, a100 = _run("phantora_a100_40g_W1_2x1", emit=False)
    assert l40s.db_fraction == pytest.approx(1.0) and l40s.kernels_from_db == l40s.kernels_per_step
    assert a100.db_fraction == 0.0 and a100.kernels_from_db == 0


def test_single_steady_step_and_topology_overrides():
    base = RunSpec("W4", "a100_40g", 4, 2)
    slow = RunSpec("W4", "a100_40g", 4, 2, topology=(("host_bw_gbps", 200), ("rack_uplink_port_bw_gbps", 200)))
    r1 = AnalyticSimulator(base, iterations=1, warmup=False, emit=False).run()
    r2 = AnalyticSimulator(slow, iterations=1, warmup=False, emit=False).run()
    assert len(r1.iteration_ns) == 1 and r1.step_ns == r1.iteration_ns[0]
    # no overlap on this path: 4x slower links -> 4x the exposed communication
    assert r2.exposed_comm_ns == pytest.approx(4 * r1.exposed_comm_ns, rel=0.01)
    assert r2.compute_ns_per_step == pytest.approx(r1.compute_ns_per_step, rel=0.01)
