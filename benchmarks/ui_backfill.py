"""The UI's backfill button and the CLI backfill against ``phantora-assets build``, side by side in one run.

Usage::

    python benchmarks/ui_backfill.py              # SQLite: build, button, CLI (every shipped partition)
    python benchmarks/ui_backfill.py --postgres   # the same on a throwaway PostgreSQL server
    python benchmarks/ui_backfill.py --paths build,button   # a subset

Measurements, one after the other, each on its own fresh data root and instance:

* ``build``: ``phantora-assets build --quiet`` (its own instance in ``<data>/dagster_home``), wall
  time of the process;
* ``button``: what the UI sends when a user opens the job ``all_runs``, clicks "Materialize all",
  keeps every partition and clicks "Launch backfill": the GraphQL mutation
  ``launchPartitionBackfill`` (the partition set ``all_runs_partition_set``, the job's assets,
  every partition name, the UI's tags), POSTed to a real ``dagster-webserver``; a real
  ``dagster-daemon run`` creates and launches the runs. The clock starts when the mutation is
  sent (the webserver and the daemon are up, their code servers loaded);
* ``cli``: ``dagster job backfill -j all_runs --all --noprompt`` under a real daemon (the
  CLI creates the runs itself; the daemon's run queue launches them). The clock starts when the
  command starts.

For both daemon paths the clock stops when every run of ``all_runs`` has finished and the
dataset assets (``phantora_v0``, ``dataset_duckdb``, ``dataset_plots``) have been materialized
by a run that the automation sensor launched after the last of them ended -- nobody launches it
by hand. The instance is the project's ``dagster.yaml``; with ``--postgres`` its SQLite event log
is replaced by the project's PostgreSQL storage (``phantora_assets.instance.PooledPostgresStorage``)
on a server this script starts (``tests/fixtures/pg_server.py``; as root it runs as the ``postgres`` user).

Printed: the load average, each wall time, the ratios button/build (target <= 1.5 on SQLite,
issue 29), cli/build and, with ``--postgres``, button/build and cli/build against target 2.0; the
status of every run (all must be SUCCESS: the runs that do not fit in GPU memory are successful
runs), the seconds from the click to the first run created, and whether every data root holds
byte-identical dataset CSVs. Exit code 0 iff every target is met, every run succeeded and the
CSVs agree.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGET = {"sqlite": 1.5, "postgres": 2.0}
DATASET = ("phantora_v0", "dataset_duckdb", "dataset_plots")
CSVS = ("runs.csv", "flows_100ms.csv", "windows.csv", "run_status.csv")
LOCATION, REPOSITORY, JOB = "phantora_assets", "__repository__", "all_runs"
BIN = Path(sys.executable).parent

LAUNCH = """mutation LaunchPartitionBackfill($backfillParams: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $backfillParams) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message stack }
    ... on PartitionSetNotFoundError { message }
  }
}"""
PARTITIONS = """query ($repo: RepositorySelector!, $name: String!) {
  partitionSetOrError(repositorySelector: $repo, partitionSetName: $name) {
    __typename
    ... on PartitionSet { partitionsOrError { ... on Partitions { results { name } } } }
  }
}"""


def _sha(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in CSVS if (folder / n).exists()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _graphql(port: int, query: str, variables: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/graphql",
        data=json.dumps({"query": query, "variables": variables}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    if out.get("errors"):
        raise RuntimeError(f"GraphQL errors: {out['errors']}")
    return out["data"]


def _wait_daemon(instance, timeout: float = 180.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if {"QUEUED_RUN_COORDINATOR", "ASSET", "BACKFILL"} <= set(instance.get_daemon_heartbeats()):
            return
        time.sleep(0.5)
    raise SystemExit(f"dagster-daemon reported no heartbeat in {timeout:.0f} s")


def _partition_names(port: int, timeout: float = 180.0) -> list[str]:
    """The partition names the UI's dialog lists, once the webserver has loaded the code location."""
    repo = {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY}
    t0 = time.monotonic()
    last: object = None
    while time.monotonic() - t0 < timeout:
        try:
            data = _graphql(port, PARTITIONS, {"repo": repo, "name": f"{JOB}_partition_set"})
            ps = data["partitionSetOrError"]
            if ps["__typename"] == "PartitionSet":
                return [p["name"] for p in ps["partitionsOrError"]["results"]]
            last = ps
        except (urllib.error.URLError, ConnectionError, RuntimeError) as exc:
            last = exc
        time.sleep(0.5)
    raise SystemExit(f"dagster-webserver did not serve the partition set in {timeout:.0f} s: {last}")


