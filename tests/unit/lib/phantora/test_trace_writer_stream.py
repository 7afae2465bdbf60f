"""The Chrome-trace writer streams (issue 14): its bytes are those of the whole-table writer it replaced,
whatever the chunk size or the input form (DataFrame or Parquet file), and its memory does not
grow with the trace's text."""

from __future__ import annotations

import gzip
import hashlib
import tracemalloc
from pathlib import Path

import pandas as pd
import pytest

from phantora_assets.lib.phantora.trace_writer import write_chrome_trace
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.analytic import simulate
from phantora_assets.lib.store.parquet import write_parquet

#: sha256 of the files the whole-table writer (main before issue 14) wrote for these analytic runs.
OLD_WRITER = {
    ("W2", 2, 2, "t.json.gz"): "7dd31aec413590a12646235b5c519ce1c0ffaa7e700407e60ad53f7bc2659a6f",
    ("W2", 2, 2, "t.json"): "78a87dc4bc6c0bbd4f45d4da370c04fb7c4f81ffb8ced918755fbdb7c9d0295f",
    ("W1", 2, 4, "t.json.gz"): "e2e117d223f2a940115d419c11b24584891a49d0b9da574c1e45183259852d56",
    ("W1", 2, 4, "t.json"): "ad73dc4415a224ddadd1ef3437464cbd9c66215398baac0a535498af8f09b7e6",
    ("W5", 2, 2, "t.json.gz"): "42eaa754903e12fdf1c263a02e08df85cb169183f17108d97320f78230f753f2",
    ("W5", 2, 2, "t.json"): "2b35a7e47cb86d0d0fb6582c9ac493b6532111ec704edb91c622c7b854a2963b",
}


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("wl,n,g", [("W2", 2, 2), ("W1", 2, 4), ("W5", 2, 2)])
def test_stream_writer_matches_the_whole_table_writer(tmp_path: Path, wl: str, n: int, g: int) -> None:
    """W2 has NcclSend p2p rows (peers), W1 TP and DP communicators, W5 ZeRO-3 and many compute rows."""
    raw = simulate(RunSpec(wl, "h100", n, g)).raw
    write_parquet(raw, tmp_path / "raw.parquet")
    for name in ("t.json.gz", "t.json"):
        want = OLD_WRITER[(wl, n, g, name)]
        for i, (src, rows) in enumerate([(raw, 65_536), (raw, 997), (tmp_path / "raw.parquet", 1000)]):
            out = tmp_path / f"{i}_{name}"
            stats = write_chrome_trace(src, out, chunk_rows=rows)
            assert _sha(out) == want, (name, i, rows)
            assert stats["n_events"] == len(raw) and stats["bytes_written"] == out.stat().st_size


def test_empty_and_one_row_tables(tmp_path: Path) -> None:
    raw = simulate(RunSpec("W4", "h100", 1, 2)).raw
    write_chrome_trace(raw.iloc[:0], tmp_path / "e.json")
    assert (tmp_path / "e.json").read_bytes() == b"[\n\n]"
    write_chrome_trace(raw.iloc[:1], tmp_path / "o.json")
    body = (tmp_path / "o.json").read_bytes()
    assert body.startswith(b"[\n{") and body.endswith(b"}\n]") and body.count(b"\n") == 2
    write_chrome_trace(raw.iloc[:40], tmp_path / "a.json")  # one row per chunk, a chunk per kind
    write_chrome_trace(raw.iloc[:40], tmp_path / "b.json", chunk_rows=1)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_a_bad_row_in_the_parquet_file_writes_nothing(tmp_path: Path) -> None:
    """The rules are checked on the whole table before the first byte, also for a Parquet input."""
    raw = simulate(RunSpec("W2", "h100", 2, 2)).raw
    i = len(raw) - 3  # the last chunk
    raw.loc[i, "end_ns"] = raw.loc[i, "start_ns"] - 1
    write_parquet(raw, tmp_path / "raw.parquet")
    with pytest.raises(ValueError, match=rf"^row {i} \(event {i}\): bad span"):
        write_chrome_trace(tmp_path / "raw.parquet", tmp_path / "t.json.gz", chunk_rows=500)
    assert list(tmp_path.iterdir()) == [tmp_path / "raw.parquet"]


@pytest.mark.slow
def test_writer_memory_does_not_grow_with_the_text(tmp_path: Path) -> None:
    """Memory guard: a 99 k-event trace (W2 2x2 repeated 11 times, 62 MB of text) is written from
    its Parquet file with a peak Python and numpy allocation (tracemalloc; pyarrow's own pool is not
    traced) below 8 MiB + 160 bytes per event: a few 4096-row chunks of text plus the integer
    columns of the whole-table rules (host order, p2p peers). Measured: 13.3 MiB; the whole-table
    writer peaked at 211 MiB (2.2 kB per event, ~3.5x the text)."""
    one = simulate(RunSpec("W2", "h100", 2, 2)).raw
    raw = pd.concat([one] * 11, ignore_index=True)
    raw["event_id"] = range(len(raw))
    write_parquet(raw, tmp_path / "raw.parquet")
    n = len(raw)
    del raw, one
    tracemalloc.start()
    try:
        write_chrome_trace(tmp_path / "raw.parquet", tmp_path / "t.json.gz", chunk_rows=4096)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    with gzip.open(tmp_path / "t.json.gz", "rb") as fh:
        text = len(fh.read())
    assert text > 55 * 2**20, text
    assert peak < 8 * 2**20 + 160 * n, f"peak {peak / 2**20:.1f} MiB for {n} events, {text / 2**20:.0f} MiB of text"
