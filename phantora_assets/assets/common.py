"""What the asset modules share: the partitions of a run matrix, the RunSpec of a partition,
check specs from the registry (``checks.py``), StageResult -> Dagster metadata and checks, and
:func:`quiet_skipped_check_warnings`."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from phantora_assets.checks import BY_NAME, checks_of, clear_step_error, record_step_error
from phantora_assets.lib.run.catalog import gpu_specs
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.outcomes import StageResult
from phantora_assets.stages.common import release_memory

#: The name of the run partitions (a ``DynamicPartitionsDefinition``): one key per run_id, kept on
#: the Dagster instance. The code location adds the keys of its run matrix when it loads
#: (``definitions.seed_run_partitions``), the ``import_dir`` sensor those of imports that appeared
#: since, ``phantora-assets build`` those it builds; none is ever removed but by
#: ``phantora-assets forget`` (docs/IMPORTS.md).
RUN_PARTITIONS = "run_id"


def seed_run_partitions(instance: dg.DagsterInstance, run_ids: Sequence[str]) -> list[str]:
    """Add the ``run_ids`` that are not keys of the dynamic run partitions
    (:data:`~phantora_assets.assets.common.RUN_PARTITIONS`) of ``instance`` yet; returns those
    added, in order. Never removes one (``phantora-assets forget`` does)."""
    have = set(instance.get_dynamic_partitions(RUN_PARTITIONS))
    new = [r for r in dict.fromkeys(run_ids) if r not in have]
    if new:
        instance.add_dynamic_partitions(RUN_PARTITIONS, new)
    return new


@dataclass(frozen=True)
class Partitions:
    """The partitions of one run matrix: ``runs`` (dynamic, :data:`RUN_PARTITIONS`: one key per
    run_id), ``gpus`` (one per GPU of ``gpus.toml``) and ``gpu_to_runs``, the partition mapping of
    ``raw_timeline``'s dependency on ``perf_db``: every GPU partition (Dagster's
    ``StaticPartitionMapping`` holds between static partitions only, and a mapping class of our
    own would not reach the UI or the daemon, which keep built-in mappings only). Which perf DB a
    run reads -- its own GPU's -- is in its fingerprint (``stages/simulation.run_spec_record``),
    which makes a run stale when that perf DB changes."""

    specs: tuple[RunSpec, ...]
    runs: dg.DynamicPartitionsDefinition
    gpus: dg.StaticPartitionsDefinition
    gpu_to_runs: dg.PartitionMapping
    by_id: dict[str, RunSpec]

    @classmethod
    def of(cls, specs: Sequence[RunSpec]) -> Partitions:
        return cls(
            tuple(specs),
            dg.DynamicPartitionsDefinition(name=RUN_PARTITIONS),
            dg.StaticPartitionsDefinition(sorted(gpu_specs())),
            dg.AllPartitionMapping(),
            {s.run_id: s for s in specs},
        )

    def spec_for(self, context: dg.AssetExecutionContext, root: Path | None = None) -> RunSpec:
        """The RunSpec of the partition being materialized: a lookup in the run matrix these
        definitions were built with (parsed once, when ``build_defs`` ran), else -- a partition
        added since, e.g. a folder dropped into the watched folder -- in the run matrix of data
        root ``root`` as it is now (``imported_runs.matrix_for``).

        Raises:
            KeyError: the partition is not a run of either.
        """
        key = context.partition_key
        spec = self.by_id.get(key)
        if spec is None and root is not None:
            from phantora_assets.imported_runs import runs_by_id

            spec = runs_by_id(root).get(key)
        if spec is None:
            raise KeyError(f"partition {key!r} is not a run of the run matrix (forgotten, or its folder is gone)")
        return spec


@contextmanager
def failure_recorded(p: Partitions, context: dg.AssetExecutionContext, data: Any, asset: str) -> Iterator[RunSpec]:
    """The partition's RunSpec, for the body of ``asset``'s step; an exception the body raises is
    recorded in the run folder (``checks.record_step_error``: ``checks.json``/``checks.txt``, which
    ``phantora-assets runs`` and ``build`` read) with its type and first line -- for our errors the
    file, rule and detail -- then re-raised, so the run fails with the same root cause. The
    trace caps of ``data`` (``DataRoot.trace_limits``) hold for the body."""
    spec = p.spec_for(context, data.paths.root)
    folder = data.paths.run_folder(spec)
    clear_step_error(folder, asset)
    try:
        with data.trace_limits():  # the caps of the run's config on every trace the step reads
            yield spec
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        record_step_error(folder, asset, f"{type(exc).__name__}: {first}"[:2000])
        raise
    finally:
        release_memory()  # every step of a run runs in one process: the next starts from what is in use


def check_specs(asset: str, partitions_def: dg.PartitionsDefinition | None = None) -> list[dg.AssetCheckSpec]:
    """The Dagster check specs of ``asset``, from the registry (``checks.CHECKS``).

    ``partitions_def``: the asset's (the run partitions), so that every execution of a check is
    recorded with its partition: the UI reads a check's results per partition, and a partition
    whose check did not run (a run that does not fit in GPU memory: "Skipped") is that partition's
    state, not the check's. Dagster 1.13 calls partitioned check specs a preview; its warning
    is not repeated at every load."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*partitions_def on an AssetCheckSpec.*")
        return [
            dg.AssetCheckSpec(
                c.name, asset=asset, blocking=c.blocking, description=c.description, partitions_def=partitions_def
            )
            for c in checks_of(asset)
        ]


