"""Tests of phantora_assets.lib.traffic.window_features."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from phantora_assets.lib.columns import BIN_COLUMNS, STEP_FLOW_COLUMNS
from phantora_assets.lib.traffic.binning import build_bins
from phantora_assets.lib.traffic.periodicity import alias_period_s, dominant_period, fold_frequency_hz, spectral_peak_hz
from phantora_assets.lib.traffic.window_features import (
    FEATURES,
    WINDOW_FEATURE_COLUMNS,
    compute_window_features,
    feature_markdown,
)


def bin_table(run_id: str, series: dict[tuple[int, int], list[int]], bin_s: float = 0.1) -> pd.DataFrame:
    """Dense BIN_COLUMNS rows from per-pair byte lists (one value per bin)."""
    rows = []
    n = len(next(iter(series.values())))
    for i in range(n):
        for (s, d), values in sorted(series.items()):
            rows.append((run_id, round(i * bin_s, 6), s, d, values[i]))
    return pd.DataFrame(rows, columns=list(BIN_COLUMNS)).astype(BIN_COLUMNS)


# Two nodes, 8 bins of 100 ms, windows of 400 ms, control level 5 B per pair-bin.
TINY = {
    (0, 1): [5, 105, 5, 5, 5, 5, 5, 5],
    (1, 0): [5, 5, 45, 5, 5, 5, 5, 5],
}


@pytest.fixture()
def tiny() -> pd.DataFrame:
    return compute_window_features(
        bin_table("r", TINY), window_sizes_s=(0.4,), window_s=0.8, control_bytes_per_pair_bin=5
    )


def test_tiny_window_by_hand(tiny: pd.DataFrame) -> None:
    assert list(tiny.columns) == list(WINDOW_FEATURE_COLUMNS)
    assert tiny[["run_id", "window_s", "window_start_s", "n_bins"]].values.tolist() == [
        ["r", 0.4, 0.0, 4],
        ["r", 0.4, 0.4, 4],
    ]
    w = tiny.iloc[0]
    # bin series x = [10, 110, 50, 10]; pair totals T = [120, 60]
    assert w.total_bytes == 180
    assert w.n_active_pairs == 2
    assert w.bytes_per_active_pair == 90.0
    assert w.bin_mean_bytes == 45.0
    assert w.bin_std_bytes == pytest.approx(math.sqrt((35**2 + 65**2 + 5**2 + 35**2) / 4))
    assert w.bin_max_bytes == 110.0
    assert w.bin_p95_bytes == pytest.approx(50 + 0.85 * 60)  # sorted [10,10,50,110], rank 2.85
    assert w.cv == pytest.approx(math.sqrt(1675) / 45)
    assert w.peak_to_mean == pytest.approx(110 / 45)
    assert w.idle_bin_fraction == 0.5  # bins 0 and 3
    assert w.pair_entropy_bits == pytest.approx(-(2 / 3) * math.log2(2 / 3) - (1 / 3) * math.log2(1 / 3))
    assert w.top_pair_share == pytest.approx(2 / 3)
    assert 2.5 <= w.spectral_peak_hz <= 5.0  # searched from 1 cycle / window to Nyquist
    # 4 bins hold two cycles of only one candidate, the 2-bin period
    assert w.dominant_period_s == pytest.approx(0.2)
    # folded at 0.2 s the phase groups are {10, 50} and {110, 10}: SS_within = 800 + 5000 against
    # SS_total = 6700, so 1 - (5800 / 2) / (6700 / 3) = -0.30, clipped to 0 (no periodicity)
    assert w.periodicity == 0.0


def test_tiny_control_only_window(tiny: pd.DataFrame) -> None:
    w = tiny.iloc[1]  # every pair at the control level, constant series
    assert w.total_bytes == 40
    assert w.n_active_pairs == 0
    assert w.bytes_per_active_pair == 0.0
    assert w.bin_mean_bytes == 10.0 and w.bin_std_bytes == 0.0 and w.bin_max_bytes == 10.0
    assert w.bin_p95_bytes == 10.0
    assert w.cv == 0.0 and w.peak_to_mean == 1.0
    assert w.idle_bin_fraction == 1.0
    assert w.pair_entropy_bits == pytest.approx(1.0)
    assert w.top_pair_share == 0.5
    for name in ("spectral_peak_hz", "dominant_period_s", "periodicity"):
        assert math.isnan(w[name]), name


def test_control_level_per_pair_mapping_and_default() -> None:
    bins = bin_table("r", TINY)
    # a level of 45 for (1, 0) makes that pair idle; (0, 1) stays active
    m = compute_window_features(
        bins, window_sizes_s=(0.4,), window_s=0.8, control_bytes_per_pair_bin={(0, 1): 5, (1, 0): 45}
    )
    assert m.iloc[0].n_active_pairs == 1
    assert m.iloc[0].bytes_per_active_pair == 120.0
    assert m.iloc[0].idle_bin_fraction == 0.75
    # default: the build rule, 5000 B/s * 0.1 s = 500 B per pair-bin for 2 nodes -> all idle
    d = compute_window_features(bins, window_sizes_s=(0.4,), window_s=0.8)
    assert d.iloc[0].n_active_pairs == 0 and d.iloc[0].idle_bin_fraction == 1.0
    with pytest.raises(ValueError, match="lacks pairs"):
        compute_window_features(bins, window_sizes_s=(0.4,), window_s=0.8, control_bytes_per_pair_bin={(0, 1): 5})


def test_empty_window() -> None:
    # bins cover only the first 400 ms of an 800 ms run: the second window has no bins
    bins = bin_table("r", {k: v[:4] for k, v in TINY.items()})
    out = compute_window_features(bins, window_sizes_s=(0.4,), window_s=0.8, control_bytes_per_pair_bin=5)
    w = out.iloc[1]
    assert w.n_bins == 0 and w.total_bytes == 0 and w.n_active_pairs == 0
    for name in (
        "bytes_per_active_pair",
        "bin_mean_bytes",
        "bin_std_bytes",
        "bin_max_bytes",
        "bin_p95_bytes",
        "cv",
        "peak_to_mean",
        "pair_entropy_bits",
        "top_pair_share",
    ):
        assert w[name] == 0.0, name
    for name in ("idle_bin_fraction", "spectral_peak_hz", "dominant_period_s", "periodicity"):
        assert math.isnan(w[name]), name


def test_run_without_rows_gets_every_window() -> None:
    out = compute_window_features(bin_table("x", TINY).iloc[:0], run_id="solo", window_s=2.0)
    assert len(out) == 2 + 0  # 2 windows of 1 s, none of 15 s (longer than the run)
    assert (out.run_id == "solo").all() and (out.n_bins == 0).all() and (out.total_bytes == 0).all()


def test_single_pair() -> None:
    bins = bin_table("r", {(0, 1): [0, 100, 0, 300]})
    w = compute_window_features(bins, window_sizes_s=(0.4,), window_s=0.4, control_bytes_per_pair_bin=0).iloc[0]
    assert w.total_bytes == 400 and w.n_active_pairs == 1 and w.bytes_per_active_pair == 400.0
    assert w.pair_entropy_bits == 0.0 and w.top_pair_share == 1.0
    assert w.idle_bin_fraction == 0.5


def test_window_grid_and_multi_run() -> None:
    rng = np.random.default_rng(3)
    series = {(0, 1): rng.integers(0, 1000, 300).tolist(), (1, 0): rng.integers(0, 1000, 300).tolist()}
    bins = pd.concat([bin_table("b", series), bin_table("a", series)], ignore_index=True)
    out = compute_window_features(bins, window_s=30.0)
    assert out.groupby(["run_id", "window_s"]).size().to_dict() == {
        ("a", 1.0): 30,
        ("a", 15.0): 2,
        ("b", 1.0): 30,
        ("b", 15.0): 2,
    }
    assert out.run_id.tolist()[0] == "a"
    one = out[(out.run_id == "a") & (out.window_s == 1.0)]
    np.testing.assert_allclose(one.window_start_s, np.arange(30.0))
    assert (one.n_bins == 10).all()
    # window totals add up to the run total, for both grains
    total = bins[bins.run_id == "a"]["bytes"].sum()
    for w in (1.0, 15.0):
        assert out[(out.run_id == "a") & (out.window_s == w)].total_bytes.sum() == total
    for col, dtype in WINDOW_FEATURE_COLUMNS.items():
        assert str(out[col].dtype) == ("object" if dtype == "str" else dtype), col


def test_invalid_inputs() -> None:
    bins = bin_table("r", TINY)
    with pytest.raises(ValueError, match="multiple"):
        compute_window_features(bins, window_sizes_s=(0.25,), window_s=0.8)
    with pytest.raises(ValueError, match="outside"):
        compute_window_features(bins, window_sizes_s=(0.4,), window_s=0.4)
    with pytest.raises(ValueError, match="lacks columns"):
        compute_window_features(bins.drop(columns="t"))


def test_spectral_peak_of_a_4_bin_pattern() -> None:
    x = np.tile([0, 100, 100, 0], 10)  # period 0.4 s: fundamental 2.5 Hz, no Nyquist term
    # the negative-frequency image pulls the finite-series peak slightly (0.006 Hz here)
    assert spectral_peak_hz(x, 0.1) == pytest.approx(2.5, abs=0.01)
    assert math.isnan(spectral_peak_hz([1, 2, 3], 0.1))
    assert math.isnan(spectral_peak_hz([7, 7, 7, 7, 7], 0.1))


def test_dominant_period_by_hand() -> None:
    # a noise-free 4-bin pattern folds perfectly at 0.4 s (and at 0.8 s, 1.2 s, ...: the shortest wins)
    assert dominant_period(np.tile([0, 100, 100, 0], 10), 0.1) == pytest.approx((0.4, 1.0))
    # alternating bins: the 2-bin (Nyquist) period, to one step of the candidate grid (40 bins,
    # M = 8: 1/(2*8*4) = 1/64 Hz; the perfect folds form a small plateau below 5 Hz, its middle is kept)
    period, strength = dominant_period(np.tile([0, 10], 20), 0.1)
    assert 1 / period == pytest.approx(5.0, abs=1 / 64 + 1e-9) and strength == 1.0
    # 20 bins, one perturbed: M = 4 phase bins, candidates 1..5 Hz every 1/16 Hz; at 0.4 s the phase
    # groups are i mod 4 and only group 1 ([110, 100, 100, 100, 100]) disperses: SS_within = 80.
    x = np.tile([0, 100, 100, 0], 5)
    x[1] = 110
    ss_total = float(((x - x.mean()) ** 2).sum())
    assert ss_total == pytest.approx(51095.0)
    period, strength = dominant_period(x, 0.1)
    assert period == pytest.approx(0.4)
    assert strength == pytest.approx(1 - (80 / (20 - 4)) / (ss_total / 19))
    # undefined: too few bins, or a constant series
    assert all(math.isnan(v) for v in dominant_period([1, 2, 3], 0.1))
    assert all(math.isnan(v) for v in dominant_period([5] * 30, 0.1))


def test_alias_helpers() -> None:
    assert fold_frequency_hz(24.3, 0.1) == pytest.approx(4.3)
    assert fold_frequency_hz(3.0, 0.1) == pytest.approx(3.0)
    assert fold_frequency_hz(16.0, 0.1) == pytest.approx(4.0)
    assert alias_period_s(0.329, 0.1) == pytest.approx(0.329)  # >= 2 bins: itself
    assert alias_period_s(0.0703, 0.1) == pytest.approx(1 / (1 / 0.0703 - 10))  # 237 ms
    assert alias_period_s(0.05, 0.1) == math.inf  # half a bin: no rhythm


def test_short_windows_search_two_cycles() -> None:
    # a 1 s window (10 bins) holds two cycles of at most 0.5 s: a 0.8 s rhythm cannot show
    x = np.tile([0, 0, 0, 0, 100, 100, 100, 100], 2)[:10]
    period, _ = dominant_period(x, 0.1)
    assert 0.2 <= period <= 0.5


def plausible_step(step_time_s: float, n_nodes: int = 2, n_flows: int = 8) -> pd.DataFrame:
    """A burst of ring flows in the last 40 % of the step."""
    step_us = step_time_s * 1e6
    rows = []
    for i in range(n_flows):
        for s in range(n_nodes):
            rows.append(
                (0.6 * step_us + i * 0.4 * step_us / n_flows, 0.4 * step_us / n_flows, s, (s + 1) % n_nodes, 50_000_000)
            )
    return pd.DataFrame(rows, columns=list(STEP_FLOW_COLUMNS)).astype(STEP_FLOW_COLUMNS)


def run_windows(step_time_s: float, run_id: str) -> pd.DataFrame:
    binned = build_bins(plausible_step(step_time_s), step_time_s=step_time_s, n_nodes=2, run_id=run_id)
    return compute_window_features(binned.bins, window_sizes_s=(15.0,))


# Published step times: >= 2 bins (recovered) and < 2 bins (read as their alias).
@pytest.mark.parametrize(
    "step_ms", [203.0, 234.9, 251.0, 329.0, 480.0, 61.5, 70.3, 90.9, 108.5, 122.4, 147.2, 178.2, 194.8]
)
def test_dominant_period_in_15s_windows_of_a_synthetic_run(step_ms: float) -> None:
    step = step_ms / 1000
    out = run_windows(step, f"recover_{step_ms}")
    assert len(out) == 12
    expected = alias_period_s(step, 0.1)
    close = (out.dominant_period_s / expected - 1).abs() <= 0.03
    if step >= 0.2:  # the step itself, in every window
        assert expected == step
        assert close.all(), out.dominant_period_s.tolist()
    else:  # its alias (to 3 %: the fold magnifies the step's jitter), in most windows; the others
        # read the alias of a harmonic of the step
        assert close.sum() >= 10, out.dominant_period_s.tolist()
    assert (out.periodicity > 0.5).all()
    assert (out.n_active_pairs == 2).all() and (out.idle_bin_fraction < 1).all()


def test_dominant_period_alias_limit_is_as_documented() -> None:
    # A 70.3 ms step (published W1 a100 2x2) folds to ~4.22 Hz: indistinguishable from a
    # 237 ms step in 100 ms bins. The feature reports the 237 ms reading for both.
    a = run_windows(0.0703, "alias_70.3")
    b = run_windows(1 / (1 / 0.0703 - 10), "alias_237")
    np.testing.assert_allclose(a.dominant_period_s, 1 / (1 / 0.0703 - 10), rtol=0.02)
    np.testing.assert_allclose(b.dominant_period_s, 1 / (1 / 0.0703 - 10), rtol=0.02)


def test_feature_registry_and_markdown() -> None:
    names = [f.name for f in FEATURES]
    assert len(names) == len(set(names))
    assert list(WINDOW_FEATURE_COLUMNS)[4:] == names
    md = feature_markdown()
    assert md.splitlines()[0] == "| feature | unit | formula | edge cases | range |"
    assert len(md.splitlines()) == 2 + len(FEATURES)
    for f in FEATURES:
        assert f"`{f.name}`" in md and f.unit and f.formula and f.edge_cases
        assert f.nullable == ("NaN" in f.edge_cases), f.name


def test_window_with_a_missing_bin() -> None:
    # bin 1 (t = 0.1) is absent: statistics over the 3 bins present, no period features (not gap-free)
    bins = bin_table("r", TINY)
    bins = bins[bins.t != 0.1]
    w = compute_window_features(bins, window_sizes_s=(0.4,), window_s=0.8, control_bytes_per_pair_bin=5).iloc[0]
    assert w.n_bins == 3 and w.total_bytes == 70  # x = [10, 50, 10]
    assert w.bin_mean_bytes == pytest.approx(70 / 3) and w.bin_max_bytes == 50.0
    assert w.bin_p95_bytes == pytest.approx(10 + 0.9 * 40)  # sorted [10, 10, 50], rank 1.9
    assert w.idle_bin_fraction == pytest.approx(2 / 3) and w.n_active_pairs == 1
    for name in ("spectral_peak_hz", "dominant_period_s", "periodicity"):
        assert math.isnan(w[name]), name


def test_windows_schema_enforces_the_registry() -> None:
    import pandera.errors as pa_errors

    from phantora_assets.contracts import windows_schema

    rng = np.random.default_rng(5)
    series = {(0, 1): rng.integers(0, 1000, 300).tolist(), (1, 0): rng.integers(0, 1000, 300).tolist()}
    good = compute_window_features(bin_table("phantora_x_W1_2x1", series), window_s=30.0)
    windows_schema().validate(good)
    cases = {
        "periodicity": (1.5, "less_than_or_equal_to"),  # a share above 1
        "top_pair_share": (-0.1, "greater_than_or_equal_to"),
        "dominant_period_s": (20.0, "dominant_period_s outside"),  # longer than half a 15 s window
        "total_bytes": (1, "bin_mean_bytes * n_bins != total_bytes"),
        "bin_p95_bytes": (1e15, "bin_p95_bytes > bin_max_bytes"),
    }
    for col, (value, check) in cases.items():
        bad = good.copy()
        row = bad.index[bad.window_s == 15.0][0]
        bad.loc[row, col] = value
        with pytest.raises(pa_errors.SchemaErrors) as exc:
            windows_schema().validate(bad, lazy=True)
        assert exc.value.failure_cases["check"].astype(str).str.contains(check, regex=False).any(), (col, check)
    bad = good.copy()
    bad.loc[0, "periodicity"] = np.nan  # NaN together with dominant_period_s, or not at all
    with pytest.raises(pa_errors.SchemaErrors):
        windows_schema().validate(bad, lazy=True)
