"""The flow-level network simulator: max-min fairness, routing, incremental rate changes."""

from __future__ import annotations

import numpy as np
import pytest

from phantora_assets.lib.sim.network import (
    FlowNetwork,
    Topology,
    max_min_rates,
    max_min_rates_py,
)

GB = 1.0  # bytes per ns == GB/s


def topo(n_hosts=4, rack_size=2, nspines=2, host=100.0, uplink=100.0, loop=360.0, ecmp="hash") -> Topology:
    return Topology(n_hosts, rack_size, nspines, host * GB, uplink * GB, loop * GB, ecmp)


def test_from_cluster_converts_gbps():
    t = Topology.from_cluster(
        {
            "rack_size": 2,
            "nspines": 2,
            "host_bw_gbps": 800,
            "rack_uplink_port_bw_gbps": 400,
            "loopback_gbps": 2880,
            "ecmp": "split",
        },
        5,
    )
    assert t.host_bw == pytest.approx(100.0) and t.uplink_bw == pytest.approx(50.0) and t.loopback_bw == 360.0
    assert t.n_racks == 3 and t.ecmp == "split"
    with pytest.raises(ValueError, match="unknown ecmp"):
        Topology.from_cluster(
            {
                "rack_size": 2,
                "nspines": 2,
                "host_bw_gbps": 1,
                "rack_uplink_port_bw_gbps": 1,
                "loopback_gbps": 1,
                "ecmp": "random",
            },
            2,
        )


def test_topology_from_a_runs_netconfig():
    from phantora_assets.lib.phantora.netconfig import dumps_netconfig, loads_netconfig, netconfig_for
    from phantora_assets.lib.run.spec import RunSpec

    spec = RunSpec("W4", "a100_40g", 5, 2, topology=(("host_bw_gbps", 400), ("nspines", 3)))
    cfg = loads_netconfig(dumps_netconfig(netconfig_for(spec)))
    t = Topology.from_netconfig(cfg)
    assert t == Topology.from_cluster(spec.cluster, 5)
    assert (t.n_hosts, t.n_racks, t.nspines, t.host_bw) == (5, 3, 3, 50.0)
    cfg["topology"]["type"] = "FatTree"
    with pytest.raises(ValueError, match="TwoLayerMultiPath only"):
        Topology.from_netconfig(cfg)


def test_textbook_max_min():
    """Links A (cap 10) and B (cap 4): f0 on A, f1 on A+B, f2 on B -> f1 = f2 = 2, f0 = 8."""
    cap = np.array([10.0, 4.0])
    fi = np.array([0, 1, 1, 2])
    li = np.array([0, 0, 1, 1])
    co = np.ones(4)
    rates = max_min_rates(3, fi, li, co, cap)
    assert rates == pytest.approx([8.0, 2.0, 2.0])
    flows = [((0, 1.0),), ((0, 1.0), (1, 1.0)), ((1, 1.0),)]
    assert max_min_rates_py(flows, cap) == pytest.approx([8.0, 2.0, 2.0])


def test_numpy_and_python_water_filling_agree_on_random_sets():
    rng = np.random.default_rng(5)
    for _ in range(30):
        t = topo(
            n_hosts=8,
            rack_size=2,
            nspines=3,
            host=100,
            uplink=float(rng.choice([25, 50, 100])),
            ecmp=str(rng.choice(["hash", "split", "first"])),
        )
        n = int(rng.integers(2, 40))
        src = rng.integers(0, 8, n)
        dst = (src + rng.integers(1, 8, n)) % 8
        fi, li, co = t.routes(src, dst, np.arange(n))
        a = max_min_rates(n, fi, li, co, t.capacities())
        per = [[] for _ in range(n)]
        for f, lk, c in zip(fi, li, co):
            per[f].append((int(lk), float(c)))
        b = max_min_rates_py([tuple(p) for p in per], t.capacities())
        assert a == pytest.approx(b)
        # feasibility: no link over capacity; every flow has a saturated link (max-min property)
        load = np.bincount(li, weights=co * a[fi], minlength=t.n_links)
        assert (load <= t.capacities() * (1 + 1e-9)).all()
        sat = load >= t.capacities() * (1 - 1e-9)
        assert all(sat[li[fi == f]].any() for f in range(n))


