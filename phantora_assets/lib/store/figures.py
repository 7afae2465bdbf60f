"""Matplotlib figures of a fixed pixel size (Agg canvas, no pyplot state), written as PNG.

A per-run plot (``plots.py``) draws the same figure for every run with other data. Making its
``Figure``, axes and ticks anew is a third of its cost, so :func:`kept_figure` keeps one figure per
plot name in each process and empties it before each use; the PNG is byte-identical to a new
figure's (``tests/integration/test_plot_reuse.py`` renders runs of different sizes one after another both ways).

No Dagster import.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from phantora_assets.lib.store.io import atomic_write_bytes

DPI = 100
#: (width, height) in pixels of each plot.
SIZES: dict[str, tuple[int, int]] = {
    "pair_heatmap": (640, 520),
    "timeseries": (1000, 560),
    "step_anatomy": (1000, 460),
    "link_utilisation": (1000, 560),
    "bytes_vs_published": (1000, 720),
    "step_time_by_layout": (1000, 480),
    "reconfig_windows": (1000, 460),
    "reconfig_sweep": (1000, 620),
}

Rect = tuple[float, float, float, float]
_Kept = tuple[Any, list[Any], tuple[tuple[float, ...], ...]]

#: plot name -> (figure, its axes, the rectangles they were made at): this process's kept figures
_KEPT: dict[str, _Kept] = {}
_KEPT_LOCK = threading.Lock()


def new_figure(name: str):
    """A new ``Figure`` of ``SIZES[name]`` pixels at :data:`DPI`, on an Agg canvas."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    w, h = SIZES[name]
    # +0.01 px: the canvas size is the truncated product, and 460 / 100 * 100 = 459.99999999999994
    fig = Figure(figsize=((w + 0.01) / DPI, (h + 0.01) / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


@contextmanager
def kept_figure(name: str, rects: Sequence[Rect]) -> Iterator[tuple[Any, list[Any]]]:
    """``(figure, axes)``: this process's figure of plot ``name`` with one axes at each of ``rects``
    (figure fractions), emptied of what the last use drew (:func:`_empty`), held for the ``with``
    block (one thread at a time). The block must set every property it relies on (titles, labels,
    ticks, limits) on every use, as it would on a new figure. A block that raises drops the figure:
    the next use makes a new one."""
    key = tuple(tuple(r) for r in rects)
    with _KEPT_LOCK:
        old = _KEPT.pop(name, None)
        if old is None or old[2] != key:
            fig = new_figure(name)
            kept: _Kept = (fig, [fig.add_axes(r) for r in key], key)
        else:
            kept = old
            _empty(kept[0], kept[1])
        yield kept[0], kept[1]
        _KEPT[name] = kept  # not reached when the block raised


def _empty(fig, axes: list[Any]) -> None:
    """Remove what a plot added (figure texts, and each axes' artists and legend), clear titles and
    axis labels, and make the data limits empty and autoscaled again, as on a new axes: the view
    limits back to the unit box a new axes has, else a run with no data to autoscale on (no network
    bin, NaN) kept the previous run's y range."""
    for t in list(fig.texts):
        t.remove()
    for ax in axes:
        legend = ax.get_legend()
        if legend is not None:
            legend.remove()
        for art in [*ax.lines, *ax.collections, *ax.texts, *ax.images, *ax.patches, *ax.artists, *ax.tables]:
            art.remove()
        ax.set_title("")
        ax.set_xlabel("")
        ax.set_ylabel("")
        ax.dataLim.set_points(np.array([[np.inf, np.inf], [-np.inf, -np.inf]]))
        ax.set_xlim(0.0, 1.0)  # a new axes' unit box (this turns autoscaling off: on again below)
        ax.set_ylim(0.0, 1.0)
        ax.ignore_existing_data_limits = True
        ax.set_autoscale_on(True)


def save_png(fig, path: Path | None) -> bytes:
    """The PNG of ``fig`` (no software tag, zlib level 1), written atomically to ``path`` when given."""
    buf = io.BytesIO()
    # compress_level 1: a third of the encoding time of the default 6, files ~1.3x larger
    fig.savefig(buf, format="png", dpi=DPI, metadata={"Software": None}, pil_kwargs={"compress_level": 1})
    data = buf.getvalue()
    if path is not None:
        atomic_write_bytes(path, data)
    return data
