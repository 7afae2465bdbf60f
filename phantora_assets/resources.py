"""Resources: where data lives, and what the simulation sources need from the environment.

``data`` is :class:`DataRoot`. ``simulator`` is the key every environment binds, to one of two
resources: :class:`AnalyticSimulatorResource` (default; no Docker) or :class:`PhantoraDocker`
(gives the ``docker`` source its Docker backend). Either way each run is simulated by the source
its spec names (``sources.REGISTRY``), through :meth:`SimulatorResource.context`;
``simulate``/``write_trace`` call a source directly (for scripts and tests).
:func:`simulator_from_env` picks one from the environment (called by ``definitions.build_defs``
and the CLI, never at import).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import dagster as dg

from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.phantora import trace_batches
from phantora_assets.lib.phantora.perfdb import perfdb_folder
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.outcomes import StageResult
from phantora_assets.paths import DataPaths
from phantora_assets.sources import get_source
from phantora_assets.sources.base import DockerBackend, SourceContext

DOCKER_MAX_CONCURRENT_ENV = "PHANTORA_ASSETS_DOCKER_MAX_CONCURRENT"
SIMULATOR_ENV = "PHANTORA_ASSETS_SIMULATOR"
DOCKER_IMAGE_ENV = "PHANTORA_ASSETS_DOCKER_IMAGE"
PHANTORA_TESTS_ENV = "PHANTORA_ASSETS_PHANTORA_TESTS_DIR"


#: Environment defaults of :class:`DataRoot`'s trace caps (``definitions.build_defs`` reads them).
MAX_LINE_MIB_ENV = "PHANTORA_ASSETS_MAX_TRACE_LINE_MIB"
MAX_INFLATED_GIB_ENV = "PHANTORA_ASSETS_MAX_TRACE_INFLATED_GIB"


class DataRoot(dg.ConfigurableResource):
    """The data root: run folders, partition tables, the dataset (``build_defs`` sets it from
    ``$PHANTORA_ASSETS_DATA_DIR``, default ``data``), and the caps on the traces read there.

    Attributes:
        data_dir: the data root.
        max_trace_line_mib: longest text without a line break a trace reader buffers, MiB
            (``lib/phantora/trace_batches.MAX_LINE_BYTES``; rule "trace too large" beyond).
        max_trace_inflated_gib: largest decompressed trace read, GiB (``MAX_INFLATED_BYTES``).

    Set the caps in a run's config (``resources: data: config: {data_dir: ..., max_trace_line_mib:
    1024}``, the launchpad) or by ``$PHANTORA_ASSETS_MAX_TRACE_LINE_MIB`` / ``..._INFLATED_GIB`` for every run.
    """

    data_dir: str
    max_trace_line_mib: int = trace_batches.MAX_LINE_BYTES >> 20
    max_trace_inflated_gib: int = trace_batches.MAX_INFLATED_BYTES >> 30

    @property
    def paths(self) -> DataPaths:
        return DataPaths(Path(self.data_dir))

    @contextmanager
    def trace_limits(self) -> Iterator[None]:
        """The caps of this resource in force while the block reads traces (restored after).

        Raises:
            ValueError: a cap is not a positive whole number (names the setting).
        """
        for name in ("max_trace_line_mib", "max_trace_inflated_gib"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"resources.data.config.{name} must be a positive integer, got {value!r}")
        before = trace_batches.MAX_LINE_BYTES, trace_batches.MAX_INFLATED_BYTES
        trace_batches.MAX_LINE_BYTES = self.max_trace_line_mib << 20
        trace_batches.MAX_INFLATED_BYTES = self.max_trace_inflated_gib << 30
        try:
            yield
        finally:
            trace_batches.MAX_LINE_BYTES, trace_batches.MAX_INFLATED_BYTES = before


def data_root_from_env(root: str | Path) -> DataRoot:
    """:class:`DataRoot` of ``root`` with the trace caps of ``$PHANTORA_ASSETS_MAX_TRACE_LINE_MIB``
    and ``$PHANTORA_ASSETS_MAX_TRACE_INFLATED_GIB`` when set.

    Raises:
        RunMatrixError: a set variable is not a positive integer (names it).
    """
    caps: dict[str, int] = {}
    for env, field in ((MAX_LINE_MIB_ENV, "max_trace_line_mib"), (MAX_INFLATED_GIB_ENV, "max_trace_inflated_gib")):
        value = os.environ.get(env, "").strip()
        if not value:
            continue
        if not value.isdigit() or int(value) <= 0:
            raise RunMatrixError(f"${env} must be a positive integer, got {value!r}")
        caps[field] = int(value)
    return DataRoot(data_dir=str(root), **caps)


class SimulatorResource(dg.ConfigurableResource):
    """Common interface: what the sources (``sources/``) need from the environment. Each run is
    simulated by the source its spec names (``sources.REGISTRY[spec.source]``)."""

    def docker_backend(self) -> DockerBackend | None:
        """The Docker backend of the ``docker`` source; None: this resource has no Docker."""
        return None

    def context(self, perfdb_status: str = "unknown") -> SourceContext:
        """The SourceContext the sources get (the raw_timeline stage fills in the perf DB status)."""
        return SourceContext(
            perfdb_status=perfdb_status, docker=self.docker_backend(), log=dg.get_dagster_logger().info
        )

    def simulate(self, spec: RunSpec, paths: DataPaths, perfdb_status: str = "unknown") -> StageResult:
        """raw_timeline of ``spec``: run.log, config/ and the raw timeline under ``paths``.

        Raises:
            ValueError: ``spec.source`` is ``docker`` and this resource has no Docker backend.
        """
        return get_source(spec.source).raw_timeline(spec, paths, self.context(perfdb_status))

    def write_trace(self, spec: RunSpec, paths: DataPaths) -> StageResult:
        """chrome_trace of ``spec``: timeline.json.gz (Phantora visualizer schema) in its run folder."""
        return get_source(spec.source).chrome_trace(spec, paths, self.context())


class AnalyticSimulatorResource(SimulatorResource):
    """The embedded analytic simulator (``phantora_assets.lib.sim.analytic``); no Docker, no GPU."""


class PhantoraDocker(SimulatorResource):
    """Phantora in Docker (``lib/phantora/docker_config.py`` builds the files,
    ``lib/phantora/docker_runner.py`` runs them).

    The image must be built with ``patches/visualizer.patch`` (README). Kernel timings are
    replayed from the run's GPU database under ``perfdb/<gpu>/`` (no GPU needed); a GPU without
    a database is refused unless ``profile_without_perfdb`` (then the simulator profiles on the
    local GPU, which must be that GPU).
    """

    #: Phantora image built with patches/visualizer.patch.
    image: str = "phantora:latest"
    #: Host path of Phantora's tests/ folder (the training scripts), mounted at /phantora/tests;
    #: None when the image contains them.
    phantora_tests_dir: str | None = None
    #: Host folder shared as /run/phantora (each run uses <socket_dir>/<run_id>).
    socket_dir: str = "/run/phantora"
    #: Simulations at once on this machine, across processes (definitions.py reads the default
    #: from $PHANTORA_ASSETS_DOCKER_MAX_CONCURRENT).
    max_concurrent: int = 1
    #: Seconds between starting the containers and the first training command.
    startup_wait_s: float = 6.0
    #: Wall-clock limit of the training command.
    timeout_s: int = 4 * 3600
    #: PHANTORA_LOG of the simulator.
    log_level: str = "info"
    #: Without a perf DB for the GPU, profile on the local GPU instead of refusing the run.
    profile_without_perfdb: bool = False
    #: Docker engine URL; None = docker.from_env().
    docker_base_url: str | None = None

    def settings(self):
        from phantora_assets.lib.phantora.docker_config import DockerSettings

        return DockerSettings(
            image=self.image,
            socket_dir=self.socket_dir,
            phantora_tests_dir=self.phantora_tests_dir,
            log_level=self.log_level,
            startup_wait_s=self.startup_wait_s,
            timeout_s=self.timeout_s,
        )

    def _client(self):
        import docker

        return docker.DockerClient(base_url=self.docker_base_url) if self.docker_base_url else docker.from_env()

    def _runner(self):
        from phantora_assets.lib.phantora.docker_runner import PhantoraDockerRunner

        return PhantoraDockerRunner(self._client(), self.settings(), dg.get_dagster_logger().info)

    def perfdb_source(self, spec: RunSpec) -> Path | None:
        """The GPU's perf DB folder (replay), or None to profile (only with profile_without_perfdb).

        Raises:
            FileNotFoundError: no database for the GPU and profiling is not allowed.
        """
        folder = perfdb_folder(spec.gpu, spec.gpu_spec)
        if (folder / "compute.csv").is_file():
            return folder
        if self.profile_without_perfdb:
            return None
        raise FileNotFoundError(
            f"{spec.run_id}: no perf DB for {spec.gpu} at {folder}; record one (tohtana/Phantora "
            "tests/perfdb/record_all.sh on that GPU) or set profile_without_perfdb on a machine with that GPU"
        )

    def docker_backend(self) -> DockerBackend:
        from phantora_assets.lib.phantora.docker_runner import SimulationSlots

        return DockerBackend(
            runner=self._runner,
            settings=self.settings(),
            slots=lambda root: SimulationSlots(root / "work" / ".slots", self.max_concurrent),
            perfdb_source=self.perfdb_source,
        )


def simulator_from_env(specs: Sequence[RunSpec]) -> AnalyticSimulatorResource | PhantoraDocker:
    """``PhantoraDocker`` when ``$PHANTORA_ASSETS_SIMULATOR=docker`` or a run of ``specs`` has
    ``source = "docker"`` (image from ``$PHANTORA_ASSETS_DOCKER_IMAGE``, training scripts from
    ``$PHANTORA_ASSETS_PHANTORA_TESTS_DIR``, slots from ``$PHANTORA_ASSETS_DOCKER_MAX_CONCURRENT``);
    else the analytic simulator."""
    choice = os.environ.get(SIMULATOR_ENV, "")
    if choice == "docker" or (choice != "analytic" and any(s.source == "docker" for s in specs)):
        return PhantoraDocker(
            image=os.environ.get(DOCKER_IMAGE_ENV, "phantora:latest"),
            phantora_tests_dir=os.environ.get(PHANTORA_TESTS_ENV) or None,
            max_concurrent=int(os.environ.get(DOCKER_MAX_CONCURRENT_ENV, "1")),
        )
    return AnalyticSimulatorResource()
