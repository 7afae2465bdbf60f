"""The embedded analytic simulator: a pure-Python stand-in for Phantora.

From a :class:`~phantora_assets.lib.sim.workloads.WorkloadModel` it runs ``iterations`` training
steps (the first is warm-up: parameter broadcasts before it, Adam state initialisation, no
ZeRO-3 trace yet) and emits Phantora's event schema as a raw-timeline DataFrame
(``columns.RAW_TIMELINE_COLUMNS``): one computation event per rank per compute item, one
communication event per ring flow (loopback hops included, as Phantora does).

Timing model (documented, per GPU model, never per run):

* **compute**: every compute item is a list of the torch calls Phantora intercepts
  (``lib.sim.torch_ops``), each timed by the GPU's perf DB when it holds the call's key, else by the
  roofline of ``gpus.toml`` (``lib.sim.kernels``). The fraction of compute time that came from the
  DB is reported (``SimulationResult.db_fraction``).
* **network**: the flows of a collective start when the collective starts; a flow-level
  simulator of the TwoLayerMultiPath topology of the run's ``netconfig.toml`` (``lib.sim.network``,
  ``lib.phantora.netconfig``) shares links by per-flow
  max-min fairness, recomputed at every flow start and end; loopback flows run at the loopback
  speed. A collective ends with its last flow. Collectives of <= 4 KiB take 0 us (as in
  Phantora traces).
* **streams**: each rank has one compute stream; each communicator one NCCL stream (its
  collectives run in issue order). A collective starts when its stream is free and every
  member rank has issued it (it waits for the compute issued before it). A *blocking*
  collective is waited for by the next compute on every member rank (TP all-reduce, MoE
  all-to-all, DeepSpeed ZeRO-0); an asynchronous one only by the compute items that name its tag
  (Megatron overlapped grad reduce-scatter and param all-gather, ZeRO-3 prefetched gathers and
  overlapped reduce-scatters: see ``workloads``). Each iteration ends with a synchronisation
  (``torch.cuda.synchronize()`` / ``loss.cpu()`` in Phantora's test scripts, and the next step's
  first collective lines the ranks up), modelled as a barrier: the next iteration starts when every
  stream of every rank is idle. Every steady iteration therefore starts from the same state, so
  the warm-up and the first steady iteration are simulated and the later ones are that steady
  iteration replicated with their own jitter factor (all event times of the step scaled by it);
  ``replicate=False`` simulates every iteration (the tests check both agree within 0.5 %), as a run on a
  reconfigured optical network always does (its delays are no compute: a replica would scale them).
* warm-up step: compute x 1.2; every step gets a deterministic +-0.1 % compute jitter seeded by
  the job (``RunSpec.job_key``: the run id without its fabric, optical or name tails; Phantora's steps
  differ by ~0.1 %).

Exposed communication of a step = step time minus the compute stream's busy time on rank 0.

This module holds the simulator: the DAG of one run's programs and its event loop. The result
type and the raw-timeline assembly are in :mod:`~phantora_assets.lib.sim.timeline`, the seeds,
communicator ids and perf-DB key helpers in :mod:`~phantora_assets.lib.sim.keys`.

Raises nothing for non-fitting runs: :func:`simulate` returns ``fits=False`` with the memory
estimate and an empty timeline.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Any

import numpy as np

from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.net.fabric import Fabric, build_fabric
from phantora_assets.lib.net.optical import OpticalConfig, OpticalRails, run_config
from phantora_assets.lib.phantora.netconfig import netconfig_for
from phantora_assets.lib.phantora.perfdb import perfdb_folder
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.kernels import KernelTimer
from phantora_assets.lib.sim.keys import seed_of
from phantora_assets.lib.sim.memory import estimate_memory
from phantora_assets.lib.sim.network import FlowNetwork, Topology
from phantora_assets.lib.sim.symmetry import AsymmetricRanks, OrbitFlows, group_ends, orbit_flows, orbits
from phantora_assets.lib.sim.timeline import IterationTimes, SimulatedDag, SimulationResult, emit_raw_timeline
from phantora_assets.lib.sim.workload_types import AllToAll, Collective, Communicator, Compute, Item, SendRecv
from phantora_assets.lib.sim.workloads import WorkloadModel
from phantora_assets.lib.stage_memory import host_memory_rule
from phantora_assets.lib.traffic.ring import DTYPE_BYTES, ring_flows
from phantora_assets.lib.workload.collectives import (
    EVERY_RANK,
    ONE_RANK_A_STAGE,
    compute_hosts,
    representatives,
    scope_keeps,
    trace_events,
)
from phantora_assets.lib.workload.dag import build_dag, stage_rank_range
from phantora_assets.lib.workload.placement import GROUP_OF_KIND

TINY_COLLECTIVE_BYTES = 4096
#: Most events (compute items x ranks + flows, every iteration) a simulated trace of every rank may hold: the
#: largest trace measured through every per-run asset within 2 GiB peak RSS a stage (Llama-3-70B TP=8 PP=8 DP=16
#: on 128x8, 3.73 M events: raw_timeline 2022 MiB; benchmarks/pipeline_scale.py, docs/WORKLOADS.md "Scale").
#: A run past it is emitted with scope ``one rank a stage`` (``lib/workload/collectives.TIMELINE_SCOPES``),
#: which is held to the same bound.
MAX_TRACE_EVENTS = 3_800_000
WARMUP_COMPUTE_FACTOR = 1.2
STEP_JITTER = 0.001


def timeline_scope(spec: RunSpec, iterations: int | None = None, warmup: bool = True) -> tuple[str, int]:
    """What the run's raw timeline holds and how many events (``lib/workload/collectives.TIMELINE_SCOPES``,
    ``trace_events``: the init and warm-up iteration counted as run, ``warmup`` as :class:`AnalyticSimulator`'s):
    every rank when that is within :data:`MAX_TRACE_EVENTS`, else one rank a stage (every network flow,
    the compute of each stage's first rank)."""
    iterations = int(iterations or spec.wl.train.iterations)
    events = trace_events(spec, EVERY_RANK, iterations, warmup)
    if events <= MAX_TRACE_EVENTS:
        return EVERY_RANK, events
    return ONE_RANK_A_STAGE, trace_events(spec, ONE_RANK_A_STAGE, iterations, warmup)


def trace_bound_rule(spec: RunSpec, iterations: int | None = None, warmup: bool = True) -> str | None:
    """Why the analytic simulator refuses ``spec`` before simulating (its trace, even of scope one rank a
    stage, would hold more than :data:`MAX_TRACE_EVENTS` events: ``lib/workload/collectives.trace_events``,
    the first iteration with its init broadcasts and the steady ones), or None. ``phantora-assets runs``
    states the same rule, so a run it shows as fitting is not refused at build."""
    iterations = int(iterations or spec.wl.train.iterations)
    scope, events = timeline_scope(spec, iterations, warmup)
    if events <= MAX_TRACE_EVENTS:
        return None
    return (
        f"the trace would hold about {events:,} events ({iterations} iterations; {scope}: every network flow "
        f"and the compute of one rank a pipeline stage), more than the {MAX_TRACE_EVENTS:,} the per-run assets "
        "build within their memory bound: refused before simulating; lower train.iterations (>= 3), the "
        "micro-batches per step or the layout"
    )


class AnalyticSimulator:
    """Simulate one run (see module docstring). Construct once per run."""

    def __init__(  # noqa: PLR0913 (the run and its simulation's switches, keyword-only after spec)
        self,
        spec: RunSpec,
        iterations: int | None = None,
        perfdb_dir: str | Path | None = "default",
        emit: bool = True,
        replicate: bool = True,
        warmup: bool = True,
        compress: bool = True,
        optical: OpticalConfig | None | str = "run",
        schedule: dict[int, list[str]] | None = None,
        keep_schedule: bool = False,
    ) -> None:
        self.spec = spec
        self.model = WorkloadModel(spec)
        self.iterations = int(iterations or spec.wl.train.iterations)
        self.G = spec.gpus_per_node
        self.world = spec.world_size
        # seeded by the job, not the run id: the same job on another fabric, optical network or name gets the
        # same jitter, so comparing them is exact (RunSpec.job_key; was spec.run_id: an _ocs_ run's steps
        # differed from its EPS twin's by up to 0.1 % of jitter)
        self.rng = np.random.default_rng(seed_of(spec.job_key, "analytic"))
        if perfdb_dir == "default":
            perfdb_dir = perfdb_folder(spec.gpu, spec.gpu_spec)
        self._perfdb_dir = perfdb_dir
        self.timer = KernelTimer(spec.gpu_spec, perfdb_dir)
        # the network of the run's netconfig.toml (lib/phantora/netconfig.py writes the same dict to config/)
        if spec.cluster["topology"] == "TwoLayerMultiPath":
            ecmp = str(spec.cluster.get("ecmp", "hash"))
            self.topology: Any = Topology.from_netconfig(netconfig_for(spec), ecmp=ecmp)
        else:  # a fabric of lib/net/fabric.py: flows leave the sending GPU's NIC (docs/FABRIC.md)
            self.topology = build_fabric(spec.cluster, spec.n_nodes, spec.gpus_per_node)
        self.emit = emit
        self.replicate = replicate
        self.warmup = warmup  # False: every iteration is a steady step (no init, no warm-up step)
        # the optical rails (lib/net/optical.py): "run" = the run's own reconfig table (None: the EPS, as before)
        self.optical: OpticalConfig | None = run_config(dict(spec.reconfig)) if isinstance(optical, str) else optical
        if self.optical is not None and (
            not isinstance(self.topology, Fabric) or not self.topology.optical_endpoints.any()
        ):
            raise ValueError(
                f"{spec.run_id}: optical rails need a rail fabric or an Arbitrary file with optical = true switches "
                f"under NICs, not {spec.cluster['topology']} without"
            )
        self.schedule = schedule  # a provisioned run's ports' sequences of groups (the EPS run's log)
        self.rails: OpticalRails | None = None
        # one rank a stage, checked (lib/sim/symmetry.py); False: every rank. Optical rails run every rank: the
        # circuit states of a stage's ranks' NICs need not be alike (docs/SIMULATOR.md)
        self.compress = compress and self.optical is None
        # a reconfigured network simulates every iteration: a replicated step scales every event time by its
        # jitter factor, the reconfiguration delays too (a fixed time of the switch, not compute: 2 D read
        # 2 D x f_k / f_1), so an _ocs_ run's steps would differ from its EPS twin's by more than the delays
        if self.optical is not None and self.optical.mode != "eps":
            self.replicate = False
        self.symmetry = ""
        self.scope = EVERY_RANK
        self.keep_schedule = keep_schedule  # True: run() leaves the simulated DAG in ``simulated`` (lib/chakra)
        self.simulated: tuple[SimulatedDag, IterationTimes, list[list[Item]]] | None = None
        self._flow_cache: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._orbits: dict[int, list[int]] = {}
        self._orbit_cache: dict[tuple, OrbitFlows] = {}

    # --------------------------------------------------------------- pieces
    def _endpoints(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Network endpoints of rank pairs: hosts on TwoLayerMultiPath, NICs on a fabric (one endpoint
        twice inside a scale-up domain: the simulator's loopback)."""
        if isinstance(self.topology, Topology):
            return src // self.G, dst // self.G
        return self.topology.endpoints(src, dst)

    def _host(self, rank: int) -> int:
        return rank // self.G

    def flows_of(self, item: Collective | AllToAll | SendRecv, comm: Communicator) -> list[tuple[int, int, int]]:
        """(src global rank, dst global rank, bytes) of ``item`` on ``comm``."""
        if isinstance(item, SendRecv):
            b = item.count * DTYPE_BYTES[item.dtype]
            return [(comm.ranks[x], comm.ranks[y], b) for x, y in item.pairs]
        if isinstance(item, AllToAll):
            b = item.count * DTYPE_BYTES[item.dtype]
            return [(s, d, b) for s in comm.ranks for d in comm.ranks if s != d]
        return [
            (comm.ranks[a], comm.ranks[b], by)
            for a, b, by in ring_flows(item.op, item.count, DTYPE_BYTES[item.dtype], len(comm.ranks), item.root)
        ]

    @staticmethod
    def _flow_key(item: Collective | AllToAll | SendRecv, comm: Communicator) -> tuple:
        return (
            type(item).__name__,
            getattr(item, "op", getattr(item, "pairs", "a2a")),
            item.count,
            item.dtype,
            getattr(item, "root", 0),
            comm.name,
        )

    def _flows_arrays(
        self, item: Collective | AllToAll | SendRecv, comm: Communicator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = self._flow_key(item, comm)
        hit = self._flow_cache.get(key)
        if hit is None:
            fl = self.flows_of(item, comm)
            arr = np.array(fl, dtype=np.int64).reshape(-1, 3)
            hit = self._flow_cache[key] = (arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy())
        return hit

    def network_bytes_per_step(self) -> int:
        """Network bytes (source host != destination host) of one steady step, both directions."""
        total = 0
        model = self.model
        seen: set[str] = set()
        for st, program in enumerate(model.stage_programs()):
            for item in program:
                if not isinstance(item, (Collective, AllToAll, SendRecv)):
                    continue
                comms = model.comms[item.kind]
                if item.kind == "pp":
                    if item.tag in seen:
                        continue
                    seen.add(item.tag)
                elif model.spec.par.pp > 1:
                    ranks = model.stage_ranks(st)
                    comms = [c for c in comms if c.ranks[0] in ranks]
                for comm in comms:
                    src, dst, nbytes = self._flows_arrays(item, comm)
                    total += int(nbytes[(src // self.G) != (dst // self.G)].sum())
        return total

    # --------------------------------------------------------------- main loop
    def _admit(self) -> None:
        """The rules a fitting run meets before it is simulated, and what they decide: the trace bound and every
        stage's host memory (``lib/stage_memory``) when a timeline is emitted (``RunMatrixError`` naming the
        rule otherwise), the timeline scope, and a provisioned optical run's EPS schedule."""
        spec = self.spec
        if self.emit and (why := trace_bound_rule(spec, self.iterations, self.warmup)) is not None:
            raise RunMatrixError(f"{spec.run_id}: {why}")
        every_rank = not self.compress or self.world == self.spec.par.pp
        if self.emit and (why := host_memory_rule(spec, self.iterations, self.warmup, every_rank)) is not None:
            raise RunMatrixError(f"{spec.run_id}: {why}")
        self.scope = timeline_scope(spec, self.iterations, self.warmup)[0] if self.emit else EVERY_RANK
        if self.optical is not None and self.optical.mode == "provisioned" and self.schedule is None:
            self.schedule = self._eps_schedule()

    def _admit_every_rank(self, why: AsymmetricRanks) -> None:
        """The host-memory rule of the simulation of every rank a run falls back to when the ranks of a stage
        differ (``why``): behind a timeline of one rank a stage its DAG is a term of its own (``lib/stage_memory``
        ``dag_events``), not known before the check; ``RunMatrixError`` naming the rule rather than a build past
        the bound."""
        spec = self.spec
        if not self.emit or self.scope == EVERY_RANK:
            return
        if (bound := host_memory_rule(spec, self.iterations, self.warmup, True)) is not None:
            raise RunMatrixError(
                f"{spec.run_id}: the ranks of a stage differ ({why}), so every rank is simulated: {bound}"
            ) from None

    def run(self) -> SimulationResult:
        spec, model = self.spec, self.model
        memory = estimate_memory(model)
        if not memory.fits:
            return SimulationResult(spec, memory, None)
        self._admit()
        comm_list = [c for cs in model.comms.values() for c in cs]
        stages = model.stage_programs(warmup=False)
        warm_stages = model.stage_programs(warmup=True)
        n_stages = len(stages)
        steady_progs = stages
        warm_progs = [model.init_program(st) + warm_stages[st] for st in range(n_stages)] if self.warmup else stages
        iters = self.iterations
        factors = [
            (WARMUP_COMPUTE_FACTOR if it == 0 and self.warmup else 1.0)
            * (1.0 + STEP_JITTER * float(self.rng.standard_normal()))
            for it in range(iters)
        ]
        n_sim = min(iters, 2) if self.replicate else iters

        # ---- per-item base durations
        base: dict[int, float] = {}
        db_ns: dict[int, float] = {}
        for progs in (warm_progs, steady_progs):
            for prog in progs:
                for item in prog:
                    if isinstance(item, Compute) and id(item) not in base:
                        base[id(item)], db_ns[id(item)] = self.timer.time_kernels(item.kernels)

        # ---- the DAG (lib/workload/dag.py) of one rank a stage, checked (lib/sim/symmetry.py), else of every rank
        sim = None
        alike = self.world == n_stages  # every rank of a stage runs as its first rank does (checked, or one rank)
        if self.compress and self.world > n_stages:  # a stage of more than one rank
            try:
                sim = self._simulate(comm_list, warm_progs, steady_progs, base, factors, n_sim, True)
                alike = True
                self.symmetry = (
                    f"one rank a stage: {n_stages} of {self.world} ranks simulated, the others checked equal"
                )
            except AsymmetricRanks as why:
                self.symmetry = f"every rank (the ranks of a stage differ: {why})"
                self._admit_every_rank(why)
        if sim is None:
            sim = self._simulate(comm_list, warm_progs, steady_progs, base, factors, n_sim, False)
            if self.optical is not None:
                self.symmetry = "every rank (optical rails: circuit states need not be alike across a stage)"
            self.symmetry = self.symmetry or "every rank"
        kind, who, iter_of, start, end = sim.kind, sim.who, sim.iter_of, sim.start, sim.end

        # ---- iterations: simulated ones, then the steady one replicated with its jitter
        it_arr = np.array(iter_of)
        k_arr = np.array(kind)
        bars = np.nonzero(k_arr == 2)[0]
        sim_end = end[bars]
        sim_start = np.concatenate([[0.0], sim_end[:-1]])
        durations = list(sim_end - sim_start)
        for it in range(n_sim, iters):
            durations.append(durations[1] * factors[it] / factors[1])
        iteration_ns = [int(round(d)) for d in durations]
        who_arr = np.array(who)
        r0 = (k_arr == 0) & (who_arr == 0)
        busy = [float((end - start)[r0 & (it_arr == i)].sum()) for i in range(n_sim)]
        busy += [busy[1] * factors[it] / factors[1] for it in range(n_sim, iters)]
        first_steady = 1 if iters > 1 else 0  # a single simulated step counts as the steady one
        exposed = [max(0.0, durations[i] - busy[i]) for i in range(first_steady, iters)]
        steady_items = [i for i in steady_progs[0] if isinstance(i, Compute)]
        comp_step = sum(base[id(i)] for i in steady_items)
        from_db = sum(db_ns[id(i)] for i in steady_items)
        n_k = sum(len(i.kernels) for i in steady_items)
        n_db = sum(1 for i in steady_items for k in i.kernels if self.timer.lookup(k)[1])
        timeline = None
        times = IterationTimes(list(sim_start), durations, factors, n_sim)
        if self.keep_schedule:
            self.simulated = (sim, times, steady_progs)
        keep = None if self.scope == EVERY_RANK else representatives(spec)  # every rank without emit
        if self.emit:
            timeline = emit_raw_timeline(spec, self._flows_arrays, sim, times, keep)
        return SimulationResult(
            spec,
            memory,
            timeline,
            iteration_ns,
            int(round(busy[first_steady])),
            (from_db / comp_step) if comp_step else 0.0,
            int(round(float(np.median(exposed)))),
            n_k,
            n_db,
            self.symmetry,
            self.scope,
            # the hosts whose compute a scoped timeline holds whole (step_anatomy reports those only)
            None if keep is None else compute_hosts(spec, alike),
        )

    def _eps_schedule(self) -> dict[int, list[str]]:
        """A provisioned run's schedule when none is given: each port's sequence of groups in the same job on
        the EPS (lib/net/optical.py "Modes"), simulated as this run is (every rank, every iteration, the same
        seed). Was none: a run's own ``reconfig = { mode = "provisioned" }`` network never provisioned and
        was its on-demand twin (EPS + 2 D on a DP x PP job whose sweep's provisioned row hides 2 ms of it)."""
        assert self.optical is not None
        eps = AnalyticSimulator(
            self.spec,
            iterations=self.iterations,
            perfdb_dir=self._perfdb_dir,
            emit=False,
            replicate=self.replicate,
            warmup=self.warmup,
            compress=False,
            optical=OpticalConfig("eps", 0.0, self.optical.packet_bytes),
        )
        eps.run()
        return eps.rails.log if eps.rails is not None else {}

    def _simulate(
        self, comm_list, warm_progs, steady_progs, base, factors, n_sim: int, representatives: bool
    ) -> SimulatedDag:
        """Build the DAG (of every rank, or of one rank a stage), run it, and give the simulated DAG with
        every communicator's flows (each group expanded and checked, ``lib/sim/symmetry.group_ends``).

        Raises:
            AsymmetricRanks: (``representatives``) a group's communicators end a call apart.
            RuntimeError: DAG nodes never ran (a generator bug).
        """
        model = self.model
        kind, dur, who, what, iter_of, dependents, deps_left = build_dag(
            model, comm_list, warm_progs, steady_progs, base, factors, n_sim, representatives
        )
        n_stages = len(steady_progs)
        self._orbits = orbits(model, comm_list, n_stages) if representatives else {}
        self._orbit_cache = {}
        start, end, flow_first, flow_end, orbit_first = self._event_loop(
            kind, dur, who, what, dependents, deps_left, comm_list
        )
        if self.unfinished:
            raise RuntimeError(
                f"{self.spec.run_id}: {self.unfinished} of {len(kind)} DAG nodes never ran: the step programs wait in "
                "a cycle (a pipeline schedule whose sends and receives do not match): a generator bug"
            )
        self.n_nodes, self.n_flows = len(kind), len(flow_end)
        # a timeline of scope one rank a stage leaves out the communicators inside one host (scope_keeps): their
        # flows' ends are checked (group_ends) and not held. They were most of raw_timeline's memory at TP 32 in
        # a host: every TP call's ends on each of the stage's TP communicators, about 1 KB a row emitted
        kept = None if self.scope == EVERY_RANK else [scope_keeps(c.ranks, self.G) for c in comm_list]
        flow_groups: dict[int, list[tuple[int, np.ndarray]]] = {}
        for n, first in flow_first.items():
            item = what[n]
            src, _, _ = self._flows_arrays(item, comm_list[who[n]])
            rep_ends = flow_end[first : first + len(src)]
            orbit = self._orbit_cache.get(self._flow_key(item, comm_list[who[n]])) if representatives else None
            if orbit is None:
                groups = [(who[n], rep_ends)]
            else:
                o_first, rep_net = orbit_first[n]
                o_ends = None if o_first < 0 else flow_end[o_first : o_first + orbit.n_net]
                groups = group_ends(item, orbit, rep_ends, o_ends, float(start[n]), rep_net)
            flow_groups[n] = groups if kept is None else [g for g in groups if kept[g[0]]]
        if representatives:
            stages = [list(stage_rank_range(model, st, n_stages)) for st in range(n_stages)]
            ranks_of = {ranks[0]: ranks for ranks in stages}
        else:
            ranks_of = {r: [r] for r in range(self.world)}
        return SimulatedDag(kind, who, what, iter_of, start, end, flow_groups, ranks_of, comm_list)

    def _event_loop(self, kind, dur, who, what, dependents, deps_left, comm_list):  # noqa: C901, PLR0912, PLR0915 (the DAG's event loop, every node kind in it)
        """Run the DAG: compute nodes take their duration, collective nodes inject their flows into
        the network simulator and end with their last flow, barriers take no time."""
        n_nodes = len(kind)
        start = np.zeros(n_nodes)
        end = np.zeros(n_nodes)
        ready = [0.0] * n_nodes
        net = FlowNetwork(self.topology)
        heap: list[tuple[float, int, int]] = []  # (time, node, event) 0 = compute end, 1 = collective start
        pending: dict[int, int] = {}
        flow_node = np.full(1024, -1, dtype=np.int64)  # flow id -> node (-1: another communicator of its group)
        flow_first: dict[int, int] = {}
        # node -> (the id of its group's first network flow, which of its own flows cross the network)
        orbit_first: dict[int, tuple[int, np.ndarray]] = {}
        world = self.world
        n_comms = len(comm_list)
        rails = self.rails = None if self.optical is None else OpticalRails(self.optical, self.schedule)
        admitted: set[int] = set()  # collectives the optical rails let start (or that need no circuit)

        def finish(n: int, t: float) -> None:
            end[n] = t
            for x in dependents[n]:
                if t > ready[x]:
                    ready[x] = t
                deps_left[x] -= 1
                if deps_left[x] == 0:
                    schedule(x)

        def schedule(n: int) -> None:
            t = ready[n]
            start[n] = t
            k = kind[n]
            if k == 0:
                heapq.heappush(heap, (t + dur[n], n, 0))
            elif k == 1:
                heapq.heappush(heap, (t, n, 1))
            else:
                heapq.heappush(heap, (t, n, 0))

        def completed(done: np.ndarray, t: float) -> None:
            """Finish the collectives whose last flows are among ``done``."""
            if len(done):
                owners = flow_node[done]
                uniq, cnt = np.unique(owners[owners >= 0], return_counts=True)
                for n, c in zip(uniq.tolist(), cnt.tolist()):
                    pending[n] -= c
                    if pending[n] == 0:
                        del pending[n]
                        finish_call(n, t)

        def finish_call(n: int, t: float) -> None:
            """A collective ends: its circuits drain (optical rails), then what waits on it runs."""
            if rails is not None and n in admitted and n in rails.calls:
                start_calls(rails.release(n, t), t)
            finish(n, t)

        def start_calls(calls: list[int], t: float) -> None:
            for m in calls:  # admitted by the optical rails: they start now
                start[m] = t
                heapq.heappush(heap, (t, m, 1))

        optical_ep: np.ndarray = self.topology.optical_endpoints if rails is not None else np.zeros(0, dtype=bool)

        def circuit_ports(n: int, e_src: np.ndarray, e_dst: np.ndarray) -> tuple[int, ...]:
            """The NIC ports of a call's network flows on optical switches (every NIC's on a rail fabric)."""
            net_ = e_src != e_dst
            ends = set(e_src[net_].tolist()) | set(e_dst[net_].tolist())
            return tuple(sorted(e for e in ends if optical_ep[e]))

        for n in range(n_nodes):
            if deps_left[n] == 0:
                schedule(n)
        inf = float("inf")
        while heap or pending or (rails is not None and rails.wakes):
            t_heap = heap[0][0] if heap else inf
            t_net = net.next_time()
            t_wake = inf if rails is None else rails.next_wake()
            if t_wake < t_heap and t_wake <= t_net:  # a circuit is up: the calls waiting for it start
                if t_wake > net.now:
                    completed(net.advance(t_wake), t_wake)
                start_calls(rails.wake(t_wake), t_wake)  # type: ignore[union-attr]
                continue
            if t_net <= t_heap and t_net != inf:
                completed(net.advance(t_net), t_net)
                continue
            if not heap:
                break
            t, n, ev = heapq.heappop(heap)
            if t > net.now:  # flows within the network's tolerance of their end complete here too
                completed(net.advance(t), t)
            if ev == 0:
                finish(n, t)
                continue
            item = what[n]
            comm = comm_list[who[n]]
            src, dst, nbytes = self._flows_arrays(item, comm)
            call_bytes = item.count * DTYPE_BYTES[item.dtype]
            tiny = call_bytes <= TINY_COLLECTIVE_BYTES
            if rails is not None and n not in admitted and len(src):
                admitted.add(n)
                ports = circuit_ports(n, *self._endpoints(src, dst))
                if ports and rails.needs_circuit(call_bytes):  # waits for its circuits (lib/net/optical.py)
                    group = GROUP_OF_KIND.get(comm.kind, "other")
                    start_calls([m for m in rails.request(n, group, ports, t) if m != n], t)
                    if n not in rails.calls or n in rails.waiting:
                        continue
                    start[n] = t
            flow_first[n] = net.n_added  # the id of its first flow (the network numbers flows as added)
            if not len(src):
                finish(n, t)
                continue
            if tiny:  # 0 us in Phantora traces: record the flows, no network time
                e_src, e_dst = self._endpoints(src, dst)
                ids = net.add(e_src, e_dst, np.zeros(len(src)))
                if self._orbit_of(item, who[n], comm_list) is not None:
                    orbit_first[n] = (-1, e_src != e_dst)  # every flow of the group ends at its start
                net.advance(net.now)
                finish_call(n, t)
                continue
            conn = (src * world + dst) * n_comms + who[n]  # one NCCL connection per (src, dst, comm)
            e_src, e_dst = self._endpoints(src, dst)
            ids = net.add(e_src, e_dst, nbytes, conn)
            orbit = self._orbit_of(item, who[n], comm_list)
            if orbit is not None:  # the group's other communicators: their network flows (lib/sim/symmetry.py)
                o_ids = net.add(orbit.src, orbit.dst, orbit.nbytes, orbit.conn)
                orbit_first[n] = (int(o_ids[0]) if len(o_ids) else -1, e_src != e_dst)
                top = int(o_ids[-1]) if len(o_ids) else -1
            else:
                o_ids, top = ids[:0], -1
            top = max(top, int(ids[-1]))
            if top >= len(flow_node):  # grow to hold the largest id (ids can skip ahead)
                grow = max(len(flow_node), top + 1 - len(flow_node))
                flow_node = np.concatenate([flow_node, np.full(grow, -1, dtype=np.int64)])
            flow_node[ids] = n
            flow_node[o_ids] = -1  # ends nothing in the DAG: checked against the representative's after the run
            pending[n] = len(ids)
        self.net_recomputations = net.recomputations
        self.unfinished = int(sum(1 for x in deps_left if x > 0))
        return start, end, flow_first, net.end_times(), orbit_first

    def _orbit_of(self, item, rep: int, comm_list: list[Communicator]) -> OrbitFlows | None:
        """The flows of ``item`` on the other communicators of representative ``rep``'s group (cached by
        the call's flows), or None when the DAG is every rank's or the group is ``rep`` alone."""
        group = self._orbits.get(rep)
        if group is None or len(group) == 1:
            return None
        key = self._flow_key(item, comm_list[rep])
        hit = self._orbit_cache.get(key)
        if hit is None:
            hit = self._orbit_cache[key] = orbit_flows(item, rep, group, comm_list, self._flows_arrays, self._endpoints)
        return hit


def simulate(spec: RunSpec, iterations: int | None = None) -> SimulationResult:
    """Simulate ``spec`` with the analytic model. See :class:`AnalyticSimulator`."""
    return AnalyticSimulator(spec, iterations).run()
