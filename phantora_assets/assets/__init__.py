"""Dagster assets, thin wrappers around ``stages/`` (one module per asset group, paired by name).

Each module has ``build(partitions) -> [AssetsDefinition]``; :func:`build_assets` makes the whole
graph for one run matrix (``definitions.build_defs`` calls it). Importing these modules does no I/O.
"""

from __future__ import annotations

import dagster as dg

from phantora_assets.assets import analysis, dataset, flows, links, simulation, traces
from phantora_assets.assets.common import RUN_ASSET_NAMES as RUN_ASSET_NAMES
from phantora_assets.assets.common import Partitions, quiet_skipped_check_warnings

#: Assets that only draw (``phantora-assets build --no-plots`` skips them).
PLOT_ASSET_NAMES = ("run_plots", "dataset_plots")
#: Unpartitioned assets materialized after every run, in order.
DATASET_ASSET_NAMES = ("phantora_v0", "dataset_duckdb", "dataset_plots")


def build_assets(p: Partitions) -> dict[str, dg.AssetsDefinition]:
    """Every asset of the graph for the partitions ``p``, by name. Also quiets Dagster's misleading
    warnings about the checks of skipped steps (``common.quiet_skipped_check_warnings``: a run
    that does not fit in GPU memory skips its assets below ``chrome_trace``)."""
    quiet_skipped_check_warnings()
    out: dict[str, dg.AssetsDefinition] = {}
    for module in (simulation, traces, flows, links, dataset, analysis):
        for a in module.build(p):
            out[a.key.to_user_string()] = a
    return out
