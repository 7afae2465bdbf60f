"""Phantora Chrome/Perfetto traces (``timeline.json`` / ``timeline.json.gz``): write and read.

The layout is the one of Phantora's ``phantora_visualizer`` (PHANTORA_FORMATS.md section 3):
``[\\n`` + one complete event (``"ph": "X"``) per line, joined by ``,\\n``, + ``\\n]``.
``ts`` and ``dur`` are simulated microseconds.

* :func:`write_chrome_trace` turns a raw timeline (``tables.RAW_TIMELINE_COLUMNS``) into such a
  file, byte-for-byte deterministic (gzip ``mtime=0``, no file name in the gzip header).
* :func:`read_trace` parses a trace into a flow table (``tables.FLOW_COLUMNS``) and a per-host
  computation summary (``tables.COMPUTE_SUMMARY_COLUMNS``).

Reader design (performance, see ``trace_decode``): the file is inflated on a background thread
(ISA-L when available), cut into ~1 MiB batches of whole elements at ``,\\n`` (the visualizer
layout) and each batch is decoded in place in one ``msgspec`` call into typed Structs; columns
are pulled out with C-level passes (strings and communicators coded through tables, each
distinct communicator object decoded once) and Computation events are only summed per host.
For a large trace, forked helper processes decode batches that the main process copies into
shared memory (``read_trace(workers=...)``). Only a few batches of text are in memory at a time.
A valid JSON array in another layout (e.g. all on one line, or pretty-printed) is accepted too:
it is decoded as one document (memory then grows with the file).

This module does not import dagster.
"""

from __future__ import annotations

import gc
import gzip
import hashlib
import mmap
import multiprocessing as mp
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from phantora_assets.lib.phantora import trace_decode as td
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.store.io import atomic_path
from phantora_assets.lib.traffic.ring import CALL_TO_OP, DTYPE_BYTES
from phantora_assets.contracts import COMPUTE_SUMMARY_COLUMNS, FLOW_COLUMNS, RAW_TIMELINE_COLUMNS

__all__ = ["ParsedTrace", "read_trace", "write_chrome_trace", "comm_id_of"]

#: Largest ts/dur (µs) accepted; beyond it float64 can no longer hold integers exactly.
MAX_TIME_US = td.MAX_TIME_US
_HOST_RE = re.compile(r"host-([0-9]+)")

# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------

_enc = msgspec.json.Encoder()
#: gzip level of written traces: 3 deflates ~3x faster than the default 9 for ~1.6x the size.
GZIP_LEVEL = 3
_FLOW_TAIL = ',"token":null,"tenant_id":null,"vsrc":null,"vdst":null,"udp_src_port":null},'


def _p2p_peers(raw: pd.DataFrame) -> dict[int, int]:
    """Best-effort peer rank of NcclSend/NcclRecv rows (the raw timeline has no peer column).

    The caller's host is the flow source for a send and the destination for a recv; the peer is
    the smallest other rank of the same communicator seen on the other end's host. Falls back to
    ``comm_rank ^ 1`` (the other rank of a 2-rank communicator).
    """
    comm = raw[raw["kind"] == "communication"]
    rank_host: dict[str, dict[int, str]] = {}
    # first (communicator, rank) occurrence in row order decides the rank's host
    firsts = comm[["call", "comm_id_hex", "comm_rank", "src_host", "dst_host"]].drop_duplicates()
    for call, cid, rank, src, dst in zip(firsts["call"], firsts["comm_id_hex"], firsts["comm_rank"],
                                         firsts["src_host"], firsts["dst_host"]):
        host = dst if call == "NcclRecv" else src
        rank_host.setdefault(cid, {}).setdefault(int(rank), host)
    peers: dict[int, int] = {}
    p2p = comm[comm["call"].isin(("NcclSend", "NcclRecv"))]
    memo: dict[tuple, int] = {}
    for idx, call, cid, rank, src, dst in zip(p2p.index, p2p["call"], p2p["comm_id_hex"],
                                              p2p["comm_rank"], p2p["src_host"], p2p["dst_host"]):
        other_host = dst if call == "NcclSend" else src
        key = (cid, int(rank), other_host)
        peer = memo.get(key)
        if peer is None:
            cands = sorted(r for r, h in rank_host.get(cid, {}).items() if h == other_host and r != rank)
            peer = memo[key] = cands[0] if cands else int(rank) ^ 1
        peers[idx] = peer
    return peers


