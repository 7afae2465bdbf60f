"""Typed sidecar records (records.py) and the run matrix read once per input state (matrix.py)."""

from __future__ import annotations

import json

import pytest

from phantora_assets import matrix
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


def test_matrix_parsed_once_per_input_state(tmp_path, monkeypatch):
    calls = []
    real = matrix.parse_entries
    monkeypatch.setattr(matrix, "parse_entries", lambda *a, **k: calls.append(1) or real(*a, **k))
    f = tmp_path / "runs.toml"
    f.write_text('[[run]]\nworkload = "W4"\ngpu = "l40s"\nnodes = 2\ngpus_per_node = 1\n')
    monkeypatch.setenv(matrix.RUN_MATRIX_ENV, str(f))
    data = tmp_path / "data"
    first = matrix.matrix_for(data)
    for _ in range(50):
        assert matrix.matrix_for(data) == first
    assert len(calls) == 1
    f.write_text(f.read_text() + '\n[[run]]\nworkload = "W4"\ngpu = "l40s"\nnodes = 4\ngpus_per_node = 1\n')
    assert [s.layout for s in matrix.matrix_for(data)] == ["2x1", "4x1"]
    assert len(calls) == 2