#: Per-run assets, in graph order.
RUN_ASSET_NAMES = (
    "raw_timeline",
    "chrome_trace",
    "validated_flows",
    "binned_flows",
    "link_bins",
    "window_features",
    "run_summary",
    "step_anatomy",
    "reconfig",
    "run_plots",
)
#: The per-run assets a run that does not fit in GPU memory does not build (``chrome_trace`` and below).
NOT_APPLICABLE_ASSETS = RUN_ASSET_NAMES[RUN_ASSET_NAMES.index("chrome_trace") :]


def not_applicable_materializations(context: dg.AssetExecutionContext, reason: str) -> list[dg.AssetMaterialization]:
    """For a partition that does not fit in GPU memory: one ``AssetMaterialization`` of that
    partition per asset of :data:`NOT_APPLICABLE_ASSETS` in the run's selection, metadata
    ``status = "not_applicable"`` and ``reason``, so that the UI reads "not applicable" and why,
    not "Missing" like a partition never built. Nothing is written: the steps below
    ``chrome_trace`` are skipped and their checks stay unexecuted ("Skipped" for that partition)."""
    selected = context.run.asset_selection or None  # None or empty (execute_in_process): the whole job
    names = [n for n in NOT_APPLICABLE_ASSETS if selected is None or dg.AssetKey(n) in selected]
    meta, words = {"status": "not_applicable", "reason": reason}, f"not applicable: {reason}"
    key = context.partition_key
    return [dg.AssetMaterialization(n, partition=key, metadata=meta, description=words) for n in names]


def stage_metadata(result: StageResult, **extra: Any) -> dict[str, Any]:
    """Metadata of a stage: its numbers, plus the output path when there is one."""
    meta: dict[str, Any] = {**result.metadata, **extra}
    if result.path is not None:
        meta["path"] = dg.MetadataValue.path(str(result.path))
    return {k: v for k, v in meta.items() if v is not None}


def check_results(result: StageResult, asset: str) -> Iterator[dg.AssetCheckResult]:
    """One AssetCheckResult per outcome. Its severity is WARN when the registry says so
    (``checks.CHECKS``: advisory checks, and ``fits_in_memory``, which gates the dataset without
    failing the run) or the outcome is an advisory one, else ERROR; blocking is set on the spec.
    The run folder's record is the stage's: a failed ``fits_in_memory`` stays ``failed`` there.
    Metadata keys ending in ``_md`` are rendered as Markdown."""
    for o in result.outcomes:
        meta: dict[str, Any] = {"message": o.message}
        for k, v in o.metadata.items():
            if v is None:
                continue
            meta[k] = dg.MetadataValue.md(v) if k.endswith("_md") else v
        registered = BY_NAME.get(o.name)
        warn = o.severity == "warn" or (registered is not None and registered.severity == "warn")
        yield dg.AssetCheckResult(
            asset_key=asset,
            check_name=o.name,
            passed=o.passed,
            severity=dg.AssetCheckSeverity.WARN if warn else dg.AssetCheckSeverity.ERROR,
            metadata=meta,
            description=o.message,
        )


class _SkippedCheckWarning(logging.Filter):
    """Drops Dagster's "Blocking asset check ... emitted no result in step ...; downstream step
    ... will proceed without gating on it." (``dagster._core.execution.plan.active``).

    Dagster 1.13 logs it, through Python logging (stderr, outside the run's event log), for every
    blocking check of a *skipped* step and every step below it, although those steps are skipped
    too: 16 or 17 misleading lines per run that does not fit in GPU memory (``chrome_trace`` yields
    nothing there, and Dagster skips validated_flows ... run_plots). A step that succeeds cannot
    omit a check result (Dagster fails it with DagsterStepOutputNotFoundError), so in this graph
    the message only ever follows a skip; ``tests/integration/test_honest_outcomes.py`` checks both facts.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.startswith("Blocking asset check ") and " emitted no result in step " in msg)


_SKIPPED_CHECK_FILTER = _SkippedCheckWarning()
DAGSTER_PLAN_LOGGER = "dagster._core.execution.plan.active"


def quiet_skipped_check_warnings() -> None:
    """Install :class:`_SkippedCheckWarning` on Dagster's execution-plan logger (once; called
    when the asset graph is built, not at import)."""
    logger = logging.getLogger(DAGSTER_PLAN_LOGGER)
    if _SKIPPED_CHECK_FILTER not in logger.filters:
        logger.addFilter(_SKIPPED_CHECK_FILTER)
