"""The 180 s binned build at any ``bin_s`` (docs/DATASET.md, "How a trace becomes the dataset", steps 4-5).

One steady step's network flows are repeated back to back over the window, with a
random length per repetition and a random phase, then summed into bins together with
the nodes' control traffic. Everything is computed in integer nanoseconds and integer
bytes, so the conservation rule holds exactly::

    bins.bytes.sum() == placed_flow_bytes + control_bytes

Placement (decisions):

* Repetition ``k`` has length ``L_k = round(step_ns * f_k)`` ns with
  ``f_k ~ U[1 - jitter, 1 + jitter]``; repetitions are back to back.
* Repetition 0 contains ``t = 0``: it starts at ``-phase`` with
  ``phase ~ U[0, L_0)`` (integer ns). Repetitions are placed while they start before
  the window end. If a step's flows extend past the step length, earlier repetitions
  (negative index) are placed too, as long as their flows can reach ``t >= 0``.
* Flows keep their unscaled offset and duration inside each repetition; nothing is
  clipped at the repetition end (a flow may overlap the next repetition).
* A flow instance of ``B`` bytes over ``[a, a + d)`` ns sends, by time ``t``,
  ``C(t) = floor(B * clip(t - a, 0, d) / d)`` bytes (cumulative floor). Its bytes in a
  bin ``[e0, e1)`` are ``C(e1) - C(e0)`` and its in-window share is
  ``C(window) - C(0)``; both telescope, so per-instance sums are exact. A 0-duration
  flow puts all its bytes into the bin containing ``a`` (if ``0 <= a < window``).
* Control traffic: each node sends ``control_bytes_per_s * 0.1`` bytes per 100 ms (must
  be an integer), split evenly over the other nodes; the remainder goes one byte each
  to the lowest destination indices. A pair sends its share at a constant rate, counted
  by the same cumulative floor (``lib/bins/width.control_bins``): 100 ms bins hold the
  split, and bins of any width sum to them exactly. One node: no control traffic.
* Randomness: ``numpy.random.default_rng(seed)`` with ``seed`` = the first 8 bytes of
  ``sha256(run_id)`` (big-endian). Draw order: the factors of repetitions 0..K-1
  (K fixed by window, step time and jitter), then the phase, then the factors of the
  earlier repetitions (if any). A rebuild with the same inputs is byte-identical.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import pandas as pd

from phantora_assets.columns import BIN_COLUMNS, STEP_FLOW_COLUMNS
from phantora_assets.lib.bins.width import CONTROL_SPLIT_NS, add_control

NS_PER_S = 1_000_000_000
NS_PER_US = 1_000

#: Flow instances processed per chunk (bounds peak memory to a few hundred MB).
_CHUNK_INSTANCES = 2_000_000
#: int64-safe bound on a duration for the split ``floor(B*x/d)`` (d**2 < 2**63).
_MAX_INT64_DUR_NS = 3_000_000_000
#: Exact sum (a Python int) of an int64 array of < 2**31 values, as two sums that cannot wrap (numpy's can).
exact_sum = lambda v: (int((v >> 32).sum()) << 32) + int((v & 0xFFFFFFFF).sum())


@dataclass(frozen=True)
class BinnedFlows:
    """Result of :func:`build_bins`.

    Attributes:
        bins: ``BIN_COLUMNS`` rows, dense: every bin x every ordered pair
            ``src_node != dst_node``, sorted by ``(t, src_node, dst_node)``.
        placed_flow_bytes: network bytes of the flow instances placed in the window
            (their in-window share).
        control_bytes: control-traffic bytes in the window (all nodes).
        n_repetitions: repetitions placed (including earlier ones whose flows reach
            into the window).
        phase_s: phase of the window start inside repetition 0, seconds.
        seed: the RNG seed derived from the run id.
        repetition_factors: length factor of each placed repetition, in time order.
    """

    bins: pd.DataFrame
    placed_flow_bytes: int
    control_bytes: int
    n_repetitions: int
    phase_s: float
    seed: int
    repetition_factors: np.ndarray


def seed_from_run_id(run_id: str) -> int:
    """The RNG seed of a run: the first 8 bytes of ``sha256(run_id)``, big-endian."""
    return int.from_bytes(hashlib.sha256(run_id.encode("utf-8")).digest()[:8], "big")


def _to_ns(seconds: float, what: str) -> int:
    ns = int(round(float(seconds) * NS_PER_S))
    if ns <= 0:
        raise ValueError(f"{what} must be > 0 s, got {seconds!r}")
    return ns


def control_bytes_per_node_bin(control_bytes_per_s: float, bin_s: float) -> int:
    """Control bytes each node sends per bin; raises ValueError if not an integer."""
    value = float(control_bytes_per_s) * float(bin_s)
    rounded = int(round(value))
    if rounded < 0 or abs(value - rounded) > 1e-9 * max(1.0, abs(value)):
        raise ValueError(
            f"control_bytes_per_s * bin_s must be a non-negative integer, got "
            f"{control_bytes_per_s!r} * {bin_s!r} = {value!r}"
        )
    return rounded


def control_matrix(n_nodes: int, control_bytes_per_s: float = 5000, bin_s: float = 0.1) -> np.ndarray:
    """Control bytes per bin for every ordered pair.

    Args:
        n_nodes: number of nodes (>= 1).
        control_bytes_per_s: control traffic each node sends, bytes/s.
        bin_s: bin length, seconds.

    Returns:
        int64 array ``m`` of shape ``(n_nodes, n_nodes)``: ``m[src, dst]`` bytes per bin,
        0 on the diagonal. Each row sums to the per-node control bytes per bin (0 for
        one node). The per-node amount is split evenly over the other nodes, the
        remainder one byte each to the lowest destination indices.

    Raises:
        ValueError: ``control_bytes_per_s * bin_s`` is not an integer, or n_nodes < 1.
    """
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
    per_node = control_bytes_per_node_bin(control_bytes_per_s, bin_s)
    m = np.zeros((n_nodes, n_nodes), dtype=np.int64)
    if n_nodes == 1:
        return m
    base, rem = divmod(per_node, n_nodes - 1)
    for src in range(n_nodes):
        dsts = [d for d in range(n_nodes) if d != src]
        for rank, dst in enumerate(dsts):
            m[src, dst] = base + (1 if rank < rem else 0)
    return m


def _validate_step_flows(step_flows: pd.DataFrame, n_nodes: int) -> None:
    missing = [c for c in STEP_FLOW_COLUMNS if c not in step_flows.columns]
    if missing:
        raise ValueError(f"step_flows lacks columns {missing} (STEP_FLOW_COLUMNS)")
    if len(step_flows) == 0:
        return
    src = step_flows["src_node"].to_numpy()
    dst = step_flows["dst_node"].to_numpy()
    if ((src < 0) | (src >= n_nodes) | (dst < 0) | (dst >= n_nodes)).any():
        raise ValueError(f"step_flows has node indices outside [0, {n_nodes})")
    if (src == dst).any():
        raise ValueError("step_flows has flows with src_node == dst_node (not network flows)")
    for col in ("offset_us", "dur_us", "bytes"):
        values = step_flows[col].to_numpy()
        if not np.isfinite(values.astype(np.float64)).all() or (values < 0).any():
            raise ValueError(f"step_flows.{col} must be finite and >= 0")


class _Apportion:
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
            out = [
                qq * xx + (rr * xx) // dd
                for qq, rr, xx, dd in zip(self.q.tolist(), self.r.tolist(), x.tolist(), self.d.tolist())
            ]
            return np.asarray(out, dtype=np.int64)
        return self.q * x + (self.r * x) // self.d

    def take(self, keep: np.ndarray) -> _Apportion:
        out = object.__new__(_Apportion)
        out.d, out.q, out.r, out.big = self.d[keep], self.q[keep], self.r[keep], self.big
        return out


def _draw_repetitions(
    rng: np.random.Generator,
    *,
    step_ns: int,
    window_ns: int,
    jitter: float,
    max_flow_end_ns: int,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Repetition start times (ns) and factors in time order, and the phase (ns)."""
    low, high = 1.0 - jitter, 1.0 + jitter
    min_len = max(1, int(np.floor(step_ns * low)))
    n_main = window_ns // min_len + 3
    factors = rng.uniform(low, high, size=n_main)
    lengths = np.maximum(1, np.rint(step_ns * factors).astype(np.int64))
    phase_ns = int(rng.integers(0, lengths[0])) if lengths[0] > 1 else 0
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])) - phase_ns
    keep = starts < window_ns
    starts, factors = starts[keep], factors[keep]

    pre_starts: list[int] = []
    pre_factors: list[float] = []
    start = -phase_ns
    while True:
        if start + max_flow_end_ns < 0:
            break
        f = float(rng.uniform(low, high))
        start -= max(1, int(np.rint(step_ns * f)))
        if start + max_flow_end_ns < 0:
            break
        pre_starts.append(start)
        pre_factors.append(f)
    all_starts = np.concatenate((np.asarray(pre_starts[::-1], dtype=np.int64), starts))
    all_factors = np.concatenate((np.asarray(pre_factors[::-1], dtype=np.float64), factors))
    return all_starts, all_factors, phase_ns


