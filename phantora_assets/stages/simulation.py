"""Stages of group ``simulation``: the perf DB of each GPU and the raw timeline of each run
(no Dagster import).

    perf_db      -> <root>/perfdb/<gpu>/perf_db.json (the validated perf DB summary)
    raw_timeline -> whatever the run's source writes (``sources/``), and run_log.json

:func:`memory_verdict` reads back what ``raw_timeline`` recorded about GPU memory (a run that does
not fit is an outcome: the assets from ``chrome_trace`` on do not apply to it).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phantora_assets import contracts
from phantora_assets.checks import FITS_IN_MEMORY, invalidate_checks, read_checks
from phantora_assets.lib.bins.width import DEFAULT_BIN_S
from phantora_assets.lib.net.fabric import FILE_KEYS, network_files
from phantora_assets.lib.phantora.perfdb import load_perfdb, perfdb_folder
from phantora_assets.lib.run.catalog import gpu_specs
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.store.io import remove_output, same_path
from phantora_assets.lib.workload.collectives import EVERY_RANK
from phantora_assets.outcomes import StageResult
from phantora_assets.paths import DataPaths
from phantora_assets.records import (
    PerfDbRecord,
    RecordError,
    RunLogRecord,
    RunSpecRecord,
    SimulationRecord,
    read_record_or_none,
    write_record,
)
from phantora_assets.sources import get_source
from phantora_assets.sources.base import SourceContext


def perf_db(gpu: str, paths: DataPaths) -> tuple[PerfDbRecord, bool]:
    """Validate the perf DB of ``gpu`` (``perfdb/<gpu>/``, or ``$PHANTORA_ASSETS_PERFDB_DIR``) and
    write its summary ``perf_db.json``. Returns ``(record, present)``; a GPU without a database
    gives status ``absent`` (its runs are timed by the roofline model only).

    Raises:
        PerfDBError: a row or the manifest breaks the format (names the file and the rule).
        pandera.errors.SchemaError: a table breaks ``contracts.PERFDB_COMPUTE`` / ``PERFDB_MEMCPY``.
    """
    spec = gpu_specs()[gpu]
    folder = perfdb_folder(gpu, spec)
    try:
        db = load_perfdb(folder, expected_gpu_name=spec["name"])
    except FileNotFoundError:
        rec = PerfDbRecord(
            gpu=gpu,
            status="absent",
            message=f"no performance database for {gpu} (perfdb/{gpu}/ is missing): runs on this "
            "GPU are timed by the roofline model only",
        )
        present = False
    else:
        contracts.PERFDB_COMPUTE.validate(db.compute)
        contracts.PERFDB_MEMCPY.validate(db.memcpy)
        rec = PerfDbRecord(
            gpu=gpu,
            status="present",
            gpu_name=db.gpu_name,
            compute_entries=db.counts["compute"],
            memcpy_entries=db.counts["memcpy"],
            ops=int(db.compute["op"].nunique()),
        )
        present = True
    write_record(paths.perfdb_summary(gpu), rec)
    return rec, present


def perfdb_status(spec: RunSpec, paths: DataPaths) -> str:
    """``present`` / ``absent`` from the GPU's ``perf_db.json``, or ``not materialized``."""
    rec = read_record_or_none(paths.perfdb_summary(spec.gpu), PerfDbRecord)
    return rec.status if rec is not None else "not materialized"


