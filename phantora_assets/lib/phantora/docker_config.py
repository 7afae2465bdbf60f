"""Everything a Phantora simulation in Docker needs, as files and command lines (no Docker here).

No Dagster import, no Docker engine needed: this module only builds configuration. It follows
Phantora's own conventions (upstream ``tests/docker/<framework>/config_gen.py`` and the
perf-DB fork's ``tests/perfdb/record_all.sh``; PHANTORA_FORMATS.md section 1):

* ``config/compose.yaml``: a ``simulator`` service running ``phantora_server --netconfig
  /netconfig.toml --timeline-file ... [--perf-db ...]`` and one service per simulated host
  ``host-1 .. host-N`` (hostname = service name), all sharing ``/run/phantora`` (Unix sockets)
  with ``pid: host`` and ``ipc: host``. Hosts get ``PHANTORA_NGPU``, ``PHANTORA_VRAM_MIB`` (the
  card memory, ``gpus.toml`` ``memory_gb`` x 1024), ``PHANTORA_IGNORE_CPU_TIME=1``,
  ``CUDA_DEVICE_MAX_CONNECTIONS=1``, ``PHANTORA_SOCKET_PREFIX`` and ``PHANTORA_GPU_NAME``. In
  replay mode (``--perf-db``, the run's GPU database mounted) the simulator reserves no GPU;
  only profiling without a database adds the NVIDIA device reservation.
* ``config/netconfig.toml`` (:mod:`phantora_assets.lib.phantora.netconfig`).
* ``config/hostfile`` and ``config/deepspeed_env`` for DeepSpeed runs (``host-k slots=G``; the
  environment DeepSpeed's ssh launcher passes to remote ranks).
* ``config/command.txt``: the exact commands, runnable from ``config/`` with ``docker compose``.

Host paths in ``compose.yaml`` are relative to ``config/`` (compose semantics) except the
socket directory; :func:`container_kwargs` resolves them for the Docker SDK, so the launcher
and the file cannot disagree. Per run, scratch space lives under ``<data root>/work/<run_id>/``:
``perfdb/<db>/`` (a copy of the GPU's database; Phantora writes shapes it lacks to
``perfdb/<db>.missing/``) and ``out/`` (``timeline.bin``, ``timeline.json``, ``run.log``).
"""

from __future__ import annotations

import os
import shlex
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from phantora_assets.lib.phantora.netconfig import dumps_netconfig, netconfig_for
from phantora_assets.lib.run.catalog import gpu_specs, presets
from phantora_assets.lib.run.spec import RunSpec

SOCKET_PREFIX = "/run/phantora/phantora"
SERVER = "/phantora/dist/phantora_server"
RUNNER = "/phantora/dist/phantora_run"
VISUALIZER = "/phantora/dist/phantora_visualizer"
RDZV_PORT = 12345
LABEL = "phantora_assets.run_id"


@dataclass(frozen=True)
class DockerSettings:
    """Settings of the Docker simulator (the ``PhantoraDocker`` resource's config).

    Attributes:
        image: the Phantora image (built with ``patches/visualizer.patch``).
        socket_dir: host directory shared as ``/run/phantora``; each run uses its own
            ``<socket_dir>/<run_id>`` so that simulations can run side by side.
        phantora_tests_dir: host path of Phantora's ``tests/`` folder (the training scripts),
            mounted read-only at ``/phantora/tests``; ``None`` when the image already has them.
        log_level: ``PHANTORA_LOG`` of the simulator.
        startup_wait_s: seconds between starting the containers and the first training command.
        timeout_s: wall-clock limit of the training command (``timeout`` inside host-1).
        cpuset_simulator / cpuset_hosts: optional CPU pinning (compose ``cpuset``).
    """

    image: str = "phantora:latest"
    socket_dir: str = "/run/phantora"
    phantora_tests_dir: str | None = None
    log_level: str = "info"
    startup_wait_s: float = 6.0
    timeout_s: int = 4 * 3600
    cpuset_simulator: str | None = None
    cpuset_hosts: str | None = None


