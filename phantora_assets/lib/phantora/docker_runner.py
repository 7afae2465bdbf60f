"""Run one Phantora simulation in Docker through the Docker SDK, and convert its timeline.

No Dagster import. The configuration comes from :mod:`phantora_assets.lib.phantora.docker_config`
(the same dict that is written to ``config/compose.yaml``). Lifecycle of :meth:`PhantoraDockerRunner.simulate`:

1. check the image exists; create a bridge network ``<project>`` (services reach each other as
   ``host-1`` ...: the network alias is the service name, as with compose);
2. create and start ``simulator`` and ``host-1 .. host-N`` (``pid``/``ipc`` host, the shared
   socket folder, labels ``phantora_assets.run_id``);
3. wait ``startup_wait_s``; run the training command detached in ``host-2 ..`` (torchrun) and in
   the foreground in ``host-1``, streaming its output to ``out/run.log``;
4. send SIGINT to the simulator (``phantora_server`` never exits by itself; it flushes every
   ``timeline.bin`` record as it writes it, so stopping it loses nothing) and wait for it;
5. **always** (``finally``) remove every container it created and the network, even when a
   step above failed or was interrupted.

:meth:`PhantoraDockerRunner.visualize` runs ``phantora_visualizer`` in the image (``out/`` mounted)
to turn ``timeline.bin`` into ``timeline.json``; it needs the image built with
``patches/visualizer.patch`` (upstream panics on NcclSend/NcclRecv events).

:class:`SimulationSlots` limits how many simulations run at once on this machine, across
processes (one ``flock``-ed file per slot under the data root).
"""

from __future__ import annotations

import contextlib
import fcntl
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phantora_assets.lib.errors import PhantoraAssetsError
from phantora_assets.lib.phantora.docker_config import (
    DockerSettings,
    RunLayout,
    compose_config,
    container_kwargs,
    project_name,
    timeout_argv,
    training_argv,
    training_hosts,
    visualizer_argv,
)
from phantora_assets.lib.run.spec import RunSpec


class PhantoraDockerError(PhantoraAssetsError):
    """The Docker simulation could not run (no image, engine error, training command failed)."""


@dataclass
class SimulationOutcome:
    """What one Docker simulation left in ``out/``.

    Attributes:
        exit_code: exit status of the training command in host-1.
        run_log: ``out/run.log`` (host-1's output).
        timeline: ``out/timeline.bin`` if the simulator wrote one, else None.
        seconds: wall-clock seconds from container start to simulator stop.
    """

    exit_code: int
    run_log: Path
    timeline: Path | None
    seconds: float


class SimulationSlots:
    """At most ``limit`` simulations at once, across processes sharing ``folder``.

    Each slot is a file ``slot-<i>.lock`` held with ``fcntl.flock`` while a simulation runs;
    a process that finds every slot taken polls every ``poll_s`` seconds.
    """

    def __init__(self, folder: Path, limit: int, poll_s: float = 2.0) -> None:
        if limit < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {limit}")
        self.folder = Path(folder)
        self.limit = int(limit)
        self.poll_s = poll_s

    @contextlib.contextmanager
    def acquire(self, log: Callable[[str], None] = lambda _m: None) -> Iterator[int]:
        self.folder.mkdir(parents=True, exist_ok=True)
        waited = False
        while True:
            for i in range(self.limit):
                fh = open(self.folder / f"slot-{i}.lock", "a+")
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    fh.close()
                    continue
                try:
                    yield i
                finally:
                    fcntl.flock(fh, fcntl.LOCK_UN)
                    fh.close()
                return
            if not waited:
                log(f"all {self.limit} simulation slot(s) busy; waiting")
                waited = True
            time.sleep(self.poll_s)


