"""The per-step collectives of a workload, per communicator: what the generator issues.

* :func:`run_spec_of`: a :class:`~phantora_assets.lib.run.spec.RunSpec` (source ``analytic``) of a
  ``[workloads.NAME]`` table (or a parsed :class:`~phantora_assets.lib.workload.spec.
  WorkloadSpec`) on a layout, validated as a run-matrix entry.
* :func:`step_collectives`: every :class:`CollectiveCall` of one steady (or the warm-up) step, in
  issue order per communicator, over the programs of all pipeline stages.
* :func:`collective_table`: the same grouped per (communicator, op, dtype, count).
* :func:`comm_groups`: the parallelism group (tp, cp, ep, dp, pp, other) of each communicator of a
  run's flow table (the flows' ``group`` column).

docs/WORKLOADS.md "Python API" documents the fields. The programs come from
:class:`~phantora_assets.lib.sim.workloads.WorkloadModel`; nothing is simulated. Raises
:class:`~phantora_assets.lib.errors.RunMatrixError` for a spec the schema refuses. No Dagster import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pandas as pd

from phantora_assets.lib.phantora.chrome_trace import comm_id_of
from phantora_assets.lib.run.spec import PROFILED_SOURCES, RunSpec, validate
from phantora_assets.lib.sim.keys import comm_id_bytes
from phantora_assets.lib.sim.workload_types import AllToAll, Collective, Communicator, SendRecv
from phantora_assets.lib.sim.workloads import WorkloadModel, workload_model
from phantora_assets.lib.traffic.ring import DTYPE_BYTES
from phantora_assets.lib.workload.dag import stage_rank_range, stage_representatives
from phantora_assets.lib.workload.placement import GROUP_OF_KIND
from phantora_assets.lib.workload.spec import WorkloadSpec, parse_workload


@dataclass(frozen=True)
class CollectiveCall:
    """One collective call on one communicator (docs/WORKLOADS.md "Python API")."""

    comm: str
    group: str
    ranks: tuple[int, ...]
    op: str
    count: int
    dtype: str
    nbytes: int
    tag: str
    src: int = -1
    dst: int = -1
    stage: int = -1


def run_spec_of(
    table: dict[str, Any] | WorkloadSpec,
    nodes: int,
    gpus_per_node: int,
    gpu: str = "h100",
    name: str = "workload",
    ep: int | None = None,
) -> RunSpec:
    """The RunSpec of workload ``table`` (named ``name``) on ``nodes`` x ``gpus_per_node`` GPUs
    of ``gpu`` (a ``gpus.toml`` key), validated like a run-matrix entry (RunMatrixError)."""
    wl = table if isinstance(table, WorkloadSpec) else parse_workload(name, table, "run_spec_of")
    spec = RunSpec(wl.name, gpu, nodes, gpus_per_node, workload_def=wl, ep_size=ep)
    validate(spec, f"run_spec_of ({wl.name} {gpu} {nodes}x{gpus_per_node})")
    return spec


def group_of(comm: Communicator) -> str:
    """The parallelism group of a communicator's flows (docs/WORKLOADS.md "Groups")."""
    return GROUP_OF_KIND.get(comm.kind, "other")


def stage_communicators(model: WorkloadModel, kind: str, stage: int) -> list[Communicator]:
    """The communicators of ``kind`` a collective of ``stage``'s program runs on (all for ``pp``)."""
    comms = model.comms.get(kind, [])
    if kind == "pp" or model.spec.par.pp == 1:
        return comms
    ranks = model.stage_ranks(stage)
    return [c for c in comms if c.ranks[0] in ranks]


