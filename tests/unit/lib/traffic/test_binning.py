"""Tests of phantora_assets.lib.traffic.binning (DATASET.md sections 4 and 5)."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phantora_assets.lib.columns import BIN_COLUMNS, STEP_FLOW_COLUMNS
from phantora_assets.lib.traffic.binning import (
    BinnedFlows,
    build_bins,
    conservation_ok,
    control_matrix,
    seed_from_run_id,
    split_flow_bytes,
)

MS = 1_000_000  # ns


def flows(rows: list[tuple[float, float, int, int, int]]) -> pd.DataFrame:
    """STEP_FLOW_COLUMNS frame from (offset_us, dur_us, src, dst, bytes) tuples."""
    df = pd.DataFrame(rows, columns=list(STEP_FLOW_COLUMNS))
    return df.astype(STEP_FLOW_COLUMNS)


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


def test_2000_flow_step_is_fast() -> None:
    step = ring_step(0.0615, n_nodes=4, n_flows=2000, seed=7)
    t0 = time.perf_counter()
    r = build_bins(step, step_time_s=0.0615, n_nodes=4, run_id="fast")
    elapsed = time.perf_counter() - t0
    assert conservation_ok(r)
    assert r.n_repetitions > 2800
    assert elapsed < 15.0, f"build_bins took {elapsed:.1f} s"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n_nodes=st.integers(1, 4),
    step_ms=st.integers(1, 900),
    n_bins=st.sampled_from([1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 24, 30]),
    jitter=st.sampled_from([0.0, 0.02, 0.3]),
    run_id=st.text(min_size=1, max_size=12),
)
def test_conservation_property(data, n_nodes, step_ms, n_bins, jitter, run_id) -> None:
    window_ms = 1200  # every bin length 1200 / n_bins ms divides the window
    bin_ms = window_ms // n_bins
    n_flows = data.draw(st.integers(0, 12)) if n_nodes > 1 else 0
    rows = []
    for _ in range(n_flows):
        src = data.draw(st.integers(0, n_nodes - 1))
        dst = (src + data.draw(st.integers(1, n_nodes - 1))) % n_nodes
        rows.append(
            (
                data.draw(st.floats(0, 2 * step_ms * 1000, allow_nan=False)),
                data.draw(st.one_of(st.just(0.0), st.floats(0, 3_000_000, allow_nan=False))),
                src,
                dst,
                data.draw(st.integers(0, 10**12)),
            )
        )
    r = build_bins(
        flows(rows),
        step_time_s=step_ms / 1000,
        n_nodes=n_nodes,
        run_id=run_id,
        window_s=window_ms / 1000,
        bin_s=bin_ms / 1000,
        jitter=jitter,
        control_bytes_per_s=1000,
    )
    assert conservation_ok(r)
    assert (r.bins["bytes"] >= 0).all()
    assert len(r.bins) == n_bins * n_nodes * (n_nodes - 1)
    assert r.control_bytes == _control_total(n_nodes, 1000, window_ms * 1_000_000)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n_nodes=st.integers(2, 5),
    bin_us=st.integers(1, 250_000),  # any bin size (whole microseconds)
    n_bins=st.integers(1, 40),
    step_us=st.integers(1, 2_000_000),
    jitter=st.sampled_from([0.0, 0.02, 0.5]),
    control=st.sampled_from([0, 1_000_000, 5_000_000]),
)
def test_conservation_property_any_bin_size(data, n_nodes, bin_us, n_bins, step_us, jitter, control) -> None:
    """Random flows (zero-length, longer than a step or the whole window, huge byte counts)
    and any bin size: the bins hold exactly the placed flow bytes plus the control bytes."""
    rows = []
    for _ in range(data.draw(st.integers(0, 15))):
        src = data.draw(st.integers(0, n_nodes - 1))
        dst = (src + data.draw(st.integers(1, n_nodes - 1))) % n_nodes
        rows.append(
            (
                data.draw(st.floats(0, 3 * step_us, allow_nan=False)),
                data.draw(st.one_of(st.just(0.0), st.floats(0, 5 * step_us + bin_us * n_bins, allow_nan=False))),
                src,
                dst,
                data.draw(st.one_of(st.integers(0, 10), st.integers(0, 2**50))),
            )
        )
    r = build_bins(
        flows(rows),
        step_time_s=step_us / 1e6,
        n_nodes=n_nodes,
        run_id="prop",
        window_s=bin_us * n_bins / 1e6,
        bin_s=bin_us / 1e6,
        jitter=jitter,
        control_bytes_per_s=control,
    )
    assert conservation_ok(r)
    assert int(r.bins["bytes"].sum()) == r.placed_flow_bytes + r.control_bytes
    assert (r.bins["bytes"] >= 0).all()
    assert len(r.bins) == n_bins * n_nodes * (n_nodes - 1)
    assert r.control_bytes == _control_total(n_nodes, control, bin_us * n_bins * 1000)


def _control_total(n_nodes: int, control_bytes_per_s: int, window_ns: int) -> int:
    """Control bytes of a window: each pair's 100 ms share at a constant rate, whole bytes sent by its end."""
    m = control_matrix(n_nodes, control_bytes_per_s, 0.1)
    return sum(int(c) * window_ns // 100_000_000 for c in m[~np.eye(n_nodes, dtype=bool)])


def _build_alone(rows: list[tuple], **kw) -> tuple[np.ndarray, int]:
    """The matrix and placed bytes of building every flow of ``rows`` on its own, summed."""
    out = [build_bins(flows([r]), **kw) for r in rows]
    return sum(b.matrix for b in out), sum(b.placed_flow_bytes for b in out)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n_nodes=st.integers(2, 5),
    bin_ms=st.sampled_from([1, 10, 100]),
    step_us=st.integers(1_000, 400_000),
    jitter=st.sampled_from([0.0, 0.02, 0.3]),
)
def test_repeated_flows_place_as_each_flow_alone(data, n_nodes, bin_ms, step_us, jitter) -> None:
    """Flows that share offset, duration and bytes, on one pair or on many (a ring's every hop), are
    split once (lib/bins/place.py): the bins are the sum of building each flow on its own, to the byte."""
    shape = st.tuples(
        st.floats(0, 2 * step_us, allow_nan=False),
        st.one_of(st.just(0.0), st.floats(0, 3 * step_us, allow_nan=False)),
        st.one_of(st.integers(0, 10), st.integers(0, 2**40)),
    )
    shapes = data.draw(st.lists(shape, min_size=1, max_size=3))
    rows = []
    for _ in range(data.draw(st.integers(1, 14))):
        offset, dur, nbytes = shapes[data.draw(st.integers(0, len(shapes) - 1))]
        src = data.draw(st.integers(0, n_nodes - 1))
        rows.append((offset, dur, src, (src + data.draw(st.integers(1, n_nodes - 1))) % n_nodes, nbytes))
    kw = dict(step_time_s=step_us / 1e6, n_nodes=n_nodes, run_id="dup", window_s=1.2, bin_s=bin_ms / 1000)
    kw.update(jitter=jitter, control_bytes_per_s=0)
    full = build_bins(flows(rows), **kw)
    matrix, placed = _build_alone(rows, **kw)
    assert np.array_equal(full.matrix, matrix)
    assert full.placed_flow_bytes == placed
    assert conservation_ok(full)


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
    matrix, placed = _build_alone(rows, **kw)
    assert np.array_equal(full.matrix, matrix) and full.placed_flow_bytes == placed
