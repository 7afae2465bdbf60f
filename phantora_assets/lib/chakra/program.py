"""A run of the embedded simulator as Chakra execution traces, from its step program (issue 42).

``phantora-assets chakra`` of a run whose source is ``analytic`` comes here; other sources (Phantora
traces, imports) have no program and keep the timeline export of :mod:`.export`. The run is simulated
again without emitting events (``AnalyticSimulator(emit=False, keep_schedule=True)``: the build's own
simulation, so every time is the build's), and each rank's ET is written node by node while the
rank's program is walked (``et_io.EtWriter``): one rank's nodes at a time, never the world's. Ranks
alike (``_Template``: the same program, groups, pair sides and DAG-list lengths) are walked once: the
first is encoded with its own attributes and times as slots, the others are those bytes with theirs
filled in, byte for byte what their own walk writes (``share=False`` walks every rank; the unit
tests hold the two to the same sha256).

The dependencies are those the simulator runs (``lib/workload/dag.build_dag``), projected on one rank:

* a ``Compute`` item: data deps on the blocking collectives issued since the rank's previous compute
  (a TP all-gather / reduce-scatter, an all-to-all), on the pipeline receive posted before it, and on
  the asynchronous collectives it ``waits`` for (an FSDP / ZeRO-3 parameter gather, an overlapped
  gradient reduce-scatter); a ctrl dep on the rank's previous compute (its compute stream);
* a collective, all-to-all or point-to-point item: data deps on what the rank last did on its
  compute stream (the compute that produces its input, and the blocking collectives after it); a
  ctrl dep on the previous call on its communicator (one NCCL stream a communicator; pipeline
  sends have none, as in ``build_dag``). A pipeline ``SendRecv`` is a ``COMM_SEND_NODE`` on the
  sending stage (its ``isend``: nothing waits for it but the step's end) and a ``COMM_RECV_NODE`` on the
  receiving stage (the next compute's data dep); both carry ``comm_src``, ``comm_dst``, ``comm_size``
  and the same ``comm_tag``. A ring exchange (context parallelism) is a send and a receive per pair;
* the step's end (``torch.cuda.synchronize()`` in the simulator's model, which then lines every rank up
  for the next step): a CPU ``COMP_NODE`` of 0 us (``is_cpu_op = true``: no GPU time; the ingest
  skips it) named ``step_end`` that waits for everything the rank issued in the step; the next step
  starts after it.

``stream_order = "data"`` (CLI ``--stream-order data``) writes every ctrl dep as a data dep: Chakra's
first feeder (``src/feeder/et_feeder.cpp``) and the ASTRA-sim versions built on it resolve ``data_deps``
only; its ``feeder_v3`` (``USE_DATA_DEPS`` and ``USE_CTRL_DEPS`` both true) reads both lists.

Node attributes are those of :mod:`.export` (``comm_type``, ``comm_size``, ``pg_name``, ``stream``,
``is_cpu_op``; the comm-size table is in its docstring); times are the simulated ones, in us since the
first exported step's start; a collective's ``duration_micros`` is its simulated time (ASTRA-sim
replays a broadcast with it). No Dagster import.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from phantora_assets.lib.chakra.et_io import (
    COMM_COLL_NODE,
    COMM_RECV_NODE,
    COMM_SEND_NODE,
    COMP_NODE,
    OP_COMM_TYPES,
    EtNode,
    EtWriter,
    attr_field,
    length_prefix,
    node_head,
)
from phantora_assets.lib.chakra.export import SOURCE_NAME, ExportSummary, check_out
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.timeline import COMPUTE_STREAM_ID, IterationTimes, SimulatedDag
from phantora_assets.lib.sim.workload_types import AllToAll, Collective, Communicator, Compute, Item, SendRecv
from phantora_assets.lib.store.io import atomic_write_text
from phantora_assets.lib.traffic.ring import DTYPE_BYTES
from phantora_assets.lib.workload.dag import stage_rank_range

STREAM_ORDERS = ("ctrl", "data")
KINDS = {COMP_NODE: "compute", COMM_COLL_NODE: "collective", COMM_SEND_NODE: "send", COMM_RECV_NODE: "recv"}


class _Times:
    """Start and end (ns) of the simulated DAG's nodes, for any iteration: the simulated ones as run,
    a replicated one as the timeline makes it (iteration 1's times t -> T_k + (t - T_1) f_k / f_1)."""

    def __init__(self, dag: SimulatedDag, times: IterationTimes) -> None:
        self.dag, self.n_sim, self.f = dag, times.n_sim, times.factors
        self.t0 = [sum(times.durations[:k]) for k in range(len(times.durations) + 1)]
        self.compute: dict[tuple[int, int], list[int]] = {}
        # (iteration, communicator, tag) -> its calls in issue order (a tag repeats per micro-batch; a
        # pipeline call is one node both stages add to, build_dag's ``shared``)
        self.calls: dict[tuple[int, int, str], list[int]] = {}
        for n, (k, w, it) in enumerate(zip(dag.kind, dag.who, dag.iter_of)):
            if k == 0:
                self.compute.setdefault((it, w), []).append(n)
            elif k == 1:
                self.calls.setdefault((it, w, dag.what[n].tag), []).append(n)

    def source(self, it: int) -> int:
        return it if it < self.n_sim else 1

    def span(self, it: int, n: int) -> _Span:
        s, e = float(self.dag.start[n]), float(self.dag.end[n])
        if it < self.n_sim:
            return _Span((s, e), (it, n))
        scale = self.f[it] / self.f[1]
        return _Span((self.t0[it] + (s - self.t0[1]) * scale, self.t0[it] + (e - self.t0[1]) * scale), (it, n))

    def spans_us(self, its: np.ndarray, ns: np.ndarray, w0: float) -> tuple[np.ndarray, np.ndarray]:
        """``start_micros`` and ``duration_micros`` of nodes ``ns`` of iterations ``its`` as :meth:`_Rank.node`
        makes them from :meth:`span`, element-wise in float64 (the same operations, so the same values)."""
        s, e = np.asarray(self.dag.start, dtype=np.float64)[ns], np.asarray(self.dag.end, dtype=np.float64)[ns]
        rep = its >= self.n_sim
        if rep.any():
            t0, f = np.asarray(self.t0, dtype=np.float64), np.asarray(self.f, dtype=np.float64)
            scale = f[its[rep]] / f[1]
            base = t0[its[rep]]
            s[rep], e[rep] = base + (s[rep] - t0[1]) * scale, base + (e[rep] - t0[1]) * scale
        start = np.maximum(np.rint((s - w0) / 1000), 0).astype(np.int64)
        dur = np.maximum(np.rint((e - s) / 1000), 0).astype(np.int64)
        return start, dur


class _Span(tuple):
    """A node's (start, end) ns and where :meth:`_Times.span` took it from (``ref``: iteration, DAG node)."""

    ref: tuple[int, int]

    def __new__(cls, span: tuple[float, float], ref: tuple[int, int]) -> _Span:
        out = super().__new__(cls, span)
        out.ref = ref
        return out


@dataclass
class _Rank:
    """The walk's state on one rank (``build_dag``'s frontier and stream order, by ET node id)."""

    rank: int
    stream_order: str
    w0: float
    next_id: int = 1
    frontier: list[int] = field(default_factory=list)
    stream_last: dict[int, list[int]] = field(default_factory=dict)
    sync: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS.values(), 0))
    refs: list[tuple[int, int] | None] | None = None  # per node, its span's (iteration, DAG node) (_Template)

    def node(
        self, name: str, ntype: int, span: tuple[float, float], data: list[int], ctrl: list[int], **attrs
    ) -> EtNode:
        i, self.next_id = self.next_id, self.next_id + 1
        ctrl = [d for d in ctrl if d not in data]
        if self.stream_order == "data":
            data, ctrl = sorted(set(data) | set(ctrl)), []
        start = max(0, round((span[0] - self.w0) / 1000))
        dur = max(0, round((span[1] - span[0]) / 1000))
        if ntype in KINDS and not attrs.get("is_cpu_op"):
            self.counts[KINDS[ntype]] += 1
        attrs.setdefault("is_cpu_op", False)
        if self.refs is not None:
            self.refs.append(span.ref if isinstance(span, _Span) else None)
        return EtNode(i, name, ntype, sorted(set(ctrl)), sorted(set(data)), start, dur, attrs)

    def split(self, deps: list[int]) -> tuple[list[int], list[int]]:
        """(data, ctrl) of frontier deps: the step-end node is a ctrl dep, the rest data."""
        return [d for d in deps if d != self.sync], [d for d in deps if d == self.sync]


