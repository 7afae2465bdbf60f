"""Phantora's ring rule (ring.py): table tests and properties."""

from __future__ import annotations

import pytest

from phantora_assets.lib.traffic.ring import (
    CALL_TO_OP,
    DTYPE_BYTES,
    OP_TO_CALL,
    group_sizes_for,
    hop_bytes,
    network_bytes_of,
    ring_flows,
)

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv"]


@pytest.mark.parametrize(
    "op,count,db,n,expected",
    [
        ("all_reduce", 4_194_304, 2, 2, 8_388_608),  # S = 8 MiB, n=2: S
        ("all_reduce", 4_194_304, 2, 4, 12_582_912),  # 2S * 3/4
        ("all_reduce", 1, 4, 4, 6),  # floor(8 * 3 / 4)
        ("all_reduce", 1, 4, 3, 5),  # floor(8 * 2 / 3)
        ("all_reduce", 7, 1, 3, 9),  # floor(14 * 2 / 3) = floor(9.33)
        ("all_reduce", 100, 2, 1, 0),  # one rank: no traffic
        ("all_gather", 1000, 2, 4, 6000),  # (n-1) * S
        ("reduce_scatter", 1000, 4, 8, 28000),
        ("all_gather", 1000, 2, 1, 0),
        ("broadcast", 1000, 2, 8, 2000),
        ("send", 512, 2, 2, 1024),
        ("recv", 512, 8, 7, 4096),
    ],
)
def test_hop_bytes_table(op, count, db, n, expected):
    assert hop_bytes(op, count, db, n) == expected


def test_hop_bytes_rejects_bad_input():
    with pytest.raises(ValueError):
        hop_bytes("all_reduce", 1, 2, 0)
    with pytest.raises(ValueError):
        hop_bytes("all_to_all", 1, 2, 2)


def test_tables():
    assert DTYPE_BYTES == {
        "I8": 1,
        "U8": 1,
        "I32": 4,
        "U32": 4,
        "I64": 8,
        "U64": 8,
        "F16": 2,
        "F32": 4,
        "F64": 8,
        "Bf16": 2,
    }
    assert set(CALL_TO_OP.values()) == set(OPS)
    assert all(OP_TO_CALL[op] == call for call, op in CALL_TO_OP.items())


def test_ring_flows_table():
    assert ring_flows("all_reduce", 4, 2, 4) == [(0, 1, 12), (1, 2, 12), (2, 3, 12), (3, 0, 12)]
    assert ring_flows("broadcast", 10, 1, 3, root=1) == [(1, 0, 10), (1, 2, 10)]
    assert ring_flows("all_gather", 10, 1, 1) == []
    with pytest.raises(ValueError):
        ring_flows("send", 10, 1, 2)
    # ranks 0,1 on host 0 and 2,3 on host 1: hops 1->2 and 3->0 cross the network
    assert network_bytes_of(ring_flows("all_reduce", 4, 2, 4), [0, 0, 1, 1]) == 24


def test_group_sizes_table():
    assert group_sizes_for("all_reduce", 4_194_304, 2, 12_582_912) == [4]
    assert group_sizes_for("all_gather", 1000, 2, 6000) == [4]
    assert group_sizes_for("all_gather", 1000, 2, 6001) == []
    assert group_sizes_for("all_reduce", 1000, 2, 1999) == []  # below S
    assert group_sizes_for("all_reduce", 1000, 2, 4000) == []  # >= 2S
    assert group_sizes_for("broadcast", 1000, 2, 2000) == [0]
    assert group_sizes_for("send", 1000, 2, 1999) == []
    assert group_sizes_for("all_reduce", 0, 2, 0) == [0]
    # tiny all-reduces: many n give the same floor (the bug fixed in ring.py: the old
    # search looked only near the real root, returning [6, 7, 8, 9] here)
    assert group_sizes_for("all_reduce", 3, 1, 5, max_n=20) == list(range(6, 21))
    assert group_sizes_for("all_reduce", 1, 4, 6, max_n=20) == [4, 5, 6, 7]
