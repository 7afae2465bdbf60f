"""Detector features per non-overlapping 1 s and 15 s window of a run's 100 ms bins.

Grain: one row per ``(run_id, window_s, window_start_s)``. Windows are aligned to
``t = 0`` and do not overlap; window ``k`` of size ``w`` holds the bins with
``k*w <= t < (k+1)*w``. Only whole windows inside ``[0, window_s)`` are emitted (180
one-second and 12 fifteen-second windows for the 180 s build). Features aggregate over
all ordered node pairs of the run: the questions they serve ("is this training, which
parallelism, is a step stalled") are about the whole cluster, and a pair-level table
would only repeat ``flows_100ms``.

Notation for one window: ``X[i, p]`` bytes of pair ``p`` in bin ``i`` (``n_bins`` bins,
the run's pairs), ``c[p]`` the control-only bytes pair ``p`` gets per bin,
``x[i] = sum_p X[i, p]`` the bin series, ``T[p] = sum_i X[i, p]`` the pair totals.
Each feature is defined once, in :data:`FEATURES`; :func:`feature_markdown` renders
the registry for the docs and the schema reuses it.

Dominant period and aliasing. Step times (60-260 ms) are close to or below two bins,
so the bin series aliases: a step of period ``P`` shows in the series at the folded
frequency ``fa = |1/P - k/bin_s|`` in ``[0, 1/(2*bin_s)]``, and every period
``1/(k/bin_s +- fa)`` fits the series equally well (exactly, for any step waveform).
``dominant_frequency_hz`` is the measured ``fa``; ``dominant_period_s`` picks, among
those alias candidates, the longest inside ``step_period_range_s`` (the direct reading
``1/fa`` when it is a plausible step time, else the first unfolded one). This recovers
the step time within one bin for most step times, but not all: for steps of about
62-77 ms the direct reading (200-260 ms) is itself plausible and is chosen, and no
function of 100 ms bins can tell such a step from its 200-260 ms alias (e.g. 70.3 ms
reads as 237 ms). An autocorrelation-lag estimate (integer lags >= 2 bins) fails
worse: for a 90.9 ms step the series repeats every 1.0 s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from phantora_assets.lib.binning import control_matrix

#: Zero-padded FFT length of the periodogram behind the dominant frequency.
_FFT_POINTS = 16384
#: Fewer bins than this: no dominant frequency (NaN).
MIN_BINS_FOR_PERIOD = 4


@dataclass(frozen=True)
class FeatureSpec:
    """One window feature: its column, unit, dtype, formula and edge cases.

    ``nullable`` is True for the features that are NaN in some edge case.
    """

    name: str
    unit: str
    dtype: str
    formula: str
    edge_cases: str
    nullable: bool = False


#: The feature registry, in output column order.
FEATURES: tuple[FeatureSpec, ...] = (
    FeatureSpec("total_bytes", "bytes", "int64",
                "sum_i sum_p X[i,p] (flows and control traffic)",
                "0 for an empty window"),
    FeatureSpec("n_active_pairs", "pairs", "int64",
                "number of pairs p with X[i,p] > c[p] in at least one bin i",
                "0 when every pair carries only control traffic, or no bins"),
    FeatureSpec("bytes_per_active_pair", "bytes", "float64",
                "sum over active pairs p of T[p], divided by n_active_pairs",
                "0 when n_active_pairs = 0"),
    FeatureSpec("bin_mean_bytes", "bytes", "float64",
                "mean_i x[i]",
                "0 for an empty window"),
    FeatureSpec("bin_std_bytes", "bytes", "float64",
                "population standard deviation (ddof=0) of x[i]",
                "0 for an empty window or a single bin"),
    FeatureSpec("bin_max_bytes", "bytes", "float64",
                "max_i x[i]",
                "0 for an empty window"),
    FeatureSpec("bin_p95_bytes", "bytes", "float64",
                "95th percentile of x[i], linear interpolation (numpy default)",
                "0 for an empty window"),
    FeatureSpec("cv", "1", "float64",
                "bin_std_bytes / bin_mean_bytes",
                "0 when bin_mean_bytes = 0"),
    FeatureSpec("peak_to_mean", "1", "float64",
                "bin_max_bytes / bin_mean_bytes",
                "0 when bin_mean_bytes = 0"),
    FeatureSpec("idle_bin_fraction", "1", "float64",
                "fraction of bins i with X[i,p] <= c[p] for every pair p",
                "NaN for an empty window", nullable=True),
    FeatureSpec("pair_entropy_bits", "bits", "float64",
                "-sum_p s[p] log2 s[p] over s[p] = T[p] / total_bytes > 0",
                "0 when total_bytes = 0 or the run has one pair"),
    FeatureSpec("top_pair_share", "1", "float64",
                "max_p T[p] / total_bytes",
                "0 when total_bytes = 0"),
    FeatureSpec("dominant_frequency_hz", "Hz", "float64",
                "argmax over f in [1/(n_bins*bin_s), 1/(2*bin_s)] of the periodogram "
                "|FFT(x - mean x)|^2, zero-padded to 16384 points (the folded step frequency)",
                "NaN when n_bins < 4 or x is constant", nullable=True),
    FeatureSpec("dominant_period_s", "s", "float64",
                "longest of 1/f for f in {fa, k/bin_s - fa, k/bin_s + fa : k >= 1} inside "
                "step_period_range_s (default 0.06-0.26 s), fa = dominant_frequency_hz; "
                "1/fa if none is inside",
                "NaN when dominant_frequency_hz is NaN; aliased for steps near 62-77 ms",
                nullable=True),
)

#: Key columns (name -> dtype) of the window feature table, before the features.
KEY_COLUMNS: dict[str, str] = {
    "run_id": "str",
    "window_s": "float64",
    "window_start_s": "float64",
    "n_bins": "int64",          # bins present in the window
}

#: All columns (name -> dtype) of the window feature table, in order.
WINDOW_FEATURE_COLUMNS: dict[str, str] = {**KEY_COLUMNS, **{f.name: f.dtype for f in FEATURES}}


def feature_markdown() -> str:
    """The feature registry as a Markdown table (name, unit, formula, edge cases)."""
    lines = [
        "| feature | unit | formula | edge cases |",
        "|---|---|---|---|",
    ]
    for f in FEATURES:
        cells = [f"`{f.name}`", f.unit, f.formula, f.edge_cases]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def dominant_frequency_hz(series: np.ndarray, bin_s: float) -> float:
    """Peak frequency of the mean-removed periodogram of a bin series.

    Searched over ``[1/(n*bin_s), 1/(2*bin_s)]`` (at least one cycle per series, up to
    Nyquist). NaN when the series has fewer than 4 bins or is constant.
    """
    x = np.asarray(series, dtype=np.float64)
    n = len(x)
    if n < MIN_BINS_FOR_PERIOD:
        return float("nan")
    x = x - x.mean()
    if not np.any(x):
        return float("nan")
    n_fft = max(_FFT_POINTS, n)
    power = np.abs(np.fft.rfft(x, n_fft)) ** 2
    freqs = np.fft.rfftfreq(n_fft, bin_s)
    power[freqs < 1.0 / (n * bin_s)] = -1.0
    return float(freqs[int(np.argmax(power))])


def step_period_from_frequency(
    fa_hz: float, bin_s: float, period_range_s: tuple[float, float] = (0.06, 0.26)
) -> float:
    """Longest alias period ``1/(k/bin_s +- fa)`` inside ``period_range_s``.

    Returns ``1/fa`` when no candidate is inside the range, NaN for NaN or 0 input.
    """
    if not np.isfinite(fa_hz) or fa_hz <= 0:
        return float("nan")
    lo, hi = period_range_s
    fs = 1.0 / bin_s
    # Periods below lo have frequency above 1/lo: enough k to pass it.
    k_max = int(np.ceil((1.0 / lo) / fs)) + 1 if lo > 0 else 1
    freqs = [fa_hz] + [k * fs + s * fa_hz for k in range(1, k_max + 1) for s in (-1, 1)]
    periods = [1.0 / f for f in freqs if f > 0 and lo <= 1.0 / f <= hi]
    return float(max(periods)) if periods else 1.0 / fa_hz


def _window_row(
    X: np.ndarray, control: np.ndarray, bin_s: float, period_range_s: tuple[float, float]
) -> dict[str, float]:
    """Features of one window. ``X``: (n_bins, n_pairs) int64; ``control``: (n_pairs,)."""
    n_bins = X.shape[0]
    x = X.sum(axis=1)
    pair_totals = X.sum(axis=0)
    total = int(x.sum())
    above = X > control[None, :]
    active = above.any(axis=0) if n_bins else np.zeros(X.shape[1], dtype=bool)
    n_active = int(active.sum())
    row: dict[str, float] = {
        "total_bytes": total,
        "n_active_pairs": n_active,
        "bytes_per_active_pair": float(pair_totals[active].sum()) / n_active if n_active else 0.0,
    }
    if n_bins:
        xf = x.astype(np.float64)
        mean, std, peak = float(xf.mean()), float(xf.std()), float(xf.max())
        p95 = float(np.percentile(xf, 95))
        idle = float((~above.any(axis=1)).mean())
    else:
        mean = std = peak = p95 = 0.0
        idle = float("nan")
    row.update(
        bin_mean_bytes=mean,
        bin_std_bytes=std,
        bin_max_bytes=peak,
        bin_p95_bytes=p95,
        cv=std / mean if mean else 0.0,
        peak_to_mean=peak / mean if mean else 0.0,
        idle_bin_fraction=idle,
    )
    if total > 0 and X.shape[1] > 1:
        share = pair_totals[pair_totals > 0] / total
        entropy = float(-(share * np.log2(share)).sum())
        row["pair_entropy_bits"] = max(entropy, 0.0)
    else:
        row["pair_entropy_bits"] = 0.0
    row["top_pair_share"] = float(pair_totals.max()) / total if total else 0.0
    fa = dominant_frequency_hz(x, bin_s)
    row["dominant_frequency_hz"] = fa
    row["dominant_period_s"] = step_period_from_frequency(fa, bin_s, period_range_s)
    return row


def _control_vector(
    pairs: Sequence[tuple[int, int]],
    control: int | Mapping[tuple[int, int], int] | None,
    bin_s: float,
    control_bytes_per_s: float,
) -> np.ndarray:
    if control is None:
        n_nodes = 1 + max((max(s, d) for s, d in pairs), default=0)
        m = control_matrix(n_nodes, control_bytes_per_s, bin_s)
        return np.asarray([m[s, d] for s, d in pairs], dtype=np.int64)
    if isinstance(control, Mapping):
        missing = [p for p in pairs if p not in control]
        if missing:
            raise ValueError(f"control_bytes_per_pair_bin lacks pairs {missing[:5]}")
        return np.asarray([int(control[p]) for p in pairs], dtype=np.int64)
    return np.full(len(pairs), int(control), dtype=np.int64)


def compute_window_features(
    bins: pd.DataFrame,
    *,
    run_id: str | None = None,
    window_sizes_s: Sequence[float] = (1.0, 15.0),
    bin_s: float = 0.1,
    window_s: float = 180.0,
    control_bytes_per_pair_bin: int | Mapping[tuple[int, int], int] | None = None,
    control_bytes_per_s: float = 5000,
    step_period_range_s: tuple[float, float] = (0.06, 0.26),
) -> pd.DataFrame:
    """Detector features per window; one row per (run_id, window_s, window_start_s).

    Args:
        bins: ``BIN_COLUMNS`` rows (``run_id, t, src_node, dst_node, bytes``), normally
            dense (every bin x every pair). Missing bins are left out of a window
            (``n_bins`` counts the bins present).
        run_id: if given, only rows of this run are used and the result is labelled
            with it (all windows are emitted, even with no rows); if None, every
            run_id in ``bins`` is processed, sorted.
        window_sizes_s: window lengths, seconds; each a multiple of ``bin_s``.
        bin_s: bin length, seconds.
        window_s: length of the binned run, seconds; windows cover ``[0, window_s)``.
        control_bytes_per_pair_bin: control-only bytes per bin of a pair: a scalar for
            every pair, a mapping ``(src, dst) -> bytes``, or None to derive it from
            the build rule (:func:`phantora_assets.lib.binning.control_matrix` with
            ``control_bytes_per_s`` and the node count seen in the run's bins).
        control_bytes_per_s: control traffic per node, used only when
            ``control_bytes_per_pair_bin`` is None.
        step_period_range_s: plausible step periods (s) used to unfold the aliased
            dominant frequency into ``dominant_period_s``.

    Returns:
        DataFrame with :data:`WINDOW_FEATURE_COLUMNS`, sorted by run_id, window_s,
        window_start_s.

    Raises:
        ValueError: missing columns, a window size or ``window_s`` that is not a
            multiple of ``bin_s``, ``t`` off the bin grid or outside ``[0, window_s)``,
            or a control mapping lacking a pair.
    """
    missing = [c for c in ("run_id", "t", "src_node", "dst_node", "bytes") if c not in bins.columns]
    if missing:
        raise ValueError(f"bins lacks columns {missing} (BIN_COLUMNS)")
    n_total = _bins_in(window_s, bin_s, "window_s")
    per_window = [(float(w), _bins_in(w, bin_s, "window size")) for w in window_sizes_s]

    if run_id is not None:
        groups = [(run_id, bins[bins["run_id"] == run_id])]
    else:
        groups = [(str(r), g) for r, g in bins.groupby("run_id", sort=True)]

    rows: list[dict[str, float]] = []
    for rid, run_bins in groups:
        X, present, pairs = _dense_matrix(run_bins, bin_s, n_total)
        control = _control_vector(pairs, control_bytes_per_pair_bin, bin_s, control_bytes_per_s)
        for w, nb in per_window:
            for k in range(n_total // nb):
                sl = slice(k * nb, (k + 1) * nb)
                Xw = X[sl][present[sl]]
                row = {
                    "run_id": rid,
                    "window_s": w,
                    "window_start_s": round(k * nb * bin_s, 6),
                    "n_bins": int(Xw.shape[0]),
                }
                row.update(_window_row(Xw, control, bin_s, step_period_range_s))
                rows.append(row)
    out = pd.DataFrame(rows, columns=list(WINDOW_FEATURE_COLUMNS))
    return out.astype({c: (object if d == "str" else d) for c, d in WINDOW_FEATURE_COLUMNS.items()})


def _bins_in(length_s: float, bin_s: float, what: str) -> int:
    ratio = float(length_s) / float(bin_s)
    n = int(round(ratio))
    if n < 1 or abs(ratio - n) > 1e-9 * max(1.0, ratio):
        raise ValueError(f"{what}={length_s!r} is not a positive multiple of bin_s={bin_s!r}")
    return n


def _dense_matrix(
    run_bins: pd.DataFrame, bin_s: float, n_total: int
) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """(n_total, n_pairs) bytes matrix, the present-bin mask and the sorted pair list."""
    t = run_bins["t"].to_numpy(np.float64)
    ratio = t / bin_s
    idx = np.rint(ratio).astype(np.int64)
    if len(t) and (np.abs(ratio - idx) > 1e-6).any():
        raise ValueError("bins has t values off the bin grid")
    if len(t) and ((idx < 0) | (idx >= n_total)).any():
        raise ValueError(f"bins has t outside [0, {n_total * bin_s:g}) s")
    src = run_bins["src_node"].to_numpy(np.int64)
    dst = run_bins["dst_node"].to_numpy(np.int64)
    pair_keys = sorted(set(zip(src.tolist(), dst.tolist())))
    lookup = {p: i for i, p in enumerate(pair_keys)}
    pidx = np.fromiter((lookup[p] for p in zip(src.tolist(), dst.tolist())), dtype=np.int64, count=len(src))
    X = np.zeros((n_total, len(pair_keys)), dtype=np.int64)
    np.add.at(X, (idx, pidx), run_bins["bytes"].to_numpy(np.int64))
    present = np.zeros(n_total, dtype=bool)
    present[idx] = True
    return X, present, pair_keys
