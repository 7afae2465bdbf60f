"""Per-link traffic (lib/net/, stages/links.py, the link_bins asset): a hand-worked leaf-spine to the
byte, ECMP determinism, the conservation check failing on a corrupted table, and a shipped run
through a real Dagster materialization into DuckDB."""

from __future__ import annotations

import dagster as dg
import duckdb
import numpy as np
import pandas as pd
import pytest
from fixtures.materialize import ephemeral_with_runs

from phantora_assets import definitions as d
from phantora_assets.checks import read_checks
from phantora_assets.lib.net import link_bins as lb
from phantora_assets.lib.net import routes
from phantora_assets.lib.sim.network import Topology
from phantora_assets.lib.traffic.binning import control_matrix
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.resources import AnalyticSimulatorResource, DataRoot
from phantora_assets.stages import dataset as dataset_stage
from phantora_assets.stages import links as links_stage

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
# 4 hosts in racks of 2 (leaf-1: host-1, host-2; leaf-2: host-3, host-4), 2 spines
CLUSTER = {"rack_size": 2, "nspines": 2, "host_bw_gbps": 800, "rack_uplink_port_bw_gbps": 400, "loopback_gbps": 2880}
# one step of 100 ms, each flow lasting the whole step: repeated back to back (jitter 0) every 100 ms bin
# holds exactly each flow's bytes, whatever the random phase
STEP = pd.DataFrame(
    {
        "offset_us": [0.0] * 4,
        "dur_us": [100_000.0] * 4,
        "src_node": [0, 0, 3, 2],
        "dst_node": [1, 2, 1, 3],
        "bytes": [1000, 3000, 501, 7],
    }
)
WINDOW = {"window_s": 1.0, "bin_s": 0.1, "jitter": 0.0}


def _topo(ecmp: str) -> Topology:
    return Topology.from_cluster({**CLUSTER, "ecmp": ecmp}, 4)


def _build(ecmp: str, conn=None) -> lb.LinkBins:
    conn = np.arange(len(STEP), dtype=np.int64) if conn is None else conn
    return lb.build_link_bins(STEP, conn, _topo(ecmp), step_time_s=0.1, run_id="hand", routes="modelled", **WINDOW)


def _per_bin(table: pd.DataFrame) -> dict[tuple[str, str], list[int]]:
    return {(s, t): g["bytes"].tolist() for (s, t), g in table.groupby(["src", "dst"], sort=False)}


# host links of the hand-worked example, per 100 ms bin: host-1 sends 1000 + 3000, host-4 501, host-3 7
HOST_LINKS = {
    ("host-1", "leaf-1"): 4000,
    ("host-2", "leaf-1"): 0,
    ("host-3", "leaf-2"): 7,
    ("host-4", "leaf-2"): 501,
    ("leaf-1", "host-1"): 0,
    ("leaf-1", "host-2"): 1501,
    ("leaf-2", "host-3"): 3000,
    ("leaf-2", "host-4"): 7,
}


def test_hand_worked_leaf_spine_first_spine():
    got = _build("first")
    t = got.table
    assert len(t) == 10 * 16 and t["link_id"].tolist()[:16] == list(range(16))
    fabric = {
        ("leaf-1", "spine-1"): 3000,  # host-1 -> host-3
        ("leaf-1", "spine-2"): 0,
        ("leaf-2", "spine-1"): 501,  # host-4 -> host-2
        ("leaf-2", "spine-2"): 0,
        ("spine-1", "leaf-1"): 501,
        ("spine-2", "leaf-1"): 0,
        ("spine-1", "leaf-2"): 3000,
        ("spine-2", "leaf-2"): 0,
    }
    assert _per_bin(t) == {k: [v] * 10 for k, v in {**HOST_LINKS, **fabric}.items()}
    assert got.class_bytes == {"host_up": 45080, "leaf_spine": 35010, "spine_leaf": 35010, "host_down": 45080}
    caps = t.groupby("link_class")["capacity_bps"].unique().to_dict()
    assert {k: v.tolist() for k, v in caps.items()} == {
        "host_down": [8e11],
        "host_up": [8e11],
        "leaf_spine": [4e11],
        "spine_leaf": [4e11],
    }


def test_hand_worked_leaf_spine_split_divides_each_bin_to_the_byte():
    t = _build("split").table
    fabric = {
        ("leaf-1", "spine-1"): 1500,
        ("leaf-1", "spine-2"): 1500,
        ("leaf-2", "spine-1"): 251,  # 501 = 250 + 250, the remainder byte to the lowest spine
        ("leaf-2", "spine-2"): 250,
        ("spine-1", "leaf-1"): 251,
        ("spine-2", "leaf-1"): 250,
        ("spine-1", "leaf-2"): 1500,
        ("spine-2", "leaf-2"): 1500,
    }
    assert _per_bin(t) == {k: [v] * 10 for k, v in {**HOST_LINKS, **fabric}.items()}


