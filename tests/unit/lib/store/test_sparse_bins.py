"""Sparse per-pair bins (issue 37 item 3): a run whose dense table exceeds the bound is built, written and
read as the rows that carry flow bytes only; the omitted rows are the pairs' control bytes of the build
rule, so the dense table, the conservation sum and every window feature are those of the dense build."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from fixtures.bin_flows import flows

from phantora_assets.lib.store import bin_table, plots
from phantora_assets.lib.traffic import window_features as wf
from phantora_assets.lib.traffic.binning import build_bins, conservation_ok

STEP_S = 0.1782


def ring_and_pipeline(n_nodes: int) -> pd.DataFrame:
    """A 3-D-parallel-like step: a ring all-reduce's hops i -> i+1 late in the step, and two pipeline
    sends 0 -> n/2 early in it (so most ordered pairs carry nothing but control traffic)."""
    rows = [(120_000.0 + 300 * i, 40_000.0, i, (i + 1) % n_nodes, 700_000_123 + i) for i in range(n_nodes)]
    rows += [(1_000.0, 5_000.0, 0, n_nodes // 2, 9_999_999), (60_000.0, 0.0, n_nodes // 2, 0, 4_321)]
    return flows(rows)


def control_cells(n_nodes: int, n_bins: int, bin_s: float, control_bytes_per_s: float) -> np.ndarray:
    """The control bytes of every (bin, pair) at width ``bin_s``, counted independently: each pair's
    100 ms share (500 B a node split over the others, the remainder to the lowest) sent at a constant
    rate, whole bytes by time t = floor(share * t / 100 ms), per bin the difference at its ends."""
    per_node = round(control_bytes_per_s * 0.1)
    shares = []
    for s in range(n_nodes):
        others = [d for d in range(n_nodes) if d != s]
        base, rem = divmod(per_node, len(others))
        shares += [base + (k < rem) for k in range(len(others))]
    edges = [round(i * bin_s * 1e9) for i in range(n_bins + 1)]
    return np.array([[c * edges[i + 1] // 10**8 - c * edges[i] // 10**8 for c in shares] for i in range(n_bins)])


CASES = [(8, 0.1, 5000), (6, 0.01, 5000), (12, 0.1, 20000), (5, 0.5, 0)]


@pytest.mark.parametrize("n_nodes, bin_s, cps", CASES)
def test_sparse_build_is_the_dense_build_without_its_control_only_rows(monkeypatch, n_nodes, bin_s, cps):
    kw = dict(step_time_s=STEP_S, n_nodes=n_nodes, run_id="r", bin_s=bin_s, control_bytes_per_s=cps)
    dense = build_bins(ring_and_pipeline(n_nodes), **kw)
    assert dense.sparse is None and dense.matrix is not None
    monkeypatch.setenv(bin_table.MAX_CELLS_ENV, "1000")  # every case above the bound: built sparse
    sparse = build_bins(ring_and_pipeline(n_nodes), **kw)
    assert sparse.matrix is None and sparse.sparse is not None
    sb = sparse.sparse
    ctrl = control_cells(n_nodes, sb.n_bins, bin_s, cps)
    flow = dense.matrix - ctrl
    assert (flow >= 0).all()
    b, p = np.nonzero(flow)  # the cells that carry flow bytes, in (bin, pair) order
    assert np.array_equal(sb.bin_idx, b) and np.array_equal(sb.pair, p)
    assert np.array_equal(sb.bytes, dense.matrix[b, p])
    assert len(b) < dense.matrix.size // 2  # most cells are control only
    monkeypatch.delenv(bin_table.MAX_CELLS_ENV)
    assert np.array_equal(bin_table.densify(sb), dense.matrix)
    assert conservation_ok(sparse) and conservation_ok(dense)
    assert sparse.binned_bytes() == int(dense.matrix.sum()) == sparse.placed_flow_bytes + sparse.control_bytes
    assert (sparse.placed_flow_bytes, sparse.control_bytes) == (dense.placed_flow_bytes, dense.control_bytes)
    assert sparse.control_bytes == int(ctrl.sum())


def test_a_sparse_file_holds_the_rows_says_so_and_reads_back(tmp_path, monkeypatch):
    n, kw = 8, dict(step_time_s=STEP_S, n_nodes=8, run_id="run_x", bin_s=0.1)
    dense = build_bins(ring_and_pipeline(n), **kw)
    sb = build_bins(ring_and_pipeline(n), sparse=True, **kw).sparse
    path = tmp_path / "flows_100ms.parquet"
    bin_table.write_sparse_bins(sb, "run_x", path)
    meta = pq.ParquetFile(path).schema_arrow.metadata
    assert meta[b"phantora_sparse_pairs"] == b"8" and meta[b"phantora_bins"] == b"1800"
    assert b"phantora_dense_pairs" not in meta and b"control-only rows" in meta[b"phantora_omitted_rows"]
    table = pd.read_parquet(path)
    assert list(table.columns) == ["run_id", "t", "src_node", "dst_node", "bytes"] and len(table) == len(sb.bytes)
    assert (table["run_id"] == "run_x").all() and table["bytes"].dtype == np.int64
    assert table.equals(build_bins(ring_and_pipeline(n), sparse=True, **kw).bins.astype(table.dtypes))
    keys = table[["t", "src_node", "dst_node"]].to_records(index=False).tolist()
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    back = bin_table.read_bins(path, 0.1, 1800)
    assert isinstance(back, bin_table.SparseBins)
    for a, b in ((back.bin_idx, sb.bin_idx), (back.pair, sb.pair), (back.bytes, sb.bytes)):
        assert np.array_equal(a, b)
    X, present, pairs = bin_table.read_bin_matrix(path, 0.1, 1800)  # the dense form, every pair
    assert np.array_equal(X, dense.matrix) and present.all() and len(pairs) == n * (n - 1)
    monkeypatch.setenv(bin_table.MAX_CELLS_ENV, "1000")
    with pytest.raises(ValueError, match=r"densify: 1800 bins x 56 pairs = 100,800 cells, more than the 1,000"):
        bin_table.densify(back)


@pytest.mark.parametrize("n_nodes, bin_s, cps", CASES)
def test_window_features_of_sparse_bins_equal_those_of_dense_bins(n_nodes, bin_s, cps):
    kw = dict(step_time_s=STEP_S, n_nodes=n_nodes, run_id="r", bin_s=bin_s, control_bytes_per_s=cps)
    dense = build_bins(ring_and_pipeline(n_nodes), sparse=False, **kw)
    sparse = build_bins(ring_and_pipeline(n_nodes), sparse=True, **kw)
    src, dst = bin_table.pair_nodes(n_nodes)
    pairs = list(zip(src.tolist(), dst.tolist()))
    present = np.ones(dense.matrix.shape[0], dtype=bool)
    a = wf.matrix_window_features(dense.matrix, present, pairs, "r", bin_s=bin_s, control_bytes_per_s=cps)
    b = wf.sparse_window_features(sparse.sparse, "r")
    assert list(a.columns) == list(b.columns) and a.dtypes.equals(b.dtypes) and len(a) == len(b) > 0
    for col in a.columns:
        if col == "pair_entropy_bits":  # a sum of floats in another order
            np.testing.assert_allclose(b[col], a[col], rtol=1e-12, atol=1e-12)
        else:
            assert a[col].equals(b[col]), col
    assert (a["n_active_pairs"] <= n_nodes + 2).all() and (a["idle_bin_fraction"] < 1).all()


def test_the_timeseries_plot_of_a_sparse_run_has_the_dense_series():
    n, kw = 8, dict(step_time_s=STEP_S, n_nodes=8, run_id="r", bin_s=0.1)
    dense = build_bins(ring_and_pipeline(n), sparse=False, **kw)
    sb = build_bins(ring_and_pipeline(n), sparse=True, **kw).sparse
    t, per_pair, keys, total = plots._sparse_series(sb, 3)
    assert np.array_equal(total, dense.matrix.sum(axis=1)) and len(t) == 1800
    src, dst = bin_table.pair_nodes(n)
    top = np.argsort(-dense.matrix.sum(axis=0), kind="stable")[:3]
    assert keys.tolist() == [int(src[j]) * 2**20 + int(dst[j]) for j in top]
    assert np.array_equal(per_pair, dense.matrix[:, top].T)
    assert plots.timeseries(sb, "r", 0.1, STEP_S)[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sparse_bound_counts_bins_times_pairs_that_carry_flows(monkeypatch):
    assert bin_table.sparse_rows_rule(1800, 18_000) is None  # 32.4 M rows <= 2**25
    why = bin_table.sparse_rows_rule(1800, 20_000)
    assert why is not None and why.startswith("1800 bins x 20,000 node pairs that carry flows = up to 36,000,000 rows")
    monkeypatch.setenv(bin_table.MAX_SPARSE_ROWS_ENV, "1000")
    assert "more than the 1,000" in bin_table.sparse_rows_rule(100, 11)
    assert not bin_table.is_sparse(193, 180.0, 0.1) and bin_table.is_sparse(194, 180.0, 0.1)
    assert bin_table.is_sparse(2048, 180.0, 0.1) and not bin_table.is_sparse(256, 180.0, 1.0)


def test_the_documented_duckdb_query_gives_the_dense_table_back():
    """docs/QUERIES.md "The dense form of a sparse run": its SQL over a sparse run's rows is the dense build."""
    import duckdb
    from fixtures.paths import ROOT

    text = (ROOT / "docs" / "QUERIES.md").read_text()
    sql = text.split("## The dense form of a sparse run", 1)[1].split("```sql\n", 1)[1].split("```", 1)[0]
    for n, bin_s in ((8, 0.1), (6, 0.01)):
        kw = dict(step_time_s=STEP_S, n_nodes=n, run_id="r", bin_s=bin_s)
        dense = build_bins(ring_and_pipeline(n), sparse=False, **kw).bins
        rows = build_bins(ring_and_pipeline(n), sparse=True, **kw).bins.assign(bin_s=bin_s)
        con = duckdb.connect()
        con.register("rows_df", rows)
        con.execute("CREATE TABLE flows_binned AS SELECT * FROM rows_df")
        con.execute(f"CREATE TABLE runs AS SELECT 'r' AS run_id, {n}::BIGINT AS n_nodes, {bin_s}::DOUBLE AS bin_s")
        out = con.execute(sql, ["r"]).df()
        assert len(rows) < len(out) == len(dense) == 1800 * round(0.1 / bin_s) * n * (n - 1)
        for col in ("t", "src_node", "dst_node", "bytes"):
            assert np.array_equal(out[col].to_numpy(), dense[col].to_numpy()), col
