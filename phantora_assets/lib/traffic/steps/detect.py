"""The entry point of step detection (:func:`detect_steps`); the package docstring states the rules."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from phantora_assets.columns import STEP_FLOW_COLUMNS
from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.steps.align import _head_aligned, _start_aligned, split_period
from phantora_assets.lib.traffic.steps.coarse import (
    _coarse_cut,
    _coarser,
    _overlap,
    broken_period,
    offbeat_anchor,
    parts_of_a_step,
    split_with_extras,
    unjustified_multiple,
)
from phantora_assets.lib.traffic.steps.cut import (
    _cut,
    _fail,
    _Periodicity,
    _primary_periods,
    _sequences,
)
from phantora_assets.lib.traffic.steps.verify import (
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


def detect_steps(  # noqa: C901, PLR0912, PLR0915 (the step detector's driver, each refusal named in order)
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
    aligned = lambda c: _head_aligned(
        cs, _start_aligned(cs, c, repeating, warmup_steps, src), per, repeating, warmup_steps, src
    )
    cut = aligned(cut)
    coarser = lambda g: (
        c
        if isinstance(c := _coarser(cs, per, prim, repeating, cut, g, warmup_steps, min_repeats, src), str)
        else aligned(c)
    )
    if (recut := agree_with_compute(cs, cut, rhythm, coarser, warmup_steps, src)) is not cut:
        if (split := split_period(cs, per, prim, recut)) is not None:
            raise _fail(src, "steps disagree with compute", split)
        cut = recut
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
