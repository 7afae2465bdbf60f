"""One in-process Dagster materialization of a run partition, as the tests of imported and
profiled runs do it (tests/test_import*.py, tests/test_kineto_import.py, ...): every per-run asset
and check of ``partition`` in the matrix of ``data`` (with its imports), the analytic simulator,
an ephemeral instance, console logs quiet, errors returned in the result."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from phantora_assets import definitions as d
from phantora_assets.imported_runs import effective_matrix
from phantora_assets.resources import AnalyticSimulatorResource, DataRoot

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


def ephemeral_with_runs(run_ids) -> dg.DagsterInstance:
    """An ephemeral instance whose dynamic run partitions hold ``run_ids`` (``definitions.seed_run_partitions``)."""
    instance = dg.DagsterInstance.ephemeral()
    d.seed_run_partitions(instance, list(run_ids))
    return instance


def materialize_run(data: Path, partition: str) -> dg.ExecuteInProcessResult:
    """Materialize the per-run assets of ``partition`` under data root ``data`` (``raise_on_error=False``)."""
    all_assets, run_assets = d.assets_for(effective_matrix(data))
    return dg.materialize(
        all_assets,
        selection=run_assets,
        partition_key=partition,
        raise_on_error=False,
        instance=ephemeral_with_runs([partition]),
        run_config=QUIET,
        resources={"data": DataRoot(data_dir=str(data)), "simulator": AnalyticSimulatorResource()},
    )
