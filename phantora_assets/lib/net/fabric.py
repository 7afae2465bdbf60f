"""Multi-tier and multi-NIC fabrics: ``FatTree``, ``RailOptimized``, ``MultiPlane`` and ``Arbitrary``.

``TwoLayerMultiPath`` (Phantora's leaf-spine, one endpoint per host) stays
:class:`phantora_assets.lib.sim.network.Topology`; every other topology is a :class:`Fabric`: an explicit
graph of endpoints (NICs), switches and directed links, with the interface the flow-level simulator
(``lib/sim/network.FlowNetwork``) and the link tables (``lib/net/routes.py``, ``lib/net/link_bins.py``)
use: ``n_links``, ``capacities()``, ``routes(src, dst, conn)``, ``loopback_bw``, ``ecmp``.

Endpoints. Endpoint ``e = host * nics_per_host + nic`` is NIC ``nic`` of host ``host`` (0-based). The
GPU with local index ``g`` of a host of ``G`` GPUs sends and receives through NIC ``g * nics // G``
(:meth:`Fabric.nic_of_gpu`); ranks live on hosts host-major (rank ``r`` on host ``r // G``). Traffic
between two GPUs of one scale-up domain (``scale_up_gpus`` consecutive ranks; by default one host) is
on no network link: it runs at ``loopback_bw`` like intra-host traffic of ``TwoLayerMultiPath``
(:meth:`Fabric.endpoints` maps such a pair to one endpoint, the simulator's loopback).

Links. Every link is directed (a full-duplex cable is two links), numbered ``0 .. n_links - 1`` in the
order the builder adds them, and has a class: ``host_up`` (NIC -> its switch), ``host_down`` (switch ->
NIC), and per topology the switch tiers below. Capacities are bytes per ns (= GB/s; Gbps / 8).

* ``FatTree`` (k-ary, ``fattree_k`` = k even): k pods of k/2 edge and k/2 aggregation switches, (k/2)^2
  core switches, k/2 hosts per edge switch (k^3/4 hosts at most; hosts fill edge switches in order).
  Edge j of a pod links to every aggregation switch of its pod; aggregation switch a of a pod links to
  cores ``a*k/2 .. a*k/2 + k/2 - 1``. Host links at ``host_bw_gbps``; ``oversubscription`` o >= 1
  divides the edge -> aggregation links (``host_bw / o`` each: k/2 hosts share k/2 uplinks); core
  links at ``host_bw``. Classes ``edge_agg``, ``agg_edge``, ``agg_core``, ``core_agg``.
* ``RailOptimized``: ``nics_per_host`` rails; hosts in rail groups of ``rail_group_hosts`` (default:
  all hosts); rail switch ``rail-<group>.<i>`` links NIC i of every host of its group (``nic_bw_gbps``
  each); every rail switch links to every one of ``nspines`` spines, non-blocking unless ``oversubscription``
  o says otherwise: ``group hosts x nic_bw / (nspines x o)`` a spine link (the leaf-spine's
  ``rack_uplink_port_bw_gbps`` is not used). Classes ``rail_spine``, ``spine_rail``. NIC i talks to NIC i of
  a host of its group in 2 hops. **PXN** (``pxn``, on by default as in NCCL, ``NCCL_PXN_DISABLE=0``): a flow
  to another host leaves its host through the NIC on the destination GPU's rail (NCCL moves the data over
  NVLink to the GPU of that rail first: ``ncclTopoGetIntermediateRank``, PXN's "send from the NIC local to the
  destination's rail"), so traffic between hosts of one rail group never crosses a spine; the NVLink hop is
  scale-up traffic, on no network link. ``pxn = false``: a flow leaves through the sending GPU's own NIC.
* ``MultiPlane``: ``planes`` copies of the RailOptimized fabric; every NIC has one port on every plane
  at ``nic_bw_gbps / planes``; a flow takes one plane (ECMP, below). Classes, spines and PXN as RailOptimized.
* ``Arbitrary``: a user TOML file (``fabric_file``, :func:`load_arbitrary`): switches, full-duplex
  switch-switch links with bandwidths, and each host's NICs attached to a switch. Class ``fabric``.

Routing. A flow from endpoint a to endpoint b takes a shortest path (fewest links) from a to b that
passes through switches only (a host never forwards). Of the shortest paths, enumerated in
lexicographic order of their link ids (at most :data:`MAX_PATHS` per pair, else ``ValueError``), ``ecmp``
picks as on the leaf-spine: ``hash`` path ``splitmix64(conn, a, b) mod n_paths`` (one path per
connection), ``first`` path 0, ``split`` every path with coefficient ``1 / n_paths`` (a link shared by
several paths sums their coefficients). A k-ary fat-tree has 1 path inside an edge switch, k/2 inside a
pod and (k/2)^2 between pods; a rail fabric 1 path on one rail of a group and ``nspines`` otherwise.

No Dagster import.
"""