def step_collectives(spec: RunSpec, warmup: bool = False) -> list[CollectiveCall]:
    """Every collective of one step of ``spec`` (steady, or the warm-up step with the init
    broadcasts before it), one :class:`CollectiveCall` per (call, communicator), in issue order:
    stage by stage, each stage's program in order. A pipeline send (listed by both stages'
    programs) and a pipeline all-reduce (listed by every stage) are given once, the send with
    stage -1, the all-reduce with the first stage's number."""
    model = WorkloadModel(spec)
    out: list[CollectiveCall] = []
    seen_p2p: set[str] = set()
    for stage, program in enumerate(model.stage_programs(warmup)):
        items = (model.init_program(stage) + program) if warmup else program
        for item in items:
            if isinstance(item, SendRecv):
                if item.kind == "pp":
                    if item.tag in seen_p2p:
                        continue
                    seen_p2p.add(item.tag)
                for c in stage_communicators(model, item.kind, stage):
                    for a, b in item.pairs:
                        out.append(
                            CollectiveCall(
                                c.name, group_of(c), c.ranks, "send", item.count, item.dtype,
                                item.count * DTYPE_BYTES[item.dtype], item.tag, c.ranks[a], c.ranks[b],
                                -1 if item.kind == "pp" else stage,
                            )
                        )  # fmt: skip
                continue
            if isinstance(item, (Collective, AllToAll)):
                if item.kind == "pp":  # a collective over the pipeline: listed by every stage
                    if item.tag in seen_p2p:
                        continue
                    seen_p2p.add(item.tag)
                op = item.op if isinstance(item, Collective) else "all_to_all"
                for c in stage_communicators(model, item.kind, stage):
                    nbytes = item.count * DTYPE_BYTES[item.dtype]
                    out.append(
                        CollectiveCall(
                            c.name, group_of(c), c.ranks, op, item.count, item.dtype, nbytes, item.tag, stage=stage
                        )
                    )
    return out


def collective_table(spec: RunSpec, warmup: bool = False) -> pd.DataFrame:
    """:func:`step_collectives` grouped: one row per (comm, group, op, dtype, count) with ``calls``
    per step, ``bytes_per_call`` (count x dtype size) and ``ranks`` (communicator size)."""
    calls = step_collectives(spec, warmup)
    df = pd.DataFrame(
        [(c.comm, c.group, c.op, c.dtype, c.count, c.nbytes, len(c.ranks)) for c in calls],
        columns=["comm", "group", "op", "dtype", "count", "bytes_per_call", "ranks"],
    )
    if df.empty:
        return df.assign(calls=pd.Series(dtype="int64"))
    keys = ["comm", "group", "op", "dtype", "count", "bytes_per_call", "ranks"]
    return df.groupby(keys, sort=True).size().rename("calls").reset_index()


def comm_groups(spec: RunSpec, flows: pd.DataFrame) -> dict[str, str]:
    """``comm_id -> group`` for every communicator of ``flows`` (``columns.FLOW_COLUMNS``) of run
    ``spec`` (docs/WORKLOADS.md "Groups"):

    * analytic runs: the communicator named by the id (``keys.comm_id_bytes`` of its name) takes
      its kind's group (:data:`~phantora_assets.lib.sim.workload_layout.GROUP_OF_KIND`);
    * other runs of a known workload (Phantora in Docker, imports): the global ranks that send on
      the communicator (host index x gpus_per_node + the stream's device) and its size (the
      largest ``comm_rank`` + 1) are matched against the communicators the generator builds for
      the run's layout: the group of the one kind with a communicator of that size holding every
      sender, else ``other``;
    * runs without a workload (Kineto, Chakra) and anything unmatched: ``other``.
    """
    ids = flows["comm_id"].unique().tolist() if len(flows) else []
    if not ids or spec.source in PROFILED_SOURCES or not spec.workload:
        return {c: "other" for c in ids}
    model = workload_model(spec)
    comms = [c for cs in model.comms.values() for c in cs]
    if spec.source == "analytic":
        named = {comm_id_of(comm_id_bytes(spec.run_id, c.name)): group_of(c) for c in comms}
        return {c: named.get(c, "other") for c in ids}
    g = spec.gpus_per_node
    rank = flows["src_node"].to_numpy() * g + (flows["stream"].to_numpy() >> 32)
    frame = pd.DataFrame({"comm_id": flows["comm_id"].to_numpy(), "rank": rank, "comm_rank": flows["comm_rank"]})
    out: dict[str, str] = {}
    for cid, part in frame.groupby("comm_id", sort=False):
        members = set(part["rank"].tolist())
        size = int(part["comm_rank"].max()) + 1
        kinds = {group_of(c) for c in comms if len(c.ranks) >= max(size, 2) and members <= set(c.ranks)}
        out[str(cid)] = kinds.pop() if len(kinds) == 1 else "other"
    return out


