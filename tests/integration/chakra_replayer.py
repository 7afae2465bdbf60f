"""A small replayer of Chakra execution traces, written from Chakra's documented semantics only
(``et_def.proto`` and the feeder's rule: a node is issued when every node of its ``data_deps`` and
``ctrl_deps`` is done), for tests/integration/test_chakra_replay.py. It imports nothing of the code
under test but the ET decoder (``lib/chakra/et_io.read_et``, tested on its own against Chakra's and
ASTRA-sim's files).

Timing: a ``COMP_NODE`` takes its ``duration_micros`` (a CPU op: none); a collective starts when every
member of its group (``pg_name`` in ``comm_groups.json``) has issued its k-th collective on that group
and takes the alpha-beta time of a ring over the group in group-rank order; a send and the receive with
the same (src, dst, ``comm_tag``) start when both are issued and take alpha + bytes / bandwidth.

Network (an "equivalent network" of a two-level fabric): a hop inside a host runs at ``intra_bps``; a
hop between hosts at ``host_bps / share``, share being the number of groups of the same size whose ring
leaves the same host over the network (the SPMD program issues a call on every such group at once, so
they split the host's NIC); a ring runs at its slowest hop. Latency ``alpha_s`` per ring step.
"""

from __future__ import annotations

import heapq
import json
from collections import defaultdict
from pathlib import Path

from phantora_assets.lib.chakra.et_io import read_et

COMP, SEND, RECV, COLL = 4, 5, 6, 7


def wire_bytes(comm_type: int, size: int, n: int) -> tuple[float, int]:
    """(bytes each rank puts on its ring hop, ring steps) of a collective of ``comm_size`` ``size``:
    the textbook ring formulas (all-reduce 2(n-1)/n S, all-gather (n-1) S with S per rank,
    reduce-scatter and all-to-all (n-1)/n S with S the whole input, broadcast S pipelined)."""
    if n <= 1:
        return 0.0, 0
    if comm_type == 0:
        return 2 * (n - 1) / n * size, 2 * (n - 1)
    if comm_type == 2:
        return (n - 1) * size, n - 1
    if comm_type in (6, 7):
        return (n - 1) / n * size, n - 1
    if comm_type == 5:
        return float(size), n - 1
    raise ValueError(f"comm_type {comm_type}")


class Network:
    def __init__(self, groups: dict[str, list[int]], gpus_per_node: int, host_bps: float, intra_bps: float,
                 alpha_s: float = 0.0) -> None:  # fmt: skip
        self.g, self.gpn, self.host, self.intra, self.alpha = groups, gpus_per_node, host_bps, intra_bps, alpha_s
        leaving: dict[tuple[int, int], int] = defaultdict(int)  # (group size, host) -> groups leaving it
        for ranks in groups.values():
            for h in self._out_hosts(ranks):
                leaving[(len(ranks), h)] += 1
        self.ring_bps = {}
        for name, ranks in groups.items():
            hosts = self._out_hosts(ranks)
            share = max((leaving[(len(ranks), h)] for h in hosts), default=1)
            self.ring_bps[name] = self.intra if not hosts else min(self.intra, self.host / share)

    def _out_hosts(self, ranks: list[int]) -> set[int]:
        n = len(ranks)
        return {ranks[i] // self.gpn for i in range(n) if ranks[i] // self.gpn != ranks[(i + 1) % n] // self.gpn}

    def coll_s(self, pg: str, comm_type: int, size: int) -> float:
        wire, steps = wire_bytes(comm_type, size, len(self.g[pg]))
        return steps * self.alpha + 8 * wire / self.ring_bps[pg] if wire else 0.0

    def p2p_s(self, src: int, dst: int, size: int) -> float:
        if src // self.gpn == dst // self.gpn:
            return self.alpha + 8 * size / self.intra
        peers = [r for r in self.g.values() if len(r) == 2]  # two-rank groups leaving the host split its NIC
        share = max(1, sum(1 for r in peers if src // self.gpn in {x // self.gpn for x in r} and
                           r[0] // self.gpn != r[1] // self.gpn))  # fmt: skip
        return self.alpha + 8 * size / (self.host / share)


def replay(folder: Path, prefix: str, net: Network) -> tuple[float, dict[int, float]]:
    """Replay ``folder/prefix.<rank>.et``; returns (the makespan, each rank's end) in seconds."""
    ranks = sorted(int(p.name.split(".")[-2]) for p in folder.glob(f"{prefix}.*.et"))
    nodes, children, left = {}, {}, {}
    coll_no: dict[tuple[int, int], tuple[str, int]] = {}
    for r in ranks:
        et = read_et(folder / f"{prefix}.{r}.et")
        per_pg: dict[str, int] = defaultdict(int)
        for n in et.nodes:
            nodes[(r, n.id)] = n
            deps = set(n.data_deps) | set(n.ctrl_deps)
            left[(r, n.id)] = len(deps)
            for d in deps:
                children.setdefault((r, d), []).append((r, n.id))
            if n.type == COLL:
                coll_no[(r, n.id)] = (n.attrs["pg_name"], per_pg[n.attrs["pg_name"]])
                per_pg[n.attrs["pg_name"]] += 1
    waiting: dict[tuple, list[tuple[tuple[int, int], float]]] = defaultdict(list)
    done: dict[tuple[int, int], float] = {}
    heap: list[tuple[float, int, int]] = []

    def issue(key: tuple[int, int], t: float) -> None:
        n = nodes[key]
        if n.type == COMP:
            heapq.heappush(heap, (t + (0 if n.attrs.get("is_cpu_op") else n.dur_us * 1e-6), *key))
            return
        if n.type == COLL:
            pg, k = coll_no[key]
            match, need = ("coll", pg, k), len(net.g[pg])
        else:
            a = n.attrs
            match, need = ("p2p", a["comm_src"], a["comm_dst"], a["comm_tag"]), 2
        waiting[match].append((key, t))
        if len(waiting[match]) == need:
            start = max(x[1] for x in waiting[match])
            if n.type == COLL:
                dur = net.coll_s(pg, n.attrs["comm_type"], n.attrs["comm_size"])
            else:
                dur = net.p2p_s(n.attrs["comm_src"], n.attrs["comm_dst"], n.attrs["comm_size"])
            for k2, _ in waiting.pop(match):
                heapq.heappush(heap, (start + dur, *k2))

    ready: dict[tuple[int, int], float] = defaultdict(float)
    for key, c in left.items():
        if c == 0:
            issue(key, 0.0)
    while heap:
        t, r, i = heapq.heappop(heap)
        done[(r, i)] = t
        for ch in children.get((r, i), []):
            ready[ch] = max(ready[ch], t)
            left[ch] -= 1
            if left[ch] == 0:
                issue(ch, ready[ch])
    if len(done) != len(nodes):
        raise AssertionError(f"{len(nodes) - len(done)} of {len(nodes)} nodes never ran (unmatched or cyclic)")
    ends = {r: max(t for (rr, _), t in done.items() if rr == r) for r in ranks}
    return max(ends.values()), ends


def load_groups(folder: Path, prefix: str) -> dict[str, list[int]]:
    return json.loads((folder / f"{prefix}.comm_groups.json").read_text())
