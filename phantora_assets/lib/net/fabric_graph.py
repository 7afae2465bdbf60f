"""The graph a fabric is built from, and the ``Arbitrary`` topology's user file (``lib/net/fabric.py``).

No Dagster import.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_GBPS = 1 / 8  # Gbps -> bytes per ns


@dataclass
class Builder:
    """Nodes (by name) and directed links (ends, capacity in bytes per ns, class) of a fabric being built."""

    names: list[str] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)
    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    cap: list[float] = field(default_factory=list)
    cls: list[str] = field(default_factory=list)
    optical: set[str] = field(default_factory=set)  # an Arbitrary file's optical circuit switches (by name)

    def node(self, name: str) -> int:
        if name not in self.index:
            self.index[name] = len(self.names)
            self.names.append(name)
        return self.index[name]

    def duplex(self, a: str, b: str, bw: float, up: str, down: str) -> None:
        """Links a -> b (class ``up``) and b -> a (class ``down``), ``bw`` bytes per ns each."""
        ia, ib = self.node(a), self.node(b)
        for s, d, c in ((ia, ib, up), (ib, ia, down)):
            self.src.append(s)
            self.dst.append(d)
            self.cap.append(float(bw))
            self.cls.append(c)


def nic_name(host: int, nic: int, nics_per_host: int) -> str:
    """The endpoint's node name: ``host-k`` (one NIC a host) or ``host-k/nic-i`` (1-based k, 0-based i)."""
    return f"host-{host + 1}" if nics_per_host == 1 else f"host-{host + 1}/nic-{nic}"


