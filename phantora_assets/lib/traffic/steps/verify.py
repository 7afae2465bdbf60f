"""Step detection checked against the trace's compute rhythm (internal to
:mod:`~phantora_assets.lib.traffic.steps`, whose docstring, "Compute rhythm", states the rule).

Shapes: ``compute`` is one row per Computation event (``host``, ``ts_us``, ``dur_us``; what
``chrome_trace.read_trace(compute_events=True)`` returns); times in microseconds. No Dagster import.

:func:`compute_rhythm` finds the period of each host's sequence of compute durations (the same
z-function rule as the communicators' periods) and its length in time; :func:`recut_by_compute`
re-cuts the run when the communicators' step is a whole multiple of it (an irregular collective,
e.g. a logging all-reduce every few steps, made the communicators' period several iterations).

Raises :class:`~phantora_assets.lib.errors.StepDetectionError` (rule ``"steps disagree with
compute"``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.steps.cut import _Calls, _Cut, _fail, _Periodicity, _step_table

#: Hosts whose compute sequence is read (first, middle and last by name): enough to agree on one
#: rhythm, and bounded work on a trace of thousands of hosts.
MAX_HOSTS = 3
#: A host's compute periods must last within this share of their median (else no rhythm).
PERIOD_REL_TOL = 0.05
#: Durations within this share of each other (chained) are one token: a kernel's time varies a
#: little from iteration to iteration (0.2 % in the analytic simulator).
TOKEN_REL_TOL = 0.01
#: The communicators' step and the compute rhythm agree within this share.
AGREE_REL_TOL = 0.10
#: Steps that are no rhythm are kept (as late steps) when at most this share is off the median.
LATE_SHARE = 0.15
#: The longest cycle of steps read as one step of several parts (as ``coarse.MAX_REPETITIONS``).
MAX_CYCLE = 64
#: A cycle of steps is one step of several parts when its off-median steps take this share of its time.
PARTS_SHARE = 0.25
#: Late steps are told from a step of several parts only in a run of at least this many timed steady steps.
LATE_MIN_STEPS = 12


@dataclass(frozen=True)
class ComputeRhythm:
    """The compute rhythm of a run.

    Attributes:
        period_us: median time between the starts of consecutive compute periods, us.
        starts_us: start (us) of every full compute period of the first host read, ascending,
            shape (n_periods,).
        events_per_period: compute events per period on that host.
        host: that host.
    """

    period_us: float
    starts_us: np.ndarray
    events_per_period: int
    host: str


def compute_rhythm(compute: pd.DataFrame | None, min_repeats: int = 3) -> ComputeRhythm | None:
    """The rhythm of the run's Computation events, or None when they show none.

    Each host's events, ordered by (ts_us, dur_us), form a sequence of tokens (its duration;
    durations within ``TOKEN_REL_TOL`` of each other, chained, are one token); its period is the
    one with the longest periodic tail repeating at least ``min_repeats`` times. None when
    ``compute`` is None or empty, a host read has no period, its periods' durations differ by
    more than ``PERIOD_REL_TOL`` from their median (with 4 periods or more the first, warm-up, may be
    longer and is left out), or the hosts' period lengths differ by more than ``PERIOD_REL_TOL``.
    """
    if compute is None or len(compute) == 0:
        return None
    host = compute["host"].astype(str).to_numpy()
    names = sorted(set(host.tolist()))
    picked = sorted({names[0], names[len(names) // 2], names[-1]}, key=names.index)[:MAX_HOSTS]
    found: list[ComputeRhythm] = []
    for h in picked:
        m = host == h
        ts = compute["ts_us"].to_numpy(dtype=np.float64)[m]
        dur = compute["dur_us"].to_numpy(dtype=np.float64)[m]
        o = np.lexsort((dur, ts))
        ts, dur = ts[o], dur[o]
        tokens = _duration_tokens(dur)
        pz = _Periodicity(tokens)
        p = pz.best_period(min_repeats)
        if p is None:
            return None
        n = pz.full_periods(p)
        starts = ts[len(ts) - (np.arange(n, dtype=np.int64) + 1) * p][::-1]
        d = np.diff(starts)
        steady = d[1:] if len(d) >= 3 else d  # the first (warm-up) period may last longer
        if len(d) == 0 or float(d[0]) < (1.0 - PERIOD_REL_TOL) * float(np.median(steady)):
            return None
        med = float(np.median(steady))
        if med <= 0 or float(np.abs(steady - med).max()) > PERIOD_REL_TOL * med:
            return None
        found.append(ComputeRhythm(med, starts, int(p), h))
    lengths = np.array([r.period_us for r in found])
    if float(lengths.max() - lengths.min()) > PERIOD_REL_TOL * float(lengths.min()):
        return None
    return found[0]


def _duration_tokens(dur: np.ndarray) -> np.ndarray:
    """One token per duration, shape like ``dur``: sorted durations that are within
    ``TOKEN_REL_TOL`` of the previous one share its token."""
    u = np.unique(dur)
    new = np.ones(len(u), dtype=bool)
    new[1:] = u[1:] > u[:-1] * (1.0 + TOKEN_REL_TOL) + 1e-6
    return (np.cumsum(new) - 1)[np.searchsorted(u, dur)].astype(np.int64)


def multiple_of(step_us: float, rhythm: ComputeRhythm) -> float:
    """``step_us`` in compute periods (1.0: they agree)."""
    return step_us / rhythm.period_us


def agrees(ratio: float) -> bool:
    """The communicators' step and the compute rhythm agree (ratio within ``AGREE_REL_TOL`` of 1)."""
    return abs(ratio - 1.0) <= AGREE_REL_TOL


