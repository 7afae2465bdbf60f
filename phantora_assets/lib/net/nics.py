"""The NIC every flow leaves and enters on a multi-NIC fabric (``src_nic``, ``dst_nic``).

A trace names a flow's source and destination host, its communicator (``comm_id``), the caller's rank in
it (``comm_rank``) and the CUDA device of the caller's stream (``stream >> 32``: the local GPU). The
source GPU is that device. The destination GPU is a member of the same communicator on the destination
host, found by these rules, in order:

1. ring collectives (``all_reduce``, ``all_gather``, ``reduce_scatter``): Phantora's ring hop goes from
   communicator rank i to rank (i + 1) mod n (PHANTORA_FORMATS.md section 4), n = the highest rank seen
   + 1; only this rule, and only when that member lives on the destination host;
2. other operations: the only member of the communicator on the destination host;
3. several members there: the flows one member sends to that host at one instant (one grouped
   send/recv or broadcast call, ``ts_us``) go to them in communicator-rank order, when their counts
   are equal;
4. otherwise, when every candidate uses the same NIC (always so with one NIC a host), that NIC.

A member's (host, GPU) comes from the flows it sends: every flow of the trace, the loopback ones inside a
host too (``comm_members.parquet``, :func:`members`, written by ``validated_flows``); with several NICs a
host this table is required (the network flows alone miss the members that send only inside their host,
and rules 1-2 would then pick a wrong receiver). A member that sends no flow at all in the trace is not
seen. Anything else -- a communicator rank seen on two
GPUs, a destination no rule resolves -- raises ``ValueError`` naming the communicator and the rule: the
NIC is never guessed. The NIC of local GPU g is ``g * nics_per_host // gpus_per_node``
(``lib/net/fabric.Fabric.nic_of_gpu``). No Dagster import.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")

#: Columns :func:`flow_nics` reads.
NIC_INPUT_COLUMNS = ("flow_id", "ts_us", "src_node", "dst_node", "op", "comm_id", "comm_rank", "stream")


#: Columns of :func:`members`.
MEMBER_COLUMNS = {"comm_id": "str", "comm_rank": "int64", "node": "int64", "gpu": "int64"}


def members(flows: pd.DataFrame) -> pd.DataFrame:
    """Every (communicator, rank) seen sending and its (node, local GPU): ``MEMBER_COLUMNS``, sorted, unique
    rows (a rank on two GPUs gives two rows: :func:`flow_gpus` refuses it)."""
    m = pd.DataFrame(
        {
            "comm_id": flows["comm_id"].astype(str).to_numpy(),
            "comm_rank": flows["comm_rank"].to_numpy(np.int64),
            "node": flows["src_node"].to_numpy(np.int64),
            "gpu": flows["stream"].to_numpy(np.int64) >> 32,
        }
    )
    return m.drop_duplicates().sort_values(list(MEMBER_COLUMNS), kind="stable").reset_index(drop=True)


def flow_gpus(flows: pd.DataFrame, known: pd.DataFrame | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Local GPU index of every flow's sender and receiver (module docstring rules).

    Args:
        flows: :data:`NIC_INPUT_COLUMNS` (``flows.parquet`` rows, any order).
        known: the communicators' members (:func:`members` of all the trace's flows); None: ``flows``'.

    Returns:
        ``(src_gpu, dst_gpu)`` int64 arrays; -1 in ``dst_gpu`` where rule 4 applies (the caller maps it
        with the NIC every candidate shares, :func:`flow_nics`).

    Raises:
        ValueError: a communicator rank on two GPUs, or a column of :data:`NIC_INPUT_COLUMNS` missing.
    """
    missing = sorted(set(NIC_INPUT_COLUMNS) - set(flows.columns))
    if missing:
        raise ValueError(f"flows lack the columns {missing} the NIC rules read")
    dst_node = flows["dst_node"].to_numpy(np.int64)
    src_gpu = flows["stream"].to_numpy(np.int64) >> 32
    comm = flows["comm_id"].astype(str).to_numpy()
    crank = flows["comm_rank"].to_numpy(np.int64)
    op = flows["op"].astype(str).to_numpy()
    dst_gpu = np.full(len(flows), -1, dtype=np.int64)
    m = members(flows) if known is None else known
    members_ = pd.DataFrame(
        {"c": m["comm_id"].astype(str), "r": m["comm_rank"], "n": m["node"], "g": m["gpu"]}
    ).drop_duplicates()
    dup = members_.duplicated(["c", "r"], keep=False)
    if dup.any():
        bad = members_[dup].iloc[0]
        raise ValueError(
            f"communicator {bad['c']}: rank {bad['r']} sends from two GPUs (host, GPU) -- no NIC rule holds"
        )
    where: dict[tuple[str, int], tuple[int, int]] = {
        (c, r): (n, g) for c, r, n, g in members_.itertuples(index=False, name=None)
    }
    size = (members_.groupby("c")["r"].max() + 1).to_dict()
    on_host: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for c, r, n, g in members_.sort_values(["c", "r"]).itertuples(index=False, name=None):
        on_host.setdefault((c, n), []).append((r, g))
    pending: list[int] = []
    for i in range(len(flows)):
        c, n_dst = comm[i], int(dst_node[i])
        if op[i] in RING_OPS:
            nxt = where.get((c, int((crank[i] + 1) % size[c]))) if c in size else None
            if nxt is not None and nxt[0] == n_dst:
                dst_gpu[i] = nxt[1]
            continue
        cand = on_host.get((c, n_dst), [])
        if len(cand) == 1:
            dst_gpu[i] = cand[0][1]
        elif len(cand) > 1:
            pending.append(i)
    if pending:  # rule 3: one sender's flows to one host at one instant, in communicator-rank order
        p = np.array(pending)
        sub = pd.DataFrame(
            {
                "i": p,
                "c": comm[p],
                "r": crank[p],
                "d": dst_node[p],
                "t": flows["ts_us"].to_numpy(np.float64)[p],
                "f": flows["flow_id"].to_numpy(np.int64)[p],
            }
        ).sort_values(["c", "r", "d", "t", "f"], kind="stable")
        for (c, _r, d, _t), grp in sub.groupby(["c", "r", "d", "t"], sort=False):
            cand = on_host[(c, int(d))]
            if len(grp) == len(cand):
                dst_gpu[grp["i"].to_numpy()] = [g for _, g in cand]
    return src_gpu, dst_gpu


