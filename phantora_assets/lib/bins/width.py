"""The bin width of a run: ``bin_s`` of a run-matrix entry, or ``phantora-assets build --bin-s``.

Rule (:data:`BIN_WIDTHS_MS`): a width is one of 1, 2, 5, 10, 20, 25, 50, 100, 200, 500 and
1000 ms. Each one nests with v1's 100 ms grid (it divides 100 ms or is a multiple of 100 ms), so
the bins of any width sum exactly into those of a coarser width of the list that it divides
(1 ms into 10 ms into 100 ms, 100 ms into 500 ms ...); each divides 1 s, so the 180 s window
(``WINDOW_S``), the 1 s and 15 s feature windows and any whole second are whole bins; and a
width under 10 ms divides 10 ms, the coarsest series the dominant-period search folds
(:func:`period_group`). The default is v1's 0.1 s.

Exactness: a flow's bytes are apportioned by a cumulative floor of absolute time
(``lib/traffic/binning.py``), and so is control traffic here (:func:`control_bins`): the bytes
of a bin are ``C(end) - C(start)`` of one cumulative count per flow instance and pair, so the
bins of a fine width telescope to those of a coarse one, to the byte.
"""

from __future__ import annotations

import os

import numpy as np

#: v1's bin width, s: the default of every run, the grid of ``flows_100ms``.
DEFAULT_BIN_S = 0.1
#: The allowed widths, ms (module docstring).
BIN_WIDTHS_MS = (1, 2, 5, 10, 20, 25, 50, 100, 200, 500, 1000)
#: What ``phantora-assets build --bin-s S`` sets for the build's processes: every run's width.
BIN_S_ENV = "PHANTORA_ASSETS_BIN_S"
#: The dominant period is searched in series of bins of at least this width, s (:func:`period_group`).
PERIOD_MIN_BIN_S = 0.01
#: Control traffic is split over the destinations per 100 ms, as v1 did (:func:`control_bins`).
CONTROL_SPLIT_NS = 100_000_000
_NS_PER_S = 1_000_000_000


def bin_s_rule(value: object) -> str | None:
    """What is wrong with ``value`` as a bin width (None when it is allowed): it must be a float
    (TOML ``0.01``; not an integer, not a boolean, not a string) of :data:`BIN_WIDTHS_MS`."""
    allowed = ", ".join(f"{ms / 1000:g}" for ms in BIN_WIDTHS_MS)
    if not isinstance(value, float):
        kind = {bool: "boolean", int: "integer", str: "string"}.get(type(value), type(value).__name__)
        return f"must be a float (seconds: one of {allowed}), got {value!r} ({kind})"
    if not any(value == ms / 1000 for ms in BIN_WIDTHS_MS):
        return (
            f"must be one of {allowed} s (a width that nests with the 100 ms bins and divides 1 s, so that "
            f"the 180 s window and the 1 s and 15 s windows are whole bins), got {value!r}"
        )
    return None


def bin_s_override() -> float | None:
    """The width ``$PHANTORA_ASSETS_BIN_S`` sets for every run (None when unset or empty).

    Raises:
        ValueError: the value is not a number of :data:`BIN_WIDTHS_MS` (names the variable and the rule).
    """
    text = os.environ.get(BIN_S_ENV, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = None
    rule = bin_s_rule(value) if value is not None else f"must be a number of seconds, got {text!r}"
    if rule:
        raise ValueError(f"${BIN_S_ENV}: bin_s {rule}")
    return value


def bin_ns(bin_s: float) -> int:
    """The width in integer nanoseconds (an allowed width is a whole number of ms)."""
    return int(round(bin_s * _NS_PER_S))


def control_bins(per_split: np.ndarray, bin_ns: int, n_bins: int, first: int = 0) -> np.ndarray:
    """Control bytes of every pair in bins ``first .. first + n_bins - 1``, exact at any width.

    Pair ``p`` sends ``per_split[p]`` bytes per 100 ms at a constant rate, counted in whole bytes:
    by time ``t`` ns it has sent ``floor(per_split[p] * t / 100 ms)``, and a bin holds the
    difference of that count at its ends. So the bins of any width sum to the same 100 ms bins,
    and at 100 ms (and its multiples) every bin holds ``per_split`` (times the multiple): v1.

    Args:
        per_split: int64 ``(n_pairs,)``: each pair's control bytes per 100 ms (``binning.control_matrix``
            at 0.1 s: a node's bytes split evenly over the others, the remainder to the lowest ones).
        bin_ns: bin width, ns (> 0).
        n_bins: how many bins; ``first``: the index of the first (bin ``i`` starts at ``i * bin_ns``).

    Returns:
        int64 ``(n_pairs,)`` when every bin holds the same bytes (``bin_ns`` a multiple of
        100 ms), else ``(n_bins, n_pairs)``. int64 holds ``per_split * t`` up to ``t`` = 180 s for
        per_split below 5e7 bytes (a node's control traffic below 500 MB/s).
    """
    per_split = np.asarray(per_split, dtype=np.int64)
    if bin_ns % CONTROL_SPLIT_NS == 0:
        return per_split * (bin_ns // CONTROL_SPLIT_NS)
    edges = np.arange(first, first + n_bins + 1, dtype=np.int64) * bin_ns
    return np.diff((per_split[None, :] * edges[:, None]) // CONTROL_SPLIT_NS, axis=0)


def add_control(acc: np.ndarray, per_split: np.ndarray, bin_ns: int) -> int:
    """Add :func:`control_bins` to ``acc`` (int64 ``(n_bins, n_pairs)``, in place, a few MB of
    bins at a time); returns the control bytes added (a Python int)."""
    per_split = np.asarray(per_split, dtype=np.int64)
    n_bins, n_pairs = acc.shape
    if bin_ns % CONTROL_SPLIT_NS == 0:
        acc += control_bins(per_split, bin_ns, n_bins)
        return int(per_split.sum()) * (bin_ns // CONTROL_SPLIT_NS) * n_bins
    step = max(1, (1 << 20) // max(1, n_pairs))
    for b0 in range(0, n_bins, step):
        acc[b0 : b0 + step] += control_bins(per_split, bin_ns, min(step, n_bins - b0), b0)
    return sum(int(c) * n_bins * bin_ns // CONTROL_SPLIT_NS for c in per_split.tolist())


def period_group(n_bins: int, bin_s: float) -> int:
    """How many bins the dominant-period search sums into one: 1 for a width of at least
    :data:`PERIOD_MIN_BIN_S`, else the bins of 10 ms (a finer series would cost the search's
    fold O((n_bins)^2) memory and time for rhythms no step has: 2 ms steps). ``n_bins`` whole
    groups are required; a window of a part of them keeps its bins (1)."""
    if bin_s >= PERIOD_MIN_BIN_S:
        return 1
    g = int(round(PERIOD_MIN_BIN_S / bin_s))
    return g if n_bins % g == 0 else 1
