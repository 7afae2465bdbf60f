"""The embedded analytic simulator: a pure-Python stand-in for Phantora.

From a :class:`~phantora_assets.lib.sim.workloads.WorkloadModel` it runs ``iterations`` training
steps (the first is warm-up: parameter broadcasts before it, Adam state initialisation, no
ZeRO-3 trace yet) and emits Phantora's event schema as a raw-timeline DataFrame
(``tables.RAW_TIMELINE_COLUMNS``): one computation event per rank per compute item, one
communication event per ring flow (loopback hops included, as Phantora does).

Timing model (documented, per GPU model, never per run):

* **compute**: every compute item is a list of the torch calls Phantora intercepts
  (``lib.torch_ops``), each timed by the GPU's perf DB when it holds the call's key, else by the
  roofline of ``gpus.toml`` (``lib.kernels``). The fraction of compute time that came from the
  DB is reported (``SimulationResult.db_fraction``).
* **network**: the flows of a collective start when the collective starts; a flow-level
  simulator of the TwoLayerMultiPath topology of the run's ``netconfig.toml`` (``lib.network``,
  ``lib.netconfig``) shares links by per-flow
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

Raises nothing for non-fitting runs: :func:`simulate` returns ``fits=False`` with the memory
estimate and an empty timeline.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from phantora_assets.lib.sim.kernels import KernelTimer
from phantora_assets.lib.sim.memory import MemoryEstimate, estimate_memory
from phantora_assets.lib.phantora.netconfig import netconfig_for
from phantora_assets.lib.sim.network import FlowNetwork, Topology
from phantora_assets.lib.traffic.ring import DTYPE_BYTES, OP_TO_CALL, ring_flows
from phantora_assets.contracts import RAW_TIMELINE_COLUMNS
from phantora_assets.lib.sim.workloads import AllToAll, Collective, Communicator, Compute, WorkloadModel
from phantora_assets.matrix import RunSpec, presets

TINY_COLLECTIVE_BYTES = 4096
WARMUP_COMPUTE_FACTOR = 1.2
STEP_JITTER = 0.001
COMPUTE_STREAM_ID = 7


def seed_of(run_id: str, salt: str = "") -> int:
    """A 64-bit seed derived from ``run_id`` (sha256), stable across processes and platforms."""
    return int.from_bytes(hashlib.sha256(f"{salt}{run_id}".encode()).digest()[:8], "little")


def comm_id_bytes(run_id: str, comm_name: str) -> bytes:
    """The 128-byte NCCL communicator id of ``comm_name`` in ``run_id`` (deterministic)."""
    a = hashlib.blake2b(f"{run_id}/{comm_name}".encode(), digest_size=64, person=b"ncclUniqueId0").digest()
    b = hashlib.blake2b(f"{run_id}/{comm_name}".encode(), digest_size=64, person=b"ncclUniqueId1").digest()
    return a + b


def default_perfdb_folder(spec: RunSpec) -> Path:
    from phantora_assets.paths import default_perfdb_dir

    return default_perfdb_dir() / str(spec.gpu_spec.get("perfdb", spec.gpu))


@dataclass
class SimulationResult:
    """Output of one analytic simulation.

    Attributes:
        raw: raw timeline (RAW_TIMELINE_COLUMNS); empty when the run does not fit.
        memory: per-GPU peak memory estimate.
        iteration_ns: simulated duration of each iteration (ns), as ``run.log`` would print.
        compute_ns_per_step: compute-stream busy time of one steady step on rank 0 (ns).
        db_fraction: share of that compute time whose kernels came from the perf DB.
        exposed_comm_ns: median over steady steps of (step time - compute busy time), rank 0.
        kernels_per_step / kernels_from_db: intercepted calls of one steady step on one rank, and
            how many of them had their key in the perf DB.
    """

    spec: RunSpec
    memory: MemoryEstimate
    raw: pd.DataFrame
    iteration_ns: list[int] = field(default_factory=list)
    compute_ns_per_step: int = 0
    db_fraction: float = 0.0
    exposed_comm_ns: int = 0
    kernels_per_step: int = 0
    kernels_from_db: int = 0

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def step_ns(self) -> float:
        """Median duration of the steady iterations (all but the first)."""
        steady = self.iteration_ns[1:] or self.iteration_ns
        return float(np.median(steady)) if steady else 0.0


def _empty_raw() -> pd.DataFrame:
    df = pd.DataFrame({c: pd.Series(dtype="int64" if t == "int64" else object) for c, t in RAW_TIMELINE_COLUMNS.items()})
    return df


class AnalyticSimulator:
    """Simulate one run (see module docstring). Construct once per run."""

    def __init__(self, spec: RunSpec, iterations: int | None = None, perfdb_dir: str | Path | None = "default",
                 emit: bool = True, replicate: bool = True, warmup: bool = True) -> None:
        self.spec = spec
        self.model = WorkloadModel(spec)
        self.iterations = int(iterations or presets()["common"]["iterations"])
        self.G = spec.gpus_per_node
        self.world = spec.world_size
        self.rng = np.random.default_rng(seed_of(spec.run_id, "analytic"))
        if perfdb_dir == "default":
            perfdb_dir = default_perfdb_folder(spec)
        self.timer = KernelTimer(spec.gpu_spec, perfdb_dir)
        # the network of the run's netconfig.toml (lib/netconfig.py writes the same dict to config/)
        self.topology = Topology.from_netconfig(netconfig_for(spec), ecmp=str(spec.cluster.get("ecmp", "hash")))
        self.emit = emit
        self.replicate = replicate
        self.warmup = warmup  # False: every iteration is a steady step (no init, no warm-up step)
        self._flow_cache: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    # --------------------------------------------------------------- pieces
    def _host(self, rank: int) -> int:
        return rank // self.G

    def flows_of(self, item: Collective | AllToAll, comm: Communicator) -> list[tuple[int, int, int]]:
        """(src global rank, dst global rank, bytes) of ``item`` on ``comm``."""
        if isinstance(item, AllToAll):
            b = item.count * DTYPE_BYTES[item.dtype]
            return [(s, d, b) for s in comm.ranks for d in comm.ranks if s != d]
        return [(comm.ranks[a], comm.ranks[b], by)
                for a, b, by in ring_flows(item.op, item.count, DTYPE_BYTES[item.dtype], len(comm.ranks), item.root)]

    def _flows_arrays(self, item: Collective | AllToAll, comm: Communicator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = (type(item).__name__, getattr(item, "op", "a2a"), item.count, item.dtype, getattr(item, "root", 0),
               comm.name)
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

    def compute_ns(self, item: Compute) -> float:
        return self.timer.time_kernels(item.kernels)[0]

    # --------------------------------------------------------------- main loop
    def run(self) -> SimulationResult:
        spec, model = self.spec, self.model
        memory = estimate_memory(model)
        if not memory.fits:
            return SimulationResult(spec, memory, _empty_raw())
        world = self.world
        comm_list = [c for cs in model.comms.values() for c in cs]
        steady = model.step_program(warmup=False)
        warm = (model.init_program() + model.step_program(warmup=True)) if self.warmup else steady
        iters = self.iterations
        factors = [(WARMUP_COMPUTE_FACTOR if it == 0 and self.warmup else 1.0) * (1.0 + STEP_JITTER * float(self.rng.standard_normal()))
                   for it in range(iters)]
        n_sim = min(iters, 2) if self.replicate else iters

        # ---- per-item base durations
        base: dict[int, float] = {}
        db_ns: dict[int, float] = {}
        for prog in (warm, steady):
            for item in prog:
                if isinstance(item, Compute) and id(item) not in base:
                    base[id(item)], db_ns[id(item)] = self.timer.time_kernels(item.kernels)

        # ---- build the DAG
        kind: list[int] = []        # 0 compute, 1 collective, 2 barrier
        dur: list[float] = []       # compute duration (ns)
        who: list[int] = []         # compute: rank; collective: communicator index
        what: list[object] = []     # the item
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
        raw = _empty_raw()
        if self.emit:
            raw = self._emit(kind, who, what, iter_of, start, end, flow_first, flow_end, comm_list,
                             list(sim_start), durations, factors, n_sim)
        return SimulationResult(
            spec, memory, raw, iteration_ns, int(round(busy[first_steady])),
            (from_db / comp_step) if comp_step else 0.0, int(round(float(np.median(exposed)))), n_k, n_db)

    def _event_loop(self, kind, dur, who, what, dependents, deps_left, comm_list):
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
        G = self.G
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
                ids = net.add(src // G, dst // G, np.zeros(len(src)))
                net.advance(net.now)
                finish(n, t)
                continue
            conn = (src * world + dst) * n_comms + who[n]  # one NCCL connection per (src, dst, comm)
            ids = net.add(src // G, dst // G, nbytes, conn)
            if ids[-1] >= len(flow_node):
                flow_node = np.concatenate([flow_node, np.zeros(max(len(flow_node), len(ids)), dtype=np.int64)])
            flow_node[ids] = n
            pending[n] = len(ids)
        self.net_recomputations = net.recomputations
        return start, end, flow_first, net.end_times()

    # --------------------------------------------------------------- emission
    def _emit(self, kind, who, what, iter_of, start, end, flow_first, flow_end, comm_list,
              sim_start, durations, factors, n_sim) -> pd.DataFrame:
        """Raw timeline rows of the simulated iterations, then of the replicated steady ones
        (iteration 1's rows with times t -> T_k + (t - T_1) * f_k / f_1)."""
        spec = self.spec
        G = self.G
        pids = [4000 + 17 * r for r in range(self.world)]
        comm_hex = {c.name: comm_id_bytes(spec.run_id, c.name).hex() for c in comm_list}
        comm_stream = {c.name: 13 + i for i, c in enumerate(comm_list)}
        info_cache: dict[int, str] = {}
        hosts = [f"host-{h + 1}" for h in range(spec.n_nodes)]
        # one block of rows per simulated iteration: str/int columns + float times
        blocks = []
        order = np.lexsort((np.arange(len(kind)), start))
        iter_arr = np.array(iter_of)
        for it in range(n_sim):
            nodes = [int(n) for n in order if iter_arr[n] == it and kind[n] != 2]
            c_rows: dict[str, list] = {c: [] for c in ("kind", "name", "src_host", "dst_host", "bytes", "call", "count",
                                                       "dtype", "reduce_op", "root", "comm_id_hex", "comm_rank",
                                                       "stream_device", "stream_id", "os_pid", "info")}
            t0: list[float] = []
            t1: list[float] = []
            for n in nodes:
                item = what[n]
                if kind[n] == 0:
                    r = who[n]
                    info = info_cache.get(id(item))
                    if info is None:
                        info = info_cache[id(item)] = _torch_info(item)
                    vals = ("computation", item.name, hosts[r // G], "", 0, "", 0, "", "", -1, "", -1, r % G,
                            COMPUTE_STREAM_ID, pids[r], info)
                    for c, v in zip(c_rows, vals):
                        c_rows[c].append(v)
                    t0.append(start[n])
                    t1.append(end[n])
                    continue
                comm = comm_list[who[n]]
                src, dst, nbytes = self._flows_arrays(item, comm)
                first = flow_first[n]
                if isinstance(item, AllToAll):
                    call, op_name, root = "NcclSend", "", -1
                else:
                    call = OP_TO_CALL[item.op]
                    op_name = "Sum" if item.op in ("all_reduce", "reduce_scatter") else ""
                    root = item.root if item.op == "broadcast" else -1
                rank_of = {g: i for i, g in enumerate(comm.ranks)}
                hexid, sid = comm_hex[comm.name], comm_stream[comm.name]
                for j, (a, b, by) in enumerate(zip(src.tolist(), dst.tolist(), nbytes.tolist())):
                    vals = ("communication", call, hosts[a // G], hosts[b // G], by, call, item.count, item.dtype,
                            op_name, root, hexid, rank_of[a], a % G, sid, pids[a], None)
                    for c, v in zip(c_rows, vals):
                        c_rows[c].append(v)
                    t0.append(start[n])
                    t1.append(max(start[n], flow_end[first + j]))
            blocks.append((c_rows, np.array(t0), np.array(t1)))
        # columns of each simulated block as arrays, built once (replicated steps reuse them)
        str_cols = [c for c, t in RAW_TIMELINE_COLUMNS.items() if t != "int64" and c != "meta_json"]
        int_cols = [c for c, t in RAW_TIMELINE_COLUMNS.items() if t == "int64" and c not in ("event_id", "start_ns", "end_ns")]
        arrays = []
        for c_rows, t0, t1 in blocks:
            arr = {c: np.array(c_rows[c], dtype=object) for c in str_cols}
            arr.update({c: np.array(c_rows[c], dtype=np.int64) for c in int_cols})
            comp_idx = np.array([j for j, x in enumerate(c_rows["info"]) if x is not None], dtype=np.int64)
            arrays.append((arr, t0, t1, comp_idx, c_rows))
        starts = [0.0]
        for d in durations[:-1]:
            starts.append(starts[-1] + d)
        parts: dict[str, list[np.ndarray]] = {c: [] for c in RAW_TIMELINE_COLUMNS}
        meta_tpl = ('{"Torch":{"time":%d,"id":{"host":{"hostname":"%s","pid":%d},"tid":%d},'
                    '"stream":{"device":%d,"id":' + str(COMPUTE_STREAM_ID) + '},"info":%s}}')
        for it in range(len(durations)):
            arr, t0, t1, comp_idx, c_rows = arrays[it if it < n_sim else 1]
            if it < n_sim:
                s_ns, e_ns = t0, t1
            else:
                scale = factors[it] / factors[1]
                s_ns = starts[it] + (t0 - sim_start[1]) * scale
                e_ns = starts[it] + (t1 - sim_start[1]) * scale
            s_i = np.rint(s_ns).astype(np.int64)
            e_i = np.maximum(np.rint(e_ns).astype(np.int64), s_i)
            for c in str_cols + int_cols:
                parts[c].append(arr[c])
            parts["start_ns"].append(s_i)
            parts["end_ns"].append(e_i)
            meta = np.full(len(s_i), "", dtype=object)
            d = (e_i - s_i)[comp_idx].tolist()
            host, pid, dev, info = (c_rows["src_host"], c_rows["os_pid"], c_rows["stream_device"], c_rows["info"])
            meta[comp_idx] = [meta_tpl % (dj, host[j], pid[j], pid[j], dev[j], info[j])
                              for dj, j in zip(d, comp_idx.tolist())]
            parts["meta_json"].append(meta)
        n_rows = sum(len(x) for x in parts["start_ns"])
        parts["event_id"] = [np.arange(n_rows, dtype=np.int64)]
        return pd.DataFrame({c: np.concatenate(parts[c]) for c in RAW_TIMELINE_COLUMNS})


def _torch_info(item: Compute) -> str:
    """``info`` of the computation meta: the tensors of the item's largest GEMM (or first call)."""
    ks = [k for k in item.kernels if k.flops] or list(item.kernels)
    if not ks:
        return '{"MM":[]}'
    k = max(ks, key=lambda x: x.flops)
    args = next(iter(json.loads(k.key).values()))
    tensors = _tensors(args)[:2]
    return json.dumps({"MM": [{"shape": t[1], "dtype": {"bf16": "BFloat16", "f32": "Float"}.get(t[0], t[0])}
                              for t in tensors]}, separators=(",", ":"))


def _tensors(v) -> list:
    if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], list):
        return [v]
    if isinstance(v, dict) and "R" in v:
        return _tensors(v["R"][1])
    if isinstance(v, list):
        return [t for x in v for t in _tensors(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _tensors(x)]
    return []


def simulate(spec: RunSpec, iterations: int | None = None) -> SimulationResult:
    """Simulate ``spec`` with the analytic model. See :class:`AnalyticSimulator`."""
    return AnalyticSimulator(spec, iterations).run()
