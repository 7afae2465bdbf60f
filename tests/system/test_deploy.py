"""deploy/: the image, the Docker Compose and Kubernetes (Helm) deployments, checked as far as a machine
without a Docker engine or a cluster allows, each against the tool's own rules:

- deploy/dagster.yaml through Dagster's instance schema (``dagster_instance_config``), its run launcher
  against ``DockerRunLauncher.config_type()``, its storage against dagster-postgres's, and the whole
  instance started against a real PostgreSQL server when this machine has the server binaries;
- deploy/workspace.yaml through Dagster's workspace schema, and loaded for real against the gRPC server
  that deploy/Dockerfile's command starts;
- deploy/docker-compose.yaml by ``docker compose config`` where a Compose CLI exists, and always parsed:
  files, mounts, environment, network and volume names against what the instance config and the image use;
- deploy/Dockerfile: base image, pins, command (parsed by Dagster's own CLI), and its build context
  (deploy/Dockerfile.dockerignore applied to the repository) holding what ``pip install .`` needs;
- deploy/helm/values.yaml: keys against the chart's values schema (the key names below are those of the
  dagster/dagster chart's schema), and the instance config the chart renders from them through Dagster's
  instance schema and ``K8sRunLauncher.config_type()``;
- the run limits of every deployment equal those of the project's own dagster.yaml.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, NoReturn

import click
import pytest
import yaml
from dagster._config import process_config
from dagster._core.errors import DagsterInvalidConfigError
from dagster._core.instance.config import dagster_instance_config
from dagster._core.workspace.config_schema import ensure_workspace_config
from fixtures.paths import ROOT
from fixtures.pg_server import REQUIRE_ENV, PostgresUnavailable, free_port, pg_server

DEPLOY = ROOT / "deploy"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DAGSTER_SERVICES = ("phantora_assets", "dagster_webserver", "dagster_daemon")
SOCKET = "/var/run/docker.sock"


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _instance() -> dict[str, Any]:
    return _yaml(DEPLOY / "dagster.yaml")


def _project_concurrency() -> dict[str, Any]:
    """The run and pool limits of the project's own dagster.yaml (what every deployment carries over)."""
    return _yaml(ROOT / "dagster.yaml")["concurrency"]


