"""The code location: :func:`build_defs` makes the Definitions; the one place that reads the
environment (data root, run matrix, simulator choice). ``defs`` below is what ``dagster dev``,
``dagster asset materialize -m phantora_assets.definitions`` and ``workspace.yaml`` load.

Environment (all optional):
    PHANTORA_ASSETS_DATA_DIR            data root (default ./data)
    PHANTORA_ASSETS_RUN_MATRIX          run matrix file (default: the shipped runs.toml)
    PHANTORA_ASSETS_IMPORT_DIR          folders of Phantora run folders to import (os.pathsep-separated)
    PHANTORA_ASSETS_SIMULATOR           docker | analytic (default: docker iff a run has source = "docker")
    PHANTORA_ASSETS_DOCKER_IMAGE, PHANTORA_ASSETS_PHANTORA_TESTS_DIR, PHANTORA_ASSETS_DOCKER_MAX_CONCURRENT
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import dagster as dg

from phantora_assets.assets import DATASET_ASSET_NAMES, RUN_ASSET_NAMES, build_assets
from phantora_assets.assets.common import Partitions
from phantora_assets.imported_runs import matrix_for
from phantora_assets.matrix import RunSpec, check_specs
from phantora_assets.paths import default_data_dir
from phantora_assets.resources import DataRoot, simulator_from_env

#: Run tag of Docker simulations; dagster.yaml limits concurrent runs with it (tag_concurrency_limits).
DOCKER_TAG = {"phantora/simulator": "docker"}


def _jobs(assets: dict[str, dg.AssetsDefinition], parts: Partitions) -> list[dg.UnresolvedAssetJobDefinition]:
    run_assets = [assets[n] for n in RUN_ASSET_NAMES]
    return [
        dg.define_asset_job(
            "all_runs",
            selection=dg.AssetSelection.assets(*run_assets),
            partitions_def=parts.runs,
            description="Every per-run asset and check for the selected run partitions (use for backfills).",
        ),
        dg.define_asset_job(
            "docker_runs",
            selection=dg.AssetSelection.assets(*run_assets),
            partitions_def=parts.runs,
            tags=DOCKER_TAG,
            description="Like all_runs, for partitions simulated with Phantora in Docker: runs carry the tag "
            "phantora/simulator=docker, which dagster.yaml limits (tag_concurrency_limits).",
        ),
        dg.define_asset_job(
            "dataset",
            selection=dg.AssetSelection.assets(*[assets[n] for n in DATASET_ASSET_NAMES]),
            description="Assemble data/phantora_v0 from every run that passed its checks, rebuild "
            "data/phantora.duckdb from the same runs, and draw the dataset plots.",
        ),
    ]


def _schedules(parts: Partitions) -> list[dg.ScheduleDefinition]:
    keys = parts.runs.get_partition_keys()

    @dg.schedule(
        cron_schedule="0 2 * * 0",
        job_name="all_runs",
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description="Weekly backfill: one run request per run partition (every run of the matrix).",
    )
    def weekly_runs_backfill(context: dg.ScheduleEvaluationContext):
        for key in keys:
            yield dg.RunRequest(run_key=f"{context.scheduled_execution_time:%Y%m%d}-{key}", partition_key=key)

    @dg.schedule(
        cron_schedule="0 6 * * 0",
        job_name="dataset",
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description="Weekly dataset assembly, after the runs backfill.",
    )
    def weekly_dataset(context: dg.ScheduleEvaluationContext):
        return dg.RunRequest(run_key=f"{context.scheduled_execution_time:%Y%m%d}")

    return [weekly_runs_backfill, weekly_dataset]


def build_defs(
    data_dir: str | Path | None = None,
    specs: Sequence[RunSpec] | None = None,
    *,
    simulator: dg.ConfigurableResource | None = None,
) -> dg.Definitions:
    """The Definitions of one data root.

    Args:
        data_dir: the data root (default ``$PHANTORA_ASSETS_DATA_DIR`` or ``./data``).
        specs: the run matrix (default :func:`~phantora_assets.matrix.matrix_for` of ``data_dir``:
            the matrix with its imports); its run_ids are the run partitions.
        simulator: the ``simulator`` resource (default :func:`simulator_from_env`).

    Jobs: ``all_runs`` and ``docker_runs`` (per-run assets, partitioned), ``dataset``; schedules
    ``weekly_runs_backfill`` and ``weekly_dataset`` (stopped by default).

    Raises:
        RunMatrixError: the run matrix or an import is invalid (names the entry and the rule).
    """
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    if specs is None:
        specs = matrix_for(root)
    else:
        specs = list(specs)
        check_specs(specs, "build_defs(specs=...)")
    parts = Partitions.of(specs)
    assets = build_assets(parts)
    return dg.Definitions(
        assets=list(assets.values()),
        jobs=_jobs(assets, parts),
        schedules=_schedules(parts),
        resources={"data": DataRoot(data_dir=str(root)), "simulator": simulator or simulator_from_env(specs)},
    )


defs = build_defs()

#: The assets of ``defs`` by name (``ASSETS["validated_flows"]``), and the lists the CLI and tests
#: select from: every asset, the per-run assets (``all_runs``) and the dataset assets.
ASSETS: dict[str, dg.AssetsDefinition] = {
    a.key.to_user_string(): a for a in defs.assets or [] if isinstance(a, dg.AssetsDefinition)
}
ALL_ASSETS: list[dg.AssetsDefinition] = list(ASSETS.values())
RUN_ASSETS: list[dg.AssetsDefinition] = [ASSETS[n] for n in RUN_ASSET_NAMES]
DATASET_ASSETS: list[dg.AssetsDefinition] = [ASSETS[n] for n in DATASET_ASSET_NAMES]


def assets_for(specs: Sequence[RunSpec]) -> tuple[list[dg.AssetsDefinition], list[dg.AssetsDefinition]]:
    """``(every asset, the per-run assets)`` partitioned by the run_ids of ``specs``, for
    ``dagster.materialize`` in a process whose data root's imports differ from ``defs``'s."""
    assets = build_assets(Partitions.of(specs))
    return list(assets.values()), [assets[n] for n in RUN_ASSET_NAMES]
