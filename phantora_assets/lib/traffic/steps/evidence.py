"""The evidence beyond the communicators' calls (internal to :mod:`~phantora_assets.lib.traffic.steps`;
``rule.py`` orders it): run.log's iteration records select a candidate, the Computation events say why an
outlier step is longer. Times in microseconds; no Dagster import.
"""

from __future__ import annotations

import math
from typing import TypeGuard

import numpy as np
import pandas as pd

from phantora_assets.lib.traffic.steps.cut import Cut, Periodicity
from phantora_assets.lib.traffic.steps.rule import RULE


def _typical(d: np.ndarray) -> np.ndarray:
    """Which of the durations ``d`` (any order, not empty) are typical: those in the window ``[d_k, (1 + 2
    RULE.outlier_rel_tol) d_k]`` holding the most of them (ties: the shortest window, as outliers only
    lengthen steps). Boolean, shape like ``d``."""
    srt = np.sort(d)
    inside = np.searchsorted(srt, srt * (1 + 2 * RULE.outlier_rel_tol), side="right") - np.arange(len(srt))
    lo = float(srt[int(np.argmax(inside))])
    return (d >= lo) & (d <= lo * (1 + 2 * RULE.outlier_rel_tol))


def run_log_decides(iteration_s: list[float] | None) -> TypeGuard[list[float]]:
    """run.log's iterations decide (``run_log_violation`` compares them): 3 or more; fewer tell nothing."""
    return iteration_s is not None and len(iteration_s) >= 3


def typical_step_us(durations: np.ndarray) -> tuple[float, int]:
    """``(step time, number of typical steps)`` of the timed steady steps' ``durations``: the typical ones
    are the most of them within a window of ``2 * RULE.outlier_rel_tol`` above one of them (jitter of up to
    that share either way; ties: the shortest window, as outliers only lengthen steps), the step time their
    median; the others (an eval pass, a checkpoint, a straggler) are outliers, kept as
    steps, not setting it. Typical ones no more than half of them: the median of all (``detect_steps``
    refuses such steps, "steps irregular": no typical step).
    ``(nan, 0)`` when there is none."""
    d = np.sort(np.asarray(durations, dtype=np.float64))
    if not len(d):
        return float("nan"), 0
    typical = d[_typical(d)]
    if 2 * len(typical) <= len(d):  # as many outliers as typical steps: no typical step, the median of all
        return float(np.median(d)), len(typical)
    return float(np.median(typical)), len(typical)


def duration_cycle(durations: np.ndarray) -> str | None:
    """Why the timed steady steps' ``durations`` (us, in step order) alternate short, long, or None: at least
    ``RULE.cycle_min_per_phase`` steps at each parity, every step of the shorter parity shorter than every
    step of the longer, their medians ``RULE.cycle_separation`` spreads (1.4826 x the pooled median absolute
    deviation from each parity's median) and ``RULE.cycle_min_share`` of the median step apart. Such steps are
    either half an iteration (a communicator issuing the same calls twice an iteration: the calls' finest
    partition, which timing may not coarsen) or iterations of which every second is longer (an eval pass): the
    trace cannot tell them apart, and ``detect_steps`` refuses as ambiguous (unless run.log decides). Jitter
    does not alternate; a checkpoint or straggler among the shorter steps breaks the separation (then nothing
    is said: the rule refuses only what it sees)."""
    d = np.asarray(durations, dtype=np.float64)
    if len(d) < 2 * RULE.cycle_min_per_phase:
        return None
    typical = _typical(d)
    parities = []
    for j in (0, 1):
        p, t = d[j::2], typical[j::2]
        parities.append((p[t] if 2 * int(t.sum()) > len(t) else p, j))  # sporadic outliers aside
    (short, _), (long_, _) = sorted(parities, key=lambda pj: float(np.median(pj[0])))
    if min(len(short), len(long_)) < RULE.cycle_min_per_phase or short.max() >= long_.min():
        return None
    m_s, m_l = float(np.median(short)), float(np.median(long_))
    spread = 1.4826 * float(np.median(np.abs(np.concatenate([short - m_s, long_ - m_l]))))
    gap = m_l - m_s
    if gap >= RULE.cycle_separation * spread and gap >= RULE.cycle_min_share * float(np.median(d)):
        return (
            f"the timed steady steps' durations alternate ({m_s:.3f} us and {m_l:.3f} us, medians of every second "
            f"one, spread {spread:.3f} us): an iteration of 2 steps (calls issued twice an iteration) or a longer "
            "iteration every second one; the trace cannot tell them apart"
        )
    return None