def whole(ratio: float) -> int | None:
    """``g`` when ``ratio`` is within ``AGREE_REL_TOL`` of a whole ``g >= 2``, else None."""
    g = int(round(ratio))
    return g if g >= 2 and abs(ratio - g) <= AGREE_REL_TOL * g else None


def recut_by_compute(cs: _Calls, cut: _Cut, rhythm: ComputeRhythm, warmup_steps: int, src: str) -> _Cut:
    """The steps of the compute rhythm, when the communicators' steps of ``cut`` last a whole
    number ``g >= 2`` of compute periods.

    Step boundaries are the compute period starts shifted by one phase: the median offset of the
    steps of ``cut`` (from the latest compute period start at or before each), less half the
    shortest quiet time before a step's first call (the steps of ``cut`` and the first call at each
    shifted compute period start, less the offsets' spread), so every step of ``cut`` starts a step
    here too and a call between two iterations stays in its own. Every call goes to the step its
    start falls in (calls before the first boundary: no step). The first ``warmup_steps`` steps
    are warm-up; the rest steady. The new steps must hold the same collectives in most steady
    steps (the irregular ones are then named by the ``steps_match`` check): otherwise the compute
    rhythm is not the step either.

    Raises:
        StepDetectionError: ``"steps disagree with compute"``: a step of the compute rhythm holds
            no call, or the steady steps hold the same calls in fewer than half of them.
    """
    c = rhythm.starts_us
    s = cut.starts[np.isfinite(cut.starts)]
    j = np.searchsorted(c, s, side="right") - 1
    ok = j >= 0
    delta = float(np.median(s[ok] - c[j[ok]])) if ok.any() else 0.0
    # boundaries half-way into the quiet time before each step's first call, not on it: the steps of
    # cut and those inside them (first call at the phase, less the spread of cut's steps around it)
    ts_all = np.sort(cs.ts_s)
    spread = float(np.abs(s[ok] - c[j[ok]] - delta).max()) if ok.any() else 0.0
    at = np.searchsorted(ts_all, c + delta - spread, side="left")
    firsts = np.concatenate([s, ts_all[at[at < len(ts_all)]]])
    before = np.searchsorted(ts_all, firsts, side="left") - 1
    gaps = firsts[before >= 0] - ts_all[before[before >= 0]]
    bounds = c + delta - (0.5 * float(gaps.min()) if len(gaps) else 0.0)
    # the periods before the first full compute period: extend the boundaries backwards
    first_ts = float(cs.ts_s.min())
    n_back = int(np.floor((bounds[0] - first_ts) / rhythm.period_us))
    if n_back > 0:
        bounds = np.concatenate([bounds[0] - rhythm.period_us * np.arange(n_back, 0, -1), bounds])
    bounds = bounds[bounds <= float(cs.ts_s.max())]
    step_sorted = np.searchsorted(bounds, cs.ts_s, side="right") - 1
    n_steps = len(bounds)
    held = np.bincount(step_sorted[step_sorted >= 0], minlength=n_steps)
    why = _why(cut, rhythm)
    if n_steps - warmup_steps < 2 or (held == 0).any():
        empty = np.flatnonzero(held == 0)
        raise _fail(
            src,
            "steps disagree with compute",
            f"{why}, but cut at the compute rhythm, "
            + (f"steps {', '.join(map(str, empty[:5]))} hold no call" if len(empty) else "fewer than 2 steps remain"),
        )
    # every steady step should issue the same calls: compare per-step call signatures
    call_step = step_sorted[cs.call_rows]
    code = cs.seq_id[cs.call_rows] * (int(cs.call_tok.max()) + 1) + cs.call_tok
    sig = pd.DataFrame({"step": call_step, "code": code})
    sig = sig[sig["step"] >= warmup_steps].sort_values(["step", "code"], kind="mergesort")
    per_step = sig.groupby("step")["code"].agg(tuple)
    counts = per_step.value_counts()
    if int(counts.iloc[0]) * 2 <= len(per_step):
        raise _fail(
            src,
            "steps disagree with compute",
            f"{why}, but cut at the compute rhythm only {int(counts.iloc[0])} of {len(per_step)} steady steps "
            "issue the same calls",
        )
    first_steady = warmup_steps
    steps, starts = _step_table(cs, step_sorted, n_steps, first_steady, n_steps)
    call_seq = cs.seq_id[cs.call_rows]
    period = {
        i: int(np.median(np.bincount(call_step[(call_seq == i) & (call_step >= 0)], minlength=n_steps)))
        for i in cut.anchors + cut.by_time
    }
    return _Cut(
        period=period,
        counts={i: n_steps for i in period},
        anchors=list(period),
        by_time=[],
        n_steps=n_steps,
        first_steady=first_steady,
        n_complete=n_steps,
        step_sorted=step_sorted,
        steps=steps,
        starts=starts,
    )


