"""Decode a Kineto trace in batches of events, with bounded memory (no Dagster import).

PyTorch's profiler writes one JSON object: the metadata (``distributedInfo``, ``deviceProperties``,
...), ``"traceEvents": [`` with one event per ``\\n  {`` ... ``\\n  }`` block, separated by
``\\n  },\\n  {``, then the rest of the metadata. :func:`decode` inflates the file in
:data:`CHUNK` pieces, cuts the event array at those separators and decodes each batch with a typed
``msgspec`` schema that keeps only the fields ``reader`` uses (unknown keys are skipped); the caller's
``add`` sees each batch once and keeps what it needs, so memory is one chunk and its events plus what
``add`` keeps. The metadata (header and trailer around the array) is decoded last. A file in any
other JSON layout (one line, other indentation) is decoded as one document, which needs memory for
its whole text and events: it, and any one event of the streamed layout, is refused (``trace too
large``) beyond ``lib/phantora/trace_batches.MAX_LINE_BYTES`` (the cap of one decoded-whole
document of Phantora's traces, set by ``$PHANTORA_ASSETS_MAX_TRACE_LINE_MIB``), so a compressed
file of whitespace cannot inflate into memory. At most :data:`MAX_INFLATED_BYTES` of text is read
either way. Times
are float64 microseconds of the host clock: at epoch-scale values (~1.7e15 us) that is about
0.25 us resolution, finer than any collective of interest.

Errors: :class:`~phantora_assets.lib.errors.TraceFormatError` rules ``invalid trace`` (cannot be
read, not JSON, a field of the wrong type, nested too deep) and ``trace too large``.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar, cast

import msgspec

from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.phantora import trace_batches

#: Largest decompressed trace read.
MAX_INFLATED_BYTES = 4 << 30
#: Inflated bytes read at a time.
CHUNK = 8 << 20
_START = b'"traceEvents": ['
_SEP = b"\n  },\n  {"
_END = re.compile(rb"\n  \}\s*\]")
_HEADER_LIMIT = 16 << 20  # the array must start within this much text to be streamed


def _f(name: str) -> Any:
    return msgspec.field(default=None, name=name)


class Args(msgspec.Struct, gc=False):
    """The ``args`` of an event that are read (values as recorded: checked by ``reader``)."""

    collective: Any = _f("Collective name")
    in_nelems: Any = _f("In msg nelems")
    out_nelems: Any = _f("Out msg nelems")
    in_split: Any = _f("In split size")
    out_split: Any = _f("Out split size")
    dtype: Any = None
    group_size: Any = _f("Group size")
    pg_ranks: Any = _f("Process Group Ranks")
    pg_name: Any = _f("Process Group Name")
    pg_id: Any = _f("Process Group ID")
    rank_start: Any = _f("Global rank start")
    rank_stride: Any = _f("Global rank stride")
    correlation: Any = None
    stream: Any = None


class Event(msgspec.Struct, gc=False):
    """One trace event: ``ts`` / ``dur`` in microseconds."""

    ph: Any = ""
    cat: Any = ""
    name: Any = ""
    pid: Any = 0
    tid: Any = 0
    ts: Any = 0.0
    dur: Any = 0.0
    args: Args | None = None


class Device(msgspec.Struct):
    """One ``deviceProperties`` entry."""

    name: Any = ""
    totalGlobalMem: Any = 0


class Meta(msgspec.Struct):
    """The trace's metadata; ``traceEvents`` is empty once :func:`decode` handed them out."""

    distributedInfo: dict[str, Any] | None = None
    deviceProperties: list[Device] = []
    traceEvents: list[Event] = []


_BATCH = msgspec.json.Decoder(list[Event])
_META = msgspec.json.Decoder(Meta)
S = TypeVar("S")


class _Layout(Exception):
    """The text is not in the profiler's layout: decode it as one document."""


