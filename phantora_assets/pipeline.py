"""The per-run stages of the asset graph as plain functions (no Dagster import).

Each stage reads the previous stage's files under a :class:`~phantora_assets.paths.DataPaths`
root, writes its own files atomically and returns a :class:`StageResult` with metadata and
check outcomes. Dagster assets (``phantora_assets.assets``) are thin wrappers around these,
and so are the CLI and tests that run without Dagster.

    simulate_run     -> partitions/<run_id>/raw_timeline.parquet, run folder run.log, config/
    simulate_docker  -> run folder run.log, timeline.bin, config/ (Phantora in Docker)
    import_run_folder-> run folder run.log, timeline.bin, config/ copied from an imported folder
    (the three above also write partitions/<run_id>/run_log.json)
    write_trace      -> run folder timeline.json.gz (from raw_timeline.parquet)
    docker_trace     -> run folder timeline.json.gz (phantora_visualizer on timeline.bin)
    import_trace     -> run folder timeline.json.gz (copied from the imported folder, validated)
    validate_flows   -> partitions/<run_id>/{flows,steps,step_flows}.parquet, trace_summary.json,
                        cross_check.json
    bin_flows        -> partitions/<run_id>/flows_100ms.parquet
    window_features  -> partitions/<run_id>/windows.parquet
    summarize_run    -> partitions/<run_id>/run_summary.parquet
    export_dataset   -> phantora_v0/{runs,flows_100ms,windows}.{csv,parquet}
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pandera.errors as pa_errors

from phantora_assets import schemas
from phantora_assets.lib import binning, chrome_trace, steps, trace_checks
from phantora_assets.lib import window_features as wf
from phantora_assets.lib.analytic import simulate
from phantora_assets.lib.checks_log import blocking_failures, read_checks, record_checks, reset_checks, run_passed
from phantora_assets.lib.cross_check import cross_check
from phantora_assets.lib.docker_config import config_files, layout_for, missing_listing
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.io import atomic_path, atomic_write_csv, atomic_write_text
from phantora_assets.lib.phantora_docker import PhantoraDockerError
from phantora_assets.lib.run_folder import trace_file
from phantora_assets.lib.run_log import RunLog, read_run_log
from phantora_assets.lib.tables import BIN_COLUMNS
from phantora_assets.lib.netconfig import dumps_netconfig, netconfig_for
from phantora_assets.lib.workloads import Compute, workload_model
from phantora_assets.paths import DataPaths
from phantora_assets.runs import RunSpec

WINDOW_S = 180.0
BIN_S = 0.1
CONTROL_BYTES_PER_S = 5000


@dataclass(frozen=True)
class Outcome:
    """One check outcome: ``passed``, a plain-words ``message`` and metadata values."""

    name: str
    passed: bool
    message: str
    metadata: dict[str, Any] = field(default_factory=dict)
    severity: str = "error"  # "warn" for advisory checks (never block the dataset)


@dataclass
class StageResult:
    """What a stage produced: output ``path``, ``metadata`` for the UI, check ``outcomes``."""

    path: Path | None
    metadata: dict[str, Any] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)


def _write_parquet(df: pd.DataFrame, path: Path, durable: bool = False) -> None:
    with atomic_path(path, durable) as tmp:
        df.to_parquet(tmp, index=False, engine="pyarrow", compression="zstd")


def _record(paths: DataPaths, spec: RunSpec, asset: str, outcomes: list[Outcome]) -> None:
    record_checks(paths.run_folder(spec), asset, [(o.name, o.passed, o.message, o.severity == "warn") for o in outcomes])


# --------------------------------------------------------------------------- simulation
_ANALYTIC_PERFDB = Outcome(
    "perfdb_complete", True,
    "not a perf-DB replay: the embedded analytic simulator times kernels with its roofline model",
    {"mode": "analytic"})


def _write_run_log_summary(paths: DataPaths, spec: RunSpec) -> RunLog:
    """Parse the run folder's run.log (if any) into partitions/<run_id>/run_log.json."""
    log_path = paths.run_folder(spec) / "run.log"
    parsed = read_run_log(log_path) if log_path.is_file() else RunLog()
    atomic_write_text(paths.partition_dir(spec.run_id) / "run_log.json",
                      json.dumps({"run_id": spec.run_id, "present": log_path.is_file(), **parsed.as_dict()},
                                 indent=1, sort_keys=True) + "\n")
    return parsed


def read_run_log_summary(paths: DataPaths, run_id: str) -> dict[str, Any] | None:
    p = paths.partition_dir(run_id) / "run_log.json"
    return json.loads(p.read_text()) if p.is_file() else None


