"""Runs on fabric topologies through real Dagster materializations: a RailOptimized run whose scale-out
traffic stays on its rails, link_bins conserving bytes per link class, per-NIC-pair tables, and the
reconfiguration tables and plots in DuckDB once the flows carry their parallelism group."""

from __future__ import annotations

import duckdb
import numpy as np
import pandas as pd
import pytest
from fixtures.materialize import ephemeral_with_runs

from phantora_assets.checks import read_checks
from phantora_assets.definitions import build_defs
from phantora_assets.matrix import parse_entries
from phantora_assets.paths import DataPaths
from phantora_assets.stages import dataset as dataset_stage
from phantora_assets.stages import reconfig as reconfig_stage

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
ARBITRARY = """
[[switch]]
name = "tor-1"
[[switch]]
name = "tor-2"
[[switch]]
name = "core"
[[link]]
a = "tor-1"
b = "core"
gbps = 200
[[link]]
a = "tor-2"
b = "core"
gbps = 200
[[nic]]
host = 1
nic = 0
switch = "tor-1"
gbps = 400
[[nic]]
host = 2
nic = 0
switch = "tor-2"
gbps = 400
"""


def _build(tmp_path, topology: dict):
    """W1 (TP = 2 inside a host, DP across hosts) on 2 hosts x 2 GPUs, every run asset materialized."""
    (spec,) = parse_entries(
        [{"workload": "W1", "gpu": "a100_40g", "nodes": 2, "gpus_per_node": 2, "topology": topology}]
    )
    data = tmp_path / "data"
    defs = build_defs(data, [spec])
    job = defs.resolve_job_def("all_runs")
    res = job.execute_in_process(
        partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET
    )
    assert res.success
    return spec, DataPaths(data)


def _with_groups(paths: DataPaths, run_id: str) -> None:
    """Tag W1's flows as the workloads issue will: between hosts the DP all-reduces, inside a host TP."""
    f = paths.table(run_id, "flows")
    flows = pd.read_parquet(f)
    flows["group"] = np.where(flows["src_node"] != flows["dst_node"], "dp", "tp")
    flows.to_parquet(f, index=False)


def test_rail_optimized_run_keeps_scale_out_traffic_on_its_rails(tmp_path):
    spec, paths = _build(tmp_path, {"topology": "RailOptimized", "nic_bw_gbps": 400})
    assert spec.run_id == "phantora_a100_40g_W1_2x2_railoptimized"
    assert read_checks(paths.run_folder(spec))["link_bins_conserve_bytes"]["status"] == "passed"
    links = pd.read_parquet(paths.table(spec.run_id, "link_bins"))
    per_class = links.groupby("link_class")["bytes"].sum().to_dict()
    # DP peers are ranks r and r + 2: local GPU g of both hosts, NIC g, one rail switch -- no spine link used
    assert per_class["rail_spine"] == per_class["spine_rail"] == 0
    assert per_class["host_up"] == per_class["host_down"] > 0
    assert set(links["src"]) >= {"host-1/nic-0", "host-1/nic-1", "rail-0.0", "rail-0.1", "spine-0"}
    pairs = pd.read_parquet(paths.table(spec.run_id, "nic_pairs"))
    net = pairs[pairs["network"]]
    assert len(net) == 4 and (net["src_nic"] == net["dst_nic"]).all()
    assert set(zip(net["src"], net["dst"])) == {
        ("host-1/nic-0", "host-2/nic-0"),
        ("host-2/nic-0", "host-1/nic-0"),
        ("host-1/nic-1", "host-2/nic-1"),
        ("host-2/nic-1", "host-1/nic-1"),
    }
    steps = pd.read_parquet(paths.table(spec.run_id, "steps"))
    per_step = steps.loc[steps["steady"], "network_bytes"].iloc[0]
    assert net["bytes_per_step"].sum() == pytest.approx(per_step)
    assert "group" in pd.read_parquet(paths.table(spec.run_id, "flows")).columns  # flows carry their group (issue 26)

    _with_groups(paths, spec.run_id)
    result = reconfig_stage.reconfig_stage(spec, paths)
    assert "skipped" not in result.metadata
    sweep = pd.read_parquet(paths.table(spec.run_id, "reconfig_sweep"))
    assert len(sweep) == 20 and set(sweep["mode"]) == {"on_demand", "provisioned"}
    # one group on the network (dp): no transition, nothing stalls, utilisation = compute / step time
    assert len(pd.read_parquet(paths.table(spec.run_id, "transition_windows"))) == 0
    assert (sweep["stall_s"] == 0).all() and sweep["utilisation"].nunique() == 1
    for png in ("reconfig_windows", "reconfig_sweep"):
        assert (paths.plots_dir(spec) / f"{png}.png").stat().st_size > 1000
    dataset_stage.export_dataset([spec], paths)
    db = dataset_stage.dataset_duckdb_stage([spec], paths)
    assert db.outcome.passed and db.build.rows["reconfig_sweep"] == 20 and db.build.rows["nic_pairs"] == len(pairs)
    with duckdb.connect(str(paths.duckdb_path), read_only=True) as con:
        (n,) = con.execute("select count(*) from reconfig_sweep where mode = 'provisioned'").fetchone() or (0,)
    assert n == 10