def test_a_flow_inside_one_host_crosses_no_link():
    fi, li, co = routes.flow_links(_topo("hash"), np.array([1, 0]), np.array([1, 2]), np.array([5, 6]))
    assert fi.tolist() == [1, 1, 1, 1]  # only the 0 -> 2 flow: host up, leaf->spine, spine->leaf, host down
    up, down, to_spine, from_spine = li.tolist()  # host-1 up, host-3 down, leaf-1 -> spine j, spine j -> leaf-2
    assert (up, down) == (0, 4 + 2) and to_spine in (8, 9) and from_spine == to_spine + 6 and co.tolist() == [1.0] * 4


def test_hash_ecmp_is_deterministic_and_follows_the_network_model():
    flows = pd.DataFrame(
        {
            "comm_id": [f"{c:016x}" for c in range(40)] * 2,
            "stream": [(k % 2) << 32 for k in range(80)],
            "src_node": [0] * 80,
            "dst_node": [2] * 80,
        }
    )
    keys = routes.connection_keys(flows, 2)
    assert (keys == routes.connection_keys(flows, 2)).all()
    # rows k and k + 40: same communicator, source rank (device k % 2) and destination node
    assert (keys[:40] == keys[40:]).all() and len(set(keys.tolist())) == 40
    topo = _topo("hash")
    fi, li, _ = routes.flow_links(topo, flows["src_node"].to_numpy(), flows["dst_node"].to_numpy(), keys)
    up = li[(li >= 8) & (li < 12)]  # the leaf_spine link of each flow, in flow order
    # the spine of Topology.routes (the analytic simulator's rule) for the same keys
    _, ref, _ = topo.routes(flows["src_node"].to_numpy(), flows["dst_node"].to_numpy(), keys)
    assert up.tolist() == ref[(ref >= 8) & (ref < 12)].tolist()
    # one connection (same communicator, source rank and destination node): one spine
    by_key = pd.Series(up).groupby(keys).nunique()
    assert (by_key == 1).all()
    assert set(up.tolist()) == {8, 9}  # 40+ connections spread over both spines
    t1 = lb.build_link_bins(STEP, np.array([3, 1, 4, 1]), topo, step_time_s=0.1, run_id="r", routes="m", **WINDOW)
    t2 = lb.build_link_bins(STEP, np.array([3, 1, 4, 1]), topo, step_time_s=0.1, run_id="r", routes="m", **WINDOW)
    pd.testing.assert_frame_equal(t1.table, t2.table)


def test_routes_kind_says_modelled_unless_the_simulation_used_these_paths():
    src, dst = np.array([0]), np.array([2])
    assert routes.routes_kind("analytic", _topo("first"), src, dst) == "simulated"
    assert routes.routes_kind("analytic", _topo("split"), src, dst) == "simulated"
    assert routes.routes_kind("analytic", _topo("hash"), src, dst) == "modelled"
    assert routes.routes_kind("analytic", _topo("hash"), np.array([0]), np.array([1])) == "simulated"  # one rack
    for source in ("import", "docker", "kineto", "chakra"):
        assert routes.routes_kind(source, _topo("first"), src, dst) == "modelled"


@pytest.mark.parametrize("ecmp", ["first", "split", "hash"])
def test_conservation_holds_and_fails_on_a_corrupted_table(ecmp):
    built = _build(ecmp)
    expected = lb.expected_class_bytes(STEP, _topo(ecmp), step_time_s=0.1, run_id="hand", **WINDOW)
    assert expected == {"host_up": 45080, "leaf_spine": 35010, "spine_leaf": 35010, "host_down": 45080}
    assert links_stage.conservation_outcome(built.table, expected).passed
    one_byte = built.table.copy()
    row = one_byte.index[(one_byte["link_class"] == "spine_leaf") & (one_byte["bytes"] > 0)][0]
    one_byte.loc[row, "bytes"] -= 1
    bad = links_stage.conservation_outcome(one_byte, expected)
    assert not bad.passed and "spine_leaf: table 35009 != flows 35010 (by -1)" in bad.message
    dropped = built.table[built.table["src"] != "host-1"]  # host-1's uplink lost
    bad = links_stage.conservation_outcome(dropped, expected)
    assert not bad.passed and "host_up: table 5080 != flows 45080" in bad.message


RUN = "phantora_a100_40g_W4_4x1"  # 4 hosts, 2 racks: traffic between racks crosses the spines


