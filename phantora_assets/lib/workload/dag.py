"""The DAG of one run's step programs, as the analytic simulator runs it.

:func:`build_dag` turns the programs of every pipeline stage (one list of items per stage, the
warm-up iteration's and the steady one's) into DAG nodes: kind 0 compute (one per rank of the
stage per compute item, its duration the item's base time x the iteration's factor), 1
collective (one per communicator of the issuing stage; a call on a communicator spanning stages
-- a pipeline send, a pipeline all-reduce -- is one node that every side's program adds its
dependencies to), 2 barrier (the end of an iteration). Edges: a rank's program order (its
frontier), a communicator's NCCL stream order, the ``waits`` of a compute on asynchronous
collectives, a blocking collective before its members' next compute, a pipeline receive before
the receiver's next compute (the sender goes on: ``isend``). Returns the per-node lists the event
loop of :mod:`~phantora_assets.lib.sim.analytic` reads. No Dagster import; raises nothing.
"""

from __future__ import annotations

from phantora_assets.lib.sim.workload_layout import WorkloadLayout
from phantora_assets.lib.sim.workload_types import Communicator, Compute, Item, SendRecv


def stage_rank_range(model: WorkloadLayout, stage: int, n_stages: int) -> range:
    """Global ranks of ``stage`` (every rank for a one-stage program)."""
    return model.stage_ranks(stage) if n_stages > 1 else range(model.spec.world_size)


def stage_representatives(model: WorkloadLayout, n_stages: int) -> list[int]:
    """The representative rank of each stage: its first (lowest) global rank."""
    return [stage_rank_range(model, st, n_stages)[0] for st in range(n_stages)]


def stage_communicators(model: WorkloadLayout, n_stages: int) -> dict[tuple[str, int], list[Communicator]]:
    """(kind, stage) -> the communicators of that kind a call of ``stage``'s program is issued on, in
    order of their first rank: those whose ranks lie in the stage; every pipeline communicator for kind
    ``pp`` (a call on it spans stages); every communicator of the kind for a one-stage program."""
    out: dict[tuple[str, int], list[Communicator]] = {}
    for k_, cs in model.comms.items():
        for st in range(n_stages):
            if k_ == "pp" or n_stages == 1:
                out[(k_, st)] = list(cs)
            else:
                ranks = stage_rank_range(model, st, n_stages)
                out[(k_, st)] = [c for c in cs if ranks[0] <= c.ranks[0] <= ranks[-1]]
    return out


