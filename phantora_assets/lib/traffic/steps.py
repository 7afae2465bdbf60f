"""Step detection: cut a run's flows into training steps without step markers.

docs/DATASET.md, "How a trace becomes the dataset", step 2. Each communicator rank
(``comm_id``, ``comm_rank``) issues a repeating sequence of NCCL calls; its period is one
training step (or a whole fraction of one: "Sub-periods" and "Several repetitions per step
on every communicator" below). Periods are cut aligned to the END of each sequence (the
last step ends with the last call), so a warm-up that differs from the steady steps only
affects the beginning.

Definitions used here (all documented choices):

* **Call**: one row of the flows table, except that the ``n - 1`` flows a broadcast root
  issues at the same ``ts_us`` for one call are merged (the fan-out of a communicator's
  broadcasts is the gcd of its same-``ts`` broadcast group sizes). Calls of one sequence
  are ordered by ``(ts_us, flow_id)``.
* **Call token**: ``(op, count, dtype, root, peer)`` where ``peer`` is the node offset of
  the other end for send/recv (``dst_node - src_node`` for send, ``src_node - dst_node``
  for recv; flows carry no peer rank) and 0 otherwise.
* **Period** of a sequence: among the periods ``p`` whose periodic tail covers at least
  ``min_repeats`` (3) full periods, the one whose periodic tail is the LONGEST; ties go to
  the smallest ``p``. (Taking simply the smallest ``p`` with 3 repetitions would pick
  ``p = 1`` for any step that ends with three identical calls, e.g. three 1-element loss
  all-reduces; the longest tail is the step's primitive period, by Fine and Wilf.)
* **Sub-periods**: a communicator whose step holds its pattern k times (two identical
  gradient buckets) has a primitive period of 1/k step. When exactly one multiple of its
  period brings its number of full periods within ``[C, C + slack]`` (``C`` the smallest
  count over all sequences, ``slack = warmup_steps + 1``) it uses that multiple. When
  several do (e.g. the 16 identical all-to-all sends of a MoE step), the boundary inside
  it is ambiguous: its calls are assigned to steps **by time**, using the step starts of
  the other ("anchor") sequences, and the last step, cut short by the end of the trace,
  is not steady. When none does, :class:`StepDetectionError` ("steps disagree"), unless
  the steps of several periods below hold.
* **Steps**: with ``N`` the largest count, a sequence with ``N_i`` full periods numbers
  them ``N - N_i ... N - 1``; calls before its first full period belong to no step.
  Steps ``0 .. (N - C) + warmup_steps - 1`` are warm-up; the rest are steady (for the
  typical 20-iteration run: 20 steps, step 0 warm-up, steps 1..19 steady, i.e. 19 steady
  steps). The last step is steady but untimed: its end is the end of its last flow, not
  the next step's start, so ``step_time_us`` is the median over the steady steps except
  the last (18 for a 20-iteration run); a run whose only steady step is the last one is
  refused (``"no steady step"``).
* A communicator rank that never repeats is tolerated only if every one of its flows
  starts before the first steady step (e.g. a parameter broadcast on a group used only
  at start-up); its flows get step -1. Otherwise :class:`StepDetectionError` with rule
  ``"steps never repeat"``.
* Every sequence's first call of steady step ``k`` must come before step ``k + 1`` starts,
  else the communicators disagree on the steps (:class:`StepDetectionError` "steps
  disagree", unless the steps of several periods below hold).
* **Several repetitions per step on every communicator**: when every communicator repeats
  its pattern within a step (two equal gradient buckets on the DP group and two equal
  all-reduces on the TP group), no sequence has the step as its primitive period, and the
  cut above is wrong: it fails ("steps disagree"), or its steps overlap in time (a call of
  one step starts after a call of the next step started; any step, warm-up included). The
  calls' times then tell the step. The reference sequence ``R`` (fewest full periods; the
  first in (``comm_id``, ``comm_rank``) order on a tie) is given the period ``k * p_R``
  for ``k = 2, 3, ...``. Every other sequence takes, among the multiples of its period
  whose number of full periods is within ``slack`` of ``R``'s (and at least
  ``min_repeats``), the one nearest ``R``'s count (the smaller multiple on a tie) whose
  steps do not overlap ``R``'s and whose calls sit at the same places among ``R``'s calls
  in each of the last ``min(N_i, N_R) - warmup_steps`` steps (the place of a call: how
  many of the step's calls of ``R`` start before it); if none does, this ``k`` fails. The
  steps are then numbered as above and must pass the rules above, not overlap, include at
  least 2 steady steps, and be indivisible: for every prime ``g`` dividing every
  sequence's multiple (period / primitive period), no steady step splits into ``g`` equal
  parts that would be steps themselves (not overlapping, passing the check above, calls at
  the same places), so one late call does not turn two iterations into one step. The
  smallest ``k`` that holds gives the steps; when a larger ``k`` that is not a multiple of
  it holds too, the data are ambiguous: :class:`StepDetectionError` "steps ambiguous".
  ``k`` is searched up to ``step_coarse.MAX_REPETITIONS`` (64): beyond it the search would be
  quadratic in the trace, so a step of more repetitions is refused with that reason and an
  ambiguous cut beyond it is not looked for. When none holds, a failed cut above raises its
  "steps disagree" error with the reason the first ``k`` failed, and a cut above that overlaps
  is kept. A single communicator, or
  several whose primitive cut passes the check and does not overlap, keep their primitive
  periods, unless the compute rhythm below shows a longer step.
* **A period broken inside the run**: the calls before a sequence's periodic tail holding
  ``min_repeats`` copies of its period's block are steps the period missed (an extra call in some
  steps on that communicator), not warm-up: ``"steps irregular"``, naming the call that breaks it;
  so are anchors that open their steps at wandering places or whose uneven repeats make an evenly
  repeating sequence take several periods a step (``step_coarse.offbeat_anchor``, ``unjustified_multiple``).
* **Start-up repeats**: a sequence whose last call comes in the first half of the run's time
  span (e.g. a start-up barrier issued 4 times) is treated as never repeating (the rule above:
  allowed inside the warm-up only), so it cannot make 1-us steps.
* **A trace cut short** (:func:`~phantora_assets.lib.traffic.step_cut._start_aligned`): an anchor
  sequence with fewer full periods than the most and no call before its first full period (every
  communicator is used in the run's first step) lacks its LAST steps, not its first: it is numbered
  from step 0 and the steps it lacks are not steady (the last steady step is then timed by the
  next step's start). Kept only when that cut passes the time check and its steps are ordered in
  time. Left open: a cut inside one communicator's pattern rotates its periods.
* **Time-assigned calls between the anchors' steps** go to the earlier step, unless the sequence's
  first call precedes the anchors' first step (its calls open a step, as the first step shows; the
  anchors' warm-up calls before their first full period left out): then the calls ending the gap that
  repeat the end of that head (calls of a kind it lacks passed over: a logging call inside it) open the
  later step, the others (an occasional call just before the next step's head) stay in the earlier one.
* **Occasional collectives** (:func:`~phantora_assets.lib.traffic.step_verify.occasional`): the
  sequences with the fewest full periods, when the others alone cut steps (sub-period rule, none by
  time) that last the compute rhythm (the few at any steps), or, without one, are a rhythm in time
  (gaps within 10 % of the median, warm-up left out) with 2+ kinds of call on one of them or 2+ of
  them, and the few repeat every whole ``g >= 2`` of those steps, each a call or a period repeating a
  kind (a logging all-reduce every 5th step): the step is the others', the few are assigned
  by time and occur in some steps only (the blocking ``steps_match`` names them). Without a compute
  rhythm, a period of ``q`` calls that ends with a block of ``b`` calls (``2 <= b <= q/3``, 2 kinds)
  repeated 3+ times (one communicator with an extra call every few steps) is refused:
  ``"steps ambiguous"`` (:func:`~phantora_assets.lib.traffic.step_verify.repeated_block`).
* **Steps in rhythm** (no compute rhythm; :func:`~phantora_assets.lib.traffic.step_verify.steps_in_rhythm`):
  the steady steps must be a rhythm in time (every gap between step starts within 10 % of their
  median). Gaps that repeat exactly every ``g >= 2`` steps (at most 64), the off-median ones taking
  at least a quarter of the cycle (two calls 120 us apart in a 1000 us iteration give steps of 120 and
  880 us), are a step of ``g`` times as many calls, kept when those steps are a rhythm, else
  ``"steps ambiguous"``; other gaps are kept as late steps (a straggler, a checkpoint step, also every
  20th) when at most 15 % of at least 12 are off their median, else refused (``"steps ambiguous"``).
* **Steps of equal parts** (no compute rhythm; ``step_coarse.split_with_extras``, ``parts_of_a_step``):
  an anchor whose step is ``g >= 2`` copies of one block, evenly spaced in time, plus a few other calls
  (a call every 2nd iteration on a communicator that calls every iteration), or a sequence whose step
  is ``g >= 2`` blocks evenly spaced in time (gaps within 10 %, not told apart by gaps cycling every
  ``g``) because another repeats once a step (a rare call on its own communicator), is refused:
  ``"steps ambiguous"``, a step of several iterations or an occasional collective.
* **Compute rhythm** (``compute`` given; :mod:`~phantora_assets.lib.traffic.step_verify`): each
  host's Computation events, as a sequence of durations, have a period (the same longest-tail
  rule); its length in time is the compute rhythm (none when a host's periods, the first (warm-up)
  left out, differ by more than 5 % or hosts disagree). The steady steps must last it (10 %). Steps of a whole
  ``g >= 2`` compute periods (an irregular collective, e.g. a logging all-reduce every 5th
  iteration, made the period 5 iterations) are re-cut at the compute periods, the phase kept
  (every communicators' step start is a step start; each boundary half-way into the shortest quiet
  time before an iteration's first call, so a call between two iterations stays in its own): the
  extra collective then sits in some steady steps only, and the blocking ``steps_match`` check
  names them. Steps of ``1/g`` compute period by their mean (two equal gradient buckets per step read as two
  steps) are replaced by the steps of ``g`` times as many calls of the reference sequence when those
  agree with the rhythm. Any other disagreement, or a re-cut whose steady steps mostly differ, is
  :class:`StepDetectionError` ``"steps disagree with compute"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from phantora_assets.columns import STEP_FLOW_COLUMNS
from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.step_coarse import (
    _coarse_cut,
    _coarser,
    _overlap,
    broken_period,
    offbeat_anchor,
    parts_of_a_step,
    split_with_extras,
    unjustified_multiple,
)
from phantora_assets.lib.traffic.step_cut import _cut, _fail, _Periodicity, _primary_periods, _sequences, _start_aligned
from phantora_assets.lib.traffic.step_verify import (
    agree_with_compute,
    compute_rhythm,
    occasional,
    repeated_block,
    steps_in_rhythm,
)

#: Minimum number of full periods the periodic tail of a sequence must cover.
MIN_REPEATS = 3

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


def detect_steps(
    flows: pd.DataFrame,
    *,
    warmup_steps: int = 1,
    source: str | Path | None = None,
    min_repeats: int = MIN_REPEATS,
    compute: pd.DataFrame | None = None,
) -> StepResult:
    """Cut a run's flows (``FLOW_COLUMNS``, any row order) into steps.

    Args:
        flows: one row per Communication event, loopback included.
        compute: the run's Computation events (``host``, ``ts_us``, ``dur_us``, one row each), or
            None: the steps must then agree with their rhythm (module docstring, "Compute rhythm").
        warmup_steps: full leading periods dropped as warm-up, on top of the part before
            the first full period.
        source: file path or run label named in errors.
        min_repeats: full periods the periodic tail must cover (3).

    Returns:
        StepResult (see the module docstring for the definitions).

    Raises:
        StepDetectionError: no flows, a communicator rank whose calls never repeat (rule ``"steps never
            repeat"``), communicators that disagree on the number or the timing of steps (``"steps disagree"``),
            two incompatible steps or steps of parts nothing tells apart (``"steps ambiguous"``), a period
            broken inside the run (``"steps irregular"``), no steady step left (``"no steady step"``), or
            steps the compute rhythm contradicts (``"steps disagree with compute"``).
    """
    src = "<flows>" if source is None else str(source)
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    missing = [c for c in _REQUIRED if c not in flows.columns]
    if missing:
        raise _fail(src, "flows table lacks columns", ", ".join(missing))
    n_rows = len(flows)
    if n_rows == 0:
        raise _fail(src, "steps never repeat", "no communication flows")

    cs = _sequences(flows)
    n_seq, seq_start, seq_len = len(cs.seq_start), cs.seq_start, cs.seq_len
    seq_comm, seq_rank, order, ts_s = cs.seq_comm, cs.seq_rank, cs.order, cs.ts_s
    call_tok, seq_call_start = cs.call_tok, cs.seq_call_start

    # ---- period of each sequence ---------------------------------------------------
    cache: dict[bytes, tuple[_Periodicity, int | None]] = {}
    per: list[_Periodicity] = []
    best: list[int | None] = []
    for i in range(n_seq):
        toks = call_tok[seq_call_start[i] : seq_call_start[i] + seq_len[i]]
        key = toks.tobytes()
        if key not in cache:
            pz = _Periodicity(toks)
            cache[key] = (pz, pz.best_period(min_repeats))
        pz, p = cache[key]
        per.append(pz)
        best.append(p)

    # a sequence that repeats only in the first half of the run is start-up, not the step
    t_lo, t_hi = float(ts_s.min()), float(ts_s.max())
    for i in range(n_seq):
        if best[i] is not None and float(ts_s[cs.seq_end[i] - 1]) < t_lo + 0.5 * (t_hi - t_lo):
            best[i] = None
    repeating = [i for i in range(n_seq) if best[i] is not None]
    prim = {i: p for i, p in enumerate(best) if p is not None}  # primitive period of each repeating sequence
    if not repeating:
        i = int(np.argmax(seq_len))
        raise _fail(
            src,
            "steps never repeat",
            f"communicator {seq_comm[i]} rank {seq_rank[i]}: {seq_len[i]} calls, "
            f"no period repeats {min_repeats} times; no communicator repeats",
        )

    if (broken := broken_period(cs, per, prim, min_repeats)) is not None:
        raise _fail(src, "steps irregular", broken)

    # ---- steps: by the sub-period rule, else several periods on every sequence -------
    rhythm = compute_rhythm(compute, 2)  # two iterations of compute already tell the step
    try:
        primary = lambda seqs: _primary_periods(cs, per, prim, seqs, warmup_steps, src)
        extra = occasional(cs, per, prim, repeating, primary, warmup_steps, rhythm)
        period, counts, by_time = primary([i for i in repeating if i not in extra])
        by_time += extra
        cut = _cut(cs, period, counts, by_time, repeating, warmup_steps, src)
    except StepDetectionError as err:
        if err.rule != "steps disagree":
            raise
        coarse = _coarse_cut(cs, per, prim, repeating, warmup_steps, min_repeats, src)
        if isinstance(coarse, str):
            raise _fail(
                src, err.rule, f"{err.detail}; no step of several periods on every communicator fits either ({coarse})"
            ) from None
        cut = coarse
    else:
        if _overlap(cs, cut) is not None:
            coarse = _coarse_cut(cs, per, prim, repeating, warmup_steps, min_repeats, src)
            if not isinstance(coarse, str):
                cut = coarse
    cut = _start_aligned(cs, cut, repeating, warmup_steps, src)
    coarser = lambda g: _coarser(cs, per, prim, repeating, cut, g, warmup_steps, min_repeats, src)
    cut = agree_with_compute(cs, cut, rhythm, coarser, warmup_steps, src)
    if rhythm is None:
        cut = steps_in_rhythm(cut, coarser, src)
    block = (repeated_block(cs, per, cut) or split_with_extras(cs, cut)) if rhythm is None else None
    if block is not None:
        raise _fail(src, "steps ambiguous", block)
    if (offbeat := offbeat_anchor(cs, cut) or unjustified_multiple(cs, per, prim, cut)) is not None:
        raise _fail(src, "steps irregular", offbeat)
    if rhythm is None and (block := parts_of_a_step(cs, per, prim, cut)) is not None:
        raise _fail(src, "steps ambiguous", block)
    period, steps, starts = cut.period, cut.steps, cut.starts
    first_steady, n_complete = cut.first_steady, cut.n_complete
    period_step = np.empty(n_rows, dtype=np.int64)
    period_step[order] = cut.step_sorted

    # ---- sequences that never repeat: only allowed inside the warm-up --------------
    steady_start = starts[first_steady]
    for i in range(n_seq):
        if best[i] is not None:
            continue
        rows = slice(seq_start[i], seq_start[i + 1] if i + 1 < n_seq else n_rows)
        last = float(ts_s[rows].max())
        if last >= steady_start:
            raise _fail(
                src,
                "steps never repeat",
                f"communicator {seq_comm[i]} rank {seq_rank[i]}: {seq_len[i]} calls, no "
                f"period repeats {min_repeats} times, and it has calls at {last:.3f} us, "
                f"after the first steady step began ({steady_start:.3f} us)",
            )

    # ---- summary -------------------------------------------------------------------
    steady_steps = [int(k) for k in range(first_steady, n_complete)]
    if n_complete < len(steps):  # the last step is not steady: every steady step ends at the next one's start
        timed = steady_steps
    else:
        timed = steady_steps[:-1]  # the last step's end is its last flow's: never a step time
        if not timed:
            raise _fail(src, "no steady step", "the only steady step is the last one, which has no next step to end it")
    step_time = float(np.median(steps["duration_us"].to_numpy()[timed]))
    net_steady = np.sort(steps["network_bytes"].to_numpy()[steady_steps])
    net_per_step = int(net_steady[(len(net_steady) - 1) // 2])
    periods: dict[str, int] = {}
    for i in repeating:
        periods[str(seq_comm[i])] = max(periods.get(str(seq_comm[i]), 0), int(period[i]))

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