def raw_timeline(spec: RunSpec, paths: DataPaths, ctx: SourceContext) -> StageResult:
    """The run's raw timeline, by its source (``sources.REGISTRY[spec.source]``); ``ctx`` gets the
    GPU's perf DB status filled in. Then ``run_spec.json`` (:func:`run_spec_record`): what the run
    was built from, which the dataset export checks.

    A run whose dense per-pair bin table would exceed ``bin_table.max_dense_cells`` is not refused here:
    its bins are built and stored sparse (``bin_table.is_sparse``), and their bound
    (``bin_table.sparse_rows_rule``: bins x the node pairs that carry flows) is checked by ``binned_flows``
    from the step's flows, before any bin is built (the pairs that carry flows are known only then).

    Raises:
        FileNotFoundError, FileRuleError, TraceFormatError: the source's ``check_inputs`` refused its
            folder (``sources/base.py``), before anything of the run was invalidated.
    """
    ctx = SourceContext(perfdb_status=perfdb_status(spec, paths), docker=ctx.docker, log=ctx.log)
    spec_file = paths.partition_dir(spec.run_id) / "run_spec.json"
    now = run_spec_record(spec)
    try:
        before = read_record_or_none(spec_file, RunSpecRecord)
    except RecordError:
        before = None
    source = get_source(spec.source)
    if (check_inputs := getattr(source, "check_inputs", None)) is not None:
        check_inputs(spec, paths)  # a folder that cannot be built from changes nothing of the run
    if before is None or not same_inputs(spec, before, now):
        invalidate_downstream(spec, paths, before)
    spec_file.unlink(missing_ok=True)
    result = source.raw_timeline(spec, paths, ctx)
    write_record(spec_file, now)
    result.metadata.update(workload_metadata(spec))
    return result


def workload_metadata(spec: RunSpec) -> dict[str, Any]:
    """What the UI shows of a run's workload (its partition's materialization metadata): model,
    framework, parallelism and sizes, batch; {} for a profiled run (no workload)."""
    if not spec.workload:
        return {}
    wl, par = spec.wl, spec.par
    m, t = wl.model, wl.train
    batch = t.global_batch if t.global_batch is not None else t.micro_batch * par.dp * par.micro_batches
    return {
        "workload": spec.workload,
        "model": f"{spec.model_name} ({m.kind}, {m.layers} layers, hidden {m.hidden})",
        "framework": wl.framework,
        "parallelism": spec.parallelism,
        "tp_pp_dp_cp_ep": f"{par.tp} x {par.pp} x {par.dp} x {par.cp} (ep {par.ep})",
        "pp_schedule": par.pp_schedule,
        "zero": par.zero,
        "batch": f"global {batch} = micro {t.micro_batch} x dp {par.dp} x {par.micro_batches} micro-batches",
        "seq_len": t.seq_len,
        "recompute": t.recompute,
    }


#: What ``raw_timeline`` itself writes in ``partitions/<run_id>/`` (every source rewrites these).
RAW_TIMELINE_FILES = frozenset(
    {"raw_timeline.parquet", "simulation.json", "run_log.json", "run_spec.json", "kineto.json", "chakra.json"}
)


def invalidate_downstream(spec: RunSpec, paths: DataPaths, before: RunSpecRecord | None) -> None:
    """Before ``raw_timeline`` rebuilds a run from other inputs than its files were built from
    (``before``: the ``run_spec.json`` it had, None when absent or unreadable): remove what the
    assets below it wrote (the partition's other tables and records, the run folder's
    ``timeline.json.gz`` and ``plots/``, unless that trace is the run's only copy of its source) and
    mark their checks in ``checks.json`` as not evaluated.
    Without this, rematerializing ``raw_timeline`` alone would leave the old flows, windows and
    run summary beside a current ``run_spec.json``, and the dataset would export them as current.
    """
    pdir, folder = paths.partition_dir(spec.run_id), paths.run_folder(spec)
    if pdir.is_dir():
        for f in pdir.iterdir():
            if f.name not in RAW_TIMELINE_FILES and (f.is_file() or f.is_symlink()):
                f.unlink(missing_ok=True)
    # the data root's timeline.json.gz is the run's only trace when the folder is registered in
    # place (the data root's own run folder is the imported one: its plots/ came with it too) or
    # when the registered folder is gone (the import builds from the data root's copy): kept
    if not (spec.path and (same_path(Path(spec.path), folder) or not Path(spec.path).is_dir())):
        paths.chrome_trace(spec).unlink(missing_ok=True)
        remove_output(paths.plots_dir(spec))  # renamed away first: never a partial plots/
    why = "built without a run_spec.json" if before is None else "built from other inputs"
    invalidate_checks(
        folder,
        ("raw_timeline", "perf_db"),
        f"raw_timeline was rebuilt (the run's files were {why} than the run matrix now gives); "
        "materialize this asset again",
    )


