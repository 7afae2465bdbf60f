"""Importing this module imports what a run of this code location imports: the code location
itself and the libraries its runs import lazily (plots, Parquet datasets, DuckDB, the trace
decoder, pandera's backends, the parts of Dagster a run worker loads).
:class:`~phantora_assets.instance.launcher.ForkRunLauncher` preloads it in its forkserver and
``phantora-assets build`` imports it before forking run workers, so that no run pays for these
imports again (about 1 s of a 2.5 s run on a 2-core machine). A module missing from another
version of a library is skipped: the list only saves time, it is never needed for correctness."""

import gc
import importlib

import pandas as pd

from phantora_assets.definitions import defs

defs()  # the code location of the environment: built once here, not in every forked worker

#: Found by diffing ``sys.modules`` around an ``all_runs`` and a ``dataset`` run (Dagster 1.13.27).
LAZY_MODULES = (
    "duckdb",
    "matplotlib.backends.backend_agg",
    "matplotlib.figure",
    "matplotlib.lines",
    "matplotlib.patches",
    "matplotlib.ticker",
    "PIL.PngImagePlugin",
    "pyarrow.csv",
    "pyarrow.dataset",
    "pyarrow.parquet",
    "isal.igzip",
    "hypothesis",
    "pandera.strategies.pandas_strategies",
    "pandera.backends.pandas.register",
    "dagster._core.execution.api",
    "dagster._core.executor.in_process",
    "dagster._core.instance.factory",
    "dagster._core.launcher.sync_in_memory_run_launcher",
    "dagster._core.storage.noop_compute_log_manager",
    "dagster._core.storage.migration",
    "dagster._core.storage.run_size",
    "dagster._core.snap",
    "dagster._core.remote_representation",
    "dagster._core.op_concurrency_limits_counter",
    "dagster._core.execution.plan.active",
    "dagster._core.execution.plan.resume_retry",
    "dagster._core.execution.telemetry",
    "dagster._core.definitions.repository_definition.repository_data_builder",
    "dagster._utils.hosted_user_process",
    "dagster._cli.api",
    "phantora_assets.lib.phantora.run_log",
    "phantora_assets.lib.phantora.trace_decode",
    "phantora_assets.sources.analytic",
)

for _name in LAZY_MODULES:
    try:
        importlib.import_module(_name)
    except ImportError:
        pass


def _register_pandera_backends() -> None:
    """pandera registers its pandas backends on the first validation: do one."""
    import pandera.pandas as pa

    pa.DataFrameSchema({"x": pa.Column(int)}).validate(pd.DataFrame({"x": [1]}))


_register_pandera_backends()


def _freeze_heap() -> None:
    """Move every object alive now into the garbage collector's permanent generation
    (``gc.freeze``): a full collection in a run worker forked from this process then scans only
    what the run allocated. Without it, each step's ``gc.collect()`` walked the ~280,000 objects of
    the preloaded code location (~0.1-0.2 s a step, ~250 steps a build) and wrote to their pages,
    so every forked worker copied them (twice the minor page faults of a86f02d's build)."""
    gc.collect()
    gc.freeze()


_freeze_heap()
