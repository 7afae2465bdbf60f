"""What-if sweeps with the analytic simulator: a grid of layouts x host bandwidths x workloads.

Each grid point is a :class:`~phantora_assets.lib.run.spec.RunSpec` (any layout, any GPU of ``gpus.toml``,
topology overrides of ``presets.toml [cluster]``) simulated directly by
:class:`~phantora_assets.lib.sim.analytic.AnalyticSimulator` -- no Dagster, no trace files -- and
summarised in one row:

=========================  ================================================================
column                     meaning (units)
=========================  ================================================================
workload, gpu, layout      the point; ``layout`` = ``<nodes>x<gpus_per_node>``
n_nodes, gpus_per_node,    placement (ranks host-major)
world_size, parallelism
host_bw_gbps,              host link and spine-uplink port bandwidths (Gbps), rack size,
uplink_bw_gbps, rack_size,  spines and ECMP mode of the simulated TwoLayerMultiPath network
nspines, ecmp
status                     ``ok``, ``out_of_memory`` (estimate > card) or ``invalid: <rule>``
peak_memory_gib            per-GPU peak memory estimate
iteration_time_ms          median of the simulator's steady iterations (all but the first), as its
                           run.log prints them (see below)
compute_ms                 rank 0's compute-stream busy time in a steady step
exposed_comm_ms            iteration time - compute (communication not hidden behind compute)
exposed_comm_fraction      exposed_comm_ms / iteration_time_ms
inter_node_bytes_per_step  network bytes of one steady step (src host != dst host), both directions
perf_db_fraction           share of compute time timed by the GPU's perf DB (rest: roofline)
sim_s                      wall time of the point's simulation
settings                   the workload keys the point sets (``--set parallel.tp=4``), "" for none
=========================  ================================================================

``iteration_time_ms`` is not named a step time on purpose: a run's *step time* (``runs.step_time_s``,
``trace_summary.step_time_us``, ``run_anatomy.step_time_ms``) is the median of the typical timed steady steps
cut from the trace's flows (``lib/traffic/steps``: a step runs from its first flow to the next step's first
flow), which a sweep point, simulated without a trace, does not have; an iteration runs between the
simulator's iteration barriers. Both repeat at the same period, so they differ only by where the cut falls
(measured on ten shipped runs: at most 0.062 %, W4 a100_40g 2x1: 164.756 ms iterations, 164.653 ms steps).

By default the spine-uplink port bandwidth follows the host bandwidth (``uplink_bw_gbps =
host_bw_gbps``), which keeps the published network's shape (rack of 2 hosts, 2 spines:
non-blocking) while the host link changes; pass ``uplink_bw_gbps`` to oversubscribe.

No Dagster import.
"""

from __future__ import annotations

import itertools
import time
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.run.catalog import workload_specs
from phantora_assets.lib.run.spec import RunSpec, validate
from phantora_assets.lib.workload.spec import parse_workload

SWEEP_COLUMNS = [
    "workload",
    "gpu",
    "layout",
    "n_nodes",
    "gpus_per_node",
    "world_size",
    "parallelism",
    "host_bw_gbps",
    "uplink_bw_gbps",
    "rack_size",
    "nspines",
    "ecmp",
    "status",
    "peak_memory_gib",
    "iteration_time_ms",
    "compute_ms",
    "exposed_comm_ms",
    "exposed_comm_fraction",
    "inter_node_bytes_per_step",
    "perf_db_fraction",
    "sim_s",
    "settings",
]


@dataclass(frozen=True)
class SweepPoint:
    workload: str
    gpu: str
    nodes: int
    gpus_per_node: int
    host_bw_gbps: float
    uplink_bw_gbps: float | None = None
    rack_size: int | None = None
    nspines: int | None = None
    ecmp: str | None = None
    settings: tuple[tuple[str, Any], ...] = ()

    def spec(self) -> RunSpec:
        """The point's RunSpec; with ``settings`` (``("parallel.tp", 4), ...``) the workload's table
        with those keys set, validated by the schema (RunMatrixError naming the key and rule)."""
        topo: dict[str, Any] = {
            "host_bw_gbps": self.host_bw_gbps,
            "rack_uplink_port_bw_gbps": self.uplink_bw_gbps or self.host_bw_gbps,
        }
        if self.rack_size:
            topo["rack_size"] = self.rack_size
        if self.nspines:
            topo["nspines"] = self.nspines
        if self.ecmp:
            topo["ecmp"] = self.ecmp
        wl = None
        if self.settings:
            table = workload_specs()[self.workload].table()
            for key, value in self.settings:
                sect, _, k = key.rpartition(".")
                target = table.setdefault(sect, {}) if sect else table
                if not isinstance(target, dict):
                    raise RunMatrixError(f"sweep --set {key}: {sect} is not a table of the workload")
                target[k] = value
            wl = parse_workload(self.workload, table, f"sweep --set {settings_label(self.settings)}")
        topology = tuple(sorted(topo.items()))
        return RunSpec(self.workload, self.gpu, self.nodes, self.gpus_per_node, topology=topology, workload_def=wl)


def settings_label(settings: tuple[tuple[str, Any], ...]) -> str:
    """``parallel.tp=4 train.micro_batch=2`` (the sweep table's ``settings`` column)."""
    return " ".join(f"{k}={v}" for k, v in settings)


