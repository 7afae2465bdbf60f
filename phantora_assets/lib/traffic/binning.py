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

from phantora_assets.lib.bins.place import exact_sum, place_classes, place_flows
from phantora_assets.lib.bins.width import CONTROL_SPLIT_NS, add_control
from phantora_assets.lib.columns import BIN_COLUMNS, STEP_FLOW_COLUMNS
from phantora_assets.lib.store import bin_table
from phantora_assets.lib.store.bin_table import SparseBins, bins_frame

NS_PER_S = 1_000_000_000
NS_PER_US = 1_000


@dataclass(frozen=True)
class BinnedFlows:
    """Result of :func:`build_bins`.

    Attributes:
        matrix: int64 bytes of shape ``(n_bins, n_pairs)``, the pairs ``src_node != dst_node`` in
            ``(src, dst)`` order (``bin_table.pair_nodes``); ``bins`` is the same as a table. None for
            a sparse build (``sparse``).
        placed_flow_bytes: network bytes of the flow instances placed in the window
            (their in-window share).
        control_bytes: control-traffic bytes in the window (all nodes).
        n_repetitions: repetitions placed (including earlier ones whose flows reach
            into the window).
        phase_s: phase of the window start inside repetition 0, seconds.
        seed: the RNG seed derived from the run id.
        repetition_factors: length factor of each placed repetition, in time order.
        sparse: the build's rows that carry flow bytes (``bin_table.SparseBins``) when it is built
            sparse (its dense table above ``bin_table.max_dense_cells``), else None.
    """

    matrix: np.ndarray | None
    placed_flow_bytes: int
    control_bytes: int
    n_repetitions: int
    phase_s: float
    seed: int
    repetition_factors: np.ndarray
    run_id: str = ""
    bin_s: float = 0.1
    n_nodes: int = 1
    sparse: SparseBins | None = None

    @property
    def bins(self) -> pd.DataFrame:
        """``matrix`` as ``BIN_COLUMNS`` rows (``lib/store/bin_table.bins_frame``; 40 bytes a row); a sparse
        build's rows only (``bin_table.OMITTED_ROWS``)."""
        if self.sparse is not None:
            sb = self.sparse
            src, dst = bin_table.pair_of(sb.pair, sb.n_nodes)
            t = bin_table.bin_times(sb.n_bins, sb.bin_s)[sb.bin_idx]
            data = {"run_id": pd.Series([self.run_id] * len(t), dtype=object), "t": t}
            data |= {"src_node": src, "dst_node": dst, "bytes": sb.bytes}
            return pd.DataFrame(data, columns=list(BIN_COLUMNS))
        assert self.matrix is not None
        return bins_frame(self.matrix, self.run_id, self.bin_s, self.n_nodes)

    def binned_bytes(self) -> int:
        """Exact bytes of the whole (dense) table, a Python int: the matrix's sum, or a sparse build's
        rows plus the control bytes of the rows it omits."""
        if self.sparse is not None:
            sb = self.sparse
            return exact_sum(sb.bytes) + sb.control_total() - exact_sum(sb.row_control())
        assert self.matrix is not None
        return exact_sum(self.matrix.reshape(-1))


def seed_from_run_id(run_id: str) -> int:
    """The RNG seed of a run: the first 8 bytes of ``sha256(run_id)``, big-endian."""
    return int.from_bytes(hashlib.sha256(run_id.encode("utf-8")).digest()[:8], "big")


def to_ns(seconds: float, what: str) -> int:
    """``seconds`` as integer nanoseconds; ValueError (naming ``what``) unless > 0."""
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
    if n_nodes == 1:
        return np.zeros((1, 1), dtype=np.int64)
    base, rem = divmod(per_node, n_nodes - 1)
    src, dst = np.indices((n_nodes, n_nodes))
    rank = np.where(dst < src, dst, dst - 1)  # the destination's index among the other nodes
    return np.where(src == dst, 0, base + (rank < rem)).astype(np.int64)


