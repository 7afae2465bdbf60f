"""The entry point of step detection (:func:`detect_steps`): evidence -> candidates -> invariants -> decision
(``rule.py`` states the rule; the package docstring the definitions)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from phantora_assets.lib.columns import STEP_COLUMNS, STEP_FLOW_COLUMNS
from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.steps.align import head_aligned, start_aligned
from phantora_assets.lib.traffic.steps.coarse import broken_period, coarse_cut, coarser_cut, overlap_violation
from phantora_assets.lib.traffic.steps.cut import (
    CONCURRENT_SHARE,
    Calls,
    Cut,
    Periodicity,
    call_sequences,
    cut_steps,
    first_alike,
    primary_periods,
    step_error,
    step_table,
)
from phantora_assets.lib.traffic.steps.evidence import (
    compute_violation,
    duration_cycle,
    duration_period,
    outliers,
    run_log_decides,
    run_log_violation,
    typical_step_us,
)
from phantora_assets.lib.traffic.steps.rule import RULE

#: Minimum number of full periods the periodic tail of a sequence must cover.
MIN_REPEATS = RULE.min_repeats

_REQUIRED = (
    "flow_id",
    "ts_us",
    "dur_us",
    "src_node",
    "dst_node",
    "bytes",
    "op",
    "dtype",
    "count",
    "comm_id",
    "comm_rank",
    "root",
)


@dataclass(frozen=True, eq=False)
class StepResult:
    """Outcome of :func:`detect_steps`.

    Attributes:
        flows: the input flows (same rows, order and index; their columns shared with the
            input, not copied) plus an int64 column ``step``:
            the steady step of the flow, -1 for warm-up steps, the warm-up prefix and flows
            of communicators that never repeat.
        steps: one row per step (warm-up steps included), columns ``STEP_COLUMNS``.
        step_time_us: median ``duration_us`` of the timed steps.
        periods: ``comm_id -> period length in calls`` (largest over the communicator's
            ranks; a broadcast root also counts its broadcasts). Communicators that never
            repeat (warm-up only) are absent.
        steady_steps: steady step indices, ascending (the last step included).
        timed_steps: the steady steps whose durations give ``step_time_us``.
        network_bytes_per_step: network bytes of the (lower) median steady step.
        source: file path or run label, used in error messages.
    """

    flows: pd.DataFrame
    steps: pd.DataFrame
    step_time_us: float
    periods: dict[str, int]
    steady_steps: list[int]
    timed_steps: list[int]
    network_bytes_per_step: int
    source: str = "<flows>"
    _period_step: np.ndarray | None = field(default=None, repr=False)  # step of every flow, warm-up included

    def step_flows(self, step: int, network_only: bool = True) -> pd.DataFrame:
        """Flows of one step (any row of ``steps``), columns ``STEP_FLOW_COLUMNS``.

        ``offset_us`` is the flow's start minus the step's ``start_us`` (>= 0). With
        ``network_only`` (default) loopback flows (``src_node == dst_node``) are left out.
        Rows are sorted by (offset_us, src_node, dst_node).

        Raises:
            KeyError: ``step`` is not a step of this run.
        """
        match = self.steps.index[self.steps["step"].to_numpy() == step]
        if len(match) == 0:
            raise KeyError(f"{self.source}: no step {step} (steps 0..{len(self.steps) - 1})")
        start = float(self.steps.loc[match[0], "start_us"])
        mask = self._period_step == step
        f = self.flows.loc[mask]
        if network_only:
            f = f.loc[f["src_node"].to_numpy() != f["dst_node"].to_numpy()]
        out = pd.DataFrame(
            {
                "offset_us": f["ts_us"].to_numpy(dtype="float64") - start,
                "dur_us": f["dur_us"].to_numpy(dtype="float64"),
                "src_node": f["src_node"].to_numpy(dtype="int64"),
                "dst_node": f["dst_node"].to_numpy(dtype="int64"),
                "bytes": f["bytes"].to_numpy(dtype="int64"),
            }
        )
        out = out.sort_values(["offset_us", "src_node", "dst_node"], kind="mergesort")
        return out.reset_index(drop=True).astype(STEP_FLOW_COLUMNS)


@dataclass(eq=False)
class _Evidence:
    """The communicators' evidence: calls (``cs``), each sequence's periodicity (``per``), primitive
    period (``prim``: repeating sequences only) and whether send/recv counts were left out (``tolerant``)."""

    cs: Calls
    per: list[Periodicity]
    prim: dict[int, int]
    repeating: list[int]
    tolerant: bool


def _periods(cs: Calls, min_repeats: int) -> tuple[list[Periodicity], dict[int, int]]:
    """Each sequence's periodicity and primitive period (the longest periodic tail covering ``min_repeats``
    periods; a sequence whose last call comes in the first half of the run's span is start-up: none)."""
    cache: dict[bytes, tuple[Periodicity, int | None]] = {}
    per: list[Periodicity] = []
    prim: dict[int, int] = {}
    t_lo, t_hi = float(cs.ts_s.min()), float(cs.ts_s.max())
    for i in range(len(cs.seq_start)):
        toks = cs.call_tok[cs.seq_call_start[i] : cs.seq_call_start[i] + cs.seq_len[i]]
        key = toks.tobytes()
        if key not in cache:
            pz = Periodicity(toks)
            cache[key] = (pz, pz.best_period(min_repeats))
        pz, p = cache[key]
        per.append(pz)
        if p is not None and float(cs.ts_s[cs.seq_end[i] - 1]) >= t_lo + 0.5 * (t_hi - t_lo):
            prim[i] = p
    return per, prim