def _dataset_run(instance, after: float):
    """The finished run that materialized every dataset asset and started after ``after``."""
    for rec in instance.get_run_records():
        run = rec.dagster_run
        keys = {k.to_user_string() for k in (run.asset_selection or ())}
        if set(DATASET) <= keys and rec.start_time and rec.start_time >= after and run.is_finished:
            return rec
    return None


@contextlib.contextmanager
def _process(cmd: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, env=env, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _instance_yaml(storage: dict[str, Any] | None) -> str:
    """The project's dagster.yaml, with its event log replaced by ``storage`` when given."""
    import yaml

    cfg = yaml.safe_load((ROOT / "dagster.yaml").read_text())
    if storage is not None:
        for key in ("run_storage", "event_log_storage", "schedule_storage"):
            cfg.pop(key, None)
        cfg["storage"] = storage
    return yaml.safe_dump(cfg, sort_keys=False)


def _daemon_path(
    path: str, tmp: Path, env0: dict[str, str], storage: Callable[[str], dict[str, Any]] | None, timeout: float
) -> dict:
    """One backfill of every partition of all_runs, by the UI's mutation (``button``) or the CLI
    (``cli``), under a real daemon (and webserver), on a fresh home and data root."""
    import dagster as dg

    work = tmp / path
    home, data = work / "dagster_home", work / "data"
    home.mkdir(parents=True)
    (home / "dagster.yaml").write_text(_instance_yaml(storage(path) if storage else None))
    env = {**env0, "DAGSTER_HOME": str(home), "PHANTORA_ASSETS_DATA_DIR": str(data)}
    workspace = str(ROOT / "workspace.yaml")
    # create the instance's databases here, before the daemon starts: Dagster's SQLite run storage
    # is not safe to create from two processes at once (alembic_version gets two heads)
    instance = dg.DagsterInstance.from_config(str(home))
    with contextlib.ExitStack() as stack:
        stack.enter_context(instance)
        stack.enter_context(_process([str(BIN / "dagster-daemon"), "run", "-w", workspace], env, work / "daemon.log"))
        port = _free_port()
        if path == "button":
            cmd = [str(BIN / "dagster-webserver"), "-w", workspace, "-h", "127.0.0.1", "-p", str(port)]
            stack.enter_context(_process(cmd, env, work / "webserver.log"))
            names = _partition_names(port)
        _wait_daemon(instance)
        t0 = time.time()
        if path == "button":
            params = {
                "tags": [{"key": "dagster/from_ui", "value": "true"}],
                "assetSelection": [{"path": [n]} for n in _run_asset_names()],
                "partitionNames": names,
                "fromFailure": False,
                "selector": {
                    "partitionSetName": f"{JOB}_partition_set",
                    "repositorySelector": {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY},
                },
            }
            got = _graphql(port, LAUNCH, {"backfillParams": params})["launchPartitionBackfill"]
            if got["__typename"] != "LaunchBackfillSuccess":
                raise SystemExit(f"launchPartitionBackfill: {got}")
        else:
            sub = subprocess.run(
                [str(BIN / "dagster"), "job", "backfill", "-w", workspace, "-j", JOB, "--all", "--noprompt"],
                env=env,
                cwd=work,
                capture_output=True,
                text=True,
            )
            if sub.returncode:
                tail = sub.stdout[-2000:] + sub.stderr[-2000:]
                raise SystemExit(f"dagster job backfill exited {sub.returncode}:\n{tail}")
        submit_s = time.time() - t0
        while time.time() - t0 < timeout:
            recs = [r for r in instance.get_run_records() if r.dagster_run.job_name == JOB]
            if recs and all(r.dagster_run.is_finished for r in recs):
                last = max(r.end_time or 0 for r in recs)
                ds = _dataset_run(instance, last)
                if ds is not None:
                    break
            time.sleep(0.25)
        else:
            tail = (work / "daemon.log").read_text()[-3000:]
            raise SystemExit(f"{path}: timed out after {timeout:.0f} s; daemon log tail:\n{tail}")
        created = sorted(r.create_timestamp.timestamp() - t0 for r in recs)
        statuses: dict[str, int] = {}
        for r in recs:
            statuses[r.dagster_run.status.value] = statuses.get(r.dagster_run.status.value, 0) + 1
        return {
            "wall": (ds.end_time or time.time()) - t0,
            "runs": len(recs),
            "statuses": statuses,
            "submit": submit_s,
            "first": created[0],
            "last_created": created[-1],
            "green": statuses == {"SUCCESS": len(recs)} and ds.dagster_run.status.value == "SUCCESS",
            "sensor": ds.dagster_run.tags.get("dagster/sensor_name", "?"),
            "dataset_status": ds.dagster_run.status.value,
            "after_last": (ds.end_time or 0) - last,
            "data": data,
        }


def _run_asset_names() -> tuple[str, ...]:
    sys.path.insert(0, str(ROOT))
    from phantora_assets.assets import RUN_ASSET_NAMES

    return RUN_ASSET_NAMES


@contextlib.contextmanager
def _postgres(tmp: Path) -> Iterator[Callable[[str], dict[str, Any]]]:
    """A throwaway PostgreSQL server; yields ``storage(path)``: the ``storage:`` block naming the
    project's storage class on a fresh database of that server for each path."""
    import sqlalchemy as sa

    sys.path.insert(0, str(ROOT / "tests"))
    from fixtures.pg_server import pg_server

    with pg_server(tmp / "pg") as server:

        def storage(path: str) -> dict[str, Any]:
            engine = sa.create_engine(server.url("postgresql+psycopg2"), isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                conn.execute(sa.text(f'CREATE DATABASE "{server.dbname}_{path}"'))
            engine.dispose()
            block = server.project_storage()
            base = block["custom"]["config"]["postgres_url"]
            block["custom"]["config"]["postgres_url"] = f"{base}_{path}"
            return block

        yield storage


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--postgres", action="store_true", help="the daemon paths on a throwaway PostgreSQL server")
    ap.add_argument("--paths", default="build,button,cli", help="comma-separated: build, button, cli")
    args = ap.parse_args(argv)
    paths = args.paths.split(",")
    env0 = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "PHANTORA_ASSETS_DATA_DIR")}
    env0["PYTHONPATH"] = str(ROOT)
    kind = "postgres" if args.postgres else "sqlite"
    print(f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; instance: {kind}")
    ok = True
    with tempfile.TemporaryDirectory(prefix="ui_backfill_") as tmp_s, contextlib.ExitStack() as stack:
        tmp = Path(tmp_s)
        storage = stack.enter_context(_postgres(tmp)) if args.postgres else None
        build_s = None
        roots: dict[str, Path] = {}
        if "build" in paths:
            t0 = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-m", "phantora_assets.cli", "build", "--data-dir", str(tmp / "build"), "--quiet"],
                env=env0,
                cwd=tmp,
                capture_output=True,
                text=True,
            )
            build_s = time.perf_counter() - t0
            first_line = (out.stdout.strip().splitlines() or [""])[0]
            print(f"build:  {build_s:7.1f} s  (exit {out.returncode})  {first_line}", flush=True)
            if out.returncode:
                print(out.stdout[-2000:], out.stderr[-2000:])
                ok = False
            roots["build"] = tmp / "build"
        for path in ("button", "cli"):
            if path not in paths:
                continue
            r = _daemon_path(path, tmp, env0, storage, args.timeout)
            roots[path] = r["data"]
            ratio = f", {path}/build = {r['wall'] / build_s:.2f}" if build_s else ""
            print(
                f"{path}: {r['wall']:7.1f} s  ({r['runs']} runs {r['statuses']}; submitted in {r['submit']:.1f} s, "
                f"runs created {r['first']:.1f}-{r['last_created']:.1f} s after the click; "
                f"dataset run {r['dataset_status']}, launched by {r['sensor']}, "
                f"ended {r['after_last']:.1f} s after the last run){ratio}",
                flush=True,
            )
            ok &= r["green"]
            if build_s:
                target = TARGET[kind] if path == "button" or kind == "postgres" else None
                if target is not None:
                    met = r["wall"] / build_s <= target
                    verdict = "met" if met else "MISSED"
                    print(f"  {path} / build = {r['wall'] / build_s:.2f}  (target <= {target}: {verdict})")
                    ok &= met
        shas = {p: _sha(root / "phantora_v0") for p, root in roots.items()}
        same = len({json.dumps(s, sort_keys=True) for s in shas.values()}) == 1 and all(shas.values())
        print(f"dataset CSVs byte-identical ({', '.join(shas)}): {same}")
        ok &= same
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