def _comm_size(item: Collective | AllToAll, n: int) -> int:
    s = item.count * DTYPE_BYTES[item.dtype]
    if isinstance(item, AllToAll) or (isinstance(item, Collective) and item.op == "reduce_scatter"):
        return n * s
    return s


def _rank_nodes(  # noqa: PLR0913, PLR0915 (build_dag's rules in program order, a branch per item kind; the run's tables)
    st: _Rank, stage: int, program: list[Item], iters: list[int], times: _Times, rep: int,
    comm_of: dict[tuple[int, str], int], comms: list[Communicator], pg: dict[int, str], tag_no: dict[str, int],
    gpn: int,
) -> Iterator[EtNode]:  # fmt: skip
    """The ET nodes of rank ``st.rank`` (stage ``stage``; its times are those of ``rep``, itself or its
    stage's representative) over the steady iterations ``iters`` (module docstring)."""
    r, dev = st.rank, (st.rank % gpn) << 32
    for k, it in enumerate(iters):
        src = times.source(it)
        comp = iter(times.compute[(src, rep)])
        tags: dict[str, list[int]] = {}
        seen: dict[tuple[int, str], int] = {}  # (communicator, tag) -> calls so far this step
        loose: list[int] = []  # issued, not on the frontier: waited for by the step's end
        last_compute: list[int] = [d for d in st.frontier if d == st.sync]
        for item in program:
            if isinstance(item, Compute):
                n = next(comp)
                data, ctrl = st.split(st.frontier)
                data = [d for d in data if d not in last_compute]
                for tg in item.waits:
                    data += tags.get(tg, [])
                node = st.node(item.name, COMP_NODE, times.span(it, n), data, ctrl + last_compute,
                               stream=dev | COMPUTE_STREAM_ID)  # fmt: skip
                yield node
                st.frontier = last_compute = [node.id]
                continue
            ci = comm_of.get((r, item.kind))
            if ci is None or len(comms[ci].ranks) == 1:  # not on this rank, or a group of one: no traffic, no time
                continue
            c = comms[ci]
            calls = seen.get((ci, item.tag), 0)
            seen[(ci, item.tag)] = calls + 1
            j = calls if item.kind != "pp" else 0
            n = times.calls[(src, comm_of[(rep, item.kind)], item.tag)][j]
            span = times.span(it, n)
            base = {"pg_name": pg[ci], "stream": dev | (13 + ci)}
            data, ctrl = st.split(st.frontier)
            stream = item.kind != "pp"
            if stream:
                ctrl = ctrl + st.stream_last.get(ci, [])
            made: list[EtNode] = []
            if isinstance(item, SendRecv):
                size = item.count * DTYPE_BYTES[item.dtype]
                pp = item.kind == "pp"
                for q, (a, b) in enumerate(item.pairs):
                    # one tag a call: a tag the program issues again in the step (a context-parallel
                    # ring exchange, once a micro-batch) numbers each call apart (its j-th issue), as
                    # ASTRA-sim's analytical backend keys a message by (tag, src, dst, size, chunk)
                    # (CallbackTracker) and two in flight with one key are one message (issue 42)
                    call_no = k * tag_no[""] + tag_no[item.tag] + calls
                    pair = {"comm_src": c.ranks[a], "comm_dst": c.ranks[b], "comm_size": size,
                            "comm_tag": 1 + (call_no * 64 + q) % (2**31 - 1)}  # fmt: skip
                    if c.ranks[a] == r:
                        made.append(st.node(f"{item.tag}.send", COMM_SEND_NODE, span, data, ctrl, **pair, **base))
                    if c.ranks[b] == r:
                        # a pipeline receive is posted after the rank's earlier work (issue order, ctrl);
                        # the next compute consumes it (data, below)
                        d_, c_ = ([], data + ctrl) if pp else (data, ctrl)
                        made.append(st.node(f"{item.tag}.recv", COMM_RECV_NODE, span, d_, c_, **pair, **base))
                waited = [m.id for m in made if m.type == COMM_RECV_NODE] if pp else [m.id for m in made]
                blocking = pp or item.blocking
            else:
                n_ranks = len(c.ranks)
                attrs = {"comm_type": OP_COMM_TYPES["all_to_all" if isinstance(item, AllToAll) else item.op],
                         "comm_size": _comm_size(item, n_ranks)}  # fmt: skip
                if isinstance(item, Collective) and item.op == "broadcast":
                    attrs["comm_src"] = c.ranks[item.root]
                made.append(st.node(item.tag, COMM_COLL_NODE, span, data, ctrl, **attrs, **base))
                waited = [made[0].id]
                blocking = item.blocking
            yield from made
            ids = [m.id for m in made]
            tags[item.tag] = ids
            if stream:
                st.stream_last[ci] = ids
            if blocking:
                st.frontier = st.frontier + waited
                loose += [i for i in ids if i not in waited]
            else:
                loose += ids
        # the step's end: every stream drained (build_dag's barrier, on this rank)
        ends = sorted(set(st.frontier) | {x for v in st.stream_last.values() for x in v} | set(loose))
        t_end = times.t0[it + 1]
        node = st.node("step_end", COMP_NODE, (t_end, t_end), [], ends, is_cpu_op=True)
        yield node
        st.sync, st.frontier, st.stream_last = node.id, [node.id], {}