def _evidence(flows: pd.DataFrame, min_repeats: int) -> _Evidence:
    """The calls with exact tokens; when a sequence issuing send/recv never repeats, the calls again with
    send/recv counts left out (routing varies them), kept when that leaves fewer sequences that never repeat."""
    cs = call_sequences(flows)
    per, prim = _periods(cs, min_repeats)
    tolerant = False
    if any(cs.seq_p2p[i] and i not in prim for i in range(len(cs.seq_start))):
        cs2 = call_sequences(flows, p2p_counts=False)
        per2, prim2 = _periods(cs2, min_repeats)
        if len(prim2) > len(prim):
            cs, per, prim, tolerant = cs2, per2, prim2, True
    return _Evidence(cs, per, prim, sorted(prim), tolerant)


# ---- candidates: the communicators' cuts, finest first -----------------------------------------


def _primitive(ev: _Evidence, warmup_steps: int, src: str) -> Cut | str:
    """Every sequence at its primitive period (or the one multiple matching the others' step count;
    sequences with several are assigned by time), or the violation."""
    try:
        period, counts, by_time = primary_periods(ev.cs, ev.per, ev.prim, ev.repeating, warmup_steps, src)
        cut = cut_steps(ev.cs, period, counts, by_time, ev.repeating, warmup_steps, src, relaxed=True)
    except StepDetectionError as err:
        if err.rule != "steps disagree":
            raise
        return err.detail
    return overlap_violation(ev.cs, cut, first_alike(ev.cs, cut)[0]) or cut


def _aligned(ev: _Evidence, cut: Cut, warmup_steps: int, src: str) -> Cut:
    """``cut`` aligned to the end of the trace it holds (a trace cut short or inside a pattern: align.py)."""
    c = start_aligned(ev.cs, cut, ev.repeating, warmup_steps, src)
    return head_aligned(ev.cs, c, ev.per, ev.repeating, warmup_steps, src)


# ---- invariants: each returns a violation (rule, detail) or None --------------------------------


def _never_repeats_in_warmup(ev: _Evidence, cut: Cut, min_repeats: int) -> tuple[str, str] | None:
    """A sequence that never repeats calls only before the first steady step."""
    cs, steady_start = ev.cs, cut.starts[cut.first_steady]
    for i in range(len(cs.seq_start)):
        if i in ev.prim:
            continue
        last = float(cs.ts_s[cs.seq_start[i] : cs.seq_end[i]].max())
        if last >= steady_start:
            return (
                "steps never repeat",
                f"{cs.name(i)}: {cs.seq_len[i]} calls, no period repeats {min_repeats} times, and it has calls at "
                f"{last:.3f} us, after the first steady step began ({steady_start:.3f} us)",
            )
    return None


