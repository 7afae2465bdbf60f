"""Phantora Chrome/Perfetto traces (``timeline.json`` / ``timeline.json.gz``): write and read.

The layout is the one of Phantora's ``phantora_visualizer`` (PHANTORA_FORMATS.md section 3):
``[\\n`` + one complete event (``"ph": "X"``) per line, joined by ``,\\n``, + ``\\n]``.
``ts`` and ``dur`` are simulated microseconds.

* :func:`write_chrome_trace` turns a raw timeline (``tables.RAW_TIMELINE_COLUMNS``) into such a
  file, byte-for-byte deterministic (gzip ``mtime=0``, no file name in the gzip header).
* :func:`read_trace` parses a trace into a flow table (``tables.FLOW_COLUMNS``) and a per-host
  computation summary (``tables.COMPUTE_SUMMARY_COLUMNS``).

Reader design (performance): a background thread streams the file and inflates it in large
chunks (zlib releases the GIL, so inflation overlaps decoding on a second core); the main thread
cuts the text at the last ``,\\n`` (an element boundary in the visualizer layout) of each ~1 MiB
batch, overwrites that comma with ``]`` and decodes the batch in place in one ``msgspec`` call into
typed Structs (``gc=False``; events are a union tagged by ``cat``; ``ph`` is not checked and
Computation ``meta`` is skipped as ``msgspec.Raw``).
Columns are pulled out with C-level ``map``/``attrgetter`` passes, strings are factorized per
batch into small integer codes, and the 128-byte communicator ids are kept as raw JSON and
blake2b-hashed once per distinct communicator. Only the current chunk of text is ever in memory. A
valid JSON array in another layout (e.g. all on one line, or pretty-printed) is accepted too:
it is decoded as one document (memory then grows with the file).

This module does not import dagster.
"""

from __future__ import annotations

import gc
import gzip
import hashlib
import queue
import re
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from itertools import compress, repeat
from operator import attrgetter, itemgetter
from pathlib import Path

import msgspec
from msgspec.structs import astuple
import numpy as np
import pandas as pd

from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.io import atomic_path
from phantora_assets.lib.ring import CALL_TO_OP, DTYPE_BYTES
from phantora_assets.lib.tables import COMPUTE_SUMMARY_COLUMNS, FLOW_COLUMNS, RAW_TIMELINE_COLUMNS

__all__ = ["ParsedTrace", "read_trace", "write_chrome_trace", "comm_id_of"]

#: Largest ts/dur (µs) accepted; beyond it float64 can no longer hold integers exactly.
MAX_TIME_US = float(2**53)
_INT64_MAX = 2**63 - 1
_HOST_RE = re.compile(r"host-([0-9]+)")

# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------

_enc = msgspec.json.Encoder()
_COMM_LINE = (b'{"name":%s,"cat":"Communication","ph":"X","ts":%s,"dur":%s,"pid":%d,"tid":%d,'
              b'"args":{"Communication":[{"id":%d,"bytes":%d,"src":%s,"dst":%s,"token":null,"tenant_id":null,'
              b'"vsrc":null,"vdst":null,"udp_src_port":null},%s%d%s%s,"comm":{"rank":%d%s')
_COMP_LINE = (b'{"name":%s,"cat":"Computation","ph":"X","ts":%s,"dur":%s,"pid":%d,"tid":%d,'
              b'"args":{"Computation":[{"hostname":%s,"pid":%d},%d,%s]}}')
#: gzip level of written traces: 3 deflates ~3x faster than the default 9 for ~1.6x the size.
GZIP_LEVEL = 3
_FLOW_TAIL = b',"token":null,"tenant_id":null,"vsrc":null,"vdst":null,"udp_src_port":null}'