def _fits_outcome(mem: dict[str, Any]) -> Outcome:
    """The ``fits_in_memory`` outcome of a memory estimate (``MemoryEstimate.as_dict()``)."""
    fits = bool(mem["fits"])
    words = "fits: estimated peak {p:.2f} GiB <= card {c:.2f} GiB" if fits else \
        "does not fit: estimated peak {p:.2f} GiB > card {c:.2f} GiB"
    return Outcome("fits_in_memory", fits, words.format(p=mem["peak_gib"], c=mem["card_gib"]),
                   {"peak_gib": mem["peak_gib"], "card_gib": mem["card_gib"]})


def simulate_run(spec: RunSpec, paths: DataPaths, perfdb_status: str = "unknown") -> StageResult:
    """Run the analytic simulator; write the raw timeline, ``run.log`` and ``config/``.

    A run that does not fit in GPU memory writes ``run.log`` with the estimate, no timeline,
    and a failed ``fits_in_memory`` outcome; it never raises for that.
    """
    folder = paths.run_folder(spec)
    reset_checks(folder, "raw_timeline")
    result = simulate(spec)
    mem = result.memory.as_dict()
    config = folder / "config"
    atomic_write_text(config / "netconfig.toml", dumps_netconfig(netconfig_for(spec)))
    atomic_write_text(config / "run.toml", "\n".join([
        f'run_id = "{spec.run_id}"', f'workload = "{spec.workload}"', f'gpu = "{spec.gpu}"',
        f"nodes = {spec.n_nodes}", f"gpus_per_node = {spec.gpus_per_node}", f'source = "{spec.source}"',
        f'parallelism = "{spec.parallelism}"', "",
    ]))
    log = [f"# analytic simulation of {spec.run_id} ({spec.framework} {spec.preset['model']}, {spec.parallelism})",
           f"# perf DB: {perfdb_status}",
           f"peak memory estimate: {mem['peak_gib']:.2f} GiB of {mem['card_gib']:.2f} GiB"]
    meta: dict[str, Any] = {"fits": result.fits, **{f"memory_{k}": v for k, v in mem.items() if k != "fits"}}
    if not result.fits:
        log.append(f"OUT OF MEMORY: estimated peak {mem['peak_gib']:.2f} GiB exceeds the card ({mem['card_gib']:.2f} GiB)")
        atomic_write_text(folder / "run.log", "\n".join(log) + "\n")
        outcomes = [_fits_outcome(mem), _ANALYTIC_PERFDB]
        _record(paths, spec, "raw_timeline", outcomes)
        return StageResult(None, {**meta, "status": "out_of_memory"}, outcomes)
    log.append(f"# compute per steady step (rank 0): {result.compute_ns_per_step / 1e6:.3f} ms, "
               f"{result.db_fraction:.1%} of it from the perf DB ({result.kernels_from_db}/{result.kernels_per_step} "
               f"intercepted calls found), the rest from the {spec.gpu} roofline")
    log.append(f"# exposed communication per steady step (rank 0): {result.exposed_comm_ns / 1e6:.3f} ms")
    for i, ns in enumerate(result.iteration_ns):
        log.append(f"iteration {i + 1:3d}/{len(result.iteration_ns)} | simulated time (ms): {ns / 1e6:.3f} "
                   f"| peak memory (GiB): {mem['peak_gib']:.2f}")
    out = paths.table(spec.run_id, "raw_timeline")
    _write_parquet(result.raw, out)
    sim = {"step_ms": round(result.step_ns / 1e6, 6), "compute_ms_per_step": round(result.compute_ns_per_step / 1e6, 6),
           "exposed_comm_ms_per_step": round(result.exposed_comm_ns / 1e6, 6),
           "perf_db_fraction": round(result.db_fraction, 6), "kernels_per_step": result.kernels_per_step,
           "kernels_from_perf_db": result.kernels_from_db}
    atomic_write_text(paths.partition_dir(spec.run_id) / "simulation.json", json.dumps(sim, indent=1, sort_keys=True) + "\n")
    atomic_write_text(folder / "run.log", "\n".join(log) + "\n")
    outcomes = [_fits_outcome(mem), _ANALYTIC_PERFDB]
    _record(paths, spec, "raw_timeline", outcomes)
    run_log = _write_run_log_summary(paths, spec)
    meta.update({"status": "simulated", "n_events": len(result.raw), "iterations": len(result.iteration_ns),
                 **sim, **run_log.metadata()})
    return StageResult(out, meta, outcomes)


