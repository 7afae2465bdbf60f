"""Peak host memory of each per-run asset stage, known before simulating (issue 37 item 4).

Each stage's peak resident memory is estimated as a stated function of the job's sizes, all counted from
the run's step programs and network before anything is simulated (:func:`job_size`):

    peak(stage) = BASELINE_MIB + sum over its terms of  rows x row bytes x copies

* rows: the job quantities a stage holds -- the raw timeline's events (flows and compute events of its
  scope, ``lib/workload/collectives.trace_events``), the network flows of the whole trace and of one steady
  step, the per-pair bin table's rows (dense: bins x ordered host pairs; sparse: bins x the host pairs that
  carry network flows, ``lib/store/bin_table``), the link-bin matrix's cells (bins x directed links), the
  host-pair heatmap (hosts squared);
* row bytes: from the column dtypes of the table the stage holds (:func:`row_bytes` of the contracts of
  ``lib/columns.py``: 8 B an int64 or float64, 1 B a bool, 8 B a str -- the object pointer of a pandas column;
  the values are a few shared strings, host and call names, communicator ids) or of its matrix (8 B an int64
  cell; 24 B a sparse row of three int64, ``bin_table.MAX_SPARSE_ROWS``);
* copies: how many such tables the stage holds at its peak, a stated multiplier per stage and term
  (:data:`STAGE_TERMS`). A table is not held once: the simulator's per-row Python lists (boxed ints, 40 B an
  int64 value against 8 in a column), the DataFrame, its Arrow copy at the Parquet write, the decoder's
  buffers. The multipliers were measured (``benchmarks/stage_memory.py``, docs/BENCHMARKS.md "Host memory
  per stage": peak RSS per stage against rows x row bytes) and rounded up, so the estimate is an upper bound
  of the measured peak within the factor stated there.

:func:`host_memory_rule` refuses a run whose largest stage's estimate exceeds the host-RAM bound
(:func:`max_host_gib`: ``$PHANTORA_ASSETS_MAX_HOST_GIB``, default :data:`MAX_HOST_GIB`) before it is simulated
(``lib/sim/analytic.AnalyticSimulator.run``); ``phantora-assets runs`` shows the same estimate and the same
rule, so a run it shows as fitting is not refused at build, with one stated exception: a run whose timeline
holds one rank a stage is counted with the simulation of one rank a stage, and when the ranks of a stage are
found to differ (``lib/sim/symmetry.py``, known only by simulating) the simulator checks the DAG of every rank
it falls back to (``dag_events``) and refuses the run there if it passes the bound; ``runs`` says so beside the
scope. It also states the binned stages' own bound
(``bin_table.sparse_rows_rule``, checked again by ``binned_flows`` from the step's flows), from the host pairs
the layout's collectives connect. The estimate covers runs of the analytic simulator (:func:`applies`): a
Phantora or imported run's trace is not counted from a step program. No Dagster import, no I/O.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import numpy as np

from phantora_assets.lib.columns import BIN_COLUMNS, FLOW_COLUMNS, RAW_TIMELINE_COLUMNS, STEP_FLOW_COLUMNS
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.workload_types import AllToAll, Collective, SendRecv
from phantora_assets.lib.sim.workloads import WorkloadModel
from phantora_assets.lib.store import bin_table
from phantora_assets.lib.traffic.ring import RING_OPS
from phantora_assets.lib.workload.collectives import EVERY_RANK, scope_keeps, stage_communicators, trace_events

#: The host-RAM bound of one stage, GiB: the machine class this project targets, a 2-core host on which the
#: 16,384-GPU Llama 3 405B job goes through every stage within 4 GiB peak RSS (issue 37 "Done when").
MAX_HOST_GIB = 4.0
MAX_HOST_GIB_ENV = "PHANTORA_ASSETS_MAX_HOST_GIB"
#: Resident memory of a build's run worker before its stage holds any table, MiB: the interpreter with the
#: code location, Dagster, pandas, pyarrow, matplotlib and DuckDB imported (``instance/warm.py``, what the
#: forkserver preloads): 250 MiB measured (``ru_maxrss`` after importing it and its ``LAZY_MODULES``).
BASELINE_MIB = 256
#: The window of the build, s (``stages/common.WINDOW_S``; a test checks they agree).
WINDOW_S = 180.0
#: Every per-run asset in graph order (``assets/common.RUN_ASSET_NAMES``; a test checks they agree).
STAGES = (
    "raw_timeline",
    "chrome_trace",
    "validated_flows",
    "binned_flows",
    "link_bins",
    "window_features",
    "run_summary",
    "step_anatomy",
    "reconfig",
    "run_plots",
)

#: Rows of the Chrome trace's text assembled at once (``lib/phantora/trace_writer.CHUNK_ROWS``) and the most
#: events an analytic run's trace holds whole (``sources/analytic.CHROME_TRACE_MAX_EVENTS``); a test checks both.
CHROME_CHUNK_ROWS = 65_536
CHROME_TRACE_MAX_EVENTS = 2_000_000

_DTYPE_BYTES = {"int64": 8, "float64": 8, "bool": 1, "str": 8}


def row_bytes(columns: dict[str, str]) -> int:
    """Bytes of one row of a table of ``columns`` (``lib/columns.py``: name -> dtype) as pandas holds it: 8 an
    int64 or float64, 1 a bool, 8 a str (the object pointer; the strings are shared).

    Raises:
        KeyError: a dtype not in the table above (a new contract dtype must be costed here).
    """
    return sum(_DTYPE_BYTES[t] for t in columns.values())


#: Bytes a row of each table a stage holds, with where each comes from.
RAW_ROW = row_bytes(RAW_TIMELINE_COLUMNS)  # 152: 10 int64 + 9 str
FLOW_ROW = row_bytes(FLOW_COLUMNS)  # 144: 9 int64 + 2 float64 + 7 str
STEP_FLOW_ROW = row_bytes(STEP_FLOW_COLUMNS)  # 40: 3 int64 + 2 float64
BIN_ROW = row_bytes(BIN_COLUMNS)  # 40: flows_100ms rows as the export writes them (run_id, t, src, dst, bytes)
CELL = 8  # an int64 cell of the dense per-pair or link-bin matrix (bin_table, link_table)
SPARSE_ROW = 24  # a sparse per-pair row: bin, pair, bytes as int64 (bin_table.MAX_SPARSE_ROWS)


@dataclass(frozen=True)
class JobSize:
    """The sizes of a run's tables, counted before simulating (:func:`job_size`).

    Attributes:
        hosts: hosts (nodes) of the run.
        scope: what its raw timeline holds (``lib/workload/collectives.TIMELINE_SCOPES``).
        events: raw timeline rows of that scope, every iteration (= flow_events + compute_events).
        flow_events, compute_events: its communication (one per flow) and computation rows.
        network_flows: flows between two hosts in the whole trace (the rows of ``flows.parquet``).
        step_network_flows: those of one steady step (the rows of ``step_flows.parquet``).
        pairs: ordered host pairs that carry network flows in a steady step.
        bins: bins of the 180 s window at the run's ``bin_s``.
        sparse: the per-pair table is built sparse (``bin_table.is_sparse``).
        pair_rows: rows of the per-pair table: bins x hosts (hosts - 1) dense, bins x pairs sparse.
        links: directed links of the run's network (``lib/net/routes.link_table``).
        dag_events: raw timeline rows of every rank (every iteration) when the simulator holds the DAG of
            every rank while the timeline holds one rank a stage (optical rails, one rank a stage being every
            rank, or the ranks of a stage found to differ: :func:`job_size` ``every_rank``), else 0: the
            simulated DAG the emitted rows (``events``) do not count.
        sweep_events: raw timeline rows of every rank over the warm-up and one steady iteration when the run
            asks for the re-timed reconfiguration sweep (``reconfig.sweep_delays_ms``), else 0: the DAG each of
            the ``reconfig`` stage's simulations holds (``lib/net/reconfig_sim.py``: every rank, two
            iterations, the EPS run's kept beside the current one's).
    """

    hosts: int
    scope: str
    events: int
    flow_events: int
    compute_events: int
    network_flows: int
    step_network_flows: int
    pairs: int
    bins: int
    sparse: bool
    pair_rows: int
    links: int
    dag_events: int = 0
    sweep_events: int = 0

    def rows(self, name: str) -> int:
        """The quantity a term of :data:`STAGE_TERMS` names."""
        if name == "link_cells":
            return self.bins * self.links
        if name == "host_cells":
            return self.hosts * self.hosts
        if name == "one":
            return 1
        if name == "chunk_events":  # the Chrome trace's text is assembled a chunk at a time
            return min(self.events, CHROME_CHUNK_ROWS)
        if name == "trace_events":  # past its bound the Chrome trace holds some hosts' events only
            return min(self.events, CHROME_TRACE_MAX_EVENTS)
        if name == "every_rank_events":  # the rows of a timeline of every rank
            return self.events if self.scope == EVERY_RANK else 0
        if name == "scoped_events":  # the rows of a timeline of one rank a stage
            return 0 if self.scope == EVERY_RANK else self.events
        return int(getattr(self, name))


@dataclass(frozen=True)
class Term:
    """``rows`` (a :class:`JobSize` quantity) x ``row_bytes`` x ``copies`` bytes of a stage's peak."""

    rows: str
    row_bytes: int
    copies: float
    what: str