#: The attributes of a node that name the rank's own GPU or communicators (``_Template``).
_PATCHED = ("stream", "pg_name", "comm_src", "comm_dst")
#: Templates kept per stage (a run whose ranks all differ in time walks each rank; this bounds memory).
_MAX_TEMPLATES = 16


class _Template:
    """One rank's ET nodes as wire bytes with what is the rank's own left as slots, so the file of any
    rank of its class (:func:`_class_key`) is these bytes with the slots filled for that rank.

    Two ranks of a class walk :func:`_rank_nodes` alike step for step: the same program, the same
    items skipped (a communicator of one, or none), the same sides of every send / receive pair, the
    same group sizes and as many DAG nodes in each list the walk reads by position; so their nodes
    have the same ids, names, types, dependencies, ``comm_type``, ``comm_size``, ``comm_tag`` and
    ``is_cpu_op``, and differ only in the times (node k takes the span of the DAG node at the
    template's position in the rank's lists), in ``stream`` (the GPU and communicator), ``pg_name``
    and the members ``comm_src`` / ``comm_dst`` (``c.ranks[i]``), which map one to one from the
    template's rank to the other through its communicator of each kind. Protobuf writes a message's
    fields in number order and omits a proto3 scalar at 0: a node's record is its fields 1-5, then
    ``start_time_micros`` (6) and ``duration_micros`` (7) when not 0, then its ``attr`` entries (10).
    """

    def __init__(self, rank: int, nodes: list[EtNode], refs: list, idx: np.ndarray, counts: dict[str, int]) -> None:
        self.rank, self.counts, self.n = rank, counts, len(nodes)
        pos = {int(n): p for p, n in enumerate(idx)}
        self.consts: list[bytes] = []
        slot_of: dict[tuple[str, object, object], int] = {}
        timed_it: list[int] = []
        timed_pos: list[int] = []
        segs: list[list[int] | bytes] = []  # per node: table indices, or the framed record when fixed
        for node, ref in zip(nodes, refs):
            parts: list = []
            if ref is None:
                parts.append(node_head(node))
            else:
                head = EtNode(node.id, node.name, node.type, node.ctrl_deps, node.data_deps, 0, 0)
                parts += [node_head(head), ("#time", len(timed_it))]
                timed_it.append(ref[0])
                timed_pos.append(pos[ref[1]])
            for k, v in node.attrs.items():
                if k in _PATCHED:
                    parts.append((k, v, node.attrs.get("pg_name") if k in ("comm_src", "comm_dst") else None))
                elif isinstance(parts[-1], bytes):
                    parts[-1] += attr_field(k, v)
                else:
                    parts.append(attr_field(k, v))
            if len(parts) == 1:
                segs.append(length_prefix(len(parts[0])) + parts[0])
                continue
            ids: list[int] = []
            for p in parts:
                if isinstance(p, bytes):
                    ids.append(len(self.consts))
                    self.consts.append(p)
                elif p[0] == "#time":
                    ids.append(-1 - p[1])
                else:
                    ids.append(-1 - len(nodes) - slot_of.setdefault(p, len(slot_of)))
            segs.append(ids)
        self.slots = list(slot_of)
        self.its, self.pos = np.asarray(timed_it, dtype=np.int64), np.asarray(timed_pos, dtype=np.int64)
        # table = consts + the rank's time fields (one a timed node) + its filled slots
        c, t = len(self.consts), len(timed_it)
        self.segs = [
            s
            if isinstance(s, bytes)
            else tuple(i if i >= 0 else c - 1 - i if -1 - i < len(nodes) else c + t - 1 - i - len(nodes) for i in s)
            for s in segs
        ]

    def encode(self, maps: dict[str, dict], idx: np.ndarray, times: _Times, w0: float) -> bytes:
        """The node records of a rank of the class: ``idx`` the rank's DAG nodes in the walk's lists
        (:func:`_class_key`); ``maps`` takes each slot's template value to the rank's (``stream`` and
        ``pg_name`` by value, ``comm_src`` / ``comm_dst`` by (pg_name, rank))."""
        start, dur = times.spans_us(self.its, idx[self.pos], w0)
        tfields = [
            (b"\x30" + length_prefix(a) if a else b"") + (b"\x38" + length_prefix(d) if d else b"")
            for a, d in zip(start.tolist(), dur.tolist())
        ]
        filled = [attr_field(k, maps[k][v] if pg_t is None else maps[k][(pg_t, v)]) for k, v, pg_t in self.slots]
        table = self.consts + tfields + filled
        out: list[bytes] = []
        put = out.append
        for s in self.segs:
            if isinstance(s, bytes):
                put(s)
            else:
                body = b"".join([table[i] for i in s])
                put(length_prefix(len(body)))
                put(body)
        return b"".join(out)


