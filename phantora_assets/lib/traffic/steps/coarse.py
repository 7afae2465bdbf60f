"""The fallback of step detection when every communicator repeats its pattern within a step
(internal to :mod:`~phantora_assets.lib.traffic.steps`; its docstring's "Several repetitions per
step on every communicator" is the rule implemented here).

:func:`coarse_cut` tries periods ``k * p_R`` of the reference sequence for ``k = 2, 3, ...``
(:func:`_coarse_try`) and keeps the smallest ``k`` whose steps are ordered in time, place every
call at the same place among the reference's calls and are indivisible. Times in microseconds.

Raises :class:`~phantora_assets.lib.errors.StepDetectionError` ("steps disagree", "steps ambiguous").
"""

from __future__ import annotations

import numpy as np

from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.periodicity import copies_before_tail
from phantora_assets.lib.traffic.steps.cut import CONCURRENT_SHARE, Calls, Cut, Periodicity, cut_steps, step_error
from phantora_assets.lib.traffic.steps.rule import RULE


def _ordered(bounds: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Steps ordered in time. ``bounds``: per sequence, the (first, last) call start of each
    of its steps, counted from the end (index 0 = the last step; a sequence with fewer steps
    lacks the earliest ones). Returns, for each step ``e = 0 .. E - 1`` counted from the end
    (``E + 1`` the most steps of a sequence), True when no call of step ``e + 1`` (the earlier
    one) of any sequence starts after a call of step ``e`` of any sequence. Shape (E,)."""
    n = max(len(f) for f, _ in bounds)
    first = np.full((len(bounds), n), np.inf)
    last = np.full((len(bounds), n), -np.inf)
    for j, (f, lst) in enumerate(bounds):
        first[j, : len(f)] = f
        last[j, : len(lst)] = lst
    return last.max(axis=0)[1:] <= first.min(axis=0)[:-1]


def _places(ref: np.ndarray, other: np.ndarray) -> np.ndarray:
    """Place of every call of ``other`` among the calls of ``ref`` of the same step: the number
    of them that start before it. ``ref`` (n, q_r) and ``other`` (n, q) call starts in us, one
    row per step, each row of ``ref`` ascending. Shape (n, q)."""
    n, q_r = ref.shape
    if n == 0:
        return np.zeros(other.shape, dtype=np.int64)
    lo = min(ref.min(), other.min())
    width = max(ref.max(), other.max()) - lo + 1.0  # rows apart: one search for all
    shift = np.arange(n, dtype=np.float64)[:, None] * width - lo
    pos = np.searchsorted((ref + shift).ravel(), (other + shift).ravel(), side="left")
    return pos.reshape(other.shape) - np.arange(n, dtype=np.int64)[:, None] * q_r


def overlap_violation(cs: Calls, cut: Cut, first: int = 0) -> str | None:
    """Why the anchors' steps of ``cut`` are not ordered in time (:func:`_ordered`, every step from
    ``first`` on and the one before it), None when they are."""
    bad = ~_ordered([cs.step_bounds(i, cut.period[i], cut.counts[i]) for i in cut.anchors])
    bad &= cut.n_steps - 1 - np.arange(len(bad)) >= first  # the later step of each pair
    if bad.any():
        e = int(np.argmax(bad))
        return f"steps {cut.n_steps - 2 - e} and {cut.n_steps - 1 - e} overlap in time"
    return None


def _split_step(cs: Calls, r: int, cut: Cut, g: int) -> int | None:
    """The first steady step of ``cut`` that splits into ``g`` steps of its own: each anchor's
    step cut into ``g`` equal parts that are ordered in time (:func:`_ordered`), pass the
    check of the module docstring (every anchor's first call of a part comes before the next
    part starts) and are alike (every anchor's calls at the same places among the calls of
    ``r`` in each part). None when no steady step does. ``g`` divides every anchor's period."""
    e_n = cut.n_steps - cut.first_steady
    bounds = [cs.step_bounds(i, cut.period[i] // g, e_n * g) for i in cut.anchors]
    first = np.array([f for f, _ in bounds])
    ok = _ordered(bounds) & (first.max(axis=0)[1:] < first.min(axis=0)[:-1])  # part e + 1 vs e
    ok = np.append(ok, False).reshape(e_n, g)[:, : g - 1].all(axis=1)  # inner boundaries
    ref = cs.call_starts(r, cut.period[r] // g, e_n * g)
    for i in cut.anchors:
        if i != r:
            pl = _places(ref, cs.call_starts(i, cut.period[i] // g, e_n * g)).reshape(e_n, g, -1)
            ok &= (pl == pl[:, :1]).all(axis=(1, 2))
    return cut.n_steps - 1 - int(np.argmax(ok)) if ok.any() else None


def _coarse_try(  # noqa: C901, PLR0913 (the step detector's state, passed explicitly)
    cs: Calls,
    per: list[Periodicity],
    best: dict[int, int],
    repeating: list[int],
    same: dict[int, int],
    r: int,
    k: int,
    warmup_steps: int,
    min_repeats: int,
    src: str,
    indivisible: bool = True,
) -> Cut | str:
    """The cut with reference sequence ``r`` at period ``k * best[r]`` (module docstring,
    "Several repetitions per step on every communicator"), or the reason it does not hold.
    ``same[i]``: the first sequence with the calls (tokens and start times) of sequence ``i``.
    ``indivisible=False`` skips the last rule (no steady step splits into steps of its own): the
    compute rhythm showed the steps of ``k`` periods (verify)."""
    slack = warmup_steps + 1
    q_r = k * best[r]
    n_r = per[r].full_periods(q_r)
    if n_r < min_repeats:
        return f"{n_r} steps of {q_r} calls of {cs.name(r)}, fewer than {min_repeats}"
    ref = cs.step_bounds(r, q_r, n_r)
    tol = CONCURRENT_SHARE * float(np.median(-np.diff(ref[0]))) if n_r > 1 else 0.0
    ref_calls = cs.call_starts(r, q_r, n_r)
    period, counts = {r: q_r}, {r: n_r}
    for i in repeating:
        if i == r:
            continue
        if same[i] != i and same[i] in period:  # the same calls: the same choice
            period[i], counts[i] = period[same[i]], counts[same[i]]
            continue
        p, length = best[i], int(cs.seq_len[i])
        tail = per[i].tail(p)
        choice = None
        # counts within slack of n_r: tail(q) // q <= n_r + slack needs q > tail(p) / (n_r + slack + 1)
        q = (tail // (n_r + slack + 1) // p + 1) * p
        while q * max(1, min_repeats, n_r - slack) <= length:
            n = per[i].full_periods(q)
            nearer = choice is None or abs(n - n_r) < abs(choice[1] - n_r)
            if n >= min_repeats and abs(n - n_r) <= slack and nearer:
                m = min(n, n_r) - warmup_steps  # steps that can be steady
                if m >= 2 and _ordered([ref, cs.step_bounds(i, q, n)]).all():
                    pl = _places(ref_calls[:m], cs.call_starts(i, q, m) - tol)  # concurrent calls: no order
                    if (pl == pl[:1]).all():
                        choice = (q, n)
            q += p
        if choice is None:
            return (
                f"no multiple of the {p}-call period of {cs.name(i)} has steps ordered in time "
                f"and placed alike among the {n_r} steps of {q_r} calls of {cs.name(r)}"
            )
        period[i], counts[i] = choice
    try:
        cut = cut_steps(cs, period, counts, [], repeating, warmup_steps, src)
    except StepDetectionError as err:
        return err.detail
    why = overlap_violation(cs, cut)
    if why:
        return why
    if cut.n_steps - cut.first_steady < 2:
        return f"{cut.n_steps - cut.first_steady} steady step"
    if not indivisible:
        return cut
    mult = int(np.gcd.reduce(np.array([period[i] // best[i] for i in cut.anchors], dtype=np.int64)))
    for g in (d for d in range(2, mult + 1) if mult % d == 0 and all(d % f for f in range(2, d))):
        step = _split_step(cs, r, cut, g)
        if step is not None:
            return f"its steady step {step} splits into {g} steps that agree in time"
    return cut


def coarse_cut(
    cs: Calls,
    per: list[Periodicity],
    best: dict[int, int],
    repeating: list[int],
    warmup_steps: int,
    min_repeats: int,
    src: str,
) -> Cut | str:
    """Steps of several primitive periods on every sequence (module docstring, "Several
    repetitions per step on every communicator"): the cut, or why none holds.

    Raises:
        StepDetectionError: ``"steps ambiguous"``: two such cuts hold, neither a grouping of
            the other.
    """
    counts, r, same = _reference(cs, per, best, repeating)
    chosen: tuple[int, Cut] | None = None
    reason = None
    k_max = int(cs.seq_len[r]) // (max(1, min_repeats) * best[r])
    if k_max > MAX_REPETITIONS:
        reason = (
            f"{cs.name(r)} would need up to {k_max} repetitions of its {best[r]}-call period per step; "
            f"steps of more than {MAX_REPETITIONS} are not searched"
        )
    for k in range(2, min(k_max, MAX_REPETITIONS) + 1):
        if chosen is not None and k % chosen[0] == 0:
            continue  # a grouping of the chosen steps
        got = _coarse_try(cs, per, best, repeating, same, r, k, warmup_steps, min_repeats, src)
        if isinstance(got, str):
            reason = reason or f"with {k * best[r]}-call steps of {cs.name(r)}: {got}"
            continue
        if chosen is None:
            chosen = (k, got)
            continue
        k0, c0 = chosen
        raise step_error(
            src,
            "steps ambiguous",
            f"every communicator repeats its pattern several times per step, and both "
            f"{c0.n_steps} steps of {k0 * best[r]} calls and {got.n_steps} steps of "
            f"{k * best[r]} calls of {cs.name(r)} (period {best[r]} calls) hold",
        )
    if chosen is not None:
        return chosen[1]
    return reason or f"{cs.name(r)} repeats {counts[r]} times"


#: The fallback tries steps of 2 .. MAX_REPETITIONS periods of the reference sequence: each try
#: walks every sequence, so an unbounded search is quadratic in the trace (104 s for 512 identical
#: calls per step on every communicator). A step of more repetitions is refused with the reason,
#: and a second, ambiguous cut beyond the bound is not looked for.
MAX_REPETITIONS = RULE.max_repetitions


def _reference(
    cs: Calls, per: list[Periodicity], best: dict[int, int], repeating: list[int]
) -> tuple[dict[int, int], int, dict[int, int]]:
    """``(counts, r, same)``: full primitive periods of every sequence, the reference sequence
    (fewest; the first on a tie) and, per sequence, the first sequence with the same calls."""
    counts = {i: per[i].full_periods(best[i]) for i in repeating}
    r = min(repeating, key=lambda j: counts[j])
    same: dict[int, int] = {}
    first_of: dict[tuple[int, bytes], int] = {}
    for i in repeating:
        calls = cs.call_rows[cs.seq_call_start[i] : cs.seq_call_start[i] + cs.seq_len[i]]
        same[i] = first_of.setdefault((id(per[i]), cs.ts_s[calls].tobytes()), i)
    return counts, r, same


def coarser_cut(  # noqa: PLR0913 (the step detector's state, passed explicitly)
    cs: Calls,
    per: list[Periodicity],
    best: dict[int, int],
    repeating: list[int],
    cut: Cut,
    g: int,
    warmup_steps: int,
    min_repeats: int,
    src: str,
) -> Cut | str:
    """The cut whose steps hold ``g`` steps of ``cut`` on the reference sequence (its period
    ``g * cut.period[r]``), divisible or not, or why it does not hold."""
    _counts, r, same = _reference(cs, per, best, repeating)
    k = g * cut.period.get(r, best[r]) // best[r]
    if k < 1:  # r assigned by time, fewer calls a step than its period
        return f"{cs.name(r)} issues {cut.period[r]} calls a step, fewer than its period of {best[r]}"
    return _coarse_try(cs, per, best, repeating, same, r, k, warmup_steps, min_repeats, src, indivisible=False)


def broken_period(cs: Calls, per: list[Periodicity], prim: dict[int, int], min_repeats: int) -> str | None:
    """A repeating sequence whose calls before its periodic tail hold ``min_repeats`` copies of its
    period's block: a period broken inside the run (a call in some steps only), not warm-up."""
    for i, q in prim.items():
        start, n = int(cs.seq_call_start[i]), int(cs.seq_len[i])
        n_full = per[i].full_periods(q)
        if copies_before_tail(cs.call_tok[start : start + n], q, n_full) >= min_repeats:
            brk = float(cs.ts_s[cs.call_rows[start + n - n_full * q - 1]])
            return (
                f"{cs.name(i)}: its period of {q} calls repeats {n_full} times at the end and at least "
                f"{min_repeats} times before its call at {brk:.3f} us breaks it (a call in some steps only)"
            )
    return None
