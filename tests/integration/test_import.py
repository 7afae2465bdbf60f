"""Importing run folders (`phantora-assets import`): real folders on disk, real materializations.

The folders are built like the published dataset (tests/fixtures/run_folders.py) from analytic
simulations, with hand-made edge cases: events in random order, a second communicator that only
carries a 0 us grad-norm all-reduce, loopback flows, MoE all-to-all in Phantora's matched
send/recv encoding (NcclSend, count in bytes as U8, no stream), a run whose all-to-all flows are
missing, a plain (not gzipped) trace, a run not in the run matrix, a non-default network, an
out-of-memory run without trace, and folders that cannot be imported.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from fixtures.materialize import materialize_run
from fixtures.paths import ROOT
from fixtures.run_folders import analytic, deepspeed_log, megatron_log, mixed_send_recv, write_run_folder

from phantora_assets.checks import RUN_CHECKS, read_checks
from phantora_assets.cli import main
from phantora_assets.imported_runs import effective_matrix, read_registry, register
from phantora_assets.lib.phantora.chrome_trace import read_trace
from phantora_assets.lib.phantora.netconfig import dumps_netconfig, netconfig_for
from phantora_assets.lib.phantora.run_folder import discover
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths

W1 = "phantora_a100_40g_W1_2x2"  # in the matrix: the import replaces its analytic source
W3_P2P = "phantora_a100_40g_W3_2x2"  # all-to-all in Phantora's matched send/recv encoding
W3_NO_A2A = "phantora_a100_40g_W3_2x4"  # a published-style trace missing its all-to-all flows
W3_MIXED = "phantora_a100_40g_W3_4x1"  # all-to-all as a group of NcclSend and NcclRecv events
W4_NEW = "phantora_h100_W4_2x2"  # not in the matrix: a new partition
W5_OOM = "phantora_l40s_W5_2x1"  # run.log reports out of memory, no trace
IMPORTED = [W1, W3_P2P, W3_NO_A2A, W3_MIXED, W4_NEW, W5_OOM]
COMPLETE = [W1, W3_P2P, W3_MIXED, W4_NEW]  # traces with every flow


def _second_communicator(raw: pd.DataFrame) -> pd.DataFrame:
    """Duplicate the 1-element F32 grad-norm all-reduces onto a communicator of their own."""
    tiny = raw[(raw["call"] == "NcclAllReduce") & (raw["count"] == 1)].copy()
    assert len(tiny) and (tiny["end_ns"] == tiny["start_ns"]).all()  # 0 us collectives
    tiny["comm_id_hex"] = "ab" * 128
    tiny["event_id"] = tiny["event_id"] + int(raw["event_id"].max()) + 1
    return pd.concat([raw, tiny], ignore_index=True)


def _phantora_p2p(raw: pd.DataFrame) -> pd.DataFrame:
    """Phantora's encoding of a matched send/recv pair: one NcclSend flow, count = bytes (U8), no stream."""
    raw = raw.copy()
    send = raw["call"] == "NcclSend"
    raw.loc[send, "count"] = raw.loc[send, "bytes"]
    raw.loc[send, "dtype"] = "U8"
    raw.loc[send, "stream_id"] = -1
    return raw


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("published")
    spec, raw, its = analytic(W1)
    raw = _second_communicator(raw).sample(frac=1.0, random_state=7)  # unsorted events
    write_run_folder(root, spec, raw, run_log=megatron_log(its, 4, 16000.0))
    spec, raw, its = analytic(W3_P2P)
    write_run_folder(root, spec, _phantora_p2p(raw), run_log=megatron_log(its, 4, 20000.0))
    spec, raw, its = analytic(W3_NO_A2A)
    write_run_folder(root, spec, raw[raw["call"] != "NcclSend"], run_log=megatron_log(its, 8, 20000.0))
    spec, raw, its = analytic(W3_MIXED)
    write_run_folder(root, spec, mixed_send_recv(raw, 4), run_log=megatron_log(its, 4, 20000.0))
    new = RunSpec("W4", "h100", 2, 2, topology=(("host_bw_gbps", 400),))
    spec, raw, its = analytic(new)
    folder = write_run_folder(root, spec, raw, run_log=deepspeed_log(its, 4), gz=False, timeline_bin=False)
    (folder / "config" / "netconfig.toml").write_text(dumps_netconfig(netconfig_for(new)))
    oom = write_run_folder(
        root,
        RunSpec("W5", "l40s", 2, 1),
        None,
        netconfig=False,
        timeline_bin=False,
        run_log="[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.00 GiB\n",
    )
    assert oom.name == "W5_2x1"
    (root / "traces" / "a100_40g" / "W9_2x2").mkdir(parents=True)  # unknown workload
    (root / "traces" / "a100_40g" / "W9_2x2" / "timeline.json.gz").write_bytes(b"")
    (root / "traces" / "a100_40g" / "W1_2x1").mkdir(parents=True)  # nothing in it
    return root


