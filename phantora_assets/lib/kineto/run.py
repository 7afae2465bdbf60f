"""A folder of PyTorch profiler traces (one per rank) as one run: placement, timeline, steps, notes.

:func:`trace_files` finds the traces (``*.json`` / ``*.json.gz`` directly in the folder, symlinks
refused), :func:`read_folder` reads them (``reader.read_rank_trace``) and checks that they are one
job: the same world size, each rank once, ``gpus_per_node`` dividing the world size.
:func:`convert` gives the raw timeline (``collectives.raw_timeline``), the ``ProfilerStep#N`` steps
on its clock and the assumptions made, in plain words. Ranks are placed host-major: rank r on
``host-(r // gpus_per_node + 1)``, as for simulated runs. No Dagster import.
"""

from __future__ import annotations

import re
import stat
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from phantora_assets.lib.errors import FileRuleError, TraceFormatError
from phantora_assets.lib.kineto.collectives import group_sequences, raw_timeline
from phantora_assets.lib.kineto.reader import RankTrace, read_rank_trace

#: The endings of a PyTorch profiler trace file.
TRACE_SUFFIXES = (".json", ".json.gz")
_RANK = re.compile(r"(?<![a-z0-9])rank[-_]?(\d+)(?!\d)", re.IGNORECASE)


def _us(us: float) -> float:
    """``us`` rounded to whole ns, as the timeline writes times (so a flow at a step start is in it)."""
    return round(us * 1000) / 1000


