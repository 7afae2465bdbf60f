"""Stages of group ``simulation``: the perf DB of each GPU and the raw timeline of each run
(no Dagster import).

    perf_db      -> <root>/perfdb/<gpu>/perf_db.json (the validated perf DB summary)
    raw_timeline -> whatever the run's source writes (``sources/``), and run_log.json
"""

from __future__ import annotations

from phantora_assets import contracts
from phantora_assets.lib.phantora.perfdb import load_perfdb
from phantora_assets.matrix import RunSpec, gpu_specs
from phantora_assets.paths import DataPaths, default_perfdb_dir
from phantora_assets.records import PerfDbRecord, read_record_or_none, write_record
from phantora_assets.sources import get_source
from phantora_assets.sources.base import SourceContext
from phantora_assets.stages.common import StageResult


def perf_db(gpu: str, paths: DataPaths) -> tuple[PerfDbRecord, bool]:
    """Validate the perf DB of ``gpu`` (``perfdb/<gpu>/``, or ``$PHANTORA_ASSETS_PERFDB_DIR``) and
    write its summary ``perf_db.json``. Returns ``(record, present)``; a GPU without a database
    gives status ``absent`` (its runs are timed by the roofline model only).

    Raises:
        PerfDBError: a row or the manifest breaks the format (names the file and the rule).
        pandera.errors.SchemaError: a table breaks ``contracts.PERFDB_COMPUTE`` / ``PERFDB_MEMCPY``.
    """
    spec = gpu_specs()[gpu]
    folder = default_perfdb_dir() / spec.get("perfdb", gpu)
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
    GPU's perf DB status filled in."""
    ctx = SourceContext(perfdb_status=perfdb_status(spec, paths), docker=ctx.docker, log=ctx.log)
    return get_source(spec.source).raw_timeline(spec, paths, ctx)
