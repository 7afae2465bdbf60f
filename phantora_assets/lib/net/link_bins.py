"""Bytes per (directed link, bin) of the 180 s window: ``link_bins`` (README, "What each asset holds").

Every flow of the chosen steady step is placed over the window exactly as ``binned_flows`` places it
(``lib/traffic/binning.build_bins``: the same repetitions, lengths, phase and seed from the run id, the
same bin width and cumulative-floor split of a flow's bytes over the bins it overlaps), and its bytes
appear on every link of its path (``lib/net/routes.flow_links``). The bins of a link are computed by
``build_bins`` itself, so the split rule is binning's, not a copy of it: each flow is placed once on a
virtual node pair that stands for its path (the links it crosses), and each path's bins are added to
each of its links (exact integer sums; or, when paths are many, each (flow, link) row is placed on a
pair that stands for the link: the same bytes, by ``build_link_bins(by_path=...)``). A ``split`` flow's
fabric hop is binned once per (rack, direction) and each bin's bytes are divided over the ``S`` spines:
``b // S`` each, the remainder one byte each to the lowest spine numbers, so every bin still adds up
to the byte.

Not on any link: flows inside one host (as in ``binned_flows``) and the synthetic control traffic
(``flows_100ms``'s 5 kB/s per node, which no collective sends): ``link_bins`` on the ``host_up`` links
sums to ``flows_100ms`` minus its control bytes.

Conservation per link class ``c`` (the ``link_bins_conserve_bytes`` check)::

    sum over links of class c and bins of bytes == sum over network flow instances of
        (in-window bytes) x (the path's coefficients on links of class c)

i.e. ``host_up`` and ``host_down`` hold every network byte once, ``leaf_spine`` and ``spine_leaf`` every
byte between racks once (a ``hash`` or ``first`` path has one such link, a ``split`` path ``S`` links of
``1/S``). The right side is counted from the flows alone, without bins (:func:`expected_class_bytes`).
No Dagster import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from phantora_assets.lib.bins.place import Apportion  # the placement's own rules, for the direct count
from phantora_assets.lib.columns import STEP_FLOW_COLUMNS
from phantora_assets.lib.net.fabric import Fabric
from phantora_assets.lib.net.fabric_bins import fabric_subflows
from phantora_assets.lib.net.routes import LINK_CLASSES, classes_of, flow_links, link_table
from phantora_assets.lib.sim.network import Topology
from phantora_assets.lib.traffic.binning import build_bins, exact_sum, flow_ns, repetitions, to_ns, window_bins_ns

#: link_bins rows: bytes on one directed link in the bin starting at t.
LINK_BIN_COLUMNS: dict[str, str] = {
    "run_id": "str",
    "t": "float64",  # bin start, s (as flows_100ms)
    "bin_s": "float64",  # bin width, s
    "link_id": "int64",  # lib/net/routes.py numbering
    "link_class": "str",  # host_up | leaf_spine | spine_leaf | host_down
    "src": "str",  # host-k | leaf-k | spine-k
    "dst": "str",
    "bytes": "int64",  # bytes on the link in the bin
    "capacity_bps": "float64",  # link capacity, bits per second
    "routes": "str",  # simulated | modelled (lib/net/routes.routes_kind)
}

#: What each column means (the DuckDB column comments).
LINK_BIN_DOCS: dict[str, str] = {
    "t": "bin start, s (0 <= t < 180 s)",
    "bin_s": "bin width, s",
    "link_id": "the link's number: host_up h, host_down H + h, leaf_spine 2H + r*S + j, spine_leaf 2H + R*S + r*S + j",
    "link_class": "host_up | leaf_spine | spine_leaf | host_down",
    "src": "sending end: host-k, leaf-k (the ToR of rack k) or spine-k",
    "dst": "receiving end",
    "bytes": "bytes on the link in the bin",
    "capacity_bps": "link capacity in one direction, bit/s",
    "routes": "simulated (the run's simulation used these paths) | modelled (the routing model assigned them)",
}


@dataclass(frozen=True)
class LinkBins:
    """Result of :func:`build_link_bins`: ``per_link``, the bytes of every (bin, directed link) as an int64
    ``(n_bins, n_links)`` matrix (column ``k`` is ``link_id`` ``k``), the run's ``links``
    (``routes.link_table``), the ``run_id``, ``bin_s`` and ``routes`` written in every row, and the bytes
    per link class the matrix holds (exact Python ints).

    Memory: 8 B a cell (a 2,048-host leaf-spine: 1800 bins x 8192 links = 118 MB). The ``LINK_BIN_COLUMNS``
    rows are made from it only where they are needed: :attr:`table` (every row at once, about 100 B a
    row in pandas with its string columns: small runs and tests) or ``lib/store/link_table.write_link_bins``
    (a Parquet row group at a time)."""

    per_link: np.ndarray
    links: pd.DataFrame
    run_id: str
    bin_s: float
    routes: str
    class_bytes: dict[str, int]

    @property
    def table(self) -> pd.DataFrame:
        """The ``LINK_BIN_COLUMNS`` table, dense: every bin x every link, sorted by (t, link_id)."""
        return _table(self.per_link, self.links, self.run_id, self.bin_s, self.routes)


def _link_bins(
    per_link: np.ndarray, links: pd.DataFrame, run_id: str, bin_s: float, routes: str, classes: tuple[str, ...]
) -> LinkBins:
    """A :class:`LinkBins` of ``per_link``, its class bytes summed per class of ``classes`` over the columns."""
    cls = links["link_class"].to_numpy()
    got = {c: exact_sum(per_link[:, cls == c].reshape(-1)) for c in classes}
    return LinkBins(per_link, links, run_id, float(bin_s), routes, got)


def _pairs(keys: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Virtual (src, dst) node pairs of ``n_keys`` keys: key ``k`` is pair index ``k`` of ``m`` nodes
    (``build_bins``' dense pair order ``src * (m - 1) + (dst if dst < src else dst - 1)``)."""
    m = max(2, math.ceil((1 + math.sqrt(1 + 4 * n_keys)) / 2))
    while m * (m - 1) < n_keys:
        m += 1
    src = keys // (m - 1)
    rest = keys % (m - 1)
    return src, np.where(rest < src, rest, rest + 1), m