def _env_refs(node: Any) -> set[str]:
    """Names of the environment variables a config reads (``{env: NAME}``)."""
    if isinstance(node, dict):
        if set(node) == {"env"}:
            return {node["env"]}
        return set().union(*(_env_refs(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(_env_refs(v) for v in node)) if node else set()
    return set()


# ---------------------------------------------------------------------------------------------- Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Dockerfile: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, rest = (pending + line).partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    assert not pending, "deploy/Dockerfile ends in a continuation line"
    return out


def _instructions(name: str) -> list[str]:
    return [args for word, args in _dockerfile() if word == name]


def _image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in _instructions("ENV"):
        for key, value in re.findall(r'(\w+)=("[^"]*"|\S+)', args):
            env[key] = value.strip('"')
    return env


def _cmd() -> list[str]:
    (cmd,) = _instructions("CMD")
    return json.loads(cmd)


def test_dockerfile_base_image_and_python():
    from packaging.specifiers import SpecifierSet

    froms = _instructions("FROM")
    assert froms == ["python:3.11-slim"]
    assert "3.11" in SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"


def _pins() -> dict[str, str]:
    """name -> version of every ``==`` pin of pyproject.toml (dependencies and every extra)."""
    deps = list(PYPROJECT["project"]["dependencies"])
    for extra in PYPROJECT["project"]["optional-dependencies"].values():
        deps += extra
    pins = {}
    for dep in deps:
        if dep.startswith(f"{PYPROJECT['project']['name']}["):  # dev brings other extras: their pins are there
            continue
        name, sep, version = dep.partition("==")
        assert sep, f"{dep!r} is not pinned with =="
        pins[name.strip().lower()] = version.strip()
    return pins


def test_dockerfile_installs_the_project_with_its_pins():
    extras = PYPROJECT["project"]["optional-dependencies"]
    pins = _pins()
    # SQLAlchemy 2.0, whose bare postgresql:// is psycopg2's, the driver dagster-postgres is written for (issue 39
    # item 15; tests/system/test_postgres_storage.py loads Dagster's own storage as its docs write it)
    assert extras["postgres"] == ["dagster-postgres==0.29.27", "sqlalchemy==2.0.58"]
    assert extras["k8s"] == ["dagster-k8s==0.29.27"]
    # the README's one install command (pip install -e ".[dev]") brings what every test needs
    assert "phantora-assets[postgres,k8s,test]" in extras["dev"]
    # the run launchers and storage of the deployments, all at the one version of the integrations
    integration = {n: v for n, v in pins.items() if n.startswith("dagster-") and not v.startswith("1.")}
    assert {"dagster-docker", "dagster-postgres", "dagster-k8s"} <= set(integration)
    assert set(integration.values()) == {"0.29.27"}
    assert pins["dagster"] == pins["dagster-webserver"] == "1.13.27"

    (arg,) = _instructions("ARG")
    name, _, default = arg.partition("=")
    assert name == "EXTRAS"
    assert default == "postgres"
    # the image for Kubernetes (README, values.yaml) adds k8s; every extra named exists in pyproject
    for extra_set in (default, "postgres,k8s"):
        assert set(extra_set.split(",")) <= set(extras)
    runs = " ".join(_instructions("RUN"))
    assert 'pip install ".[${EXTRAS}]"' in runs
    # nothing installed at another version than pyproject.toml's
    for name, version in re.findall(r"([A-Za-z0-9_.\-]+)==([\w.]+)", runs):
        assert pins.get(name.lower()) == version, f"deploy/Dockerfile pins {name}=={version}"


def test_dockerfile_command_is_the_code_location_server():
    module = PYPROJECT["tool"]["dagster"]["module_name"]
    assert _cmd() == ["dagster", "code-server", "start", "-h", "0.0.0.0", "-p", "4000", "-m", module]
    assert _instructions("EXPOSE") == ["4000"]
    # Kubernetes passes the chart's command as `args` and the run launchers pass `dagster api
    # execute_run ...` as the command: an ENTRYPOINT would be prepended to each
    assert _instructions("ENTRYPOINT") == []
    _parse_cli(_cmd())


def test_dockerfile_environment():
    env = _image_env()
    assert env["DAGSTER_HOME"] == "/opt/dagster/dagster_home"
    assert env["PHANTORA_ASSETS_DATA_DIR"] == "/opt/dagster/data"
    # the installed package does not sit beside perfdb/ (lib/phantora/perfdb.default_perfdb_dir): the image copies
    # it and says where
    copies = [c.split() for c in _instructions("COPY")]
    assert ["perfdb/", env["PHANTORA_ASSETS_PERFDB_DIR"].rstrip("/") + "/"] in copies


# the Dockerfile-specific ignore file (BuildKit): deploy/Dockerfile.dockerignore, patterns relative to
# the context root (the repository)
def _ignore_rules() -> list[tuple[bool, re.Pattern[str], str]]:
    """(exception?, regex, pattern) per line, ``**`` any folders, ``*`` and ``?`` within one name."""
    rules = []
    for raw in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((negate, re.compile(regex + r"\Z"), pattern))
    return rules


def _ignored(rel: str, rules: list[tuple[bool, re.Pattern[str], str]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for negate, regex, _ in rules:
        if any(regex.match(p) for p in prefixes):
            ignored = not negate
    return ignored


def _build_context() -> set[str]:
    rules = _ignore_rules()
    exceptions = [pattern for negate, _, pattern in rules if negate]

    def may_reinclude_below(folder: str) -> bool:
        return any(p.startswith(folder + "/") or p[:1] in "*?[" for p in exceptions)

    files: set[str] = set()
    for folder, dirs, names in os.walk(ROOT):
        rel_folder = os.path.relpath(folder, ROOT)
        rel_folder = "" if rel_folder == "." else rel_folder + "/"
        # descend into an excluded folder only if an exception could re-include something below it
        dirs[:] = [d for d in dirs if not _ignored(rel_folder + d, rules) or may_reinclude_below(rel_folder + d)]
        files |= {rel_folder + n for n in names if not _ignored(rel_folder + n, rules)}
    return files


def test_build_context_holds_what_the_install_needs():
    context = _build_context()
    # every COPY source is in the context
    for copy in _instructions("COPY"):
        *sources, _dest = copy.split()
        for src in sources:
            src = src.rstrip("/")
            assert any(f == src or f.startswith(src + "/") for f in context), f"COPY {src}: not in the context"
    # what setuptools reads: pyproject.toml, its readme, every module, the package data, the C source
    pkg = ROOT / "phantora_assets"
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"]}
    needed |= {str(p.relative_to(ROOT)) for p in pkg.rglob("*.py") if "__pycache__" not in p.parts}
    for pattern in PYPROJECT["tool"]["setuptools"]["package-data"]["phantora_assets"]:
        needed |= {str(p.relative_to(ROOT)) for p in pkg.rglob(pattern)}
    for ext in PYPROJECT["tool"]["setuptools"]["ext-modules"]:
        needed |= set(ext["sources"])
    needed |= {str(p.relative_to(ROOT)) for p in (ROOT / "perfdb").rglob("*") if p.is_file()}
    assert needed - context == set()
    assert any(f.endswith(".toml") and f.startswith("phantora_assets/") for f in context)
    # and nothing else: no virtualenv, git, data, tests, caches or compiled objects of this checkout
    assert not [f for f in context if f.split("/")[0] in {".venv", ".git", "data", "tests", "benchmarks", "deploy"}]
    assert not [f for f in context if "__pycache__" in f or f.endswith((".so", ".pyc"))]


def test_dockerfile_parses_with_the_official_parser():
    import dockerfile  # BuildKit's parser; the dev extra brings it

    parsed = dockerfile.parse_file(str(DEPLOY / "Dockerfile"))
    assert [c.cmd.upper() for c in parsed] == [w for w, _ in _dockerfile()]
    (cmd,) = [c for c in parsed if c.cmd.upper() == "CMD"]
    assert list(cmd.value) == _cmd() and cmd.json
    # the reading of ENV and COPY the other tests rely on is BuildKit's
    env = {}
    for c in parsed:
        if c.cmd.upper() == "ENV":
            env |= dict(zip(c.value[::2], c.value[1::2]))
    assert env == _image_env()
    assert [list(c.value) for c in parsed if c.cmd.upper() == "COPY"] == [c.split() for c in _instructions("COPY")]


# ------------------------------------------------------------------------------------- Dagster's own CLIs


def _parse_cli(argv: list[str], paths: dict[str, Path] | None = None) -> click.Context:
    """Parse ``argv`` with the click command of its console script, as the container would run it
    (options, choices, types; paths of the container mapped to the repository's files by ``paths``);
    raises click's UsageError on an unknown option or a bad value."""
    argv = [str(paths.get(a, a)) if paths else a for a in argv]
    (ep,) = entry_points(group="console_scripts", name=argv[0])
    command: click.Command = importlib.import_module(ep.module).cli  # the click group main() invokes
    args = argv[1:]
    name = argv[0]
    while isinstance(command, click.Group):
        sub = command.get_command(click.Context(command), args[0])
        assert sub is not None, f"{name}: no subcommand {args[0]!r}"
        name, command, args = f"{name} {args[0]}", sub, args[1:]
    return command.make_context(name, list(args))


# ------------------------------------------------------------------------------- the instance (Compose)


def test_instance_loads_through_dagster_schema():
    config, custom_class = dagster_instance_config(str(DEPLOY))
    assert custom_class is None
    assert config["run_launcher"]["module"] == "dagster_docker"
    assert config["run_launcher"]["class"] == "DockerRunLauncher"
    assert config["run_coordinator"]["class"] == "QueuedRunCoordinator"
    assert set(config["storage"]) == {"custom"}
    storage = config["storage"]["custom"]
    assert (storage["module"], storage["class"]) == ("phantora_assets.instance", "PooledPostgresStorage")
    db = storage["config"]["postgres_db"]
    # every connection setting from the environment, the driver named
    assert {k: v for k, v in db.items() if k != "scheme"} == {
        "username": {"env": "DAGSTER_POSTGRES_USER"},
        "password": {"env": "DAGSTER_POSTGRES_PASSWORD"},
        "hostname": {"env": "DAGSTER_POSTGRES_HOST"},
        "db_name": {"env": "DAGSTER_POSTGRES_DB"},
        "port": {"env": "DAGSTER_POSTGRES_PORT"},
    }
    assert db["scheme"] == "postgresql+psycopg2"


def test_instance_carries_the_project_limits():
    project = _project_concurrency()
    assert project["runs"]["max_concurrent_runs"] == 4
    assert {"key": "phantora/simulator", "value": "docker", "limit": 1} in project["runs"]["tag_concurrency_limits"]
    assert _instance()["concurrency"] == project
    # and the concurrency config is one Dagster accepts next to this run coordinator
    config, _ = dagster_instance_config(str(DEPLOY))
    assert config["concurrency"]["pools"]["default_limit"] == project["pools"]["default_limit"]


def test_instance_schema_rejects_a_broken_copy(tmp_path):
    """The schema check above can fail: a misspelt key and a conflicting limit are refused."""
    broken = _instance()
    broken["run_launcher"]["config"]["netwrok"] = broken["run_launcher"]["config"].pop("network")
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(broken))
    config, _ = dagster_instance_config(str(tmp_path))  # the launcher's own config is Permissive here ...
    from dagster_docker import DockerRunLauncher

    # ... and refused by the launcher's schema
    assert not process_config(DockerRunLauncher.config_type(), config["run_launcher"]["config"]).success
    conflicting = _instance()
    conflicting["run_coordinator"]["config"] = {"max_concurrent_runs": 4}
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(conflicting))
    with pytest.raises(DagsterInvalidConfigError, match="incompatible with the `concurrency > runs` config"):
        dagster_instance_config(str(tmp_path))


def test_run_launcher_config_is_docker_run_launcher_s():
    from dagster_docker import DockerRunLauncher

    launcher_config = _instance()["run_launcher"]["config"]
    result = process_config(DockerRunLauncher.config_type(), launcher_config)
    assert result.success, result.errors
    launcher = DockerRunLauncher(**result.value)  # validates network / container_kwargs as Dagster does
    assert launcher.networks == ["phantora_assets"]
    assert set(launcher.env_vars) == _env_refs(_instance()["storage"])
    assert launcher.image is None  # the image is the code location's (DAGSTER_CURRENT_IMAGE)


def test_storage_config_is_dagster_postgres_s(monkeypatch):
    import sqlalchemy
    from dagster_postgres import DagsterPostgresStorage
    from dagster_postgres.utils import pg_url_from_config

    storage = _instance()["storage"]["custom"]["config"]  # PooledPostgresStorage takes dagster-postgres's config
    for name, value in [
        ("DAGSTER_POSTGRES_USER", "u"),
        ("DAGSTER_POSTGRES_PASSWORD", "p"),
        ("DAGSTER_POSTGRES_HOST", "postgresql"),
        ("DAGSTER_POSTGRES_DB", "d"),
        ("DAGSTER_POSTGRES_PORT", "5432"),
    ]:
        monkeypatch.setenv(name, value)
    result = process_config(DagsterPostgresStorage.config_type(), storage)
    assert result.success, result.errors
    url = pg_url_from_config(result.value)
    assert url == "postgresql+psycopg2://u:p@postgresql:5432/d"
    sqlalchemy.create_engine(url)  # the driver the URL names is importable (a bare postgresql:// is not)
    monkeypatch.delenv("DAGSTER_POSTGRES_PORT")
    assert not process_config(DagsterPostgresStorage.config_type(), storage).success


def _no_postgres(reason: str) -> NoReturn:
    """Skip, or fail where CI asks for PostgreSQL (.ci/run sets PHANTORA_ASSETS_REQUIRE_POSTGRES)."""
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(reason)
    pytest.skip(reason)


@contextlib.contextmanager
def _postgres(folder: Path):
    """The throwaway server of ``tests/fixtures/pg_server.py`` (the machine's own binaries, 127.0.0.1, a free
    port; as root, run as an unprivileged user) with an empty database ``phantora``."""
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(pg_server(folder, dbname="phantora"))
        except PostgresUnavailable as exc:
            _no_postgres(str(exc))
        yield {
            "host": server.host,
            "port": server.port,
            "user": server.user,
            "password": server.password,
            "db": "phantora",
        }


def test_instance_starts_against_postgresql(tmp_path, monkeypatch):
    """deploy/dagster.yaml as the webserver and the daemon load it, against a real PostgreSQL server (this
    machine's; the compose file runs postgres:15)."""
    from dagster import DagsterInstance, DagsterRun, DagsterRunStatus
    from dagster._core.run_coordinator import QueuedRunCoordinator
    from dagster_docker import DockerRunLauncher
    from dagster_postgres import PostgresRunStorage

    from phantora_assets.instance.postgres import (
        PooledPostgresEventLogStorage,
        PooledPostgresRunStorage,
        PooledPostgresScheduleStorage,
    )

    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(DEPLOY / "dagster.yaml", home / "dagster.yaml")
    with _postgres(tmp_path / "pg") as pg:
        for name, value in [
            ("DAGSTER_POSTGRES_USER", pg["user"]),
            ("DAGSTER_POSTGRES_PASSWORD", pg["password"]),
            ("DAGSTER_POSTGRES_HOST", pg["host"]),
            ("DAGSTER_POSTGRES_DB", "phantora"),
            ("DAGSTER_POSTGRES_PORT", str(pg["port"])),
        ]:
            monkeypatch.setenv(name, value)
        with DagsterInstance.from_config(str(home)) as instance:
            # the project's kept-connection storage (what makes a PostgreSQL backfill as fast as SQLite's)
            assert isinstance(instance.run_storage, PooledPostgresRunStorage)
            assert isinstance(instance.event_log_storage, PooledPostgresEventLogStorage)
            assert isinstance(instance.schedule_storage, PooledPostgresScheduleStorage)
            assert isinstance(instance.run_storage, PostgresRunStorage)  # still dagster-postgres's underneath
            assert isinstance(instance.run_coordinator, QueuedRunCoordinator)
            assert isinstance(instance.run_launcher, DockerRunLauncher)
            assert instance.run_launcher.networks == ["phantora_assets"]

            limits = instance.get_concurrency_config()
            project = _project_concurrency()
            assert limits.run_queue_config.max_concurrent_runs == project["runs"]["max_concurrent_runs"]
            assert list(limits.run_queue_config.tag_concurrency_limits) == project["runs"]["tag_concurrency_limits"]
            assert limits.pool_config.default_pool_limit == project["pools"]["default_limit"]

            # the tables exist: a run of the Docker simulator is stored and read back
            run = instance.add_run(
                DagsterRun(
                    job_name="docker_runs", status=DagsterRunStatus.NOT_STARTED, tags={"phantora/simulator": "docker"}
                )
            )
            assert instance.get_run_by_id(run.run_id).tags["phantora/simulator"] == "docker"

            # a run container rebuilds this instance from its ref: the variables it reads are exactly
            # those the run launcher hands on
            ref = instance.get_ref()
            # (a custom storage: the ref holds its config as written, env: references unresolved)
            assert ref.storage_data is not None and ref.storage_data.class_name == "PooledPostgresStorage"
            assert _env_refs(yaml.safe_load(ref.storage_data.config_yaml)) == set(instance.run_launcher.env_vars)
            assert pg["password"] not in ref.storage_data.config_yaml  # no secret written into the ref


# ------------------------------------------------------------------------------------------- workspace


def test_workspace_loads_through_dagster_schema():
    path = DEPLOY / "workspace.yaml"
    config = ensure_workspace_config(_yaml(path), str(path))
    (entry,) = config["load_from"]
    server = entry["grpc_server"]
    assert server == {"host": "phantora_assets", "port": 4000, "location_name": "phantora_assets"}
    assert server["location_name"] == PYPROJECT["tool"]["dagster"]["code_location_name"]
    assert str(server["port"]) == _cmd()[_cmd().index("-p") + 1]
    bad = {"load_from": [{"grpc_server": {"host": "phantora_assets", "prot": 4000}}]}
    with pytest.raises(DagsterInvalidConfigError):
        ensure_workspace_config(bad, str(path))


def test_code_location_server_serves_the_workspace(tmp_path):
    """deploy/Dockerfile's command, run here (on 127.0.0.1 and a free port), loaded through
    deploy/workspace.yaml's entry as the webserver and the daemon load it."""
    from dagster import DagsterInstance
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import WorkspaceFileTarget
    from dagster._grpc.client import DagsterGrpcClient

    port = free_port()
    argv = _cmd()
    argv[argv.index("-h") + 1] = "127.0.0.1"
    argv[argv.index("-p") + 1] = str(port)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    image = _compose_from_yaml()["services"]["phantora_assets"]["environment"]["DAGSTER_CURRENT_IMAGE"]
    env = os.environ | {
        "DAGSTER_HOME": str(tmp_path / "home"),
        "PHANTORA_ASSETS_DATA_DIR": str(tmp_path / "data"),
        "DAGSTER_CURRENT_IMAGE": image,
    }
    exe = shutil.which(argv[0], path=os.path.dirname(sys.executable)) or shutil.which(argv[0])
    assert exe, f"{argv[0]} is not installed"
    with open(tmp_path / "server.log", "w") as log:
        server = subprocess.Popen([exe, *argv[1:]], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    try:
        client = DagsterGrpcClient(port=port, host="127.0.0.1")
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            with contextlib.suppress(Exception):
                if client.ping("deploy")["echo"] == "deploy":
                    break
            assert time.monotonic() < deadline, "the code location server did not answer in 180 s"
            time.sleep(0.5)
        workspace = _yaml(DEPLOY / "workspace.yaml")
        workspace["load_from"][0]["grpc_server"].update(host="127.0.0.1", port=port)
        (tmp_path / "workspace.yaml").write_text(yaml.safe_dump(workspace))
        with (
            DagsterInstance.from_config(str(tmp_path / "home")) as instance,
            WorkspaceProcessContext(instance, WorkspaceFileTarget(paths=[str(tmp_path / "workspace.yaml")])) as ctx,
        ):
            request = ctx.create_request_context()
            assert not request.has_code_location_error("phantora_assets"), request.get_code_location_error(
                "phantora_assets"
            )
            location = request.get_code_location("phantora_assets")
            assert location.container_image == image  # what DockerRunLauncher launches runs in
            (repo,) = location.get_repositories().values()
            jobs = {j.name for j in repo.get_all_jobs()}
            assert {"all_runs", "docker_runs", "dataset"} <= jobs
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


# ------------------------------------------------------------------------------------------ Compose

_INTERPOLATION = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(node: Any) -> Any:
    """Compose's variable substitution with the defaults (``${NAME:-default}``; ``$$`` is a ``$``)."""
    if isinstance(node, str):
        return _INTERPOLATION.sub(lambda m: m.group(2) or "", node.replace("$$", "\0")).replace("\0", "$")
    if isinstance(node, dict):
        return {k: _interpolate(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v) for v in node]
    return node


def _compose_from_yaml() -> dict[str, Any]:
    return _interpolate(_yaml(DEPLOY / "docker-compose.yaml"))  # YAML anchors and << merges resolved


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    found = shutil.which("docker-compose", path=os.path.dirname(sys.executable)) or shutil.which("docker-compose")
    if found and subprocess.run([found, "version"], capture_output=True).returncode == 0:
        return [found]
    return None


def _mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """target -> (type, source) of a service's volumes, short or long syntax; bind sources absolute."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target, *_ = v.split(":")
            kind = "bind" if source.startswith((".", "/")) else "volume"
        else:
            source, target, kind = v["source"], v["target"], v["type"]
        if kind == "bind":
            source = os.path.normpath(os.path.join(DEPLOY, source))
        out[target] = (kind, source)
    return out


def _check_compose(model: dict[str, Any]) -> None:
    services = model["services"]
    assert set(services) == {"postgresql", *DAGSTER_SERVICES}
    assert services["postgresql"]["image"] == "postgres:15"
    image_env = _image_env()
    home = image_env["DAGSTER_HOME"]
    instance = _instance()
    launcher = instance["run_launcher"]["config"]

    # one image, built from the repository with deploy/Dockerfile; the code location names it for its runs
    images = {services[s]["image"] for s in DAGSTER_SERVICES}
    assert len(images) == 1
    for name in DAGSTER_SERVICES:
        build = services[name]["build"]
        context = (DEPLOY / build["context"]).resolve()
        assert context == ROOT
        assert (context / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    assert services["phantora_assets"]["environment"]["DAGSTER_CURRENT_IMAGE"] in images
    assert services["phantora_assets"].get("command") is None  # the image's: the code location server

    # every file mounted exists; the instance and the workspace are where Dagster looks for them
    for name in DAGSTER_SERVICES:
        mounts = _mounts(services[name])
        for target, (kind, source) in mounts.items():
            if kind == "bind" and target != SOCKET:
                assert Path(source).is_file(), f"{name} mounts {source}, which does not exist"
        assert mounts[f"{home}/dagster.yaml"] == ("bind", str(DEPLOY / "dagster.yaml"))
    for name in ("dagster_webserver", "dagster_daemon"):
        mounts = _mounts(services[name])
        command = services[name]["command"]
        workspace = command[command.index("-w") + 1]
        assert mounts[workspace] == ("bind", str(DEPLOY / "workspace.yaml"))
        assert mounts[SOCKET] == ("bind", SOCKET)  # the run launcher launches and terminates containers
        # the command parses as Dagster's CLI parses it (container paths as the files mounted there)
        ctx = _parse_cli(command, {t: Path(s) for t, (_, s) in mounts.items()})
        assert str(DEPLOY / "workspace.yaml") in str(ctx.params)
    _parse_cli(services["phantora_assets"]["healthcheck"]["test"][1:])

    # the environment the instance reads, and hands to run containers, is set where it is loaded
    needed = _env_refs(instance) | set(launcher["env_vars"])
    pg = services["postgresql"]["environment"]
    for name in DAGSTER_SERVICES:
        env = services[name]["environment"]
        assert needed - set(env) == set(), name
        assert env["DAGSTER_POSTGRES_HOST"] == "postgresql"
        assert str(env["DAGSTER_POSTGRES_PORT"]) == "5432"
        assert (env["DAGSTER_POSTGRES_USER"], env["DAGSTER_POSTGRES_PASSWORD"], env["DAGSTER_POSTGRES_DB"]) == (
            pg["POSTGRES_USER"],
            pg["POSTGRES_PASSWORD"],
            pg["POSTGRES_DB"],
        )

    # the run containers join the network and the volumes of the compose project, by their names
    networks = {key: net.get("name", key) for key, net in model["networks"].items()}
    assert launcher["network"] in networks.values()
    net_key = next(k for k, n in networks.items() if n == launcher["network"])
    for name in DAGSTER_SERVICES:
        assert net_key in services[name]["networks"]
    volumes = {key: vol.get("name", key) for key, vol in model["volumes"].items()}
    run_mounts = dict(reversed(v.split(":")[:2]) for v in launcher["container_kwargs"]["volumes"])
    for target, volume_name in run_mounts.items():
        keys = [k for k, n in volumes.items() if n == volume_name]
        assert len(keys) == 1, f"the run containers' volume {volume_name} is not one of the compose project"
        key = keys[0]
        users = [s for s in DAGSTER_SERVICES if _mounts(services[s]).get(target) == ("volume", key)]
        assert users, f"no service mounts the run containers' {volume_name} at {target}"
    # the data root: where the image looks, what the code location and every run see
    data_dir = image_env["PHANTORA_ASSETS_DATA_DIR"]
    assert _mounts(services["phantora_assets"])[data_dir][0] == "volume"
    assert data_dir in run_mounts
    # compute logs: written by the run containers, read by the webserver
    logs = instance["compute_logs"]["config"]["base_dir"]
    assert logs in run_mounts
    assert _mounts(services["dagster_webserver"])[logs] == _mounts(services["dagster_daemon"])[logs]
    assert _mounts(services["dagster_webserver"])[logs][0] == "volume"

    # the workspace reaches the code location's server
    (entry,) = _yaml(DEPLOY / "workspace.yaml")["load_from"]
    assert entry["grpc_server"]["host"] in services
    port = str(entry["grpc_server"]["port"])
    assert services["phantora_assets"]["healthcheck"]["test"][-2:] == ["-p", port]


def test_compose_structure():
    _check_compose(_compose_from_yaml())


def test_compose_config_by_docker_compose():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose CLI (docker compose / docker-compose) on this machine")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DAGSTER_POSTGRES_", "COMPOSE_"))}
    out = subprocess.run(
        [*cli, "-f", str(DEPLOY / "docker-compose.yaml"), "config", "--format", "json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    model = json.loads(out.stdout)
    assert model["name"] == "phantora_assets"
    _check_compose(model)


def test_compose_check_can_fail():
    """The structural check refuses a compose file whose run volumes are not the project's."""
    model = _compose_from_yaml()
    model["volumes"]["data"]["name"] = "elsewhere"
    with pytest.raises(AssertionError):
        _check_compose(model)
    model = _compose_from_yaml()
    del model["services"]["dagster_daemon"]["environment"]["DAGSTER_POSTGRES_PORT"]
    with pytest.raises(AssertionError):
        _check_compose(model)


# -------------------------------------------------------------------------------------------- Helm

# Key names of the dagster/dagster chart's values schema (helm/dagster/schema/schema/charts/...), for the
# sections values.yaml sets.
CHART_TOP = {
    "dagsterWebserver", "dagster-user-deployments", "postgresql", "generatePostgresqlPasswordSecret",
    "generateCeleryConfigSecret", "rabbitmq", "redis", "flower", "ingress", "imagePullSecrets",
    "computeLogManager", "scheduler", "runLauncher", "pythonLogs", "dagsterDaemon", "busybox", "migrate",
    "telemetry", "serviceAccount", "global", "retention", "concurrency", "additionalInstanceConfig",
}  # fmt: skip
CHART_USER_DEPLOYMENTS = {"enabled", "enableSubchart", "imagePullSecrets", "deployments"}
CHART_USER_DEPLOYMENT = {
    "name", "image", "port", "dagsterApiGrpcArgs", "codeServerArgs", "includeConfigInLaunchedRuns", "env",
    "envConfigMaps", "envSecrets", "annotations", "nodeSelector", "affinity", "tolerations",
    "podSecurityContext", "securityContext", "resources", "livenessProbe", "readinessProbe", "startupProbe",
    "labels", "volumeMounts", "volumes", "schedulerName",
}  # fmt: skip
CHART_IMAGE = {"repository", "tag", "pullPolicy"}
CHART_PULL_POLICIES = {"Always", "IfNotPresent", "Never"}
CHART_RUN_LAUNCHER_TYPES = {"CeleryK8sRunLauncher": "celeryK8sRunLauncher", "K8sRunLauncher": "k8sRunLauncher",
                            "CustomRunLauncher": "customRunLauncher"}  # fmt: skip
CHART_K8S_RUN_LAUNCHER = {
    "image", "imagePullPolicy", "jobNamespace", "loadInclusterConfig", "kubeconfigFile", "envConfigMaps",
    "envSecrets", "envVars", "volumeMounts", "volumes", "labels", "failPodOnRunFailure", "resources",
    "schedulerName", "securityContext", "runK8sConfig",
}  # fmt: skip
CHART_POSTGRESQL = {
    "image", "enabled", "postgresqlHost", "postgresqlUsername", "postgresqlPassword", "postgresqlDatabase",
    "postgresqlParams", "postgresqlScheme", "service",
}  # fmt: skip
CHART_DAEMON = {
    "enabled", "image", "runCoordinator", "heartbeatTolerance", "env", "envConfigMaps", "envSecrets",
    "deploymentLabels", "labels", "nodeSelector", "affinity", "tolerations", "podSecurityContext",
    "securityContext", "resources", "livenessProbe", "readinessProbe", "startupProbe", "annotations",
    "runMonitoring", "runRetries", "sensors", "schedules", "schedulerName", "volumeMounts", "volumes",
}  # fmt: skip
CHART_RUN_COORDINATOR = {"enabled", "type", "config"}
CHART_QUEUED_RUN_COORDINATOR = {
    "maxConcurrentRuns", "tagConcurrencyLimits", "dequeueIntervalSeconds", "dequeueNumWorkers",
    "dequeueUseThreads", "blockOpConcurrencyLimitedRuns",
}  # fmt: skip
CHART_CONCURRENCY = {"enabled", "pools", "runs"}
CHART_POOLS = {"defaultLimit", "granularity", "opGranularityRunBuffer"}
CHART_RUNS = {"maxConcurrentRuns", "tagConcurrencyLimits"}
CHART_TAG_LIMIT = {"key", "value", "limit"}


def _values() -> dict[str, Any]:
    return _yaml(DEPLOY / "helm" / "values.yaml")


def _keys_within(section: dict[str, Any], allowed: set[str], where: str) -> None:
    assert isinstance(section, dict), where
    assert set(section) - allowed == set(), f"{where}: keys the chart does not have"


def _check_chart_keys(values: dict[str, Any]) -> None:
    _keys_within(values, CHART_TOP, "values")
    user = values["dagster-user-deployments"]
    _keys_within(user, CHART_USER_DEPLOYMENTS, "dagster-user-deployments")
    for i, dep in enumerate(user["deployments"]):
        _keys_within(dep, CHART_USER_DEPLOYMENT, f"deployments[{i}]")
        assert {"name", "image", "port"} <= set(dep)
        _keys_within(dep["image"], CHART_IMAGE, f"deployments[{i}].image")
        assert dep["image"]["pullPolicy"] in CHART_PULL_POLICIES
        assert all(isinstance(a, str) for a in dep.get("dagsterApiGrpcArgs", []))
        assert set(dep.get("includeConfigInLaunchedRuns", {})) <= {"enabled"}
    launcher = values["runLauncher"]
    _keys_within(launcher, {"type", "config"}, "runLauncher")
    assert launcher["type"] in CHART_RUN_LAUNCHER_TYPES
    _keys_within(launcher["config"], set(CHART_RUN_LAUNCHER_TYPES.values()), "runLauncher.config")
    k8s = launcher["config"][CHART_RUN_LAUNCHER_TYPES[launcher["type"]]]
    _keys_within(k8s, CHART_K8S_RUN_LAUNCHER, "runLauncher.config.k8sRunLauncher")
    assert k8s["imagePullPolicy"] in CHART_PULL_POLICIES
    _keys_within(values["postgresql"], CHART_POSTGRESQL, "postgresql")
    daemon = values["dagsterDaemon"]
    _keys_within(daemon, CHART_DAEMON, "dagsterDaemon")
    coordinator = daemon["runCoordinator"]
    _keys_within(coordinator, CHART_RUN_COORDINATOR, "dagsterDaemon.runCoordinator")
    assert coordinator["type"] in {"QueuedRunCoordinator", "CustomRunCoordinator"}
    _keys_within(coordinator.get("config", {}), {"queuedRunCoordinator", "customRunCoordinator"}, "runCoordinator")
    queued = coordinator.get("config", {}).get("queuedRunCoordinator", {})
    _keys_within(queued, CHART_QUEUED_RUN_COORDINATOR, "queuedRunCoordinator")
    concurrency = values["concurrency"]
    _keys_within(concurrency, CHART_CONCURRENCY, "concurrency")
    _keys_within(concurrency.get("pools", {}), CHART_POOLS, "concurrency.pools")
    _keys_within(concurrency.get("runs", {}), CHART_RUNS, "concurrency.runs")
    for limit in concurrency.get("runs", {}).get("tagConcurrencyLimits", []) + queued.get("tagConcurrencyLimits", []):
        _keys_within(limit, CHART_TAG_LIMIT, "tagConcurrencyLimits")
    _keys_within(values.get("telemetry", {}), {"enabled"}, "telemetry")


def test_helm_values_keys_are_the_chart_s():
    _check_chart_keys(_values())
    broken = _values()
    broken["runLauncher"]["config"]["k8sRunLauncher"]["imagePullPolcy"] = "Always"
    with pytest.raises(AssertionError, match="keys the chart does not have"):
        _check_chart_keys(broken)


def _render_instance(values: dict[str, Any], release: str = "dagster") -> dict[str, Any]:  # noqa: C901 (the chart template's branches, as the chart renders them)
    """The parts of dagster.yaml that the chart's configmap-instance.yaml renders from these values
    (helpers dagsterYaml.postgresql.config, .runLauncher.k8s, .runCoordinator.queued, .concurrency)."""
    pg = values["postgresql"]
    db = {
        "username": pg["postgresqlUsername"],
        "password": {"env": "DAGSTER_PG_PASSWORD"},
        "hostname": f"{release}-postgresql" if pg["enabled"] else pg["postgresqlHost"],
        "db_name": pg["postgresqlDatabase"],
        "port": pg.get("service", {}).get("port", 5432),
        "params": pg.get("postgresqlParams", {}),
    }
    if pg.get("postgresqlScheme"):
        db["scheme"] = pg["postgresqlScheme"]
    k8s = values["runLauncher"]["config"]["k8sRunLauncher"]
    launcher: dict[str, Any] = {
        "load_incluster_config": k8s["loadInclusterConfig"],
        "job_namespace": k8s.get("jobNamespace") or "default",
        "image_pull_policy": k8s["imagePullPolicy"],
        "service_account_name": f"{release}",
        "dagster_home": "/opt/dagster/dagster_home",
        "instance_config_map": f"{release}-instance",
        "postgres_password_secret": f"{release}-postgresql-secret",
    }
    for chart_key, key in [
        ("kubeconfigFile", "kubeconfig_file"),
        ("envVars", "env_vars"),
        ("volumeMounts", "volume_mounts"),
        ("volumes", "volumes"),
        ("labels", "labels"),
        ("resources", "resources"),
        ("schedulerName", "scheduler_name"),
        ("securityContext", "security_context"),
    ]:
        if k8s.get(chart_key):
            launcher[key] = k8s[chart_key]
    for chart_key, key in [("envConfigMaps", "env_config_maps"), ("envSecrets", "env_secrets")]:
        if k8s.get(chart_key):
            launcher[key] = [s["name"] for s in k8s[chart_key] if "name" in s]
    if k8s.get("failPodOnRunFailure"):
        launcher["fail_pod_on_run_failure"] = True
    storage = {
        name: {"module": f"dagster_postgres.{module}", "class": cls, "config": {"postgres_db": db}}
        for name, module, cls in [
            ("run_storage", "run_storage", "PostgresRunStorage"),
            ("event_log_storage", "event_log", "PostgresEventLogStorage"),
            ("schedule_storage", "schedule_storage", "PostgresScheduleStorage"),
        ]
    }
    instance: dict[str, Any] = {
        **storage,
        "run_launcher": {"module": "dagster_k8s", "class": "K8sRunLauncher", "config": launcher},
        "telemetry": {"enabled": values.get("telemetry", {}).get("enabled", True)},
    }
    daemon = values["dagsterDaemon"]
    concurrency = values.get("concurrency", {})
    if daemon["enabled"] and daemon["runCoordinator"]["enabled"]:
        queued = daemon["runCoordinator"].get("config", {}).get("queuedRunCoordinator", {})
        config: dict[str, Any] = {}
        if not concurrency.get("enabled") or queued.get("maxConcurrentRuns") is not None:
            config["max_concurrent_runs"] = queued.get("maxConcurrentRuns", -1)
        if queued.get("tagConcurrencyLimits"):
            config["tag_concurrency_limits"] = queued["tagConcurrencyLimits"]
        instance["run_coordinator"] = {"module": "dagster.core.run_coordinator", "class": "QueuedRunCoordinator"}
        if config:
            instance["run_coordinator"]["config"] = config
        # the chart's own refusal of limits set twice
        runs = concurrency.get("runs", {})
        assert not (runs.get("maxConcurrentRuns") is not None and queued.get("maxConcurrentRuns") is not None)
        assert not (runs.get("tagConcurrencyLimits") and queued.get("tagConcurrencyLimits"))
    if concurrency.get("enabled"):
        block: dict[str, Any] = {}
        pools = concurrency.get("pools", {})
        if pools:
            block["pools"] = {
                {"defaultLimit": "default_limit", "opGranularityRunBuffer": "op_granularity_run_buffer"}.get(k, k): v
                for k, v in pools.items()
            }
        runs = concurrency.get("runs", {})
        if runs:
            block["runs"] = {}
            if runs.get("maxConcurrentRuns") is not None:
                block["runs"]["max_concurrent_runs"] = runs["maxConcurrentRuns"]
            if runs.get("tagConcurrencyLimits"):
                block["runs"]["tag_concurrency_limits"] = runs["tagConcurrencyLimits"]
        instance["concurrency"] = block
    return instance


def _load_rendered(instance: dict[str, Any], folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "dagster.yaml").write_text(yaml.safe_dump(instance))
    config, _ = dagster_instance_config(str(folder))
    return config


def test_helm_instance_loads_through_dagster_schema(tmp_path):
    rendered = _render_instance(_values())
    config = _load_rendered(rendered, tmp_path / "ok")
    assert config["run_launcher"]["class"] == "K8sRunLauncher"
    assert config["run_coordinator"]["class"] == "QueuedRunCoordinator"
    assert "config" not in config["run_coordinator"]  # the limits are in concurrency (below)
    assert config["concurrency"] == _project_concurrency()
    assert config["run_storage"]["config"]["postgres_db"]["scheme"] == "postgresql+psycopg2"

    # why the limits are not in the run coordinator's config: next to the pools' default limit,
    # Dagster refuses them
    values = _values()
    runs = values["concurrency"].pop("runs")
    values["dagsterDaemon"]["runCoordinator"]["config"] = {"queuedRunCoordinator": runs}
    with pytest.raises(DagsterInvalidConfigError, match="incompatible with the `concurrency > runs` config"):
        _load_rendered(_render_instance(values), tmp_path / "coordinator")


def test_helm_storage_is_dagster_postgres_s(monkeypatch):
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage

    rendered = _render_instance(_values())
    monkeypatch.setenv("DAGSTER_PG_PASSWORD", "secret")  # the chart sets it from its secret
    for key, cls in [
        ("run_storage", PostgresRunStorage),
        ("event_log_storage", PostgresEventLogStorage),
        ("schedule_storage", PostgresScheduleStorage),
    ]:
        assert rendered[key]["class"] == cls.__name__
        result = process_config(cls.config_type(), rendered[key]["config"])
        assert result.success, (key, result.errors)


def test_helm_run_launcher_is_k8s_run_launcher_s():
    import kubernetes
    from dagster_k8s import K8sRunLauncher
    from dagster_k8s.models import k8s_model_from_dict, k8s_snake_case_dict

    values = _values()
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    launcher = _render_instance(values)["run_launcher"]["config"]
    result = process_config(K8sRunLauncher.config_type(), launcher)
    assert result.success, result.errors
    assert result.value["resources"]["requests"]["memory"] == "4Gi"
    assert result.value["fail_pod_on_run_failure"] is True
    broken = launcher | {"resources": {"request": {"cpu": "1"}}}
    assert not process_config(K8sRunLauncher.config_type(), broken).success

    def model(cls: type, data: dict[str, Any]) -> Any:  # raises on a key Kubernetes does not have
        return k8s_model_from_dict(cls, k8s_snake_case_dict(cls, data))

    client = kubernetes.client
    model(client.V1ResourceRequirements, values["runLauncher"]["config"]["k8sRunLauncher"]["resources"])
    (dep,) = values["dagster-user-deployments"]["deployments"]
    volumes = [model(client.V1Volume, v) for v in dep["volumes"]]
    mounts = [model(client.V1VolumeMount, m) for m in dep["volumeMounts"]]
    model(client.V1ResourceRequirements, dep["resources"])
    assert {m.name for m in mounts} <= {v.name for v in volumes}
    pvc = model(client.V1PersistentVolumeClaim, _yaml(DEPLOY / "helm" / "data-pvc.yaml"))
    assert pvc.kind == "PersistentVolumeClaim"
    assert "ReadWriteMany" in pvc.spec.access_modes  # run pods land on any node
    (data_mount,) = [m for m in mounts if m.mount_path == _image_env()["PHANTORA_ASSETS_DATA_DIR"]]
    (data_volume,) = [v for v in volumes if v.name == data_mount.name]
    assert data_volume.persistent_volume_claim.claim_name == pvc.metadata.name
    with pytest.raises(Exception, match="Unexpected keys"):
        model(client.V1VolumeMount, {"name": "x", "mountPth": "/x"})


def test_helm_user_deployment_is_the_code_location():
    values = _values()
    user = values["dagster-user-deployments"]
    assert user["enabled"] and user["enableSubchart"]
    (dep,) = user["deployments"]
    module = PYPROJECT["tool"]["dagster"]["module_name"]
    assert dep["dagsterApiGrpcArgs"] == ["-m", module]
    assert dep["port"] == 4000
    assert dep["image"]["tag"] == PYPROJECT["project"]["version"]
    # runs inherit the deployment's env and volumes (the data root)
    assert dep["includeConfigInLaunchedRuns"] == {"enabled": True}
    assert dep["env"]["PHANTORA_ASSETS_DATA_DIR"] == _image_env()["PHANTORA_ASSETS_DATA_DIR"]
    # the container's args as the chart writes them, and its readiness probe, parse as Dagster's CLI
    args = ["dagster", "api", "grpc", "-h", "0.0.0.0", "-p", str(dep["port"]), *dep["dagsterApiGrpcArgs"]]
    ctx = _parse_cli(args)
    assert ctx.params["module_name"] == module and ctx.params["port"] == 4000
    _parse_cli(["dagster", "api", "grpc-health-check", "-p", str(dep["port"])])
    with pytest.raises(click.UsageError):
        _parse_cli(["dagster", "api", "grpc", "--modul", module])
    assert values["postgresql"]["postgresqlScheme"] == "postgresql+psycopg2"


def test_helm_limits_are_the_project_s():
    concurrency = _values()["concurrency"]
    project = _project_concurrency()
    assert concurrency["enabled"] is True
    assert concurrency["runs"]["maxConcurrentRuns"] == project["runs"]["max_concurrent_runs"]
    assert concurrency["runs"]["tagConcurrencyLimits"] == project["runs"]["tag_concurrency_limits"]
    assert concurrency["pools"]["defaultLimit"] == project["pools"]["default_limit"]


def test_deploy_holds_no_machine_paths():
    """Nothing in deploy/ names a folder of the machine it was written on."""
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            text = path.read_text()
            for needle in ("/work/", "/tmp/"):
                assert needle not in text, f"{path.relative_to(ROOT)} names {needle}"


def test_deployment_doc_one_host_storage_block(tmp_path):
    """docs/DEPLOYMENT.md's `storage:` block for one host, added to the project's dagster.yaml, is an instance
    Dagster loads, with deploy/dagster.yaml's connection settings."""
    doc = (ROOT / "docs" / "DEPLOYMENT.md").read_text()
    section = doc.split("## One host: PostgreSQL and the daemon", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```yaml\n(.*?)```", section, re.S)
    storage = yaml.safe_load(block)
    assert set(storage) == {"storage"}
    # in place of the project's own storage blocks, as docs/DEPLOYMENT.md says
    own = {"run_storage", "event_log_storage", "schedule_storage", "storage"}
    project = {k: v for k, v in _yaml(ROOT / "dagster.yaml").items() if k not in own}
    instance = project | storage
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(instance))
    config, _ = dagster_instance_config(str(tmp_path))
    # the project's storage class (kept connections, docs/INSTANCE.md), configured as storage: postgres:
    custom = config["storage"]["custom"]
    assert (custom["module"], custom["class"]) == ("phantora_assets.instance", "PooledPostgresStorage")
    db = custom["config"]["postgres_db"]
    deploy_db = _instance()["storage"]["custom"]["config"]["postgres_db"]
    # no scheme needed: the class reads the bare postgresql:// with psycopg2 (deploy/dagster.yaml names it)
    same = {k: v for k, v in deploy_db.items() if k not in ("port", "scheme")}
    assert {k: v for k, v in db.items() if k != "port"} == same
    assert db["port"] == 5432
