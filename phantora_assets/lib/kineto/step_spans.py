"""Steps from step markers (a profiler's ``ProfilerStep#N`` spans) instead of the communicator rule.

Rules (each a documented choice):

* step ``k`` is ``[start_k, start_{k+1})``; the last one ends at ``last_end_us``. A flow belongs to
  the step whose interval holds its ``ts_us``; a flow before the first start belongs to no step
  (-1), a flow after ``last_end_us`` to the last step (kernels run behind the CPU span that
  issued them);
* the first ``warmup_steps`` (1) steps are warm-up; the rest are steady, and all of them are timed
  (every step has a marked end): **step time** = the median ``duration_us`` of the typical steady steps
  (``lib/traffic/steps/evidence.typical_step_us``, the run's one definition of a step time); a steady step
  more than ``RULE.outlier_rel_tol`` off it is an outlier (an eval pass, a checkpoint, a straggler), kept
  and named in ``steps.outlier`` as the communicator rule names it (``evidence.outliers``; was never
  flagged, so one checkpoint step refused a marked run at ``steady_steps_stable``);
* ``network_bytes_per_step`` = the lower median of the steady steps' network bytes (as
  :func:`~phantora_assets.lib.traffic.steps.detect_steps`); ``periods``: calls per steady step of
  each communicator (the most over its ranks).

The result is a :class:`~phantora_assets.lib.traffic.steps.StepResult`, so the trace rules,
binning and anatomy use it unchanged. No Dagster import.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from phantora_assets.lib.columns import STEP_COLUMNS
from phantora_assets.lib.errors import StepDetectionError
from phantora_assets.lib.traffic.steps import StepResult
from phantora_assets.lib.traffic.steps.evidence import outliers, typical_step_us


def steps_from_spans(
    flows: pd.DataFrame,
    starts_us: Sequence[float],
    last_end_us: float,
    *,
    warmup_steps: int = 1,
    source: str | Path | None = None,
    compute: pd.DataFrame | None = None,
) -> StepResult:
    """Cut ``flows`` (``FLOW_COLUMNS``) at the step starts ``starts_us`` (ascending, us of the trace).
    ``compute`` (``host``, ``ts_us``, ``dur_us``, optional) names why an outlier step is longer.

    Raises:
        StepDetectionError: rule ``no steady step``: fewer than ``warmup_steps + 1`` starts, starts
            not ascending, or ``last_end_us`` not after the last start.
    """
    src = "<flows>" if source is None else str(source)
    starts = np.asarray(starts_us, dtype=np.float64)
    if len(starts) < warmup_steps + 1 or (np.diff(starts) <= 0).any() or last_end_us <= starts[-1]:
        raise StepDetectionError(
            src,
            "no steady step",
            f"{len(starts)} step marker(s) (need {warmup_steps + 1}, ascending, ending after the last)",
        )
    ts = flows["ts_us"].to_numpy(np.float64)
    step = (np.searchsorted(starts, ts, side="right") - 1).astype(np.int64)
    ends = np.append(starts[1:], last_end_us)
    net = flows["src_node"].to_numpy() != flows["dst_node"].to_numpy()
    nbytes = flows["bytes"].to_numpy(np.int64)
    n = len(starts)
    net_bytes = np.bincount(step[(step >= 0) & net], weights=nbytes[(step >= 0) & net], minlength=n)
    n_flows = np.bincount(step[step >= 0], minlength=n)
    steps = pd.DataFrame(
        {
            "step": np.arange(n),
            "start_us": starts,
            "end_us": ends,
            "duration_us": ends - starts,
            "steady": np.arange(n) >= warmup_steps,
            "timed": np.arange(n) >= warmup_steps,  # every step ends at its own marker's end, the last too
            "network_bytes": net_bytes.astype(np.int64),
            "n_flows": n_flows.astype(np.int64),
            "outlier": "",
        }
    ).astype(STEP_COLUMNS)
    steady = [int(k) for k in range(warmup_steps, n)]
    step_us = typical_step_us(steps["duration_us"].to_numpy()[steady])[0]
    steps["outlier"] = outliers(steps, steady, step_us, compute)
    net_steady = np.sort(steps["network_bytes"].to_numpy()[steady])
    out = flows.copy()
    out["step"] = np.where(step >= warmup_steps, step, -1).astype(np.int64)
    periods: dict[str, int] = {}
    f = out[out["step"] >= 0]
    if len(f):
        per = f.groupby(["comm_id", "comm_rank", "step"]).size().groupby(level=[0, 1]).max()
        for (comm, _), v in per.items():
            periods[str(comm)] = max(periods.get(str(comm), 0), int(v))
    return StepResult(
        flows=out,
        steps=steps,
        # the run's one step time (lib/traffic/steps): the median of the typical timed steady steps (was the
        # median of all of them: a checkpoint or eval step among few moved it)
        step_time_us=step_us,
        periods=dict(sorted(periods.items())),
        steady_steps=steady,
        timed_steps=steady,
        network_bytes_per_step=int(net_steady[(len(net_steady) - 1) // 2]),
        source=src,
        _period_step=step,
    )