def _open(path: Path) -> IO[bytes]:
    try:
        return cast("IO[bytes]", gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb"))
    except OSError as exc:
        raise TraceFormatError(path, "invalid trace", f"cannot read: {exc}") from exc


def _reader(path: Path) -> Callable[[int], bytes]:
    """``read(n)`` of the inflated text, refusing more than :data:`MAX_INFLATED_BYTES`."""
    fh = _open(path)
    total = 0

    def read(n: int) -> bytes:
        nonlocal total
        try:
            data = fh.read(n)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise TraceFormatError(path, "invalid trace", f"cannot read: {exc}") from exc
        total += len(data)
        if total > MAX_INFLATED_BYTES:
            raise TraceFormatError(path, "trace too large", f"more than {MAX_INFLATED_BYTES} bytes decompressed")
        if not data:
            fh.close()
        return data

    return read


def _stream(path: Path, add: Callable[[list[Event]], None]) -> Meta:
    """The streamed decode (module docstring). Raises _Layout when the text is laid out otherwise."""
    read = _reader(path)
    head = bytearray()
    while (i := head.find(_START)) < 0:
        data = read(CHUNK)
        if not data or len(head) + len(data) > _HEADER_LIMIT:
            raise _Layout
        head += data
    header, buf = bytes(head[:i]), bytes(head[i + len(_START) :])
    del head
    while True:
        data = read(CHUNK)
        if len(buf) + len(data) > trace_batches.MAX_LINE_BYTES:
            raise TraceFormatError(path, "trace too large", _too_large("one event of"))
        buf += data
        p = buf.rfind(_SEP) if data else -1
        if p >= 0:
            _add(b"[" + buf[: p + 4] + b"]", add)
            buf = buf[p + len(_SEP) - 1 :]
            continue
        if data:
            continue
        m = _END.search(buf)
        if m is None:
            if buf.lstrip().startswith(b"]"):  # an empty array
                return _meta(header + _START + buf, path)
            raise _Layout
        _add(b"[" + buf[: m.start() + 4] + b"]", add)
        return _meta(header + _START + buf[m.end() - 1 :], path)


def _add(batch: bytes, add: Callable[[list[Event]], None]) -> None:
    try:
        events = _BATCH.decode(batch)
    except (msgspec.DecodeError, RecursionError):
        raise _Layout from None
    add(events)


def _meta(text: bytes | bytearray, path: Path) -> Meta:
    try:
        return _META.decode(text)
    except msgspec.DecodeError as exc:
        raise TraceFormatError(path, "invalid trace", f"not a PyTorch profiler JSON object: {exc}") from exc
    except RecursionError:
        raise TraceFormatError(path, "invalid trace", "JSON nested too deep for a PyTorch profiler trace") from None


def _too_large(what: str) -> str:
    cap = trace_batches.MAX_LINE_BYTES
    return (
        f"{what} more than {cap} bytes, decoded whole (MAX_LINE_BYTES, $PHANTORA_ASSETS_MAX_TRACE_LINE_MIB): "
        "write it as torch.profiler does (one event per block)"
    )


def decode(path: str | Path, make: Callable[[], S], add: Callable[[S, list[Event]], None]) -> tuple[Meta, S]:
    """Decode ``path``: ``make()`` a sink, ``add(sink, batch)`` every batch of events in file order,
    then return the metadata and the sink. A file not in the profiler's layout starts over with a
    new sink and is decoded as one document.

    Raises:
        TraceFormatError: ``invalid trace`` or ``trace too large`` (names the file).
    """
    path = Path(path)
    sink = make()
    try:
        return _stream(path, lambda events: add(sink, events)), sink
    except _Layout:
        pass
    sink = make()
    read = _reader(path)
    text = bytearray()
    while data := read(CHUNK):
        if len(text) + len(data) > trace_batches.MAX_LINE_BYTES:
            raise TraceFormatError(path, "trace too large", _too_large("a text not in the profiler's layout of"))
        text += data
    meta = _meta(text, path)
    add(sink, meta.traceEvents)
    meta.traceEvents = []
    return meta, sink