@pytest.fixture(scope="module")
def imported(src, tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("imported") / "data"
    assert main(["import", str(src), "--data-dir", str(data), "--quiet"]) == 0
    return data


def test_discover_finds_run_folders_and_says_why_others_are_skipped(src):
    found, skipped = discover(src)
    assert [f.spec.run_id for f in found] == sorted(IMPORTED)
    reasons = {s.path.name: s.reason for s in skipped}
    assert "unknown workload 'W9'" in reasons["W9_2x2"]
    assert "no timeline.json.gz" in reasons["W1_2x1"]
    by_id = {f.spec.run_id: f for f in found}
    assert by_id[W4_NEW].spec.topology == (("host_bw_gbps", 400),)  # from its config/netconfig.toml
    assert by_id[W4_NEW].trace.name == "timeline.json"
    assert by_id[W5_OOM].trace is None
    # a run folder itself, or the traces/ folder, works as the root too
    assert [f.spec.run_id for f in discover(by_id[W1].path)[0]] == [W1]
    assert len(discover(src / "traces")[0]) == len(IMPORTED)


def test_registry_and_replacement_rule(imported, src):
    assert sorted(s.run_id for s in read_registry(imported)) == sorted(IMPORTED)
    matrix = effective_matrix(imported)
    by_id = {s.run_id: s for s in matrix}
    shipped = {s.run_id: s for s in load_run_matrix()}
    assert len(matrix) == len(shipped) + 1  # only W4_NEW is new
    for rid in (W1, W3_P2P, W3_NO_A2A, W3_MIXED, W5_OOM):
        assert by_id[rid].source == "import" and by_id[rid].published == shipped[rid].published
        assert (
            Path(by_id[rid].path)
            == (src / "traces" / by_id[rid].gpu / f"{by_id[rid].workload}_{by_id[rid].layout}").resolve()
        )
    assert [s.run_id for s in matrix][-1] == W4_NEW
    # registering the same run_id again replaces the entry
    other = dataclasses.replace(by_id[W1], path=str(src / "elsewhere"))
    register(imported.parent / "again", [by_id[W1]])
    register(imported.parent / "again", [other])
    assert [s.path for s in read_registry(imported.parent / "again")] == [str(src / "elsewhere")]


def test_every_imported_run_passes_every_check_and_enters_the_dataset(imported):
    paths = DataPaths(imported)
    by_id = {s.run_id: s for s in effective_matrix(imported)}
    for rid in COMPLETE + [W3_NO_A2A]:
        checks = read_checks(paths.run_folder(by_id[rid]))
        assert all(checks[c]["status"] == "passed" for c in RUN_CHECKS), (rid, checks)
    runs = pd.read_csv(imported / "phantora_v0" / "runs.csv").set_index("run_id")
    assert set(runs.index) == set(COMPLETE) | {W3_NO_A2A}
    assert set(runs["source"]) == {"phantora_v0"} and set(runs["simulator"]) == {"import"}
    # the analytic simulation's bytes (published W1 2x2: 7.69 GB) plus the second communicator's
    _, raw, its = analytic(W1)
    tiny = raw[(raw["call"] == "NcclAllReduce") & (raw["count"] == 1) & (raw["src_host"] != raw["dst_host"])]
    assert runs.loc[W1, "inter_node_bytes_per_step"] == 7692648480 + tiny["bytes"].sum() // len(its)
    assert runs.loc[W1, "peak_memory_gib"] == pytest.approx(16000.0 / 1024)  # from run.log
    assert pd.isna(runs.loc[W4_NEW, "peak_memory_gib"])  # DeepSpeed prints none
    assert runs.loc[W4_NEW, "nic_bw"] == 400e9 / 8  # the folder's netconfig
    status = pd.read_csv(imported / "phantora_v0" / "run_status.csv").set_index("run_id")
    assert status.loc[W5_OOM, "status"] == "excluded" and "fits_in_memory: failed" in status.loc[W5_OOM, "reason"]


def test_run_folder_gets_the_imported_files(imported, src):
    paths = DataPaths(imported)
    by_id = {s.run_id: s for s in effective_matrix(imported)}
    folder = paths.run_folder(by_id[W1])
    assert (folder / "timeline.bin").read_bytes() == (Path(by_id[W1].path) / "timeline.bin").read_bytes()
    assert (folder / "run.log").read_text() == (Path(by_id[W1].path) / "run.log").read_text()
    assert (folder / "config" / "command.txt").exists() and not (folder / "config" / "run.toml").exists()
    assert json.loads((folder / "import.json").read_text())["source"] == by_id[W1].path
    # the edge cases are really in the imported traces
    w1 = read_trace(paths.chrome_trace(by_id[W1]))
    assert (w1.flows["src_node"] == w1.flows["dst_node"]).any()  # loopback flows
    assert (w1.flows["dur_us"] == 0).any()  # 0 us tiny collectives
    assert w1.flows["comm_id"].nunique() == 5  # 2 TP + 2 DP + the extra one
    with gzip.open(paths.chrome_trace(by_id[W1]), "rt") as fh:
        ts = [float(line.split('"ts":', 1)[1].split(",", 1)[0]) for line in fh if '"ts":' in line]
    assert ts != sorted(ts)  # unsorted events
    mixed = read_trace(paths.chrome_trace(by_id[W3_MIXED])).flows
    assert set(mixed["op"]) >= {"send", "recv"}
    log = json.loads((paths.partition_dir(W1) / "run_log.json").read_text())
    assert log["format"] == "megatron" and len(log["iteration_s"]) == 20
    # the plain timeline.json was gzip-compressed on the way in
    with gzip.open(paths.run_folder(by_id[W4_NEW]) / "timeline.json.gz") as fh:
        assert fh.read(2) == b"[\n"
    assert not (paths.run_folder(by_id[W4_NEW]) / "timeline.bin").exists()
    oom = read_checks(paths.run_folder(by_id[W5_OOM]))
    assert oom["fits_in_memory"]["status"] == "failed" and "out-of-memory" in oom["fits_in_memory"]["message"]
    assert not paths.chrome_trace(by_id[W5_OOM]).exists()


def test_missing_all_to_all_is_reported_by_the_cross_check(imported):
    paths = DataPaths(imported)
    by_id = {s.run_id: s for s in effective_matrix(imported)}
    rec = read_checks(paths.run_folder(by_id[W3_NO_A2A]))["matches_workload_model"]
    assert rec["status"] == "warning"
    assert "all-to-all" in rec["message"] and "missing from this trace" in rec["message"]
    cc = json.loads((paths.partition_dir(W3_NO_A2A) / "cross_check.json").read_text())
    rows = {r["kind"]: r for r in cc["rows"]}
    assert rows["all_to_all"]["measured_bytes"] == 0 and rows["all_to_all"]["predicted_bytes"] > 0
    assert rows["dp"]["deviation_pct"] == 0.0
    for rid in COMPLETE:  # complete traces agree with the model
        assert read_checks(paths.run_folder(by_id[rid]))["matches_workload_model"]["status"] == "passed"


def test_materialization_reports_checks_with_severity_and_run_log_metadata(imported):
    res = materialize_run(imported, W3_NO_A2A)
    assert res.success  # the cross-check is advisory
    evals = {e.check_name: e for e in res.get_asset_check_evaluations()}
    assert set(evals) == set(RUN_CHECKS) | {"matches_workload_model", "anatomy_adds_up", "link_bins_conserve_bytes"}
    cc = evals["matches_workload_model"]
    assert not cc.passed and cc.severity == dg.AssetCheckSeverity.WARN
    assert cc.metadata["trace_bytes_all_to_all"].value == 0
    assert "all_to_all" in cc.metadata["breakdown_md"].value
    assert all(e.passed for name, e in evals.items() if name != "matches_workload_model")
    # an imported trace's links: the same routing model assigns them, and the table says so
    links = pd.read_parquet(DataPaths(imported).table(W3_NO_A2A, "link_bins"), columns=["routes"])
    assert set(links["routes"]) == {"modelled"}
    raw_meta = res.asset_materializations_for_node("raw_timeline")[0].metadata
    assert raw_meta["source"].value == "import" and raw_meta["run_log_iterations"].value == 20
    assert len(raw_meta["run_log_iteration_ms"].value) == 20 and raw_meta["run_log_peak_memory_gib"].value == 19.531


def test_broken_trace_fails_its_partition_and_names_the_file(tmp_path):
    spec, raw, its = analytic(W1)
    folder = write_run_folder(tmp_path / "src", spec, raw, run_log=megatron_log(its, 4, 16000.0))
    data = tmp_path / "data"
    register(data, [discover(folder)[0][0].spec])
    good = (folder / "timeline.json.gz").read_bytes()
    (folder / "timeline.json.gz").write_bytes(good[: len(good) // 2])  # truncated gzip
    res = materialize_run(data, W1)
    assert not res.success
    failure = next(e for e in res.all_events if e.is_step_failure)
    assert failure.step_key == "chrome_trace"
    error = failure.event_specific_data.error.to_string()
    assert f"{folder / 'timeline.json.gz'}: truncated gzip" in error
    assert not DataPaths(data).chrome_trace(spec).exists()  # nothing half-written became visible


def test_import_dir_env_var_feeds_the_dagster_cli(src, tmp_path):
    """The UI's way in: $PHANTORA_ASSETS_IMPORT_DIR adds partitions when the code location loads."""
    env = {
        **os.environ,
        "DAGSTER_HOME": str(tmp_path / "home"),
        "PHANTORA_ASSETS_DATA_DIR": str(tmp_path / "data"),
        "PHANTORA_ASSETS_IMPORT_DIR": str(src / "traces" / "h100"),
        "PYTHONPATH": str(ROOT),
    }
    (tmp_path / "home").mkdir()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dagster",
            "asset",
            "materialize",
            "-m",
            "phantora_assets.definitions",
            "--select",
            "raw_timeline,chrome_trace,validated_flows",
            "--partition",
            W4_NEW,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    checks = json.loads((tmp_path / "data" / "traces" / "h100" / "W4_2x2" / "checks.json").read_text())
    assert checks["ring_bytes_match"]["status"] == "passed"
    assert checks["matches_workload_model"]["status"] == "passed"


def test_replay_with_missing_perf_db_shapes_blocks_the_run(tmp_path):
    """A run folder whose replay listed missing kernel shapes (perfdb_missing/, as this project's
    Docker runs keep <db>.missing/) fails the blocking perfdb_complete check: no trace, no dataset row."""
    spec, raw, its = analytic(W1)
    folder = write_run_folder(tmp_path / "src", spec, raw, run_log=megatron_log(its, 4, 16000.0))
    (folder / "perfdb_missing").mkdir()
    (folder / "perfdb_missing" / "compute.csv").write_text(
        'key\n{"BMM":[["bf16",[32,1024,128]],["bf16",[32,128,1024]]]}\n'
    )
    data = tmp_path / "data"
    assert main(["import", str(folder), "--data-dir", str(data), "--quiet"]) == 1
    checks = read_checks(DataPaths(data).run_folder(spec))
    assert checks["perfdb_complete"]["status"] == "failed"
    assert "2 kernel shape(s) missing" in checks["perfdb_complete"]["message"]
    assert checks["fits_in_memory"]["status"] == "passed"
    assert not DataPaths(data).chrome_trace(spec).exists()  # downstream assets did not run
    status = pd.read_csv(data / "phantora_v0" / "run_status.csv").set_index("run_id")
    assert status.loc[W1, "status"] == "excluded" and "perfdb_complete: failed" in status.loc[W1, "reason"]
    assert (DataPaths(data).run_folder(spec) / "perfdb_missing" / "compute.csv").exists()


def test_import_dir_env_var_must_name_a_directory(tmp_path, monkeypatch):
    from phantora_assets.lib.errors import RunMatrixError

    monkeypatch.setenv("PHANTORA_ASSETS_IMPORT_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(RunMatrixError, match="PHANTORA_ASSETS_IMPORT_DIR: .*nowhere is not a directory"):
        effective_matrix(tmp_path / "data")


def test_cli_names_the_file_and_rule_of_a_failed_run(tmp_path, capsys):
    spec, raw, its = analytic(W1)
    folder = write_run_folder(tmp_path / "src", spec, raw, run_log=megatron_log(its, 4, 16000.0))
    good = (folder / "timeline.json.gz").read_bytes()
    (folder / "timeline.json.gz").write_bytes(good[: len(good) // 2])  # truncated gzip
    assert main(["import", str(folder), "--data-dir", str(tmp_path / "data")]) == 1
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(W1))
    assert "FAILED: chrome_trace: " in line and f"{folder / 'timeline.json.gz'}: truncated gzip" in line
    assert "Error occurred while executing op" not in line
    # the same root cause in the run folder's checks.txt and in `phantora-assets runs` (issue 12)
    cause = f"TraceFormatError: {folder / 'timeline.json.gz'}: truncated gzip"
    checks_txt = (DataPaths(tmp_path / "data").run_folder(spec) / "checks.txt").read_text()
    assert f"[ERROR] step_failed:chrome_trace (chrome_trace): {cause}" in checks_txt
    assert main(["runs", "--data-dir", str(tmp_path / "data")]) == 0
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(W1))
    assert row.count(cause) == 1 and f"step chrome_trace: {cause}" in row and "flows_exist: not evaluated" in row


def test_a_folder_registered_in_place_keeps_its_trace(tmp_path):
    """The data root's own run folder imported in place: its timeline.json.gz is the source trace
    (the only copy). raw_timeline's invalidation of a first build (no run_spec.json yet) must not
    remove it, nor a later one after the run matrix changed."""
    data = tmp_path / "data"
    spec, raw, its = analytic(W1)
    folder = write_run_folder(data, spec, raw, run_log=megatron_log(its, 4, 16000.0))
    trace = (folder / "timeline.json.gz").read_bytes()
    assert main(["import", str(data / "traces"), "--data-dir", str(data), "--quiet"]) == 0
    assert (folder / "timeline.json.gz").read_bytes() == trace
    assert read_checks(folder)["fits_in_memory"]["status"] == "passed"
    assert (data / "partitions" / W1 / "run_summary.parquet").is_file()
    from phantora_assets.stages.simulation import build_reason

    assert build_reason({s.run_id: s for s in effective_matrix(data)}[W1], DataPaths(data)) is None


def test_a_replaced_trace_makes_the_imported_run_stale(tmp_path):
    """The folder of an imported run replaced by one with another trace (same path, as the watched
    folder's "write aside, then move in"): the build is no longer current. Before, build_reason
    (the import_dir sensor, the nightly schedule) called it complete and current and the dataset
    exported the old trace's tables."""
    from phantora_assets.stages.simulation import build_reason, stale_reason

    src, data = tmp_path / "src", tmp_path / "data"
    spec, raw, its = analytic(W1)
    folder = write_run_folder(src, spec, raw, run_log=megatron_log(its, 4, 16000.0))
    assert main(["import", str(src), "--data-dir", str(data), "--quiet"]) == 0
    imported = {s.run_id: s for s in effective_matrix(data)}[W1]
    paths = DataPaths(data)
    assert build_reason(imported, paths) is None
    aside = write_run_folder(tmp_path / "aside", spec, raw.iloc[: len(raw) // 2], run_log=megatron_log(its, 4, 16000.0))
    os.replace(aside / "timeline.json.gz", folder / "timeline.json.gz")
    assert (build_reason(imported, paths) or "").startswith("stale:")
    assert stale_reason(imported, paths)  # the dataset leaves it out until it is rebuilt
    shutil.rmtree(src)  # the folder gone since: the data root's copies are what was built
    assert stale_reason(imported, paths) is None


def test_the_import_dir_sensor_requests_a_folder_again_when_its_files_change(tmp_path, monkeypatch):
    """The import_dir sensor over a watched folder that was built: nothing to request; then an
    edited file under config/, an edited run.log: each makes the build stale and gets a run request
    with a run key of its own. Before, the key named only the trace's size and mtime (Dagster took
    the request for the earlier one and never ran it), and a change under config/ (raw_timeline
    copies it) neither made the build stale nor changed the key."""
    import phantora_assets.definitions as d
    from phantora_assets.stages.simulation import build_reason

    src, data = tmp_path / "src", tmp_path / "data"
    spec, raw, its = analytic(W1)
    folder = write_run_folder(src, spec, raw, run_log=megatron_log(its, 4, 16000.0))
    monkeypatch.setenv("PHANTORA_ASSETS_IMPORT_DIR", str(src))
    monkeypatch.setenv("PHANTORA_ASSETS_DATA_DIR", str(data))

    def requests() -> list[dg.RunRequest]:
        defs = d.build_defs(data)
        with dg.instance_for_test() as inst:  # a real instance (ref): the sensor adds dynamic partitions
            ctx = dg.build_sensor_context(
                instance=inst, instance_ref=inst.get_ref(), repository_def=defs.get_repository_def()
            )
            result = defs.get_sensor_def("import_dir").evaluate_tick(ctx)
        return result.run_requests or []

    first = requests()
    assert [r.partition_key for r in first] == [W1] and first[0].tags["phantora/build_reason"] == "missing"
    assert main(["build", "--data-dir", str(data), "--run", W1, "--no-plots", "--quiet"]) == 0
    assert requests() == []
    keys = {first[0].run_key}
    imported = {s.run_id: s for s in effective_matrix(data)}[W1]
    for name, text in (("config/command.txt", "# another command\n"), ("run.log", "\n# re-run\n")):
        with open(folder / name, "a") as f:
            f.write(text)
        assert (build_reason(imported, DataPaths(data)) or "").startswith("stale:"), name
        again = requests()
        assert [r.partition_key for r in again] == [W1], name
        assert again[0].run_key not in keys, name
        keys.add(again[0].run_key)
