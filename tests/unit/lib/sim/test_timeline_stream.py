"""The analytic raw timeline is written one iteration at a time (issue 14, bounded memory): the file
is the one the whole-DataFrame write made, at any chunk size, and the whole frame is the
iterations' rows joined."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from phantora_assets.lib.columns import RAW_TIMELINE_COLUMNS
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.analytic import AnalyticSimulator, simulate
from phantora_assets.lib.store.parquet import write_parquet, write_parquet_frames


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def w5():
    return simulate(RunSpec("W5", "h100", 2, 2))


def test_iterations_join_into_the_frame(w5) -> None:
    tl = w5.timeline
    parts = list(tl.iterations())
    assert len(parts) == len(w5.iteration_ns) == 20
    assert [list(p) for p in parts] == [list(RAW_TIMELINE_COLUMNS)] * 20
    assert sum(len(p["event_id"]) for p in parts) == len(tl) == len(w5.raw)
    joined = pd.concat([pd.DataFrame(p) for p in parts], ignore_index=True)
    pd.testing.assert_frame_equal(joined, w5.raw)
    assert w5.raw["event_id"].tolist() == list(range(len(tl)))
    assert [str(t) for t in w5.raw.dtypes] == [
        "int64" if t == "int64" else "object" for t in RAW_TIMELINE_COLUMNS.values()
    ]


@pytest.mark.parametrize("chunk_rows", [250, 997, 5000, 10**9])
def test_streamed_parquet_is_the_whole_frame_write(tmp_path: Path, w5, chunk_rows: int) -> None:
    """Chunks smaller than an iteration, spanning several, exactly dividing or holding all rows."""
    whole, streamed = tmp_path / "whole.parquet", tmp_path / "streamed.parquet"
    write_parquet(w5.raw, whole, chunk_rows=chunk_rows)
    write_parquet_frames(w5.timeline.frames(), streamed, chunk_rows=chunk_rows)
    assert _sha(streamed) == _sha(whole)


def test_chunk_boundaries_on_frame_edges(tmp_path: Path) -> None:
    """Frames of 3 rows, chunks of 3 and 6 rows: every chunk ends on a frame's edge."""
    df = pd.DataFrame({"a": np.arange(12, dtype=np.int64), "s": [f"x{i}" for i in range(12)]})
    frames = [df.iloc[i : i + 3].reset_index(drop=True) for i in range(0, 12, 3)]
    for chunk in (3, 6, 12):
        write_parquet(df, tmp_path / "w.parquet", chunk_rows=chunk)
        write_parquet_frames(iter(frames), tmp_path / "s.parquet", chunk_rows=chunk)
        assert _sha(tmp_path / "s.parquet") == _sha(tmp_path / "w.parquet"), chunk
        assert pd.read_parquet(tmp_path / "s.parquet").equals(df)


def test_no_events_without_emit() -> None:
    res = AnalyticSimulator(RunSpec("W4", "h100", 1, 2), iterations=2, emit=False).run()
    assert res.timeline is None
    assert len(res.raw) == 0 and list(res.raw.columns) == list(RAW_TIMELINE_COLUMNS)