def test_routes_same_rack_and_cross_rack():
    t = topo(n_hosts=4, rack_size=2, nspines=2, ecmp="first")
    fi, li, co = t.routes(np.array([0, 0]), np.array([1, 3]), np.array([0, 1]))
    same = sorted(li[fi == 0].tolist())
    cross = sorted(li[fi == 1].tolist())
    assert same == [0, 4 + 1]  # host 0 up, host 1 down
    assert len(cross) == 4 and 0 in cross and 4 + 3 in cross
    split = topo(n_hosts=4, rack_size=2, nspines=2, ecmp="split")
    fi, li, co = split.routes(np.array([0]), np.array([3]), np.array([0]))
    assert len(li) == 2 + 2 * 2 and sorted(co.tolist()) == [0.5, 0.5, 0.5, 0.5, 1.0, 1.0]


def test_hash_ecmp_is_per_connection_and_deterministic():
    t = topo(n_hosts=4, rack_size=2, nspines=4)
    conn = np.arange(64)
    src, dst = np.zeros(64, dtype=np.int64), np.full(64, 2)
    a = t.routes(src, dst, conn)[1]
    b = t.routes(src, dst, conn)[1]
    assert (a == b).all()
    spines = {int(x) for x in a if x >= 2 * 4 and x < 2 * 4 + 2 * 4}  # rack 0 -> spine links
    assert len(spines) > 1  # different connections spread over spines


def test_incremental_rates_when_a_flow_ends():
    """Two flows share host 0's uplink (100 GB/s): 100 B and 300 B. Both run at 50 until the
    first ends at t = 2 ns; the second then gets the whole link and ends at 2 + 200/100 = 4 ns."""
    net = FlowNetwork(topo(n_hosts=2, rack_size=2))
    ids = net.add(np.array([0, 0]), np.array([1, 1]), np.array([100.0, 300.0]))
    t1 = net.next_time()
    assert t1 == pytest.approx(2.0)
    assert net.advance(t1).tolist() == [ids[0]]
    t2 = net.next_time()
    assert t2 == pytest.approx(4.0)
    net.advance(t2)
    assert net.end_times() == pytest.approx([2.0, 4.0])
    assert net.recomputations == 2


def test_flow_starting_later_slows_the_running_one():
    net = FlowNetwork(topo(n_hosts=2, rack_size=2))
    net.add(np.array([0]), np.array([1]), np.array([300.0]))
    net.advance(1.0)  # 100 B sent alone
    net.add(np.array([0]), np.array([1]), np.array([100.0]))
    while np.isfinite(net.next_time()):
        net.advance(net.next_time())
    # both at 50 until the second ends (t = 3), then the first alone: 300 - 100 - 100 = 100 left -> t = 4
    assert net.end_times() == pytest.approx([4.0, 3.0])


def test_loopback_runs_at_loopback_speed_and_shares_nothing():
    net = FlowNetwork(topo(n_hosts=2, rack_size=2, loop=360.0))
    net.add(np.array([0, 0, 0]), np.array([0, 0, 1]), np.array([720.0, 720.0, 100.0]))
    while np.isfinite(net.next_time()):
        net.advance(net.next_time())
    assert net.end_times() == pytest.approx([2.0, 2.0, 1.0])


def test_zero_byte_flows_end_when_they_start():
    net = FlowNetwork(topo(n_hosts=2, rack_size=2))
    net.advance(5.0)
    ids = net.add(np.array([0]), np.array([1]), np.array([0.0]))
    assert net.advance(net.now).tolist() == ids.tolist()
    assert net.end_times()[0] == 5.0


def test_oversubscribed_uplink_is_the_bottleneck():
    """Rack 0 hosts 0, 1 both send to rack 1 through one spine port of 50 GB/s: 25 each."""
    net = FlowNetwork(topo(n_hosts=4, rack_size=2, nspines=1, uplink=50.0))
    net.add(np.array([0, 1]), np.array([2, 3]), np.array([100.0, 100.0]))
    assert net.next_time() == pytest.approx(4.0)


def test_large_flow_sets_use_the_vectorised_path():
    net = FlowNetwork(topo(n_hosts=64, rack_size=8, nspines=4, ecmp="split"))
    src = np.arange(64)
    net.add(src, (src + 1) % 64, np.full(64, 1000.0))  # a ring: every host link carries one flow
    assert net.next_time() == pytest.approx(10.0)