def parse_set(text: str) -> tuple[str, list[Any]]:
    """``"parallel.tp=2,4,8"`` -> ("parallel.tp", [2, 4, 8]): each value as a TOML value (integer,
    float, boolean, quoted string), else the bare text as a string (``dp=rest``).

    Raises:
        ValueError: no ``=`` or no value.
    """
    key, sep, values = text.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise ValueError(f"--set {text!r} is not <section>.<key>=<value>[,<value>...] (e.g. parallel.tp=2,4,8)")
    out: list[Any] = []
    for v in values.split(","):
        try:
            out.append(tomllib.loads(f"v = {v.strip()}")["v"])
        except tomllib.TOMLDecodeError:
            out.append(v.strip())
    return key.strip(), out


def parse_layout(text: str) -> tuple[int, int]:
    """``"16x8"`` -> (16, 8)."""
    try:
        n, g = text.lower().split("x")
        return int(n), int(g)
    except ValueError as exc:
        raise ValueError(f"layout {text!r} is not <nodes>x<gpus_per_node>") from exc


def grid(
    layouts: Iterable[str],
    bandwidths: Iterable[float],
    workloads: Iterable[str],
    gpu: str,
    sets: Iterable[tuple[str, list[Any]]] = (),
    **topology: Any,
) -> list[SweepPoint]:
    """Every (workload, layout, bandwidth, schema settings) point, in that nesting order; ``sets``
    (:func:`parse_set`) vary workload keys (their cartesian product)."""
    sets = list(sets)
    combos = [tuple(zip([k for k, _ in sets], vals)) for vals in itertools.product(*[v for _, v in sets])]
    pts = []
    for wl in workloads:
        for lay in layouts:
            n, g = parse_layout(lay)
            for bw in bandwidths:
                for combo in combos:
                    pts.append(SweepPoint(wl, gpu, n, g, float(bw), **topology, settings=combo))
    return pts


def simulate_point(point: SweepPoint) -> dict[str, Any]:
    """One row of the sweep table (see module docstring)."""
    from phantora_assets.lib.sim.analytic import AnalyticSimulator

    try:
        spec = point.spec()
    except RunMatrixError as exc:
        spec, bad = RunSpec(point.workload, point.gpu, point.nodes, point.gpus_per_node), str(exc)
    else:
        bad = ""
    cluster = {**spec.cluster, "host_bw_gbps": point.host_bw_gbps}
    cluster["rack_uplink_port_bw_gbps"] = point.uplink_bw_gbps or point.host_bw_gbps
    row: dict[str, Any] = {
        "workload": spec.workload,
        "settings": settings_label(point.settings),
        "gpu": spec.gpu,
        "layout": spec.layout,
        "n_nodes": spec.n_nodes,
        "gpus_per_node": spec.gpus_per_node,
        "world_size": spec.world_size,
        "parallelism": "",
        "host_bw_gbps": float(cluster["host_bw_gbps"]),
        "uplink_bw_gbps": float(cluster["rack_uplink_port_bw_gbps"]),
        "rack_size": int(cluster["rack_size"]),
        "nspines": int(cluster["nspines"]),
        "ecmp": str(cluster["ecmp"]),
    }
    if bad:
        return {**row, "status": f"invalid: {bad}"}
    try:
        validate(spec, f"sweep point {spec.workload} {spec.gpu} {spec.layout}")
    except RunMatrixError as exc:
        return {**row, "status": f"invalid: {exc}"}
    row["parallelism"] = spec.parallelism
    t0 = time.perf_counter()
    sim = AnalyticSimulator(spec, emit=False)
    res = sim.run()
    row["peak_memory_gib"] = res.memory.as_dict()["peak_gib"]
    if not res.fits:
        return {**row, "status": "out_of_memory", "sim_s": time.perf_counter() - t0}
    step = res.step_ns
    row.update(
        {
            "status": "ok",
            "iteration_time_ms": step / 1e6,
            "compute_ms": res.compute_ns_per_step / 1e6,
            "exposed_comm_ms": res.exposed_comm_ns / 1e6,
            "exposed_comm_fraction": res.exposed_comm_ns / step if step else 0.0,
            "inter_node_bytes_per_step": sim.network_bytes_per_step(),
            "perf_db_fraction": res.db_fraction,
            "sim_s": time.perf_counter() - t0,
        }
    )
    return row


def run_sweep(points: list[SweepPoint], jobs: int = 1) -> pd.DataFrame:
    """Simulate every point (``jobs`` worker processes) and return the table, in point order."""
    if jobs > 1 and len(points) > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(min(jobs, len(points))) as pool:
            rows = pool.map(simulate_point, points, chunksize=1)
            pool.close()
            pool.join()
    else:
        rows = [simulate_point(p) for p in points]
    df = pd.DataFrame(rows, columns=SWEEP_COLUMNS)
    for c in ("n_nodes", "gpus_per_node", "world_size", "rack_size", "nspines"):
        df[c] = df[c].astype("int64")
    df["inter_node_bytes_per_step"] = df["inter_node_bytes_per_step"].astype("Int64")
    return df