def _maps(t: int, r: int, kinds: list[str], comm_of: dict, comms: list[Communicator], pg: dict[int, str], gpn: int):
    """The slot maps (``_Template.encode``) from template rank ``t`` to rank ``r`` of its class."""
    dt, dr = (t % gpn) << 32, (r % gpn) << 32
    stream = {dt | COMPUTE_STREAM_ID: dr | COMPUTE_STREAM_ID}
    pgs: dict[str, str] = {}
    members: dict[tuple[str, int], int] = {}
    for kind in kinds:
        ct, cr = comm_of.get((t, kind)), comm_of.get((r, kind))
        if ct is None or cr is None:
            continue
        stream[dt | (13 + ct)] = dr | (13 + cr)
        pgs[pg[ct]] = pg[cr]
        members.update({(pg[ct], a): b for a, b in zip(comms[ct].ranks, comms[cr].ranks)})
    return {"stream": stream, "pg_name": pgs, "comm_src": members, "comm_dst": members}


def _class_key(
    r: int, rep: int, program: list[Item], kinds: list[str], srcs: list[int], times: _Times, comm_of: dict,
    comms: list[Communicator],
) -> tuple[tuple, np.ndarray]:  # fmt: skip
    """Rank ``r``'s class (``_Template``) and its DAG nodes in the lists :func:`_rank_nodes` reads.

    The class: per kind of call, the group size (None: not on the rank) and, for a kind with send /
    receive pairs, the rank's place in the group; and the length of every list of ``rep``'s times the
    walk reads by position (per simulated iteration, the compute nodes and each (kind, tag)'s calls)."""
    pairs = {x.kind for x in program if isinstance(x, SendRecv)}
    shape: list = []
    for kind in kinds:
        ci = comm_of.get((r, kind))
        if ci is None:
            shape.append(None)
        else:
            ranks = list(comms[ci].ranks)
            shape.append((len(ranks), ranks.index(r) if kind in pairs else -1))
    tags = sorted({(x.kind, x.tag) for x in program if not isinstance(x, Compute)})
    idx: list[int] = []
    lens: list[int] = []
    for src in srcs:
        for part in [times.compute.get((src, rep), [])] + [
            times.calls.get((src, comm_of.get((rep, kind), -1), tag), []) for kind, tag in tags
        ]:
            idx += part
            lens.append(len(part))
    return (tuple(shape), tuple(lens)), np.asarray(idx, dtype=np.int64)


