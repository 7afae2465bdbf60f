"""`phantora-assets import FOLDER` of PyTorch profiler (Kineto) traces: real Dagster runs through
every asset and check into the dataset (the CLI's build, as tests/integration/test_import.py), the asset
checks of an in-process materialization, and the declined folders. Expected bytes by hand."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pandas as pd
import pytest
from fixtures.kineto_traces import Coll, rank_trace, write_traces
from fixtures.materialize import materialize_run
from fixtures.paths import ROOT

from phantora_assets.checks import RUN_CHECKS, read_checks
from phantora_assets.cli import main
from phantora_assets.imported_runs import read_registry
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.run.spec import RunSpec, validate
from phantora_assets.paths import DataPaths

G = (0, 1, 2, 3)
COLLS = [
    Coll("allreduce", 1000, 1000, "BFloat16", G),  # S = 2000: 4 hops of floor(2000 * 2 * 3 / 4) = 3000
    Coll("_allgather_base", 250, 1000, "Float", G),  # per-rank S = 1000: 4 hops of 3 * 1000 = 3000
    Coll("wait", 0, 0, "Float", G),  # not a flow
    Coll("alltoall_base", 400, 400, "Half", G, in_split=(1, 1, 1, 1)),  # 12 flows of 100 x 2 B = 200
]
#: 2 hosts of 2 GPUs: hops 1->2 and 3->0 of each ring cross hosts (2 x 3000 twice), and 8 of the 12
#: all-to-all flows (rank 0 and 1 to 2 and 3, and back).
NET_PER_STEP = 2 * 3000 + 2 * 3000 + 8 * 200
RUN = "mytrace_2x2"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kineto")
    write_traces(root / "mytrace", {0: rank_trace(0, 4, COLLS, steps=6)})
    data = root / "data"
    assert main(["import", str(root / "mytrace"), "--gpus-per-node", "2", "--data-dir", str(data), "--quiet"]) == 0
    return data


def test_the_profiled_run_passes_every_check_and_enters_the_dataset(built):
    paths = DataPaths(built)
    (spec,) = read_registry(built)
    assert (spec.run_id, spec.source, spec.layout, spec.workload, spec.gpu) == (RUN, "kineto", "2x2", "", "")
    checks = read_checks(paths.run_folder(spec))
    assert all(checks[c]["status"] == "passed" for c in RUN_CHECKS), checks
    assert checks["matches_workload_model"]["message"].startswith("not applicable: a profiled run")
    runs = pd.read_csv(built / "phantora_v0" / "runs.csv").set_index("run_id")
    row = runs.loc[RUN]
    assert (row["source"], row["simulator"], row["framework"], row["parallelism"]) == (
        "kineto",
        "kineto",
        "PyTorch",
        "world=4",
    )
    assert row["gpu"] == "NVIDIA H100 80GB HBM3" and pd.isna(row["workload"]) and row["n_steady_steps"] == 5
    assert row["inter_node_bytes_per_step"] == NET_PER_STEP == 13600
    assert row["step_time_s"] == 0.01  # the ProfilerStep#N spans start 10 ms apart
    bins = pd.read_csv(built / "phantora_v0" / "flows_100ms.csv")
    assert set(bins["run_id"]) == {RUN} and set(zip(bins["src_node"], bins["dst_node"])) == {(0, 1), (1, 0)}
    with duckdb.connect(str(built / "phantora.duckdb"), read_only=True) as con:
        got = con.execute("select collective, bytes_per_step from collective_bytes order by 1").fetchall()
    assert got == [("all_gather", 6000.0), ("all_reduce", 6000.0), ("all_to_all", 1600.0)]


def test_checks_txt_states_the_assumption(built):
    paths = DataPaths(built)
    (spec,) = read_registry(built)
    text = (paths.run_folder(spec) / "checks.txt").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("[NOTE] source_assumptions (raw_timeline)"))
    assert "1 of 4 ranks' traces (rank 0): the other ranks of each of their 1 process group(s) are assumed" in line
    assert "all 18 collectives timed by their NCCL kernel on the GPU stream" in line
    assert "not network flows: 6 wait" in line and "steps from the 6 ProfilerStep#N markers of rank 0" in line


def test_materialization_reports_every_check(built):
    res = materialize_run(built, RUN)
    assert res.success
    evals = {e.check_name: e for e in res.get_asset_check_evaluations()}
    assert set(evals) == set(RUN_CHECKS) | {"matches_workload_model", "anatomy_adds_up", "link_bins_conserve_bytes"}
    assert all(e.passed for e in evals.values())
    links = pd.read_parquet(DataPaths(built).table(RUN, "link_bins"))  # 2 hosts in one rack: host links carry all
    assert set(links["routes"]) == {"modelled"}
    assert links.loc[links["link_class"] == "host_up", "bytes"].sum() == links["bytes"].sum() // 2
    raw_meta = res.asset_materializations_for_node("raw_timeline")[0].metadata
    assert raw_meta["ranks_traced"].value == 1 and raw_meta["n_collectives"].value == 18
    flows_meta = res.asset_materializations_for_node("validated_flows")[0].metadata
    assert flows_meta["network_bytes_per_step"].value == NET_PER_STEP and flows_meta["step_time_ms"].value == 10.0


def test_runs_lists_the_profiled_run(built, capsys):
    assert main(["runs", "--data-dir", str(built)]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(RUN))
    assert line.split()[:4] == [RUN, "kineto", "world=4", "profiled"] and "all checks passed" in line


def test_run_id_option_and_declined_folders(tmp_path, capsys):
    write_traces(tmp_path / "job", {0: rank_trace(0, 2, [Coll("allreduce", 8, 8, "Float", (0, 1))])})
    data = tmp_path / "data"
    assert (
        main(["import", str(tmp_path / "job"), "--run-id", "llama_probe", "--data-dir", str(data), "--no-build"]) == 0
    )
    assert [(s.run_id, s.layout) for s in read_registry(data)] == [("llama_probe", "2x1")]
    assert main(["import", str(tmp_path / "job"), "--run-id", "Bad Name", "--data-dir", str(data), "--no-build"]) == 2
    assert "a kineto run has workload = gpu = '', a path, a name of [a-z0-9_]" in capsys.readouterr().err
    copied = ROOT / "tests" / "data" / "kineto_hta" / "cpu_only"
    assert main(["import", str(copied), "--data-dir", str(data), "--no-build"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"import: declined {copied / 'rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz'}: no message sizes"
    )
    assert [s.run_id for s in read_registry(data)] == ["llama_probe"]  # nothing registered


def test_profiled_entries_follow_the_matrix_rules():
    ok = RunSpec("", "", 2, 1, source="kineto", path="/traces", name="job_2x1")
    validate(ok, "t")
    assert ok.run_id == "job_2x1" and ok.trace_dir == "traces/kineto/job_2x1"
    for bad in (
        RunSpec("W1", "", 2, 1, source="kineto", path="/traces", name="job"),  # a workload
        RunSpec("", "", 2, 1, source="kineto", path="/traces", name="phantora_x"),  # a matrix-like id
        RunSpec("", "", 2, 1, source="kineto", path="", name="job"),  # no folder
    ):
        with pytest.raises(RunMatrixError, match="a kineto run has"):
            validate(bad, "t")
    # on a simulated run, name is the run id's suffix (issue 38 item 6); a bad one, or one on an import, is refused
    named = RunSpec("W1", "a100_40g", 2, 1, name="job")
    validate(named, "t")
    assert named.run_id == "phantora_a100_40g_W1_2x1_job" and named.trace_dir == "traces/a100_40g/W1_2x1_job"
    for bad in ("Job", "_job", "x" * 41, "a-b"):
        with pytest.raises(RunMatrixError, match="name is a simulated run's run-id suffix"):
            validate(RunSpec("W1", "a100_40g", 2, 1, name=bad), "t")
    with pytest.raises(RunMatrixError, match="an imported run folder is named by its folder"):
        validate(RunSpec("W1", "a100_40g", 2, 1, source="import", path="/x", name="job"), "t")


def test_only_folders_of_profiler_traces_are_taken_for_kineto(tmp_path, capsys):
    from phantora_assets.sources.kineto import is_trace_folder

    write_traces(tmp_path / "job", {0: rank_trace(0, 2, [Coll("allreduce", 8, 8, "Float", (0, 1))])})
    (tmp_path / "run").mkdir()  # a Phantora run folder (its checks.json is no trace)
    (tmp_path / "run" / "timeline.json.gz").write_bytes(b"")
    (tmp_path / "run" / "checks.json").write_text("{}")
    (tmp_path / "oom").mkdir()
    (tmp_path / "oom" / "checks.json").write_text("{}")
    assert [is_trace_folder(tmp_path / n) for n in ("job", "run", "oom")] == [True, False, False]
    (tmp_path / "job" / "link.json").symlink_to(tmp_path / "job" / "rank-0.pt.trace.json.gz")
    assert is_trace_folder(tmp_path / "job")
    assert main(["import", str(tmp_path / "job"), "--data-dir", str(tmp_path / "data"), "--no-build"]) == 2
    assert f"import: declined {tmp_path / 'job' / 'link.json'}: symlink in run folder" in capsys.readouterr().err