def _fixed(mib: int, what: str) -> Term:
    """A stage's working set that does not grow with the job (a figure's canvas, Arrow's kernels and pool)."""
    return Term("one", mib << 20, 1.0, what)


def _pair_term(copies: float, what: str) -> Term:
    return Term("pair_rows", CELL, copies, what)  # SPARSE_ROW replaces CELL for a sparse table (estimate)


#: Each stage's terms: what it holds at its peak. The copies are the measured peak over rows x row bytes,
#: rounded up (``benchmarks/stage_memory.py``; docs/BENCHMARKS.md "Host memory per stage").
STAGE_TERMS: dict[str, tuple[Term, ...]] = {
    "raw_timeline": (
        _fixed(64, "the fabric, kernel tables"),
        # a row of a timeline of every rank: opus_small 1,273 MiB over the interpreter for 2,089,540 rows (4.2
        # RAW_ROW), the shipped W5 32x8 at most 5.2 (its whole build: 870 MiB over 784,000 rows): 6. A row of a
        # timeline of one rank a stage costs more, the compressed simulator's state outgrowing the rows it emits:
        # Llama 3 405B on 2,048 GPUs 3,311 MiB over 1,815,327 rows (11.6 RAW_ROW): 13 (docs/BENCHMARKS.md "Host
        # memory per stage")
        Term("every_rank_events", RAW_ROW, 6.0, "the simulated DAG, the rows as Python lists, the frame, Arrow"),
        Term("scoped_events", RAW_ROW, 13.0, "the compressed simulation, the rows, the frame and its Arrow copy"),
        # the DAG of every rank behind a timeline of one rank a stage: measured 391 MiB over 2,927,736 rows of
        # every rank (134 B a row, 0.9 RAW_ROW; Megatron TP 4 PP 2 DP 16 on 32 x 4, the ranks of a stage differ
        # under hash ECMP; docs/BENCHMARKS.md "Host memory per stage"), rounded up to 2 rows
        Term("dag_events", RAW_ROW, 2.0, "the simulated DAG of every rank (the timeline holds one rank a stage)"),
    ),
    "chrome_trace": (
        _fixed(64, "Arrow's string kernels, the gzip stream"),
        Term("chunk_events", RAW_ROW, 28.0, "one chunk of the JSON text (trace_writer.CHUNK_ROWS rows)"),
        Term("trace_events", RAW_ROW, 3.0, "the integer columns of the rows written"),
    ),
    "validated_flows": (
        _fixed(64, "the step detector's tables"),
        Term("events", RAW_ROW, 6.0, "the raw timeline decoded into flows and compute events"),
    ),
    "binned_flows": (
        _fixed(64, "the placement's tables"),
        Term("step_network_flows", STEP_FLOW_ROW, 8.0, "the step's flows and their placement"),
        _pair_term(3.0, "the per-pair bin table and its write"),
    ),
    "link_bins": (
        _fixed(64, "the routes' tables"),
        Term("step_network_flows", STEP_FLOW_ROW, 16.0, "the step's flows, their NICs and routes"),
        Term("link_cells", CELL, 3.0, "the (bins, links) matrix and its write"),
    ),
    "window_features": (
        _fixed(64, "the feature registry's frames"),
        _pair_term(4.0, "the per-pair bins read back, per-window sums"),
    ),
    "run_summary": (_fixed(32, "the summary row"), Term("network_flows", FLOW_ROW, 1.0, "the flows table")),
    "step_anatomy": (
        _fixed(64, "the chart"),
        Term("compute_events", RAW_ROW, 3.0, "the compute events and the steps' flows"),
    ),
    "reconfig": (
        _fixed(128, "the CDF and sweep figures"),
        Term("network_flows", FLOW_ROW, 5.0, "the flows by NIC pair, phases and windows"),
        # the re-timed sweep: the EPS run's DAG and the current point's, every rank, two iterations; measured
        # 306 MiB over 975,928 such rows (329 B a row for the two; Megatron TP 4 PP 2 DP 8 on 16 x 4 rails,
        # delays 0 and 1 ms, docs/BENCHMARKS.md "Host memory per stage"), counted as 2 DAGs of 2 rows each
        Term("sweep_events", RAW_ROW, 4.0, "the sweep's simulated DAGs of every rank (reconfig.sweep_delays_ms)"),
    ),
    "run_plots": (
        _fixed(160, "the figures' canvases"),
        _pair_term(5.0, "the per-pair bins and the time series"),
        Term("host_cells", CELL, 4.0, "the host-pair heatmap"),
        Term("link_cells", CELL, 2.0, "the link utilisation"),
    ),
}


