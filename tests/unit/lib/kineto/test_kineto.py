"""PyTorch profiler (Kineto) traces -> ring flows (lib/kineto/): the real public traces of
../shared/reference/traces/hta/ (MIT; the two small ones copied into tests/data/kineto_hta/), and
small traces written in the same format (tests/fixtures/kineto_traces.py) for every collective and dtype,
with the expected bytes worked out by hand below."""

from __future__ import annotations

import gzip
import json

import pytest
from fixtures.kineto_traces import Coll, rank_trace, write_traces
from fixtures.paths import ROOT

from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.kineto.collectives import DTYPES, flows_of
from phantora_assets.lib.kineto.reader import Collective, KinetoDeclined, read_rank_trace
from phantora_assets.lib.kineto.run import convert, default_run_id, read_folder
from phantora_assets.lib.kineto.step_spans import steps_from_spans
from phantora_assets.lib.phantora.chrome_trace import read_trace
from phantora_assets.lib.phantora.trace_writer import write_chrome_trace
from phantora_assets.lib.traffic import trace_checks

HTA = ROOT.parent / "shared" / "reference" / "traces" / "hta"  # ../shared/reference (not in the repo)
COPIED = ROOT / "tests" / "data" / "kineto_hta"


def _coll(name, in_n, out_n, dtype, group, split=()) -> Collective:
    return Collective(
        name, in_n, out_n, dtype, tuple(group), "pg", tuple(split), tuple(split), 0.0, 1.0, "kernel", 0, 0.0
    )


def _flows(c: Collective, rank: int | None = None) -> list[tuple[int, int, int]]:
    return [(f.src, f.dst, f.bytes) for f in flows_of(c, "t", rank=rank)]


# ---- the real traces ---------------------------------------------------------------------------
REAL = {  # file -> (rule, words of the reason)
    COPIED / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz": ("no message sizes", "gloo:all_reduce x10"),
    COPIED / "distributed_info_unavailable" / "distributed_info_not_found.json.gz": (
        "no distributedInfo",
        "does not say its rank and world size",
    ),
    HTA / "ns_resolution_trace" / "rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz": (
        "world size 1",
        "distributedInfo.world_size = 1: a single-GPU job has no network traffic",
    ),
    HTA / "negative_queue_length_values_check" / "rank0.json.gz": (
        "no message sizes",
        "nccl:all_to_all x55, record_param_comms x150",
    ),
    HTA / "trace_diff" / "test" / "test.json.gz": ("no message sizes", "nccl:all_reduce x18, nccl:all_to_all x42"),
}


@pytest.mark.parametrize("path", list(REAL), ids=lambda p: p.parent.name)
def test_real_traces_that_cannot_give_flows_are_declined_with_the_file_and_reason(path):
    if not path.is_file():
        pytest.skip(
            f"{path.name}: ../shared/reference/traces/hta/ is not here: "
            "facebookresearch/HolisticTraceAnalysis's tests/data/ copied there"
        )
    rule, words = REAL[path]
    with pytest.raises(KinetoDeclined) as err:
        read_folder(path.parent, 1)
    assert err.value.rule == rule and err.value.path == str(path)
    assert str(err.value).startswith(f"{path}: {rule} (") and words in str(err.value)


@pytest.mark.slow
def test_the_real_full_metadata_trace_reads_every_field(tmp_path):
    """The world-size-1 trace with full metadata (record_param_comms with sizes), its world size
    edited to 2 so that it is read rather than declined: the values are the trace's own."""
    src = HTA / "ns_resolution_trace" / "rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"
    if not src.is_file():
        pytest.skip(
            "../shared/reference/traces/hta/ is not here: "
            "facebookresearch/HolisticTraceAnalysis's tests/data/ copied there"
        )
    data = json.loads(gzip.decompress(src.read_bytes()))
    data["distributedInfo"]["world_size"] = 2
    (tmp_path / "rank-0.json").write_text(json.dumps(data))
    rt = read_rank_trace(tmp_path / "rank-0.json")
    assert (rt.rank, rt.world_size, rt.backend, rt.device, rt.pid) == (0, 2, "nccl", "Tesla V100-SXM2-32GB", 1102)
    assert rt.device_bytes == 34079637504 and len(rt.kernels) == 4350 and rt.skipped == {"wait": 10}
    assert [s[0] for s in rt.steps] == [101, 102, 103, 104, 105]
    assert [round(s[2], 3) for s in rt.steps] == [35115.869, 72077.474, 95697.341, 95551.087, 95699.037]
    sizes = sorted({(c.name, c.dtype, c.in_nelems) for c in rt.collectives})
    assert sizes == [
        ("allreduce", "Float", 2049000),
        ("allreduce", "Float", 2431040),
        ("allreduce", "Float", 6563840),
        ("allreduce", "Float", 6637568),
        ("allreduce", "Float", 7875584),
        ("broadcast", "Float", 53120),
        ("broadcast", "Long", 53),
    ]
    assert len(rt.collectives) == 35 and {c.group for c in rt.collectives} == {(0,)}
    assert {c.timed_by for c in rt.collectives} == {"cpu op"}  # NCCL on one rank launches no kernel
    conv = convert(read_folder(tmp_path, 1))
    assert (conv.raw["kind"] == "communication").sum() == 0  # groups of one rank: no flow
    assert "35 on groups of one rank" in " ".join(conv.notes) and "35 of 35 collectives timed by their CPU op" in (
        " ".join(conv.notes)
    )


