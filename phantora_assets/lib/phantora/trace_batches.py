"""The text layer of the trace reader: inflate a ``timeline.json(.gz)`` and cut it into batches.

This module imports neither pandas nor dagster.

* :func:`raw_chunks` streams the decompressed text (gzip detected by magic bytes, inflated with
  ISA-L when ``isal`` is installed, else zlib; multi-member ok); :func:`iter_batches` runs it on a
  background thread and cuts the text of the JSON array into batches of whole elements: a batch
  ends at the first ``,\\n`` (an element boundary in the visualizer layout,
  ``docs/PHANTORA_FORMATS.md`` section 3) at or after ``chunk_bytes`` bytes from its start, so
  the cut positions depend on the text only. Batches are views into one buffer, bracketed in
  place (``[`` ... ``]``) for decoding without a copy (``trace_decode.BatchDecoder``).
* :func:`whole_document` is the fallback for another layout (the whole text, then decoded as
  one document).
* Line numbers (1-based) are computed only when an error is reported, by re-reading the file
  (:func:`line_at`, :func:`locator`); offsets are byte offsets into the decompressed text.

Errors: :class:`StreamError` (rule, detail) for a file-level problem (``corrupt gzip``,
``truncated gzip``, ``not a JSON array``, ``invalid JSON``: empty document, byte order mark, the
array never closes, a trailing comma); ``chrome_trace.read_trace`` adds the file name.
"""

import json
import queue
import threading
import types
import zlib
from collections.abc import Callable, Iterator

# either isal_zlib or zlib (same decompressobj/error API); isal's stub types ``error`` as an
# instance, not the exception class it is, so the module is typed plainly
_inflate_mod: types.ModuleType
try:  # ISA-L inflates 2-3x faster than zlib; optional
    from isal import isal_zlib as _inflate_mod
except ImportError:  # pragma: no cover - isal is a pinned dependency
    _inflate_mod = zlib

_INFLATE_ERRORS: tuple[type[BaseException], ...] = tuple({zlib.error, _inflate_mod.error})

_WS = b" \t\r\n"


#: Longest run of text without a line break the reader buffers (the visualizer writes one event per
#: line, a few kB): beyond it the trace fails with rule "line too long" instead of filling memory
#: (``[`` + 1 GiB of spaces + ``]`` peaked at 3.3 GB). Read at each call: set it to change the cap.
MAX_LINE_BYTES = 256 << 20
#: Largest decompressed trace read (a gzip bomb fails with rule "trace too large"); read at each call.
MAX_INFLATED_BYTES = 64 << 30


