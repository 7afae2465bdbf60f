"""Issue 13, third adversarial round: hostile import folders and hostile queries.

Real files on disk (tmp_path), no mocks. Each test failed before its fix (the commit says how)."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.paths import ROOT
from fixtures.run_folders import analytic, megatron_log, write_run_folder

from phantora_assets.imported_runs import discover_imports
from phantora_assets.lib.errors import FileRuleError
from phantora_assets.lib.phantora.run_folder import discover
from phantora_assets.paths import DataPaths
from phantora_assets.sources import phantora_import
from phantora_assets.stages.simulation import run_spec_record

W4 = "phantora_a100_40g_W4_2x1"
DEPTH = 300  # deeper than _shallow_stack allows: Python 3.11's os.walk recursed once per level


def _deep(top: Path, depth: int = DEPTH, leaf: str | None = None) -> None:
    """``top/d/d/.../d`` ``depth`` levels (made relative to an open directory: the full path
    stays below PATH_MAX for the walk, 2 bytes a level), with file ``leaf`` at the bottom."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        if leaf is not None:
            os.close(os.open(leaf, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)


@contextlib.contextmanager
def _shallow_stack(frames: int = 150):
    """Python's recursion limit at ``frames`` above the caller's depth: a walk that takes a frame a
    level fails on a ``DEPTH``-deep tree here as it does on a 1,000-deep one at the default limit
    (a tree that deep could not be removed by pytest's own cleanup, whose rmtree recurses too)."""
    was = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack(0)) + frames)
    try:
        yield
    finally:
        sys.setrecursionlimit(was)


@pytest.fixture
def run_folder(tmp_path) -> Path:
    spec, raw, its = analytic(W4)
    return write_run_folder(tmp_path / "src", spec, raw, run_log=megatron_log(its, 2, 16000.0))


# ---- deep directories ---------------------------------------------------------------------------
def test_a_deep_tree_beside_run_folders_is_walked_without_recursion_error(tmp_path, run_folder):
    # was: RecursionError from os.walk (Python 3.11 recurses a level a frame), a traceback from
    # `phantora-assets import` and, under $PHANTORA_ASSETS_IMPORT_DIR, a code location that cannot load
    _deep(tmp_path / "src" / "junk")
    with _shallow_stack():
        found, _ = discover(tmp_path / "src")
        assert [f.spec.run_id for f in found] == [W4]
        found, _ = discover_imports(tmp_path / "src")
        assert [f.spec.run_id for f in found] == [W4]


def test_a_deep_config_tree_is_refused_by_name_and_nothing_is_copied(tmp_path, run_folder):
    _deep(run_folder / "config" / "sub", leaf="hostfile")
    spec = discover(run_folder)[0][0].spec
    paths = DataPaths(tmp_path / "data")
    with _shallow_stack():
        leaf = "/".join(["config", "sub", *["d"] * DEPTH, "hostfile"])
        assert leaf in run_spec_record(spec).inputs["source_files"]  # the fingerprint walks config/ to its bottom
        with pytest.raises(FileRuleError) as ei:
            phantora_import.import_run_folder(spec, paths)
    assert ei.value.rule == "too deep"
    assert ei.value.path.startswith(str(run_folder / "config" / "sub" / "d"))
    assert "levels" in ei.value.detail
    run = paths.run_folder(spec)
    # refused by check_inputs before anything is written: no run folder, no temporary entry
    assert not run.exists()
    assert not run.parent.exists() or [p.name for p in run.parent.iterdir() if p.name.startswith(".")] == []


# ---- Chakra folders: the comm-groups file and the ETs must be regular files ---------------------
def _chakra_folder(tmp: Path) -> Path:
    from phantora_assets.lib.chakra.et_io import EtNode, write_et

    node = EtNode(1, "c", 7, start_us=10, dur_us=5, attrs={"is_cpu_op": False, "comm_type": 0, "comm_size": 1000})
    tmp.mkdir()
    for r in range(2):
        write_et(tmp / f"t.{r}.et", {"rank": r}, [node])
    return tmp


