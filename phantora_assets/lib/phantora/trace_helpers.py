"""Helper processes of ``chrome_trace.read_trace``: how many to start, the pool, the child's body.

Job: decode trace batches on idle cores, in forked child processes, while the main process
inflates and cuts the file (and decodes batches too).

* :func:`default_workers` picks the number of helpers for a file: none below
  :data:`PARALLEL_MIN_BYTES` (estimated decompressed bytes) or without an idle core
  (:func:`idle_cpus`, cores idle over a short sample of ``/proc/stat``), at most
  :data:`MAX_WORKERS`.
* :class:`HelperPool` (main process) forks the helpers, copies each batch handed to it into a
  slot of one shared anonymous ``mmap`` (``n * MAX_IN_FLIGHT`` slots of ``2 * chunk_bytes +
  64 KiB`` bytes), sends ``(k, slot, end, offset)`` through a pipe and collects the answers on
  one receiving thread per helper (``msgs``: ``(kind, helper, k, ...)`` or ``("dead", helper)``);
  :meth:`HelperPool.drain` hands those answers to the reader's assembly (a :class:`BatchSink`).
* :func:`helper_main` is the body of a helper: it decodes the batches in its slots with its own
  ``trace_decode.BatchDecoder`` and sends back the columns and its new table entries.

Errors: a batch that breaks a rule comes back as ``("error", k, slot, rule, detail)`` (the
``trace_decode.BatchError`` of that batch), one in another layout as ``("whole", k, slot)``; a
helper that dies is reported as ``("dead", i)`` (``drain`` then has the main process decode its
batches). ``HelperPool()`` raises ``OSError`` when no memory or processes are left for helpers.

This module does not import pandas or dagster.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from phantora_assets.lib.phantora import trace_decode as td
from phantora_assets.lib.phantora.trace_batches import line_at
from phantora_assets.lib.phantora.trace_decode import BatchDecoder, BatchError, NeedWholeDoc

#: Decompressed size (bytes, estimated) from which ``read_trace`` uses helper processes.
PARALLEL_MIN_BYTES = 48 << 20
#: Most helper processes ``read_trace`` starts.
MAX_WORKERS = 4


def default_workers(path: str | Path) -> int:
    """Helper processes ``read_trace`` starts by default for a trace of at least
    ``PARALLEL_MIN_BYTES`` (estimated), when at least one core is idle (:func:`idle_cpus`), else
    none: one per core but one (this process decodes too) with the compiled scanner, one per
    core without it (this process then only inflates, cuts and assembles); at most
    ``MAX_WORKERS``.

    Measured on this project's 2-core machine with a 500 MB trace, six alternating runs each:
    with the scanner, 1 helper 281-333 MB/s, 2 helpers 268-301 MB/s, none ~260-340 MB/s; with
    msgspec only, 2 helpers ~150-240 MB/s, 1 helper ~130-170 MB/s, none ~90-115 MB/s. With both
    cores busy with other work, helpers cost about a quarter more CPU in all, which only pays off
    on idle cores.
    """
    cpus = _usable_cpus()
    if cpus < 2 or _estimated_size(Path(path)) < PARALLEL_MIN_BYTES:
        return 0
    n = cpus - 1 if td._tracescan is not None else cpus
    return min(n, MAX_WORKERS) if idle_cpus() >= 1.0 else 0


def idle_cpus(sample_s: float = 0.05) -> float:
    """Cores idle right now: the idle share of ``/proc/stat`` over ``sample_s`` times the core
    count (the load average is no measure of it: a kernel thread in the run queue keeps it near 1
    on an idle machine here); elsewhere cores minus the 1-minute load average."""
    cpus = _usable_cpus()

    def snapshot() -> tuple[int, int] | None:
        try:
            with open("/proc/stat", "rb") as fh:
                fields = [int(x) for x in fh.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)  # total, idle + iowait

    first = snapshot()
    if first is None:
        try:
            return cpus - os.getloadavg()[0]
        except OSError:  # pragma: no cover - no load average on this platform
            return 0.0
    time.sleep(sample_s)
    second = snapshot()
    if second is None:
        return 0.0
    total, idle = second[0] - first[0], second[1] - first[1]
    return cpus * idle / total if total > 0 else float(cpus)


def _usable_cpus() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _estimated_size(path: Path) -> int:
    """Decompressed size: the file size, or for gzip the larger of ISIZE and 4x the file."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if fh.read(2) != b"\x1f\x8b" or size < 20:
            return size
        fh.seek(-4, os.SEEK_END)
        return max(int.from_bytes(fh.read(4), "little"), 4 * size)


