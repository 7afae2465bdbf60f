"""link_bins on disk (lib/store/link_table.py, issue 37 item 5): the matrix written a row group at a time
reads back as the same rows the whole pandas table held (the representation before), to the byte, and
both equal a 2-host run's link bytes summed by hand from the routing rule; the utilisation plot's
per-class peaks read a row group at a time equal the whole table's; DuckDB reads the file as before."""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from phantora_assets.lib.net import link_bins as lb
from phantora_assets.lib.sim.network import Topology
from phantora_assets.lib.store import link_table
from phantora_assets.lib.store.parquet import write_parquet
from phantora_assets.stages import links as links_stage

# 2 hosts in 2 racks of 1 (leaf-1: host-1, leaf-2: host-2), 1 spine
CLUSTER = {"rack_size": 1, "nspines": 1, "host_bw_gbps": 800, "rack_uplink_port_bw_gbps": 400, "loopback_gbps": 2880}
# each flow lasts the whole 100 ms step, repeated back to back (jitter 0): every 100 ms bin holds its bytes
STEP = pd.DataFrame(
    {"offset_us": [0.0, 0.0], "dur_us": [100_000.0] * 2, "src_node": [0, 1], "dst_node": [1, 0], "bytes": [1000, 37]}
)
WINDOW = {"window_s": 1.0, "bin_s": 0.1, "jitter": 0.0}
# By hand (lib/net/routes.py's docstring): links host_up 0, 1; host_down 2 (leaf-1 -> host-1), 3 (leaf-2 ->
# host-2); leaf_spine 4 (leaf-1 -> spine-1), 5 (leaf-2 -> spine-1); spine_leaf 6 (-> leaf-1), 7 (-> leaf-2).
# host-1 -> host-2 (1000 B): host_up 0, leaf_spine 4, spine_leaf 7, host_down 3;
# host-2 -> host-1 (37 B): host_up 1, leaf_spine 5, spine_leaf 6, host_down 2.
HAND = [1000, 37, 37, 1000, 1000, 37, 37, 1000]
ENDS = [
    ("host-1", "leaf-1"),
    ("host-2", "leaf-2"),
    ("leaf-1", "host-1"),
    ("leaf-2", "host-2"),
    ("leaf-1", "spine-1"),
    ("leaf-2", "spine-1"),
    ("spine-1", "leaf-1"),
    ("spine-1", "leaf-2"),
]


def _built() -> lb.LinkBins:
    topo = Topology.from_cluster({**CLUSTER, "ecmp": "hash"}, 2)
    return lb.build_link_bins(STEP, np.array([0, 1]), topo, step_time_s=0.1, run_id="two", routes="modelled", **WINDOW)


def _write(built: lb.LinkBins, path) -> None:
    times = lb.link_bin_times(built.per_link.shape[0], built.bin_s)
    link_table.write_link_bins(built.per_link, built.links, "two", built.bin_s, built.routes, times, path)


@pytest.mark.parametrize("chunk_rows", [link_table.CHUNK_ROWS, 8, 5, 1])
def test_written_matrix_reads_back_as_the_whole_tables_rows_and_the_hand_sums(tmp_path, monkeypatch, chunk_rows):
    monkeypatch.setattr(link_table, "CHUNK_ROWS", chunk_rows)  # 1 row group; 1 bin; 1 bin (5 < 8 links); 1 bin
    built = _built()
    _write(built, tmp_path / "new.parquet")
    write_parquet(built.table, tmp_path / "old.parquet")  # the representation before: one pandas table
    new, old = pd.read_parquet(tmp_path / "new.parquet"), pd.read_parquet(tmp_path / "old.parquet")
    pd.testing.assert_frame_equal(new, old)
    assert list(new.dtypes.astype(str)) == ["object", "float64", "float64", "int64"] + ["object"] * 3 + [
        "int64",
        "float64",
        "object",
    ]
    assert pq.ParquetFile(tmp_path / "new.parquet").num_row_groups == (1 if chunk_rows >= 80 else 10)
    assert len(new) == 10 * 8 and new["link_id"].tolist() == list(range(8)) * 10
    assert new["t"].tolist() == np.repeat(np.round(np.arange(10) * 0.1, 6), 8).tolist()
    assert new["bytes"].tolist() == HAND * 10
    assert list(zip(new["src"], new["dst"]))[:8] == ENDS
    assert new["capacity_bps"].tolist()[:8] == [8e11] * 4 + [4e11] * 4
    assert set(new["run_id"]) == {"two"} and set(new["routes"]) == {"modelled"}


def test_class_bytes_of_the_matrix_are_the_tables_and_the_hand_sums():
    built = _built()
    hand = {"host_up": 10 * 1037, "leaf_spine": 10 * 1037, "spine_leaf": 10 * 1037, "host_down": 10 * 1037}
    assert built.class_bytes == lb.class_bytes(built.table) == hand
    expected = lb.expected_class_bytes(STEP, Topology.from_cluster(CLUSTER, 2), step_time_s=0.1, run_id="two", **WINDOW)
    a = links_stage.conservation_outcome(built.class_bytes, expected)
    b = links_stage.conservation_outcome(built.table, expected)
    assert a.passed and (a.message, a.metadata) == (b.message, b.metadata)
    assert not links_stage.conservation_outcome({**built.class_bytes, "host_up": 10 * 1037 - 1}, expected).passed


def test_class_peaks_by_row_group_equal_the_whole_tables_and_the_hand_values(tmp_path, monkeypatch):
    monkeypatch.setattr(link_table, "CHUNK_ROWS", 8)  # a row group a bin
    built = _built()
    _write(built, tmp_path / "lb.parquet")
    by_file, whole = link_table.class_peaks(tmp_path / "lb.parquet"), link_table.class_peaks(built.table)
    assert by_file.classes == whole.classes == ("host_up", "host_down", "leaf_spine", "spine_leaf")
    assert by_file.links == whole.links == (2, 2, 2, 2)
    assert (by_file.bin_s, by_file.routes) == (whole.bin_s, whole.routes) == (0.1, "modelled")
    np.testing.assert_array_equal(by_file.t, whole.t)
    np.testing.assert_array_equal(by_file.peak, whole.peak)
    host, fabric = 1000 * 8 / 0.1 / 8e11 * 100, 1000 * 8 / 0.1 / 4e11 * 100  # the busiest link: host-1's flow
    np.testing.assert_allclose(by_file.peak, np.tile([host, host, fabric, fabric], (10, 1)), rtol=1e-15)


def test_duckdb_reads_the_file_as_the_link_bins_view_does(tmp_path, monkeypatch):
    monkeypatch.setattr(link_table, "CHUNK_ROWS", 8)
    _write(_built(), tmp_path / "lb.parquet")
    with duckdb.connect() as con:
        rows = con.execute(
            f"select link_class, typeof(src), sum(bytes)::bigint from read_parquet('{tmp_path / 'lb.parquet'}') "
            "group by all order by 1"
        ).fetchall()
    assert rows == [(c, "VARCHAR", 10 * 1037) for c in ("host_down", "host_up", "leaf_spine", "spine_leaf")]


def test_a_matrix_that_is_not_the_links_is_refused(tmp_path):
    built = _built()
    with pytest.raises(ValueError, match="8 links and 10 bins"):
        link_table.write_link_bins(built.per_link[:, :7], built.links, "two", 0.1, "m", np.zeros(10), tmp_path / "x")
