"""The pandera schemas of the published CSV contract (v1, ``docs/DATASET.md``, "Files
(data/phantora_v0/)") and of the perf DB tables.

No Dagster import. Units: bytes, seconds (``_s``), bytes/s, FLOP. Column descriptions are the
documentation of the contract (README links here). Schemas: ``RUNS``, ``FLOWS_100MS``,
:func:`windows_schema` (the published tables), ``PERFDB_COMPUTE`` / ``PERFDB_MEMCPY``. The column
dicts of the in-memory tables are in :mod:`phantora_assets.lib.columns`, the sidecar records in
:mod:`phantora_assets.records`.
"""

from __future__ import annotations

from pandera.pandas import Check, Column, DataFrameSchema

from phantora_assets.lib.traffic.periodicity import MIN_CYCLES
from phantora_assets.lib.traffic.window_features import FEATURES
from phantora_assets.sources import SOURCE_NAMES

#: A simulated or imported Phantora run, or a profiled run named by its import (lib/run/spec.PROFILED_SOURCES).
# phantora_<gpu>_<workload>_<layout>, then _<topology type in lower case> on a topology other than
# presets.toml's, _ocs_<mode>_<delay>ms on a reconfigured network (lib/net/optical.reconfig_tail) and
# _<name> (the entry's name, lib/run/spec._SUFFIX) (lib/run/spec.RunSpec.run_id); a workload is W1..W5 or a
# user's [workloads.NAME]. (Was without the last two: a run with name or reconfig.mode failed windows_contract.)
_RUN_ID = Check.str_matches(
    r"^(phantora_[a-z0-9_]+_[A-Za-z0-9_]+_\d+x\d+(_(fattree|railoptimized|multiplane|arbitrary))?"
    r"(_ocs_(on_demand|provisioned)_\d+(p\d+)?ms)?(_[a-z0-9][a-z0-9_]{0,39})?"
    r"|(?!phantora_)[a-z0-9][a-z0-9_]*)$"
)

#: Unit of every column of the published tables, kept in each pandera Column's ``metadata["unit"]``
#: (the dataset card's data dictionary reads it there; "" = no unit: an id, a name or a label).
_UNITS = {
    "run_id": "",
    "source": "",
    "layout": "",
    "n_nodes": "hosts",
    "step_time_s": "s",
    "inter_node_bytes_per_step": "bytes",
    "nic_bw": "bytes/s",
    "flops_per_step": "FLOP",
    "mfu": "1",
    "peak_flops": "FLOP/s",
    "alpha": "1",
    "workload": "",
    "framework": "",
    "model": "",
    "parallelism": "",
    "gpu": "",
    "gpus_per_node": "GPUs",
    "world_size": "GPUs",
    "simulator": "",
    "n_steady_steps": "steps",
    "peak_memory_gib": "GiB",
    "perf_db_fraction": "1",
    "exposed_comm_s": "s",
    "window_s": "s",
    "bin_s": "s",
    "seed": "",
    "t": "s",
    "src_node": "node index",
    "dst_node": "node index",
    "bytes": "bytes",
    "window_start_s": "s",
    "n_bins": "bins",
    **{f.name: f.unit for f in FEATURES},
}


def _with_units(schema: DataFrameSchema) -> DataFrameSchema:
    """``schema`` with ``metadata={"unit": ...}`` on every column (KeyError: a column without a unit)."""
    return schema.update_columns({c: {"metadata": {"unit": _UNITS[c]}} for c in schema.columns})


def unit(column: Column) -> str:
    """The unit of a published column (``metadata["unit"]``; "" for ids, names and labels)."""
    return str((column.metadata or {}).get("unit", ""))


PERFDB_COMPUTE = DataFrameSchema(
    {
        "op": Column(str, Check.str_length(min_value=1), description="torch op name (the key's top-level name)"),
        "key": Column(str, Check.str_startswith("{"), unique=True, description="torch call as compact JSON"),
        "nanos": Column("int64", Check.ge(0), description="kernel time, ns"),
    },
    strict=True,
    name="perfdb_compute",
)