def _step_us(cut: _Cut) -> float:
    """Median time between the starts of the steady steps of ``cut`` (us; 0 with one step)."""
    s = cut.starts[cut.first_steady :]
    d = np.diff(s[np.isfinite(s)])
    return float(np.median(d)) if len(d) else 0.0


def _why(cut: _Cut, rhythm: ComputeRhythm) -> str:
    step = _step_us(cut)
    return (
        f"the communicators' steps ({cut.n_steps} of {step:.3f} us) last {multiple_of(step, rhythm):.2f} "
        f"compute periods of {rhythm.period_us:.3f} us ({rhythm.events_per_period} Computation events on "
        f"{rhythm.host}, {len(rhythm.starts_us)} periods)"
    )


def agree_with_compute(
    cs: _Calls,
    cut: _Cut,
    rhythm: ComputeRhythm | None,
    coarsen: Callable[[int], _Cut | str],
    warmup_steps: int,
    src: str,
) -> _Cut:
    """``cut`` when its steps agree with the compute rhythm (or there is none); the steps of the
    compute rhythm when the communicators' step is a whole multiple of it
    (:func:`recut_by_compute`); ``coarsen(g)`` (the communicators' steps of ``g`` times as many
    calls) when it is a whole fraction ``1/g`` of it and those steps agree.

    Raises:
        StepDetectionError: ``"steps disagree with compute"``, naming both rhythms.
    """
    if rhythm is None:
        return cut
    ratio = multiple_of(_step_us(cut), rhythm)
    if agrees(ratio):
        return cut
    g = whole(ratio)
    if g is not None:
        return recut_by_compute(cs, cut, rhythm, warmup_steps, src)
    s = cut.starts[cut.first_steady :][np.isfinite(cut.starts[cut.first_steady :])]  # parts of a step may be uneven:
    g = whole(rhythm.period_us * (len(s) - 1) / (s[-1] - s[0])) if len(s) > 1 and s[-1] > s[0] else None  # mean step
    if g is not None:
        got = coarsen(g)
        if not isinstance(got, str) and agrees(multiple_of(_step_us(got), rhythm)):
            return got
        reason = got if isinstance(got, str) else _why(got, rhythm)
        raise _fail(
            src, "steps disagree with compute", f"{_why(cut, rhythm)}; steps of {g} times as many calls: {reason}"
        )
    raise _fail(src, "steps disagree with compute", f"{_why(cut, rhythm)}, not a whole multiple or fraction")