def write_chrome_trace(raw: pd.DataFrame, path: str | Path) -> dict:
    """Write a raw timeline as a Phantora visualizer Chrome trace.

    Rows are written in the order given (the visualizer's order is arbitrary too).
    Communication rows become ``"cat": "Communication"`` events exactly as in
    PHANTORA_FORMATS.md section 3 (``pid`` = index of the source host in order of first
    appearance, ``tid`` = ``(stream_device << 32) | stream_id``); computation rows become
    ``"cat": "Computation"`` events with ``pid`` = ``os_pid``, ``tid`` as above and
    ``args = {"Computation": [{"hostname", "pid"}, <dur ns>, <meta>]}``. For ``NcclSend`` /
    ``NcclRecv`` rows with a negative ``stream_id`` the call's ``"stream"`` is written as
    ``null`` and ``tid`` as 0 (upstream p2p calls carry no stream); their ``peer`` is inferred
    (see ``_p2p_peers``).

    The lines are assembled column-wise (pyarrow string kernels): every JSON fragment that only
    depends on repeated values (names, hosts, calls with their communicator and stream, meta) is
    encoded once per distinct value, numbers are formatted by array casts.

    Args:
        raw: DataFrame with ``RAW_TIMELINE_COLUMNS`` (times in ns, ``end_ns >= start_ns >= 0``).
        path: output file; gzip-compressed when the name ends in ``.gz``. Written atomically;
            identical input gives a byte-identical file.

    Returns:
        ``{"n_events", "n_communication", "n_computation", "bytes_written"}``; bytes_written is
        the size of the file on disk.

    Raises:
        ValueError: missing columns, unknown kind, negative time or duration, or a
            communicator id that is not hex (the first offending row is named).
    """
    missing = [c for c in RAW_TIMELINE_COLUMNS if c not in raw.columns]
    if missing:
        raise ValueError(f"raw timeline lacks columns {missing}")
    raw = raw.reset_index(drop=True)
    n = len(raw)
    kind = raw["kind"].to_numpy(object)
    is_comm = kind == "communication"
    is_comp = kind == "computation"
    errors: list[tuple[int, str]] = []
    for c, dtype in RAW_TIMELINE_COLUMNS.items():
        if dtype == "int64" and raw[c].dtype.kind not in "iu":   # e.g. float with a NaN
            vals = pd.to_numeric(raw[c], errors="coerce")
            bad_int = (vals.isna() | (vals != vals.round())).to_numpy()
            if bad_int.any():
                i = int(np.argmax(bad_int))
                errors.append((i, f"row {i}: {c} is not an integer: {raw[c].iat[i]!r}"))
    if errors:
        raise ValueError(min(errors)[1])
    start = raw["start_ns"].to_numpy(np.int64)
    end = raw["end_ns"].to_numpy(np.int64)
    unknown = ~(is_comm | is_comp)
    if unknown.any():
        i = int(np.argmax(unknown))
        errors.append((i, f"row {i}: unknown kind {kind[i]!r}"))
    bad = (start < 0) | (end < start)
    if bad.any():
        i = int(np.argmax(bad))
        errors.append((i, f"row {i} (event {int(raw['event_id'].iat[i])}): bad span [{int(start[i])}, {int(end[i])}] ns"))
    comm = raw[is_comm]
    comp = raw[is_comp]
    comm_parts, comm_errors = _comm_line_parts(comm, _p2p_peers(raw)) if len(comm) else ([], [])
    errors += comm_errors
    if errors:
        raise ValueError(min(errors)[1])
    lines: list[pa.Array] = []
    rows: list[np.ndarray] = []
    if len(comm):
        lines.append(_join(comm_parts))
        rows.append(np.flatnonzero(is_comm))
    if len(comp):
        lines.append(_join(_comp_line_parts(comp)))
        rows.append(np.flatnonzero(is_comp))
    if n:
        order = np.argsort(np.concatenate(rows), kind="stable")
        text = pa.concat_arrays(lines).take(pa.array(order))
        text = _join([text, pa.array([",\n"] * (n - 1) + ["\n"], _TEXT)])
        offsets = np.frombuffer(text.buffers()[1], np.int64, n + 1, text.offset * 8)
        body = text.buffers()[2].slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_pybytes()
        data = b"[\n" + body + b"]"
    else:
        data = b"[\n\n]"
    path = Path(path)
    with atomic_path(path) as tmp:
        if path.name.endswith(".gz"):
            with open(tmp, "wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0,
                                                          compresslevel=GZIP_LEVEL) as gz:
                gz.write(data)
        else:
            tmp.write_bytes(data)
    return {"n_events": n, "n_communication": int(is_comm.sum()), "n_computation": int(is_comp.sum()),
            "bytes_written": path.stat().st_size}