# ---------------------------------------------------------------------------------------------
# Main process: the pool of helpers
# ---------------------------------------------------------------------------------------------


class BatchSink(Protocol):
    """Where :meth:`HelperPool.drain` puts the helpers' results (``chrome_trace``'s assembly):
    ``batches[k] = (decoder, columns)`` with decoder ``1 + i`` for helper ``i``."""

    batches: dict[int, tuple[int, dict]]

    def limit(self) -> float: ...  # index of the first failed batch (inf: none)

    def fail(self, k: int, kind: str, rule: str = "", detail: str = "") -> None: ...

    def add_helper_tables(self, decoder: int, tables: tuple[list, list, list]) -> None: ...


class HelperPool:
    """Forked helper processes (:func:`helper_main`) decoding batches handed to them
    through shared memory, and one thread per process receiving its results."""

    MAX_IN_FLIGHT = 3  # batches queued per helper

    def __init__(self, path: Path, chunk_bytes: int, n: int) -> None:
        self.n = n
        self.slot_size = 2 * max(chunk_bytes, 1 << 16) + (1 << 16)
        n_slots = n * self.MAX_IN_FLIGHT
        self.mm = mmap.mmap(-1, self.slot_size * n_slots)  # shared with the forked children
        # fork: a child needs no imports (no re-import of __main__ as with spawn/forkserver)
        # and only runs trace_decode code on the shared memory.
        ctx = mp.get_context("fork")
        self.jobs, self.results, self.procs = [], [], []
        try:
            for i in range(n):
                job_r, job_w = ctx.Pipe(duplex=False)
                res_r, res_w = ctx.Pipe(duplex=False)
                self.jobs.append(job_w)
                self.results.append(res_r)
                proc = ctx.Process(
                    target=helper_main,
                    args=(self.mm, self.slot_size, job_r, res_w, str(path)),
                    daemon=True,
                    name=f"phantora-trace-helper-{i}",
                )
                proc.start()
                job_r.close()
                res_w.close()
                self.procs.append(proc)
        except BaseException:
            for proc in self.procs:
                proc.kill()
                proc.join(timeout=5)
            for conn in self.jobs + self.results:
                conn.close()
            self.mm.close()
            raise
        self.dead = [False] * n
        self.free = list(range(n_slots))
        self.load = [0] * n
        self.in_flight: dict[int, tuple[int, int, int, int]] = {}  # k -> (helper, slot, end, offset)
        self.msgs: queue.Queue = queue.Queue()
        self.threads = [threading.Thread(target=self._receive, args=(i,), daemon=True) for i in range(n)]
        for th in self.threads:
            th.start()

    def _receive(self, i: int) -> None:
        while True:
            try:
                msg = self.results[i].recv()
            except (EOFError, OSError):
                self.msgs.put(("dead", i))
                return
            self.msgs.put((msg[0], i, *msg[1:]))

    def submit(self, k: int, buf, end: int, offset: int) -> bool:
        """Hand batch ``k`` to the least busy helper if one has room; False to decode it here."""
        if not self.free or end > self.slot_size:
            return False
        i = min((h for h in range(self.n) if not self.dead[h]), key=self.load.__getitem__, default=None)
        if i is None or self.load[i] >= self.MAX_IN_FLIGHT:
            return False
        slot = self.free.pop()
        start = slot * self.slot_size
        with memoryview(buf) as mv:
            self.mm[start : start + end] = mv[:end]
        try:
            self.jobs[i].send((k, slot, end, offset))
        except OSError:
            self.free.append(slot)
            return False
        self.load[i] += 1
        self.in_flight[k] = (i, slot, end, offset)
        return True

    @property
    def saturates_cpus(self) -> bool:
        """One helper per core: they can keep every core busy without this process decoding."""
        return self.n >= _usable_cpus()

    def can_take(self, end: int) -> bool:
        """True when a live helper exists and a batch of ``end`` bytes fits a slot (then a slot
        frees up once a batch in flight is done)."""
        return end <= self.slot_size and not all(self.dead) and bool(self.in_flight)

    def done(self, k: int) -> None:
        i, slot, _, _ = self.in_flight.pop(k)
        self.load[i] -= 1
        self.free.append(slot)

    def slot_copy(self, k: int) -> tuple[bytearray, int, int]:
        """The text of in-flight batch ``k`` (to decode it here when its helper is gone)."""
        _, slot, end, offset = self.in_flight[k]
        start = slot * self.slot_size
        return bytearray(self.mm[start : start + end]), end, offset

    def drain(
        self, sink: BatchSink, decode_here: Callable[[int, bytearray, int, int], None], block: bool, at_most: int = 0
    ) -> None:
        """Hand the helpers' results to ``sink``; with ``block``, until none is outstanding (or
        ``at_most`` messages were taken, when > 0). The batches a dead helper still held are
        decoded by ``decode_here(k, buf, end, offset)`` (those before ``sink.limit()``)."""
        taken = 0
        while self.in_flight and not (at_most and taken >= at_most):
            try:
                msg = self.msgs.get(block=block)
            except queue.Empty:
                return
            taken += 1
            kind, i = msg[0], msg[1]
            if kind == "dead":  # decode here what that helper still held
                self.dead[i] = True
                for k in sorted(k for k, v in self.in_flight.items() if v[0] == i):
                    if k < sink.limit():
                        buf, end, offset = self.slot_copy(k)
                        decode_here(k, buf, end, offset)
                    self.done(k)
                continue
            k = msg[2]
            if k not in self.in_flight:
                continue
            self.done(k)
            if kind == "batch":
                sink.add_helper_tables(1 + i, msg[5])
                sink.batches[k] = (1 + i, msg[4])
            elif kind == "error":
                sink.fail(k, "error", msg[4], msg[5])
            else:
                sink.fail(k, "whole")

    def close(self) -> None:
        for conn in self.jobs:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self.jobs:
            conn.close()
        for th in self.threads:
            th.join(timeout=5)
        for conn in self.results:
            conn.close()
        try:
            self.mm.close()
        except BufferError:  # pragma: no cover - a view is still referenced by an exception
            pass


