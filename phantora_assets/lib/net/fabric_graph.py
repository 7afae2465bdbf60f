"""The graph a fabric is built from, and the ``Arbitrary`` topology's user file (``lib/net/fabric.py``).

No Dagster import.
"""

from __future__ import annotations

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


def load_arbitrary(path: str | Path, n_hosts: int) -> tuple[Builder, int]:  # noqa: C901, PLR0912 (one check per rule of the file, each with its message)
    """An ``Arbitrary`` fabric file: returns the graph and the NICs per host.

    Format (TOML)::

        [[switch]]
        name = "tor-1"                 # unique; not of the form host-k
        [[link]]                       # full duplex between two switches
        a = "tor-1"
        b = "core-1"
        gbps = 400
        [[nic]]                        # one per (host, nic): every host of the run, nics 0 .. n-1 each
        host = 1                       # 1-based, as host-1
        nic = 0                        # 0-based
        switch = "tor-1"
        gbps = 400

    Raises:
        ValueError: the file, the entry and the rule (unknown keys, unknown or duplicate switches, a
            bandwidth not a positive number, a host of the run without NICs, unequal NIC counts).
    """
    p = Path(path)
    try:
        doc = tomllib.loads(p.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"Arbitrary fabric file {p}: {e}") from e
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

    switches = [str(r["name"]) for r in rows("switch", {"name"})]
    if len(set(switches)) != len(switches) or any(s.startswith("host-") for s in switches):
        raise ValueError(f"{p}: switch names must be unique and not start with 'host-'")
    known = set(switches)
    nic_rows = rows("nic", {"host", "nic", "switch", "gbps"})
    per_host: dict[int, set[int]] = {}
    for i, r in enumerate(nic_rows):
        where = f"[[nic]] #{i + 1}"
        if not all(isinstance(r[k], int) and not isinstance(r[k], bool) for k in ("host", "nic")):
            raise ValueError(f"{p}: {where}: host and nic must be integers")
        if r["switch"] not in known:
            raise ValueError(f"{p}: {where}: unknown switch {r['switch']!r}")
        if r["nic"] in per_host.setdefault(r["host"], set()):
            raise ValueError(f"{p}: {where}: host {r['host']} nic {r['nic']} listed twice")
        per_host[r["host"]].add(r["nic"])
    for h in range(1, n_hosts + 1):
        if h not in per_host:
            raise ValueError(f"{p}: host {h} of the run has no [[nic]]")
    counts = {len(per_host[h]) for h in range(1, n_hosts + 1)}
    nics = counts.pop()
    if counts or any(per_host[h] != set(range(nics)) for h in range(1, n_hosts + 1)):
        raise ValueError(f"{p}: every host needs NICs 0 .. n-1, the same n for all hosts")
    b = Builder()
    for h in range(n_hosts):
        for i in range(nics):
            b.node(nic_name(h, i, nics))
    for i, r in enumerate(sorted(nic_rows, key=lambda r: (r["host"], r["nic"]))):
        if r["host"] <= n_hosts:
            end = nic_name(r["host"] - 1, r["nic"], nics)
            b.duplex(end, r["switch"], bw(r, f"nic {i + 1}"), "host_up", "host_down")
    for i, r in enumerate(rows("link", {"a", "b", "gbps"})):
        where = f"[[link]] #{i + 1}"
        if r["a"] not in known or r["b"] not in known or r["a"] == r["b"]:
            raise ValueError(f"{p}: {where}: a and b must be two different known switches, got {r['a']!r}, {r['b']!r}")
        b.duplex(r["a"], r["b"], bw(r, where), "fabric", "fabric")
    return b, nics
