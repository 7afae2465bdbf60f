"""Issue 38 attacked: the optical rail's schema and closed forms on hand-built DAGs (review findings).

The DAG harness is ``test_optical.py``'s: two hosts of two GPUs on RailOptimized (a NIC a GPU, 400 Gb/s =
50 bytes/ns), rank 0 and rank 2 on rail 0 (NIC 0 of each host), rank 1 and rank 3 on rail 1. A call of
B bytes alone on its link takes T = B / 50 ns.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from fixtures.optical_rails import T_CALL, B, rail_sim

from phantora_assets.lib.net.optical import OpticalConfig, reconfig_rule
from phantora_assets.lib.sim.workload_types import Communicator, Compute, SendRecv

D = 5e6  # 5 ms
RAIL = "RailOptimized"


def _dag(nodes: list[tuple], comms: list[Communicator]):
    """``nodes``: (kind, comm index or -1, pairs or compute ns, group kind, deps) with kind 'call' | 'compute'."""
    kind, dur, who, what, dependents, deps_left = [], [], [], [], [[] for _ in nodes], []
    for i, (k, c, arg, grp, deps) in enumerate(nodes):
        if k == "compute":
            kind.append(0)
            dur.append(float(arg))
            who.append(0)
            what.append(Compute("c", 0.0, 0.0, "fwd"))
        else:
            kind.append(1)
            dur.append(0.0)
            who.append(c)
            what.append(SendRecv(grp, arg, B // 2, "Bf16", f"t{i}"))
        deps_left.append(len(deps))
        for d in deps:
            dependents[d].append(i)
    return kind, dur, who, what, dependents, deps_left, comms


def _run(optical, nodes, comms, schedule=None):
    sim = rail_sim(optical, schedule)
    start, end, *_ = sim._event_loop(*_dag(nodes, comms))
    assert sim.unfinished == 0
    return sim, np.asarray(start), np.asarray(end)


# ------------------------------------------------------------------------------------------------- schema


@pytest.mark.parametrize("mode", [0, False, 0.0])
def test_a_falsy_non_string_mode_is_refused_not_read_as_the_eps(mode):
    """``reconfig = { mode = false, delay_ms = 10 }`` (or 0) was accepted, and the run was the EPS with no
    ``_ocs_`` tail: a misspelt mode silently turned into another network. Rule: ``mode`` is one of the mode
    names (a string)."""
    why = reconfig_rule({"mode": mode, "delay_ms": 10}, RAIL, "analytic")
    assert why is not None and "reconfig.mode must be one of" in why


@pytest.mark.parametrize(
    "table", [{"packet_bytes": 0}, {"sweep_delays_ms": []}, {"packet_bytes": 64, "sweep_delays_ms": []}]
)
def test_a_reconfig_table_that_asks_for_nothing_is_refused(table):
    """No ``mode`` (no reconfigured run) and no delay to sweep: the table changes nothing, yet it was accepted
    (``packet_bytes`` then applies to no simulation). Correct or loud: refused, saying what it needs."""
    why = reconfig_rule(table, RAIL, "analytic")
    assert why is not None and "asks for nothing" in why


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1, -1e-9, "10", True, None])
def test_bad_delays_are_refused(bad):
    """Probe (passes): NaN, inf, negative, a string, a boolean delay are refused with the rule."""
    assert reconfig_rule({"mode": "on_demand", "delay_ms": bad}, RAIL, "analytic") is not None


@pytest.mark.parametrize("sweep", [[1, 1], [0.5], [-1], [math.nan], "0,10", [True], [10**7]])
def test_bad_sweeps_are_refused(sweep):
    """Probe (passes): duplicates, fractions, negatives, NaN, a string, booleans and delays beyond the bound."""
    assert reconfig_rule({"sweep_delays_ms": sweep}, RAIL, "analytic") is not None


# ---------------------------------------------------------------------------------------------- delay 0


def test_zero_delay_is_not_the_eps_when_groups_overlap_on_a_port():
    """A dp call 0 -> 2 and a pp call 2 -> 0, both ready at 0 (opposite directions: no shared link). On the EPS
    both run at once: T. On optical rails a port serves one group at a time, so at D = 0 the pp call waits for
    the dp call to drain: 2 T. The sweep's 0 ms row is the EPS (reconfig_sim: ``step = eps_step`` at d = 0),
    so a run ``reconfig = { mode = "on_demand", delay_ms = 0 }`` gives another number than the sweep's row of
    the same delay and mode. Rule chosen: the 0 ms point is the EPS, so a mode with delay 0 is refused (the
    same entry without ``mode`` is that run)."""
    comms = [Communicator("dp0", "dp", (0, 2)), Communicator("pp0", "pp", (0, 2))]
    nodes = [("call", 0, ((0, 1),), "dp", []), ("call", 1, ((1, 0),), "pp", [])]
    _, _, e_eps = _run(None, nodes, comms)
    _, _, e_zero = _run(OpticalConfig("on_demand", 0.0), nodes, comms)
    assert e_eps.max() == pytest.approx(T_CALL, rel=1e-9)
    assert e_zero.max() == pytest.approx(2 * T_CALL, rel=1e-9)  # the model's D = 0: groups serialised
    why = reconfig_rule({"mode": "on_demand", "delay_ms": 0}, RAIL, "analytic")
    assert why is not None and "EPS" in why


# ------------------------------------------------------------------------------------------------ probes


def test_two_rails_switch_in_parallel():
    """Probe (passes): a call over both rails (pairs 0 -> 2 on rail 0 and 1 -> 3 on rail 1), alternating dp and
    pp: the four ports switch at once, so each change costs D, not D per rail: K T + (K - 1) D."""
    comms = [Communicator("dp0", "dp", (0, 1, 2, 3)), Communicator("pp0", "pp", (0, 1, 2, 3))]
    k = 4
    nodes = [("call", i % 2, ((0, 2), (1, 3)), ("dp", "pp")[i % 2], [i - 1] if i else []) for i in range(k)]
    _, _, end = _run(OpticalConfig("on_demand", D), nodes, comms)
    assert end.max() == pytest.approx(k * T_CALL + (k - 1) * D, rel=1e-9)


def test_delay_longer_than_the_step():
    """Probe (passes): D = 1 s against calls of 1 ms: on demand K T + (K - 1) D, nothing capped."""
    comms = [Communicator("dp0", "dp", (0, 2)), Communicator("pp0", "pp", (0, 2))]
    k, big = 4, 1e9
    nodes = [("call", i % 2, ((0, 1),), ("dp", "pp")[i % 2], [i - 1] if i else []) for i in range(k)]
    _, _, end = _run(OpticalConfig("on_demand", big), nodes, comms)
    assert end.max() == pytest.approx(k * T_CALL + (k - 1) * big, rel=1e-12)


# ------------------------------------------------------------------------------- formula vs simulated


def _flows(rows):
    """Flows between host 0 and host 1 (one NIC a host): (ts_us, dur_us, group, count, dtype_bytes)."""
    import pandas as pd

    return pd.DataFrame(
        {
            "step": [1] * len(rows),
            "ts_us": [r[0] for r in rows],
            "dur_us": [r[1] for r in rows],
            "src_node": [0] * len(rows),
            "src_nic": [0] * len(rows),
            "dst_node": [1] * len(rows),
            "dst_nic": [0] * len(rows),
            "group": [r[2] for r in rows],
            "network": [True] * len(rows),
            "bytes": [r[3] * r[4] for r in rows],
            "count": [r[3] for r in rows],
            "dtype_bytes": [r[4] for r in rows],
        }
    )


def test_formula_leaves_control_scalars_on_the_packet_network_as_the_simulator_does():
    """A dp all-reduce [0, 100] us, at its end the step's 4-byte gradient-norm all-reduce over pp (0 us), then
    the next step's pipeline send at 300 us. The simulator runs calls of <= packet_bytes (4096) on the packet
    network: the port's pp circuit is first needed at 300 us, so the dp -> pp window is 200 us and provisioned
    stalls max(0, D - 200 us). The formula took the scalar as the pp phase's start: window 0, a full D (a tiny
    DP x PP job's formula row at 10 ms provisioned read 19.48 ms beside the simulated 18.01 ms: its dp -> pp
    windows 0 on hosts 1-2, 1.05 ms to the first send). With the packet network's rule the formula's phases are
    the circuits' and the window is 200 us; ``packet_bytes = 0`` keeps every call on the circuits (window 0)."""
    from phantora_assets.lib.net.reconfig import nic_phases, transition_windows

    flows = _flows([(0.0, 100.0, "dp", 50_000_000, 2), (100.0, 0.0, "pp", 1, 4), (300.0, 100.0, "pp", 1_000_000, 2)])
    default = transition_windows(nic_phases(flows, 1, "r"), {1}, "r")
    # both ends of the link (host-1 and host-2: hosts are numbered from 1)
    assert default[["nic", "from_group", "to_group"]].values.tolist() == [
        ["host-1", "dp", "pp"],
        ["host-2", "dp", "pp"],
    ]
    assert default["window_s"].tolist() == pytest.approx([200e-6, 200e-6], rel=1e-9)
    strict = transition_windows(nic_phases(flows, 1, "r", packet_bytes=0), {1}, "r")
    assert strict["window_s"].tolist() == [0.0, 0.0]


