"""Bounded memory for the per-pair bins (issue 26 item 6): a layout the matrix accepts whose dense
per-pair bin table would be too large (a 1024 x 1 run: 1800 bins x 1,047,552 pairs, 14 GiB a
matrix) is refused before it is simulated, with the sizes and the rule, instead of being simulated
and then dying on the allocation; the shipped layouts are far inside the bound."""

from __future__ import annotations

import pytest
from fixtures.materialize import ephemeral_with_runs

from phantora_assets.definitions import build_defs
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.run.spec import RunSpec, validate
from phantora_assets.lib.store import bin_table
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.sources.base import SourceContext
from phantora_assets.stages import simulation

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def test_the_rule_counts_bins_times_ordered_pairs():
    assert bin_table.dense_cells(1024, 180.0, 0.1) == 1800 * 1024 * 1023 == 1_885_593_600
    assert bin_table.dense_cells(128, 180.0, 0.1) == 1800 * 128 * 127
    assert bin_table.dense_cells(4, 180.0, 0.01) == 18_000 * 12
    why = bin_table.dense_table_rule(1024, 180.0, 0.1)
    assert why is not None and why.startswith("1800 bins x 1,047,552 ordered node pairs = 1,885,593,600 cells")
    assert "more than the 67,108,864" in why and "14.0 GiB" in why
    assert bin_table.dense_table_rule(128, 180.0, 0.1) is None  # 29 M cells: 128 x 8 layouts are built
    assert bin_table.dense_table_rule(193, 180.0, 0.1) is None  # 1800 x 193 x 192 = 66.7 M
    assert bin_table.dense_table_rule(194, 180.0, 0.1) is not None  # 67.4 M > 2**26
    assert bin_table.dense_table_rule(256, 180.0, 0.1) is not None  # 118 M: 3.1 GiB peak measured
    assert bin_table.dense_table_rule(256, 180.0, 1.0) is None  # wider bins, fewer cells


def test_every_shipped_run_is_inside_the_bound():
    specs = load_run_matrix()
    assert specs and all(bin_table.dense_table_rule(s.n_nodes, 180.0, s.bin_s) is None for s in specs)


def test_the_bound_can_be_set(monkeypatch):
    monkeypatch.setenv(bin_table.MAX_CELLS_ENV, "1000")
    assert "more than the 1,000 the binned stages" in bin_table.dense_table_rule(4, 180.0, 0.1)
    monkeypatch.setenv(bin_table.MAX_CELLS_ENV, str(2**31))
    assert bin_table.dense_table_rule(1024, 180.0, 0.1) is None  # 1.89 G cells <= 2**31: a host with the memory
    monkeypatch.setenv(bin_table.MAX_CELLS_ENV, "not a number")
    assert bin_table.max_dense_cells() == bin_table.MAX_DENSE_CELLS


def test_a_1024_node_run_the_matrix_accepts_is_refused_before_simulating(tmp_path):
    spec = RunSpec("W4", "h100", 1024, 1)
    validate(spec, "t")  # the matrix accepts the layout
    paths = DataPaths(tmp_path / "data")
    with pytest.raises(RunMatrixError, match=r"run phantora_h100_W4_1024x1 \(1024x1\): bin table too large: 1800 bins"):
        simulation.raw_timeline(spec, paths, SourceContext())
    assert not paths.partition_dir(spec.run_id).exists() or not any(paths.partition_dir(spec.run_id).iterdir())


def test_the_partition_fails_at_raw_timeline_naming_the_rule(tmp_path):
    spec = RunSpec("W4", "h100", 1024, 1)
    defs = build_defs(tmp_path / "data", [spec])
    res = defs.resolve_job_def("all_runs").execute_in_process(
        partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET, raise_on_error=False
    )
    assert not res.success
    failures = [e for e in res.all_events if e.event_type_value == "STEP_FAILURE"]
    assert [e.step_key for e in failures] == ["raw_timeline"]
    err = failures[0].event_specific_data.error
    text = err.message + (err.cause.message if err.cause is not None else "")
    assert "bin table too large" in text and "1,885,593,600 cells" in text
