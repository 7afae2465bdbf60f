"""The compiled fast path of the trace reader (``phantora_assets.lib.phantora._tracescan``).

Its contract: for a batch it either returns what the msgspec path returns for that batch, or
declines it (None) and the msgspec path decodes it. These tests compare the two paths on the
writer's traces, on hand-picked odd inputs, on random events and on randomly damaged batches.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from fixtures.raw_timelines import big_trace, raw_timeline
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from phantora_assets.lib.phantora import trace_batches as tb
from phantora_assets.lib.phantora import trace_decode as td
from phantora_assets.lib.phantora.chrome_trace import read_trace, write_chrome_trace

ID = list(range(0, 256, 2))

BASE_COMM = {
    "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
    "cat": "Communication",
    "ph": "X",
    "ts": 20695710.616,
    "dur": 2244.834,
    "pid": 0,
    "tid": 7,
    "args": {
        "Communication": [
            {"id": 1, "bytes": 28410992, "src": "host-1", "dst": "host-7", "token": None},
            {
                "NcclAllReduce": {
                    "count": 14205496,
                    "dtype": "F16",
                    "op": "Sum",
                    "comm": {"rank": 1, "id": ID},
                    "stream": {"device": 7, "id": 7},
                }
            },
        ]
    },
}
BASE_COMP = {
    "name": "aten::mm",
    "cat": "Computation",
    "ph": "X",
    "ts": 746474.068,
    "dur": 1641.913,
    "pid": 1005,
    "tid": 21474836487,
    "args": {
        "Computation": [
            {"hostname": "host-6", "pid": 1005},
            1641913,
            {"Torch": {"time": 1641913, "info": {"MM": [{"shape": [1024, 4096]}]}}},
        ]
    },
}


def _batch(lines: list[str]) -> bytearray:
    return bytearray(("[" + ",\n".join(lines) + "]").encode("utf-8", "surrogatepass"))


def _decode(text: bytes, fast: bool):
    """(columns, tables) of one batch with or without the fast path, or (rule,) on an error."""
    dec = td.BatchDecoder(fast=fast)
    buf = bytearray(text)
    try:
        cols = dec.decode(buf, len(buf), 0, lambda offset: 1)
    except td.BatchError as exc:
        return (exc.rule, exc.detail)
    except td.NeedWholeDoc:
        return ("whole",)
    return cols, (dec.names.values, dec.hosts.values, dec.comms.values)


def _assert_same(text: bytes) -> None:
    fast, slow = _decode(text, True), _decode(text, False)
    if len(slow) != 2 or len(fast) != 2 or isinstance(slow[0], str):
        assert fast == slow
        return
    (fc, ft), (sc, st_) = fast, slow
    assert ft == st_
    assert fc.keys() == sc.keys()
    for key in sc:
        if key == "n_events":
            assert fc[key] == sc[key]
        else:
            assert fc[key].dtype == sc[key].dtype, key
            np.testing.assert_array_equal(fc[key], sc[key], err_msg=key, strict=True)
            # -0.0 and 0.0 compare equal: compare the bits too
            assert fc[key].tobytes() == sc[key].tobytes(), key


# the tests that call the scanner itself; without it only test_fast_path_is_built fails
needs_scanner = pytest.mark.skipif(td._tracescan is None, reason="the C scanner was not compiled")


def _scan(text: bytes):
    return td._tracescan.scan(bytes(text), td._CALLS_B, td._DTYPES_B)


def test_fast_path_is_built() -> None:
    assert td._tracescan is not None, (
        "the C fast path (phantora_assets/lib/phantora/_tracescan.c) was not compiled when the package was "
        "installed: install a C compiler and the Python headers, then reinstall"
    )


@needs_scanner
def test_fast_path_takes_every_batch_of_the_writers_traces(tmp_path: Path) -> None:
    p = big_trace(tmp_path, copies=50)
    n = 0
    for _, view, end in tb.iter_batches(p, 4096):
        res = _scan(view[:end])
        assert res is not None
        n += res[0]
    assert n == 500


def test_read_trace_is_the_same_with_and_without_the_fast_path(tmp_path: Path, monkeypatch) -> None:
    p = big_trace(tmp_path, copies=80)
    fast = read_trace(p, chunk_bytes=8192, workers=0, compute_events=True)
    monkeypatch.setattr(td, "_tracescan", None)
    slow = read_trace(p, chunk_bytes=8192, workers=0, compute_events=True)
    pd.testing.assert_frame_equal(fast.flows, slow.flows, check_exact=True)
    pd.testing.assert_frame_equal(fast.compute, slow.compute, check_exact=True)
    pd.testing.assert_frame_equal(fast.compute_events, slow.compute_events, check_exact=True)
    assert fast.n_events == slow.n_events == 800
    # and the values are the writer's: 7 flows per copy, bytes as written
    assert len(fast.flows) == 560
    assert int(fast.flows["bytes"].sum()) == 80 * int(raw_timeline().query("kind == 'communication'")["bytes"].sum())


@needs_scanner
def test_typical_lines_are_taken() -> None:
    text = _batch([json.dumps(BASE_COMM), json.dumps(BASE_COMP), json.dumps(BASE_COMM, indent=1)])
    res = _scan(text)
    assert res is not None
    n, ts = res[0], np.frombuffer(res[1])
    assert n == 3 and ts.tolist() == [20695710.616, 20695710.616]
    assert np.frombuffer(res[5], np.int64).tolist() == [28410992, 28410992]
    assert res[18] == [b"host-1", b"host-7", b"host-6"]
    assert len(res[19]) == 2  # communicators are told apart by their text, as msgspec's path does
    _assert_same(text)


def _variant(change) -> bytes:
    ev = json.loads(json.dumps(BASE_COMM))
    change(ev)
    return _batch([json.dumps(BASE_COMP), json.dumps(ev)])


DECLINED = {
    "escape in a kept string": lambda e: e["args"]["Communication"][0].update(src="host\\u002d1"),
    "non-ASCII name": lambda e: e.update(name="kernel\u00e9"),
    "float count": lambda e: e["args"]["Communication"][1]["NcclAllReduce"].update(count=1.0),
    "int64 overflow": lambda e: e["args"]["Communication"][0].update(bytes=2**63),
    "unknown call": lambda e: e["args"]["Communication"].__setitem__(1, {"NcclAllToAll": {}}),
    "unknown dtype": lambda e: e["args"]["Communication"][1]["NcclAllReduce"].update(dtype="F8"),
    "two calls": lambda e: e["args"]["Communication"][1].update(NcclSend={"count": 1}),
    "missing src": lambda e: e["args"]["Communication"][0].pop("src"),
    "missing cat": lambda e: e.pop("cat"),
    "other cat": lambda e: e.update(cat="Memory"),
    "tuple of 3": lambda e: e["args"]["Communication"].append(None),
    "negative dur": lambda e: e.update(dur=-1.5),
    "bad communicator": lambda e: e["args"]["Communication"][1]["NcclAllReduce"].update(comm={"rank": 0}),
}


@needs_scanner
@pytest.mark.parametrize("case", sorted(DECLINED))
def test_declined_batches_go_to_msgspec(case: str) -> None:
    text = _variant(DECLINED[case])
    if case not in ("negative dur", "bad communicator"):  # those two are refused after the scan
        assert _scan(text) is None
    _assert_same(text)


@needs_scanner
@pytest.mark.parametrize(
    "text",
    [
        b'[{"cat":"Communication","cat":"Computation"}]',  # duplicate field
        b'[{"name":"a","cat":"Computation","ts":1e400,"dur":1,"args":{"Computation":[{"hostname":"host-1"},1,0]}}]',
        b'[{"name":"a","cat":"Computation","ts":01,"dur":1,"args":{"Computation":[{"hostname":"host-1"},1,0]}}]',
        b'[{"name":"a","cat":"Computation","ts":1,"dur":1,"args":{"Computation":[{"hostname":"host-1"},1,[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}]}]',
        b'[{"name":"a","cat":"Computation","ts":1,"dur":1,"args":{"Computation":[{"hostname":"host-1"},1,"\\ud800"]}}]',
        b'[{"name":"a","cat":"Computation","ts":1,"dur":1,"args":{"Computation":[{"hostname":"host-1"},1,0]}},]',
        b"[]",
        # ends right after a field name (the scanner must not read past the end)
        b'[{"args":{"Communication":',
        b'[{"cat":"Computation","args":{"Computation":',
        b'[{"args":{"Communication":[{"id":1,"bytes":1,"src":"a","dst":"b"},{"NcclSend":{"comm":',
        b'[{"name":"a","cat":"Computation","ts":0.'
        + b"0" * 500
        + b'1,"dur":1,"args":{"Computation":[{"hostname":"host-1"},1,0]}}]',
    ],
)
def test_odd_batches_are_declined(text: bytes) -> None:
    assert _scan(text) is None
    _assert_same(text)


@needs_scanner
@pytest.mark.parametrize(
    "number",
    [
        "0",
        "-0",
        "-0.0",
        "1e3",
        "1E+3",
        "12.5e-3",
        "0.30000000000000004",
        "9007199254740993",
        "123456789012345678901234",
        "1e-400",
        "4.9406564584124654e-324",
        "2244.8340000000003",
        "7e22",
        "8e22",
    ],
)
def test_numbers_convert_as_msgspec_does(number: str) -> None:
    line = json.dumps(BASE_COMP).replace('"ts": 746474.068', f'"ts": {number}')
    text = _batch([line, json.dumps(BASE_COMM).replace('"dur": 2244.834', f'"dur": {number}')])
    assert _scan(text) is not None
    _assert_same(text)


@needs_scanner
def test_keys_in_any_order_with_unknown_fields_and_whitespace() -> None:
    comm = {
        "args": {
            "Other": [1, {"x": None}],
            "Communication": [
                {"dst": "host-2", "extra": [True, False, None], "src": "host-3", "bytes": 5, "id": -1},
                {"NcclBcast": {"root": 3, "comm": {"id": [1, 2], "rank": 0}, "dtype": "U8", "count": 5}},
            ],
        },
        "tid": -9223372036854775808,
        "dur": 0,
        "ts": 0,
        "cat": "Communication",
        "name": "bc",
    }
    text = _batch([json.dumps(comm, indent="\t"), json.dumps(BASE_COMP, indent=2)])
    assert _scan(text) is not None
    _assert_same(text)


# ------------------------------------------------------------------------------------- random


_hosts = st.sampled_from(["host-1", "host-2", "host-10", "h\u00e9", "host\\n"])
_ints = st.one_of(st.integers(-5, 5), st.integers(-(2**63), 2**63 - 1), st.integers(2**63, 2**64))
# JSON number texts: integers, Python floats (shortest repr), fixed-point decimals, exponents
_numbers = st.one_of(
    st.integers(-10, 10**18).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    st.decimals(0, 10**9, places=3).map(str),
    st.tuples(st.integers(0, 99999), st.integers(-330, 330)).map(lambda t: f"{t[0]}e{t[1]}"),
)


@st.composite
def _event(draw) -> str:
    """One event's JSON text; ts and dur are number texts put in place of placeholders."""
    if draw(st.booleans()):
        call = draw(st.sampled_from(list(td.CALLS) + ["NcclFoo"]))
        payload = {
            "count": draw(_ints),
            "dtype": draw(st.sampled_from(list(td.DTYPES) + ["X"])),
            "comm": {"rank": draw(st.integers(0, 3)), "id": draw(st.lists(st.integers(0, 255), max_size=4))},
        }
        if draw(st.booleans()):
            payload["root"] = draw(_ints)
        ev = {
            "name": draw(st.sampled_from(["ar", "ag", "k\u00e9"])),
            "cat": "Communication",
            "ts": "@TS@",
            "dur": "@DUR@",
            "tid": draw(_ints),
            "args": {
                "Communication": [
                    {"id": draw(_ints), "bytes": draw(_ints), "src": draw(_hosts), "dst": draw(_hosts)},
                    {call: payload},
                ]
            },
        }
    else:
        ev = {
            "name": "mm",
            "cat": "Computation",
            "ts": "@TS@",
            "dur": "@DUR@",
            "tid": 1,
            "args": {"Computation": [{"hostname": draw(_hosts)}, draw(_ints), {"Torch": {"x": [1.5, None]}}]},
        }
    text = json.dumps(ev, indent=draw(st.sampled_from([None, 1])))
    return text.replace('"@TS@"', draw(_numbers)).replace('"@DUR@"', draw(_numbers))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_event(), min_size=1, max_size=6))
