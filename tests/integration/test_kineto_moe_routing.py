"""Issue 39 item 11 (second half), through ``phantora-assets import``: a profiled MoE job whose all-to-all
splits vary with routing, its iterations jittered by up to +-10 %, enters the dataset with the steps its
``ProfilerStep#N`` markers give and the bytes counted by hand (``fixtures.kineto_traces.moe_profile``).
Before, ``validated_flows`` failed its blocking checks ``steps_match`` and ``steady_steps_stable``."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from fixtures.kineto_traces import MOE_GPUS_PER_NODE, moe_profile, write_traces

from phantora_assets.checks import RUN_CHECKS, read_checks
from phantora_assets.cli import main
from phantora_assets.imported_runs import read_registry
from phantora_assets.paths import DataPaths

STEPS = 10
RUN = "moe_2x2"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("kineto_moe")
    prof = moe_profile(STEPS, seed=1, jitter=0.10)
    write_traces(root / "moe", prof.traces)
    data = root / "data"
    args = ["import", str(root / "moe"), "--gpus-per-node", str(MOE_GPUS_PER_NODE), "--data-dir", str(data)]
    assert main([*args, "--quiet"]) == 0
    return data, prof


def test_the_routed_jittered_profile_enters_the_dataset_at_its_markers(built):
    data, prof = built
    paths = DataPaths(data)
    (spec,) = read_registry(data)
    checks = read_checks(paths.run_folder(spec))
    assert all(checks[c]["status"] == "passed" for c in RUN_CHECKS), checks
    steps = pd.read_parquet(paths.partition_dir(RUN) / "steps.parquet")
    assert steps["start_us"].tolist() == pytest.approx(prof.starts_us[:-1], abs=1e-3)
    steady = steps[steps["steady"]]
    assert steady["step"].tolist() == list(range(1, STEPS))
    assert steady["network_bytes"].tolist() == prof.net_per_step[1:]
    median = sorted(prof.net_per_step[1:])[(STEPS - 2) // 2]
    runs = pd.read_csv(data / "phantora_v0" / "runs.csv").set_index("run_id")
    assert runs.loc[RUN, "inter_node_bytes_per_step"] == median
    assert runs.loc[RUN, "n_steady_steps"] == STEPS - 1
    # the step time: the median of the marked steady steps (all typical: +-10 % of one another's median);
    # the last ends at its span's end, 10 us before the next step would start
    durations = np.diff(prof.starts_us)[1:]
    durations[-1] -= 10.0
    assert runs.loc[RUN, "step_time_s"] == pytest.approx(float(np.median(durations)) / 1e6, abs=1e-6)
    summary = json.loads((paths.partition_dir(RUN) / "trace_summary.json").read_text())
    assert summary["chosen_step"] in steady["step"].tolist()


def test_the_180_s_series_repeats_the_step_runs_csv_states(built):
    """The series repeats ``chosen_step``'s network flows (``step_flows.parquet``); with routed sizes the steps
    differ, and the repeated one carries runs.csv's ``inter_node_bytes_per_step``, the median hand count (was
    the step nearest the step time: step 9, 220,528 B beside runs.csv's 216,432 B for seed 1)."""
    data, prof = built
    paths = DataPaths(data)
    median = sorted(prof.net_per_step[1:])[(STEPS - 2) // 2]
    step_flows = pd.read_parquet(paths.partition_dir(RUN) / "step_flows.parquet")
    assert int(step_flows["bytes"].sum()) == median
    summary = json.loads((paths.partition_dir(RUN) / "trace_summary.json").read_text())
    steps = pd.read_parquet(paths.partition_dir(RUN) / "steps.parquet").set_index("step")
    assert int(steps.loc[summary["chosen_step"], "network_bytes"]) == median