def test_provisioned_can_exceed_on_demand_when_the_order_differs_from_the_eps_schedule():
    """Probe (passes; docs/FABRIC.md "Modes" says so): rail 0 carries A1 (dp) at 0, A2 (dp) after A1 and 3 T
    of compute, and B1 (pp) after C (pp on rail 1, after Q0, dp on rail 1). On the EPS rail 0's order is A1,
    B1 (at 2 T), A2 (at 4 T): the schedule dp, pp, dp. Re-timed with D = 5 T, C waits for rail 1's switch, so
    B1 comes at 7 T, after A2. On demand: A2 runs on the dp circuit at 4 T, B1 switches at 7 T: ends 13 T.
    Provisioned: rail 0 switches to pp when A1 ends (1 T, up at 6 T), A2 must switch back (up at 11 T, ends
    12 T), B1 switches again (up at 17 T): ends 18 T, 5 T above on demand (a mispredicted switch costs D)."""
    comms = [
        Communicator("dp0", "dp", (0, 2)),
        Communicator("pp0", "pp", (0, 2)),
        Communicator("dp1", "dp", (1, 3)),
        Communicator("pp1", "pp", (1, 3)),
    ]
    p2p = ((0, 1),)
    nodes = [
        ("call", 0, p2p, "dp", []),  # A1, rail 0
        ("compute", -1, 3 * T_CALL, "", [0]),
        ("call", 0, p2p, "dp", [1]),  # A2, rail 0
        ("call", 2, p2p, "dp", []),  # Q0, rail 1
        ("call", 3, p2p, "pp", [3]),  # C, rail 1
        ("call", 1, p2p, "pp", [4]),  # B1, rail 0
    ]
    eps, _, _ = _run(OpticalConfig("eps", 0.0), nodes, comms)
    assert eps.rails.log[0] == ["dp", "pp", "dp"]
    d = 5 * T_CALL
    _, _, od = _run(OpticalConfig("on_demand", d), nodes, comms)
    _, _, pv = _run(OpticalConfig("provisioned", d), nodes, comms, eps.rails.log)
    assert od.max() == pytest.approx(13 * T_CALL, rel=1e-9)
    assert pv.max() == pytest.approx(18 * T_CALL, rel=1e-9)