from __future__ import annotations

import math
import os
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from phantora_assets.lib.net.fabric_graph import Builder, load_arbitrary, nic_name
from phantora_assets.lib.sim.network import ECMP_MODES, Topology, mix_hash

__all__ = [
    "FABRIC_KEYS",
    "FABRIC_TYPES",
    "FILE_KEYS",
    "Fabric",
    "build_fabric",
    "host_nic_bw",
    "load_arbitrary",
    "network_files",
    "network_for",
    "nic_name",
    "resolve_files",
]

#: Topology types built here (``TwoLayerMultiPath`` is ``lib/sim/network.Topology``).
FABRIC_TYPES = ("FatTree", "RailOptimized", "MultiPlane", "Arbitrary")
#: Fabrics whose every rail switch is optical when a run asks for reconfig (docs/FABRIC.md).
RAIL_TYPES = ("RailOptimized", "MultiPlane")
#: Shortest paths kept per endpoint pair.
MAX_PATHS = 4096
_GBPS = 1 / 8  # Gbps -> bytes per ns

#: Parameters of the fabric topologies: run-entry ``topology`` keys beyond presets.toml ``[cluster]``,
#: with their defaults (None: derived from the run, as the module docstring says).
FABRIC_KEYS: dict[str, Any] = {
    "fattree_k": None,  # FatTree: even k >= 2; default the smallest with k^3/4 >= hosts
    # FatTree: >= 1, edge uplink capacity = host_bw / oversubscription; RailOptimized, MultiPlane: the rail
    # switches' spine links carry their hosts' NIC bandwidth / oversubscription in all
    "oversubscription": 1.0,
    "pxn": None,  # RailOptimized, MultiPlane: NCCL's PXN (true by default); Arbitrary, FatTree: false
    "nics_per_host": None,  # RailOptimized, MultiPlane, Arbitrary (from the file): default gpus_per_node
    "nic_bw_gbps": None,  # RailOptimized, MultiPlane: default host_bw_gbps
    "scale_up_gpus": None,  # GPUs per scale-up (NVLink) domain, a multiple of gpus_per_node: default gpus_per_node
    "rail_group_hosts": None,  # RailOptimized, MultiPlane: hosts per rail group, default all hosts
    "planes": 2,  # MultiPlane: >= 1
    "fabric_file": "",  # Arbitrary: the fabric TOML file
}


#: The topology keys that name a file the run reads (``lib/run/spec`` resolves a relative one against the
#: folder of the run-matrix file naming it; ``stages/simulation.run_spec_record`` fingerprints its bytes).
FILE_KEYS = ("fabric_file",)


