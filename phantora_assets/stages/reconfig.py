"""Stage of group ``links``: NIC-level traffic and the reconfiguration analysis (no Dagster import).

    reconfig_stage -> partitions/<run_id>/{nic_pairs,nic_phases,transition_windows,reconfig_sweep}.parquet
                      run folder plots/{reconfig_windows,reconfig_sweep}.png

Reads ``validated_flows``' ``flows.parquet`` and ``steps.parquet`` and ``step_anatomy``'s table. Every flow
gets its NICs (``lib/net/nics.py``; one NIC a host on TwoLayerMultiPath and FatTree), the per-NIC-pair
table sums the steady steps, and ``lib/net/reconfig.py`` finds the phases, transition windows and the
delay sweep, over the timed steady steps (``steps.timed``: not the last step when the trace's end cuts its
time short). The analysis needs the flows' parallelism ``group`` (``tp``, ``cp``, ``ep``, ``dp``, ``pp``,
``other``): a run whose flows do not carry it writes ``nic_pairs`` only and says so (the materialization's
metadata ``skipped``), with no number guessed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from phantora_assets.lib.net import nics, optical, reconfig, reconfig_sim
from phantora_assets.lib.net.fabric import Fabric, nic_name
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store import database, reconfig_plots
from phantora_assets.lib.store.io import replacing_outputs
from phantora_assets.lib.store.parquet import write_parquet
from phantora_assets.outcomes import StageResult
from phantora_assets.paths import DataPaths
from phantora_assets.stages.links import known_members, run_topology
from phantora_assets.stages.simulation import compute_hosts_of

#: nic_pairs rows: the NIC pair's traffic per steady step.
NIC_PAIR_COLUMNS: dict[str, str] = {
    "run_id": "str",
    "src_node": "int64",
    "src_nic": "int64",
    "dst_node": "int64",
    "dst_nic": "int64",
    "src": "str",  # host-k or host-k/nic-i
    "dst": "str",
    "network": "bool",  # False: inside one scale-up domain (on no link)
    "bytes_per_step": "float64",  # mean over steady steps
    "flows_per_step": "float64",
}
NIC_PAIR_DOCS = {
    "src_nic": "0-based NIC of the sending GPU on its host (lib/net/nics.py rules)",
    "dst_nic": "0-based NIC of the receiving GPU on its host",
    "src": "sending NIC: host-k on a one-NIC-a-host topology, else host-k/nic-i",
    "network": "false inside one scale-up domain: the pair's traffic crosses no link",
    "bytes_per_step": "bytes from src to dst per steady step (mean)",
    "flows_per_step": "flows from src to dst per steady step (mean)",
}
OUTPUTS = ("nic_pairs", "nic_phases", "transition_windows", "reconfig_sweep")
PLOTS = ("reconfig_windows", "reconfig_sweep")


def nic_flows(spec: RunSpec, flows: pd.DataFrame, paths: DataPaths) -> tuple[pd.DataFrame, int]:
    """``flows`` with ``src_nic``, ``dst_nic`` and ``network``, and the NICs per host of the run's topology."""
    topo = run_topology(spec, paths)
    src, dst = flows["src_node"].to_numpy(np.int64), flows["dst_node"].to_numpy(np.int64)
    out = flows.copy()
    if isinstance(topo, Fabric):
        k = topo.nics_per_host
        known = known_members(paths, spec)
        out["src_nic"], out["dst_nic"] = nics.flow_nics(flows, spec.gpus_per_node, k, known, pxn=topo.pxn)
        out["network"] = ~topo.same_domain_hosts(src, dst)
    else:
        k = 1
        out["src_nic"], out["dst_nic"] = np.zeros(len(flows), np.int64), np.zeros(len(flows), np.int64)
        out["network"] = src != dst
    return out, k


def nic_pair_table(flows: pd.DataFrame, steady: set[int], k: int, run_id: str) -> pd.DataFrame:
    """``NIC_PAIR_COLUMNS``: the steady steps' flows per (src NIC, dst NIC), means per step."""
    f = flows[flows["step"].isin(steady)]
    n = max(len(steady), 1)
    keys = ["src_node", "src_nic", "dst_node", "dst_nic", "network"]
    g = f.groupby(keys, sort=True).agg(b=("bytes", "sum"), c=("bytes", "size")).reset_index()
    name = lambda h, i: [nic_name(int(a), int(b), k) for a, b in zip(h, i)]
    return pd.DataFrame(
        {
            "run_id": pd.Series([run_id] * len(g), dtype=object),
            "src_node": g["src_node"].to_numpy(np.int64),
            "src_nic": g["src_nic"].to_numpy(np.int64),
            "dst_node": g["dst_node"].to_numpy(np.int64),
            "dst_nic": g["dst_nic"].to_numpy(np.int64),
            "src": pd.Series(name(g["src_node"], g["src_nic"]), dtype=object),
            "dst": pd.Series(name(g["dst_node"], g["dst_nic"]), dtype=object),
            "network": g["network"].to_numpy(bool),
            "bytes_per_step": g["b"].to_numpy(np.float64) / n,
            "flows_per_step": g["c"].to_numpy(np.float64) / n,
        },
        columns=list(NIC_PAIR_COLUMNS),
    )


