"""`phantora-assets sweep`: a grid of layouts x bandwidths x workloads in one table."""

from __future__ import annotations

import pandas as pd

from phantora_assets.cli import main
from phantora_assets.sweep import SWEEP_COLUMNS, SweepPoint, grid, run_sweep, simulate_point


def test_exposed_communication_grows_as_bandwidth_falls(tmp_path):
    """3 layouts x 3 bandwidths x 2 workloads, through the CLI, written as CSV."""
    out = tmp_path / "sweep.csv"
    rc = main(
        [
            "sweep",
            "--layouts",
            "2x2,4x2,2x4",
            "--bandwidths",
            "400,200,100",
            "--workloads",
            "W1,W4",
            "--gpu",
            "a100_40g",
            "--out",
            str(out),
            "--quiet",
            "--jobs",
            "1",
        ]
    )
    assert rc == 0
    df = pd.read_csv(out)
    assert list(df.columns) == SWEEP_COLUMNS and len(df) == 18 and (df["status"] == "ok").all()
    for (wl, layout), g in df.groupby(["workload", "layout"]):
        g = g.sort_values("host_bw_gbps", ascending=False)
        exposed = g["exposed_comm_ms"].tolist()
        assert exposed[0] < exposed[1] < exposed[2], (wl, layout, exposed)
        assert g["iteration_time_ms"].is_monotonic_increasing
        assert g["inter_node_bytes_per_step"].nunique() == 1  # bytes do not depend on bandwidth
        assert (g["compute_ms"].max() - g["compute_ms"].min()) / g["compute_ms"].max() < 0.01


def test_grid_points_invalid_and_oom_rows():
    pts = grid(["2x1", "4x2"], [800], ["W1", "W2"], "a100_40g")
    assert [(p.workload, p.nodes, p.gpus_per_node) for p in pts] == [
        ("W1", 2, 1),
        ("W1", 4, 2),
        ("W2", 2, 1),
        ("W2", 4, 2),
    ]
    bad = simulate_point(SweepPoint("W1", "a100_40g", 3, 1, 800.0))  # 3 GPUs: TP=2 cannot divide
    assert bad["status"].startswith("invalid:")
    oom = simulate_point(SweepPoint("W2", "a100_40g", 2, 1, 800.0))
    assert oom["status"] == "out_of_memory" and oom["peak_memory_gib"] > 40


def test_sweep_topology_knobs_and_parallel_workers():
    pts = [
        SweepPoint("W4", "h100", 4, 8, 400.0, uplink_bw_gbps=100.0, rack_size=2, nspines=2, ecmp="split"),
        SweepPoint("W4", "h100", 4, 8, 400.0),
    ]
    df = run_sweep(pts, jobs=2)
    assert df.loc[0, "uplink_bw_gbps"] == 100 and df.loc[0, "ecmp"] == "split"
    assert df.loc[1, "uplink_bw_gbps"] == 400 and df.loc[1, "ecmp"] == "hash"
    # a 4:1 oversubscribed spine uplink slows the step
    assert df.loc[0, "iteration_time_ms"] > df.loc[1, "iteration_time_ms"]
