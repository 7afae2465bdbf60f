"""A folder of Chakra ETs (``<prefix>.<rank>.et``, one per rank, and ``<prefix>.comm_groups.json``
when present) as one run's raw timeline (``columns.RAW_TIMELINE_COLUMNS``). No Dagster import.

Every rank 0..N-1 must have its file (ASTRA-sim reads one per NPU). Rank r is placed on
``host-(r // gpus_per_node + 1)``. A node's ``pg_name`` names its group in the comm-groups file
(members in group-rank order); without the file, a group is the ranks whose ETs name it, in rank
order, and a node without ``pg_name`` is on the whole world (ASTRA-sim's default). Times are the
nodes' ``start_time_micros`` and ``duration_micros`` (whole us).

Collectives (COMM_COLL nodes with ``comm_type``; the CPU-side COMM_COLL nodes Chakra's converter
writes without one launch them and are not flows) become Phantora's ring flows by the table of
``export.py`` (``docs/PHANTORA_FORMATS.md`` section 4), each rank's node giving the flows that
rank sends: all-reduce one hop of floor(comm_size * 2(n-1)/n), all-gather one of (n-1) *
comm_size, reduce-scatter one of (n-1) * comm_size / n (integer division), broadcast n-1 flows of
comm_size from the root (``comm_src``, else group rank 0), all-to-all n-1 flows of comm_size / n,
COMM_SEND_NODE one flow of comm_size to ``comm_dst`` (COMM_RECV_NODE: none, the sender gives it).
The flows are written with dtype ``U8`` and count = bytes (Phantora's own encoding of its p2p
flows), so the bytes are exact; barriers are not flows. Compute: every COMP_NODE that is not a
CPU op (``is_cpu_op`` false or absent) is a Computation event of its rank.

Errors (each names the file and the rule): ``invalid ET``, ``no ET`` (no ``*.<rank>.et``),
``missing rank``, ``layout`` (``gpus_per_node`` does not divide the world size), ``comm groups``
(the JSON is not ``{"<id>": [ranks]}`` of distinct ranks of the world, a node's rank is not in its
group, a broadcast root outside it), ``invalid ET`` (a node's ``comm_type``, ``comm_size``,
``comm_src`` or ``comm_dst`` missing, not an integer, negative or beyond the world), ``ranks
disagree`` (the members of a group issue different collectives on it: count, kind, ``comm_size``;
all-to-all: kind; every rank's ET is present, so every group is cross-checked), ``no ring rule``
(REDUCE, GATHER, SCATTER, REDUCE_SCATTER_BLOCK: Phantora has no ring rule for them).
"""

from __future__ import annotations

import json
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from phantora_assets.lib.chakra.et_io import (
    COMM_COLL_NODE,
    COMM_SEND_NODE,
    COMM_TYPE_OPS,
    COMP_NODE,
    EtFile,
    EtNode,
    et_files,
    read_et,
)
from phantora_assets.lib.columns import RAW_TIMELINE_COLUMNS
from phantora_assets.lib.errors import FileRuleError, TraceFormatError
from phantora_assets.lib.kineto.collectives import comm_hex

WORLD = "world"
BARRIER = 9
_CALL = {"all_reduce": "NcclAllReduce", "all_gather": "NcclAllGather", "reduce_scatter": "NcclReduceScatter",
         "broadcast": "NcclBcast", "all_to_all": "NcclSend", "send": "NcclSend"}  # fmt: skip


@dataclass(frozen=True)
class ChakraRun:
    """The ETs of one job (:func:`read_folder`): ``ets`` by rank, ``groups`` pg_name -> ranks."""

    folder: Path
    ets: dict[int, EtFile]
    groups: dict[str, list[int]]
    gpus_per_node: int
    groups_file: Path | None

    @property
    def world_size(self) -> int:
        return len(self.ets)

    @property
    def n_nodes(self) -> int:
        return self.world_size // self.gpus_per_node


