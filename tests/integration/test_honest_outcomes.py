"""A run that does not fit in GPU memory is an outcome, not an error: real Dagster runs of the
``all_runs`` job (``definitions.build_defs``) for one partition that does not fit and one that fits.

The non-fitting run succeeds: ``raw_timeline`` materializes with the verdict and the estimate in
its metadata, its ``fits_in_memory`` check fails with WARN severity (not blocking), ``chrome_trace``
writes nothing (``output_required=False``), records itself and every asset below it as materialized
with status ``not_applicable`` and the reason, and Dagster skips every step below it; the run
folder records the same outcomes as before (``checks.json`` ``failed``), so the dataset still
excludes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from fixtures.materialize import ephemeral_with_runs
from fixtures.memory import peak_gib
from fixtures.run_folders import write_run_folder

from phantora_assets import checks
from phantora_assets.assets import RUN_ASSET_NAMES
from phantora_assets.assets.common import DAGSTER_PLAN_LOGGER
from phantora_assets.checks import RUN_CHECKS, read_checks
from phantora_assets.cli import main
from phantora_assets.definitions import build_defs
from phantora_assets.imported_runs import effective_matrix, register
from phantora_assets.lib.phantora.run_folder import discover
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.resources import AnalyticSimulatorResource
from phantora_assets.stages.dataset import export_dataset

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
OOM = "phantora_l40s_W5_2x1"  # estimated peak above the L40S card (46.00 GiB)
FITS = "phantora_l40s_W1_2x1"
#: The steps Dagster skips below chrome_trace in the non-fitting run.
SKIPPED = [n for n in RUN_ASSET_NAMES if n not in ("raw_timeline", "chrome_trace")]


def _run(defs: dg.Definitions, partition: str, instance: dg.DagsterInstance) -> dg.ExecuteInJobResult:
    job = defs.resolve_job_def("all_runs")
    return job.execute_in_process(partition_key=partition, instance=instance, raise_on_error=False, run_config=QUIET)


def _materialized(res: dg.ExecuteInJobResult) -> dict[str, dict]:
    return {
        e.asset_key.to_user_string(): {k: v.value for k, v in e.event_specific_data.materialization.metadata.items()}
        for e in res.get_asset_materialization_events()
        if e.asset_key is not None and e.event_specific_data is not None
    }


def _steps(res: dg.ExecuteInJobResult, event_type: str) -> set[str]:
    return {e.step_key for e in res.all_events if e.event_type_value == event_type and e.step_key}


def _user_logs(instance: dg.DagsterInstance, res: dg.ExecuteInJobResult) -> list[str]:
    """The run's log lines (context.log), not the descriptions of its events."""
    return [e.user_message for e in instance.all_logs(res.run_id) if e.user_message and e.dagster_event is None]


@dataclass
class Runs:
    data: Path
    defs: dg.Definitions
    instance: dg.DagsterInstance
    res: dict[str, dg.ExecuteInJobResult]
    plan_warnings: list[str]  # what Dagster's execution-plan logger let through at WARNING


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    data = tmp_path_factory.mktemp("honest") / "data"
    specs = [s for s in load_run_matrix() if s.run_id in (OOM, FITS)]
    defs = build_defs(data, specs, simulator=AnalyticSimulatorResource())
    instance = ephemeral_with_runs([OOM, FITS])
    seen: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = _Keep(logging.WARNING)
    logger = logging.getLogger(DAGSTER_PLAN_LOGGER)
    logger.addHandler(keep)
    try:
        res = {rid: _run(defs, rid, instance) for rid in (OOM, FITS)}
    finally:
        logger.removeHandler(keep)
    return Runs(data, defs, instance, res, seen)


def test_both_runs_succeed(runs):
    assert runs.res[OOM].success and runs.res[FITS].success
    assert runs.res[OOM].dagster_run.status == dg.DagsterRunStatus.SUCCESS
    assert not _steps(runs.res[OOM], "STEP_FAILURE") and not _steps(runs.res[FITS], "STEP_FAILURE")


def _applicable(mats: dict[str, dict]) -> set[str]:
    return {k for k, meta in mats.items() if meta.get("status") != "not_applicable"}


def test_not_fitting_run_records_the_estimate_on_raw_timeline(runs):
    mats = _materialized(runs.res[OOM])
    assert _applicable(mats) == {"raw_timeline"}
    reason = f"phantora_l40s_W5_2x1 does not fit in GPU memory ({peak_gib(OOM)} GiB > 46.00 GiB)"
    assert {k: v for k, v in mats.items() if k != "raw_timeline"} == {
        n: {"status": "not_applicable", "reason": reason} for n in RUN_ASSET_NAMES if n != "raw_timeline"
    }
    meta = mats["raw_timeline"]
    assert meta["fits_in_memory"] is False
    assert meta["peak_memory_gib"] == pytest.approx(float(peak_gib(OOM)), abs=0.005)
    assert float(peak_gib(OOM)) > 46.0
    assert meta["card_gib"] == pytest.approx(46.0)
    assert meta["outcome"].startswith(f"does not fit: estimated peak {peak_gib(OOM)} GiB > card 46.00 GiB")
    assert "not applicable" in meta["outcome"]


