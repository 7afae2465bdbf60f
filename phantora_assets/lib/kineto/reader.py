"""Read one PyTorch profiler (Kineto) trace per rank: its placement, collectives, kernels and steps.

A Kineto trace is one JSON object (``.json`` or ``.json.gz``): ``distributedInfo`` {``backend``,
``rank``, ``world_size``, ``pg_config``}, ``deviceProperties`` [{``name``, ``totalGlobalMem``}] and
``traceEvents`` (complete events ``"ph": "X"``, ``ts`` / ``dur`` in microseconds of the host
clock). The file is decoded in batches of events (``stream.py``: bounded memory, at most
``stream.MAX_INFLATED_BYTES`` of text); of each batch only this is kept:

* collectives: the ``record_param_comms`` CPU ops with their args ``Collective name``, ``In msg
  nelems``, ``Out msg nelems``, ``dtype``, ``Group size``, ``Process Group Ranks`` (truncated by
  PyTorch beyond 30 ranks, or absent: ``distributedInfo.pg_config`` by ``Process Group Name``, or
  ``Global rank start`` / ``Global rank stride``; :func:`_group`), ``In split size`` / ``Out split size``;
* their timing: the NCCL kernel (``ncclKernel_*`` / ``ncclDevKernel_*``, RCCL's too) launched inside
  the op, found through the CUDA runtime call on the op's thread whose ``correlation`` is the
  kernel's; an op without such a kernel keeps its CPU span (:attr:`Collective.timed_by` says which).
  A kernel carrying the size args itself gives them when its CPU op lacks them, and stands for the
  collectives when no CPU op carries sizes at all (a trace of GPU activity only);
* computation: every other GPU kernel (``cat: kernel``);
* steps: the ``ProfilerStep#N`` CPU spans.

Traces that cannot give flows are declined with a :class:`KinetoDeclined` naming the file and the
reason (:data:`DECLINE_RULES`); a trace without ``distributedInfo`` is placed by the world size and
rank it is given (``--world-size``; ``--rank`` or its file name, ``run.read_folder``). Errors:
:class:`~phantora_assets.lib.errors.TraceFormatError` (``invalid trace``, ``trace too large``). No Dagster import.
"""

from __future__ import annotations

import json
import re
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.kineto.stream import Args, Device, Event, Meta, decode

#: The reasons a trace is declined (rule names of :class:`KinetoDeclined`).
DECLINE_RULES = ("no distributedInfo", "world size 1", "no message sizes")
_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_NOT_DATA = ("wait", "barrier", "init", "coalesced")  # recorded, but move no data of their own


class KinetoDeclined(TraceFormatError):
    """A readable Kineto trace that cannot give network flows (rule: one of :data:`DECLINE_RULES`)."""


@dataclass(frozen=True)
class Collective:
    """One ``record_param_comms`` op of a rank.

    Attributes:
        name: the ``Collective name`` as recorded (``allreduce``, ``_allgather_base``, ...).
        in_nelems, out_nelems: ``In msg nelems`` / ``Out msg nelems`` (elements).
        dtype: the recorded ``dtype`` (PyTorch's ScalarType name: ``Float``, ``BFloat16``, ...).
        group: the global ranks of its process group, in group-rank order.
        pg: the group's key (``Process Group Name`` / ``ID`` and the ranks).
        in_split, out_split: ``In split size`` / ``Out split size`` (rows of dim 0; () if none).
        ts_us, dur_us: start and duration, host-clock microseconds (the kernel's, or the op's).
        timed_by: ``kernel`` (the matched NCCL kernel) or ``cpu op`` (no kernel found).
        stream: the kernel's CUDA stream (0 when timed by the CPU op).
        cpu_ts_us: the CPU op's start (the step it was issued in).
    """

    name: str
    in_nelems: int
    out_nelems: int
    dtype: str
    group: tuple[int, ...]
    pg: str
    in_split: tuple[int, ...]
    out_split: tuple[int, ...]
    ts_us: float
    dur_us: float
    timed_by: str
    stream: int
    cpu_ts_us: float


