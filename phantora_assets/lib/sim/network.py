"""Flow-level network simulator of Phantora's ``TwoLayerMultiPath`` topology.

Topology (``netconfig.toml`` ``[topology.args]``, PHANTORA_FORMATS.md section 1): hosts in racks of
``rack_size`` (host i in rack i // rack_size), one ToR per rack, ``nspines`` spines, every ToR
linked to every spine. Links are full duplex, each direction its own capacity: host <-> ToR at
``host_bw``, ToR <-> spine at ``rack_uplink_port_bw`` (Gbps).

Routing: a flow between hosts of one rack uses [host up, host down]; between racks
[host up, ToR->spine, spine->ToR, host down]. The spine is chosen by ``ecmp``:

* ``"hash"`` (default): one spine per flow from a deterministic hash of the flow's connection
  key (the caller passes one per NCCL connection: source rank, destination rank, communicator),
  like a switch hashing the 5-tuple of a long-lived connection -- the path ``EcmpEverything``
  intends (a hash over the spine uplinks; a flow never splits), stable from step to step;
* ``"split"``: every flow is spread evenly over all spines (ideal fluid ECMP/packet spraying);
* ``"first"``: every flow takes spine 0 -- what upstream Phantora's network simulator actually does
  at commit b8c9de3 (``add_flow`` calls ``resolve_route``, which follows ``parent[0]``; the
  load balancer is parsed but unused), i.e. inter-rack traffic sees one uplink per rack.

Sharing: per-flow max-min fairness (``PerFlowMaxMin``) by progressive filling (water-filling):
all unfrozen flows grow at the same rate until a link saturates; the flows crossing it freeze;
repeat. Rates are recomputed whenever a flow starts or ends. A flow whose source and destination
host are the same (loopback) runs at ``loopback_speed`` and shares nothing, as in Phantora.
Flows of 0 bytes end when they start. Time is in nanoseconds, sizes in bytes.

The simulator is incremental and vectorised with numpy: the active flows are arrays, one
water-filling pass costs O(links touched) per bottleneck level, so a collective of N flows
costs O(N) per rate recomputation.

No Dagster import.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

ECMP_MODES = ("hash", "split", "first")

#: Allowed values of the name-valued ``[cluster]`` keys: the topology the simulators build
#: (TwoLayerMultiPath here; the others in lib/net/fabric.py, docs/FABRIC.md), Phantora's FairnessModel and
#: LoadBalancerType, and the analytic simulator's ECMP modes.
TOPOLOGY_NAMES: dict[str, tuple[str, ...]] = {
    "topology": ("TwoLayerMultiPath", "FatTree", "RailOptimized", "MultiPlane", "Arbitrary"),
    "fairness": ("PerFlowMaxMin", "PerVmPairMaxMin", "TenantFlowMaxMin"),
    "load_balancer": ("EcmpEverything", "EcmpSourcePort"),
    "ecmp": ECMP_MODES,
}
#: Count-valued ``[cluster]`` keys and their largest value.
TOPOLOGY_COUNTS = {"rack_size": 4096, "nspines": 512}  # lib/run/spec.MAX_NODES, MAX_NSPINES
#: Bandwidth-valued ``[cluster]`` keys, Gbps from 1 Mb/s to 1 Pb/s: the network simulator's float
#: nanoseconds break outside (1e-300 gives steps of 0 ns, 1e300 never ends, <= 0 loops or fails).
TOPOLOGY_BANDWIDTHS = ("host_bw_gbps", "rack_uplink_port_bw_gbps", "loopback_gbps")
MIN_BW_GBPS, MAX_BW_GBPS = 0.001, 1_000_000


def topology_rule(key: str, value: object, preset: object, source: str, got: Callable[[object], str]) -> str | None:  # noqa: PLR0911 (one return per rule broken, each its message)
    """What is wrong with ``topology.<key> = value`` (None when it is allowed); ``got`` words a value."""
    if key in TOPOLOGY_NAMES:
        known = TOPOLOGY_NAMES[key]
        if not isinstance(value, str):
            return f"must be a string, {got(value)}"
        if value not in known:
            return f"{value!r} is not supported (known: {', '.join(known)})"
        if key == "fairness" and source == "analytic" and value != "PerFlowMaxMin":
            return f"{value!r} is not simulated by the analytic simulator (PerFlowMaxMin only; use source = 'docker')"
    elif key in TOPOLOGY_COUNTS:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, {got(value)}"
        if not 1 <= value <= TOPOLOGY_COUNTS[key]:
            return f"must be between 1 and {TOPOLOGY_COUNTS[key]}, got {value}"
    elif key in TOPOLOGY_BANDWIDTHS:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number (Gbps), {got(value)}"
        if not MIN_BW_GBPS <= value <= MAX_BW_GBPS:  # also refuses nan and inf
            return f"must be a number from {MIN_BW_GBPS} to {MAX_BW_GBPS} (Gbps), got {value}"
    elif type(value) is not type(preset):
        return f"must be of the type of presets.toml's {preset!r}, {got(value)}"
    return None


_EPS_BYTES = 1e-3  # a flow with less left than this is complete


@dataclass(frozen=True)
class Topology:
    """A TwoLayerMultiPath network: ``n_hosts`` hosts, bandwidths in bytes per ns (= GB/s)."""

    n_hosts: int
    rack_size: int
    nspines: int
    host_bw: float
    uplink_bw: float
    loopback_bw: float
    ecmp: str = "hash"

    @classmethod
    def from_cluster(cls, cluster: dict[str, Any], n_hosts: int) -> Topology:
        """From a run's ``[cluster]`` settings (Gbps; ``presets.toml`` + the run's overrides)."""
        gbps = 1e9 / 8 / 1e9  # Gbps -> bytes per ns
        ecmp = str(cluster.get("ecmp", "hash"))
        if ecmp not in ECMP_MODES:
            raise ValueError(f"unknown ecmp mode {ecmp!r} (known: {', '.join(ECMP_MODES)})")
        return cls(
            int(n_hosts),
            int(cluster["rack_size"]),
            int(cluster["nspines"]),
            float(cluster["host_bw_gbps"]) * gbps,
            float(cluster["rack_uplink_port_bw_gbps"]) * gbps,
            float(cluster["loopback_gbps"]) * gbps,
            ecmp,
        )

    @classmethod
    def from_netconfig(cls, cfg: dict[str, Any], ecmp: str = "hash") -> Topology:
        """From a Phantora ``netconfig.toml`` (parsed): ``TwoLayerMultiPath`` only; hosts =
        ``host_mapping``. ``ecmp`` is this simulator's choice (the file's ``load_balancer_type``
        names Phantora's, see the module docstring)."""
        topo = cfg["topology"]
        if topo.get("type") != "TwoLayerMultiPath":
            raise ValueError(f"netconfig topology {topo.get('type')!r} is not supported (TwoLayerMultiPath only)")
        a = topo["args"]
        n_hosts = len(cfg.get("host_mapping") or []) or int(a["nracks"]) * int(a["rack_size"])
        return cls.from_cluster(
            {
                "rack_size": a["rack_size"],
                "nspines": a["nspines"],
                "host_bw_gbps": a["host_bw"],
                "rack_uplink_port_bw_gbps": a["rack_uplink_port_bw"],
                "loopback_gbps": cfg["simulator"]["loopback_speed"],
                "ecmp": ecmp,
            },
            n_hosts,
        )

    @property
    def n_racks(self) -> int:
        return math.ceil(self.n_hosts / self.rack_size)

    @property
    def n_links(self) -> int:
        return 2 * self.n_hosts + 2 * self.n_racks * self.nspines

    def capacities(self) -> np.ndarray:
        h, rs = self.n_hosts, self.n_racks * self.nspines
        return np.concatenate([np.full(2 * h, self.host_bw), np.full(2 * rs, self.uplink_bw)])

    def routes(self, src: np.ndarray, dst: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Link incidence of flows (src != dst): (flow index, link id, coefficient) arrays."""
        n = len(src)
        h, s = self.n_hosts, self.nspines
        up, down = src, h + dst
        rsrc, rdst = src // self.rack_size, dst // self.rack_size
        cross = np.nonzero(rsrc != rdst)[0]
        fi = [np.arange(n), np.arange(n)]
        li = [up, down]
        co = [np.ones(n), np.ones(n)]
        if len(cross):
            tor_up = 2 * h + rsrc[cross] * s
            spine_down = 2 * h + self.n_racks * s + rdst[cross] * s
            if self.ecmp == "split" and s > 1:
                for j in range(s):
                    fi += [cross, cross]
                    li += [tor_up + j, spine_down + j]
                    co += [np.full(len(cross), 1.0 / s)] * 2
            else:
                if self.ecmp == "first" or s == 1:
                    spine = np.zeros(len(cross), dtype=np.int64)
                else:
                    spine = (mix_hash(seq[cross], src[cross], dst[cross]) % np.uint64(s)).astype(np.int64)
                fi += [cross, cross]
                li += [tor_up + spine, spine_down + spine]
                co += [np.ones(len(cross))] * 2
        return np.concatenate(fi), np.concatenate(li).astype(np.int64), np.concatenate(co)


def mix_hash(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """splitmix64 of (a, b, c): a deterministic per-flow hash."""
    with np.errstate(over="ignore"):
        x: np.ndarray = (
            (a.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
            ^ (b.astype(np.uint64) << np.uint64(32))
            ^ c.astype(np.uint64)
        )
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def max_min_rates(
    n_flows: int, flow_idx: np.ndarray, link_idx: np.ndarray, coef: np.ndarray, cap: np.ndarray
) -> np.ndarray:
    """Per-flow max-min fair rates by progressive filling.

    ``(flow_idx, link_idx, coef)``: flow f loads link l with ``coef * rate_f``. Every flow must
    cross at least one link. Returns the rates (same unit as ``cap``).
    """
    rate = np.zeros(n_flows)
    if n_flows == 0:
        return rate
    left = cap.astype(float).copy()
    active_e = np.ones(len(flow_idx), dtype=bool)
    frozen = np.zeros(n_flows, dtype=bool)
    nl = len(cap)
    while True:
        w = np.bincount(link_idx[active_e], weights=coef[active_e], minlength=nl)
        used = w > 0
        if not used.any():
            break
        share = left[used] / w[used]
        inc = float(share.min())
        rate[~frozen] += inc
        left -= inc * w
        sat = used & (left <= 1e-9 * cap)
        hit = active_e & sat[link_idx]
        newly = np.unique(flow_idx[hit])
        frozen[newly] = True
        if frozen.all():
            break
        active_e &= ~frozen[flow_idx]
    return rate


def max_min_rates_py(flows: list[tuple[tuple[int, float], ...]], cap: np.ndarray | list[float]) -> list[float]:
    """:func:`max_min_rates` in plain Python (faster for a few dozen flows).
    ``flows[f]`` = ((link, coefficient), ...)."""
    n = len(flows)
    rate = [0.0] * n
    users: dict[int, list[tuple[int, float]]] = {}
    for f, lks in enumerate(flows):
        for lk, c in lks:
            users.setdefault(lk, []).append((f, c))
    left = {lk: float(cap[lk]) for lk in users}
    active = set(range(n))
    while active:
        weights: dict[int, float] = {}
        best = math.inf
        for lk, us in users.items():
            w = sum(c for f, c in us if f in active)
            if w > 0:
                weights[lk] = w
                share = left[lk] / w
                if share < best:
                    best = share
        if not weights:
            break
        for f in active:
            rate[f] += best
        frozen: set[int] = set()
        for lk, w in weights.items():
            left[lk] -= best * w
            if left[lk] <= 1e-9 * cap[lk]:
                frozen.update(f for f, _ in users[lk])
        active -= frozen
        if not frozen:  # numerical safety: should not happen
            break
    return rate


SMALL = 48  # flow sets up to this size use the pure-Python water-filling


class FlowNetwork:
    """Incremental flow-level simulation on a :class:`Topology` (see module docstring).

    Use: :meth:`add` flows at the current time, :meth:`next_time` is the earliest completion,
    :meth:`advance` moves the clock and returns the flows that completed; ``end_ns[i]`` is the
    completion time of flow ``i`` (ids are assigned in :meth:`add` order, from 0).
    """

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.cap = topo.capacities()
        self.now = 0.0
        self._seq = 0
        self.end_ns: list[np.ndarray] = []
        # active flows
        self.ids = np.zeros(0, dtype=np.int64)
        self.left = np.zeros(0)
        self.rate = np.zeros(0)
        self.loop = np.zeros(0, dtype=bool)
        self.src = np.zeros(0, dtype=np.int64)
        self.dst = np.zeros(0, dtype=np.int64)
        self.conn = np.zeros(0, dtype=np.int64)
        self._routes: dict[int, tuple[tuple[int, float], ...]] = {}
        self._dirty = False
        self._ends: list[tuple[np.ndarray, np.ndarray]] = []
        self.recomputations = 0

    # ------------------------------------------------------------------ flows
    def add(self, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, conn: np.ndarray | None = None) -> np.ndarray:
        """Start flows (host indices, bytes) now; returns their ids. ``conn``: the ECMP hash key
        of each flow (default: its id)."""
        src = np.asarray(src, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=float)
        n = len(src)
        ids = np.arange(self._seq, self._seq + n, dtype=np.int64)
        self._seq += n
        conn = ids if conn is None else np.asarray(conn, dtype=np.int64)
        zero = nbytes <= 0
        if zero.any():
            self._ends.append((ids[zero], np.full(int(zero.sum()), self.now)))
        keep = ~zero
        net = keep & (src != dst)
        if net.any() and (self.topo.n_hosts > 1):
            self._store_routes(ids[net], src[net], dst[net], conn[net])
        if keep.any():
            self.ids = np.concatenate([self.ids, ids[keep]])
            self.left = np.concatenate([self.left, nbytes[keep]])
            self.rate = np.concatenate([self.rate, np.zeros(int(keep.sum()))])
            self.loop = np.concatenate([self.loop, src[keep] == dst[keep]])
            self.src = np.concatenate([self.src, src[keep]])
            self.dst = np.concatenate([self.dst, dst[keep]])
            self.conn = np.concatenate([self.conn, conn[keep]])
            self._dirty = True
        return ids

    def _recompute(self) -> None:
        self._dirty = False
        if not len(self.ids):
            return
        self.recomputations += 1
        rate = np.full(len(self.ids), self.topo.loopback_bw)
        net = np.nonzero(~self.loop)[0]
        if len(net) and len(net) <= SMALL:
            rate[net] = max_min_rates_py([self._route(int(i)) for i in self.ids[net]], self.cap)
        elif len(net):
            fi, li, co = self.topo.routes(self.src[net], self.dst[net], self.conn[net])
            rate[net] = max_min_rates(len(net), fi, li, co, self.cap)
        self.rate = rate

    def _route(self, fid: int) -> tuple[tuple[int, float], ...]:
        return self._routes[fid]

    def _store_routes(self, ids: np.ndarray, src: np.ndarray, dst: np.ndarray, conn: np.ndarray) -> None:
        fi, li, co = self.topo.routes(src, dst, conn)
        per: list[list[tuple[int, float]]] = [[] for _ in range(len(ids))]
        for f, lk, c in zip(fi.tolist(), li.tolist(), co.tolist()):
            per[f].append((lk, c))
        for fid, r in zip(ids.tolist(), per):
            self._routes[fid] = tuple(r)

    @property
    def n_added(self) -> int:
        """Flows added so far (the id the next flow gets)."""
        return self._seq

    def next_time(self) -> float:
        """Time of the earliest completion among active flows (inf when none)."""
        if self._dirty:
            self._recompute()
        if not len(self.ids):
            return math.inf
        return self.now + float((self.left / self.rate).min())

    def advance(self, t: float) -> np.ndarray:
        """Move the clock to ``t`` (<= :meth:`next_time`); return ids of flows completed at ``t``
        (together with any 0-byte flows added since the last call)."""
        if self._dirty:
            self._recompute()
        done_ids: list[np.ndarray] = [e[0] for e in self._ends]
        for ids, ts in self._ends:
            self._record(ids, ts)
        self._ends = []
        if len(self.ids) and t > self.now:
            dt = t - self.now
            self.left = self.left - self.rate * dt
            fin = self.left <= np.maximum(_EPS_BYTES, self.rate * 1e-3)
            if fin.any():
                ids = self.ids[fin]
                self._record(ids, np.full(len(ids), t))
                for fid in ids[~self.loop[fin]].tolist():
                    self._routes.pop(fid, None)
                done_ids.append(ids)
                keep = ~fin
                self.ids, self.left, self.rate = self.ids[keep], self.left[keep], self.rate[keep]
                self.loop, self.src, self.dst = self.loop[keep], self.src[keep], self.dst[keep]
                self.conn = self.conn[keep]
                self._dirty = True
        self.now = max(self.now, t)
        return np.concatenate(done_ids) if done_ids else np.zeros(0, dtype=np.int64)

    def _record(self, ids: np.ndarray, ts: np.ndarray) -> None:
        self.end_ns.append(np.stack([ids.astype(float), ts]))

    def end_times(self) -> np.ndarray:
        """Completion time of every flow added so far (NaN for flows still running)."""
        out = np.full(self._seq, np.nan)
        for blk in self.end_ns:
            out[blk[0].astype(np.int64)] = blk[1]
        return out
