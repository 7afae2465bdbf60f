"""The directed links of a run's ``TwoLayerMultiPath`` leaf-spine and the path of every flow over them.

The network is the one the analytic simulator runs on (:class:`phantora_assets.lib.sim.network.Topology`,
built from the run's ``netconfig.toml`` settings: ``presets.toml [cluster]`` with the run's ``topology``
overrides, ``lib/phantora/netconfig.py``). Its links, numbered as that module numbers them (``link_id``):

============  ==================================  =======================  ==================
link_class    link_id                             direction                capacity
============  ==================================  =======================  ==================
host_up       ``h``                                host-(h+1) -> leaf-(r+1)  ``host_bw_gbps``
host_down     ``H + h``                            leaf-(r+1) -> host-(h+1)  ``host_bw_gbps``
leaf_spine    ``2H + r*S + j``                     leaf-(r+1) -> spine-(j+1) ``rack_uplink_port_bw_gbps``
spine_leaf    ``2H + R*S + r*S + j``               spine-(j+1) -> leaf-(r+1) ``rack_uplink_port_bw_gbps``
============  ==================================  =======================  ==================

with ``H`` hosts, rack ``r = h // rack_size`` (``R`` racks), ``S`` spines; links are full duplex, each
direction its own link. Node ``k`` of the flow tables is ``host-(k+1)``.

Path of a flow from node ``a`` to node ``b != a``: inside one rack ``[host_up a, host_down b]``; between
racks ``[host_up a, leaf_spine (rack a, j), spine_leaf (j, rack b), host_down b]``, the spine ``j`` chosen
by the run's ``ecmp`` setting exactly as ``Topology.routes`` (``lib/sim/network.py``) chooses it:

* ``hash``: ``j = splitmix64(conn, a, b) mod S`` (``network._mix``), ``conn`` the flow's connection key
  (:func:`connection_keys`); every flow of one connection takes one spine;
* ``first``: ``j = 0`` (upstream Phantora's ``add_flow`` follows ``parent[0]``);
* ``split``: the flow is spread evenly over all ``S`` spines (coefficient ``1/S`` on each).

A flow with ``a == b`` (inside one host) crosses no link, as in the simulator and in ``binned_flows``.
No Dagster import.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from phantora_assets.lib.net.fabric import Fabric
from phantora_assets.lib.sim.network import Topology

#: The link classes, in path order.
LINK_CLASSES = ("host_up", "leaf_spine", "spine_leaf", "host_down")

#: Columns of :func:`link_table`.
LINK_COLUMNS: dict[str, str] = {
    "link_id": "int64",  # the link's index in Topology's numbering (module docstring)
    "link_class": "str",  # host_up | leaf_spine | spine_leaf | host_down
    "src": "str",  # host-k | leaf-k | spine-k (1-based, like the trace's host names)
    "dst": "str",
    "capacity_bps": "float64",  # link capacity, bits per second (one direction)
}

_BITS_PER_NS_TO_BPS = 8e9  # Topology bandwidths are bytes per ns (= GB/s)


def link_table(topo: Topology | Fabric) -> pd.DataFrame:
    """Every directed link of ``topo``: ``LINK_COLUMNS``, one row per link, ordered by ``link_id``
    (``0 .. topo.n_links - 1``). Capacities in bits per second (``host_bw`` or ``uplink_bw`` x 8e9).
    A :class:`~phantora_assets.lib.net.fabric.Fabric`: its links, ends and classes as it numbers them."""
    if isinstance(topo, Fabric):
        return pd.DataFrame(
            {
                "link_id": np.arange(topo.n_links, dtype=np.int64),
                "link_class": pd.Series(topo.link_class, dtype=object),
                "src": pd.Series(topo.link_src, dtype=object),
                "dst": pd.Series(topo.link_dst, dtype=object),
                "capacity_bps": topo.capacities() * _BITS_PER_NS_TO_BPS,
            },
            columns=list(LINK_COLUMNS),
        )
    h, r, s = topo.n_hosts, topo.n_racks, topo.nspines
    hosts = [f"host-{i + 1}" for i in range(h)]
    leaf_of = [f"leaf-{i // topo.rack_size + 1}" for i in range(h)]
    up_src = [f"leaf-{i // s + 1}" for i in range(r * s)]
    up_dst = [f"spine-{i % s + 1}" for i in range(r * s)]
    rows_class = ["host_up"] * h + ["host_down"] * h + ["leaf_spine"] * (r * s) + ["spine_leaf"] * (r * s)
    src = hosts + leaf_of + up_src + up_dst
    dst = leaf_of + hosts + up_dst + up_src
    return pd.DataFrame(
        {
            "link_id": np.arange(topo.n_links, dtype=np.int64),
            "link_class": pd.Series(rows_class, dtype=object),
            "src": pd.Series(src, dtype=object),
            "dst": pd.Series(dst, dtype=object),
            "capacity_bps": topo.capacities() * _BITS_PER_NS_TO_BPS,
        },
        columns=list(LINK_COLUMNS),
    )


def classes_of(topo: Topology | Fabric) -> tuple[str, ...]:
    """The link classes of ``topo`` in path order: :data:`LINK_CLASSES`, or a fabric's (``host_up`` first,
    ``host_down`` last, its switch tiers between, in link-number order)."""
    if not isinstance(topo, Fabric):
        return LINK_CLASSES
    mid = [c for c in dict.fromkeys(topo.link_class) if c not in ("host_up", "host_down")]
    return ("host_up", *mid, "host_down")


def connection_keys(flows: pd.DataFrame, gpus_per_node: int) -> np.ndarray:
    """The ECMP key of every flow: one per NCCL connection as a trace shows it.

    A connection is (communicator, source rank, destination node): the source rank is
    ``src_node * gpus_per_node + (stream >> 32)`` (the CUDA device of the flow's stream, as
    ``lib/chakra/export.py`` reads it), a ring hop's destination is one rank of that node. The key is
    the first 8 bytes of ``blake2b(f"{comm_id}/{src_rank}/{dst_node}")`` as a signed int64
    (deterministic across processes and machines).

    Args:
        flows: ``comm_id`` (str), ``stream``, ``src_node``, ``dst_node`` (int64) columns.
        gpus_per_node: GPUs per node of the run (>= 1).

    Returns:
        int64 array, one key per row of ``flows``.
    """
    src_rank = flows["src_node"].to_numpy(np.int64) * int(gpus_per_node) + (flows["stream"].to_numpy(np.int64) >> 32)
    triple = pd.DataFrame(
        {"c": flows["comm_id"].astype(str).to_numpy(), "s": src_rank, "d": flows["dst_node"].to_numpy(np.int64)}
    )
    codes, uniq = pd.factorize(pd.MultiIndex.from_frame(triple), sort=False)
    keys = np.array(
        [
            int.from_bytes(hashlib.blake2b(f"{c}/{s}/{d}".encode(), digest_size=8).digest(), "big", signed=True)
            for c, s, d in uniq
        ],
        dtype=np.int64,
    )
    return keys[codes] if len(keys) else np.zeros(len(flows), dtype=np.int64)


def flow_links(
    topo: Topology | Fabric, src_node: np.ndarray, dst_node: np.ndarray, conn: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The path of every flow as directed links, by ``Topology.routes`` (module docstring).

    Args:
        topo: the run's network.
        src_node, dst_node: int64 node indices (``0 .. n_hosts - 1``); rows with ``src == dst`` cross
            no link and appear in no output row.
        conn: int64 ECMP key per flow (:func:`connection_keys`); used by ``ecmp = "hash"`` only.

    Returns:
        ``(flow index, link id, coefficient)`` arrays, one row per (flow, link of its path): the
        coefficient is 1, or ``1 / nspines`` on the fabric links of a ``split`` flow.

    Raises:
        ValueError: a node index outside the topology.
    """
    src = np.asarray(src_node, dtype=np.int64)
    dst = np.asarray(dst_node, dtype=np.int64)
    n_ends = topo.n_endpoints if isinstance(topo, Fabric) else topo.n_hosts
    if len(src) and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n_ends):
        raise ValueError(f"node index outside the topology's {n_ends} endpoints")
    net = np.nonzero(src != dst)[0]
    if not len(net):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0)
    fi, li, co = topo.routes(src[net], dst[net], np.asarray(conn, dtype=np.int64)[net])
    order = np.lexsort((li, fi))
    return net[fi[order]], li[order], co[order]


