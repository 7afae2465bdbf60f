"""Adversarial review of the profiled-trace sources (issue 15): PyTorch profiler (Kineto) folders
and Chakra ET folders as a user with real, messy traces would hand them in.

Each defect found is pinned as ``xfail(strict=True)`` with what happens and what should; the
passing tests pin byte rules checked by hand (``docs/PHANTORA_FORMATS.md`` section 4)."""

from __future__ import annotations

import gzip
import json
import tracemalloc
from pathlib import Path

import pytest
from fixtures.kineto_traces import Coll, rank_trace, write_traces

from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.kineto.run import convert, read_folder
from phantora_assets.lib.phantora import trace_batches


def _comm(folder: Path, gpn: int = 1, **kw) -> list[tuple[str, str, int]]:
    """(src host, dst host, bytes) of every communication row of the folder's raw timeline."""
    raw = convert(read_folder(folder, gpn, **kw)).raw
    c = raw[raw["kind"] == "communication"]
    return [(str(s), str(d), int(b)) for s, d, b in zip(c["src_host"], c["dst_host"], c["bytes"])]


# ---- Kineto: byte rules by hand (pass) ----------------------------------------------------------
@pytest.mark.parametrize(
    ("coll", "hops"),
    [
        # all-reduce, n = 3, BFloat16: S = 1001 * 2 = 2002, hop floor(2002 * 4 / 3) = 2669
        (Coll("allreduce", 1001, 1001, "BFloat16", (0, 1, 2)), {("host-1", "host-2", 2669), ("host-2", "host-3", 2669),
                                                                 ("host-3", "host-1", 2669)}),
        # all-gather, per-rank S = 7 * 4 = 28, hop (3 - 1) * 28 = 56
        (Coll("_allgather_base", 7, 21, "Float", (0, 1, 2)), {("host-1", "host-2", 56), ("host-2", "host-3", 56),
                                                               ("host-3", "host-1", 56)}),
        # reduce-scatter, per-rank S = Out 7 * 4 = 28, hop 56
        (Coll("_reduce_scatter_base", 21, 7, "Float", (0, 1, 2)), {("host-1", "host-2", 56), ("host-2", "host-3", 56),
                                                                    ("host-3", "host-1", 56)}),
        # broadcast, S = 5 * 8 = 40 from group rank 0 to each other rank
        (Coll("broadcast", 5, 5, "Double", (0, 1, 2)), {("host-1", "host-2", 40), ("host-1", "host-3", 40)}),
        # send on a group of two: S = 9 * 2 = 18
        (Coll("send", 9, 9, "Half", (0, 1)), {("host-1", "host-2", 18)}),
        # Float8: 1 byte, written as U8 bytes; all-reduce n = 2: hop floor(64 * 2 / 2) = 64
        (Coll("allreduce", 64, 64, "Float8_e4m3fn", (0, 1)), {("host-1", "host-2", 64), ("host-2", "host-1", 64)}),
        # ComplexFloat: 8 bytes; all-gather n = 2: hop 1 * 3 * 8 = 24
        (Coll("allgather", 3, 6, "ComplexFloat", (0, 1)), {("host-1", "host-2", 24), ("host-2", "host-1", 24)}),
    ],
)  # fmt: skip
def test_ring_bytes_by_hand(tmp_path, coll, hops):
    world = max(coll.group) + 1
    write_traces(tmp_path, {0: rank_trace(0, max(world, 3), [coll], steps=2)})
    assert set(_comm(tmp_path)) == hops


def test_a_group_inside_one_host_is_loopback_only(tmp_path):
    write_traces(tmp_path, {0: rank_trace(0, 2, [Coll("allreduce", 1000, 1000, "Float", (0, 1))], steps=2)})
    assert {(s == d) for s, d, _ in _comm(tmp_path, gpn=2)} == {True}