def trace_files(folder: str | Path) -> list[Path]:
    """The Kineto traces of ``folder`` (``*.json``, ``*.json.gz``; not recursive), by name.

    Raises:
        FileNotFoundError: ``folder`` is not a directory.
        FileRuleError: a trace is a symlink (``symlink in run folder``) or not a regular file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a directory")
    out = []
    for p in sorted(folder.iterdir()):
        if not p.name.endswith(TRACE_SUFFIXES) or p.name.startswith("."):
            continue
        mode = p.lstat().st_mode
        if stat.S_ISLNK(mode):
            raise FileRuleError(p, "symlink in run folder", "the import does not follow links")
        if not stat.S_ISREG(mode):
            raise FileRuleError(p, "not a regular file", "a trace must be a regular file")
        out.append(p)
    return out


def default_run_id(folder: str | Path, n_nodes: int, gpus_per_node: int) -> str:
    """``<folder name>_<nodes>x<gpus>``, lower-case, characters outside [a-z0-9_] as ``_``."""
    name = re.sub(r"[^a-z0-9_]+", "_", Path(folder).resolve().name.lower()).strip("_") or "kineto"
    return f"{name}_{n_nodes}x{gpus_per_node}"


@dataclass(frozen=True)
class KinetoRun:
    """The traces of one job (:func:`read_folder`): ``ranks`` by rank, the layout."""

    folder: Path
    ranks: list[RankTrace]
    world_size: int
    gpus_per_node: int

    @property
    def n_nodes(self) -> int:
        return self.world_size // self.gpus_per_node


def rank_from_name(path: Path) -> int | None:
    """The rank a trace's file name gives (``rank-3...``, ``rank3...``, ``...rank_3...``: the word
    ``rank`` then digits), or None when it names none or two different ones."""
    found = {int(m) for m in _RANK.findall(path.name)}
    return found.pop() if len(found) == 1 else None


def read_folder(
    folder: str | Path, gpus_per_node: int, world_size: int | None = None, rank: int | None = None
) -> KinetoRun:
    """Read every trace of ``folder`` as the ranks of one job.

    A trace without ``distributedInfo`` is placed by ``world_size`` (``--world-size``) and, in a
    folder of one trace, ``rank`` (``--rank``), else by the rank its file name gives
    (:func:`rank_from_name`); a trace with ``distributedInfo`` is placed by it.

    Raises:
        KinetoDeclined: a trace cannot give flows (``reader.DECLINE_RULES``; names the file).
        TraceFormatError: ``no trace`` (the folder holds none), ``ranks disagree`` (two world
            sizes, a rank twice), ``layout`` (``gpus_per_node`` does not divide the world size),
            ``placement`` (``rank`` with a folder of several traces, or not the rank of its
            ``distributedInfo``), or a format rule of one file.
    """
    folder = Path(folder)
    files = trace_files(folder)
    if not files:
        raise TraceFormatError(folder, "no trace", "no *.json or *.json.gz PyTorch profiler trace in the folder")
    if rank is not None and len(files) > 1:
        raise TraceFormatError(
            folder, "placement", f"--rank {rank} names the rank of a folder of one trace; this one holds {len(files)} "
            "(their ranks come from distributedInfo, else from the file names: rank-<r> / rank<r>)"
        )  # fmt: skip
    ranks = [read_rank_trace(p, world_size, rank if rank is not None else rank_from_name(p)) for p in files]
    if rank is not None and ranks[0].rank != rank:
        raise TraceFormatError(files[0], "placement", f"--rank {rank}, but its distributedInfo.rank is {ranks[0].rank}")
    world = ranks[0].world_size
    seen: dict[int, Path] = {}
    for rt in ranks:
        if rt.world_size != world:
            raise TraceFormatError(
                rt.path, "ranks disagree", f"world size {rt.world_size}, {ranks[0].path.name} says {world}"
            )
        if rt.rank in seen:
            raise TraceFormatError(rt.path, "ranks disagree", f"rank {rt.rank} again (also {seen[rt.rank].name})")
        seen[rt.rank] = rt.path
    if gpus_per_node < 1 or world % gpus_per_node:
        raise TraceFormatError(
            ranks[0].path, "layout", f"--gpus-per-node {gpus_per_node} does not divide the world size {world}"
        )
    return KinetoRun(folder, sorted(ranks, key=lambda r: r.rank), world, gpus_per_node)


@dataclass(frozen=True)
class Converted:
    """What :func:`convert` gives: the raw timeline (ns since ``t0_us``), the steps (us on the
    same clock: ``step_starts_us``, ``step_last_end_us``, their numbers; empty without markers),
    collective counts and the ``notes`` (assumptions, plain words)."""

    raw: pd.DataFrame
    t0_us: float
    step_numbers: list[int] = field(default_factory=list)
    step_starts_us: list[float] = field(default_factory=list)
    step_last_end_us: float = 0.0
    n_collectives: int = 0
    timed_by_kernel: int = 0
    timed_by_cpu: int = 0
    notes: list[str] = field(default_factory=list)


def convert(run: KinetoRun) -> Converted:
    """The run's raw timeline, steps and notes (module docstring).

    Steps: the ``ProfilerStep#N`` spans of the lowest rank, each start moved back to the first
    kernel of a collective its CPU ops issued in that span (the GPU runs behind the CPU).

    Raises:
        TraceFormatError: a collective breaks a rule of ``collectives`` (names the file).
    """
    ranks = run.ranks
    times = [c.ts_us for rt in ranks for c in rt.collectives] + [c.cpu_ts_us for rt in ranks for c in rt.collectives]
    times += [k[1] for rt in ranks for k in rt.kernels] + [s[1] for rt in ranks for s in rt.steps]
    t0 = min(times) if times else 0.0
    raw = raw_timeline(ranks, run.gpus_per_node, t0)
    colls = [c for rt in ranks for c in rt.collectives]
    by_kernel = sum(c.timed_by == "kernel" for c in colls)
    notes: list[str] = []
    present = [rt.rank for rt in ranks]
    groups = group_sequences(ranks)
    if len(ranks) < run.world_size:
        notes.append(
            f"{len(ranks)} of {run.world_size} ranks' traces (rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, present))}): the other ranks of each of their {len(groups)} process group(s) "
            "are assumed to issue the same collectives; groups without a traced rank are not seen"
        )
    else:
        notes.append(f"all {run.world_size} ranks traced: every group's members issue the same collectives (checked)")
    given = [rt.rank for rt in ranks if rt.placed == "given"]
    if given:
        notes.append(
            f"no distributedInfo in the trace(s) of rank(s) {', '.join(map(str, given))}: placed by the world size "
            f"{run.world_size} given and the rank given or named by the file"
        )
    if by_kernel < len(colls):
        notes.append(
            f"{len(colls) - by_kernel} of {len(colls)} collectives timed by their CPU op (no NCCL kernel found for "
            "them); the others by their NCCL kernel on the GPU stream"
        )
    else:
        notes.append(f"all {len(colls)} collectives timed by their NCCL kernel on the GPU stream")
    single = sum(len(c.group) == 1 for c in colls)
    skipped = {k: v for rt in ranks for k, v in rt.skipped.items()}
    if single or skipped:
        what = [f"{v} {k}" for k, v in sorted(skipped.items())] + (
            [f"{single} on groups of one rank"] if single else []
        )
        notes.append("not network flows: " + ", ".join(what))
    out = Converted(raw=raw, t0_us=t0, n_collectives=len(colls), timed_by_kernel=by_kernel,
                    timed_by_cpu=len(colls) - by_kernel, notes=notes)  # fmt: skip
    spans = ranks[0].steps
    if len(spans) < 2:
        notes.append("no ProfilerStep#N markers: steps by the communicator rule")
        return out
    marked = [s[1] for s in spans]
    starts = list(marked)
    for c in ranks[0].collectives:  # a step starts no later than the first kernel it issued
        k = bisect_right(marked, c.cpu_ts_us) - 1
        if k >= 0:
            starts[k] = min(starts[k], c.ts_us)
    last_end = max(spans[-1][1] + spans[-1][2], *(c.ts_us + c.dur_us for c in ranks[0].collectives))
    notes.append(
        f"steps from the {len(spans)} ProfilerStep#N markers of rank {ranks[0].rank} "
        f"(#{spans[0][0]}..#{spans[-1][0]}; the first is warm-up; step time = median steady step)"
    )
    return Converted(
        raw=raw, t0_us=t0, step_numbers=[s[0] for s in spans], step_starts_us=[_us(s - t0) for s in starts],
        step_last_end_us=_us(last_end - t0), n_collectives=len(colls), timed_by_kernel=by_kernel,
        timed_by_cpu=len(colls) - by_kernel, notes=notes,
    )  # fmt: skip
