"""Found by the issue-12 attack on the console script's ending (``cli.run``: exit handlers, flush
of the standard streams, then ``os._exit``): real processes, real files."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