# ---------------------------------------------------------------------------------------------
# Helper process
# ---------------------------------------------------------------------------------------------


def helper_main(mm, slot_size: int, jobs, results, path: str) -> None:
    """Body of the helper process of ``read_trace`` (forked, so ``mm`` is the parent's memory).

    Receives ``(k, slot, end, offset)``: batch ``k`` is ``mm[slot * slot_size:][:end]``
    (``[`` + elements + ``]``, text offset ``offset``); decodes it and sends
    ``("batch", k, slot, cols, tables)`` where ``tables`` holds this decoder's table entries
    added since its previous message, or ``("error", k, slot, rule, detail)`` /
    ``("whole", k, slot)``. Stops on ``None`` or when the pipe closes.
    """
    dec = BatchDecoder()
    sent = [0, 0, 0]
    view = memoryview(mm)

    def line_of(offset: int) -> int:
        return line_at(path, offset)

    try:
        while True:
            job = jobs.recv()
            if job is None:
                break
            k, slot, end, offset = job
            start = slot * slot_size
            try:
                cols = dec.decode(view[start : start + end], end, offset, line_of)
            except BatchError as exc:
                results.send(("error", k, slot, exc.rule, exc.detail))
                continue
            except NeedWholeDoc:
                results.send(("whole", k, slot))
                continue
            tables = (dec.names.values[sent[0] :], dec.hosts.values[sent[1] :], dec.comms.values[sent[2] :])
            sent = [len(dec.names.values), len(dec.hosts.values), len(dec.comms.values)]
            results.send(("batch", k, slot, cols, tables))
    except (EOFError, OSError):
        pass
