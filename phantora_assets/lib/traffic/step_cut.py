"""The primitive-period cut of step detection (internal to :mod:`~phantora_assets.lib.traffic.steps`,
whose docstring defines calls, periods, sub-periods and steps).

Shapes: a run's flows sorted into sequences (one per ``(comm_id, comm_rank)``) as flat numpy arrays
(:class:`_Calls`); times in microseconds. :func:`_primary_periods` finds each sequence's period
(the longest periodic tail, z-function), :func:`_cut` numbers the full periods of the anchor
sequences from the end and assigns the time-assigned ones by the anchors' step starts.

Raises :class:`~phantora_assets.lib.errors.StepDetectionError` ("steps disagree", "no steady step").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from phantora_assets.columns import STEP_COLUMNS
from phantora_assets.lib.errors import StepDetectionError


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


class _Periodicity:
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


def _fail(source: str, rule: str, detail: str) -> StepDetectionError:
    return StepDetectionError(source, rule, detail)


@dataclass(eq=False)
class _Calls:
    """The calls of every sequence. Rows are in sequence order: sorted by (comm_id, comm_rank,
    ts_us, flow_id); ``order[j]`` is the input position of sorted row ``j``.

    Per sorted row (length n_rows): ``seq_id``, ``ts_s`` (us), ``call_no`` (global call number).
    Per call: ``call_rows`` (its first sorted row). Per sequence (length n_seq): ``seq_start`` and
    ``seq_end`` (sorted rows ``[seq_start, seq_end)``), ``seq_comm``, ``seq_rank``,
    ``seq_call_start`` (global number of its first call) and ``seq_len`` (calls). Per input row:
    ``flow_arrays``. Per call: ``call_tok``.
    """

    n_rows: int
    order: np.ndarray
    seq_id: np.ndarray
    ts_s: np.ndarray
    call_no: np.ndarray
    call_rows: np.ndarray
    seq_start: np.ndarray
    seq_end: np.ndarray
    seq_comm: np.ndarray
    seq_rank: np.ndarray
    seq_call_start: np.ndarray
    seq_len: np.ndarray
    flow_arrays: tuple[np.ndarray, ...]  # ts_us, dur_us, src_node, dst_node, bytes in input order
    call_tok: np.ndarray  # token of every call (its kind: op, count, dtype, root, peer)

    def name(self, i: int) -> str:
        return f"communicator {self.seq_comm[i]} rank {self.seq_rank[i]}"

    def step_bounds(self, i: int, q: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Start (us) of the first and of the last call of each of the last ``n`` periods of
        ``q`` calls of sequence ``i``, both shape (n,), index 0 = the last period."""
        e = np.arange(n, dtype=np.int64)
        length = int(self.seq_len[i])
        g0 = int(self.seq_call_start[i])
        first_row = self.call_rows[g0 + length - (e + 1) * q]
        nxt = length - e * q  # first call after the period
        end_row = np.where(nxt < length, self.call_rows[g0 + np.minimum(nxt, length - 1)], self.seq_end[i])
        return self.ts_s[first_row], self.ts_s[end_row - 1]  # rows are sorted by ts in a sequence

    def call_starts(self, i: int, q: int, n: int) -> np.ndarray:
        """Start (us) of every call of the last ``n`` periods of ``q`` calls of sequence ``i``,
        shape (n, q), row 0 = the last period."""
        e = np.arange(n, dtype=np.int64)[:, None]
        first = self.seq_call_start[i] + self.seq_len[i] - (e + 1) * q  # shape (n, 1)
        return self.ts_s[self.call_rows[first + np.arange(q, dtype=np.int64)[None, :]]]


@dataclass(eq=False)
class _Cut:
    """Steps of every call for one choice of periods (see :func:`_cut`)."""

    period: dict[int, int]  # sequence -> period in calls (time-assigned: median calls per step)
    counts: dict[int, int]  # anchor sequence -> full periods
    anchors: list[int]
    by_time: list[int]
    n_steps: int
    first_steady: int
    n_complete: int  # steps 0 .. n_complete - 1 are complete
    step_sorted: np.ndarray  # step of every sorted row, -1 before a sequence's first full period
    steps: pd.DataFrame
    starts: np.ndarray  # start_us of every step, shape (n_steps,)