# ---- the ring rules, by hand -------------------------------------------------------------------
def test_ring_rules_by_hand():
    g4 = (0, 1, 2, 3)
    # all-reduce: S = 1000 x 4 B = 4000; floor(4000 * 2 * 3 / 4) = 6000 per hop, ring 0-1-2-3-0
    assert _flows(_coll("allreduce", 1000, 1000, "Float", g4)) == [
        (0, 1, 6000),
        (1, 2, 6000),
        (2, 3, 6000),
        (3, 0, 6000),
    ]
    # all-reduce: S = 1001 x 2 B = 2002; floor(2002 * 4 / 3) = floor(2669.33) = 2669
    assert _flows(_coll("allreduce", 1001, 1001, "BFloat16", (4, 5, 6))) == [(4, 5, 2669), (5, 6, 2669), (6, 4, 2669)]
    # all-gather: per-rank S = In 250 x 2 B = 500; (4 - 1) * 500 = 1500
    assert {b for *_, b in _flows(_coll("_allgather_base", 250, 1000, "Half", g4))} == {1500}
    # reduce-scatter: per-rank S = Out 250 x 8 B = 2000; 3 * 2000 = 6000
    assert {b for *_, b in _flows(_coll("_reduce_scatter_base", 1000, 250, "Double", g4))} == {6000}
    # broadcast: S = 77 x 8 B = 616 from group rank 0 to every other rank
    assert _flows(_coll("broadcast", 77, 77, "Long", (2, 3, 0, 1))) == [(2, 3, 616), (2, 0, 616), (2, 1, 616)]
    # all-to-all, splits [1, 2, 3, 0] rows of 12 / 6 = 2 Int (8 B): 8, 16, 24, 0 bytes to group ranks 0..3
    a2a = _flows(_coll("alltoall_base", 12, 12, "Int", g4, (1, 2, 3, 0)))
    assert [f for f in a2a if f[0] == 0] == [(0, 1, 16), (0, 2, 24)]  # not to itself, no 0-byte flow
    # untraced rank 3 -> traced rank 0: rank 0's Out split size [1, 2, 3, 0] records 0 rows from rank 3
    assert [f for f in a2a if f[0] == 3] == [(3, 1, 16), (3, 2, 24)]
    # rank 0 sends 16 + 24; rank 1: 16 to 0 (Out split), 24 to 2, 0 to 3; rank 2: 24 to 0, 16 to 1, 0 to 3;
    # rank 3: 0 to 0, 16 to 1, 24 to 2: 40 each
    assert sum(b for *_, b in a2a) == 4 * 40
    # all-to-all without splits: 8 Char / 4 ranks = 2 B to every other rank
    assert {b for *_, b in _flows(_coll("all_to_all", 8, 8, "Char", g4))} == {2}
    # send / recv on a pair: S = 10 x 1 B from the sender, 5 x 1 B to the receiver
    assert _flows(_coll("send", 10, 10, "Byte", (0, 1)), rank=0) == [(0, 1, 10)]
    assert _flows(_coll("recv", 5, 5, "Byte", (0, 1)), rank=0) == [(1, 0, 5)]
    # a group of one rank gives no flow
    assert _flows(_coll("allreduce", 1000, 1000, "Float", (3,))) == []