class StreamError(Exception):
    """A file-level problem found while streaming (gzip, array start/end): rule and detail."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(rule, detail)
        self.rule, self.detail = rule, detail


# ---------------------------------------------------------------------------------------------
# Layout and line numbers (error path)
# ---------------------------------------------------------------------------------------------


def looks_like_layout(body: bytes) -> bool:
    """Every non-blank line is one ``{...}`` element (optionally followed by a comma)."""
    for ln in body.split(b"\n"):
        s = ln.strip(_WS)
        if s and not (s.startswith(b"{") and s.rstrip(b",").rstrip(_WS).endswith(b"}")):
            return False
    return True


def locator(body: bytes, offset: int, line_of: Callable[[int], int]) -> Callable[[int], str]:
    """Maps an event index of a batch (text ``body`` at ``offset``) to ``"line L"`` (error path)."""

    def where(i: int) -> str:
        line0 = line_of(offset)
        starts = [k for k, ln in enumerate(body.split(b"\n")) if ln.strip(_WS)]
        if i < len(starts) and looks_like_layout(body):
            return f"line {line0 + starts[i]}"
        return f"event {i} of the batch starting at line {line0}"

    return where


class _Twice(Exception):
    pass


def _no_key_twice(pairs: list) -> None:
    if len(pairs) > 1 and len(dict(pairs)) < len(pairs):
        keys = [k for k, _ in pairs]
        raise _Twice(next(k for n, k in enumerate(keys) if k in keys[:n]))


_pairs_checker = json.JSONDecoder(object_pairs_hook=_no_key_twice)


def duplicate_key(doc: bytes, line0: int) -> tuple[str, str] | None:
    """``(rule, detail)`` when a key comes twice in one object of an element of the JSON array
    ``doc`` (text msgspec decoded, its first byte on line ``line0``), else None. Rule ``duplicate
    key``: JSON does not say which value counts (RFC 8259: names SHOULD be unique) and msgspec
    keeps the last silently; the C scanner declines such a batch, so it is checked here."""
    try:
        json.loads(doc, object_pairs_hook=_no_key_twice)  # the keys of every object (C but the hook)
        return None
    except RecursionError as exc:
        return "invalid JSON", f"an event of the text starting at line {line0} nests too deep: {exc}"
    except _Twice:
        pass
    text, i = doc.decode("utf-8", "surrogatepass"), 1  # (error path) which element: one at a time
    while True:
        while text[i] in " \t\r\n,":
            i += 1
        if text[i] == "]":
            return "duplicate key", f"the text starting at line {line0}: a key twice in one object"  # (not reached)
        try:
            i = _pairs_checker.raw_decode(text, i)[1]
        except _Twice as exc:
            where = f"line {line0 + text.count(chr(10), 0, i)}"
            return "duplicate key", f"{where}: key {exc.args[0]!r} twice in one object of the event (which value?)"


# ---------------------------------------------------------------------------------------------
# Byte stream
# ---------------------------------------------------------------------------------------------

_DONE = object()


def raw_chunks(path, out_bytes: int) -> Iterator[bytes]:  # noqa: C901, PLR0912 (the gzip member loop and its refusals)
    """Decompressed chunks of the file (gzip by magic, multi-member ok), each <= ~out_bytes.

    Raises:
        StreamError: ``corrupt gzip`` or ``truncated gzip``.
    """
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
                    d = _inflate_mod.decompressobj(wbits=31)
                try:
                    out = d.decompress(data, out_bytes)
                except _INFLATE_ERRORS as exc:
                    raise StreamError("corrupt gzip", str(exc)) from None
                if out:
                    yield out
                if d.eof:
                    data, d = d.unused_data, None
                else:
                    data = d.unconsumed_tail
            while d is not None and not d.eof:  # drain output still pending inside the inflater
                try:
                    out = d.decompress(b"", out_bytes)
                except _INFLATE_ERRORS as exc:
                    raise StreamError("corrupt gzip", str(exc)) from None
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
                    raise StreamError("truncated gzip", "compressed stream ends before its end marker")
                return


class _Producer(threading.Thread):
    """Inflates the file on a background thread into a bounded queue (inflating releases the GIL)."""

    def __init__(self, path, out_bytes: int) -> None:
        super().__init__(daemon=True)
        self.path, self.out_bytes = path, out_bytes
        self.q: queue.Queue = queue.Queue(maxsize=4)
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
            for chunk in raw_chunks(self.path, self.out_bytes):
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


def check_start(head: bytes) -> None:
    """The document (after leading whitespace; ``head``: its first 3 bytes or more) must
    start with ``[``."""
    c = head[:1]
    if c == b"[":
        return
    if not c:
        raise StreamError("invalid JSON", "empty document")
    if head.startswith(b"\xef\xbb\xbf"):
        raise StreamError(
            "invalid JSON", "line 1: the text starts with a UTF-8 byte order mark, which JSON does not allow"
        )
    if c in b'{"-0123456789tfn':
        raise StreamError("not a JSON array", f"document starts with {c.decode()!r}")
    raise StreamError("invalid JSON", f"line 1: unexpected {c!r}")


def iter_batches(path, chunk_bytes: int) -> Iterator[tuple[int, memoryview, int]]:  # noqa: C901, PLR0912, PLR0915 (the streaming scanner's one loop)
    """``(offset, view, end)`` for each batch of elements of the array in ``path``, in file order.

    ``view`` (``end`` bytes) is ``[`` + whole elements joined by ``,\\n`` + ``]``, a view into
    the reader's buffer: decode it in place, and drop every reference into it before asking for
    the next batch. ``offset`` is the text offset of ``view[1]``. A batch ends at the first
    ``,\\n`` at or after ``chunk_bytes`` bytes from its start (its comma is overwritten by
    ``]``, the newline after it by the next batch's ``[``), so the batches depend on the text
    only. When the first line break of the text is ``\\r\\n``, batches end at ``,\\r\\n``
    instead (the ``\\r`` stays between two batches).

    Raises:
        StreamError: bad gzip, not an array, the array never closes, or a trailing comma.
    """
    span = max(1, int(chunk_bytes)) - 1
    buf = bytearray(b"[")  # buf[0] is "[", buf[1] the text at `offset`
    offset = 0
    started = False
    searched = 0  # no batch cut starts in buf[1 + span:searched]
    n_batches = 0
    sep = b""  # the element separator, known at the first line break
    skipped = 0  # leading whitespace dropped before the document starts
    total = 0
    max_line, max_total = MAX_LINE_BYTES, MAX_INFLATED_BYTES
    for chunk in _Producer(path, max(int(chunk_bytes), 4 << 20)).chunks():
        buf += chunk
        total += len(chunk)
        if total > max_total:
            raise StreamError("trace too large", f"more than {max_total} bytes decompressed (MAX_INFLATED_BYTES)")
        if not started:
            stripped = bytes(buf[1:]).lstrip(_WS)
            if not stripped:  # whitespace only so far: drop it (keeping it rescanned it every chunk)
                skipped += len(buf) - 1
                del buf[1:]
                continue
            if len(stripped) < 3 and b"\xef\xbb\xbf".startswith(stripped):
                continue  # may be a byte order mark split across chunks: wait for more text
            check_start(stripped[:3])
            offset = skipped + len(buf) - len(stripped)  # after the whitespace and the "["
            buf = bytearray(b"[") + stripped[1:]
            started = True
        if not sep:
            nl = buf.find(b"\n", 1)
            if nl < 0:
                if len(buf) > max_line:
                    raise StreamError("line too long", f"line {line_at(path, offset)}: {_too_long(max_line)}")
                continue
            sep = b",\r\n" if buf[nl - 1] == 0x0D else b",\n"
        k = len(sep)
        s = 1  # start of the next batch (buf[s - 1] is "[")
        while True:
            lo = max(s + span, searched)
            cut = buf.find(sep, lo) if lo < len(buf) else -1
            if cut < 0:
                searched = max(lo, len(buf) - (k - 1))
                if len(buf) - s > span + max_line and buf.rfind(b"\n", s + span) < 0:
                    raise StreamError("line too long", f"line {line_at(path, offset)}: {_too_long(max_line)}")
                break
            buf[cut] = 0x5D  # "]"
            view = memoryview(buf)[s - 1 : cut + 1]
            yield offset, view, cut + 2 - s
            view.release()
            n_batches += 1
            offset += cut + k - s
            s = cut + k
            buf[s - 1] = 0x5B  # "[" over the "\n"
            searched = 0
        if s > 1:
            del buf[: s - 1]
            searched = max(0, searched - (s - 1))
    if not started:
        check_start(bytes(buf[1:]).lstrip(_WS))
    tail = bytes(buf[1:]).rstrip(_WS)
    if not tail.endswith(b"]"):
        raise StreamError(
            "invalid JSON", f"line {line_at(path, offset + len(tail))}: document ends before the closing ']'"
        )
    body = tail[:-1]
    if body.strip(_WS):
        if body.rstrip(_WS).endswith(b","):
            raise StreamError(
                "invalid JSON", f"line {line_at(path, offset + len(body.rstrip(_WS)))}: trailing comma before ']'"
            )
        final = bytearray(b"[") + body + b"]"
        yield offset, memoryview(final), len(final)
    elif n_batches:
        raise StreamError("invalid JSON", f"line {line_at(path, offset)}: trailing comma before ']'")


def line_at(path, offset: int) -> int:
    """Line number (1-based) of the text offset ``offset`` of the document (re-reads the file)."""
    lines, seen = 1, 0
    try:
        for chunk in raw_chunks(path, 16 << 20):
            if seen + len(chunk) >= offset:
                return lines + chunk.count(b"\n", 0, offset - seen)
            lines += chunk.count(b"\n")
            seen += len(chunk)
    except StreamError:
        pass
    return lines


def _too_long(cap: int) -> str:
    return f"more than {cap} bytes without a line break (MAX_LINE_BYTES); write one event per line"


def whole_document(path) -> tuple[bytes, int]:
    """The whole decompressed document without leading whitespace, and the line it starts on.

    Raises:
        StreamError: rule "trace too large" past ``MAX_LINE_BYTES`` (the whole document is one
            piece of memory here).
    """
    parts, size = [], 0
    for part in raw_chunks(path, 64 << 20):
        size += len(part)
        if size > MAX_LINE_BYTES:
            raise StreamError("trace too large", f"{_too_long(MAX_LINE_BYTES)} (decoded as one document)")
        parts.append(part)
    data = b"".join(parts)
    stripped = data.lstrip(_WS)
    check_start(stripped)
    return stripped, 1 + data.count(b"\n", 0, len(data) - len(stripped))
