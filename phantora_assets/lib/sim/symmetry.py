"""Symmetry of a run's ranks: the analytic simulator runs one rank a pipeline stage, checked.

Every rank of a pipeline stage runs the same program (the generators of ``lib/workload`` give one
program a stage), each compute item taking the same time on every rank (one GPU model a run, no
per-rank jitter), and every call of the program is issued on each communicator of its kind in the
stage (every pipeline communicator for a call that spans stages). So when every call ends at the
same instant on each of those communicators, every rank of a stage has its representative's
timeline: the stage's first rank (``lib/workload/dag.stage_representatives``). Whether a call ends
at the same instant on every communicator is a property of the network: of the links each
communicator's flows cross under the routing and of the other flows on them.

The rule, as the simulator applies it (``lib/sim/analytic.AnalyticSimulator``, ``compress=True``):

* the DAG holds the representative rank of each stage and the communicators through it (the
  quotient DAG, ``build_dag(representatives=True)``): a compute item is one node, not one a rank;
* a call on a representative communicator injects into the network simulator the flows of the
  call on **every** communicator of its :func:`orbits` group that cross the network, each with its
  own endpoints, route and ECMP key; the network therefore carries exactly the flows of the full
  simulation at every instant. Flows that stay inside a scale-up domain (the simulator's loopback:
  one endpoint twice) share nothing; they are simulated once, on the representative communicator;
* after the run every group is checked: each communicator's flows of each call must end at the
  instant the representative's do (to :data:`TOLERANCE_NS`), and flow ``j`` of every communicator
  must stay in its scale-up domain exactly when the representative's flow ``j`` does. When the check
  holds, the full DAG's times are the quotient's (by induction over the DAG: every node of a group
  becomes ready when its representative does), so the expanded timeline is the full simulation's:
  the same flows to the byte, each at its own simulated end.
* when it fails, :class:`AsymmetricRanks` names the call, the communicators and the two ends, and
  the simulator runs the full DAG instead (every rank its own node), and says so
  (``SimulationResult.symmetry``).

What breaks it: anything that gives the communicators of a group different links or different load:
oversubscription or capacities that differ between racks, rails or planes, an Arbitrary fabric file
that is not symmetric, per-flow ECMP hashing onto spines (``ecmp = "hash"`` on a multi-rack
TwoLayerMultiPath: each connection its own spine), a rank placement that puts one communicator's
ring inside a host and another's across hosts. Mixed GPUs and stragglers would break the first
premise (one compute time a stage); the schema has neither.

No Dagster import. Raises :class:`AsymmetricRanks` (the simulator catches it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from phantora_assets.lib.sim.workload_layout import WorkloadLayout
from phantora_assets.lib.sim.workload_types import AllToAll, Collective, Communicator, SendRecv
from phantora_assets.lib.workload.dag import stage_communicators, stage_representatives

#: Two ends of a group's call closer than this (ns) are the same instant (float rounding of the
#: network simulator's sums; the timeline is written in whole ns).
TOLERANCE_NS = 1e-3

Call = Collective | AllToAll | SendRecv
FlowsOf = Callable[[Call, Communicator], tuple[np.ndarray, np.ndarray, np.ndarray]]
Endpoints = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


class AsymmetricRanks(Exception):
    """The ranks of a stage do not run as their representative does (module docstring): the message
    names the call, the two communicators and what differs."""


def orbits(model: WorkloadLayout, comm_list: list[Communicator], n_stages: int) -> dict[int, list[int]]:
    """Representative communicator index -> the indices of its group (itself included, in the order
    the full DAG issues the call on them: ``lib/workload/dag.stage_communicators``). A representative
    communicator is one holding a stage's representative rank; its group is the communicators of
    its kind in that stage (every pipeline communicator for kind ``pp``)."""
    index = {c.name: i for i, c in enumerate(comm_list)}
    reps = set(stage_representatives(model, n_stages))
    out: dict[int, list[int]] = {}
    for cs in stage_communicators(model, n_stages).values():
        group = [index[c.name] for c in cs]
        for i in group:
            if reps.intersection(comm_list[i].ranks):
                out[i] = group
    return out


@dataclass(frozen=True)
class OrbitFlows:
    """One call's flows on the other communicators of its group (all but the representative's,
    concatenated in group order).

    Attributes:
        group: communicator indices of the group (the representative's at ``rep_pos``).
        rep_pos: the representative's position in ``group``.
        bounds: offsets of each other communicator's flows in the concatenation (len = others + 1).
        j: per flow, the index of the representative's flow it corresponds to (same comm-local ranks).
        loop: per flow, True when it stays in its scale-up domain (not injected; its end is the
            representative's flow ``j``'s).
        src, dst, nbytes, conn: the network flows (``~loop``) as the network simulator takes them:
            endpoints, bytes, ECMP key.
        net_bounds: offsets of each other communicator's network flows among them.
    """

    group: list[int]
    rep_pos: int
    bounds: np.ndarray
    j: np.ndarray
    loop: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    conn: np.ndarray
    net_bounds: np.ndarray

    @property
    def n_net(self) -> int:
        return len(self.src)


def orbit_flows(
    item: Call,
    rep: int,
    group: list[int],
    comm_list: list[Communicator],
    flows_of: FlowsOf,
    endpoints: Endpoints,
) -> OrbitFlows:
    """:class:`OrbitFlows` of ``item`` issued on representative communicator ``rep`` of ``group``.
    ECMP keys as the simulator gives a flow: ``(src rank x world + dst rank) x communicators + index``.

    Raises:
        AsymmetricRanks: another communicator's flow ``j`` stays in its scale-up domain where the
            representative's does not, or the reverse; or it has another number of flows.
    """
    world = 1 + max(max(c.ranks) for c in comm_list)
    n_comms = len(comm_list)
    r_src, r_dst, _ = flows_of(item, comm_list[rep])
    e_src, e_dst = endpoints(r_src, r_dst)
    rep_loop = e_src == e_dst
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("j", "loop", "src", "dst", "nbytes", "conn")}
    bounds, net_bounds = [0], [0]
    for ci in group:
        if ci == rep:
            continue
        src, dst, nbytes = flows_of(item, comm_list[ci])
        if len(src) != len(r_src):
            raise AsymmetricRanks(
                f"{_name(item)} has {len(src)} flows on {comm_list[ci].name}, {len(r_src)} on {comm_list[rep].name}"
            )
        a, b = endpoints(src, dst)
        loop = a == b
        if not np.array_equal(loop, rep_loop):
            raise AsymmetricRanks(
                f"{_name(item)}: a flow stays in its scale-up domain on {comm_list[ci].name} and crosses the "
                f"network on {comm_list[rep].name}, or the reverse"
            )
        net = ~loop
        parts["j"].append(np.arange(len(src)))
        parts["loop"].append(loop)
        parts["src"].append(a[net])
        parts["dst"].append(b[net])
        parts["nbytes"].append(nbytes[net])
        parts["conn"].append((src[net] * world + dst[net]) * n_comms + ci)
        bounds.append(bounds[-1] + len(src))
        net_bounds.append(net_bounds[-1] + int(net.sum()))
    cat = {k: (np.concatenate(v) if v else np.zeros(0, dtype=np.int64)) for k, v in parts.items()}
    return OrbitFlows(
        group,
        group.index(rep),
        np.array(bounds),
        cat["j"].astype(np.int64),
        cat["loop"].astype(bool),
        cat["src"].astype(np.int64),
        cat["dst"].astype(np.int64),
        cat["nbytes"],
        cat["conn"].astype(np.int64),
        np.array(net_bounds),
    )


def group_ends(
    item: Call,
    orbit: OrbitFlows,
    rep_ends: np.ndarray,
    orbit_ends: np.ndarray | None,
    start: float,
    rep_net: np.ndarray,
) -> list[tuple[int, np.ndarray]]:
    """(communicator index, per-flow end ns) of each communicator of the group, in group order, after
    checking that each ends the call when the representative does.

    ``rep_ends``: the representative's flows' ends; ``orbit_ends``: the injected network flows' ends
    (None for a call that took no network time: every flow ends at ``start``); ``rep_net``: which of
    the representative's flows crossed the network.

    Raises:
        AsymmetricRanks: a communicator's network flows end the call more than :data:`TOLERANCE_NS`
            away from the representative's.
    """
    ends = np.empty(len(orbit.j))
    ends[orbit.loop] = rep_ends[orbit.j[orbit.loop]]
    if orbit_ends is None:
        ends[~orbit.loop] = start
    else:
        ends[~orbit.loop] = orbit_ends
        if orbit.n_net:
            rep_last = float(rep_ends[rep_net].max())
            nb = orbit.net_bounds
            nonempty = nb[1:] > nb[:-1]
            lasts = np.maximum.reduceat(orbit_ends, nb[:-1][nonempty])
            bad = np.nonzero(np.abs(lasts - rep_last) > TOLERANCE_NS)[0]
            if len(bad):
                others = [ci for ci in orbit.group if ci != orbit.group[orbit.rep_pos]]
                k = int(np.nonzero(nonempty)[0][bad[0]])
                raise AsymmetricRanks(
                    f"{_name(item)} at {start:.0f} ns ends at {lasts[bad[0]]:.3f} ns on communicator #{others[k]} "
                    f"and at {rep_last:.3f} ns on the representative #{orbit.group[orbit.rep_pos]}"
                )
    out: list[tuple[int, np.ndarray]] = []
    b = orbit.bounds
    k = 0
    for pos, ci in enumerate(orbit.group):
        if pos == orbit.rep_pos:
            out.append((ci, rep_ends))
            continue
        out.append((ci, ends[b[k] : b[k + 1]]))
        k += 1
    return out


def _name(item: Call) -> str:
    op = getattr(item, "op", type(item).__name__)
    return f"{op} {item.tag!r} ({item.kind})"
