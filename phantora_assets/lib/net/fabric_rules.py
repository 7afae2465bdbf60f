"""The run matrix's rules for a run's ``topology`` settings, and the run-id tail of a fabric run
(``lib/run/spec.validate`` calls them; docs/FABRIC.md). No Dagster import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phantora_assets.lib.net.fabric import FABRIC_KEYS, FABRIC_TYPES, build_fabric
from phantora_assets.lib.sim.network import topology_rule


def topology_tail(topology: dict[str, Any], default: str) -> str:
    """What a run id and run folder get after the layout: ``""`` on the default topology (presets.toml's),
    else ``_<topology type in lower case>`` (``_railoptimized``), so one job on several fabrics is several runs."""
    kind = str(topology.get("topology", default))
    return "" if kind == default else f"_{kind.lower()}"


def topology_problem(
    topo: Any, cluster: dict[str, Any], n_hosts: int, gpus_per_host: int, source: str, got: Callable[[object], str]
) -> str | None:
    """What is wrong with a run entry's ``topology`` pairs (None: nothing): not unique (key, value) pairs, a
    key of neither presets.toml ``[cluster]`` nor :data:`FABRIC_KEYS`, a ``[cluster]`` key's rule
    (``lib/sim/network.topology_rule``), then :func:`fabric_rule` on the run's settings. ``got`` words a value."""
    pairs = isinstance(topo, tuple) and all(
        isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in topo
    )
    if not pairs or len({kv[0] for kv in topo}) != len(topo):
        return f"topology must be (key, value) pairs with unique keys, {got(topo)}"
    unknown = {k for k, _ in topo} - set(cluster) - set(FABRIC_KEYS)
    if unknown:
        return f"unknown topology keys {sorted(unknown)}"
    for key, value in topo:
        rule = None if key in FABRIC_KEYS else topology_rule(key, value, cluster[key], source, got)
        if rule:
            return f"topology.{key} {rule}"
    return fabric_rule({**cluster, **dict(topo)}, {k for k, _ in topo}, n_hosts, gpus_per_host, source)


def fabric_rule(cluster: dict[str, Any], keys: set[str], n_hosts: int, gpus_per_host: int, source: str) -> str | None:
    """What is wrong with a run's topology settings beyond the ``[cluster]`` keys' own rules (None: nothing):
    :data:`FABRIC_KEYS` without a fabric topology, a rule of :func:`build_fabric`, or a multi-NIC fabric
    for ``source = "docker"`` (Phantora has none: ``lib/phantora/netconfig.netconfig_for``)."""
    kind = cluster.get("topology")
    if kind == "TwoLayerMultiPath":
        extra = sorted(keys & set(FABRIC_KEYS))
        return f"topology keys {extra} need a fabric topology ({', '.join(FABRIC_TYPES)})" if extra else None
    try:
        build_fabric(cluster, n_hosts, gpus_per_host)
    except ValueError as e:
        return str(e)
    if source == "docker" and kind in ("RailOptimized", "MultiPlane"):
        return f"Phantora (source = 'docker') has no {kind} topology: its hosts have one network endpoint each"
    return None