GROUPS_CASES = {
    # was: followed (a file outside the folder read as the groups); FIFO and directory: ignored, the
    # groups inferred from pg_name instead, silently
    "link": (lambda p, out: p.symlink_to(out), "symlink in run folder"),
    "fifo": (lambda p, out: os.mkfifo(p), "not a regular file"),
    "directory": (lambda p, out: p.mkdir(), "not a regular file"),
}


@pytest.mark.parametrize("case", list(GROUPS_CASES))
def test_a_comm_groups_file_that_is_no_regular_file_is_refused(tmp_path, case):
    from phantora_assets.lib.chakra.ingest import read_folder

    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"0": [0, 1]}))
    folder = _chakra_folder(tmp_path / "ets")
    make, rule = GROUPS_CASES[case]
    make(folder / "t.comm_groups.json", outside)
    with pytest.raises(FileRuleError) as ei:
        read_folder(folder, 1)
    assert (ei.value.path, ei.value.rule) == (str(folder / "t.comm_groups.json"), rule)


def test_two_comm_groups_files_are_refused_not_one_picked(tmp_path):
    from phantora_assets.lib.chakra.ingest import read_folder

    folder = _chakra_folder(tmp_path / "ets")
    (folder / "a.comm_groups.json").write_text(json.dumps({"0": [0, 1]}))
    (folder / "t.comm_groups.json").write_text(json.dumps({"0": [1, 0]}))
    with pytest.raises(FileRuleError) as ei:
        read_folder(folder, 1)  # was: a.comm_groups.json used, t.comm_groups.json ignored
    assert ei.value.rule == "comm groups" and "a.comm_groups.json" in ei.value.detail


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_et_that_is_no_regular_file_is_refused_by_rule(tmp_path, kind):
    from phantora_assets.lib.chakra.ingest import read_folder

    folder = _chakra_folder(tmp_path / "ets")
    (folder / "t.1.et").unlink()
    os.mkfifo(folder / "t.1.et") if kind == "fifo" else (folder / "t.1.et").mkdir()
    with pytest.raises(FileRuleError) as ei:
        read_folder(folder, 1)  # was: FileNotFoundError 'no such Chakra ET file'
    assert (ei.value.path, ei.value.rule) == (str(folder / "t.1.et"), "not a regular file")


# ---- a folder name that is not UTF-8 ------------------------------------------------------------
@pytest.mark.slow
def test_a_run_folder_under_a_non_utf8_name_is_skipped_with_the_reason(tmp_path):
    # was: registered, then UnicodeEncodeError writing imports.toml (a traceback, exit 1)
    spec, raw, its = analytic(W4)
    top = Path(os.fsdecode(os.fsencode(tmp_path) + b"/run\xff"))
    folder = write_run_folder(top, spec, raw, run_log=megatron_log(its, 2, 16000.0))
    found, skipped = discover(top)
    assert found == []
    assert [(s.path, "not UTF-8" in s.reason) for s in skipped] == [(folder, True)]
    data = tmp_path / "data"
    cli = [sys.executable, "-m", "phantora_assets.cli", "import", "--data-dir", str(data), "--no-build", str(top)]
    done = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "is not UTF-8 text" in done.stderr and "Traceback" not in done.stderr
    assert not (data / "imports.toml").exists()


# ---- query: the result's memory is bounded ------------------------------------------------------
#: runs the CLI as ``python -m phantora_assets.cli`` does and, as the command exits (its exit handlers
#: run before ``os._exit``), writes the process's own peak RSS (VmHWM, kB) to the file in argv[1]. Not
#: the child's rusage: a child forked from a large pytest process counts the parent's pages as its
#: own until it execs (ru_maxrss was 2,303 MiB in a full test run for a 300 MiB query).
_PEAK = (
    "import atexit, runpy, sys\n"
    "out = sys.argv.pop(1)\n"
    "def peak():\n"
    "    kb = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')]\n"
    "    open(out, 'w').write(kb[0])\n"
    "atexit.register(peak)\n"
    "runpy.run_module('phantora_assets.cli', run_name='__main__', alter_sys=True)\n"
)