def _p2p_bytes(ev: _Evidence, cut: Cut) -> tuple[str, str] | None:
    """With send/recv counts left out: every steady step's bytes per communicator within
    ``RULE.p2p_bytes_rel_tol`` of the median steady step's."""
    if not ev.tolerant:
        return None
    cs = ev.cs
    nbytes = cs.flow_arrays[4][cs.order]
    steady = (cut.step_sorted >= cut.first_steady) & (cut.step_sorted < cut.n_complete)
    comm = cs.seq_comm[cs.seq_id]
    frame = pd.DataFrame({"comm": comm[steady], "step": cut.step_sorted[steady], "bytes": nbytes[steady]})
    per = frame.groupby(["comm", "step"])["bytes"].sum().unstack(fill_value=0)
    med = per.median(axis=1)
    dev = per.sub(med, axis=0).abs().div(med.where(med > 0, 1), axis=0)
    if (dev.to_numpy() > RULE.p2p_bytes_rel_tol).any():
        c, k = dev.stack().idxmax()
        return (
            "steps disagree",
            f"communicator {c} moves {int(per.loc[c, k])} bytes in step {k}, {float(dev.loc[c, k]):.0%} off the "
            f"median steady step's {int(med[c])} (send/recv compared within {RULE.p2p_bytes_rel_tol:.0%})",
        )
    return None


def _steady_calls(ev: _Evidence, cut: Cut, src: str) -> Cut:
    """``cut`` with the leading steps whose calls differ from the steady steps' made unsteady (warm-up, a
    batch-size ramp-up); the rule itself: every later steady step issues, on every communicator rank, the
    calls most steady steps issue.

    Raises:
        StepDetectionError: ``"steps irregular"``: a steady step after the first one that issues them differs.
    """
    first_steady, why = first_alike(ev.cs, cut)
    if why is not None:
        raise step_error(src, "steps irregular", why)
    if first_steady == cut.first_steady:
        return cut
    steps, starts = step_table(ev.cs, cut.step_sorted, cut.n_steps, first_steady, cut.n_complete)
    return dataclasses.replace(cut, first_steady=first_steady, steps=steps, starts=starts)


def _logged_end(ev: _Evidence, cut: Cut, iteration_s: list[float]) -> Cut:
    """``cut`` with its last step steady when run.log's iterations are its steps (as many: the trace ends with
    the job's last iteration, so a time-assigned sequence's last step, which ``cut_steps`` takes as cut short
    by the trace's end, is whole) and the steps before it leave one steady step (a job of 3 iterations, which
    the rule's two steady steps would refuse). Longer runs keep their last step out, as without run.log (the
    shipped build's numbers: tests/data/golden_manifest.sha256). ``_steady_calls`` still compares its calls."""
    if not (
        cut.by_time
        and cut.n_complete == cut.n_steps - 1
        and cut.n_complete - cut.first_steady < 2
        and cut.n_steps == len(iteration_s)
    ):
        return cut
    steps, starts = step_table(ev.cs, cut.step_sorted, cut.n_steps, cut.first_steady, cut.n_steps)
    return dataclasses.replace(cut, n_complete=cut.n_steps, steps=steps, starts=starts)


