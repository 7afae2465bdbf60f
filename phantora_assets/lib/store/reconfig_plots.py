"""PNG plots of the reconfiguration analysis of one run (``lib/net/reconfig.py``; Agg canvas, no pyplot).

    reconfig_windows  the transition-window CDF of every transition pair (dp->pp, pp->dp, ...), log x
    reconfig_sweep    step time and GPU utilisation against the reconfiguration delay, on demand and
                      provisioned

No Dagster import.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from phantora_assets.lib.net.reconfig import window_cdf
from phantora_assets.lib.store.figures import new_figure, save_png

_MODE_STYLE = {"on_demand": ("#d62728", "o"), "provisioned": ("#1f77b4", "s")}
_FLOOR_S = 1e-6  # windows of 0 s are drawn at 1 us on the log axis


def windows_cdf_plot(transitions: pd.DataFrame, run_id: str, path: Path | None = None) -> bytes:
    """Empirical CDF of the transition windows, one line per (from_group -> to_group) pair."""
    fig = new_figure("reconfig_windows")
    ax = fig.add_axes((0.09, 0.12, 0.66, 0.78))
    cdf = window_cdf(transitions)
    for name, (w, p) in cdf.items():
        x = np.maximum(w, _FLOOR_S)
        ax.step(np.r_[x[0], x], np.r_[0.0, p], where="post", lw=1.2, label=f"{name} ({len(w)})")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel(f"transition window (s; 0 drawn at {_FLOOR_S:g} s)")
    ax.set_ylabel("fraction of transitions")
    if cdf:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    else:
        ax.text(0.5, 0.5, "no transition between groups in the steady steps", ha="center", transform=ax.transAxes)
    ax.set_title(f"{run_id}: idle window between phases of different groups, per NIC", fontsize=10)
    return save_png(fig, path)


def sweep_plot(sweep: pd.DataFrame, run_id: str, path: Path | None = None) -> bytes:
    """Step time (top) and utilisation (bottom) against the delay (ms, symlog), both modes; both methods
    when the sweep has ``simulated`` rows (formula solid, simulated dashed)."""
    fig = new_figure("reconfig_sweep")
    top = fig.add_axes((0.09, 0.56, 0.7, 0.36))
    bottom = fig.add_axes((0.09, 0.1, 0.7, 0.36))
    methods = sweep["method"].unique().tolist() if "method" in sweep else ["formula"]
    for method in ("formula", "simulated"):
        if method not in methods:
            continue
        by = sweep[sweep["method"] == method] if "method" in sweep else sweep
        ls = "-" if method == "formula" else "--"
        for mode, (color, marker) in _MODE_STYLE.items():
            s = by[by["mode"] == mode].sort_values("delay_ms")
            d = s["delay_ms"].to_numpy(np.float64)
            label = mode if len(methods) == 1 else f"{mode} ({method})"
            top.plot(d, s["step_time_s"].to_numpy(), color=color, marker=marker, ms=4, lw=1.2, ls=ls, label=label)
            bottom.plot(d, 100 * s["utilisation"].to_numpy(), color=color, marker=marker, ms=4, lw=1.2, ls=ls)
    for ax in (top, bottom):
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlim(0, 1000)
    top.set_ylabel("step time (s)")
    bottom.set_ylabel("GPU utilisation (%)")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("reconfiguration delay (ms)")
    top.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    top.set_title(f"{run_id}: cost of reconfiguring the rails between parallelism groups", fontsize=10)
    return save_png(fig, path)
