"""Issue 38's re-timed reconfiguration sweep through the real asset path: ``phantora-assets build`` of a user's
run matrix, then DuckDB.

The job: a 4-block GPT of hidden 1024 (Megatron, PP = 2 with 1F1B over 4 micro-batches, DP = 2 with the
gradient all-reduce after the backward) on 4 hosts x 1 GPU, RailOptimized (one NIC a host, all on rail 0):
DP peers are hosts 1-2 and 3-4, PP peers 1-3 and 2-4, so every NIC carries both groups. A step is the
pipeline (PP sends), then the gradient all-reduce (DP), then the next step's pipeline: two changes of group
a step on every NIC, both on the critical path (the all-reduce waits for the last backward's PP traffic, the
next step's first send for the optimizer after the all-reduce). Closed forms:

* ``simulated`` on demand: the step of the EPS + 2 D, exactly (``stall_s`` = 2 D);
* ``simulated`` provisioned: sum over the two changes of max(0, D - w) with windows w below 10 ms on this
  job, so between 10 and 50 ms it grows by exactly 2 x 40 ms; never above on demand;
* the D = 0 rows of both modes: the EPS (stall 0), whose step is the run's own simulated steady iteration;
* every ``simulated`` row equals the direct ``lib/net/reconfig_sim.simulated_sweep`` call's;
* the run's own reconfigured twin (``reconfig = { mode = "on_demand", delay_ms = 10 }``, run id ``_ocs_...``)
  draws the EPS run's jitter (seeded by the job, not the run id): its simulated iterations are the EPS's + 2 D,
  to the ns.
"""

from __future__ import annotations

import json

import duckdb
import pandas as pd
import pytest
from fixtures.reconfig_job import EPS, MATRIX, OCS

from phantora_assets.checks import read_checks
from phantora_assets.lib.net.reconfig_sim import simulated_sweep
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from phantora_assets.cli import main

    root = tmp_path_factory.mktemp("reconfig_simulated")
    (root / "runs.toml").write_text(MATRIX)
    mp = pytest.MonkeyPatch()
    mp.setenv("PHANTORA_ASSETS_RUN_MATRIX", str(root / "runs.toml"))
    mp.delenv("DAGSTER_HOME", raising=False)
    try:
        assert main(["build", "--data-dir", str(root / "data"), "--quiet", "--jobs", "1"]) == 0
    finally:
        mp.undo()
    return load_run_matrix(root / "runs.toml"), DataPaths(root / "data")


def _sweep(paths: DataPaths) -> pd.DataFrame:
    with duckdb.connect(str(paths.duckdb_path), read_only=True) as con:
        return con.execute("select * from reconfig_sweep order by run_id, method, delay_ms, mode").df()


def test_build_is_green_and_duckdb_has_both_methods(built):
    specs, paths = built
    assert [s.run_id for s in specs] == [EPS, OCS]
    for s in specs:
        bad = {k: v["status"] for k, v in read_checks(paths.run_folder(s)).items() if v["status"] == "failed"}
        assert bad == {}, s.run_id
    counts = _sweep(paths).groupby(["run_id", "method"]).size().to_dict()
    # formula: 10 delays x 2 modes for the EPS run (none for the reconfigured run: its trace already holds the
    # delays, test_reconfig_attack); simulated: 3 delays x 2 modes for the run that asks
    assert counts == {(EPS, "formula"): 20, (EPS, "simulated"): 6}
    assert (paths.plots_dir(specs[0]) / "reconfig_sweep.png").stat().st_size > 1000
    assert not (paths.plots_dir(specs[1]) / "reconfig_sweep.png").exists()  # no sweep to draw