def steady_step_times(anatomy: pd.DataFrame, weights: dict[str, int] | None = None) -> pd.DataFrame:
    """Per timed steady step (``step_anatomy``'s ``timed``: not the last step a trace's end cuts short, whose
    time lacks what follows its last flow): ``step``, ``step_time_s`` (the step's ``duration_us`` in s) and
    ``compute_s`` (the mean over the run's hosts of ``step_anatomy``'s ``compute_us``). ``weights`` None: the
    anatomy's hosts are every host, the plain mean; else (a timeline of scope one rank a stage) each reported
    host's compute counts for the hosts that have that very compute (``simulation.json`` ``compute_hosts``),
    ``sum(w c) / sum(w)``: the mean over every host when the weights sum to the run's hosts (the caller checks).

    Raises:
        ValueError: ``anatomy`` has no ``timed`` column (built before it: rebuild ``validated_flows`` and
            ``step_anatomy``), or a reported host has no weight.
    """
    if "timed" not in anatomy.columns:
        raise ValueError(
            "step_anatomy.parquet has no 'timed' column (built before it): rebuild validated_flows and step_anatomy"
        )
    a = anatomy[anatomy["timed"].to_numpy(bool)]
    if weights is not None:
        missing = sorted(set(a["host"]) - set(weights))
        if missing:
            raise ValueError(f"step_anatomy reports hosts simulation.json's compute_hosts does not: {missing[:5]}")
        w = a["host"].map(weights).to_numpy(np.float64)
        a = a.assign(compute_us=a["compute_us"].to_numpy(np.float64) * w, w=w)
        g = a.groupby("step", sort=True).agg(t=("duration_us", "first"), c=("compute_us", "sum"), w=("w", "sum"))
        g = g.reset_index()
        g["c"] = g["c"] / g["w"]
    else:
        g = a.groupby("step", sort=True).agg(t=("duration_us", "first"), c=("compute_us", "mean")).reset_index()
    return pd.DataFrame({"step": g["step"].to_numpy(np.int64), "step_time_s": g["t"] / 1e6, "compute_s": g["c"] / 1e6})


def sweep_rule(spec: RunSpec, weights: dict[str, int] | None) -> str | None:
    """Why the delay sweep cannot be computed for ``spec`` (its utilisation needs the mean compute over every
    host, ``step_anatomy``'s), or None: ``weights`` (``simulation.json`` ``compute_hosts``; None: every host in
    the anatomy) stand for fewer hosts than the run has, so that mean is not known (a raw timeline of scope one
    rank a stage without every host's compute: docs/WORKLOADS.md "Scale"). Never a mean over some hosts."""
    if weights is None:
        return None
    known = sum(weights.values())
    if known == spec.n_nodes:
        return None
    return (
        f"the raw timeline (scope one rank a stage) holds the compute of {known} of the run's {spec.n_nodes} "
        f"hosts (simulation.json compute_hosts: {', '.join(weights) or 'none'}), so the hosts' mean compute the "
        "utilisation needs is not known: no reconfig_sweep (docs/WORKLOADS.md 'Scale')"
    )


def reconfig_stage(spec: RunSpec, paths: DataPaths) -> StageResult:
    """``reconfig``: the per-NIC-pair table, and (flows with ``group``) the phases, transition windows,
    sweep and plots (module docstring).

    Raises:
        ValueError: a flow whose NIC no rule of ``lib/net/nics.py`` determines, or a group outside
            ``reconfig.GROUPS``.
    """
    # each table replaced whole; one this build does not write (no flow groups) removed after it
    # (was: all four unlinked first, so a build killed mid-stage lost them: issue 39 item 13)
    with replacing_outputs(paths.table(spec.run_id, name) for name in OUTPUTS) as written:
        return _reconfig_tables(spec, paths, written)