def _validate_step_flows(step_flows: pd.DataFrame, n_nodes: int) -> None:
    missing = [c for c in STEP_FLOW_COLUMNS if c not in step_flows.columns]
    if missing:
        raise ValueError(f"step_flows lacks columns {missing} (STEP_FLOW_COLUMNS)")
    src, dst = step_flows["src_node"].to_numpy(), step_flows["dst_node"].to_numpy()
    if ((src < 0) | (src >= n_nodes) | (dst < 0) | (dst >= n_nodes)).any():
        raise ValueError(f"step_flows has node indices outside [0, {n_nodes})")
    if (src == dst).any():
        raise ValueError("step_flows has flows with src_node == dst_node (not network flows)")
    for col in ("offset_us", "dur_us", "bytes"):
        values = step_flows[col].to_numpy()
        if not np.isfinite(values.astype(np.float64)).all() or (values < 0).any():
            raise ValueError(f"step_flows.{col} must be finite and >= 0")


def _draw_repetitions(
    rng: np.random.Generator, *, step_ns: int, window_ns: int, jitter: float, max_flow_end_ns: int
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


def window_bins_ns(window_s: float, bin_s: float) -> tuple[int, int]:
    """``(window_ns, bin_ns)``; ValueError unless both are > 0 and the window is a multiple of the bin."""
    window_ns, bin_ns = to_ns(window_s, "window_s"), to_ns(bin_s, "bin_s")
    if window_ns % bin_ns:
        raise ValueError(f"window_s={window_s!r} is not a multiple of bin_s={bin_s!r}")
    return window_ns, bin_ns


def flow_ns(step_flows: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """``(offset_ns, dur_ns)`` int64 of ``STEP_FLOW_COLUMNS`` rows, rounded as :func:`build_bins` places them."""
    return tuple(
        np.rint(step_flows[c].to_numpy(np.float64) * NS_PER_US).astype(np.int64) for c in ("offset_us", "dur_us")
    )


def repetitions(
    offset_ns: np.ndarray, dur_ns: np.ndarray, *, step_ns: int, window_ns: int, run_id: str, jitter: float
) -> tuple[np.ndarray, np.ndarray, int]:
    """The repetitions :func:`build_bins` places flows ``offset_ns, dur_ns`` in: start times (ns, in time
    order), length factors, and the phase (ns), drawn from the run id's seed (module docstring)."""
    return _draw_repetitions(
        np.random.default_rng(seed_from_run_id(run_id)),
        step_ns=step_ns,
        window_ns=window_ns,
        jitter=jitter,
        max_flow_end_ns=int((offset_ns + dur_ns).max()) if len(offset_ns) else 0,
    )


def build_bins(  # noqa: PLR0913 (the build's settings, keyword-only)
    step_flows: pd.DataFrame,
    *,
    step_time_s: float,
    n_nodes: int,
    run_id: str,
    window_s: float = 180.0,
    bin_s: float = 0.1,
    jitter: float = 0.02,
    control_bytes_per_s: float = 5000,
    sparse: bool | None = None,
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
        sparse: build the rows that carry flow bytes only (``BinnedFlows.sparse``: never the
            ``(n_bins, n_pairs)`` matrix, memory ~ bins x the pairs that carry flows); None (default):
            when the dense table exceeds ``bin_table.max_dense_cells`` (``bin_table.is_sparse``).
            Both forms hold the same cells (``bin_table.densify``).

    Returns:
        A :class:`BinnedFlows`; its ``bins`` has ``BIN_COLUMNS``, one row per bin and
        ordered pair (sparse: per bin and pair that carries flow bytes), ``t = round(i * bin_s, 6)``,
        int64 bytes.

    Raises:
        ValueError: invalid arguments, ``window_s`` not a multiple of ``bin_s``,
            ``control_bytes_per_s * 0.1`` not an integer, or step_flows breaking
            ``STEP_FLOW_COLUMNS`` (missing columns, negative values, bad node indices).
    """
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
    if not 0.0 <= jitter < 1.0:
        raise ValueError(f"jitter must be in [0, 1), got {jitter!r}")
    step_ns = to_ns(step_time_s, "step_time_s")
    window_ns, bin_ns = window_bins_ns(window_s, bin_s)
    n_bins = window_ns // bin_ns
    control = control_matrix(n_nodes, control_bytes_per_s, CONTROL_SPLIT_NS / NS_PER_S)  # per 100 ms
    _validate_step_flows(step_flows, n_nodes)

    offset_ns, dur_ns = flow_ns(step_flows)
    flow_bytes, src, dst = (step_flows[c].to_numpy(np.int64) for c in ("bytes", "src_node", "dst_node"))
    # Dense pair index in (src, dst) order, src != dst.
    pair = src * (n_nodes - 1) + np.where(dst < src, dst, dst - 1)
    n_pairs = n_nodes * (n_nodes - 1)
    seed = seed_from_run_id(run_id)
    rep_starts, rep_factors, phase_ns = repetitions(
        offset_ns, dur_ns, step_ns=step_ns, window_ns=window_ns, run_id=run_id, jitter=jitter
    )

    per_split = control[~np.eye(n_nodes, dtype=bool)]  # control[off-diagonal], row-major (src, dst) = pair index
    if sparse is None:
        sparse = bin_table.is_sparse(n_nodes, window_s, bin_s)
    rows: SparseBins | None = None
    matrix: np.ndarray | None = None
    if sparse:
        acc, pairs, cls, placed = place_classes(
            offset_ns, dur_ns, flow_bytes, pair, rep_starts=rep_starts, bin_ns=bin_ns, n_bins=n_bins
        )
        rows = _sparse_rows(acc, pairs, cls, per_split, bin_ns, n_nodes, bin_s, control_bytes_per_s)
        control_bytes = rows.control_total()
    else:
        matrix, placed = place_flows(
            offset_ns, dur_ns, flow_bytes, pair, n_pairs=n_pairs, rep_starts=rep_starts, bin_ns=bin_ns, n_bins=n_bins
        )
        control_bytes = add_control(matrix, per_split, bin_ns) if n_pairs else 0

    return BinnedFlows(
        sparse=rows,
        matrix=matrix,
        placed_flow_bytes=int(placed),
        control_bytes=int(control_bytes),
        n_repetitions=int(len(rep_starts)),
        phase_s=phase_ns / NS_PER_S,
        seed=seed,
        repetition_factors=rep_factors,
        run_id=run_id,
        bin_s=bin_s,
        n_nodes=n_nodes,
    )


def _sparse_rows(
    acc: np.ndarray,
    pairs: np.ndarray,
    cls: np.ndarray,
    per_split: np.ndarray,
    bin_ns: int,
    n_nodes: int,
    bin_s: float,
    control_bytes_per_s: float,
) -> SparseBins:
    """The rows of ``place_classes``' ``(n_bins, n_classes)`` bytes ``acc`` that carry flow bytes, their
    control bytes added, sorted by (bin, pair): a few MB of ``(bins, pairs that carry flows)`` at a time."""
    n_bins = acc.shape[0]
    step = max(1, (1 << 22) // max(1, len(pairs)))
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for b0 in range(0, n_bins, step):
        block = acc[b0 : b0 + step][:, cls]  # (bins, pairs that carry flows), pairs ascending
        b, j = np.nonzero(block)
        flow = block[b, j]
        b += b0
        p = pairs[j]
        parts.append((b, p, flow + bin_table.control_at(per_split[p], b, bin_ns)))
    b_all, p_all, v_all = (np.concatenate([x[k] for x in parts]) if parts else np.zeros(0, np.int64) for k in range(3))
    return SparseBins(b_all, p_all, v_all, n_bins, n_nodes, bin_s, control_bytes_per_s)


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
    one = (np.array([v], dtype=np.int64) for v in (start_ns, dur_ns, total_bytes, 0))
    matrix, _ = place_flows(*one, n_pairs=1, rep_starts=np.zeros(1, dtype=np.int64), bin_ns=bin_ns, n_bins=n_bins)
    return matrix[:, 0]


def conservation_ok(binned: BinnedFlows) -> bool:
    """True when the bins hold exactly the placed flow bytes plus the control bytes."""
    return binned.binned_bytes() == binned.placed_flow_bytes + binned.control_bytes