@dataclass(frozen=True)
class RunLayout:
    """Where one Docker run's files live (absolute paths)."""

    run_folder: Path
    work_dir: Path
    perfdb_name: str

    @property
    def config_dir(self) -> Path:
        return self.run_folder / "config"

    @property
    def perfdb_root(self) -> Path:
        return self.work_dir / "perfdb"

    @property
    def perfdb_dir(self) -> Path:
        return self.perfdb_root / self.perfdb_name

    @property
    def missing_dir(self) -> Path:
        """Where Phantora lists the (op, shape)s its replay did not find: ``<db>.missing/``."""
        return self.perfdb_root / f"{self.perfdb_name}.missing"

    @property
    def out_dir(self) -> Path:
        return self.work_dir / "out"

    def rel(self, p: Path) -> str:
        """``p`` relative to ``config/`` (how compose.yaml names host paths)."""
        r = os.path.relpath(p, self.config_dir)
        return r if r.startswith(".") else f"./{r}"


def layout_for(spec: RunSpec, data_root: Path, run_folder: Path) -> RunLayout:
    """The RunLayout of ``spec`` under ``data_root`` (run folder given by DataPaths)."""
    db = str(gpu_specs()[spec.gpu].get("perfdb", spec.gpu))
    return RunLayout(
        run_folder=Path(run_folder).absolute(),
        work_dir=(Path(data_root) / "work" / spec.run_id).absolute(),
        perfdb_name=db,
    )


@cache
def launch_table() -> dict[str, Any]:
    """``launch.toml``: launcher, script and arguments of each workload."""
    with resources.files("phantora_assets").joinpath("launch.toml").open("rb") as fh:
        return tomllib.load(fh)


def vram_mib(spec: RunSpec) -> int:
    """Simulated card memory in MiB: ``gpus.toml`` memory_gb x 1024."""
    return int(round(float(spec.gpu_spec["memory_gb"]) * 1024))


def project_name(spec: RunSpec) -> str:
    """Compose project name (lower case, ``[a-z0-9_-]``)."""
    return "phantora-" + spec.run_id.lower().replace(".", "-")


def training_argv(spec: RunSpec) -> list[str]:
    """The training command run in ``host-1`` (and, for torchrun, in every host)."""
    entry = launch_table()[spec.workload]
    common = presets()["common"]
    args = [a.replace("{ep}", str(spec.ep)) for a in entry["args"]]
    script_args = [
        entry["script"],
        "--num_layers",
        str(common["num_layers"]),
        "--sequence_length",
        str(common["sequence_length"]),
        "--iterations",
        str(common["iterations"]),
        *args,
    ]
    if entry["launcher"] == "torchrun":
        return [
            RUNNER,
            "torchrun",
            "--nproc_per_node",
            str(spec.gpus_per_node),
            "--nnodes",
            str(spec.n_nodes),
            "--rdzv_backend",
            "c10d",
            f"--rdzv_endpoint=host-1:{RDZV_PORT}",
            *script_args,
        ]
    if entry["launcher"] == "deepspeed":
        return [RUNNER, "deepspeed", "-H", "/hostfile", *script_args]
    raise ValueError(f"{spec.workload}: unknown launcher {entry['launcher']!r} in launch.toml")


def training_hosts(spec: RunSpec) -> list[str]:
    """Hosts the training command is executed in (host-1 last: its output is run.log)."""
    if launch_table()[spec.workload]["launcher"] == "torchrun":
        return [f"host-{i}" for i in range(2, spec.n_nodes + 1)] + ["host-1"]
    return ["host-1"]


def simulator_argv(spec: RunSpec, layout: RunLayout, replay: bool) -> list[str]:
    """``phantora_server`` command line (timeline into /phantora/out, perf DB replay)."""
    argv = [SERVER, "--netconfig", "/netconfig.toml", "--timeline-file", "/phantora/out/timeline.bin"]
    if replay:
        argv += ["--perf-db", f"/phantora/perfdb/{layout.perfdb_name}"]
    return argv


def visualizer_argv() -> list[str]:
    """``phantora_visualizer`` command line, run in the image with ``out/`` at /phantora/out."""
    return [VISUALIZER, "-t", "/phantora/out/timeline.bin", "-o", "/phantora/out/timeline.json"]


def socket_dir(spec: RunSpec, settings: DockerSettings) -> str:
    return f"{settings.socket_dir.rstrip('/')}/{spec.run_id}"


