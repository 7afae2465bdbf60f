"""Stage of group ``links``: per-link traffic (no Dagster import).

    link_bins_stage -> partitions/<run_id>/link_bins.parquet

Reads ``validated_flows``' tables (``flows.parquet``, ``steps.parquet``, ``trace_summary.json``) and places
the chosen steady step's flows over the window as ``binned_flows`` does (``lib/net/link_bins.py``), on the
paths the run's network gives them (``lib/net/routes.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phantora_assets.checks import LINK_BINS_CONSERVE_BYTES, reset_checks
from phantora_assets.lib.columns import STEP_FLOW_COLUMNS
from phantora_assets.lib.errors import FileRuleError, TraceFormatError
from phantora_assets.lib.net import link_bins, nics, routes
from phantora_assets.lib.net.fabric import Fabric, build_fabric, network_files
from phantora_assets.lib.phantora.netconfig import netconfig_for
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.network import Topology
from phantora_assets.lib.store import database, link_table
from phantora_assets.lib.traffic.binning import exact_sum
from phantora_assets.outcomes import Outcome, StageResult, record
from phantora_assets.paths import DataPaths
from phantora_assets.records import RunSpecRecord, read_record_or_none
from phantora_assets.stages.common import WINDOW_S
from phantora_assets.stages.flows import read_trace_summary
from phantora_assets.stages.simulation import file_digest

CHECK = LINK_BINS_CONSERVE_BYTES


def run_topology(spec: RunSpec, paths: DataPaths | None = None) -> Topology | Fabric:
    """The run's network: its netconfig (``lib/phantora/netconfig.netconfig_for``) with its ``ecmp``, as the
    analytic simulator builds it (``lib/sim/analytic.py``); a fabric topology's graph (``lib/net/fabric.py``).
    With ``paths``, every file the network reads (``fabric_file``) must hold the bytes the run was simulated
    with (``run_spec.json``), else ``FileRuleError`` ``changed since the run was simulated``: a table of this
    run never describes another network than the one it was simulated on."""
    for key, name in network_files(spec.cluster).items():
        if paths is None:
            break
        rec = read_record_or_none(paths.partition_dir(spec.run_id) / "run_spec.json", RunSpecRecord)
        built = rec.inputs.get(key) if rec is not None else None
        if built != (now := file_digest(Path(name))):
            raise FileRuleError(
                name,
                "changed since the run was simulated",
                f"{key} {now[:20]}... against {str(built)[:20]}... in run_spec.json: rebuild the run from raw_timeline",
            )
    if spec.cluster["topology"] != "TwoLayerMultiPath":
        return build_fabric(spec.cluster, spec.n_nodes, spec.gpus_per_node)
    return Topology.from_netconfig(netconfig_for(spec), ecmp=str(spec.cluster.get("ecmp", "hash")))


def known_members(paths: DataPaths, spec: RunSpec) -> pd.DataFrame | None:
    """The run's communicator members (``comm_members.parquet`` of ``validated_flows``: every flow's sender,
    loopback flows included), or None for a run validated before the file existed."""
    f = paths.table(spec.run_id, "comm_members")
    return pd.read_parquet(f) if f.exists() else None


def with_nics(flows: pd.DataFrame, spec: RunSpec, fab: Fabric, paths: DataPaths) -> pd.DataFrame:
    """``flows`` (``flows.parquet`` columns incl. ``flow_id``, ``op``, ``comm_rank``) with ``src_nic``,
    ``dst_nic`` (``lib/net/nics.flow_nics``), the endpoints ``src_ep``, ``dst_ep`` (host x NICs + NIC) and
    ``network`` (False inside one scale-up domain: on no link)."""
    src_nic, dst_nic = nics.flow_nics(
        flows, spec.gpus_per_node, fab.nics_per_host, known_members(paths, spec), pxn=fab.pxn
    )
    k = fab.nics_per_host
    src, dst = flows["src_node"].to_numpy(np.int64), flows["dst_node"].to_numpy(np.int64)
    out = flows.copy()
    out["src_nic"], out["dst_nic"] = src_nic, dst_nic
    out["src_ep"], out["dst_ep"] = src * k + src_nic, dst * k + dst_nic
    out["network"] = ~fab.same_domain_hosts(src, dst)
    return out


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
        columns=["flow_id", "ts_us", "dur_us", "src_node", "dst_node", "bytes", "step", "comm_id", "stream", "op"]
        + ["comm_rank"],
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
            "flow_id": f["flow_id"].to_numpy(np.int64),
            "ts_us": f["ts_us"].to_numpy(np.float64),
            "op": f["op"].astype(str).to_numpy(),
            "comm_rank": f["comm_rank"].to_numpy(np.int64),
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
    topo = run_topology(spec, paths)
    conn = routes.connection_keys(flows, spec.gpus_per_node)
    if isinstance(topo, Fabric):  # NIC endpoints; a scale-up domain's flows cross no link
        nf = with_nics(flows, spec, topo, paths)
        on_net = nf["network"].to_numpy()
        flows = nf.assign(src_node=nf["src_ep"], dst_node=np.where(on_net, nf["dst_ep"], nf["src_ep"]))
    src, dst = flows["src_node"].to_numpy(np.int64), flows["dst_node"].to_numpy(np.int64)
    kind = routes.routes_kind(spec.source, topo, src, dst)
    # the placement of binned_flows (stages/flows.bin_flows): same window, bin width and seed
    bin_args: dict[str, Any] = {"window_s": WINDOW_S, "bin_s": spec.bin_s}
    step_s = summary.step_time_us / 1e6
    built = link_bins.build_link_bins(
        flows, conn, topo, step_time_s=step_s, run_id=spec.run_id, routes=kind, **bin_args
    )
    expected = link_bins.expected_class_bytes(
        flows, topo, step_time_s=step_s, run_id=spec.run_id, conn=conn, **bin_args
    )
    outcome = conservation_outcome(built.class_bytes, expected)
    out = paths.table(spec.run_id, "link_bins")
    if outcome.passed:  # a row group at a time from the matrix: never the whole table in pandas
        times = link_bins.link_bin_times(built.per_link.shape[0], built.bin_s)
        link_table.write_link_bins(built.per_link, built.links, spec.run_id, built.bin_s, kind, times, out)
    record(paths, spec, "link_bins", [outcome])
    meta: dict[str, Any] = {
        "rows": int(built.per_link.size),
        "links": int(topo.n_links),
        "routes": kind,
        "ecmp": topo.ecmp,
        "topology": spec.cluster["topology"],
        **{f"bytes_{c}": v for c, v in built.class_bytes.items()},
    }
    return StageResult(out if outcome.passed else None, meta, [outcome])


def conservation_outcome(table: pd.DataFrame | dict[str, int], expected: dict[str, int]) -> Outcome:
    """``link_bins_conserve_bytes`` of ``table`` (a ``link_bins`` table, or the bytes per link class of the
    matrix the stage writes, ``LinkBins.class_bytes``) against ``expected`` (``link_bins.expected_class_bytes``)."""
    got = link_bins.class_bytes(table, tuple(expected)) if isinstance(table, pd.DataFrame) else dict(table)
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