@dataclass(frozen=True)
class MemoryVerdict:
    """What ``raw_timeline`` recorded about the run's GPU memory.

    Attributes:
        fits: ``fits_in_memory`` is recorded as passed.
        peak_gib: peak memory per GPU, GiB: the analytic estimate, or the peak Phantora's run.log
            reports (None when it reports none, e.g. a bare CUDA out-of-memory error).
        card_gib: memory of the simulated card, GiB.
        message: the check's plain-words outcome, as recorded in ``checks.json``.
    """

    fits: bool
    peak_gib: float | None
    card_gib: float
    message: str

    def words(self, run_id: str) -> str:
        """``<run_id> does not fit in GPU memory (49.70 GiB > 46.00 GiB)`` (or ``fits ... (16.55 GiB
        <= 46.00 GiB)``); when the numbers are not what decided (no reported peak, or a CUDA
        out-of-memory error below the card), the recorded reason instead of them."""
        verb = "fits" if self.fits else "does not fit"
        if self.peak_gib is None or (self.peak_gib <= self.card_gib) != self.fits:
            why = self.message.removeprefix(f"{verb}: ")
            return f"{run_id} {verb} in GPU memory ({why})"
        sign = "<=" if self.fits else ">"
        return f"{run_id} {verb} in GPU memory ({self.peak_gib:.2f} GiB {sign} {self.card_gib:.2f} GiB)"


def memory_verdict(spec: RunSpec, paths: DataPaths) -> MemoryVerdict | None:
    """The ``fits_in_memory`` outcome ``raw_timeline`` recorded in the run folder, with its
    numbers: the analytic memory estimate (``lib/sim/memory.py``, what the analytic source
    compared) or the run's ``run_log.json`` peak (Phantora sources). None when the check was not
    evaluated (``raw_timeline`` not materialized, or it stopped before recording).

    Raises:
        RecordError: ``checks.json`` or ``run_log.json`` is malformed (names the file).
    """
    rec = read_checks(paths.run_folder(spec)).get(FITS_IN_MEMORY)
    if rec is None or rec["status"] not in ("passed", "failed"):
        return None
    peak: float | None
    card = float(spec.gpu_spec.get("memory_gb", "nan"))  # nan: a profiled run simulates no card
    if spec.source == "analytic":
        from phantora_assets.lib.sim.memory import estimate_memory
        from phantora_assets.lib.sim.workloads import workload_model

        mem = estimate_memory(workload_model(spec)).as_dict()
        peak, card = float(mem["peak_gib"]), float(mem["card_gib"])
    else:
        log = read_record_or_none(paths.partition_dir(spec.run_id) / "run_log.json", RunLogRecord)
        peak = log.peak_memory_gib if log is not None else None
    return MemoryVerdict(rec["status"] == "passed", peak, card, str(rec.get("message", "")))


def run_spec_record(spec: RunSpec) -> RunSpecRecord:
    """What ``spec``'s outputs depend on, and a sha256 fingerprint of it: the run-matrix entry (layout,
    source, topology, import path, a bin width other than 0.1 s), the workload preset, the GPU's ``gpus.toml``
    entry, the effective network settings, the sha256 of the GPU's perf DB files and of every file the
    network reads (``fabric_file``: ``lib/net/fabric.network_files``; so editing it in place makes the run
    stale), and a registered folder's source files (:func:`source_files`). A file the topology names is
    written as its path relative to the run-matrix file's folder (:func:`portable_files`; its bytes are in
    the sha256): the record holds no path of this machine, and a data root moved with its matrix to
    another machine or folder stays current."""
    folder = perfdb_folder(spec.gpu, spec.gpu_spec)
    perfdb = {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.glob("*.csv")) + sorted(folder.glob("manifest.md"))
        if f.is_file() and spec.gpu  # a profiled run (gpu "") replays no perf DB
    }
    inputs: dict[str, Any] = {
        "entry": {
            "workload": spec.workload,
            "gpu": spec.gpu,
            "nodes": spec.n_nodes,
            "gpus_per_node": spec.gpus_per_node,
            "source": spec.source,
            "path": spec.path,
            "topology": numbers_by_value(portable_files(dict(spec.topology), spec.matrix_dir)),
            **({"name": spec.name} if spec.name else {}),
            **({"rank": spec.rank} if spec.rank is not None else {}),
            **({"bin_s": spec.bin_s} if spec.bin_s != DEFAULT_BIN_S else {}),  # v1's width: as before it was a setting
            **({"ep": spec.ep_size} if spec.ep_size is not None else {}),
            **({"reconfig": dict(spec.reconfig)} if spec.reconfig else {}),  # optical rails: docs/FABRIC.md
        },
        "workload": spec.preset,
        "gpu": spec.gpu_spec,
        "network": numbers_by_value(portable_files(spec.cluster, spec.matrix_dir)),
        "perf_db": perfdb,
    }
    for key, name in network_files(spec.cluster).items():  # by content: an edit in place makes the run stale
        inputs[key] = file_digest(Path(name))
    input_files = getattr(get_source(spec.source), "input_files", None)
    if input_files is not None and spec.path:
        inputs["source_files"] = source_files(Path(spec.path), input_files)
    text = json.dumps(inputs, sort_keys=True, default=str)
    return RunSpecRecord(
        run_id=spec.run_id, fingerprint=hashlib.sha256(text.encode()).hexdigest()[:16], inputs=json.loads(text)
    )