def compose_config(spec: RunSpec, settings: DockerSettings, layout: RunLayout, replay: bool) -> dict[str, Any]:
    """The compose file of ``spec`` as a dict (see the module docstring)."""
    socket = f"{socket_dir(spec, settings)}:/run/phantora"
    deepspeed = launch_table()[spec.workload]["launcher"] == "deepspeed"
    simulator: dict[str, Any] = {
        "image": settings.image,
        "volumes": [
            socket,
            "./netconfig.toml:/netconfig.toml:ro",
            f"{layout.rel(layout.perfdb_root)}:/phantora/perfdb",
            f"{layout.rel(layout.out_dir)}:/phantora/out",
        ],
        "pid": "host",
        "ipc": "host",
        "environment": [f"PHANTORA_LOG={settings.log_level}", f"PHANTORA_SOCKET_PREFIX={SOCKET_PREFIX}"],
        "command": shlex.join(simulator_argv(spec, layout, replay)),
        "labels": {LABEL: spec.run_id},
    }
    if settings.cpuset_simulator:
        simulator["cpuset"] = settings.cpuset_simulator
    if not replay:
        simulator["deploy"] = {
            "resources": {
                "reservations": {"devices": [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]}
            }
        }
    services: dict[str, Any] = {"simulator": simulator}
    for i in range(1, spec.n_nodes + 1):
        volumes = [socket]
        if settings.phantora_tests_dir:
            volumes.append(f"{settings.phantora_tests_dir}:/phantora/tests:ro")
        if deepspeed:
            volumes += ["./hostfile:/hostfile:ro", "./deepspeed_env:/root/.deepspeed_env:ro"]
        host: dict[str, Any] = {
            "image": settings.image,
            "volumes": volumes,
            "pid": "host",
            "ipc": "host",
            "environment": [
                "CUDA_DEVICE_MAX_CONNECTIONS=1",
                f"PHANTORA_NGPU={spec.gpus_per_node}",
                f"PHANTORA_VRAM_MIB={vram_mib(spec)}",
                "PHANTORA_IGNORE_CPU_TIME=1",
                f"PHANTORA_SOCKET_PREFIX={SOCKET_PREFIX}",
                f"PHANTORA_GPU_NAME={spec.gpu_spec['name']}",
            ],
            "hostname": f"host-{i}",
            "command": "/usr/sbin/sshd -D" if deepspeed else "sleep infinity",
            "labels": {LABEL: spec.run_id},
            "depends_on": ["simulator"],
        }
        if settings.cpuset_hosts:
            host["cpuset"] = settings.cpuset_hosts
        services[f"host-{i}"] = host
    return {"name": project_name(spec), "services": services}


def hostfile(spec: RunSpec) -> str:
    """DeepSpeed hostfile: ``host-k slots=G`` per host."""
    return "".join(f"host-{i} slots={spec.gpus_per_node}\n" for i in range(1, spec.n_nodes + 1))


def deepspeed_env(spec: RunSpec) -> str:
    """``~/.deepspeed_env``: what DeepSpeed's ssh launcher exports to remote ranks."""
    return "".join(
        f"{line}\n"
        for line in [
            "LD_LIBRARY_PATH=/phantora/dist:/phantora/pytorch/torch/lib:/usr/local/cuda/lib64:/usr/local/python3.11.9/lib",
            "LD_PRELOAD=/phantora/dist/libcuda.so.1",
            f"PHANTORA_SOCKET_PREFIX={SOCKET_PREFIX}",
            "PHANTORA=1",
            f"PHANTORA_NGPU={spec.gpus_per_node}",
            f"PHANTORA_VRAM_MIB={vram_mib(spec)}",
            "PHANTORA_IGNORE_CPU_TIME=1",
        ]
    )


def timeout_argv(settings: DockerSettings, argv: list[str]) -> list[str]:
    """``argv`` under ``timeout`` (the training command's wall-clock limit)."""
    return ["timeout", str(int(settings.timeout_s)), *argv]


