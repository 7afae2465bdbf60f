"""Placing a step's flow instances into bins, exactly, once per distinct flow (``lib/traffic/binning.py``
draws the repetitions, calls :func:`place_flows` and adds the control traffic; no Dagster import).

A flow instance of ``B`` bytes over ``[a, a + d)`` ns sends ``C(t) = floor(B * clip(t - a, 0, d) / d)``
bytes by time ``t``; its bytes in a bin ``[e0, e1)`` are ``C(e1) - C(e0)`` (``binning``'s docstring).
Two flows of a step with the same offset, duration and bytes therefore split alike in every
repetition, whatever their pair, and two pairs that carry the same such flows (a ring's every hop
does) get the same column of bins. So the split is computed once per *unit*: a distinct
(offset, duration, bytes) of a *pair class* (the pairs whose flows are the same multiset), its bin
parts multiplied by how many such flows each pair of the class has; the class's column is then
copied to its pairs. All in integers, so the matrix is the one of placing every instance on its
own, to the byte (``tests/unit/lib/traffic/test_binning.py``); a 64-node ring step of 8,384 flows has 123 units.
"""

from __future__ import annotations

import numpy as np

#: Flow instances processed per chunk (bounds peak memory to a few hundred MB).
CHUNK_INSTANCES = 2_000_000
#: int64-safe bound on a duration for the split ``floor(B*x/d)`` (d**2 < 2**63).
_MAX_INT64_DUR_NS = 3_000_000_000


def exact_sum(v: np.ndarray) -> int:
    """Exact sum (a Python int) of an int64 array of < 2**31 values: numpy's own sum when no partial sum
    can wrap (values in [0, 2**63 / len)), else two sums that cannot wrap (numpy's can)."""
    if not len(v):
        return 0
    if int(v.min()) >= 0 and int(v.max()) < 2**63 // len(v):
        return int(v.sum())
    return (int((v >> 32).sum()) << 32) + int((v & 0xFFFFFFFF).sum())


def _dot(v: np.ndarray, w: np.ndarray) -> int:
    """``sum(v * w)`` exactly (a Python int) for non-negative int64 ``v``, ``w``."""
    if not len(v):
        return 0
    if int(v.max()) * int(w.max()) < 2**62:
        return exact_sum(v * w)
    return sum(int(a) * int(b) for a, b in zip(v.tolist(), w.tolist()))


