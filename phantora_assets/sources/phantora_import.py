"""Source ``import``: run folders of a Phantora dataset, registered by ``phantora-assets import``
(``lib/phantora/run_folder.py``); no simulator needed.

    raw_timeline -> run folder run.log, timeline.bin, config/, perfdb_missing/ copied in;
                    import.json and partitions/<run_id>/run_log.json
    chrome_trace -> run folder timeline.json.gz (the folder's trace, validated, gzip-compressed)
"""

from __future__ import annotations

from pathlib import Path

from phantora_assets.checks import reset_checks
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.phantora.docker_config import missing_listing
from phantora_assets.lib.phantora.run_folder import trace_file
from phantora_assets.lib.store.io import copy_file, link_or_copy, replace_dir, same_path
from phantora_assets.matrix import RunSpec
from phantora_assets.paths import DataPaths
from phantora_assets.records import ImportRecord, write_record
from phantora_assets.sources.base import SourceContext
from phantora_assets.sources.phantora_run import (
    fits_from_log,
    install_trace,
    perfdb_from_missing,
    write_run_log_summary,
)
from phantora_assets.stages.common import StageResult, record

NAME = "import"
DESCRIPTION = "a Phantora run folder imported from disk (phantora-assets import, $PHANTORA_ASSETS_IMPORT_DIR)"
DATASET_SOURCE = "phantora_v0"
ROOFLINE_TIMING = False


def import_run_folder(spec: RunSpec, paths: DataPaths) -> StageResult:
    """raw_timeline of an imported run: copy its run folder's files into the data root's run folder.

    Copies ``run.log``, ``config/`` and ``perfdb_missing/`` and hard-links (else copies)
    ``timeline.bin``; a file the source lacks is removed from the destination. Writes
    ``import.json`` (source folder, files and sizes) and ``run_log.json``. Outcomes:
    ``fits_in_memory`` from run.log, ``perfdb_complete`` from ``perfdb_missing/`` (written by
    this project's Docker runs; a folder without it has no replay record and passes).

    Raises:
        FileNotFoundError: the registered folder does not exist.
        TraceFormatError: the folder has no trace and its run.log reports no out-of-memory error.
    """
    folder = paths.run_folder(spec)
    reset_checks(folder, "raw_timeline")
    src = Path(spec.path)
    if not src.is_dir():
        raise FileNotFoundError(
            f"{spec.run_id}: imported run folder {src} does not exist "
            f"(registered in {paths.root / 'imports.toml'} or $PHANTORA_ASSETS_IMPORT_DIR)"
        )
    copied: dict[str, int] = {}
    if not same_path(src, folder):
        for name in ("run.log", "timeline.bin"):
            if (src / name).is_file():
                (link_or_copy if name == "timeline.bin" else copy_file)(src / name, folder / name)
                copied[name] = (src / name).stat().st_size
            else:
                (folder / name).unlink(missing_ok=True)
        for sub in ("config", "perfdb_missing"):
            replace_dir(src / sub if (src / sub).is_dir() else None, folder / sub)
            if (src / sub).is_dir():
                copied[f"{sub}/"] = sum(1 for p in (src / sub).rglob("*") if p.is_file())
    trace = trace_file(src)
    log_present = (folder / "run.log").is_file()
    log = write_run_log_summary(paths, spec)
    fits = fits_from_log(spec, log, log_present, "imported")
    missing_dir = src / "perfdb_missing"
    perfdb = perfdb_from_missing(
        missing_listing(missing_dir) if missing_dir.is_dir() else None,
        "imported run folder without a perf-DB replay record (no perfdb_missing/): nothing to check",
    )
    outcomes = [fits, perfdb]
    record(paths, spec, "raw_timeline", outcomes)
    if trace is None:
        paths.chrome_trace(spec).unlink(missing_ok=True)  # no stale trace of an earlier source
    if trace is None and fits.passed:
        raise TraceFormatError(
            src, "missing trace", "no timeline.json.gz or timeline.json, and run.log reports no out-of-memory error"
        )
    write_record(
        folder / "import.json",
        ImportRecord(run_id=spec.run_id, source=str(src), trace=trace.name if trace else None, copied=copied),
    )
    meta = {
        "status": "imported" if fits.passed else "out_of_memory",
        "source_folder": str(src),
        "trace_file": trace.name if trace else None,
        "copied_files": len(copied),
        **log.metadata(),
    }
    return StageResult(folder, meta, outcomes)


def import_trace(spec: RunSpec, paths: DataPaths) -> StageResult:
    """chrome_trace of an imported run: its folder's trace, validated and copied (gzip-compressed)."""
    src_dir = Path(spec.path)
    src = trace_file(src_dir)
    if src is None:
        raise TraceFormatError(src_dir, "missing trace", "no timeline.json.gz or timeline.json")
    return install_trace(spec, paths, src, f"imported from {src}")


def raw_timeline(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``raw_timeline`` of an imported run (:func:`import_run_folder`)."""
    return import_run_folder(spec, paths)


def chrome_trace(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``chrome_trace`` of an imported run (:func:`import_trace`)."""
    return import_trace(spec, paths)