@pytest.mark.parametrize(
    "topology",
    [{"topology": "FatTree", "fattree_k": 4, "oversubscription": 2.0}, {"topology": "Arbitrary"}],
    ids=["fattree", "arbitrary"],
)
def test_fat_tree_and_arbitrary_runs_conserve_bytes_per_link_class(tmp_path, topology):
    if topology["topology"] == "Arbitrary":
        (tmp_path / "fabric.toml").write_text(ARBITRARY)
        topology = {**topology, "fabric_file": str(tmp_path / "fabric.toml")}
    spec, paths = _build(tmp_path, topology)
    assert read_checks(paths.run_folder(spec))["link_bins_conserve_bytes"]["status"] == "passed"
    links = pd.read_parquet(paths.table(spec.run_id, "link_bins"))
    per_class = links.groupby("link_class")["bytes"].sum().to_dict()
    up = per_class["host_up"]
    if topology["topology"] == "FatTree":  # hosts 1, 2 under one edge switch: nothing above it
        assert per_class["edge_agg"] == per_class["agg_edge"] == 0 and up > 0
    else:  # two racks: every network byte crosses tor -> core and core -> tor
        assert per_class["fabric"] == 2 * up and up > 0
    pairs = pd.read_parquet(paths.table(spec.run_id, "nic_pairs"))
    assert set(pairs.loc[pairs["network"], "src_nic"]) == {0}


def test_moe_run_on_rails_has_ep_dp_transitions_and_a_linear_on_demand_cost(tmp_path):
    """W2 (expert all-to-alls over all 8 GPUs, dense gradients over DP) on 2 hosts x 4 GPUs with a NIC each:
    EP and DP phases alternate on every rail. Groups tagged by collective (all-to-all = ep, else dp) until
    the workloads issue tags them."""
    (spec,) = parse_entries(
        [
            {
                "workload": "W2",
                "gpu": "a100_40g",
                "nodes": 2,
                "gpus_per_node": 4,
                "topology": {"topology": "RailOptimized"},
            }
        ]
    )
    data = tmp_path / "data"
    res = (
        build_defs(data, [spec])
        .resolve_job_def("all_runs")
        .execute_in_process(partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET)
    )
    assert res.success
    paths = DataPaths(data)
    f = paths.table(spec.run_id, "flows")
    flows = pd.read_parquet(f)
    flows["group"] = np.where(flows["op"].isin(["send", "recv"]), "ep", "dp")
    flows.to_parquet(f, index=False)
    reconfig_stage.reconfig_stage(spec, paths)
    t = pd.read_parquet(paths.table(spec.run_id, "transition_windows"))
    sweep = pd.read_parquet(paths.table(spec.run_id, "reconfig_sweep"))
    # the 8-rank DP ring crosses hosts at ranks 3 -> 4 and 7 -> 0 (GPU 3 -> GPU 0 of the other host): with
    # PXN both leave through NIC 0, the receiver's rail, so NIC 0 of each host carries DP and EP; NICs 1-3
    # carry the all-to-alls only (one group: no transition). PXN keeps the all-to-alls on their rails.
    assert set(t["nic"]) == {f"host-{h}/nic-0" for h in (1, 2)}
    links = pd.read_parquet(paths.table(spec.run_id, "link_bins"))
    assert links.loc[links["link_class"] == "rail_spine", "bytes"].sum() == 0
    assert {("ep", "dp"), ("dp", "ep")} <= set(zip(t["from_group"], t["to_group"]))
    n_steps = t["step"].nunique()
    most = t.groupby(["step", "nic"]).size().groupby(level="step").max()
    od = sweep[sweep["mode"] == "on_demand"].set_index("delay_ms")
    pv = sweep[sweep["mode"] == "provisioned"].set_index("delay_ms")
    # on demand: the most transitioned NIC's count of delays per step
    assert od.loc[100, "stall_s"] == pytest.approx(0.1 * most.sum() / n_steps)
    assert (pv["stall_s"] <= od["stall_s"] + 1e-12).all() and pv.loc[1000, "stall_s"] > 0
    assert od.loc[0, "utilisation"] > od.loc[1000, "utilisation"]
    print(
        f"\n{spec.run_id}: {len(t) / n_steps:.1f} transitions per steady step, most stalled NIC {most.mean():.1f}; "
        + "; ".join(
            f"{d} ms: on demand {od.loc[d, 'step_time_s']:.4f} s ({100 * od.loc[d, 'utilisation']:.1f} %), "
            f"provisioned {pv.loc[d, 'step_time_s']:.4f} s ({100 * pv.loc[d, 'utilisation']:.1f} %)"
            for d in (0, 1, 10, 100, 1000)
        )
    )
    print(t.groupby(["from_group", "to_group"])["window_s"].describe().to_string())


