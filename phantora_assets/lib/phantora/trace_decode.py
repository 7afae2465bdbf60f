"""Typed decoding of trace batches into column arrays (the engine of ``chrome_trace.read_trace``).

This module imports neither pandas nor dagster.

:class:`BatchDecoder` decodes one batch (``[`` + whole elements + ``]``, cut by
``trace_batches.iter_batches``) in place. It first hands the batch to the compiled scanner
``_tracescan.scan`` (C, built with the package; it runs without the GIL and returns the flow
columns directly), which takes the batches it can decode exactly as the msgspec schema below
would and declines the others (odd shapes, non-ASCII text, escapes in kept strings, integers
beyond int64, a key twice in an object, any broken rule). A declined batch is decoded in one
``msgspec`` call (its keys then checked by ``trace_batches.duplicate_key``) into typed Structs
(the schema of ``docs/PHANTORA_FORMATS.md`` section 3: a union tagged by ``cat``; the NCCL call
is a one-key dict whose key is a ``Literal`` of the six calls, ``dtype`` a ``Literal`` of the ten
dtypes; Computation ``meta`` is skipped as ``msgspec.Raw``) and pulls the flow columns out with
C-level ``map``/``zip`` passes. Strings are coded through per-decoder tables (:class:`CodeTable`);
each distinct communicator object text is decoded and validated once. Computation events are
only summed per host. Times (``ts``, ``dur``) are float64 µs, at most :data:`MAX_TIME_US`; counts
and bytes int64. The code tables :data:`CALLS` / :data:`DTYPES` (indices of the ``call`` /
``dtype`` columns) are shared with the reader and the C scanner.

Errors are raised as :class:`BatchError` (rule, detail naming the line) or :class:`NeedWholeDoc`
(the text is in another layout); ``read_trace`` adds the file name.
"""

import re
import types
from collections.abc import Callable
from itertools import compress, repeat
from operator import attrgetter, itemgetter
from typing import Annotated, Literal

import msgspec
import numpy as np
from msgspec.structs import astuple

from phantora_assets.lib.phantora.trace_batches import duplicate_key, locator, looks_like_layout
from phantora_assets.lib.traffic.ring import CALL_TO_OP, DTYPE_BYTES

_tracescan: types.ModuleType | None  # _tracescan.pyi declares scan()
try:  # the compiled fast path (built with the package; without it every batch goes to msgspec)
    from phantora_assets.lib.phantora import _tracescan
except ImportError:  # pragma: no cover - no C compiler where the package was installed
    _tracescan = None

#: Largest ts/dur (µs) accepted; beyond it float64 can no longer hold integers exactly.
MAX_TIME_US = float(2**53)

CALLS: tuple[str, ...] = tuple(CALL_TO_OP)
DTYPES: tuple[str, ...] = tuple(DTYPE_BYTES)
_CALL_CODE = {c: i for i, c in enumerate(CALLS)}
_DTYPE_CODE = {d: i for i, d in enumerate(DTYPES)}
_CALLS_B = tuple(c.encode() for c in CALLS)
_DTYPES_B = tuple(d.encode() for d in DTYPES)


