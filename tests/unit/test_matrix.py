"""The run matrix: partitions, run ids, and invalid entries rejected before anything runs."""

from __future__ import annotations

import pytest
from fixtures.paths import published_rows

from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.matrix import load_run_matrix, parse_entries


def test_matrix_ships_every_published_run():
    ids = {s.run_id for s in load_run_matrix()}
    assert len(ids) == 30
    assert {r["run_id"] for r in published_rows()} <= ids


def test_run_id_and_parallelism_follow_published_names():
    by_id = {s.run_id: s for s in load_run_matrix()}
    for row in published_rows():
        assert by_id[row["run_id"]].parallelism == row["parallelism"]
        assert by_id[row["run_id"]].published == row["status"]


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ({"workload": "W9", "gpu": "l40s", "nodes": 2, "gpus_per_node": 1}, "unknown workload 'W9'"),
        ({"workload": "W1", "gpu": "v100", "nodes": 2, "gpus_per_node": 1}, "unknown GPU 'v100'"),
        ({"workload": "W1", "gpu": "l40s", "nodes": 1, "gpus_per_node": 1}, "tensor_parallel_size=2"),
        ({"workload": "W2", "gpu": "a100_40g", "nodes": 3, "gpus_per_node": 1}, "num_moe_experts=8"),
        ({"workload": "W1", "gpu": "l40s", "nodes": 2}, "missing keys ['gpus_per_node']"),
        ({"workload": "W1", "gpu": "l40s", "nodes": 2, "gpus_per_node": 1, "source": "slurm"}, "unknown source"),
    ],
)
def test_invalid_entry_names_entry_and_rule(entry, fragment):
    with pytest.raises(RunMatrixError) as err:
        parse_entries([entry], "my_runs.toml")
    assert "my_runs.toml [[run]] #1" in str(err.value)
    assert fragment in str(err.value)


def test_user_matrix_file(tmp_path):
    f = tmp_path / "runs.toml"
    f.write_text('[[run]]\nworkload = "W4"\ngpu = "h100"\nnodes = 16\ngpus_per_node = 8\n')
    (spec,) = load_run_matrix(f)
    assert spec.run_id == "phantora_h100_W4_16x8"
    assert spec.dp == 128


def test_duplicate_run_rejected():
    e = {"workload": "W4", "gpu": "l40s", "nodes": 2, "gpus_per_node": 1}
    with pytest.raises(RunMatrixError, match="duplicate run_id phantora_l40s_W4_2x1"):
        parse_entries([e, e])


@pytest.mark.slow
def test_cli_reports_invalid_matrix_without_traceback(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad_runs.toml"
    bad.write_text('[[run]]\nworkload = "W1"\ngpu = "a100_40g"\nnodes = 1\ngpus_per_node = 1\n')
    env = {**__import__("os").environ, "PHANTORA_ASSETS_RUN_MATRIX": str(bad)}
    out = subprocess.run(
        [sys.executable, "-m", "phantora_assets.cli", "runs", "--data-dir", str(tmp_path / "d")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "bad_runs.toml [[run]] #1" in out.stderr and "tensor_parallel_size=2" in out.stderr
