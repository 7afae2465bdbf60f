"""The raw timeline read as a table (issue 37, item 1): ``read_raw_timeline`` gives the ParsedTrace that
``read_trace`` gives for the Chrome JSON ``write_chrome_trace`` writes from the same table, to the bit,
and refuses what the Chrome reader refuses, with the same rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures.raw_timelines import raw_timeline

from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.phantora.chrome_trace import read_trace, write_chrome_trace
from phantora_assets.lib.phantora.raw_tables import read_raw_timeline
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.analytic import simulate
from phantora_assets.lib.store.parquet import write_parquet


def _both(raw: pd.DataFrame, tmp_path: Path, row_group: int | None = None):
    table = tmp_path / "raw.parquet"
    if row_group is None:
        write_parquet(raw, table)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pandas(raw, preserve_index=False), table, row_group_size=row_group)
    write_chrome_trace(table, tmp_path / "t.json.gz")
    return read_raw_timeline(table, compute_events=True), read_trace(tmp_path / "t.json.gz", compute_events=True)


def _same(a, b) -> None:
    assert a.n_events == b.n_events
    pd.testing.assert_frame_equal(a.flows, b.flows, check_exact=True)
    pd.testing.assert_frame_equal(a.compute, b.compute, check_exact=True)
    pd.testing.assert_frame_equal(a.compute_events, b.compute_events, check_exact=True)


def test_hand_built_timeline_every_kind_of_event(tmp_path: Path) -> None:
    """Every call (p2p without a stream, broadcast roots), out of time order, odd ns."""
    _same(*_both(raw_timeline(), tmp_path))


def test_row_groups_do_not_change_the_result(tmp_path: Path) -> None:
    raw = raw_timeline()
    _same(*_both(raw, tmp_path, row_group=3))


@pytest.mark.parametrize("wl,n,g", [("W1", 2, 2), ("W2", 2, 2), ("W5", 2, 2), ("W4", 4, 1)])
def test_simulated_runs(tmp_path: Path, wl: str, n: int, g: int) -> None:
    """TP and DP communicators (W1), p2p all-to-all (W2), ZeRO-3 with many kernels (W5), one GPU a node (W4)."""
    raw = simulate(RunSpec(wl, "h100", n, g)).raw
    a, b = _both(raw, tmp_path)
    _same(a, b)
    assert len(a.flows) == int((raw["kind"] == "communication").sum()) > 0


def test_times_are_the_parsed_decimals(tmp_path: Path) -> None:
    """ns / 1000 as a float is the parse of the printed decimal, including values a float cannot hold exactly."""
    raw = raw_timeline()
    ns = np.array([1, 3, 999, 1_000_001, 123_456_789_123, 2**52 + 7], np.int64)
    raw = pd.concat([raw.iloc[:1]] * len(ns), ignore_index=True)
    raw["event_id"] = np.arange(len(ns))
    raw["start_ns"], raw["end_ns"] = ns, ns + ns[::-1]
    a, b = _both(raw, tmp_path)
    _same(a, b)
    assert a.flows["ts_us"].tolist() == [float(f"{x // 1000}.{x % 1000:03d}") for x in sorted(ns)]


@pytest.mark.parametrize(
    "column,value,rule",
    [
        ("start_ns", -5, "negative duration"),
        ("end_ns", 0, "negative duration"),
        ("call", "NcclAllToAllv", "unknown NCCL op"),
        ("dtype", "Bf17", "unknown dtype"),
        ("src_host", "host-01", "bad host name"),
        ("dst_host", "host-0", "bad host name"),
        ("bytes", -1, "negative bytes"),
        ("comm_id_hex", "zz", "bad communicator"),
        ("kind", "memcpy", "invalid event"),
    ],
)
def test_refusals_name_the_file_and_rule(tmp_path: Path, column: str, value, rule: str) -> None:
    raw = raw_timeline()
    i = int(np.flatnonzero((raw["kind"] == "communication").to_numpy())[2])
    if column == "end_ns":
        raw.loc[i, "start_ns"] = 10
    raw.loc[i, column] = value
    write_parquet(raw, tmp_path / "raw.parquet")
    with pytest.raises(TraceFormatError, match=rule) as exc:
        read_raw_timeline(tmp_path / "raw.parquet")
    assert "raw.parquet" in str(exc.value)


def test_empty_table_refused(tmp_path: Path) -> None:
    write_parquet(raw_timeline().iloc[:0], tmp_path / "raw.parquet")
    with pytest.raises(TraceFormatError, match="empty trace"):
        read_raw_timeline(tmp_path / "raw.parquet")
