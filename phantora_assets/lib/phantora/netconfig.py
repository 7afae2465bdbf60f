"""Phantora's ``netconfig.toml`` (PHANTORA_FORMATS.md section 1): build and parse.

The simulator reads it with ``deny_unknown_fields``, so only Phantora's own keys appear.
"""

from __future__ import annotations

import math
import tomllib
from typing import Any

import tomli_w

from phantora_assets.lib.run.spec import RunSpec


class NoPhantoraTopology(ValueError):
    """The run's topology has no Phantora netconfig (Phantora builds TwoLayerMultiPath, FatTree and
    Arbitrary only); the message says why."""


def netconfig_for(spec: RunSpec) -> dict[str, Any]:
    """The netconfig of ``spec`` from the run's cluster settings (docs/FABRIC.md, "Phantora's netconfig").

    ``TwoLayerMultiPath``: hosts ``host-1 .. host-N`` map to topology hosts 0..N-1; racks =
    ceil(N / rack_size); bandwidths in Gbps. ``FatTree``: Phantora's ``{nports, bandwidth,
    oversub_ratio}`` from ``fattree_k``, ``host_bw_gbps`` and ``oversubscription``. ``Arbitrary``:
    Phantora's ``{nracks, rack_size, host_bw, rack_bw}`` when the fabric file has that shape (every
    host one NIC on a rack switch of ``rack_size`` hosts, every rack switch one link to one core switch,
    uniform bandwidths).

    Raises:
        NoPhantoraTopology: ``RailOptimized`` / ``MultiPlane`` (Phantora has no multi-NIC host), an
            ``Arbitrary`` file of another shape, or a scale-up domain larger than a host.
    """
    c = spec.cluster
    n = spec.n_nodes
    kind = c["topology"]
    if kind != "TwoLayerMultiPath":
        return _fabric_netconfig(spec)
    return {
        "host_mapping": [f"host-{i + 1}" for i in range(n)],
        "simulator": {"loopback_speed": c["loopback_gbps"], "fairness": c["fairness"]},
        "topology": {
            "type": c["topology"],
            "args": {
                "nspines": c["nspines"],
                "nracks": math.ceil(n / c["rack_size"]),
                "rack_size": c["rack_size"],
                "host_bw": c["host_bw_gbps"],
                "rack_uplink_port_bw": c["rack_uplink_port_bw_gbps"],
                "load_balancer_type": c["load_balancer"],
            },
        },
    }


def dumps_netconfig(cfg: dict[str, Any]) -> str:
    """TOML text of a netconfig dict (tomli-w; deterministic key order)."""
    return tomli_w.dumps(cfg)


def loads_netconfig(text: str) -> dict[str, Any]:
    """Parse netconfig TOML text (tomllib)."""
    return tomllib.loads(text)


def _fabric_netconfig(spec: RunSpec) -> dict[str, Any]:
    from phantora_assets.lib.net.fabric import build_fabric  # matrix -> fabric -> network: no cycle at import

    c, n = spec.cluster, spec.n_nodes
    kind = c["topology"]
    fab = build_fabric(c, n, spec.gpus_per_node)
    head: dict[str, Any] = {
        "host_mapping": [f"host-{i + 1}" for i in range(n)],
        "simulator": {"loopback_speed": c["loopback_gbps"], "fairness": c["fairness"]},
    }
    if fab.scale_up_gpus != spec.gpus_per_node:
        raise NoPhantoraTopology(
            f"{kind} with scale_up_gpus = {fab.scale_up_gpus}: Phantora puts only one host's GPUs on loopback"
        )
    if kind in ("RailOptimized", "MultiPlane"):
        raise NoPhantoraTopology(
            f"Phantora has no {kind} topology: its hosts have one network endpoint each (netconfig types "
            "TwoLayerMultiPath, FatTree, Arbitrary); use source = 'analytic'"
        )
    if kind == "FatTree":
        args = {
            "nports": fab.params["fattree_k"],
            "bandwidth": c["host_bw_gbps"],
            "oversub_ratio": float(fab.params["oversubscription"]),
        }
        return {**head, "topology": {"type": "FatTree", "args": args}}
    shape = _rack_shape(fab)
    if isinstance(shape, str):
        raise NoPhantoraTopology(
            f"Phantora's Arbitrary topology is racks under one switch ({{nracks, rack_size, host_bw, rack_bw}}); "
            f"{c['fabric_file']} is not: {shape}"
        )
    return {**head, "topology": {"type": "Arbitrary", "args": shape}}


def _rack_shape(fab: Any) -> dict[str, Any] | str:
    """Phantora ``Arbitrary`` args of a fabric of racks under one core switch, or why it is not one."""
    if fab.nics_per_host != 1:
        return f"{fab.nics_per_host} NICs per host"
    up = [i for i, c in enumerate(fab.link_class) if c == "host_up"]
    tor = [fab.link_dst[i] for i in up]
    host_bw = {float(fab.cap[i]) for i in up}
    racks = list(dict.fromkeys(tor))
    sizes = {tor.count(r) for r in racks}
    if len(host_bw) != 1 or len(sizes) != 1:
        return "host links or rack sizes differ"
    if any(tor[i] != racks[i // next(iter(sizes))] for i in range(len(tor))):
        return "hosts are not in consecutive racks"
    fabric = [i for i, c in enumerate(fab.link_class) if c == "fabric"]
    ups = [i for i in fabric if fab.link_src[i] in racks]
    cores = {fab.link_dst[i] for i in ups}
    rack_bw = {float(fab.cap[i]) for i in ups}
    one_core = len(cores) == 1 and len(ups) == len(racks) and len(rack_bw) == 1 and 2 * len(ups) == len(fabric)
    if len(racks) > 1 and not one_core:
        return "not every rack switch has exactly one link, of one bandwidth, to one core switch"
    gbps = lambda v: v * 8  # bytes per ns -> Gbps
    return {
        "nracks": len(racks),
        "rack_size": next(iter(sizes)),
        "host_bw": gbps(next(iter(host_bw))),
        "rack_bw": gbps(next(iter(rack_bw))) if rack_bw else gbps(next(iter(host_bw))),
    }