class PhantoraDockerRunner:
    """Launch one run's containers with a Docker SDK client (``docker.from_env()``)."""

    def __init__(self, client: Any, settings: DockerSettings, log: Callable[[str], None] = lambda _m: None) -> None:
        self.client = client
        self.settings = settings
        self.log = log

    # ------------------------------------------------------------------ helpers
    def _require_image(self) -> None:
        import docker.errors

        try:
            self.client.images.get(self.settings.image)
        except docker.errors.ImageNotFound as exc:
            raise PhantoraDockerError(
                f"Docker image {self.settings.image!r} not found: build it from a Phantora checkout with "
                "patches/visualizer.patch applied (README, 'Simulating with Phantora in Docker')"
            ) from exc

    def _exec_foreground(self, container: Any, argv: list[str], log_path: Path) -> int:
        api = self.client.api
        exec_id = api.exec_create(container.id, argv, stdout=True, stderr=True)["Id"]
        with open(log_path, "wb") as fh:
            for chunk in api.exec_start(exec_id, stream=True):
                fh.write(chunk)
                fh.flush()
        code = api.exec_inspect(exec_id).get("ExitCode")
        return int(code) if code is not None else -1

    # ------------------------------------------------------------------ simulate
    def simulate(self, spec: RunSpec, layout: RunLayout, replay: bool) -> SimulationOutcome:
        """Run the simulation of ``spec`` (see the module docstring). Containers are always removed.

        Raises:
            PhantoraDockerError: the image is missing or the engine refused a step.
        """
        compose = compose_config(spec, self.settings, layout, replay)
        project = project_name(spec)
        layout.out_dir.mkdir(parents=True, exist_ok=True)
        for stale in ("timeline.bin", "timeline.json", "run.log"):
            (layout.out_dir / stale).unlink(missing_ok=True)
        socket_host = compose["services"]["simulator"]["volumes"][0].split(":")[0]
        Path(socket_host).mkdir(parents=True, exist_ok=True)
        self._require_image()
        created: list[Any] = []
        network = None
        t0 = time.monotonic()
        run_log = layout.out_dir / "run.log"
        try:
            network = self.client.networks.create(
                project, driver="bridge", labels=dict(compose["services"]["simulator"]["labels"])
            )
            containers: dict[str, Any] = {}
            for name, service in compose["services"].items():
                kw = container_kwargs(name, service, layout.config_dir, project)
                kw.pop("detach", None)
                c = self.client.containers.create(**kw)
                created.append(c)
                network.connect(c, aliases=[name])
                c.start()
                containers[name] = c
                self.log(f"started {kw['name']}")
            time.sleep(self.settings.startup_wait_s)
            argv = ["bash", "-c", shlex.join(timeout_argv(self.settings, training_argv(spec)))]
            code = -1
            for host in training_hosts(spec):
                if host == "host-1":
                    self.log(f"training in host-1: {argv[-1]}")
                    code = self._exec_foreground(containers[host], argv, run_log)
                else:
                    containers[host].exec_run(argv, detach=True)
            sim = containers["simulator"]
            sim.kill(signal="SIGINT")
            with contextlib.suppress(Exception):
                sim.wait(timeout=120)
            timeline = layout.out_dir / "timeline.bin"
            return SimulationOutcome(code, run_log, timeline if timeline.is_file() else None, time.monotonic() - t0)
        finally:
            for c in reversed(created):
                with contextlib.suppress(Exception):
                    c.remove(force=True)
            if network is not None:
                with contextlib.suppress(Exception):
                    network.remove()
            self.log(f"removed {len(created)} container(s) of {project}")

    # ------------------------------------------------------------------ visualize
    def visualize(self, spec: RunSpec, layout: RunLayout) -> Path:
        """``out/timeline.bin`` -> ``out/timeline.json`` with the image's (patched) visualizer.

        Raises:
            PhantoraDockerError: no timeline.bin, or the visualizer failed (e.g. an unpatched image
                panicking on NcclSend/NcclRecv events).
        """
        import docker.errors

        src = layout.out_dir / "timeline.bin"
        if not src.is_file():
            raise PhantoraDockerError(f"{src}: no timeline.bin to convert (was the simulation run?)")
        out = layout.out_dir / "timeline.json"
        out.unlink(missing_ok=True)
        self._require_image()
        try:
            self.client.containers.run(
                self.settings.image,
                visualizer_argv(),
                remove=True,
                stdout=True,
                stderr=True,
                volumes={str(layout.out_dir): {"bind": "/phantora/out", "mode": "rw"}},
                name=f"{project_name(spec)}-visualizer",
                labels={"phantora_assets.run_id": spec.run_id},
            )
        except docker.errors.ContainerError as exc:
            err = (exc.stderr or b"").decode(errors="replace")[-2000:] if isinstance(exc.stderr, bytes) else str(exc)
            hint = (
                " (NcclSend/NcclRecv events need the image built with patches/visualizer.patch)"
                if "unwrap" in err or "None" in err
                else ""
            )
            raise PhantoraDockerError(f"phantora_visualizer failed on {src}{hint}: {err}") from exc
        if not out.is_file():
            raise PhantoraDockerError(f"phantora_visualizer wrote no {out}")
        return out
