"""PNG plots of one run and of the dataset (matplotlib, Agg canvas, no pyplot state).

Every plot has a fixed pixel size (:data:`SIZES`, width x height at :data:`DPI`), is
rendered in memory and written atomically; each function returns the PNG bytes so callers
can also embed them (e.g. as Dagster Markdown metadata).

Per run:
    pair_heatmap    network bytes per steady step for every (source host, destination host)
    timeseries      100 ms traffic over the 180 s window (total and the top pairs), with a
                    zoom on the first seconds where the step rhythm is visible
    step_anatomy    one steady step, per host: compute spans and network spans, with the
                    exposed-communication and idle totals (at most 16 hosts: the most exposed)
    link_utilisation  per link class, the busiest link's utilisation in every bin (link_bins),
                    over the window and in its first seconds
Per dataset:
    bytes_vs_published   inter-node bytes per step: ours against the published figures
    step_time_by_layout  step time of every run by layout, per GPU (published as hollow marks)

No Dagster import.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from phantora_assets.lib.store.bin_table import SparseBins, bin_times, control_at, pair_of
from phantora_assets.lib.store.figures import DPI as DPI  # re-exported, with every plot's size
from phantora_assets.lib.store.figures import SIZES as SIZES
from phantora_assets.lib.store.figures import kept_figure, new_figure, save_png
from phantora_assets.lib.store.link_table import class_peaks

#: Layouts in plotting order (then any other, sorted).
LAYOUT_ORDER = ["2x1", "2x2", "4x1", "2x4", "4x2"]
_PAIR_COLORS = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd"]
#: axes rectangles (figure fractions) of the per-run plots
_HEATMAP_AXES = ((0.17, 0.12, 0.78, 0.74),)
_TWO_PANELS = ((0.07, 0.55, 0.76, 0.36), (0.07, 0.09, 0.76, 0.33))
_ANATOMY_AXES = ((0.09, 0.11, 0.62, 0.72),)


#: Host labels at most on a heatmap axis (a 2,048-node run's axis names 16 hosts, evenly spaced).
_MAX_TICKS = 16


def _host(n: int) -> str:
    return f"host-{n + 1}"


# --------------------------------------------------------------------------- per run
def pair_matrix(flows: pd.DataFrame, steps: pd.DataFrame, n_nodes: int) -> np.ndarray:
    """Mean network bytes per steady step, ``m[src_node, dst_node]`` (float, n_nodes x n_nodes)."""
    steady = steps.loc[steps["steady"], "step"]
    m = np.zeros((n_nodes, n_nodes))
    if len(steady) == 0:
        return m
    f = flows[flows["step"].isin(steady) & (flows["src_node"] != flows["dst_node"])]
    g = f.groupby(["src_node", "dst_node"])["bytes"].sum()
    for (s, d), b in g.items():
        m[int(s), int(d)] = b / len(steady)
    return m


#: Most hosts a pair heatmap shows one by one; a larger run's hosts are summed in consecutive blocks, at most
#: :data:`HEATMAP_BLOCKS` of them a side (2,048 hosts: 64 blocks of 32; a 2,048-pixel side would be unreadable).
MAX_HEATMAP_HOSTS = 128
HEATMAP_BLOCKS = 64


def host_blocks(matrix: np.ndarray) -> tuple[np.ndarray, int]:
    """``matrix`` (hosts x hosts) summed over consecutive blocks of ``k`` hosts (the last block may be short),
    and ``k``: 1 (the matrix itself) up to :data:`MAX_HEATMAP_HOSTS` hosts, else ``ceil(n /
    HEATMAP_BLOCKS)``."""
    n = matrix.shape[0]
    if n <= MAX_HEATMAP_HOSTS:
        return matrix, 1
    k = -(-n // HEATMAP_BLOCKS)
    m = -(-n // k)
    padded = np.zeros((m * k, m * k), dtype=np.float64)
    padded[:n, :n] = matrix
    return padded.reshape(m, k, m, k).sum(axis=(1, 3)), k


def pair_heatmap(matrix: np.ndarray, run_id: str, path: Path | None = None) -> bytes:
    """Heatmap of ``matrix`` (bytes per step, src rows x dst columns), cells labelled in GB; more than
    :data:`MAX_HEATMAP_HOSTS` hosts are shown as blocks of consecutive hosts (:func:`host_blocks`), the title
    saying how many a block."""
    with kept_figure("pair_heatmap", _HEATMAP_AXES) as (fig, (ax,)):
        n_hosts = matrix.shape[0]
        blocks, k = host_blocks(matrix)
        n = blocks.shape[0]
        gb = blocks / 1e9

        def label(i: int) -> str:
            return _host(i) if k == 1 else f"{_host(i * k)}..{min((i + 1) * k, n_hosts)}"

        ax.imshow(gb, cmap="viridis", vmin=0, vmax=max(float(gb.max()), 1e-9), interpolation="nearest")
        ticks = range(n) if n <= _MAX_TICKS else np.linspace(0, n - 1, _MAX_TICKS).round().astype(int)
        ax.set_xticks(ticks, [label(i) for i in ticks], rotation=30 if n > 4 else 0)
        ax.set_yticks(ticks, [label(i) for i in ticks])
        ax.set_xlabel("destination")
        ax.set_ylabel("source")
        if n <= 8:
            top = float(gb.max()) or 1.0
            for i in range(n):
                for j in range(n):
                    if i != j:
                        ax.text(
                            j,
                            i,
                            f"{gb[i, j]:.2f}",
                            ha="center",
                            va="center",
                            fontsize=9,
                            color="black" if gb[i, j] > 0.6 * top else "white",
                        )
        by = "by pair" if k == 1 else f"by pair of blocks of {k} hosts ({n_hosts} hosts)"
        ax.set_title(f"{run_id}\nnetwork GB per steady step, {by} (total {gb.sum():.2f} GB)", fontsize=10)
        return save_png(fig, path)


def timeseries(
    bins: pd.DataFrame | tuple | SparseBins,
    run_id: str,
    bin_s: float,
    step_time_s: float | None = None,
    top: int = 3,
    zoom_s: float = 5.0,
    path: Path | None = None,
) -> bytes:
    """Gbit/s per bin (``bin_s`` wide, named in the title): the total and the ``top`` busiest directed pairs; full
    window and a zoom. ``bins``: a ``BIN_COLUMNS`` table, ``bin_table.read_bin_matrix``'s tuple, or a sparse
    run's ``bin_table.SparseBins`` (the top pairs among those that carry flows; ``top + 1`` series of bins)."""
    from matplotlib.ticker import MaxNLocator

    with kept_figure("timeseries", _TWO_PANELS) as (fig, (ax, az)):
        to_gbps = 8 / bin_s / 1e9
        if isinstance(bins, SparseBins):  # a sparse run: the total and the top pairs, never its dense matrix
            grid, per_pair, keys, all_pairs = _sparse_series(bins, top)
            per_pair, all_pairs = per_pair * to_gbps, all_pairs * to_gbps
        elif isinstance(bins, tuple):  # (matrix, present, pairs) of bin_table.read_bin_matrix: bins of the window
            X, present, pairs = bins
            grid = np.round(np.flatnonzero(present) * bin_s, 6)
            per_pair = X[present].T * to_gbps
            keys = np.array([s * (1 << 20) + d for s, d in pairs], np.int64)
        else:
            t = bins["t"].to_numpy(np.float64)
            b = bins["bytes"].to_numpy(np.float64) * to_gbps
            grid, ti = np.unique(t, return_inverse=True)
            pair = bins["src_node"].to_numpy(np.int64) * (1 << 20) + bins["dst_node"].to_numpy(np.int64)
            keys, pi = np.unique(pair, return_inverse=True)
            per_pair = np.zeros((len(keys), len(grid)))
            np.add.at(per_pair, (pi.reshape(-1), ti.reshape(-1)), b)
        if not isinstance(bins, SparseBins):
            all_pairs = per_pair.sum(axis=0)
        order = np.argsort(-per_pair.sum(axis=1), kind="stable")[:top]
        series = [("all pairs", all_pairs, "black", 1.0)]
        for k, j in enumerate(order):
            s, d = divmod(int(keys[j]), 1 << 20)
            series.append((f"{_host(s)} -> {_host(d)}", per_pair[j], _PAIR_COLORS[k % len(_PAIR_COLORS)], 0.8))
        end = float(grid.max()) + bin_s if len(grid) else bin_s
        zoom = grid < zoom_s
        for label, y, color, lw in series:
            ax.plot(
                grid,
                y,
                drawstyle="steps-post",
                color=color,
                lw=lw,
                label=label,
                alpha=0.9 if color == "black" else 0.75,
            )
            az.plot(
                grid[zoom], y[zoom], drawstyle="steps-post", color=color, lw=lw, alpha=0.9 if color == "black" else 0.75
            )
        # few ticks, and grid lines as one collection: matplotlib's cost here is mostly the Tick
        # objects (five artists each; Axes.grid restyles all of them)
        ax.set_xticks(np.linspace(0, end, 4) if end > 0 else [0])
        zoom_ticks = np.arange(0, zoom_s + 1e-9, 1.0)
        az.set_xticks(zoom_ticks)
        for a, lim in ((ax, end), (az, zoom_s)):
            a.yaxis.set_major_locator(MaxNLocator(3))
            a.set_xlim(0, lim)
            a.set_ylabel("Gbit/s")
        az.vlines(zoom_ticks, 0, 1, transform=az.get_xaxis_transform(), colors="#0000004d", lw=0.8)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax.set_title(
            f"{run_id}: traffic per {bin_s * 1000:g} ms bin"
            + (f" (step time {step_time_s * 1000:.1f} ms)" if step_time_s else ""),
            fontsize=10,
        )
        az.set_xlabel(f"t (s); the first {zoom_s:g} s")
        return save_png(fig, path)