#: Type of the text arrays the writer assembles (64-bit offsets: a trace may pass 2 GiB).
_TEXT = pa.large_string()


def _coded(values: pd.Series, encode) -> pa.Array:
    """``encode(str(v))`` for every value, computed once per distinct text."""
    codes, uniques = pd.factorize(values.astype(str), sort=False, use_na_sentinel=False)
    return pa.array([encode(v) for v in uniques], _TEXT).take(pa.array(codes))


def _num(values: np.ndarray) -> pa.Array:
    """Integers as decimal text (as ``%d``)."""
    return pc.cast(pa.array(values, pa.int64()), _TEXT)


_FRACTION = pa.array([("." + f"{r:03d}").rstrip("0") if r else "" for r in range(1000)], _TEXT)


def _micros(ns: np.ndarray) -> pa.Array:
    """``ns / 1000`` as JSON numbers: an int when exact, else up to 3 decimals (no trailing zeros)."""
    q, r = np.divmod(ns, 1000)
    return _join([_num(q), _FRACTION.take(pa.array(r))])


def _js(v) -> str:
    return _enc.encode(str(v)).decode()


def _comm_line_parts(comm: pd.DataFrame, peers: dict[int, int]) -> tuple[list, list[tuple[int, str]]]:
    """The pieces of the Communication lines of ``comm`` (rows of the whole table), and errors."""
    call = comm["call"].astype(str).to_numpy(object)
    p2p = (call == "NcclSend") | (call == "NcclRecv")
    dev = comm["stream_device"].to_numpy(np.int64)
    sid = comm["stream_id"].to_numpy(np.int64)
    null_stream = p2p & (sid < 0)
    tid = np.where(null_stream, 0, (dev << 32) | sid)
    src = comm["src_host"].astype(str)
    pid_codes, _ = pd.factorize(src, sort=False)   # hosts in order of first appearance
    root = np.where(call == "NcclBcast", comm["root"].to_numpy(np.int64), 0)
    key = pd.DataFrame({"call": call, "dtype": comm["dtype"].astype(str).to_numpy(object),
                        "op": comm["reduce_op"].astype(str).to_numpy(object), "root": root,
                        "cid": comm["comm_id_hex"].astype(str).to_numpy(object), "null": null_stream,
                        "dev": dev, "sid": sid})
    codes, uniques = pd.factorize(pd.MultiIndex.from_frame(key), sort=False)
    pre, mid, post, errors = [], [], [], []
    for k, (c, dtype, op, rt, cid, nul, d, sd) in enumerate(uniques):
        try:
            ids = _enc.encode(list(bytes.fromhex(cid))).decode()
        except ValueError:
            row = int(comm.index[int(np.argmax(codes == k))])
            errors.append((row, f"row {row}: comm_id_hex is not hex: {cid[:40]!r}"))
            ids = "[]"
        m = ',"dtype":' + _js(dtype)
        if c in ("NcclAllReduce", "NcclReduceScatter"):
            m += ',"op":' + _js(op or "Sum")
        elif c == "NcclBcast":
            m += ',"root":' + str(int(rt))
        elif c in ("NcclSend", "NcclRecv"):
            m += ',"peer":'
        stream = "null" if nul else '{"device":' + str(int(d)) + ',"id":' + str(int(sd)) + "}"
        pre.append("{" + _js(c) + ':{"count":')
        mid.append(m)
        post.append(',"id":' + ids + '}' + ',"stream":' + stream + '}}]}}')
    take = pa.array(codes)
    peer = np.array([peers.get(int(i), 0) for i in comm.index[p2p]], np.int64)
    peer_text = pa.array([""] * len(comm), _TEXT)
    if p2p.any():
        full = np.zeros(len(comm), np.int64)
        full[p2p] = peer
        peer_text = pc.if_else(pa.array(p2p), _num(full), peer_text)
    start = comm["start_ns"].to_numpy(np.int64)
    dur = comm["end_ns"].to_numpy(np.int64) - start
    parts = [
        '{"name":', _coded(comm["name"], _js), ',"cat":"Communication","ph":"X","ts":', _micros(start),
        ',"dur":', _micros(dur), ',"pid":', _num(pid_codes), ',"tid":', _num(tid),
        ',"args":{"Communication":[{"id":', _num(comm["event_id"].to_numpy(np.int64)),
        ',"bytes":', _num(comm["bytes"].to_numpy(np.int64)), ',"src":', _coded(src, _js),
        ',"dst":', _coded(comm["dst_host"], _js), _FLOW_TAIL,
        pa.array(pre, _TEXT).take(take), _num(comm["count"].to_numpy(np.int64)),
        pa.array(mid, _TEXT).take(take), peer_text, ',"comm":{"rank":',
        _num(comm["comm_rank"].to_numpy(np.int64)), pa.array(post, _TEXT).take(take),
    ]
    return parts, errors


