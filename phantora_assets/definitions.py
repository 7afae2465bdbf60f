"""The code location: :func:`build_defs` makes the Definitions; the one place that reads the
environment (data root, run matrix, simulator choice). :func:`defs` (``@dagster.definitions``, a
lazy loader) is what ``dagster dev``, ``dagster asset materialize -m phantora_assets.definitions``,
``workspace.yaml``, ``dagster-webserver`` and ``dagster-daemon`` load: importing this module reads
no file and no environment; the first call of ``defs()`` reads the run matrix and the import
folders, builds the Definitions and keeps them for the process (:func:`forget_if_changed` drops
them when the matrix, the imports or the environment changed). ``ASSETS``, ``ALL_ASSETS``,
``RUN_ASSETS``, ``DATASET_ASSETS`` and ``LOADED_FROM`` are attributes of the module computed from
``defs()`` on first access (module ``__getattr__``), so reading one loads the definitions.

Environment (all optional):
    PHANTORA_ASSETS_DATA_DIR            data root (default ./data)
    PHANTORA_ASSETS_RUN_MATRIX          run matrix file (default: the shipped runs.toml)
    PHANTORA_ASSETS_IMPORT_DIR          folders of Phantora run folders (or of traces with import.toml) to import
    PHANTORA_ASSETS_MAX_TRACE_LINE_MIB, PHANTORA_ASSETS_MAX_TRACE_INFLATED_GIB   trace caps (resources.DataRoot)
    PHANTORA_ASSETS_SIMULATOR           docker | analytic (default: docker iff a run has source = "docker")
    PHANTORA_ASSETS_DOCKER_IMAGE, PHANTORA_ASSETS_PHANTORA_TESTS_DIR, PHANTORA_ASSETS_DOCKER_MAX_CONCURRENT
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import dagster as dg

from phantora_assets.assets import DATASET_ASSET_NAMES, RUN_ASSET_NAMES, build_assets
from phantora_assets.assets.common import RUN_PARTITIONS, Partitions, seed_run_partitions
from phantora_assets.assets.dataset_retry import dataset_retry_sensor
from phantora_assets.imported_runs import (
    IMPORT_DIR_ENV,
    discover_imports,
    env_import_dirs,
    matrix_for,
    remember_watched,
)
from phantora_assets.lib.errors import FileRuleError, OutputWriteError, RunMatrixError
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.matrix import check_specs
from phantora_assets.paths import DataPaths, check_data_root, default_data_dir
from phantora_assets.resources import data_root_from_env, simulator_from_env
from phantora_assets.stages.simulation import build_reason_or_record_error, run_spec_record

#: Run tag of Docker simulations; dagster.yaml limits concurrent runs with it (tag_concurrency_limits).
DOCKER_TAG = {"phantora/simulator": "docker"}


def _jobs(assets: dict[str, dg.AssetsDefinition], parts: Partitions) -> list[dg.UnresolvedAssetJobDefinition]:
    run_assets = [assets[n] for n in RUN_ASSET_NAMES]
    return [
        dg.define_asset_job(
            "all_runs",
            selection=dg.AssetSelection.assets(*run_assets),
            partitions_def=parts.runs,
            executor_def=dg.in_process_executor,
            description="Every per-run asset and check for the selected run partitions (use for backfills): "
            "one run per partition, its steps in one process.",
        ),
        dg.define_asset_job(
            "docker_runs",
            selection=dg.AssetSelection.assets(*run_assets),
            partitions_def=parts.runs,
            executor_def=dg.in_process_executor,
            tags=DOCKER_TAG,
            description="Like all_runs, for partitions simulated with Phantora in Docker: runs carry the tag "
            "phantora/simulator=docker, which dagster.yaml limits (tag_concurrency_limits).",
        ),
        dg.define_asset_job(
            "perf_dbs",
            selection=dg.AssetSelection.assets(assets["perf_db"]),
            partitions_def=parts.gpus,
            executor_def=dg.in_process_executor,
            description="The perf DB of the selected GPU partitions.",
        ),
        dg.define_asset_job(
            "dataset",
            executor_def=dg.in_process_executor,
            selection=dg.AssetSelection.assets(*[assets[n] for n in DATASET_ASSET_NAMES]),
            description="Assemble data/phantora_v0 from every run that passed its checks, rebuild "
            "data/phantora.duckdb from the same runs, and draw the dataset plots.",
        ),
    ]


#: When the dataset assets (phantora_v0, the DuckDB file, the dataset plots) bring themselves up to
#: date: a run partition they read was materialized since they last were, and no partition they
#: read is being materialized or queued (so a backfill ends in one dataset run, not thirty). Unlike
#: ``AutomationCondition.eager()`` it does not wait for every partition to exist: a run that does
#: not fit in GPU memory never materializes its run summary.
DATASET_AUTOMATION = (
    dg.AutomationCondition.any_deps_updated().since_last_handled()
    & ~dg.AutomationCondition.any_deps_in_progress()
    & ~dg.AutomationCondition.in_progress()
).with_label("dataset_up_to_date")


def _automation(assets: dict[str, dg.AssetsDefinition], parts: Partitions, root: Path) -> list:
    """The sensor that evaluates DATASET_AUTOMATION (on by default; needs ``dagster-daemon``) and
    the nightly schedule that requests only the run partitions that are missing or stale."""
    dataset_sensor = dg.AutomationConditionSensorDefinition(
        "dataset_automation",
        target=dg.AssetSelection.assets(*[assets[n] for n in DATASET_ASSET_NAMES]),
        default_status=dg.DefaultSensorStatus.RUNNING,
        # every pass of the daemon's asset loop (it runs at most every 5 s): a backfill's dataset
        # is requested within ~5 s of its last run, not 10-15 s
        minimum_interval_seconds=1,
        description="Assembles the dataset (phantora_v0, phantora.duckdb, dataset plots) after run partitions "
        "change, once none is in progress.",
    )
    paths = DataPaths(root)

    @dg.schedule(
        cron_schedule="0 2 * * *",
        job_name="all_runs",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Nightly: one run request per run partition that is missing (never built, or stopped "
        "before its summary) or stale (built from another matrix entry, preset, GPU or perf DB); none for "
        "partitions that are complete and current.",
    )
    def nightly_missing_runs(context: dg.ScheduleEvaluationContext):
        reasons = {s.run_id: _reason(s, paths) for s in parts.specs}
        todo = {k: v for k, v in reasons.items() if v}
        if not todo:
            return dg.SkipReason(f"all {len(parts.specs)} run partitions are complete and current")
        day = f"{context.scheduled_execution_time:%Y%m%d}"
        return [
            dg.RunRequest(run_key=f"{day}-{k}", partition_key=k, tags={"phantora/build_reason": why[:200]})
            for k, why in todo.items()
        ]

    return [dataset_sensor, nightly_missing_runs, _import_dir_sensor(parts, paths)]


def _import_dir_sensor(parts: Partitions, paths: DataPaths) -> dg.SensorDefinition:
    """The sensor ``import_dir`` (on by default). Every tick:

    1. the runs of the data root's matrix as it is now (``imported_runs.matrix_for``: the shipped
       matrix, the registry ``<data root>/imports.toml``, the folders under
       ``$PHANTORA_ASSETS_IMPORT_DIR``) that are not yet keys of the dynamic run partitions
       (:data:`~phantora_assets.assets.common.RUN_PARTITIONS`) are added to them
       (``SensorResult.dynamic_partitions_requests``): a folder dropped in, or registered by
       ``phantora-assets import --no-build``, becomes a partition with no reload of the code
       location; the watched folder's runs are registered (``imported_runs.remember_watched``), so
       that they stay runs of the data root when the variable is unset later;
    2. every run folder under ``$PHANTORA_ASSETS_IMPORT_DIR`` without a complete, current build
       gets one run of ``all_runs`` in the same tick. Its run key is the run_id and the
       fingerprint of what the build reads (``run_spec_record`` of the matrix entry as the folder
       now gives it, netconfig included, which covers the size and mtime of the folder's files:
       for a Phantora run folder the trace, ``run.log``, ``timeline.bin`` and every file under
       ``config/`` and ``perfdb_missing/``), so a folder whose files change is requested again and
       a failing one once per state of its files. A folder of profiler traces or Chakra ETs counts
       when it has an ``import.toml`` (``imported_runs.discover_imports``); the folders that
       cannot be imported are named in the skip message.

    No partition is ever deleted here: removal is explicit (``phantora-assets forget``)."""

    @dg.sensor(
        job_name="all_runs",
        minimum_interval_seconds=2,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Adds the runs of the data root that are not partitions yet (shipped matrix, imports.toml, "
        "$PHANTORA_ASSETS_IMPORT_DIR) to the dynamic run partitions, and materializes the run folders found under "
        "$PHANTORA_ASSETS_IMPORT_DIR that have no complete, current build (one run of all_runs each).",
    )
    def import_dir(context: dg.SensorEvaluationContext):
        dirs = env_import_dirs()
        for d in dirs:
            if not d.is_dir():
                return dg.SkipReason(f"${IMPORT_DIR_ENV}: {d} is not a directory")
        notes: list[str] = []
        try:
            remember_watched(paths.root)
        except (RunMatrixError, OSError) as exc:  # a read-only data root: still a partition, named
            notes.append(f"cannot register the watched folder's runs: {exc}")
        try:  # the entries as the folders give them now (the code location's may be older: netconfig)
            now = {s.run_id: s for s in matrix_for(paths.root)}
        except RunMatrixError as exc:
            return dg.SkipReason(str(exc))
        have = set(context.instance.get_dynamic_partitions(RUN_PARTITIONS))
        added = [r for r in now if r not in have]
        requests, declined = [], []
        for d in dirs:
            found, skipped = discover_imports(d)
            declined += [f"{s.path}: {s.reason}" for s in skipped]
            for folder in found:
                spec = now.get(folder.spec.run_id)
                if spec is None or spec.path != folder.spec.path:
                    continue  # shadowed by a later import directory of the same run_id
                why = _reason(spec, paths)
                if why:
                    requests.append(
                        dg.RunRequest(
                            run_key=f"{spec.run_id}@{run_spec_record(spec).fingerprint}",
                            partition_key=spec.run_id,
                            tags={"phantora/build_reason": why[:200]},
                        )
                    )
        if added:
            notes.insert(0, f"added {len(added)} run partition(s): {', '.join(added[:10])}{' ...' * (len(added) > 10)}")
        if not dirs:
            notes.append(f"${IMPORT_DIR_ENV} is not set")
        elif not requests:
            notes.append("every imported run folder is built and current")
        note = "; ".join(notes) + "".join(f"; declined {s}" for s in declined)
        return dg.SensorResult(
            run_requests=requests,
            dynamic_partitions_requests=[dg.AddDynamicPartitionsRequest(RUN_PARTITIONS, added)] if added else None,
            skip_reason=None if requests else note,
        )

    return import_dir


def _seed_at_load(specs: Sequence[RunSpec]) -> None:
    """When the code location loads with ``$DAGSTER_HOME`` set (``dagster dev``, ``dagster-daemon
    run``, ``dagster asset materialize``, the code servers of the deployments): its run matrix's
    run_ids become keys of the run partitions of that instance at once, so the UI lists them
    before the ``import_dir`` sensor's first tick. Not in a run worker (its launcher's side did it).
    A failure is a warning: the sensor adds them on its next tick."""
    worker = sys.modules.get("phantora_assets.instance.worker")
    if not os.environ.get("DAGSTER_HOME") or (worker is not None and worker.IN_RUN_WORKER[0]):
        return
    try:
        with dg.DagsterInstance.get() as instance:
            seed_run_partitions(instance, [s.run_id for s in specs])
    except Exception as exc:  # e.g. a read-only or half-created instance: the sensor tries again
        warnings.warn(f"phantora_assets: run partitions not added at load ({type(exc).__name__}: {exc})", stacklevel=1)


def _reason(spec: RunSpec, paths: DataPaths) -> str | None:
    """build_reason, with an unreadable record a reason to rebuild that one partition (named with
    the file and rule) instead of an error that would fail the whole schedule tick."""
    return build_reason_or_record_error(spec, paths)


def build_defs(
    data_dir: str | Path | None = None,
    specs: Sequence[RunSpec] | None = None,
    *,
    simulator: dg.ConfigurableResource | None = None,
) -> dg.Definitions:
    """The Definitions of one data root.

    Args:
        data_dir: the data root (default ``$PHANTORA_ASSETS_DATA_DIR`` or ``./data``).
        specs: the run matrix (default :func:`~phantora_assets.imported_runs.matrix_for` of ``data_dir``:
            the matrix with its imports); its run_ids are keys of the dynamic run partitions
            (``assets.common.RUN_PARTITIONS``; added on an instance by :func:`seed_run_partitions`,
            the ``import_dir`` sensor and ``phantora-assets build``).
        simulator: the ``simulator`` resource (default :func:`simulator_from_env`).

    Jobs: ``all_runs`` and ``docker_runs`` (per-run assets, partitioned by run, steps in one
    process), ``perf_dbs`` (by GPU), ``dataset``. Every job runs its steps in one process (the
    in-process executor), also the asset job Dagster makes for a selection of assets materialized
    from the UI or requested by a sensor (Dagster's default starts a process per step, ~2.5 s of
    imports each: the dataset run the sensor launched took 11.5 s instead of 3). The dataset assets carry
    :data:`DATASET_AUTOMATION`, evaluated by the sensor ``dataset_automation`` (running by
    default); the schedule ``nightly_missing_runs`` (running by default) requests only the run
    partitions :func:`~phantora_assets.stages.simulation.build_reason` names. Sensors and
    schedules need ``dagster-daemon``.

    Raises:
        RunMatrixError: the run matrix or an import is invalid (names the entry and the rule).
        FileRuleError: the data root is no directory and cannot be made one (``paths.data_root_rule``).
    """
    root = check_data_root(data_dir if data_dir is not None else default_data_dir())
    if specs is None:
        specs = matrix_for(root)
    else:
        specs = list(specs)
        check_specs(specs, "build_defs(specs=...)")
    parts = Partitions.of(specs)
    assets = build_assets(parts)
    for name in DATASET_ASSET_NAMES:
        assets[name] = assets[name].map_asset_specs(
            lambda spec: spec.replace_attributes(automation_condition=DATASET_AUTOMATION)
        )
    sensor, schedule, import_dir = _automation(assets, parts, root)
    return dg.Definitions(
        assets=list(assets.values()),
        jobs=_jobs(assets, parts),
        sensors=[sensor, import_dir, dataset_retry_sensor([assets[n].key for n in DATASET_ASSET_NAMES])],
        schedules=[schedule],
        resources={"data": data_root_from_env(root), "simulator": simulator or simulator_from_env(specs)},
        executor=dg.in_process_executor,
    )


def loaded_from() -> tuple:
    """What :func:`defs` is built from: ``(the PHANTORA_ASSETS_* environment as sorted (name,
    value) pairs, the run matrix with imports of the data root)``. A process reuses the Definitions
    ``defs()`` made only while this is unchanged (:func:`forget_if_changed`).

    Raises:
        RunMatrixError: the run matrix or an import is invalid (names the file and the rule).
    """
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("PHANTORA_ASSETS_")))
    return env, tuple(matrix_for(default_data_dir()))


#: At most one ``(loaded_from(), its Definitions)``: what :func:`defs` made in this process.
_LOADED: list[tuple[tuple, dg.Definitions]] = []


@dg.definitions
def defs() -> dg.Definitions:
    """The Definitions of the data root and run matrix of the environment (:func:`build_defs` with
    no arguments), made at the first call in a process and returned again until
    :func:`forget_if_changed` drops them. At the first call the matrix's run_ids become run
    partitions of ``$DAGSTER_HOME``'s instance (``_seed_at_load``).

    Raises:
        RunMatrixError: the run matrix or an import is invalid (names the file and the rule).
        FileRuleError: an input file or the data root breaks a rule (names it and the rule).
        Either, when nothing catches it (a Dagster command such as ``dagster asset materialize``
        loads the code location outside any handler), is printed as its one line, not the
        interpreter's traceback through Dagster's loader (:func:`_input_errors_in_one_line`).
    """
    if not _LOADED:
        try:
            source = loaded_from()
            _LOADED.append((source, build_defs()))
        except (RunMatrixError, FileRuleError) as exc:
            if not isinstance(exc, OutputWriteError):
                _input_errors_in_one_line()
            raise
        _seed_at_load(source[1])
    return _LOADED[0][1]


def _input_errors_in_one_line() -> None:
    """Make the interpreter print an uncaught input error of ours (:class:`RunMatrixError`, a
    :class:`FileRuleError` other than a write failure) as ``<type>: <message>`` (the message names the
    file, entry and rule) plus where it was raised, instead of the traceback: Dagster's CLI loads
    the code location outside any handler (``dagster asset materialize`` printed 70 lines of
    Dagster's and click's frames before the one that says what is wrong). Installed only when such an
    error is being raised; every other exception, and any one a caller catches (the webserver and
    the daemon show a code location's load error themselves), is untouched."""
    previous = sys.excepthook
    if getattr(previous, "phantora_input_errors", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: object) -> None:
        if isinstance(exc, (RunMatrixError, FileRuleError)) and not isinstance(exc, OutputWriteError):
            print(f"{kind.__name__}: {exc}", file=sys.stderr)
            print("  (raised loading the code location phantora_assets.definitions; fix the input and run again)",
                  file=sys.stderr)  # fmt: skip
            return
        previous(kind, exc, tb)  # type: ignore[arg-type]

    hook.phantora_input_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def forget_if_changed() -> bool:
    """Drop the Definitions :func:`defs` made when :func:`loaded_from` differs now (or cannot be
    read: the next ``defs()`` reports the error), so that the next ``defs()`` builds them again;
    True when dropped. A run worker forked from a process that loaded them calls it before each run."""
    if not _LOADED:
        return False
    try:
        current = loaded_from() == _LOADED[0][0]
    except Exception:  # an invalid matrix now: the next defs() raises it, naming the file
        current = False
    if not current:
        _LOADED.clear()
    return not current


def __getattr__(name: str):
    """``LOADED_FROM`` (what :func:`defs` was built from), ``ASSETS`` (the assets of ``defs()`` by
    name, ``ASSETS["validated_flows"]``) and the lists the CLI and tests select from:
    ``ALL_ASSETS``, ``RUN_ASSETS`` (``all_runs``), ``DATASET_ASSETS``; each loads ``defs()``."""
    if name not in ("LOADED_FROM", "ASSETS", "ALL_ASSETS", "RUN_ASSETS", "DATASET_ASSETS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    loaded = defs()
    if name == "LOADED_FROM":
        return _LOADED[0][0]
    by_name = {a.key.to_user_string(): a for a in loaded.assets or [] if isinstance(a, dg.AssetsDefinition)}
    if name == "ASSETS":
        return by_name
    if name == "ALL_ASSETS":
        return list(by_name.values())
    names = RUN_ASSET_NAMES if name == "RUN_ASSETS" else DATASET_ASSET_NAMES
    return [by_name[n] for n in names]


def assets_for(specs: Sequence[RunSpec]) -> tuple[list[dg.AssetsDefinition], list[dg.AssetsDefinition]]:
    """``(every asset, the per-run assets)`` partitioned by the run_ids of ``specs``, for
    ``dagster.materialize`` in a process whose data root's imports differ from ``defs()``'s."""
    assets = build_assets(Partitions.of(specs))
    return list(assets.values()), [assets[n] for n in RUN_ASSET_NAMES]