def test_simulated_rows_are_the_closed_forms_and_the_direct_call(built):
    specs, paths = built
    sweep = _sweep(paths)
    sim = sweep[(sweep["run_id"] == EPS) & (sweep["method"] == "simulated")].reset_index(drop=True)
    od = sim[sim["mode"] == "on_demand"].set_index("delay_ms")
    pv = sim[sim["mode"] == "provisioned"].set_index("delay_ms")
    eps_step = od.loc[0, "step_time_s"]
    assert pv.loc[0, "step_time_s"] == eps_step and od.loc[0, "stall_s"] == pv.loc[0, "stall_s"] == 0
    own = json.loads((paths.partition_dir(EPS) / "simulation.json").read_text())["iteration_ns"]
    assert eps_step == pytest.approx(own[1] / 1e9, abs=1e-9)  # the run's own simulated steady iteration
    for d in (10, 50):
        assert od.loc[d, "stall_s"] == pytest.approx(2 * d / 1e3, abs=1e-9)  # two delays a step, exactly
        assert od.loc[d, "step_time_s"] == pytest.approx(eps_step + 2 * d / 1e3, abs=1e-9)
        assert 0 < pv.loc[d, "stall_s"] <= od.loc[d, "stall_s"]
    assert pv.loc[50, "stall_s"] - pv.loc[10, "stall_s"] == pytest.approx(2 * 0.040, abs=1e-9)
    # utilisation: one compute time over each row's step (the jobs share their seed)
    compute = sim["utilisation"] * sim["step_time_s"]
    assert compute.to_numpy() == pytest.approx([compute.iloc[0]] * len(sim), rel=1e-12)
    # ... the same quantity as the formula rows' at D = 0 (hosts' mean compute over the step)
    formula0 = sweep[(sweep["run_id"] == EPS) & (sweep["method"] == "formula") & (sweep["delay_ms"] == 0)]
    assert od.loc[0, "utilisation"] == pytest.approx(float(formula0["utilisation"].iloc[0]), rel=1e-3)
    direct, _ = simulated_sweep(specs[0], [0, 10, 50])
    pd.testing.assert_frame_equal(sim[direct.columns.tolist()], direct, check_dtype=False)


def test_reconfigured_run_is_its_eps_twin_plus_the_delays(built):
    _, paths = built
    it = {r: json.loads((paths.partition_dir(r) / "simulation.json").read_text())["iteration_ns"] for r in (EPS, OCS)}
    # the warm-up and the first steady iteration are simulated in both (the later EPS ones are replicas)
    assert [o - e for o, e in zip(it[OCS][:2], it[EPS][:2])] == [20_000_000, 20_000_000]


def test_arbitrary_file_with_an_optical_switch_is_the_rail(tmp_path):
    """Issue 38 item 1's Arbitrary case: the 4 NICs on one switch marked ``optical = true`` at 400 Gbps are
    RailOptimized's rail 0 (one NIC a host): the same simulated sweep, to the ns."""
    fabric = '[[switch]]\nname = "ocs"\noptical = true\n' + "".join(
        f'[[nic]]\nhost = {h}\nnic = 0\nswitch = "ocs"\ngbps = 400\n' for h in range(1, 5)
    )
    (tmp_path / "fabric.toml").write_text(fabric)
    topo = f'{{ topology = "Arbitrary", fabric_file = "{tmp_path / "fabric.toml"}" }}'
    first_run = MATRIX.split("[[run]]")[1]
    rail = MATRIX.split("[[run]]")[0] + "[[run]]" + first_run
    arbitrary = rail.replace('{ topology = "RailOptimized", nic_bw_gbps = 400 }', topo)
    (tmp_path / "rail.toml").write_text(rail)
    (tmp_path / "arbitrary.toml").write_text(arbitrary)
    (r,) = load_run_matrix(tmp_path / "rail.toml")
    (a,) = load_run_matrix(tmp_path / "arbitrary.toml")
    cols = ["delay_ms", "mode", "step_time_s", "stall_s", "utilisation"]
    got = simulated_sweep(a, [0, 10])[0]
    pd.testing.assert_frame_equal(got[cols], simulated_sweep(r, [0, 10])[0][cols])
    assert got.loc[(got["delay_ms"] == 10) & (got["mode"] == "on_demand"), "stall_s"].item() == pytest.approx(0.02)