def command_lines(spec: RunSpec, settings: DockerSettings, layout: RunLayout, replay: bool) -> list[str]:
    """The exact commands of one simulation, as run from ``config/`` with docker compose."""
    train = shlex.join(timeout_argv(settings, training_argv(spec)))
    out = layout.rel(layout.out_dir)
    lines = [
        f"mkdir -p {shlex.quote(socket_dir(spec, settings))} {shlex.quote(out)}",
        "docker compose -f compose.yaml up -d",
        f"sleep {settings.startup_wait_s:g}",
    ]
    for h in training_hosts(spec):
        if h == "host-1":
            lines.append(
                f"docker compose -f compose.yaml exec -T host-1 bash -c {shlex.quote(train)} "
                f"> {shlex.quote(out)}/run.log 2>&1"
            )
        else:
            lines.append(f"docker compose -f compose.yaml exec -d {h} bash -c {shlex.quote(train)}")
    lines += [
        "docker compose -f compose.yaml kill -s SIGINT simulator",
        "docker compose -f compose.yaml down --remove-orphans",
        f'docker run --rm -v "$(realpath {shlex.quote(out)})":/phantora/out {shlex.quote(settings.image)} '
        + shlex.join(visualizer_argv()),
    ]
    return lines


def command_txt(spec: RunSpec, settings: DockerSettings, layout: RunLayout, replay: bool) -> str:
    mode = (
        f"replay of the {layout.perfdb_name} perf DB (no GPU)" if replay else "profiling on the local GPU (no perf DB)"
    )
    head = [
        f"# Phantora simulation of {spec.run_id}: {spec.framework} {spec.model_name} ({spec.parallelism}),",
        f"# {spec.n_nodes} hosts x {spec.gpus_per_node} GPUs, {mode}.",
        "# Exact commands, run from this config/ folder (phantora_assets runs the same through the Docker SDK).",
    ]
    return "\n".join(head + command_lines(spec, settings, layout, replay)) + "\n"


def config_files(spec: RunSpec, settings: DockerSettings, layout: RunLayout, replay: bool) -> dict[str, str]:
    """File name (under ``config/``) -> content."""
    files = {
        "compose.yaml": yaml.safe_dump(compose_config(spec, settings, layout, replay), sort_keys=False),
        "netconfig.toml": dumps_netconfig(netconfig_for(spec)),
        "command.txt": command_txt(spec, settings, layout, replay),
    }
    if launch_table()[spec.workload]["launcher"] == "deepspeed":
        files["hostfile"] = hostfile(spec)
        files["deepspeed_env"] = deepspeed_env(spec)
    return files


def container_kwargs(name: str, service: dict[str, Any], base_dir: Path, project: str) -> dict[str, Any]:
    """Docker SDK ``containers.create`` arguments of one compose service.

    Relative host paths are resolved against ``base_dir`` (the compose file's folder).
    The GPU reservation becomes a ``device_requests`` entry (keyword arguments of
    ``docker.types.DeviceRequest``, which the SDK accepts as a dict).
    """
    volumes: dict[str, dict[str, str]] = {}
    for v in service.get("volumes", []):
        parts = v.split(":")
        src, dst = parts[0], parts[1]
        mode = parts[2] if len(parts) > 2 else "rw"
        host = src if src.startswith("/") else str((base_dir / src).resolve())
        volumes[host] = {"bind": dst, "mode": mode}
    kw: dict[str, Any] = {
        "image": service["image"],
        "command": service["command"],
        "name": f"{project}-{name}",
        "hostname": service.get("hostname", name),
        "environment": list(service.get("environment", [])),
        "volumes": volumes,
        "pid_mode": service.get("pid"),
        "ipc_mode": service.get("ipc"),
        "labels": dict(service.get("labels", {})),
        "detach": True,
    }
    if service.get("cpuset"):
        kw["cpuset_cpus"] = service["cpuset"]
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    if devices:
        kw["device_requests"] = [
            {"driver": d["driver"], "device_ids": list(d["device_ids"]), "capabilities": [list(d["capabilities"])]}
            for d in devices
        ]
    return kw


def missing_listing(missing_dir: Path) -> dict[str, int]:
    """Files under ``<db>.missing/`` with their number of non-empty lines ({} if none).

    Phantora lists every (op, shape) its replay did not find there; any non-empty file means
    the run charged zero time for kernels it could not time, so its numbers are invalid.
    """
    if not missing_dir.is_dir():
        return {}
    out: dict[str, int] = {}
    for f in sorted(p for p in missing_dir.rglob("*") if p.is_file()):
        try:
            n = sum(1 for line in f.read_text(errors="replace").splitlines() if line.strip())
        except OSError:
            n = 1
        if n:
            out[str(f.relative_to(missing_dir))] = n
    return out
