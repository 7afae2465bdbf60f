"""The analytic simulator's outputs: :class:`SimulationResult` and the raw-timeline assembly.

:func:`emit_raw_timeline` turns the simulated DAG of :class:`~phantora_assets.lib.sim.analytic.
AnalyticSimulator` (a :class:`SimulatedDag`, with its :class:`IterationTimes`) into Phantora's
event schema, the columns and dtypes of :data:`~phantora_assets.lib.columns.RAW_TIMELINE_COLUMNS`
(a :class:`RawTimeline`: one iteration's rows at a time, or one DataFrame): one computation event per rank per
compute item (its ``meta_json`` the Torch record, ``info`` from
:func:`~phantora_assets.lib.sim.keys.torch_info`), one communication event per ring flow
(loopback hops included); or, for a run past the trace bound (scope ``one rank a stage``), the computation
events of the first rank of each stage and the flows of the communicators that span hosts. Times are integer
ns (rounded, ``end_ns >= start_ns``); the steady iterations beyond the simulated ones are iteration 1's
rows rescaled by their jitter factor.
:func:`empty_raw` is the empty frame of a run that does not fit.

Raises nothing for consistent inputs (a node, flow or communicator missing from the arrays is an
``IndexError`` / ``KeyError``, a bug of the caller). No Dagster import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from phantora_assets.lib.columns import RAW_TIMELINE_COLUMNS
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.keys import comm_id_bytes, torch_info
from phantora_assets.lib.sim.memory import MemoryEstimate
from phantora_assets.lib.sim.workload_types import AllToAll, Collective, Communicator, SendRecv
from phantora_assets.lib.traffic.ring import OP_TO_CALL
from phantora_assets.lib.workload.collectives import scope_keeps

COMPUTE_STREAM_ID = 7

#: (src global ranks, dst global ranks, bytes) of a collective's flows on a communicator
FlowsArrays = Callable[[Collective | AllToAll | SendRecv, Communicator], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass
class SimulationResult:
    """Output of one analytic simulation.

    Attributes:
        timeline: the raw timeline, iteration by iteration (:class:`RawTimeline`); None when the
            run does not fit or was simulated without emitting events. ``raw`` is it as one
            DataFrame (RAW_TIMELINE_COLUMNS; empty for None), made on first use.
        memory: per-GPU peak memory estimate.
        iteration_ns: simulated duration of each iteration (ns), as ``run.log`` would print.
        compute_ns_per_step: compute-stream busy time of one steady step on rank 0 (ns).
        db_fraction: share of that compute time whose kernels came from the perf DB.
        exposed_comm_ns: median over steady steps of (step time - compute busy time), rank 0.
        kernels_per_step / kernels_from_db: intercepted calls of one steady step on one rank, and
            how many of them had their key in the perf DB.
        symmetry: which DAG was simulated: one rank a stage (the others checked equal) or every
            rank, and why (``lib/sim/symmetry.py``).
        scope: what ``timeline`` holds (``lib/workload/collectives.TIMELINE_SCOPES``).
        compute_hosts: scope ``one rank a stage``: the hosts (node, 0-based) whose compute the timeline holds
            whole, each with how many hosts have that compute (``lib/workload/collectives.compute_hosts``);
            None for scope ``every rank`` (every host).
    """

    spec: RunSpec
    memory: MemoryEstimate
    timeline: RawTimeline | None
    iteration_ns: list[int] = field(default_factory=list)
    compute_ns_per_step: int = 0
    db_fraction: float = 0.0
    exposed_comm_ns: int = 0
    kernels_per_step: int = 0
    kernels_from_db: int = 0
    symmetry: str = ""
    scope: str = "every rank"
    compute_hosts: dict[int, int] | None = None

    @cached_property
    def raw(self) -> pd.DataFrame:
        return self.timeline.frame() if self.timeline is not None else empty_raw()

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def step_ns(self) -> float:
        """Median duration of the steady iterations (all but the first)."""
        steady = self.iteration_ns[1:] or self.iteration_ns
        return float(np.median(steady)) if steady else 0.0


def empty_raw() -> pd.DataFrame:
    """An empty raw timeline with the columns and dtypes of RAW_TIMELINE_COLUMNS."""
    df = pd.DataFrame(
        {c: pd.Series(dtype="int64" if t == "int64" else object) for c, t in RAW_TIMELINE_COLUMNS.items()}
    )
    return df


@dataclass(frozen=True)
class SimulatedDag:
    """The simulated DAG of one run, as :class:`~phantora_assets.lib.sim.analytic.AnalyticSimulator`
    leaves it.

    Attributes:
        kind: per node, 0 compute, 1 collective, 2 barrier (the end of an iteration).
        who: per node, the global rank of a compute node, the communicator index of a collective.
        what: per node, its program item (a ``Compute``, ``Collective``, ``AllToAll`` or ``SendRecv``).
        iter_of: per node, its iteration.
        start, end: per node, its start and end (ns, float).
        flow_groups: a collective node -> (communicator index, per-flow end ns) of every communicator
            the node stands for, in the order the full DAG issues the call on them (one, its own, when
            the DAG is every rank's; its group when it is one rank a stage: ``lib/sim/symmetry.py``); for a
            timeline of scope one rank a stage, of those the timeline holds only (``scope_keeps``: none of a
            communicator inside one host).
        ranks_of: a rank with compute nodes -> the ranks whose compute it stands for (itself alone, or
            its pipeline stage's ranks in order).
        comm_list: the communicators, indexed by ``who`` of a collective node.
    """

    kind: list[int]
    who: list[int]
    what: list
    iter_of: list[int]
    start: np.ndarray
    end: np.ndarray
    flow_groups: dict[int, list[tuple[int, np.ndarray]]]
    ranks_of: dict[int, list[int]]
    comm_list: list[Communicator]


@dataclass(frozen=True)
class IterationTimes:
    """Per iteration: ``sim_start`` (ns, the simulated ones), ``durations`` (ns, all of them) and the
    jitter ``factors`` (all of them); ``n_sim`` iterations were simulated, the rest replicate iteration 1."""

    sim_start: list[float]
    durations: list[float]
    factors: list[float]
    n_sim: int


def emit_raw_timeline(
    spec: RunSpec,
    flows_arrays: FlowsArrays,
    dag: SimulatedDag,
    times: IterationTimes,
    keep_ranks: frozenset[int] | None = None,
) -> RawTimeline:
    """Raw timeline rows of the simulated iterations, then of the replicated steady ones
    (iteration 1's rows with times t -> T_k + (t - T_1) * f_k / f_1), as a :class:`RawTimeline`;
    ``flows_arrays`` gives a collective's flows. ``keep_ranks`` None: every rank's compute and every flow
    (scope ``every rank``); else scope ``one rank a stage`` (``lib/workload/collectives.scope_keeps``): the
    compute of those ranks only, and the flows of the communicators that span hosts (every network flow; no
    host-local traffic)."""
    kind, who, what, start, end = dag.kind, dag.who, dag.what, dag.start, dag.end
    comm_list, n_sim = dag.comm_list, times.n_sim
    G = spec.gpus_per_node
    pids = [4000 + 17 * r for r in range(spec.world_size)]
    comm_hex = {c.name: comm_id_bytes(spec.run_id, c.name).hex() for c in comm_list}
    comm_stream = {c.name: 13 + i for i, c in enumerate(comm_list)}
    info_cache: dict[int, str] = {}
    hosts = [f"host-{h + 1}" for h in range(spec.n_nodes)]
    # one block of rows per simulated iteration: str/int columns + float times
    blocks = []
    order = np.lexsort((np.arange(len(kind)), start))
    iter_arr = np.array(dag.iter_of)
    for it in range(n_sim):
        nodes = [int(n) for n in order if iter_arr[n] == it and kind[n] != 2]
        c_rows: dict[str, list] = {
            c: []
            for c in (
                "kind",
                "name",
                "src_host",
                "dst_host",
                "bytes",
                "call",
                "count",
                "dtype",
                "reduce_op",
                "root",
                "comm_id_hex",
                "comm_rank",
                "stream_device",
                "stream_id",
                "os_pid",
                "info",
            )
        }
        t0s: list[float] = []
        t1s: list[float] = []
        for n in nodes:
            item = what[n]
            if kind[n] == 0:
                info = info_cache.get(id(item))
                if info is None:
                    info = info_cache[id(item)] = torch_info(item)
                for r in dag.ranks_of[who[n]]:
                    if keep_ranks is not None and r not in keep_ranks:
                        continue
                    comp_vals = (
                        "computation",
                        item.name,
                        hosts[r // G],
                        "",
                        0,
                        "",
                        0,
                        "",
                        "",
                        -1,
                        "",
                        -1,
                        r % G,
                        COMPUTE_STREAM_ID,
                        pids[r],
                        info,
                    )
                    for c, v in zip(c_rows, comp_vals):
                        c_rows[c].append(v)
                    t0s.append(start[n])
                    t1s.append(end[n])
                continue
            if isinstance(item, (AllToAll, SendRecv)):
                call, op_name, root = "NcclSend", "", -1
            else:
                call = OP_TO_CALL[item.op]
                op_name = "Sum" if item.op in ("all_reduce", "reduce_scatter") else ""
                root = item.root if item.op == "broadcast" else -1
            for ci, flow_end in dag.flow_groups[n]:
                comm = comm_list[ci]
                if keep_ranks is not None and not scope_keeps(comm.ranks, G):
                    continue
                src, dst, nbytes = flows_arrays(item, comm)
                rank_of = {g: i for i, g in enumerate(comm.ranks)}
                hexid, sid = comm_hex[comm.name], comm_stream[comm.name]
                for j, (a, b, by) in enumerate(zip(src.tolist(), dst.tolist(), nbytes.tolist())):
                    flow_vals = (
                        "communication",
                        call,
                        hosts[a // G],
                        hosts[b // G],
                        by,
                        call,
                        item.count,
                        item.dtype,
                        op_name,
                        root,
                        hexid,
                        rank_of[a],
                        a % G,
                        sid,
                        pids[a],
                        None,
                    )
                    for c, v in zip(c_rows, flow_vals):
                        c_rows[c].append(v)
                    t0s.append(start[n])
                    t1s.append(max(start[n], flow_end[j]))
        blocks.append((c_rows, np.array(t0s), np.array(t1s)))
    return RawTimeline(blocks, list(times.sim_start), list(times.durations), list(times.factors), n_sim)


#: the string columns of a raw timeline (object arrays) other than ``meta_json``, and its int64 ones
#: other than the ids and times: a simulated iteration's values, shared by its replicas
_STR_COLS = [c for c, t in RAW_TIMELINE_COLUMNS.items() if t != "int64" and c != "meta_json"]
_INT_COLS = [c for c, t in RAW_TIMELINE_COLUMNS.items() if t == "int64" and c not in ("event_id", "start_ns", "end_ns")]
_META_TPL = (
    '{"Torch":{"time":%d,"id":{"host":{"hostname":"%s","pid":%d},"tid":%d},'
    '"stream":{"device":%d,"id":' + str(COMPUTE_STREAM_ID) + '},"info":%s}}'
)


class RawTimeline:
    """The raw timeline of a simulation, held as the columns of its simulated iterations (the
    replicated steady ones are iteration 1's rows rescaled): :meth:`iterations` gives its rows one
    iteration at a time, so a writer never holds the whole table (3.1 M rows, about 1.5 GB as a
    DataFrame at 128x8); :meth:`frame` is the whole DataFrame (RAW_TIMELINE_COLUMNS)."""

    def __init__(self, blocks: list, sim_start: list, durations: list, factors: list, n_sim: int) -> None:
        self._blocks = []
        for c_rows, t0, t1 in blocks:  # each block: column lists of one simulated iteration
            arr = {c: np.array(c_rows[c], dtype=object) for c in _STR_COLS}
            arr.update({c: np.array(c_rows[c], dtype=np.int64) for c in _INT_COLS})
            comp = [j for j, x in enumerate(c_rows["info"]) if x is not None]
            host, pid, dev, infos = (c_rows["src_host"], c_rows["os_pid"], c_rows["stream_device"], c_rows["info"])
            meta_args = [(host[j], pid[j], pid[j], dev[j], infos[j]) for j in comp]
            self._blocks.append((arr, t0, t1, np.array(comp, dtype=np.int64), meta_args))
        self._sim_start, self._durations, self._factors, self._n_sim = sim_start, durations, factors, n_sim
        self._n_rows = [len(self._block(it)[1]) for it in range(len(durations))]

    def _block(self, it: int) -> tuple:
        return self._blocks[it if it < self._n_sim else 1]

    def __len__(self) -> int:
        return sum(self._n_rows)

    def iterations(self) -> Iterator[dict[str, np.ndarray]]:
        """The columns (RAW_TIMELINE_COLUMNS, in order) of each iteration's rows, in order."""
        starts = [0.0]
        for d in self._durations[:-1]:
            starts.append(starts[-1] + d)
        first = 0
        for it in range(len(self._durations)):
            arr, t0, t1, comp_idx, meta_args = self._block(it)
            if it < self._n_sim:
                s_ns, e_ns = t0, t1
            else:
                scale = self._factors[it] / self._factors[1]
                s_ns = starts[it] + (t0 - self._sim_start[1]) * scale
                e_ns = starts[it] + (t1 - self._sim_start[1]) * scale
            s_i = np.rint(s_ns).astype(np.int64)
            e_i = np.maximum(np.rint(e_ns).astype(np.int64), s_i)
            meta = np.full(len(s_i), "", dtype=object)
            d = (e_i - s_i)[comp_idx].tolist()
            meta[comp_idx] = [_META_TPL % (dj, *a) for dj, a in zip(d, meta_args)]
            cols = {"event_id": np.arange(first, first + len(s_i), dtype=np.int64), "start_ns": s_i, "end_ns": e_i}
            cols.update(arr)
            cols["meta_json"] = meta
            first += len(s_i)
            yield {c: cols[c] for c in RAW_TIMELINE_COLUMNS}

    def frames(self) -> Iterator[pd.DataFrame]:
        """:meth:`iterations` as DataFrames."""
        for cols in self.iterations():
            yield pd.DataFrame(cols)

    def frame(self) -> pd.DataFrame:
        """The whole raw timeline as one DataFrame."""
        parts: dict[str, list[np.ndarray]] = {c: [] for c in RAW_TIMELINE_COLUMNS}
        for cols in self.iterations():
            for c, v in cols.items():
                parts[c].append(v)
        if not parts["event_id"]:
            return empty_raw()
        return pd.DataFrame({c: np.concatenate(parts[c]) for c in RAW_TIMELINE_COLUMNS})