def _reconfig_tables(spec: RunSpec, paths: DataPaths, written: set[Path]) -> StageResult:
    pdir = paths.partition_dir(spec.run_id)
    cols = ["flow_id", "ts_us", "dur_us", "src_node", "dst_node", "bytes", "step", "op", "comm_id", "comm_rank"]
    have = set(pq.ParquetFile(pdir / "flows.parquet").schema_arrow.names)
    extra = [c for c in ("group", "count", "dtype_bytes") if c in have]  # count x dtype_bytes: a call's size
    flows = pd.read_parquet(pdir / "flows.parquet", columns=cols + ["stream"] + extra)
    steps = pd.read_parquet(pdir / "steps.parquet")
    steady = set(steps.loc[steps["steady"].to_numpy(bool), "step"].astype(int).tolist())
    if "timed" not in steps.columns:
        raise ValueError("steps.parquet has no 'timed' column (built before it): rebuild validated_flows")
    # bytes per step over the steady steps (their calls are complete); times, transitions and the sweep over the
    # timed ones (docs/FABRIC.md: the last step a trace's end cuts short is no step time)
    timed = set(steps.loc[steps["timed"].to_numpy(bool), "step"].astype(int).tolist())
    flows, k = nic_flows(spec, flows, paths)
    pairs = nic_pair_table(flows, steady, k, spec.run_id)
    write_parquet(pairs, paths.table(spec.run_id, "nic_pairs"), columns=NIC_PAIR_COLUMNS)
    written.add(paths.table(spec.run_id, "nic_pairs"))
    meta: dict[str, Any] = {"nics_per_host": k, "nic_pairs": len(pairs), "topology": spec.cluster["topology"]}
    if "group" not in have:
        why = "flows.parquet carries no group column (the parallelism group of each flow): no phases, no sweep"
        return StageResult(paths.table(spec.run_id, "nic_pairs"), {**meta, "skipped": why})
    rc = dict(spec.reconfig)
    # control collectives (calls of <= packet_bytes) on the packet network, as the simulator runs them
    phases = reconfig.nic_phases(flows, k, spec.run_id, int(rc.get("packet_bytes", optical.PACKET_BYTES)))
    trans = reconfig.transition_windows(phases, timed, spec.run_id)
    weights = compute_hosts_of(spec, paths)
    counts = {"phases": len(phases), "transitions": len(trans), "transitions_per_step": len(trans) / max(len(timed), 1)}
    if (no_sweep := sweep_rule(spec, weights)) is not None:  # the phases and windows need no compute; the sweep does
        for name, df, columns in (
            ("nic_phases", phases, reconfig.PHASE_COLUMNS),
            ("transition_windows", trans, reconfig.TRANSITION_COLUMNS),
        ):
            write_parquet(df, paths.table(spec.run_id, name), columns=columns)
            written.add(paths.table(spec.run_id, name))
        reconfig_plots.windows_cdf_plot(trans, spec.run_id, paths.plots_dir(spec) / "reconfig_windows.png")
        (paths.plots_dir(spec) / "reconfig_sweep.png").unlink(missing_ok=True)  # an earlier build's, not this one's
        return StageResult(paths.table(spec.run_id, "transition_windows"), {**meta, **counts, "skipped": no_sweep})
    times = steady_step_times(pd.read_parquet(pdir / "step_anatomy.parquet"), weights)
    if optical.run_config(rc) is None:
        sweep = reconfig.reconfig_sweep(trans, times, spec.run_id)
    else:
        # the formula adds each transition's stall to an unreconfigured run's steps; this run's trace is already
        # the reconfigured network's (its windows and steps hold the delays), so its rows counted every delay
        # twice (a tiny DP x PP job at 10 ms on demand: EPS + 4 D at delay_ms = 10, the run itself EPS + 2 D,
        # and its 0 ms row the 10 ms network's step): none written, the job's EPS run has them
        sweep = pd.DataFrame({c: pd.Series(dtype=t) for c, t in reconfig.SWEEP_COLUMNS.items()})
        meta["formula"] = (
            "skipped: the run's own network is reconfigured (reconfig.mode): the formula adds stalls to an "
            "unreconfigured run's trace; the same entry without reconfig.mode has its rows"
        )
    if rc.get("sweep_delays_ms"):  # the re-timed sweep (lib/net/reconfig_sim.py): opt-in, a simulation a point
        simulated, cost = reconfig_sim.simulated_sweep(
            spec, rc["sweep_delays_ms"], int(rc.get("packet_bytes", optical.PACKET_BYTES))
        )
        sweep = pd.concat([sweep, simulated], ignore_index=True) if len(sweep) else simulated
        meta |= {"simulated_runs": int(cost["simulations"]), "simulated_sweep_wall_s": round(cost["wall_s"], 1)}
    for name, df, columns in (
        ("nic_phases", phases, reconfig.PHASE_COLUMNS),
        ("transition_windows", trans, reconfig.TRANSITION_COLUMNS),
        ("reconfig_sweep", sweep, reconfig.SWEEP_COLUMNS),
    ):
        write_parquet(df, paths.table(spec.run_id, name), columns=columns)
        written.add(paths.table(spec.run_id, name))
    png = {name: paths.plots_dir(spec) / f"{name}.png" for name in PLOTS}
    reconfig_plots.windows_cdf_plot(trans, spec.run_id, png["reconfig_windows"])
    if len(sweep):
        reconfig_plots.sweep_plot(sweep, spec.run_id, png["reconfig_sweep"])
    else:  # a reconfigured run without a simulated sweep: no sweep to draw (nor a stale one of an earlier build)
        png["reconfig_sweep"].unlink(missing_ok=True)
    formula = sweep[sweep["method"] == "formula"]
    at = lambda d, m: float(formula.loc[(formula["delay_ms"] == d) & (formula["mode"] == m), "utilisation"].iloc[0])
    meta |= counts
    if len(formula):
        meta |= {
            "utilisation_0ms": at(0, "on_demand"),
            "utilisation_10ms_on_demand": at(10, "on_demand"),
            "utilisation_10ms_provisioned": at(10, "provisioned"),
        }
    return StageResult(paths.table(spec.run_id, "reconfig_sweep"), meta)