#: all-reduce of 8 elements on 2 ranks: floor(S * 2 * 1 / 2) = S = 8 x the element size.
BY_DTYPE = {
    "Float": 32, "Double": 64, "Half": 16, "BFloat16": 16, "Byte": 8, "Char": 8, "Bool": 8, "Int": 32, "Long": 64,
    "UInt32": 32, "UInt64": 64, "Short": 16, "UInt16": 16, "Float8_e4m3fn": 8, "Float8_e5m2": 8,
    "Float8_e4m3fnuz": 8, "Float8_e5m2fnuz": 8, "ComplexHalf": 32, "ComplexFloat": 64, "ComplexDouble": 128,
}  # fmt: skip


@pytest.mark.parametrize("dtype", sorted(BY_DTYPE))
def test_every_dtype_by_hand(dtype):
    flows = flows_of(_coll("allreduce", 8, 8, dtype, (0, 1)), "t")
    assert [(f.src, f.dst, f.bytes) for f in flows] == [(0, 1, BY_DTYPE[dtype]), (1, 0, BY_DTYPE[dtype])]
    name = DTYPES[dtype][1]
    # a dtype without a Phantora name is written as U8 with count = bytes (exact)
    assert {(f.count, f.dtype) for f in flows} == ({(8, name)} if name else {(BY_DTYPE[dtype], "U8")})


def test_rules_refuse_what_they_cannot_place():
    with pytest.raises(TraceFormatError, match="unknown dtype"):
        flows_of(_coll("allreduce", 8, 8, "QUInt8", (0, 1)), "f.json")
    with pytest.raises(TraceFormatError, match="no ring rule"):
        flows_of(_coll("gather", 8, 8, "Float", (0, 1)), "f.json")
    with pytest.raises(TraceFormatError, match="all-to-all sizes"):
        flows_of(_coll("all_to_all", 10, 10, "Float", (0, 1, 2, 3)), "f.json")  # 10 does not split in 4
    with pytest.raises(TraceFormatError, match="send/recv peer"):
        flows_of(_coll("send", 8, 8, "Float", (0, 1, 2)), "f.json")


# ---- whole traces in the Kineto format -----------------------------------------------------------
G4 = (0, 1, 2, 3)
EVERY = [
    Coll("allreduce", 1000, 1000, "BFloat16", G4),  # 4 hops x floor(2000*6/4) = 3000
    Coll("_allgather_base", 250, 1000, "Float", G4),  # 4 hops x 3*1000 = 3000
    Coll("reduce_scatter_tensor_coalesced", 1024, 256, "Half", G4),  # 4 hops x 3*512 = 1536
    Coll("broadcast", 100, 100, "Long", G4),  # 3 flows x 800
    Coll("alltoall_base", 400, 400, "Short", G4, in_split=(1, 1, 1, 1)),  # 12 flows x 100*2 = 200
    Coll("allreduce", 8, 8, "Float8_e4m3fn", (0, 1)),  # 2 hops x 8
    Coll("wait", 0, 0, "Float", G4),
    Coll("barrier", 0, 0, "Byte", G4),
]
#: network bytes of one step with rank r on host r // 2 + 1: ring hops 1->2 and 3->0 cross; the
#: broadcast's 0->2, 0->3; 8 of the 12 all-to-all flows; the pair (0, 1) stays on host-1.
STEP_NET = 2 * 3000 + 2 * 3000 + 2 * 1536 + 2 * 800 + 8 * 200


def test_a_trace_of_every_collective_gives_the_hand_bytes_and_passes_the_trace_rules(tmp_path):
    write_traces(tmp_path / "job", {0: rank_trace(0, 4, EVERY, steps=5)})
    run = read_folder(tmp_path / "job", 2)
    conv = convert(run)
    comm = conv.raw[conv.raw["kind"] == "communication"]
    assert comm["bytes"].sum() == 5 * (4 * 3000 + 4 * 3000 + 4 * 1536 + 3 * 800 + 12 * 200 + 2 * 8)
    assert conv.raw["kind"].eq("computation").sum() == 5  # one GEMM per step
    assert sorted(set(comm["call"])) == ["NcclAllGather", "NcclAllReduce", "NcclBcast", "NcclReduceScatter", "NcclSend"]
    write_chrome_trace(conv.raw, tmp_path / "timeline.json.gz")
    flows = read_trace(tmp_path / "timeline.json.gz").flows
    steps = steps_from_spans(flows, conv.step_starts_us, conv.step_last_end_us, source="t")
    assert (
        steps.step_time_us == 10000.0
        and steps.network_bytes_per_step == STEP_NET
        and steps.steady_steps == [1, 2, 3, 4]
    )
    assert all(o.passed for o in trace_checks.run_trace_checks(flows, steps)), trace_checks.run_trace_checks(
        flows, steps
    )
    notes = " ".join(conv.notes)
    assert "1 of 4 ranks' traces (rank 0): the other ranks of each of their 2 process group(s) are assumed" in notes
    assert "not network flows: 5 barrier, 5 wait" in notes and "all 30 collectives timed by their NCCL kernel" in notes


