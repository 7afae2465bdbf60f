"""Deterministic ids and perf-DB key helpers of the analytic simulator.

* :func:`seed_of`: a 64-bit int seed from a run id (sha256), stable across processes.
* :func:`comm_id_bytes`: the 128-byte NCCL communicator id of a communicator of a run.
* :func:`torch_info`: the ``info`` JSON of a computation event's Torch meta, decoded from the
  perf-DB key (:mod:`~phantora_assets.lib.sim.kernels`) of the item's largest GEMM.

A malformed perf-DB key raises ``json.JSONDecodeError``; nothing else raises. No Dagster import.
"""

from __future__ import annotations

import hashlib
import json

from phantora_assets.lib.sim.workload_types import Compute


def seed_of(run_id: str, salt: str = "") -> int:
    """A 64-bit seed derived from ``run_id`` (sha256), stable across processes and platforms."""
    return int.from_bytes(hashlib.sha256(f"{salt}{run_id}".encode()).digest()[:8], "little")


def comm_id_bytes(run_id: str, comm_name: str) -> bytes:
    """The 128-byte NCCL communicator id of ``comm_name`` in ``run_id`` (deterministic)."""
    a = hashlib.blake2b(f"{run_id}/{comm_name}".encode(), digest_size=64, person=b"ncclUniqueId0").digest()
    b = hashlib.blake2b(f"{run_id}/{comm_name}".encode(), digest_size=64, person=b"ncclUniqueId1").digest()
    return a + b


def torch_info(item: Compute) -> str:
    """``info`` of the computation meta: the tensors of the item's largest GEMM (or first call)."""
    ks = [k for k in item.kernels if k.flops] or list(item.kernels)
    if not ks:
        return '{"MM":[]}'
    k = max(ks, key=lambda x: x.flops)
    args = next(iter(json.loads(k.key).values()))
    tensors = _tensors(args)[:2]
    return json.dumps(
        {"MM": [{"shape": t[1], "dtype": {"bf16": "BFloat16", "f32": "Float"}.get(t[0], t[0])} for t in tensors]},
        separators=(",", ":"),
    )


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