@dataclass(frozen=True)
class RankTrace:
    """What one rank's trace gives (:func:`read_rank_trace`).

    Attributes:
        path: the file. rank, world_size, backend: from ``distributedInfo`` (else as given, backend "").
        device: the first ``deviceProperties`` name ("" when none); device_bytes its memory.
        collectives: in CPU issue order. kernels: ``(name, ts_us, dur_us, stream)`` of the
        non-NCCL GPU kernels. steps: ``(N, ts_us, dur_us)`` of the ``ProfilerStep#N`` spans, by ts.
        pid: the OS pid of the rank's process (its first CPU op; 0 when none).
        skipped: ``Collective name`` -> ops recorded but not collectives of data (``wait``, ...).
        placed: ``distributedInfo``, or ``given`` (no distributedInfo: the world size and rank given).
    """

    path: Path
    rank: int
    world_size: int
    backend: str
    device: str
    device_bytes: int
    collectives: list[Collective]
    kernels: list[tuple[str, float, float, int]]
    steps: list[tuple[int, float, float]]
    pid: int
    skipped: dict[str, int]
    placed: str = "distributedInfo"


def _int(v: Any, path: Path, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise TraceFormatError(path, "invalid trace", f"{what} is not an integer: {v!r}")
    try:
        out = int(v)
    except ValueError:
        raise TraceFormatError(path, "invalid trace", f"{what} is not an integer: {v!r}") from None
    if out != float(v) or out < 0:
        raise TraceFormatError(path, "invalid trace", f"{what} is not a count: {v!r}")
    return out


def _int_list(v: Any, path: Path, what: str) -> tuple[int, ...]:
    """A list recorded as a list or as its text (``"[0, 1]"``); () for None or ``"[]"``."""
    if v is None or v == "":
        return ()
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            raise TraceFormatError(path, "invalid trace", f"{what} is not a list: {v!r}") from None
    if not isinstance(v, list):
        raise TraceFormatError(path, "invalid trace", f"{what} is not a list: {v!r}")
    return tuple(_int(x, path, what) for x in v)


def _pg_config(meta: Meta) -> dict[str, tuple[int, ...]]:
    """``distributedInfo.pg_config``: process group name -> its ranks (entries whose ``ranks`` is
    not a list of integers, e.g. truncated, are left out)."""
    cfg = (meta.distributedInfo or {}).get("pg_config")
    out: dict[str, tuple[int, ...]] = {}
    for e in cfg if isinstance(cfg, list) else []:
        ranks = e.get("ranks") if isinstance(e, dict) else None
        if isinstance(ranks, list) and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            out[str(e.get("pg_name"))] = tuple(ranks)
    return out


def _group(
    a: Args, path: Path, rank: int, world: int, what: str, pgs: dict[str, tuple[int, ...]]
) -> tuple[tuple[int, ...], str]:
    """The op's group ranks and its key. Ranks from ``Process Group Ranks``; when PyTorch truncated
    it (``"[0, 1, ..., 29, ...]"``, groups of more than 30 ranks) or left it out: the
    ``distributedInfo.pg_config`` entry of its ``Process Group Name`` (else ``ID``) of ``Group
    size`` ranks, else ``Global rank start`` / ``Global rank stride`` / ``Group size`` (no stride
    recorded: refused, it is not guessed). Raises TraceFormatError ``invalid trace``, or
    ``process group`` when the ranks list one twice or one outside the ``world`` (0..world-1):
    a ring over such a list is not a communicator NCCL can build (a duplicate would lengthen the
    ring, 5,333,332 B a step instead of 4,000,000 for ``[0, 0, 1]``), so it is refused, not binned."""
    size = _int(a.group_size, path, f"{what} Group size") if a.group_size is not None else None
    truncated = isinstance(a.pg_ranks, str) and a.pg_ranks.rstrip().endswith("...]")
    ranks = () if truncated else _int_list(a.pg_ranks, path, f"{what} Process Group Ranks")
    if not ranks:
        by_name = [pgs[str(k)] for k in (a.pg_name, a.pg_id) if k is not None and str(k) in pgs]
        if by_name and (size is None or len(by_name[0]) == size):
            ranks = by_name[0]
        elif size is not None and a.rank_start is not None and a.rank_stride is not None:
            start = _int(a.rank_start, path, f"{what} Global rank start")
            stride = _int(a.rank_stride, path, f"{what} Global rank stride")
            ranks = tuple(start + i * stride for i in range(size))
    if not ranks:
        raise TraceFormatError(
            path,
            "invalid trace",
            f"{what}: its group's ranks are not recorded: Process Group Ranks "
            f"{'truncated' if truncated else 'absent'} ({a.pg_ranks!r}), no distributedInfo.pg_config entry of "
            f"{size} ranks for Process Group Name {a.pg_name!r} / ID {a.pg_id!r}, and no Global rank start and "
            "stride (a stride is not guessed)",
        )
    if size is not None and size != len(ranks):
        raise TraceFormatError(path, "invalid trace", f"{what}: Group size {size} but {len(ranks)} Process Group Ranks")
    name = a.pg_name if a.pg_name is not None else a.pg_id
    twice = next((r for i, r in enumerate(ranks) if r in ranks[:i]), None)
    outside = next((r for r in ranks if not 0 <= r < world), None)
    if twice is not None or outside is not None:
        raise TraceFormatError(
            path,
            "process group",
            f"{what}: Process Group Ranks {list(ranks)} of group {str(name)!r} "
            + (
                f"lists rank {twice} twice"
                if twice is not None
                else f"lists rank {outside}, outside the world of {world} ranks (0..{world - 1})"
            )
            + ": each rank of a process group is listed once, all in the world",
        )
    if size != 1 and rank not in ranks:
        raise TraceFormatError(path, "invalid trace", f"{what}: rank {rank} is not in its group {list(ranks)}")
    return ranks, f"{name if name is not None else ''}:{','.join(map(str, ranks))}"


def _placement(t: Meta, path: Path, world_size: int | None, rank: int | None) -> tuple[int, int, str, str]:
    """``(rank, world size, backend, placed)`` from ``distributedInfo``, else from the placement
    given (``world_size``, ``rank``: ``--world-size``, and ``--rank`` or the file name)."""
    info = t.distributedInfo
    if info and "rank" in info and "world_size" in info:
        rank, world = _int(info["rank"], path, "distributedInfo.rank"), _int(info["world_size"], path, "world_size")
        where, backend, placed = "distributedInfo.world_size", str(info.get("backend", "")), "distributedInfo"
    elif world_size is None or rank is None:
        raise KinetoDeclined(
            path,
            "no distributedInfo",
            "the trace does not say its rank and world size, so its ranks cannot be placed on hosts: "
            + (
                "give --world-size N (the job's GPU count)"
                if world_size is None
                else f"--world-size {world_size} is given, but not the rank: the file name names none "
                "(rank-<r> / rank<r>) or more than one"
            )
            + " and, for a folder of one trace, --rank R; or profile with torch.distributed initialized "
            "before the profiler starts (Kineto then writes distributedInfo)",
        )
    else:
        rank, world, where, backend, placed = rank, world_size, "the world size given", "", "given"
    if world <= 1:
        raise KinetoDeclined(path, "world size 1", f"{where} = {world}: a single-GPU job has no network traffic")
    if rank >= world:
        raise TraceFormatError(path, "invalid trace", f"rank {rank} >= world size {world} ({where})")
    return rank, world, backend, placed


def _time(v: Any, path: Path, name: str, what: str) -> float:
    """An event's ``ts`` / ``dur`` (us) as a finite float. Raises TraceFormatError ``invalid trace``, or
    ``negative duration`` (was: a kernel of dur -50 became a flow of duration 0, silently)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300:
        if what == "dur" and v < 0:
            raise TraceFormatError(path, "negative duration", f"event {name[:80]!r}: dur {v!r} us")
        return float(v)
    raise TraceFormatError(path, "invalid trace", f"event {name[:80]!r}: {what} {v!r} is not a number of us")


class _Kept:
    """What :func:`read_rank_trace` keeps of the events, batch by batch (``stream.decode``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.nccl: dict[Any, Event] = {}  # NCCL kernels by correlation id
        self.twice: dict[Any, tuple[Event, Event]] = {}  # ids of two NCCL kernels of different times
        self.sized: list[Event] = []  # NCCL kernels that carry the size args themselves
        self.launches: dict[tuple[Any, Any], list[tuple[float, Any]]] = {}  # CUDA runtime calls per thread
        self.ops: list[Event] = []  # record_param_comms
        self.kernels: list[tuple[str, float, float, int]] = []
        self.steps: dict[int, tuple[int, float, float]] = {}
        self.unsized: Counter[str] = Counter()
        self.pid = 0
        self._names: dict[str, str] = {}

    def add(self, events: list[Event]) -> None:
        for e in events:
            if e.ph != "X":
                continue
            name, args = str(e.name), e.args
            if e.cat in ("kernel", "cuda_runtime", "cpu_op", "user_annotation"):
                e.ts, e.dur = _time(e.ts, self.path, name, "ts"), _time(e.dur, self.path, name, "dur")
            if e.cat == "kernel":
                if "nccl" in name.lower() or "rccl" in name.lower():
                    if args is not None and args.correlation is not None:
                        had = self.nccl.setdefault(args.correlation, e)
                        if (had.ts, had.dur) != (e.ts, e.dur):  # refused if an op is timed by it
                            self.twice.setdefault(args.correlation, (had, e))
                    if args is not None and args.collective is not None and args.in_nelems is not None:
                        self.sized.append(e)
                else:
                    stream = args.stream if args is not None and isinstance(args.stream, int) else 0
                    self.kernels.append((self._names.setdefault(name, name), float(e.ts), float(e.dur), stream))
            elif e.cat == "cuda_runtime":
                if args is not None and args.correlation is not None:
                    self.launches.setdefault((e.pid, e.tid), []).append((float(e.ts), args.correlation))
            elif name == "record_param_comms":
                self.ops.append(e)
            elif (m := _STEP.match(name)) and e.cat in ("user_annotation", "cpu_op"):
                self.steps.setdefault(int(m.group(1)), (int(m.group(1)), float(e.ts), float(e.dur)))
            elif name.startswith(("gloo:", "nccl:")):
                self.unsized[name] += 1
            if e.cat == "cpu_op" and not self.pid and isinstance(e.pid, int):
                self.pid = e.pid


def read_rank_trace(path: str | Path, world_size: int | None = None, rank: int | None = None) -> RankTrace:
    """Read one rank's Kineto trace (module docstring: what is kept), streamed (``stream.decode``).
    ``world_size`` and ``rank`` place a trace without ``distributedInfo`` (they are not used when
    it has one: :attr:`RankTrace.placed` says which).

    Raises:
        KinetoDeclined: rule ``no distributedInfo`` (and no placement given), ``world size 1`` or
            ``no message sizes`` (no ``record_param_comms`` op nor NCCL kernel carries ``Collective
            name`` and ``In msg nelems``: an older PyTorch, or a backend that records none, e.g.
            Gloo's ``gloo:all_reduce`` annotations).
        TraceFormatError: ``invalid trace`` (not JSON, a field of the wrong type), ``trace too large``.
    """
    path = Path(path)
    meta, kept = decode(path, lambda: _Kept(path), _Kept.add)
    rank, world, backend, placed = _placement(meta, path, world_size, rank)
    pgs = _pg_config(meta)
    launches = {k: sorted(v, key=lambda c: c[0]) for k, v in kept.launches.items()}
    colls: list[Collective] = []
    skipped: Counter[str] = Counter()
    unsized = kept.unsized
    for e in kept.ops:
        a = e.args or Args()
        k = _kernel_of(e, launches, kept)
        if (a.collective is None or a.in_nelems is None) and k is not None and k.args is not None:
            a = k.args if k.args.collective is not None else a
        if a.collective is None or a.in_nelems is None:
            unsized["record_param_comms"] += 1
        elif str(a.collective) in _NOT_DATA:
            skipped[str(a.collective)] += 1
        else:
            colls.append(_collective(a, e, k, path, rank, world, pgs))
    if not colls and kept.sized:  # no sized CPU op (e.g. not recorded): the kernels' own args
        for k in kept.sized:
            if str(k.args.collective) in _NOT_DATA:  # type: ignore[union-attr]
                skipped[str(k.args.collective)] += 1  # type: ignore[union-attr]
            else:
                colls.append(_collective(k.args, k, k, path, rank, world, pgs))  # type: ignore[arg-type]
        colls.sort(key=lambda c: c.cpu_ts_us)
    if not colls and not skipped:
        seen = ", ".join(f"{n} x{c}" for n, c in sorted(unsized.items())) or "no collective at all"
        raise KinetoDeclined(
            path,
            "no message sizes",
            f"no record_param_comms op carries Collective name and In msg nelems ({seen}): traces of an "
            "older PyTorch, or of a backend that records no sizes, cannot give bytes",
        )
    dev = meta.deviceProperties[0] if meta.deviceProperties else Device()
    return RankTrace(
        path=path,
        rank=rank,
        world_size=world,
        backend=backend,
        device=str(dev.name),
        device_bytes=int(dev.totalGlobalMem or 0),
        collectives=colls,
        kernels=kept.kernels,
        steps=[kept.steps[n] for n in sorted(kept.steps, key=lambda n: kept.steps[n][1])],
        pid=kept.pid,
        skipped=dict(skipped),
        placed=placed,
    )


def _collective(
    a: Args, op: Event, k: Event | None, path: Path, rank: int, world: int, pgs: dict[str, tuple[int, ...]]
) -> Collective:
    """The collective of CPU op ``op`` (or a kernel standing for it) with args ``a``, timed by kernel ``k``."""
    name = str(a.collective)
    what = f"{op.name} {name} at ts {op.ts}"
    group, pg = _group(a, path, rank, world, what, pgs)
    return Collective(
        name=name,
        in_nelems=_int(a.in_nelems, path, f"{what} In msg nelems"),
        out_nelems=_int(a.in_nelems if a.out_nelems is None else a.out_nelems, path, f"{what} Out msg nelems"),
        dtype=str(a.dtype),
        group=group,
        pg=pg,
        in_split=_int_list(a.in_split, path, f"{what} In split size"),
        out_split=_int_list(a.out_split, path, f"{what} Out split size"),
        ts_us=float(k.ts if k is not None else op.ts),
        dur_us=float(k.dur if k is not None else op.dur),
        timed_by="kernel" if k is not None else "cpu op",
        stream=int(k.args.stream) if k is not None and k.args and isinstance(k.args.stream, int) else 0,
        cpu_ts_us=float(op.ts),
    )


def _kernel_of(op: Event, launches: dict[tuple[Any, Any], list[tuple[float, Any]]], kept: _Kept):
    """The NCCL kernel launched inside ``op`` on its thread (the first one), or None.

    Raises:
        TraceFormatError: ``ambiguous kernel``: two NCCL kernels of different times carry that launch's
            ``correlation`` (was: the last one timed the op, silently). Real traces give each launch its
            own id; a kernel that times no op (e.g. one standing for itself) is not refused.
    """
    calls = launches.get((op.pid, op.tid))
    if not calls:
        return None
    end = float(op.ts) + float(op.dur)
    for i in range(bisect_left(calls, float(op.ts), key=lambda c: c[0]), len(calls)):
        if calls[i][0] > end:
            break
        if (corr := calls[i][1]) in kept.twice:
            a, b = kept.twice[corr]
            raise TraceFormatError(
                kept.path,
                "ambiguous kernel",
                f"correlation {corr!r} (the launch in {op.name} at ts {op.ts}) is carried by two NCCL kernels: "
                f"{str(a.name)[:80]!r} at ts {a.ts} dur {a.dur} and {str(b.name)[:80]!r} at ts {b.ts} dur {b.dur}",
            )
        if corr in kept.nccl:
            return kept.nccl[corr]
    return None
