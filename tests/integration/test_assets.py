"""Real Dagster materializations of single partitions (in process and through the dagster CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
from fixtures.materialize import ephemeral_with_runs
from fixtures.paths import ROOT

from phantora_assets import definitions as d
from phantora_assets.checks import ADVISORY_CHECKS, RUN_CHECKS, read_checks
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.resources import AnalyticSimulatorResource, DataRoot

RUNS_BY_ID = {s.run_id: s for s in load_run_matrix()}

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def _materialize(run_id: str, root: Path, instance: dg.DagsterInstance) -> dg.ExecuteInJobResult:
    return dg.materialize(
        d.ALL_ASSETS,
        selection=d.RUN_ASSETS,
        partition_key=run_id,
        instance=instance,
        raise_on_error=False,
        resources={"data": DataRoot(data_dir=str(root)), "simulator": AnalyticSimulatorResource()},
        run_config=QUIET,
    )


def _check_evals(result: dg.ExecuteInJobResult) -> dict[str, bool]:
    return {e.check_name: e.passed for e in result.get_asset_check_evaluations()}


def test_failing_check_is_reported_on_its_own_partition(tmp_path):
    """A failing check of partition A (does not fit) is reported on A; partition B passes. Not
    fitting is an outcome: A's run succeeds, its check fails with WARN severity (see
    tests/integration/test_honest_outcomes.py)."""
    oom, ok = "phantora_l40s_W5_2x1", "phantora_l40s_W4_2x1"
    instance = ephemeral_with_runs([oom, ok])
    res_oom = _materialize(oom, tmp_path, instance)
    res_ok = _materialize(ok, tmp_path, instance)
    assert res_oom.success
    assert _check_evals(res_oom) == {"fits_in_memory": False, "perfdb_complete": True}
    assert res_ok.success
    evals = _check_evals(res_ok)
    assert evals["fits_in_memory"] and all(evals.values())
    assert set(evals) == set(RUN_CHECKS) | set(ADVISORY_CHECKS) | {"anatomy_adds_up", "link_bins_conserve_bytes"}
    paths = DataPaths(tmp_path)
    assert read_checks(paths.run_folder(RUNS_BY_ID[oom]))["fits_in_memory"]["status"] == "failed"
    assert read_checks(paths.run_folder(RUNS_BY_ID[ok]))["fits_in_memory"]["status"] == "passed"
    # the non-fitting run wrote no trace; downstream assets did not run (skipped), and are recorded
    # as not applicable (tests/integration/test_check_partitions.py)
    assert not paths.chrome_trace(RUNS_BY_ID[oom]).exists()
    mats = {
        m.asset_key.to_user_string(): m.metadata.get("status")
        for m in res_oom.get_asset_materialization_events()
        for m in [m.event_specific_data.materialization]
    }
    applicable = {k for k, status in mats.items() if getattr(status, "value", None) != "not_applicable"}
    assert applicable == {"raw_timeline"} and len(mats) > 1


def test_dagster_cli_materializes_one_partition(tmp_path):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "PHANTORA_ASSETS_DATA_DIR": str(tmp_path / "data")}
    (tmp_path / "home").mkdir()
    run_id = "phantora_a100_40g_W1_2x2"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dagster",
            "asset",
            "materialize",
            "-m",
            "phantora_assets.definitions",
            "--select",
            "raw_timeline",
            "--partition",
            run_id,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "data" / "partitions" / run_id / "raw_timeline.parquet").stat().st_size > 0
    assert "passed" in (tmp_path / "data" / "traces" / "a100_40g" / "W1_2x2" / "checks.json").read_text()


def test_nightly_schedule_requests_only_missing_or_stale_partitions(built: Path) -> None:
    """On the session's complete build nothing is requested; a partition whose summary is gone
    (missing) and one whose run_spec.json names another input (stale) are, and only they."""
    import shutil

    import msgspec

    root = built.parent / "nightly"
    shutil.copytree(built, root, ignore=shutil.ignore_patterns("dagster_home"))
    nightly = d.build_defs(root).resolve_schedule_def("nightly_missing_runs")
    ctx = dg.build_schedule_context(scheduled_execution_time=__import__("datetime").datetime(2026, 11, 29, 2))
    assert isinstance(nightly(ctx), dg.SkipReason)
    (root / "partitions" / "phantora_l40s_W1_2x1" / "run_summary.parquet").unlink()
    spec_file = root / "partitions" / "phantora_a100_40g_W2_2x2" / "run_spec.json"
    rec = msgspec.json.decode(spec_file.read_bytes())
    rec["fingerprint"] = "0" * 16
    rec["inputs"]["workload"] = {"changed": True}
    spec_file.write_bytes(msgspec.json.encode(rec))
    requests = list(nightly(ctx))
    assert {r.partition_key: r.tags["phantora/build_reason"] for r in requests} == {
        "phantora_l40s_W1_2x1": "missing",
        "phantora_a100_40g_W2_2x2": "stale: built from another workload than the run matrix now gives; rebuild the run",
    }
    # a run that does not fit is complete once its simulation said so: never requested
    assert "phantora_l40s_W5_2x1" not in {r.partition_key for r in requests}