def _finer_by_time(ev: _Evidence, cut: Cut, min_repeats: int) -> tuple[str, str] | None:
    """A step of several periods (``coarse.py``) that a finer partition would satisfy too: the reference
    sequence's steady steps cut into ``g`` parts at its own periods (``g`` a prime dividing its periods a
    step), every call placed by time, and every sequence then issues the same calls in every part of the
    steady steps. The rule takes the finest partition: refused as ambiguous rather than coarsened."""
    cs = ev.cs
    counts = {i: ev.per[i].full_periods(ev.prim[i]) for i in ev.repeating}
    r = min(ev.repeating, key=lambda j: counts[j])
    if r not in cut.counts:
        return None
    k = cut.period[r] // ev.prim[r]
    n = cut.n_complete - cut.first_steady
    for g in (d for d in range(2, k + 1) if k % d == 0 and all(d % f for f in range(2, d))):
        first, _ = cs.step_bounds(r, cut.period[r] // g, (cut.counts[r]) * g)
        bounds = np.sort(first)
        bounds -= CONCURRENT_SHARE * float(np.median(np.diff(bounds)))  # calls issued with the first: in its part
        call_ts = cs.ts_s[cs.call_rows]
        part = np.searchsorted(bounds, call_ts, side="right") - 1
        lo = len(bounds) - (cut.n_steps - cut.first_steady) * g
        hi = min(lo + n * g, len(bounds) - 1)  # the last part ends with the trace: not compared
        if lo < 0 or hi - lo < max(min_repeats, 2):
            continue
        seq = cs.seq_id[cs.call_rows]
        m = (part >= lo) & (part < hi) & np.isin(seq, np.asarray(ev.repeating))
        sig = pd.Series(seq[m] * (int(cs.call_tok.max()) + 1) + cs.call_tok[m]).groupby(part[m]).agg(tuple)
        if len(sig) == hi - lo and sig.nunique() == 1:
            return (
                "steps ambiguous",
                f"steps of {cut.period[r]} calls of {cs.name(r)} hold, and so do steps of {cut.period[r] // g} calls "
                "(every communicator issues the same calls in each): the finest partition is not found",
            )
    return None


def _parts_are_iterations(
    part: np.ndarray, seq: np.ndarray, tok: np.ndarray, length: np.ndarray, g: int, n_seq: int
) -> bool:
    """Whether the parts (``part``: each call's, in time order; ``g`` parts a step from part 0; ``length``:
    each part's, us) look like ``g`` iterations and a pass of their own in every step: every communicator
    rank calls in every part; all parts but one issue one signature (the iterations), the other (the one
    with the extra calls) more calls, of the kinds the iterations issue (an eval forward's TP calls, its loss
    all-reduce), and lasts at least as long as they do (its pass adds time, within ``RULE.outlier_rel_tol``);
    every rank's calls common to all the parts are not empty. A rank issuing
    calls of other kinds in each part, or extra calls in a shorter part (one iteration's two phases), fails."""
    n_steps = len(length) // g
    if n_steps < 2 or len(part) == 0:
        return False
    calls: dict[int, dict[int, list[int]]] = {}
    for p, s, t in zip(part.tolist(), seq.tolist(), tok.tolist(), strict=True):
        calls.setdefault(p, {}).setdefault(s, []).append(t)
    tol = RULE.outlier_rel_tol
    for lo in range(0, n_steps * g, g):
        parts = [calls.get(p, {}) for p in range(lo, lo + g)]
        if any(len(c) < n_seq for c in parts):
            return False
        sizes = [sum(len(v) for v in c.values()) for c in parts]
        odd = [j for j in range(g) if sizes[j] > min(sizes)]
        if len(odd) != 1:
            return False
        regular = [tuple(sorted((s, tuple(v)) for s, v in parts[j].items())) for j in range(g) if j != odd[0]]
        reg_len = [float(length[lo + j]) for j in range(g) if j != odd[0]]
        if len(set(regular)) != 1 or float(length[lo + odd[0]]) < (1 - tol) * float(np.median(reg_len)):
            return False
        if max(reg_len) > (1 + 2 * tol) * min(reg_len):
            return False
        for s in parts[0]:
            core = Counter(parts[0][s])
            for c in parts[1:]:
                core &= Counter(c[s])
            if not core:
                return False
            regular_kinds = {t for j in range(g) if j != odd[0] for t in parts[j][s]}
            if not set(parts[odd[0]][s]) <= regular_kinds:  # the pass repeats the iterations' kinds of calls
                return False
    return True


def _repeats_inside(ev: _Evidence, cut: Cut) -> tuple[str, str] | None:
    """A step holding ``g >= 2`` even repetitions of a communicator rank's whole pattern (``StepRule.
    repeat_gap_rel_tol``): ``g`` training iterations with an evaluation pass every ``g``-th (a forward's TP
    all-reduces and a one-element eval-loss all-reduce make the other communicators' period ``g``
    iterations, issue 39 item 11) read as one ``g``-iteration step, or one step of ``g`` micro-batches with
    per-micro-batch reductions; flows alone cannot tell (docs/STEPS.md), only an iteration source can.
    Only an anchor's steady full periods are looked at: the gaps between the repetitions' first calls in
    each step, the step's length (the next step's first call of that rank), and whether every communicator
    rank calls in every repetition's span (an iteration) -- a rank calling twice in an iteration while
    another calls once is one step's two parts (``test_steps_by_time``), not two iterations."""
    cs = ev.cs
    n_steady = cut.n_complete - cut.first_steady
    for r in cut.anchors:
        p, q = cut.period.get(r, 0), ev.prim.get(r, 0)
        if q <= 0 or p < 2 * q or p % q or r not in cut.counts:
            continue
        g = p // q
        n = min(cut.counts[r], n_steady)
        if n < 3:
            continue
        starts = cs.call_starts(r, p, n)[:, ::q]  # (n, g): each repetition's first call, row 0 the last step
        gaps = np.diff(starts, axis=1)
        step = starts[:-1, 0] - starts[1:, 0]  # the steps followed by another (rows 1 .. n - 1)
        med = float(np.median(gaps))
        if med <= 0 or not len(step) or np.any(np.abs(gaps / med - 1) > RULE.repeat_gap_rel_tol):
            continue
        if g * med < RULE.repeat_span_share * float(np.median(step)):
            continue
        # each repetition an iteration (every communicator rank calls in every one) and one a pass longer
        first = np.sort(starts.ravel())  # part k starts at first[k]; parts 0 .. (n - 1) g - 1 have an end
        bounds = first - CONCURRENT_SHARE * med  # calls issued with the first: in its part
        call_ts, seq = cs.ts_s[cs.call_rows], cs.seq_id[cs.call_rows]
        part = np.searchsorted(bounds, call_ts, side="right") - 1
        m = (part >= 0) & (part < len(bounds) - g) & np.isin(seq, np.asarray(ev.repeating))
        length = np.diff(first)[: len(first) - g]
        if not _parts_are_iterations(part[m], seq[m], cs.call_tok[m], length, g, len(ev.repeating)):
            continue
        return (
            "steps ambiguous",
            f"{cs.name(r)} repeats its calls {g} times, evenly every {med:.0f} us, in each step of "
            f"{float(np.median(step)):.0f} us: {g} iterations with a pass of their own every {g}-th (an evaluation) "
            f"or one step of {g} micro-batches; the trace cannot tell without run.log or ProfilerStep markers",
        )
    return None


def _violation(ev: _Evidence, cut: Cut, min_repeats: int) -> tuple[str, str] | None:
    """The first invariant ``cut`` breaks, or None."""
    return _never_repeats_in_warmup(ev, cut, min_repeats) or _p2p_bytes(ev, cut)


def _step_time(durations: np.ndarray, src: str, logged: bool) -> float:
    """The step time (us) of the timed steady steps' ``durations`` (in step order): their typical steps'
    median (``typical_step_us``).

    Raises:
        StepDetectionError: ``"steps irregular"`` when as many are outliers as typical (no step time the
            evidence states), ``"steps ambiguous"`` when the durations alternate (``duration_cycle``) or differ
            every k-th step within the typical ones (``duration_period``) and no
            run.log (``logged``: its iterations, which decide, said whether a step is an iteration).
    """
    step_time, n_typical = typical_step_us(durations)
    if 2 * n_typical <= len(durations):
        raise step_error(
            src,
            "steps irregular",
            f"no typical step: {n_typical} of the {len(durations)} timed steady steps lie within "
            f"{2 * RULE.outlier_rel_tol:.0%} of each other, the others as many outliers; the step time is undecidable",
        )
    if not logged and (cycle := duration_cycle(durations) or duration_period(durations)) is not None:
        raise step_error(src, "steps ambiguous", cycle)
    return step_time


# ---- decision -------------------------------------------------------------------------------------


def _decide(
    ev: _Evidence, warmup_steps: int, min_repeats: int, iteration_s: list[float] | None, res_s: float, src: str
) -> Cut:
    """The finest candidate that holds (the primitive cut, else steps of several periods on every
    communicator); with run.log's iterations, the candidate they select (steps of ``g`` times as many calls
    when the finest lasts ``1/g`` iteration).

    Raises:
        StepDetectionError: no candidate holds (its violation), two incompatible ones do (``steps ambiguous``,
            from ``coarse_cut``), or run.log's iterations agree with none (``steps disagree with run.log``).
    """
    cs = ev.cs
    got = _primitive(ev, warmup_steps, src)
    # the primitive cut fails when the periods disagree, or when its steady steps do not all issue the
    # same calls (a sequence whose pattern repeats within the others' period); then steps of several periods
    cut: Cut | None = None
    if isinstance(got, str):
        failed = ("steps disagree", got)
    else:
        cut = _aligned(ev, got, warmup_steps, src)
        unlike = first_alike(cs, cut)[1]
        failed = ("steps irregular", unlike) if unlike is not None else ("", "")
    if failed[0]:
        coarse = coarse_cut(cs, ev.per, ev.prim, ev.repeating, warmup_steps, min_repeats, src)
        if isinstance(coarse, str):
            raise step_error(
                src, failed[0], f"{failed[1]}; no step of several periods on every communicator fits either ({coarse})"
            )
        cut = _aligned(ev, coarse, warmup_steps, src)
        if not run_log_decides(iteration_s) and (
            finer := _finer_by_time(ev, coarse, min_repeats) or _finer_by_time(ev, cut, min_repeats)
        ):
            raise step_error(src, *finer)
    assert cut is not None
    if iteration_s:
        why = run_log_violation(cut, iteration_s, res_s)
        if why is not None:
            g = int(round(why[1]))
            coarser = (
                coarser_cut(cs, ev.per, ev.prim, ev.repeating, cut, g, warmup_steps, min_repeats, src)
                if g >= 2
                else why[0]
            )
            if isinstance(coarser, str) or run_log_violation(coarser, iteration_s, res_s) is not None:
                reason = coarser if isinstance(coarser, str) else run_log_violation(coarser, iteration_s, res_s)
                detail = f"{why[0]}; steps of {g} times as many calls: {reason}"
                raise step_error(src, "steps disagree with run.log", detail)
            cut = _aligned(ev, coarser, warmup_steps, src)
    if run_log_decides(iteration_s):
        cut = _logged_end(ev, cut, iteration_s)
    cut = _steady_calls(ev, cut, src)
    if (bad := _violation(ev, cut, min_repeats)) is not None:
        raise step_error(src, *bad)
    return cut


def detect_steps(
    flows: pd.DataFrame,
    *,
    warmup_steps: int = RULE.warmup_steps,
    source: str | Path | None = None,
    min_repeats: int = RULE.min_repeats,
    compute: pd.DataFrame | None = None,
    iteration_s: list[float] | None = None,
    iteration_resolution_s: float = 0.0,
) -> StepResult:
    """Cut a run's flows (``FLOW_COLUMNS``, any row order) into steps by the rule of ``rule.py``.

    Args:
        flows: one row per Communication event, loopback included.
        warmup_steps: full leading periods dropped as warm-up, on top of the part before the first full period.
        source: file path or run label named in errors.
        min_repeats: full periods the periodic tail must cover (3).
        compute: the run's Computation events (``host``, ``ts_us``, ``dur_us``), or None: they say why an
            outlier step is longer (extra compute or idle time) and refuse steps of several compute periods;
            they never change the steps.
        iteration_s: run.log's iteration times (seconds, every iteration the job ran), or None: the steps
            must agree with their count and median (``RULE.log_rel_tol``).
        iteration_resolution_s: how finely run.log prints ``iteration_s`` (0.01 s for a log of two
            decimals, 0 for full precision or the simulator's own iteration marks): added to the tolerance.

    Returns:
        StepResult (see the module docstring for the definitions); ``steps.outlier`` names why a steady
        step is more than ``RULE.outlier_rel_tol`` off the median step ("" when it is not).

    Raises:
        StepDetectionError: no flows, a communicator rank whose calls never repeat (``"steps never repeat"``),
            communicators that disagree on the number or the timing of steps (``"steps disagree"``), two
            incompatible steps (``"steps ambiguous"``; also, without run.log, steps each holding ``g`` even
            repetitions of every communicator's calls, one longer with more of them: ``_repeats_inside``),
            a period broken inside the run (``"steps irregular"``), no steady step left (``"no steady step"``),
            steps run.log contradicts (``"steps disagree with run.log"``, also for an iteration time that is not
            finite and > 0) or that last a whole number of compute periods (``"steps disagree with compute"``);
            a flows or compute table without its columns.
    """
    src = "<flows>" if source is None else str(source)
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    missing = [c for c in _REQUIRED if c not in flows.columns]
    if missing:
        raise step_error(src, "flows table lacks columns", ", ".join(missing))
    if compute is not None and (lack := [c for c in ("host", "ts_us", "dur_us") if c not in compute.columns]):
        raise step_error(src, "compute table lacks columns", ", ".join(lack))
    if iteration_s is not None:
        iteration_s = [float(x) for x in iteration_s]
        if bad := [x for x in iteration_s if not (math.isfinite(x) and x > 0)]:
            raise step_error(
                src,
                "steps disagree with run.log",
                f"run.log's iteration times must be finite and > 0 s, got {bad[0]!r} ({len(bad)} such)",
            )
    n_rows = len(flows)
    if n_rows == 0:
        raise step_error(src, "steps never repeat", "no communication flows")
    ev = _evidence(flows, min_repeats)
    cs = ev.cs
    if not ev.repeating:
        i = int(np.argmax(cs.seq_len))
        raise step_error(
            src,
            "steps never repeat",
            f"{cs.name(i)}: {cs.seq_len[i]} calls, no period repeats {min_repeats} times; no communicator repeats",
        )
    if (broken := broken_period(cs, ev.per, ev.prim, min_repeats)) is not None:
        raise step_error(src, "steps irregular", broken)
    cut = _decide(ev, warmup_steps, min_repeats, iteration_s, iteration_resolution_s, src)
    if (slow := compute_violation(cut, compute)) is not None:
        raise step_error(src, "steps disagree with compute", slow)
    if not run_log_decides(iteration_s) and (inside := _repeats_inside(ev, cut)) is not None:
        raise step_error(src, *inside)  # the compute rhythm, when it refuses, names the finer reason first

    # ---- summary -------------------------------------------------------------------
    steps, first_steady, n_complete = cut.steps, cut.first_steady, cut.n_complete
    period_step = np.empty(n_rows, dtype=np.int64)
    period_step[cs.order] = cut.step_sorted
    steady_steps = [int(k) for k in range(first_steady, n_complete)]
    # the step table's rule (cut.step_table): a steady step with a next step is timed; the last step's end is
    # its last flow's, never a step time
    timed = [int(k) for k in steps.loc[steps["timed"].to_numpy(bool), "step"]]
    if not timed:
        raise step_error(
            src, "no steady step", "the only steady step is the last one, which has no next step to end it"
        )
    if len(steady_steps) < 2:  # the rule's "every steady step" needs two to compare
        raise step_error(
            src,
            "no steady step",
            f"one steady step (step {steady_steps[0]}): no second one shows its calls repeat; the steps after it "
            "are cut short or differ",
        )
    step_time = _step_time(steps["duration_us"].to_numpy()[timed], src, run_log_decides(iteration_s))
    net_steady = np.sort(steps["network_bytes"].to_numpy()[steady_steps])
    net_per_step = int(net_steady[(len(net_steady) - 1) // 2])
    periods: dict[str, int] = {}
    for i in ev.repeating:
        periods[str(cs.seq_comm[i])] = max(periods.get(str(cs.seq_comm[i]), 0), int(cut.period[i]))
    steps = steps.assign(outlier=outliers(steps, timed, step_time, compute)).astype(
        {"outlier": STEP_COLUMNS["outlier"]}
    )

    out = flows.copy(deep=False)  # the input's columns, not copied (2.7 M rows at 128x8: ~0.9 GB)
    out["step"] = np.where((period_step >= first_steady) & (period_step < n_complete), period_step, -1).astype(np.int64)
    return StepResult(
        flows=out,
        steps=steps,
        step_time_us=step_time,
        periods=dict(sorted(periods.items())),
        steady_steps=steady_steps,
        timed_steps=timed,
        network_bytes_per_step=net_per_step,
        source=src,
        _period_step=period_step,
    )
