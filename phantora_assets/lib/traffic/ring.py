"""Phantora's ring model: how one NCCL collective becomes network flows.

Rule (PHANTORA_FORMATS.md section 4): one ring over the communicator's ranks in rank
order; hop i goes from rank i to rank (i+1) mod n. With S = count x dtype size bytes:

    all-reduce                  floor(S * 2(n-1) / n) per hop
    all-gather, reduce-scatter  (n-1) * S per hop (count is the per-rank count)
    broadcast                   S, from the root to every other rank
    send / recv                 S, one flow

A hop whose two ranks live on the same host is a loopback flow (not network traffic).
"""

from __future__ import annotations

from collections.abc import Sequence

#: NCCL call name (as in the Chrome JSON) -> op name used in every table.
CALL_TO_OP: dict[str, str] = {
    "NcclAllReduce": "all_reduce",
    "NcclAllGather": "all_gather",
    "NcclReduceScatter": "reduce_scatter",
    "NcclBcast": "broadcast",
    "NcclSend": "send",
    "NcclRecv": "recv",
}
OP_TO_CALL: dict[str, str] = {v: k for k, v in CALL_TO_OP.items()}

#: Phantora dtype name -> size in bytes.
DTYPE_BYTES: dict[str, int] = {
    "I8": 1,
    "U8": 1,
    "I32": 4,
    "U32": 4,
    "I64": 8,
    "U64": 8,
    "F16": 2,
    "F32": 4,
    "F64": 8,
    "Bf16": 2,
}

RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")
#: A flow's ``name`` when its source tells which collective issued a point-to-point transfer (the Kineto
#: reader, ``lib/kineto/collectives.py``: the ``Collective name`` of the record): an all-to-all's parts, whose
#: sizes routing varies (``trace_checks.routed_p2p``), or a send/recv's, whose sizes are fixed (a pipeline
#: message: Megatron-LM ``megatron/core/pipeline_parallel/p2p_communication.py``, ``_communicate``: ``if not
#: config.variable_seq_lengths: recv_prev_shape = tensor_shape``, the one ``tensor_shape`` the schedule passes
#: for the run). Phantora's own traces name every such flow ``NcclSend`` (a grouped send cannot tell).
P2P_NAME_ALL_TO_ALL = "all_to_all"
P2P_NAME_SEND_RECV = "send_recv"


def hop_bytes(op: str, count: int, dtype_bytes: int, n: int) -> int:
    """Bytes of one flow of a collective, per the ring rule.

    Args:
        op: one of ``all_reduce, all_gather, reduce_scatter, broadcast, send, recv``.
        count: the NCCL ``count`` argument (elements; per-rank for all-gather and
            reduce-scatter).
        dtype_bytes: element size in bytes.
        n: communicator size (ranks), >= 1.

    Returns:
        bytes of each flow (int). 0 when ``n == 1`` for ring ops (no flow at all).

    Raises:
        ValueError: unknown op or n < 1.
    """
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    size = count * dtype_bytes
    if op == "all_reduce":
        return (size * 2 * (n - 1)) // n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) * size
    if op in ("broadcast", "send", "recv"):
        return size
    raise ValueError(f"unknown op {op!r}")


def ring_flows(op: str, count: int, dtype_bytes: int, n: int, root: int = 0) -> list[tuple[int, int, int]]:
    """Flows of one collective as ``(src_rank, dst_rank, bytes)``, loopback not yet removed.

    Ring ops give n hops ``i -> (i+1) % n``; broadcast gives ``root -> r`` for every other
    rank r. A communicator of one rank gives no flow. Send/recv are point-to-point and
    are not expanded here (one flow of ``count * dtype_bytes``).
    """
    if n <= 1:
        return []
    b = hop_bytes(op, count, dtype_bytes, n)
    if op in RING_OPS:
        return [(i, (i + 1) % n, b) for i in range(n)]
    if op == "broadcast":
        return [(root, r, b) for r in range(n) if r != root]
    raise ValueError(f"{op!r} is point-to-point; build its flow directly")


def group_sizes_for(op: str, count: int, dtype_bytes: int, flow_bytes: int, max_n: int = 4096) -> list[int]:
    """Every group size n in [2, max_n] for which the ring rule gives ``flow_bytes``.

    Used to infer a communicator's size from its flows. For broadcast/send/recv the bytes do
    not depend on n: returns ``[]`` when ``flow_bytes != count * dtype_bytes``, else ``[0]``
    (meaning "any n").
    """
    size = count * dtype_bytes
    if op in ("broadcast", "send", "recv"):
        return [0] if flow_bytes == size else []
    if size == 0:
        return [0] if flow_bytes == 0 else []
    if op in ("all_gather", "reduce_scatter"):
        if flow_bytes % size:
            return []
        n = flow_bytes // size + 1
        return [n] if 2 <= n <= max_n else []
    if op == "all_reduce":
        # floor(2 S (n-1)/n) is non-decreasing in n and lies in [S, 2S).
        if not size <= flow_bytes < 2 * size:
            return []
        # b = floor(2S(n-1)/n)  <=>  b <= 2S(n-1)/n < b + 1
        #   <=>  n >= 2S / (2S - b)  and  n (2S - b - 1) < 2S.
        # Many n can give the same b (small S, large n), so solve for the whole range
        # exactly in integers instead of searching near the real root.
        two_s = 2 * size
        lo = max(2, -(-two_s // (two_s - flow_bytes)))
        d = two_s - flow_bytes - 1
        hi = max_n if d <= 0 else min(max_n, (two_s - 1) // d)
        return list(range(lo, hi + 1))
    raise ValueError(f"unknown op {op!r}")


def network_bytes_of(flows: Sequence[tuple[int, int, int]], rank_host: Sequence[int]) -> int:
    """Sum of the bytes of ``flows`` whose ranks sit on different hosts."""
    return sum(b for s, d, b in flows if rank_host[s] != rank_host[d])
