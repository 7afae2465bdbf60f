"""Removing a run from the dataset is only ever explicit: an import never drops the runs of
another source. A run built from the watched folder ($PHANTORA_ASSETS_IMPORT_DIR) stays a run of
the data root when a later ``phantora-assets import`` (or ``build``) runs without that variable
set; ``phantora-assets forget`` is the one way out. Real folders, real builds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from fixtures.run_folders import analytic, deepspeed_log, write_run_folder

from phantora_assets.assets.common import RUN_PARTITIONS
from phantora_assets.cli import main
from phantora_assets.imported_runs import IMPORT_DIR_ENV, effective_matrix, read_registry
from phantora_assets.lib.run.spec import RunSpec

WATCHED = RunSpec("W4", "h100", 2, 1)  # dropped into the watched folder; not in the shipped matrix
CLI = RunSpec("W4", "l40s", 2, 1)  # imported later with `phantora-assets import`, the variable unset


def _folder(root: Path, spec: RunSpec) -> Path:
    s, raw, its = analytic(spec)
    return write_run_folder(root, s, raw, run_log=deepspeed_log(its, 2))


def _status(data: Path) -> pd.DataFrame:
    return pd.read_csv(data / "phantora_v0" / "run_status.csv").set_index("run_id")


def test_a_cli_import_keeps_the_runs_of_the_watched_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    watched, other, data = tmp_path / "watched", tmp_path / "other", tmp_path / "data"
    _folder(watched, WATCHED)
    _folder(other, CLI)
    monkeypatch.setenv(IMPORT_DIR_ENV, str(watched))
    assert main(["build", "--data-dir", str(data), "--run", WATCHED.run_id, "--no-plots", "--quiet"]) == 0
    assert _status(data).loc[WATCHED.run_id, "status"] == "included"

    monkeypatch.delenv(IMPORT_DIR_ENV)
    assert main(["import", str(other), "--data-dir", str(data), "--quiet"]) == 0
    status = _status(data)
    assert status.loc[WATCHED.run_id, "status"] == "included", status.to_dict()
    assert status.loc[CLI.run_id, "status"] == "included"
    runs = pd.read_csv(data / "phantora_v0" / "runs.csv")
    assert {WATCHED.run_id, CLI.run_id} <= set(runs["run_id"])
    # the registry holds both, the watched one with the watched folder's path
    reg = {s.run_id: s for s in read_registry(data)}
    assert Path(reg[WATCHED.run_id].path) == (watched / "traces" / "h100" / "W4_2x1").resolve()
    assert CLI.run_id in reg
    capsys.readouterr()
    assert main(["runs", "--data-dir", str(data)]) == 0
    assert any(ln.startswith(WATCHED.run_id) for ln in capsys.readouterr().out.splitlines())

    # explicit removal: `forget` takes it out of the registry, and the next dataset leaves it out
    with dg.DagsterInstance.from_config(str(data / "dagster_home")) as instance:
        assert WATCHED.run_id in instance.get_dynamic_partitions(RUN_PARTITIONS)
    assert main(["forget", WATCHED.run_id, "--data-dir", str(data)]) == 0
    assert WATCHED.run_id not in {s.run_id for s in effective_matrix(data)}
    with dg.DagsterInstance.from_config(str(data / "dagster_home")) as instance:
        assert WATCHED.run_id not in instance.get_dynamic_partitions(RUN_PARTITIONS)
        assert CLI.run_id in instance.get_dynamic_partitions(RUN_PARTITIONS)
    assert main(["build", "--data-dir", str(data), "--run", CLI.run_id, "--no-plots", "--quiet"]) == 0
    status = _status(data)
    assert WATCHED.run_id not in status.index and status.loc[CLI.run_id, "status"] == "included"


def test_forget_refuses_a_run_that_is_not_imported_and_one_still_in_the_watched_folder(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    watched, data = tmp_path / "watched", tmp_path / "data"
    _folder(watched, WATCHED)
    assert main(["forget", "phantora_a100_40g_W1_2x2", "--data-dir", str(data)]) == 2
    assert "not an imported run" in capsys.readouterr().err
    monkeypatch.setenv(IMPORT_DIR_ENV, str(watched))
    assert main(["import", str(watched), "--data-dir", str(data), "--no-build"]) == 0
    assert main(["forget", WATCHED.run_id, "--data-dir", str(data)]) == 2
    err = capsys.readouterr().err
    assert f"${IMPORT_DIR_ENV}" in err and "remove the folder" in err
    assert WATCHED.run_id in {s.run_id for s in read_registry(data)}


def test_the_watched_folder_runs_are_registered_by_an_import(tmp_path: Path, monkeypatch) -> None:
    """The rule, without a build: after the watched folder's runs were seen by a build (here
    ``import --no-build`` of another folder with the variable set), the data root's matrix keeps them."""
    watched, other, data = tmp_path / "watched", tmp_path / "other", tmp_path / "data"
    _folder(watched, WATCHED)
    _folder(other, CLI)
    monkeypatch.setenv(IMPORT_DIR_ENV, str(watched))
    assert main(["import", str(other), "--data-dir", str(data), "--no-build"]) == 0
    monkeypatch.delenv(IMPORT_DIR_ENV)
    ids = {s.run_id for s in effective_matrix(data)}
    assert {WATCHED.run_id, CLI.run_id} <= ids