@pytest.mark.slow
def test_shipped_run_materializes_link_bins_into_duckdb(tmp_path):
    res = dg.materialize(
        d.ALL_ASSETS,
        selection=d.RUN_ASSETS,
        partition_key=RUN,
        instance=ephemeral_with_runs([RUN]),
        raise_on_error=False,
        resources={"data": DataRoot(data_dir=str(tmp_path)), "simulator": AnalyticSimulatorResource()},
        run_config=QUIET,
    )
    assert res.success
    (check,) = [e for e in res.get_asset_check_evaluations() if e.asset_key.to_user_string() == "link_bins"]
    assert check.check_name == "link_bins_conserve_bytes" and check.passed
    paths = DataPaths(tmp_path)
    spec = next(s for s in load_run_matrix() if s.run_id == RUN)
    assert read_checks(paths.run_folder(spec))["link_bins_conserve_bytes"]["status"] == "passed"
    table = pd.read_parquet(paths.table(RUN, "link_bins"))
    assert len(table) == 1800 * 16 and set(table["routes"]) == {"modelled"}
    # every host uplink in every bin = that node's bytes in flows_100ms minus its control traffic, to the byte
    bins = pd.read_parquet(paths.table(RUN, "flows_100ms"))
    net = bins["bytes"] - control_matrix(4)[bins["src_node"], bins["dst_node"]]
    sent = net.groupby([bins["t"], bins["src_node"]]).sum()
    up = table[table["link_class"] == "host_up"]
    assert up["bytes"].tolist() == sent.tolist()
    cls = table.groupby("link_class")["bytes"].sum().to_dict()
    # every byte sent up is received down; 4 hosts, 2 a leaf: the data-parallel ring 1-2-3-4 crosses racks
    # on 2 of its 4 hops (2 -> 3, 4 -> 1), so half the bytes go up a spine and down again
    total = int(sent.sum())
    assert cls == {"host_up": total, "host_down": total, "leaf_spine": total // 2, "spine_leaf": total // 2}
    assert total % 2 == 0
    dataset_stage.export_dataset([spec], paths)
    db = dataset_stage.dataset_duckdb_stage([spec], paths)
    assert db.outcome.passed and db.build.rows["link_bins"] == 1800 * 16
    with duckdb.connect(str(paths.duckdb_path), read_only=True) as con:
        (n, top) = con.execute("select count(*), max(peak_utilisation) from hottest_links").fetchone() or (0, 0)
        (peak,) = con.execute("select max(bytes * 8 / 0.1 / capacity_bps) from link_bins").fetchone() or (0,)
        (mine,) = con.execute("select max(utilisation) from link_utilisation").fetchone() or (0,)
    assert n == 10 and top == pytest.approx(peak) and mine == pytest.approx(peak)
    assert (paths.plots_dir(spec) / "link_utilisation.png").exists()


@pytest.mark.slow
@pytest.mark.parametrize("ecmp", ["first", "split", "hash"])
def test_path_form_and_per_link_rows_give_the_same_table_to_the_byte(ecmp):
    """build_link_bins places each flow once per path (by_path=True, the default for small runs) or once
    per (flow, link) (by_path=False, many paths): integer sums of the same placements, so the tables are
    equal to the byte -- here for 400 flows with random offsets, lengths (some past the step, some 0, some
    past the whole window), sizes up to 2**40 and every host pair, 3 spines, on a jittered window with
    edge instances; and expected_class_bytes (in-window shares counted directly, no bins) agrees."""
    rng = np.random.default_rng(7)
    n = 400
    src = rng.integers(0, 6, n)
    dst = (src + rng.integers(1, 6, n)) % 6
    dur = rng.uniform(0, 40_000, n)
    dur[::17] = 0.0
    dur[5::29] = 2_500_000.0  # longer than the 2 s window: instances across both edges
    dur[7::31] = 3_200_000.0  # >= 3 s: the split's Python-integer path
    flows = pd.DataFrame(
        {
            "offset_us": rng.uniform(0, 30_000, n),
            "dur_us": dur,
            "src_node": src,
            "dst_node": dst,
            "bytes": rng.integers(1, 2**40, n),
        }
    )
    topo = Topology.from_cluster({**CLUSTER, "nspines": 3, "ecmp": ecmp}, 6)
    conn = rng.integers(0, 50, n)
    args = dict(step_time_s=0.031, run_id="paths", routes="modelled", window_s=2.0, bin_s=0.01, jitter=0.02)
    a = lb.build_link_bins(flows, conn, topo, by_path=True, **args)
    b = lb.build_link_bins(flows, conn, topo, by_path=False, **args)
    pd.testing.assert_frame_equal(a.table, b.table)
    assert a.class_bytes == b.class_bytes
    assert a.table["bytes"].sum() > 0
    expected = lb.expected_class_bytes(flows, topo, step_time_s=0.031, run_id="paths", window_s=2.0, bin_s=0.01)
    assert links_stage.conservation_outcome(a.table, expected).passed