def write_trace(spec: RunSpec, paths: DataPaths) -> StageResult:
    """Convert the raw timeline into ``timeline.json.gz`` (Phantora visualizer schema)."""
    raw = pd.read_parquet(paths.table(spec.run_id, "raw_timeline"))
    out = paths.chrome_trace(spec)
    stats = chrome_trace.write_chrome_trace(raw, out)
    return StageResult(out, {k: int(v) for k, v in stats.items()})


# --------------------------------------------------------------------------- external runs (import, Docker)
def _fits_from_log(spec: RunSpec, log: RunLog, log_present: bool, origin: str) -> Outcome:
    """fits_in_memory of a run timed by Phantora itself (its run.log is the evidence)."""
    card_gib = float(spec.gpu_spec["memory_gb"])  # PHANTORA_VRAM_MIB / 1024
    meta: dict[str, Any] = {"card_gib": card_gib, "peak_gib": log.peak_memory_gib}
    if log.out_of_memory:
        return Outcome("fits_in_memory", False,
                       f"does not fit: the {origin} run.log reports a CUDA out-of-memory error ({log.oom_line[:200]})",
                       meta)
    if log.peak_memory_gib is not None:
        ok = log.peak_memory_gib <= card_gib
        return Outcome("fits_in_memory", ok,
                       f"{'fits' if ok else 'does not fit'}: the {origin} run.log reports a peak of "
                       f"{log.peak_memory_gib:.2f} GiB {'<=' if ok else '>'} card {card_gib:.2f} GiB", meta)
    how = "its run.log reports no out-of-memory error" if log_present else "it has no run.log"
    return Outcome("fits_in_memory", True, f"fits: the {origin} run completed and {how} (peak memory not reported)",
                   meta)


