"""Source ``docker``: Phantora in Docker (``lib/phantora/docker_config.py`` writes the files,
``lib/phantora/docker_runner.py`` runs the containers). Needs the ``PhantoraDocker`` resource.

    raw_timeline -> run folder config/ (compose.yaml, netconfig.toml, command.txt, ...), run.log,
                    timeline.bin, perfdb_missing/; partitions/<run_id>/run_log.json
    chrome_trace -> run folder timeline.json.gz (phantora_visualizer on timeline.bin, validated)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from phantora_assets.checks import reset_checks
from phantora_assets.lib.phantora.docker_config import config_files, layout_for, missing_listing
from phantora_assets.lib.phantora.docker_runner import PhantoraDockerError
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store.io import atomic_write_text, copy_file, link_or_copy, replace_dir, replacing_outputs
from phantora_assets.outcomes import StageResult, record
from phantora_assets.paths import DataPaths
from phantora_assets.sources.base import DockerBackend, SourceContext
from phantora_assets.sources.phantora_run import (
    fits_from_log,
    install_trace,
    perfdb_from_missing,
    write_run_log_summary,
)

NAME = "docker"
DESCRIPTION = "Phantora itself, run in Docker (image built with patches/visualizer.patch)"
DATASET_SOURCE = "phantora_v0"
ROOFLINE_TIMING = False


def simulate_docker(
    spec: RunSpec, paths: DataPaths, runner, slots, settings, *, perfdb_source: Path | None, log=lambda _m: None
) -> StageResult:
    """raw_timeline of a ``docker`` run: Phantora in Docker (see ``lib/phantora/docker_runner.py``).

    Writes ``config/`` (compose.yaml, netconfig.toml, command.txt, hostfile and deepspeed_env
    for DeepSpeed), copies the GPU's perf DB into the run's work folder (replay when
    ``perfdb_source`` is given, else profiling on the local GPU), runs the simulation inside one
    of ``slots``, then moves ``run.log`` and ``timeline.bin`` into the run folder and copies a
    non-empty ``<db>.missing/`` to ``perfdb_missing/``.

    Raises:
        PhantoraDockerError: the engine or the training command failed (not out of memory).
    """
    folder = paths.run_folder(spec)
    reset_checks(folder, "raw_timeline")
    replay = perfdb_source is not None
    layout = layout_for(spec, paths.root, folder)
    files = config_files(spec, settings, layout, replay)
    optional = ("hostfile", "deepspeed_env", "run.toml")  # one a run of another framework wrote goes after
    with replacing_outputs(layout.config_dir / name for name in (*files, *optional)) as written:
        for name, text in files.items():
            atomic_write_text(layout.config_dir / name, text)
            written.add(layout.config_dir / name)
    shutil.rmtree(layout.perfdb_root, ignore_errors=True)
    if perfdb_source is not None:
        shutil.copytree(perfdb_source, layout.perfdb_dir)
    with slots.acquire(log):
        outcome = runner.simulate(spec, layout, replay)
    if outcome.run_log.is_file():
        copy_file(outcome.run_log, folder / "run.log")
    if outcome.timeline is not None:
        link_or_copy(outcome.timeline, folder / "timeline.bin")
    else:
        for stale in (folder / "timeline.bin", paths.chrome_trace(spec)):
            stale.unlink(missing_ok=True)
    missing = missing_listing(layout.missing_dir) if replay else None
    replace_dir(layout.missing_dir if missing else None, folder / "perfdb_missing")
    log_present = (folder / "run.log").is_file()
    run_log = write_run_log_summary(paths, spec)
    fits = fits_from_log(spec, run_log, log_present, "Phantora")
    perfdb = perfdb_from_missing(missing, "profiled on the local GPU (no perf-DB replay)")
    outcomes = [fits, perfdb]
    record(paths, spec, "raw_timeline", outcomes)
    if fits.passed and (outcome.exit_code != 0 or outcome.timeline is None):
        tail = "\n".join((folder / "run.log").read_text(errors="replace").splitlines()[-15:]) if log_present else ""
        why = f"exited with status {outcome.exit_code}" if outcome.exit_code != 0 else "left no timeline.bin"
        raise PhantoraDockerError(f"{spec.run_id}: the training command {why}; last lines of run.log:\n{tail}")
    meta = {
        "status": "simulated" if fits.passed else "out_of_memory",
        "mode": "replay" if replay else "profile",
        "exit_code": int(outcome.exit_code),
        "wall_s": round(outcome.seconds, 1),
        "timeline_bin_bytes": int(outcome.timeline.stat().st_size) if outcome.timeline else 0,
        **run_log.metadata(),
    }
    return StageResult(folder / "timeline.bin" if outcome.timeline else folder, meta, outcomes)


def docker_trace(spec: RunSpec, paths: DataPaths, runner) -> StageResult:
    """chrome_trace of a ``docker`` run: ``phantora_visualizer`` in the image, then gzip + validate."""
    folder = paths.run_folder(spec)
    layout = layout_for(spec, paths.root, folder)
    work_bin = layout.out_dir / "timeline.bin"
    if not work_bin.is_file() and (folder / "timeline.bin").is_file():
        link_or_copy(folder / "timeline.bin", work_bin)
    json_path = runner.visualize(spec, layout)
    try:
        return install_trace(spec, paths, json_path, "phantora_visualizer (patches/visualizer.patch)")
    finally:
        json_path.unlink(missing_ok=True)


def _backend(spec: RunSpec, ctx: SourceContext) -> DockerBackend:
    if ctx.docker is None:
        raise ValueError(
            f"{spec.run_id}: source {spec.source!r} needs the Phantora Docker simulator; bind PhantoraDocker "
            "under the 'simulator' resource key (PHANTORA_ASSETS_SIMULATOR=docker)"
        )
    return ctx.docker


def raw_timeline(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``raw_timeline`` of a Docker run (:func:`simulate_docker`).

    Raises:
        ValueError: the ``simulator`` resource is not ``PhantoraDocker`` (no Docker backend).
        FileNotFoundError: the GPU has no perf DB and profiling is not allowed.
    """
    b = _backend(spec, ctx)
    perfdb = b.perfdb_source(spec)
    return simulate_docker(spec, paths, b.runner(), b.slots(paths.root), b.settings, perfdb_source=perfdb, log=ctx.log)


def chrome_trace(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``chrome_trace`` of a Docker run (:func:`docker_trace`)."""
    return docker_trace(spec, paths, _backend(spec, ctx).runner())
