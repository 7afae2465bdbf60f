"""Bounded memory for the per-pair bins (issue 26 item 6, issue 37 item 3): a run whose dense per-pair
bin table would exceed the bound (a 1024 x 1 run: 1800 bins x 1,047,552 pairs, 14 GiB a matrix) is no
longer refused: it is built and stored sparse (the rows that carry flow bytes), through every asset, with
the dense build's cells and windows; a sparse table above its own bound is refused at binned_flows,
named. The shipped layouts are dense, far inside the bound."""

from __future__ import annotations

import numpy as np
import pandas as pd
from fixtures.materialize import ephemeral_with_runs

from phantora_assets.definitions import build_defs
from phantora_assets.lib.run.spec import RunSpec, validate
from phantora_assets.lib.store import bin_table
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.sources.base import SourceContext
from phantora_assets.stages import simulation

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def test_the_dense_bound_counts_bins_times_ordered_pairs():
    assert bin_table.dense_cells(1024, 180.0, 0.1) == 1800 * 1024 * 1023 == 1_885_593_600
    assert bin_table.dense_cells(128, 180.0, 0.1) == 1800 * 128 * 127
    assert bin_table.dense_cells(4, 180.0, 0.01) == 18_000 * 12
    assert not bin_table.is_sparse(128, 180.0, 0.1)  # 29 M cells: 128 x 8 layouts are dense
    assert not bin_table.is_sparse(193, 180.0, 0.1)  # 1800 x 193 x 192 = 66.7 M
    assert bin_table.is_sparse(194, 180.0, 0.1)  # 67.4 M > 2**26
    assert not bin_table.is_sparse(256, 180.0, 1.0)  # wider bins, fewer cells


def test_every_shipped_run_is_dense():
    specs = load_run_matrix()
    assert specs and not any(bin_table.is_sparse(s.n_nodes, 180.0, s.bin_s) for s in specs)


def test_the_bound_can_be_set(monkeypatch):
    monkeypatch.setenv(bin_table.MAX_CELLS_ENV, "1000")
    assert bin_table.is_sparse(4, 180.0, 0.1)
    monkeypatch.setenv(bin_table.MAX_CELLS_ENV, str(2**31))
    assert not bin_table.is_sparse(1024, 180.0, 0.1)  # 1.89 G cells <= 2**31: a host with the memory
    monkeypatch.setenv(bin_table.MAX_CELLS_ENV, "not a number")
    assert bin_table.max_dense_cells() == bin_table.MAX_DENSE_CELLS


def test_a_run_above_the_dense_bound_is_simulated_not_refused(tmp_path):
    spec = RunSpec("W4", "h100", 1024, 1)  # was refused at raw_timeline: 1.89 G dense cells
    validate(spec, "t")
    paths = DataPaths(tmp_path / "data")
    simulation.raw_timeline(spec, paths, SourceContext())
    assert (paths.partition_dir(spec.run_id) / "run_spec.json").exists()


def _built(root, spec, env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    defs = build_defs(root, [spec])
    res = defs.resolve_job_def("all_runs").execute_in_process(
        partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET, raise_on_error=False
    )
    for k in env:
        monkeypatch.delenv(k)
    return res, DataPaths(root).partition_dir(spec.run_id)


def test_a_leaf_spine_job_above_the_bound_goes_through_every_asset_sparse(tmp_path, monkeypatch):
    """W4 (DeepSpeed, data parallel: a ring over the 16 single-GPU nodes of the leaf-spine fabric) with
    the dense bound lowered to 1,000 cells: built sparse, every asset materialized; its rows are the dense
    build's cells that exceed their control bytes, and its windows are the dense build's."""
    spec = RunSpec("W4", "a100_40g", 16, 1)
    res, sparse_dir = _built(tmp_path / "sparse", spec, {bin_table.MAX_CELLS_ENV: "1000"}, monkeypatch)
    assert res.success, [e.message for e in res.all_events if e.event_type_value == "STEP_FAILURE"]
    ref, dense_dir = _built(tmp_path / "dense", spec, {}, monkeypatch)
    assert ref.success
    sparse_file, dense_file = sparse_dir / "flows_100ms.parquet", dense_dir / "flows_100ms.parquet"
    assert bin_table.is_sparse_file(sparse_file) and not bin_table.is_sparse_file(dense_file)
    dense = pd.read_parquet(dense_file)
    assert len(dense) == 1800 * 16 * 15
    ctrl = bin_table.control_at(  # each pair's control bytes in every bin, from the build rule
        bin_table.control_per_split(16, 5000)[bin_table.pair_index(dense["src_node"], dense["dst_node"], 16)],
        np.rint(dense["t"] / 0.1).astype(np.int64),
        100_000_000,
    )
    flow_rows = dense[dense["bytes"].to_numpy() > ctrl].reset_index(drop=True)
    sparse = pd.read_parquet(sparse_file)
    assert sparse.equals(flow_rows) and 0 < len(sparse) <= 1800 * 16  # the ring's 16 pairs at most
    X, _, _ = bin_table.read_bin_matrix(sparse_file, 0.1, 1800)
    assert np.array_equal(X, dense["bytes"].to_numpy().reshape(1800, 240))
    a, b = pd.read_parquet(dense_dir / "windows.parquet"), pd.read_parquet(sparse_dir / "windows.parquet")
    pd.testing.assert_frame_equal(a, b, check_exact=False, rtol=1e-12)
    plots = DataPaths(tmp_path / "sparse").plots_dir(spec)
    assert {p.name for p in plots.glob("*.png")} >= {"timeseries.png", "pair_heatmap.png"}


def test_a_sparse_table_above_its_own_bound_is_refused_before_simulating(tmp_path, monkeypatch):
    """The binned stages' bound (bins x the node pairs that carry flows) is known from the layout's
    collectives (``lib/stage_memory.host_memory_rule``): the run is refused at raw_timeline, before it is
    simulated, with binned_flows' rule (was: simulated, then refused at binned_flows after `runs` said it fits)."""
    spec = RunSpec("W4", "a100_40g", 16, 1)
    env = {bin_table.MAX_CELLS_ENV: "1000", bin_table.MAX_SPARSE_ROWS_ENV: "1000"}
    res, _ = _built(tmp_path / "data", spec, env, monkeypatch)
    assert not res.success
    failures = [e for e in res.all_events if e.event_type_value == "STEP_FAILURE"]
    assert [e.step_key for e in failures] == ["raw_timeline"]
    err = failures[0].event_specific_data.error
    text = err.message + (err.cause.message if err.cause is not None else "")
    assert "binned_flows: bin table too large: 1800 bins x 16 node pairs that carry flows = up to 28,800 rows" in text
