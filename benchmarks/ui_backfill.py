"""The UI path against ``phantora-assets build``, side by side in one run.

Usage::

    python benchmarks/ui_backfill.py      # every partition of the shipped matrix (or $PHANTORA_ASSETS_RUN_MATRIX)

Two measurements, one after the other, each on its own fresh data root:

* ``build``: ``phantora-assets build --quiet`` (its own instance in ``<data>/dagster_home``), wall
  time of the process;
* ``backfill``: a fresh ``$DAGSTER_HOME`` holding only the project's ``dagster.yaml``;
  ``dagster-daemon run -w workspace.yaml`` is started and, once its run queue and asset daemons
  report heartbeats, the clock starts and ``dagster job backfill -j all_runs --all --noprompt``
  (what the UI's backfill of the job does) submits one run per partition. The clock stops when
  every backfill run has finished and the dataset assets (``phantora_v0``, ``dataset_duckdb``,
  ``dataset_plots``) have been materialized by a run that the automation sensor launched after
  the last backfill run ended -- nobody launches it by hand.

Printed: both wall times, the ratio backfill/build (target <= 2.0, issue 12), the status of every
run (all must be SUCCESS: the runs that do not fit in GPU memory are successful runs), the most
runs in progress at once, and whether both data roots hold byte-identical dataset CSVs.
Exit code 0 iff the target is met, every run succeeded and the CSVs agree.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 2.0
DATASET = ("phantora_v0", "dataset_duckdb", "dataset_plots")
CSVS = ("runs.csv", "flows_100ms.csv", "windows.csv", "run_status.csv")


def _sha(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in CSVS if (folder / n).exists()}


def _wait_daemon(instance, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        beats = instance.get_daemon_heartbeats()
        if {"QUEUED_RUN_COORDINATOR", "ASSET"} <= set(beats):
            return
        time.sleep(0.5)
    raise SystemExit("dagster-daemon reported no heartbeat in 120 s")


def _dataset_run(instance, after: float):
    """The finished run that materialized every dataset asset and started after ``after``."""
    for rec in instance.get_run_records():
        run = rec.dagster_run
        keys = {k.to_user_string() for k in (run.asset_selection or ())}
        if set(DATASET) <= keys and rec.start_time and rec.start_time >= after and run.is_finished:
            return rec
    return None


def main(argv: list[str] | None = None) -> int:  # noqa: PLR0915 (a benchmark script: start, backfill, poll and report, in order)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--keep", type=Path, default=None, help="copy the backfill's DAGSTER_HOME here")
    args = ap.parse_args(argv)
    py = sys.executable
    env0 = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "PHANTORA_ASSETS_DATA_DIR")}
    env0["PYTHONPATH"] = str(ROOT)
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="ui_backfill_") as tmp_s:
        tmp = Path(tmp_s)
        matrix_env = dict(env0)
        # 1. phantora-assets build
        t0 = time.perf_counter()
        out = subprocess.run(
            [py, "-m", "phantora_assets.cli", "build", "--data-dir", str(tmp / "build"), "--quiet"],
            env=matrix_env,
            cwd=tmp,
            capture_output=True,
            text=True,
        )
        build_s = time.perf_counter() - t0
        print(f"build:    {build_s:7.1f} s  (exit {out.returncode})  {out.stdout.strip().splitlines()[0]}")
        if out.returncode:
            print(out.stdout[-2000:], out.stderr[-2000:])
        # 2. the daemon-driven backfill
        home = tmp / "home"
        home.mkdir()
        shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
        env = {**matrix_env, "DAGSTER_HOME": str(home), "PHANTORA_ASSETS_DATA_DIR": str(tmp / "ui")}
        os.environ.update({"DAGSTER_HOME": str(home)})
        import dagster as dg

        # create the instance's databases here, before the daemon starts: Dagster's SQLite run
        # storage is not safe to create from two processes at once (alembic_version gets two heads)
        dg.DagsterInstance.get().dispose()
        log = open(tmp / "daemon.log", "w")
        daemon = subprocess.Popen(
            [py, "-m", "dagster._daemon", "run", "-w", str(ROOT / "workspace.yaml")],
            env=env,
            cwd=tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            with dg.DagsterInstance.get() as instance:
                _wait_daemon(instance)
                t0 = time.time()
                sub = subprocess.run(
                    [py, "-m", "dagster", "job", "backfill", "-w", str(ROOT / "workspace.yaml"), "-j", "all_runs"]
                    + ["--all", "--noprompt"],
                    env=env,
                    cwd=tmp,
                    capture_output=True,
                    text=True,
                )
                if sub.returncode:
                    print(sub.stdout[-2000:], sub.stderr[-2000:])
                    return 1
                submit_s = time.time() - t0
                peak, ds = 0, None
                while time.time() - t0 < args.timeout:
                    recs = [r for r in instance.get_run_records() if r.dagster_run.job_name == "all_runs"]
                    peak = max(peak, sum(r.dagster_run.status.value in ("STARTING", "STARTED") for r in recs))
                    if recs and all(r.dagster_run.is_finished for r in recs):
                        last = max(r.end_time or 0 for r in recs)
                        ds = _dataset_run(instance, last)
                        if ds is not None:
                            break
                    time.sleep(0.25)
                else:
                    print(f"timed out after {args.timeout:.0f} s; daemon log tail:")
                    print((tmp / "daemon.log").read_text()[-3000:])
                    return 1
                backfill_s = (ds.end_time or time.time()) - t0
                workers = {r.dagster_run.tags.get("phantora/run_worker_pid") for r in recs}
                statuses: dict[str, int] = {}
                for r in recs:
                    statuses[r.dagster_run.status.value] = statuses.get(r.dagster_run.status.value, 0) + 1
                print(
                    f"backfill: {backfill_s:7.1f} s  ({len(recs)} runs {statuses}, submitted in {submit_s:.1f} s, "
                    f"at most {peak} in progress at once, in {len(workers)} worker processes; "
                    f"dataset run {ds.dagster_run.run_id[:8]} "
                    f"{ds.dagster_run.status.value}, launched by {ds.dagster_run.tags.get('dagster/sensor_name', '?')}"
                    f", ended {ds.end_time - last:.1f} s after the last backfill run)"
                )
        finally:
            os.killpg(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(daemon.pid, signal.SIGKILL)
            log.close()
        if args.keep is not None:
            shutil.copytree(home, args.keep, dirs_exist_ok=True)
        same = _sha(tmp / "build" / "phantora_v0") == _sha(tmp / "ui" / "phantora_v0") != {}
        ratio = backfill_s / build_s
        green = statuses == {"SUCCESS": len(recs)} and ds.dagster_run.status.value == "SUCCESS"
        print(f"dataset CSVs byte-identical (build vs backfill): {same}")
        print(f"backfill / build = {ratio:.2f}  (target <= {TARGET}: {'met' if ratio <= TARGET else 'MISSED'})")
        return 0 if ratio <= TARGET and green and same and out.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