def test_random_events_decode_the_same(lines: list[str]) -> None:
    _assert_same(bytes(_batch(lines)))


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
def test_damaged_batches_decode_the_same(seed: int, n_edits: int) -> None:
    rng = random.Random(seed)
    text = bytearray(
        _batch([json.dumps(BASE_COMM, separators=(",", ":")), json.dumps(BASE_COMP), json.dumps(BASE_COMM, indent=1)])
    )
    alphabet = b'{}[]",:0123456789-+.eE \\ntfunl\x00\x80'
    for _ in range(n_edits):
        i = rng.randrange(1, len(text) - 1)
        op = rng.randrange(3)
        if op == 0:
            del text[i]
        elif op == 1:
            text.insert(i, rng.choice(alphabet))
        else:
            text[i] = rng.choice(alphabet)
    _assert_same(bytes(text))


def test_helper_processes_give_the_same_flows(tmp_path: Path) -> None:
    p = big_trace(tmp_path, copies=200)
    ref = read_trace(p, workers=0)
    got = read_trace(p, chunk_bytes=4096, workers=2)
    pd.testing.assert_frame_equal(got.flows, ref.flows, check_exact=True)
    assert len(got.flows) == 1400


@needs_scanner
def test_fast_path_columns_are_writable_and_the_key_sets_must_be_tuples() -> None:
    cols, _ = _decode(bytes(_batch([json.dumps(BASE_COMM), json.dumps(BASE_COMP)])), True)
    for key in ("ts", "bytes", "comp_ts", "call"):
        assert cols[key].flags.writeable, key
    with pytest.raises(TypeError, match="tuple of bytes"):
        td._tracescan.scan(b"[]", list(td._CALLS_B), td._DTYPES_B)


@needs_scanner
def test_writer_output_scans(tmp_path: Path) -> None:
    p = tmp_path / "t.json"
    write_chrome_trace(raw_timeline(), p)
    text = p.read_bytes()
    res = _scan(text)
    assert res is not None and res[0] == 10
