"""Issue 13, finding 4: the trace caps (longest text without a line break, largest decompressed
trace) are set per run through Dagster's config (the ``data`` resource) or for every run by the
environment; a trace past the cap fails its partition with the rule and the cap named, and the
cap in force is restored after the step. Real run folders, real materializations."""

from __future__ import annotations

import gzip
from pathlib import Path

import dagster as dg
import pytest
from fixtures.materialize import ephemeral_with_runs
from fixtures.run_folders import analytic, megatron_log, write_run_folder

from phantora_assets import definitions as d
from phantora_assets.imported_runs import effective_matrix, register
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.phantora import trace_batches
from phantora_assets.lib.phantora.run_folder import discover
from phantora_assets.resources import MAX_LINE_MIB_ENV, AnalyticSimulatorResource, DataRoot, data_root_from_env

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
W1 = "phantora_a100_40g_W1_2x2"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A data root with one imported run whose first event holds 8 MiB of spaces (valid JSON, one
    line of 8 MiB; the reader buffers up to a batch plus the cap before it refuses)."""
    tmp = tmp_path_factory.mktemp("caps")
    spec, raw, its = analytic(W1)
    folder = write_run_folder(tmp / "src", spec, raw, run_log=megatron_log(its, 4, 16000.0))
    trace = folder / "timeline.json.gz"
    text = gzip.decompress(trace.read_bytes())
    brace = text.index(b"{")
    trace.write_bytes(gzip.compress(text[: brace + 1] + b" " * (8 << 20) + text[brace + 1 :]))
    root = tmp / "data"
    register(root, [discover(folder)[0][0].spec])
    return root


def _materialize(data: Path, **caps: int) -> dg.ExecuteInProcessResult:
    all_assets, run_assets = d.assets_for(effective_matrix(data))
    return dg.materialize(
        all_assets,
        selection=run_assets[:3],  # raw_timeline, chrome_trace, validated_flows
        partition_key=W1,
        raise_on_error=False,
        run_config=QUIET,
        instance=ephemeral_with_runs([W1]),
        resources={"data": DataRoot(data_dir=str(data), **caps), "simulator": AnalyticSimulatorResource()},
    )


def test_a_line_past_the_configured_cap_fails_the_partition_naming_the_rule(data):
    res = _materialize(data, max_trace_line_mib=1)
    assert not res.success
    failure = next(e for e in res.all_events if e.is_step_failure)
    assert failure.step_key == "chrome_trace"  # the import validates the trace before installing it
    error = failure.event_specific_data.error.to_string()
    assert "line too long" in error and f"more than {1 << 20} bytes without a line break" in error, error
    assert trace_batches.MAX_LINE_BYTES == 256 << 20  # restored after the step


def test_the_same_trace_passes_under_the_default_cap(data):
    res = _materialize(data)
    assert res.success
    checks = {e.check_name: e.passed for e in res.get_asset_check_evaluations()}
    assert checks["ring_bytes_match"] and checks["steps_match"]


def test_the_cap_is_a_field_of_the_data_resource_in_the_run_config(data):
    """What the launchpad edits: resources.data.config.max_trace_line_mib of the code location."""
    job = d.build_defs(data, effective_matrix(data)).resolve_job_def("all_runs")
    res = job.execute_in_process(
        partition_key=W1,
        run_config={**QUIET, "resources": {"data": {"config": {"data_dir": str(data), "max_trace_line_mib": 1}}}},
        instance=ephemeral_with_runs([W1]),
        raise_on_error=False,
    )
    assert not res.success
    failure = next(e for e in res.all_events if e.is_step_failure)
    assert "without a line break" in failure.event_specific_data.error.to_string()


def test_the_environment_sets_the_cap_and_refuses_a_bad_value(monkeypatch, tmp_path):
    monkeypatch.setenv(MAX_LINE_MIB_ENV, "512")
    assert data_root_from_env(tmp_path).max_trace_line_mib == 512
    for bad in ("0", "-1", "1.5", "lots"):
        monkeypatch.setenv(MAX_LINE_MIB_ENV, bad)
        with pytest.raises(RunMatrixError, match=f"{MAX_LINE_MIB_ENV} must be a positive integer"):
            data_root_from_env(tmp_path)
    bad = DataRoot(data_dir=str(tmp_path), max_trace_inflated_gib=0)
    with pytest.raises(ValueError, match="max_trace_inflated_gib must be a positive integer"), bad.trace_limits():
        pass