def test_not_fitting_check_fails_with_warn_severity_and_does_not_block(runs):
    evals = {e.check_name: e for e in runs.res[OOM].get_asset_check_evaluations()}
    assert set(evals) == {"fits_in_memory", "perfdb_complete"}
    fits = evals["fits_in_memory"]
    assert not fits.passed and fits.severity == dg.AssetCheckSeverity.WARN
    assert evals["perfdb_complete"].passed
    spec = {s.name: s for s in runs.defs.resolve_assets_def("raw_timeline").check_specs}["fits_in_memory"]
    assert not spec.blocking
    assert checks.BY_NAME["fits_in_memory"].gates_dataset and "fits_in_memory" in RUN_CHECKS


def test_downstream_steps_are_skipped_not_failed(runs):
    oom = runs.res[OOM]
    assert _steps(oom, "STEP_SUCCESS") == {"raw_timeline", "chrome_trace"}  # chrome_trace ran, yielded nothing
    assert _steps(oom, "STEP_SKIPPED") == set(SKIPPED)
    assert f"not applicable: {OOM} does not fit in GPU memory ({peak_gib(OOM)} GiB > 46.00 GiB)" in _user_logs(
        runs.instance, oom
    )
    # Dagster's "Blocking asset check ... emitted no result" lines for the skipped steps are quieted
    assert not [m for m in runs.plan_warnings if "emitted no result" in m]


def test_fitting_run_materializes_every_asset(runs):
    ok = runs.res[FITS]
    mats = _materialized(ok)
    assert set(mats) == set(RUN_ASSET_NAMES)
    assert mats["raw_timeline"]["fits_in_memory"] is True
    assert mats["raw_timeline"]["outcome"].startswith(f"fits: estimated peak {peak_gib(FITS)} GiB <= card 46.00 GiB")
    assert not _steps(ok, "STEP_SKIPPED")
    assert all(e.passed for e in ok.get_asset_check_evaluations())
    assert not [m for m in _user_logs(runs.instance, ok) if m.startswith("not applicable")]


def test_run_folders_record_the_same_outcomes_and_the_dataset_excludes_the_run(runs):
    paths = DataPaths(runs.data)
    by_id = {s.run_id: s for s in load_run_matrix()}
    oom = read_checks(paths.run_folder(by_id[OOM]))
    assert list(oom) == ["fits_in_memory", "perfdb_complete"]  # nothing below raw_timeline ran
    assert oom["fits_in_memory"]["status"] == "failed"
    assert oom["fits_in_memory"]["message"] == f"does not fit: estimated peak {peak_gib(OOM)} GiB > card 46.00 GiB"
    assert not paths.chrome_trace(by_id[OOM]).exists()
    assert all(v["status"] == "passed" for v in read_checks(paths.run_folder(by_id[FITS])).values())
    assert checks.blocking_failures(paths.run_folder(by_id[OOM]))["flows_exist"]["status"] == checks.NOT_EVALUATED
    result = export_dataset([by_id[OOM], by_id[FITS]], paths)
    assert result.included == [FITS]
    status = pd.read_csv(paths.dataset_dir / "run_status.csv").set_index("run_id")
    assert status.loc[OOM, "status"] == "excluded"
    assert status.loc[OOM, "reason"].startswith("fits_in_memory: failed, flows_exist: not evaluated")


def test_runs_command_says_not_evaluated(runs, capsys):
    assert main(["runs", "--data-dir", str(runs.data)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    never = [n for n in RUN_CHECKS if n not in ("fits_in_memory", "perfdb_complete")]
    assert lines[OOM].endswith("fits_in_memory: failed, " + ", ".join(f"{n}: not evaluated" for n in never))
    assert lines[FITS].endswith("all checks passed")
    assert "not passed" not in lines[OOM]


def test_imported_run_that_reports_cuda_out_of_memory_is_skipped_too(tmp_path):
    """A Phantora run folder whose run.log reports a CUDA out-of-memory error (no peak, no trace)."""
    folder = write_run_folder(
        tmp_path / "src",
        RunSpec("W5", "l40s", 2, 1),
        None,
        netconfig=False,
        timeline_bin=False,
        run_log="[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB\n",
    )
    data = tmp_path / "data"
    register(data, [discover(folder)[0][0].spec])
    specs = [s for s in effective_matrix(data) if s.run_id == OOM]
    assert specs[0].source == "import"
    defs = build_defs(data, specs, simulator=AnalyticSimulatorResource())
    instance = ephemeral_with_runs([OOM])
    res = _run(defs, OOM, instance)
    assert res.success
    assert _applicable(_materialized(res)) == {"raw_timeline"}
    assert set(_materialized(res)) == set(RUN_ASSET_NAMES)
    assert _materialized(res)["raw_timeline"]["fits_in_memory"] is False
    assert _steps(res, "STEP_SKIPPED") == set(SKIPPED)
    logs = [m for m in _user_logs(instance, res) if m.startswith("not applicable")]
    assert logs == [
        "not applicable: phantora_l40s_W5_2x1 does not fit in GPU memory (the imported run.log reports a CUDA "
        "out-of-memory error ([rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB))"
    ]


def test_a_succeeding_step_cannot_omit_a_check_result():
    """Why quieting Dagster's "emitted no result" warning hides nothing here: a step that succeeds
    must yield every check result of its asset (Dagster 1.13 fails it otherwise), so the warning
    only ever follows a skipped step."""

    @dg.asset(check_specs=[dg.AssetCheckSpec("c", asset="a", blocking=True)])
    def a():
        yield dg.MaterializeResult()

    res = dg.materialize([a], instance=dg.DagsterInstance.ephemeral(), raise_on_error=False, run_config=QUIET)
    assert not res.success
    failure = next(e for e in res.all_events if e.is_step_failure)
    assert "DagsterStepOutputNotFoundError" in failure.event_specific_data.error.to_string()