@dataclass(frozen=True)
class StageEstimate:
    """One stage's estimated peak: ``mib`` = :data:`BASELINE_MIB` + its ``terms`` (name -> MiB)."""

    stage: str
    mib: float
    terms: dict[str, float]


def _term_bytes(term: Term, size: JobSize) -> float:
    rb = SPARSE_ROW if term.rows == "pair_rows" and size.sparse else term.row_bytes
    return size.rows(term.rows) * rb * term.copies


def estimate_stages(size: JobSize) -> list[StageEstimate]:
    """Every per-run stage's estimated peak RSS, MiB, in graph order (:data:`STAGE_TERMS`)."""
    out = []
    for stage in STAGES:
        terms = {f"{t.rows} ({t.what})": _term_bytes(t, size) / 2**20 for t in STAGE_TERMS[stage]}
        out.append(StageEstimate(stage, BASELINE_MIB + sum(terms.values()), terms))
    return out


def largest_stage(size: JobSize) -> StageEstimate:
    """The stage with the largest estimate (the first of equals)."""
    return max(estimate_stages(size), key=lambda e: e.mib)


def max_host_gib() -> float:
    """:data:`MAX_HOST_GIB`, or ``$PHANTORA_ASSETS_MAX_HOST_GIB`` when it is a positive number (GiB)."""
    raw = os.environ.get(MAX_HOST_GIB_ENV, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return MAX_HOST_GIB
    return value if value > 0 else MAX_HOST_GIB


def applies(spec: RunSpec) -> bool:
    """Whether the estimate covers ``spec``: a run of the analytic simulator with a workload."""
    return spec.source == "analytic" and bool(spec.workload)


# ----------------------------------------------------------------------------------------- counting
def _flow_ends(item: Collective | AllToAll | SendRecv, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) global ranks of ``item``'s flows on a communicator of ``ranks`` (the ring rules of
    ``lib/traffic/ring.ring_flows``, as ``AnalyticSimulator.flows_of`` expands them)."""
    n = len(ranks)
    if isinstance(item, SendRecv):
        idx = np.asarray(item.pairs, dtype=np.int64).reshape(-1, 2)
        return ranks[idx[:, 0]], ranks[idx[:, 1]]
    if n <= 1:
        return ranks[:0], ranks[:0]
    if isinstance(item, AllToAll):
        s, d = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        off = s != d
        return ranks[s[off]], ranks[d[off]]
    if item.op in RING_OPS:
        i = np.arange(n)
        return ranks[i], ranks[(i + 1) % n]
    if item.op == "broadcast":
        others = np.array([r for r in range(n) if r != item.root], dtype=np.int64)
        return np.full(len(others), ranks[item.root]), ranks[others]
    raise ValueError(f"unknown collective op {item.op!r}")


def _shape(item: Collective | AllToAll | SendRecv) -> tuple:
    if isinstance(item, SendRecv):
        return ("p2p", item.pairs)
    if isinstance(item, AllToAll):
        return ("a2a",)
    return ("ring",) if item.op in RING_OPS else ("bcast", item.root)


@functools.lru_cache(maxsize=64)
def _step_flows(spec: RunSpec, scope: str, warmup: bool) -> tuple[int, int, int, np.ndarray]:
    """(compute events, flow events, network flows, sorted unique src * hosts + dst keys of the network flows)
    of one step's program in a timeline of ``scope`` (``warmup``: the first iteration, init program included),
    counted as ``lib/workload/collectives.trace_events_per_step`` counts the events."""
    model = WorkloadModel(spec)
    programs = model.stage_programs(warmup)
    if warmup:
        programs = [model.init_program(st) + prog for st, prog in enumerate(programs)]
    G, H = spec.gpus_per_node, spec.n_nodes
    compute = flows = network = 0
    keys: list[np.ndarray] = []
    seen_p2p: set[str] = set()
    kept: dict[tuple[str, int], list] = {}  # (kind, stage) -> the communicators the scope holds
    per_group: dict[tuple, tuple[int, int]] = {}  # (shape, kind, stage) -> (flows, network flows) over them
    for stage, program in enumerate(programs):
        ranks_here = len(model.stage_ranks(stage)) if scope == EVERY_RANK else 1
        for item in program:
            if not isinstance(item, (Collective, AllToAll, SendRecv)):
                compute += ranks_here
                continue
            if item.kind == "pp":
                if item.tag in seen_p2p:
                    continue
                seen_p2p.add(item.tag)
            gk = (_shape(item), item.kind, stage)
            hit = per_group.get(gk)
            if hit is None:
                comms = kept.get((item.kind, stage))
                if comms is None:
                    comms = kept[(item.kind, stage)] = [
                        c
                        for c in stage_communicators(model, item.kind, stage)
                        if scope == EVERY_RANK or scope_keeps(c.ranks, G)
                    ]
                n_flows = n_net = 0
                for comm in comms:
                    src, dst = _flow_ends(item, np.asarray(comm.ranks, dtype=np.int64))
                    hs, hd = src // G, dst // G
                    cross = hs != hd
                    n_flows += len(src)
                    n_net += int(cross.sum())
                    if cross.any():
                        keys.append(np.unique(hs[cross] * H + hd[cross]))
                hit = per_group[gk] = (n_flows, n_net)
            flows += hit[0]
            network += hit[1]
    uniq = np.unique(np.concatenate(keys)) if keys else np.zeros(0, dtype=np.int64)
    return compute, flows, network, uniq


def network_pairs(spec: RunSpec) -> int:
    """Ordered host pairs that carry network flows in a steady step of ``spec`` (every flow between hosts is
    in every timeline scope): what ``binned_flows`` counts from the step's flows for
    ``bin_table.sparse_rows_rule``, here from the layout's communicators."""
    return len(_step_flows(spec, EVERY_RANK, False)[3])


