"""Issue 38 attacked through ``phantora-assets build --run``: a run whose own network is reconfigured, read back
from DuckDB, ``simulation.json`` and the ``reconfig`` asset's Dagster metadata (review findings).

The job is ``test_reconfig_simulated``'s tiny DP x PP GPT on 4 hosts x 1 GPU, RailOptimized (every NIC on rail
0): two changes of group a step on every NIC, both on the critical path, with windows below 10 ms (that
test's closed forms: on demand stalls exactly 2 D a step, provisioned sum_i max(0, D - w_i) with both w_i
< 10 ms, so 0 < stall(10 ms) < 2 D and stall(50) - stall(10) = 2 x 40 ms).
"""

from __future__ import annotations

import json

import dagster as dg
import duckdb
import pandas as pd
import pytest
from fixtures.reconfig_job import EPS, MATRIX

from phantora_assets.checks import read_checks
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths

_HEAD, _EPS_ENTRY, _OWN = MATRIX.split("[[run]]")  # workloads, the EPS run (sweep 0, 10, 50), an on-demand run
OWN_RECONFIG = 'reconfig = { mode = "on_demand", delay_ms = 10 }'
RUNS = (
    _HEAD
    + "[[run]]"
    + _EPS_ENTRY
    + "".join(
        "[[run]]" + _OWN.replace(OWN_RECONFIG, rc)
        for rc in (
            OWN_RECONFIG,
            'reconfig = { mode = "provisioned", delay_ms = 10 }',
            'reconfig = { mode = "provisioned", delay_ms = 50 }',
            'reconfig = { mode = "on_demand", delay_ms = 10, sweep_delays_ms = [0, 10] }\nname = "withsweep"',
        )
    )
)
OD10, PV10, PV50 = (EPS + t for t in ("_ocs_on_demand_10ms", "_ocs_provisioned_10ms", "_ocs_provisioned_50ms"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from phantora_assets.cli import main

    root = tmp_path_factory.mktemp("reconfig_attack")
    (root / "runs.toml").write_text(RUNS)
    specs = load_run_matrix(root / "runs.toml")
    mp = pytest.MonkeyPatch()
    mp.setenv("PHANTORA_ASSETS_RUN_MATRIX", str(root / "runs.toml"))
    mp.delenv("DAGSTER_HOME", raising=False)
    try:
        args = ["build", "--data-dir", str(root / "data"), "--quiet", "--jobs", "1"]
        assert main(args + [a for s in specs for a in ("--run", s.run_id)]) == 0
    finally:
        mp.undo()
    return specs, DataPaths(root / "data")


def _iters(paths: DataPaths, run_id: str) -> list[int]:
    return json.loads((paths.partition_dir(run_id) / "simulation.json").read_text())["iteration_ns"]


def _sweep(paths: DataPaths) -> pd.DataFrame:
    with duckdb.connect(str(paths.duckdb_path), read_only=True) as con:
        return con.execute("select * from reconfig_sweep order by run_id, method, delay_ms, mode").df()


def test_a_provisioned_run_of_its_own_provisions(built):
    """``reconfig = { mode = "provisioned", delay_ms = 10 }`` on the entry was simulated with no schedule (the
    sweep passes the EPS run's ports' sequences; the run's own simulation passed none), so it never switched
    ahead and was its on-demand twin: EPS + 20.000 ms. Its steady iteration is the EPS's + the closed form's
    provisioned stall: below 2 D, the same as the sweep's provisioned row at 10 ms, and 2 x 40 ms less at 10
    than at 50 ms."""
    _, paths = built
    eps, od, pv10, pv50 = (_iters(paths, r)[1] for r in (EPS, OD10, PV10, PV50))
    assert od - eps == 20_000_000  # on demand: 2 D
    assert 0 < pv10 - eps < 20_000_000
    assert (pv50 - eps) - (pv10 - eps) == pytest.approx(80_000_000, abs=2)
    sweep = _sweep(paths)
    row = sweep[(sweep.run_id == EPS) & (sweep.method == "simulated") & (sweep.delay_ms == 10)]
    assert pv10 - eps == pytest.approx(row[row["mode"] == "provisioned"]["stall_s"].item() * 1e9, abs=2)


def test_a_reconfigured_runs_sweep_has_no_formula_rows(built):
    """The formula adds each transition's stall to the steps of the trace it reads; an ``_ocs_`` run's trace is
    already the reconfigured network's, so its formula rows counted the delays twice: its ``delay_ms = 10,
    on_demand`` row read EPS + 4 D (0.0494 s) where the run at exactly that network is EPS + 2 D (0.0294 s), and
    its 0 ms row was the 10 ms network's step. Such a run writes no formula rows (its EPS twin has them), its
    simulated rows (asked with ``sweep_delays_ms``) are the job's, equal to the EPS run's; the asset's metadata
    says why and reports no 0 ms utilisation of a network that is not the EPS."""
    specs, paths = built
    for s in specs:  # the build's asset checks
        bad = {k: v["status"] for k, v in read_checks(paths.run_folder(s)).items() if v["status"] == "failed"}
        assert bad == {}, s.run_id
    sweep = _sweep(paths)
    by = sweep.groupby(["run_id", "method"]).size().to_dict()
    assert by.get((OD10, "formula"), 0) == 0 and by.get((PV10, "formula"), 0) == 0
    named = OD10 + "_withsweep"
    assert by.get((named, "formula"), 0) == 0 and by[(named, "simulated")] == 4
    mine = sweep[(sweep.run_id == named) & (sweep.method == "simulated")].reset_index(drop=True)
    eps = sweep[(sweep.run_id == EPS) & (sweep.method == "simulated") & (sweep.delay_ms <= 10)].reset_index(drop=True)
    cols = ["delay_ms", "mode", "step_time_s", "stall_s", "utilisation"]
    pd.testing.assert_frame_equal(mine[cols], eps[cols])
    with dg.DagsterInstance.from_config(str(paths.root / "dagster_home")) as instance:
        recs = instance.fetch_materializations(dg.AssetKey("reconfig"), limit=100).records
        meta = {r.partition_key: r.asset_materialization.metadata for r in recs}
    assert "skipped" in meta[OD10]["formula"].value and "utilisation_0ms" not in meta[OD10]
    assert meta[EPS]["utilisation_0ms"].value == pytest.approx(
        sweep[(sweep.run_id == EPS) & (sweep.method == "formula") & (sweep.delay_ms == 0)]["utilisation"].iloc[0]
    )
    assert meta[named]["simulated_runs"].value == 3


def test_formula_and_simulated_agree_where_every_change_is_on_the_critical_path(built):
    """On this job both changes of group a step are on the critical path, so the formula's stall (the most
    stalled NIC's sum of max(0, D - w)) and the simulated one are one number, on demand (2 D) and provisioned.
    Provisioned at 10 ms the formula read 19.481 ms beside the simulated 18.013 ms: its dp -> pp window ended
    at the 4-byte gradient norm over pp (0 us after the all-reduce) where the pp circuit is first needed at the
    next pipeline send (1.468 ms later on hosts 1-2); with control collectives on the packet network, as the
    simulator runs them, both are 18.013 ms."""
    _, paths = built
    sweep = _sweep(paths)
    s = sweep[sweep.run_id == EPS].set_index(["method", "delay_ms", "mode"])["stall_s"]
    for d in (10, 50):
        assert s["formula", d, "on_demand"] == pytest.approx(2 * d / 1e3, abs=1e-9)
        assert s["formula", d, "provisioned"] == pytest.approx(s["simulated", d, "provisioned"], abs=1e-6)