def portable_files(settings: dict[str, Any], matrix_dir: str) -> dict[str, Any]:
    """``settings`` with every file a topology names (``lib/net/fabric.FILE_KEYS``) written relative to
    ``matrix_dir``, the run-matrix file's folder, with ``/`` separators (``fabrics/two.toml``; an
    absolute path written in the matrix becomes ``../..``-relative to it), so what ``run_spec.json``
    records and fingerprints does not depend on where the matrix and its files live; a RunSpec built in
    code (``matrix_dir`` "") keeps the path as given. The file's identity is its sha256
    (:func:`run_spec_record`), not its path."""
    if not matrix_dir:
        return settings
    out = dict(settings)
    for key in FILE_KEYS:
        v = out.get(key)
        if isinstance(v, str) and v:
            try:
                out[key] = Path(os.path.relpath(v, matrix_dir)).as_posix()
            except ValueError:  # another drive (Windows): no relative path, the name alone
                out[key] = Path(v).name
    return out


def numbers_by_value(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with every integral float written as its int (``2.0`` -> ``2``; booleans, ints, other
    floats and non-numbers as they are): a run's network settings are fingerprinted by value, so
    ``oversubscription = 2`` and ``= 2.0``, the same network (``lib/net/fabric`` reads a number key as
    ``float``; an integer key refuses a float), are the same run (issue 39 item 18: the one written
    differently from its build was stale). The shipped settings are ints: their fingerprints are unchanged."""
    return {k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in settings.items()}


def file_digest(path: Path) -> str:
    """``sha256:<hex>`` of a file's bytes, or ``unreadable: <why>`` (a fingerprint that matches no build, so
    the run is stale and its rebuild names the file)."""
    try:
        return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        return f"unreadable: {e.strerror or e}"


def source_files(folder: Path, input_files: Callable[[Path], Iterable[str]]) -> dict[str, list[int]]:
    """``name -> [size, mtime_ns]`` of the files a registered folder's build reads
    (``input_files(folder)``, the source's: the trace, run.log and timeline.bin of a Phantora run
    folder, the traces and ``import.toml`` of a profiled one), as ``lstat`` gives them (a stat, no
    read: the import_dir sensor asks every tick); an absent file is left out. A folder whose files
    were replaced (a new trace moved in or written over) is then built from other inputs: stale,
    rebuilt, and out of the dataset until it is."""
    out: dict[str, list[int]] = {}
    try:
        names = list(input_files(folder))
    except OSError:  # the folder is gone: nothing to stat (stale_reason then keeps the build)
        return out
    for name in names:
        try:
            st = os.lstat(folder / name)
        except OSError:
            continue
        out[name] = [st.st_size, st.st_mtime_ns]
    return out


def stale_reason(spec: RunSpec, paths: DataPaths) -> str | None:
    """Why the run's files were built from something else than ``spec`` now describes (the
    parts of :func:`run_spec_record` that differ), or None when they match.

    Raises:
        RecordError: ``run_spec.json`` is malformed (names the file).
    """
    rec = read_record_or_none(paths.partition_dir(spec.run_id) / "run_spec.json", RunSpecRecord)
    if rec is None:
        return "stale: built without a run_spec.json (by an older version); rebuild the run"
    now = run_spec_record(spec)
    if same_inputs(spec, rec, now):
        return None
    changed = sorted(k for k in now.inputs if rec.inputs.get(k) != now.inputs[k])
    return f"stale: built from another {', '.join(changed) or 'input'} than the run matrix now gives; rebuild the run"


def same_inputs(spec: RunSpec, before: RunSpecRecord, now: RunSpecRecord) -> bool:
    """Whether a run built from ``before`` is built from what ``now`` describes: the same
    fingerprint, or only the source files differ because the imported folder is gone since (what
    the data root copied is what was built, and the import builds from that copy:
    ``sources/phantora_import.source_folder``)."""
    if before.fingerprint == now.fingerprint:
        return True
    changed = sorted(k for k in now.inputs if before.inputs.get(k) != now.inputs[k])
    return changed == ["source_files"] and bool(spec.path) and not Path(spec.path).is_dir()


def build_reason(spec: RunSpec, paths: DataPaths) -> str | None:
    """Why partition ``spec`` needs a (re)build: ``missing`` (never simulated, or its last build
    stopped before the run summary although the run fits), ``stale: ...`` (:func:`stale_reason`),
    or None when its files are complete and current. A run that does not fit in GPU memory is
    complete once its simulation recorded that (``fits_in_memory`` failed in ``checks.json``).

    Raises:
        RecordError: ``run_spec.json`` or ``checks.json`` is malformed (names the file).
    """
    if not (paths.partition_dir(spec.run_id) / "run_spec.json").is_file():
        return "missing"
    stale = stale_reason(spec, paths)
    if stale:
        return stale
    fits = read_checks(paths.run_folder(spec)).get(FITS_IN_MEMORY, {}).get("status")
    if fits == "failed":
        return None
    if not (paths.partition_dir(spec.run_id) / "run_summary.parquet").is_file():
        return "missing"
    return None


def build_reason_or_record_error(spec: RunSpec, paths: DataPaths) -> str | None:
    """:func:`build_reason`, with an unreadable record a reason to rebuild that one run (``stale:
    <the file and rule>``) instead of an error: what the schedule, the ``import_dir`` sensor and
    ``phantora-assets build`` decide a run's (re)build on."""
    try:
        return build_reason(spec, paths)
    except RecordError as exc:
        return f"stale: {exc}"


