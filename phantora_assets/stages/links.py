"""Stage of group ``links``: per-link traffic (no Dagster import).

    link_bins_stage -> partitions/<run_id>/link_bins.parquet

Reads ``validated_flows``' tables (``flows.parquet``, ``steps.parquet``, ``trace_summary.json``) and places
the chosen steady step's flows over the window as ``binned_flows`` does (``lib/net/link_bins.py``), on the
paths the run's network gives them (``lib/net/routes.py``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from phantora_assets.checks import reset_checks
from phantora_assets.columns import STEP_FLOW_COLUMNS
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.net import link_bins, routes
from phantora_assets.lib.phantora.netconfig import netconfig_for
from phantora_assets.lib.sim.network import Topology
from phantora_assets.lib.store import database
from phantora_assets.lib.traffic.binning import exact_sum
from phantora_assets.matrix import RunSpec
from phantora_assets.paths import DataPaths
from phantora_assets.stages.common import WINDOW_S, Outcome, StageResult, record, write_parquet
from phantora_assets.stages.flows import read_trace_summary

CHECK = "link_bins_conserve_bytes"


def run_topology(spec: RunSpec) -> Topology:
    """The run's network: its netconfig (``lib/phantora/netconfig.netconfig_for``) with its ``ecmp``, as the
    analytic simulator builds it (``lib/sim/analytic.py``)."""
    return Topology.from_netconfig(netconfig_for(spec), ecmp=str(spec.cluster.get("ecmp", "hash")))


def chosen_step_flows(paths: DataPaths, run_id: str) -> pd.DataFrame:
    """The chosen steady step's network flows with their connection columns: ``STEP_FLOW_COLUMNS`` plus
    ``comm_id`` and ``stream``, from ``flows.parquet`` (the rows ``step_flows.parquet`` was made from).

    Raises:
        TraceFormatError: they disagree with ``step_flows.parquet`` (rows or bytes), naming both files.
    """
    pdir = paths.partition_dir(run_id)
    chosen = int(read_trace_summary(paths, run_id).chosen_step)
    steps = pd.read_parquet(pdir / "steps.parquet")
    start = float(steps.loc[steps["step"] == chosen, "start_us"].iloc[0])
    f = pd.read_parquet(
        pdir / "flows.parquet",
        columns=["ts_us", "dur_us", "src_node", "dst_node", "bytes", "step", "comm_id", "stream"],
    )
    f = f[(f["step"].to_numpy() == chosen) & (f["src_node"].to_numpy() != f["dst_node"].to_numpy())]
    out = pd.DataFrame(
        {
            "offset_us": f["ts_us"].to_numpy(np.float64) - start,
            "dur_us": f["dur_us"].to_numpy(np.float64),
            "src_node": f["src_node"].to_numpy(np.int64),
            "dst_node": f["dst_node"].to_numpy(np.int64),
            "bytes": f["bytes"].to_numpy(np.int64),
            "comm_id": f["comm_id"].astype(str).to_numpy(),
            "stream": f["stream"].to_numpy(np.int64),
        }
    )
    ref = pd.read_parquet(pdir / "step_flows.parquet", columns=list(STEP_FLOW_COLUMNS))
    if len(ref) != len(out) or exact_sum(ref["bytes"].to_numpy(np.int64)) != exact_sum(out["bytes"].to_numpy(np.int64)):
        raise TraceFormatError(
            pdir / "flows.parquet",
            "step flows disagree",
            f"step {chosen}: {len(out)} network flows here, {len(ref)} in {pdir / 'step_flows.parquet'}",
        )
    return out


def link_bins_stage(spec: RunSpec, paths: DataPaths) -> StageResult:
    """``link_bins``: bytes per (directed link, bin) of every link of the run's topology; checks
    ``link_bins_conserve_bytes`` (per link class, exactly). A failed check writes no data file.

    Raises:
        TraceFormatError: ``flows.parquet`` and ``step_flows.parquet`` disagree.
        ValueError: a node outside the topology, or bad step flows (``binning.build_bins``).
    """
    reset_checks(paths.run_folder(spec), "link_bins", (CHECK,))
    summary = read_trace_summary(paths, spec.run_id)
    flows = chosen_step_flows(paths, spec.run_id)
    topo = run_topology(spec)
    src, dst = flows["src_node"].to_numpy(np.int64), flows["dst_node"].to_numpy(np.int64)
    kind = routes.routes_kind(spec.source, topo, src, dst)
    conn = routes.connection_keys(flows, spec.gpus_per_node)
    # the placement of binned_flows (stages/flows.bin_flows): same window, bin width and seed
    bin_args: dict[str, Any] = {"window_s": WINDOW_S, "bin_s": spec.bin_s}
    step_s = summary.step_time_us / 1e6
    built = link_bins.build_link_bins(
        flows, conn, topo, step_time_s=step_s, run_id=spec.run_id, routes=kind, **bin_args
    )
    expected = link_bins.expected_class_bytes(flows, topo, step_time_s=step_s, run_id=spec.run_id, **bin_args)
    outcome = conservation_outcome(built.table, expected)
    out = paths.table(spec.run_id, "link_bins")
    if outcome.passed:
        write_parquet(built.table, out)
    record(paths, spec, "link_bins", [outcome])
    meta: dict[str, Any] = {
        "rows": len(built.table),
        "links": int(topo.n_links),
        "routes": kind,
        "ecmp": topo.ecmp,
        **{f"bytes_{c}": v for c, v in built.class_bytes.items()},
    }
    return StageResult(out if outcome.passed else None, meta, [outcome])


def conservation_outcome(table: pd.DataFrame, expected: dict[str, int]) -> Outcome:
    """``link_bins_conserve_bytes`` of ``table`` (a ``link_bins`` table) against ``expected``
    (``link_bins.expected_class_bytes``)."""
    got = link_bins.class_bytes(table)
    ok, msg = link_bins.conservation(got, expected)
    meta = {f"table_{c}": v for c, v in got.items()} | {f"expected_{c}": v for c, v in expected.items()}
    return Outcome(CHECK, ok, msg, meta)


def link_bins_table() -> database.Table:
    """The ``link_bins`` table of ``phantora.duckdb`` (``stages/dataset.database_tables``): every included
    run's ``link_bins.parquet`` (a run built before the asset existed adds no rows)."""
    return database.Table(
        "link_bins",
        dict(link_bins.LINK_BIN_COLUMNS),
        "link_bins.parquet",
        "Bytes on each directed link of the run's leaf-spine in the bin starting at t (the link_bins asset): "
        "every network flow on every link of its path, placed over the window as flows_100ms places it; "
        "control traffic on no link.",
        link_bins.LINK_BIN_DOCS,
        optional=True,
    )
