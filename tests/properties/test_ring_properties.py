"""Properties of Phantora's ring rule (lib/traffic/ring.py): group sizes invert the hop bytes, point-to-
point sizes, the flows of a ring."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from phantora_assets.lib.traffic.ring import (
    DTYPE_BYTES,
    RING_OPS,
    group_sizes_for,
    hop_bytes,
    network_bytes_of,
    ring_flows,
)


@settings(max_examples=400, deadline=None)
@given(
    op=st.sampled_from(RING_OPS),
    count=st.integers(1, 2**34),
    dtype=st.sampled_from(sorted(DTYPE_BYTES)),
    n=st.integers(2, 4096),
)
def test_group_sizes_inverts_hop_bytes(op, count, dtype, n):
    db = DTYPE_BYTES[dtype]
    b = hop_bytes(op, count, db, n)
    cands = group_sizes_for(op, count, db, b)
    assert n in cands
    assert cands == sorted(set(cands)) and all(2 <= m <= 4096 for m in cands)
    for m in cands[:50] + cands[-50:]:  # sound: every candidate gives the bytes
        assert hop_bytes(op, count, db, m) == b


@settings(max_examples=300, deadline=None)
@given(
    op=st.sampled_from(RING_OPS),
    count=st.integers(1, 40),
    db=st.sampled_from([1, 2, 4, 8]),
    b=st.integers(0, 700),
    max_n=st.integers(2, 300),
)
def test_group_sizes_complete_small(op, count, db, b, max_n):
    expected = [n for n in range(2, max_n + 1) if hop_bytes(op, count, db, n) == b]
    assert group_sizes_for(op, count, db, b, max_n=max_n) == expected


@settings(max_examples=100, deadline=None)
@given(
    op=st.sampled_from(["broadcast", "send", "recv"]),
    count=st.integers(0, 2**30),
    db=st.sampled_from([1, 2, 4, 8]),
    delta=st.integers(-3, 3),
)
def test_point_to_point_sizes(op, count, db, delta):
    b = count * db + delta
    assert group_sizes_for(op, count, db, b) == ([0] if delta == 0 else [])


@settings(max_examples=100, deadline=None)
@given(
    op=st.sampled_from(RING_OPS + ("broadcast",)),
    count=st.integers(0, 10**6),
    db=st.sampled_from([1, 2, 4, 8]),
    n=st.integers(1, 64),
    data=st.data(),
)
def test_ring_flows_properties(op, count, db, n, data):
    root = data.draw(st.integers(0, max(0, n - 1)))
    flows = ring_flows(op, count, db, n, root=root)
    if n == 1:
        assert flows == []
        return
    b = hop_bytes(op, count, db, n)
    assert all(x == b for _, _, x in flows)
    if op == "broadcast":
        assert sorted(d for _, d, _ in flows) == [r for r in range(n) if r != root]
        assert all(s == root for s, _, _ in flows)
    else:
        assert flows == [(i, (i + 1) % n, b) for i in range(n)]
    # all ranks on one host: no network bytes; each rank on its own host: all of them
    assert network_bytes_of(flows, [0] * n) == 0
    assert network_bytes_of(flows, list(range(n))) == b * len(flows)