PERFDB_MEMCPY = DataFrameSchema(
    {
        "kind": Column(str, description="copy direction, e.g. DeviceToDevice"),
        "size_bytes": Column("int64", Check.ge(0), description="bytes copied"),
        "nanos": Column("int64", Check.ge(0), description="copy time, ns"),
    },
    strict=True,
    name="perfdb_memcpy",
)

#: runs.csv: one row per run. The first 11 columns are the v1 contract, in order.
RUNS = _with_units(
    DataFrameSchema(
        {
            "run_id": Column(
                str,
                _RUN_ID,
                unique=True,
                description="phantora_<gpu>_<workload>_<nodes>x<gpus>, or a profiled run's name",
            ),
            "source": Column(
                str, description="where timing came from: phantora_v0 (Phantora traces), phantora_analytic or kineto"
            ),
            "layout": Column(str, Check.str_matches(r"^\d+x\d+$"), description="<nodes>x<gpus_per_node>"),
            "n_nodes": Column("int64", Check.ge(1), description="hosts"),
            "step_time_s": Column(float, Check.gt(0), description="median steady step, s"),
            "inter_node_bytes_per_step": Column(
                "int64", Check.ge(0), description="network bytes of one steady step, both directions"
            ),
            "nic_bw": Column(
                float,
                Check.gt(0),
                description="a host's network bandwidth, bytes/s: its link (800 Gbps = 1e11), on a multi-NIC "
                "fabric the sum of its NICs' (8 NICs of 400 Gbps = 4e11)",
            ),
            "flops_per_step": Column(
                float, Check.ge(0), nullable=True, description="model FLOP per step, all ranks (roofline timing only)"
            ),
            "mfu": Column(
                float, Check.in_range(0, 1), nullable=True, description="model FLOP utilisation (roofline timing only)"
            ),
            "peak_flops": Column(
                float, Check.gt(0), nullable=True, description="per-GPU BF16 peak, FLOP/s (roofline timing only)"
            ),
            "alpha": Column(
                float,
                Check.in_range(0, 1),
                nullable=True,
                description="roofline matmul efficiency (roofline timing only)",
            ),
            "workload": Column(
                str,
                Check.str_matches(r"^(W\d+|[a-z0-9][a-z0-9_]*)?$"),
                description="W1..W5 or a [workloads.NAME] of the run matrix; empty for a profiled run",
            ),
            "framework": Column(
                str, description="Megatron | DeepSpeed | TorchTitan (the workload), or what a profiled run used"
            ),
            "model": Column(str, description="the model of the workload (model.name; W1-W5: 4-layer slices)"),
            "parallelism": Column(str, description="e.g. tp=2,dp=4 | ep=4 | dp=4,zero=3"),
            "gpu": Column(str, description="GPU model: a key of gpus.toml, or the profiled device"),
            "gpus_per_node": Column("int64", Check.ge(1), description="GPUs per host"),
            "world_size": Column("int64", Check.ge(1), description="GPUs (ranks) in all"),
            "simulator": Column(
                str, Check.isin(list(SOURCE_NAMES)), description="which simulation source produced the trace"
            ),
            "n_steady_steps": Column("int64", Check.ge(1), description="steps of the trace after warm-up"),
            "peak_memory_gib": Column(
                float, Check.ge(0), nullable=True, description="per-GPU peak memory estimate, GiB"
            ),
            "perf_db_fraction": Column(
                float,
                Check.in_range(0, 1),
                nullable=True,
                description="share of the analytic simulator's compute time timed by the GPU's perf DB "
                "(the rest by the roofline); null for Phantora traces",
            ),
            "exposed_comm_s": Column(
                float,
                Check.ge(0),
                nullable=True,
                description="analytic simulator: steady step time minus rank 0's compute-stream busy "
                "time, s; null for Phantora traces",
            ),
            "window_s": Column(float, Check.gt(0), description="length of the flows_100ms window, s"),
            "bin_s": Column(float, Check.gt(0), description="bin length, s"),
            "seed": Column("int64", description="seed of the build's randomness (from run_id)"),
        },
        strict=True,
        ordered=True,
        name="runs",
    )
)