def _link_count(spec: RunSpec) -> int:
    from phantora_assets.lib.net.fabric import build_fabric
    from phantora_assets.lib.phantora.netconfig import netconfig_for
    from phantora_assets.lib.sim.network import Topology

    if spec.cluster["topology"] != "TwoLayerMultiPath":
        return int(build_fabric(spec.cluster, spec.n_nodes, spec.gpus_per_node).n_links)
    return int(Topology.from_netconfig(netconfig_for(spec)).n_links)


def simulates_every_rank(spec: RunSpec) -> bool:
    """Whether the analytic simulator runs ``spec`` with the DAG of every rank before any check
    (``AnalyticSimulator``: optical rails, ``reconfig.mode``, are never simulated one rank a stage; a run of one
    rank a stage has no other)."""
    from phantora_assets.lib.net.optical import run_config

    return run_config(dict(spec.reconfig)) is not None or spec.world_size == spec.par.pp


def job_size(
    spec: RunSpec, iterations: int | None = None, warmup: bool = True, every_rank: bool | None = None
) -> JobSize:
    """The sizes of ``spec``'s tables (:class:`JobSize`), counted from its step programs, its layout's
    communicators and its network; nothing simulated. ``iterations``/``warmup`` as ``AnalyticSimulator``'s.
    ``every_rank``: whether the simulator holds the DAG of every rank (None: :func:`simulates_every_rank`;
    True: also what a run whose ranks of a stage differ falls back to); with a timeline of one rank a stage,
    that DAG's rows are ``dag_events``.

    Raises:
        RunMatrixError: the network of the run cannot be built (its topology's own rule).
    """
    from phantora_assets.lib.sim.analytic import timeline_scope  # analytic states this module's rule

    n = int(iterations or spec.wl.train.iterations)
    scope = timeline_scope(spec, n, warmup)[0]
    if every_rank is None:
        every_rank = simulates_every_rank(spec)
    dag_events = 0
    if every_rank and scope != EVERY_RANK:
        dag_events = trace_events(spec, EVERY_RANK, n, warmup)
    sweep_events = 0
    if dict(spec.reconfig).get("sweep_delays_ms"):  # reconfig_sim: min(iterations, 2), the warm-up included
        sweep_events = trace_events(spec, EVERY_RANK, min(int(spec.wl.train.iterations), 2), True)
    s_comp, s_flows, s_net, _ = _step_flows(spec, scope, False)
    if warmup and n >= 1:
        w_comp, w_flows, w_net, _ = _step_flows(spec, scope, True)
        comp, fl, net = w_comp + s_comp * (n - 1), w_flows + s_flows * (n - 1), w_net + s_net * (n - 1)
    else:
        comp, fl, net = s_comp * n, s_flows * n, s_net * n
    bins = int(round(WINDOW_S * 1e9)) // int(round(spec.bin_s * 1e9))
    sparse = bin_table.is_sparse(spec.n_nodes, WINDOW_S, spec.bin_s)
    pairs = network_pairs(spec)
    pair_rows = bins * pairs if sparse else bin_table.dense_cells(spec.n_nodes, WINDOW_S, spec.bin_s)
    return JobSize(
        hosts=spec.n_nodes,
        scope=scope,
        events=comp + fl,
        flow_events=fl,
        compute_events=comp,
        network_flows=net,
        step_network_flows=s_net,
        pairs=pairs,
        bins=bins,
        sparse=sparse,
        pair_rows=pair_rows,
        links=_link_count(spec),
        dag_events=dag_events,
        sweep_events=sweep_events,
    )