def build_dag(  # noqa: C901, PLR0912, PLR0915 (the DAG rules in program order: one branch per item kind)
    model: WorkloadLayout,
    comm_list: list[Communicator],
    warm_progs: list[list[Item]],
    steady_progs: list[list[Item]],
    base: dict[int, float],
    factors: list[float],
    n_sim: int,
    representatives: bool = False,
) -> tuple[list[int], list[float], list[int], list[object], list[int], list[list[int]], list[int]]:
    """(kind, dur, who, what, iter_of, dependents, deps_left) of ``n_sim`` iterations (module
    docstring): iteration 0 runs ``warm_progs``, the others ``steady_progs``; ``base`` holds each
    compute item's duration (ns) by ``id``.

    ``representatives``: the DAG of each stage's representative rank only (its first rank,
    :func:`stage_representatives`) and the communicators through them: the quotient of the full DAG
    when every rank of a stage runs as its representative does (the caller simulates the other
    communicators' flows and checks that, ``lib/sim/analytic``). Its nodes are in the full DAG's order of
    each group's first node: the full DAG's node of rank or communicator ``k`` of a group is that
    group's node here expanded in the order of :func:`stage_rank_range` / :func:`stage_communicators`."""
    world = model.spec.world_size
    n_stages = len(steady_progs)
    kind: list[int] = []  # 0 compute, 1 collective, 2 barrier
    dur: list[float] = []  # compute duration (ns)
    who: list[int] = []  # compute: rank; collective: communicator index
    what: list[object] = []  # the item
    iter_of: list[int] = []
    dependents: list[list[int]] = []
    deps_left: list[int] = []
    comm_index = {c.name: i for i, c in enumerate(comm_list)}

    def new(k: int, d: float, w: int, item: object, it: int, deps) -> int:
        n = len(kind)
        kind.append(k)
        dur.append(d)
        who.append(w)
        what.append(item)
        iter_of.append(it)
        dependents.append([])
        cnt = 0
        for x in deps:
            dependents[x].append(n)
            cnt += 1
        deps_left.append(cnt)
        return n

    def add_deps(n: int, deps) -> None:
        for x in deps:
            if x != n:
                dependents[x].append(n)
                deps_left[n] += 1

    stage_comms = stage_communicators(model, n_stages)
    if representatives:  # the stage's first rank and the communicators through it (module docstring)
        stage_ranks = [[r] for r in stage_representatives(model, n_stages)]
        reps = {r for (r,) in stage_ranks}
        stage_comms = {key: [c for c in cs if reps.intersection(c.ranks)] for key, cs in stage_comms.items()}
    else:
        stage_ranks = [list(stage_rank_range(model, st, n_stages)) for st in range(n_stages)]
    frontier: list[list[int]] = [[] for _ in range(world)]
    stream_last: dict[str, int] = {}
    for it in range(n_sim):
        progs = warm_progs if it == 0 else steady_progs
        factor = factors[it]
        tags: dict[str, dict[int, int]] = {}
        shared: dict[tuple[str, str], int] = {}  # (tag, comm) -> node of a call spanning stages
        for st, program in enumerate(progs):
            ranks = stage_ranks[st]
            for item in program:
                if isinstance(item, Compute):
                    d = base[id(item)] * factor
                    for r in ranks:
                        deps = set(frontier[r])
                        for tg in item.waits:
                            node = tags.get(tg, {}).get(r)
                            if node is not None:
                                deps.add(node)
                        frontier[r] = [new(0, d, r, item, it, deps)]
                    continue
                per_rank = tags.setdefault(item.tag, {})
                if isinstance(item, SendRecv) and item.kind == "pp":  # both stages list it
                    ((a, b),) = item.pairs
                    side = a if st == a else b
                    for c in stage_comms[(item.kind, st)]:
                        r = c.ranks[side]
                        node = shared.get((item.tag, c.name))
                        if node is None:
                            node = shared[(item.tag, c.name)] = new(
                                1, 0.0, comm_index[c.name], item, it, set(frontier[r])
                            )
                        else:
                            add_deps(node, set(frontier[r]))
                        per_rank[r] = node
                        if st == item.receiver:
                            frontier[r].append(node)
                    continue
                blocking = item.blocking
                in_stage = set(ranks)
                for c in stage_comms[(item.kind, st)]:
                    members = [r for r in c.ranks if r in in_stage]
                    if item.kind == "pp":  # a collective over the pipeline: one node, every stage's side
                        node = shared.get((item.tag, c.name))
                        if node is None:
                            node = shared[(item.tag, c.name)] = new(1, 0.0, comm_index[c.name], item, it, set())
                        add_deps(node, {x for r in members for x in frontier[r]})
                    else:
                        deps = set()
                        last = stream_last.get(c.name)
                        if last is not None:
                            deps.add(last)
                        for r in members:
                            deps.update(frontier[r])
                        node = new(1, 0.0, comm_index[c.name], item, it, deps)
                        stream_last[c.name] = node
                    for r in members:
                        per_rank[r] = node
                        if blocking:
                            frontier[r].append(node)
        # end of iteration: every stream drains (torch.cuda.synchronize / loss.cpu() on every
        # rank, and the next step's first collective lines the ranks up): a global barrier
        last_nodes = {x for f in frontier for x in f} | set(stream_last.values()) | set(shared.values())
        bar = new(2, 0.0, -1, None, it, last_nodes)
        frontier = [[bar] for _ in range(world)]
        stream_last = {name: bar for name in stream_last}
    return kind, dur, who, what, iter_of, dependents, deps_left
