"""A fabric's flows as sub-flows on single paths, the input ``link_bins`` places (``lib/net/link_bins.py``).

No Dagster import.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from phantora_assets.lib.columns import STEP_FLOW_COLUMNS
from phantora_assets.lib.net.fabric import Fabric


def fabric_subflows(
    step_flows: pd.DataFrame, conn: np.ndarray, fab: Fabric
) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    """The network flows of ``step_flows`` (endpoint columns ``src_node`` / ``dst_node``) on ``fab``'s paths.

    Returns ``(sub, flow index, link id)``: ``sub`` has ``STEP_FLOW_COLUMNS``, one row per (flow, path it
    takes) -- one path by ``hash`` / ``first``; by ``split`` all ``n`` shortest paths, the flow's bytes
    ``b`` divided ``b // n`` each and the remainder one byte each to the first paths (every byte on one
    path, so the bins add up to the byte) -- and the (row of ``sub``, link) pairs of its path.
    """
    src = step_flows["src_node"].to_numpy(np.int64)
    dst = step_flows["dst_node"].to_numpy(np.int64)
    net = np.nonzero(src != dst)[0]
    pick = fab.routes(src[net], dst[net], np.asarray(conn, dtype=np.int64)[net]) if fab.ecmp != "split" else None
    rows: list[int] = []
    nbytes: list[int] = []
    fi: list[int] = []
    li: list[int] = []
    b_all = step_flows["bytes"].to_numpy(np.int64)
    if pick is not None:
        pf, pl, _ = pick
        rows, nbytes = net.tolist(), b_all[net].tolist()
        fi, li = pf.tolist(), pl.tolist()
    else:
        for f in net.tolist():
            ps = fab.paths(int(src[f]), int(dst[f]))
            q, r = divmod(int(b_all[f]), len(ps))
            for j, p in enumerate(ps):
                k = len(rows)
                rows.append(f)
                nbytes.append(q + (j < r))
                fi += [k] * len(p)
                li += list(p)
    base = step_flows.iloc[np.array(rows, dtype=np.int64)] if rows else step_flows.iloc[:0]
    sub = pd.DataFrame(
        {
            "offset_us": base["offset_us"].to_numpy(np.float64),
            "dur_us": base["dur_us"].to_numpy(np.float64),
            "src_node": base["src_node"].to_numpy(np.int64),
            "dst_node": base["dst_node"].to_numpy(np.int64),
            "bytes": np.array(nbytes, dtype=np.int64),
        },
        columns=list(STEP_FLOW_COLUMNS),
    )
    return sub, np.array(fi, dtype=np.int64), np.array(li, dtype=np.int64)
