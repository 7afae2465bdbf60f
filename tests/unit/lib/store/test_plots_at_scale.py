"""Per-run plots of a large run (issue 37 item 5): the step anatomy chart shows at most 16 hosts, the most
exposed ones (chosen by hand here); the link utilisation plot read from link_bins.parquet a row group at a
time is the plot of the whole table, to the byte."""

from __future__ import annotations

import numpy as np
import pandas as pd

from phantora_assets.lib.net import link_bins as lb
from phantora_assets.lib.sim.network import Topology
from phantora_assets.lib.store import link_table, plots
from phantora_assets.stages.analysis import png_size


def test_anatomy_hosts_are_all_up_to_16_else_the_16_most_exposed_in_host_order():
    few = [f"host-{i + 1}" for i in range(16)]
    assert plots.anatomy_hosts(few, pd.DataFrame({"host": [], "exposed_comm_us": []})) == few
    hosts = [f"host-{i + 1}" for i in range(40)]
    # exposed: host-k has k us, except host-3 and host-7 with 1000 us; host-40 has no row (0)
    rows = pd.DataFrame(
        {"host": hosts[:39], "exposed_comm_us": [1000.0 if i in (2, 6) else i + 1.0 for i in range(39)]}
    )
    # by hand: host-3, host-7, then host-39 down to host-26 (14 more): 16 hosts
    want = ["host-3", "host-7"] + [f"host-{k}" for k in range(26, 40)]
    assert plots.anatomy_hosts(hosts, rows) == want
    ties = pd.DataFrame({"host": hosts, "exposed_comm_us": [5.0] * 40})
    assert plots.anatomy_hosts(hosts, ties) == hosts[:16]


def test_anatomy_chart_of_2048_hosts_draws_16_lanes():
    n = 2048
    hosts = [f"host-{i + 1}" for i in range(n)]
    spans = pd.DataFrame(
        {
            "host": np.repeat(hosts, 2),
            "kind": ["compute", "communication"] * n,
            "start_us": [0.0, 500.0] * n,
            "end_us": [500.0, 900.0] * n,
        }
    )
    rows = pd.DataFrame(
        {
            "host": hosts,
            "compute_us": 500.0,
            "comm_us": 400.0,
            "exposed_comm_us": np.arange(n, dtype=float),
            "idle_us": 100.0,
        }
    )
    png = plots.step_anatomy_chart(spans, rows, "big", 1, 1000.0)
    assert png_size(png) == plots.SIZES["step_anatomy"]


def test_link_utilisation_from_the_file_by_row_group_is_the_whole_tables_plot(tmp_path, monkeypatch):
    cluster = {"rack_size": 2, "nspines": 2, "host_bw_gbps": 800, "rack_uplink_port_bw_gbps": 400}
    topo = Topology.from_cluster({**cluster, "loopback_gbps": 2880, "ecmp": "hash"}, 4)
    step = pd.DataFrame(
        {
            "offset_us": [0.0, 20_000.0, 50_000.0],
            "dur_us": [30_000.0, 60_000.0, 10_000.0],
            "src_node": [0, 3, 1],
            "dst_node": [2, 0, 0],
            "bytes": [9_000_000, 4_000_000, 123_456],
        }
    )
    built = lb.build_link_bins(
        step, np.arange(3), topo, step_time_s=0.1, run_id="r", routes="modelled", window_s=6.0, bin_s=0.1, jitter=0.02
    )
    monkeypatch.setattr(link_table, "CHUNK_ROWS", 16 * 7)  # 7 bins a row group: 9 groups, the last shorter
    times = lb.link_bin_times(60, 0.1)
    link_table.write_link_bins(built.per_link, built.links, "r", 0.1, "modelled", times, tmp_path / "lb.parquet")
    assert built.per_link.sum() > 0
    whole = plots.link_utilisation(built.table, "r")
    assert plots.link_utilisation(tmp_path / "lb.parquet", "r") == whole


def test_pair_heatmap_sums_blocks_of_hosts_past_128():
    # 2,048 hosts of 1 byte a pair: 64 blocks of 32 hosts, 32 x 32 = 1,024 bytes a block pair
    blocks, k = plots.host_blocks(np.ones((2048, 2048)))
    assert (k, blocks.shape) == (32, (64, 64)) and (blocks == 1024.0).all()
    # 130 hosts: blocks of ceil(130 / 64) = 3 hosts, 44 of them, the last holding host-130 alone
    m = np.zeros((130, 130))
    m[129, 0] = 7.0  # host-130 -> host-1
    m[5, 6] = 2.0  # host-6 -> host-7: block 1 -> block 2
    blocks, k = plots.host_blocks(m)
    assert (k, blocks.shape) == (3, (44, 44))
    assert blocks[43, 0] == 7.0 and blocks[1, 2] == 2.0 and blocks.sum() == 9.0
    # up to 128 hosts: the matrix itself
    same, k = plots.host_blocks(np.eye(128))
    assert k == 1 and same.shape == (128, 128)
    png = plots.pair_heatmap(np.ones((2048, 2048)), "big")
    assert png_size(png)[0] > 0