def _chi2_sf(x: float, df: int) -> float:
    """``P(X >= x)`` for ``X`` chi-squared with integer ``df >= 1`` degrees of freedom (the regularized upper
    incomplete gamma ``Q(df / 2, x / 2)`` in closed form: a finite sum for even ``df``, ``erfc`` and a finite
    sum for odd ``df``; Abramowitz & Stegun 26.4.4, 26.4.5)."""
    if x <= 0:
        return 1.0
    h = x / 2.0
    if df % 2 == 0:
        return math.exp(-h) * sum(h**i / math.factorial(i) for i in range(df // 2))
    tail = sum(h ** (i + 0.5) / math.gamma(i + 1.5) for i in range((df - 1) // 2))
    return math.erfc(math.sqrt(h)) + math.exp(-h) * tail


def _kruskal_wallis(d: np.ndarray, k: int) -> tuple[float, float]:
    """``(H, p)``: the Kruskal-Wallis statistic of the durations ``d`` (in step order) grouped by step index
    mod ``k``, with its tie correction, and its chi-squared (``k - 1`` degrees of freedom) upper tail."""
    n = len(d)
    srt = np.sort(d)
    ranks = (np.searchsorted(srt, d, side="left") + np.searchsorted(srt, d, side="right") + 1) / 2.0  # mid-ranks
    h = 12.0 / (n * (n + 1)) * sum(float(ranks[j::k].sum()) ** 2 / len(ranks[j::k]) for j in range(k))
    h -= 3.0 * (n + 1)
    _, tie = np.unique(d, return_counts=True)
    corr = 1.0 - float((tie**3 - tie).sum()) / (n**3 - n)
    h = h / corr if corr > 0 else 0.0
    return h, _chi2_sf(h, k - 1)


def duration_period(durations: np.ndarray) -> str | None:
    """Why the timed steady steps' ``durations`` (us, in step order) hold every ``k``-th step of another length
    within the typical steps, or None. For ``k = 2 .. K`` (``K``: at least ``RULE.period_min_per_phase`` steps
    at every phase), the steps are grouped by index mod ``k`` and ranked together: the Kruskal-Wallis
    statistic ``H`` (rank-based: iteration jitter of any shape, independent from one iteration to the next,
    gives every phase the same distribution, ``H`` then chi-squared with ``k - 1`` degrees of freedom) has a
    p-value below ``RULE.period_alpha / (K - 1)`` (Bonferroni over the ``k`` tried: a run whose jitter has no
    period is refused with probability at most ``RULE.period_alpha``; the chi-squared tail is conservative at
    these group sizes). The phases then differ beyond what the jitter explains: every ``k``-th iteration is
    longer (an evaluation pass, a checkpoint) or shorter. That alone is no reason: outliers are kept as steps
    and do not set the step time (``typical_step_us``), and a minority of longer steps among the typical ones
    does not move their median much. It is refused when the median of the typical steps with the steps of the
    phase of the longest median and without them differ by ``RULE.cycle_min_share`` (``duration_cycle``'s
    floor) of the latter or more: then the typical window holds both populations (their overlapping tails under
    jitter) and the step time is neither the regular iteration's nor a step's the evidence states (issue 39
    item 11: an eval pass every 2nd iteration under +-10 % jitter was timed 11,257 us, the regular iteration
    9,681 us). ``duration_cycle`` (every step of one parity shorter than every step of the other) is the
    separated case of ``k = 2``."""
    d = np.asarray(durations, dtype=np.float64)
    k_max = min(len(d) // RULE.period_min_per_phase, RULE.period_max)
    if k_max < 2:
        return None
    typical = _typical(d)
    alpha = RULE.period_alpha / (k_max - 1)
    for k in range(2, k_max + 1):
        h, p = _kruskal_wallis(d, k)
        if p >= alpha:
            continue
        med = [float(np.median(d[j::k])) for j in range(k)]
        others = typical & (np.arange(len(d)) % k != int(np.argmax(med)))
        if not others.any():
            continue
        with_long, without = float(np.median(d[typical])), float(np.median(d[others]))
        if abs(with_long - without) < RULE.cycle_min_share * without:
            continue  # the longest phase's steps are outliers, or too few to move the step time
        return (
            f"every k-th timed steady step differs (k = {k}: an eval pass?): the phases' median durations "
            f"{', '.join(f'{m:.3f}' for m in med)} us (steps at index mod {k}) differ beyond the jitter "
            f"(Kruskal-Wallis H = {h:.2f}, p = {p:.2g} < {alpha:.2g}), and the typical steps' median is "
            f"{with_long:.3f} us with the longest phase's, {without:.3f} us without: the step time would mix "
            "iterations of two lengths; run.log or step markers decide"
        )
    return None


def _timed_median(cut: Cut) -> float:
    """The step time (us) of the timed steady steps of ``cut`` (as ``detect_steps`` times them)."""
    d = cut.steps["duration_us"].to_numpy()
    hi = cut.n_complete if cut.n_complete < cut.n_steps else cut.n_steps - 1
    return typical_step_us(d[cut.first_steady : hi])[0]


def run_log_violation(cut: Cut, iteration_s: list[float], resolution_s: float = 0.0) -> tuple[str, float] | None:
    """Why ``cut`` disagrees with run.log's iterations (``iteration_s``, seconds; the first is warm-up) and
    run.log's median iteration in steps of ``cut`` (the multiple a coarser cut must take), or None: as many
    steps as iterations (up to ``RULE.log_missing_steps`` fewer) and the median step within
    ``RULE.log_rel_tol`` of the median iteration plus ``resolution_s`` (a log that prints two decimals:
    0.01 s). None with fewer than 3 iterations (nothing to tell)."""
    if not run_log_decides(iteration_s):
        return None
    med_us = float(np.median(np.asarray(iteration_s[1:], dtype=float))) * 1e6
    step_us = _timed_median(cut)
    ratio = med_us / step_us if step_us > 0 else float("inf")
    n_log = len(iteration_s)
    close = abs(med_us - step_us) <= RULE.log_rel_tol * med_us + resolution_s * 1e6
    if n_log - RULE.log_missing_steps <= cut.n_steps <= n_log and close:
        return None
    return (
        f"{cut.n_steps} steps of {step_us:.3f} us, but run.log reports {n_log} iterations of {med_us:.3f} us "
        f"({ratio:.2f} steps)",
        ratio,
    )


def outliers(steps: pd.DataFrame, timed: list[int], step_us: float, compute: pd.DataFrame | None) -> np.ndarray:
    """Why each step is an outlier, shape (len(steps),) of str ("" when it is not): a timed steady step
    more than ``RULE.outlier_rel_tol`` longer or shorter than the median ``step_us``. A longer one is
    named by the Computation events when given: more compute than the median step ("extra compute: an
    eval pass?") or not ("idle: a checkpoint or a straggler?")."""
    out = np.full(len(steps), "", dtype=object)
    if not timed or step_us <= 0:
        return out
    start = steps["start_us"].to_numpy(dtype=np.float64)
    dur = steps["duration_us"].to_numpy(dtype=np.float64)
    busy = None
    if compute is not None and len(compute):
        ts = compute["ts_us"].to_numpy(dtype=np.float64)
        k = np.searchsorted(start, ts, side="right") - 1
        ok = (k >= 0) & (ts < start[-1] + np.nan_to_num(dur[-1]))
        n_hosts = max(1, compute["host"].nunique())
        busy = np.bincount(k[ok], weights=compute["dur_us"].to_numpy(dtype=np.float64)[ok], minlength=len(steps))
        busy = busy / n_hosts
    med_busy = float(np.median(busy[timed])) if busy is not None else 0.0
    for k in timed:
        dev = dur[k] / step_us - 1.0
        if abs(dev) <= RULE.outlier_rel_tol:
            continue
        what = f"{dev:+.0%} of the median step"
        if dev > 0 and busy is not None:
            extra = busy[k] - med_busy
            why = (
                "extra compute: an eval pass?"
                if extra >= 0.5 * (dur[k] - step_us)
                else "idle: a checkpoint or a straggler?"
            )
            what = f"{what} ({why})"
        out[k] = what
    return out


def compute_periods(compute: pd.DataFrame | None, min_repeats: int = 2) -> tuple[float, np.ndarray] | None:
    """The period (us) of the run's Computation events and the start times (us, ascending) of the first
    host's full periods, or None when they show none.

    Each host's events, ordered by (ts_us, dur_us), form a sequence of tokens (its duration;
    durations within ``RULE.compute_token_rel_tol`` of each other, chained, are one token); its period is the
    one with the longest periodic tail repeating at least ``min_repeats`` times; its length is the median
    of the typical periods, those within ``RULE.compute_rel_tol`` of the median of all (with 4 periods or
    more the first, warm-up, may be longer and is left out; a longer one, an eval pass or a checkpoint
    stall, is not typical). None when ``compute`` is None or empty, a host read has no period, its typical
    periods are no majority or the first is shorter than them, or the hosts' period lengths differ by more
    than ``RULE.compute_rel_tol``.
    """
    if compute is None or len(compute) == 0:
        return None
    host = compute["host"].astype(str).to_numpy()
    names = sorted(set(host.tolist()))
    picked = sorted({names[0], names[len(names) // 2], names[-1]}, key=names.index)  # first, middle, last host
    found: list[float] = []
    first_starts = np.empty(0)
    for h in picked:
        m = host == h
        ts = compute["ts_us"].to_numpy(dtype=np.float64)[m]
        dur = compute["dur_us"].to_numpy(dtype=np.float64)[m]
        o = np.lexsort((dur, ts))
        ts, dur = ts[o], dur[o]
        tokens = _duration_tokens(dur)
        pz = Periodicity(tokens)
        p = pz.best_period(min_repeats)
        if p is None:
            return None
        n = pz.full_periods(p)
        starts = ts[len(ts) - (np.arange(n, dtype=np.int64) + 1) * p][::-1]
        d = np.diff(starts)
        steady = d[1:] if len(d) >= 3 else d  # the first (warm-up) period may last longer
        if len(d) == 0 or float(d[0]) < (1.0 - RULE.compute_rel_tol) * float(np.median(steady)):
            return None
        med = float(np.median(steady))
        typical = steady[np.abs(steady - med) <= RULE.compute_rel_tol * med]
        if med <= 0 or 2 * len(typical) <= len(steady):
            return None
        found.append(float(np.median(typical)))
        first_starts = starts if len(found) == 1 else first_starts
    lengths = np.array(found)
    if float(lengths.max() - lengths.min()) > RULE.compute_rel_tol * float(lengths.min()):
        return None
    return found[0], first_starts


def _duration_tokens(dur: np.ndarray) -> np.ndarray:
    """One token per duration, shape like ``dur``: sorted durations that are within
    ``RULE.compute_token_rel_tol`` of the previous one share its token."""
    u = np.unique(dur)
    new = np.ones(len(u), dtype=bool)
    new[1:] = u[1:] > u[:-1] * (1.0 + RULE.compute_token_rel_tol) + 1e-6
    return (np.cumsum(new) - 1)[np.searchsorted(u, dur)].astype(np.int64)


def compute_violation(cut: Cut, compute: pd.DataFrame | None) -> str | None:
    """Why the steps of ``cut`` contradict the compute rhythm, or None: they last a whole ``g >= 2`` compute
    periods (within ``RULE.compute_rel_tol``), or most timed steady steps hold the starts of the same ``g >= 2``
    compute periods (a longer eval or checkpoint iteration among them): the step is set by calls in some
    iterations only (an occasional collective) or it is ``g`` iterations; the compute rhythm cannot re-cut it
    (it never coarsens or re-cuts)."""
    got = compute_periods(compute)
    step = _timed_median(cut)
    if got is None or not step > 0:
        return None
    period, starts = got
    ratio = step / period
    g = int(round(ratio))
    if g >= 2 and abs(ratio - g) <= RULE.compute_rel_tol * g:
        return (
            f"the communicators' steps ({cut.n_steps} of {step:.3f} us) last {ratio:.2f} compute periods of "
            f"{period:.3f} us: a step of {g} iterations or a collective in some iterations only"
        )
    lo = cut.first_steady
    hi = cut.n_complete if cut.n_complete < cut.n_steps else cut.n_steps - 1
    s0 = cut.steps["start_us"].to_numpy(dtype=np.float64)[lo:hi]
    s1 = s0 + cut.steps["duration_us"].to_numpy(dtype=np.float64)[lo:hi]
    held = np.searchsorted(starts, s1, side="left") - np.searchsorted(starts, s0, side="left")
    inside = (s0 >= starts[0]) & (s1 <= starts[-1])  # steps the host's periods cover from end to end
    if inside.sum() >= 2:
        g_held = int(np.median(held[inside]))
        if g_held >= 2 and 2 * int((held[inside] == g_held).sum()) > int(inside.sum()):
            return (
                f"the communicators' steps ({cut.n_steps} of {step:.3f} us) each hold {g_held} compute periods of "
                f"{period:.3f} us: a step of {g_held} iterations or a collective in some iterations only"
            )
    return None
