"""A built run as Chakra execution traces: one ``<prefix>.<rank>.et`` per rank and
``<prefix>.comm_groups.json`` (``phantora-assets chakra RUN_ID OUT_DIR``). No Dagster import.

Input: the run's Chrome trace (every flow, loopback too, and every Computation event, placed on
its rank by ``compute.rank_compute_events``) and its ``steps.parquet`` / ``flows.parquet``
(``validated_flows``). Only the steady steps are written: the events of the window from the first
steady step's start to the last one's end; a collective belongs to the step ``flows.parquet``
gives its network flows, else (all its hops inside one host) to the step its start falls in.

The caller of a flow is global rank ``src_node * gpus_per_node + (stream >> 32)`` (the stream's
CUDA device is the local GPU). A communicator's members are its callers by ``comm_rank``; one
that only broadcasts shows its root and the hosts it sends to, and its other members are taken
as the lowest ranks of those hosts, in rank order (an assumption, as in Phantora's host-level
flows). Communicators are numbered ``1, 2, ...`` in order of their member lists:
``comm_groups.json`` maps that number (a string) to the members in group-rank order, the format
of ASTRA-sim's ``--comm-group-configuration``, and each collective node names it in ``pg_name``.

Each rank's file: the GlobalMetadata record (version ``et_io.SCHEMA_VERSION``; ``source``,
``run_id``, ``rank``, ``world_size``, ``gpus_per_node``, ``steady_steps``, ``first_step``), then in
issue order (start time, compute before communication at a tie) COMP_NODEs (name = the kernel or
op, ``duration_micros``) and communication nodes, all with ``is_cpu_op = false``, a ``stream``
attribute (the trace's ``(device << 32) | stream id``), ``start_time_micros`` since the window's
start, and ``ctrl_deps`` on the previous node of the same stream; a communication node also has
``data_deps`` on the last compute node of its rank that ended before it started. ``comm_size``
is the bytes of the collective's input buffer, as Chakra's PyTorch converter writes it and as
ASTRA-sim reads it (``S = count x dtype size``; n = group size; per-hop bytes are
``docs/PHANTORA_FORMATS.md`` section 4):

===================  =================  ===================================================
op (comm_type)       comm_size          the rank's ring flow(s)
===================  =================  ===================================================
all-reduce (0)       S                  one hop of floor(comm_size * 2(n-1) / n)
all-gather (2)       S (per-rank)       one hop of (n-1) * comm_size
reduce-scatter (7)   n * S (per-rank S) one hop of (n-1) * comm_size / n
broadcast (5)        S                  the root (``comm_src``): n-1 flows of comm_size
all-to-all (6)       n * S              n-1 flows of comm_size / n, one to every other rank
send / recv (5, 6)   S                  COMM_SEND_NODE (``comm_dst``): one flow; COMM_RECV_NODE
                                        (``comm_src``) on the peer: none
===================  =================  ===================================================

Phantora issues an all-to-all as grouped ``NcclSend``s: a rank's sends on one communicator at
one instant, one of S bytes to every other member, are one ALL_TO_ALL node; other sends are
COMM_SEND / COMM_RECV pairs (peer: the lowest member on the destination host not yet used by
that batch). So, per rank, the collective nodes of a steady window expand by the table to exactly
the flows the rank sends in it (``tests/integration/test_chakra.py`` checks it against ``flows.parquet``).
"""

from __future__ import annotations

import json
from bisect import bisect_right, insort
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from phantora_assets.lib.chakra.compute import rank_compute_events
from phantora_assets.lib.chakra.et_io import (
    COMM_COLL_NODE,
    COMM_RECV_NODE,
    COMM_SEND_NODE,
    COMP_NODE,
    OP_COMM_TYPES,
    EtNode,
    write_et,
)
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.phantora.chrome_trace import read_trace
from phantora_assets.lib.store.io import atomic_write_text