def load_arbitrary(path: str | Path, n_hosts: int) -> tuple[Builder, int]:  # noqa: C901, PLR0912, PLR0915 (one check per rule of the file, each with its message)
    """An ``Arbitrary`` fabric file: returns the graph and the NICs per host. Every rule is checked
    before anything is built (a file is refused whole, never used in part).

    Format (TOML)::

        [[switch]]
        name = "tor-1"                 # a string, unique; not of the form host-k
        optical = true                 # optional (default false): an optical circuit switch (below)
        [[link]]                       # full duplex between two different switches; two [[link]]s
        a = "tor-1"                    # of one pair are two parallel cables (ECMP between them)
        b = "core-1"
        gbps = 400
        [[nic]]                        # one per (host, nic): every host of the run, nics 0 .. n-1 each
        host = 1                       # 1 .. the run's nodes (host-1 is node 0)
        nic = 0                        # 0-based
        switch = "tor-1"
        gbps = 400

    Rules: only the tables ``switch``, ``link``, ``nic``, each entry with exactly its keys; switch
    names strings, unique, not ``host-...``; a link's ends two different declared switches; a NIC's
    ``host`` an integer 1 .. ``n_hosts`` (hosts are numbered from 1: a ``host = 0``, a negative host or
    one beyond the run would be a node of the graph that is no host of the run, forwarding traffic as a
    switch), ``nic`` an integer >= 0, each (host, nic) once, its switch declared; every bandwidth a
    number from 0.001 to 1000000 Gbps; every host of the run NICs 0 .. n-1, the same n for all, and
    the same total NIC bandwidth (the run's one ``nic_bw``, bytes/s a host: docs/DATASET.md); every NIC
    reaches every other through switches (one connected fabric: a host never forwards, so a NIC on a
    switch island is refused with the NICs that host-1's first NIC cannot reach).

    ``optical = true`` marks a switch as an optical circuit switch: with the run's ``reconfig``
    (docs/FABRIC.md, "The optical rail in the simulator") the port of every NIC on it holds a circuit for
    one parallelism group at a time (``lib/net/optical.py``), as every NIC's port does on a rail fabric;
    NICs on the other switches need no circuit. Without ``reconfig`` the key changes nothing (the EPS).
    The circuit model covers a NIC's own port only, so an optical switch must never be crossed between two
    other switches: one on a shortest path between the switches of two NICs, neither of them on it, is
    refused (its switch-to-switch circuits are not modelled).

    Raises:
        ValueError: the file, the entry and the rule.
    """
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"Arbitrary fabric file {p}: {e}") from e
    doc_switches = doc.get("switch", [])
    if set(doc) - {"switch", "link", "nic"}:
        raise ValueError(f"{p}: unknown tables {sorted(set(doc) - {'switch', 'link', 'nic'})} (switch, link, nic)")

    def rows(name: str, keys: set[str]) -> list[dict[str, Any]]:
        v = doc.get(name, [])
        if not isinstance(v, list) or not all(isinstance(r, dict) for r in v):
            raise ValueError(f"{p}: {name} must be an array of tables ([[{name}]])")
        for i, r in enumerate(v):
            if set(r) != keys:
                raise ValueError(f"{p}: [[{name}]] #{i + 1} must have exactly the keys {sorted(keys)}, got {sorted(r)}")
        return v

    def bw(r: dict[str, Any], where: str) -> float:
        g = r["gbps"]
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.001 <= g <= 1_000_000:
            raise ValueError(f"{p}: {where}: gbps must be a number from 0.001 to 1000000, got {g!r}")
        return float(g) * _GBPS

    def integer(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    switch_rows = doc.get("switch", [])
    if isinstance(switch_rows, list):  # "optical" is optional: rows() checks the keys of the rest
        for i, r in enumerate(switch_rows):
            if isinstance(r, dict) and "optical" in r and not isinstance(r["optical"], bool):
                raise ValueError(f"{p}: [[switch]] #{i + 1}: optical must be true or false, got {r['optical']!r}")
        doc["switch"] = [
            {k: v for k, v in r.items() if k != "optical"} if isinstance(r, dict) else r for r in switch_rows
        ]
    switch_rows = rows("switch", {"name"})
    for i, r in enumerate(switch_rows):
        if not isinstance(r["name"], str) or not r["name"] or r["name"].startswith("host-"):
            raise ValueError(
                f"{p}: [[switch]] #{i + 1}: name must be a non-empty string, not 'host-...', got {r['name']!r}"
            )
    switches = [r["name"] for r in switch_rows]
    if len(set(switches)) != len(switches):
        twice = sorted({s for s in switches if switches.count(s) > 1})
        raise ValueError(f"{p}: switch names must be unique, {twice} repeat")
    known = set(switches)
    nic_rows = rows("nic", {"host", "nic", "switch", "gbps"})
    per_host: dict[int, set[int]] = {}
    host_gbps: dict[int, list[float]] = {}
    for i, r in enumerate(nic_rows):
        where = f"[[nic]] #{i + 1}"
        if not integer(r["host"]) or not 1 <= r["host"] <= n_hosts:
            raise ValueError(
                f"{p}: {where}: host must be an integer from 1 to {n_hosts} (the run's nodes; hosts are numbered "
                f"from 1, host-1 is node 0), got {r['host']!r}"
            )
        if not integer(r["nic"]) or r["nic"] < 0:
            raise ValueError(f"{p}: {where}: nic must be an integer >= 0 (NICs are numbered from 0), got {r['nic']!r}")
        if not isinstance(r["switch"], str) or r["switch"] not in known:
            raise ValueError(f"{p}: {where}: unknown switch {r['switch']!r} (declare it as a [[switch]])")
        if r["nic"] in per_host.setdefault(r["host"], set()):
            raise ValueError(f"{p}: {where}: host {r['host']} nic {r['nic']} listed twice")
        per_host[r["host"]].add(r["nic"])
        bw(r, where)
        host_gbps.setdefault(r["host"], []).append(float(r["gbps"]))
    link_rows = rows("link", {"a", "b", "gbps"})
    for i, r in enumerate(link_rows):
        where = f"[[link]] #{i + 1}"
        if not all(isinstance(r[k], str) and r[k] in known for k in ("a", "b")) or r["a"] == r["b"]:
            raise ValueError(f"{p}: {where}: a and b must be two different known switches, got {r['a']!r}, {r['b']!r}")
        bw(r, where)
    for h in range(1, n_hosts + 1):
        if h not in per_host:
            raise ValueError(f"{p}: host {h} of the run has no [[nic]]")
    counts = {len(per_host[h]) for h in range(1, n_hosts + 1)}
    nics = counts.pop()
    if counts or any(per_host[h] != set(range(nics)) for h in range(1, n_hosts + 1)):
        raise ValueError(f"{p}: every host needs NICs 0 .. n-1, the same n for all hosts")
    sums = {f"host-{h}": math.fsum(host_gbps[h]) for h in range(1, n_hosts + 1)}  # exact: order-free
    if len(set(sums.values())) > 1:
        raise ValueError(
            f"{p}: every host needs the same total NIC bandwidth (the run's nic_bw is one per host), got Gbps {sums}"
        )
    islands = _unreachable(nic_rows, link_rows)
    if islands:
        raise ValueError(
            f"{p}: the fabric is not connected: {_listed(islands)} cannot be reached from host-1's nic 0 through "
            "switches (every NIC must reach every other; a host never forwards)"
        )
    optical = {
        str(r["name"]) for r in (doc_switches if isinstance(doc_switches, list) else []) if r.get("optical") is True
    }
    if optical and (crossed := _crossed_optical(optical, nic_rows, link_rows)):
        raise ValueError(
            f"{p}: optical switch {crossed[0]!r} is on a shortest path between {crossed[1]!r} and {crossed[2]!r}, "
            "the switches of two NICs neither on it: a circuit between two switches is not modelled (only a NIC's "
            "own port on an optical switch; docs/FABRIC.md)"
        )
    b = Builder(optical=optical)
    for h in range(n_hosts):
        for i in range(nics):
            b.node(nic_name(h, i, nics))
    for i, r in enumerate(sorted(nic_rows, key=lambda r: (r["host"], r["nic"]))):
        end = nic_name(r["host"] - 1, r["nic"], nics)
        b.duplex(end, r["switch"], bw(r, f"nic {i + 1}"), "host_up", "host_down")
    for i, r in enumerate(link_rows):
        b.duplex(r["a"], r["b"], bw(r, f"[[link]] #{i + 1}"), "fabric", "fabric")
    return b, nics


def _crossed_optical(
    optical: set[str], nic_rows: list[dict[str, Any]], link_rows: list[dict[str, Any]]
) -> tuple[str, str, str] | None:
    """An optical switch X on a shortest path (hops, as ``Fabric.paths`` routes) between two switches S, T of
    NICs, X not S nor T: ``(X, S, T)`` (the first by name), else None. d(S, X) + d(X, T) = d(S, T) by
    breadth-first search from each of those switches and from X."""
    adj: dict[str, set[str]] = {}
    for r in link_rows:
        adj.setdefault(r["a"], set()).add(r["b"])
        adj.setdefault(r["b"], set()).add(r["a"])

    def dist(src: str) -> dict[str, int]:
        d, frontier = {src: 0}, [src]
        while frontier:
            nxt = []
            for u in frontier:
                for v in sorted(adj.get(u, ())):
                    if v not in d:
                        d[v] = d[u] + 1
                        nxt.append(v)
            frontier = nxt
        return d

    ends = sorted({str(r["switch"]) for r in nic_rows})
    from_end = {s: dist(s) for s in ends}
    for x in sorted(optical):
        dx = dist(x)
        for s in ends:
            for t in ends:
                if x in (s, t) or s >= t or t not in from_end[s] or s not in dx or t not in dx:
                    continue
                if dx[s] + dx[t] == from_end[s][t]:
                    return x, s, t
    return None


def _unreachable(nic_rows: list[dict[str, Any]], link_rows: list[dict[str, Any]]) -> list[str]:
    """``host-k nic i`` of every NIC whose switch is not in the switch component of host-1's nic 0
    (``[[link]]``s are full duplex: components of the undirected switch graph, by union-find, no
    recursion). Rows already checked by :func:`load_arbitrary`."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for r in link_rows:
        ra, rb = root(r["a"]), root(r["b"])
        if ra != rb:
            parent[ra] = rb
    ordered = sorted(nic_rows, key=lambda r: (r["host"], r["nic"]))
    home = root(ordered[0]["switch"])
    return [f"host-{r['host']} nic {r['nic']}" for r in ordered if root(r["switch"]) != home]


def _listed(items: list[str], most: int = 8) -> str:
    """``a, b, c`` or ``a, b, ... (12 NICs)`` past ``most``."""
    head = ", ".join(items[:most])
    return head if len(items) <= most else f"{head}, ... ({len(items)} NICs)"