def _meta_json(text) -> str:
    text = str(text)
    return _enc.encode(msgspec.json.decode(text)).decode() if text else "null"


def _comp_line_parts(comp: pd.DataFrame) -> list:
    """The pieces of the Computation lines of ``comp``."""
    start = comp["start_ns"].to_numpy(np.int64)
    dur = comp["end_ns"].to_numpy(np.int64) - start
    os_pid = _num(comp["os_pid"].to_numpy(np.int64))
    tid = (comp["stream_device"].to_numpy(np.int64) << 32) | comp["stream_id"].to_numpy(np.int64)
    return [
        '{"name":', _coded(comp["name"], _js), ',"cat":"Computation","ph":"X","ts":', _micros(start),
        ',"dur":', _micros(dur), ',"pid":', os_pid, ',"tid":', _num(tid),
        ',"args":{"Computation":[{"hostname":', _coded(comp["src_host"], _js), ',"pid":', os_pid,
        "},", _num(dur), ",", _coded(comp["meta_json"], _meta_json), "]}}",
    ]


def _join(parts: list) -> pa.Array:
    """Element-wise concatenation of text arrays and (broadcast) str pieces."""
    return pc.binary_join_element_wise(*(pa.scalar(p, _TEXT) if isinstance(p, str) else p for p in parts),
                                       pa.scalar("", _TEXT))


# ---------------------------------------------------------------------------------------------
# Reader: public API
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParsedTrace:
    """A parsed Chrome trace.

    Attributes:
        path: the file read.
        flows: one row per Communication event, columns ``tables.FLOW_COLUMNS`` (dtypes as
            listed there; strings as object), sorted by ``(ts_us, flow_id)``, RangeIndex.
        compute: one row per host with Computation events, ``tables.COMPUTE_SUMMARY_COLUMNS``,
            sorted by host name.
        n_events: number of events in the array (all categories).
        compute_events: with ``read_trace(compute_events=True)``, one row per Computation
            event in file order: ``host`` (str), ``ts_us``, ``dur_us`` (float64, µs); else None.
    """

    path: Path
    flows: pd.DataFrame
    compute: pd.DataFrame
    n_events: int
    compute_events: pd.DataFrame | None = None


