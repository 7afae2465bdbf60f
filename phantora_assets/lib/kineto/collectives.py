"""Kineto collectives -> Phantora's ring flows and a raw timeline (``columns.RAW_TIMELINE_COLUMNS``).

Bytes follow the ring rules of Phantora's own traces (``docs/PHANTORA_FORMATS.md`` section 4,
``lib/traffic/ring.py``): one ring over the group's ranks in group-rank order (``Process Group
Ranks``), hop i from group rank i to (i+1) mod n, on the hosts those ranks live on (rank r on
``host-(r // gpus_per_node + 1)``). With ``d`` the dtype's size in bytes (:data:`DTYPES`):

* all-reduce (``allreduce``, ``allreduce_coalesced``): S = ``In msg nelems`` x d, each hop
  floor(S * 2(n-1) / n) (section 4, all-reduce);
* all-gather (``allgather``, ``_allgather_base``, ``all_gather_into_tensor``, ``allgather_into_tensor_coalesced``):
  S = ``In msg nelems`` x d, the per-rank size, each hop (n-1) * S (section 4);
* reduce-scatter (``reduce_scatter``, ``_reduce_scatter_base``, ``reduce_scatter_tensor_coalesced``):
  S = ``Out msg nelems`` x d, the per-rank size, each hop (n-1) * S (section 4);
* broadcast (``broadcast``, ``_broadcast_oop``): S = ``In msg nelems`` x d from the root to every
  other rank (section 4). The profiler does not record the root: it is taken as group rank 0
  (DDP's and FSDP's broadcasts come from the group's first rank);
* all-to-all (``all_to_all``, ``all_to_allv``, ``alltoall``, ``alltoall_base``): Phantora issues it as
  grouped send/recv (section 3, ``NcclSend``), so each group rank i sends to every other rank j
  ``In split size[j]`` rows of ``In msg nelems / sum(In split size)`` elements (with no split sizes:
  ``In msg nelems / n`` elements), one flow each, ``S`` = those elements x d (section 4, send/recv);
  with several ranks' traces, j's ``Out split size`` must agree with what i sends it; an untraced
  rank i sends a traced rank j what j's ``Out split size[i]`` rows of ``Out msg nelems / sum(Out
  split size)`` elements record, and other untraced ranks what the traced record's In split says;
* send / recv on a group of two: S = ``In msg nelems`` x d, one flow to / from the other rank
  (section 4, send/recv). A send and its peer's matching recv are one flow: the group's sequence
  (of its lowest present rank, below) gives each once.

Point-to-point flows (call ``NcclSend``) are named in the raw timeline by the collective that issued them,
``ring.P2P_NAME_ALL_TO_ALL`` or ``ring.P2P_NAME_SEND_RECV`` (Phantora's own traces cannot tell and name them
``NcclSend``): only an all-to-all's sizes may vary with routing (``trace_checks.routed_p2p``).

Not network flows: ``wait``, ``barrier`` (the NCCL barrier's traffic is the 1-element all-reduce it
issues), any op on a group of one rank, and flows of 0 bytes; collectives inside one host give
loopback flows (src host = dst host), which are not network traffic, as in Phantora's traces.
Dtypes without a Phantora name (``Short``, ``Float8_*``, complex) are written as ``U8`` with
``count`` = bytes, Phantora's own encoding of its p2p flows, so the bytes stay exact.

One rank's trace only: the other ranks of each of its groups are assumed to issue the same
collectives (their hops are built from its records); groups it is not part of are not seen. With
several ranks, every group's members must issue the same sequence (op, sizes, dtype; all-to-all:
op and dtype); the flows of a group come from its lowest present rank's records and timing.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import pandas as pd

from phantora_assets.lib.columns import RAW_TIMELINE_COLUMNS
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.kineto.reader import Collective, RankTrace
from phantora_assets.lib.traffic.ring import P2P_NAME_ALL_TO_ALL, P2P_NAME_SEND_RECV

#: PyTorch ScalarType name -> (bytes per element, Phantora dtype name or None: written as U8 bytes).
DTYPES: dict[str, tuple[int, str | None]] = {
    "Float": (4, "F32"),
    "Double": (8, "F64"),
    "Half": (2, "F16"),
    "BFloat16": (2, "Bf16"),
    "Byte": (1, "U8"),
    "Char": (1, "I8"),
    "Bool": (1, "U8"),
    "Int": (4, "I32"),
    "Long": (8, "I64"),
    "UInt32": (4, "U32"),
    "UInt64": (8, "U64"),
    "Short": (2, None),
    "UInt16": (2, None),
    "Float8_e4m3fn": (1, None),
    "Float8_e5m2": (1, None),
    "Float8_e4m3fnuz": (1, None),
    "Float8_e5m2fnuz": (1, None),
    "ComplexHalf": (4, None),
    "ComplexFloat": (8, None),
    "ComplexDouble": (16, None),
}
#: ``Collective name`` -> op (the ops of ``lib/traffic/ring.py``, and ``all_to_all``).
OPS: dict[str, str] = {
    **dict.fromkeys(("allreduce", "allreduce_coalesced", "all_reduce"), "all_reduce"),
    **dict.fromkeys(
        (
            "allgather",
            "all_gather",
            "_allgather_base",
            "all_gather_into_tensor",
            "allgather_coalesced",
            "allgather_into_tensor_coalesced",
        ),
        "all_gather",
    ),
    **dict.fromkeys(
        ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
        "reduce_scatter",
    ),
    **dict.fromkeys(("broadcast", "_broadcast_oop"), "broadcast"),
    **dict.fromkeys(("all_to_all", "all_to_allv", "alltoall", "alltoall_base", "all_to_all_single"), "all_to_all"),
    "send": "send",
    "recv": "recv",
}
_CALL = {"all_reduce": "NcclAllReduce", "all_gather": "NcclAllGather", "reduce_scatter": "NcclReduceScatter",
         "broadcast": "NcclBcast"}  # fmt: skip


@dataclass(frozen=True)
class Flow:
    """One flow of a collective: global ranks ``src`` -> ``dst``, ``bytes``, and the NCCL call
    fields the raw timeline records (``call``, ``count``, ``dtype``, ``comm_rank``, ``root``)."""

    src: int
    dst: int
    bytes: int
    call: str
    count: int
    dtype: str
    comm_rank: int
    root: int = -1


def op_of(c: Collective, path: object = "<trace>") -> str:
    """The op of ``c`` (:data:`OPS`). Raises TraceFormatError ``no ring rule`` for any other name."""
    op = OPS.get(c.name)
    if op is None:
        raise TraceFormatError(
            str(path), "no ring rule", f"collective {c.name!r} (supported: {', '.join(sorted(OPS))}, wait, barrier)"
        )
    return op


def flows_of(
    c: Collective, path: object = "<trace>", own: dict[int, Collective] | None = None, rank: int | None = None
) -> list[Flow]:
    """The flows of collective ``c`` over its group (module docstring: the rules), as
    :class:`Flow` rows (global ranks, bytes).

    ``own`` maps group members to their own record of the same collective (all-to-all splits per
    rank); members without one use ``c``. ``rank``: the rank whose record ``c`` is (send/recv:
    the sender / the receiver; default the group's first rank). Raises TraceFormatError (``unknown dtype``, ``no ring
    rule``, ``all-to-all sizes``, ``send/recv peer``, ``invalid trace``: bytes beyond int64) naming ``path``.
    """
    if c.dtype not in DTYPES:
        raise TraceFormatError(str(path), "unknown dtype", f"{c.name}: dtype {c.dtype!r} (known: {', '.join(DTYPES)})")
    op, (size, ph) = op_of(c, path), DTYPES[c.dtype]
    g, n = c.group, len(c.group)
    if n <= 1:
        return []

    def call(nelems: int) -> tuple[int, str]:  # (count, dtype) as written; U8 = bytes
        return (nelems, ph) if ph else (nelems * size, "U8")

    out: list[Flow] = []
    if op in ("all_reduce", "all_gather", "reduce_scatter"):
        nelems = c.out_nelems if op == "reduce_scatter" else c.in_nelems
        s = nelems * size
        hop = (s * 2 * (n - 1)) // n if op == "all_reduce" else (n - 1) * s
        count, dt = call(nelems)
        out = [Flow(g[i], g[(i + 1) % n], hop, _CALL[op], count, dt, i) for i in range(n)]
    elif op == "broadcast":
        count, dt = call(c.in_nelems)
        out = [Flow(g[0], g[j], c.in_nelems * size, "NcclBcast", count, dt, 0, 0) for j in range(1, n)]
    elif op == "all_to_all":
        own = own or {rank if rank in g else g[0]: c}
        got = {r: _a2a_bytes(rec, n, size, path, "Out") for r, rec in own.items()}
        for i in range(n):
            sent = _a2a_bytes(own.get(g[i], c), n, size, path)
            for j in range(n):  # an untraced sender: what a traced receiver's Out split size records
                b = sent[j] if g[i] in own or g[j] not in got else got[g[j]][i]
                if j != i and b:
                    out.append(Flow(g[i], g[j], b, "NcclSend", b, "U8", i))
    else:
        if n != 2:
            raise TraceFormatError(
                str(path), "send/recv peer", f"{c.name} on a group of {n} ranks: the profiler does not record the peer"
            )
        me = g.index(rank) if rank in g else 0
        src, dst = (g[me], g[1 - me]) if op == "send" else (g[1 - me], g[me])
        out = [Flow(src, dst, c.in_nelems * size, "NcclSend", c.in_nelems * size, "U8", g.index(src))]
    big = next((f for f in out if max(f.bytes, f.count) >= 1 << 63), None)
    if big is not None:
        raise TraceFormatError(
            str(path), "invalid trace", f"{c.name}: In msg nelems {c.in_nelems} gives {big.bytes} bytes, beyond int64"
        )
    return [f for f in out if f.bytes > 0]


def _a2a_bytes(c: Collective, n: int, size: int, path: object, side: str = "In") -> list[int]:
    """Bytes group rank i of ``c`` sends to (``side`` ``In``) or receives from (``Out``) every group
    rank (all-to-all rule, module docstring)."""
    nelems, split = (c.in_nelems, c.in_split) if side == "In" else (c.out_nelems, c.out_split)
    split = split or (1,) * n
    if len(split) != n or sum(split) == 0 or (nelems % sum(split)):
        raise TraceFormatError(
            str(path),
            "all-to-all sizes",
            f"{c.name}: {side} msg nelems {nelems} does not split into {n} parts by {side} split size {list(split)}",
        )
    row = nelems // sum(split)
    return [s * row * size for s in split]


def check_all_to_all(per: dict[int, Collective], group: tuple[int, ...], path: object) -> None:
    """With several members' records of one all-to-all: what rank i sends to j (i's ``In split
    size``) must be what j receives from i (j's ``Out split size``).

    Raises:
        TraceFormatError: rule ``ranks disagree`` naming the pair and both byte counts.
    """
    n, size = len(group), DTYPES.get(next(iter(per.values())).dtype, (1, None))[0]
    sent = {r: _a2a_bytes(c, n, size, path) for r, c in per.items()}
    got = {r: _a2a_bytes(c, n, size, path, "Out") for r, c in per.items()}
    for i, src in enumerate(group):
        for j, dst in enumerate(group):
            if src in sent and dst in got and i != j and sent[src][j] != got[dst][i]:
                raise TraceFormatError(
                    str(path),
                    "ranks disagree",
                    f"all-to-all on group {list(group)}: rank {src} sends {sent[src][j]} bytes to rank {dst}, "
                    f"which receives {got[dst][i]} from it (In / Out split size)",
                )


def _signature(c: Collective) -> tuple:
    op = OPS.get(c.name, c.name)
    if op in ("send", "recv"):  # a send matches its peer's recv
        return ("p2p", c.in_nelems, c.dtype)
    return (op, c.dtype) if op == "all_to_all" else (op, c.in_nelems, c.out_nelems, c.dtype)


def comm_hex(pg: str) -> str:
    """A 128-byte communicator id (256 hex chars) for the group key ``pg`` (blake2b, deterministic)."""
    return hashlib.blake2b(pg.encode(), digest_size=64).hexdigest() * 2


def group_sequences(ranks: list[RankTrace]) -> dict[str, tuple[RankTrace, list[Collective], dict[int, list]]]:
    """Per group key: the issuing rank (lowest present member), its collectives on the group in
    issue order, and every present member's own sequence (for all-to-all splits).

    Raises:
        TraceFormatError: rule ``ranks disagree``: two present members of a group issued different
            sequences (names both files, the group and the first difference), or a present member
            issued none of the group's collectives (under that group's key).
    """
    seqs: dict[str, dict[int, tuple[RankTrace, list[Collective]]]] = {}
    for rt in sorted(ranks, key=lambda r: r.rank):
        for c in rt.collectives:
            if len(c.group) > 1:
                seqs.setdefault(c.pg, {}).setdefault(rt.rank, (rt, []))[1].append(c)
    out: dict[str, tuple[RankTrace, list[Collective], dict[int, list]]] = {}
    present = {rt.rank: rt for rt in ranks}
    for pg, members in seqs.items():
        first = min(members)
        ref_rt, ref = members[first]
        silent = [r for r in ref[0].group if r in present and r not in members]
        if silent:  # a traced member issued nothing on this group: its hops would come twice
            raise TraceFormatError(
                present[silent[0]].path,
                "ranks disagree",
                f"group {pg}: rank {silent[0]} is a member and is traced, but issues none of its {len(ref)} "
                f"collectives (rank {first}, {ref_rt.path.name}, does; another group name or key in this file?)",
            )
        for r, (rt, seq) in members.items():
            a, b = [_signature(c) for c in ref], [_signature(c) for c in seq]
            if a != b:
                k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                raise TraceFormatError(
                    rt.path,
                    "ranks disagree",
                    f"group {pg}: rank {r} issues {len(b)} collectives, rank {first} ({ref_rt.path.name}) {len(a)}; "
                    f"first difference at #{k}: {b[k] if k < len(b) else 'none'} vs {a[k] if k < len(a) else 'none'}",
                )
        out[pg] = (ref_rt, ref, {r: seq for r, (_, seq) in members.items()})
    return out


def raw_timeline(ranks: list[RankTrace], gpus_per_node: int, t0_us: float) -> pd.DataFrame:
    """The raw timeline of the run: one communication row per flow, one computation row per
    non-NCCL GPU kernel of every present rank; times in ns since ``t0_us`` (host-clock us).

    Raises:
        TraceFormatError: a collective breaks a rule of :func:`flows_of` or :func:`group_sequences`.
    """
    cols = [c for c in RAW_TIMELINE_COLUMNS if c != "event_id"]
    rows: list[tuple] = []  # communication rows, in ``cols`` order

    def ns(us: float) -> int:
        return max(0, round((us - t0_us) * 1000))

    def host(r: int) -> str:
        return f"host-{r // gpus_per_node + 1}"

    for pg, (rt, seq, own) in sorted(group_sequences(ranks).items()):
        cid = comm_hex(pg)
        for k, c in enumerate(seq):
            per = {r: s[k] for r, s in own.items() if k < len(s)}
            if len(per) > 1 and OPS.get(c.name) == "all_to_all":
                check_all_to_all(per, c.group, rt.path)
            start, end = ns(c.ts_us), ns(c.ts_us) + max(0, round(c.dur_us * 1000))
            # a point-to-point flow is named by the collective that issued it (ring.P2P_NAME_*): only an
            # all-to-all's parts may vary with routing (trace_checks.routed_p2p), a send/recv's sizes are fixed
            p2p_name = P2P_NAME_ALL_TO_ALL if OPS.get(c.name) == "all_to_all" else P2P_NAME_SEND_RECV
            for f in flows_of(c, rt.path, per, rt.rank):
                op = "Sum" if f.call in ("NcclAllReduce", "NcclReduceScatter") else ""
                name = p2p_name if f.call == "NcclSend" else f.call
                rows.append(
                    ("communication", name, start, end, host(f.src), host(f.dst), f.bytes, f.call, f.count,
                     f.dtype, op, f.root, cid, f.comm_rank, f.src % gpus_per_node, c.stream, 0, "")
                )  # fmt: skip
    parts = [pd.DataFrame.from_records(rows, columns=cols)]
    for rt in sorted(ranks, key=lambda r: r.rank):  # computation rows, column-wise
        k = pd.DataFrame.from_records(rt.kernels, columns=["name", "ts", "dur", "stream"])
        start = np.maximum(0, np.round((k["ts"].to_numpy(np.float64) - t0_us) * 1000)).astype(np.int64)
        n = len(k)
        parts.append(
            pd.DataFrame(
                {"kind": ["computation"] * n, "name": k["name"].astype(object), "start_ns": start,
                 "end_ns": start + np.maximum(0, np.round(k["dur"].to_numpy(np.float64) * 1000)).astype(np.int64),
                 "src_host": [host(rt.rank)] * n, "dst_host": [""] * n, "bytes": 0, "call": [""] * n, "count": 0,
                 "dtype": [""] * n, "reduce_op": [""] * n, "root": -1, "comm_id_hex": [""] * n, "comm_rank": -1,
                 "stream_device": rt.rank % gpus_per_node, "stream_id": k["stream"].to_numpy(np.int64),
                 "os_pid": rt.pid, "meta_json": [json.dumps({"Cuda": {"Kernel": {"rank": rt.rank}}})] * n},
                columns=cols,
            )
        )  # fmt: skip
    df = pd.concat([p for p in parts if len(p)] or parts[:1], ignore_index=True)
    df.insert(0, "event_id", np.arange(len(df), dtype=np.int64))
    return df.astype({c: ("int64" if t == "int64" else object) for c, t in RAW_TIMELINE_COLUMNS.items()})