def _flows_per_call(op: str, n: int) -> int:
    if n < 2:
        return 0
    if op == "all_to_all":
        return n * (n - 1)
    return n - 1 if op == "broadcast" else n


#: What a raw timeline holds (:func:`trace_events_per_step`, ``lib/sim/timeline.emit_raw_timeline``): every
#: rank's compute and flows, or -- a run whose full timeline is past the bound -- every flow that crosses hosts
#: (all the network traffic) with the compute of one rank a pipeline stage.
EVERY_RANK = "every rank"
ONE_RANK_A_STAGE = "one rank a stage"
TIMELINE_SCOPES = (EVERY_RANK, ONE_RANK_A_STAGE)


def scope_keeps(ranks: tuple[int, ...] | list[int], gpus_per_node: int) -> bool:
    """Whether a timeline of scope :data:`ONE_RANK_A_STAGE` holds a communicator's flows: all of them (its ring
    rules hold) when its ranks are on more than one host, none when it lies inside one host (host-local traffic
    is no network traffic, docs/PHANTORA_FORMATS.md; at 16,384 GPUs the tensor-parallel calls inside the hosts
    are some 25 M flows a step)."""
    return len({r // gpus_per_node for r in ranks}) > 1


def representatives(spec: RunSpec) -> frozenset[int]:
    """The ranks whose compute a timeline of scope :data:`ONE_RANK_A_STAGE` holds: the first rank of each
    pipeline stage (``lib/workload/dag.stage_representatives``)."""
    model = WorkloadModel(spec)
    return frozenset(stage_representatives(model, len(model.stage_programs())))


def compute_hosts(spec: RunSpec, alike: bool) -> dict[int, int]:
    """The hosts whose compute a timeline of scope :data:`ONE_RANK_A_STAGE` holds whole, each with how many of
    the run's hosts have that very compute: node (0-based) -> count (itself included), in node order.

    ``step_anatomy``'s C of a host is the union of the compute intervals of its GPUs (``lib/traffic/anatomy``).
    The timeline holds the compute of the :func:`representatives` (each stage's first rank) only, so host ``h``
    (ranks ``h G .. h G + G - 1``) has its whole C there exactly when every rank ``r`` on it is

    * a representative (its own events are in the timeline), or
    * ``alike`` (the simulator ran one rank a stage and the check held, ``lib/sim/symmetry.py``: every rank of
      a stage has its representative's compute intervals to the ns) and the representative of ``r``'s stage is
      on ``h`` too (then ``r``'s intervals are already in ``h``'s union).

    With the ranks of a stage not alike (the simulator fell back to every rank) a non-representative rank's
    compute is its own and not in the timeline: only a host of representatives only is whole. The counts: with
    ``alike``, a host's C is the union of the representative intervals of the stages it holds ranks of, so every
    host holding ranks of the same stages has the same C; a whole host stands for those hosts (two whole hosts
    never share that set: each holds the representative of each of its stages, and a representative is on one
    host). Without ``alike`` a whole host stands for itself. The counts sum to ``spec.n_nodes`` exactly when
    every host's C is a reported one's (what the hosts' mean compute of ``reconfig`` needs).

    The kept ranks stay one a stage (not every rank of a host of each stage, which would make a host whole in
    every case): at Llama 3 405B on 2,048 GPUs (TP 8, PP 16) that multiplies the timeline's compute by 8,
    3.86 M events, past ``MAX_TRACE_EVENTS`` (docs/WORKLOADS.md "Scale"). Every host-aligned layout (a stage's
    ranks a whole number of hosts: pp outermost, ``lib/workload/placement.rank_coords``) run alike has the first
    host of each stage whole, standing for that stage's hosts.
    """
    model = WorkloadModel(spec)
    n_stages = len(model.stage_programs())
    g = spec.gpus_per_node
    stage_of = [0] * spec.world_size
    rep_host = []
    for st in range(n_stages):
        ranks = stage_rank_range(model, st, n_stages)
        for r in ranks:
            stage_of[r] = st
        rep_host.append(ranks[0] // g)
    reps = set(stage_representatives(model, n_stages))
    stages_on = [frozenset(stage_of[r] for r in range(h * g, (h + 1) * g)) for h in range(spec.n_nodes)]
    whole = [
        h
        for h in range(spec.n_nodes)
        if all(r in reps or (alike and rep_host[stage_of[r]] == h) for r in range(h * g, (h + 1) * g))
    ]
    if not alike:
        return {h: 1 for h in whole}
    hosts_with: dict[frozenset[int], int] = {}
    for stages in stages_on:
        hosts_with[stages] = hosts_with.get(stages, 0) + 1
    return {h: hosts_with[stages_on[h]] for h in whole}


@functools.lru_cache(maxsize=64)  # a spec is frozen; 16,384 GPUs take seconds to count
def trace_events_per_step(spec: RunSpec, scope: str = EVERY_RANK, warmup: bool = False) -> int:
    """Events of one step in the run's raw timeline of ``scope`` (:data:`TIMELINE_SCOPES`): one per rank
    (or per stage) per compute item of its stage, one per flow of every collective the scope holds
    (:func:`scope_keeps`; ring ops n, broadcast n - 1, all-to-all n(n - 1), a send 1). ``warmup`` False: a
    steady step; True: the first iteration as the simulator runs it, the init program (the parameter
    broadcasts: DeepSpeed's one a parameter tensor, ``WorkloadModel.init_program``) before the warm-up step's
    program. What the simulator emits; counted from the programs, nothing simulated (:func:`trace_events`).

    Raises:
        ValueError: an unknown scope.
    """
    if scope not in TIMELINE_SCOPES:
        raise ValueError(f"unknown timeline scope {scope!r} (known: {', '.join(TIMELINE_SCOPES)})")
    model = WorkloadModel(spec)
    programs = model.stage_programs(warmup)
    if warmup:
        programs = [model.init_program(st) + prog for st, prog in enumerate(programs)]
    events = 0
    # per (kind, stage): the sizes of the communicators a call is issued on and the scope holds
    sizes: dict[tuple[str, int], list[int]] = {}
    seen_p2p: set[str] = set()  # a pipeline call is listed by every stage it spans: counted once
    for stage, program in enumerate(programs):
        ranks = len(model.stage_ranks(stage)) if scope == EVERY_RANK else 1
        events += ranks * sum(1 for item in program if not isinstance(item, (Collective, AllToAll, SendRecv)))
        for item in program:
            if not isinstance(item, (Collective, AllToAll, SendRecv)):
                continue
            if item.kind == "pp":
                if item.tag in seen_p2p:
                    continue
                seen_p2p.add(item.tag)
            key = (item.kind, stage)
            if key not in sizes:
                comms = stage_communicators(model, item.kind, stage)
                keep = [c for c in comms if scope == EVERY_RANK or scope_keeps(c.ranks, spec.gpus_per_node)]
                sizes[key] = [len(c.ranks) for c in keep]
            if isinstance(item, SendRecv):
                events += len(item.pairs) * len(sizes[key])
            else:
                op = item.op if isinstance(item, Collective) else "all_to_all"
                events += sum(_flows_per_call(op, n) for n in sizes[key])
    return events


def trace_events(spec: RunSpec, scope: str = EVERY_RANK, iterations: int | None = None, warmup: bool = True) -> int:
    """Events of the run's whole raw timeline of ``scope``: the first iteration (with ``warmup``, as the pipeline
    simulates: the init program and the warm-up step, :func:`trace_events_per_step` ``warmup=True``) and the
    steady ones (``iterations`` default ``train.iterations``). Equal to the rows
    ``lib/sim/timeline.emit_raw_timeline`` writes (tests/unit/lib/sim/test_timeline_scope.py); counting steady
    steps only missed DeepSpeed's per-tensor init broadcasts, 1.2 M flows of an 8B model on 4,096 GPUs.

    Raises:
        ValueError: an unknown scope.
    """
    n = int(iterations or spec.wl.train.iterations)
    steady = trace_events_per_step(spec, scope)
    if not warmup or n < 1:
        return steady * n
    return trace_events_per_step(spec, scope, True) + steady * (n - 1)