def resolve_files(topology: dict[str, Any], folder: Path | None) -> dict[str, Any]:
    """``topology`` with every relative :data:`FILE_KEYS` path made absolute against ``folder`` (the
    run-matrix file's folder, as a config file's relative paths are read; None: left as written, relative
    to the working directory, for a RunSpec built in code). A value that is no string is left for the
    rules to refuse."""
    out = dict(topology)
    for key in FILE_KEYS:
        v = out.get(key)
        if folder is not None and isinstance(v, str) and v and not Path(v).is_absolute():
            out[key] = os.path.normpath(Path(folder).absolute() / v)
    return out


def network_files(cluster: dict[str, Any]) -> dict[str, str]:
    """The files a run's network reads, by topology key: ``{"fabric_file": path}`` for ``Arbitrary``, else
    ``{}``."""
    if cluster.get("topology") != "Arbitrary":
        return {}
    return {k: cluster[k] for k in FILE_KEYS if isinstance(cluster.get(k), str) and cluster[k]}


class Fabric:
    """A fabric graph (module docstring): endpoints, switches, directed links, shortest-path ECMP routing.

    Attributes:
        kind: topology type (:data:`FABRIC_TYPES`).
        n_hosts, nics_per_host, gpus_per_host, scale_up_gpus: the layout (``n_endpoints`` = hosts x NICs).
        link_src, link_dst: node names of every link's ends (``host-k[/nic-i]`` or a switch name).
        link_class: class of every link; ``cap``: bytes per ns of every link.
        loopback_bw: bytes per ns inside a scale-up domain; ``ecmp``: :data:`ECMP_MODES`.
        pxn: a flow between hosts leaves through the NIC on the destination GPU's rail (module docstring).
        optical_endpoints: bool a endpoint: its NIC's port is on an optical circuit switch (every NIC of
            ``RailOptimized`` and ``MultiPlane``; on ``Arbitrary`` those on ``optical = true`` switches).
    """

    def __init__(  # noqa: PLR0913 (a graph and its layout, keyword-only)
        self,
        kind: str,
        b: Builder,
        *,
        n_hosts: int,
        nics_per_host: int,
        gpus_per_host: int,
        scale_up_gpus: int,
        loopback_bw: float,
        ecmp: str,
        params: dict[str, Any],
        pxn: bool = False,
    ) -> None:
        if ecmp not in ECMP_MODES:
            raise ValueError(f"unknown ecmp mode {ecmp!r} (known: {', '.join(ECMP_MODES)})")
        self.kind, self.ecmp, self.params, self.pxn = kind, ecmp, dict(params), bool(pxn)
        self.n_hosts, self.nics_per_host, self.gpus_per_host = n_hosts, nics_per_host, gpus_per_host
        self.scale_up_gpus, self.loopback_bw = scale_up_gpus, float(loopback_bw)
        self.n_endpoints = n_hosts * nics_per_host
        ep = [b.node(nic_name(h, i, nics_per_host)) for h in range(n_hosts) for i in range(nics_per_host)]
        self._ep_node = np.array(ep, dtype=np.int64)
        self._is_ep = np.zeros(len(b.names), dtype=bool)
        self._is_ep[self._ep_node] = True
        self.node_names = list(b.names)
        self.link_src = [b.names[i] for i in b.src]
        self.link_dst = [b.names[i] for i in b.dst]
        self.link_class = list(b.cls)
        self.cap = np.array(b.cap, dtype=np.float64)
        self._lsrc, self._ldst = np.array(b.src, dtype=np.int64), np.array(b.dst, dtype=np.int64)
        self._out: list[list[int]] = [[] for _ in b.names]
        for lk, s in enumerate(b.src):
            self._out[s].append(lk)
        self._in: list[list[int]] = [[] for _ in b.names]
        for lk, d in enumerate(b.dst):
            self._in[d].append(lk)
        self._paths: dict[tuple[int, int], list[tuple[int, ...]]] = {}
        self._switch_cache: dict[tuple[int, int], list[tuple[int, ...]]] = {}
        for e, node in enumerate(ep):
            if not self._out[node]:
                raise ValueError(f"{kind}: endpoint {b.names[node]} (endpoint {e}) is attached to no switch")
        # the endpoints whose port is on an optical circuit switch (lib/net/optical.py, with a run's reconfig):
        # every NIC of a rail fabric (its rail switches), the NICs on an Arbitrary file's optical = true switches
        self.optical_endpoints = np.array(
            [kind in RAIL_TYPES or any(b.names[int(self._ldst[lk])] in b.optical for lk in self._out[n]) for n in ep],
            dtype=bool,
        )

    def host_bw(self) -> float:
        """A host's network bandwidth, bytes per second: the sum of its NICs' ``host_up`` links (every
        plane of a MultiPlane NIC): ``nics_per_host x nic_bw`` on a rail fabric, ``host_bw`` on a
        fat-tree, a host's [[nic]] bandwidths on an Arbitrary file (runs.csv ``nic_bw``, docs/DATASET.md).

        Raises:
            ValueError: hosts differ (the builders and ``load_arbitrary`` refuse such a fabric).
        """
        host_of = {int(node): e // self.nics_per_host for e, node in enumerate(self._ep_node)}
        per: list[list[float]] = [[] for _ in range(self.n_hosts)]
        for lk, c in enumerate(self.link_class):
            if c == "host_up":
                per[host_of[int(self._lsrc[lk])]].append(float(self.cap[lk]))
        sums = {math.fsum(p) for p in per}
        if len(sums) != 1:
            raise ValueError(f"{self.kind}: hosts have different NIC bandwidths ({sorted(sums)} bytes/ns)")
        return sums.pop() * 1e9

    # ---------------------------------------------------------------- the simulator's interface
    @property
    def n_links(self) -> int:
        return len(self.cap)

    def capacities(self) -> np.ndarray:
        """Capacity of every link, bytes per ns (``link_id`` order)."""
        return self.cap.copy()

    def nic_of_gpu(self, local_gpu: np.ndarray) -> np.ndarray:
        """The NIC (0-based, on its host) of local GPU indices: ``g * nics_per_host // gpus_per_host``."""
        return np.asarray(local_gpu, dtype=np.int64) * self.nics_per_host // self.gpus_per_host

    def endpoint_of_rank(self, rank: np.ndarray) -> np.ndarray:
        """Endpoint of global ranks (host-major placement)."""
        r = np.asarray(rank, dtype=np.int64)
        g = self.gpus_per_host
        return (r // g) * self.nics_per_host + self.nic_of_gpu(r % g)

    def endpoints(self, src_rank: np.ndarray, dst_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Simulator endpoints of rank pairs: the ranks' NICs (with :attr:`pxn`, the source host's NIC on the
        destination GPU's rail); a pair inside one scale-up domain gets the source's endpoint twice (no network
        link: the simulator's loopback)."""
        s, d = self.endpoint_of_rank(src_rank), self.endpoint_of_rank(dst_rank)
        same = np.asarray(src_rank) // self.scale_up_gpus == np.asarray(dst_rank) // self.scale_up_gpus
        if self.pxn:
            k = self.nics_per_host
            return np.where(same, s, (s // k) * k + d % k), np.where(same, s, d)
        return s, np.where(same, s, d)

    def same_domain_hosts(self, src_host: np.ndarray, dst_host: np.ndarray) -> np.ndarray:
        """True where two hosts are in one scale-up domain (their traffic is on no network link)."""
        per = self.scale_up_gpus // self.gpus_per_host
        return np.asarray(src_host, dtype=np.int64) // per == np.asarray(dst_host, dtype=np.int64) // per

    def paths(self, a: int, b: int) -> list[tuple[int, ...]]:
        """The shortest paths (link-id tuples, lexicographic) from endpoint ``a`` to endpoint ``b != a``.

        An endpoint forwards nothing, so a path is a link of ``a`` up to a switch, a shortest path between
        switches, and a link down to ``b`` (or one link straight from ``a`` to ``b``): the switch-to-switch
        paths are searched once per pair of switches (:meth:`_switch_paths`) and shared by every pair of
        endpoints on them -- at 2,048 hosts x 8 rails a few thousand leaf pairs instead of a search per
        NIC pair.

        Raises:
            ValueError: no path, or more than :data:`MAX_PATHS`.
        """
        key = (int(a), int(b))
        hit = self._paths.get(key)
        if hit is not None:
            return hit
        s, t = int(self._ep_node[a]), int(self._ep_node[b])
        direct = sorted(lk for lk in self._out[s] if int(self._ldst[lk]) == t)
        out: list[tuple[int, ...]]
        if direct:
            out = [(lk,) for lk in direct]
        else:
            best: int | None = None
            parts: list[tuple[int, list[tuple[int, ...]], int]] = []
            for up in self._out[s]:
                u = int(self._ldst[up])
                if self._is_ep[u]:
                    continue
                for down in self._in[t]:
                    v = int(self._lsrc[down])
                    if self._is_ep[v]:
                        continue
                    mid = self._switch_paths(u, v)
                    if not mid:
                        continue
                    n = len(mid[0])
                    if best is None or n < best:
                        best, parts = n, []
                    if n == best:
                        parts.append((up, mid, down))
            if best is None:
                raise ValueError(f"{self.kind}: no path from {self.node_names[s]} to {self.node_names[t]}")
            out = sorted((up, *m, down) for up, mid, down in parts for m in mid)
        if len(out) > MAX_PATHS:
            raise ValueError(
                f"{self.kind}: more than {MAX_PATHS} shortest paths from {self.node_names[s]} to {self.node_names[t]}"
            )
        self._paths[key] = out
        return out

    def _switch_paths(self, u: int, v: int) -> list[tuple[int, ...]]:
        """The shortest paths (link-id tuples, lexicographic) from switch ``u`` to switch ``v`` through
        switches only (``[()]`` when ``u == v``, ``[]`` when there is none), cached per pair.

        Raises:
            ValueError: more than :data:`MAX_PATHS`.
        """
        key = (u, v)
        hit = self._switch_cache.get(key)
        if hit is not None:
            return hit
        if u == v:
            self._switch_cache[key] = [()]
            return [()]
        # BFS from v over incoming links, through switches only, stopped once u is reached: every switch
        # nearer to v than u is labelled by then (one of distance d is labelled while those of distance
        # d - 1 are expanded, all before the first of distance dist[u] - 1 is), and the walk below steps
        # only through those
        dist = {v: 0}
        q = deque([v])
        while q and u not in dist:
            x = q.popleft()
            for lk in self._in[x]:
                w = int(self._lsrc[lk])
                if w not in dist and not self._is_ep[w]:
                    dist[w] = dist[x] + 1
                    q.append(w)
        found: list[tuple[int, ...]] = []
        if u in dist:
            # Depth-first over the links that step one closer to v, lowest link id first: the paths come
            # out in lexicographic order. An explicit stack (a path is as long as the file makes it:
            # recursion ended in RecursionError past about 1,000 links); a partial path is a (link,
            # parent) chain.
            chain: list[tuple[int, int]] = []  # (link id, index of the previous entry or -1)
            stack: list[tuple[int, int]] = [(u, -1)]  # (node, its chain entry)
            while stack:
                x, at = stack.pop()
                if x == v:
                    path: list[int] = []
                    while at >= 0:
                        lk, at = chain[at]
                        path.append(lk)
                    found.append(tuple(reversed(path)))
                    if len(found) > MAX_PATHS:
                        raise ValueError(
                            f"{self.kind}: more than {MAX_PATHS} shortest paths from {self.node_names[u]} to "
                            f"{self.node_names[v]}"
                        )
                    continue
                nxt = []
                for lk in sorted(self._out[x]):
                    w = int(self._ldst[lk])
                    if dist.get(w) == dist[x] - 1:
                        chain.append((lk, at))
                        nxt.append((w, len(chain) - 1))
                stack.extend(reversed(nxt))
        self._switch_cache[key] = found
        return found

    def routes(self, src: np.ndarray, dst: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Link incidence of flows between endpoints (``src != dst``): (flow index, link id, coefficient),
        flow by flow, each flow's links in path order (``split``: its paths' links in id order, each with
        the share of the paths through it). Computed once per (endpoint pair, path chosen), then gathered
        for every flow."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        n = len(src)
        if n == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
        pick = mix_hash(np.asarray(seq, dtype=np.int64), src, dst)
        pairs, inv = np.unique(src * self.n_endpoints + dst, return_inverse=True)
        inv = inv.reshape(-1)
        paths = [self.paths(k // self.n_endpoints, k % self.n_endpoints) for k in pairs.tolist()]
        n_paths = np.array([len(ps) for ps in paths], dtype=np.int64)
        if self.ecmp == "hash":
            per_flow = n_paths[inv]
            choice = np.where(per_flow > 1, (pick % per_flow.astype(np.uint64)).astype(np.int64), 0)
        else:  # first, and split (all of a pair's paths at once): one variant a pair
            choice = np.zeros(n, dtype=np.int64)
        variants, vinv = np.unique(inv * (MAX_PATHS + 1) + choice, return_inverse=True)
        vinv = vinv.reshape(-1)
        v_links: list[np.ndarray] = []
        v_coef: list[np.ndarray] = []
        for v in variants.tolist():
            ps = paths[v // (MAX_PATHS + 1)]
            if self.ecmp == "split" and len(ps) > 1:
                w: dict[int, float] = {}
                for p in ps:
                    for lk in p:
                        w[lk] = w.get(lk, 0.0) + 1.0 / len(ps)
                v_links.append(np.array(sorted(w), dtype=np.int64))
                v_coef.append(np.array([w[lk] for lk in sorted(w)], dtype=np.float64))
            else:
                path = ps[v % (MAX_PATHS + 1)]
                v_links.append(np.array(path, dtype=np.int64))
                v_coef.append(np.ones(len(path), dtype=np.float64))
        v_len = np.array([len(x) for x in v_links], dtype=np.int64)
        v_off = np.concatenate([[0], np.cumsum(v_len)[:-1]])
        lens = v_len[vinv]
        fi = np.repeat(np.arange(n, dtype=np.int64), lens)
        out_start = np.concatenate([[0], np.cumsum(lens)[:-1]])
        at = np.repeat(v_off[vinv] - out_start, lens) + np.arange(len(fi), dtype=np.int64)
        return fi, np.concatenate(v_links)[at], np.concatenate(v_coef)[at]


# -------------------------------------------------------------------- builders
def fat_tree(n_hosts: int, k: int, host_bw: float, oversubscription: float = 1.0) -> tuple[Builder, dict[str, Any]]:
    """A k-ary fat-tree holding ``n_hosts`` hosts (module docstring); bandwidths bytes per ns."""
    if k < 2 or k % 2:
        raise ValueError(f"FatTree: fattree_k must be an even integer >= 2, got {k}")
    if n_hosts > k**3 // 4:
        raise ValueError(f"FatTree: {n_hosts} hosts do not fit a {k}-ary fat-tree ({k**3 // 4} hosts at most)")
    if not oversubscription >= 1:
        raise ValueError(f"FatTree: oversubscription must be >= 1, got {oversubscription}")
    b, h = Builder(), k // 2
    for host in range(n_hosts):
        b.node(nic_name(host, 0, 1))
    for host in range(n_hosts):  # host links first: link 2*host is host_up of host
        edge = host // h
        b.duplex(nic_name(host, 0, 1), f"edge-{edge // h}.{edge % h}", host_bw, "host_up", "host_down")
    n_edges = math.ceil(n_hosts / h)
    pods = math.ceil(n_edges / h)
    for p in range(pods):
        for e in range(h):
            if p * h + e < n_edges:
                for a in range(h):
                    b.duplex(f"edge-{p}.{e}", f"agg-{p}.{a}", host_bw / oversubscription, "edge_agg", "agg_edge")
    if pods > 1:
        for p in range(pods):
            for a in range(h):
                for c in range(h):
                    b.duplex(f"agg-{p}.{a}", f"core-{a * h + c}", host_bw, "agg_core", "core_agg")
    return b, {"fattree_k": k, "oversubscription": oversubscription}


def rail_fabric(
    n_hosts: int,
    nics: int,
    nic_bw: float,
    nspines: int,
    uplink_bw: float,
    group_hosts: int,
    planes: int = 1,
) -> Builder:
    """RailOptimized (``planes = 1``) or MultiPlane rails (module docstring); bandwidths bytes per ns."""
    b = Builder()
    for host in range(n_hosts):
        for i in range(nics):
            b.node(nic_name(host, i, nics))
    for p in range(planes):
        tag = f"p{p}." if planes > 1 else ""
        for host in range(n_hosts):
            for i in range(nics):
                sw = f"rail-{tag}{host // group_hosts}.{i}"
                b.duplex(nic_name(host, i, nics), sw, nic_bw / planes, "host_up", "host_down")
    groups = math.ceil(n_hosts / group_hosts)
    if groups > 1 or nics > 1:
        for p in range(planes):
            tag = f"p{p}." if planes > 1 else ""
            for g in range(groups):
                for i in range(nics):
                    for s in range(nspines):
                        b.duplex(f"rail-{tag}{g}.{i}", f"spine-{tag}{s}", uplink_bw, "rail_spine", "spine_rail")
    return b


def _int_param(cluster: dict[str, Any], key: str, default: int, low: int = 1) -> int:
    v = cluster.get(key)
    v = default if v is None else v
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"topology.{key} must be an integer >= {low}, got {v!r}")
    return v


def _oversubscription(cluster: dict[str, Any]) -> float:
    o = cluster.get("oversubscription", FABRIC_KEYS["oversubscription"])
    o = FABRIC_KEYS["oversubscription"] if o is None else o
    if isinstance(o, bool) or not isinstance(o, (int, float)) or not 1 <= o <= 1000:
        raise ValueError(f"topology.oversubscription must be a number from 1 to 1000, got {o!r}")
    return float(o)


def build_fabric(cluster: dict[str, Any], n_hosts: int, gpus_per_host: int) -> Fabric:
    """The :class:`Fabric` of a run's ``[cluster]`` settings (``topology`` one of :data:`FABRIC_TYPES`; Gbps;
    the :data:`FABRIC_KEYS` parameters or their defaults).

    Raises:
        ValueError: an unknown topology type or a parameter the rules refuse, naming the key.
    """
    kind = str(cluster.get("topology"))
    host_bw = float(cluster["host_bw_gbps"]) * _GBPS
    scale_up = _int_param(cluster, "scale_up_gpus", gpus_per_host)
    if scale_up % gpus_per_host:
        raise ValueError(
            f"topology.scale_up_gpus must be a multiple of gpus_per_node ({gpus_per_host}), got {scale_up}: "
            "the host-pair tables count a host as one node, so a scale-up domain holds whole hosts"
        )
    common: dict[str, Any] = dict(
        n_hosts=n_hosts,
        gpus_per_host=gpus_per_host,
        scale_up_gpus=scale_up,
        loopback_bw=float(cluster["loopback_gbps"]) * _GBPS,
        ecmp=str(cluster.get("ecmp", "hash")),
    )
    if cluster.get("pxn") is not None and kind not in ("RailOptimized", "MultiPlane"):
        raise ValueError(f"topology.pxn is a rail fabric's (RailOptimized, MultiPlane), not {kind}'s")
    if kind == "FatTree":
        k_min = 2
        while k_min**3 // 4 < n_hosts:
            k_min += 2
        k = _int_param(cluster, "fattree_k", k_min, 2)
        b, params = fat_tree(n_hosts, k, host_bw, _oversubscription(cluster))
        return Fabric(kind, b, nics_per_host=1, params=params, **common)
    if kind in ("RailOptimized", "MultiPlane"):
        nics = _int_param(cluster, "nics_per_host", gpus_per_host)
        if gpus_per_host % nics:
            raise ValueError(f"topology.nics_per_host ({nics}) must divide gpus_per_node ({gpus_per_host})")
        nic_bw_gbps = cluster.get("nic_bw_gbps")
        nic_bw = host_bw if nic_bw_gbps is None else float(nic_bw_gbps) * _GBPS
        if not nic_bw > 0:
            raise ValueError(f"topology.nic_bw_gbps must be > 0, got {nic_bw_gbps!r}")
        group = _int_param(cluster, "rail_group_hosts", n_hosts)
        planes = _int_param(cluster, "planes", FABRIC_KEYS["planes"]) if kind == "MultiPlane" else 1
        o = _oversubscription(cluster)
        spines = int(cluster["nspines"])
        uplink = min(group, n_hosts) * nic_bw / (spines * o)  # non-blocking at o = 1 (module docstring)
        pxn = cluster.get("pxn")
        if pxn is not None and not isinstance(pxn, bool):
            raise ValueError(f"topology.pxn must be true or false, got {pxn!r}")
        b = rail_fabric(n_hosts, nics, nic_bw, spines, uplink, group, planes)
        params = {
            "nics_per_host": nics,
            "nic_bw_gbps": nic_bw / _GBPS,
            "rail_group_hosts": group,
            "planes": planes,
            "oversubscription": o,
            "pxn": pxn is not False,
        }
        return Fabric(kind, b, nics_per_host=nics, params=params, pxn=pxn is not False, **common)
    if kind == "Arbitrary":
        path = cluster.get("fabric_file") or ""
        if not isinstance(path, str) or not path:
            raise ValueError("topology.fabric_file must name the Arbitrary fabric's TOML file")
        b, nics = load_arbitrary(path, n_hosts)
        if gpus_per_host % nics:
            raise ValueError(f"{path}: {nics} NICs per host must divide gpus_per_node ({gpus_per_host})")
        return Fabric(kind, b, nics_per_host=nics, params={"fabric_file": path, "nics_per_host": nics}, **common)
    raise ValueError(f"topology {kind!r} is not a fabric topology (known: {', '.join(FABRIC_TYPES)})")


def host_nic_bw(cluster: dict[str, Any], n_hosts: int, gpus_per_host: int) -> float:
    """runs.csv ``nic_bw``: a host's network bandwidth, bytes per second (docs/DATASET.md). On
    ``TwoLayerMultiPath`` a host has one link, ``host_bw_gbps``; on a fabric the sum of its NICs'
    (:meth:`Fabric.host_bw`): RailOptimized with 8 NICs of 400 Gbps is 8 x 50e9 = 4e11, not the unused
    ``host_bw_gbps``.

    Raises:
        ValueError: the fabric's rules (:func:`build_fabric`).
    """
    if cluster.get("topology", "TwoLayerMultiPath") == "TwoLayerMultiPath":
        return float(cluster["host_bw_gbps"]) * 1e9 / 8
    return build_fabric(cluster, n_hosts, gpus_per_host).host_bw()


def network_for(cluster: dict[str, Any], n_hosts: int, gpus_per_host: int) -> Any:
    """The network a run's flows cross: ``lib/sim/network.Topology`` for ``TwoLayerMultiPath`` (as
    ``Topology.from_cluster``, the same as from the run's netconfig), else :func:`build_fabric`."""
    if cluster.get("topology", "TwoLayerMultiPath") == "TwoLayerMultiPath":
        return Topology.from_cluster(cluster, n_hosts)
    return build_fabric(cluster, n_hosts, gpus_per_host)