def database_tables() -> list[database.Table]:
    """The ``nic_pairs``, ``transition_windows`` and ``reconfig_sweep`` tables of ``phantora.duckdb`` (a run
    built before the asset existed, or without flow groups, adds no rows)."""
    return [
        database.Table(
            "nic_pairs",
            dict(NIC_PAIR_COLUMNS),
            "nic_pairs.parquet",
            "Traffic per (sending NIC, receiving NIC) per steady step (the reconfig asset): on a multi-NIC "
            "topology every flow leaves the sending GPU's NIC; one NIC a host elsewhere (NIC 0).",
            NIC_PAIR_DOCS,
            optional=True,
        ),
        database.Table(
            "transition_windows",
            dict(reconfig.TRANSITION_COLUMNS),
            "transition_windows.parquet",
            "One row per transition of a NIC between communication phases of two parallelism groups in a "
            "timed steady step, with the idle window before the next phase (lib/net/reconfig.py; docs/FABRIC.md).",
            {
                "step": "the step of the phase the transition leads into",
                "nic": "host-k or host-k/nic-i",
                "from_group": "group of the phase that ends (tp, cp, ep, dp, pp, other)",
                "to_group": "group of the phase that starts",
                "window_s": "time with no flow of any group on the NIC before the next phase starts, s (0: none)",
            },
            optional=True,
        ),
        database.Table(
            "reconfig_sweep",
            dict(reconfig.SWEEP_COLUMNS),
            "reconfig_sweep.parquet",
            "Step time and GPU utilisation when every transition needs an optical reconfiguration of "
            "delay_ms, on demand or provisioned: by the formula over the unreconfigured run, and (runs whose "
            "reconfig.sweep_delays_ms asks) by re-timed simulations on optical rails (docs/FABRIC.md).",
            {
                "method": "formula (stalls added to the unreconfigured run's steps) | simulated (the run re-timed "
                "by the analytic simulator on optical rails: lib/net/reconfig_sim.py)",
                "delay_ms": "reconfiguration delay: 0, 1, 5, 10, 50, 100, 250, 500, 750, 1000 ms",
                "mode": "on_demand (each transition stalls the delay) | provisioned (max(0, delay - window))",
                "step_time_s": "formula: the run's step time (median of the typical timed steady steps) with the "
                "steps' stalls; simulated: the simulated steady iteration (lib/net/reconfig_sim.py)",
                "stall_s": "formula: mean over timed steady steps of the stall of the step's most stalled NIC; "
                "simulated: the step time minus the EPS run's",
                "utilisation": "T_compute / (T_compute + T_non-overlapped comm + T_stall), T_compute the hosts' mean "
                "compute (step_anatomy.compute_us); formula: over the timed steady steps; simulated: of the step",
            },
            optional=True,
        ),
    ]