def comm_id_of(id_bytes: bytes | list[int]) -> str:
    """Short communicator id: 16 hex chars of ``blake2b(bytes(id), digest_size=8)``."""
    return hashlib.blake2b(bytes(id_bytes), digest_size=8).hexdigest()


#: Decompressed size (bytes, estimated) from which ``read_trace`` uses helper processes.
PARALLEL_MIN_BYTES = 48 << 20
#: Most helper processes ``read_trace`` starts.
MAX_WORKERS = 4


def read_trace(path: str | Path, *, chunk_bytes: int = 1 << 20, workers: int | None = None,
               compute_events: bool = False) -> ParsedTrace:
    """Parse a Phantora Chrome trace (``.json`` or ``.json.gz``; gzip is detected by magic bytes).

    The text is streamed and decoded in batches of whole elements (``trace_decode``); memory
    stays bounded by a few batches plus the output tables for the visualizer layout (and any
    layout whose elements are separated by ``,\\n``); other layouts are decoded as one document.

    Args:
        path: the trace file.
        chunk_bytes: size of the decompressed text batches (tuning only).
        workers: helper processes (forked; they decode batches the main process copies into
            shared memory while it inflates the file and decodes batches too). ``None``: see
            :func:`default_workers`.
        compute_events: also return every Computation event as (host, ts, dur) in
            ``ParsedTrace.compute_events`` (20 bytes per event; the step anatomy's input).

    Returns:
        A :class:`ParsedTrace`; ``flows.ts_us``/``dur_us`` in µs, ``bytes`` in bytes,
        ``src_node = k - 1`` for ``host-k``, ``stream`` = event tid, ``root`` = -1 except
        for NcclBcast. The result does not depend on ``chunk_bytes`` or ``workers``.

    Raises:
        TraceFormatError: naming the file and one of the rules ``truncated gzip``,
            ``corrupt gzip``, ``invalid JSON`` (with line number), ``not a JSON array``,
            ``empty trace``, ``invalid event`` (wrong field type, missing field, or a ``cat``
            other than Communication / Computation),
            ``negative duration`` (ts or dur < 0), ``overflowing duration`` (ts or dur not
            finite or > 2**53), ``overflowing value`` (an integer beyond int64),
            ``unknown NCCL op``, ``unknown dtype``, ``bad host name`` (not ``host-<k>``,
            k >= 1), ``negative bytes`` (bytes or count < 0), ``bad communicator``.
        OSError: the file cannot be read.
    """
    path = Path(path)
    if workers is None:
        workers = default_workers(path)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        try:
            try:
                asm = _read_batches(path, chunk_bytes, max(0, min(int(workers), MAX_WORKERS)))
                asm.raise_failure()
            except td.NeedWholeDoc:
                asm = _read_whole(path)
            return asm.finish(compute_events)
        except (td.BatchError, td.StreamError) as exc:
            raise TraceFormatError(path, exc.rule, exc.detail) from None
    finally:
        if gc_was:
            gc.enable()


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
        return sum(fields), fields[3] + (fields[4] if len(fields) > 4 else 0)   # total, idle + iowait

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
# Reader: orchestration (main process + optional helper process)
# ---------------------------------------------------------------------------------------------


class _Helper:
    """Forked helper processes (``trace_decode.helper_main``) decoding batches handed to them
    through shared memory, and one thread per process receiving its results."""

    MAX_IN_FLIGHT = 3   # batches queued per helper

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
                proc = ctx.Process(target=td.helper_main, args=(self.mm, self.slot_size, job_r, res_w, str(path)),
                                   daemon=True, name=f"phantora-trace-helper-{i}")
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
        self.in_flight: dict[int, tuple[int, int, int, int]] = {}   # k -> (helper, slot, end, offset)
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
            self.mm[start:start + end] = mv[:end]
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
        return bytearray(self.mm[start:start + end]), end, offset

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