def test_all_ranks_present_are_cross_checked_and_give_each_flow_once(tmp_path):
    colls = [Coll("allreduce", 1000, 1000, "Float", (0, 1)), Coll("send", 10, 10, "Byte", (0, 1))]
    peer = [Coll("allreduce", 1000, 1000, "Float", (0, 1)), Coll("recv", 10, 10, "Byte", (0, 1))]
    write_traces(tmp_path / "one", {0: rank_trace(0, 2, colls)})
    write_traces(tmp_path / "both", {0: rank_trace(0, 2, colls), 1: rank_trace(1, 2, peer)})
    one, both = (convert(read_folder(tmp_path / n, 1)) for n in ("one", "both"))
    comm = both.raw[both.raw["kind"] == "communication"]
    # per step: 2 hops of floor(4000 * 2 / 2) = 4000, and the 10-byte send 0 -> 1 once
    assert comm["bytes"].sum() == 4 * (2 * 4000 + 10) == one.raw["bytes"].sum()
    assert both.raw["kind"].eq("computation").sum() == 8  # both ranks' GEMMs, on their hosts
    assert set(both.raw.loc[both.raw["kind"] == "computation", "src_host"]) == {"host-1", "host-2"}
    assert "all 2 ranks traced" in " ".join(both.notes)
    bad = [Coll("allreduce", 999, 999, "Float", (0, 1)), Coll("recv", 10, 10, "Byte", (0, 1))]
    write_traces(tmp_path / "bad", {0: rank_trace(0, 2, colls), 1: rank_trace(1, 2, bad)})
    with pytest.raises(TraceFormatError, match="ranks disagree") as err:
        convert(read_folder(tmp_path / "bad", 1))
    assert err.value.path.endswith("rank-1.pt.trace.json.gz") and "rank-0.pt.trace.json.gz" in str(err.value)


def test_all_to_all_uses_each_ranks_own_splits(tmp_path):
    g = (0, 1)

    def two(out1):  # rank 0 sends 2 rows x 2 x 4 B = 16 to 1, rank 1 5 rows x 1 x 4 B = 20 to 0
        return {
            0: rank_trace(0, 2, [Coll("alltoall_base", 6, 7, "Float", g, in_split=(1, 2), out_split=(2, 5))]),
            1: rank_trace(1, 2, [Coll("alltoall_base", 6, 5, "Float", g, in_split=(5, 1), out_split=out1)]),
        }

    write_traces(tmp_path / "a2a", two((4, 1)))  # rank 1 receives 4 rows x 1 x 4 B = 16 from 0: agrees
    raw = convert(read_folder(tmp_path / "a2a", 1)).raw
    step = raw[(raw["kind"] == "communication") & (raw["start_ns"] < 10_000_000)]
    assert sorted(zip(step["src_host"], step["dst_host"], step["bytes"], strict=True)) == [
        ("host-1", "host-2", 16),
        ("host-2", "host-1", 20),
    ]
    write_traces(tmp_path / "bad", two((3, 2)))  # 3 rows: 12 bytes from rank 0, which sends 16
    with pytest.raises(TraceFormatError, match="rank 0 sends 16 bytes to rank 1, which receives 12 from it"):
        convert(read_folder(tmp_path / "bad", 1))


def test_cpu_timing_fallback_and_no_markers_are_said(tmp_path):
    colls = [Coll("allreduce", 1000, 1000, "Float", (0, 1)), Coll("allreduce", 10, 10, "Float", (0, 1), kernel=False)]
    write_traces(tmp_path / "j", {0: rank_trace(0, 2, colls, markers=False)})
    conv = convert(read_folder(tmp_path / "j", 1))
    assert conv.step_starts_us == [] and conv.timed_by_cpu == 4 and conv.timed_by_kernel == 4
    notes = " ".join(conv.notes)
    assert "4 of 8 collectives timed by their CPU op" in notes and "steps by the communicator rule" in notes
    comm = conv.raw[(conv.raw["kind"] == "communication") & (conv.raw["count"] == 10)]
    assert set(comm["end_ns"] - comm["start_ns"]) == {50_000}  # the CPU op's 50 us