def _build_w2(tmp_path, topology: dict):
    """W2 (MoE, ep = 8: all-to-alls between every pair of ranks) on 2 hosts x 4 GPUs, a NIC a GPU."""
    (spec,) = parse_entries(
        [{"workload": "W2", "gpu": "a100_40g", "nodes": 2, "gpus_per_node": 4, "topology": topology}]
    )
    data = tmp_path / "data"
    res = (
        build_defs(data, [spec])
        .resolve_job_def("all_runs")
        .execute_in_process(partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET)
    )
    assert res.success
    paths = DataPaths(data)
    per_class = pd.read_parquet(paths.table(spec.run_id, "link_bins")).groupby("link_class")["bytes"].sum()
    pairs = pd.read_parquet(paths.table(spec.run_id, "nic_pairs"))
    return per_class.to_dict(), pairs[pairs["network"]]


def test_rail_optimized_pxn_keeps_cross_rail_all_to_all_off_the_spines(tmp_path):
    """Issue 38 item 5: NCCL's PXN (on by default) sends a flow to GPU j of another host from the NIC on rail j
    (NVLink to that rail's GPU first), so a one-group rail fabric carries no byte on a spine; without PXN, the
    all-to-all's cross-rail flows (GPU i -> GPU j, i != j: 12 of 16 ordered GPU pairs between the hosts) cross
    the spines."""
    on, pairs_on = _build_w2(tmp_path / "on", {"topology": "RailOptimized", "nic_bw_gbps": 400})
    assert on["rail_spine"] == on["spine_rail"] == 0 and on["host_up"] > 0
    assert (pairs_on["src_nic"] == pairs_on["dst_nic"]).all()
    off, pairs_off = _build_w2(tmp_path / "off", {"topology": "RailOptimized", "nic_bw_gbps": 400, "pxn": False})
    assert pairs_off["bytes_per_step"].sum() == pairs_on["bytes_per_step"].sum()  # the same bytes leave the hosts
    assert off["rail_spine"] == off["spine_rail"] > 0
    cross = pairs_off[pairs_off["src_nic"] != pairs_off["dst_nic"]]
    assert len(cross) == 2 * 12 and off["rail_spine"] == pytest.approx(
        cross["bytes_per_step"].sum() / pairs_off["bytes_per_step"].sum() * off["host_up"], rel=1e-4
    )


def test_link_tables_refuse_a_fabric_file_changed_since_the_simulation(tmp_path):
    """Issue 39 item 6 (a fresh attack): link_bins and reconfig rebuilt the network from the fabric file as it is
    now, so an edit (then a revert) left a current-looking run whose link capacities were another network's."""
    from phantora_assets.lib.errors import FileRuleError
    from phantora_assets.stages import links as links_stage

    fabric = tmp_path / "fabric.toml"
    fabric.write_text(ARBITRARY)
    spec, paths = _build(tmp_path, {"topology": "Arbitrary", "fabric_file": str(fabric)})
    links_stage.link_bins_stage(spec, paths)  # the file as simulated: accepted
    fabric.write_text(ARBITRARY.replace("gbps = 200", "gbps = 100"))
    for stage in (links_stage.link_bins_stage, reconfig_stage.reconfig_stage):
        with pytest.raises(FileRuleError, match="changed since the run was simulated") as exc:
            stage(spec, paths)
        assert str(fabric) in str(exc.value)
