"""Tests of phantora_assets.lib.phantora.chrome_trace: writer -> reader round trip and format errors."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures.raw_timelines import COMM_A, COMM_B, COMM_C, TORCH_META, big_trace, raw_timeline

from phantora_assets.lib.columns import COMPUTE_SUMMARY_COLUMNS, FLOW_COLUMNS
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.phantora.chrome_trace import comm_id_of, read_trace, write_chrome_trace


@pytest.fixture()
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "timeline.json.gz"
    write_chrome_trace(raw_timeline(), path)
    return path


def _lines(path: Path) -> list[str]:
    return gzip.decompress(path.read_bytes()).decode().split("\n")


# ------------------------------------------------------------------------------------- writer


def test_writer_layout_and_stats(tmp_path: Path) -> None:
    path = tmp_path / "t.json.gz"
    stats = write_chrome_trace(raw_timeline(), path)
    assert stats == {"n_events": 10, "n_communication": 7, "n_computation": 3, "bytes_written": path.stat().st_size}
    text = gzip.decompress(path.read_bytes()).decode()
    assert text.startswith("[\n{") and text.endswith("}\n]")
    lines = text.split("\n")
    assert len(lines) == 12 and all(ln.endswith("},") for ln in lines[1:-2])
    events = json.loads(text)
    ar = events[0]
    assert ar == {
        "name": "ar",
        "cat": "Communication",
        "ph": "X",
        "ts": 5000,
        "dur": 56,
        "pid": 0,
        "tid": 7,
        "args": {
            "Communication": [
                {
                    "id": 11,
                    "bytes": 8388608,
                    "src": "host-1",
                    "dst": "host-2",
                    "token": None,
                    "tenant_id": None,
                    "vsrc": None,
                    "vdst": None,
                    "udp_src_port": None,
                },
                {
                    "NcclAllReduce": {
                        "count": 4194304,
                        "dtype": "Bf16",
                        "op": "Sum",
                        "comm": {"rank": 0, "id": list(COMM_A)},
                        "stream": {"device": 0, "id": 7},
                    }
                },
            ]
        },
    }
    # second AllReduce: fractional µs, device 1 -> tid, host-2 is the second src host
    ar2 = events[2]
    assert ar2["dur"] == 56.5 and ar2["pid"] == 1 and ar2["tid"] == (1 << 32) | 9
    bc = events[5]["args"]["Communication"][1]
    assert bc == {
        "NcclBcast": {
            "count": 1000000,
            "dtype": "I8",
            "root": 1,
            "comm": {"rank": 1, "id": list(COMM_A)},
            "stream": {"device": 0, "id": 7},
        }
    }
    assert events[5]["ts"] == 3000.123 and '"ts":3000.123,' in lines[6]
    send = events[6]
    assert send["tid"] == 0
    assert send["args"]["Communication"][1] == {
        "NcclSend": {"count": 32768, "dtype": "F16", "peer": 1, "comm": {"rank": 0, "id": list(COMM_C)}, "stream": None}
    }
    recv = events[7]["args"]["Communication"][1]["NcclRecv"]
    assert recv["peer"] == 0 and recv["stream"] == {"device": 0, "id": 3}
    ag = events[3]["args"]["Communication"][1]["NcclAllGather"]
    assert set(ag) == {"count", "dtype", "comm", "stream"}
    comp = events[1]
    assert comp == {
        "name": "aten::mm",
        "cat": "Computation",
        "ph": "X",
        "ts": 10,
        "dur": 3,
        "pid": 101,
        "tid": 7,
        "args": {"Computation": [{"hostname": "host-1", "pid": 101}, 3000, TORCH_META]},
    }


def test_writer_deterministic_bytes(tmp_path: Path) -> None:
    a, b = tmp_path / "a" / "t.json.gz", tmp_path / "b" / "t.json.gz"
    write_chrome_trace(raw_timeline(), a)
    write_chrome_trace(raw_timeline(), b)
    assert a.read_bytes() == b.read_bytes()
    first = a.read_bytes()
    write_chrome_trace(raw_timeline(), a)  # rewrite in place
    assert a.read_bytes() == first
    assert first[4:8] == b"\0\0\0\0"  # gzip mtime 0
    assert not first[3] & 0x08  # no FNAME in the header
    assert not list(a.parent.glob(".*tmp"))


def test_writer_plain_json(tmp_path: Path) -> None:
    p = tmp_path / "t.json"
    write_chrome_trace(raw_timeline(), p)
    assert p.read_bytes().startswith(b"[\n{")
    assert len(json.loads(p.read_text())) == 10


def test_writer_rejects_bad_span(tmp_path: Path) -> None:
    raw = raw_timeline()
    raw.loc[0, "end_ns"] = raw.loc[0, "start_ns"] - 1
    with pytest.raises(ValueError):
        write_chrome_trace(raw, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


# ------------------------------------------------------------------------------------- reader


def test_round_trip_flows(trace: Path) -> None:
    pt = read_trace(trace)
    f = pt.flows
    assert pt.n_events == 10 and pt.path == trace
    assert list(f.columns) == list(FLOW_COLUMNS)
    for c, t in FLOW_COLUMNS.items():
        assert str(f[c].dtype) == ("object" if t == "str" else t), c
    assert isinstance(f.index, pd.RangeIndex) and f.index[0] == 0
    assert f["flow_id"].tolist() == [13, 14, 15, 16, 17, 11, 12]
    assert f["ts_us"].tolist() == [1.0, 2.0, 3000.123, 4000.0, 4000.0, 5000.0, 5000.0]
    assert f["dur_us"].tolist() == [0.0, 0.0, 9.877, 20.0, 20.0, 56.0, 56.5]
    assert f["bytes"].tolist() == [4096, 2048, 1_000_000, 65_536, 65_536, 8_388_608, 8_388_608]
    assert f["src_node"].tolist() == [0, 1, 1, 0, 0, 0, 1]
    assert f["dst_node"].tolist() == [0, 0, 0, 1, 1, 1, 0]
    assert f["src_host"].tolist() == ["host-1", "host-2", "host-2", "host-1", "host-1", "host-1", "host-2"]
    assert f["op"].tolist() == ["all_gather", "reduce_scatter", "broadcast", "send", "recv", "all_reduce", "all_reduce"]
    assert f["call"].tolist()[2] == "NcclBcast"
    assert f["dtype"].tolist() == ["F32", "F64", "I8", "F16", "F16", "Bf16", "Bf16"]
    assert f["dtype_bytes"].tolist() == [4, 8, 1, 2, 2, 2, 2]
    assert f["count"].tolist() == [1024, 256, 1_000_000, 32_768, 32_768, 4_194_304, 4_194_304]
    assert f["root"].tolist() == [-1, -1, 1, -1, -1, -1, -1]
    assert f["comm_rank"].tolist() == [0, 1, 1, 0, 1, 0, 1]
    assert f["stream"].tolist() == [7, 7, 7, 0, 3, 7, (1 << 32) | 9]
    assert f["name"].tolist() == ["ag", "rs", "bc", "send", "recv", "ar", "ar"]
    # loopback flow is kept, with src == dst
    assert (f["src_node"] == f["dst_node"]).sum() == 1
    # communicator ids: equal within one communicator, 16 hex chars, blake2b of the id bytes
    cid = dict(zip(f["flow_id"], f["comm_id"]))
    assert cid[11] == cid[12] == cid[15] == comm_id_of(COMM_A)
    assert cid[13] == cid[14] == comm_id_of(COMM_B) != cid[11]
    assert cid[16] == cid[17] == comm_id_of(COMM_C)
    assert all(len(x) == 16 for x in f["comm_id"])


def test_round_trip_compute(trace: Path) -> None:
    c = read_trace(trace).compute
    assert list(c.columns) == list(COMPUTE_SUMMARY_COLUMNS)
    assert c["host"].tolist() == ["host-1", "host-2"]
    assert c["n_events"].tolist() == [2, 1]
    assert c["busy_us"].tolist() == [5.5, 1.0]
    assert c["first_ts_us"].tolist() == [0.0, 0.5]
    assert c["last_end_us"].tolist() == [13.0, 1.5]
    assert str(c["n_events"].dtype) == "int64" and str(c["busy_us"].dtype) == "float64"


def test_plain_json_and_one_line_array(tmp_path: Path, trace: Path) -> None:
    ref = read_trace(trace)
    events = json.loads(gzip.decompress(trace.read_bytes()))
    one = tmp_path / "one.json"
    one.write_text(json.dumps(events))  # one line, ", " separators
    pretty = tmp_path / "pretty.json.gz"
    pretty.write_bytes(gzip.compress(json.dumps(events, indent=2).encode()))
    plain = tmp_path / "plain.json"
    plain.write_bytes(gzip.decompress(trace.read_bytes()))
    for p in (one, pretty, plain):
        got = read_trace(p)
        pd.testing.assert_frame_equal(got.flows, ref.flows)
        pd.testing.assert_frame_equal(got.compute, ref.compute)
        assert got.n_events == 10
    # small batches cut the pretty-printed elements apart (",\n" inside them): the whole
    # document is decoded in one piece instead
    for workers in (0, 1):
        got = read_trace(pretty, chunk_bytes=64, workers=workers)
        pd.testing.assert_frame_equal(got.flows, ref.flows)
        pd.testing.assert_frame_equal(got.compute, ref.compute)


def test_crlf_layout_is_streamed_in_batches(tmp_path: Path) -> None:
    from phantora_assets.lib.phantora import trace_batches as tb

    big = big_trace(tmp_path, copies=30)
    ref = read_trace(big)
    crlf = tmp_path / "crlf.json.gz"
    crlf.write_bytes(gzip.compress(gzip.decompress(big.read_bytes()).replace(b"\n", b"\r\n")))
    batches = [(offset, bytes(view[:end])) for offset, view, end in tb.iter_batches(crlf, 4096)]
    assert len(batches) > 20  # cut at ",\r\n", not decoded as one document
    assert batches[0][1].startswith(b"[\r\n{")
    assert all(b.startswith(b"[{") and b.endswith(b"}]") for _, b in batches[1:-1])
    text = gzip.decompress(crlf.read_bytes())
    assert all(text[o : o + 1] == b"{" for o, _ in batches[1:])  # offsets point at each batch's text
    for workers in (0, 1):
        got = read_trace(crlf, chunk_bytes=4096, workers=workers)
        pd.testing.assert_frame_equal(got.flows, ref.flows, check_exact=True)
        pd.testing.assert_frame_equal(got.compute, ref.compute, check_exact=True)


def test_small_chunks_and_multimember_gzip(tmp_path: Path, trace: Path) -> None:
    """Tiny batches exercise the ',\\n' cutting across chunk boundaries."""
    ref = read_trace(trace)
    for cb in (1, 7, 64, 300, 1000):
        pd.testing.assert_frame_equal(read_trace(trace, chunk_bytes=cb).flows, ref.flows)
    text = gzip.decompress(trace.read_bytes())
    half = len(text) // 2
    mm = tmp_path / "mm.json.gz"
    mm.write_bytes(gzip.compress(text[:half]) + gzip.compress(text[half:]))
    pd.testing.assert_frame_equal(read_trace(mm, chunk_bytes=100).flows, ref.flows)


def test_many_events(tmp_path: Path) -> None:
    raw = raw_timeline()
    big = pd.concat([raw] * 300, ignore_index=True)
    big["event_id"] = np.arange(len(big), dtype=np.int64)
    big["start_ns"] = big["start_ns"] + np.arange(len(big)) * 10
    big["end_ns"] = big["end_ns"] + np.arange(len(big)) * 10
    p = tmp_path / "big.json.gz"
    write_chrome_trace(big, p)
    pt = read_trace(p, chunk_bytes=4096)
    assert pt.n_events == 3000 and len(pt.flows) == 2100
    assert pt.flows["ts_us"].is_monotonic_increasing
    assert pt.flows["bytes"].sum() == 300 * raw["bytes"].sum()
    assert pt.compute["n_events"].tolist() == [600, 300]


# ------------------------------------------------------------------------------------- errors


def _write(tmp_path: Path, name: str, text: str, gz: bool = False) -> Path:
    p = tmp_path / name
    data = text.encode()
    p.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return p


def _expect(path: Path, rule: str, *fragments: str) -> TraceFormatError:
    with pytest.raises(TraceFormatError) as ei:
        read_trace(path)
    msg = str(ei.value)
    assert path.name in msg and rule in msg, msg
    assert ei.value.rule == rule
    for frag in fragments:
        assert frag in msg, msg
    return ei.value


def _mutated(trace: Path, tmp_path: Path, name: str, old: str, new: str, line: int | None = None) -> Path:
    lines = _lines(trace)
    idxs = [i for i, ln in enumerate(lines) if old in ln] if line is None else [line - 1]
    assert idxs
    i = idxs[0]
    assert old in lines[i]
    lines[i] = lines[i].replace(old, new, 1)
    return _write(tmp_path, name, "\n".join(lines), gz=True)


def test_error_truncated_gzip(tmp_path: Path, trace: Path) -> None:
    data = trace.read_bytes()
    p = tmp_path / "cut.json.gz"
    p.write_bytes(data[: len(data) - 20])
    _expect(p, "truncated gzip")


def test_error_invalid_json_with_line(tmp_path: Path, trace: Path) -> None:
    p = _mutated(trace, tmp_path, "bad.json.gz", '"cat":"Computation"', '"cat":Computation"', line=3)
    _expect(p, "invalid JSON", "line 3")
    p2 = _write(tmp_path, "open.json", _lines(trace)[0] + "\n" + _lines(trace)[1])
    _expect(p2, "invalid JSON")
    p3 = _write(tmp_path, "comma.json", "\n".join(_lines(trace)[:-1]) + ",\n]")
    _expect(p3, "invalid JSON")
    p4 = _write(tmp_path, "nocomma.json", "\n".join(_lines(trace)).replace("},\n{", "}\n{", 1))
    _expect(p4, "invalid JSON")


def test_error_empty_trace(tmp_path: Path) -> None:
    _expect(_write(tmp_path, "empty.json.gz", "[\n]", gz=True), "empty trace")
    _expect(_write(tmp_path, "empty2.json", "[]"), "empty trace")


def test_error_not_array(tmp_path: Path) -> None:
    _expect(_write(tmp_path, "obj.json", '{"traceEvents": []}'), "not a JSON array")


def test_error_negative_duration(tmp_path: Path, trace: Path) -> None:
    _expect(_mutated(trace, tmp_path, "neg.json.gz", '"dur":56,', '"dur":-56,'), "negative duration", "line 2")
    _expect(_mutated(trace, tmp_path, "negts.json.gz", '"ts":10,', '"ts":-0.5,'), "negative duration")


def test_error_overflowing_duration(tmp_path: Path, trace: Path) -> None:
    _expect(_mutated(trace, tmp_path, "big.json.gz", '"dur":56,', '"dur":1e300,'), "overflowing duration")
    _expect(_mutated(trace, tmp_path, "inf.json.gz", '"dur":56,', '"dur":1e999,'), "overflowing duration")
    _expect(_mutated(trace, tmp_path, "big2.json.gz", '"ts":5000,', f'"ts":{2**60},'), "overflowing duration")
    _expect(_mutated(trace, tmp_path, "i64.json.gz", '"bytes":8388608', f'"bytes":{2**64}'), "overflowing value")


def test_error_unknown_op(tmp_path: Path, trace: Path) -> None:
    _expect(
        _mutated(trace, tmp_path, "op.json.gz", '"NcclAllGather"', '"NcclAllToAll"'), "unknown NCCL op", "NcclAllToAll"
    )


def test_error_unknown_dtype(tmp_path: Path, trace: Path) -> None:
    _expect(_mutated(trace, tmp_path, "dt.json.gz", '"dtype":"F32"', '"dtype":"F128"'), "unknown dtype", "F128")


def test_error_bad_host(tmp_path: Path, trace: Path) -> None:
    _expect(_mutated(trace, tmp_path, "h.json.gz", '"dst":"host-2"', '"dst":"node-2"'), "bad host name", "node-2")
    _expect(_mutated(trace, tmp_path, "h0.json.gz", '"src":"host-1"', '"src":"host-0"'), "bad host name")
    _expect(
        _mutated(trace, tmp_path, "hc.json.gz", '"hostname":"host-2"', '"hostname":"gpu7"'), "bad host name", "gpu7"
    )


def test_error_negative_bytes(tmp_path: Path, trace: Path) -> None:
    _expect(_mutated(trace, tmp_path, "b.json.gz", '"bytes":4096', '"bytes":-4096'), "negative bytes")


def test_error_wrong_type(tmp_path: Path, trace: Path) -> None:
    _expect(_mutated(trace, tmp_path, "t.json.gz", '"bytes":4096', '"bytes":"4096"'), "invalid event", "line")
    _expect(_mutated(trace, tmp_path, "c.json.gz", '"cat":"Computation"', '"cat":"Memory"'), "invalid event")


def test_error_oversized_rank_deep_nesting_and_byte_order_mark(tmp_path: Path, trace: Path) -> None:
    _expect(
        _mutated(trace, tmp_path, "r.json.gz", '"rank":0', '"rank":9223372036854775808'), "bad communicator", "line"
    )
    deep = "[" * 5000 + "]" * 5000
    _expect(
        _mutated(trace, tmp_path, "d.json.gz", '"Torch":', f'"Torch":{deep},"x":'), "invalid JSON", "nests too deep"
    )
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf" + gzip.decompress(trace.read_bytes()))
    _expect(bom, "invalid JSON", "byte order mark")


def test_reader_accepts_null_stream_and_missing_optional_fields(tmp_path: Path) -> None:
    ev = {
        "name": "s",
        "cat": "Communication",
        "ph": "X",
        "ts": 1,
        "dur": 2,
        "pid": 0,
        "tid": 0,
        "args": {
            "Communication": [
                {"id": 5, "bytes": 10, "src": "host-3", "dst": "host-12"},
                {
                    "NcclSend": {
                        "count": 5,
                        "dtype": "U8",
                        "peer": 1,
                        "comm": {"rank": 0, "id": [1, 2, 3]},
                        "stream": None,
                    }
                },
            ]
        },
    }
    p = _write(tmp_path, "p2p.json", json.dumps([ev]))
    f = read_trace(p).flows
    assert f[["src_node", "dst_node", "bytes", "op", "stream", "root"]].iloc[0].tolist() == [2, 11, 10, "send", 0, -1]
    assert f["comm_id"].iloc[0] == comm_id_of(bytes([1, 2, 3]))
    assert read_trace(p).compute.empty


# ------------------------------------------------------------------------------------- helper process


@pytest.mark.parametrize("chunk,workers", [(4096, 1), (1000, 2), (1 << 20, 1)])
def test_helper_process_gives_the_same_tables(tmp_path: Path, chunk: int, workers: int) -> None:
    p = big_trace(tmp_path)
    ref = read_trace(p, workers=0)
    got = read_trace(p, chunk_bytes=chunk, workers=workers)
    pd.testing.assert_frame_equal(got.flows, ref.flows, check_exact=True)
    pd.testing.assert_frame_equal(got.compute, ref.compute, check_exact=True)
    assert got.n_events == ref.n_events == 3000


def test_default_uses_helpers_only_for_idle_cores(tmp_path: Path, monkeypatch) -> None:
    import phantora_assets.lib.phantora.chrome_trace as ct
    import phantora_assets.lib.phantora.trace_decode as td
    import phantora_assets.lib.phantora.trace_helpers as th

    p = big_trace(tmp_path)
    ref = read_trace(p, workers=0)
    calls = []
    real = th.HelperPool

    class Spy(real):
        def __init__(self, *a, **k):
            calls.append(a)
            super().__init__(*a, **k)

    monkeypatch.setattr(th, "HelperPool", Spy)
    monkeypatch.setattr(th, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(th, "_usable_cpus", lambda: 2)
    monkeypatch.setattr(th, "idle_cpus", lambda: 0.3)  # busy: no helper
    assert ct.default_workers(p) == 0
    monkeypatch.setattr(th, "idle_cpus", lambda: 1.4)  # a core idles
    # one per core, but one for this process when the compiled scanner decodes here too
    expected = 1 if td._tracescan is not None else 2
    assert ct.default_workers(p) == expected
    got = read_trace(p, chunk_bytes=4096)
    assert calls and calls[0][2] == expected, "the helper processes were not used"
    pd.testing.assert_frame_equal(got.flows, ref.flows, check_exact=True)
    monkeypatch.setattr(th, "PARALLEL_MIN_BYTES", 1 << 40)  # small trace: none
    assert ct.default_workers(p) == 0


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_first_error_in_file_order_with_line(tmp_path: Path, workers: int) -> None:
    """Errors in two batches: the first one in the file is reported, with its line, whichever
    process decoded it."""
    lines = _lines(big_trace(tmp_path))
    i = next(k for k in range(2400, 2600) if '"cat":"Communication"' in lines[k])
    lines[i] = lines[i].replace('"dur":', '"dur":-', 1)
    j = next(k for k in range(2800, 2900) if '"cat":"Computation"' in lines[k])
    lines[j] = lines[j].replace('"cat":"', '"cat":', 1)
    p = _write(tmp_path, "two_errors.json.gz", "\n".join(lines), gz=True)
    with pytest.raises(TraceFormatError) as ei:
        read_trace(p, chunk_bytes=2048, workers=workers)
    assert ei.value.rule == "negative duration", str(ei.value)
    assert f"line {i + 1}:" in str(ei.value) and p.name in str(ei.value)


def _read_in_pool_worker(args):
    path, workers = args
    return read_trace(path, chunk_bytes=4096, workers=workers).flows


def test_helpers_are_skipped_inside_a_daemonic_pool_worker(tmp_path: Path) -> None:
    """A parallel build runs partitions in pool workers, which may not have children."""
    import multiprocessing as mp

    p = big_trace(tmp_path)
    ref = read_trace(p, workers=0)
    with mp.get_context("fork").Pool(1) as pool:
        got = pool.map(_read_in_pool_worker, [(p, 2)])[0]
    pd.testing.assert_frame_equal(got, ref.flows, check_exact=True)


def test_idle_cpus_sees_a_busy_core() -> None:
    """/proc/stat over a short sample: a core spinning in this process is not idle."""
    import threading
    import time as _time

    import phantora_assets.lib.phantora.trace_helpers as th

    if not Path("/proc/stat").exists():
        pytest.skip("no /proc/stat here")
    quiet = th.idle_cpus(0.2)
    stop = _time.perf_counter() + 0.6
    spin = threading.Thread(target=lambda: [None for _ in iter(lambda: _time.perf_counter() < stop, False)])
    spin.start()
    busy = th.idle_cpus(0.2)
    spin.join()
    cpus = os.cpu_count() or 1
    assert 0.0 <= busy <= cpus and 0.0 <= quiet <= cpus
    assert busy <= cpus - 0.5, (quiet, busy)


def test_writer_refuses_a_missing_integer(tmp_path) -> None:
    raw = raw_timeline()
    raw["stream_id"] = raw["stream_id"].astype("float64")
    raw.loc[raw.index[2], "stream_id"] = np.nan
    with pytest.raises(ValueError, match=r"row 2: stream_id is not an integer"):
        write_chrome_trace(raw, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


def test_writer_keeps_text_of_odd_string_values(tmp_path) -> None:
    """None is written as the text "None" (str of the value), as the row-by-row writer did."""
    raw = raw_timeline()
    raw["name"] = raw["name"].astype(object)
    raw.loc[raw.index[0], "name"] = None
    write_chrome_trace(raw, tmp_path / "t.json")
    first = (tmp_path / "t.json").read_text().splitlines()[1]
    assert first.startswith('{"name":"None",')


@pytest.mark.slow
def test_leading_whitespace_is_read_in_linear_time_and_lines_stay_right(tmp_path: Path) -> None:
    """Issue 13 (finding 4): whitespace before '[' was rescanned on every chunk (0.25 GiB: 28 s).
    A hang guard (bound ~6x what it takes now), and the line an error names still counts it."""
    import time

    ev = (
        b'{"name":"x","cat":"Computation","ph":"X","ts":1,"dur":1,"pid":0,"tid":1,'
        b'"args":{"Computation":[{"hostname":"host-1","pid":1},1,0]}}'
    )
    good = tmp_path / "good.json.gz"
    with gzip.open(good, "wb", compresslevel=1) as fh:
        fh.write(b"\n" * 3 + b" " * (256 << 20))
        fh.write(b"[\n" + ev + b"\n]")
    t0 = time.perf_counter()
    assert read_trace(good).n_events == 1
    assert time.perf_counter() - t0 < 10.0
    bad = tmp_path / "bad.json.gz"
    with gzip.open(bad, "wb", compresslevel=1) as fh:
        fh.write(b"\n" * 3 + b" " * (8 << 20) + b"[\n" + ev + b',\n{"name": \n]')
    with pytest.raises(TraceFormatError, match="line 7: JSON is malformed"):  # as without the padding
        read_trace(bad)


@pytest.mark.slow
def test_a_line_longer_than_the_cap_fails_with_bounded_memory(tmp_path: Path) -> None:
    """Issue 13 (finding 4): '[' + 1 GiB of spaces + ']' (a 1 MB gzip) peaked at 3.3 GB RSS. The
    reader buffers at most MAX_LINE_BYTES (256 MiB) without a line break, then fails with the rule
    'line too long'; measured in a fresh process (peak RSS of the child)."""
    import subprocess
    import sys

    path = tmp_path / "spaces.json.gz"
    with gzip.open(path, "wb", compresslevel=9) as fh:
        fh.write(b"[")
        for _ in range(1024):
            fh.write(b" " * (1 << 20))
        fh.write(b"]")
    assert path.stat().st_size < 2 << 20
    code = (
        "import sys\n"
        "from phantora_assets.lib.errors import TraceFormatError\n"
        "from phantora_assets.lib.phantora.chrome_trace import read_trace\n"
        "try:\n"
        f"    read_trace({str(path)!r}, workers=0)\n"
        "except TraceFormatError as e:\n"
        "    print('ERR', e)\n"
        # VmHWM: this process's peak (ru_maxrss would carry the parent's peak across exec)
        "hwm = [ln for ln in open('/proc/self/status') if ln.startswith('VmHWM:')][0].split()[1]\n"
        "print('RSS_MB', int(hwm) // 1024)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"ERR {path}: line too long (line 1: more than {256 << 20} bytes without a line break" in out
    rss_mb = int(out.split("RSS_MB")[1])
    assert rss_mb < 1200, out  # 256 MiB of buffer and its copies, not the 1 GiB document (3.3 GB before)