def _us(ns: int) -> bytes:
    """``ns / 1000`` as a JSON number: an int when exact, else up to 3 decimals."""
    q, r = divmod(ns, 1000)
    if r == 0:
        return str(q).encode()
    return f"{q}.{r:03d}".rstrip("0").encode()


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

    Args:
        raw: DataFrame with ``RAW_TIMELINE_COLUMNS`` (times in ns, ``end_ns >= start_ns >= 0``).
        path: output file; gzip-compressed when the name ends in ``.gz``. Written atomically;
            identical input gives a byte-identical file.

    Returns:
        ``{"n_events", "n_communication", "n_computation", "bytes_written"}``; bytes_written is
        the size of the file on disk.

    Raises:
        ValueError: missing columns, unknown kind, negative time or duration, or a
            communicator id that is not 256 hex digits.
    """
    missing = [c for c in RAW_TIMELINE_COLUMNS if c not in raw.columns]
    if missing:
        raise ValueError(f"raw timeline lacks columns {missing}")
    raw = raw.reset_index(drop=True)
    peers = _p2p_peers(raw)
    host_pid: dict[str, int] = {}
    lines: list[bytes] = []
    n_comm = n_comp = 0
    # Per-row work is kept to formatting the varying numbers: every JSON fragment that depends
    # only on repeated values (names, hosts, dtypes, communicators, streams) is encoded once.
    enc_cache: dict[str, bytes] = {}

    def js(v: str) -> bytes:
        b = enc_cache.get(v)
        if b is None:
            b = enc_cache[v] = _enc.encode(v)
        return b

    payload_cache: dict[tuple, tuple[bytes, bytes, bytes]] = {}
    meta_cache: dict[str, bytes] = {}
    dur_cache: dict[int, bytes] = {}
    cols = [raw[c].tolist() for c in RAW_TIMELINE_COLUMNS]
    (c_id, c_kind, c_name, c_start, c_end, c_src, c_dst, c_bytes, c_call, c_count, c_dtype, c_op, c_root, c_comm,
     c_rank, c_dev, c_sid, c_pid, c_meta) = cols
    for i in range(len(c_id)):
        start, end = int(c_start[i]), int(c_end[i])
        if start < 0 or end < start:
            raise ValueError(f"row {i} (event {c_id[i]}): bad span [{start}, {end}] ns")
        dev, sid = int(c_dev[i]), int(c_sid[i])
        name = js(str(c_name[i]))
        ts = _us(start)
        d = end - start
        du = dur_cache.get(d)
        if du is None:
            du = dur_cache[d] = _us(d)
        kind = c_kind[i]
        if kind == "communication":
            n_comm += 1
            call = str(c_call[i])
            src = str(c_src[i])
            pid = host_pid.setdefault(src, len(host_pid))
            p2p = call in ("NcclSend", "NcclRecv")
            null_stream = p2p and sid < 0
            tid = 0 if null_stream else (dev << 32) | sid
            cid = str(c_comm[i])
            key = (call, str(c_dtype[i]), str(c_op[i]), int(c_root[i]) if call == "NcclBcast" else 0, cid,
                   null_stream, dev, sid)
            parts = payload_cache.get(key)
            if parts is None:
                try:
                    ids = _enc.encode(list(bytes.fromhex(cid)))
                except ValueError as exc:
                    raise ValueError(f"row {i}: comm_id_hex is not hex: {cid[:40]!r}") from exc
                mid = b',"dtype":' + _enc.encode(key[1])
                if call in ("NcclAllReduce", "NcclReduceScatter"):
                    mid += b',"op":' + _enc.encode(key[2] or "Sum")
                elif call == "NcclBcast":
                    mid += b',"root":' + str(key[3]).encode()
                elif p2p:
                    mid += b',"peer":'
                tail = (b'}' + b',"stream":' + (b"null" if null_stream else
                                                b'{"device":' + str(dev).encode() + b',"id":' + str(sid).encode() + b'}')
                        + b'}}]}}')
                parts = payload_cache[key] = (b'{' + _enc.encode(call) + b':{"count":', mid, b',"id":' + ids + tail)
            pre, mid, post = parts
            peer = b"%d" % peers[i] if p2p else b""
            lines.append(_COMM_LINE % (name, ts, du, pid, tid, int(c_id[i]), int(c_bytes[i]), js(src),
                                       js(str(c_dst[i])), pre, int(c_count[i]), mid, peer, int(c_rank[i]), post))
        elif kind == "computation":
            n_comp += 1
            os_pid = int(c_pid[i])
            meta_txt = str(c_meta[i])
            meta = meta_cache.get(meta_txt) if len(meta_cache) < 4096 else None
            if meta is None:
                meta = _enc.encode(msgspec.json.decode(meta_txt)) if meta_txt else b"null"
                if len(meta_cache) < 4096:
                    meta_cache[meta_txt] = meta
            lines.append(_COMP_LINE % (name, ts, du, os_pid, (dev << 32) | sid, js(str(c_src[i])), os_pid,
                                       end - start, meta))
        else:
            raise ValueError(f"row {i}: unknown kind {kind!r}")
    data = b"[\n" + b",\n".join(lines) + b"\n]"
    path = Path(path)
    with atomic_path(path) as tmp:
        if path.name.endswith(".gz"):
            with open(tmp, "wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0,
                                                          compresslevel=GZIP_LEVEL) as gz:
                gz.write(data)
        else:
            tmp.write_bytes(data)
    return {"n_events": len(lines), "n_communication": n_comm, "n_computation": n_comp,
            "bytes_written": path.stat().st_size}


# ---------------------------------------------------------------------------------------------
# Reader: typed schema
# ---------------------------------------------------------------------------------------------


class _Flow(msgspec.Struct, gc=False):
    id: int
    bytes: int
    src: str
    dst: str


class _Payload(msgspec.Struct, gc=False):
    count: int
    dtype: str
    comm: msgspec.Raw            # {"rank": r, "id": [128 ints]}: decoded once per distinct value
    root: int = -1
    # op / peer / stream are not needed (stream = event tid); "stream": null is accepted.


# One payload class per call, so that ``type(payload)`` names the call.
class _AllReduce(_Payload, gc=False):
    pass


class _AllGather(_Payload, gc=False):
    pass


class _ReduceScatter(_Payload, gc=False):
    pass


class _Bcast(_Payload, gc=False):
    pass


class _Send(_Payload, gc=False):
    pass


class _Recv(_Payload, gc=False):
    pass


class _Call(msgspec.Struct, gc=False, forbid_unknown_fields=True):
    """The externally tagged NCCL call ``{"NcclAllReduce": {...}}`` (a struct decodes faster than a dict)."""

    NcclAllReduce: _AllReduce | None = None
    NcclAllGather: _AllGather | None = None
    NcclReduceScatter: _ReduceScatter | None = None
    NcclBcast: _Bcast | None = None
    NcclSend: _Send | None = None
    NcclRecv: _Recv | None = None


_PAYLOAD_CALL: dict[type, str] = {
    _AllReduce: "NcclAllReduce", _AllGather: "NcclAllGather", _ReduceScatter: "NcclReduceScatter",
    _Bcast: "NcclBcast", _Send: "NcclSend", _Recv: "NcclRecv",
}


class _Comm(msgspec.Struct):
    rank: int
    id: list[int]


class _CompHost(msgspec.Struct, gc=False):
    hostname: str


class _CommArgs(msgspec.Struct, gc=False):
    Communication: tuple[_Flow, _Call]


class _CompArgs(msgspec.Struct, gc=False):
    Computation: tuple[_CompHost, int, msgspec.Raw]   # meta is skipped (kept raw, never decoded)


# Events are a union tagged by "cat"; "ph" is not checked (Phantora writes only "X" events).
class _CommEvent(msgspec.Struct, gc=False, tag_field="cat", tag="Communication"):
    name: str
    ts: float
    dur: float
    tid: int
    args: _CommArgs


class _CompEvent(msgspec.Struct, gc=False, tag_field="cat", tag="Computation"):
    ts: float
    dur: float
    args: _CompArgs


_batch_decoder = msgspec.json.Decoder(list[_CommEvent | _CompEvent])
_comm_decoder = msgspec.json.Decoder(_Comm)

_g_ts, _g_dur, _g_tid, _g_name = (attrgetter(a) for a in ("ts", "dur", "tid", "name"))
_g_commargs = attrgetter("args.Communication")
_g_compargs = attrgetter("args.Computation")
_g_id, _g_bytes, _g_src, _g_dst = (attrgetter(a) for a in ("id", "bytes", "src", "dst"))
_g_count, _g_dtype, _g_comm, _g_root = (attrgetter(a) for a in ("count", "dtype", "comm", "root"))
_g_hostname = attrgetter("hostname")
_first, _second = itemgetter(0), itemgetter(1)


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
    """

    path: Path
    flows: pd.DataFrame
    compute: pd.DataFrame
    n_events: int


