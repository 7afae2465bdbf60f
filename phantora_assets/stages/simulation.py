"""Stages of group ``simulation``: the perf DB of each GPU and the raw timeline of each run
(no Dagster import).

    perf_db      -> <root>/perfdb/<gpu>/perf_db.json (the validated perf DB summary)
    raw_timeline -> whatever the run's source writes (``sources/``), and run_log.json
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from phantora_assets import contracts
from phantora_assets.lib.phantora.perfdb import load_perfdb
from phantora_assets.matrix import RunSpec, gpu_specs
from phantora_assets.paths import DataPaths, default_perfdb_dir
from phantora_assets.records import PerfDbRecord, RunSpecRecord, read_record_or_none, write_record
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
    GPU's perf DB status filled in. Then ``run_spec.json`` (:func:`run_spec_record`): what the run
    was built from, which the dataset export checks."""
    ctx = SourceContext(perfdb_status=perfdb_status(spec, paths), docker=ctx.docker, log=ctx.log)
    (paths.partition_dir(spec.run_id) / "run_spec.json").unlink(missing_ok=True)
    result = get_source(spec.source).raw_timeline(spec, paths, ctx)
    write_record(paths.partition_dir(spec.run_id) / "run_spec.json", run_spec_record(spec))
    return result


def run_spec_record(spec: RunSpec) -> RunSpecRecord:
    """What ``spec``'s outputs depend on, and a sha256 fingerprint of it: the run-matrix entry
    (layout, source, topology, import path), the workload preset, the GPU's ``gpus.toml`` entry,
    the effective network settings and the sha256 of the GPU's perf DB files."""
    folder = default_perfdb_dir() / str(spec.gpu_spec.get("perfdb", spec.gpu))
    perfdb = {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.glob("*.csv")) + sorted(folder.glob("manifest.md"))
        if f.is_file()
    }
    inputs: dict[str, Any] = {
        "entry": {
            "workload": spec.workload,
            "gpu": spec.gpu,
            "nodes": spec.n_nodes,
            "gpus_per_node": spec.gpus_per_node,
            "source": spec.source,
            "path": spec.path,
            "topology": dict(spec.topology),
        },
        "workload": spec.preset,
        "gpu": spec.gpu_spec,
        "network": spec.cluster,
        "perf_db": perfdb,
    }
    text = json.dumps(inputs, sort_keys=True, default=str)
    return RunSpecRecord(
        run_id=spec.run_id, fingerprint=hashlib.sha256(text.encode()).hexdigest()[:16], inputs=json.loads(text)
    )


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
    if rec.fingerprint == now.fingerprint:
        return None
    changed = sorted(k for k in now.inputs if rec.inputs.get(k) != now.inputs[k])
    return f"stale: built from another {', '.join(changed) or 'input'} than the run matrix now gives; rebuild the run"