def test_folder_rules(tmp_path):
    pair = [Coll("allreduce", 1000, 1000, "BFloat16", (0, 1))]  # a group inside a world of 2 or 3
    write_traces(tmp_path / "odd", {0: rank_trace(0, 3, pair)})
    with pytest.raises(TraceFormatError, match="does not divide the world size 3"):
        read_folder(tmp_path / "odd", 2)
    write_traces(tmp_path / "twice", {0: rank_trace(0, 2, pair)})
    (tmp_path / "twice" / "copy.json").write_text(json.dumps(rank_trace(0, 2, pair)))
    with pytest.raises(TraceFormatError, match="rank 0 again"):
        read_folder(tmp_path / "twice", 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFormatError, match="no trace"):
        read_folder(tmp_path / "empty", 1)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "r.json").write_text("{ not json")
    with pytest.raises(TraceFormatError, match="invalid trace"):
        read_folder(tmp_path / "broken", 1)
    assert default_run_id(tmp_path / "My-Trace.v2", 2, 1) == "my_trace_v2_2x1"


def test_streamed_decode_equals_the_whole_document(tmp_path, monkeypatch):
    """The profiler's layout is decoded in batches (lib/kineto/stream.py); any other layout as one
    document; both give the same trace."""
    from phantora_assets.lib.kineto import stream

    write_traces(tmp_path / "laid_out", {0: rank_trace(0, 4, EVERY, steps=5)})
    write_traces(tmp_path / "one_line", {0: rank_trace(0, 4, EVERY, steps=5)}, one_line=True)
    monkeypatch.setattr(stream, "CHUNK", 4096)  # many batches
    batches: list[int] = []
    meta, n = stream.decode(
        tmp_path / "laid_out" / "rank-0.pt.trace.json.gz", list, lambda s, ev: (s.append(len(ev)), batches.append(1))
    )
    # per step: the marker, a GEMM, and per collective its op, launch and kernel: 5 x (2 + 8 x 3)
    assert len(batches) > 5 and sum(n) == len(rank_trace(0, 4, EVERY, steps=5)["traceEvents"]) == 130
    assert meta.distributedInfo is not None and meta.distributedInfo["world_size"] == 4 and meta.traceEvents == []
    a, b = (read_rank_trace(tmp_path / d / "rank-0.pt.trace.json.gz") for d in ("laid_out", "one_line"))
    assert a.collectives == b.collectives and a.kernels == b.kernels and a.steps == b.steps and len(a.collectives) == 30
    real = HTA / "trace_diff" / "test" / "test.json.gz"
    if real.is_file():  # a real trace streams in batches too, every event seen once
        _, sizes = stream.decode(real, list, lambda s, ev: s.append(len(ev)))
        assert len(sizes) > 1 and sum(sizes) == 105167


def test_trace_too_large_and_truncated_gzip_name_the_file(tmp_path, monkeypatch):
    from phantora_assets.lib.kineto import stream

    write_traces(tmp_path / "j", {0: rank_trace(0, 2, EVERY[:1])})
    path = tmp_path / "j" / "rank-0.pt.trace.json.gz"
    monkeypatch.setattr(stream, "MAX_INFLATED_BYTES", 1000)
    with pytest.raises(TraceFormatError, match="trace too large") as err:
        read_rank_trace(path)
    assert err.value.path == str(path)
    monkeypatch.undo()
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(TraceFormatError, match="invalid trace"):
        read_rank_trace(path)


def test_kernels_carrying_the_sizes_stand_for_missing_cpu_ops(tmp_path):
    """A trace of GPU activity only (the NCCL/RCCL kernels carry Collective name, sizes, and the
    group as a list): the same flows as with the CPU ops, timed by the kernels."""
    write_traces(tmp_path / "cpu", {0: rank_trace(0, 4, EVERY, steps=5)})
    write_traces(tmp_path / "gpu", {0: rank_trace(0, 4, EVERY, steps=5, gpu_only=True)})
    a, b = (convert(read_folder(tmp_path / d, 2)) for d in ("cpu", "gpu"))
    cols = ["src_host", "dst_host", "bytes", "call", "count", "dtype", "start_ns", "end_ns"]
    comm = [c.raw.loc[c.raw["kind"] == "communication", cols].reset_index(drop=True) for c in (a, b)]
    assert len(comm[0]) == 5 * (4 + 4 + 4 + 3 + 12 + 2) and comm[0].equals(comm[1])
    assert b.timed_by_kernel == 30 and "not network flows: 5 barrier, 5 wait" in " ".join(b.notes)
