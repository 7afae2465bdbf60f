"""Found by the issue-12 attack on the console script's ending (``cli.run``: exit handlers, flush
of the standard streams, then ``os._exit``): real processes, real files."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

from fixtures.paths import ROOT as REPO


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout block-buffered, as usual
    env["PYTHONPATH"] = str(REPO)
    return env


def _limit_file_size(limit: int):
    def pre() -> None:
        # a write past `limit` bytes fails with EFBIG, as one on a full disk fails with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    return pre


def test_output_lost_at_the_final_flush_is_a_failure_not_exit_0(tmp_path: Path) -> None:
    """`phantora-assets runs > file` on a disk that fills: the listing (a few KB, still in stdout's
    buffer when main returns) fails to be written at the final flush. Was: the error swallowed, the
    file cut at 100 bytes and exit 0 (an interpreter's own exit says 120 and why)."""
    out = tmp_path / "runs.txt"
    with out.open("wb") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "phantora_assets.cli", "runs", "--data-dir", str(tmp_path / "data")],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=tmp_path,
            preexec_fn=_limit_file_size(100),
            timeout=120,
        )
    assert out.stat().st_size <= 100
    assert proc.returncode == 120, (proc.returncode, proc.stderr)
    assert "File too large" in proc.stderr and "stdout" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_closed_stdout_is_not_a_traceback(tmp_path: Path) -> None:
    """Started with stdout closed (`>&-`, a service without one), Python's print writes nothing and a
    command succeeds. Was: the final flush called None.flush(): AttributeError traceback, exit 1."""
    proc = subprocess.run(
        [sys.executable, "-m", "phantora_assets.cli", "runs", "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=tmp_path,
        preexec_fn=lambda: os.close(1),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_build_whose_reader_left_exits_with_the_builds_outcome(tmp_path: Path) -> None:
    """`phantora-assets build | head -1`: a build whose stdout reader is gone (here before the first
    line) still ends with its outcome's code, without a traceback, and its runs are on the instance.
    Was: the BrokenPipeError of the first run line ended it with a traceback and exit 1 after a
    successful build."""
    from dagster import DagsterInstance, DagsterRunStatus

    read, write = os.pipe()
    os.close(read)  # the reader has left
    data = tmp_path / "data"
    env = _env()
    env.pop("DAGSTER_HOME", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "phantora_assets.cli", "build", "--data-dir", str(data), "--no-plots"]
            + ["--run", "phantora_l40s_W1_2x1", "--run", "phantora_l40s_W2_2x1"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=600,
        )
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    with DagsterInstance.from_config(str(data / "dagster_home")) as instance:
        runs = instance.get_runs()
        assert {r.job_name for r in runs} == {"perf_dbs", "all_runs", "dataset"}
        assert all(r.status == DagsterRunStatus.SUCCESS for r in runs), [(r.job_name, r.status) for r in runs]


def _drain(fd: int) -> None:
    while os.read(fd, 1 << 16):
        pass


def test_sigterm_while_the_build_reports_exits_143_with_a_message(tmp_path: Path) -> None:
    """SIGTERM after every run ended, while the build prints its report (here: held in a write to a
    full pipe, as with a paused terminal or a slow reader): exit 143 and the "build stopped" message,
    as at any other moment. Was: a `_Terminated: SIGTERM` traceback and exit 1."""
    import fcntl
    import threading
    import time

    read, write = os.pipe()
    fcntl.fcntl(write, 1031, 4096)  # F_SETPIPE_SZ: one page
    os.set_blocking(write, False)
    try:
        while True:
            os.write(write, b"x" * 512)
    except BlockingIOError:
        pass
    os.set_blocking(write, True)  # full: the build's first line of output waits for a reader
    env = _env()
    env.pop("DAGSTER_HOME", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "phantora_assets.cli", "build", "--data-dir", str(tmp_path / "data"), "--no-plots"]
        + ["--run", "phantora_l40s_W1_2x1", "--run", "phantora_l40s_W3_2x1"],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    os.close(write)
    try:
        deadline = time.monotonic() + 300
        while "pipe_write" not in Path(f"/proc/{proc.pid}/wchan").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, "the build never wrote its report"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        threading.Thread(target=_drain, args=(read,), daemon=True).start()  # the reader comes back
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    assert "build stopped: terminated (SIGTERM)" in err, err
    assert "Traceback" not in err, err


def test_a_reader_that_leaves_mid_output_is_not_a_traceback(tmp_path: Path) -> None:
    """`phantora-assets query "..." --format csv | head -1` on a result larger than stdout's buffer:
    the reader leaves while the rows are written. Exit 141 (128 + SIGPIPE, as a shell reports `seq
    | head`), nothing on stderr. Was: a BrokenPipeError traceback from the csv writer, exit 1."""
    import duckdb

    data = tmp_path / "data"
    data.mkdir()
    duckdb.connect(str(data / "phantora.duckdb")).close()
    read, write = os.pipe()
    os.close(read)  # the reader has left
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "phantora_assets.cli", "query", "select * from range(200000)"]
            + ["--format", "csv", "--data-dir", str(data)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=tmp_path,
            timeout=120,
        )
    finally:
        os.close(write)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == "", proc.stderr


def test_build_with_a_file_as_data_dir_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Issue 39 item 14: `build --data-dir FILE` ended in a 26-line NotADirectoryError traceback from
    the instance's mkdir. The data root is checked before anything is read or written under it; a
    path under a file is refused the same way."""
    f = tmp_path / "not_a_dir"
    f.write_text("")
    for data_dir, rule in (
        (f, f"{f}: the data root must be a directory, and this is a file"),
        (f / "sub", f"{f / 'sub'}: the data root must be a directory, and its parent {f} is not one"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "phantora_assets.cli", "build", "--data-dir", str(data_dir)],
            capture_output=True,
            text=True,
            env=_env(),
            cwd=tmp_path,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == f"error: --data-dir {rule}\n"
    assert f.read_text() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["not_a_dir"]
