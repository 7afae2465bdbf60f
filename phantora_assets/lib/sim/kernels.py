"""Kernel-level compute model: Phantora perf-DB keys, and their times per GPU model.

Phantora times only the torch calls it intercepts (``TorchCallInfo`` in the simulator:
matmul/mm/linear/bmm/baddbmm, element-wise add/mul/div/pow/where, softmax and its backward,
dropout, masked_fill, sum, zeros_like, dtype conversions, SDPA and the ``_foreach_*`` optimizer
ops). Everything else (embedding, fused norms, index/permute ops, ...) runs on a stubbed GPU and
costs zero simulated time. A recorded call is stored in the perf DB under its compact JSON key
(PHANTORA_FORMATS.md section 5), e.g. ``{"MatMul":[["bf16",[1024,1,4096]],["bf16",[4096,3072]]]}``.

A :class:`Kernel` is one such call: its key (the exact compact JSON Phantora writes), the FLOP it
performs and the bytes it moves as Phantora's estimator measures it. :class:`KernelTimer` gives
its time on a GPU model:

* **perf DB** (``perfdb/<gpu>/compute.csv``): the recorded nanoseconds when the key is there;
* else the **roofline** of ``gpus.toml``::

      t = max(flops / (peak_bf16_flops * matmul_efficiency),   # GEMM-like ops only
              bytes / bandwidth) + floor       (gemm_floor_ns for GEMMs, else kernel_floor_ns)
      bandwidth = l2_bw_bytes_per_s        if unique working set <= l2_bytes
                = mem_bw_bytes_per_s * memory_efficiency   otherwise

  Phantora's estimator runs each call on tensors drawn from a cache keyed by (numel, dtype),
  so repeated same-sized tensors alias and a small working set stays in L2 (seen in the L40S DB:
  ``Add_`` of two [4096, 4096] bf16 tensors moves 67 MB in 14 us, 4.6 TB/s; a 512-tensor
  ``_foreach_addcdiv_`` over two distinct sizes runs from L2). ``bytes`` therefore counts each
  distinct (numel, dtype) once for reads, plus the output for out-of-place ops.

No Dagster import.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

DTYPE_CODE_BYTES = {"f32": 4, "f64": 8, "f16": 2, "bf16": 2, "b8": 1, "i32": 4, "i64": 8, "i16": 2, "i8": 1, "u8": 1}
#: ConvDType target names (tch::Kind Debug names) -> dtype code
KIND_NAMES = {
    "Float": "f32",
    "BFloat16": "bf16",
    "Double": "f64",
    "Half": "f16",
    "Int": "i32",
    "Int64": "i64",
    "Bool": "b8",
}

Tensor = list  # ["bf16", [d0, d1, ...]]


def T(dtype: str, *shape: int) -> Tensor:
    """A tensor argument as Phantora serialises it: ``[dtype_code, [dims]]``."""
    return [dtype, [int(s) for s in shape]]


def numel(t: Tensor) -> int:
    return math.prod(t[1]) if t[1] else 1


def nbytes(t: Tensor) -> int:
    return numel(t) * DTYPE_CODE_BYTES[t[0]]


def _is_tensor(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], list)


def compact(v: Any) -> Any:
    """Phantora's compaction: a list of tensors that repeats one period k >= 2 times becomes
    ``{"R": [k, period]}`` (smallest period). Lists of lists and mixed lists are kept, with
    their elements compacted."""
    if _is_tensor(v):
        return v
    if isinstance(v, list):
        if len(v) >= 2 and all(_is_tensor(x) for x in v):
            n = len(v)
            for p in range(1, n // 2 + 1):
                if n % p == 0 and v == v[:p] * (n // p):
                    return {"R": [n // p, v[:p]]}
            return v
        return [compact(x) for x in v]
    if isinstance(v, dict):
        return {k: compact(x) for k, x in v.items()}
    return v


def make_key(op: str, args: Any) -> str:
    """The compact JSON key of a torch call (no spaces, Phantora's field order)."""
    return json.dumps({op: compact(args)}, separators=(",", ":"))


@dataclass(frozen=True)
class Kernel:
    """One intercepted torch call. ``flops`` > 0 marks a GEMM-like op (tensor cores). ``engine``
    names a kernel family with its own efficiency per GPU model: ``"sdpa"`` for torch SDPA's
    flash backend (``sdpa_efficiency`` of gpus.toml), ``""`` for every other call."""

    key: str
    flops: float
    bytes: float
    working_set: float
    engine: str = ""

    @property
    def op(self) -> str:
        return self.key[2 : self.key.index('"', 2)]


def _unique_bytes(tensors: list[Tensor]) -> int:
    seen = {(t[0], numel(t)): nbytes(t) for t in tensors if t is not None}
    return sum(seen.values())


def kernel(
    op: str,
    args: Any,
    flops: float = 0.0,
    out: Tensor | None = None,
    inputs: list[Tensor] | None = None,
    passes: float = 1.0,
) -> Kernel:
    """Build a Kernel. ``inputs`` (default: every tensor in ``args``) are read once per distinct
    (numel, dtype); ``out`` is written; ``passes`` scales the traffic (e.g. 2 for read+write of
    an in-place op without ``out``)."""
    ins = inputs if inputs is not None else _tensors_in(args)
    read = _unique_bytes(ins)
    written = nbytes(out) if out is not None else 0
    ws = read + written
    return Kernel(make_key(op, args), float(flops), float((read + written) * passes), float(ws))


def _tensors_in(v: Any) -> list[Tensor]:
    if _is_tensor(v):
        return [v]
    if isinstance(v, list):
        return [t for x in v for t in _tensors_in(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _tensors_in(x)]
    return []


# ------------------------------------------------------------------------------ op builders
def matmul(a: Tensor, b: Tensor, op: str = "MatMul") -> Kernel:
    """``aten::matmul`` / ``mm`` / ``bmm`` of a [.., M, K] by [.., K, N] (batch dims broadcast)."""
    m, k, n = math.prod(a[1][:-1]), a[1][-1], b[1][-1]
    out = T(a[0], m * n)
    return kernel(op, [a, b], 2.0 * m * k * n, out)


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Kernel:
    """``aten::linear``: x [.., K] @ w[N, K]^T (+ bias)."""
    m, k, n = math.prod(x[1][:-1]), x[1][-1], w[1][0]
    return kernel("Linear", [x, w, bias], 2.0 * m * k * n, T(x[0], m * n), inputs=[x, w] + ([bias] if bias else []))


def baddbmm(c: Tensor, a: Tensor, b: Tensor) -> Kernel:
    bsz, m, k = a[1]
    n = b[1][-1]
    return kernel("BAddBMM", [c, a, b], 2.0 * bsz * m * k * n, T(c[0], bsz * m * n), inputs=[c, a, b])


def ew(op: str, args: list[Any], out: Tensor | None = None) -> Kernel:
    """An element-wise / reduction op: reads its distinct inputs, writes ``out`` (default: the
    largest input, in place or not, as Phantora times it)."""
    ins = _tensors_in(args)
    if out is None and ins:
        out = max(ins, key=nbytes)
    return kernel(op, args, 0.0, out, inputs=ins)


def conv(t: Tensor, to: str) -> Kernel:
    """``aten::to`` (ConvDType) to kind ``to`` (``Float``, ``BFloat16``...). Same-dtype: no-op."""
    if KIND_NAMES[to] == t[0]:
        return Kernel(make_key("ConvDType", [t, to]), 0.0, 0.0, 0.0)
    return kernel("ConvDType", [t, to], 0.0, T(KIND_NAMES[to], numel(t)), inputs=[t])


def foreach(op: str, lists: list[list[Tensor]] | list[Tensor]) -> Kernel:
    """``_foreach_*_`` in place over tensor lists. The lists' i-th tensors have one size and
    alias in the estimator, so the traffic is a read and a write of every tensor of one list;
    the working set (for the L2 rule) is the distinct sizes."""
    first = lists if (lists and _is_tensor(lists[0])) else lists[0]
    traffic = 2.0 * sum(nbytes(t) for t in first)
    return Kernel(make_key(op, lists), 0.0, traffic, float(_unique_bytes(list(first))))


def flash_attention(
    s_q: int, s_k: int, heads: int, kv_heads: int, d: int, phase: str, batch: int = 1, engine: str = ""
) -> Kernel:
    """A fused causal attention call (FlashAttention-2: torch SDPA, Transformer Engine) of one rank:
    ``batch`` sequences, each ``heads`` query heads of [s_q, d] against ``kv_heads`` of [s_k, d]
    (attention stays inside a sequence: the FLOP are linear in ``batch``, quadratic in s). Forward
    4 s_q s_k d heads / 2 FLOP per sequence (causal), reading Q, K, V and writing O (bf16) and the
    fp32 log-sum-exp; backward 2.5 x the FLOP (recomputed scores, dQ, dK, dV), reading Q, K, V, O,
    dO and writing dQ, dK, dV. The perf-DB key names ``batch`` only when it is > 1. ``engine``:
    ``"sdpa"`` for torch's ``scaled_dot_product_attention`` (its flash backend is FlashAttention-2,
    timed at the GPU's ``sdpa_efficiency``), ``""`` for Transformer Engine's fused attention
    (cuDNN, at ``matmul_efficiency``)."""
    q, kv = batch * s_q * heads * d * 2, batch * s_k * kv_heads * d * 2
    dims = [s_q, s_k, heads, kv_heads, d] + ([batch] if batch > 1 else [])
    if phase == "fwd":
        return Kernel(make_key("FlashAttention", dims), 2.0 * batch * s_q * s_k * d * heads,
                      float(2 * q + 2 * kv + 4 * batch * s_q * heads), float(2 * q + 2 * kv), engine)  # fmt: skip
    return Kernel(make_key("FlashAttentionBackward", dims), 5.0 * batch * s_q * s_k * d * heads,
                  float(5 * q + 4 * kv), float(5 * q + 4 * kv), engine)  # fmt: skip


def uncaptured(op: str, dims: list[int], traffic: float) -> Kernel:
    """A kernel the framework runs on the GPU that Phantora does not intercept (its key op ``op``,
    e.g. ``SiLU``, ``LogSoftmax``, ``FsdpCopyOut``), timed by its memory traffic ``traffic`` (bytes
    read + written; no FLOP, no perf-DB entry). Only programs with ``train.uncaptured_kernels``
    list such kernels."""
    return Kernel(make_key(op, [int(x) for x in dims]), 0.0, float(traffic), float(traffic))


def fuse_pointwise(kernels: list[Kernel]) -> list[Kernel]:
    """torch.compile (Inductor) on a kernel list: every maximal run of consecutive element-wise
    kernels (no FLOP, not a ``Foreach`` optimizer call) becomes one fused kernel, which reads the
    run's inputs and writes its outputs once while the intermediates stay on chip; its traffic and
    working set are taken as those of the run's largest member (RMSNorm: read x, write y; SwiGLU:
    read x1, x3, write y), and it pays one launch floor. GEMMs and fused attention stay as they are.
    A run of one kernel is left unchanged (its perf-DB key too)."""
    out: list[Kernel] = []
    run: list[Kernel] = []

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            big = max(run, key=lambda k: k.bytes)
            out.append(Kernel(make_key("FusedPointwise", [len(run), big.key]), 0.0, big.bytes, big.working_set))
        run.clear()

    for k in kernels:
        if k.flops == 0.0 and not k.op.startswith("Foreach"):
            run.append(k)
        else:
            flush()
            out.append(k)
    flush()
    return out


def zeros_like(t: Tensor) -> Kernel:
    return kernel("ZerosLike", t, 0.0, t, inputs=[])


# ------------------------------------------------------------------------------ timing
@dataclass(frozen=True)
class GpuRoofline:
    """Per-GPU-model constants of the roofline (gpus.toml)."""

    peak_flops: float
    matmul_efficiency: float
    mem_bw: float
    memory_efficiency: float
    l2_bytes: float
    l2_bw: float
    floor_ns: float
    gemm_floor_ns: float = 0.0
    sdpa_efficiency: float = 0.0  # torch SDPA flash (FlashAttention-2) kernels; 0: matmul_efficiency

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> GpuRoofline:
        return cls(
            float(spec["peak_bf16_flops"]),
            float(spec["matmul_efficiency"]),
            float(spec["mem_bw_bytes_per_s"]),
            float(spec["memory_efficiency"]),
            float(spec.get("l2_bytes", 0.0)),
            float(spec.get("l2_bw_bytes_per_s", 0.0)),
            float(spec.get("kernel_floor_ns", 1000.0)),
            float(spec.get("gemm_floor_ns", spec.get("kernel_floor_ns", 1000.0))),
            float(spec.get("sdpa_efficiency", 0.0)),
        )

    def time_ns(self, k: Kernel) -> float:
        if k.bytes == 0.0 and k.flops == 0.0:
            return 0.0
        bw = self.mem_bw * self.memory_efficiency
        if self.l2_bytes and k.working_set <= self.l2_bytes and self.l2_bw > bw:
            bw = self.l2_bw
        t = k.bytes / bw
        if k.flops:
            eff = self.sdpa_efficiency if (k.engine == "sdpa" and self.sdpa_efficiency) else self.matmul_efficiency
            t = max(t, k.flops / (self.peak_flops * eff))
            return t * 1e9 + self.gemm_floor_ns
        return t * 1e9 + self.floor_ns


@cache
def load_compute_db(folder: str) -> dict[str, int]:
    """``key -> nanos`` of ``<folder>/compute.csv`` (empty when the folder has none)."""
    path = Path(folder) / "compute.csv"
    if not path.exists():
        return {}
    with path.open(newline="") as fh:
        rows = csv.reader(fh)
        header = next(rows)
        ki, ni = header.index("key"), header.index("nanos")
        return {r[ki]: int(r[ni]) for r in rows}


class KernelTimer:
    """Times kernels of one GPU model: perf DB first, roofline otherwise.

    Tracks, over every :meth:`time_ns` call, the nanoseconds that came from the DB and in total
    (``db_fraction``), and the keys that missed (``missing``).
    """

    def __init__(self, spec: dict[str, Any], perfdb_dir: str | Path | None) -> None:
        self.roofline = GpuRoofline.from_spec(spec)
        self.db = load_compute_db(str(perfdb_dir)) if perfdb_dir else {}
        self._cache: dict[str, tuple[float, bool]] = {}
        self.missing: set[str] = set()

    def lookup(self, k: Kernel) -> tuple[float, bool]:
        hit = self._cache.get(k.key)
        if hit is None:
            if k.key in self.db:
                hit = (float(self.db[k.key]), True)
            else:
                hit = (self.roofline.time_ns(k), False)
                if self.db:
                    self.missing.add(k.key)
            self._cache[k.key] = hit
        return hit

    def time_kernels(self, kernels: tuple[Kernel, ...] | list[Kernel]) -> tuple[float, float]:
        """(total ns, ns that came from the DB) of a kernel list."""
        total = from_db = 0.0
        for k in kernels:
            ns, hit = self.lookup(k)
            total += ns
            if hit:
                from_db += ns
        return total, from_db