#: flows_100ms.csv: bytes sent src_node -> dst_node in the bin starting at t.
FLOWS_100MS = _with_units(
    DataFrameSchema(
        {
            "run_id": Column(str, _RUN_ID, description="the run (runs.run_id)"),
            "t": Column(float, [Check.ge(0), Check.lt(180.0)], description="bin start, s"),
            "src_node": Column("int64", Check.ge(0), description="sending host: host-k is node k-1"),
            "dst_node": Column("int64", Check.ge(0), description="receiving host (!= src_node)"),
            "bytes": Column("int64", Check.ge(0), description="bytes in the bin"),
        },
        checks=[Check(lambda df: (df["src_node"] != df["dst_node"]).all(), error="src_node == dst_node")],
        unique=["run_id", "t", "src_node", "dst_node"],
        strict=True,
        ordered=True,
        name="flows_100ms",
    )
)


def windows_schema() -> DataFrameSchema:
    """windows.csv: one row per (run_id, window_s, window_start_s); features from the registry.

    Each feature's column gets its dtype, nullability and valid range from
    :data:`phantora_assets.lib.traffic.window_features.FEATURES`; the frame-level checks tie the
    features to each other (mean x bins = total, mean <= p95 <= max, a period within the
    window's search range, NaN period iff NaN periodicity).
    """

    cols: dict[str, Column] = {
        "run_id": Column(str, _RUN_ID, description="the run (runs.run_id)"),
        "window_s": Column(float, Check.isin([1.0, 15.0]), description="window length, s"),
        "window_start_s": Column(float, Check.ge(0), description="window start, s"),
        "n_bins": Column("int64", Check.ge(1), description="bins of the run's bin_s (runs.bin_s) in the window"),
    }
    for f in FEATURES:
        checks = []
        if f.ge is not None:
            checks.append(Check.ge(f.ge))
        if f.le is not None:
            checks.append(Check.le(f.le))
        cols[f.name] = Column(
            float if f.dtype == "float64" else f.dtype,
            checks,
            nullable=f.nullable,
            description=f"{f.formula} [{f.unit}]",
        )

    def _close(a, b):
        return (a - b).abs() <= 1e-6 * b.abs().clip(lower=1.0)

    frame_checks = [
        Check(
            lambda df: _close(df["bin_mean_bytes"] * df["n_bins"], df["total_bytes"].astype(float)),
            error="bin_mean_bytes * n_bins != total_bytes",
        ),
        Check(
            lambda df: df["bin_p95_bytes"] <= df["bin_max_bytes"] * (1 + 1e-12), error="bin_p95_bytes > bin_max_bytes"
        ),
        Check(
            lambda df: df["bin_mean_bytes"] <= df["bin_max_bytes"] * (1 + 1e-12), error="bin_mean_bytes > bin_max_bytes"
        ),
        Check(
            lambda df: df["bytes_per_active_pair"] * df["n_active_pairs"] <= df["total_bytes"] * (1 + 1e-12),
            error="bytes of the active pairs exceed total_bytes",
        ),
        Check(
            lambda df: df["dominant_period_s"].isna() == df["periodicity"].isna(),
            error="dominant_period_s and periodicity must be NaN together",
        ),
        # 2 bins <= period <= window / MIN_CYCLES (bin length = window_s / n_bins for a whole window)
        Check(
            lambda df: (
                df["dominant_period_s"].isna()
                | (
                    (df["dominant_period_s"] >= 2 * df["window_s"] / df["n_bins"] * (1 - 1e-9))
                    & (df["dominant_period_s"] <= df["window_s"] / MIN_CYCLES * (1 + 1e-9))
                )
            ),
            error="dominant_period_s outside [2 bins, window / 2]",
        ),
        Check(
            lambda df: (
                df["spectral_peak_hz"].isna()
                | (df["spectral_peak_hz"] <= df["n_bins"] / (2 * df["window_s"]) * (1 + 1e-9))
            ),
            error="spectral_peak_hz above the Nyquist frequency",
        ),
    ]
    return _with_units(
        DataFrameSchema(
            cols,
            checks=frame_checks,
            strict=True,
            ordered=True,
            unique=["run_id", "window_s", "window_start_s"],
            name="windows",
        )
    )