def test_a_run_whose_folder_was_deleted_stays_as_built_and_rebuilds_from_the_data_roots_copy(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """The folder of a watched run is deleted; a later build of that run builds it from the data
    root's copy (run.log, timeline.bin, config/, the validated timeline.json.gz): same tables to the
    byte, still included. Without the copy's trace the build fails naming the folder and the way out
    (``forget``), and the refused build leaves the run's checks as they were."""
    watched, data = tmp_path / "watched", tmp_path / "data"
    src = _folder(watched, WATCHED)
    monkeypatch.setenv(IMPORT_DIR_ENV, str(watched))
    build = ["build", "--data-dir", str(data), "--run", WATCHED.run_id, "--no-plots", "--quiet"]
    assert main(build) == 0
    part = data / "partitions" / WATCHED.run_id
    before = {p.name: p.read_bytes() for p in part.glob("*.parquet")}
    assert {"flows.parquet", "flows_100ms.parquet", "windows.parquet"} <= set(before)

    shutil.rmtree(src)
    assert main(build) == 0
    assert _status(data).loc[WATCHED.run_id, "status"] == "included"
    assert {p.name: p.read_bytes() for p in part.glob("*.parquet")} == before

    folder = data / "traces" / "h100" / "W4_2x1"
    (folder / "timeline.json.gz").unlink()
    checks = (folder / "checks.json").read_text()
    capsys.readouterr()
    assert main(build) == 1  # --quiet too names the failed run and why
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith(WATCHED.run_id))
    assert "FAILED: raw_timeline: " in line and f"imported run folder {src} does not exist" in line, line
    after = json.loads((folder / "checks.json").read_text())
    kept = {k: v for k, v in json.loads(checks).items()}
    assert {k: after[k] for k in kept} == kept  # nothing reset by the refused build: the failure is added
    assert [k for k in after if k not in kept] == ["step_failed:raw_timeline"], after.keys()
    why = _status(data).loc[WATCHED.run_id, "reason"]
    assert "raw_timeline" in why and "does not exist" in why, why

    # `runs` gives the reason run_status.csv gives, the failed step once
    assert main(["runs", "--data-dir", str(data)]) == 0
    (row,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(WATCHED.run_id)]
    assert row.endswith(why) and row.count("does not exist") == 1, row


def test_inputs_that_change_after_the_folder_is_gone_rebuild_from_the_data_roots_copy(tmp_path: Path, monkeypatch):
    """Another bin width (any input but the gone folder's files) rebuilds the run from the data
    root's copy: the copy of the trace is the run's source, not an output to invalidate."""
    watched, data = tmp_path / "watched", tmp_path / "data"
    src = _folder(watched, WATCHED)
    monkeypatch.setenv(IMPORT_DIR_ENV, str(watched))
    build = ["build", "--data-dir", str(data), "--run", WATCHED.run_id, "--no-plots", "--quiet"]
    assert main(build) == 0
    shutil.rmtree(src)
    assert main([*build, "--bin-s", "0.2"]) == 0
    assert _status(data).loc[WATCHED.run_id, "status"] == "included"
    flows = pd.read_parquet(data / "partitions" / WATCHED.run_id / "flows_100ms.parquet")
    assert len(flows) and main(build) == 0  # and back to the matrix's width, from the same copy
    assert _status(data).loc[WATCHED.run_id, "status"] == "included"


def _inputs(copy: Path) -> dict[Path, bytes]:
    """The data root's copy of a run folder, less the check records (which record the refusal)."""
    return {
        p.relative_to(copy): p.read_bytes()
        for p in copy.rglob("*")
        if p.is_file() and p.name not in ("checks.json", "checks.txt")
    }


@pytest.mark.parametrize(
    "half",
    [
        pytest.param({}, id="an empty folder (a copy just started)"),
        pytest.param({"run.log": "[rank0] iteration 1/6\n"}, id="run.log only, no trace, no out-of-memory error"),
    ],
)
def test_a_half_copied_folder_at_the_registered_path_changes_nothing_of_the_built_run(
    tmp_path: Path, monkeypatch, half: dict[str, str]
) -> None:
    """A folder at the registered path that cannot be built from (no trace, and no run.log saying
    the run did not fit) is refused before raw_timeline invalidates or copies anything: the data
    root's copy stays whole, and once the folder is gone again the run builds from that copy."""
    watched, data = tmp_path / "watched", tmp_path / "data"
    src = _folder(watched, WATCHED)
    monkeypatch.setenv(IMPORT_DIR_ENV, str(watched))
    build = ["build", "--data-dir", str(data), "--run", WATCHED.run_id, "--no-plots", "--quiet"]
    assert main(build) == 0
    copy = data / "traces" / "h100" / "W4_2x1"
    kept = _inputs(copy)
    part = data / "partitions" / WATCHED.run_id
    tables = {p.name: p.read_bytes() for p in part.glob("*.parquet")}
    shutil.rmtree(src)
    src.mkdir(parents=True)
    for name, text in half.items():
        (src / name).write_text(text)
    assert main(build) == 1
    assert "missing trace" in _status(data).loc[WATCHED.run_id, "reason"]
    assert _inputs(copy) == kept
    assert {p.name: p.read_bytes() for p in part.glob("*.parquet")} == tables
    shutil.rmtree(src)
    assert main(build) == 0
    assert _status(data).loc[WATCHED.run_id, "status"] == "included"
