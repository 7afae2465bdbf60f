"""Which end of the trace the steps are aligned to (internal to :mod:`~phantora_assets.lib.traffic.steps`,
whose docstring, "A trace cut short" and "A trace cut inside a pattern", states the rules).

:func:`_cut` numbers each anchor sequence's full periods from its END. A trace cut short (the run
stopped inside its last iteration) breaks that: a communicator with no call in the last iteration
lacks its last step (:func:`_start_aligned`), and one whose last iteration holds only the first calls
of its pattern ends with a part of a period, so its periods counted from the end are rotated: each
holds the end of one iteration and the start of the next (:func:`_head_aligned`).
The same phase question for steps re-cut at the compute rhythm: :func:`split_period` (a step
boundary inside a communicator's own period).

Raises nothing: a cut that does not hold is not taken (the callers keep the one they have); a
split period is returned as the reason the caller refuses.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.steps.cut import _Calls, _Cut, _cut, _Periodicity


def _in_order(cs: _Calls, got: _Cut) -> bool:
    """The anchors' steps follow each other in time: no call of a step after a call of the next."""
    rows = (got.step_sorted >= 0) & np.isin(cs.seq_id, np.asarray(got.anchors))
    span = pd.Series(cs.ts_s[rows]).groupby(got.step_sorted[rows]).agg(["min", "max"])
    return bool((span["max"].to_numpy()[:-1] <= span["min"].to_numpy()[1:]).all())


def _start_aligned(cs: _Calls, cut: _Cut, repeating: list[int], warmup_steps: int, src: str) -> _Cut:
    """``cut`` renumbered when the trace ends inside its last step (steps module docstring, "A trace
    cut short"): every anchor sequence with fewer full periods than the most and no call before its
    first full period is numbered from step 0, so the steps it lacks are the last ones, which are not
    steady. Kept only when that cut holds (the check of :func:`_cut`, steps ordered in time); else
    ``cut``, unchanged."""
    shift = {}
    for i in cut.anchors:
        missing = cut.n_steps - cut.counts[i]
        if missing and int(cs.seq_len[i]) == cut.counts[i] * cut.period[i]:
            shift[i] = missing
    if not shift:
        return cut
    period = {i: cut.period[i] for i in cut.anchors}
    try:
        got = _cut(cs, period, dict(cut.counts), list(cut.by_time), repeating, warmup_steps, src, shift)
    except StepDetectionError:
        return cut
    return got if _in_order(cs, got) else cut


def _head_aligned(
    cs: _Calls, cut: _Cut, per: list[_Periodicity], repeating: list[int], warmup_steps: int, src: str
) -> _Cut:
    """``cut`` renumbered from the run's first step when the trace ends inside a pattern (steps module
    docstring, "A trace cut inside a pattern"): an anchor sequence periodic from its first call whose
    calls are no whole number of periods has its last period cut short (the run starts with a step;
    its end can be anywhere). Every anchor periodic from its first call is then numbered from step 0
    (its calls after its last full period: the last step, not steady); an anchor with calls before
    its periodic tail (warm-up) takes the step whose start its first full period follows. Kept only
    when that cut holds (the check of :func:`_cut`, steps ordered in time); else ``cut``, unchanged."""
    q = {i: cut.period[i] for i in cut.anchors}
    whole = [i for i in cut.anchors if per[i].tail(q[i]) == int(cs.seq_len[i])]  # periodic from call 0
    if not any(int(cs.seq_len[i]) % q[i] for i in whole):
        return cut
    counts = {i: int(cs.seq_len[i]) // q[i] for i in whole}
    n_total = max(counts[i] + (1 if int(cs.seq_len[i]) % q[i] else 0) for i in whole)
    starts = np.full(n_total, np.inf)  # start of each step: the first call of a period of these anchors
    for i in whole:
        g0 = int(cs.seq_call_start[i])
        k = np.arange(counts[i] + (1 if int(cs.seq_len[i]) % q[i] else 0))
        starts[k] = np.minimum(starts[k], cs.ts_s[cs.call_rows[g0 + k * q[i]]])
    shift = {i: n_total - counts[i] for i in whole}
    head = dict.fromkeys(whole, 0)
    for j in cut.anchors:
        if j in shift:
            continue
        counts[j] = cut.counts[j]
        first = int(cs.seq_call_start[j] + cs.seq_len[j] - counts[j] * q[j])  # its first full period
        lead = int(np.searchsorted(starts, cs.ts_s[cs.call_rows[first]], side="right")) - 1
        if lead < 0 or lead + counts[j] > n_total:
            return cut
        shift[j] = n_total - counts[j] - lead
    try:
        got = _cut(cs, q, counts, list(cut.by_time), repeating, warmup_steps, src, shift, head)
    except StepDetectionError:
        return cut
    return got if _in_order(cs, got) else cut


def split_period(cs: _Calls, per: list[_Periodicity], prim: dict[int, int], cut: _Cut) -> str | None:
    """Why ``cut`` (steps re-cut at the compute rhythm) splits a sequence's own period, or None (steps
    module docstring, "Compute rhythm"): a sequence whose primitive period ``p`` (a whole number of them
    in its periodic tail, so their phase is known) is at most its calls per step has a step boundary
    inside one of them: the steps start mid-iteration."""
    for i, p in prim.items():
        n, tail = int(cs.seq_len[i]), per[i].tail(p)
        if tail % p or p > cut.period.get(i, 0):
            continue
        g0 = int(cs.seq_call_start[i])
        step = cut.step_sorted[cs.call_rows[g0 + n - tail : g0 + n]]
        inside = np.flatnonzero((step[1:] != step[:-1]) & (step[:-1] >= 0) & ((np.arange(1, tail) % p) != 0))
        if len(inside):
            t = float(cs.ts_s[cs.call_rows[g0 + n - tail + int(inside[0]) + 1]])
            return f"{cs.name(i)}: a step starts at {t:.3f} us, inside its period of {p} calls"
    return None