class _Assembly:
    """Per-batch columns from one or two decoders, assembled into the output tables."""

    def __init__(self, path: Path, chunk_bytes: int) -> None:
        self.path, self.chunk_bytes = path, chunk_bytes
        self.batches: dict[int, tuple[int, dict]] = {}     # k -> (decoder, columns)
        self.tables: dict[int, tuple[list, list, list]] = {}  # decoder -> (names, hosts, comms)
        self.failure: tuple[int, str, str, str] | None = None  # (k, kind, rule, detail)

    def line_of(self, offset: int) -> int:
        return td.line_at(self.path, offset)

    def fail(self, k: int, kind: str, rule: str = "", detail: str = "") -> None:
        if self.failure is None or k < self.failure[0]:
            self.failure = (k, kind, rule, detail)

    def limit(self) -> float:
        return self.failure[0] if self.failure else float("inf")

    def add_helper_tables(self, decoder: int, tables: tuple[list, list, list]) -> None:
        mine = self.tables.setdefault(decoder, ([], [], []))
        for have, new in zip(mine, tables):
            have.extend(new)

    def raise_failure(self) -> None:
        if self.failure is None:
            return
        _, kind, rule, detail = self.failure
        if kind == "whole":
            raise td.NeedWholeDoc()
        raise td.BatchError(rule, detail)

    # -- final tables ----------------------------------------------------------------------------

    def finish(self, compute_events: bool = False) -> ParsedTrace:
        self.raise_failure()
        ks = sorted(self.batches)
        n_events = sum(self.batches[k][1]["n_events"] for k in ks)
        if n_events == 0:
            raise TraceFormatError(self.path, "empty trace", "the JSON array has no events")
        names, hosts, comms = td.CodeTable(), td.CodeTable(), td.CodeTable()
        maps = {}
        for d, (nv, hv, cv) in self.tables.items():
            maps[d] = tuple(np.fromiter(map(t.__getitem__, vals), np.int64, len(vals))
                            for t, vals in ((names, nv), (hosts, hv), (comms, cv)))
        cols: dict[str, list[np.ndarray]] = {}
        nh = len(hosts.values)
        comp_hosts, comp_ts, comp_durs = [], [], []
        comp_first = np.full(nh, np.inf)
        comp_last = np.full(nh, -np.inf)
        for k in ks:
            d, c = self.batches[k]
            nmap, hmap, cmap = maps[d]
            if "ts" in c:
                for key in ("ts", "dur", "stream", "flow_id", "bytes", "count", "root", "call", "dtype"):
                    cols.setdefault(key, []).append(c[key])
                cols.setdefault("name", []).append(nmap[c["name"]])
                cols.setdefault("src", []).append(hmap[c["src"]])
                cols.setdefault("dst", []).append(hmap[c["dst"]])
                cols.setdefault("comm", []).append(cmap[c["comm"]])
            if "comp_host" in c:
                comp_hosts.append(hmap[c["comp_host"]])
                comp_ts.append(c["comp_ts"])
                comp_durs.append(c["comp_dur"])
                idx = hmap[:len(c["comp_first"])]
                comp_first[idx] = np.minimum(comp_first[idx], c["comp_first"])
                comp_last[idx] = np.maximum(comp_last[idx], c["comp_last"])
        flows = self._flows(cols, names.values, hosts.values, comms.values)
        # one pass in file order: the sums do not depend on the batches (or who decoded them)
        ch = np.concatenate(comp_hosts) if comp_hosts else np.zeros(0, np.int64)
        cd = np.concatenate(comp_durs) if comp_durs else np.zeros(0, np.float64)
        events = None
        if compute_events:
            events = pd.DataFrame({
                "host": _strings(hosts.values, ch),
                "ts_us": np.concatenate(comp_ts) if comp_ts else np.zeros(0, np.float64),
                "dur_us": cd,
            })
        comp_n = np.bincount(ch, minlength=nh).astype(np.int64)
        comp_busy = np.bincount(ch, weights=cd, minlength=nh)
        has = comp_n > 0
        comp_hosts = [h for h, ok in zip(hosts.values, has) if ok]
        for h in comp_hosts:
            self._node(h)
        compute = pd.DataFrame({
            "host": _strings(comp_hosts, np.arange(len(comp_hosts))),
            "n_events": comp_n[has],
            "busy_us": comp_busy[has],
            "first_ts_us": comp_first[has],
            "last_end_us": comp_last[has],
        }, columns=list(COMPUTE_SUMMARY_COLUMNS), copy=False)
        compute = compute.sort_values("host", kind="stable").reset_index(drop=True)
        return ParsedTrace(path=self.path, flows=flows, compute=compute, n_events=n_events,
                           compute_events=events)

    def _node(self, host: str) -> int:
        m = _HOST_RE.fullmatch(host) if isinstance(host, str) else None
        if not m or int(m.group(1)) < 1:
            raise TraceFormatError(self.path, "bad host name", f"{host!r} is not of the form host-<k>, k >= 1")
        return int(m.group(1)) - 1

    def _flows(self, parts: dict[str, list[np.ndarray]], names: list, hosts: list, comms: list) -> pd.DataFrame:
        if not parts:
            return pd.DataFrame({k: pd.Series([], dtype=v if v != "str" else object)
                                 for k, v in FLOW_COLUMNS.items()})
        col = {k: np.concatenate(v) for k, v in parts.items()}
        for key in ("bytes", "count"):
            neg = col[key] < 0
            if neg.any():
                i = int(np.argmax(neg))
                raise TraceFormatError(self.path, "negative bytes",
                                       f"flow {int(col['flow_id'][i])}: {key}={int(col[key][i])}")
        nodes = np.array([self._node(h) for h in hosts], dtype=np.int64)
        comm_rank = np.array([r for r, _ in comms], dtype=np.int64)
        comm_hex = [comm_id_of(ident) for _, ident in comms]
        order = np.lexsort((col["flow_id"], col["ts"]))
        col = {k: v[order] for k, v in col.items()}
        calls = list(td.CALLS)
        dtypes = list(td.DTYPES)
        bcast = col["call"] == calls.index("NcclBcast")
        out = {
            "flow_id": col["flow_id"],
            "ts_us": col["ts"],
            "dur_us": col["dur"],
            "src_host": _strings(hosts, col["src"]),
            "dst_host": _strings(hosts, col["dst"]),
            "src_node": nodes[col["src"]],
            "dst_node": nodes[col["dst"]],
            "bytes": col["bytes"],
            "call": _strings(calls, col["call"]),
            "op": _strings([CALL_TO_OP[c] for c in calls], col["call"]),
            "dtype": _strings(dtypes, col["dtype"]),
            "dtype_bytes": np.array([DTYPE_BYTES[d] for d in dtypes], dtype=np.int64)[col["dtype"]],
            "count": col["count"],
            "comm_id": _strings(comm_hex, col["comm"]),
            "comm_rank": comm_rank[col["comm"]],
            "root": np.where(bcast, col["root"], -1).astype(np.int64),
            "stream": col["stream"],
            "name": _strings(names, col["name"]),
        }
        return pd.DataFrame(out, columns=list(FLOW_COLUMNS), copy=False)


