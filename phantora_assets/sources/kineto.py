"""Source ``kineto``: a folder of PyTorch profiler (Kineto) traces, one per rank, registered by
``phantora-assets import FOLDER --gpus-per-node N`` (``lib/kineto/``); no simulator needed.

    raw_timeline -> partitions/<run_id>/raw_timeline.parquet (the traces' collectives as Phantora's
                    ring flows, their GPU kernels as computation), kineto.json, run_log.json;
                    the assumptions made as the ``source_assumptions`` note of checks.txt
    chrome_trace -> run folder timeline.json.gz in the Phantora visualizer schema (the raw
                    timeline written by ``trace_writer``), which every asset below reads

The bytes rules and their sources are in ``lib/kineto/collectives.py``; what is read and what is
declined in ``lib/kineto/reader.py``; steps come from the ``ProfilerStep#N`` markers when the
traces have them (``lib/kineto/step_spans.py``, read by ``validated_flows`` from ``kineto.json``),
else from the communicator rule. ``fits_in_memory``: the job ran on real GPUs, so it fit;
``perfdb_complete``: nothing was replayed from a perf DB.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phantora_assets.checks import FITS_IN_MEMORY, PERFDB_COMPLETE
from phantora_assets.lib.errors import FileRuleError, TraceFormatError
from phantora_assets.lib.kineto.run import TRACE_SUFFIXES, convert, read_folder, trace_files
from phantora_assets.lib.phantora.run_folder import trace_file
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.outcomes import Outcome, StageResult
from phantora_assets.paths import DataPaths
from phantora_assets.records import KinetoRecord, read_record_or_none, write_record
from phantora_assets.sources import profiled
from phantora_assets.sources.base import SourceContext
from phantora_assets.sources.profiled import (
    SIDECAR,
    check_world,
    finish_raw_timeline,
    make_spec,
    start_raw_timeline,
)

NAME = "kineto"
DESCRIPTION = "a folder of PyTorch profiler (Kineto) traces, one per rank (phantora-assets import)"
DATASET_SOURCE = "kineto"
ROOFLINE_TIMING = False
_RUN_FOLDER_JSON = ("checks.json", "import.json")  # what a run folder of a data root holds besides its trace


def is_trace_folder(folder: str | Path) -> bool:
    """True when ``folder`` holds PyTorch profiler traces: ``*.json`` / ``*.json.gz`` directly in it,
    and it is no Phantora run folder (no ``timeline.json(.gz)``; its ``checks.json`` and
    ``import.json`` are not traces). A link among the traces counts (``spec_for`` refuses it)."""
    folder = Path(folder)
    if not folder.is_dir() or trace_file(folder) is not None:
        return False
    try:
        return any(p.name not in _RUN_FOLDER_JSON for p in trace_files(folder))
    except FileRuleError:
        return True


def spec_for(
    folder: str | Path,
    gpus_per_node: int = 1,
    run_id: str | None = None,
    world_size: int | None = None,
    rank: int | None = None,
) -> RunSpec:
    """The RunSpec of a folder of profiler traces: every trace read and converted (so a trace that
    cannot give flows is declined now, before it is registered), rank r on host r // gpus_per_node + 1,
    run_id ``run_id`` or ``<folder name>_<nodes>x<gpus_per_node>`` (``lib/kineto/run.default_run_id``).
    ``world_size`` and ``rank`` (``--world-size``, ``--rank``) place traces without
    ``distributedInfo`` (``lib/kineto/run.read_folder``); given with traces that have it, they must agree.

    Raises:
        KinetoDeclined / TraceFormatError: as ``lib/kineto/run.read_folder`` and ``convert``;
            ``layout``: the traces' world size is not ``world_size``.
        RunMatrixError: ``run_id`` is not a valid name (lib/run/spec.validate).
    """
    folder = Path(folder).resolve()
    run = read_folder(folder, gpus_per_node, world_size, rank)
    if world_size is not None and run.world_size != world_size:
        raise TraceFormatError(
            run.ranks[0].path, "layout", f"world size {run.world_size}, but --world-size {world_size}"
        )
    convert(run)
    return make_spec(NAME, folder, run.world_size, gpus_per_node, run_id, rank)


def input_files(folder: Path) -> list[str]:
    """The files of a registered folder its build reads (what its fingerprint covers): the
    traces (``*.json``, ``*.json.gz``, links too) and ``import.toml``."""
    names = [p.name for p in folder.iterdir() if p.name.endswith(TRACE_SUFFIXES) and not p.name.startswith(".")]
    return [*sorted(n for n in names if n not in _RUN_FOLDER_JSON), SIDECAR]


def record_path(paths: DataPaths, spec: RunSpec) -> Path:
    """``partitions/<run_id>/kineto.json``."""
    return paths.partition_dir(spec.run_id) / "kineto.json"


def import_traces(spec: RunSpec, paths: DataPaths) -> StageResult:
    """raw_timeline of a Kineto run: read the folder's traces, write the raw timeline and records.
    A trace without ``distributedInfo`` is placed by the spec's world size and ``rank``.

    Raises:
        FileNotFoundError: the registered folder does not exist.
        KinetoDeclined / TraceFormatError: a trace cannot give flows or breaks a rule (names the
            file and the rule); ``layout``: the folder's world size is not the spec's.
    """
    _, src = start_raw_timeline(spec, paths, "profiler traces")
    run = read_folder(src, spec.gpus_per_node, spec.world_size, spec.rank)
    check_world(spec, run.world_size, run.ranks[0].path)
    conv = convert(run)
    first = run.ranks[0]
    rec = KinetoRecord(
        run_id=spec.run_id,
        files={str(rt.rank): rt.path.name for rt in run.ranks},
        world_size=run.world_size,
        ranks_present=[rt.rank for rt in run.ranks],
        backend=first.backend,
        device=first.device,
        device_gib=round(first.device_bytes / 2**30, 2),
        step_numbers=conv.step_numbers,
        step_starts_us=conv.step_starts_us,
        step_last_end_us=conv.step_last_end_us,
        n_collectives=conv.n_collectives,
        timed_by_kernel=conv.timed_by_kernel,
        timed_by_cpu=conv.timed_by_cpu,
        skipped={k: v for rt in run.ranks for k, v in rt.skipped.items()},
        notes=conv.notes,
    )
    write_record(record_path(paths, spec), rec)
    device = f"{first.device or 'an unnamed GPU'}, {rec.device_gib:.2f} GiB"
    outcomes = [
        Outcome(FITS_IN_MEMORY, True, f"fits: a job profiled on real GPUs ({device}) ran, so it fit", {}),
        Outcome(PERFDB_COMPLETE, True, "no perf-DB replay: kernel times measured by the PyTorch profiler", {}),
    ]
    out = finish_raw_timeline(spec, paths, conv.raw, f"PyTorch profiler traces of {src}", conv.notes, outcomes)
    meta: dict[str, Any] = {
        "status": "imported",
        "source_folder": str(src),
        "ranks_traced": len(run.ranks),
        "world_size": run.world_size,
        "n_events": len(conv.raw),
        "n_collectives": conv.n_collectives,
        "timed_by_cpu_op": conv.timed_by_cpu,
        "profiler_steps": len(conv.step_numbers),
    }
    return StageResult(out, meta, outcomes)


def profiler_steps(paths: DataPaths, spec: RunSpec) -> tuple[list[float], float] | None:
    """The ``ProfilerStep#N`` step starts and the last step's end (us of the run's trace), or None
    when the run is not a Kineto run or its traces have no markers."""
    rec = read_record_or_none(record_path(paths, spec), KinetoRecord) if spec.source == NAME else None
    if rec is None or len(rec.step_starts_us) < 2:
        return None
    return list(rec.step_starts_us), float(rec.step_last_end_us)


def run_fields(spec: RunSpec, paths: DataPaths) -> dict[str, Any]:
    """The descriptive ``runs.csv`` columns of a Kineto run: no workload preset, the profiled GPU."""
    rec = read_record_or_none(record_path(paths, spec), KinetoRecord)
    return {
        "workload": "",
        "framework": "PyTorch",
        "model": "",
        "parallelism": f"world={spec.world_size}",
        "gpu": rec.device if rec is not None else "",
    }


def raw_timeline(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``raw_timeline`` of a Kineto run (:func:`import_traces`)."""
    return import_traces(spec, paths)


def chrome_trace(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``chrome_trace`` of a Kineto run: its raw timeline as ``timeline.json.gz`` (Phantora schema)."""
    return profiled.chrome_trace(spec, paths, ctx)
