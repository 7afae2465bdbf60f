"""Group ``simulation``: the perf DB of each GPU and the raw timeline of each run."""


import json

import dagster as dg

from phantora_assets import schemas
from phantora_assets.assets.common import check_results, stage_metadata
from phantora_assets.lib.errors import PerfDBError
from phantora_assets.lib.io import atomic_write_text
from phantora_assets.lib.perfdb import load_perfdb
from phantora_assets.partitions import gpu_partitions, gpu_to_runs, run_partitions, spec_for
from phantora_assets.paths import default_perfdb_dir
from phantora_assets.resources import DataRoot, SimulatorResource
from phantora_assets.runs import gpu_specs


@dg.asset(
    partitions_def=gpu_partitions,
    group_name="simulation",
    kinds={"csv", "pandera"},
    description="One Phantora performance database per GPU (perfdb/<gpu>/): compute and memcpy kernel "
    "timings in ns, validated (keys parse, nanos >= 0, manifest GPU name). A GPU without a database "
    "materializes as 'absent'; its runs use the roofline.",
)
def perf_db(context: dg.AssetExecutionContext, data: DataRoot) -> dg.MaterializeResult:
    gpu = context.partition_key
    folder = default_perfdb_dir() / gpu_specs()[gpu].get("perfdb", gpu)
    try:
        db = load_perfdb(folder, expected_gpu_name=gpu_specs()[gpu]["name"])
    except FileNotFoundError:
        summary = {"gpu": gpu, "status": "absent",
                   "message": f"no performance database for {gpu} (perfdb/{gpu}/ is missing): runs on this "
                              "GPU are timed by the roofline model only"}
        context.log.warning(summary["message"])
    else:
        schemas.PERFDB_COMPUTE.validate(db.compute)
        schemas.PERFDB_MEMCPY.validate(db.memcpy)
        summary = {"gpu": gpu, "status": "present", "gpu_name": db.gpu_name, **{f"{k}_entries": v for k, v in db.counts.items()},
                   "ops": int(db.compute["op"].nunique())}
    out = data.paths.perfdb_summary(gpu)
    atomic_write_text(out, json.dumps(summary, indent=1, sort_keys=True) + "\n")
    meta = {k: v for k, v in summary.items() if k != "gpu"}
    return dg.MaterializeResult(metadata={**meta, "path": dg.MetadataValue.path(str(out))})


@dg.asset(
    partitions_def=run_partitions,
    group_name="simulation",
    deps=[dg.AssetDep(perf_db, partition_mapping=gpu_to_runs)],
    check_specs=[
        dg.AssetCheckSpec("fits_in_memory", asset="raw_timeline", blocking=True,
                          description="The run fits the simulated card: the analytic peak memory estimate, or "
                          "Phantora's run.log (no CUDA out-of-memory error, reported peak <= card)."),
        dg.AssetCheckSpec("perfdb_complete", asset="raw_timeline", blocking=True,
                          description="A perf-DB replay met no kernel shape missing from the database "
                          "(Phantora's <db>.missing/ is empty); otherwise the run's timings are invalid."),
    ],
    kinds={"python", "parquet", "docker"},
    pool="phantora_simulation",
    description="The simulator's output for one run, 20 iterations (the first is warm-up). Analytic: "
    "raw_timeline.parquet, one row per computation event and per ring flow (simulated ns). Docker "
    "(Phantora): timeline.bin, run.log and config/ in the run folder. Import: the registered run "
    "folder's timeline.bin, run.log and config/ copied in. run.log's per-iteration time and peak "
    "memory become metadata. A run that does not fit in GPU memory fails the blocking fits_in_memory "
    "check.",
)
def raw_timeline(context: dg.AssetExecutionContext, data: DataRoot, simulator: SimulatorResource):
    spec = spec_for(context)
    status_file = data.paths.perfdb_summary(spec.gpu)
    perfdb_status = json.loads(status_file.read_text())["status"] if status_file.exists() else "not materialized"
    result = simulator.simulate(spec, data.paths, perfdb_status)
    yield dg.MaterializeResult(metadata=stage_metadata(result, run_id=spec.run_id, source=spec.source,
                                                       perf_db=perfdb_status))
    yield from check_results(result, "raw_timeline")
