"""Issue 13 ("correct or loud"), fifth adversarial round: what the previous rounds left open.

Real files on disk (tmp_path), no mocks. Each test failed before its fix (the commit says how)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from fixtures.run_folders import analytic

from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.phantora import trace_decode as td
from phantora_assets.lib.phantora.chrome_trace import read_trace, write_chrome_trace

W4 = "phantora_a100_40g_W4_2x1"

# ---- a key twice in one object of a Phantora trace event -------------------------------------------
# (old, new, the key): each puts a key twice into one object of the first event of its category
TWICE = {
    "dur of a Communication event": ('"ph":"X",', '"ph":"X","dur":0.001,', "dur"),
    "an unread key (ph)": ('"ph":"X",', '"ph":"X","ph":"B",', "ph"),
    "dur spelt with an escape": ('"ph":"X",', '"ph":"X","d\\u0075r":0.001,', "dur"),
    "src of the flow": ('"src":"host-1",', '"src":"host-2","src":"host-1",', "src"),
    "rank of the communicator": ('"comm":{"rank":', '"comm":{"rank":3,"rank":', "rank"),
    "the NCCL call's count": ('"dtype":"Bf16",', '"dtype":"Bf16","count":1,', "count"),
    "hostname (Computation)": ('{"hostname":"host-1",', '{"hostname":"host-2","hostname":"host-1",', "hostname"),
    "a key of the meta (Computation)": ('"stream":{"device":0,', '"stream":{"device":0,"device":1,', "device"),
}


@pytest.fixture(scope="module")
def trace_lines(tmp_path_factory) -> list[str]:
    _, raw, _ = analytic(W4)
    path = tmp_path_factory.mktemp("w4") / "timeline.json"
    write_chrome_trace(raw, path)
    return path.read_text().split("\n")


def _with_key_twice(lines: list[str], case: str, path, one_line: bool = False) -> int:
    """Writes the trace with ``case`` put into one event; returns that event's line (1-based)."""
    old, new, _ = TWICE[case]
    cat = "Computation" if "Computation" in case else "Communication"
    # past the middle: a line of a later batch (chunk_bytes below), not the first one
    k = next(i for i in range(len(lines) // 2, len(lines)) if f'"cat":"{cat}"' in lines[i] and old in lines[i])
    lines = list(lines)
    lines[k] = lines[k].replace(old, new, 1)
    path.write_text(("" if one_line else "\n").join(lines))
    return k + 1


@pytest.mark.parametrize("path_", ["scanner", "msgspec"])
@pytest.mark.parametrize("case", sorted(TWICE))
def test_a_key_twice_in_an_event_is_refused_naming_the_line(trace_lines, tmp_path, monkeypatch, case, path_):
    # was: read with the last value silently on both paths (the scanner declined a known key twice
    # and took an unread key twice; msgspec keeps the last), the run built 'ok'
    if path_ == "msgspec":
        monkeypatch.setattr(td, "_tracescan", None)  # as installed without a C compiler
    path = tmp_path / "timeline.json"
    line = _with_key_twice(trace_lines, case, path)
    with pytest.raises(TraceFormatError) as ei:
        read_trace(path, chunk_bytes=16384, workers=0)
    key = TWICE[case][2]
    assert ei.value.path == str(path) and ei.value.rule == "duplicate key"
    assert ei.value.detail.startswith(f"line {line}: key {key!r} twice in one object of the event")


def test_a_key_twice_is_refused_by_the_helper_processes_and_in_one_line_documents(trace_lines, tmp_path):
    path = tmp_path / "timeline.json"
    line = _with_key_twice(trace_lines, "dur of a Communication event", path)
    with pytest.raises(TraceFormatError) as ei:
        read_trace(path, chunk_bytes=16384, workers=1)
    assert ei.value.rule == "duplicate key" and ei.value.detail.startswith(f"line {line}: key 'dur' twice")
    one = tmp_path / "one_line.json"  # not the visualizer layout: decoded as one document
    _with_key_twice(trace_lines, "a key of the meta (Computation)", one, one_line=True)
    with pytest.raises(TraceFormatError) as ei:
        read_trace(one, workers=0)
    assert ei.value.rule == "duplicate key" and ei.value.detail.startswith("line 1: key 'device' twice")
    assert trace_lines[0] == "[" and trace_lines[-1] == "]"  # the visualizer layout: one event a line


def test_the_same_keys_in_different_objects_are_not_a_key_twice(trace_lines, tmp_path, monkeypatch):
    # "id", "pid", "hostname" and "stream" come in several objects of one event: that is no duplicate
    path = tmp_path / "timeline.json"
    path.write_text("\n".join(trace_lines))
    fast = read_trace(path, chunk_bytes=16384, workers=0)
    monkeypatch.setattr(td, "_tracescan", None)
    slow = read_trace(path, chunk_bytes=16384, workers=0)
    assert fast.n_events == slow.n_events == len(trace_lines) - 2  # every event of the visualizer layout
    assert len(fast.flows) == len(slow.flows) == sum('"cat":"Communication"' in ln for ln in trace_lines) > 0


# ---- host names: one spelling per host ------------------------------------------------------------
@pytest.mark.parametrize("spelling", ["host-01", "host-002", "host-0000000000000000000000001"])
def test_a_zero_padded_host_name_is_refused(trace_lines, tmp_path, spelling):
    # was: host-01 read as host-1 (node 0): a trace with both spellings merged two hosts into one node
    lines = list(trace_lines)
    k = next(i for i in range(len(lines) // 2, len(lines)) if '"dst":"host-2"' in lines[i])
    lines[k] = lines[k].replace('"dst":"host-2"', f'"dst":"{spelling}"', 1)
    path = tmp_path / "timeline.json"
    path.write_text("\n".join(lines))
    with pytest.raises(TraceFormatError) as ei:
        read_trace(path, workers=0)
    assert ei.value.rule == "bad host name"
    assert ei.value.detail == f"{spelling!r} is not of the form host-<k>, k >= 1 written without leading zeros"


def test_the_compute_anatomy_refuses_a_zero_padded_host_name_too():
    from phantora_assets.lib.traffic.anatomy import node_of

    assert node_of("host-1") == 0 and node_of("host-10") == 9 and node_of("host-9223372036854775808") == 2**63 - 1
    for bad in ("host-01", "host-0", "host-", "host-1 "):
        with pytest.raises(ValueError, match="written without leading zeros"):
            node_of(bad)


# ---- Kineto: two NCCL kernels with one correlation id ---------------------------------------------
def _kineto_folder(tmp_path, change) -> None:
    from fixtures.kineto_traces import Coll, rank_trace, write_traces

    traces = {r: rank_trace(r, 2, [Coll("allreduce", 1000, 1000, "Float", (0, 1))], steps=4) for r in range(2)}
    events = traces[0]["traceEvents"]
    k = next(i for i, e in enumerate(events) if e.get("cat") == "kernel" and "nccl" in e["name"].lower())
    change(events, k)
    write_traces(tmp_path, traces, gz=False)


def test_two_nccl_kernels_of_one_correlation_are_refused_naming_it(tmp_path):
    # was: the last one timed the collective, silently (a flow 500 us later than its launch)
    from phantora_assets.lib.kineto.run import convert, read_folder

    def twice(events, k):
        events.append({**events[k], "ts": events[k]["ts"] + 500})

    _kineto_folder(tmp_path, twice)
    events = json.loads((tmp_path / "rank-0.pt.trace.json").read_text())["traceEvents"]
    kernel = next(e for e in events if e.get("cat") == "kernel" and "nccl" in e["name"].lower())
    with pytest.raises(TraceFormatError) as ei:
        convert(read_folder(tmp_path, 1))
    assert ei.value.rule == "ambiguous kernel" and ei.value.path.endswith("rank-0.pt.trace.json")
    corr = kernel["args"]["correlation"]
    assert ei.value.detail.startswith(f"correlation {corr!r} (the launch in record_param_comms at ts ")
    assert f"at ts {float(kernel['ts'])} dur {float(kernel['dur'])} and " in ei.value.detail
    assert ei.value.detail.endswith(f"at ts {float(kernel['ts'] + 500)} dur {float(kernel['dur'])}")


def test_a_kernel_repeated_exactly_is_one_kernel(tmp_path):
    from phantora_assets.lib.kineto.run import convert, read_folder

    ref = tmp_path / "ref"
    ref.mkdir()
    _kineto_folder(ref, lambda events, k: None)
    same = tmp_path / "same"
    same.mkdir()
    _kineto_folder(same, lambda events, k: events.append(dict(events[k])))
    a, b = convert(read_folder(ref, 1)), convert(read_folder(same, 1))
    assert a.n_collectives == b.n_collectives == 8 and a.timed_by_kernel == b.timed_by_kernel == 8
    pd.testing.assert_frame_equal(a.raw, b.raw, check_exact=True)