def _tag_numbers(programs: list[list[Item]]) -> dict[str, int]:
    """A send / receive tag's first call number; a tag issued c times in a stage's step takes c
    numbers (its calls apart, :func:`_rank_nodes`); ``""``: the numbers a step."""
    issues: dict[str, int] = {}
    for p in programs:
        for t, c in Counter(x.tag for x in p if isinstance(x, SendRecv)).items():
            issues[t] = max(issues.get(t, 0), c)
    tag_no: dict[str, int] = {}
    first = 0
    for t in sorted(issues):
        tag_no[t], first = first, first + issues[t]
    tag_no[""] = first
    return tag_no


@dataclass(frozen=True)
class ProgramExport(ExportSummary):
    """:class:`ExportSummary` plus the simulated duration (ns) of each exported step and the symmetry
    of the simulation (``lib/sim/symmetry.py``)."""

    step_ns: list[int] = field(default_factory=list)
    symmetry: str = ""


def export_program(
    spec: RunSpec, steady_steps: list[int], out_dir: Path, prefix: str, stream_order: str = "ctrl", share: bool = True
) -> ProgramExport:
    """Write the ETs of ``spec``'s iterations ``steady_steps`` (the run's steady steps: iteration k is
    step k) and ``<prefix>.comm_groups.json`` under ``out_dir`` (module docstring).

    Raises:
        ValueError: the run does not fit in GPU memory, no step is given, a step is beyond the run's
            iterations, ``stream_order`` is not ``ctrl`` / ``data``, or a rank is on two
            communicators of one kind (the projection needs one); ``out_dir`` / ``prefix`` as
            ``export.check_out`` (checked before the simulation).
        RunMatrixError: the simulator refuses the run (its trace bound).

    ``share=False`` walks and encodes every rank node by node (the same bytes, slower: the tests' reference).
    """
    from phantora_assets.lib.sim.analytic import AnalyticSimulator

    if stream_order not in STREAM_ORDERS:
        raise ValueError(f"stream order {stream_order!r}: one of {', '.join(STREAM_ORDERS)}")
    check_out(out_dir, prefix)
    sim = AnalyticSimulator(spec, emit=False, keep_schedule=True)
    if not steady_steps or min(steady_steps) < 1 or max(steady_steps) >= sim.iterations:
        raise ValueError(f"{spec.run_id}: steps {steady_steps} are not steady steps of its {sim.iterations} iterations")
    result = sim.run()
    if not result.fits or sim.simulated is None:
        raise ValueError(f"{spec.run_id}: it does not fit in GPU memory ({result.memory}): nothing was simulated")
    dag, itimes, programs = sim.simulated
    sim.simulated = None
    times = _Times(dag, itimes)
    comms = dag.comm_list
    comm_of: dict[tuple[int, str], int] = {}
    for i, c in enumerate(comms):
        for r in c.ranks:
            if comm_of.setdefault((r, c.kind), i) != i:
                raise ValueError(f"{spec.run_id}: rank {r} is on two {c.kind} communicators; the export needs one")
    order = sorted(range(len(comms)), key=lambda i: (list(comms[i].ranks), comms[i].name))
    pg = {i: str(k + 1) for k, i in enumerate(order)}
    tag_no = _tag_numbers(programs)
    n_stages = len(programs)
    rep_of = {r: rep for rep, ranks in dag.ranks_of.items() for r in ranks}
    world, gpn = spec.world_size, spec.gpus_per_node
    w0 = times.t0[steady_steps[0]]
    out_dir.mkdir(parents=True, exist_ok=True)
    files, counts = [], {}
    srcs = sorted({times.source(it) for it in steady_steps})
    for stage in range(n_stages):
        program = programs[stage]
        kinds = sorted({x.kind for x in program if not isinstance(x, Compute)})
        templates: dict[tuple, _Template] = {}
        for r in stage_rank_range(sim.model, stage, n_stages):
            meta = {"source": SOURCE_NAME, "run_id": spec.run_id, "rank": r, "world_size": world,
                    "gpus_per_node": gpn, "steady_steps": len(steady_steps), "first_step": steady_steps[0],
                    "dependencies": "step program", "stream_order": f"{stream_order}_deps"}  # fmt: skip
            path = out_dir / f"{prefix}.{r}.et"
            if not share:  # every rank walked, node by node (the reference the tests hold the templates to)
                st = _Rank(r, stream_order, w0)
                with EtWriter(path, meta) as w:
                    for node in _rank_nodes(st, stage, program, steady_steps, times, rep_of[r], comm_of, comms,
                                            pg, tag_no, gpn):  # fmt: skip
                        w.write(node)
                files.append(path)
                counts[r] = st.counts
                continue
            key, idx = _class_key(r, rep_of[r], program, kinds, srcs, times, comm_of, comms)
            tpl = templates.get(key)
            if tpl is None:
                st = _Rank(r, stream_order, w0, refs=[])
                nodes = list(_rank_nodes(st, stage, program, steady_steps, times, rep_of[r], comm_of, comms, pg,
                                         tag_no, gpn))  # fmt: skip
                tpl = _Template(r, nodes, st.refs or [], idx, st.counts)
                if len(templates) < _MAX_TEMPLATES:
                    templates[key] = tpl
            with EtWriter(path, meta) as w:
                w.write_records(tpl.encode(_maps(tpl.rank, r, kinds, comm_of, comms, pg, gpn), idx, times, w0), tpl.n)
            files.append(path)
            counts[r] = dict(tpl.counts)
    groups = out_dir / f"{prefix}.comm_groups.json"
    atomic_write_text(groups, json.dumps({pg[i]: list(comms[i].ranks) for i in order}, indent=1) + "\n")
    order_files = sorted(range(len(files)), key=lambda i: int(files[i].name.rsplit(".", 2)[1]))
    return ProgramExport(
        [files[i] for i in order_files],
        groups,
        dict(sorted(counts.items())),
        list(steady_steps),
        [int(round(itimes.durations[s])) for s in steady_steps],
        sim.symmetry,
    )
