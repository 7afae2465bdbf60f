"""Fabric topologies (lib/net/fabric.py): hand-worked hop counts, path counts and link loads to the byte
on small FatTree, RailOptimized, MultiPlane and Arbitrary fabrics; the run matrix's topology rules; the
Phantora netconfig written or refused with the reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.net import fabric as fb
from phantora_assets.lib.net import link_bins as lb
from phantora_assets.lib.net import routes
from phantora_assets.lib.phantora.netconfig import NoPhantoraTopology, netconfig_for
from phantora_assets.matrix import parse_entries

BASE = {"host_bw_gbps": 800, "rack_uplink_port_bw_gbps": 400, "loopback_gbps": 2880, "nspines": 2, "rack_size": 2}
WINDOW = {"window_s": 1.0, "bin_s": 0.1, "jitter": 0.0}  # flows lasting the whole 100 ms step: each bin = bytes


def _fab(kind: str, hosts: int, gpus: int, ecmp: str = "hash", **kw) -> fb.Fabric:
    return fb.build_fabric({**BASE, "topology": kind, "ecmp": ecmp, **kw}, hosts, gpus)


def _hops(f: fb.Fabric, a: int, b: int) -> tuple[int, int]:
    ps = f.paths(a, b)
    return len(ps), len(ps[0])


def test_fat_tree_k4_links_hops_and_paths():
    f = _fab("FatTree", 16, 1, fattree_k=4, oversubscription=2.0)
    # 16 hosts x 2 + 8 edges x 2 aggs x 2 + 8 aggs x 2 cores x 2
    assert f.n_links == 96
    assert _hops(f, 0, 1) == (1, 2)  # one edge switch
    assert _hops(f, 0, 2) == (2, 4)  # one pod: 2 aggregation switches
    assert _hops(f, 0, 4) == (4, 6)  # between pods: (k/2)^2 cores
    cap = {c: set(f.cap[np.array(f.link_class) == c].tolist()) for c in set(f.link_class)}
    edge = {"edge_agg": {50.0}, "agg_edge": {50.0}}  # 800 Gbps / 2 = 50 bytes/ns
    assert cap == {"host_up": {100.0}, "host_down": {100.0}, **edge, "agg_core": {100.0}, "core_agg": {100.0}}
    assert fb.build_fabric({**BASE, "topology": "FatTree"}, 16, 1).params["fattree_k"] == 4  # smallest k


def test_rail_optimized_same_rail_in_two_hops_cross_rail_over_a_spine():
    f = _fab("RailOptimized", 4, 4, pxn=False)  # 4 hosts x 4 GPUs, a NIC each, rails 0..3, 2 spines; no PXN
    assert f.n_endpoints == 16 and f.n_links == 16 * 2 + 4 * 2 * 2
    assert _hops(f, 0, 4) == (1, 2)  # host-1/nic-0 -> host-2/nic-0: rail 0's switch
    assert [f.link_src[lk] for lk in f.paths(0, 4)[0]] == ["host-1/nic-0", "rail-0.0"]
    assert _hops(f, 0, 5) == (2, 4)  # nic-0 -> nic-1: rail 0 -> a spine -> rail 1
    assert _hops(f, 0, 1) == (2, 4)  # two NICs of one host, different rails
    # GPUs 0..3 on NICs 0..3; ranks 0 and 1 share a host: one scale-up domain, the loopback
    s, d = f.endpoints(np.array([0, 0, 1]), np.array([1, 4, 5]))
    assert s.tolist() == [0, 0, 1] and d.tolist() == [0, 4, 5]
    # two GPUs a NIC
    g = _fab("RailOptimized", 2, 4, nics_per_host=2)
    assert g.nic_of_gpu(np.arange(4)).tolist() == [0, 0, 1, 1]


def test_multi_plane_one_path_per_plane_at_a_share_of_the_nic():
    f = _fab("MultiPlane", 2, 2, planes=2, nic_bw_gbps=400)
    assert _hops(f, 0, 2) == (2, 2)  # nic-0 -> nic-0: one rail switch on each plane
    host = np.array(f.link_class) == "host_up"
    assert set(f.cap[host].tolist()) == {25.0}  # 400 Gbps / 2 planes = 25 bytes/ns


ARBITRARY = """
[[switch]]
name = "tor-a"
[[switch]]
name = "tor-b"
[[switch]]
name = "core"
[[link]]
a = "tor-a"
b = "core"
gbps = 100
[[link]]
a = "tor-b"
b = "core"
gbps = 100
[[nic]]
host = 1
nic = 0
switch = "tor-a"
gbps = 400
[[nic]]
host = 2
nic = 0
switch = "tor-a"
gbps = 400
[[nic]]
host = 3
nic = 0
switch = "tor-b"
gbps = 400
"""


def _arbitrary(tmp_path: Path, text: str = ARBITRARY) -> str:
    p = tmp_path / "fabric.toml"
    p.write_text(text)
    return str(p)


def test_arbitrary_file_hops_and_link_loads_to_the_byte(tmp_path):
    f = _fab("Arbitrary", 3, 1, ecmp="first", fabric_file=_arbitrary(tmp_path))
    assert f.n_links == 10 and _hops(f, 0, 1) == (1, 2) and _hops(f, 0, 2) == (1, 4)
    step = pd.DataFrame(
        {
            "offset_us": [0.0] * 3,
            "dur_us": [1e5] * 3,
            "src_node": [0, 0, 2],
            "dst_node": [1, 2, 0],
            "bytes": [1000, 3, 70],
        }
    )
    conn = np.arange(3, dtype=np.int64)
    got = lb.build_link_bins(step, conn, f, step_time_s=0.1, run_id="arb", routes="simulated", **WINDOW)
    per = got.table.groupby(["src", "dst"], sort=False)["bytes"].apply(list).to_dict()
    want = {
        ("host-1", "tor-a"): 1003,
        ("tor-a", "host-1"): 70,
        ("host-2", "tor-a"): 0,
        ("tor-a", "host-2"): 1000,
        ("host-3", "tor-b"): 70,
        ("tor-b", "host-3"): 3,
        ("tor-a", "core"): 3,
        ("core", "tor-a"): 70,
        ("tor-b", "core"): 70,
        ("core", "tor-b"): 3,
    }
    assert per == {k: [v] * 10 for k, v in want.items()}
    assert got.class_bytes == {"host_up": 10730, "fabric": 1460, "host_down": 10730}
    exp = lb.expected_class_bytes(step, f, step_time_s=0.1, run_id="arb", conn=conn, **WINDOW)
    assert exp == got.class_bytes


def test_fat_tree_split_divides_a_flow_over_its_paths_to_the_byte():
    f = _fab("FatTree", 16, 1, ecmp="split", fattree_k=4)
    step = pd.DataFrame({"offset_us": [0.0], "dur_us": [1e5], "src_node": [0], "dst_node": [4], "bytes": [1003]})
    got = lb.build_link_bins(step, np.zeros(1, np.int64), f, step_time_s=0.1, run_id="ft", routes="m", **WINDOW)
    first = got.table[got.table["t"] == 0.0]
    load = {(s, d): b for s, d, b in zip(first["src"], first["dst"], first["bytes"]) if b}
    # 4 paths of 251, 251, 251, 250 bytes (lexicographic path order); agg-0.0 carries the first two
    assert load[("host-1", "edge-0.0")] == 1003 and load[("edge-1.0", "host-5")] == 1003
    assert load[("edge-0.0", "agg-0.0")] == 502 and load[("edge-0.0", "agg-0.1")] == 501
    assert sorted(v for (s, _), v in load.items() if s.startswith("agg-0")) == [250, 251, 251, 251]
    assert got.class_bytes == lb.expected_class_bytes(
        step, f, step_time_s=0.1, run_id="ft", conn=np.zeros(1, np.int64), **WINDOW
    )
    assert got.class_bytes["agg_core"] == 10030


def test_routes_kind_on_a_fabric():
    f = _fab("RailOptimized", 4, 4)
    same_rail = (np.array([0, 4]), np.array([4, 8]))
    assert routes.routes_kind("analytic", f, *same_rail) == "simulated"  # one path each
    assert routes.routes_kind("analytic", f, np.array([0]), np.array([5])) == "modelled"  # hash over 2 spines
    assert routes.classes_of(f) == ("host_up", "rail_spine", "spine_rail", "host_down")


def _entry(**topology) -> list:
    return [{"workload": "W3", "gpu": "a100_40g", "nodes": 4, "gpus_per_node": 2, "topology": topology}]


def test_matrix_topology_rules_and_run_ids(tmp_path):
    (spec,) = parse_entries(_entry(topology="RailOptimized", nic_bw_gbps=400))
    assert spec.run_id == "phantora_a100_40g_W3_4x2_railoptimized"
    (default,) = parse_entries(_entry())
    assert default.run_id == "phantora_a100_40g_W3_4x2"
    with pytest.raises(RunMatrixError, match="need a fabric topology"):
        parse_entries(_entry(nics_per_host=2))
    with pytest.raises(RunMatrixError, match="fattree_k must be an even integer"):
        parse_entries(_entry(topology="FatTree", fattree_k=3))
    with pytest.raises(RunMatrixError, match="do not fit a 2-ary"):
        parse_entries(_entry(topology="FatTree", fattree_k=2))
    with pytest.raises(RunMatrixError, match="scale_up_gpus must be a multiple"):
        parse_entries(_entry(topology="RailOptimized", scale_up_gpus=1))
    with pytest.raises(RunMatrixError, match="host 4 of the run has no"):
        parse_entries(_entry(topology="Arbitrary", fabric_file=_arbitrary(tmp_path)))
    with pytest.raises(RunMatrixError, match="unknown switch 'nowhere'"):
        parse_entries(
            _entry(
                topology="Arbitrary",
                fabric_file=_arbitrary(tmp_path, ARBITRARY.replace('"tor-b"\ngbps = 400', '"nowhere"\ngbps = 400')),
            )
        )


def test_phantora_netconfig_written_or_refused_with_the_reason(tmp_path):
    (ft,) = parse_entries(_entry(topology="FatTree", oversubscription=2.0))
    assert netconfig_for(ft)["topology"] == {
        "type": "FatTree",
        "args": {"nports": 4, "bandwidth": 800, "oversub_ratio": 2.0},
    }
    (rail,) = parse_entries(_entry(topology="RailOptimized"))
    with pytest.raises(NoPhantoraTopology, match="Phantora has no RailOptimized topology"):
        netconfig_for(rail)
    three = [{"workload": "W4", "gpu": "a100_40g", "nodes": 3, "gpus_per_node": 1}]
    three[0]["topology"] = {"topology": "Arbitrary", "fabric_file": _arbitrary(tmp_path)}
    (arb,) = parse_entries(three)
    with pytest.raises(NoPhantoraTopology, match="rack sizes differ"):  # 2 hosts on tor-a, 1 on tor-b
        netconfig_for(arb)
    even = ARBITRARY.replace('host = 2\nnic = 0\nswitch = "tor-a"', 'host = 2\nnic = 0\nswitch = "tor-b"')
    even = even.replace('host = 3\nnic = 0\nswitch = "tor-b"', 'host = 3\nnic = 0\nswitch = "tor-a"')
    three[0]["nodes"] = 2
    three[0]["topology"] = {
        "topology": "Arbitrary",
        "fabric_file": _arbitrary(tmp_path, even.split("[[nic]]\nhost = 3")[0]),
    }
    (two,) = parse_entries(three)
    assert netconfig_for(two)["topology"] == {
        "type": "Arbitrary",
        "args": {"nracks": 2, "rack_size": 1, "host_bw": 400.0, "rack_bw": 100.0},
    }


TWO_RACKS = """
[[switch]]
name = "tor-a"
[[switch]]
name = "tor-b"
[[switch]]
name = "core"
[[link]]
a = "tor-a"
b = "core"
gbps = 100
[[link]]
a = "tor-b"
b = "core"
gbps = 100
[[nic]]
host = 1
nic = 0
switch = "tor-a"
gbps = 400
[[nic]]
host = 2
nic = 0
switch = "tor-b"
gbps = 400
"""


def _nic(host: object, nic: object = 0, switch: object = '"tor-a"', gbps: object = 400) -> str:
    return f"[[nic]]\nhost = {host}\nnic = {nic}\nswitch = {switch}\ngbps = {gbps}\n"


def test_a_phantom_host_would_forward_half_the_traffic_so_hosts_are_1_to_the_runs_nodes(tmp_path):
    """``host = 0`` with two NICs on both racks was a node host-0 joining tor-a and tor-b: a second shortest
    path (host-1 -> tor-a -> host-0 -> tor-b -> host-2 beside ... -> core -> ...), so hash ECMP sent about half
    the traffic through a host that is no host of the run. Hosts are 1 .. nodes (docs/DATASET.md: host-k is
    node k-1); the file is refused, named, with the rule."""
    phantom = TWO_RACKS + _nic(0, 0, '"tor-a"') + _nic(0, 1, '"tor-b"')
    with pytest.raises(ValueError, match=r"fabric.toml: \[\[nic\]\] #3: host must be an integer from 1 to 2 .* got 0"):
        _fab("Arbitrary", 2, 1, fabric_file=_arbitrary(tmp_path, phantom))
    with pytest.raises(RunMatrixError, match=r"\[\[run\]\] #1 .*\[\[nic\]\] #3: host must be an integer from 1 to 2"):
        entry = [{"workload": "W4", "gpu": "a100_40g", "nodes": 2, "gpus_per_node": 1}]
        entry[0]["topology"] = {"topology": "Arbitrary", "fabric_file": _arbitrary(tmp_path, phantom)}
        parse_entries(entry)
    f = _fab("Arbitrary", 2, 1, fabric_file=_arbitrary(tmp_path, TWO_RACKS))  # the file without it: one path
    assert _hops(f, 0, 1) == (1, 4) and "host-0" not in f.node_names


@pytest.mark.parametrize(
    ("extra", "rule"),
    [
        (_nic(-1, 0, '"tor-a"') + _nic(-1, 1, '"tor-b"'), r"#3: host must be an integer from 1 to 2 .* got -1"),
        (_nic(3), r"#3: host must be an integer from 1 to 2 .* got 3"),  # beyond the run: was dropped unread
        (_nic(3, gbps=-1), r"#3: host must be an integer from 1 to 2"),  # its bandwidth was never checked
        (_nic('"1"', 1), r"#3: host must be an integer from 1 to 2 .* got '1'"),
        (_nic(1, -1), r"#3: nic must be an integer >= 0 .* got -1"),
        (_nic(1, 0), r"#3: host 1 nic 0 listed twice"),
        (_nic(1, 1, '"host-2"'), r"#3: unknown switch 'host-2'"),
        ('[[link]]\na = "tor-a"\nb = "host-2"\ngbps = 100\n', r"\[\[link\]\] #3: a and b must be two different known"),
        ('[[link]]\na = "tor-a"\nb = "tor-a"\ngbps = 100\n', r"\[\[link\]\] #3: a and b must be two different known"),
        ('[[link]]\na = "tor-a"\nb = "tor-b"\ngbps = 0\n', r"\[\[link\]\] #3: gbps must be a number from 0.001"),
        ('[[link]]\na = "tor-a"\nb = "tor-b"\ngbps = -100\n', r"\[\[link\]\] #3: gbps must be a number from 0.001"),
        ("[[switch]]\nname = 7\n", r"\[\[switch\]\] #4: name must be a non-empty string"),
        ('[[switch]]\nname = "core"\n', r"switch names must be unique, \['core'\] repeat"),
        ('[[switch]]\nname = "host-9"\n', r"\[\[switch\]\] #4: name must be a non-empty string, not 'host-"),
        (
            _nic(1, 1, gbps=100) + _nic(2, 1, gbps=200),
            r"the same total NIC bandwidth .*'host-1': 500.0, 'host-2': 600.0",
        ),
    ],
    ids=[
        "negative-host",
        "host-beyond-run",
        "host-beyond-run-bad-bw",
        "host-a-string",
        "negative-nic",
        "duplicate-nic",
        "nic-on-a-host",
        "link-to-a-host",
        "self-link",
        "zero-bw",
        "negative-bw",
        "switch-name-int",
        "duplicate-switch",
        "switch-named-host",
        "unequal-hosts",
    ],
)
def test_every_rule_of_an_arbitrary_file_is_checked_before_use(tmp_path, extra, rule):
    with pytest.raises(ValueError, match=rule):
        _fab("Arbitrary", 2, 2, fabric_file=_arbitrary(tmp_path, TWO_RACKS + extra))


def test_rail_spines_non_blocking_unless_oversubscribed():
    """Issue 38 item 5: a rail switch's spine links carry its hosts' NIC bandwidth: 4 hosts x 400 Gbps over
    2 spines is 4 x 50 / 2 = 100 GB/s a spine link (was the leaf-spine's 800 Gbps = 100 GB/s whatever the
    rail), / oversubscription."""
    from phantora_assets.lib.net.fabric import build_fabric

    base = {"host_bw_gbps": 800, "loopback_gbps": 2880, "nspines": 2, "rack_uplink_port_bw_gbps": 800}
    for hosts, o, want in ((4, 1.0, 100.0), (4, 2.0, 50.0), (16, 1.0, 400.0)):
        cluster = {**base, "topology": "RailOptimized", "nic_bw_gbps": 400, "oversubscription": o}
        fab = build_fabric(cluster, hosts, 8)
        caps = {c for c, k in zip(fab.capacities(), fab.link_class) if k in ("rail_spine", "spine_rail")}
        assert caps == {want}
        assert fab.pxn is True


def test_pxn_endpoints_use_the_destination_rail():
    from phantora_assets.lib.net.fabric import build_fabric

    base = {"host_bw_gbps": 800, "loopback_gbps": 2880, "nspines": 2, "rack_uplink_port_bw_gbps": 800}
    on = build_fabric({**base, "topology": "RailOptimized"}, 2, 4)
    off = build_fabric({**base, "topology": "RailOptimized", "pxn": False}, 2, 4)
    src, dst = np.array([0, 1, 0]), np.array([6, 7, 2])  # rank 0 -> 6 (GPU 0 -> GPU 2 of host 2), same host last
    assert on.endpoints(src, dst)[0].tolist() == [2, 3, 0]  # host 1's NIC 2, NIC 3; loopback stays
    assert off.endpoints(src, dst)[0].tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="pxn"):
        build_fabric({**base, "topology": "FatTree", "pxn": True}, 2, 1)


def _chain(n_switches: int) -> str:
    """host-1 on sw-0, host-2 on sw-(n-1), the switches in a line: one path of n + 1 links."""
    text = "".join(f'[[switch]]\nname = "sw-{i}"\n' for i in range(n_switches))
    text += "".join(f'[[link]]\na = "sw-{i}"\nb = "sw-{i + 1}"\ngbps = 100\n' for i in range(n_switches - 1))
    return text + _nic(1, 0, '"sw-0"') + _nic(2, 0, f'"sw-{n_switches - 1}"')


def test_a_path_longer_than_the_recursion_limit_is_routed(tmp_path):
    """Issue 39 item 14: the shortest paths were enumerated by recursion, one frame a link, so a file
    whose path is longer than about 1,000 links ended in a bare RecursionError. 3,000 switches in a
    line: one path, host-1's up link, the 2,999 switch links in order, host-2's down link."""
    import sys

    n = 3000
    assert n > sys.getrecursionlimit()
    f = _fab("Arbitrary", 2, 1, fabric_file=_arbitrary(tmp_path, _chain(n)))
    (path,) = f.paths(0, 1)
    names = [(f.link_src[lk], f.link_dst[lk]) for lk in path]
    assert len(path) == n + 1
    assert names[0] == ("host-1", "sw-0") and names[-1] == (f"sw-{n - 1}", "host-2")
    assert names[1:-1] == [(f"sw-{i}", f"sw-{i + 1}") for i in range(n - 1)]
    (back,) = f.paths(1, 0)
    assert [(f.link_src[lk], f.link_dst[lk]) for lk in back] == [(d, s) for s, d in reversed(names)]


def test_paths_come_in_lexicographic_order_of_link_ids(tmp_path):
    """Two parallel cables between the racks' switches: two shortest paths, the lower link id first
    (the order hash / first ECMP index into, docs/FABRIC.md "Routing")."""
    twice = TWO_RACKS + '[[link]]\na = "tor-a"\nb = "tor-b"\ngbps = 100\n' * 2
    f = _fab("Arbitrary", 2, 1, fabric_file=_arbitrary(tmp_path, twice))
    ps = f.paths(0, 1)
    assert len(ps) == 2 and ps == sorted(ps) and all(len(p) == 3 for p in ps)


def test_a_disconnected_fabric_file_is_refused_when_validated_naming_the_unreachable_nics(tmp_path):
    """A NIC on a switch island was accepted by the run matrix and failed at build with a bare
    ``ValueError: no path`` naming no file. The file is refused where it is validated: the file, the
    rule, the NICs host-1's first NIC cannot reach."""
    island = TWO_RACKS + '[[switch]]\nname = "island"\n' + _nic(3, 0, '"island"') + _nic(4, 0, '"island"')
    fabric = _arbitrary(tmp_path, island)
    rule = r"fabric.toml: the fabric is not connected: host-3 nic 0, host-4 nic 0 cannot be reached from host-1's nic 0"
    with pytest.raises(ValueError, match=rule):
        _fab("Arbitrary", 4, 1, fabric_file=fabric)
    entry = [{"workload": "W4", "gpu": "a100_40g", "nodes": 4, "gpus_per_node": 1}]
    entry[0]["topology"] = {"topology": "Arbitrary", "fabric_file": fabric}
    with pytest.raises(RunMatrixError, match=r"\[\[run\]\] #1 .*" + rule):
        parse_entries(entry)