def host_memory_rule(
    spec: RunSpec, iterations: int | None = None, warmup: bool = True, every_rank: bool | None = None
) -> str | None:
    """Why ``spec`` is refused before simulating for host memory, or None: its largest stage's estimate
    (:func:`largest_stage`) exceeds :func:`max_host_gib`, or its sparse per-pair table would exceed
    ``bin_table.max_sparse_rows`` (``bin_table.sparse_rows_rule`` over the host pairs its collectives connect,
    the rule ``binned_flows`` checks again from the step's flows). A run the estimate does not cover
    (:func:`applies`) is never refused here. The message names the stage, the estimate and the bound.
    ``every_rank`` as :func:`job_size`'s (True: the simulation of every rank a run whose ranks of a stage differ
    falls back to, checked by the simulator when it does)."""
    if not applies(spec):
        return None
    size = job_size(spec, iterations, warmup, every_rank)
    if size.sparse and (why := bin_table.sparse_rows_rule(size.bins, size.pairs)) is not None:
        return f"binned_flows: bin table too large: {why}"
    top, bound = largest_stage(size), max_host_gib()
    if top.mib <= bound * 1024:
        return None
    terms = ", ".join(f"{k} {v:,.0f} MiB" for k, v in top.terms.items())
    return (
        f"host memory: the {top.stage} stage would peak at about {top.mib / 1024:.2f} GiB ({BASELINE_MIB} MiB "
        f"baseline + {terms}; lib/stage_memory.py), more than the {bound:g} GiB bound of ${MAX_HOST_GIB_ENV}: "
        "refused before simulating; lower train.iterations (>= 3), the micro-batches per step or the layout, use "
        "a wider bin_s, or set the variable on a host with the memory"
    )
