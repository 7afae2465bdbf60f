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
  ``replicate=False`` simulates every iteration (the tests check both agree within 0.5 %).
* warm-up step: compute x 1.2; every step gets a deterministic +-0.1 % compute jitter seeded by
  run_id (Phantora's steps differ by ~0.1 %).

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

from phantora_assets.lib.net.fabric import build_fabric
from phantora_assets.lib.phantora.netconfig import netconfig_for
from phantora_assets.lib.sim.kernels import KernelTimer
from phantora_assets.lib.sim.keys import default_perfdb_folder, seed_of
from phantora_assets.lib.sim.memory import estimate_memory
from phantora_assets.lib.sim.network import FlowNetwork, Topology
from phantora_assets.lib.sim.timeline import SimulationResult, emit_raw_timeline
from phantora_assets.lib.sim.workload_types import AllToAll, Collective, Communicator, Compute
from phantora_assets.lib.sim.workloads import WorkloadModel
from phantora_assets.lib.traffic.ring import DTYPE_BYTES, ring_flows
from phantora_assets.matrix import RunSpec, presets

TINY_COLLECTIVE_BYTES = 4096
WARMUP_COMPUTE_FACTOR = 1.2
STEP_JITTER = 0.001


class AnalyticSimulator:
    """Simulate one run (see module docstring). Construct once per run."""

    def __init__(
        self,
        spec: RunSpec,
        iterations: int | None = None,
        perfdb_dir: str | Path | None = "default",
        emit: bool = True,
        replicate: bool = True,
        warmup: bool = True,
    ) -> None:
        self.spec = spec
        self.model = WorkloadModel(spec)
        self.iterations = int(iterations or presets()["common"]["iterations"])
        self.G = spec.gpus_per_node
        self.world = spec.world_size
        self.rng = np.random.default_rng(seed_of(spec.run_id, "analytic"))
        if perfdb_dir == "default":
            perfdb_dir = default_perfdb_folder(spec)
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
        self._flow_cache: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    # --------------------------------------------------------------- pieces
    def _endpoints(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Network endpoints of rank pairs: hosts on TwoLayerMultiPath, NICs on a fabric (one endpoint
        twice inside a scale-up domain: the simulator's loopback)."""
        if isinstance(self.topology, Topology):
            return src // self.G, dst // self.G
        return self.topology.endpoints(src, dst)

    def _host(self, rank: int) -> int:
        return rank // self.G

    def flows_of(self, item: Collective | AllToAll, comm: Communicator) -> list[tuple[int, int, int]]:
        """(src global rank, dst global rank, bytes) of ``item`` on ``comm``."""
        if isinstance(item, AllToAll):
            b = item.count * DTYPE_BYTES[item.dtype]
            return [(s, d, b) for s in comm.ranks for d in comm.ranks if s != d]
        return [
            (comm.ranks[a], comm.ranks[b], by)
            for a, b, by in ring_flows(item.op, item.count, DTYPE_BYTES[item.dtype], len(comm.ranks), item.root)
        ]

    def _flows_arrays(
        self, item: Collective | AllToAll, comm: Communicator
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = (
            type(item).__name__,
            getattr(item, "op", "a2a"),
            item.count,
            item.dtype,
            getattr(item, "root", 0),
            comm.name,
        )
        hit = self._flow_cache.get(key)
        if hit is None:
            fl = self.flows_of(item, comm)
            arr = np.array(fl, dtype=np.int64).reshape(-1, 3)
            hit = self._flow_cache[key] = (arr[:, 0].copy(), arr[:, 1].copy(), arr[:, 2].copy())
        return hit

    def network_bytes_per_step(self) -> int:
        """Network bytes (source host != destination host) of one steady step, both directions."""
        total = 0
        for item in self.model.step_program():
            if isinstance(item, (Collective, AllToAll)):
                for comm in self.model.comms[item.kind]:
                    src, dst, nbytes = self._flows_arrays(item, comm)
                    total += int(nbytes[(src // self.G) != (dst // self.G)].sum())
        return total

    # --------------------------------------------------------------- main loop
    def run(self) -> SimulationResult:  # noqa: C901, PLR0912, PLR0915 (the step DAG of the workload, then its simulation)
        spec, model = self.spec, self.model
        memory = estimate_memory(model)
        if not memory.fits:
            return SimulationResult(spec, memory, None)
        world = self.world
        comm_list = [c for cs in model.comms.values() for c in cs]
        steady = model.step_program(warmup=False)
        warm = (model.init_program() + model.step_program(warmup=True)) if self.warmup else steady
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
        for prog in (warm, steady):
            for item in prog:
                if isinstance(item, Compute) and id(item) not in base:
                    base[id(item)], db_ns[id(item)] = self.timer.time_kernels(item.kernels)

        # ---- build the DAG
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

        frontier: list[list[int]] = [[] for _ in range(world)]
        stream_last: dict[str, int] = {}
        for it in range(n_sim):
            program = warm if it == 0 else steady
            factor = factors[it]
            tags: dict[str, dict[int, int]] = {}
            for item in program:
                if isinstance(item, Compute):
                    d = base[id(item)] * factor
                    for r in range(world):
                        deps = set(frontier[r])
                        for tg in item.waits:
                            node = tags.get(tg, {}).get(r)
                            if node is not None:
                                deps.add(node)
                        frontier[r] = [new(0, d, r, item, it, deps)]
                    continue
                blocking = item.blocking
                per_rank = tags.setdefault(item.tag, {})
                for c in model.comms[item.kind]:
                    deps = set()
                    last = stream_last.get(c.name)
                    if last is not None:
                        deps.add(last)
                    for r in c.ranks:
                        deps.update(frontier[r])
                    node = new(1, 0.0, comm_index[c.name], item, it, deps)
                    stream_last[c.name] = node
                    for r in c.ranks:
                        per_rank[r] = node
                        if blocking:
                            frontier[r].append(node)
            # end of iteration: every stream drains (torch.cuda.synchronize / loss.cpu() on every
            # rank, and the next step's first collective lines the ranks up): a global barrier
            last_nodes = {x for f in frontier for x in f} | set(stream_last.values())
            bar = new(2, 0.0, -1, None, it, last_nodes)
            frontier = [[bar] for _ in range(world)]
            stream_last = {name: bar for name in stream_last}

        start, end, flow_first, flow_end = self._event_loop(kind, dur, who, what, dependents, deps_left, comm_list)
        self.n_nodes, self.n_flows = len(kind), len(flow_end)

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
        steady_items = [i for i in steady if isinstance(i, Compute)]
        comp_step = sum(base[id(i)] for i in steady_items)
        from_db = sum(db_ns[id(i)] for i in steady_items)
        n_k = sum(len(i.kernels) for i in steady_items)
        n_db = sum(1 for i in steady_items for k in i.kernels if self.timer.lookup(k)[1])
        timeline = None
        if self.emit:
            timeline = emit_raw_timeline(
                spec,
                self._flows_arrays,
                kind,
                who,
                what,
                iter_of,
                start,
                end,
                flow_first,
                flow_end,
                comm_list,
                list(sim_start),
                durations,
                factors,
                n_sim,
            )
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
        )

    def _event_loop(self, kind, dur, who, what, dependents, deps_left, comm_list):  # noqa: C901, PLR0915 (the DAG's event loop, every node kind in it)
        """Run the DAG: compute nodes take their duration, collective nodes inject their flows into
        the network simulator and end with their last flow, barriers take no time."""
        n_nodes = len(kind)
        start = np.zeros(n_nodes)
        end = np.zeros(n_nodes)
        ready = [0.0] * n_nodes
        net = FlowNetwork(self.topology)
        heap: list[tuple[float, int, int]] = []  # (time, node, event) 0 = compute end, 1 = collective start
        pending: dict[int, int] = {}
        flow_node = np.zeros(1024, dtype=np.int64)  # flow id -> node
        flow_first: dict[int, int] = {}
        world = self.world
        n_comms = len(comm_list)

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

        for n in range(n_nodes):
            if deps_left[n] == 0:
                schedule(n)
        n_flows_total = 0
        inf = float("inf")
        while heap or pending:
            t_heap = heap[0][0] if heap else inf
            t_net = net.next_time()
            if t_net <= t_heap and t_net != inf:
                done = net.advance(t_net)
                if len(done):
                    uniq, cnt = np.unique(flow_node[done], return_counts=True)
                    for n, c in zip(uniq.tolist(), cnt.tolist()):
                        pending[n] -= c
                        if pending[n] == 0:
                            del pending[n]
                            finish(n, t_net)
                continue
            if not heap:
                break
            t, n, ev = heapq.heappop(heap)
            if t > net.now:
                net.advance(t)
            if ev == 0:
                finish(n, t)
                continue
            item = what[n]
            comm = comm_list[who[n]]
            src, dst, nbytes = self._flows_arrays(item, comm)
            tiny = item.count * DTYPE_BYTES[item.dtype] <= TINY_COLLECTIVE_BYTES
            flow_first[n] = n_flows_total
            n_flows_total += len(src)
            if not len(src):
                finish(n, t)
                continue
            if tiny:  # 0 us in Phantora traces: record the flows, no network time
                ids = net.add(*self._endpoints(src, dst), np.zeros(len(src)))
                net.advance(net.now)
                finish(n, t)
                continue
            conn = (src * world + dst) * n_comms + who[n]  # one NCCL connection per (src, dst, comm)
            ids = net.add(*self._endpoints(src, dst), nbytes, conn)
            if ids[-1] >= len(flow_node):  # grow to hold the largest id (ids can skip ahead)
                grow = max(len(flow_node), int(ids[-1]) + 1 - len(flow_node))
                flow_node = np.concatenate([flow_node, np.zeros(grow, dtype=np.int64)])
            flow_node[ids] = n
            pending[n] = len(ids)
        self.net_recomputations = net.recomputations
        return start, end, flow_first, net.end_times()


def simulate(spec: RunSpec, iterations: int | None = None) -> SimulationResult:
    """Simulate ``spec`` with the analytic model. See :class:`AnalyticSimulator`."""
    return AnalyticSimulator(spec, iterations).run()