def _cut(
    cs: _Calls,
    period: dict[int, int],
    counts: dict[int, int],
    by_time: list[int],
    repeating: list[int],
    warmup_steps: int,
    src: str,
) -> _Cut:
    """Number the full periods of every anchor sequence (aligned to its end), assign the
    time-assigned sequences by the anchors' step starts, build the step table and check that
    every anchor sequence's first call of a steady step comes before the next step starts.

    Raises:
        StepDetectionError: ``"steps disagree"`` (step counts more than ``warmup_steps + 1``
            apart, or the time check fails), ``"no steady step"``.
    """
    slack = warmup_steps + 1
    seq_id, ts_s = cs.seq_id, cs.ts_s
    anchors = [i for i in repeating if i in period]
    n_min, n_max = min(counts[i] for i in anchors), max(counts[i] for i in anchors)
    if n_max - n_min > slack:
        lo = min(anchors, key=lambda i: counts[i])
        hi = max(anchors, key=lambda i: counts[i])
        raise _fail(
            src,
            "steps disagree",
            f"{cs.name(hi)} has {counts[hi]} steps (period {period[hi]} calls) but "
            f"{cs.name(lo)} has {counts[lo]} (period {period[lo]} calls)",
        )
    n_steps = n_max
    first_steady = (n_max - n_min) + warmup_steps
    # with time-assigned sequences the last step is cut short by the end of the trace
    n_complete = n_steps - 1 if by_time else n_steps
    if first_steady >= n_complete:
        raise _fail(src, "no steady step", f"{n_steps} steps, of which {first_steady} are warm-up")

    # ---- step of every call, then of every row -------------------------------------
    n_seq = len(cs.seq_start)
    q_arr = np.ones(n_seq, dtype=np.int64)
    nper = np.zeros(n_seq, dtype=np.int64)
    for i in anchors:
        q_arr[i], nper[i] = period[i], counts[i]
    local = cs.call_no - cs.seq_call_start[seq_id]  # call index within its sequence
    first_full = cs.seq_len[seq_id] - nper[seq_id] * q_arr[seq_id]
    rel = local - first_full
    step_sorted = np.where((rel >= 0) & (nper[seq_id] > 0), (n_steps - nper[seq_id]) + rel // q_arr[seq_id], -1)
    if by_time:
        anchor_rows = step_sorted >= 0
        a_starts = pd.Series(ts_s[anchor_rows]).groupby(step_sorted[anchor_rows]).min()
        a_starts = a_starts.reindex(np.arange(n_steps)).to_numpy(dtype=np.float64)
        timed_rows = np.isin(seq_id, np.asarray(by_time))
        k = np.searchsorted(a_starts, ts_s[timed_rows], side="right") - 1
        step_sorted[timed_rows] = k
        for i in by_time:
            rows = seq_id == i
            per_step = np.bincount(step_sorted[rows & (step_sorted >= first_steady)], minlength=n_steps)
            period[i] = int(np.median(per_step[first_steady:n_complete]))
    steps, starts = _step_table(cs, step_sorted, n_steps, first_steady, n_complete)

    # ---- consistency of the cut in time (steady steps) -----------------------------
    ss = pd.DataFrame({"seq": seq_id, "step": step_sorted, "ts": ts_s})
    ss = ss[(ss["step"] >= first_steady) & (ss["step"] < n_steps - 1) & np.isin(ss["seq"], np.asarray(anchors))]
    first_ts = ss.groupby(["seq", "step"])["ts"].min()
    if len(first_ts):
        nxt = starts[first_ts.index.get_level_values("step").to_numpy() + 1]
        bad = first_ts.to_numpy() >= nxt
        if bad.any():
            (s_i, k) = first_ts.index[int(np.argmax(bad))]
            nxt_rows = np.flatnonzero(step_sorted == k + 1)
            o = int(seq_id[nxt_rows[np.argmin(ts_s[nxt_rows])]])
            raise _fail(
                src,
                "steps disagree",
                f"{cs.name(s_i)} starts its step {k} "
                f"at {first_ts.iloc[int(np.argmax(bad))]:.3f} us, after step {k + 1} "
                f"began at {starts[k + 1]:.3f} us on {cs.name(o)} "
                f"(periods {period[s_i]} and {period[o]} calls)",
            )
    return _Cut(
        period=period,
        counts=counts,
        anchors=anchors,
        by_time=by_time,
        n_steps=n_steps,
        first_steady=first_steady,
        n_complete=n_complete,
        step_sorted=step_sorted,
        steps=steps,
        starts=starts,
    )


def _step_table(
    cs: _Calls, step_sorted: np.ndarray, n_steps: int, first_steady: int, n_complete: int
) -> tuple[pd.DataFrame, np.ndarray]:
    """The step table (``STEP_COLUMNS``) of a step for every sorted row (-1: no step), and the
    start (us) of every step, shape (n_steps,). A step starts with its first flow and ends where
    the next starts (the last one: with the end of its last flow); steps ``first_steady ..
    n_complete - 1`` are steady."""
    period_step = np.empty(cs.n_rows, dtype=np.int64)
    period_step[cs.order] = step_sorted
    ts, dur, sn, dn, nbytes = cs.flow_arrays
    in_step = period_step >= 0
    st = pd.DataFrame(
        {
            "step": period_step[in_step],
            "ts": ts[in_step],
            "end": ts[in_step] + dur[in_step],
            "net": np.where(sn[in_step] != dn[in_step], nbytes[in_step], 0),
        }
    )
    g = st.groupby("step").agg(start=("ts", "min"), end=("end", "max"), net=("net", "sum"), n=("ts", "size"))
    g = g.reindex(np.arange(n_steps))
    starts = g["start"].to_numpy(dtype=np.float64)
    ends = np.append(starts[1:], g["end"].to_numpy(dtype=np.float64)[-1])
    steady = (np.arange(n_steps) >= first_steady) & (np.arange(n_steps) < n_complete)
    steps = pd.DataFrame(
        {
            "step": np.arange(n_steps, dtype=np.int64),
            "start_us": starts,
            "end_us": ends,
            "duration_us": ends - starts,
            "steady": steady,
            "network_bytes": g["net"].fillna(0).to_numpy(dtype=np.int64),
            "n_flows": g["n"].fillna(0).to_numpy(dtype=np.int64),
        }
    ).astype(STEP_COLUMNS)
    return steps, starts


def _primary_periods(
    cs: _Calls,
    per: list[_Periodicity],
    best: dict[int, int],
    repeating: list[int],
    warmup_steps: int,
    src: str,
) -> tuple[dict[int, int], dict[int, int], list[int]]:
    """Periods by the sub-period rule (module docstring): ``(period, counts, by_time)``.

    Raises:
        StepDetectionError: ``"steps disagree"``: a sequence repeats more often than the
            others and no multiple of its period matches their step count.
    """
    counts = {i: per[i].full_periods(best[i]) for i in repeating}
    c_ref = min(counts.values())
    slack = warmup_steps + 1
    # Sequences whose primitive period repeats more often than a step (e.g. the identical
    # all-to-all sends of MoE layers) cannot place step boundaries themselves: their calls
    # are assigned to steps by time, using the boundaries of the other ("anchor") sequences.
    # A sequence that repeats its pattern k times per step is an anchor with period k * p
    # when exactly one multiple brings its count into [c_ref, c_ref + slack]; when several
    # do, the step boundary inside it is ambiguous and it is assigned by time.
    period = {}
    by_time = []
    for i in repeating:
        p = best[i]
        if counts[i] <= c_ref + slack:
            period[i] = p
            continue
        fits = [q for q in range(p, cs.seq_len[i] + 1, p) if c_ref <= per[i].full_periods(q) <= c_ref + slack]
        if len(fits) == 1:
            period[i] = fits[0]
            counts[i] = per[i].full_periods(fits[0])
        elif fits:
            by_time.append(i)
        else:
            lo = min(repeating, key=lambda j: counts[j])
            raise _fail(
                src,
                "steps disagree",
                f"{cs.name(i)} repeats {counts[i]} times "
                f"(period {p} calls), no multiple of which matches the {counts[lo]} steps of "
                f"{cs.name(lo)} (period {best[lo]} calls)",
            )
    return period, counts, by_time