def build_bins(
    step_flows: pd.DataFrame,
    *,
    step_time_s: float,
    n_nodes: int,
    run_id: str,
    window_s: float = 180.0,
    bin_s: float = 0.1,
    jitter: float = 0.02,
    control_bytes_per_s: float = 5000,
) -> BinnedFlows:
    """Repeat one steady step over the window and sum its flows into bins.

    Args:
        step_flows: ``STEP_FLOW_COLUMNS`` rows: one steady step's network flows, offsets
            and durations in microseconds within the step, ``src_node != dst_node``.
        step_time_s: step time (median steady step), seconds, > 0.
        n_nodes: number of nodes; node indices are ``0 .. n_nodes - 1``.
        run_id: run id; seeds the randomness and fills the ``run_id`` column.
        window_s: window length, seconds; a multiple of ``bin_s``.
        bin_s: bin length, seconds.
        jitter: repetition length factor is drawn from ``U[1 - jitter, 1 + jitter]``.
        control_bytes_per_s: control traffic each node sends, bytes/s.

    Returns:
        A :class:`BinnedFlows`; its ``bins`` has ``BIN_COLUMNS``, one row per bin and
        ordered pair, ``t = round(i * bin_s, 6)``, int64 bytes.

    Raises:
        ValueError: invalid arguments, ``window_s`` not a multiple of ``bin_s``,
            ``control_bytes_per_s * 0.1`` not an integer, or step_flows breaking
            ``STEP_FLOW_COLUMNS`` (missing columns, negative values, bad node indices).
    """
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter!r}")
    step_ns = _to_ns(step_time_s, "step_time_s")
    window_ns = _to_ns(window_s, "window_s")
    bin_ns = _to_ns(bin_s, "bin_s")
    if window_ns % bin_ns:
        raise ValueError(f"window_s={window_s!r} is not a multiple of bin_s={bin_s!r}")
    n_bins = window_ns // bin_ns
    control = control_matrix(n_nodes, control_bytes_per_s, CONTROL_SPLIT_NS / NS_PER_S)  # per 100 ms
    _validate_step_flows(step_flows, n_nodes)

    offset_ns = np.rint(step_flows["offset_us"].to_numpy(np.float64) * NS_PER_US).astype(np.int64)
    dur_ns = np.rint(step_flows["dur_us"].to_numpy(np.float64) * NS_PER_US).astype(np.int64)
    flow_bytes = step_flows["bytes"].to_numpy(np.int64)
    src = step_flows["src_node"].to_numpy(np.int64)
    dst = step_flows["dst_node"].to_numpy(np.int64)
    # Dense pair index in (src, dst) order, src != dst.
    pair = src * (n_nodes - 1) + np.where(dst < src, dst, dst - 1)
    n_pairs = n_nodes * (n_nodes - 1)
    max_end_ns = int((offset_ns + dur_ns).max()) if len(offset_ns) else 0

    seed = seed_from_run_id(run_id)
    rng = np.random.default_rng(seed)
    rep_starts, rep_factors, phase_ns = _draw_repetitions(
        rng, step_ns=step_ns, window_ns=window_ns, jitter=jitter, max_flow_end_ns=max_end_ns
    )

    acc = np.zeros(n_bins * max(n_pairs, 1), dtype=np.int64)
    placed = 0
    n_flows = len(flow_bytes)
    if n_flows and n_pairs:
        reps_per_chunk = max(1, _CHUNK_INSTANCES // n_flows)
        for c0 in range(0, len(rep_starts), reps_per_chunk):
            chunk = rep_starts[c0 : c0 + reps_per_chunk]
            a = (chunk[:, None] + offset_ns[None, :]).ravel()
            d = np.broadcast_to(dur_ns, (len(chunk), n_flows)).ravel()
            b = np.broadcast_to(flow_bytes, (len(chunk), n_flows)).ravel()
            p = np.broadcast_to(pair, (len(chunk), n_flows)).ravel()
            placed += _place_zero_duration(acc, a, d, b, p, n_pairs, bin_ns, window_ns)
            placed += _place_spread(acc, a, d, b, p, n_pairs, bin_ns, n_bins, window_ns)

    control_bytes = 0
    if n_pairs:  # control[off-diagonal], row-major (src, dst) order == pair index
        control_bytes = add_control(acc.reshape(n_bins, n_pairs), control[~np.eye(n_nodes, dtype=bool)], bin_ns)

    src_of_pair, dst_of_pair = np.nonzero(~np.eye(n_nodes, dtype=bool))
    t = np.round(np.arange(n_bins, dtype=np.int64) * bin_ns / NS_PER_S, 6)
    bins = pd.DataFrame(
        {
            "run_id": pd.Series([run_id] * (n_bins * n_pairs), dtype=object),
            "t": np.repeat(t, n_pairs).astype(np.float64),
            "src_node": np.tile(src_of_pair.astype(np.int64), n_bins),
            "dst_node": np.tile(dst_of_pair.astype(np.int64), n_bins),
            "bytes": acc[: n_bins * n_pairs] if n_pairs else np.zeros(0, dtype=np.int64),
        },
        columns=list(BIN_COLUMNS),
    )
    return BinnedFlows(
        bins=bins,
        placed_flow_bytes=int(placed),
        control_bytes=int(control_bytes),
        n_repetitions=int(len(rep_starts)),
        phase_s=phase_ns / NS_PER_S,
        seed=seed,
        repetition_factors=rep_factors,
    )


def _place_zero_duration(acc, a, d, b, p, n_pairs, bin_ns, window_ns) -> int:
    """Add 0-duration instances to their start bin; returns their in-window bytes."""
    sel = (d == 0) & (a >= 0) & (a < window_ns)
    if not sel.any():
        return 0
    idx = (a[sel] // bin_ns) * n_pairs + p[sel]
    np.add.at(acc, idx, b[sel])
    return exact_sum(b[sel])


def _place_spread(acc, a, d, b, p, n_pairs, bin_ns, n_bins, window_ns) -> int:
    """Spread instances with ``d > 0`` over the bins they overlap; returns in-window bytes."""
    end = a + d
    sel = (d > 0) & (end > 0) & (a < window_ns) & (b > 0)
    if not sel.any():
        return 0
    a, d, b, p, end = a[sel], d[sel], b[sel], p[sel], end[sel]
    app = _Apportion(b, d)
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
    np.add.at(acc, first[single] * n_pairs + p[single], b[single])
    multi = ~single
    a, d, p, first, span = a[multi], d[multi], p[multi], first[multi], span[multi]
    app = app.take(multi)
    sent_lo = app.sent(np.clip(first * bin_ns - a, 0, d))
    for m in range(int(span.max()) if len(span) else 0):
        live = span > m
        if not live.all():
            a, d, p, first, span, sent_lo = (x[live] for x in (a, d, p, first, span, sent_lo))
            app = app.take(live)
        k = first + m
        sent_hi = app.sent(np.clip((k + 1) * bin_ns - a, 0, d))
        np.add.at(acc, k * n_pairs + p, sent_hi - sent_lo)
        sent_lo = sent_hi
    return exact_sum(in_window)


def split_flow_bytes(start_ns: int, dur_ns: int, total_bytes: int, *, bin_ns: int, n_bins: int) -> np.ndarray:
    """Bytes of one flow instance per bin, as :func:`build_bins` apportions them.

    Args:
        start_ns: instance start, ns since the window start (may be negative).
        dur_ns: duration, ns (0: all bytes in the bin containing the start).
        total_bytes: the instance's bytes.
        bin_ns: bin length, ns.
        n_bins: bins in the window (the window is ``[0, n_bins * bin_ns)``).

    Returns:
        int64 array of ``n_bins`` values; their sum is the instance's in-window share.
    """
    acc = np.zeros(n_bins, dtype=np.int64)
    args = (
        np.array([start_ns], dtype=np.int64),
        np.array([dur_ns], dtype=np.int64),
        np.array([total_bytes], dtype=np.int64),
        np.zeros(1, dtype=np.int64),
    )
    window_ns = n_bins * bin_ns
    _place_zero_duration(acc, *args, 1, bin_ns, window_ns)
    _place_spread(acc, *args, 1, bin_ns, n_bins, window_ns)
    return acc


def conservation_ok(binned: BinnedFlows) -> bool:
    """True when the bins hold exactly the placed flow bytes plus the control bytes."""
    return exact_sum(binned.bins["bytes"].to_numpy(np.int64)) == binned.placed_flow_bytes + binned.control_bytes
