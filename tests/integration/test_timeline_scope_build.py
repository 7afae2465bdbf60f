"""A run past the trace bound goes through every per-run asset with a timeline of scope ``one rank a stage``
(issue 37): its network flows are the full timeline's, flow for flow; its steps are the simulated iterations
(the detector's cut, a step's first collective of any rank, needs every rank's host-local calls), so each
steady step carries the full build's network bytes; the step anatomy reports the hosts whose compute the
timeline holds whole (``simulation.json`` ``compute_hosts``), and none when there is none.

The job: Megatron TP 2 (inside each host of 2 GPUs) x DP 2 x PP 2 on 4 hosts; stage 0 is ranks 0-3 (hosts 1-2),
stage 1 ranks 4-7 (hosts 3-4), run alike, so the scoped timeline holds the compute of ranks 0 and 4, which is
all of hosts 1 and 3 (their ranks 1 and 5 run as 0 and 4), each standing for its stage's two hosts. The second
job, PP 2 x DP 3 on 3 hosts of 2, is not run alike (its ranks of a stage differ) and every host has a rank that
is no stage's first: no host's compute is whole, the anatomy has no rows and reconfig no sweep, each saying why.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest
from fixtures.materialize import ephemeral_with_runs

import phantora_assets.lib.sim.analytic as analytic
from phantora_assets.definitions import build_defs
from phantora_assets.lib.workload.collectives import ONE_RANK_A_STAGE, trace_events_per_step
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.sources import analytic as analytic_source
from phantora_assets.stages import reconfig as reconfig_stage

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
MATRIX = """
[workloads.tiny_pp]
framework = "megatron"
model = {kind = "dense", layers = 4, hidden = 256, ffn_hidden = 512, heads = 8, kv_heads = 4, vocab = 1024}
parallel = {tp = 2, pp = 2, sequence_parallel = true}
train = {seq_len = 128, global_batch = 4, iterations = 3}

