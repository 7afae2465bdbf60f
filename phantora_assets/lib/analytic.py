"""The embedded analytic simulator: a pure-Python stand-in for Phantora.

From a :class:`~phantora_assets.lib.workloads.WorkloadModel` it runs ``iterations`` training
steps (the first is warm-up: parameter broadcasts before it, slower kernels, and for ZeRO-3
no reuse-distance trace yet) and emits Phantora's event schema as a raw-timeline DataFrame
(``tables.RAW_TIMELINE_COLUMNS``): one computation event per rank per compute item, one
communication event per ring flow (loopback hops included, as Phantora does).

Timing model (documented, per GPU model, never per run):
    compute: roofline, max(flops / (peak_bf16_flops * matmul_efficiency),
             mem_bytes / (mem_bw_bytes_per_s * memory_efficiency)) + 8 us launch overhead.
    communication: every flow of a collective starts when the collective is issued; a network
             flow gets host_bw / max(concurrent flows leaving its source host, entering its
             destination host) (per-flow max-min fair share with symmetric load), loopback flows
             get loopback_speed; a collective ends with its last flow. Collectives of <= 4 KiB
             take 0 us (as in Phantora traces).
    ranks run in lockstep (SPMD); compute and communication do not overlap.
    warm-up step: compute x 1.2; every step gets a deterministic +-0.1 % jitter seeded by run_id.

Raises nothing for non-fitting runs: :func:`simulate` returns ``fits=False`` with the memory
estimate and an empty timeline.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from phantora_assets.lib.memory import MemoryEstimate, estimate_memory
from phantora_assets.lib.ring import DTYPE_BYTES, OP_TO_CALL, ring_flows
from phantora_assets.lib.tables import RAW_TIMELINE_COLUMNS
from phantora_assets.lib.workloads import AllToAll, Collective, Communicator, Compute, WorkloadModel
from phantora_assets.runs import RunSpec, presets

LAUNCH_OVERHEAD_NS = 8_000
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


@dataclass
class SimulationResult:
    """Output of one analytic simulation.

    Attributes:
        raw: raw timeline (RAW_TIMELINE_COLUMNS); empty when the run does not fit.
        memory: per-GPU peak memory estimate.
        iteration_ns: simulated duration of each iteration (ns), as ``run.log`` would print.
        compute_ns_per_step: compute time of one steady step on one rank (ns).
    """

    spec: RunSpec
    memory: MemoryEstimate
    raw: pd.DataFrame
    iteration_ns: list[int] = field(default_factory=list)
    compute_ns_per_step: int = 0

    @property
    def fits(self) -> bool:
        return self.memory.fits


class _Emitter:
    def __init__(self) -> None:
        self.cols: dict[str, list] = {c: [] for c in RAW_TIMELINE_COLUMNS}

    def add(self, **kw) -> None:
        for c in self.cols:
            self.cols[c].append(kw[c])

    def frame(self) -> pd.DataFrame:
        df = pd.DataFrame(self.cols)
        for c, t in RAW_TIMELINE_COLUMNS.items():
            df[c] = df[c].astype("int64" if t == "int64" else object)
        return df


class AnalyticSimulator:
    """Simulate one run (see module docstring). Construct once per run."""

    def __init__(self, spec: RunSpec, iterations: int | None = None) -> None:
        self.spec = spec
        self.model = WorkloadModel(spec)
        self.iterations = int(iterations or presets()["common"]["iterations"])
        gpu = spec.gpu_spec
        self.flops_rate = gpu["peak_bf16_flops"] * gpu["matmul_efficiency"]
        self.mem_rate = gpu["mem_bw_bytes_per_s"] * gpu["memory_efficiency"]
        cluster = spec.cluster
        self.host_bw = cluster["host_bw_gbps"] * 1e9 / 8
        self.loopback_bw = cluster["loopback_gbps"] * 1e9 / 8
        self.G = spec.gpus_per_node
        self.rng = np.random.default_rng(seed_of(spec.run_id, "analytic"))

    # --------------------------------------------------------------- timing pieces
    def compute_ns(self, item: Compute) -> int:
        t = max(item.flops / self.flops_rate, item.mem_bytes / self.mem_rate)
        return int(round(t * 1e9)) + LAUNCH_OVERHEAD_NS

    def _host(self, rank: int) -> int:
        return rank // self.G

    def flows_of(self, item: Collective | AllToAll, comm: Communicator) -> list[tuple[int, int, int]]:
        """(src global rank, dst global rank, bytes) of ``item`` on ``comm``."""
        n = len(comm.ranks)
        if isinstance(item, AllToAll):
            b = item.count * DTYPE_BYTES[item.dtype]
            return [(s, d, b) for s in comm.ranks for d in comm.ranks if s != d]
        return [(comm.ranks[a], comm.ranks[b], by)
                for a, b, by in ring_flows(item.op, item.count, DTYPE_BYTES[item.dtype], n, item.root)]

    def flow_durations_ns(self, flows: list[tuple[int, int, int]], tiny: bool) -> list[int]:
        if tiny:
            return [0] * len(flows)
        out_n: dict[int, int] = {}
        in_n: dict[int, int] = {}
        for s, d, _ in flows:
            hs, hd = self._host(s), self._host(d)
            if hs != hd:
                out_n[hs] = out_n.get(hs, 0) + 1
                in_n[hd] = in_n.get(hd, 0) + 1
        durs = []
        for s, d, b in flows:
            hs, hd = self._host(s), self._host(d)
            if hs == hd:
                rate = self.loopback_bw
            else:
                rate = self.host_bw / max(out_n[hs], in_n[hd])
            durs.append(int(round(b / rate * 1e9)))
        return durs

    # --------------------------------------------------------------- main loop
    def run(self) -> SimulationResult:
        spec, model = self.spec, self.model
        memory = estimate_memory(model)
        if not memory.fits:
            return SimulationResult(spec, memory, _Emitter().frame())
        em = _Emitter()
        world = spec.world_size
        comm_hex = {c.name: comm_id_bytes(spec.run_id, c.name).hex() for cs in model.comms.values() for c in cs}
        comm_stream = {c.name: 13 + i for i, c in enumerate(c for cs in model.comms.values() for c in cs)}
        pids = [4000 + 17 * r for r in range(world)]
        t = 0
        next_id = 0
        iteration_ns: list[int] = []
        compute_ns_step = 0
        steady = model.step_program(warmup=False)
        warm = model.init_program() + model.step_program(warmup=True)
        compute_cache: dict[str, int] = {}
        for it in range(self.iterations):
            program = warm if it == 0 else steady
            factor = (WARMUP_COMPUTE_FACTOR if it == 0 else 1.0) * (1.0 + STEP_JITTER * float(self.rng.standard_normal()))
            start_it = t
            step_compute = 0
            for item in program:
                if isinstance(item, Compute):
                    base = compute_cache.get(item.name)
                    if base is None:
                        base = compute_cache[item.name] = self.compute_ns(item)
                    dur = int(base * factor)
                    step_compute += dur
                    for r in range(world):
                        meta = json.dumps({"Torch": {
                            "time": dur,
                            "id": {"host": {"hostname": f"host-{self._host(r) + 1}", "pid": pids[r]}, "tid": pids[r]},
                            "stream": {"device": r % self.G, "id": COMPUTE_STREAM_ID},
                            "info": {"MM": [{"shape": list(s), "dtype": "BFloat16"} for s in item.shapes]},
                        }}, separators=(",", ":"))
                        em.add(event_id=next_id, kind="computation", name=item.name, start_ns=t, end_ns=t + dur,
                               src_host=f"host-{self._host(r) + 1}", dst_host="", bytes=0, call="", count=0,
                               dtype="", reduce_op="", root=-1, comm_id_hex="", comm_rank=-1,
                               stream_device=r % self.G, stream_id=COMPUTE_STREAM_ID, os_pid=pids[r], meta_json=meta)
                        next_id += 1
                    t += dur
                    continue
                comms = model.comms[item.kind]
                all_flows: list[tuple[Communicator, int, int, int]] = []
                for comm in comms:
                    for s, d, b in self.flows_of(item, comm):
                        all_flows.append((comm, s, d, b))
                if not all_flows:
                    continue
                tiny = (item.count * DTYPE_BYTES[item.dtype]) <= TINY_COLLECTIVE_BYTES
                durs = self.flow_durations_ns([(s, d, b) for _, s, d, b in all_flows], tiny)
                if isinstance(item, AllToAll):
                    call, op_name = "NcclSend", ""
                else:
                    call = OP_TO_CALL[item.op]
                    op_name = "Sum" if item.op in ("all_reduce", "reduce_scatter") else ""
                for (comm, s, d, b), dur in zip(all_flows, durs):
                    em.add(event_id=next_id, kind="communication", name=call, start_ns=t, end_ns=t + dur,
                           src_host=f"host-{self._host(s) + 1}", dst_host=f"host-{self._host(d) + 1}", bytes=b,
                           call=call, count=item.count, dtype=item.dtype, reduce_op=op_name,
                           root=(item.root if isinstance(item, Collective) and item.op == "broadcast" else -1),
                           comm_id_hex=comm_hex[comm.name], comm_rank=comm.ranks.index(s),
                           stream_device=s % self.G, stream_id=comm_stream[comm.name], os_pid=pids[s], meta_json="")
                    next_id += 1
                t += max(durs) + (LAUNCH_OVERHEAD_NS if not tiny else 1_000)
            iteration_ns.append(t - start_it)
            if it == 1:
                compute_ns_step = step_compute
        return SimulationResult(spec, memory, em.frame(), iteration_ns, compute_ns_step)


def simulate(spec: RunSpec, iterations: int | None = None) -> SimulationResult:
    """Simulate ``spec`` with the analytic model. See :class:`AnalyticSimulator`."""
    return AnalyticSimulator(spec, iterations).run()
