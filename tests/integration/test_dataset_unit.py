"""The dataset is one unit (issue 13, finding 2): every table of one export is swapped in at once,
every table is written even when empty, and a run built from an older run-matrix entry is named as
stale instead of being exported. Real Dagster runs of a two-run matrix, real files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from fixtures.materialize import ephemeral_with_runs

from phantora_assets.definitions import build_defs
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store import export as export_writer
from phantora_assets.stages import dataset as dataset_stage

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
A = RunSpec("W4", "l40s", 2, 1)
B = RunSpec("W4", "h100", 2, 1)
TABLES = [f"{t}.csv" for t in ("runs", "flows_100ms", "windows")] + [
    "runs.parquet",
    *(f"{t}/{s.run_id}" for t in ("flows_100ms", "windows") for s in (A, B)),  # its part-<h>.parquet
    "run_status.csv",
    "README.md",
]


def _build(root: Path, specs: list[RunSpec], runs: list[RunSpec] | None = None) -> dg.Definitions:
    defs = build_defs(root, specs)
    for spec in runs if runs is not None else specs:
        res = defs.resolve_job_def("all_runs").execute_in_process(
            partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET
        )
        assert res.success
    return defs


def _export(defs: dg.Definitions) -> None:
    res = defs.resolve_job_def("dataset").execute_in_process(instance=dg.DagsterInstance.ephemeral(), run_config=QUIET)
    assert res.success


def _digests(d: Path) -> dict[str, str]:
    def one(p: Path) -> bytes:
        if p.is_dir():
            (p,) = p.glob("part-*.parquet")
        return p.name.encode() + p.read_bytes()

    return {n: hashlib.sha256(one(d / n)).hexdigest() for n in TABLES}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("unit") / "data"
    _export(_build(root, [A, B]))
    return root


def test_a_failed_export_leaves_the_previous_dataset_whole(root, monkeypatch):
    d = root / "phantora_v0"
    before = _digests(d)
    real = export_writer.TableWriter.add_run
    calls = []

    def failing(self, run_id, batches):
        calls.append(self.name)
        if self.name == "windows":  # after runs and flows_100ms were written
            raise OSError(28, "No space left on device")
        return real(self, run_id, batches)

    monkeypatch.setattr(export_writer.TableWriter, "add_run", failing)
    with pytest.raises(OSError):
        dataset_stage.export_dataset([A], dataset_stage_paths(root))
    assert calls == ["runs", "flows_100ms", "windows"]
    assert _digests(d) == before  # not a mix of two exports
    assert not [p for p in root.iterdir() if p.name.startswith(".phantora_v0.") and p.name != ".phantora_v0.gens"]
    assert not [p for p in (root / ".phantora_v0.gens").iterdir() if p.name.endswith(".tmp")]  # no staging left


def test_every_table_is_written_even_when_no_run_is_included(root, tmp_path):
    other = tmp_path / "other"
    import shutil

    shutil.copytree(root, other)
    result = dataset_stage.export_dataset([RunSpec("W4", "a100_40g", 2, 1)], dataset_stage_paths(other))  # not built
    assert result.included == [] and result.outcome.passed
    for name in ("runs.csv", "flows_100ms.csv", "windows.csv"):
        assert len(pd.read_csv(other / "phantora_v0" / name)) == 0, name  # no rows of the earlier export


def test_a_run_built_from_an_older_matrix_entry_is_named_stale(root, tmp_path):
    import shutil

    other = tmp_path / "stale"
    shutil.copytree(root, other)
    changed = RunSpec("W4", "l40s", 2, 1, topology=(("host_bw_gbps", 100),))  # same run_id as A
    result = dataset_stage.export_dataset([changed, B], dataset_stage_paths(other))
    assert result.included == [B.run_id]
    assert result.excluded[A.run_id].startswith("stale: built from another entry, network")
    status = (other / "phantora_v0" / "run_status.csv").read_text()
    assert f'{A.run_id},excluded,"stale: built from another entry, network' in status
    # rebuilding the run with the new entry brings it back
    _export(_build(other, [changed, B], runs=[changed]))
    assert set(pd.read_csv(other / "phantora_v0" / "runs.csv")["run_id"]) == {A.run_id, B.run_id}


def dataset_stage_paths(root: Path):
    from phantora_assets.paths import DataPaths

    return DataPaths(root)


def test_rebuilding_only_the_raw_timeline_from_a_changed_entry_does_not_pass_old_tables_as_current(root, tmp_path):
    """raw_timeline rewrites run_spec.json; the flows, windows and run summary below it were built
    from the old entry, so they are removed and their checks shown as not evaluated: the export
    names the run instead of exporting the old tables under the new entry."""
    import shutil

    other = tmp_path / "upstream_only"
    shutil.copytree(root, other)
    changed = RunSpec("W4", "l40s", 2, 1, topology=(("host_bw_gbps", 100),))  # same run_id as A
    defs = build_defs(other, [changed, B])
    res = defs.resolve_implicit_global_asset_job_def().execute_in_process(
        partition_key=A.run_id,
        asset_selection=[dg.AssetKey("raw_timeline")],
        instance=ephemeral_with_runs([A.run_id]),
        run_config=QUIET,
    )
    assert res.success
    pdir = other / "partitions" / A.run_id
    assert sorted(p.name for p in pdir.iterdir()) == [
        "raw_timeline.parquet",
        "run_log.json",
        "run_spec.json",
        "simulation.json",
    ]
    assert not (other / A.trace_dir / "timeline.json.gz").exists()
    checks = json.loads((other / A.trace_dir / "checks.json").read_text())
    assert checks["fits_in_memory"]["status"] == "passed"
    assert checks["ring_bytes_match"]["status"] == "not evaluated"
    assert "raw_timeline was rebuilt" in checks["ring_bytes_match"]["message"]
    result = dataset_stage.export_dataset([changed, B], dataset_stage_paths(other))
    assert result.included == [B.run_id]
    assert "ring_bytes_match: not evaluated" in result.excluded[A.run_id]
    # the same entry again: nothing is invalidated (the tables below stay)
    _build(other, [changed, B], runs=[changed])
    before = {p.name: p.stat().st_mtime_ns for p in pdir.iterdir()}
    res = defs.resolve_implicit_global_asset_job_def().execute_in_process(
        partition_key=A.run_id,
        asset_selection=[dg.AssetKey("raw_timeline")],
        instance=ephemeral_with_runs([A.run_id]),
        run_config=QUIET,
    )
    assert res.success
    after = {p.name: p.stat().st_mtime_ns for p in pdir.iterdir()}
    assert set(after) == set(before) and after["run_summary.parquet"] == before["run_summary.parquet"]
    result = dataset_stage.export_dataset([changed, B], dataset_stage_paths(other))
    assert result.included == sorted([A.run_id, B.run_id])


@pytest.mark.parametrize(
    ("table", "column", "value", "rule"),
    [
        ("flows_100ms", "bytes", -1, "greater_than_or_equal_to(0)"),
        ("windows", "window_start_s", -1.0, "greater_than_or_equal_to(0)"),
    ],
)
def test_a_contract_violation_in_the_second_run_names_that_run_s_file(root, tmp_path, table, column, value, rule):
    """The runs' batches are validated together (one pandera call for many small runs); a row that
    breaks the contract still fails the export naming its own run's file and the rule, not the first run's."""
    import shutil

    import pyarrow.parquet as pq

    other = tmp_path / "broken"
    shutil.copytree(root, other)
    first, second = sorted([A.run_id, B.run_id])
    f = other / "partitions" / second / f"{table}.parquet"
    t = pq.read_table(f)
    col = t.column(column).to_pylist()
    col[len(col) // 2] = value
    pq.write_table(
        t.set_column(t.schema.get_field_index(column), column, pa_array(col, t.schema.field(column).type)), f
    )
    before = _digests(other / "phantora_v0")
    result = dataset_stage.export_dataset([A, B], dataset_stage_paths(other))
    assert not result.outcome.passed and result.outcome.name == "dataset_contract"
    assert result.outcome.message.startswith(f"{f}: 1 violation(s) of the {table} contract: {column}: {rule}")
    assert first not in result.outcome.message
    assert _digests(other / "phantora_v0") == before  # nothing published


def pa_array(values, type_):
    import pyarrow as pa

    return pa.array(values, type=type_)
