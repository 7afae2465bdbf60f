"""Column contracts of the in-memory tables passed between stages (no Dagster, no pandera).

Each constant lists the columns (name -> dtype) of one pandas DataFrame. Producers emit exactly
these columns (extra columns only where noted); consumers may rely on them. Units are in the
names (``_ns``, ``_us``, ``_s``, bytes). The pandera schemas of the published tables are in
:mod:`phantora_assets.contracts`.
"""

from __future__ import annotations

#: Raw timeline of the analytic simulator: one row per event (an Action with its final Span).
#: Communication rows describe one flow; computation rows one kernel / torch op of one rank.
RAW_TIMELINE_COLUMNS: dict[str, str] = {
    "event_id": "int64",  # unique id (Phantora Action id)
    "kind": "str",  # "communication" | "computation"
    "name": "str",  # event name (kernel or torch op, or the NCCL call name)
    "start_ns": "int64",  # simulated ns since the first span of the run
    "end_ns": "int64",  # >= start_ns
    "src_host": "str",  # host of the flow's source, or the computing host ("host-1" ...)
    "dst_host": "str",  # host of the flow's destination ("" for computation)
    "bytes": "int64",  # flow bytes (0 for computation)
    # NcclAllReduce | NcclAllGather | NcclReduceScatter | NcclBcast | NcclSend | NcclRecv ("" for computation)
    "call": "str",
    "count": "int64",  # NCCL count argument (0 for computation)
    "dtype": "str",  # Phantora dtype name, e.g. "Bf16" ("" for computation)
    "reduce_op": "str",  # "Sum" for all-reduce / reduce-scatter, else ""
    "root": "int64",  # broadcast root rank, else -1
    "comm_id_hex": "str",  # 256 hex chars = the 128-byte NCCL communicator id ("" for computation)
    "comm_rank": "int64",  # caller's rank in the communicator (-1 for computation)
    "stream_device": "int64",  # CUDA device of the stream (local GPU index)
    "stream_id": "int64",  # CUDA stream id
    "os_pid": "int64",  # OS pid of the rank process (computation events)
    "meta_json": "str",  # computation meta as compact JSON ({"Torch": {...}} or {"Cuda": {...}}), "" for communication
}

#: Network/loopback flows parsed from a Chrome JSON trace: one row per Communication event.
FLOW_COLUMNS: dict[str, str] = {
    "flow_id": "int64",  # args.Communication[0].id
    "ts_us": "float64",  # event ts, simulated microseconds
    "dur_us": "float64",  # event dur, microseconds (0 for collectives <= 4 KiB)
    "src_host": "str",  # "host-1" ...
    "dst_host": "str",
    "src_node": "int64",  # host-k -> node k-1
    "dst_node": "int64",
    "bytes": "int64",  # flow bytes
    "call": "str",  # NCCL call name, e.g. "NcclAllReduce"
    "op": "str",  # all_reduce | all_gather | reduce_scatter | broadcast | send | recv
    "dtype": "str",  # "Bf16" ...
    "dtype_bytes": "int64",
    "count": "int64",
    "comm_id": "str",  # 16 hex chars: blake2b(digest_size=8) of the 128 communicator id bytes
    "comm_rank": "int64",  # caller's rank in the communicator
    "root": "int64",  # broadcast root, else -1
    "stream": "int64",  # event tid = (device << 32) | stream id
    "name": "str",  # event name
}

#: Per-host summary of Computation events (they are not kept whole).
COMPUTE_SUMMARY_COLUMNS: dict[str, str] = {
    "host": "str",
    "n_events": "int64",
    "busy_us": "float64",  # sum of dur
    "first_ts_us": "float64",
    "last_end_us": "float64",
}

#: Output of step detection: one row per step of the run.
STEP_COLUMNS: dict[str, str] = {
    "step": "int64",  # 0-based step index in trace order
    "start_us": "float64",  # earliest start of the step's first collectives across communicators
    "end_us": "float64",  # start of the next step (last step: end of its last flow)
    "duration_us": "float64",
    "steady": "bool",  # False for warm-up steps (and the partial/unbounded last one if untimed)
    # steady and its end is the step's own end (the next step's start, or the framework's step marker): its
    # duration is a step time. False for the last step of a trace whose end is its last flow's (cut by the
    # trace's end: the compute after that flow is missing); average times over these, bytes over steady
    "timed": "bool",
    "network_bytes": "int64",  # bytes of the step's flows with src_node != dst_node
    "n_flows": "int64",
    "outlier": "str",  # why a steady step is kept although it is > 10 % off the median (eval, checkpoint), else ""
}

#: One steady step's network flows, the input of the 180 s build.
STEP_FLOW_COLUMNS: dict[str, str] = {
    "offset_us": "float64",  # flow start minus the step's start_us, >= 0
    "dur_us": "float64",  # >= 0
    "src_node": "int64",
    "dst_node": "int64",  # != src_node
    "bytes": "int64",
}

#: flows_100ms rows (the v1 contract): bytes sent src_node -> dst_node in the bin starting at t.
BIN_COLUMNS: dict[str, str] = {
    "run_id": "str",
    "t": "float64",  # bin start, seconds, multiple of the bin length, 0 <= t < window
    "src_node": "int64",
    "dst_node": "int64",
    "bytes": "int64",
}