def timeline_scope_of(spec: RunSpec, paths: DataPaths) -> str:
    """What the run's raw timeline holds (``lib/workload/collectives.TIMELINE_SCOPES``): ``simulation.json``'s
    ``timeline_scope`` for an analytic run, ``every rank`` for any other source (it has no such record).

    Raises:
        RecordError: ``simulation.json`` is malformed (names it).
    """
    rec = read_record_or_none(paths.partition_dir(spec.run_id) / "simulation.json", SimulationRecord)
    return EVERY_RANK if rec is None else rec.timeline_scope


def compute_hosts_of(spec: RunSpec, paths: DataPaths) -> dict[str, int] | None:
    """The hosts whose compute the run's raw timeline holds whole (``host-k`` -> how many of the run's hosts
    have that compute, itself included: ``lib/workload/collectives.compute_hosts``), from ``simulation.json``;
    None when it holds every host's (scope ``every rank``, or a source with no such record). Empty: none.

    Raises:
        RecordError: ``simulation.json`` is malformed, or of scope ``one rank a stage`` without
            ``compute_hosts`` (written before the field: rebuild raw_timeline).
    """
    path = paths.partition_dir(spec.run_id) / "simulation.json"
    rec = read_record_or_none(path, SimulationRecord)
    if rec is None or rec.timeline_scope == EVERY_RANK:
        return None
    if rec.compute_hosts is None:
        raise RecordError(
            path,
            "scoped timeline without compute_hosts",
            f"timeline_scope {rec.timeline_scope!r} needs the hosts whose compute it holds whole (written since "
            "issue 37): rebuild raw_timeline",
        )
    return dict(rec.compute_hosts)