def _regular_step_us(cs: _Calls, i: int, q: int, n: int, skip: int) -> float | None:
    """Median time (us) between the starts of the last ``n`` periods of ``q`` calls of sequence ``i``
    when they are a rhythm (every gap after the first ``skip`` within ``AGREE_REL_TOL`` of it), else None."""
    d = np.diff(cs.step_bounds(i, q, n)[0][::-1])[skip:]
    if len(d) < 2:
        return None
    return float(np.median(d)) if _is_rhythm(d) else None


def occasional(
    cs: _Calls,
    per: list[_Periodicity],
    best: dict[int, int],
    repeating: list[int],
    primary: Callable[[list[int]], tuple[dict[int, int], dict[int, int], list[int]]],
    warmup_steps: int,
    rhythm: ComputeRhythm | None = None,
) -> list[int]:
    """The sequences that repeat only every ``g >= 2`` steps of the others (steps module docstring,
    "Occasional collectives"), or ``[]``: those with the fewest full periods (within ``warmup_steps +
    1``), when the others alone cut steps by ``primary`` (the sub-period rule; none assigned by time)
    and either those steps last the compute ``rhythm`` (the few then may come at any steps), or, with
    no rhythm, they are a rhythm in time (:func:`_regular_step_us`) with a pattern of at least 2 kinds
    of call on one of them or at least 2 of them, each of the few repeats every whole ``g >= 2`` of
    those steps and repeats a kind of call in its period unless it has one call (a period of several
    calls, each of its own kind, is a step's pattern as much as an occasional collective)."""
    slack = warmup_steps + 1
    counts = {i: per[i].full_periods(best[i]) for i in repeating}
    c_ref = min(counts.values())
    few = [i for i in repeating if counts[i] <= c_ref + slack]
    rest = [i for i in repeating if i not in few]
    if not rest:
        return []
    try:
        period, n, by_time = primary(rest)
    except StepDetectionError:
        return []
    if by_time:
        return []
    g0 = cs.seq_call_start
    if rhythm is not None:
        gaps = [np.diff(cs.step_bounds(i, period[i], n[i])[0][::-1])[slack:] for i in rest]
        gaps = [g for g in gaps if len(g)]
        return few if gaps and agrees(float(np.median(np.concatenate(gaps))) / rhythm.period_us) else []
    kinds = [len(set(cs.call_tok[g0[i] + cs.seq_len[i] - period[i] : g0[i] + cs.seq_len[i]].tolist())) for i in rest]
    steps_us = [_regular_step_us(cs, i, period[i], n[i], slack) for i in rest]
    if (max(kinds) < 2 and len(rest) < 2) or any(s is None for s in steps_us):
        return []
    step_us = float(np.median([s for s in steps_us if s is not None]))
    for i in few:
        toks = cs.call_tok[g0[i] + cs.seq_len[i] - best[i] : g0[i] + cs.seq_len[i]]
        if best[i] > 1 and len(set(toks.tolist())) == best[i]:  # calls of as many kinds: a step's pattern
            return []
        # its first period may hold the warm-up: left out when 2 gaps remain (3 calls: both kept)
        every = _regular_step_us(cs, i, best[i], counts[i], 1 if counts[i] > 3 else 0)
        if every is None or whole(every / step_us) is None:
            return []
    return few


