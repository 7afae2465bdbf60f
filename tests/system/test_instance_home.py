"""One Dagster instance per data root: ``phantora-assets build`` with DAGSTER_HOME unset records into
``<data root>/dagster_home`` with the project's dagster.yaml settings, and a real ``dagster-webserver``
started as docs/INSTANCE.md says (``DAGSTER_HOME=<data root>/dagster_home``) lists every run the build
made, as the UI's runs page asks for them (GraphQL ``runsOrError``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import dagster as dg
import yaml
from fixtures.paths import ROOT

from phantora_assets.cli.build import HOME_YAML

BIN = Path(sys.executable).parent
FITS = "phantora_a100_40g_W1_2x1"
RUNS = """query { runsOrError(limit: 1000) { __typename ... on Runs { results { runId jobName status } } } }"""


def test_the_build_home_has_the_project_settings() -> None:
    """The dagster.yaml a build writes is the project's (same settings, so `dagster dev` on it gets the
    launcher, run queue, backfill threads and concurrency limits the project's file sets)."""
    assert yaml.safe_load(HOME_YAML) == yaml.safe_load((ROOT / "dagster.yaml").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _runs_of_webserver(port: int, timeout: float = 240.0) -> list[dict]:
    t0, last = time.monotonic(), None
    body = json.dumps({"query": RUNS}).encode()
    while time.monotonic() - t0 < timeout:
        try:
            req = urllib.request.Request(
                f"http://127.0.0.1:{port}/graphql", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                out = json.loads(resp.read())
            return out["data"]["runsOrError"]["results"]
        except (urllib.error.URLError, ConnectionError) as exc:
            last = exc
            time.sleep(0.5)
    raise AssertionError(f"dagster-webserver did not answer in {timeout:.0f} s: {last}")


def test_the_ui_on_the_data_root_instance_shows_every_build_run(tmp_path: Path) -> None:
    data = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME",) and not k.startswith("PHANTORA_ASSETS_")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "phantora_assets.cli", "build", "--data-dir", str(data), "--run", FITS, "--quiet"]
    built = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    home = data / "dagster_home"
    assert (home / "dagster.yaml").read_text() == HOME_YAML
    with dg.DagsterInstance.from_config(str(home)) as inst:
        made = {r.run_id: r.job_name for r in inst.get_runs()}
    assert sorted(made.values()) == ["all_runs", "dataset", "perf_dbs"], made

    # a second build under another DAGSTER_HOME is told where this data root's runs are
    other = tmp_path / "other_home"
    other.mkdir()
    (other / "dagster.yaml").write_text(HOME_YAML)
    again = subprocess.run(
        cmd, env={**env, "DAGSTER_HOME": str(other)}, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"earlier builds of this data root recorded theirs in {home.resolve()}" in again.stderr, again.stderr

    port = _free_port()
    web_env = {**env, "DAGSTER_HOME": str(home), "PHANTORA_ASSETS_DATA_DIR": str(data)}
    web = subprocess.Popen(
        [str(BIN / "dagster-webserver"), "-w", str(ROOT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
        env=web_env,
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        shown = _runs_of_webserver(port)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(web.pid, signal.SIGTERM)
        web.wait(60)
    assert {r["runId"]: r["jobName"] for r in shown} == made
    assert {r["status"] for r in shown} == {"SUCCESS"}