def _query(data: Path, sql: str, *fmt: str) -> tuple[int, str, str, int]:
    """(exit code, stdout, stderr, peak RSS in MiB) of `phantora-assets query` run as its own process."""
    peak = data / "query.peak"
    cli = [sys.executable, "-c", _PEAK, str(peak), "query", "--data-dir", str(data), sql, *fmt]
    out, err = data / "query.out", data / "query.err"
    with open(out, "w") as fo, open(err, "w") as fe:
        code = subprocess.run(cli, cwd=ROOT, stdout=fo, stderr=fe, timeout=600).returncode
    return code, out.read_text(), err.read_text(), int(peak.read_text()) // 1024


@pytest.fixture
def tiny_db(tmp_path) -> Path:
    import duckdb

    data = tmp_path / "data"
    data.mkdir()
    with duckdb.connect(str(DataPaths(data).duckdb_path)) as con:
        con.execute("CREATE TABLE t AS SELECT 1 AS x")
    return data


@pytest.mark.slow
def test_a_query_whose_table_would_not_fit_is_refused_in_bounded_memory(tiny_db):
    # was: every row fetched into Python, then formatted: 30 M rows took 111 s and 8.6 GiB RSS
    code, out, err, rss = _query(tiny_db, "select i from range(20000000) t(i)")
    assert code == 2 and out == ""
    assert "larger than 256 MiB" in err and "--format csv" in err, err
    assert rss < 1024, f"peak RSS {rss} MiB"


@pytest.mark.slow
def test_a_large_csv_result_streams_in_bounded_memory(tiny_db):
    code, out, err, rss = _query(tiny_db, "select i, i * 2 as j from range(4000000) t(i)", "--format", "csv")
    assert code == 0, err
    lines = out.split("\n")
    assert lines[:3] == ["i,j", "0,0", "1,2"] and lines[-2:] == ["3999999,7999998", ""] and len(lines) == 4000002
    assert rss < 700, f"peak RSS {rss} MiB"


# ---- a trace with duplicate keys ----------------------------------------------------------------
def test_a_trace_event_with_a_key_twice_is_refused(tmp_path):
    from phantora_assets.lib.errors import TraceFormatError
    from phantora_assets.lib.phantora.chrome_trace import read_trace, write_chrome_trace

    _, raw, _ = analytic(W4)
    path = tmp_path / "timeline.json"
    write_chrome_trace(raw, path)
    lines = path.read_text().split("\n")
    k = next(i for i, line in enumerate(lines) if '"cat":"Communication"' in line)
    lines[k] = lines[k].replace('"ph":"X",', '"ph":"X","dur":0.001,', 1)  # "dur" before and after
    assert lines[k].count('"dur":') == 2
    path.write_text("\n".join(lines))
    with pytest.raises(TraceFormatError) as ei:
        read_trace(path, workers=0)
    assert ei.value.rule == "duplicate key" and "line" in ei.value.detail


# ---- Kineto: a kernel of negative duration --------------------------------------------------------
def test_a_kineto_nccl_kernel_of_negative_duration_is_refused(tmp_path):
    # was: converted into a flow of zero duration (start = end), every other round 400 us long, silently
    from fixtures.kineto_traces import Coll, rank_trace, write_traces

    from phantora_assets.lib.errors import TraceFormatError
    from phantora_assets.lib.kineto.run import convert, read_folder

    traces = {r: rank_trace(r, 2, [Coll("allreduce", 1000, 1000, "Float", (0, 1))], steps=4) for r in range(2)}
    kernel = next(e for e in traces[0]["traceEvents"] if e.get("cat") == "kernel" and "nccl" in e["name"].lower())
    kernel["dur"] = -50
    write_traces(tmp_path, traces, gz=False)
    with pytest.raises(TraceFormatError) as ei:
        convert(read_folder(tmp_path, 1))
    assert ei.value.rule == "negative duration" and ei.value.path.endswith("rank-0.pt.trace.json")
    assert "-50" in ei.value.detail
