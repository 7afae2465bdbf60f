"""Adversarial review of Chakra ET import (issue 15, ``lib/chakra/ingest.py``): folders of ETs a user
could hand in, written with the project's own encoder (``et_io.write_et``, Chakra's ``et_def.proto`` schema).

Each defect was pinned as ``xfail(strict=True)`` (the test body: what should happen) and is fixed; the one
left (a dependency cycle) is still pinned. Every
bad ET should fail with ``TraceFormatError`` naming the file and the rule, never give flows silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_a_collective_without_comm_size_is_refused(tmp_path):
    e = _refused(_folder(tmp_path, {r: [_coll(1, 0)] for r in range(2)}))
    assert (e.rule, Path(e.path).name) == ("invalid ET", "t.0.et") and "node 1" in e.detail and "comm_size" in e.detail


def test_a_negative_comm_size_is_refused(tmp_path):
    e = _refused(_folder(tmp_path, {r: [_coll(1, 0, -100)] for r in range(2)}))
    assert e.rule == "invalid ET" and "-100" in e.detail


def test_a_send_without_comm_dst_is_refused(tmp_path):
    e = _refused(_folder(tmp_path, {0: [EtNode(1, "s", 5, attrs={"comm_size": 10})], 1: []}))
    assert (e.rule, Path(e.path).name) == ("invalid ET", "t.0.et") and "comm_dst missing" in e.detail


def test_a_send_beyond_the_world_is_refused(tmp_path):
    e = _refused(_folder(tmp_path, {0: [EtNode(1, "s", 5, attrs={"comm_size": 10, "comm_dst": 9})], 1: []}))
    assert e.rule == "invalid ET" and "comm_dst 9" in e.detail


def test_comm_groups_with_a_rank_twice_are_refused(tmp_path):
    f = _folder(tmp_path, {r: [_coll(1, 0, 1000, "1")] for r in range(2)}, groups={"1": [0, 1, 1]})
    assert _refused(f).rule == "comm groups"


def test_comm_groups_of_strings_are_refused(tmp_path):
    f = _folder(tmp_path, {r: [_coll(1, 0, 1000, "1")] for r in range(2)}, groups={"1": "01"})
    assert _refused(f).rule == "comm groups"


def test_members_issuing_different_sequences_are_refused(tmp_path):
    f = _folder(tmp_path, {0: [_coll(1, 0, 1000, "1")], 1: [_coll(1, 0, 1000, "1"), _coll(2, 0, 1000, "1")]})
    e = _refused(f)
    assert (e.rule, Path(e.path).name) == ("ranks disagree", "t.1.et") and "t.0.et" in e.detail


def test_members_issuing_different_sizes_are_refused(tmp_path):
    f = _folder(tmp_path, {0: [_coll(1, 0, 1000)], 1: [_coll(1, 0, 1001)]})
    assert _refused(f).rule == "ranks disagree"


def test_a_rank_named_twice_is_refused(tmp_path):
    nodes = {0: [_coll(1, 0, 1000)], 1: [_coll(1, 0, 1000)], 2: [_coll(1, 0, 999_999)]}
    f = _folder(tmp_path, nodes, names={0: "t.0.et", 1: "t.1.et", 2: "t.01.et"})
    with pytest.raises(TraceFormatError) as exc:
        read_folder(f, 1)
    assert exc.value.rule == "ET names" and "t.1.et" in str(exc.value)


@pytest.mark.xfail(
    strict=True,
    reason="ctrl_deps 1 -> 2 -> 1 (a cycle ASTRA-sim never finishes) is accepted; left so on purpose: Chakra's own "
    "converter output (the reference chakra.0.et) has 764 nodes in ctrl_deps cycles, so a refusal would decline it",
)
def test_a_dependency_cycle_is_refused(tmp_path):
    def nodes() -> list[EtNode]:
        k = {"is_cpu_op": False}
        a, b = EtNode(1, "k", 4, ctrl_deps=[2], dur_us=5, attrs=k), EtNode(2, "k", 4, ctrl_deps=[1], dur_us=5, attrs=k)
        return [a, b, _coll(3, 0, 100)]

    _refused(_folder(tmp_path, {r: nodes() for r in range(2)}))


def test_a_broadcast_root_outside_its_group_is_refused(tmp_path):
    assert "comm_src 7" in _refused(_folder(tmp_path, {r: [_coll(1, 5, 100, comm_src=7)] for r in range(2)})).detail
    # root 2 is in the world of 3 but not in group "1" = [0, 1]
    f = _folder(tmp_path, {r: [_coll(1, 5, 100, "1", comm_src=2)] for r in range(2)} | {2: []}, groups={"1": [0, 1]})
    assert _refused(f).rule == "comm groups"


def test_a_string_comm_type_is_refused(tmp_path):
    assert _refused(_folder(tmp_path, {r: [_coll(1, "x", 100)] for r in range(2)})).rule == "invalid ET"
