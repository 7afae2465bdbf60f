"""Detector features per non-overlapping 1 s and 15 s window of a run's bins (``bin_s``; v1: 100 ms).

Grain: one row per ``(run_id, window_s, window_start_s)``. Windows are aligned to
``t = 0`` and do not overlap; window ``k`` of size ``w`` holds the bins with
``k*w <= t < (k+1)*w``. Only whole windows inside ``[0, window_s)`` are emitted (180
one-second and 12 fifteen-second windows for the 180 s build). Features aggregate over
all ordered node pairs of the run: the questions they serve ("is this training, which
parallelism, is a step stalled") are about the whole cluster; per-pair traffic of a
window is one ``GROUP BY`` of ``flows_100ms`` away (and the pair distribution enters
here through ``n_active_pairs``, ``pair_entropy_bits`` and ``top_pair_share``).

Notation for one window: ``X[i, p]`` bytes of pair ``p`` in bin ``i`` (``n_bins`` bins
of ``b`` seconds, the run's pairs), ``c[p]`` the control-only bytes pair ``p`` gets in the
bin (the same in every bin at 100 ms and its multiples; at finer widths the build's
cumulative count of the pair's constant rate, ``lib/bins/width.control_bins``, so ``c[i, p]``),
``x[i] = sum_p X[i, p]`` the bin series, ``T[p] = sum_i X[i, p]`` the pair totals.
Each feature is defined once, in :data:`FEATURES` (formula, unit, edge cases, valid
range); :func:`feature_markdown` renders the registry for the README and the pandera
model of ``windows.csv`` is built from it.

The dominant period, its aliasing and the spectral peak are computed in
:mod:`phantora_assets.lib.traffic.periodicity` (its docstring says what a 100 ms bin can show).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

from phantora_assets.lib.bins.width import CONTROL_SPLIT_NS, bin_ns, control_bins
from phantora_assets.lib.store.bin_table import SparseBins, control_at
from phantora_assets.lib.traffic.binning import control_matrix
from phantora_assets.lib.traffic.periodicity import (
    dominant_periods,
    spectral_peaks,
)


@dataclass(frozen=True)
class FeatureSpec:
    """One window feature: its column, unit, dtype, formula, edge cases and valid range.

    ``nullable`` is True for the features that are NaN in some edge case; ``ge`` / ``le``
    bound every non-null value (None: unbounded) and become pandera checks.
    """

    name: str
    unit: str
    dtype: str
    formula: str
    edge_cases: str
    nullable: bool = False
    ge: float | None = 0.0
    le: float | None = None


#: The feature registry, in output column order.
FEATURES: tuple[FeatureSpec, ...] = (
    FeatureSpec(
        "total_bytes", "bytes", "int64", "sum_i sum_p X[i,p] (flows and control traffic)", "0 for an empty window"
    ),
    FeatureSpec(
        "n_active_pairs",
        "pairs",
        "int64",
        "number of pairs p with X[i,p] > c[p] in at least one bin i",
        "0 when every pair carries only control traffic, or for an empty window",
    ),
    FeatureSpec(
        "bytes_per_active_pair",
        "bytes",
        "float64",
        "sum of T[p] over the active pairs, divided by n_active_pairs",
        "0 when n_active_pairs = 0",
    ),
    FeatureSpec("bin_mean_bytes", "bytes", "float64", "mean_i x[i]", "0 for an empty window"),
    FeatureSpec(
        "bin_std_bytes",
        "bytes",
        "float64",
        "population standard deviation (ddof=0) of x[i]",
        "0 for an empty window or a single bin",
    ),
    FeatureSpec("bin_max_bytes", "bytes", "float64", "max_i x[i]", "0 for an empty window"),
    FeatureSpec(
        "bin_p95_bytes",
        "bytes",
        "float64",
        "95th percentile of x[i], linear interpolation between order statistics (numpy default)",
        "0 for an empty window",
    ),
    FeatureSpec(
        "cv", "1", "float64", "coefficient of variation: bin_std_bytes / bin_mean_bytes", "0 when bin_mean_bytes = 0"
    ),
    FeatureSpec("peak_to_mean", "1", "float64", "bin_max_bytes / bin_mean_bytes", "0 when bin_mean_bytes = 0"),
    FeatureSpec(
        "idle_bin_fraction",
        "1",
        "float64",
        "fraction of bins i with X[i,p] <= c[p] for every pair p (control traffic only)",
        "NaN for an empty window",
        nullable=True,
        le=1.0,
    ),
    FeatureSpec(
        "pair_entropy_bits",
        "bits",
        "float64",
        "Shannon entropy -sum_p s[p] log2 s[p] of the pair shares s[p] = T[p] / total_bytes "
        "(terms with s[p] = 0 are 0)",
        "0 when total_bytes = 0 or the run has a single pair",
    ),
    FeatureSpec(
        "top_pair_share",
        "1",
        "float64",
        "max_p T[p] / total_bytes",
        "0 when total_bytes = 0; 1 for a single pair",
        le=1.0,
    ),
    FeatureSpec(
        "spectral_peak_hz",
        "Hz",
        "float64",
        "frequency of the largest value of the periodogram |FFT(x - mean x)|^2 over "
        "[1/(n_bins*b), 1/(2b)], zero-padded to a power of two >= 64*n_bins points; the "
        "strongest rhythm of the series, folded into [0, 1/(2b)] (a burst every 41 ms shows "
        "at its alias, not at 24 Hz)",
        "NaN when n_bins < 4, the window has a missing bin, or x is constant",
        nullable=True,
    ),
    FeatureSpec(
        "dominant_period_s",
        "s",
        "float64",
        "the period P in [2b, n_bins*b/2] whose fold of x into M = min(10, max(2, n_bins // 5)) "
        "phase bins has the least dispersion theta = [SS_within / (n_bins - M_occupied)] / "
        "[SS_total / (n_bins - 1)] (candidates 1/P every 1/(2*M*n_bins*b) Hz; P/2 or P/3 is kept "
        "when its theta is within 0.2*(1 - theta) of the best). The step time when the step is "
        ">= 2 bins, else its alias 1/|1/step - k/b| (module docstring: aliasing)",
        "NaN when n_bins < 4, the window has a missing bin, or x is constant",
        nullable=True,
    ),
    FeatureSpec(
        "periodicity",
        "1",
        "float64",
        "1 - theta at dominant_period_s, clipped to [0, 1]: the share of the variance of x that "
        "its mean folded profile explains (adjusted R^2; 1 = perfectly periodic)",
        "NaN whenever dominant_period_s is NaN",
        nullable=True,
        le=1.0,
    ),
)

#: Key columns (name -> dtype) of the window feature table, before the features.
KEY_COLUMNS: dict[str, str] = {
    "run_id": "str",
    "window_s": "float64",
    "window_start_s": "float64",
    "n_bins": "int64",  # bins present in the window
}

#: All columns (name -> dtype) of the window feature table, in order.
WINDOW_FEATURE_COLUMNS: dict[str, str] = {**KEY_COLUMNS, **{f.name: f.dtype for f in FEATURES}}


def feature_markdown() -> str:
    """The feature registry as a Markdown table (name, unit, formula, edge cases, range)."""
    lines = [
        "| feature | unit | formula | edge cases | range |",
        "|---|---|---|---|---|",
    ]
    for f in FEATURES:
        rng = f"[{_fmt(f.ge, '-inf')}, {_fmt(f.le, 'inf')}]"
        cells = [f"`{f.name}`", f.unit, f.formula, f.edge_cases, rng]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(v: float | None, none: str) -> str:
    return none if v is None else f"{v:g}"


# --------------------------------------------------------------------------- period helpers


# --------------------------------------------------------------------------- the table
def _control_vector(
    pairs: Sequence[tuple[int, int]],
    control: int | Mapping[tuple[int, int], int] | None,
    bin_s: float,
    control_bytes_per_s: float,
    n_total: int,
) -> np.ndarray:
    """Control-only bytes per bin: ``(n_pairs,)``, the same in every bin, or ``(n_total, n_pairs)``."""
    if control is None:  # the build's rule at the run's width: per bin, or one value for every bin
        n_nodes = 1 + max((max(s, d) for s, d in pairs), default=0)
        m = control_matrix(n_nodes, control_bytes_per_s, CONTROL_SPLIT_NS / 1e9)
        per_split = np.asarray([m[s, d] for s, d in pairs], dtype=np.int64)
        return control_bins(per_split, bin_ns(bin_s), n_total)
    if isinstance(control, Mapping):
        missing = [p for p in pairs if p not in control]
        if missing:
            raise ValueError(f"control_bytes_per_pair_bin lacks pairs {missing[:5]}")
        return np.asarray([int(control[p]) for p in pairs], dtype=np.int64)
    return np.full(len(pairs), int(control), dtype=np.int64)


def _windows_of(
    X: np.ndarray, present: np.ndarray, control: np.ndarray, nb: int, bin_s: float
) -> dict[str, np.ndarray]:
    """Every feature of the ``len(X) // nb`` windows of ``nb`` bins, vectorised over windows."""
    k = X.shape[0] // nb
    n_pairs = X.shape[1]
    Xw = X[: k * nb].reshape(k, nb, n_pairs)
    pres = present[: k * nb].reshape(k, nb)
    n_present = pres.sum(axis=1)
    x = Xw.sum(axis=2)  # (k, nb); absent bins hold 0
    T = Xw.sum(axis=1)  # (k, n_pairs)
    total = x.sum(axis=1)
    ctrl = control[None, None, :] if control.ndim == 1 else control[: k * nb].reshape(k, nb, n_pairs)
    above = (Xw > ctrl) & pres[:, :, None]
    active = above.any(axis=1)
    n_active = active.sum(axis=1)
    active_bytes = np.where(active, T, 0).sum(axis=1).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(total[:, None] > 0, T / np.maximum(total, 1)[:, None], 0.0)
        plogp = np.where(share > 0, share * np.log2(np.where(share > 0, share, 1.0)), 0.0)
    entropy = np.maximum(-plogp.sum(axis=1), 0.0) if n_pairs > 1 else np.zeros(k)
    idle_bins = (pres & ~above.any(axis=2)).sum(axis=1)
    return {
        **_series_features(x, pres, nb, bin_s),
        "total_bytes": total.astype(np.int64),
        "n_active_pairs": n_active.astype(np.int64),
        "bytes_per_active_pair": np.where(n_active > 0, active_bytes / np.maximum(n_active, 1), 0.0),
        "idle_bin_fraction": np.where(n_present == 0, np.nan, idle_bins / np.maximum(n_present, 1)),
        "pair_entropy_bits": entropy,
        "top_pair_share": np.where(total > 0, T.max(axis=1, initial=0) / np.maximum(total, 1), 0.0),
    }


