"""Small PyTorch profiler (Kineto) traces in the format of the real ones (tests/test_kineto*.py).

Each rank's trace is what ``torch.profiler`` writes (see ../shared/reference/traces/hta/): a JSON
object with ``distributedInfo``, ``deviceProperties`` and ``traceEvents``; per step a
``ProfilerStep#N`` CPU span, compute kernels on stream 7 and, per collective, a
``record_param_comms`` CPU op (the size args), the ``cudaLaunchKernel`` inside it and the NCCL
kernel it launched (same ``correlation``) on stream 20.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

T0 = 1_700_000_000_000_000.0  # host clock, us


@dataclass(frozen=True)
class Coll:
    """One collective: ``record_param_comms`` args (``group`` = Process Group Ranks)."""

    name: str
    in_nelems: int
    out_nelems: int
    dtype: str
    group: tuple[int, ...]
    in_split: tuple[int, ...] = ()
    out_split: tuple[int, ...] | None = None  # None: as in_split
    kernel: bool = True  # False: no NCCL kernel (timed by the CPU op)
    extra: dict = field(default_factory=dict)


def rank_trace(
    rank: int,
    world: int,
    colls: list[Coll],
    *,
    steps: int = 4,
    step_us: float = 10_000.0,
    pg_name: str = "0",
    markers: bool = True,
    device: str = "NVIDIA H100 80GB HBM3",
    gpu_only: bool = False,
) -> dict:
    """One rank's trace: ``steps`` steps of ``step_us``, each issuing ``colls`` in order.
    ``gpu_only``: no CPU ops; the NCCL kernels carry the size args (``Process Group Ranks`` a list)."""
    pid, tid = 4000 + rank, 4000 + rank
    ev: list[dict] = []
    corr = 1000
    for s in range(steps):
        t = T0 + s * step_us
        if markers:
            ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{100 + s}", "pid": pid,
                       "tid": tid, "ts": t, "dur": step_us - 10, "args": {"External id": s}})  # fmt: skip
        ev.append({"ph": "X", "cat": "kernel", "name": "ampere_bf16_gemm", "pid": 0, "tid": 7, "ts": t + 100,
                   "dur": 2000.0, "args": {"device": 0, "stream": 7, "correlation": corr}})  # fmt: skip
        corr += 1
        for i, c in enumerate(colls):
            cpu = t + 3000 + i * 600
            args = {"Collective name": c.name, "In msg nelems": c.in_nelems, "Out msg nelems": c.out_nelems,
                    "dtype": c.dtype, "Group size": len(c.group), "Process Group Name": pg_name,
                    "Process Group Ranks": json.dumps(list(c.group)), "In split size": json.dumps(list(c.in_split)),
                    "Out split size": json.dumps(list(c.in_split if c.out_split is None else c.out_split)),
                    **c.extra}  # fmt: skip
            if gpu_only:
                args = {**args, "Process Group Ranks": list(c.group), "device": 0, "stream": 20, "correlation": corr}
                ev.append({"ph": "X", "cat": "kernel", "name": "void rcclGenericKernel<1, false>", "pid": 0,
                           "tid": 20, "ts": cpu + 40, "dur": 400.0, "args": args})  # fmt: skip
            else:
                ev.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": pid, "tid": tid,
                           "ts": cpu, "dur": 50.0, "args": args})  # fmt: skip
            if c.kernel and not gpu_only:
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": pid, "tid": tid,
                           "ts": cpu + 10, "dur": 5.0, "args": {"correlation": corr}})  # fmt: skip
                ev.append({"ph": "X", "cat": "kernel", "name": f"ncclDevKernel_{c.name}(ncclDevComm*)", "pid": 0,
                           "tid": 20, "ts": cpu + 40, "dur": 400.0,
                           "args": {"device": 0, "stream": 20, "correlation": corr}})  # fmt: skip
            corr += 1
    return {
        "schemaVersion": 1,
        "deviceProperties": [{"id": 0, "name": device, "totalGlobalMem": 85_029_158_912}],
        "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world, "pg_count": 1,
                            "pg_config": [{"pg_name": pg_name, "pg_size": world, "ranks": list(range(world))}]},
        "traceEvents": ev,
    }  # fmt: skip


def kineto_layout(trace: dict) -> str:
    """``trace`` as the profiler lays it out: metadata keys one per line, ``"traceEvents": [``, one
    event per ``  {`` ... ``  }`` block joined by ``,``, then ``  ]`` and the closing brace."""
    meta = [f'  "{k}": {json.dumps(v)}' for k, v in trace.items() if k != "traceEvents"]
    events = ",\n".join("  {\n    " + json.dumps(e)[1:-1] + "\n  }" for e in trace["traceEvents"])
    return "\n{\n" + ",\n".join(meta) + ',\n  "traceEvents": [\n' + events + "\n  ]\n}\n"


def write_traces(folder: Path, traces: dict[int, dict], gz: bool = True, one_line: bool = False) -> Path:
    """Write ``rank -> trace`` as ``rank-<r>.pt.trace.json[.gz]`` in ``folder``, in the profiler's
    layout (:func:`kineto_layout`), or as one line of JSON (``one_line``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for r, t in traces.items():
        data = (json.dumps(t) if one_line else kineto_layout(t)).encode()
        name = f"rank-{r}.pt.trace.json" + (".gz" if gz else "")
        (folder / name).write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return folder