def flow_nics(
    flows: pd.DataFrame,
    gpus_per_node: int,
    nics_per_host: int,
    known: pd.DataFrame | None = None,
    pxn: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """``(src_nic, dst_nic)`` of every flow: 0-based NICs on their hosts (module docstring; ``known`` as
    :func:`flow_gpus`). With ``pxn`` (NCCL's PXN on a rail fabric, ``lib/net/fabric.Fabric.pxn``) a flow leaves
    its host through the NIC on the receiving GPU's rail: ``src_nic = dst_nic``.

    Raises:
        ValueError: a destination no rule resolves to one NIC (the communicator, host and rule named), or a
            communicator rank on two GPUs.
    """
    if known is None and int(nics_per_host) > 1:
        raise ValueError(
            "the communicators' members (comm_members.parquet of validated_flows) are needed to place flows on "
            f"{nics_per_host} NICs a host: materialize validated_flows again"
        )
    src_gpu, dst_gpu = flow_gpus(flows, known)
    g, k = int(gpus_per_node), int(nics_per_host)
    nic = lambda gpu: np.asarray(gpu, dtype=np.int64) * k // g
    if len(src_gpu) and (src_gpu.min() < 0 or src_gpu.max() >= g):
        raise ValueError(f"a flow's stream device is outside the host's {g} GPUs")
    src_nic, dst_nic = nic(src_gpu), np.where(dst_gpu >= 0, nic(np.maximum(dst_gpu, 0)), -1)
    open_ = np.nonzero(dst_gpu < 0)[0]
    if len(open_):
        comm = flows["comm_id"].astype(str).to_numpy()
        dst = flows["dst_node"].to_numpy(np.int64)
        cand_nics: dict[tuple[str, int], set[int]] = {}
        m = members(flows) if known is None else known
        for c, n, gg in zip(m["comm_id"].astype(str), m["node"].tolist(), m["gpu"].tolist()):
            cand_nics.setdefault((c, n), set()).add(gg * k // g)
        for i in open_.tolist():
            s = cand_nics.get((comm[i], int(dst[i])), set(range(k)) if k == 1 else set())
            if len(s) != 1:
                raise ValueError(
                    f"flow {int(flows['flow_id'].iloc[i])} of communicator {comm[i]} to host-{int(dst[i]) + 1}: "
                    f"its receiving GPU is not determined (rules 1-3) and the candidates use NICs {sorted(s)}"
                )
            dst_nic[i] = next(iter(s))
    return (dst_nic.copy() if pxn else src_nic), dst_nic
