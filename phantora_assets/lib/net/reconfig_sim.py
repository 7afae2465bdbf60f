"""The reconfiguration sweep, re-timed: the run simulated on optical rails at each delay and mode
(``method = "simulated"`` rows of ``reconfig_sweep``; docs/FABRIC.md "The optical rail in the simulator").

Per delay D of the run's ``reconfig.sweep_delays_ms`` and mode (``on_demand``, ``provisioned``), the
analytic simulator runs the job with an optical circuit switch per rail (``lib/net/optical.py``), every
rank (no one-rank-a-stage compression: circuit states need not be alike across a stage), no timeline
emitted. The EPS run (no optical switch) comes first: it is the D = 0 row of both modes (as the study's
0 ms run is its EPS reference) and its ports' sequences of groups are the provisioned runs' schedule.

Columns (``lib/net/reconfig.SWEEP_COLUMNS``, ``method = "simulated"``): ``step_time_s`` the simulated
steady iteration (each point is simulated for the warm-up and one steady iteration, the run's
``iterations`` capped at 2: ``SimulationResult.iteration_ns[1]``), ``stall_s`` that minus the EPS run's
(what the reconfigurations add on the critical path, exactly: the runs share their seed, so their compute
and jitter are equal), and ``utilisation`` the hosts' mean compute time of the steady iteration (a
host's: the union of its GPUs' compute intervals, as ``step_anatomy``'s ``compute_us`` the formula rows
use) over the step time.
Why one steady iteration: the simulator replicates the steady iteration for the later ones, every event
time scaled by the iteration's jitter factor (docs/SIMULATOR.md), which would scale the delays too (a
stall of 2 D read 2 D x (1 + f) / 2 with f = f_2 / f_1 = 1 +- 0.1 %: 2.0017 D on a tiny DP x PP job).

Cost: one simulation per (delay > 0, mode) plus the EPS run, each as long as the run's own simulation
without compression (docs/FABRIC.md gives the measured time of the study's example). No Dagster import.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pandas as pd

from phantora_assets.lib.net.optical import MODES, PACKET_BYTES, OpticalConfig
from phantora_assets.lib.net.reconfig import SWEEP_COLUMNS
from phantora_assets.lib.run.spec import RunSpec


def _steady(sim) -> tuple[float, float]:
    """(step time ns: the simulated steady iteration, the mean over hosts of the host's compute time in it, ns)
    of an :class:`AnalyticSimulator` run with ``keep_schedule=True``.

    A host's compute time is the union of its GPUs' compute intervals, as ``step_anatomy``'s ``compute_us``
    (``lib/traffic/anatomy.py``) that the formula rows' utilisation averages over hosts, so both methods'
    utilisation is one quantity (was rank 0's compute: on a PP job stage 0's, 0.37 beside the formula's 0.52).
    """
    assert sim.simulated is not None
    dag, times, _ = sim.simulated
    it = 1 if len(times.durations) > 1 else 0
    kind, who, iter_of = np.asarray(dag.kind), np.asarray(dag.who), np.asarray(dag.iter_of)
    sel = (kind == 0) & (iter_of == it)
    host = who[sel] // sim.spec.gpus_per_node
    start, end = np.asarray(dag.start)[sel], np.asarray(dag.end)[sel]
    busy = 0.0
    for h in np.unique(host):
        s, e = start[host == h], end[host == h]
        order = np.argsort(s, kind="stable")
        s, e = s[order], np.maximum.accumulate(e[order])
        gaps = np.maximum(0.0, s[1:] - e[:-1])  # the union's length: span minus the gaps between the intervals
        busy += float(e[-1] - s[0] - gaps.sum())
    return float(times.durations[it]), busy / sim.spec.n_nodes


def simulated_sweep(
    spec: RunSpec, delays_ms: Sequence[float], packet_bytes: int = PACKET_BYTES
) -> tuple[pd.DataFrame, dict[str, float]]:
    """The ``simulated`` rows (module docstring) for ``delays_ms``, sorted by delay, ``on_demand`` first,
    and what it cost: ``{"simulations": n, "wall_s": s}``.

    Raises:
        ValueError: the run's topology has no rails (``AnalyticSimulator``), or its memory does not fit.
    """
    from phantora_assets.lib.sim.analytic import AnalyticSimulator  # the simulator imports lib/net

    t0 = time.monotonic()
    iterations = min(int(spec.wl.train.iterations), 2)  # the warm-up and the simulated steady iteration
    eps_sim = AnalyticSimulator(
        spec, iterations=iterations, emit=False, optical=OpticalConfig("eps", 0.0, packet_bytes), keep_schedule=True
    )
    eps = eps_sim.run()
    if not eps.iteration_ns or eps_sim.simulated is None:
        raise ValueError(f"{spec.run_id}: the run does not fit in memory: no simulated sweep")
    schedule = eps_sim.rails.log if eps_sim.rails is not None else {}
    eps_step, compute = _steady(eps_sim)
    rows, n = [], 1
    for d in sorted(int(x) for x in delays_ms):
        for mode in MODES:
            if d == 0:
                step = eps_step
            else:
                sim = AnalyticSimulator(
                    spec,
                    iterations=iterations,
                    emit=False,
                    optical=OpticalConfig(mode, d * 1e6, packet_bytes),
                    schedule=schedule if mode == "provisioned" else None,
                    keep_schedule=True,
                )
                sim.run()
                step, _ = _steady(sim)
                n += 1
            rows.append((spec.run_id, d, mode, step / 1e9, (step - eps_step) / 1e9, compute / step if step else 0.0))
    cols = [c for c in SWEEP_COLUMNS if c != "method"]
    out = pd.DataFrame(rows, columns=cols)
    out["method"] = "simulated"
    return out[list(SWEEP_COLUMNS)].astype({"delay_ms": "int64"}), {"simulations": n, "wall_s": time.monotonic() - t0}