#: Bins x paths cells the path form of :func:`build_link_bins` may hold beyond the links' own (64 MB).
_PATH_CELLS = 1 << 23


def _path_signatures(fi: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct paths of the (flow, key) rows ``fi, keys``: ``(flows, paths, inverse)`` -- each
    flow that has rows once, the ``(n_paths, longest)`` sorted keys of each path padded with -1, and
    each flow's path number (``fi`` not empty)."""
    order = np.lexsort((keys, fi))
    fi, keys = fi[order], keys[order]
    new = np.r_[True, fi[1:] != fi[:-1]]
    first = np.nonzero(new)[0]
    rank = np.cumsum(new) - 1
    pos = np.arange(len(fi)) - first[rank]
    grid = np.full((len(first), int(pos.max()) + 1), -1, dtype=np.int64)
    grid[rank, pos] = keys
    sigs, inv = np.unique(grid, axis=0, return_inverse=True)
    return fi[first], sigs, inv.reshape(-1).astype(np.int64)


def _paths_to_keys(per_path: np.ndarray, sigs: np.ndarray, n_keys: int) -> np.ndarray:
    """``(n_bins, n_keys)`` bytes: every path's bins added to each key of the path (exact int64)."""
    out = np.zeros((n_keys, per_path.shape[0]), dtype=np.int64)
    by_path = np.ascontiguousarray(per_path.T)
    for j in range(sigs.shape[1]):
        live = np.nonzero(sigs[:, j] >= 0)[0]
        np.add.at(out, sigs[live, j], by_path[live])
    return np.ascontiguousarray(out.T)


def _bin_keys(flows: pd.DataFrame, fi: np.ndarray, keys: np.ndarray, n_keys: int, **bin_args) -> tuple[np.ndarray, int]:
    """Bytes per (bin, key) of the (flow, key) rows ``fi, keys``, placed by ``build_bins`` without
    control traffic: an ``(n_bins, n_keys)`` int64 array, and the placed bytes."""
    src, dst, m = _pairs(keys, n_keys)
    virtual = pd.DataFrame(
        {
            "offset_us": flows["offset_us"].to_numpy(np.float64)[fi],
            "dur_us": flows["dur_us"].to_numpy(np.float64)[fi],
            "src_node": src,
            "dst_node": dst,
            "bytes": flows["bytes"].to_numpy(np.int64)[fi],
        },
        columns=list(STEP_FLOW_COLUMNS),
    )
    built = build_bins(virtual, n_nodes=m, control_bytes_per_s=0, sparse=False, **bin_args)  # dense over keys (links)
    per_bin = built.matrix  # (n_bins, m * (m - 1)), the dense pair order
    assert per_bin is not None  # sparse=False
    return per_bin[:, :n_keys], int(built.placed_flow_bytes)


def build_link_bins(  # noqa: PLR0913 (the network model's settings, keyword-only)
    step_flows: pd.DataFrame,
    conn: np.ndarray,
    topo: Topology | Fabric,
    *,
    step_time_s: float,
    run_id: str,
    routes: str,
    window_s: float = 180.0,
    bin_s: float = 0.1,
    jitter: float = 0.02,
    by_path: bool | None = None,
) -> LinkBins:
    """Bytes per (directed link, bin) of the window (module docstring).

    Args:
        step_flows: ``STEP_FLOW_COLUMNS`` rows, one steady step's network flows (``binned_flows``'
            input, any row order).
        conn: int64 ECMP key per row (``routes.connection_keys``).
        topo: the run's network (``n_hosts`` = the run's nodes).
        step_time_s, run_id, window_s, bin_s, jitter: as ``binning.build_bins`` (the same values as
            ``binned_flows`` give the same placement).
        routes: ``simulated`` or ``modelled`` (``routes.routes_kind``), written in every row.
        by_path: place each flow once into the bins of its path (the set of keys it lands on), then
            add each path's bins to its links; or (False) place every (flow, link) row on its own.
            Integer sums, so both give the same table to the byte; None (default) takes the path
            form when the paths' bins need no more cells than the links' (or :data:`_PATH_CELLS`).

    Returns:
        A :class:`LinkBins`.

    Raises:
        ValueError: as ``build_bins`` (bad step flows or window), or a node outside the topology.

    On a :class:`~phantora_assets.lib.net.fabric.Fabric`, ``src_node`` / ``dst_node`` of ``step_flows`` are
    endpoints (NICs, ``host * nics_per_host + nic``) and a ``split`` flow is divided into one sub-flow per
    shortest path (:func:`fabric_subflows`) before it is placed.
    """
    if isinstance(topo, Fabric):
        step_flows, fi, li = fabric_subflows(step_flows, conn, topo)
        args = dict(step_time_s=step_time_s, run_id=run_id, window_s=window_s, bin_s=bin_s, jitter=jitter)
        return _place_link_rows(step_flows, fi, li, topo, routes, args, by_path)
    links = link_table(topo)
    n_links = len(links)
    fi, li, co = flow_links(
        topo, step_flows["src_node"].to_numpy(np.int64), step_flows["dst_node"].to_numpy(np.int64), conn
    )
    s, fabric0 = topo.nspines, 2 * topo.n_hosts
    split = co != 1.0
    # a split flow's fabric hop: one row per (flow, rack group) -- group g = n_links + (link - 2H) // S
    keys = np.where(split, n_links + (li - fabric0) // s, li)
    keep = ~split | ((li - fabric0) % s == 0)
    fi, keys = fi[keep], keys[keep]
    n_groups = 2 * topo.n_racks if split.any() else 0
    args = dict(step_time_s=step_time_s, run_id=run_id, window_s=window_s, bin_s=bin_s, jitter=jitter)
    n_bins, n_keys = int(round(window_s / bin_s)), n_links + n_groups
    paths = _path_signatures(fi, keys) if len(fi) and by_path is not False else None
    if paths is not None and by_path is None and len(paths[1]) * n_bins > max(n_keys * n_bins, _PATH_CELLS):
        paths = None  # many paths: each (flow, link) row is placed instead
    if not len(fi):
        per_key = np.zeros((n_bins, n_keys), dtype=np.int64)
    elif paths is not None:
        flow_of_path, sigs, inv = paths
        per_path, _ = _bin_keys(step_flows, flow_of_path, inv, len(sigs), **args)
        per_key = _paths_to_keys(per_path, sigs, n_keys)
    else:
        per_key, _ = _bin_keys(step_flows, fi, keys, n_keys, **args)
    per_link = per_key[:, :n_links].copy()
    for g in range(n_groups):  # divide the group's bytes over its S spines, remainder to the lowest
        base, rem = np.divmod(per_key[:, n_links + g], s)
        for j in range(s):
            per_link[:, fabric0 + g * s + j] += base + (j < rem)
    return _link_bins(per_link, links, run_id, bin_s, routes, LINK_CLASSES)


def _place_link_rows(
    flows: pd.DataFrame,
    fi: np.ndarray,
    li: np.ndarray,
    topo: Fabric,
    routes: str,
    args: dict[str, Any],
    by_path: bool | None,
) -> LinkBins:
    """:func:`build_link_bins` of (flow, link) rows with coefficient 1 (a fabric's sub-flows)."""
    links = link_table(topo)
    n_links = len(links)
    run_id, bin_s = args["run_id"], args["bin_s"]
    n_bins = int(round(args["window_s"] / bin_s))
    paths = _path_signatures(fi, li) if len(fi) and by_path is not False else None
    if paths is not None and by_path is None and len(paths[1]) * n_bins > max(n_links * n_bins, _PATH_CELLS):
        paths = None
    if not len(fi):
        per_link = np.zeros((n_bins, n_links), dtype=np.int64)
    elif paths is not None:
        flow_of_path, sigs, inv = paths
        per_path, _ = _bin_keys(flows, flow_of_path, inv, len(sigs), **args)
        per_link = _paths_to_keys(per_path, sigs, n_links)
    else:
        per_link, _ = _bin_keys(flows, fi, li, n_links, **args)
    return _link_bins(per_link, links, run_id, bin_s, routes, classes_of(topo))


def _table(per_link: np.ndarray, links: pd.DataFrame, run_id: str, bin_s: float, routes: str) -> pd.DataFrame:
    """``per_link`` as ``LINK_BIN_COLUMNS`` rows, sorted by (t, link_id)."""
    n_bins, n_links = per_link.shape
    t = link_bin_times(n_bins, bin_s)
    rep = lambda col: np.tile(links[col].to_numpy(), n_bins)
    return pd.DataFrame(
        {
            "run_id": pd.Series([run_id] * (n_bins * n_links), dtype=object),
            "t": np.repeat(t, n_links).astype(np.float64),
            "bin_s": np.full(n_bins * n_links, float(bin_s)),
            "link_id": rep("link_id").astype(np.int64),
            "link_class": pd.Series(rep("link_class"), dtype=object),
            "src": pd.Series(rep("src"), dtype=object),
            "dst": pd.Series(rep("dst"), dtype=object),
            "bytes": per_link.ravel(),
            "capacity_bps": rep("capacity_bps").astype(np.float64),
            "routes": pd.Series([routes] * (n_bins * n_links), dtype=object),
        },
        columns=list(LINK_BIN_COLUMNS),
    )


def link_bin_times(n_bins: int, bin_s: float) -> np.ndarray:
    """``t`` (s, float64) of bins ``0 .. n_bins - 1``: ``round(i * bin_ns / 1e9, 6)`` from integer ns."""
    return np.round(np.arange(n_bins, dtype=np.int64) * int(round(bin_s * 1e9)) / 1e9, 6).astype(np.float64)


def class_bytes(table: pd.DataFrame, classes: tuple[str, ...] = LINK_CLASSES) -> dict[str, int]:
    """Exact bytes per link class of a ``link_bins`` table (every class of ``classes``)."""
    out = {}
    for c in classes:
        v = table.loc[table["link_class"].to_numpy() == c, "bytes"].to_numpy(np.int64)
        out[c] = exact_sum(v) if len(v) else 0
    return out


def expected_class_bytes(
    step_flows: pd.DataFrame,
    topo: Topology | Fabric,
    *,
    step_time_s: float,
    run_id: str,
    window_s: float = 180.0,
    bin_s: float = 0.1,
    jitter: float = 0.02,
    conn: np.ndarray | None = None,
) -> dict[str, int]:
    """The right side of the conservation rule, from the flows alone, without any bins: the in-window
    bytes of the network flow instances inside one rack and between racks; ``host_up`` and ``host_down``
    expect both, ``leaf_spine`` and ``spine_leaf`` the second.

    The instances are ``binning.build_bins``' (the same repetition starts, drawn from the run id's seed);
    an instance inside the window counts all its bytes, one across an edge its cumulative-floor share
    ``C(min(end, window)) - C(max(start, 0))`` (module docstring of ``lib/traffic/binning.py``), computed
    directly, not as a sum of bin parts: a placement that loses or doubles a byte in some bin fails.
    ``bin_s`` is checked as ``build_bins`` checks it (the window must be a multiple of it).

    On a :class:`~phantora_assets.lib.net.fabric.Fabric` (endpoint columns, ``conn`` the ECMP keys): per
    class, the in-window bytes of every sub-flow (:func:`fabric_subflows`) times the links of that class
    on its path."""
    if isinstance(topo, Fabric):
        sub, fi, li = fabric_subflows(step_flows, np.zeros(len(step_flows), np.int64) if conn is None else conn, topo)
        per = _in_window_bytes(sub, np.arange(len(sub)), step_time_s, run_id, window_s, bin_s, jitter)
        cls = np.asarray(topo.link_class, dtype=object)[li] if len(li) else np.zeros(0, dtype=object)
        return {c: exact_sum(per[fi[cls == c]]) if (cls == c).any() else 0 for c in classes_of(topo)}
    src = step_flows["src_node"].to_numpy(np.int64)
    dst = step_flows["dst_node"].to_numpy(np.int64)
    net = np.nonzero(src != dst)[0]
    if not len(net):
        return dict.fromkeys(LINK_CLASSES, 0)
    cross = (src[net] // topo.rack_size) != (dst[net] // topo.rack_size)
    per = _in_window_bytes(step_flows, net, step_time_s, run_id, window_s, bin_s, jitter)
    intra, between = (exact_sum(per[~cross]) if (~cross).any() else 0), (exact_sum(per[cross]) if cross.any() else 0)
    return {"host_up": intra + between, "leaf_spine": between, "spine_leaf": between, "host_down": intra + between}


def _in_window_bytes(
    step_flows: pd.DataFrame,
    net: np.ndarray,
    step_time_s: float,
    run_id: str,
    window_s: float,
    bin_s: float,
    jitter: float,
) -> np.ndarray:
    """In-window bytes (int64) of every flow ``net`` (row indices) over all its instances
    (:func:`expected_class_bytes`' rule)."""
    if not len(net):
        return np.zeros(0, dtype=np.int64)
    window_ns, _ = window_bins_ns(window_s, bin_s)
    o, d = (x[net] for x in flow_ns(step_flows))
    b = step_flows["bytes"].to_numpy(np.int64)[net]
    starts, _, _ = repetitions(
        o, d, step_ns=to_ns(step_time_s, "step_time_s"), window_ns=window_ns, run_id=run_id, jitter=jitter
    )
    first = lambda x, side: np.asarray(np.searchsorted(starts, x, side=side), dtype=np.int64)
    zero = d == 0
    # instances that reach into the window: start + o + d > 0 and start + o < window (d = 0: start + o >= 0)
    starts_at_0 = first(-o, "left")
    ov_lo = np.where(zero, starts_at_0, first(-o - d, "right"))
    ov_hi = first(window_ns - o, "left")
    lo = np.maximum(starts_at_0, ov_lo)  # whole instances: start >= -o and start + o + d <= window
    hi = np.where(zero, ov_hi, np.clip(first(window_ns - o - d, "right"), lo, ov_hi))
    lo = np.where(zero, ov_lo, lo)
    whole = np.maximum(hi - lo, 0)
    per = b * whole
    # the edge instances: [ov_lo, lo) and [hi, ov_hi) of each flow with d > 0 and bytes > 0
    spread = ~zero & (b > 0)
    for r0, r1 in ((ov_lo, lo), (hi, ov_hi)):
        n = np.where(spread, np.maximum(r1 - r0, 0), 0)
        if not n.any():
            continue
        f = np.repeat(np.arange(len(n)), n)
        k = np.repeat(r0, n) + (np.arange(len(f)) - np.repeat(np.cumsum(n) - n, n))
        a, dd = starts[k] + o[f], d[f]
        app = Apportion(b[f], dd)
        share = app.sent(np.clip(window_ns - a, 0, dd)) - app.sent(np.clip(-a, 0, dd))
        np.add.at(per, f, np.asarray(share, dtype=np.int64))
    return per


def conservation(got: dict[str, int], expected: dict[str, int]) -> tuple[bool, str]:
    """``(passed, message)`` of the per-class rule: every class's bytes equal, to the byte."""
    classes = list(dict.fromkeys([*expected, *got]))
    bad = [c for c in classes if got.get(c) != expected.get(c)]
    if not bad:
        return True, "per link class, link_bins bytes = network flow bytes x links of that class on the path: " + (
            ", ".join(f"{c} {got[c]}" for c in classes)
        )
    return False, "link_bins does not conserve bytes: " + "; ".join(
        f"{c}: table {got.get(c)} != flows {expected.get(c)} (by {(got.get(c) or 0) - (expected.get(c) or 0)})"
        for c in bad
    )
