"""Issue 15's done criterion on a real profiler trace with full metadata (opt-in: the trace is not ours
to commit). HolisticTraceAnalysis (MIT) @ f4d0062, ``tests/data/nccl_parser_config/nccl_data.json.gz``:
rank 0 of a 2-rank NCCL job on NVIDIA A100-PG509-200, ``record_param_comms`` with sizes (allreduce,
broadcast, wait), ``Process Group Ranks`` "[0, 1]", 3 ``ProfilerStep`` spans. Put that file alone in a
folder and point ``$PHANTORA_ASSETS_REAL_KINETO_DIR`` at it::

    PHANTORA_ASSETS_REAL_KINETO_DIR=path/to/folder python -m pytest -q tests/integration/test_real_kineto.py

It is imported with ``--gpus-per-node 1`` (rank r on host r + 1: 2 hosts) through the CLI's build (real
Dagster runs) into the dataset. Expected flows, by hand from the trace's ``record_param_comms`` (group
of n = 2): 15 all-reduces, 2 hops of floor(S * 2 * (n - 1) / n) = S each; 6 broadcasts, S to the other
rank; 6 waits, no flow: 36 flows of 614,007,480 bytes. The other rank is assumed to issue the same
collectives (the ``source_assumptions`` note says so). Step time and bytes per step: this import's."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from phantora_assets.checks import RUN_CHECKS, read_checks
from phantora_assets.cli import main
from phantora_assets.imported_runs import read_registry
from phantora_assets.paths import DataPaths

FOLDER = os.environ.get("PHANTORA_ASSETS_REAL_KINETO_DIR", "")
pytestmark = pytest.mark.skipif(not FOLDER, reason="opt-in: set PHANTORA_ASSETS_REAL_KINETO_DIR (module docstring)")


def test_a_real_two_rank_profiler_trace_enters_the_dataset(tmp_path):
    data = tmp_path / "data"
    args = ["import", FOLDER, "--gpus-per-node", "1", "--run-id", "hta_nccl", "--data-dir", str(data), "--quiet"]
    assert main(args) == 0
    (spec,) = read_registry(data)
    assert (spec.run_id, spec.source, spec.layout) == ("hta_nccl", "kineto", "2x1")
    checks = read_checks(DataPaths(data).run_folder(spec))
    assert all(checks[c]["status"] == "passed" for c in RUN_CHECKS), checks
    assert checks["flows_exist"]["message"] == "36 of 36 flows cross the network (614007480 bytes in total)."
    note = checks["source_assumptions"]["message"]
    assert "1 of 2 ranks' traces (rank 0)" in note and "all 21 collectives timed by their NCCL kernel" in note
    row = pd.read_csv(data / "phantora_v0" / "runs.csv").set_index("run_id").loc["hta_nccl"]
    assert (row["source"], row["n_nodes"], row["inter_node_bytes_per_step"]) == ("kineto", 2, 204669160)
    assert row["step_time_s"] == pytest.approx(0.222361337, abs=1e-9)
    flows = pd.read_csv(data / "phantora_v0" / "flows_100ms.csv")
    assert len(flows) == 3600 and int(flows["bytes"].sum()) == 165764371280
