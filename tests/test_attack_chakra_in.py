"""Adversarial review of Chakra ET import (issue 15, ``lib/chakra/ingest.py``): folders of ETs a user
could hand in, written with the project's own encoder (``et_io.write_et``, mlc-chakra's schema).

Each defect is pinned as ``xfail(strict=True)``: what happens, and (the test body) what should. Every
bad ET should fail with ``TraceFormatError`` naming the file and the rule, never give flows silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("chakra.schema.protobuf.et_def_pb2")

from phantora_assets.lib.chakra.et_io import EtNode, write_et
from phantora_assets.lib.chakra.ingest import raw_timeline, read_folder
from phantora_assets.lib.errors import TraceFormatError


def _folder(tmp: Path, nodes: dict[int, list[EtNode]], groups=None, names: dict[int, str] | None = None) -> Path:
    for r, ns in nodes.items():
        write_et(tmp / (names or {}).get(r, f"t.{r}.et"), {"rank": r}, ns)
    if groups is not None:
        (tmp / "t.comm_groups.json").write_text(json.dumps(groups))
    return tmp


def _coll(i: int, ctype, size=None, pg: str | None = None, **kw) -> EtNode:
    a = {"is_cpu_op": False, "comm_type": ctype, **kw}
    if size is not None:
        a["comm_size"] = size
    if pg is not None:
        a["pg_name"] = pg
    return EtNode(i, "c", 7, start_us=10 * i, dur_us=5, attrs=a)


def _hops(folder: Path, gpn: int = 1) -> list[tuple[str, str, int]]:
    raw, _ = raw_timeline(read_folder(folder, gpn))
    c = raw[raw["kind"] == "communication"]
    return [(str(s), str(d), int(b)) for s, d, b in zip(c["src_host"], c["dst_host"], c["bytes"])]


def _refused(folder: Path) -> TraceFormatError:
    with pytest.raises(TraceFormatError) as exc:
        _hops(folder)
    return exc.value


def test_all_reduce_of_two_ranks_by_hand(tmp_path):
    # comm_size S = 1000, n = 2: each rank's hop floor(1000 * 2 * 1 / 2) = 1000
    f = _folder(tmp_path, {r: [_coll(1, 0, 1000)] for r in range(2)})
    assert sorted(_hops(f)) == [("host-1", "host-2", 1000), ("host-2", "host-1", 1000)]


def test_an_unknown_comm_type_is_refused(tmp_path):
    assert _refused(_folder(tmp_path, {r: [_coll(1, 42, 100)] for r in range(2)})).rule == "no ring rule"


@pytest.mark.xfail(
    strict=True, reason="a collective without comm_size is counted and gives no flow (0 bytes), silently"
)
def test_a_collective_without_comm_size_is_refused(tmp_path):
    _refused(_folder(tmp_path, {r: [_coll(1, 0)] for r in range(2)}))


@pytest.mark.xfail(strict=True, reason="comm_size -100 is dropped as a 0-byte flow, silently")
def test_a_negative_comm_size_is_refused(tmp_path):
    _refused(_folder(tmp_path, {r: [_coll(1, 0, -100)] for r in range(2)}))


@pytest.mark.xfail(strict=True, raises=KeyError, reason="COMM_SEND_NODE without comm_dst: bare KeyError, no file")
def test_a_send_without_comm_dst_is_refused(tmp_path):
    _refused(_folder(tmp_path, {0: [EtNode(1, "s", 5, attrs={"comm_size": 10})], 1: []}))


@pytest.mark.xfail(strict=True, reason="a send to rank 9 of a 2-rank job gives a flow to host-10, silently")
def test_a_send_beyond_the_world_is_refused(tmp_path):
    _refused(_folder(tmp_path, {0: [EtNode(1, "s", 5, attrs={"comm_size": 10, "comm_dst": 9})], 1: []}))


@pytest.mark.xfail(strict=True, reason="comm_groups.json names ranks 2, 3 of a 2-rank folder: the ring is built with "
                   "n = 4 (hop 1500 B instead of 1000) and a hop to host-3, silently")  # fmt: skip
def test_comm_groups_beyond_the_world_are_refused(tmp_path):
    f = _folder(tmp_path, {r: [_coll(1, 0, 1000, "1")] for r in range(2)}, groups={"1": [0, 1, 2, 3]})
    assert _refused(f).rule == "comm groups"


@pytest.mark.xfail(strict=True, reason="a group listing rank 1 twice gives a self-hop and n = 3, silently")
def test_comm_groups_with_a_rank_twice_are_refused(tmp_path):
    f = _folder(tmp_path, {r: [_coll(1, 0, 1000, "1")] for r in range(2)}, groups={"1": [0, 1, 1]})
    assert _refused(f).rule == "comm groups"


@pytest.mark.xfail(strict=True, reason='comm_groups.json {"1": "01"} is read as ranks [0, 1]')
def test_comm_groups_of_strings_are_refused(tmp_path):
    f = _folder(tmp_path, {r: [_coll(1, 0, 1000, "1")] for r in range(2)}, groups={"1": "01"})
    assert _refused(f).rule == "comm groups"


@pytest.mark.xfail(
    strict=True, reason="rank 1 issues two all-reduces on group 1, rank 0 one: no cross-check, a half ring"
)
def test_members_issuing_different_sequences_are_refused(tmp_path):
    f = _folder(tmp_path, {0: [_coll(1, 0, 1000, "1")], 1: [_coll(1, 0, 1000, "1"), _coll(2, 0, 1000, "1")]})
    _refused(f)


@pytest.mark.xfail(strict=True, reason="t.1.et and t.01.et are both rank 1: one is dropped silently "
                   "(et_files' docstring promises 'ET names' for a rank twice)")  # fmt: skip
def test_a_rank_named_twice_is_refused(tmp_path):
    nodes = {0: [_coll(1, 0, 1000)], 1: [_coll(1, 0, 1000)], 2: [_coll(1, 0, 999_999)]}
    f = _folder(tmp_path, nodes, names={0: "t.0.et", 1: "t.1.et", 2: "t.01.et"})
    with pytest.raises(TraceFormatError):
        read_folder(f, 1)


@pytest.mark.xfail(strict=True, reason="ctrl_deps 1 -> 2 -> 1 (a cycle ASTRA-sim never finishes) is accepted")
def test_a_dependency_cycle_is_refused(tmp_path):
    def nodes() -> list[EtNode]:
        k = {"is_cpu_op": False}
        a, b = EtNode(1, "k", 4, ctrl_deps=[2], dur_us=5, attrs=k), EtNode(2, "k", 4, ctrl_deps=[1], dur_us=5, attrs=k)
        return [a, b, _coll(3, 0, 100)]

    _refused(_folder(tmp_path, {r: nodes() for r in range(2)}))


@pytest.mark.xfail(
    strict=True, reason="a broadcast from comm_src 7, not in its group: no rank sends, 0 flows, silently"
)
def test_a_broadcast_root_outside_its_group_is_refused(tmp_path):
    _refused(_folder(tmp_path, {r: [_coll(1, 5, 100, comm_src=7)] for r in range(2)}))


@pytest.mark.xfail(strict=True, raises=ValueError, reason="comm_type given as a string: bare ValueError from int()")
def test_a_string_comm_type_is_refused(tmp_path):
    _refused(_folder(tmp_path, {r: [_coll(1, "x", 100)] for r in range(2)}))