class Apportion:
    """Cumulative-floor apportioning of ``total`` bytes over ``[a, a + d)``, ``d > 0``.

    ``sent(x) = floor(total * x / d)`` for ``0 <= x <= d`` (ns since ``a``), exact in
    int64 via ``total = q*d + r``: ``q*x + (r*x) // d`` with ``r*x < d**2 < 2**63``.
    Durations of 3 s or more fall back to Python integers.
    """

    def __init__(self, total: np.ndarray, d: np.ndarray) -> None:
        self.d = d
        self.q, self.r = np.divmod(total, d)
        self.big = bool(len(d)) and int(d.max()) >= _MAX_INT64_DUR_NS

    def sent(self, x: np.ndarray) -> np.ndarray:
        if self.big:
            qrxd = zip(self.q.tolist(), self.r.tolist(), x.tolist(), self.d.tolist())
            return np.asarray([qq * xx + (rr * xx) // dd for qq, rr, xx, dd in qrxd], dtype=np.int64)
        return self.q * x + (self.r * x) // self.d

    def take(self, keep: np.ndarray) -> Apportion:
        out = object.__new__(Apportion)
        out.d, out.q, out.r, out.big = self.d[keep], self.q[keep], self.r[keep], self.big
        return out


def flow_units(
    offset_ns: np.ndarray, dur_ns: np.ndarray, flow_bytes: np.ndarray, pair: np.ndarray
) -> tuple[tuple[np.ndarray, ...], np.ndarray, np.ndarray, np.ndarray]:
    """The units of a step's flows (module docstring).

    Returns:
        ``(offset, dur, bytes, class, count)`` of every unit (int64 arrays), the class sizes, the
        pairs that carry flows (sorted) and the class of each of them.
    """
    shapes, shape_of = np.unique(np.stack([offset_ns, dur_ns, flow_bytes], axis=1), axis=0, return_inverse=True)
    n_shapes = max(1, len(shapes))
    combo, count = np.unique(pair * n_shapes + shape_of.reshape(-1), return_counts=True)  # by pair, then shape
    cpair, cshape = combo // n_shapes, combo % n_shapes
    pairs, starts = np.unique(cpair, return_index=True)
    ends = np.append(starts[1:], len(combo)).astype(np.int64)
    classes: dict[bytes, int] = {}  # a pair's (shapes, counts), equal length: its bytes are a unique key
    cls = np.asarray(
        [classes.setdefault(cshape[s:e].tobytes() + count[s:e].tobytes(), len(classes)) for s, e in zip(starts, ends)],
        dtype=np.int64,
    )
    owner = np.repeat(np.arange(len(pairs)), ends - starts)  # each combo's index into pairs
    first = np.zeros(len(pairs), dtype=bool)
    first[np.unique(cls, return_index=True)[1]] = True  # the first pair of each class stands for it
    rep = first[owner]
    units = (*(shapes[cshape[rep], k] for k in range(3)), cls[owner[rep]], count[rep].astype(np.int64))
    return units, np.bincount(cls, minlength=len(classes)).astype(np.int64), pairs, cls


def place_flows(
    offset_ns: np.ndarray,
    dur_ns: np.ndarray,
    flow_bytes: np.ndarray,
    pair: np.ndarray,
    *,
    n_pairs: int,
    rep_starts: np.ndarray,
    bin_ns: int,
    n_bins: int,
) -> tuple[np.ndarray, int]:
    """Bytes per (bin, pair) of the flows (int64, ns and bytes; ``pair`` their column) placed in every
    repetition starting at ``rep_starts`` (ns), and the in-window bytes of those instances.

    Returns:
        the int64 ``(n_bins, n_pairs)`` matrix and the placed bytes (a Python int), computed per
        instance directly, not as the sum of its bin parts.
    """
    out = np.zeros((n_bins, n_pairs), dtype=np.int64)
    if not len(flow_bytes) or not n_pairs or not n_bins:
        return out, 0
    acc, pairs, cls, placed = place_classes(
        offset_ns, dur_ns, flow_bytes, pair, rep_starts=rep_starts, bin_ns=bin_ns, n_bins=n_bins
    )
    out[:, pairs] = acc[:, cls]
    return out, placed


def place_classes(
    offset_ns: np.ndarray,
    dur_ns: np.ndarray,
    flow_bytes: np.ndarray,
    pair: np.ndarray,
    *,
    rep_starts: np.ndarray,
    bin_ns: int,
    n_bins: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """:func:`place_flows` before its columns are copied to the pairs: the int64 ``(n_bins, n_classes)``
    bytes of each pair class (module docstring), the pairs that carry flows (sorted), the class of each
    of them, and the placed bytes. Pair ``pairs[j]``'s column is ``acc[:, cls[j]]``; every other pair's
    is 0. Memory: bins x classes (at most bins x the pairs that carry flows), never bins x all pairs."""
    if not len(flow_bytes) or not n_bins:
        return np.zeros((n_bins, 0), dtype=np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), 0
    (u_off, u_dur, u_bytes, u_cls, u_cnt), size, pairs, cls = flow_units(offset_ns, dur_ns, flow_bytes, pair)
    n_cls, n_units, window_ns = len(size), len(u_off), n_bins * bin_ns
    acc = np.zeros(n_bins * n_cls, dtype=np.int64)
    weight = u_cnt * size[u_cls]  # the unit's flows over the pairs of its class
    placed = 0
    reps_per_chunk = max(1, CHUNK_INSTANCES // n_units)
    for c0 in range(0, len(rep_starts), reps_per_chunk):
        chunk = rep_starts[c0 : c0 + reps_per_chunk]
        a = (chunk[:, None] + u_off[None, :]).ravel()
        per_unit = (u_dur, u_bytes, u_cls, u_cnt, weight)
        d, b, p, w, wp = (np.broadcast_to(x, (len(chunk), n_units)).ravel() for x in per_unit)
        pieces: list[tuple[np.ndarray, np.ndarray]] = []
        placed += _place_zero_duration(pieces, a, d, b, p, w, wp, n_cls, bin_ns, window_ns)
        placed += _place_spread(pieces, a, d, b, p, w, wp, n_cls, bin_ns, n_bins, window_ns)
        _add(acc, pieces)
    return acc.reshape(n_bins, n_cls), pairs, cls, placed


def _add(acc: np.ndarray, pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """``acc[idx] += vals`` of every piece, exactly: one ``bincount`` over the pieces' index range when
    every partial sum stays below 2**53 (float64 holds it exactly), else ``np.add.at`` (~20x slower)."""
    if not (pieces := [(i, v) for i, v in pieces if len(i)]):
        return
    idx, vals = np.concatenate([i for i, _ in pieces]), np.concatenate([v for _, v in pieces])
    if int(vals.max()) * len(vals) < 2**53 and int(vals.min()) >= 0:
        lo = int(idx.min())
        sums = np.bincount(idx - lo, weights=vals.astype(np.float64))
        acc[lo : lo + len(sums)] += sums.astype(np.int64)
    else:
        np.add.at(acc, idx, vals)


def _place_zero_duration(acc, a, d, b, p, w, wp, n_cols, bin_ns, window_ns) -> int:  # noqa: PLR0913 (the columns of one vectorized pass, not options)
    """Add 0-duration instances (times ``w``) to their start bin; returns their in-window bytes (times ``wp``)."""
    sel = (d == 0) & (a >= 0) & (a < window_ns)
    if not sel.any():
        return 0
    acc.append(((a[sel] // bin_ns) * n_cols + p[sel], b[sel] * w[sel]))
    return _dot(b[sel], wp[sel])


def _place_spread(acc, a, d, b, p, w, wp, n_cols, bin_ns, n_bins, window_ns) -> int:  # noqa: PLR0913 (the columns of one vectorized pass, not options)
    """Spread instances with ``d > 0`` (times ``w``) over the bins they overlap; returns their in-window
    bytes (times ``wp``)."""
    end = a + d
    sel = (d > 0) & (end > 0) & (a < window_ns) & (b > 0)
    if not sel.any():
        return 0
    a, d, b, p, w, wp, end = a[sel], d[sel], b[sel], p[sel], w[sel], wp[sel], end[sel]
    app = Apportion(b, d)
    # In-window share, computed directly (not as the sum of the bin parts).
    in_window = b.copy()
    edge = (a < 0) | (end > window_ns)
    if edge.any():
        e_app = app.take(edge)
        ea, ed = a[edge], d[edge]
        in_window[edge] = e_app.sent(np.clip(window_ns - ea, 0, ed)) - e_app.sent(np.clip(-ea, 0, ed))
    first = np.maximum(a // bin_ns, 0)
    last = np.minimum((end - 1) // bin_ns, n_bins - 1)
    span = last - first + 1
    # One bin, fully inside it: all bytes there, no division needed.
    single = (span == 1) & ~edge
    acc.append((first[single] * n_cols + p[single], b[single] * w[single]))
    multi = ~single
    a, d, p, w, first, span = a[multi], d[multi], p[multi], w[multi], first[multi], span[multi]
    app = app.take(multi)
    sent_lo = app.sent(np.clip(first * bin_ns - a, 0, d))
    for m in range(int(span.max()) if len(span) else 0):
        live = span > m
        if not live.all():
            a, d, p, w, first, span, sent_lo = (x[live] for x in (a, d, p, w, first, span, sent_lo))
            app = app.take(live)
        k = first + m
        sent_hi = app.sent(np.clip((k + 1) * bin_ns - a, 0, d))
        acc.append((k * n_cols + p, (sent_hi - sent_lo) * w))
        sent_lo = sent_hi
    return _dot(in_window, wp)