def routes_kind(source: str, topo: Topology | Fabric, src_node: np.ndarray, dst_node: np.ndarray) -> str:
    """``"simulated"`` when the paths are those the run's own simulation gave its flows, else ``"modelled"``.

    Simulated: an analytic run (the embedded simulator routes with ``Topology.routes``) whose spine
    choice does not depend on the connection key -- ``ecmp`` is ``first`` or ``split``, one spine, or no
    flow between racks. Otherwise (``hash`` between racks: the simulator hashes its internal connection
    number, which a trace does not carry; any imported, Docker, Kineto or Chakra trace) the same routing
    model assigns the links: modelled.
    """
    src = np.asarray(src_node, dtype=np.int64)
    dst = np.asarray(dst_node, dtype=np.int64)
    if isinstance(topo, Fabric):  # endpoints; one shortest path each, or a choice that ignores the key
        net = src != dst
        single = all(len(topo.paths(a, b)) == 1 for a, b in set(zip(src[net].tolist(), dst[net].tolist())))
        return "simulated" if source == "analytic" and (topo.ecmp != "hash" or single) else "modelled"
    cross = bool(((src // topo.rack_size) != (dst // topo.rack_size)).any())
    independent = topo.ecmp in ("first", "split") or topo.nspines == 1 or not cross
    return "simulated" if source == "analytic" and independent else "modelled"
