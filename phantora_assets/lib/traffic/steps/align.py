"""Which end of the trace the steps are aligned to (internal to :mod:`~phantora_assets.lib.traffic.steps`,
whose docstring, "A trace cut short" and "A trace cut inside a pattern", states the rules).

:func:`cut_steps` numbers each anchor sequence's full periods from its END. A trace cut short (the run
stopped inside its last iteration) breaks that: a communicator with no call in the last iteration
lacks its last step (:func:`start_aligned`), and one whose last iteration holds only the first calls
of its pattern ends with a part of a period, so its periods counted from the end are rotated: each
holds the end of one iteration and the start of the next (:func:`head_aligned`).
The same phase question for steps re-cut at the compute rhythm: :func:`split_period` (a step
boundary inside a communicator's own period).

A cut that does not hold is not taken (the callers keep the one they have); a split period is
returned as the reason the caller refuses. Raises StepDetectionError "steps ambiguous" for a periodic
tail after warm-up calls that both cuts fit (:func:`head_aligned`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.steps.cut import Calls, Cut, Periodicity, cut_steps


def _in_order(cs: Calls, got: Cut) -> bool:
    """The anchors' steps follow each other in time: no call of a step after a call of the next."""
    rows = (got.step_sorted >= 0) & np.isin(cs.seq_id, np.asarray(got.anchors))
    span = pd.Series(cs.ts_s[rows]).groupby(got.step_sorted[rows]).agg(["min", "max"])
    return bool((span["max"].to_numpy()[:-1] <= span["min"].to_numpy()[1:]).all())


def start_aligned(cs: Calls, cut: Cut, repeating: list[int], warmup_steps: int, src: str) -> Cut:
    """``cut`` renumbered when the trace ends inside its last step (steps module docstring, "A trace
    cut short"): every anchor sequence with fewer full periods than the most and no call before its
    first full period is numbered from step 0, so the steps it lacks are the last ones, which are not
    steady. Kept only when that cut holds (the check of :func:`cut_steps`, steps ordered in time); else
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
        got = cut_steps(cs, period, dict(cut.counts), list(cut.by_time), repeating, warmup_steps, src, shift)
    except StepDetectionError:
        return cut
    return got if _in_order(cs, got) else cut


def head_aligned(
    cs: Calls,
    cut: Cut,
    per: list[Periodicity],
    repeating: list[int],
    warmup_steps: int,
    src: str,
) -> Cut:
    """``cut`` renumbered from the run's first step when the trace ends inside a pattern (steps module
    docstring, "A trace cut inside a pattern"): an anchor sequence whose periodic tail is no whole number
    of periods has its last period cut short (the run starts with a step; its end can be anywhere), when
    the tail starts at its first call, or, after calls of its warm-up, when another anchor periodic from
    its first call tells the steps. Every anchor periodic from its first call is then numbered from step
    0; an anchor with warm-up calls takes the step whose start the start of its periodic tail follows,
    step 0 if none (its calls after its last full period: the last step, not steady). Kept only when
    that cut holds (the check of :func:`cut_steps`, steps ordered in time); else ``cut``, unchanged."""
    q, n = {i: cut.period[i] for i in cut.anchors}, {i: int(cs.seq_len[i]) for i in cut.anchors}
    tail = {i: per[i].tail(q[i]) for i in cut.anchors}
    whole = [i for i in cut.anchors if tail[i] == n[i]]  # periodic from call 0
    part = [i for i in cut.anchors if tail[i] % q[i]]  # a part period at one end of its periodic tail
    if not part or not whole:  # none periodic from its first call: a cut, or a warm-up in place of first calls?
        return cut
    counts = {i: tail[i] // q[i] for i in cut.anchors}
    extra = {i: 1 if tail[i] % q[i] else 0 for i in cut.anchors}
    n_total = max(counts[i] + extra[i] for i in whole)
    starts = np.full(n_total, np.inf)  # start of each step: the first call of a period of these anchors
    for i in whole:
        k = np.arange(counts[i] + extra[i])
        starts[k] = np.minimum(starts[k], cs.ts_s[cs.call_rows[int(cs.seq_call_start[i]) + k * q[i]]])
    head = {i: n[i] - tail[i] for i in whole + part}
    lead = dict.fromkeys(whole, 0)
    for j in cut.anchors:
        if j not in lead:
            counts[j] = counts[j] if j in head else cut.counts[j]
            first = int(cs.seq_call_start[j]) + (head[j] if j in head else n[j] - counts[j] * q[j])
            lead[j] = max(0, int(np.searchsorted(starts, cs.ts_s[cs.call_rows[first]], side="right")) - 1)
    n_total = max(n_total, *(lead[i] + counts[i] + (extra[i] if i in head else 0) for i in cut.anchors))
    shift = {i: n_total - counts[i] - lead[i] for i in cut.anchors}
    try:
        got = cut_steps(cs, q, counts, list(cut.by_time), repeating, warmup_steps, src, shift, head)
    except StepDetectionError:
        return cut
    if not _in_order(cs, got):
        return cut
    if warm := [j for j in part if head[j]]:  # the tail's first call opens a period only if the trace is cut
        j = warm[0]
        raise StepDetectionError(
            src,
            "steps ambiguous",
            f"{cs.name(j)}: {head[j]} warm-up calls, then a periodic tail {tail[j] % q[j]} calls into a period "
            f"of {q[j]}: a trace cut inside its pattern or warm-up calls in place of its first calls",
        )
    return got
