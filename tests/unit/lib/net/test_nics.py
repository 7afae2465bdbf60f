"""The NIC of every flow's sender and receiver (lib/net/nics.py): each rule on a hand-made trace, and the
refusals (a rank on two GPUs, a receiver no rule determines)."""

from __future__ import annotations

import pandas as pd
import pytest

from phantora_assets.lib.net import nics


def _flows(rows: list[tuple]) -> pd.DataFrame:
    """(flow_id, ts_us, src_node, dst_node, op, comm_id, comm_rank, device) rows."""
    return pd.DataFrame(
        {
            "flow_id": [r[0] for r in rows],
            "ts_us": [float(r[1]) for r in rows],
            "src_node": [r[2] for r in rows],
            "dst_node": [r[3] for r in rows],
            "op": [r[4] for r in rows],
            "comm_id": [r[5] for r in rows],
            "comm_rank": [r[6] for r in rows],
            "stream": [(r[7] << 32) | 7 for r in rows],
        }
    )


def test_ring_successor_with_a_member_that_sends_only_inside_its_host():
    # an 8-rank ring on 2 hosts x 4 GPUs: network hops 3 -> 4 and 7 -> 0; ranks 1, 2, 4, 5, 6 send on loopback
    ring = [(i, 0.0, i // 4, ((i + 1) % 8) // 4, "all_reduce", "c", i, i % 4) for i in range(8)]
    flows = _flows(ring)
    net = flows[flows["src_node"] != flows["dst_node"]]
    src, dst = nics.flow_nics(net, 4, 4, nics.members(flows))
    assert src.tolist() == [3, 3] and dst.tolist() == [0, 0]  # GPU 3 sends, GPU 0 of the other host receives
    # the network flows alone miss ranks 4 and 0 (they send only inside their host): refused, never guessed
    with pytest.raises(ValueError, match="comm_members.parquet"):
        nics.flow_nics(net, 4, 4)
    # a member missing from the table: its ring hop has no receiver
    with pytest.raises(ValueError, match="flow 3 of communicator c to host-2: its receiving GPU is not determined"):
        nics.flow_nics(net, 4, 4, nics.members(flows[flows["comm_rank"] != 4]))


def test_only_member_on_the_destination_host_and_grouped_sends_in_rank_order():
    rows = [
        (1, 0, 0, 1, "send", "pp", 0, 2),  # rank 0 (host-1 GPU 2) -> the only member on host-2
        (2, 5, 1, 0, "send", "pp", 1, 2),
        # an all-to-all from rank 0 of "ep" (host-1 GPU 0) to host-2's two members at one instant
        (3, 9, 0, 1, "send", "ep", 0, 0),
        (4, 9, 0, 1, "send", "ep", 0, 0),
        (5, 9, 1, 0, "send", "ep", 2, 1),
        (6, 9, 1, 0, "send", "ep", 3, 3),
    ]
    src, dst = nics.flow_nics(_flows(rows), 4, 4, nics.members(_flows(rows)))
    assert src.tolist() == [2, 2, 0, 0, 1, 3]
    assert dst.tolist() == [2, 2, 1, 3, 0, 0]  # ranks 2 (GPU 1) and 3 (GPU 3) in communicator-rank order
    # two GPUs a NIC: GPUs 0, 1 -> NIC 0; 2, 3 -> NIC 1
    src2, dst2 = nics.flow_nics(_flows(rows), 4, 2, nics.members(_flows(rows)))
    assert src2.tolist() == [1, 1, 0, 0, 0, 1] and dst2.tolist() == [1, 1, 0, 1, 0, 0]


def test_one_nic_a_host_never_needs_the_receiver():
    rows = [(1, 0, 0, 1, "broadcast", "b", 0, 0), (2, 0, 0, 1, "broadcast", "b", 0, 0)]
    assert [a.tolist() for a in nics.flow_nics(_flows(rows), 2, 1)] == [[0, 0], [0, 0]]


def test_a_rank_on_two_gpus_is_refused():
    rows = [(1, 0, 0, 1, "send", "x", 0, 0), (2, 1, 0, 1, "send", "x", 0, 1)]
    with pytest.raises(ValueError, match="rank 0 sends from two GPUs"):
        nics.flow_nics(_flows(rows), 2, 2, nics.members(_flows(rows)))