def is_et_folder(folder: str | Path) -> bool:
    """True when ``folder`` holds ``*.<rank>.et`` files directly."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    try:
        return bool(et_files(folder))
    except FileRuleError:  # a link or two prefixes: the import declines it with the rule
        return True


def _groups_file(folder: Path) -> Path | None:
    """The folder's one ``*.comm_groups.json``, or None. Raises FileRuleError: it is a link
    (``symlink in run folder``: never followed) or no regular file (a FIFO, a directory), or there
    are several (``comm groups``: which one holds the groups is ambiguous)."""
    found = sorted(p for p in folder.glob("*.comm_groups.json") if not p.name.startswith("."))
    for p in found:
        mode = p.lstat().st_mode
        if stat.S_ISLNK(mode):
            raise FileRuleError(p, "symlink in run folder", "the import does not follow links")
        if not stat.S_ISREG(mode):
            raise FileRuleError(p, "not a regular file", "the comm groups must be a regular file")
    if len(found) > 1:
        raise TraceFormatError(
            found[1], "comm groups", f"one comm-groups file per folder, found {[p.name for p in found]}"
        )
    return found[0] if found else None


def read_folder(folder: str | Path, gpus_per_node: int) -> ChakraRun:
    """Read every ET of ``folder`` and its comm groups (module docstring).

    Raises:
        TraceFormatError: ``no ET``, ``missing rank``, ``layout``, ``comm groups``, ``invalid ET``.
    """
    folder = Path(folder)
    files = et_files(folder)
    if not files:
        raise TraceFormatError(folder, "no ET", "no <prefix>.<rank>.et Chakra execution trace in the folder")
    missing = sorted(set(range(max(files) + 1)) - set(files))
    if missing:
        raise TraceFormatError(folder, "missing rank", f"no ET for rank(s) {missing[:10]} (one file per rank)")
    world = len(files)
    if gpus_per_node < 1 or world % gpus_per_node:
        raise TraceFormatError(folder, "layout", f"--gpus-per-node {gpus_per_node} does not divide {world} ranks")
    ets = {r: read_et(p) for r, p in files.items()}
    gfile = _groups_file(folder)
    groups: dict[str, list[int]] = {}
    if gfile is not None:
        groups = _read_groups(gfile, world)
    else:
        for r, et in ets.items():
            for n in et.nodes:
                if n.type in (COMM_COLL_NODE, COMM_SEND_NODE) and "pg_name" in n.attrs:
                    groups.setdefault(str(n.attrs["pg_name"]), [])
                    if r not in groups[str(n.attrs["pg_name"])]:
                        groups[str(n.attrs["pg_name"])].append(r)
    groups.setdefault(WORLD, list(range(world)))
    return ChakraRun(folder, ets, groups, gpus_per_node, gfile)


def _read_groups(gfile: Path, world: int) -> dict[str, list[int]]:
    """``{"<id>": [ranks]}`` of the comm-groups file: each a list of distinct integer ranks of the
    world (0..world-1), in group-rank order. Raises TraceFormatError ``comm groups``."""
    try:
        data = json.loads(gfile.read_text())
    except (ValueError, OSError, RecursionError) as exc:
        raise TraceFormatError(gfile, "comm groups", f'not {{"<id>": [ranks]}} JSON: {exc}') from None
    if not isinstance(data, dict):
        raise TraceFormatError(gfile, "comm groups", f'not {{"<id>": [ranks]}}: a {type(data).__name__}')
    groups: dict[str, list[int]] = {}
    for k, v in data.items():
        if not isinstance(v, list) or not v or not all(isinstance(r, int) and not isinstance(r, bool) for r in v):
            raise TraceFormatError(gfile, "comm groups", f"group {k!r}: not a list of integer ranks: {v!r}")
        if len(set(v)) != len(v) or not all(0 <= r < world for r in v):
            raise TraceFormatError(
                gfile, "comm groups", f"group {k!r}: {v} lists a rank twice or outside the {world} ranks' ETs"
            )
        groups[str(k)] = list(v)
    return groups


def _int_attr(n: EtNode, et: EtFile, key: str, lo: int = 0, hi: int = 1 << 62) -> int:
    """Attribute ``key`` of node ``n``: an integer in [lo, hi). Raises TraceFormatError ``invalid ET``."""
    v = n.attrs.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v < hi:
        what = "missing" if v is None else f"{v!r} is not an integer in [{lo}, {hi})"
        raise TraceFormatError(et.path, "invalid ET", f"node {n.id} {n.name!r}: {key} {what}")
    return v


def _cross_check(run: ChakraRun, seqs: dict[str, dict[int, list[tuple]]]) -> None:
    """Every member of a group issues the same collectives on it (count, kind, comm_size; all-to-all:
    kind only). Raises TraceFormatError ``ranks disagree`` naming both files."""
    for pg, per in sorted(seqs.items()):
        first = run.groups[pg][0]
        ref = per.get(first, [])
        for r in run.groups[pg]:
            seq = per.get(r, [])
            if seq != ref:
                k = next((i for i, (x, y) in enumerate(zip(ref, seq, strict=False)) if x != y), min(len(ref), len(seq)))
                raise TraceFormatError(
                    run.ets[r].path,
                    "ranks disagree",
                    f"group {pg!r}: rank {r} issues {len(seq)} collectives, rank {first} "
                    f"({run.ets[first].path.name}) {len(ref)}; first difference at #{k}: "
                    f"{seq[k] if k < len(seq) else 'none'} vs {ref[k] if k < len(ref) else 'none'}",
                )


def _stream(attrs: dict, default: int) -> int:
    s = attrs.get("stream", attrs.get("tid", default))
    return int(s) & 0xFFFFFFFF if isinstance(s, int) else default


def raw_timeline(run: ChakraRun) -> tuple[pd.DataFrame, dict[str, int]]:  # noqa: C901, PLR0912, PLR0915 (one pass over the nodes, a named rule per node kind)
    """The run's raw timeline (module docstring) and counts of what it read (``collectives``,
    ``sends``, ``compute``, ``skipped`` CPU-side or barrier nodes).

    Raises:
        TraceFormatError: ``no ring rule``, ``comm groups`` (names the ET file; also a broadcast
            root outside its group), ``invalid ET`` (``comm_type``, ``comm_size``, ``comm_src`` or
            ``comm_dst`` missing where needed, not an integer, negative, beyond the world or
            2**62), ``ranks disagree`` (:func:`_cross_check`).
    """
    cols = [c for c in RAW_TIMELINE_COLUMNS if c != "event_id"]
    gpn = run.gpus_per_node
    rows: list[tuple] = []
    comp: list[tuple] = []
    counts = {"collectives": 0, "sends": 0, "compute": 0, "skipped": 0}

    def host(r: int) -> str:
        return f"host-{r // gpn + 1}"

    seqs: dict[str, dict[int, list[tuple]]] = {}  # pg -> rank -> (op, comm_size) in issue order
    world = run.world_size
    for rank, et in sorted(run.ets.items()):
        for n in et.nodes:
            start, end = n.start_us * 1000, (n.start_us + n.dur_us) * 1000
            if n.type == COMP_NODE:
                if n.attrs.get("is_cpu_op", False) is not True:
                    comp.append((n.name, start, end, host(rank), rank % gpn, _stream(n.attrs, 7), rank))
                    counts["compute"] += 1
                continue
            if n.type == COMM_SEND_NODE:
                op = "send"
            elif n.is_collective:
                ctype = _int_attr(n, et, "comm_type", 0, 1 << 31)
                if ctype == BARRIER:
                    counts["skipped"] += 1
                    seqs.setdefault(str(n.attrs.get("pg_name", WORLD)), {}).setdefault(rank, []).append(("barrier",))
                    continue
                if ctype not in COMM_TYPE_OPS:
                    raise TraceFormatError(et.path, "no ring rule", f"node {n.id} {n.name!r}: comm_type {ctype}")
                op = COMM_TYPE_OPS[ctype]
            else:
                counts["skipped"] += n.type == COMM_COLL_NODE
                continue
            pg = str(n.attrs.get("pg_name", WORLD))
            group = run.groups.get(pg)
            if group is None or rank not in group:
                raise TraceFormatError(et.path, "comm groups", f"node {n.id}: rank {rank} is not in group {pg!r}")
            size, g, k = _int_attr(n, et, "comm_size"), len(group), group.index(rank)
            counts["sends" if op == "send" else "collectives"] += 1
            if op != "send":
                seqs.setdefault(pg, {}).setdefault(rank, []).append((op,) if op == "all_to_all" else (op, size))
            if g <= 1:
                continue
            flows: list[tuple[int, int, int, int]] = []  # (dst rank, bytes, count, root)
            if op == "all_reduce":
                flows = [(group[(k + 1) % g], size * 2 * (g - 1) // g, size, -1)]
            elif op == "all_gather":
                flows = [(group[(k + 1) % g], (g - 1) * size, size, -1)]
            elif op == "reduce_scatter":
                flows = [(group[(k + 1) % g], (g - 1) * (size // g), size // g, -1)]
            elif op == "broadcast":
                root = _int_attr(n, et, "comm_src", 0, world) if "comm_src" in n.attrs else group[0]
                if root not in group:
                    raise TraceFormatError(et.path, "comm groups", f"node {n.id}: broadcast root {root} not in {pg!r}")
                if rank == root:
                    flows = [(r, size, size, k) for r in group if r != rank]
            elif op == "all_to_all":
                flows = [(r, size // g, size // g, -1) for r in group if r != rank]
            else:
                flows = [(_int_attr(n, et, "comm_dst", 0, world), size, size, -1)]
            cid = comm_hex(f"chakra:{pg}")
            for dst, nbytes, count, root in flows:
                if nbytes <= 0:
                    continue
                call = _CALL[op]
                rows.append(
                    ("communication", call, start, end, host(rank), host(dst), nbytes, call, count, "U8",
                     "Sum" if op in ("all_reduce", "reduce_scatter") else "", root, cid, k, rank % gpn,
                     _stream(n.attrs, 13), 0, "")
                )  # fmt: skip
    _cross_check(run, seqs)
    parts = [pd.DataFrame.from_records(rows, columns=cols)]
    if comp:
        c = pd.DataFrame.from_records(comp, columns=["name", "start_ns", "end_ns", "src_host", "stream_device",
                                                     "stream_id", "rank"])  # fmt: skip
        k = len(c)
        parts.append(
            pd.DataFrame(
                {"kind": ["computation"] * k, "name": c["name"], "start_ns": c["start_ns"], "end_ns": c["end_ns"],
                 "src_host": c["src_host"], "dst_host": [""] * k, "bytes": 0, "call": [""] * k, "count": 0,
                 "dtype": [""] * k, "reduce_op": [""] * k, "root": -1, "comm_id_hex": [""] * k, "comm_rank": -1,
                 "stream_device": c["stream_device"], "stream_id": c["stream_id"], "os_pid": 1000 + c["rank"],
                 "meta_json": [json.dumps({"Cuda": {"Kernel": {"rank": int(r)}}}) for r in c["rank"]]},
                columns=cols,
            )
        )  # fmt: skip
    df = pd.concat([p for p in parts if len(p)] or parts[:1], ignore_index=True)
    df.insert(0, "event_id", np.arange(len(df), dtype=np.int64))
    df = df.astype({c: ("int64" if t == "int64" else object) for c, t in RAW_TIMELINE_COLUMNS.items()})
    return df, counts
