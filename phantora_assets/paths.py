"""Where every file lives under the data root (default ``data/``). No Dagster import.

<root>/traces/<gpu>/<workload>_<layout>/   run folder, laid out like the published dataset (a profiled
                                           run: traces/<source>/<run_id>/):
    timeline.json.gz  checks.txt  checks.json  run.log  config/...
    timeline.bin (Phantora runs)  import.json (imported runs)  perfdb_missing/ (incomplete replay)
    plots/pair_heatmap.png  plots/timeseries.png  plots/step_anatomy.png  plots/link_utilisation.png
<root>/partitions/<run_id>/                per-run intermediate tables (Parquet) and sidecar records
    raw_timeline.parquet  flows.parquet  steps.parquet  step_flows.parquet  compute_events.parquet
    flows_100ms.parquet  link_bins.parquet  windows.parquet  run_summary.parquet  step_anatomy.parquet
    step_spans.parquet
    simulation.json (analytic)  kineto.json (kineto)  run_log.json  trace_summary.json  cross_check.json
<root>/imports.toml                        imported run folders (phantora-assets import)
<root>/build_state/<what>.json             what phantora-assets build built (stages/build_state.py): run.<run_id>,
                                           perf_db.<gpu>, dataset
<root>/work/<run_id>/                      Docker scratch: perfdb/<db>/ copy, out/ (timeline.bin ...)
<root>/perfdb/<gpu>/perf_db.json           the validated perf DB summary
<root>/phantora_v0/                        runs.csv flows_100ms.csv windows.csv runs.parquet README.md (the card);
                                           a link to the current generation (lib/store/generations.py)
<root>/.phantora_v0.gens/g<ns>/            the generations (the previous ones kept for a grace period)
<root>/phantora_v0/<table>/<run_id>/       part-<sha256[:16]>.parquet: flows_100ms, windows, one file per run
<root>/phantora_v0/plots/                  bytes_vs_published.png  step_time_by_layout.png
<root>/phantora.duckdb                     cross-run database (rebuilt from partitions/)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from phantora_assets.lib.run.spec import RunSpec

DATA_DIR_ENV = "PHANTORA_ASSETS_DATA_DIR"


def default_data_dir() -> Path:
    """``$PHANTORA_ASSETS_DATA_DIR`` or ``./data``."""
    return Path(os.environ.get(DATA_DIR_ENV, "data"))


def data_root_rule(root: str | Path) -> str | None:
    """Why ``root`` cannot be a data root (None: it can): it is a directory, or a path a directory can be
    made at (it does not exist and its nearest existing parent is a directory). Reads only metadata."""
    p = Path(root)
    if p.is_dir():
        return None
    if p.exists() or p.is_symlink():
        return (
            "the data root must be a directory, and this is a file"
            if p.is_file()
            else "the data root must be a directory"
        )
    for parent in p.absolute().parents:
        if parent.is_dir():
            return None
        if parent.exists() or parent.is_symlink():
            return f"the data root must be a directory, and its parent {parent} is not one"
    return None


def check_data_root(root: str | Path) -> Path:
    """``root`` as a Path when it can be a data root (:func:`data_root_rule`).

    Raises:
        FileRuleError: ``<root>: <the rule>``, before anything is read or written under it.
    """
    from phantora_assets.lib.errors import FileRuleError

    rule = data_root_rule(root)
    if rule is not None:
        raise FileRuleError(root, rule)
    return Path(root)


@dataclass(frozen=True)
class DataPaths:
    """Paths under one data root."""

    root: Path

    def run_folder(self, spec: RunSpec) -> Path:
        return self.root / spec.trace_dir

    def partition_dir(self, run_id: str) -> Path:
        return self.root / "partitions" / run_id

    def table(self, run_id: str, name: str) -> Path:
        return self.partition_dir(run_id) / f"{name}.parquet"

    def plots_dir(self, spec: RunSpec) -> Path:
        return self.run_folder(spec) / "plots"

    def chrome_trace(self, spec: RunSpec) -> Path:
        return self.run_folder(spec) / "timeline.json.gz"

    def perfdb_summary(self, gpu: str) -> Path:
        return self.root / "perfdb" / gpu / "perf_db.json"

    @property
    def dataset_dir(self) -> Path:
        return self.root / "phantora_v0"

    @property
    def dataset_plots_dir(self) -> Path:
        return self.dataset_dir / "plots"

    @property
    def duckdb_path(self) -> Path:
        return self.root / "phantora.duckdb"
