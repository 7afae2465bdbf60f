"""The per-run plots reuse one figure per plot in each process (lib/store/figures.py, kept_figure):
what a run's PNGs show must not depend on which runs were drawn before in the same process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from phantora_assets.lib.store import figures, plots
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.stages import analysis

#: runs of different shapes, drawn one after the other: 2, 4 and 8 GPUs on 2 or 4 hosts (one
#: leaf or two: other link classes), other workloads, and the first again at the end
SEQUENCE = [
    "phantora_a100_40g_W4_2x1",
    "phantora_a100_40g_W5_4x2",
    "phantora_a100_40g_W1_2x4",
    "phantora_l40s_W3_2x1",
    "phantora_a100_40g_W2_4x1",
    "phantora_a100_40g_W4_2x1",
]


def _pngs(built: Path, run_id: str, out: Path) -> dict[str, bytes]:
    spec = {s.run_id: s for s in load_run_matrix()}[run_id]
    res = analysis.run_plots_stage(spec, DataPaths(built), out=out)
    return {name: path.read_bytes() for name, path in res.files.items()}


def test_a_kept_figure_draws_each_run_as_a_new_figure_does(built, tmp_path) -> None:
    figures._KEPT.clear()
    kept = [_pngs(built, r, tmp_path / f"kept{i}") for i, r in enumerate(SEQUENCE)]
    reused = figures._KEPT["timeseries"][0]
    _pngs(built, SEQUENCE[0], tmp_path / "again")
    assert figures._KEPT["timeseries"][0] is reused  # the figure is kept, not made anew
    fresh = []
    for i, r in enumerate(SEQUENCE):
        figures._KEPT.clear()
        fresh.append(_pngs(built, r, tmp_path / f"fresh{i}"))
    for r, k, f in zip(SEQUENCE, kept, fresh):
        for name in analysis.RUN_PLOTS:
            assert k[name] == f[name], f"{r} {name}: the kept figure's PNG differs from a new figure's"
    # the shipped plots were drawn by build workers (kept figures too): the same bytes
    spec = {s.run_id: s for s in load_run_matrix()}[SEQUENCE[1]]
    shipped = DataPaths(built).plots_dir(spec)
    assert {n: (shipped / f"{n}.png").read_bytes() for n in analysis.RUN_PLOTS} == fresh[1]
    assert kept[0] == kept[-1]


def test_a_plot_that_raises_drops_its_kept_figure(built, tmp_path) -> None:
    """A plot that fails half-drawn leaves nothing behind for the next run: its figure is dropped."""
    pdir = DataPaths(built).partition_dir(SEQUENCE[0])
    spans = pd.read_parquet(pdir / "step_spans.parquet")
    table = pd.read_parquet(pdir / "step_anatomy.parquet")
    step = int(spans.step.iloc[0])
    rows = table[table.step == step]
    good = plots.step_anatomy_chart(spans, rows, "r", step, 71000.0)
    assert "step_anatomy" in figures._KEPT
    broken = rows.drop(columns=["idle_us"])  # fails after the bars are drawn, at the totals
    with pytest.raises(AttributeError):
        plots.step_anatomy_chart(spans, broken, "r", step, 71000.0)
    assert "step_anatomy" not in figures._KEPT
    assert plots.step_anatomy_chart(spans, rows, "r", step, 71000.0) == good


def _bins(n: int, value: float = 1e9) -> pd.DataFrame:
    """``n`` 100 ms bins of traffic host-1 -> host-2 and back (``value`` bytes each)."""
    t = [i * 0.1 for i in range(n) for _ in (0, 1)]
    return pd.DataFrame({"t": t, "bytes": value, "src_node": [0, 1] * n, "dst_node": [1, 0] * n})


def _link_bins(n: int, value: float = 1e9) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "t": [i * 0.1 for i in range(n)],
            "bytes": value,
            "bin_s": 0.1,
            "capacity_bps": 1e11,
            "link_id": 0,
            "link_class": "host_up",
            "routes": "ecmp",
        }
    )


@pytest.mark.filterwarnings("ignore:No artists with labels")
@pytest.mark.parametrize(
    "draw_busy, draw_idle",
    [
        # a run without any network bin (one host) after a busy one
        (lambda: plots.timeseries(_bins(50), "busy", 0.1), lambda: plots.timeseries(_bins(0), "idle", 0.1)),
        # bins whose bytes are NaN: nothing to autoscale on either
        (lambda: plots.timeseries(_bins(50), "busy", 0.1), lambda: plots.timeseries(_bins(3, np.nan), "idle", 0.1)),
        (lambda: plots.link_utilisation(_link_bins(50), "busy"), lambda: plots.link_utilisation(_link_bins(0), "idle")),
    ],
    ids=["timeseries-no-bins", "timeseries-nan", "link_utilisation-no-bins"],
)
def test_a_run_with_no_data_after_a_busy_one_does_not_keep_its_axis_range(draw_busy, draw_idle) -> None:
    """Found by the issue-12 attack: the y range of a kept axes with nothing to autoscale on was the
    previous run's (80-160 Gbit/s ticks on an empty plot) where a new figure shows its default."""
    figures._KEPT.clear()
    draw_busy()
    kept = draw_idle()
    figures._KEPT.clear()
    assert kept == draw_idle()