def _strings(values: list, codes: np.ndarray) -> np.ndarray:
    """Object array ``values[codes]`` (1-D even when the values are sequences)."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr[codes]


def _read_batches(path: Path, chunk_bytes: int, workers: int) -> _Assembly:
    asm = _Assembly(path, chunk_bytes)
    local = td.BatchDecoder()
    asm.tables[0] = (local.names.values, local.hosts.values, local.comms.values)
    helper = None
    # a daemonic process (e.g. a multiprocessing pool worker of a parallel build) may not start
    # children: it decodes everything itself
    if workers and hasattr(os, "fork") and not mp.current_process().daemon:
        try:
            helper = _Helper(path, chunk_bytes, workers)
        except OSError:  # no memory or processes left for helpers: decode here
            helper = None
    try:
        for k, (offset, buf, end) in enumerate(td.iter_batches(path, chunk_bytes)):
            if helper is not None:
                _drain(helper, asm, local, block=False)
                if asm.failure is not None:
                    break
                # with a helper per core, the helpers decode and this process only inflates, cuts
                # and assembles: when they are all busy it waits for one (decoding here as well
                # would leave them idle meanwhile: ~135 against ~200 MB/s on 2 cores); with fewer
                # helpers than cores it decodes what they cannot take
                submitted = helper.submit(k, buf, end, offset)
                while not submitted and helper.saturates_cpus and helper.can_take(end):
                    _drain(helper, asm, local, block=True, at_most=1)
                    submitted = helper.submit(k, buf, end, offset)
                if submitted:
                    continue
                if asm.failure is not None:
                    break
            _decode_here(asm, local, k, buf, end, offset)
            if asm.failure is not None:
                break
    except td.StreamError:
        # a failure in an earlier batch takes precedence over a file-level one found later
        if helper is not None:
            _drain(helper, asm, local, block=True)
        if asm.failure is None:
            raise
    finally:
        if helper is not None:
            try:
                _drain(helper, asm, local, block=True)
            finally:
                helper.close()
    return asm


def _decode_here(asm: _Assembly, dec: td.BatchDecoder, k: int, buf, end: int, offset: int) -> None:
    try:
        asm.batches[k] = (0, dec.decode(buf, end, offset, asm.line_of))
    except td.BatchError as exc:
        asm.fail(k, "error", exc.rule, exc.detail)
    except td.NeedWholeDoc:
        asm.fail(k, "whole")


def _drain(helper: _Helper, asm: _Assembly, local: td.BatchDecoder, block: bool, at_most: int = 0) -> None:
    """Take the helpers' results; with ``block``, until none is outstanding (or ``at_most``
    messages were taken, when > 0)."""
    taken = 0
    while helper.in_flight and not (at_most and taken >= at_most):
        try:
            msg = helper.msgs.get(block=block)
        except queue.Empty:
            return
        taken += 1
        kind, i = msg[0], msg[1]
        if kind == "dead":  # decode here what that helper still held
            helper.dead[i] = True
            for k in sorted(k for k, v in helper.in_flight.items() if v[0] == i):
                if k < asm.limit():
                    buf, end, offset = helper.slot_copy(k)
                    _decode_here(asm, local, k, buf, end, offset)
                helper.done(k)
            continue
        k = msg[2]
        if k not in helper.in_flight:
            continue
        helper.done(k)
        if kind == "batch":
            asm.add_helper_tables(1 + i, msg[5])
            asm.batches[k] = (1 + i, msg[4])
        elif kind == "error":
            asm.fail(k, "error", msg[4], msg[5])
        else:
            asm.fail(k, "whole")


def _read_whole(path: Path) -> _Assembly:
    """Decode a document that is not cut into lines at ``,\\n`` in one piece."""
    asm = _Assembly(path, 0)
    data, line0 = td.whole_document(path)
    try:
        events = td.decode_document(data)
    except msgspec.ValidationError as exc:  # (a subclass of DecodeError)
        raise td.validation_error(exc, lambda i: f"event {i}") from None
    except RecursionError as exc:  # msgspec's nesting limit (about 1000 levels)
        raise td.BatchError("invalid JSON", f"an event nests too deep: {exc}") from None
    except msgspec.DecodeError as exc:
        m = re.search(r"byte (\d+)", str(exc))
        ln = line0 + data.count(b"\n", 0, int(m.group(1))) if m else "?"
        raise td.BatchError("invalid JSON", f"line {ln}: {exc}") from None
    dec = td.BatchDecoder()
    asm.tables[0] = (dec.names.values, dec.hosts.values, dec.comms.values)
    if events:
        asm.batches[0] = (0, dec.decode_events(events, lambda i: f"event {i}"))
    return asm