SOURCE_NAME = "phantora_assets"


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_run` wrote: the files, and per rank the nodes by kind
    (``compute``, ``collective``, ``send``, ``recv``)."""

    files: list[Path]
    comm_groups: Path
    nodes: dict[int, dict[str, int]]
    steady_steps: list[int]


def check_out(out_dir: Path, prefix: str) -> None:
    """Refuse, before any work, an export that would not land as ``out_dir/<prefix>.<rank>.et``.

    Raises:
        ValueError: ``prefix`` is not a plain file name (empty, ``.`` / ``..``, or holding a path
            separator: it would write into another folder, ``../x`` outside ``out_dir``), or
            ``out_dir`` exists and is not a folder.
    """
    if prefix in ("", ".", "..") or "/" in prefix or "\\" in prefix or "\0" in prefix:
        raise ValueError(f"prefix {prefix!r}: a plain file name (no path separator, not '.' or '..') is needed")
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"{out_dir}: exists and is not a folder; the ETs are written into a folder")


def _steps_of(flows: pd.DataFrame, table: pd.DataFrame, steps: pd.DataFrame) -> np.ndarray:
    """The step of every flow's collective (module docstring)."""
    step_by_id = dict(zip(table["flow_id"], table["step"]))
    starts = steps["start_us"].tolist()
    end = float(steps["end_us"].max())
    key = list(zip(flows["comm_id"], flows["op"], flows["ts_us"]))
    known: dict[tuple, int] = {}
    for k, fid in zip(key, flows["flow_id"]):
        if fid in step_by_id:
            known.setdefault(k, int(step_by_id[fid]))
    out = np.empty(len(flows), dtype=np.int64)
    for i, (k, ts) in enumerate(zip(key, flows["ts_us"])):
        s = known.get(k)
        if s is None:
            j = bisect_right(starts, ts) - 1
            s = int(steps["step"].iloc[j]) if j >= 0 and ts < end else -1
        out[i] = s
    return out


def _members(flows: pd.DataFrame, gpus_per_node: int) -> dict[str, list[int]]:
    """Communicator id -> global ranks in group-rank order (module docstring)."""
    out: dict[str, list[int]] = {}
    for cid, g in flows.groupby("comm_id", sort=True):
        by_rank: dict[int, int] = {}
        for cr, caller, op in zip(g["comm_rank"], g["caller"], g["op"]):
            if op != "broadcast" or cr not in by_rank:
                by_rank.setdefault(int(cr), int(caller))
        bc = g[g["op"] == "broadcast"]
        if len(bc) and len(by_rank) <= 1:  # broadcast only: the root and the hosts it sends to
            first = bc[bc["ts_us"] == bc["ts_us"].min()]
            taken = set(by_rank.values())
            per_host = first["dst_node"].value_counts().sort_index()
            others = []
            for node, k in per_host.items():
                free = [r for r in range(node * gpus_per_node, (node + 1) * gpus_per_node) if r not in taken]
                others += free[:k]
            root = int(first["root"].iloc[0]) if int(first["root"].iloc[0]) >= 0 else 0
            ranks = sorted(others)
            ranks.insert(root, by_rank.get(root, int(first["caller"].iloc[0])))
            out[str(cid)] = ranks
            continue
        n = max(by_rank) + 1
        if sorted(by_rank) != list(range(n)):
            raise TraceFormatError("<trace>", "communicator ranks", f"communicator {cid}: comm ranks {sorted(by_rank)}")
        out[str(cid)] = [by_rank[i] for i in range(n)]
    return out


def export_run(  # noqa: C901, PLR0912, PLR0915 (one pass over the run's collectives, a branch per op kind)
    trace: Path, steps: pd.DataFrame, table: pd.DataFrame, out_dir: Path, prefix: str, run_id: str, gpus_per_node: int,
    world_size: int,
) -> ExportSummary:  # fmt: skip
    """Write the run's ETs and comm groups under ``out_dir`` (module docstring).

    Args:
        trace: the run's ``timeline.json.gz``. steps / table: its ``steps.parquet`` and ``flows.parquet``.
        prefix: file prefix (``<prefix>.<rank>.et``). gpus_per_node / world_size: the layout.

    Raises:
        TraceFormatError: the trace breaks a rule (``rank placement``: a GPU beyond the layout,
            ``communicator ranks``: a communicator's ranks are not 0..n-1), naming the file.
        ValueError: the run has no steady step; ``out_dir`` / ``prefix`` as :func:`check_out`.
    """
    check_out(out_dir, prefix)
    steady = steps[steps["steady"]].sort_values("start_us")
    if steady.empty:
        raise ValueError(f"{trace}: the run has no steady step to export")
    w0, w1 = float(steady["start_us"].min()), float(steady["end_us"].max())
    flows = read_trace(trace).flows.copy()
    dev = flows["stream"].to_numpy(np.int64) >> 32
    if len(flows) and (dev.max() >= gpus_per_node or dev.min() < 0):
        raise TraceFormatError(trace, "rank placement", f"a flow on GPU {int(dev.max())}, a host has {gpus_per_node}")
    flows["caller"] = flows["src_node"].to_numpy(np.int64) * gpus_per_node + dev
    members = _members(flows, gpus_per_node)
    flows["step"] = _steps_of(flows, table, steps)
    flows = flows[flows["step"].isin(set(steady["step"]))].sort_values(["ts_us", "flow_id"], kind="stable")
    order = sorted(members, key=lambda c: (members[c], c))
    pg = {c: str(i + 1) for i, c in enumerate(order)}
    events: dict[int, list[tuple[float, int, EtNode]]] = defaultdict(list)  # rank -> (ts, kind, node)

    def comm(rank: int, ts: float, dur: float, name: str, ntype: int, stream: int, **attrs: Any) -> None:
        node = EtNode(0, name, ntype, start_us=round(ts - w0), dur_us=round(dur), attrs={"is_cpu_op": False, **attrs})
        node.attrs["stream"] = int(stream)
        events[rank].append((ts, 1, node))

    tag = 0
    for (cid, op, ts), g in flows.groupby(["comm_id", "op", "ts_us"], sort=False):
        group, name = members[str(cid)], str(g["call"].iloc[0])
        n, size = len(group), int(g["count"].iloc[0]) * int(g["dtype_bytes"].iloc[0])
        dur = float(g["dur_us"].max())
        base = {"pg_name": pg[str(cid)]}
        if op in ("all_reduce", "all_gather", "reduce_scatter"):
            nbytes = n * size if op == "reduce_scatter" else size
            for caller, d, st in zip(g["caller"], g["dur_us"], g["stream"]):
                comm(
                    int(caller), ts, d, name, COMM_COLL_NODE, st, comm_type=OP_COMM_TYPES[op], comm_size=nbytes, **base
                )
        elif op == "broadcast":
            root, st = int(g["caller"].iloc[0]), int(g["stream"].iloc[0])
            for r in group:
                comm(r, ts, dur, name, COMM_COLL_NODE, st, comm_type=5, comm_size=size, comm_src=root, **base)
        else:  # grouped sends of each caller
            for caller, s in g.groupby("caller", sort=True):
                caller, st = int(caller), int(s["stream"].iloc[0])
                others = [r for r in group if r != caller]
                hosts = sorted(r // gpus_per_node for r in others)
                uniform = len(set(s["bytes"])) == 1 and sorted(s["dst_node"]) == hosts and len(others) == len(s)
                if uniform:
                    comm(caller, ts, dur, "NcclAllToAll", COMM_COLL_NODE, st, comm_type=6,
                         comm_size=n * int(s["bytes"].iloc[0]), **base)  # fmt: skip
                    continue
                used: set[int] = set()
                for b, node, d in zip(s["bytes"], s["dst_node"], s["dur_us"]):
                    peer = next((r for r in others if r // gpus_per_node == node and r not in used), None)
                    if peer is None:
                        raise TraceFormatError(trace, "send peer", f"a send of rank {caller} to host-{node + 1}")
                    used.add(peer)
                    tag += 1
                    kw = {"comm_size": int(b), "comm_tag": tag, **base}
                    comm(caller, ts, d, "NcclSend", COMM_SEND_NODE, st, comm_src=caller, comm_dst=peer, **kw)
                    comm(peer, ts, d, "NcclRecv", COMM_RECV_NODE, st, comm_src=caller, comm_dst=peer, **kw)
    compute = rank_compute_events(trace, gpus_per_node)
    compute = compute[(compute["ts_us"] >= w0) & (compute["ts_us"] < w1)]
    for r, nm, ts, d, st in zip(
        compute["rank"], compute["name"], compute["ts_us"], compute["dur_us"], compute["stream"]
    ):
        node = EtNode(0, str(nm), COMP_NODE, start_us=round(ts - w0), dur_us=round(d))
        node.attrs = {"is_cpu_op": False, "stream": int(st)}
        events[int(r)].append((float(ts), 0, node))
    out_dir.mkdir(parents=True, exist_ok=True)
    files, counts = [], {}
    kinds = {COMP_NODE: "compute", COMM_COLL_NODE: "collective", COMM_SEND_NODE: "send", COMM_RECV_NODE: "recv"}
    for rank in range(world_size):
        nodes = [e[2] for e in sorted(events.get(rank, []), key=lambda e: (e[0], e[1]))]
        last: dict[int, int] = {}
        ends: list[tuple[int, int]] = []  # (end us, id) of the compute nodes so far, sorted
        for i, node in enumerate(nodes, start=1):
            node.id = i
            st = node.attrs["stream"]
            node.ctrl_deps = [last[st]] if st in last else []
            last[st] = i
            if node.type == COMP_NODE:
                insort(ends, (node.start_us + node.dur_us, i))
            else:
                k = bisect_right(ends, (node.start_us, len(nodes) + 1))
                node.data_deps = [ends[k - 1][1]] if k else []
        meta = {"source": SOURCE_NAME, "run_id": run_id, "rank": rank, "world_size": world_size,
                "gpus_per_node": gpus_per_node, "steady_steps": len(steady),
                "first_step": int(steady["step"].iloc[0])}  # fmt: skip
        path = out_dir / f"{prefix}.{rank}.et"
        write_et(path, meta, nodes)
        files.append(path)
        counts[rank] = {k: sum(n.type == t for n in nodes) for t, k in kinds.items()}
    groups = out_dir / f"{prefix}.comm_groups.json"
    atomic_write_text(groups, json.dumps({pg[c]: members[c] for c in order}, indent=1) + "\n")
    return ExportSummary(files, groups, counts, [int(s) for s in steady["step"]])