def _series_features(x: np.ndarray, pres: np.ndarray, nb: int, bin_s: float) -> dict[str, np.ndarray]:
    """The features of the bin series ``x`` (``(k, nb)`` bytes per bin of each window, absent bins 0;
    ``pres`` the bins present): ``n_bins``, the bin statistics and the period features."""
    k = x.shape[0]
    n_present = pres.sum(axis=1)
    empty = n_present == 0
    complete = n_present == nb
    mean, std, peak, p95 = (np.zeros(k) for _ in range(4))
    if complete.any():  # the normal case, vectorised
        xs = x[complete].astype(np.float64)
        mean[complete], std[complete] = xs.mean(axis=1), xs.std(axis=1)
        peak[complete], p95[complete] = xs.max(axis=1), np.percentile(xs, 95, axis=1)
    for i in np.flatnonzero(~complete & ~empty):  # windows with missing bins
        xi = x[i][pres[i]].astype(np.float64)
        mean[i], std[i], peak[i], p95[i] = xi.mean(), xi.std(), xi.max(), np.percentile(xi, 95)
    spectral = np.full(k, np.nan)
    period = np.full(k, np.nan)
    strength = np.full(k, np.nan)
    if complete.any():
        xs = x[complete].astype(np.float64)
        spectral[complete] = spectral_peaks(xs, bin_s)
        period[complete], strength[complete] = dominant_periods(xs, bin_s)
    return {
        "n_bins": n_present.astype(np.int64),
        "bin_mean_bytes": mean,
        "bin_std_bytes": std,
        "bin_max_bytes": peak,
        "bin_p95_bytes": p95,
        "cv": np.where(mean > 0, std / np.where(mean > 0, mean, 1.0), 0.0),
        "peak_to_mean": np.where(mean > 0, peak / np.where(mean > 0, mean, 1.0), 0.0),
        "spectral_peak_hz": spectral,
        "dominant_period_s": period,
        "periodicity": strength,
    }


