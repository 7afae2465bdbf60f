"""The data types of a workload's training step, and the framework constants that size it.

Shared by the parameter layout (:mod:`~phantora_assets.lib.sim.workload_layout`), the torch-op
lists (:mod:`~phantora_assets.lib.sim.torch_ops`) and the step programs
(:mod:`~phantora_assets.lib.sim.workloads`); imports none of them.

* :class:`Param`: one parameter tensor (element count, module, TP-sharded or expert-local,
  per-rank shape).
* :class:`Communicator`: an NCCL group over global ranks.
* program items (:data:`Item`): :class:`Compute` (the intercepted torch calls of one rank, with
  their GEMM FLOP and bytes), :class:`Collective` and :class:`AllToAll` (``count`` elements of
  ``dtype`` per rank / per peer), with the framework's stream semantics: a collective is
  ``blocking`` (the next compute waits for it) or asynchronous (a later compute names its tag in
  ``waits``).
* bucket and ZeRO-3 sizes in elements (Megatron-core and DeepSpeed defaults).

Pure data: nothing here raises. No Dagster import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MEGATRON_BUCKET_ELEMENTS = 40_000_000
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
ZERO3_PERSISTENCE_THRESHOLD = 100_000
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000
ZERO3_PREFETCH_BUCKET_ELEMENTS = 50_000_000


@dataclass(frozen=True)
class Param:
    """One parameter tensor. ``numel`` is the full (unsharded) element count; ``shape`` the
    tensor's shape on one rank (after tensor-parallel sharding)."""

    name: str
    numel: int
    module: str
    tp_sharded: bool = False
    expert: bool = False
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Communicator:
    """An NCCL communicator: ``ranks`` are global ranks in communicator-rank order."""

    name: str
    kind: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Compute:
    """Work of one rank on the compute stream.

    ``kernels`` are the intercepted torch calls (perf-DB keys, ``lib.sim.kernels``); ``flops`` their
    GEMM FLOP and ``mem_bytes`` their traffic; ``phase`` fwd/bwd/opt. ``waits``: tags of
    asynchronous collectives this item waits for before it starts (``work.wait()``)."""

    name: str
    flops: float
    mem_bytes: float
    phase: str
    shapes: tuple[tuple[int, ...], ...] = ()
    kernels: tuple = ()
    waits: tuple[str, ...] = ()


def compute(name: str, phase: str, kernels: list, waits: tuple[str, ...] = ()) -> Compute:
    """A :class:`Compute` item from its kernel list (flops and bytes summed)."""
    ks = tuple(kernels)
    return Compute(name, sum(k.flops for k in ks), sum(k.bytes for k in ks), phase, (), ks, tuple(waits))


@dataclass(frozen=True)
class Collective:
    """One NCCL collective issued on every communicator of ``kind`` at the same time.

    ``blocking``: the compute stream waits for it right away (a synchronous collective); when
    False it runs asynchronously and a later :class:`Compute` names its ``tag`` in ``waits``."""

    kind: str
    op: Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
    count: int
    dtype: str
    tag: str
    root: int = 0
    blocking: bool = True


@dataclass(frozen=True)
class AllToAll:
    """Grouped send/recv on every communicator of ``kind``: each rank sends every peer ``count``."""

    kind: str
    count: int
    dtype: str
    tag: str
    blocking: bool = True


@dataclass(frozen=True)
class SendRecv:
    """Point-to-point sends on every communicator of ``kind`` (of the issuing stage, or spanning
    stages for ``pp``): for each ``(a, b)`` of ``pairs`` the communicator's rank index a sends
    ``count`` elements to index b. A pipeline send appears in the programs of both stages
    (matched by ``tag``): the sender goes on (``isend``), the receiver's next compute waits for it;
    a ring exchange (context parallelism) lists every hop and is ``blocking``."""

    kind: str
    pairs: tuple[tuple[int, int], ...]
    count: int
    dtype: str
    tag: str
    blocking: bool = True
    receiver: int = -1  # pipeline send: the stage whose program waits for it (-1: every member)


Item = Compute | Collective | AllToAll | SendRecv