def comm_id_of(id_bytes: bytes | list[int]) -> str:
    """Short communicator id: 16 hex chars of ``blake2b(bytes(id), digest_size=8)``."""
    return hashlib.blake2b(bytes(id_bytes), digest_size=8).hexdigest()


def read_trace(path: str | Path, *, chunk_bytes: int = 1 << 20) -> ParsedTrace:
    """Parse a Phantora Chrome trace (``.json`` or ``.json.gz``; gzip is detected by magic bytes).

    Memory stays bounded by a few chunks of text plus the output tables for the visualizer
    layout (and for any layout whose elements are separated by ``,\\n``); other layouts are
    decoded as one document.

    Args:
        path: the trace file.
        chunk_bytes: size of the decompressed text batches (tuning only).

    Returns:
        A :class:`ParsedTrace`; ``flows.ts_us``/``dur_us`` in µs, ``bytes`` in bytes,
        ``src_node = k - 1`` for ``host-k``, ``stream`` = event tid, ``root`` = -1 except
        for NcclBcast.

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
    acc = _Accumulator(path)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        try:
            _parse_stream(path, chunk_bytes, acc)
        except _NeedWholeDoc:
            acc = _Accumulator(path)
            _parse_whole(path, acc)
        return acc.finish()
    finally:
        if gc_was:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# Reader: byte stream
# ---------------------------------------------------------------------------------------------

_DONE = object()


def _raw_chunks(path: Path, out_bytes: int) -> Iterator[bytes]:
    """Decompressed chunks of the file (gzip by magic, multi-member ok), each <= ~out_bytes."""
    with open(path, "rb") as fh:
        data = fh.read(1 << 20)
        if data[:2] != b"\x1f\x8b":
            while data:
                yield data
                data = fh.read(out_bytes)
            return
        d = None
        while True:
            while data:
                if d is None:
                    if not data.lstrip(b"\0"):  # zero padding after the last member
                        break
                    d = zlib.decompressobj(wbits=31)
                try:
                    out = d.decompress(data, out_bytes)
                except zlib.error as exc:
                    raise TraceFormatError(path, "corrupt gzip", str(exc)) from None
                if out:
                    yield out
                if d.eof:
                    data, d = d.unused_data, None
                else:
                    data = d.unconsumed_tail
            while d is not None and not d.eof:  # drain output still pending inside zlib
                out = d.decompress(b"", out_bytes)
                if not out:
                    break
                yield out
            if d is not None and d.eof:
                data, d = d.unused_data, None
                if data:
                    continue
            data = fh.read(1 << 20)
            if not data:
                if d is not None:
                    raise TraceFormatError(path, "truncated gzip", "compressed stream ends before its end marker")
                return


class _Producer(threading.Thread):
    """Inflates the file on a background thread into a bounded queue."""

    def __init__(self, path: Path, out_bytes: int) -> None:
        super().__init__(daemon=True)
        self.path, self.out_bytes = path, out_bytes
        self.q: queue.Queue = queue.Queue(maxsize=3)
        self.stop = threading.Event()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run(self) -> None:
        try:
            for chunk in _raw_chunks(self.path, self.out_bytes):
                if not self._put(chunk):
                    return
            self._put(_DONE)
        except BaseException as exc:  # handed to the consumer
            self._put(exc)

    def chunks(self) -> Iterator[bytes]:
        self.start()
        try:
            while True:
                item = self.q.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.stop.set()
            self.join()


class _NeedWholeDoc(Exception):
    """The text is not cut into elements at ``,\\n``: decode it as a whole document."""


_WS = b" \t\r\n"


def _check_start(path: Path, head: bytes) -> None:
    c = head[:1]
    if c == b"[":
        return
    if not c:
        raise TraceFormatError(path, "invalid JSON", "empty document")
    if c in b'{"-0123456789tfn':
        raise TraceFormatError(path, "not a JSON array", f"document starts with {c.decode()!r}")
    raise TraceFormatError(path, "invalid JSON", f"line 1: unexpected {c!r}")


def _parse_stream(path: Path, chunk_bytes: int, acc: "_Accumulator") -> None:
    # buf always holds "[" + text not yet decoded; a batch is cut at its last ",\n", whose comma
    # is overwritten by "]" so that msgspec decodes buf[:cut + 1] in place (no copy).
    buf = bytearray(b"[")
    line = 1                    # line number of buf[1]
    started = False
    for chunk in _Producer(path, chunk_bytes).chunks():
        if not started:
            head = bytes(buf[1:]) + chunk
            stripped = head.lstrip(_WS)
            if not stripped:
                buf = bytearray(b"[") + head
                continue
            line += head.count(b"\n", 0, len(head) - len(stripped))
            _check_start(path, stripped)
            buf = bytearray(stripped)  # keeps the document's own "["
            started = True
            start = 0
        else:
            start = len(buf) - 1
            buf += chunk
        if len(buf) < chunk_bytes:
            continue
        cut = buf.rfind(b",\n", max(start, 1))
        if cut < 0:
            continue  # no element boundary yet (e.g. one-line JSON): keep reading
        buf[cut] = 0x5D  # "]"
        _decode_piece(path, buf, cut + 1, line, acc)
        line += buf.count(b"\n", 0, cut) + 1
        del buf[1:cut + 2]
    if not started:
        _check_start(path, b"")
    # final piece: elements then "]"
    tail = bytes(buf[1:]).rstrip(_WS)
    if not tail.endswith(b"]"):
        ln = line + tail.count(b"\n")
        raise TraceFormatError(path, "invalid JSON", f"line {ln}: document ends before the closing ']'")
    body = tail[:-1]
    if body.strip(_WS):
        if body.rstrip(_WS).endswith(b","):
            ln = line + body.rstrip(_WS).count(b"\n")
            raise TraceFormatError(path, "invalid JSON", f"line {ln}: trailing comma before ']'")
        final = bytearray(b"[") + body + b"]"
        _decode_piece(path, final, len(final), line, acc)
    elif acc.n_events:
        raise TraceFormatError(path, "invalid JSON", f"line {line}: trailing comma before ']'")


def _parse_whole(path: Path, acc: "_Accumulator") -> None:
    data = b"".join(_raw_chunks(path, 64 << 20))
    stripped = data.lstrip(_WS)
    _check_start(path, stripped)
    line0 = 1 + data.count(b"\n", 0, len(data) - len(stripped))
    try:
        events = _batch_decoder.decode(stripped)
    except msgspec.ValidationError as exc:  # (a subclass of DecodeError)
        raise _validation_error(path, exc, lambda i: f"event {i}") from None
    except msgspec.DecodeError as exc:
        m = re.search(r"byte (\d+)", str(exc))
        ln = line0 + stripped.count(b"\n", 0, int(m.group(1))) if m else "?"
        raise TraceFormatError(path, "invalid JSON", f"line {ln}: {exc}") from None
    acc.add(events, lambda i: f"event {i}")


def _validation_error(path: Path, exc: Exception, where: Callable[[int], str]) -> TraceFormatError:
    """Maps a msgspec ValidationError to the rule it breaks, located at its event."""
    msg = str(exc)
    m = re.search(r"\$\[(\d+)\]", msg)
    loc = where(int(m.group(1))) if m else "?"
    rule = "invalid event"
    u = re.search(r"unknown field `([^`]*)` - at `[^`]*Communication\[1\]`", msg)
    if u:
        rule = "unknown NCCL op"
        msg = f"{u.group(1)!r}: {msg}"
    elif "out of range" in msg:
        rule = "overflowing duration" if re.search(r"\.(ts|dur)`", msg) else "overflowing value"
    return TraceFormatError(path, rule, f"{loc}: {msg}")


def _looks_like_layout(body: bytes) -> bool:
    """Every non-blank line is one ``{...}`` element (optionally followed by a comma)."""
    for ln in body.split(b"\n"):
        s = ln.strip(_WS)
        if s and not (s.startswith(b"{") and s.rstrip(b",").rstrip(_WS).endswith(b"}")):
            return False
    return True


def _decode_piece(path: Path, buf: bytearray, end: int, line0: int, acc: "_Accumulator") -> None:
    """Decode ``buf[:end]`` = ``[`` + elements + ``]``; ``buf[1]`` is on line ``line0``.

    Every reference into ``buf`` (msgspec.Raw values) is dropped before returning, so that the
    caller may resize it.
    """
    mv = memoryview(buf)
    view = mv[:end]
    try:
        events = _batch_decoder.decode(view)
    except msgspec.ValidationError as exc:  # (a subclass of DecodeError)
        body = bytes(buf[1:end - 1])
        raise _validation_error(path, exc, _locator(body, line0)) from None
    except msgspec.DecodeError as exc:
        body = bytes(buf[1:end - 1])
        if not _looks_like_layout(body):
            raise _NeedWholeDoc() from None
        m = re.search(r"byte (\d+)", str(exc))
        ln = line0 + body.count(b"\n", 0, max(0, int(m.group(1)) - 1)) if m else "?"
        raise TraceFormatError(path, "invalid JSON", f"line {ln}: {exc}") from None
    if not events:
        raise TraceFormatError(path, "invalid JSON", f"line {line0}: empty element")
    acc.add(events, _locator_lazy(buf, end, line0))  # on error buf is abandoned: no release needed
    del events
    view.release()
    mv.release()


def _locator_lazy(buf: bytearray, end: int, line0: int) -> Callable[[int], str]:
    return lambda i: _locator(bytes(buf[1:end - 1]), line0)(i)


def _locator(body: bytes, line0: int) -> Callable[[int], str]:
    """Maps an event index of a batch to ``"line L"`` (error path only)."""

    def where(i: int) -> str:
        starts = [k for k, ln in enumerate(body.split(b"\n")) if ln.strip(_WS)]
        if i < len(starts) and _looks_like_layout(body):
            return f"line {line0 + starts[i]}"
        return f"event {i} of the batch starting at line {line0}"

    return where


# ---------------------------------------------------------------------------------------------
# Reader: column accumulation
# ---------------------------------------------------------------------------------------------


class _Codes:
    """Global factorization of a string-ish column across batches."""

    def __init__(self) -> None:
        self.index: dict = {}
        self.values: list = []

    def encode(self, items: list) -> np.ndarray:
        codes, uniq = pd.factorize(np.fromiter(items, object, len(items)), use_na_sentinel=False)
        gmap = np.empty(len(uniq), dtype=np.int32)
        for k, u in enumerate(uniq):
            g = self.index.get(u)
            if g is None:
                g = self.index[u] = len(self.values)
                self.values.append(u)
            gmap[k] = g
        return gmap[codes]


class _Accumulator:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.n_events = 0
        self.cols: dict[str, list[np.ndarray]] = {k: [] for k in (
            "flow_id", "ts", "dur", "bytes", "count", "root", "stream",
            "name", "src", "dst", "call", "dtype", "comm")}
        self.codes = {k: _Codes() for k in ("name", "host", "call", "dtype", "comm")}
        self.ch_codes = _Codes()
        self.ch_n = np.zeros(0, np.int64)
        self.ch_busy = np.zeros(0, np.float64)
        self.ch_first = np.zeros(0, np.float64)
        self.ch_last = np.zeros(0, np.float64)

    def err(self, rule: str, detail: str) -> TraceFormatError:
        return TraceFormatError(self.path, rule, detail)

    def _ints(self, items, n: int, what: str, where) -> np.ndarray:
        try:
            return np.fromiter(items, np.int64, n)
        except OverflowError:
            raise self.err("overflowing value", f"{what} beyond int64") from None

    def add(self, events: list, where: Callable[[int], str]) -> None:
        n = len(events)
        self.n_events += n
        ts = np.fromiter(map(_g_ts, events), np.float64, n)
        dur = np.fromiter(map(_g_dur, events), np.float64, n)
        with np.errstate(invalid="ignore"):
            bad = ~((ts >= 0) & (dur >= 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise self.err("negative duration", f"{where(i)}: ts={ts[i]!r} dur={dur[i]!r}")
        bad = ~((ts <= MAX_TIME_US) & (dur <= MAX_TIME_US))
        if bad.any():
            i = int(np.argmax(bad))
            raise self.err("overflowing duration", f"{where(i)}: ts={ts[i]!r} dur={dur[i]!r}")
        is_comm = np.fromiter(map(isinstance, events, repeat(_CommEvent, n)), bool, n)
        if is_comm.any():
            self._add_comm(events, is_comm, ts, dur, where)
        is_comp = ~is_comm
        if is_comp.any():
            self._add_comp(events, is_comp, ts, dur, where)

    def _add_comm(self, events, mask, ts, dur, where) -> None:
        ev = list(compress(events, mask))
        m = len(ev)
        cargs = list(map(_g_commargs, ev))
        flows = list(map(_first, cargs))
        calls = list(map(_second, cargs))
        # first non-None field of each call struct, all at C level
        payloads = list(map(next, map(partial(filter, None), map(astuple, calls))))
        if len(payloads) != m:
            raise self.err("unknown NCCL op", "an NCCL call object names no known call")
        c = self.cols
        c["ts"].append(ts[mask])
        c["dur"].append(dur[mask])
        c["stream"].append(self._ints(map(_g_tid, ev), m, "tid", where))
        c["flow_id"].append(self._ints(map(_g_id, flows), m, "flow id", where))
        c["bytes"].append(self._ints(map(_g_bytes, flows), m, "bytes", where))
        c["count"].append(self._ints(map(_g_count, payloads), m, "count", where))
        c["root"].append(self._ints(map(_g_root, payloads), m, "root", where))
        k = self.codes
        c["name"].append(k["name"].encode(list(map(_g_name, ev))))
        c["src"].append(k["host"].encode(list(map(_g_src, flows))))
        c["dst"].append(k["host"].encode(list(map(_g_dst, flows))))
        c["call"].append(k["call"].encode(list(map(type, payloads))))
        c["dtype"].append(k["dtype"].encode(list(map(_g_dtype, payloads))))
        c["comm"].append(k["comm"].encode(list(map(bytes, map(_g_comm, payloads)))))

    def _add_comp(self, events, mask, ts, dur, where) -> None:
        ev = list(compress(events, mask))
        cargs = list(map(_g_compargs, ev))
        hosts = self.ch_codes.encode(list(map(_g_hostname, map(_first, cargs))))
        nh = len(self.ch_codes.values)
        if nh > len(self.ch_n):
            grow = nh - len(self.ch_n)
            self.ch_n = np.concatenate([self.ch_n, np.zeros(grow, np.int64)])
            self.ch_busy = np.concatenate([self.ch_busy, np.zeros(grow)])
            self.ch_first = np.concatenate([self.ch_first, np.full(grow, np.inf)])
            self.ch_last = np.concatenate([self.ch_last, np.full(grow, -np.inf)])
        t, d = ts[mask], dur[mask]
        self.ch_n += np.bincount(hosts, minlength=nh)
        self.ch_busy += np.bincount(hosts, weights=d, minlength=nh)
        np.minimum.at(self.ch_first, hosts, t)
        np.maximum.at(self.ch_last, hosts, t + d)

    # -- final assembly ------------------------------------------------------------------------

    def _node(self, host: str) -> int:
        m = _HOST_RE.fullmatch(host) if isinstance(host, str) else None
        if not m or int(m.group(1)) < 1:
            raise self.err("bad host name", f"{host!r} is not of the form host-<k>, k >= 1")
        return int(m.group(1)) - 1

    def finish(self) -> ParsedTrace:
        if self.n_events == 0:
            raise self.err("empty trace", "the JSON array has no events")
        flows = self._flows()
        compute = self._compute()
        return ParsedTrace(path=self.path, flows=flows, compute=compute, n_events=self.n_events)

    def _flows(self) -> pd.DataFrame:
        c = self.cols
        if not c["ts"]:
            return pd.DataFrame({k: pd.Series([], dtype=v if v != "str" else object)
                                 for k, v in FLOW_COLUMNS.items()})
        col = {k: np.concatenate(v) for k, v in c.items()}
        k = self.codes
        # validate and map the small dictionaries
        calls = [_PAYLOAD_CALL[t] for t in k["call"].values]
        for cl in calls:
            if cl not in CALL_TO_OP:
                raise self.err("unknown NCCL op", f"{cl!r}")
        dtypes = k["dtype"].values
        for dt in dtypes:
            if dt not in DTYPE_BYTES:
                raise self.err("unknown dtype", f"{dt!r}")
        hosts = k["host"].values
        nodes = np.array([self._node(h) for h in hosts], dtype=np.int64)
        comm_rank = np.empty(len(k["comm"].values), np.int64)
        comm_hex = []
        for j, raw in enumerate(k["comm"].values):
            try:
                cm = _comm_decoder.decode(raw)
                hx = comm_id_of(cm.id)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                raise self.err("bad communicator", f"{raw[:80]!r}: {exc}") from None
            comm_rank[j] = cm.rank
            comm_hex.append(hx)
        if (col["bytes"] < 0).any():
            i = int(np.argmax(col["bytes"] < 0))
            raise self.err("negative bytes", f"flow {int(col['flow_id'][i])}: bytes={int(col['bytes'][i])}")
        if (col["count"] < 0).any():
            i = int(np.argmax(col["count"] < 0))
            raise self.err("negative bytes", f"flow {int(col['flow_id'][i])}: count={int(col['count'][i])}")
        order = np.lexsort((col["flow_id"], col["ts"]))
        for key in col:
            col[key] = col[key][order]

        def strings(values, codes):
            return np.array(values + [None], dtype=object)[:-1][codes]

        call_c = col["call"]
        bcast = np.array([cl == "NcclBcast" for cl in calls], dtype=bool)[call_c]
        out = {
            "flow_id": col["flow_id"],
            "ts_us": col["ts"],
            "dur_us": col["dur"],
            "src_host": strings(hosts, col["src"]),
            "dst_host": strings(hosts, col["dst"]),
            "src_node": nodes[col["src"]],
            "dst_node": nodes[col["dst"]],
            "bytes": col["bytes"],
            "call": strings(calls, call_c),
            "op": strings([CALL_TO_OP[cl] for cl in calls], call_c),
            "dtype": strings(dtypes, col["dtype"]),
            "dtype_bytes": np.array([DTYPE_BYTES[d] for d in dtypes], dtype=np.int64)[col["dtype"]],
            "count": col["count"],
            "comm_id": strings(comm_hex, col["comm"]),
            "comm_rank": comm_rank[col["comm"]],
            "root": np.where(bcast, col["root"], -1).astype(np.int64),
            "stream": col["stream"],
            "name": strings(k["name"].values, col["name"]),
        }
        return pd.DataFrame(out, columns=list(FLOW_COLUMNS))

    def _compute(self) -> pd.DataFrame:
        hosts = self.ch_codes.values
        for h in hosts:
            self._node(h)
        df = pd.DataFrame({
            "host": np.array(hosts + [None], dtype=object)[:-1],
            "n_events": self.ch_n.astype(np.int64),
            "busy_us": self.ch_busy.astype(np.float64),
            "first_ts_us": self.ch_first.astype(np.float64),
            "last_end_us": self.ch_last.astype(np.float64),
        }, columns=list(COMPUTE_SUMMARY_COLUMNS))
        return df.sort_values("host", kind="stable").reset_index(drop=True)

