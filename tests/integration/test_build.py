"""The whole graph end to end (real `phantora-assets build`, real files), against published figures."""

from __future__ import annotations

import filecmp

import pandas as pd
import pytest
from fixtures.paths import published_rows

from phantora_assets.checks import read_checks
from phantora_assets.cli import main
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths

OK_ROWS = [r for r in published_rows() if r["status"] == "ok"]
OOM_ROWS = [r for r in published_rows() if r["status"] == "out_of_memory"]


@pytest.fixture(scope="module")
def runs(built) -> pd.DataFrame:
    return pd.read_csv(built / "phantora_v0" / "runs.csv").set_index("run_id")


@pytest.mark.parametrize("row", OK_ROWS, ids=[r["run_id"] for r in OK_ROWS])
def test_inter_node_bytes_match_published(runs, row):
    expected = float(row["inter_node_gb_per_step"]) * 1e9
    got = runs.loc[row["run_id"], "inter_node_bytes_per_step"]
    assert abs(got - expected) <= max(0.005 * expected, 0.005e9), (got, expected)


def test_out_of_memory_runs_are_the_published_ones(built, runs):
    paths = DataPaths(built)
    not_fitting = set()
    for spec in load_run_matrix():
        status = read_checks(paths.run_folder(spec))["fits_in_memory"]["status"]
        if status == "failed":
            not_fitting.add(spec.run_id)
    assert not_fitting == {r["run_id"] for r in OOM_ROWS}
    assert not_fitting.isdisjoint(runs.index)
    assert len(runs) == 26


def test_every_fitting_run_is_in_every_table(built, runs):
    bins = pd.read_parquet(built / "phantora_v0" / "flows_100ms", partitioning=None)
    wins = pd.read_parquet(built / "phantora_v0" / "windows", partitioning=None)
    assert set(bins["run_id"]) == set(runs.index) == set(wins["run_id"])


def test_binned_bytes_conserved_exactly(built, runs):
    """Sum of flows_100ms.bytes per run == placed flow bytes + control bytes, in integers."""
    import json

    from phantora_assets.lib.traffic.binning import build_bins

    paths = DataPaths(built)
    bins = pd.read_parquet(built / "phantora_v0" / "flows_100ms", partitioning=None)
    per_run = bins.groupby("run_id")["bytes"].sum()
    for spec in load_run_matrix():
        if spec.run_id not in runs.index:
            continue
        summary = json.loads((paths.partition_dir(spec.run_id) / "trace_summary.json").read_text())
        rebuilt = build_bins(
            pd.read_parquet(paths.table(spec.run_id, "step_flows")),
            step_time_s=summary["step_time_us"] / 1e6,
            n_nodes=spec.n_nodes,
            run_id=spec.run_id,
        )
        # 5 kB/s per node for 180 s
        assert rebuilt.control_bytes == spec.n_nodes * 5000 * 180
        assert int(per_run[spec.run_id]) == rebuilt.placed_flow_bytes + rebuilt.control_bytes
        assert read_checks(paths.run_folder(spec))["bins_conserve_bytes"]["status"] == "passed"


def test_rebuild_is_byte_identical(built, tmp_path):
    root2 = tmp_path / "data"
    # the plots are not compared here: skip drawing them the second time
    assert main(["build", "--data-dir", str(root2), "--quiet", "--no-plots"]) == 0
    for name in ("runs.csv", "flows_100ms.csv", "windows.csv"):
        assert filecmp.cmp(built / "phantora_v0" / name, root2 / "phantora_v0" / name, shallow=False), name
    spec = load_run_matrix()[0]
    assert filecmp.cmp(DataPaths(built).chrome_trace(spec), DataPaths(root2).chrome_trace(spec), shallow=False)


def test_run_folder_layout(built):
    spec = next(s for s in load_run_matrix() if s.run_id == "phantora_a100_40g_W1_2x2")
    folder = built / "traces" / "a100_40g" / "W1_2x2"
    assert (folder / "timeline.json.gz").stat().st_size > 0
    text = (folder / "checks.txt").read_text()
    for check in (
        "fits_in_memory",
        "flows_exist",
        "steps_match",
        "ring_bytes_match",
        "steady_steps_stable",
        "bins_conserve_bytes",
    ):
        assert f"[PASSED] {check}" in text
    assert (folder / "config" / "netconfig.toml").exists()
    assert spec.trace_dir == "traces/a100_40g/W1_2x2"


def test_every_analytic_trace_agrees_with_the_workload_model(built, runs):
    """The advisory cross-check passes on every built run, and never blocks one."""
    paths = DataPaths(built)
    for spec in load_run_matrix():
        rec = read_checks(paths.run_folder(spec)).get("matches_workload_model")
        if spec.run_id in runs.index:
            assert rec["status"] == "passed", (spec.run_id, rec)
        else:
            assert rec is None  # not fitting: no trace to cross-check
