"""The reconfiguration sweep, re-timed: the run simulated on optical rails at each delay and mode
(``method = "simulated"`` rows of ``reconfig_sweep``; docs/FABRIC.md "The optical rail in the simulator").

Per delay D of the run's ``reconfig.sweep_delays_ms`` and mode (``on_demand``, ``provisioned``), the
analytic simulator runs the job with an optical circuit switch per rail (``lib/net/optical.py``), every
rank (no one-rank-a-stage compression: circuit states need not be alike across a stage), no timeline
emitted. The EPS run (no optical switch) comes first: it is the D = 0 row of both modes (as the study's
0 ms run is its EPS reference) and its ports' sequences of groups are the provisioned runs' schedule.

Columns (``lib/net/reconfig.SWEEP_COLUMNS``, ``method = "simulated"``): ``step_time_s`` the median of the
simulated steady iterations (``SimulationResult.iteration_ns`` after the warm-up: the simulator's step,
as ``sweep.py``'s ``iteration_time_ms``), ``stall_s`` that minus the EPS run's (what the reconfigurations
add on the critical path; the runs share their seeds, so their compute and jitter are equal), and
``utilisation`` rank 0's compute busy time of a steady step over the step time.

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


def _steady(sim_result) -> tuple[float, float]:
    """(step time ns: the median of the steady iterations, compute ns of a steady step on rank 0)."""
    it = sim_result.iteration_ns
    steady = it[1:] if len(it) > 1 else it
    return float(np.median(steady)), float(sim_result.compute_ns_per_step)


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
    eps_sim = AnalyticSimulator(spec, emit=False, optical=OpticalConfig("eps", 0.0, packet_bytes))
    eps = eps_sim.run()
    if not eps.iteration_ns:
        raise ValueError(f"{spec.run_id}: the run does not fit in memory: no simulated sweep")
    schedule = eps_sim.rails.log if eps_sim.rails is not None else {}
    eps_step, compute = _steady(eps)
    rows, n = [], 1
    for d in sorted(int(x) for x in delays_ms):
        for mode in MODES:
            if d == 0:
                step = eps_step
            else:
                sim = AnalyticSimulator(
                    spec,
                    emit=False,
                    optical=OpticalConfig(mode, d * 1e6, packet_bytes),
                    schedule=schedule if mode == "provisioned" else None,
                )
                step, _ = _steady(sim.run())
                n += 1
            rows.append((spec.run_id, d, mode, step / 1e9, (step - eps_step) / 1e9, compute / step if step else 0.0))
    cols = [c for c in SWEEP_COLUMNS if c != "method"]
    out = pd.DataFrame(rows, columns=cols)
    out["method"] = "simulated"
    return out[list(SWEEP_COLUMNS)].astype({"delay_ms": "int64"}), {"simulations": n, "wall_s": time.monotonic() - t0}