def compute_window_features(
    bins: pd.DataFrame,
    *,
    run_id: str | None = None,
    window_sizes_s: Sequence[float] = (1.0, 15.0),
    bin_s: float = 0.1,
    window_s: float = 180.0,
    control_bytes_per_pair_bin: int | Mapping[tuple[int, int], int] | None = None,
    control_bytes_per_s: float = 5000,
) -> pd.DataFrame:
    """Detector features per window; one row per (run_id, window_s, window_start_s).

    Args:
        bins: ``BIN_COLUMNS`` rows (``run_id, t, src_node, dst_node, bytes``), normally
            dense (every bin x every pair). Missing bins are left out of a window
            (``n_bins`` counts the bins present; the period features need a gap-free window).
        run_id: if given, only rows of this run are used and the result is labelled
            with it (all windows are emitted, even with no rows); if None, every
            run_id in ``bins`` is processed, sorted.
        window_sizes_s: window lengths, seconds; each a multiple of ``bin_s``.
        bin_s: bin length, seconds.
        window_s: length of the binned run, seconds; windows cover ``[0, window_s)``.
        control_bytes_per_pair_bin: control-only bytes per bin of a pair: a scalar for
            every pair, a mapping ``(src, dst) -> bytes``, or None to derive it from
            the build rule (``binning.control_matrix`` split per 100 ms, counted per bin at ``bin_s``
            by ``lib/bins/width.control_bins``, with ``control_bytes_per_s`` and the node count seen).
        control_bytes_per_s: control traffic per node, used only when
            ``control_bytes_per_pair_bin`` is None.

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
    for w in window_sizes_s:  # refused before any run is read
        _bins_in(w, bin_s, "window size")
    if run_id is not None:
        groups = [(run_id, bins[bins["run_id"] == run_id])]
    else:
        groups = [(str(r), g) for r, g in bins.groupby("run_id", sort=True)]

    frames = [
        matrix_window_features(
            *_dense_matrix(run_bins, bin_s, n_total),
            rid,
            window_sizes_s,
            bin_s,
            control_bytes_per_pair_bin,
            control_bytes_per_s,
        )
        for rid, run_bins in groups
    ]
    return _table(frames)


def matrix_window_features(
    X: np.ndarray,
    present: np.ndarray,
    pairs: list[tuple[int, int]],
    run_id: str,
    window_sizes_s: Sequence[float] = (1.0, 15.0),
    bin_s: float = 0.1,
    control_bytes_per_pair_bin: int | Mapping[tuple[int, int], int] | None = None,
    control_bytes_per_s: float = 5000,
) -> pd.DataFrame:
    """:func:`compute_window_features` of one run given as its ``(n_bins, n_pairs)`` bytes matrix
    ``X`` over the whole binned run, the mask of the bins present and the sorted ``(src, dst)`` pairs
    (``lib/store/bin_table.read_bin_matrix``), so a large run is never a table in memory."""
    n_total = X.shape[0]
    per_window = [(float(w), _bins_in(w, bin_s, "window size")) for w in window_sizes_s]
    control = _control_vector(pairs, control_bytes_per_pair_bin, bin_s, control_bytes_per_s, n_total)
    frames: list[pd.DataFrame] = []
    for w, nb in sorted(per_window):
        k = n_total // nb
        if k == 0:
            continue
        cols = _windows_of(X, present, control, nb, bin_s)
        starts = np.round(np.arange(k) * nb * bin_s, 6)
        frames.append(pd.DataFrame({"run_id": run_id, "window_s": w, "window_start_s": starts, **cols}))
    return _table(frames)


def sparse_window_features(
    sparse: SparseBins, run_id: str, window_sizes_s: Sequence[float] = (1.0, 15.0)
) -> pd.DataFrame:
    """:func:`matrix_window_features` of a sparse run (``lib/store/bin_table.SparseBins``: the rows that
    carry flow bytes; every other cell holds its pair's control bytes, ``bin_table.OMITTED_ROWS``), without
    its dense matrix: the same features, the integers exactly, the entropy to float rounding.

    Over the rows: a row is a cell with ``X > c`` (flow bytes > 0), so ``n_active_pairs`` counts the pairs
    with rows in the window and ``idle_bin_fraction`` the bins without rows; ``x[i]`` is the bin's row
    flow bytes plus the control bytes of every pair (grouped by their few distinct 100 ms shares);
    ``T[p]`` is the pair's flow bytes plus its control over the window, and the pairs without rows enter
    the entropy and ``top_pair_share`` by share value (their ``T`` is their control alone). Memory: a few
    int64 arrays of the rows, and ``(n_pairs,)`` control shares.
    """
    bin_s, n_total, n_pairs = sparse.bin_s, sparse.n_bins, sparse.n_pairs
    bns = bin_ns(bin_s)
    per_split = sparse.per_split()
    vals, counts = np.unique(per_split, return_counts=True)  # the distinct control shares, pairs of each
    val_of = np.searchsorted(vals, per_split)
    flow = sparse.bytes - control_at(per_split[sparse.pair], sparse.bin_idx, bns)
    frames: list[pd.DataFrame] = []
    for w, nb in sorted((float(w), _bins_in(w, bin_s, "window size")) for w in window_sizes_s):
        k = n_total // nb
        if k == 0:
            continue
        keep = sparse.bin_idx < k * nb
        b, p, f = sparse.bin_idx[keep], sparse.pair[keep], flow[keep]
        bins_all = np.arange(k * nb, dtype=np.int64)
        ctrl_bin = sum(  # control bytes of every pair in each bin
            (int(c) * control_at(np.full(k * nb, v), bins_all, bns) for v, c in zip(vals.tolist(), counts.tolist())),
            np.zeros(k * nb, dtype=np.int64),
        )
        x = ctrl_bin.copy()
        np.add.at(x, b, f)
        x = x.reshape(k, nb)
        total = x.sum(axis=1)
        starts = np.arange(k, dtype=np.int64) * nb
        ctrl_win = np.stack([control_at(np.full(k, v), starts, bns, nb) for v in vals.tolist()], axis=1)  # (k, n_vals)
        key, inv = np.unique((b // nb) * n_pairs + p, return_inverse=True)  # (window, pair) of the rows
        fw = np.zeros(len(key), dtype=np.int64)
        np.add.at(fw, inv.reshape(-1), f)
        kw, kp = key // n_pairs, key % n_pairs
        T = fw + ctrl_win[kw, val_of[kp]]  # the active pairs' window bytes
        n_active = np.bincount(kw, minlength=k)
        active_bytes = np.zeros(k, dtype=np.int64)
        np.add.at(active_bytes, kw, T)
        rest = counts[None, :] - np.bincount(kw * len(vals) + val_of[kp], minlength=k * len(vals)).reshape(k, -1)
        top = np.zeros(k, dtype=np.int64)
        np.maximum.at(top, kw, T)
        top = np.maximum(top, np.where(rest > 0, ctrl_win, 0).max(axis=1, initial=0))
        with np.errstate(divide="ignore", invalid="ignore"):
            safe = np.maximum(total, 1).astype(np.float64)
            s_act = np.where(total[kw] > 0, T / safe[kw], 0.0)
            s_rest = np.where(total[:, None] > 0, ctrl_win / safe[:, None], 0.0)
            plogp_act = np.where(s_act > 0, s_act * np.log2(np.where(s_act > 0, s_act, 1.0)), 0.0)
            plogp_rest = np.where(s_rest > 0, s_rest * np.log2(np.where(s_rest > 0, s_rest, 1.0)), 0.0)
        plogp = np.bincount(kw, weights=plogp_act, minlength=k) + (rest * plogp_rest).sum(axis=1)
        busy = np.zeros(k * nb, dtype=bool)
        busy[b] = True
        idle_bins = nb - busy.reshape(k, nb).sum(axis=1)
        cols = {
            **_series_features(x, np.ones((k, nb), dtype=bool), nb, bin_s),
            "total_bytes": total.astype(np.int64),
            "n_active_pairs": n_active.astype(np.int64),
            "bytes_per_active_pair": np.where(
                n_active > 0, active_bytes.astype(np.float64) / np.maximum(n_active, 1), 0.0
            ),
            "idle_bin_fraction": idle_bins / nb,
            "pair_entropy_bits": np.maximum(-plogp, 0.0) if n_pairs > 1 else np.zeros(k),
            "top_pair_share": np.where(total > 0, top / np.maximum(total, 1), 0.0),
        }
        starts_s = np.round(np.arange(k) * nb * bin_s, 6)
        frames.append(pd.DataFrame({"run_id": run_id, "window_s": w, "window_start_s": starts_s, **cols}))
    return _table(frames)


def _table(frames: list[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    if frames:
        out = pd.concat(frames, ignore_index=True)[list(WINDOW_FEATURE_COLUMNS)]
    else:
        out = pd.DataFrame(columns=list(WINDOW_FEATURE_COLUMNS))
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
    codes = src * (1 + int(dst.max(initial=0))) + dst if len(src) else src
    uniq, pidx = np.unique(codes, return_inverse=True)
    width = 1 + int(dst.max(initial=0))
    pair_keys = [(int(u // width), int(u % width)) for u in uniq]
    X = np.zeros((n_total, len(pair_keys)), dtype=np.int64)
    np.add.at(X, (idx, pidx.reshape(-1)), run_bins["bytes"].to_numpy(np.int64))
    present = np.zeros(n_total, dtype=bool)
    present[idx] = True
    return X, present, pair_keys
