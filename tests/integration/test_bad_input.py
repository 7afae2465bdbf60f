"""Bad input (issue 6): each case goes through a real Dagster materialization of a partition.

For every case: the error (or the failed blocking check) names the file and the rule, no output
file of that partition is left behind (no temporary file; the asset's previous files are
byte-identical), and another partition still materializes. Run-matrix cases fail when the code
location loads, naming the entry and the rule; a good matrix still loads.

Trace cases start from a data root where partitions A and B were fully materialized up to
``validated_flows``; A's ``timeline.json.gz`` is then overwritten with bad content and
``validated_flows`` (alone, its upstream already materialized) is materialized again.
"""

from __future__ import annotations

import errno
import gc
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from fixtures.materialize import ephemeral_with_runs
from fixtures.paths import ROOT

from phantora_assets import definitions as d
from phantora_assets.checks import TRACE_CHECKS, read_checks
from phantora_assets.lib.phantora.perfdb import PERFDB_DIR_ENV
from phantora_assets.matrix import RUN_MATRIX_ENV, load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.resources import AnalyticSimulatorResource, DataRoot

perf_db, raw_timeline, chrome_trace, validated_flows, binned_flows = (
    d.ASSETS[n] for n in ("perf_db", "raw_timeline", "chrome_trace", "validated_flows", "binned_flows")
)
RUNS_BY_ID = {s.run_id: s for s in load_run_matrix()}

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
A = "phantora_l40s_W4_2x1"  # the partition fed bad input
B = "phantora_a100_40g_W1_2x2"  # another partition, which must still materialize


# ------------------------------------------------------------------------------------- helpers


def _materialize(root: Path, run_id: str, assets: list, instance: dg.DagsterInstance | None = None):
    return dg.materialize(
        d.ALL_ASSETS,
        selection=assets,
        partition_key=run_id,
        raise_on_error=False,
        instance=instance or ephemeral_with_runs([run_id]),
        run_config=QUIET,
        resources={"data": DataRoot(data_dir=str(root)), "simulator": AnalyticSimulatorResource()},
    )


def _error_text(result) -> str:
    """Every step failure's message, with the messages of its causes."""
    out = []
    for ev in result.all_events:
        if not ev.is_step_failure:
            continue
        err = ev.event_specific_data.error
        while err is not None:
            out.append(err.message)
            err = err.cause
    return "\n".join(out)


def _materialized(result) -> set[str]:
    return {
        e.event_specific_data.materialization.asset_key.to_user_string()
        for e in result.get_asset_materialization_events()
    }


def _files(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``folder``."""
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _no_temp_files(root: Path) -> None:
    tmp = [str(p) for p in root.rglob("*.tmp")]
    assert not tmp, f"temporary files left behind: {tmp}"


def _other_partition_materializes(root: Path) -> None:
    before = (root / "partitions" / B / "flows.parquet").stat().st_mtime_ns
    res = _materialize(root, B, [validated_flows])
    assert res.success, _error_text(res)
    assert (root / "partitions" / B / "flows.parquet").stat().st_mtime_ns >= before
    assert read_checks(DataPaths(root).run_folder(RUNS_BY_ID[B]))["flows_exist"]["status"] == "passed"


@pytest.fixture(scope="module")
def upstream(tmp_path_factory) -> Path:
    """Data root with A and B materialized through validated_flows (good traces)."""
    root = tmp_path_factory.mktemp("bad_input") / "data"
    instance = ephemeral_with_runs([A, B])
    for run_id in (A, B):
        res = _materialize(root, run_id, [raw_timeline, chrome_trace, validated_flows], instance)
        assert res.success, _error_text(res)
    return root


@pytest.fixture()
def root(upstream: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "data"
    shutil.copytree(upstream, dst)
    return dst


def _read_the_chrome_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    """validated_flows reads A's Chrome trace, as it does for every source without tables of its own (imported
    Phantora folders): the analytic source's ``flow_tables`` (its raw timeline, read instead) is taken away."""
    from phantora_assets.sources import analytic

    monkeypatch.delattr(analytic, "flow_tables")


def _trace(root: Path) -> Path:
    return DataPaths(root).chrome_trace(RUNS_BY_ID[A])


def _events(root: Path) -> list[dict]:
    return json.loads(gzip.decompress(_trace(root).read_bytes()))


def _layout(events: list[dict]) -> bytes:
    """The visualizer layout: one event per line."""
    return ("[\n" + ",\n".join(json.dumps(e, separators=(",", ":")) for e in events) + "\n]").encode()


