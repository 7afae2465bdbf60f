"""Tests of phantora_assets.lib.traffic.binning (DATASET.md sections 4 and 5)."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest
from fixtures.bin_flows import build_alone, flows

from phantora_assets.lib.columns import BIN_COLUMNS
from phantora_assets.lib.traffic.binning import (
    BinnedFlows,
    build_bins,
    conservation_ok,
    control_matrix,
    seed_from_run_id,
    split_flow_bytes,
)

MS = 1_000_000  # ns


def ring_step(step_time_s: float, n_nodes: int = 4, n_flows: int = 40, seed: int = 1) -> pd.DataFrame:
    """A plausible step: flows in the last 40 % of the step, some crossing its end."""
    rng = np.random.default_rng(seed)
    step_us = step_time_s * 1e6
    src = rng.integers(0, n_nodes, n_flows)
    dst = (src + rng.integers(1, n_nodes, n_flows)) % n_nodes
    return flows(
        list(
            zip(
                rng.uniform(0.6 * step_us, step_us, n_flows),
                rng.uniform(0, 0.3 * step_us, n_flows),
                src,
                dst,
                rng.integers(0, 3_000_000_000, n_flows),
            )
        )
    )


@pytest.fixture(scope="module")
def built() -> BinnedFlows:
    return build_bins(ring_step(0.1782), step_time_s=0.1782, n_nodes=4, run_id="phantora_a100_40g_W4_4x1")


def test_conservation_exact(built: BinnedFlows) -> None:
    assert conservation_ok(built)
    assert built.bins["bytes"].sum() == built.placed_flow_bytes + built.control_bytes
    assert built.control_bytes == 4 * 500 * 1800
    assert built.placed_flow_bytes > 0


def test_dense_grid_and_contract(built: BinnedFlows) -> None:
    bins = built.bins
    assert list(bins.columns) == list(BIN_COLUMNS)
    assert len(bins) == 1800 * 12
    assert bins["bytes"].dtype == np.int64
    assert bins["src_node"].dtype == np.int64 and bins["dst_node"].dtype == np.int64
    assert bins["t"].dtype == np.float64
    ts = np.sort(bins["t"].unique())
    assert len(ts) == 1800 and ts[0] == 0.0 and ts[-1] == pytest.approx(179.9)
    np.testing.assert_array_equal(ts, np.round(np.arange(1800) * 0.1, 6))
    assert (bins["src_node"] != bins["dst_node"]).all()
    assert bins.groupby("t").size().eq(12).all()
    key = bins[["t", "src_node", "dst_node"]]
    assert key.equals(key.sort_values(["t", "src_node", "dst_node"]).reset_index(drop=True))
    assert (bins["bytes"] >= 0).all()
    assert (bins["run_id"] == "phantora_a100_40g_W4_4x1").all()


def test_rebuild_is_byte_identical_and_run_id_matters(built: BinnedFlows) -> None:
    again = build_bins(ring_step(0.1782), step_time_s=0.1782, n_nodes=4, run_id="phantora_a100_40g_W4_4x1")
    assert again.bins.to_csv(index=False) == built.bins.to_csv(index=False)
    assert again.phase_s == built.phase_s and again.seed == built.seed
    np.testing.assert_array_equal(again.repetition_factors, built.repetition_factors)
    other = build_bins(ring_step(0.1782), step_time_s=0.1782, n_nodes=4, run_id="phantora_a100_40g_W4_2x2")
    assert other.seed != built.seed
    assert other.phase_s != built.phase_s
    assert not other.bins["bytes"].equals(built.bins["bytes"])
    assert seed_from_run_id("abc") == int.from_bytes(
        bytes.fromhex("ba7816bf8f01cfea"), "big"
    )  # sha256("abc") starts ba7816bf8f01cfea


def test_repetitions_phase_and_factors(built: BinnedFlows) -> None:
    f = built.repetition_factors
    assert len(f) == built.n_repetitions
    assert ((f >= 0.98) & (f <= 1.02)).all()
    assert 0 <= built.phase_s < 0.1782 * f.max()
    # ~180 / 0.1782 repetitions cover the window
    assert 180 / (0.1782 * 1.02) <= built.n_repetitions <= 180 / (0.1782 * 0.98) + 3


def test_control_matrix_split() -> None:
    m = control_matrix(4, 5000, 0.1)  # 500 B per node-bin over 3 others: 167, 167, 166
    assert m[0].tolist() == [0, 167, 167, 166]
    assert m[1].tolist() == [167, 0, 167, 166]
    assert m[3].tolist() == [167, 167, 166, 0]
    assert (m.sum(axis=1) == 500).all()
    assert control_matrix(1).tolist() == [[0]]
    with pytest.raises(ValueError, match="integer"):
        control_matrix(2, 5001, 0.1)


def test_single_flow_split_by_hand() -> None:
    # 1000 B over [50, 200) ms: cumulative floor at 100 ms: floor(1000*50/150) = 333
    np.testing.assert_array_equal(split_flow_bytes(50 * MS, 150 * MS, 1000, bin_ns=100 * MS, n_bins=3), [333, 667, 0])
    # 7 B over [30, 280) ms: C(70)=floor(1.96)=1, C(170)=floor(4.76)=4, C(250)=7
    np.testing.assert_array_equal(split_flow_bytes(30 * MS, 250 * MS, 7, bin_ns=100 * MS, n_bins=3), [1, 3, 3])
    # crossing the window end (window = 2 bins): in-window share C(170) = 4
    np.testing.assert_array_equal(split_flow_bytes(30 * MS, 250 * MS, 7, bin_ns=100 * MS, n_bins=2), [1, 3])
    # crossing the window start: 10 B over [-30, 70) ms: C(30) = 3 before t=0, 7 inside
    np.testing.assert_array_equal(split_flow_bytes(-30 * MS, 100 * MS, 10, bin_ns=100 * MS, n_bins=2), [7, 0])
    # 0-duration: all bytes in the bin holding the start; outside the window: nothing
    np.testing.assert_array_equal(split_flow_bytes(100 * MS, 0, 9, bin_ns=100 * MS, n_bins=2), [0, 9])
    np.testing.assert_array_equal(split_flow_bytes(200 * MS, 0, 9, bin_ns=100 * MS, n_bins=2), [0, 0])
    np.testing.assert_array_equal(split_flow_bytes(-1, 0, 9, bin_ns=100 * MS, n_bins=2), [0, 0])


def test_full_step_flow_gives_constant_rate_whatever_the_phase() -> None:
    # one flow over the whole 200 ms step, 2000 B, no jitter: 10 kB/s, exactly 1000 B per bin
    step = flows([(0.0, 200_000.0, 0, 1, 2000)])
    for run_id in ("a", "b", "c"):
        r = build_bins(step, step_time_s=0.2, n_nodes=2, run_id=run_id, jitter=0.0)
        fwd = r.bins[r.bins.src_node == 0]["bytes"].to_numpy()
        back = r.bins[r.bins.src_node == 1]["bytes"].to_numpy()
        np.testing.assert_array_equal(fwd, 1000 + 500)
        np.testing.assert_array_equal(back, 500)
        assert r.placed_flow_bytes == 1_800_000  # instances cut at both window edges
        assert conservation_ok(r)


def test_flows_longer_than_the_step_reach_from_earlier_repetitions() -> None:
    # flow lasts two steps: two instances overlap at every time, also at t = 0
    step = flows([(0.0, 400_000.0, 1, 0, 4000)])
    r = build_bins(step, step_time_s=0.2, n_nodes=2, run_id="x", jitter=0.0, control_bytes_per_s=0)
    np.testing.assert_array_equal(r.bins[r.bins.src_node == 1]["bytes"].to_numpy(), 2000)
    assert r.n_repetitions >= 901
    assert r.control_bytes == 0 and conservation_ok(r)


def test_zero_duration_flows() -> None:
    step = flows([(100_000.0, 0.0, 0, 1, 7), (0.0, 0.0, 1, 0, 3)])
    r = build_bins(step, step_time_s=0.25, n_nodes=2, run_id="zero", jitter=0.0)
    phase_ns = round(r.phase_s * 1e9)
    starts = [-phase_ns + k * 250 * MS for k in range(-2, 800)]
    n7 = sum(0 <= s + 100 * MS < 180_000 * MS for s in starts)
    n3 = sum(0 <= s < 180_000 * MS for s in starts)
    assert r.placed_flow_bytes == 7 * n7 + 3 * n3
    assert conservation_ok(r)
    fwd = r.bins[r.bins.src_node == 0]["bytes"].to_numpy() - 500
    assert set(np.unique(fwd)) <= {0, 7}
    assert fwd.sum() == 7 * n7


def test_single_node_has_no_rows_and_no_control() -> None:
    r = build_bins(flows([]), step_time_s=0.1, n_nodes=1, run_id="solo")
    assert len(r.bins) == 0 and list(r.bins.columns) == list(BIN_COLUMNS)
    assert r.control_bytes == 0 and r.placed_flow_bytes == 0 and conservation_ok(r)


def test_empty_step_is_control_only() -> None:
    r = build_bins(flows([]), step_time_s=0.1, n_nodes=3, run_id="idle")
    assert r.placed_flow_bytes == 0
    assert r.bins["bytes"].isin([250]).all()  # 500 B per node-bin over 2 others
    assert conservation_ok(r)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window_s": 180.05}, "multiple"),
        ({"control_bytes_per_s": 5001}, "integer"),
        ({"step_time_s": 0.0}, "step_time_s"),
        ({"jitter": 1.5}, "jitter"),
        ({"n_nodes": 0}, "n_nodes"),
    ],
)
def test_invalid_arguments(kwargs: dict, match: str) -> None:
    args = {"step_time_s": 0.1, "n_nodes": 2, "run_id": "x"} | kwargs
    with pytest.raises(ValueError, match=match):
        build_bins(flows([(0.0, 10.0, 0, 1, 5)]), **args)


@pytest.mark.parametrize(
    "row",
    [(0.0, 10.0, 0, 0, 5), (0.0, 10.0, 0, 2, 5), (-1.0, 10.0, 0, 1, 5), (0.0, -1.0, 0, 1, 5), (0.0, 1.0, 0, 1, -5)],
)
def test_invalid_flows(row: tuple) -> None:
    with pytest.raises(ValueError):
        build_bins(flows([row]), step_time_s=0.1, n_nodes=2, run_id="x")


@pytest.mark.slow
def test_2000_flow_step_is_fast() -> None:
    step = ring_step(0.0615, n_nodes=4, n_flows=2000, seed=7)
    t0 = time.perf_counter()
    r = build_bins(step, step_time_s=0.0615, n_nodes=4, run_id="fast")
    elapsed = time.perf_counter() - t0
    assert conservation_ok(r)
    assert r.n_repetitions > 2800
    assert elapsed < 15.0, f"build_bins took {elapsed:.1f} s"


def test_a_ring_step_places_each_hop_alike() -> None:
    """Every node sends the same flows to the next one (twice each): one pair class, every hop's bins equal,
    and the sum of building each flow alone."""
    n = 6
    rows = [(o, 900.0, s, (s + 1) % n, 7_000_001) for s in range(n) for o in (10.0, 10.0, 5_000.5)]
    kw = dict(step_time_s=0.0123, n_nodes=n, run_id="ring", window_s=2.0, bin_s=0.01, control_bytes_per_s=0)
    full = build_bins(flows(rows), **kw)
    hops = [s * (n - 1) + ((s + 1) % n if (s + 1) % n < s else (s + 1) % n - 1) for s in range(n)]
    assert all(np.array_equal(full.matrix[:, hops[0]], full.matrix[:, h]) for h in hops)
    assert int(full.matrix[:, hops].sum()) == full.placed_flow_bytes > 0
    matrix, placed = build_alone(rows, **kw)
    assert np.array_equal(full.matrix, matrix) and full.placed_flow_bytes == placed