def repeated_block(cs: _Calls, per: list[_Periodicity], cut: _Cut) -> str | None:
    """Why the steps of ``cut`` may be several iterations, or None: an anchor sequence whose period of
    ``q`` calls ends with a block of ``b`` calls (2 <= b <= q / 3, at least 2 kinds of call) repeated 3
    times or more, the sequence not ``b``-periodic as a whole (steps module docstring, "Occasional
    collectives": a logging all-reduce every 5th iteration makes a 5-iteration period)."""
    for i in cut.anchors:
        q, pz = cut.period[i], per[i]
        end = int(cs.seq_call_start[i] + cs.seq_len[i])
        for b in range(2, q // 3 + 1):
            run = pz.tail(b)
            if run >= 3 * b and run < pz.tail(q) and len(set(cs.call_tok[end - b : end].tolist())) >= 2:
                return (
                    f"{cs.name(i)} repeats a period of {q} calls whose last {run} calls repeat a block of {b} "
                    f"calls {run // b} times: steps of {q} calls, or of {b} calls with extra calls in some "
                    "of them (an occasional collective); the trace has no compute rhythm to tell"
                )
    return None


def _is_rhythm(d: np.ndarray) -> bool:
    """Every value of ``d`` (us) within ``AGREE_REL_TOL`` of their median (a positive one)."""
    med = float(np.median(d))
    return med > 0 and float(np.abs(d - med).max()) <= AGREE_REL_TOL * med


def steps_in_rhythm(cut: _Cut, coarsen: Callable[[int], _Cut | str], src: str) -> _Cut:
    """``cut`` when its steady steps are a rhythm in time (steps module docstring, "Steps in
    rhythm"; for traces with no compute rhythm). Else, when the steady steps' durations are a cycle of
    ``g`` (``2 <= g <= MAX_CYCLE``, at least 2 cycles: each step within ``AGREE_REL_TOL`` of the step
    ``g`` later, or of the median step when shorter (a call's jitter), the same steps off the median in
    every cycle, the sums of ``g`` steps a rhythm) whose off-median steps take at least ``PARTS_SHARE``
    of the cycle's time (the parts of a step bunched before one long gap), the steps of ``g`` times as
    many calls (``coarsen(g)``) when those are a rhythm; else ``cut`` when at most ``LATE_SHARE`` of at
    least ``LATE_MIN_STEPS`` steps are off their median (late steps: a straggler, a checkpoint, a
    periodic one too). Work: O(MAX_CYCLE * steps).

    Raises:
        StepDetectionError: ``"steps ambiguous"``: a cycle whose coarser steps fail, or steps that
            are no rhythm, no such cycle, and more than ``LATE_SHARE`` of them off their median (or fewer
            than ``LATE_MIN_STEPS``).
    """
    s = cut.starts[cut.first_steady :]
    d = np.diff(s[np.isfinite(s)])
    if len(d) < 2 or _is_rhythm(d):
        return cut
    med = float(np.median(d))
    off = np.abs(d - med) > AGREE_REL_TOL * med
    seen = f"the steady steps last {', '.join(f'{x:.3f}' for x in d[:6])}{' ...' if len(d) > 6 else ''} us"
    acc, tol = np.concatenate([[0.0], np.cumsum(d)]), AGREE_REL_TOL * np.maximum(d, med)  # short gaps: of the median
    for g in range(2, min(len(d) // 2, MAX_CYCLE) + 1):
        if (off[g:] != off[:-g]).any() or (np.abs(d[g:] - d[:-g]) > np.maximum(tol[g:], tol[:-g])).any():
            continue
        if not _is_rhythm(acc[g:] - acc[:-g]) or float(d[off].sum()) < PARTS_SHARE * float(d.sum()):
            continue
        got = coarsen(g)
        if not isinstance(got, str):
            t = got.starts[got.first_steady :]
            gaps = np.diff(t[np.isfinite(t)])
            if len(gaps) >= 1 and _is_rhythm(gaps):
                return got
            got = "those steps are no rhythm either"
        raise _fail(src, "steps ambiguous", f"{seen}, a cycle of {g} steps; steps of {g} times as many calls: {got}")
    if int(off.sum()) <= LATE_SHARE * len(d) and len(d) >= LATE_MIN_STEPS:
        return cut
    raise _fail(
        src,
        "steps ambiguous",
        f"{seen}: no rhythm, {int(off.sum())} of {len(d)} off their median (late steps are kept when at most "
        f"{LATE_SHARE:.0%} in at least {LATE_MIN_STEPS}), and no cycle of steps to tell a step of several parts",
    )