def _gz(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


def _comm(events: list[dict]) -> list[dict]:
    return [e for e in events if e["cat"] == "Communication"]


# ------------------------------------------------------------------------------------- trace cases: errors


def _truncated(events: list[dict], good: bytes) -> bytes:
    return good[: len(good) // 2]


def _invalid_json(events: list[dict], good: bytes) -> bytes:
    lines = _layout(events).split(b"\n")
    lines[3] = lines[3].replace(b'"cat":"', b'"cat":', 1)
    return _gz(b"\n".join(lines))


def _empty_array(events: list[dict], good: bytes) -> bytes:
    return _gz(b"[\n]")


def _never_repeat(events: list[dict], good: bytes) -> bytes:
    for i, e in enumerate(_comm(events)):  # every collective a new element count
        (call,) = e["args"]["Communication"][1].values()
        call["count"] += i
    return _gz(_layout(events))


def _negative_duration(events: list[dict], good: bytes) -> bytes:
    _comm(events)[5]["dur"] = -3.5
    return _gz(_layout(events))


def _overflowing_duration(events: list[dict], good: bytes) -> bytes:
    _comm(events)[5]["dur"] = 1e300
    return _gz(_layout(events))


def _unknown_op(events: list[dict], good: bytes) -> bytes:
    e = _comm(events)[7]
    ((name, call),) = e["args"]["Communication"][1].items()
    e["args"]["Communication"][1] = {"NcclAllToAll": call}
    return _gz(_layout(events))


ERROR_CASES: dict[str, tuple[Callable[[list[dict], bytes], bytes], str]] = {
    "truncated_gzip": (_truncated, "truncated gzip"),
    "invalid_json": (_invalid_json, "invalid JSON"),
    "empty_array": (_empty_array, "empty trace"),
    "steps_never_repeat": (_never_repeat, "steps never repeat"),
    "negative_duration": (_negative_duration, "negative duration"),
    "overflowing_duration": (_overflowing_duration, "overflowing duration"),
    "unknown_nccl_op": (_unknown_op, "unknown NCCL op"),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_trace_fails_its_partition_only(root: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _read_the_chrome_trace(monkeypatch)
    make, rule = ERROR_CASES[case]
    trace = _trace(root)
    trace.write_bytes(make(_events(root), trace.read_bytes()))
    pdir = root / "partitions" / A
    before = _files(pdir)

    res = _materialize(root, A, [validated_flows])

    assert not res.success
    text = _error_text(res)
    assert str(trace) in text and rule in text, text
    assert "validated_flows" not in _materialized(res)
    assert _files(pdir) == before  # previous outputs byte-identical, nothing new
    _no_temp_files(root)
    checks = read_checks(DataPaths(root).run_folder(RUNS_BY_ID[A]))
    assert all(checks[c]["status"] == "not evaluated" for c in TRACE_CHECKS)  # out of the dataset
    _other_partition_materializes(root)


def test_bad_raw_timeline_fails_its_partition_only(root: Path) -> None:
    """An analytic run's validated_flows reads its raw timeline table (issue 37): a row breaking the trace format
    there fails the partition naming the table and the rule, and leaves A's outputs as they were."""
    table = DataPaths(root).table(A, "raw_timeline")
    raw = pd.read_parquet(table)
    i = int((raw["kind"] == "communication").to_numpy().argmax())
    raw.loc[i, "end_ns"] = raw.loc[i, "start_ns"] - 1
    raw.to_parquet(table, index=False)
    pdir = root / "partitions" / A
    before = _files(pdir)

    res = _materialize(root, A, [validated_flows])

    assert not res.success
    text = _error_text(res)
    assert str(table) in text and "negative duration" in text, text
    assert _files(pdir) == before
    _no_temp_files(root)
    _other_partition_materializes(root)


# ------------------------------------------------------------------------------------- trace cases: failed checks


def _no_network_flows(events: list[dict]) -> None:
    for e in _comm(events):  # every flow stays inside its host
        flow = e["args"]["Communication"][0]
        flow["dst"] = flow["src"]


def _two_group_sizes(events: list[dict]) -> None:
    """One all-reduce of the 2-rank communicator carries the bytes of a 4-rank ring."""
    for e in _comm(events):
        flow, call = e["args"]["Communication"]
        ((name, p),) = call.items()
        if name == "NcclAllReduce" and p["count"] == 525336576:
            flow["bytes"] = p["count"] * 2 * 2 * 3 // 4


CHECK_CASES = {
    "no_network_flows": (_no_network_flows, "flows_exist"),
    "two_group_sizes": (_two_group_sizes, "ring_bytes_match"),
}


@pytest.mark.parametrize("case", list(CHECK_CASES))
def test_broken_trace_rule_is_a_failed_blocking_check(root: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace that parses but breaks a trace rule materializes validated_flows with the failed
    blocking check (in checks.txt, naming the trace file), writes no data file, and nothing
    downstream runs."""
    _read_the_chrome_trace(monkeypatch)
    mutate, check = CHECK_CASES[case]
    trace = _trace(root)
    events = _events(root)
    mutate(events)
    trace.write_bytes(_gz(_layout(events)))
    pdir = root / "partitions" / A
    before = _files(pdir)

    res = _materialize(root, A, [validated_flows, binned_flows])

    assert not res.success
    text = _error_text(res)  # the only failure is the blocking check, not an exception of ours
    assert "DagsterAssetCheckFailedError" in text and check in text, text
    assert "TraceFormatError" not in text and "StepDetectionError" not in text, text
    evals = {e.check_name: e.passed for e in res.get_asset_check_evaluations()}
    assert evals[check] is False
    assert _materialized(res) == {"validated_flows"}  # binned_flows blocked
    text = (DataPaths(root).run_folder(RUNS_BY_ID[A]) / "checks.txt").read_text()
    failed = [ln for ln in text.splitlines() if ln.startswith(f"[FAILED] {check} ")]
    assert failed and str(trace) in failed[0], text
    assert _files(pdir) == before  # no data file written or changed
    _no_temp_files(root)
    _other_partition_materializes(root)


# ------------------------------------------------------------------------------------- full disk


def _mount_tmpfs(target: Path, size: int) -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)], capture_output=True, text=True
    )
    return out.returncode == 0


def test_full_disk_while_writing(root: Path, tmp_path: Path, monkeypatch) -> None:
    """ENOSPC while validated_flows writes its Parquet files: the error names the file and
    'disk full', the previous files are intact, no temporary file is left.

    The partition folder is a small tmpfs (real ENOSPC) where ``mount`` is allowed; elsewhere
    the Parquet writer is made to write part of the file and then fail with ENOSPC."""
    pdir = root / "partitions" / A
    before = _files(pdir)
    saved = tmp_path / "saved"
    shutil.copytree(pdir, saved)
    pages = sum(-(-p.stat().st_size // 4096) for p in saved.iterdir()) + 2
    mounted = _mount_tmpfs(pdir, pages * 4096)
    try:
        if mounted:
            for p in saved.iterdir():
                shutil.copy2(p, pdir / p.name)
            assert _files(pdir) == before
        else:
            real = pd.DataFrame.to_parquet

            def full_disk(self, path, *args, **kwargs):
                real(self, path, *args, **kwargs)
                with open(path, "r+b") as fh:  # a partial file, as a full disk leaves it
                    fh.truncate(max(1, os.path.getsize(path) // 2))
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

            monkeypatch.setattr(pd.DataFrame, "to_parquet", full_disk)
        res = _materialize(root, A, [validated_flows])
        monkeypatch.undo()
        assert not res.success
        text = _error_text(res)
        assert str(pdir / "flows.parquet") in text and "disk full" in text, text
        assert _files(pdir) == before
        _no_temp_files(root)
    finally:
        if mounted:
            gc.collect()  # a failed writer's file handle may still be referenced
            if subprocess.run(["umount", str(pdir)], capture_output=True).returncode:
                subprocess.run(["umount", "-l", str(pdir)], check=True)
    assert _files(pdir) == before
    _other_partition_materializes(root)
    # with room again, A materializes and gives the same files as before
    res = _materialize(root, A, [validated_flows])
    assert res.success, _error_text(res)
    assert _files(pdir) == before


# ------------------------------------------------------------------------------------- perf DB


def _corrupt_row(folder: Path) -> tuple[str, str]:
    p = folder / "compute.csv"
    lines = p.read_text().split("\n")
    key, nanos = lines[5].rsplit(",", 1)
    lines[5] = f"{key},12x{nanos}"
    p.write_text("\n".join(lines))
    return "compute.csv", "row 6: nanos='12x"


def _missing_row(folder: Path) -> tuple[str, str]:
    p = folder / "compute.csv"
    lines = p.read_text().split("\n")
    del lines[5]
    p.write_text("\n".join(lines))
    return "manifest.md", "declares 594 compute entries, compute.csv has 593"


@pytest.mark.parametrize("damage", [_corrupt_row, _missing_row], ids=["corrupt_row", "missing_row"])
def test_bad_perf_db_row_fails_its_gpu_only(tmp_path: Path, monkeypatch, damage) -> None:
    dbroot = tmp_path / "perfdb"
    shutil.copytree(ROOT / "perfdb", dbroot)
    name, rule = damage(dbroot / "l40s")
    monkeypatch.setenv(PERFDB_DIR_ENV, str(dbroot))
    root = tmp_path / "data"
    out = DataPaths(root).perfdb_summary("l40s")

    res = _materialize(root, "l40s", [perf_db])

    assert not res.success
    text = _error_text(res)
    assert str(dbroot / "l40s" / name) in text and rule in text, text
    assert not out.exists()
    _no_temp_files(root)
    other = _materialize(root, "h100", [perf_db])
    assert other.success, _error_text(other)
    assert json.loads(DataPaths(root).perfdb_summary("h100").read_text())["status"] == "absent"


# ------------------------------------------------------------------------------------- run matrix


def _load_definitions(tmp_path: Path, matrix: str) -> subprocess.CompletedProcess:
    path = tmp_path / "matrix.toml"
    path.write_text(matrix)
    env = {**os.environ, RUN_MATRIX_ENV: str(path), "PHANTORA_ASSETS_DATA_DIR": str(tmp_path / "data")}
    code = (
        "from phantora_assets import definitions as d\n"
        "d.defs()\n"  # Dagster's loader: the run matrix of the code location is read here
        "print(sorted(s.run_id for s in d.LOADED_FROM[1]))\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env)


GOOD_ENTRY = '[[run]]\nworkload = "W4"\ngpu = "l40s"\nnodes = 2\ngpus_per_node = 1\n'
MATRIX_CASES = {
    "unknown_workload": (
        '[[run]]\nworkload = "W9"\ngpu = "l40s"\nnodes = 2\ngpus_per_node = 1\n',
        "unknown workload 'W9'",
    ),
    "unknown_gpu": ('[[run]]\nworkload = "W1"\ngpu = "v100"\nnodes = 2\ngpus_per_node = 1\n', "unknown GPU 'v100'"),
    "indivisible_layout": (
        '[[run]]\nworkload = "W1"\ngpu = "h100"\nnodes = 1\ngpus_per_node = 1\n',
        "tensor_parallel_size=2 to divide the GPU count",
    ),
}


@pytest.mark.parametrize("case", list(MATRIX_CASES))
def test_bad_run_matrix_entry_stops_loading(tmp_path: Path, case: str) -> None:
    entry, rule = MATRIX_CASES[case]
    out = _load_definitions(tmp_path, GOOD_ENTRY + "\n" + entry)
    assert out.returncode != 0
    assert "RunMatrixError" in out.stderr and "[[run]] #2" in out.stderr and rule in out.stderr, out.stderr
    assert str(tmp_path / "matrix.toml") in out.stderr
    assert not (tmp_path / "data").exists()  # nothing simulated or written


def _dagster_materialize(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    (tmp_path / "home").mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "dagster", "asset", "materialize", "-m", "phantora_assets.definitions"]
    cmd += ["--select", "perf_db", "--partition", "l40s"]
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), **env}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_bad_run_matrix_under_dagster_materialize_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """Issue 39 item 14: ``dagster asset materialize`` loads the code location outside any handler, so
    a bad run-matrix file printed the interpreter's traceback through click and Dagster's loader (70
    lines) before the line naming the file and the rule. Now that line is what it prints."""
    matrix = tmp_path / "matrix.toml"
    matrix.write_text(GOOD_ENTRY + "\n" + MATRIX_CASES["unknown_workload"][0])
    out = _dagster_materialize(tmp_path, {RUN_MATRIX_ENV: str(matrix), "PHANTORA_ASSETS_DATA_DIR": str(tmp_path / "d")})
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    line = f"RunMatrixError: {matrix} [[run]] #2 (W9 l40s 2x1): unknown workload 'W9'"
    assert line in out.stderr, out.stderr
    assert not (tmp_path / "d").exists()


def test_a_data_root_that_is_a_file_is_refused_before_use(tmp_path: Path) -> None:
    """``PHANTORA_ASSETS_DATA_DIR`` naming a file: the loader names it and the rule in one line."""
    f = tmp_path / "not_a_dir"
    f.write_text("")
    out = _dagster_materialize(tmp_path, {"PHANTORA_ASSETS_DATA_DIR": str(f)})
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
    assert f"FileRuleError: {f}: the data root must be a directory, and this is a file" in out.stderr


def test_good_run_matrix_still_loads(tmp_path: Path) -> None:
    good = _load_definitions(tmp_path, GOOD_ENTRY)
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip() == "['phantora_l40s_W4_2x1']"