[[run]]
workload = "tiny_pp"
gpu = "h100"
nodes = 4
gpus_per_node = 2
"""


def _build(root, spec):
    defs = build_defs(root, [spec])
    res = defs.resolve_job_def("all_runs").execute_in_process(
        partition_key=spec.run_id, instance=ephemeral_with_runs([spec.run_id]), run_config=QUIET, raise_on_error=False
    )
    assert res.success, [e.message for e in res.all_events if e.event_type_value == "STEP_FAILURE"]
    return DataPaths(root).partition_dir(spec.run_id)


def _net(pdir) -> pd.DataFrame:
    cols = ["ts_us", "dur_us", "src_node", "dst_node", "bytes", "comm_id", "step"]
    return pd.read_parquet(pdir / "flows.parquet", columns=cols).sort_values(cols).reset_index(drop=True)


def test_a_scoped_run_builds_with_the_full_runs_traffic_and_its_stage_hosts_anatomy(tmp_path, monkeypatch):
    matrix = tmp_path / "m.toml"
    matrix.write_text(MATRIX)
    (spec,) = load_run_matrix(matrix)
    full = _build(tmp_path / "full", spec)
    monkeypatch.setattr(analytic, "MAX_TRACE_EVENTS", trace_events_per_step(spec) * 3 - 1)
    scoped = _build(tmp_path / "scoped", spec)

    assert json.loads((scoped / "simulation.json").read_text())["timeline_scope"] == ONE_RANK_A_STAGE
    assert "timeline_scope" not in json.loads((full / "simulation.json").read_text())  # every rank: left out
    pd.testing.assert_frame_equal(_net(scoped), _net(full))

    # steps: the simulated iterations, from simulation.json (us), each with the full build's network bytes
    iteration_ns = json.loads((scoped / "simulation.json").read_text())["iteration_ns"]
    steps = pd.read_parquet(scoped / "steps.parquet")
    ends = [sum(iteration_ns[: k + 1]) / 1000 for k in range(3)]
    assert steps["start_us"].tolist() == pytest.approx([0.0, *ends[:2]])
    assert steps["end_us"].tolist() == pytest.approx(ends)
    full_steps = pd.read_parquet(full / "steps.parquet")
    # the steady steps carry the full build's bytes; the warm-up iteration holds the initial broadcasts too,
    # which the detector's first step starts after
    assert steps["network_bytes"].tolist()[1:] == full_steps["network_bytes"].tolist()[1:] == [12_077_152] * 2
    assert int(steps["network_bytes"].sum()) == int(_net(full)["bytes"].sum())
    bins_full, bins = pd.read_parquet(full / "flows_100ms.parquet"), pd.read_parquet(scoped / "flows_100ms.parquet")
    # the 180 s build repeats the chosen steady step: its duration here is the iteration's (713.28 us against
    # the detector's 713.15 us), so the totals agree to the steps' 0.02 %
    assert int(bins["bytes"].sum()) == pytest.approx(int(bins_full["bytes"].sum()), rel=1e-3)

    assert json.loads((scoped / "simulation.json").read_text())["compute_hosts"] == {"host-1": 2, "host-3": 2}
    assert "compute_hosts" not in json.loads((full / "simulation.json").read_text())
    anat = pd.read_parquet(scoped / "step_anatomy.parquet")
    assert set(pd.read_parquet(full / "step_anatomy.parquet")["host"]) == {"host-1", "host-2", "host-3", "host-4"}
    assert set(anat["host"]) == {"host-1", "host-3"} and len(anat) == 2 * 3
    assert (anat["compute_us"] > 0).all()
    total = anat["compute_us"] + anat["exposed_comm_us"] + anat["idle_us"]
    assert total.to_numpy() == pytest.approx(anat["duration_us"].to_numpy(), rel=1e-9)
    # the Perfetto view says what the timeline holds
    holds = analytic_source.write_trace(spec, DataPaths(tmp_path / "scoped")).metadata["trace_holds"]
    assert "one rank a stage" in holds
    assert analytic_source.write_trace(spec, DataPaths(tmp_path / "full")).metadata["trace_holds"] == "every event"


MIXED = """
[workloads.mixed]
framework = "megatron"
model = {kind = "dense", layers = 4, hidden = 256, ffn_hidden = 512, heads = 4, kv_heads = 2, vocab = 1000}
parallel = {tp = 1, pp = 2}
train = {seq_len = 256, micro_batch = 1, grad_accumulation = 3, iterations = 3}

[[run]]
workload = "mixed"
gpu = "h100"
nodes = 3
gpus_per_node = 2
"""


def test_a_scoped_run_with_no_whole_host_has_an_empty_anatomy_and_no_sweep(tmp_path, monkeypatch):
    matrix = tmp_path / "m.toml"
    matrix.write_text(MIXED)
    (spec,) = load_run_matrix(matrix)
    monkeypatch.setattr(analytic, "MAX_TRACE_EVENTS", trace_events_per_step(spec) * 3 - 1)
    pdir = _build(tmp_path, spec)
    paths = DataPaths(tmp_path)

    sim = json.loads((pdir / "simulation.json").read_text())
    assert sim["timeline_scope"] == ONE_RANK_A_STAGE and sim["compute_hosts"] == {}
    assert len(pd.read_parquet(pdir / "step_anatomy.parquet")) == 0
    assert len(pd.read_parquet(pdir / "step_spans.parquet")) == 0
    check = json.loads((paths.run_folder(spec) / "checks.json").read_text())
    assert "holds no host's compute whole" in json.dumps(check)
    # reconfig: the phases and windows (no compute in them), no sweep, and the reason
    assert (pdir / "transition_windows.parquet").is_file() and not (pdir / "reconfig_sweep.parquet").exists()
    result = reconfig_stage.reconfig_stage(spec, paths)
    assert "holds the compute of 0 of the run's 3 hosts" in result.metadata["skipped"]
    assert not (paths.plots_dir(spec) / "reconfig_sweep.png").exists()
