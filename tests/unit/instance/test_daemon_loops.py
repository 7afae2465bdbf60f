"""The daemon loop intervals of the project's instance (phantora_assets/instance/daemon_loops.py): set in
every process that imports ``phantora_assets.instance`` (as loading the project's dagster.yaml does), from
the environment when given, refused when not a number of seconds; and the backfill loop still reads the
constant it sets (a Dagster upgrade that stops reading it would leave the button path 30 s slow)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import phantora_assets.instance  # noqa: F401  (applies the intervals)
from phantora_assets.instance import daemon_loops


def test_the_intervals_are_set_on_import() -> None:
    from dagster._daemon import asset_daemon, backfill, controller

    assert controller.DEFAULT_DAEMON_INTERVAL_SECONDS == daemon_loops.BACKFILL_LOOP_S == 1.0
    assert asset_daemon.MIN_INTERVAL_LOOP_SECONDS == daemon_loops.ASSET_LOOP_S == 1.0
    assert "DEFAULT_DAEMON_INTERVAL_SECONDS" in backfill.execute_backfill_iteration_loop.__code__.co_names


@pytest.mark.slow
def test_a_process_loading_the_instance_yaml_gets_them(tmp_path) -> None:
    """A fresh interpreter that only loads an instance from the project's storage gets both values
    (from the environment here)."""
    (tmp_path / "dagster.yaml").write_text(
        "event_log_storage:\n  module: phantora_assets.instance\n  class: PooledSqliteEventLogStorage\n"
    )
    code = (
        "import dagster as dg\n"
        f"dg.DagsterInstance.from_config({str(tmp_path)!r}).dispose()\n"
        "from dagster._daemon import asset_daemon, controller\n"
        "print(controller.DEFAULT_DAEMON_INTERVAL_SECONDS, asset_daemon.MIN_INTERVAL_LOOP_SECONDS)\n"
    )
    env = {daemon_loops.BACKFILL_ENV: "2.5", daemon_loops.ASSET_ENV: "3"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**_env(), **env}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2.5", "3.0"]


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("PHANTORA_ASSETS_")}


@pytest.mark.parametrize("raw", ["soon", "0", "-1", "7200"])
def test_a_bad_interval_is_refused_with_the_variable(monkeypatch, raw: str) -> None:
    monkeypatch.setenv(daemon_loops.BACKFILL_ENV, raw)
    with pytest.raises(ValueError, match=rf"\$PHANTORA_ASSETS_BACKFILL_LOOP_SECONDS={raw!r}"):
        daemon_loops.apply()
