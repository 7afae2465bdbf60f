"""The primitive-period cut of step detection (internal to :mod:`~phantora_assets.lib.traffic.steps`,
whose docstring defines calls, periods, sub-periods and steps).

Shapes: a run's flows sorted into sequences (one per ``(comm_id, comm_rank)``) as flat numpy arrays
(:class:`Calls`); times in microseconds. :func:`primary_periods` finds each sequence's period
(the longest periodic tail, z-function), :func:`cut_steps` numbers the full periods of the anchor
sequences from the end and assigns the time-assigned ones by the anchors' step starts.

Raises :class:`~phantora_assets.lib.errors.StepDetectionError` ("steps disagree", "no steady step").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from phantora_assets.lib.columns import STEP_COLUMNS
from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.periodicity import Periodicity

__all__ = ["Periodicity"]  # re-exported: the step modules read it from here


def step_error(source: str, rule: str, detail: str) -> StepDetectionError:
    return StepDetectionError(source, rule, detail)


@dataclass(eq=False)
class Calls:
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
    seq_p2p: np.ndarray  # per sequence: it issues send/recv calls

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


def call_sequences(flows: pd.DataFrame, p2p_counts: bool = True) -> Calls:
    """The calls of every sequence of ``flows`` (``FLOW_COLUMNS``, at least one row): rows sorted by
    (comm_id, comm_rank, ts_us, flow_id), a broadcast root's same-``ts`` flows of one call merged
    (steps module docstring, "Call"). ``p2p_counts=False``: a send/recv's token leaves its count out
    (an MoE all-to-all's counts vary with routing; ``rule.StepRule.p2p_bytes_rel_tol``)."""
    n_rows = len(flows)
    # ---- sort into sequences -------------------------------------------------------
    comm = flows["comm_id"].astype(str).to_numpy()
    rank = flows["comm_rank"].to_numpy(dtype=np.int64)
    ts = flows["ts_us"].to_numpy(dtype=np.float64)
    dur = flows["dur_us"].to_numpy(dtype=np.float64)
    fid = flows["flow_id"].to_numpy(dtype=np.int64)
    op = flows["op"].astype(str).to_numpy()
    sn = flows["src_node"].to_numpy(dtype=np.int64)
    dn = flows["dst_node"].to_numpy(dtype=np.int64)
    nbytes = flows["bytes"].to_numpy(dtype=np.int64)

    comm_codes, comm_names = pd.factorize(comm, sort=True)
    order = np.lexsort((fid, ts, rank, comm_codes))
    c_s, r_s, ts_s, op_s = comm_codes[order], rank[order], ts[order], op[order]

    peer = np.where(op_s == "send", dn[order] - sn[order], np.where(op_s == "recv", sn[order] - dn[order], 0))
    tok_frame = pd.DataFrame(  # integer codes, not strings: a quarter of the groupby's memory
        {
            "op": pd.factorize(op_s)[0],
            "count": np.where(
                p2p_counts | ((op_s != "send") & (op_s != "recv")), flows["count"].to_numpy(dtype=np.int64)[order], -1
            ),
            "dtype": pd.factorize(flows["dtype"].astype(str).to_numpy()[order])[0],
            "root": np.where(op_s == "broadcast", flows["root"].to_numpy(dtype=np.int64)[order], -1),
            "peer": peer,
        }
    )
    token = tok_frame.groupby(list(tok_frame.columns), sort=False).ngroup().to_numpy(np.int64)

    new_seq = np.ones(n_rows, dtype=bool)
    new_seq[1:] = (c_s[1:] != c_s[:-1]) | (r_s[1:] != r_s[:-1])
    seq_id = np.cumsum(new_seq) - 1
    seq_start = np.flatnonzero(new_seq)
    n_seq = len(seq_start)
    seq_comm = comm_names[c_s[seq_start]]
    seq_rank = r_s[seq_start]

    # ---- calls: merge a broadcast root's same-ts flows of one call -----------------
    new_call = np.ones(n_rows, dtype=bool)
    is_b = op_s == "broadcast"
    if is_b.any():
        bidx = np.flatnonzero(is_b)
        bf = pd.DataFrame({"seq": seq_id[bidx], "ts": ts_s[bidx], "tok": token[bidx], "comm": c_s[bidx]})
        grp = bf.groupby(["seq", "ts", "tok"], sort=False)
        pos = grp.cumcount().to_numpy()
        sizes = grp["comm"].agg(["first", "size"])
        fan = {int(c): int(np.gcd.reduce(s.to_numpy())) for c, s in sizes.groupby("first")["size"]}
        fanout = np.array([fan[int(c)] for c in bf["comm"].to_numpy()], dtype=np.int64)
        new_call[bidx] = pos % fanout == 0
    new_call[seq_start] = True
    call_no = np.cumsum(new_call) - 1  # global call number of each row
    call_rows = np.flatnonzero(new_call)
    call_tok = token[call_rows]
    call_seq = seq_id[call_rows]
    seq_call_start = np.searchsorted(call_seq, np.arange(n_seq))
    seq_len = np.diff(np.append(seq_call_start, len(call_rows)))
    return Calls(
        n_rows=n_rows,
        order=order,
        seq_id=seq_id,
        ts_s=ts_s,
        call_no=call_no,
        call_rows=call_rows,
        seq_start=seq_start,
        seq_end=np.append(seq_start[1:], n_rows),
        seq_comm=seq_comm,
        seq_rank=seq_rank,
        seq_call_start=seq_call_start,
        seq_len=seq_len,
        flow_arrays=(ts, dur, sn, dn, nbytes),
        call_tok=call_tok,
        seq_p2p=np.bitwise_or.reduceat((op_s == "send") | (op_s == "recv"), seq_start),
    )


@dataclass(eq=False)
class Cut:
    """Steps of every call for one choice of periods (see :func:`cut_steps`)."""

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


def cut_steps(  # noqa: PLR0913 (the step detector's state, passed explicitly)
    cs: Calls,
    period: dict[int, int],
    counts: dict[int, int],
    by_time: list[int],
    repeating: list[int],
    warmup_steps: int,
    src: str,
    shift: dict[int, int] | None = None,
    head: dict[int, int] | None = None,
    relaxed: bool = False,
) -> Cut:
    """Number the full periods of every anchor sequence (aligned to its end, or ``shift[i]`` steps
    before it: the trace ends inside that sequence's next ``shift[i]`` steps, which are then not
    steady; or from its call ``head[i]`` on, its calls after its last full period in the next step),
    assign the time-assigned sequences by the anchors' steps, build the step table and
    check that every anchor sequence's first call of a steady step comes before the next step starts.

    A time-assigned call between two steps of the anchors (after the last anchor call of one, before
    the first of the next) goes to the earlier step, unless the sequence's first call precedes the
    anchors' first step (its calls come first in a step, as the run's first step shows; an anchor's warm-up
    calls before its first full period do not count): then the calls ending the gap that repeat the end of
    that head (other kinds passed over) open the later step (:func:`_opening_steps`), as do calls issued
    with the anchors' first call of it (:func:`_concurrent`).

    Raises:
        StepDetectionError: ``"steps disagree"`` (step counts more than ``warmup_steps + 1``
            apart, or the time check fails), ``"no steady step"``.
    """
    slack = warmup_steps + 1
    seq_id, ts_s = cs.seq_id, cs.ts_s
    anchors = [i for i in repeating if i in period]
    n_min, n_max = min(counts[i] for i in anchors), max(counts[i] for i in anchors)
    if n_max - n_min > slack and not relaxed:
        lo = min(anchors, key=lambda i: counts[i])
        hi = max(anchors, key=lambda i: counts[i])
        raise step_error(
            src,
            "steps disagree",
            f"{cs.name(hi)} has {counts[hi]} steps (period {period[hi]} calls) but "
            f"{cs.name(lo)} has {counts[lo]} (period {period[lo]} calls)",
        )
    sh = {i: (shift or {}).get(i, 0) for i in anchors}
    n_steps = max(n_max, *(counts[i] + sh[i] for i in anchors))
    first_steady = max(n_steps - counts[i] - sh[i] for i in anchors) + warmup_steps
    # with time-assigned sequences the last step is cut short by the end of the trace
    n_complete = n_steps - max(sh.values()) - (1 if by_time else 0)
    if first_steady >= n_complete:
        raise step_error(src, "no steady step", f"{n_steps} steps, of which {first_steady} are warm-up")

    # ---- step of every call, then of every row -------------------------------------
    n_seq = len(cs.seq_start)
    q_arr = np.ones(n_seq, dtype=np.int64)
    nper = np.zeros(n_seq, dtype=np.int64)
    lead = np.zeros(n_seq, dtype=np.int64)  # steps before a sequence's first full period
    for i in anchors:
        q_arr[i], nper[i], lead[i] = period[i], counts[i], n_steps - counts[i] - sh[i]
    local = cs.call_no - cs.seq_call_start[seq_id]  # call index within its sequence
    first_full = cs.seq_len - nper * q_arr
    for i, h in (head or {}).items():
        first_full[i] = h
    first_full = first_full[seq_id]
    rel = local - first_full
    step_sorted = np.where((rel >= 0) & (nper[seq_id] > 0), lead[seq_id] + rel // q_arr[seq_id], -1)
    if by_time:
        anchor_rows = step_sorted >= 0
        a_ts = pd.Series(ts_s[anchor_rows]).groupby(step_sorted[anchor_rows])
        a_starts = a_ts.min().reindex(np.arange(n_steps)).to_numpy(dtype=np.float64)
        a_lasts = a_ts.max().reindex(np.arange(n_steps)).to_numpy(dtype=np.float64)
        first_anchor = float(np.nanmin(a_starts))  # the anchors' first step (their warm-up calls left out)
        for i in by_time:
            rows = seq_id == i
            if float(ts_s[rows].min()) < first_anchor:  # its calls open a step (the head of the first one)
                step_sorted[rows] = _opening_steps(cs, i, a_starts, a_lasts, first_anchor)
            else:
                step_sorted[rows] = np.searchsorted(a_starts, ts_s[rows], side="right") - 1
            step_sorted[rows] = _concurrent(cs, rows, step_sorted[rows], a_starts, a_lasts)
            per_step = np.bincount(step_sorted[rows & (step_sorted >= first_steady)], minlength=n_steps)
            period[i] = int(np.median(per_step[first_steady:n_complete]))
    steps, starts = step_table(cs, step_sorted, n_steps, first_steady, n_complete)

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
            raise step_error(
                src,
                "steps disagree",
                f"{cs.name(s_i)} starts its step {k} "
                f"at {first_ts.iloc[int(np.argmax(bad))]:.3f} us, after step {k + 1} "
                f"began at {starts[k + 1]:.3f} us on {cs.name(o)} "
                f"(periods {period[s_i]} and {period[o]} calls)",
            )
    return Cut(period, counts, anchors, by_time, n_steps, first_steady, n_complete, step_sorted, steps, starts)


#: A time-assigned call within this share of a step time of the anchors' step start is concurrent with it.
CONCURRENT_SHARE = 0.01


def _concurrent(cs: Calls, rows: np.ndarray, step: np.ndarray, starts: np.ndarray, lasts: np.ndarray) -> np.ndarray:
    """``step`` (of the sorted ``rows`` of a time-assigned sequence), its calls of a kind that comes within
    ``CONCURRENT_SHARE`` of a step time of the anchors' step start, just after it in some steps and just
    before it (after the previous step's anchor calls) in others, in the later step: issued with its first call."""
    n, ts, tok = len(starts), cs.ts_s[rows], cs.call_tok[cs.call_no[rows]]
    gaps = np.diff(starts[np.isfinite(starts)])
    tol = CONCURRENT_SHARE * float(np.median(gaps)) if len(gaps) else 0.0
    k, nxt = np.clip(step, 0, n - 1), np.clip(step + 1, 0, n - 1)
    after, before = (step >= 0) & (ts - starts[k] <= tol), (step >= 0) & (step + 1 < n) & (ts > lasts[k])
    before &= starts[nxt] - ts <= tol
    return np.where(before & np.isin(tok, np.intersect1d(tok[after], tok[before])), step + 1, step)


def _opening_steps(cs: Calls, i: int, a_starts: np.ndarray, a_lasts: np.ndarray, first_anchor: float) -> np.ndarray:
    """Step of every row of time-assigned sequence ``i``, whose calls before ``first_anchor`` (the
    anchors' first call) are its head: a call in the anchors' step ``k`` or before step 0 is in it; of
    the calls in the gap before step ``k``, the last ones that repeat the end of the head open step
    ``k`` (-1 after the last step), the others end step ``k - 1`` (an occasional call does not move a
    step's start); calls of a kind the head lacks (a logging all-reduce inside it) are passed over, and
    open step ``k`` after a call that repeats the head."""
    g0, n, n_steps = int(cs.seq_call_start[i]), int(cs.seq_len[i]), len(a_starts)
    ts, tok = cs.ts_s[cs.call_rows[g0 : g0 + n]], cs.call_tok[g0 : g0 + n]
    head = tok[ts < first_anchor]
    step = np.searchsorted(a_lasts, ts, side="left")  # the step a call is in, or opens
    gi = np.flatnonzero((step >= 1) & ((step == n_steps) | (ts < a_starts[np.minimum(step, n_steps - 1)])))
    gh = gi[np.isin(tok[gi], head)]  # the gap calls of a kind the head has, matched against it
    opens = np.full(n_steps + 1, n, dtype=np.int64)  # per gap: first call that opens the later step
    if len(gh):  # runs of calls in one gap: place r from the run's end, matched against the head's end
        new_run = np.r_[True, step[gh[1:]] != step[gh[:-1]]]
        run_first, run_of, pos = np.flatnonzero(new_run), np.cumsum(new_run) - 1, np.arange(len(gh))
        run_last = np.append(run_first[1:], len(gh)) - 1
        r = run_last[run_of] - pos
        match = tok[gh] == head[len(head) - 1 - r % len(head)]  # the head repeated: a ramp-up's first step is short
        last_bad = np.maximum.reduceat(np.where(match, run_first[run_of] - 1, pos), run_first)  # last mismatch
        opens[step[gh[run_first[last_bad < run_last]]]] = gh[last_bad[last_bad < run_last] + 1]
    step[gi[gi < opens[step[gi]]]] -= 1
    step = np.where(step < n_steps, step, -1)
    return step[cs.call_no[cs.seq_start[i] : cs.seq_end[i]] - g0]


def step_table(
    cs: Calls, step_sorted: np.ndarray, n_steps: int, first_steady: int, n_complete: int
) -> tuple[pd.DataFrame, np.ndarray]:
    """The step table (``STEP_COLUMNS``) of a step for every sorted row (-1: no step), and the
    start (us) of every step, shape (n_steps,). A step starts with its first flow and ends where
    the next starts (the last one: with the end of its last flow); steps ``first_steady ..
    n_complete - 1`` are steady, and those of them with a next step are timed (the last step's
    duration ends at its last flow, not at the step's end: its calls are complete, its time is not)."""
    period_step = np.empty(cs.n_rows, dtype=np.int64)
    period_step[cs.order] = step_sorted
    ts, dur, sn, dn, nbytes = cs.flow_arrays
    in_step = period_step >= 0
    # per step with numpy's unbuffered reductions: no (rows x 4) frame and groupby copies (~0.5 GB at 4.9 M rows)
    k = period_step[in_step]
    n = np.bincount(k, minlength=n_steps)
    first, last = np.full(n_steps, np.inf), np.full(n_steps, -np.inf)
    np.minimum.at(first, k, ts[in_step])
    np.maximum.at(last, k, (ts + dur)[in_step])
    net = np.zeros(n_steps, dtype=np.int64)
    np.add.at(net, k, np.where(sn != dn, nbytes, 0)[in_step])
    starts = np.where(n > 0, first, np.nan)
    ends = np.append(starts[1:], last[-1] if n[-1] else np.nan)
    steady = (np.arange(n_steps) >= first_steady) & (np.arange(n_steps) < n_complete)
    steps = pd.DataFrame(
        {
            "step": np.arange(n_steps, dtype=np.int64),
            "start_us": starts,
            "end_us": ends,
            "duration_us": ends - starts,
            "steady": steady,
            "timed": steady & (np.arange(n_steps) < n_steps - 1),
            "network_bytes": net,
            "n_flows": n.astype(np.int64),
            "outlier": "",
        }
    ).astype(STEP_COLUMNS)
    return steps, starts


def _period_us(cs: Calls, i: int, q: int) -> float:
    """Median time (us) between the starts of the last (up to 8) periods of ``q`` calls of sequence ``i``."""
    n = min(8, int(cs.seq_len[i]) // q)
    first, _ = cs.step_bounds(i, q, n)
    d = -np.diff(first)
    return float(np.median(d)) if len(d) else 0.0


def _steady_period_us(cs: Calls, i: int, q: int) -> float:
    """:func:`_period_us` when most of the last (up to 8) periods of ``q`` calls of sequence ``i`` last
    within 10 % of their median and their mean within 25 % of it (a rhythm in time, outliers aside: its
    period is a step; not two calls close together, then a long gap), else 0."""
    n = min(8, int(cs.seq_len[i]) // q)
    first, _ = cs.step_bounds(i, q, n)
    d = -np.diff(first)
    if len(d) < 2:
        return 0.0
    med = float(np.median(d))
    most = 2 * int((np.abs(d - med) <= 0.1 * med).sum()) > len(d)
    return med if med > 0 and most and abs(float(d.mean()) / med - 1.0) <= 0.25 else 0.0


def _multiple_by_time(cs: Calls, i: int, p: int, ref: int, best: dict[int, int]) -> int | None:
    """The multiple ``m`` of sequence ``i``'s period ``p`` whose periods last the reference sequence's
    (within 10 %), or None."""
    t_i, t_ref = _period_us(cs, i, p), _period_us(cs, ref, best[ref])
    if t_i <= 0 or t_ref <= 0:
        return None
    m = int(round(t_ref / t_i))
    return m if m >= 1 and abs(t_ref / t_i - m) <= 0.1 * m and m * p <= cs.seq_len[i] else None


def primary_periods(
    cs: Calls,
    per: list[Periodicity],
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
    # do, or the one that does has periods that do not last the anchors' step (10 %: a ramp-up's fewer
    # calls alike shift the count), the step boundary inside it is not its own and it is assigned by time.
    period = {}
    by_time = []
    for i in repeating:
        p = best[i]
        if counts[i] <= c_ref + slack:
            period[i] = p
            continue
        fits = [q for q in range(p, cs.seq_len[i] + 1, p) if c_ref <= per[i].full_periods(q) <= c_ref + slack]
        ref = min(repeating, key=lambda j: counts[j])
        t_ref = _steady_period_us(cs, ref, best[ref]) if len(fits) == 1 else 0.0
        if len(fits) == 1 and t_ref > 0 and abs(_period_us(cs, i, fits[0]) / t_ref - 1.0) > 0.1:
            by_time.append(i)  # the one count that fits is not a step in time (a ramp-up's fewer calls alike)
        elif len(fits) == 1:
            period[i] = fits[0]
            counts[i] = per[i].full_periods(fits[0])
        elif fits:
            by_time.append(i)
        elif (m := _multiple_by_time(cs, i, p, min(repeating, key=lambda j: counts[j]), best)) is not None and m > 1:
            by_time.append(i)  # several of its periods a step: the others' steps place them
        elif m is not None:
            period[i] = m * p  # more steps than the others by more than the slack: a ramp-up, a longer warm-up
            counts[i] = per[i].full_periods(m * p)
        else:
            lo = min(repeating, key=lambda j: counts[j])
            raise step_error(
                src,
                "steps disagree",
                f"{cs.name(i)} repeats {counts[i]} times "
                f"(period {p} calls), no multiple of which matches the {counts[lo]} steps of "
                f"{cs.name(lo)} (period {best[lo]} calls)",
            )
    return period, counts, by_time


def first_alike(cs: Calls, cut: Cut) -> tuple[int, str | None]:
    """The first steady step from which every step issues the calls most steady steps issue (every
    sequence, by call token), and why a later steady step breaks that (None when none does)."""
    step = cut.step_sorted[cs.call_rows]
    m = (step >= cut.first_steady) & (step < cut.n_complete)
    code = cs.seq_id[cs.call_rows][m] * (int(cs.call_tok.max()) + 1) + cs.call_tok[m]
    sig = pd.Series(code).groupby(step[m], sort=True).agg(tuple)
    if sig.nunique() <= 1:
        return cut.first_steady, None
    ref = sig.value_counts().index[0]
    same = (sig == ref).to_numpy()
    first = int(np.argmax(same))
    if not same[first:].all():
        k = int(sig.index[first + int(np.argmin(same[first:]))])
        return int(sig.index[first]), f"steady step {k} issues other calls than the {int(same.sum())} steps alike"
    return int(sig.index[first]), None
