"""Typed sidecar records: the small JSON files written beside the tables (msgspec Structs).

No Dagster import, no pandera. One Struct per file; :func:`write_record` writes it atomically as
indented JSON with sorted keys (stable, diff-friendly), :func:`read_record` decodes and validates
it (a missing or malformed file raises :class:`RecordError` naming the file).

    <root>/perfdb/<gpu>/perf_db.json              PerfDbRecord      perf_db
    partitions/<run_id>/run_log.json              RunLogRecord      raw_timeline (all but analytic OOM)
    partitions/<run_id>/run_spec.json             RunSpecRecord     raw_timeline (every run)
    partitions/<run_id>/simulation.json           SimulationRecord  raw_timeline (analytic only)
    <run folder>/import.json                      ImportRecord      raw_timeline (import only)
    partitions/<run_id>/kineto.json               KinetoRecord      raw_timeline (kineto only)
    partitions/<run_id>/trace_summary.json        TraceSummary      validated_flows
    partitions/<run_id>/cross_check.json          CrossCheckRecord  validated_flows

The run folder's ``checks.json``/``checks.txt`` are written and read by :mod:`phantora_assets.checks`.

Units are in the field names (``_ms``, ``_us``, ``_s``, ``_gib``, ``_bytes``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from phantora_assets.lib.errors import FileRuleError
from phantora_assets.lib.store.io import atomic_write_text


class RecordError(FileRuleError):
    """A sidecar record is missing or does not decode as its Struct (names the file)."""


class PerfDbRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``perf_db.json``: the validated perf DB of one GPU (``status`` present or absent)."""

    gpu: str
    status: str
    message: str | None = None
    gpu_name: str | None = None
    compute_entries: int | None = None
    memcpy_entries: int | None = None
    ops: int | None = None


class RunLogRecord(msgspec.Struct, kw_only=True):
    """``run_log.json``: what the run folder's ``run.log`` says (``lib/phantora/run_log.py``), or
    for an analytic run what the simulator reported (it is not parsed back from the log it wrote).
    """

    run_id: str
    present: bool
    format: str = "unknown"
    iteration_s: list[float] = []
    per_rank_s: dict[str, list[float]] = {}
    peak_memory_mib: dict[str, float] = {}
    peak_memory_gib: float | None = None
    steady_iteration_s: float | None = None
    out_of_memory: bool = False
    oom_line: str = ""
    model_params: int | None = None
    precise: bool = False


class SimulationRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``simulation.json``: what the analytic simulator computed for a run that fits.

    Attributes:
        step_ms: the median of the steady iterations (all but the first), ms: the simulator's iteration
            time, as ``phantora-assets sweep``'s ``iteration_time_ms`` (the key keeps its name: every
            ``simulation.json`` has it); the run's step time is ``trace_summary.step_time_us`` (cut from
            the trace's flows, ``lib/traffic/steps``). compute_ms_per_step / exposed_comm_ms_per_step: rank 0's
            compute-stream busy time and the rest of the step, ms.
        perf_db_fraction: share of compute time timed by the perf DB (0..1).
        kernels_per_step / kernels_from_perf_db: intercepted calls per step, and how many the
            perf DB had.
        iteration_ns: simulated time of each iteration (the first is warm-up), ns.
        peak_memory_gib / card_gib: the memory estimate (GiB, rounded to 0.01) and the card.
        flops_per_step: model FLOP of one step summed over all ranks (GEMMs of the compute items).
        timeline_scope: what ``raw_timeline.parquet`` holds (``lib/workload/collectives.TIMELINE_SCOPES``):
            ``every rank`` (left out of the file), or ``one rank a stage`` (every network flow, the compute of
            each pipeline stage's first rank) for a run past the trace bound.
        compute_hosts: scope ``one rank a stage`` only (left out for ``every rank``): the hosts (``host-k``, in
            host order) whose compute the timeline holds whole, each with how many of the run's hosts have that
            very compute, itself included (``lib/workload/collectives.compute_hosts``); ``step_anatomy`` reports
            these hosts and no other, and ``reconfig`` weighs their compute by the counts. Empty: no host's.

    Every field but ``timeline_scope`` and ``compute_hosts`` is required: a ``simulation.json`` written before
    these fields existed is refused (:class:`RecordError` naming the file and the missing field), never read as
    nulls; a scoped one without ``compute_hosts`` is refused where it is read (``stages/simulation.compute_hosts_of``).
    """

    step_ms: float
    compute_ms_per_step: float
    exposed_comm_ms_per_step: float
    perf_db_fraction: float
    kernels_per_step: int
    kernels_from_perf_db: int
    iteration_ns: list[int]
    peak_memory_gib: float
    card_gib: float
    flops_per_step: float
    timeline_scope: str = "every rank"
    compute_hosts: dict[str, int] | None = None


class ImportRecord(msgspec.Struct, kw_only=True):
    """``import.json``: where an imported run came from and what was copied (name -> bytes or files)."""

    run_id: str
    source: str
    trace: str | None
    copied: dict[str, int] = {}


class KinetoRecord(msgspec.Struct, kw_only=True):
    """``kineto.json``: what ``raw_timeline`` read from a folder of PyTorch profiler traces.

    Attributes:
        files: rank -> trace file name. world_size / ranks_present: of the job and of the folder.
        device: the GPU the profiler saw (``deviceProperties``); device_gib its memory, GiB.
        step_starts_us / step_last_end_us: the ``ProfilerStep#N`` steps on the timeline (us since
            its start; empty: no markers, steps by the communicator rule); step_numbers their N.
        timed_by_kernel / timed_by_cpu: collectives timed by their NCCL kernel / by the CPU op.
        notes: the assumptions made, in plain words (also written to ``checks.txt``).
    """

    run_id: str
    files: dict[str, str]
    world_size: int
    ranks_present: list[int]
    backend: str
    device: str
    device_gib: float
    step_numbers: list[int] = []
    step_starts_us: list[float] = []
    step_last_end_us: float = 0.0
    n_collectives: int = 0
    timed_by_kernel: int = 0
    timed_by_cpu: int = 0
    skipped: dict[str, int] = {}
    notes: list[str] = []


class TraceSummary(msgspec.Struct, kw_only=True):
    """``trace_summary.json``: the step detection of a validated trace.

    Attributes:
        step_time_us: median steady step, us. network_bytes_per_step: bytes of one steady step
            with src_node != dst_node. chosen_step: the steady step the 180 s build repeats.
        periods: comm_id -> period in calls. compute_busy_us: host -> sum of Computation dur, us.
        network_bytes_by_group: parallelism group (tp, cp, ep, dp, pp, other; docs/WORKLOADS.md
            "Groups") -> network bytes of one steady step (mean over the steady steps).
    """

    run_id: str
    trace: str
    step_time_us: float
    network_bytes_per_step: int
    n_steady_steps: int
    chosen_step: int
    n_flows: int
    n_network_flows: int
    periods: dict[str, int] = {}
    compute_busy_us: dict[str, float] = {}
    network_bytes_by_group: dict[str, int] = {}


class RunSpecRecord(msgspec.Struct, kw_only=True):
    """``run_spec.json``: what a run was built from (its run-matrix entry, the workload preset,
    the GPU's entry, the network, the sha256 of the perf DB files and of a fabric file) and the
    ``fingerprint`` of it; the dataset export compares it with the current entry so that a run
    built from an older entry or file is named as stale, never exported silently."""

    run_id: str
    fingerprint: str
    inputs: dict[str, Any]


class CrossCheckRecord(msgspec.Struct, kw_only=True):
    """``cross_check.json``: network bytes per steady step, trace vs workload model, by kind."""

    run_id: str
    passed: bool
    message: str
    tolerance: float
    rows: list[dict[str, Any]]
    n_steady_steps: int
    unmatched_flows_per_step: int | float | None = None


R = TypeVar("R", bound=msgspec.Struct)


def dumps_record(rec: msgspec.Struct) -> str:
    """The record as indented JSON with sorted keys and a final newline."""
    return json.dumps(msgspec.to_builtins(rec), indent=1, sort_keys=True) + "\n"


def write_record(path: Path, rec: msgspec.Struct, durable: bool = False) -> None:
    """Write ``rec`` to ``path`` atomically (``lib/store/io.py``)."""
    atomic_write_text(path, dumps_record(rec), durable=durable)


def read_record(path: Path, kind: type[R]) -> R:
    """Decode ``path`` as a ``kind`` record.

    Raises:
        RecordError: the file is missing, is not JSON, or does not match ``kind`` (names the
            file and the field).
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RecordError(path, f"unreadable {kind.__name__} record", str(exc.strerror or exc)) from exc
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.DecodeError as exc:
        raise RecordError(path, f"invalid {kind.__name__} record", str(exc)) from exc


def read_record_or_none(path: Path, kind: type[R]) -> R | None:
    """Like :func:`read_record`, None when the file does not exist."""
    return read_record(path, kind) if path.is_file() else None
