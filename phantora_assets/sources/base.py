"""The interface every simulation source implements (no Dagster import).

A source turns one :class:`~phantora_assets.lib.run.spec.RunSpec` into the two per-run files the rest
of the graph shares: the raw timeline (``raw_timeline`` asset: whatever the source simulates or
copies, plus ``run.log``, ``config/`` and, for a run that fits, ``partitions/<run_id>/run_log.json``
and the source's own records) and the Chrome
trace ``timeline.json.gz`` in the Phantora visualizer schema (``chrome_trace`` asset). Everything
downstream reads the run's flows and compute as tables (the source's ``flow_tables``, else its
Chrome trace parsed) and the sidecar records, so every source gives the same schema.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from phantora_assets.lib.run.spec import RunSpec
    from phantora_assets.outcomes import StageResult
    from phantora_assets.paths import DataPaths


@dataclass(frozen=True)
class DockerBackend:
    """What the ``docker`` source needs from the ``PhantoraDocker`` resource.

    Attributes:
        runner: a factory of the ``lib.phantora.docker_runner.PhantoraDockerRunner`` (called
            only when a Docker run needs it: it connects to the engine).
        settings: its ``lib.phantora.docker_config.DockerSettings``.
        slots: a factory ``(data root) -> SimulationSlots`` (machine-wide concurrency slots).
        perfdb_source: ``spec -> perf DB folder to replay, or None to profile`` (may raise
            FileNotFoundError when the GPU has no database).
    """

    runner: Callable[[], Any]
    settings: Any
    slots: Callable[[Path], Any]
    perfdb_source: Callable[[RunSpec], Path | None]


@dataclass(frozen=True)
class SourceContext:
    """What a source may use besides the spec and the data root.

    Attributes:
        perfdb_status: ``present``, ``absent`` or ``not materialized`` (the GPU's perf_db asset).
        docker: the Docker backend when the ``simulator`` resource is ``PhantoraDocker``, else None.
        log: where progress lines go (Dagster's logger in an asset).
    """

    perfdb_status: str = "unknown"
    docker: DockerBackend | None = None
    log: Callable[[str], None] = field(default=lambda _m: None)


class Source(Protocol):
    """A simulation source: a module with these names (``sources/<name>.py``).

    Attributes:
        NAME: its key in ``sources.REGISTRY``: the value of ``source = "..."`` in the run matrix
            and of the ``simulator`` column of ``runs.csv`` (``tests/unit/sources/test_sources.py`` checks it).
        DESCRIPTION: one line for the docs.
        DATASET_SOURCE: the ``source`` column of ``runs.csv`` (where the timing came from:
            ``phantora_v0`` for Phantora's own traces, ``phantora_analytic`` for the roofline,
            ``kineto`` for PyTorch profiler traces of a real job, ``chakra`` for Chakra ETs).
        ROOFLINE_TIMING: True if the source times kernels with a roofline model and writes
            ``simulation.json`` (``records.SimulationRecord``): ``runs.csv`` then carries
            ``flops_per_step``, ``mfu``, ``peak_flops`` and ``alpha``; False leaves them null and
            reads the peak memory from ``run_log.json``.

    Optional, for sources of profiled runs (``lib/run/spec.PROFILED_SOURCES``: no workload preset):
    ``run_fields(spec, paths) -> dict`` (the descriptive ``runs.csv`` columns: workload, framework,
    model, parallelism, gpu) and ``profiler_steps(paths, spec) -> (starts_us, last_end_us) | None``
    (step markers of the trace; ``validated_flows`` then cuts steps at them, ``lib/kineto/step_spans.py``).
    Optional, for a source that holds the run as tables: ``flow_tables(spec, paths) -> ParsedTrace``
    (``lib/phantora/chrome_trace.ParsedTrace``: flows, compute summary, compute events), which
    ``validated_flows`` reads instead of parsing the Chrome trace (the analytic source: its raw
    timeline, ``lib/phantora/raw_tables.py``); the Chrome trace is then an output only.
    Optional, for sources of a registered folder (``import``, ``kineto``, ``chakra``): ``input_files(folder)
    -> names`` (the files its build reads; the run's fingerprint covers their size and mtime,
    ``stages/simulation.source_files``) and ``check_inputs(spec, paths)`` (raises when the folder
    cannot be built from, before ``raw_timeline`` invalidates anything of the run: a refused build
    leaves the run as it was).
    """

    NAME: str
    DESCRIPTION: str
    DATASET_SOURCE: str
    ROOFLINE_TIMING: bool

    def raw_timeline(self, spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
        """Simulate (or copy) the run; record ``fits_in_memory`` and ``perfdb_complete``."""
        ...

    def chrome_trace(self, spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
        """Write the run folder's ``timeline.json.gz``, parsed before it becomes visible."""
        ...
