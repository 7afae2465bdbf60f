"""Source ``chakra``: a folder of Chakra execution traces (``<prefix>.<rank>.et``, one per rank,
and ``<prefix>.comm_groups.json`` when present), registered by ``phantora-assets import FOLDER
--gpus-per-node N`` (``lib/chakra/ingest.py``); no simulator needed.

    raw_timeline -> partitions/<run_id>/raw_timeline.parquet (the ETs' collectives as Phantora's
                    ring flows, their GPU compute nodes as computation), chakra.json, run_log.json;
                    the assumptions made as the ``source_assumptions`` note of checks.txt
    chrome_trace -> run folder timeline.json.gz in the Phantora visualizer schema (the raw
                    timeline written by ``trace_writer``), which every asset below reads

Steps come from the communicator rule. ``fits_in_memory``: an ET records no memory, the run is
taken to fit; ``perfdb_complete``: nothing was replayed from a perf DB. The ``source`` and
``simulator`` columns of ``runs.csv`` are ``chakra``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from phantora_assets.checks import FITS_IN_MEMORY, PERFDB_COMPLETE
from phantora_assets.lib.chakra import ingest
from phantora_assets.lib.chakra.et_io import et_files
from phantora_assets.lib.chakra.ingest import ChakraRun, is_et_folder, read_folder
from phantora_assets.lib.errors import FileRuleError, TraceFormatError
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store.io import atomic_write_text
from phantora_assets.outcomes import Outcome, StageResult
from phantora_assets.paths import DataPaths
from phantora_assets.sources import profiled
from phantora_assets.sources.base import SourceContext
from phantora_assets.sources.profiled import SIDECAR, check_world, finish_raw_timeline, make_spec, start_raw_timeline

NAME = "chakra"
DESCRIPTION = "a folder of Chakra execution traces, one per rank (phantora-assets import)"
DATASET_SOURCE = "chakra"
ROOFLINE_TIMING = False

__all__ = ["is_et_folder", "spec_for"]


def _notes(run: ChakraRun, counts: dict[str, int]) -> list[str]:
    groups = f"comm groups from {run.groups_file.name}" if run.groups_file else "no comm-groups file: groups inferred"
    return [
        f"{run.world_size} ranks' Chakra ETs ({groups}); rank r on host r // {run.gpus_per_node} + 1",
        f"{counts['collectives']} collectives and {counts['sends']} sends as Phantora's ring flows "
        "(U8, count = bytes); "
        f"{counts['skipped']} CPU-side or barrier nodes are not flows",
        f"{counts['compute']} GPU compute nodes as Computation; times from start_time_micros (whole us); "
        "steps by the communicator rule",
    ]


def spec_for(folder: str | Path, gpus_per_node: int = 1, run_id: str | None = None, world_size: int | None = None):
    """The RunSpec of a folder of Chakra ETs: every ET read and converted (so a folder that cannot
    give flows is declined now), run_id ``run_id`` or ``<folder name>_<nodes>x<gpus_per_node>``.
    ``world_size``, when given, must be the number of ranks' ETs.

    Raises:
        TraceFormatError: as ``lib/chakra/ingest`` (names the file and the rule); ``layout``: not
            ``world_size`` ranks.
        RunMatrixError: ``run_id`` is not a valid name (lib/run/spec.validate).
    """
    folder = Path(folder).resolve()
    run = read_folder(folder, gpus_per_node)
    if world_size is not None and run.world_size != world_size:
        raise TraceFormatError(folder, "layout", f"{run.world_size} ranks' ETs, but --world-size {world_size}")
    ingest.raw_timeline(run)
    return make_spec(NAME, folder, run.world_size, gpus_per_node, run_id)


def input_files(folder: Path) -> list[str]:
    """The files of a registered folder its build reads (what its fingerprint covers): the ETs,
    the ``*.comm_groups.json`` and ``import.toml``."""
    try:
        ets = [p.name for p in et_files(folder).values()]
    except (OSError, FileRuleError):  # a link or two prefixes: the build declines it
        ets = []
    return [*ets, *sorted(p.name for p in folder.glob("*.comm_groups.json")), SIDECAR]


def import_ets(spec: RunSpec, paths: DataPaths) -> StageResult:
    """raw_timeline of a Chakra run: read the folder's ETs, write the raw timeline and records.

    Raises:
        FileNotFoundError: the registered folder does not exist.
        TraceFormatError: an ET breaks a rule (names the file); ``layout``: its world size is not the spec's.
    """
    _, src = start_raw_timeline(spec, paths, "Chakra ETs")
    run = read_folder(src, spec.gpus_per_node)
    check_world(spec, run.world_size, src, "ranks")
    raw, counts = ingest.raw_timeline(run)
    notes = _notes(run, counts)
    rec = {"run_id": spec.run_id, "files": {str(r): et.path.name for r, et in run.ets.items()}, **counts,
           "comm_groups": run.groups, "notes": notes}  # fmt: skip
    atomic_write_text(paths.partition_dir(spec.run_id) / "chakra.json", json.dumps(rec, indent=1) + "\n")
    outcomes = [
        Outcome(FITS_IN_MEMORY, True, "fits: a Chakra ET records no memory use; the run is taken to fit", {}),
        Outcome(PERFDB_COMPLETE, True, "no perf-DB replay: node durations as the ETs give them", {}),
    ]
    out = finish_raw_timeline(spec, paths, raw, f"Chakra ETs of {src}", notes, outcomes)
    meta: dict[str, Any] = {"status": "imported", "source_folder": str(src), "world_size": run.world_size,
                            "n_events": len(raw), **counts}  # fmt: skip
    return StageResult(out, meta, outcomes)


def run_fields(spec: RunSpec, paths: DataPaths) -> dict[str, Any]:
    """The descriptive ``runs.csv`` columns of a Chakra run: no workload preset, no GPU recorded."""
    return {"workload": "", "framework": "", "model": "", "parallelism": f"world={spec.world_size}", "gpu": ""}


def chrome_trace(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """chrome_trace of a Chakra run: its raw timeline as ``timeline.json.gz`` (Phantora schema)."""
    return profiled.chrome_trace(spec, paths, ctx)


def raw_timeline(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``raw_timeline`` of a Chakra run (:func:`import_ets`)."""
    return import_ets(spec, paths)
