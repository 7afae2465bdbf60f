"""Phantora's ``netconfig.toml`` (PHANTORA_FORMATS.md section 1): build and parse.

The simulator reads it with ``deny_unknown_fields``, so only Phantora's own keys appear.
"""

from __future__ import annotations

import math
import tomllib
from typing import Any

import tomli_w

from phantora_assets.matrix import RunSpec


def netconfig_for(spec: RunSpec) -> dict[str, Any]:
    """The netconfig of ``spec``: TwoLayerMultiPath leaf-spine from the run's cluster settings.

    Hosts ``host-1 .. host-N`` map to topology hosts 0..N-1; racks = ceil(N / rack_size).
    Bandwidths in Gbps.
    """
    c = spec.cluster
    n = spec.n_nodes
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
