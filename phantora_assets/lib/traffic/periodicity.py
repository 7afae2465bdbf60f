"""Periodicity of a bin series: the dominant period (phase-dispersion minimisation), its
adjusted-R^2 strength, the spectral peak, and what 100 ms bins can and cannot show of a step.

Shapes: a series is a 1-D array of bytes per bin (``bin_s`` seconds each); periods in s,
frequencies in Hz. No Dagster import. Used by :mod:`phantora_assets.lib.traffic.window_features`.

Dominant period and aliasing
----------------------------
``dominant_period_s`` folds the bin series at candidate periods ``P`` from two bins to half
the window (phase-dispersion minimisation: the series compared with itself at any real lag,
which an autocorrelation over whole-bin lags cannot do; bins under 10 ms are summed into 10 ms
first, ``lib/bins/width.period_group``, as the fold costs the square of the bins) and keeps the period whose mean
folded profile leaves the least variance, preferring ``P/2`` or ``P/3`` when they fold
nearly as well (a fold at a multiple of the period always fits); ``periodicity`` is the
share of variance that profile explains (adjusted R^2).

Bins integrate over ``b``, so a step of period ``P`` is seen only through the phases
``i*b/P mod 1``: a step of ``P`` and one of ``P' = 1/|1/P - k/b|`` (any integer ``k``)
give the same phases, and no function of the bins can tell them apart (70.3 ms and
237 ms steps look alike in 100 ms bins). The search keeps ``P >= 2b`` (the Nyquist
limit), where the reading is unique:

* a step of at least two bins (200 ms) is recovered: in the dataset, the median over a
  run's 15 s windows is within a few ms of the step time and most single windows are too;
  a window where the step's own rhythm is weak (ZeRO-3's eight per-layer bursts per step)
  can read a harmonic's alias instead;
* a shorter step shows as its alias :func:`alias_period_s` ``1/|1/P - k/b|`` or the alias
  of a low harmonic (``h/P``): it is *not* the step time. ``runs.step_time_s < 2 * runs.bin_s``
  flags those runs; the ``step_period`` view
  of the DuckDB database lists them with the reading they should show;
* a window must hold two cycles of the reading: a 1 s window searches 0.2-0.5 s only, and
  a step whose alias is longer than half the window (a step within a few ms of a whole
  fraction of a bin, e.g. 100.9 ms) shows no stable period.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from phantora_assets.lib.bins.width import period_group

#: Fewer bins than this (or a gap in the window): no spectral peak / period (NaN).
MIN_BINS_FOR_PERIOD = 4


#: Cycles of a candidate period that must fit in the window.
MIN_CYCLES = 2


#: Most phase bins of the folded profile (fewer for short windows: n_bins // 5, >= 2).
MAX_PHASE_BINS = 10


#: A fold at P/m (m = 2, 3) is preferred when its dispersion is within this share of (1 - best).
SUBHARMONIC_MARGIN = 0.2


#: Dispersions this close to the minimum are ties, resolved to the shortest period.
_TIE = 1e-9


def fold_frequency_hz(f_hz: float, bin_s: float) -> float:
    """Where a rhythm of ``f_hz`` shows in ``bin_s`` bins: ``|f - k/bin_s|`` in ``[0, 1/(2 bin_s)]``."""
    fs = 1.0 / bin_s
    return float(abs(f_hz - fs * np.round(f_hz / fs)))


def alias_period_s(step_time_s: float, bin_s: float) -> float:
    """The period ``dominant_period_s`` reads for a step of ``step_time_s``.

    ``step_time_s`` itself when the step is at least two bins, else ``1/fold(1/step)``
    (inf when the step is a whole fraction of a bin: the bins then see no rhythm).
    """
    if step_time_s >= 2 * bin_s:
        return float(step_time_s)
    f = fold_frequency_hz(1.0 / step_time_s, bin_s)
    return float(1.0 / f) if f > 0 else float("inf")


def spectral_peak_hz(series: Sequence[float] | np.ndarray, bin_s: float) -> float:
    """Peak frequency of the mean-removed periodogram of one bin series (NaN if undefined)."""
    out = spectral_peaks(np.asarray(series, dtype=np.float64)[None, :], bin_s)
    return float(out[0])


def dominant_period(series: Sequence[float] | np.ndarray, bin_s: float) -> tuple[float, float]:
    """``(dominant_period_s, periodicity)`` of one gap-free bin series (NaNs if undefined)."""
    p, r = dominant_periods(np.asarray(series, dtype=np.float64)[None, :], bin_s)
    return float(p[0]), float(r[0])


def _n_fft(n_bins: int) -> int:
    return 1 << int(np.ceil(np.log2(max(64 * n_bins, 256))))


def spectral_peaks(x: np.ndarray, bin_s: float) -> np.ndarray:
    """Spectral peak (Hz) of each row of ``x`` (rows: windows, columns: bins)."""
    k, n = x.shape
    out = np.full(k, np.nan)
    if n < MIN_BINS_FOR_PERIOD or k == 0:
        return out
    xc = x - x.mean(axis=1, keepdims=True)
    ok = np.any(xc != 0, axis=1)
    if not ok.any():
        return out
    n_fft = _n_fft(n)
    power = np.abs(np.fft.rfft(xc[ok], n_fft, axis=1)) ** 2
    freqs = np.fft.rfftfreq(n_fft, bin_s)
    power[:, freqs < 1.0 / (n * bin_s)] = -1.0
    out[ok] = freqs[np.argmax(power, axis=1)]
    return out


@functools.lru_cache(maxsize=16)
def _fold_plan(n_bins: int, bin_s: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Candidate frequencies, each bin's phase bin ``(C, n_bins)`` (int8), counts ``(C, M)``, ``M``."""
    m = max(2, min(MAX_PHASE_BINS, n_bins // 5))
    f_lo = MIN_CYCLES / (n_bins * bin_s)
    f_hi = 1.0 / (2.0 * bin_s)
    df = 1.0 / (2.0 * m * n_bins * bin_s)
    if f_lo > f_hi:
        return np.zeros(0), np.zeros((0, n_bins), dtype=np.int8), np.zeros((0, m)), m
    n_c = int(np.floor((f_hi - f_lo) / df + 1e-9)) + 1
    freqs = f_lo + df * np.arange(n_c)
    # phase of each bin's start; the 1/(2M) offset puts a whole-bin period's samples mid-phase-bin
    cycles = np.outer(freqs * bin_s, np.arange(n_bins)) + 0.5 / m
    phase = np.minimum((np.mod(cycles, 1.0) * m).astype(np.int64), m - 1).astype(np.int8)
    counts = (phase[:, None, :] == np.arange(m, dtype=np.int8)[None, :, None]).sum(axis=2).astype(np.float64)
    return freqs, phase, counts, m


#: Elements of the one-hot phase matrix multiplied at once (64 MB of float64): a longer fold goes in parts.
_FOLD_CHUNK = 1 << 23


def _fold_sums(phase: np.ndarray, m: int, z: np.ndarray) -> np.ndarray:
    """``(C, M, k)``: the sum of each column of ``z`` ``(n, k)`` over the bins of each phase bin of each candidate."""
    n_c, n = phase.shape
    rows = max(1, _FOLD_CHUNK // max(1, m * n))
    out = np.empty((n_c, m, z.shape[1]))
    for c0 in range(0, n_c, rows):
        ph = phase[c0 : c0 + rows]
        onehot = np.zeros((len(ph), m, n))
        onehot[np.arange(len(ph))[:, None], ph, np.arange(n)[None, :]] = 1.0
        out[c0 : c0 + rows] = (onehot.reshape(len(ph) * m, n) @ z).reshape(len(ph), m, z.shape[1])
    return out


def dominant_periods(x: np.ndarray, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Phase-dispersion minimisation for each row of ``x``: (period_s, periodicity)."""
    k, n = x.shape
    if (g := period_group(n, float(bin_s))) > 1:  # bins under 10 ms: searched in 10 ms sums
        x, n, bin_s = x.reshape(k, n // g, g).sum(axis=2), n // g, bin_s * g
    period = np.full(k, np.nan)
    strength = np.full(k, np.nan)
    if n < MIN_BINS_FOR_PERIOD or k == 0:
        return period, strength
    freqs, phase, counts, m = _fold_plan(n, float(bin_s))
    xc = x - x.mean(axis=1, keepdims=True)
    total = (xc**2).sum(axis=1)
    ok = total > 0
    if len(freqs) == 0 or not ok.any():
        return period, strength
    scale = np.sqrt(total[ok] / n)
    z = (xc[ok] / scale[:, None]).T  # (n, k_ok), unit variance
    sums = _fold_sums(phase, m, z)  # (C, M, k_ok)
    occupied = counts > 0
    between = (sums**2 / np.where(occupied, counts, 1.0)[:, :, None]).sum(axis=1)  # (C, k_ok)
    dof = n - occupied.sum(axis=1)  # (C,)
    within = np.maximum(n - between, 0.0)  # sum z^2 == n
    with np.errstate(divide="ignore", invalid="ignore"):
        theta = np.where(dof[:, None] > 0, (within / dof[:, None]) / (n / (n - 1)), np.inf)
    # Ties happen only for noise-free series whose period is a whole number of bins: they fold
    # perfectly on a small plateau of frequencies around 1/P, at 2P, 3P, ... and at periods whose
    # phases merely permute P's. Keep the simplest profile (fewest occupied phase bins), then the
    # middle of those candidates.
    tied = theta <= theta.min(axis=0, keepdims=True) + _TIE
    n_occ = np.where(tied, occupied.sum(axis=1)[:, None], n + 1)
    simplest = tied & (n_occ == n_occ.min(axis=0, keepdims=True))
    csum = np.cumsum(simplest, axis=0)
    best = np.argmax(csum >= (csum[-1] + 1) // 2, axis=0)
    cols = np.arange(z.shape[1])
    best_theta = theta[best, cols]
    # A fold at a multiple of the period (2P, 3P) fits at least as well as at P up to noise: prefer
    # P/m when its dispersion is within SUBHARMONIC_MARGIN of the way from the best to 1.
    df = freqs[1] - freqs[0] if len(freqs) > 1 else 0.0
    for mult in (3, 2):
        if df == 0.0:
            break
        idx = np.rint((mult * freqs[best] - freqs[0]) / df).astype(np.int64)
        near = np.clip(idx[:, None] + np.arange(-mult, mult + 1)[None, :], 0, len(freqs) - 1)
        local = theta[near, cols[:, None]]
        j = near[cols, np.argmin(local, axis=1)]
        take = (idx < len(freqs)) & (theta[j, cols] <= best_theta + SUBHARMONIC_MARGIN * (1 - best_theta))
        best = np.where(take, j, best)
        best_theta = np.where(take, theta[j, cols], best_theta)
    period[ok] = 1.0 / freqs[best]
    strength[ok] = np.clip(1.0 - best_theta, 0.0, 1.0)
    return period, strength


# ---- periodic tails of token sequences (step detection: lib/traffic/steps/cut.py) ----------------


def _z_function(seq: list[int]) -> list[int]:
    """Z-array: z[i] = length of the longest common prefix of seq and seq[i:]."""
    n = len(seq)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0
    for i in range(1, n):
        zi = 0
        if i < right:
            zi = min(right - i, z[i - left])
        while i + zi < n and seq[zi] == seq[i + zi]:
            zi += 1
        z[i] = zi
        if i + zi > right:
            left, right = i, i + zi
    return z


class Periodicity:
    """Periodic-tail lengths of one token sequence: m(q) = longest q-periodic suffix."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.n = len(tokens)
        # A suffix of s with period q is a prefix of reversed(s) with period q, whose
        # length is q + z[q] (z of the reversed sequence).
        self.z = np.asarray(_z_function(tokens[::-1].tolist()), dtype=np.int64)

    def tail(self, q: int) -> int:
        if q >= self.n:
            return self.n
        return q + int(self.z[q])

    def full_periods(self, q: int) -> int:
        return self.tail(q) // q

    def best_period(self, min_repeats: int) -> int | None:
        if self.n < min_repeats:
            return None
        ps = np.arange(1, self.n // min_repeats + 1, dtype=np.int64)
        if len(ps) == 0:
            return None
        m = ps + self.z[ps]
        ok = m >= min_repeats * ps
        if not ok.any():
            return None
        m_ok = np.where(ok, m, -1)
        return int(ps[int(np.argmax(m_ok))])  # argmax: first (smallest p) of the longest


def copies_before_tail(tokens: np.ndarray, q: int, n_full: int) -> int:
    """Non-overlapping copies of the first full period's block (``n_full`` full periods of ``q``
    calls at the end of ``tokens``) in the calls before it: the sequence already repeated its
    step there, then something broke the period (a call in some steps only). Linear in the calls
    before the block times the few offsets a candidate survives."""
    first = len(tokens) - n_full * q
    pre, block = tokens[:first], tokens[first : first + q]
    if len(pre) < q:
        return 0
    hit = np.ones(len(pre) - q + 1, dtype=bool)
    for k in range(q):
        hit &= pre[k : len(pre) - q + 1 + k] == block[k]
        if not hit.any():
            return 0
    n, end = 0, -1
    for j in np.flatnonzero(hit).tolist():
        if j >= end:
            n, end = n + 1, j + q
    return n
