"""Typed sidecar records (records.py) and the run matrix read once per input state (matrix.py)."""

from __future__ import annotations

import json
import shutil

import pytest

from phantora_assets import matrix
from phantora_assets.imported_runs import IMPORT_DIR_ENV, matrix_for
from phantora_assets.paths import DataPaths
from phantora_assets.records import RecordError, SimulationRecord, TraceSummary, read_record, write_record


def test_record_round_trip_is_sorted_indented_json(tmp_path):
    rec = TraceSummary(
        run_id="phantora_h100_W1_2x8",
        trace="timeline.json.gz",
        step_time_us=1234.5,
        network_bytes_per_step=11_500_000_000,
        n_steady_steps=19,
        chosen_step=7,
        n_flows=10,
        n_network_flows=8,
        periods={"00ff": 4},
        compute_busy_us={"host-1": 1.5},
    )
    path = tmp_path / "trace_summary.json"
    write_record(path, rec)
    text = path.read_text()
    assert text == json.dumps(json.loads(text), indent=1, sort_keys=True) + "\n"
    assert read_record(path, TraceSummary) == rec


def test_malformed_record_names_the_file_and_field(tmp_path):
    path = tmp_path / "simulation.json"
    path.write_text('{"step_ms": "fast"}')
    with pytest.raises(RecordError) as exc:
        read_record(path, SimulationRecord)
    assert str(path) in str(exc.value) and "step_ms" in str(exc.value)
    with pytest.raises(RecordError, match="unreadable SimulationRecord"):
        read_record(tmp_path / "absent.json", SimulationRecord)


def test_matrix_parsed_once_per_state_of_its_file(tmp_path, monkeypatch):
    calls = []
    real = matrix.parse_entries
    monkeypatch.setattr(matrix, "parse_entries", lambda *a, **k: calls.append(1) or real(*a, **k))
    f = tmp_path / "runs.toml"
    f.write_text('[[run]]\nworkload = "W4"\ngpu = "l40s"\nnodes = 2\ngpus_per_node = 1\n')
    monkeypatch.setenv(matrix.RUN_MATRIX_ENV, str(f))
    data = tmp_path / "data"
    first = matrix_for(data)
    for _ in range(50):
        assert matrix_for(data) == first
    assert len(calls) == 1
    f.write_text(f.read_text() + '\n[[run]]\nworkload = "W4"\ngpu = "l40s"\nnodes = 4\ngpus_per_node = 1\n')
    assert [s.layout for s in matrix_for(data)] == ["2x1", "4x1"]
    assert len(calls) == 2


def test_import_dir_changes_are_seen_at_once(tmp_path, monkeypatch):
    """Imports are not cached: a run folder added, edited or removed under $PHANTORA_ASSETS_IMPORT_DIR
    shows in the next matrix_for."""
    from fixtures.run_folders import analytic, write_run_folder

    src = tmp_path / "src"
    monkeypatch.setenv(IMPORT_DIR_ENV, str(src))
    src.mkdir()
    data = tmp_path / "data"
    base = {s.run_id for s in matrix_for(data)}
    spec, raw, _ = analytic(matrix.RunSpec("W4", "h100", 2, 1))
    folder = write_run_folder(src, spec, raw, run_log=None)
    assert {s.run_id for s in matrix_for(data)} - base == {spec.run_id}
    netconfig = folder / "config" / "netconfig.toml"
    netconfig.write_text(netconfig.read_text().replace("host_bw = 800", "host_bw = 100"))
    assert dict(next(s for s in matrix_for(data) if s.run_id == spec.run_id).topology)["host_bw_gbps"] == 100
    shutil.rmtree(folder)
    assert {s.run_id for s in matrix_for(data)} == base


def test_unreadable_checks_json_is_named_and_excludes_only_that_run(tmp_path):
    from phantora_assets.checks import read_checks
    from phantora_assets.stages.dataset import run_status_rows

    paths = DataPaths(tmp_path)
    a, b = matrix.load_run_matrix()[:2]
    paths.run_folder(a).mkdir(parents=True)
    (paths.run_folder(a) / "checks.json").write_text('{"fits_in_memory": {"status": "pass')
    with pytest.raises(RecordError, match="checks.json: invalid checks record"):
        read_checks(paths.run_folder(a))
    included, rows = run_status_rows([a, b], paths)
    assert included == {}
    status = {r[0]: r[1:] for r in rows}
    assert status[a.run_id][0] == "excluded" and "checks.json" in status[a.run_id][1]
    assert status[b.run_id] == ("excluded", "not built")


def test_simulation_record_from_before_its_fields_is_refused(tmp_path):
    """A simulation.json without the FLOPs and memory fields never becomes a row with nulls."""
    path = tmp_path / "simulation.json"
    path.write_text(
        '{"compute_ms_per_step": 1.0, "exposed_comm_ms_per_step": 0.1, "kernels_from_perf_db": 0,'
        ' "kernels_per_step": 10, "perf_db_fraction": 0.0, "step_ms": 1.1}\n'
    )
    with pytest.raises(RecordError, match="simulation.json: invalid SimulationRecord record.*missing required field"):
        read_record(path, SimulationRecord)


def test_a_scoped_simulation_record_without_its_whole_hosts_is_refused(tmp_path):
    """Issue 37: step_anatomy of a timeline of scope one rank a stage reports the hosts simulation.json's
    compute_hosts names; a record written before the field is refused (rebuild raw_timeline), never read as
    the hosts of the stages' first ranks. An every-rank record has no such field: every host."""
    from phantora_assets.lib.workload.collectives import run_spec_of
    from phantora_assets.stages.simulation import compute_hosts_of

    model = {"kind": "dense", "layers": 2, "hidden": 256, "ffn_hidden": 512, "heads": 4, "kv_heads": 2, "vocab": 1000}
    table = {"framework": "megatron", "model": model, "parallel": {"tp": 1}, "train": {"seq_len": 256}}
    table["train"] |= {"micro_batch": 1, "grad_accumulation": 1}
    spec = run_spec_of(table, 2, 2, "h100", "w")
    paths = DataPaths(tmp_path)
    path = paths.partition_dir(spec.run_id) / "simulation.json"
    path.parent.mkdir(parents=True)
    fields = dict(step_ms=1.0, compute_ms_per_step=1.0, exposed_comm_ms_per_step=0.0, perf_db_fraction=0.0)
    fields |= dict(kernels_per_step=1, kernels_from_perf_db=0, iteration_ns=[1], peak_memory_gib=1.0, card_gib=80.0)
    fields |= dict(flops_per_step=1.0)
    write_record(path, SimulationRecord(**fields))
    assert "compute_hosts" not in path.read_text() and compute_hosts_of(spec, paths) is None
    write_record(path, SimulationRecord(**fields, timeline_scope="one rank a stage", compute_hosts={}))
    assert json.loads(path.read_text())["compute_hosts"] == {} and compute_hosts_of(spec, paths) == {}
    write_record(path, SimulationRecord(**fields, timeline_scope="one rank a stage"))
    with pytest.raises(RecordError, match="scoped timeline without compute_hosts.*rebuild raw_timeline"):
        compute_hosts_of(spec, paths)