# ---- Kineto: defects ----------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["pg_config", "start/stride"])
def test_a_group_of_more_than_30_ranks_as_pytorch_writes_it_imports(tmp_path, source):
    # PyTorch writes Process Group Ranks of > 30 ranks as "[0, 1, ..., 29, ...]": the ranks come from
    # distributedInfo.pg_config (by Process Group Name) or Global rank start / stride
    group = tuple(range(32))
    trunc = '"[' + ", ".join(map(str, range(30))) + ', ...]"'
    c = Coll("allreduce", 1024, 1024, "Float", group,
             extra={"Process Group Ranks": "@RANKS@", "Global rank start": 0, "Global rank stride": 1})  # fmt: skip
    t = rank_trace(0, 32, [c], steps=2)
    if source == "start/stride":
        t["distributedInfo"]["pg_config"] = []
    else:
        t["traceEvents"] = [
            {**e, "args": {k: v for k, v in e["args"].items() if "Global" not in k}} for e in t["traceEvents"]
        ]
    text = json.dumps(t).replace('"@RANKS@"', json.dumps(json.loads(trunc)))
    (tmp_path / "rank-0.json").write_text(text)
    hops = _comm(tmp_path, gpn=8)
    assert len(hops) == 2 * 32  # two steps, one hop per group rank
    assert {b for *_, b in hops} == {4096 * 2 * 31 // 32}  # S = 1024 * 4, floor(S * 2 * 31 / 32) = 7936


def test_a_truncated_group_without_other_source_is_refused(tmp_path):
    c = Coll("allreduce", 1024, 1024, "Float", tuple(range(32)),
             extra={"Process Group Ranks": "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, "
                    "20, 21, 22, 23, 24, 25, 26, 27, 28, 29, ...]"})  # fmt: skip
    t = rank_trace(0, 32, [c], steps=2)
    t["distributedInfo"]["pg_config"] = []
    write_traces(tmp_path, {0: t})
    with pytest.raises(TraceFormatError, match="Process Group Ranks truncated") as exc:
        _comm(tmp_path)
    assert exc.value.rule == "invalid trace" and "rank-0.pt.trace.json.gz" in exc.value.path


def test_a_group_without_stride_nor_ranks_is_not_guessed(tmp_path):
    # the group [0, 1, 3] (no stride, no ranks); pg_config's group "0" has 4 ranks, not Group size 3
    c = Coll("allreduce", 100, 100, "Float", (0, 1, 3), extra={"Process Group Ranks": None, "Global rank start": 0})
    write_traces(tmp_path, {0: rank_trace(0, 4, [c], steps=2)})
    with pytest.raises(TraceFormatError, match="a stride is not guessed") as exc:
        _comm(tmp_path)
    assert exc.value.rule == "invalid trace"


def test_a_present_member_missing_from_a_group_sequence_is_refused(tmp_path):
    # rank 1 names the group "7", rank 0 names it "0": under key "0:0,1" traced rank 1 issues nothing,
    # so each hop would be given twice (once per key); refused, naming rank 1's file
    c = Coll("allreduce", 10, 10, "Float", (0, 1))
    write_traces(tmp_path, {0: rank_trace(0, 2, [c], steps=2), 1: rank_trace(1, 2, [c], steps=2, pg_name="7")})
    with pytest.raises(TraceFormatError) as exc:
        _comm(tmp_path)
    assert exc.value.rule == "ranks disagree"
    assert "rank-1.pt.trace.json.gz" in exc.value.path


def test_all_to_all_inbound_bytes_follow_the_traced_ranks_out_split(tmp_path):
    # rank 0 sends 1 row (4 B) to rank 1 and receives 3 rows (12 B) from it (Out split size [1, 3])
    c = Coll("all_to_all", 2, 4, "Float", (0, 1), in_split=(1, 1), out_split=(1, 3))
    write_traces(tmp_path, {0: rank_trace(0, 2, [c], steps=1)})
    assert sorted(_comm(tmp_path)) == [("host-1", "host-2", 4), ("host-2", "host-1", 12)]


def _bad_trace_raises_named(path: Path) -> None:
    with pytest.raises(TraceFormatError) as exc:
        read_folder(path.parent, 1)
    assert exc.value.rule == "invalid trace" and exc.value.path == str(path)


def test_a_size_beyond_int64_bytes_names_the_file(tmp_path):
    write_traces(tmp_path, {0: rank_trace(0, 2, [Coll("allreduce", 2**62, 2**62, "Float", (0, 1))], steps=2)}, gz=False)
    with pytest.raises(TraceFormatError, match="beyond int64") as exc:
        convert(read_folder(tmp_path, 1))
    assert exc.value.rule == "invalid trace" and "rank-0.pt.trace.json" in exc.value.path


def test_deeply_nested_json_names_the_file(tmp_path):
    p = tmp_path / "rank-0.json"
    p.write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    _bad_trace_raises_named(p)


def test_a_non_numeric_ts_names_the_file(tmp_path):
    t = rank_trace(0, 2, [Coll("allreduce", 10, 10, "Float", (0, 1))], steps=2)
    t["traceEvents"][0]["ts"] = "abc"
    p = tmp_path / "rank-0.json"
    p.write_text(json.dumps(t))
    _bad_trace_raises_named(p)


def test_a_whitespace_gzip_bomb_is_read_in_bounded_memory(tmp_path, monkeypatch):
    # a text not in the profiler's layout is decoded whole, so it is capped by MAX_LINE_BYTES (as a
    # one-line Phantora trace is; $PHANTORA_ASSETS_MAX_TRACE_LINE_MIB): here 16 MiB, for 96 MiB of whitespace
    monkeypatch.setattr(trace_batches, "MAX_LINE_BYTES", 16 << 20)
    p = tmp_path / "rank-0.json.gz"
    with gzip.open(p, "wb", compresslevel=1) as f:
        f.write(b"{")
        for _ in range(96):
            f.write(b" " * (1 << 20))
        f.write(b"}")
    tracemalloc.start()
    try:
        with pytest.raises(TraceFormatError) as exc:
            read_folder(tmp_path, 1, world_size=2, rank=0)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert (exc.value.rule, exc.value.path) == ("trace too large", str(p))
    assert "MAX_LINE_BYTES" in exc.value.detail
    assert peak < 48 << 20, f"peak {peak >> 20} MiB for 96 MiB of whitespace"