class BatchError(Exception):
    """A batch breaks a format rule: ``rule`` (short name) and ``detail`` (where, what)."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(rule, detail)
        self.rule, self.detail = rule, detail


class NeedWholeDoc(Exception):
    """The text is not cut into elements at ``,\\n``: decode it as one document."""


# ---------------------------------------------------------------------------------------------
# Typed schema (docs/PHANTORA_FORMATS.md section 3); unknown fields are ignored
# ---------------------------------------------------------------------------------------------

_DType = Literal[DTYPES]  # type: ignore[valid-type]
_CallName = Literal[CALLS]  # type: ignore[valid-type]


class _Flow(msgspec.Struct, gc=False):
    id: int
    bytes: int
    src: str
    dst: str


class _Comm(msgspec.Struct, forbid_unknown_fields=True):
    rank: Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]  # an int64 column
    id: list[int]


class _CompHost(msgspec.Struct, gc=False):
    hostname: str


class _CompArgs(msgspec.Struct, gc=False):
    Computation: tuple[_CompHost, int, msgspec.Raw]  # meta is skipped (kept raw, never decoded)


class _CompEvent(msgspec.Struct, gc=False, tag_field="cat", tag="Computation"):
    ts: float
    dur: float
    args: _CompArgs


class _Payload(msgspec.Struct, gc=False):
    count: int
    dtype: _DType
    comm: msgspec.Raw  # {"rank": r, "id": [128 ints]}: decoded once per distinct text
    root: int = -1  # op / peer / stream are not needed (stream = event tid); "stream": null is accepted


class _CommArgs(msgspec.Struct, gc=False):
    Communication: tuple[_Flow, dict[_CallName, _Payload]]


class _CommEvent(msgspec.Struct, gc=False, tag_field="cat", tag="Communication"):  # "ph" is not checked (all "X")
    name: str
    ts: float
    dur: float
    tid: int
    args: _CommArgs


_decoder = msgspec.json.Decoder(list[_CommEvent | _CompEvent])
_comm_decoder = msgspec.json.Decoder(_Comm)

_g_ts, _g_dur = attrgetter("ts"), attrgetter("dur")
_g_comm_fields = attrgetter("name", "ts", "dur", "tid", "args.Communication")
_g_comp_host = attrgetter("args.Computation")
_g_hostname = attrgetter("hostname")
_first = itemgetter(0)


class CodeTable(dict):
    """``value -> dense code``; new values are appended to ``values`` (codes in order)."""

    def __init__(self) -> None:
        super().__init__()
        # shadows dict.values on purpose: ``values`` (the list of values in code order) is the
        # interface the reader, the helpers and tests/unit/lib/phantora/test_tracescan.py read; a dict subclass
        # keeps every lookup in C (``__missing__`` only runs for a new value)
        self.values: list = []  # type: ignore[assignment]

    def __missing__(self, key):
        code = self[key] = len(self.values)
        self.values.append(key)
        return code

    def codes(self, items, n: int) -> np.ndarray:
        return np.fromiter(map(self.__getitem__, items), np.int32, n)


class _BadComm(Exception):
    pass


class _CommTable(CodeTable):
    """Communicator object text -> dense code; ``values`` holds ``(rank, id bytes)`` per code."""

    def __missing__(self, key: bytes) -> int:
        try:
            cm = _comm_decoder.decode(key)
            ident = bytes(cm.id)
        except (msgspec.DecodeError, ValueError):
            raise _BadComm(key) from None
        code = self[key] = len(self.values)
        self.values.append((cm.rank, ident))
        return code


# ---------------------------------------------------------------------------------------------
# Batch decoder
# ---------------------------------------------------------------------------------------------


class BatchDecoder:
    """Decodes batches into column arrays; string and communicator codes are local to it.

    ``names.values``, ``hosts.values`` (str) and ``comms.values`` (``(rank, id bytes)``) list
    the values of the codes in the arrays it returns; they only grow. ``fast=False`` (or a
    package installed without a C compiler) decodes every batch with msgspec; the columns and
    tables are the same either way (``tests/unit/lib/phantora/test_tracescan.py``).
    """

    def __init__(self, fast: bool = True) -> None:
        self.names = CodeTable()
        self.hosts = CodeTable()
        self.comms = _CommTable()
        self.fast = fast and _tracescan is not None

    def decode(self, buf: bytes | bytearray | memoryview, end: int, offset: int, line_of: Callable[[int], int]) -> dict:
        """Decode one batch in place: ``buf[:end]`` = ``[`` + elements + ``]``.

        ``offset`` is the text offset of ``buf[1]`` and ``line_of(offset)`` its line (only
        called to report an error). ``buf`` may be resized again once this returns.

        Returns a dict of column arrays: ``n_events``; for Communication events ``ts``,
        ``dur``, ``stream``, ``flow_id``, ``bytes``, ``count``, ``root`` and the codes
        ``name``, ``src``, ``dst``, ``comm`` (tables of this decoder), ``call`` and ``dtype``
        (indices into ``CALLS`` / ``DTYPES``); for Computation events ``comp_host`` (host code),
        ``comp_ts`` and ``comp_dur`` per event, ``comp_first`` and ``comp_last`` per host code.

        Raises:
            BatchError: a rule is broken (the detail names the line).
            NeedWholeDoc: the batch is not whole elements (another layout).
        """

        def where(i: int) -> str:
            return locator(bytes(buf[1 : end - 1]), offset, line_of)(i)

        if self.fast and _tracescan is not None:
            # the compiled scanner takes the batches it decodes exactly as msgspec would; any other
            # batch (one with a key twice, one breaking a rule) msgspec decodes below, naming the rule
            with memoryview(buf) as whole, whole[:end] as batch:
                res = _tracescan.scan(batch, _CALLS_B, _DTYPES_B)
            cols = self._scanned(res)
            if cols is not None:
                return cols
        mv = memoryview(buf)
        view = mv[:end]
        try:
            events = _decoder.decode(view)
        except msgspec.ValidationError as exc:  # (a subclass of DecodeError)
            raise validation_error(exc, where) from None
        except RecursionError as exc:  # msgspec's nesting limit (about 1000 levels)
            raise BatchError(
                "invalid JSON", f"an event of the batch starting at line {line_of(offset)} nests too deep: {exc}"
            ) from None
        except msgspec.DecodeError as exc:
            body = bytes(buf[1 : end - 1])
            if not looks_like_layout(body):
                raise NeedWholeDoc() from None
            m = re.search(r"byte (\d+)", str(exc))
            ln = line_of(offset) + body.count(b"\n", 0, max(0, int(m.group(1)) - 1)) if m else "?"
            raise BatchError("invalid JSON", f"line {ln}: {exc}") from None
        if (twice := duplicate_key(bytes(view), line_of(offset))) is not None:  # msgspec kept the last
            raise BatchError(*twice)
        cols = self._columns(events, where)  # on error buf is abandoned: no release needed
        del events  # drops every msgspec.Raw into buf, so that buf can be resized
        view.release()
        mv.release()
        return cols

    def _scanned(self, res: tuple | None) -> dict | None:
        """Columns of a batch from ``_tracescan.scan``'s answer (same as :meth:`_columns` gives
        for it), or None when it declined the batch or a value breaks a rule (msgspec's path
        then names the rule and the line)."""
        if res is None:
            return None
        # the Communication columns, then the Computation ones and the batch's tables (local codes)
        n, ts, dur, tid, fid, nbytes, count, root, name, src, dst, comm, call, dtype = res[:14]
        c_ts, c_dur, c_host, names, hosts, comms = res[14:]
        f8, i8, i4, i1 = np.float64, np.int64, np.int32, np.int8
        ts, dur = np.frombuffer(ts, f8), np.frombuffer(dur, f8)
        c_ts, c_dur = np.frombuffer(c_ts, f8), np.frombuffer(c_dur, f8)
        for t in (ts, dur, c_ts, c_dur):
            if not ((t >= 0) & (t <= MAX_TIME_US)).all():
                return None
        try:
            comm_code = self.comms.codes(comms, len(comms))
        except _BadComm:
            return None
        src, dst, c_host = np.frombuffer(src, i4), np.frombuffer(dst, i4), np.frombuffer(c_host, i4)
        # host codes in the order msgspec's path gives them: first seen in src, dst, then Computation
        host_code = np.empty(len(hosts), np.int32)
        done = np.zeros(len(hosts), bool)
        for col in (src, dst, c_host):
            first = np.unique(col, return_index=True)[1]
            for local in col[np.sort(first)]:
                if not done[local]:
                    host_code[local] = self.hosts[hosts[local].decode()]
                    done[local] = True
        out: dict = {"n_events": n}
        m = len(ts)
        if m:
            name_code = np.fromiter((self.names[v.decode()] for v in names), np.int32, len(names))
            out.update(
                {
                    "stream": np.frombuffer(tid, i8),
                    "flow_id": np.frombuffer(fid, i8),
                    "bytes": np.frombuffer(nbytes, i8),
                    "count": np.frombuffer(count, i8),
                    "root": np.frombuffer(root, i8),
                    "comm": comm_code[np.frombuffer(comm, i4)],
                    "name": name_code[np.frombuffer(name, i4)],
                    "src": host_code[src],
                    "dst": host_code[dst],
                    "call": np.frombuffer(call, i1),
                    "dtype": np.frombuffer(dtype, i1),
                    "ts": ts,
                    "dur": dur,
                }
            )
        if m < n:
            out.update(self._comp_summary(host_code[c_host], c_ts, c_dur))
        return out

    def decode_events(self, events: list, where: Callable[[int], str]) -> dict:
        """Columns of events decoded by :func:`decode_document` (whole-document fallback)."""
        return self._columns(events, where)

    def _columns(self, events: list, where: Callable[[int], str]) -> dict:
        n = len(events)
        if n == 0:
            raise BatchError("invalid JSON", f"{where(0)}: empty element")
        is_comm = np.fromiter(map(isinstance, events, repeat(_CommEvent, n)), bool, n)
        m = int(is_comm.sum())
        ce = list(compress(events, is_comm)) if m else []
        pe = list(compress(events, ~is_comm)) if m < n else []
        ts = np.empty(n, np.float64)
        dur = np.empty(n, np.float64)
        if m:
            name, c_ts, c_dur, tid, comm_args = zip(*map(_g_comm_fields, ce))
            ts[is_comm] = c_ts
            dur[is_comm] = c_dur
        if m < n:
            ts[~is_comm] = np.fromiter(map(_g_ts, pe), np.float64, n - m)
            dur[~is_comm] = np.fromiter(map(_g_dur, pe), np.float64, n - m)
        with np.errstate(invalid="ignore"):
            bad = ~((ts >= 0) & (dur >= 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise BatchError("negative duration", f"{where(i)}: ts={ts[i]!r} dur={dur[i]!r}")
        bad = ~((ts <= MAX_TIME_US) & (dur <= MAX_TIME_US))
        if bad.any():
            i = int(np.argmax(bad))
            raise BatchError("overflowing duration", f"{where(i)}: ts={ts[i]!r} dur={dur[i]!r}")
        out: dict = {"n_events": n}
        if m:
            index = np.flatnonzero(is_comm)
            out.update(self._comm_columns(name, tid, comm_args, m, lambda i: where(int(index[i]))))
            out["ts"], out["dur"] = ts[is_comm], dur[is_comm]
        if m < n:
            is_comp = ~is_comm
            hosts = self.hosts.codes(map(_g_hostname, map(_first, map(_g_comp_host, pe))), n - m)
            out.update(self._comp_summary(hosts, ts[is_comp], dur[is_comp]))
        return out

    def _comm_columns(self, name: tuple, tid: tuple, comm_args: tuple, m: int, where: Callable[[int], str]) -> dict:
        flows, calls = zip(*comm_args)
        try:
            call, payloads = zip(*map(dict.popitem, calls))
        except KeyError:
            i = next(k for k, c in enumerate(calls) if not c)
            raise BatchError("unknown NCCL op", f"{where(i)}: the NCCL call object names no call") from None
        if any(calls):  # a second key was left behind
            i = next(k for k, c in enumerate(calls) if c)
            raise BatchError("invalid event", f"{where(i)}: the NCCL call object names more than one call")
        fid, nbytes, src, dst = zip(*map(astuple, flows))
        count, dtype, comm, root = zip(*map(astuple, payloads))
        cols: dict = {}
        for key, vals in (("stream", tid), ("flow_id", fid), ("bytes", nbytes), ("count", count), ("root", root)):
            try:
                cols[key] = np.array(vals, dtype=np.int64)
            except OverflowError:
                i = next(k for k, v in enumerate(vals) if not -(2**63) <= v < 2**63)
                raise BatchError("overflowing value", f"{where(i)}: {key} {vals[i]} beyond int64") from None
        try:
            cols["comm"] = self.comms.codes(map(bytes, comm), m)
        except _BadComm as exc:
            i = next(k for k, c in enumerate(comm) if bytes(c) == exc.args[0])
            raise BatchError("bad communicator", f"{where(i)}: {exc.args[0][:80]!r}") from None
        cols["name"] = self.names.codes(name, m)
        cols["src"] = self.hosts.codes(src, m)
        cols["dst"] = self.hosts.codes(dst, m)
        cols["call"] = np.fromiter(map(_CALL_CODE.__getitem__, call), np.int8, m)
        cols["dtype"] = np.fromiter(map(_DTYPE_CODE.__getitem__, dtype), np.int8, m)
        return cols

    def _comp_summary(self, hosts: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> dict:
        nh = len(self.hosts.values)
        first = np.full(nh, np.inf)
        last = np.full(nh, -np.inf)
        np.minimum.at(first, hosts, ts)
        np.maximum.at(last, hosts, ts + dur)
        # busy time is summed once over the whole file (in file order), so that it does not
        # depend on how the file was cut into batches
        return {"comp_host": hosts, "comp_ts": ts, "comp_dur": dur, "comp_first": first, "comp_last": last}


# ---------------------------------------------------------------------------------------------
# Error helpers
# ---------------------------------------------------------------------------------------------


def validation_error(exc: Exception, where: Callable[[int], str]) -> BatchError:
    """Maps a msgspec ValidationError to the rule it breaks, located at its event."""
    msg = str(exc)
    m = re.search(r"\$\[(\d+)\]", msg)
    loc = where(int(m.group(1))) if m else "?"
    rule = "invalid event"
    if "Invalid enum value" in msg and re.search(r"`key` in `[^`]*Communication\[1\]`", msg):
        rule = "unknown NCCL op"
    elif "Invalid enum value" in msg and msg.endswith(".dtype`"):
        rule = "unknown dtype"
    elif "out of range" in msg:
        rule = "overflowing duration" if re.search(r"\.(ts|dur)`", msg) else "overflowing value"
    return BatchError(rule, f"{loc}: {msg}")


def decode_document(data: bytes) -> list:
    """Typed events of a whole document (raw communicator objects); msgspec errors propagate."""
    return _decoder.decode(data)