def _perfdb_from_missing(missing: dict[str, int] | None, when_none: str) -> Outcome:
    """perfdb_complete from Phantora's ``<db>.missing/`` listing (None: no replay record)."""
    if missing is None:
        return Outcome("perfdb_complete", True, when_none, {"missing_entries": 0})
    n = int(sum(missing.values()))
    if n:
        files = ", ".join(f"{k} ({v})" for k, v in sorted(missing.items()))
        return Outcome("perfdb_complete", False,
                       f"the perf-DB replay met {n} kernel shape(s) missing from the database ({files}); Phantora "
                       "charged them zero time, so this run's timings are invalid: record them and simulate again",
                       {"missing_entries": n, "missing_files": json.dumps(missing)})
    return Outcome("perfdb_complete", True, "the perf-DB replay found every kernel shape in the database "
                   "(<db>.missing/ is empty)", {"missing_entries": 0})


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _copy_file(src: Path, dst: Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` to ``dst`` (same file system), else copy; atomic either way."""
    if dst.exists() and _same_path(src, dst):
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.link.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
        os.replace(tmp, dst)
    except OSError:
        tmp.unlink(missing_ok=True)
        _copy_file(src, dst)


def _replace_dir(src: Path | None, dst: Path) -> None:
    """Make ``dst`` a copy of directory ``src`` (or remove it when ``src`` is None)."""
    if src is not None and _same_path(src, dst):
        return
    tmp = dst.with_name(f".{dst.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if src is not None:
        shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    if src is not None:
        os.replace(tmp, dst)


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
        raise FileNotFoundError(f"{spec.run_id}: imported run folder {src} does not exist "
                                f"(registered in {paths.root / 'imports.toml'} or $PHANTORA_ASSETS_IMPORT_DIR)")
    copied: dict[str, int] = {}
    if not _same_path(src, folder):
        for name in ("run.log", "timeline.bin"):
            if (src / name).is_file():
                (_link_or_copy if name == "timeline.bin" else _copy_file)(src / name, folder / name)
                copied[name] = (src / name).stat().st_size
            else:
                (folder / name).unlink(missing_ok=True)
        for sub in ("config", "perfdb_missing"):
            _replace_dir(src / sub if (src / sub).is_dir() else None, folder / sub)
            if (src / sub).is_dir():
                copied[f"{sub}/"] = sum(1 for p in (src / sub).rglob("*") if p.is_file())
    trace = trace_file(src)
    log_present = (folder / "run.log").is_file()
    log = _write_run_log_summary(paths, spec)
    fits = _fits_from_log(spec, log, log_present, "imported")
    missing_dir = src / "perfdb_missing"
    perfdb = _perfdb_from_missing(missing_listing(missing_dir) if missing_dir.is_dir() else None,
                                  "imported run folder without a perf-DB replay record (no perfdb_missing/): "
                                  "nothing to check")
    outcomes = [fits, perfdb]
    _record(paths, spec, "raw_timeline", outcomes)
    if trace is None:
        paths.chrome_trace(spec).unlink(missing_ok=True)  # no stale trace of an earlier source
    if trace is None and fits.passed:
        raise TraceFormatError(src, "missing trace", "no timeline.json.gz or timeline.json, and run.log reports "
                               "no out-of-memory error")
    atomic_write_text(folder / "import.json", json.dumps(
        {"run_id": spec.run_id, "source": str(src), "trace": trace.name if trace else None, "copied": copied},
        indent=1, sort_keys=True) + "\n")
    meta = {"status": "imported" if fits.passed else "out_of_memory", "source_folder": str(src),
            "trace_file": trace.name if trace else None, "copied_files": len(copied), **log.metadata()}
    return StageResult(folder, meta, outcomes)


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"\x1f\x8b"


def _check_hosts(spec: RunSpec, parsed: chrome_trace.ParsedTrace, src: Path) -> None:
    nodes = [int(parsed.flows["src_node"].max()), int(parsed.flows["dst_node"].max())] if len(parsed.flows) else []
    nodes += [int(h.split("-", 1)[1]) - 1 for h in parsed.compute["host"]]
    if nodes and max(nodes) >= spec.n_nodes:
        raise TraceFormatError(src, "host outside the layout",
                               f"the trace has host-{max(nodes) + 1} but {spec.run_id} has {spec.n_nodes} hosts")


def install_trace(spec: RunSpec, paths: DataPaths, src: Path, origin: str) -> StageResult:
    """Put ``src`` (``.json`` or ``.json.gz``) at the run folder's ``timeline.json.gz``, atomically.

    The copy is parsed (:func:`chrome_trace.read_trace`) and its hosts checked against the
    layout before it replaces the destination, so a broken trace never becomes visible.

    Raises:
        TraceFormatError: naming ``src`` and the rule it breaks.
    """
    dst = paths.chrome_trace(spec)
    try:
        if dst.exists() and _same_path(src, dst):
            parsed = chrome_trace.read_trace(dst)
            _check_hosts(spec, parsed, src)
        else:
            with atomic_path(dst) as tmp:
                if _is_gzip(src):
                    shutil.copyfile(src, tmp)
                else:
                    with open(src, "rb") as fi, open(tmp, "wb") as fo, \
                            gzip.GzipFile(filename="", mode="wb", fileobj=fo, mtime=0) as gz:
                        shutil.copyfileobj(fi, gz, 1 << 20)
                parsed = chrome_trace.read_trace(tmp)
                _check_hosts(spec, parsed, src)
    except TraceFormatError as exc:
        if exc.path == str(src):
            raise
        raise TraceFormatError(src, exc.rule, exc.detail) from exc
    flows = parsed.flows
    net = flows["src_node"].to_numpy() != flows["dst_node"].to_numpy()
    meta = {"origin": origin, "n_events": int(parsed.n_events), "n_communication": int(len(flows)),
            "n_network_flows": int(net.sum()), "n_loopback_flows": int((~net).sum()),
            "n_communicators": int(flows["comm_id"].nunique()), "bytes_written": int(dst.stat().st_size)}
    return StageResult(dst, meta)


def import_trace(spec: RunSpec, paths: DataPaths) -> StageResult:
    """chrome_trace of an imported run: its folder's trace, validated and copied (gzip-compressed)."""
    src_dir = Path(spec.path)
    src = trace_file(src_dir)
    if src is None:
        raise TraceFormatError(src_dir, "missing trace", "no timeline.json.gz or timeline.json")
    return install_trace(spec, paths, src, f"imported from {src}")


def simulate_docker(spec: RunSpec, paths: DataPaths, runner, slots, settings, *, perfdb_source: Path | None,
                    log=lambda _m: None) -> StageResult:
    """raw_timeline of a ``docker`` run: Phantora in Docker (see ``lib/phantora_docker.py``).

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
    for name in ("hostfile", "deepspeed_env", "run.toml"):
        (layout.config_dir / name).unlink(missing_ok=True)
    for name, text in config_files(spec, settings, layout, replay).items():
        atomic_write_text(layout.config_dir / name, text)
    shutil.rmtree(layout.perfdb_root, ignore_errors=True)
    if replay:
        shutil.copytree(perfdb_source, layout.perfdb_dir)
    with slots.acquire(log):
        outcome = runner.simulate(spec, layout, replay)
    if outcome.run_log.is_file():
        _copy_file(outcome.run_log, folder / "run.log")
    if outcome.timeline is not None:
        _link_or_copy(outcome.timeline, folder / "timeline.bin")
    else:
        for stale in (folder / "timeline.bin", paths.chrome_trace(spec)):
            stale.unlink(missing_ok=True)
    missing = missing_listing(layout.missing_dir) if replay else None
    _replace_dir(layout.missing_dir if missing else None, folder / "perfdb_missing")
    log_present = (folder / "run.log").is_file()
    run_log = _write_run_log_summary(paths, spec)
    fits = _fits_from_log(spec, run_log, log_present, "Phantora")
    perfdb = _perfdb_from_missing(missing, "profiled on the local GPU (no perf-DB replay)")
    outcomes = [fits, perfdb]
    _record(paths, spec, "raw_timeline", outcomes)
    if fits.passed and (outcome.exit_code != 0 or outcome.timeline is None):
        tail = "\n".join((folder / "run.log").read_text(errors="replace").splitlines()[-15:]) if log_present else ""
        why = f"exited with status {outcome.exit_code}" if outcome.exit_code != 0 else "left no timeline.bin"
        raise PhantoraDockerError(f"{spec.run_id}: the training command {why}; last lines of run.log:\n{tail}")
    meta = {"status": "simulated" if fits.passed else "out_of_memory", "mode": "replay" if replay else "profile",
            "exit_code": int(outcome.exit_code), "wall_s": round(outcome.seconds, 1),
            "timeline_bin_bytes": int(outcome.timeline.stat().st_size) if outcome.timeline else 0,
            **run_log.metadata()}
    return StageResult(folder / "timeline.bin" if outcome.timeline else folder, meta, outcomes)


def docker_trace(spec: RunSpec, paths: DataPaths, runner) -> StageResult:
    """chrome_trace of a ``docker`` run: ``phantora_visualizer`` in the image, then gzip + validate."""
    folder = paths.run_folder(spec)
    layout = layout_for(spec, paths.root, folder)
    work_bin = layout.out_dir / "timeline.bin"
    if not work_bin.is_file() and (folder / "timeline.bin").is_file():
        _link_or_copy(folder / "timeline.bin", work_bin)
    json_path = runner.visualize(spec, layout)
    try:
        return install_trace(spec, paths, json_path, "phantora_visualizer (patches/visualizer.patch)")
    finally:
        json_path.unlink(missing_ok=True)


# --------------------------------------------------------------------------- flows
def _outcome(o: trace_checks.CheckOutcome, trace: Path | None = None) -> Outcome:
    """A trace rule's outcome; a failed one's message starts with the trace file."""
    meta = {f"observed_{k}": v for k, v in o.observed.items()}
    meta.update({f"expected_{k}": v for k, v in o.expected.items()})
    message = o.message if o.passed or trace is None else f"{trace}: {o.message}"
    return Outcome(o.name, bool(o.passed), message, _jsonable(meta))


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, (np.integer,)):
            v = int(v)
        elif isinstance(v, (np.floating,)):
            v = float(v)
        elif not isinstance(v, (int, float, str, bool)) and v is not None:
            v = json.dumps(v, default=str)[:2000]
        out[k] = v
    return out


def validate_flows(spec: RunSpec, paths: DataPaths, trace_path: Path | None = None) -> StageResult:
    """Parse the Chrome JSON, detect steps, run the four trace rules.

    Writes ``flows.parquet`` (network flows, src_node != dst_node, with ``step``),
    ``steps.parquet``, ``step_flows.parquet`` (the chosen steady step's network flows, the
    input of the build), ``compute_events.parquet`` (host, ts_us, dur_us of every Computation
    event: the step anatomy's input) and ``trace_summary.json`` -- only when every trace rule holds. A
    broken trace rule (e.g. no network flow, two group sizes on one communicator) is a failed
    blocking check whose message names the trace file; nothing is written then (files of an
    earlier materialization stay as they were) and nothing downstream runs.

    Raises:
        TraceFormatError / StepDetectionError: the trace breaks a format rule (names the file
            and the rule); nothing is written.
    """
    reset_checks(paths.run_folder(spec), "validated_flows")
    src = trace_path or paths.chrome_trace(spec)
    parsed = chrome_trace.read_trace(src, compute_events=True)
    flows = parsed.flows
    exists = trace_checks.flows_exist(flows)
    if not exists.passed:  # nothing to detect steps on: report the rule, evaluate no other
        outcomes = [_outcome(exists, src)] + [
            Outcome(name, False, f"{src}: not evaluated: the trace has no network flow")
            for name in ("steps_match", "ring_bytes_match", "steady_steps_stable")]
        outcomes.append(_not_cross_checked("the trace has no network flow"))
        _record(paths, spec, "validated_flows", outcomes)
        return StageResult(None, {"status": "failed checks", "n_flows": int(len(flows))}, outcomes)
    result = steps.detect_steps(flows, source=str(src))
    outcomes = [_outcome(o, src) for o in trace_checks.run_trace_checks(flows, result)]
    if not all(o.passed for o in outcomes):
        outcomes.append(_not_cross_checked("a trace rule failed"))
        _record(paths, spec, "validated_flows", outcomes)
        return StageResult(None, {"status": "failed checks", "n_flows": int(len(flows))}, outcomes)
    outcomes.append(_cross_check_outcome(spec, paths, result))

    net = result.flows[result.flows["src_node"] != result.flows["dst_node"]].reset_index(drop=True)
    steady = result.steps[result.steps["steady"]]
    timed = steady[steady["step"].isin(getattr(result, "timed_steps", steady["step"]))]
    chosen = int(timed.iloc[(timed["duration_us"] - result.step_time_us).abs().argsort(kind="stable").iloc[0]]["step"])
    step_flows = result.step_flows(chosen, network_only=True)
    pdir = paths.partition_dir(spec.run_id)
    _write_parquet(net, pdir / "flows.parquet")
    _write_parquet(result.steps, pdir / "steps.parquet")
    _write_parquet(step_flows, pdir / "step_flows.parquet")
    _write_parquet(parsed.compute_events, pdir / "compute_events.parquet")
    summary = {
        "run_id": spec.run_id,
        "trace": str(src.name),
        "step_time_us": float(result.step_time_us),
        "network_bytes_per_step": int(result.network_bytes_per_step),
        "n_steady_steps": len(result.steady_steps),
        "chosen_step": chosen,
        "n_flows": int(len(flows)),
        "n_network_flows": int(len(net)),
        "periods": {k: int(v) for k, v in result.periods.items()},
        "compute_busy_us": {r.host: float(r.busy_us) for r in parsed.compute.itertuples()},
    }
    atomic_write_text(pdir / "trace_summary.json", json.dumps(summary, indent=1, sort_keys=True) + "\n")
    _record(paths, spec, "validated_flows", outcomes)
    meta = {
        "step_time_ms": round(result.step_time_us / 1000, 3),
        "network_bytes_per_step": int(result.network_bytes_per_step),
        "n_steady_steps": len(result.steady_steps),
        "n_network_flows": int(len(net)),
        "n_communicators": int(flows["comm_id"].nunique()),
    }
    return StageResult(pdir / "flows.parquet", meta, outcomes)


def _not_cross_checked(why: str) -> Outcome:
    return Outcome("matches_workload_model", False, f"not evaluated: {why}", severity="warn")


def _cross_check_outcome(spec: RunSpec, paths: DataPaths, result: steps.StepResult) -> Outcome:
    """Advisory ``matches_workload_model`` (lib/cross_check.py); writes cross_check.json."""
    name = "matches_workload_model"
    try:
        cc = cross_check(spec, result.flows, list(result.steady_steps))
    except Exception as exc:  # the check is advisory: report, never fail the asset
        return Outcome(name, False, f"cross-check against the workload model could not run: {exc}",
                       severity="warn")
    atomic_write_text(paths.partition_dir(spec.run_id) / "cross_check.json",
                      json.dumps(cc.as_dict(), indent=1, sort_keys=True) + "\n")
    meta = _jsonable(cc.metadata())
    meta["breakdown_md"] = cc.markdown()
    return Outcome(name, cc.passed, cc.message, meta, severity="warn")


def read_trace_summary(paths: DataPaths, run_id: str) -> dict[str, Any]:
    return json.loads((paths.partition_dir(run_id) / "trace_summary.json").read_text())


# --------------------------------------------------------------------------- bins
def bin_flows(spec: RunSpec, paths: DataPaths) -> StageResult:
    """The 180 s / 100 ms build of DATASET.md section 4; checks exact conservation."""
    reset_checks(paths.run_folder(spec), "binned_flows")
    summary = read_trace_summary(paths, spec.run_id)
    step_flows = pd.read_parquet(paths.table(spec.run_id, "step_flows"))
    built = binning.build_bins(
        step_flows, step_time_s=summary["step_time_us"] / 1e6, n_nodes=spec.n_nodes, run_id=spec.run_id,
        window_s=WINDOW_S, bin_s=BIN_S, control_bytes_per_s=CONTROL_BYTES_PER_S,
    )
    bins = built.bins
    total = int(bins["bytes"].sum())
    expected = int(built.placed_flow_bytes + built.control_bytes)
    ok = total == expected
    outcome = Outcome(
        "bins_conserve_bytes", ok,
        (f"sum of flows_100ms bytes {total} equals placed flow bytes {built.placed_flow_bytes} + control bytes "
         f"{built.control_bytes}" if ok else
         f"sum of flows_100ms bytes {total} differs from placed {built.placed_flow_bytes} + control "
         f"{built.control_bytes} = {expected} by {total - expected}"),
        {"binned_bytes": total, "placed_flow_bytes": int(built.placed_flow_bytes),
         "control_bytes": int(built.control_bytes)},
    )
    out = paths.table(spec.run_id, "flows_100ms")
    if ok:  # a failed blocking check writes no data file
        _write_parquet(bins, out)
    _record(paths, spec, "binned_flows", [outcome])
    meta = {"rows": len(bins), "bytes": total, "n_repetitions": int(built.n_repetitions),
            "phase_s": float(built.phase_s), "seed": int(built.seed)}
    return StageResult(out if ok else None, meta, [outcome])


def window_features(spec: RunSpec, paths: DataPaths) -> StageResult:
    """Detector features per 1 s and 15 s window, validated by the windows.csv schema."""
    reset_checks(paths.run_folder(spec), "window_features")
    bins = pd.read_parquet(paths.table(spec.run_id, "flows_100ms"))
    feats = wf.compute_window_features(bins, run_id=spec.run_id, bin_s=BIN_S, window_s=WINDOW_S)
    outcome = _contract_outcome("windows_contract", schemas.windows_schema(), feats)
    out = paths.table(spec.run_id, "windows")
    if outcome.passed:  # a failed blocking check writes no data file
        _write_parquet(feats, out)
    _record(paths, spec, "window_features", [outcome])
    return StageResult(out if outcome.passed else None, {"rows": len(feats)}, [outcome])


def _contract_outcome(name: str, schema, df: pd.DataFrame) -> Outcome:
    try:
        schema.validate(df, lazy=True)
    except pa_errors.SchemaErrors as exc:
        cases = exc.failure_cases
        head = "; ".join(f"{r.column}: {r.check}" for r in cases.head(5).itertuples())
        return Outcome(name, False, f"{len(cases)} violation(s) of the {schema.name} contract: {head}",
                       {"violations": int(len(cases))})
    return Outcome(name, True, f"{len(df)} rows satisfy the {schema.name} contract", {"rows": int(len(df))})


# --------------------------------------------------------------------------- summary
def model_flops_per_step(spec: RunSpec) -> float:
    """FLOP of one step summed over all ranks (the GEMMs of the analytic model's compute items)."""
    model = workload_model(spec)
    per_rank = sum(i.flops for i in model.step_program() if isinstance(i, Compute) and i.phase != "opt")
    return per_rank * spec.world_size


def summarize_run(spec: RunSpec, paths: DataPaths, source: str | None = None) -> StageResult:
    """The run's ``runs.csv`` row, validated by the runs.csv contract."""
    reset_checks(paths.run_folder(spec), "run_summary")
    summary = read_trace_summary(paths, spec.run_id)
    step_time_s = summary["step_time_us"] / 1e6
    gpu = spec.gpu_spec
    sim_file = paths.partition_dir(spec.run_id) / "simulation.json"
    sim = json.loads(sim_file.read_text()) if sim_file.exists() and spec.source == "analytic" else {}
    analytic = spec.source == "analytic"
    flops = model_flops_per_step(spec) if analytic else None
    from phantora_assets.lib.memory import estimate_memory
    row = {
        "run_id": spec.run_id,
        "source": source or ("phantora_analytic" if analytic else "phantora_v0"),
        "layout": spec.layout,
        "n_nodes": spec.n_nodes,
        "step_time_s": step_time_s,
        "inter_node_bytes_per_step": int(summary["network_bytes_per_step"]),
        "nic_bw": spec.cluster["host_bw_gbps"] * 1e9 / 8,
        "flops_per_step": flops,
        "mfu": (flops / (step_time_s * spec.world_size * gpu["peak_bf16_flops"])) if analytic else None,
        "peak_flops": gpu["peak_bf16_flops"] if analytic else None,
        "alpha": gpu["matmul_efficiency"] if analytic else None,
        "workload": spec.workload,
        "framework": {"megatron": "Megatron", "deepspeed": "DeepSpeed"}.get(spec.framework, spec.framework),
        "model": spec.preset["model"],
        "parallelism": spec.parallelism,
        "gpu": spec.gpu,
        "gpus_per_node": spec.gpus_per_node,
        "world_size": spec.world_size,
        "simulator": spec.source,
        "n_steady_steps": int(summary["n_steady_steps"]),
        "peak_memory_gib": (estimate_memory(workload_model(spec)).as_dict()["peak_gib"] if analytic
                            else (read_run_log_summary(paths, spec.run_id) or {}).get("peak_memory_gib")),
        "perf_db_fraction": sim.get("perf_db_fraction"),
        "exposed_comm_s": (sim["exposed_comm_ms_per_step"] / 1e3) if "exposed_comm_ms_per_step" in sim else None,
        "window_s": WINDOW_S,
        "bin_s": BIN_S,
        "seed": binning.seed_from_run_id(spec.run_id),
    }
    df = runs_frame([row])
    outcome = _contract_outcome("runs_contract", schemas.RUNS, df)
    out = paths.table(spec.run_id, "run_summary")
    if outcome.passed:  # a failed blocking check writes no data file
        _write_parquet(df, out)
    _record(paths, spec, "run_summary", [outcome])
    meta = {"step_time_ms": round(step_time_s * 1000, 3), "inter_node_gb_per_step": round(row["inter_node_bytes_per_step"] / 1e9, 4)}
    return StageResult(out if outcome.passed else None, meta, [outcome])


def runs_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """runs.csv rows as a DataFrame with the contract's column order and dtypes."""
    cols = list(schemas.RUNS.columns)
    df = pd.DataFrame(rows, columns=cols)
    for c, col in schemas.RUNS.columns.items():
        if str(col.dtype) == "int64":
            df[c] = df[c].astype("int64")
        elif str(col.dtype) == "float64":
            df[c] = df[c].astype("float64")
    return df


# --------------------------------------------------------------------------- dataset
@dataclass
class DatasetResult:
    dir: Path
    included: list[str]
    excluded: dict[str, str]
    outcome: Outcome


def export_dataset(specs: list[RunSpec], paths: DataPaths) -> DatasetResult:
    """Assemble ``phantora_v0/`` from every run whose checks all passed.

    Writes runs.csv, flows_100ms.csv, windows.csv and a Parquet copy of each, atomically;
    validates the three tables with the v1 pandera contract first (nothing is written if a
    table breaks it). Rows are sorted, so a rebuild is byte-identical.
    """
    included, excluded = [], {}
    runs, bins, wins = [], [], []
    for spec in sorted(specs, key=lambda s: s.run_id):
        folder = paths.run_folder(spec)
        if not run_passed(folder):
            if not read_checks(folder):
                excluded[spec.run_id] = "not built"
                continue
            excluded[spec.run_id] = ", ".join(f"{k}: {v.get('status', 'missing')}"
                                              for k, v in blocking_failures(folder).items())
            continue
        included.append(spec.run_id)
        runs.append(pd.read_parquet(paths.table(spec.run_id, "run_summary")))
        b = pd.read_parquet(paths.table(spec.run_id, "flows_100ms"))
        bins.append(b)
        wins.append(pd.read_parquet(paths.table(spec.run_id, "windows")))
    runs_df = runs_frame([]) if not runs else pd.concat(runs, ignore_index=True)
    bins_df = pd.concat(bins, ignore_index=True) if bins else pd.DataFrame(
        {c: pd.Series([], dtype=object if t == "str" else t) for c, t in BIN_COLUMNS.items()})
    wins_df = pd.concat(wins, ignore_index=True) if wins else None
    outcomes = [
        _contract_outcome("runs", schemas.RUNS, runs_df),
        _contract_outcome("flows_100ms", schemas.FLOWS_100MS, bins_df),
    ]
    if wins_df is not None:
        outcomes.append(_contract_outcome("windows", schemas.windows_schema(), wins_df))
    ok = all(o.passed for o in outcomes)
    msg = "; ".join(o.message for o in outcomes)
    outcome = Outcome("dataset_contract", ok, msg, {"runs": len(included), "excluded": len(excluded)})
    d = paths.dataset_dir
    if ok:
        tables = {"runs": runs_df, "flows_100ms": bins_df}
        if wins_df is not None:
            tables["windows"] = wins_df
        for name, df in tables.items():
            atomic_write_csv(df, d / f"{name}.csv", durable=True)
            _write_parquet(df, d / f"{name}.parquet", durable=True)
        listing = ["run_id,status,reason"] + [f"{r},included," for r in included] + \
                  [f'{r},excluded,"{why}"' for r, why in excluded.items()]
        atomic_write_text(d / "run_status.csv", "\n".join(listing) + "\n", durable=True)
    return DatasetResult(d, included, excluded, outcome)
