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

import pandas as pd

from phantora_assets.checks import record_note, reset_checks
from phantora_assets.lib.chakra import ingest
from phantora_assets.lib.chakra.ingest import ChakraRun, is_et_folder, read_folder
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.kineto.run import default_run_id
from phantora_assets.lib.phantora import trace_writer
from phantora_assets.lib.store.io import atomic_write_text
from phantora_assets.matrix import RunSpec, validate
from phantora_assets.paths import DataPaths
from phantora_assets.records import RunLogRecord, write_record
from phantora_assets.sources.base import SourceContext
from phantora_assets.stages.common import Outcome, StageResult, record, write_parquet

NAME = "chakra"
DESCRIPTION = "a folder of Chakra execution traces, one per rank (phantora-assets import)"
DATASET_SOURCE = "chakra"
ROOFLINE_TIMING = False
NOTE_NAME = "source_assumptions"

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


def spec_for(folder: str | Path, gpus_per_node: int = 1, run_id: str | None = None) -> RunSpec:
    """The RunSpec of a folder of Chakra ETs: every ET read and converted (so a folder that cannot
    give flows is declined now), run_id ``run_id`` or ``<folder name>_<nodes>x<gpus_per_node>``.

    Raises:
        TraceFormatError: as ``lib/chakra/ingest`` (names the file and the rule).
        RunMatrixError: ``run_id`` is not a valid name (matrix.validate).
    """
    folder = Path(folder).resolve()
    run = read_folder(folder, gpus_per_node)
    ingest.raw_timeline(run)
    name = run_id or default_run_id(folder, run.n_nodes, gpus_per_node)
    spec = RunSpec("", "", run.n_nodes, gpus_per_node, source=NAME, path=str(folder), name=name)
    validate(spec, f"--run-id {name!r} ({folder})")
    return spec


def import_ets(spec: RunSpec, paths: DataPaths) -> StageResult:
    """raw_timeline of a Chakra run: read the folder's ETs, write the raw timeline and records.

    Raises:
        FileNotFoundError: the registered folder does not exist.
        TraceFormatError: an ET breaks a rule (names the file); ``layout``: its world size is not the spec's.
    """
    folder = paths.run_folder(spec)
    reset_checks(folder, "raw_timeline")
    src = Path(spec.path)
    if not src.is_dir():
        raise FileNotFoundError(f"{spec.run_id}: folder of Chakra ETs {src} does not exist")
    run = read_folder(src, spec.gpus_per_node)
    if run.world_size != spec.world_size:
        raise TraceFormatError(src, "layout", f"{run.world_size} ranks, but {spec.run_id} is {spec.layout}")
    raw, counts = ingest.raw_timeline(run)
    out = paths.table(spec.run_id, "raw_timeline")
    write_parquet(raw, out)
    notes = _notes(run, counts)
    pdir = paths.partition_dir(spec.run_id)
    rec = {"run_id": spec.run_id, "files": {str(r): et.path.name for r, et in run.ets.items()}, **counts,
           "comm_groups": run.groups, "notes": notes}  # fmt: skip
    atomic_write_text(pdir / "chakra.json", json.dumps(rec, indent=1) + "\n")
    write_record(pdir / "run_log.json", RunLogRecord(run_id=spec.run_id, present=False, format="chakra"))
    outcomes = [
        Outcome("fits_in_memory", True, "fits: a Chakra ET records no memory use; the run is taken to fit", {}),
        Outcome("perfdb_complete", True, "no perf-DB replay: node durations as the ETs give them", {}),
    ]
    record(paths, spec, "raw_timeline", outcomes)
    record_note(folder, "raw_timeline", NOTE_NAME, "; ".join(notes))
    atomic_write_text(folder / "run.log", "".join(f"# {line}\n" for line in [f"Chakra ETs of {src}", *notes]))
    meta: dict[str, Any] = {"status": "imported", "source_folder": str(src), "world_size": run.world_size,
                            "n_events": len(raw), **counts}  # fmt: skip
    return StageResult(out, meta, outcomes)


def run_fields(spec: RunSpec, paths: DataPaths) -> dict[str, Any]:
    """The descriptive ``runs.csv`` columns of a Chakra run: no workload preset, no GPU recorded."""
    return {"workload": "", "framework": "", "model": "", "parallelism": f"world={spec.world_size}", "gpu": ""}


def chrome_trace(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """chrome_trace of a Chakra run: its raw timeline as ``timeline.json.gz`` (Phantora schema)."""
    out = paths.chrome_trace(spec)
    stats = trace_writer.write_chrome_trace(pd.read_parquet(paths.table(spec.run_id, "raw_timeline")), out)
    return StageResult(out, {k: int(v) for k, v in stats.items()})


def raw_timeline(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``raw_timeline`` of a Chakra run (:func:`import_ets`)."""
    return import_ets(spec, paths)
