"""Source ``analytic``: the embedded analytic simulator (``lib/sim``), the default; no Docker, no GPU.

raw_timeline -> partitions/<run_id>/raw_timeline.parquet, simulation.json, run_log.json;
                run folder run.log and config/{netconfig,run}.toml
chrome_trace -> run folder timeline.json.gz (written from raw_timeline.parquet)
flow_tables  -> validated_flows' input, read from raw_timeline.parquet (the Chrome trace is an output)
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from phantora_assets.checks import FITS_IN_MEMORY, PERFDB_COMPLETE, reset_checks
from phantora_assets.lib.phantora import chrome_trace as ct
from phantora_assets.lib.phantora.netconfig import NoPhantoraTopology, dumps_netconfig, netconfig_for
from phantora_assets.lib.phantora.raw_tables import read_raw_timeline
from phantora_assets.lib.phantora.run_log import RunLog
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.analytic import simulate
from phantora_assets.lib.sim.workload_types import Compute
from phantora_assets.lib.sim.workloads import workload_model
from phantora_assets.lib.store.io import atomic_write_text
from phantora_assets.lib.store.parquet import write_parquet_frames
from phantora_assets.lib.workload.collectives import EVERY_RANK
from phantora_assets.outcomes import Outcome, StageResult, record
from phantora_assets.paths import DataPaths
from phantora_assets.records import RunLogRecord, SimulationRecord, read_record_or_none, write_record
from phantora_assets.sources.base import SourceContext

NAME = "analytic"
DESCRIPTION = "the embedded analytic simulator (roofline + perf DB kernel times, flow-level network)"
DATASET_SOURCE = "phantora_analytic"
ROOFLINE_TIMING = True

_ANALYTIC_PERFDB = Outcome(
    PERFDB_COMPLETE,
    True,
    "not a perf-DB replay: the embedded analytic simulator times kernels with its roofline model",
    {"mode": "analytic"},
)


def _fits_outcome(mem: dict[str, Any]) -> Outcome:
    """The ``fits_in_memory`` outcome of a memory estimate (``MemoryEstimate.as_dict()``)."""
    fits = bool(mem["fits"])
    words = (
        "fits: estimated peak {p:.2f} GiB <= card {c:.2f} GiB"
        if fits
        else "does not fit: estimated peak {p:.2f} GiB > card {c:.2f} GiB"
    )
    return Outcome(
        FITS_IN_MEMORY,
        fits,
        words.format(p=mem["peak_gib"], c=mem["card_gib"]),
        {"peak_gib": mem["peak_gib"], "card_gib": mem["card_gib"]},
    )


def simulate_run(spec: RunSpec, paths: DataPaths, perfdb_status: str = "unknown") -> StageResult:
    """Run the analytic simulator; write the raw timeline, ``run.log`` and ``config/``.

    Writes ``partitions/<run_id>/raw_timeline.parquet`` (``columns.RAW_TIMELINE_COLUMNS``),
    ``simulation.json`` (:class:`~phantora_assets.records.SimulationRecord`: step time, compute,
    iterations, memory, FLOPs) and ``run_log.json``, and in the run folder ``run.log`` and
    ``config/{netconfig,run}.toml``. A run that does not fit in GPU memory writes ``run.log``
    with the estimate, no timeline, and a failed ``fits_in_memory`` outcome; it never raises for
    that.
    """
    folder = paths.run_folder(spec)
    reset_checks(folder, "raw_timeline")
    result = simulate(spec)
    mem = result.memory.as_dict()
    config = folder / "config"
    try:
        atomic_write_text(config / "netconfig.toml", dumps_netconfig(netconfig_for(spec)))
    except NoPhantoraTopology:  # a fabric Phantora cannot build: its settings instead (docs/FABRIC.md)
        atomic_write_text(config / "fabric.toml", dumps_netconfig({"cluster": spec.cluster}))
    atomic_write_text(
        config / "run.toml",
        "\n".join(
            [
                f'run_id = "{spec.run_id}"',
                f'workload = "{spec.workload}"',
                f'gpu = "{spec.gpu}"',
                f"nodes = {spec.n_nodes}",
                f"gpus_per_node = {spec.gpus_per_node}",
                f'source = "{spec.source}"',
                f'parallelism = "{spec.parallelism}"',
                "",
            ]
        ),
    )
    log = [
        f"# analytic simulation of {spec.run_id} ({spec.framework} {spec.model_name}, {spec.parallelism})",
        f"# perf DB: {perfdb_status}",
        f"peak memory estimate: {mem['peak_gib']:.2f} GiB of {mem['card_gib']:.2f} GiB",
    ]
    meta: dict[str, Any] = {"fits": result.fits, **{f"memory_{k}": v for k, v in mem.items() if k != "fits"}}
    if not result.fits:
        log.append(
            f"OUT OF MEMORY: estimated peak {mem['peak_gib']:.2f} GiB exceeds the card ({mem['card_gib']:.2f} GiB)"
        )
        atomic_write_text(folder / "run.log", "\n".join(log) + "\n")
        outcomes = [_fits_outcome(mem), _ANALYTIC_PERFDB]
        record(paths, spec, "raw_timeline", outcomes)
        return StageResult(None, {**meta, "status": "out_of_memory"}, outcomes)
    log.append(
        f"# compute per steady step (rank 0): {result.compute_ns_per_step / 1e6:.3f} ms, "
        f"{result.db_fraction:.1%} of it from the perf DB ({result.kernels_from_db}/{result.kernels_per_step} "
        f"intercepted calls found), the rest from the {spec.gpu} roofline"
    )
    log.append(f"# exposed communication per steady step (rank 0): {result.exposed_comm_ns / 1e6:.3f} ms")
    for i, ns in enumerate(result.iteration_ns):
        log.append(
            f"iteration {i + 1:3d}/{len(result.iteration_ns)} | simulated time (ms): {ns / 1e6:.3f} "
            f"| peak memory (GiB): {mem['peak_gib']:.2f}"
        )
    out = paths.table(spec.run_id, "raw_timeline")
    timeline = result.timeline
    assert timeline is not None  # a run that fits is simulated with its events
    # 3 M rows at 128x8: made and written one iteration at a time, never one DataFrame
    write_parquet_frames(timeline.frames(), out, chunk_rows=500_000)
    sim = SimulationRecord(
        step_ms=round(result.step_ns / 1e6, 6),
        compute_ms_per_step=round(result.compute_ns_per_step / 1e6, 6),
        exposed_comm_ms_per_step=round(result.exposed_comm_ns / 1e6, 6),
        perf_db_fraction=round(result.db_fraction, 6),
        kernels_per_step=result.kernels_per_step,
        kernels_from_perf_db=result.kernels_from_db,
        iteration_ns=[int(ns) for ns in result.iteration_ns],
        peak_memory_gib=mem["peak_gib"],
        card_gib=mem["card_gib"],
        flops_per_step=model_flops_per_step(spec),
        # the default left out of the file (msgspec omits a default by identity, not by value)
        **({} if result.scope == EVERY_RANK else {"timeline_scope": result.scope}),
        compute_hosts=None  # every rank: left out (None is the default, by identity)
        if result.compute_hosts is None
        else {f"host-{h + 1}": n for h, n in result.compute_hosts.items()},
    )
    pdir = paths.partition_dir(spec.run_id)
    write_record(pdir / "simulation.json", sim)
    atomic_write_text(folder / "run.log", "\n".join(log) + "\n")
    outcomes = [_fits_outcome(mem), _ANALYTIC_PERFDB]
    record(paths, spec, "raw_timeline", outcomes)
    # what run.log says, from the numbers the simulator returned (the log is not parsed back)
    iteration_s = [ns / 1e9 for ns in result.iteration_ns]
    run_log = RunLog(
        format="analytic",
        iteration_s=iteration_s,
        per_rank_s={0: list(iteration_s)},  # the log reports rank 0's iterations
        peak_memory_gib=mem["peak_gib"],
        precise=True,
    )
    write_record(pdir / "run_log.json", RunLogRecord(run_id=spec.run_id, present=True, **run_log.as_dict()))
    sim_meta = {
        k: v
        for k, v in msgspec.to_builtins(sim).items()
        if k not in ("iteration_ns", "peak_memory_gib", "card_gib", "flops_per_step", "compute_hosts")
    }
    if sim.compute_hosts is not None:  # a scoped run: the hosts step_anatomy reports
        sim_meta["compute_hosts"] = ", ".join(sim.compute_hosts) or "none"
    meta.update(
        {
            "status": "simulated",
            "n_events": len(timeline),
            "iterations": len(result.iteration_ns),
            **sim_meta,
            **run_log.metadata(),
        }
    )
    return StageResult(out, meta, outcomes)


#: Most events of an analytic run's Chrome trace written whole (W1 32x8: 307 k events, 18.6 MiB gzip, 3.5 s).
#: The pipeline reads the raw timeline table (:func:`flow_tables`), so the trace is a view for Perfetto: a run
#: with more events gets the events of :func:`trace_hosts` only, and its metadata says so.
CHROME_TRACE_MAX_EVENTS = 2_000_000


def trace_hosts(spec: RunSpec) -> list[str]:
    """The hosts a bounded trace holds: the host of the first rank of each pipeline stage (every framework's
    mesh puts pp outermost, ``lib/workload/placement.rank_coords``: stage ``s`` is ranks ``s W/pp .. (s+1) W/pp
    - 1``), in stage order, each once: one rank per stage with every flow and kernel of its host."""
    stage_ranks = spec.world_size // spec.par.pp
    hosts = [f"host-{s * stage_ranks // spec.gpus_per_node + 1}" for s in range(spec.par.pp)]
    return list(dict.fromkeys(hosts))


def write_trace(spec: RunSpec, paths: DataPaths) -> StageResult:
    """Convert the raw timeline into ``timeline.json.gz`` (Phantora visualizer schema): every event, or for a run
    of more than :data:`CHROME_TRACE_MAX_EVENTS` events the events of :func:`trace_hosts` (a flow when either
    end is on one of them); the metadata's ``trace_holds`` says which (and the raw timeline's scope when it is
    one rank a stage), ``events_in_run`` how many there are."""
    out = paths.chrome_trace(spec)
    table = paths.table(spec.run_id, "raw_timeline")
    total = pq.ParquetFile(table).metadata.num_rows
    rec = read_record_or_none(paths.partition_dir(spec.run_id) / "simulation.json", SimulationRecord)
    scoped = rec is not None and rec.timeline_scope != EVERY_RANK
    if total <= CHROME_TRACE_MAX_EVENTS:
        stats = ct.write_chrome_trace(table, out)
        holds = (
            "every event of the raw timeline, whose scope is one rank a stage (every network flow, the compute of "
            "each pipeline stage's first rank: docs/WORKLOADS.md 'Scale')"
            if scoped
            else "every event"
        )
        return StageResult(out, {**{k: int(v) for k, v in stats.items()}, "trace_holds": holds})
    hosts = trace_hosts(spec)
    fd, name = tempfile.mkstemp(
        prefix=f".trace_view.p{os.getpid()}.", suffix=".tmp", dir=table.parent
    )  # swept if killed (store.io.TEMP_NAME)
    os.close(fd)
    view = Path(name)
    try:
        _filter_hosts(table, view, hosts)
        stats = ct.write_chrome_trace(view, out)
    finally:
        view.unlink(missing_ok=True)
    holds = f"every event of hosts {', '.join(hosts)} (the first rank of each pipeline stage)"
    if scoped:
        holds += " in the raw timeline of scope one rank a stage (their hosts' other ranks' compute is not in it)"
    return StageResult(out, {**{k: int(v) for k, v in stats.items()}, "trace_holds": holds, "events_in_run": total})


def _filter_hosts(table, out, hosts: list[str]) -> None:
    """The rows of raw timeline ``table`` whose ``src_host`` or ``dst_host`` is in ``hosts``, into ``out``
    (one record batch at a time)."""
    keep = pa.array(hosts)
    pf = pq.ParquetFile(table)
    with pq.ParquetWriter(out, pf.schema_arrow) as writer:
        for batch in pf.iter_batches(batch_size=500_000):
            mask = pc.or_(pc.is_in(batch.column("src_host"), keep), pc.is_in(batch.column("dst_host"), keep))
            writer.write_batch(batch.filter(mask))


def model_flops_per_step(spec: RunSpec) -> float:
    """FLOP of one step summed over all ranks (the GEMMs of the analytic model's compute items)."""
    model = workload_model(spec)
    per_rank = sum(i.flops for i in model.step_program() if isinstance(i, Compute) and i.phase != "opt")
    return per_rank * spec.world_size


def raw_timeline(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``raw_timeline`` of an analytic run (:func:`simulate_run`)."""
    return simulate_run(spec, paths, ctx.perfdb_status)


def flow_tables(spec: RunSpec, paths: DataPaths) -> ct.ParsedTrace:
    """The run's flows and compute read from its raw timeline table (``lib/phantora/raw_tables.py``):
    what its Chrome trace parses to, without parsing it (``validated_flows``' input)."""
    return read_raw_timeline(paths.table(spec.run_id, "raw_timeline"), compute_events=True)


def profiler_steps(paths: DataPaths, spec: RunSpec) -> tuple[list[float], float] | None:
    """The simulated iterations as the run's step marks (starts and the last end, us of the raw timeline) when
    its raw timeline is of scope ``one rank a stage`` (``simulation.json``), else None.

    The step detector cuts a step at its first collective of any rank (``lib/traffic/steps``); a timeline that
    holds one rank a stage lacks the other ranks' host-local calls, so its cut would fall later than the full
    timeline's. The simulator knows its iterations: such a run's steps are they, exactly.

    Raises:
        RecordError: ``simulation.json`` is malformed (names it).
    """
    rec = read_record_or_none(paths.partition_dir(spec.run_id) / "simulation.json", SimulationRecord)
    if rec is None or rec.timeline_scope == EVERY_RANK:
        return None
    ends = np.cumsum(np.asarray(rec.iteration_ns, dtype=np.float64)) / 1000.0
    starts = np.concatenate([[0.0], ends[:-1]])
    return starts.tolist(), float(ends[-1])


def chrome_trace(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The ``chrome_trace`` of an analytic run (:func:`write_trace`)."""
    return write_trace(spec, paths)