def _sparse_series(sb: SparseBins, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(t, per_pair, keys, total)`` of a sparse run for :func:`timeseries`: bytes per bin of the ``top``
    pairs with the most window bytes among those that carry flows (their control included), their keys
    (``src * 2**20 + dst``) and every pair's total per bin (flows plus all control traffic). Memory:
    the rows and ``top`` series of bins."""
    bns = int(round(sb.bin_s * 1e9))
    c = sb.per_split()
    every = np.arange(sb.n_bins, dtype=np.int64)
    flow = sb.bytes - control_at(c[sb.pair], sb.bin_idx, bns)
    vals, counts = np.unique(c, return_counts=True)
    total = sum(
        (int(n) * control_at(np.full(sb.n_bins, v), every, bns) for v, n in zip(vals, counts)),
        np.zeros(sb.n_bins, np.int64),
    )
    np.add.at(total, sb.bin_idx, flow)
    pairs, inv = np.unique(sb.pair, return_inverse=True)
    window = np.bincount(inv.reshape(-1), weights=flow.astype(np.float64), minlength=len(pairs))
    window += control_at(c[pairs], np.zeros(len(pairs), np.int64), bns, sb.n_bins)
    chosen = pairs[np.argsort(-window, kind="stable")[:top]]
    per_pair = np.zeros((len(chosen), sb.n_bins))
    for j, p in enumerate(chosen):
        per_pair[j] = control_at(np.full(sb.n_bins, c[p]), every, bns)
        mine = sb.pair == p
        per_pair[j, sb.bin_idx[mine]] = sb.bytes[mine]
    src, dst = pair_of(chosen, sb.n_nodes)
    return bin_times(sb.n_bins, sb.bin_s), per_pair, src * (1 << 20) + dst, total.astype(np.float64)


_CLASS_COLORS = {"host_up": "#1f77b4", "leaf_spine": "#d62728", "spine_leaf": "#ff7f0e", "host_down": "#2ca02c"}
# the switch tiers of the fabric topologies (lib/net/fabric.py)
_CLASS_COLORS |= {"edge_agg": "#d62728", "agg_edge": "#ff7f0e", "agg_core": "#9467bd", "core_agg": "#8c564b"}
_CLASS_COLORS |= {"rail_spine": "#d62728", "spine_rail": "#ff7f0e", "fabric": "#9467bd"}


def link_utilisation(
    link_bins: pd.DataFrame | Path, run_id: str, zoom_s: float = 5.0, path: Path | None = None
) -> bytes:
    """Per link class, the largest utilisation (bytes * 8 / bin_s / capacity_bps, in %) over the class's
    links in every bin of a ``link_bins`` table (or of its Parquet file, read a row group at a time:
    ``link_table.class_peaks``); the full window and a zoom on its first ``zoom_s`` s. One line per class
    whatever the links (a 2,048-host run's 8,192 links are 4 lines)."""
    from matplotlib.ticker import MaxNLocator

    peaks = class_peaks(link_bins)
    with kept_figure("link_utilisation", _TWO_PANELS) as (fig, (ax, az)):
        grid, bin_s = peaks.t, peaks.bin_s
        for name, color in _CLASS_COLORS.items():
            if name not in peaks.classes:
                continue
            k = peaks.classes.index(name)
            peak = peaks.peak[:, k]
            label = f"{name}\n({peaks.links[k]} links)"
            zoom = grid < zoom_s
            ax.plot(grid, peak, drawstyle="steps-post", color=color, lw=0.9, alpha=0.8, label=label)
            az.plot(grid[zoom], peak[zoom], drawstyle="steps-post", color=color, lw=0.9, alpha=0.8)
        end = float(grid.max()) + bin_s if len(grid) else bin_s
        ax.set_xticks(np.linspace(0, end, 4))
        az.set_xticks(np.arange(0, zoom_s + 1e-9, 1.0))
        for a, lim in ((ax, end), (az, zoom_s)):
            a.yaxis.set_major_locator(MaxNLocator(3))
            a.set_xlim(0, lim)
            a.set_ylim(bottom=0)
            a.set_ylabel("utilisation (%)")
        routes = peaks.routes
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        ax.set_title(f"{run_id}: busiest link per class, {bin_s * 1000:g} ms bins (routes {routes})", fontsize=10)
        az.set_xlabel(f"t (s); the first {zoom_s:g} s")
        return save_png(fig, path)


def step_anatomy_chart(
    spans: pd.DataFrame,
    anatomy_row: pd.DataFrame,
    run_id: str,
    step: int,
    duration_us: float,
    path: Path | None = None,
) -> bytes:
    """Per host, two lanes over one step: compute spans and network spans (ms from the step start).

    ``anatomy_row``: the ``step_anatomy`` rows of that step (one per host), for the totals. A run of more
    than :data:`MAX_ANATOMY_HOSTS` hosts shows that many (:func:`anatomy_hosts`: those with the most
    exposed communication), named in the title; 2,048 lanes would be neither readable nor quick (77 s).
    """
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    with kept_figure("step_anatomy", _ANATOMY_AXES) as (fig, (ax,)):
        every = sorted(set(spans["host"]) | set(anatomy_row["host"]), key=lambda h: int(h.split("-")[1]))
        hosts = anatomy_hosts(every, anatomy_row)
        spans = spans[spans["host"].isin(hosts)] if len(hosts) < len(every) else spans
        lane_h = 0.36
        yticks, ylabels = [], []
        for i, host in enumerate(hosts):
            y0 = (len(hosts) - 1 - i) * 1.0
            for kind, dy, color in (("compute", 0.2, "#1f77b4"), ("communication", -0.2, "#d62728")):
                s = spans[(spans["host"] == host) & (spans["kind"] == kind)]
                bars = list(zip(s["start_us"] / 1000, (s["end_us"] - s["start_us"]) / 1000))
                if bars:
                    ax.broken_barh(
                        bars,
                        (y0 + dy - lane_h / 2, lane_h),
                        facecolors=color,
                        edgecolor="none",
                        linewidth=0,
                        antialiased=False,
                    )
            yticks.append(y0)
            ylabels.append(host)
            row = anatomy_row[anatomy_row["host"] == host]
            if len(row):
                r = row.iloc[0]
                # three lines a host up to 4 lanes; beyond, one short line (three overlapped the next host's)
                if len(hosts) <= 4:
                    words = (
                        f"{host}: compute {r.compute_us / 1000:.1f} ms\n"
                        f"  network {r.comm_us / 1000:.1f} ms (exposed {r.exposed_comm_us / 1000:.1f})\n"
                        f"  idle {r.idle_us / 1000:.1f} ms"
                    )
                else:
                    words = (
                        f"compute {r.compute_us / 1000:.1f}, exposed {r.exposed_comm_us / 1000:.1f}, "
                        f"idle {r.idle_us / 1000:.1f} ms"
                    )
                fig.text(
                    0.73,
                    0.83 - (i + 0.5) * 0.72 / max(len(hosts), 1),
                    words,
                    fontsize=8 if len(hosts) <= 4 else 7,
                    va="center",
                )
        ax.set_yticks(yticks, ylabels, fontsize=8)
        xmax = duration_us / 1000
        xticks = [x for x in MaxNLocator(6).tick_values(0, xmax) if 0 <= x <= xmax]
        ax.set_xticks(xticks)
        ax.vlines(xticks, 0, 1, transform=ax.get_xaxis_transform(), colors="#0000004d", lw=0.8, zorder=0)
        ax.set_xlim(0, xmax)
        ax.legend(
            handles=[
                Patch(color="#1f77b4", label="compute (upper lane)"),
                Patch(color="#d62728", label="network (lower lane)"),
            ],
            loc="lower left",
            bbox_to_anchor=(0.0, 1.06),
            ncol=2,
            fontsize=8,
            frameon=False,
        )
        ax.set_ylim(-0.6, len(hosts) - 0.4)
        ax.set_xlabel("ms from the step start")
        shown = "" if len(hosts) == len(every) else f"; the {len(hosts)} of {len(every)} hosts most exposed"
        shown = shown if hosts else "; no host (step_anatomy has no rows: its metadata says why)"
        fig.suptitle(
            f"{run_id}: anatomy of steady step {step} ({duration_us / 1000:.1f} ms){shown}", fontsize=10, y=0.97
        )
        return save_png(fig, path)


#: Hosts at most in the step anatomy chart (two lanes and a line of totals each).
MAX_ANATOMY_HOSTS = 16


def anatomy_hosts(hosts: list[str], anatomy_row: pd.DataFrame) -> list[str]:
    """The hosts of :func:`step_anatomy_chart`: all of ``hosts`` (``host-k`` names in host order) when there
    are at most :data:`MAX_ANATOMY_HOSTS`, else the :data:`MAX_ANATOMY_HOSTS` with the most exposed
    communication in the step (``anatomy_row.exposed_comm_us``; a host without a row counts 0; ties to the
    lower host number), in host order."""
    if len(hosts) <= MAX_ANATOMY_HOSTS:
        return hosts
    exposed = anatomy_row.groupby("host")["exposed_comm_us"].sum().to_dict()
    ranked = sorted(range(len(hosts)), key=lambda i: (-float(exposed.get(hosts[i], 0.0)), i))
    return [hosts[i] for i in sorted(ranked[:MAX_ANATOMY_HOSTS])]


# --------------------------------------------------------------------------- per dataset
def _layout_key(layout: str) -> tuple:
    if layout in LAYOUT_ORDER:
        return (0, LAYOUT_ORDER.index(layout), layout)
    n, g = (int(x) for x in layout.split("x"))
    return (1, n * g, layout)


def bytes_vs_published(runs: pd.DataFrame, published: pd.DataFrame, path: Path | None = None) -> bytes:
    """Grouped bars per run: our inter-node GB per step and the published figure (where there is one)."""
    fig = new_figure("bytes_vs_published")
    ax = fig.add_axes((0.18, 0.08, 0.76, 0.86))
    ours = runs.set_index("run_id")["inter_node_bytes_per_step"] / 1e9
    pub = published[published["status"] == "ok"].set_index("run_id")["inter_node_gb_per_step"].astype(float)
    ids = sorted(
        set(ours.index) | set(pub.index), key=lambda r: (-(pub.get(r, np.nan) if r in pub else ours.get(r, 0)), r)
    )
    y = np.arange(len(ids))
    ax.barh(y - 0.2, [ours.get(r, np.nan) for r in ids], height=0.4, color="#1f77b4", label="this build")
    ax.barh(y + 0.2, [pub.get(r, np.nan) for r in ids], height=0.4, color="#bbbbbb", label="published phantora_v0")
    for yi, r in zip(y, ids):
        if r in ours.index and r in pub.index and pub[r] > 0:
            ax.text(max(ours[r], pub[r]), yi, f"  {100 * (ours[r] / pub[r] - 1):+.1f}%", va="center", fontsize=7)
    ax.set_yticks(y, [r.removeprefix("phantora_") for r in ids], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("inter-node GB per steady step (both directions)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("bytes per step against the published figures (label: this build vs published)", fontsize=10)
    return save_png(fig, path)


def step_time_by_layout(runs: pd.DataFrame, published: pd.DataFrame, path: Path | None = None) -> bytes:
    """Step time (ms) by layout, one panel per GPU, one line per workload; published as hollow marks."""
    from matplotlib.lines import Line2D

    fig = new_figure("step_time_by_layout")
    gpus = sorted(set(runs["gpu"]) | set(published.loc[published["status"] == "ok", "gpu"]))
    layouts = sorted(
        set(runs["layout"]) | set(published["n_nodes"].astype(str) + "x" + published["gpus_per_node"].astype(str)),
        key=_layout_key,
    )
    xpos = {lay: i for i, lay in enumerate(layouts)}
    workloads = sorted(set(runs["workload"]) | set(published["workload"]))
    colors = {w: _PAIR_COLORS[i % len(_PAIR_COLORS)] for i, w in enumerate(workloads)}
    pub = published[published["status"] == "ok"].copy()
    pub["layout"] = pub["n_nodes"].astype(str) + "x" + pub["gpus_per_node"].astype(str)
    width = 0.76 / max(len(gpus), 1)
    for k, gpu in enumerate(gpus):
        ax = fig.add_axes((0.07 + k * (width + 0.01), 0.14, width - 0.03, 0.74))
        for w in workloads:
            r = runs[(runs["gpu"] == gpu) & (runs["workload"] == w)].sort_values(
                "layout", key=lambda s: s.map(_layout_key)
            )
            if len(r):
                ax.plot([xpos[x] for x in r["layout"]], r["step_time_s"] * 1000, "o-", color=colors[w], label=w)
            p = pub[(pub["gpu"] == gpu) & (pub["workload"] == w)].sort_values(
                "layout", key=lambda s: s.map(_layout_key)
            )
            if len(p):
                ax.plot(
                    [xpos[x] for x in p["layout"]],
                    p["step_time_ms"].astype(float),
                    "o--",
                    mfc="none",
                    color=colors[w],
                    alpha=0.6,
                    lw=0.8,
                )
        ax.set_xticks(range(len(layouts)), layouts)
        ax.set_xlim(-0.5, len(layouts) - 0.5)
        ax.set_title(gpu, fontsize=10)
        ax.set_xlabel("layout (nodes x GPUs per node)")
        ax.grid(alpha=0.3)
        if k == 0:
            ax.set_ylabel("step time (ms)")
    handles = [Line2D([], [], color=colors[w], marker="o", label=w) for w in workloads]
    handles += [
        Line2D([], [], color="gray", marker="o", label="this build"),
        Line2D([], [], color="gray", marker="o", mfc="none", ls="--", lw=0.8, label="published"),
    ]
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.84, 0.88), fontsize=8, frameon=False)
    fig.suptitle("step time by layout", fontsize=10)
    return save_png(fig, path)
