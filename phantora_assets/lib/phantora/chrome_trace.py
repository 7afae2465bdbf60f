"""Phantora Chrome/Perfetto traces (``timeline.json`` / ``timeline.json.gz``): the public face and the reader.

The layout is the one of Phantora's ``phantora_visualizer`` (``docs/PHANTORA_FORMATS.md``
section 3): ``[\\n`` + one complete event (``"ph": "X"``) per line, joined by ``,\\n``, +
``\\n]``. ``ts`` and ``dur`` are simulated microseconds.

* :func:`write_chrome_trace` (from ``trace_writer``) turns a raw timeline
  (``columns.RAW_TIMELINE_COLUMNS``) into such a file, byte-for-byte deterministic.
* :func:`read_trace` (this module) parses a trace into a flow table (``columns.FLOW_COLUMNS``)
  and a per-host computation summary (``columns.COMPUTE_SUMMARY_COLUMNS``); the flows are the
  input of the dataset (``docs/DATASET.md``, "How a trace becomes the dataset").

Reader design (performance): the file is inflated on a background thread and cut into ~1 MiB
batches of whole elements at ``,\\n`` (``trace_batches``); each batch is decoded in place into
column arrays (``trace_decode``: the compiled ``_tracescan`` scanner, else typed ``msgspec``);
for a large trace forked helper processes decode batches copied into shared memory
(``trace_helpers``, whose ``HelperPool.drain`` hands their columns back). This module assembles
the batches' columns, in file order, into the output tables; only a few batches of text are in
memory at a time. A JSON array in another layout (e.g. all on one line) is decoded as one
document (memory then grows with the file).

Errors: a format problem is raised as ``errors.TraceFormatError`` naming the file and the rule
broken (see :func:`read_trace`).

This module does not import dagster.
"""

from __future__ import annotations

import gc
import hashlib
import multiprocessing as mp
import os
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd

from phantora_assets.lib.columns import COMPUTE_SUMMARY_COLUMNS, FLOW_COLUMNS
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.phantora import trace_batches as tb
from phantora_assets.lib.phantora import trace_decode as td
from phantora_assets.lib.phantora import trace_helpers as th
from phantora_assets.lib.phantora.trace_helpers import default_workers
from phantora_assets.lib.phantora.trace_writer import write_chrome_trace
from phantora_assets.lib.traffic.ring import CALL_TO_OP, DTYPE_BYTES

__all__ = ["ParsedTrace", "read_trace", "write_chrome_trace", "comm_id_of", "default_workers"]

#: Largest ts/dur (µs) accepted; beyond it float64 can no longer hold integers exactly.
MAX_TIME_US = td.MAX_TIME_US
_HOST_RE = re.compile(r"host-([1-9][0-9]*)")  # as Phantora names hosts: no 0, no leading zero (no "host-01")
_HOST_FORM = "host-<k>, k >= 1 written without leading zeros"


@dataclass(frozen=True)
class ParsedTrace:
    """A parsed Chrome trace.

    Attributes:
        path: the file read.
        flows: one row per Communication event, columns ``columns.FLOW_COLUMNS`` (dtypes as
            listed there; strings as object), sorted by ``(ts_us, flow_id)``, RangeIndex.
        compute: one row per host with Computation events, ``columns.COMPUTE_SUMMARY_COLUMNS``,
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


def read_trace(
    path: str | Path, *, chunk_bytes: int = 1 << 20, workers: int | None = None, compute_events: bool = False
) -> ParsedTrace:
    """Parse a Phantora Chrome trace (``.json`` or ``.json.gz``; gzip is detected by magic bytes).

    The text is streamed in batches of whole elements (``trace_batches``) decoded by ``trace_decode``;
    memory stays bounded by a few batches plus the output tables for the visualizer layout (and
    any layout whose elements are separated by ``,\\n``); other layouts are decoded as one document.

    Args:
        path: the trace file.
        chunk_bytes: size of the decompressed text batches (tuning only).
        workers: helper processes (forked; they decode batches the main process copies into
            shared memory while it inflates the file and decodes batches too; ``trace_helpers``).
            ``None``: see :func:`default_workers`.
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
            k >= 1), ``host outside the layout`` (k > 2**63: node k - 1 beyond int64; the run's
            layout is checked by its source), ``negative bytes`` (bytes or count < 0), ``bad communicator``.
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
                asm = _read_batches(path, chunk_bytes, max(0, min(int(workers), th.MAX_WORKERS)))
                asm.raise_failure()
            except td.NeedWholeDoc:
                asm = _read_whole(path)
            return asm.finish(compute_events)
        except (td.BatchError, tb.StreamError) as exc:
            raise TraceFormatError(path, exc.rule, exc.detail) from None
    finally:
        if gc_was:
            gc.enable()


# ---------------------------------------------------------------------------------------------
# Reader: orchestration (main process + optional helper processes) and assembly
# ---------------------------------------------------------------------------------------------


class _Assembly:
    """Per-batch columns from one or two decoders, assembled into the output tables."""

    def __init__(self, path: Path, chunk_bytes: int) -> None:
        self.path, self.chunk_bytes = path, chunk_bytes
        self.batches: dict[int, tuple[int, dict]] = {}  # k -> (decoder, columns)
        self.tables: dict[int, tuple[list, list, list]] = {}  # decoder -> (names, hosts, comms)
        self.failure: tuple[int, str, str, str] | None = None  # (k, kind, rule, detail)

    def line_of(self, offset: int) -> int:
        return tb.line_at(self.path, offset)

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
            maps[d] = tuple(
                np.fromiter(map(t.__getitem__, vals), np.int64, len(vals))
                for t, vals in ((names, nv), (hosts, hv), (comms, cv))
            )
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
                idx = hmap[: len(c["comp_first"])]
                comp_first[idx] = np.minimum(comp_first[idx], c["comp_first"])
                comp_last[idx] = np.maximum(comp_last[idx], c["comp_last"])
        self.batches = {}  # cols holds the flow columns: the batches' other arrays go now
        flows = self._flows(cols, names.values, hosts.values, comms.values)
        # one pass in file order: the sums do not depend on the batches (or who decoded them)
        ch = np.concatenate(comp_hosts) if comp_hosts else np.zeros(0, np.int64)
        cd = np.concatenate(comp_durs) if comp_durs else np.zeros(0, np.float64)
        events = None
        if compute_events:
            events = pd.DataFrame(
                {
                    "host": _strings(hosts.values, ch),
                    "ts_us": np.concatenate(comp_ts) if comp_ts else np.zeros(0, np.float64),
                    "dur_us": cd,
                }
            )
        comp_n = np.bincount(ch, minlength=nh).astype(np.int64)
        comp_busy = np.bincount(ch, weights=cd, minlength=nh)
        has = comp_n > 0
        comp_hosts = [h for h, ok in zip(hosts.values, has) if ok]
        for h in comp_hosts:
            self._node(h)
        compute = pd.DataFrame(
            {
                "host": _strings(comp_hosts, np.arange(len(comp_hosts))),
                "n_events": comp_n[has],
                "busy_us": comp_busy[has],
                "first_ts_us": comp_first[has],
                "last_end_us": comp_last[has],
            },
            columns=list(COMPUTE_SUMMARY_COLUMNS),
            copy=False,
        )
        compute = compute.sort_values("host", kind="stable").reset_index(drop=True)
        return ParsedTrace(path=self.path, flows=flows, compute=compute, n_events=n_events, compute_events=events)

    def _node(self, host: str) -> int:
        m = _HOST_RE.fullmatch(host) if isinstance(host, str) else None
        if not m:  # host-01 beside host-1 would have been one node (was: read as host-1, silently)
            raise TraceFormatError(self.path, "bad host name", f"{host!r:.80} is not of the form {_HOST_FORM}")
        k = m.group(1)
        if len(k) > 19 or int(k) > 2**63:  # (no int() of a 5000-digit k); node k - 1 is an int64
            raise TraceFormatError(self.path, "host outside the layout", f"host-{k[:30]}: k - 1 beyond int64")
        return int(k) - 1

    def _flows(self, parts: dict[str, list[np.ndarray]], names: list, hosts: list, comms: list) -> pd.DataFrame:
        if not parts:
            return pd.DataFrame({k: pd.Series([], dtype=v if v != "str" else object) for k, v in FLOW_COLUMNS.items()})
        # one column at a time, each list of batch arrays dropped once joined (2.7 M flows at 128x8)
        col = {k: np.concatenate(parts.pop(k)) for k in list(parts)}
        for key in ("bytes", "count"):
            neg = col[key] < 0
            if neg.any():
                i = int(np.argmax(neg))
                raise TraceFormatError(
                    self.path, "negative bytes", f"flow {int(col['flow_id'][i])}: {key}={int(col[key][i])}"
                )
        nodes = np.array([self._node(h) for h in hosts], dtype=np.int64)
        comm_rank = np.array([r for r, _ in comms], dtype=np.int64)
        comm_hex = [comm_id_of(ident) for _, ident in comms]
        order = np.lexsort((col["flow_id"], col["ts"]))
        for k in col:  # in place, one column at a time
            col[k] = col[k][order]
        del order
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
    here = partial(_decode_here, asm, local)  # decodes batch k in this process
    helper = None
    # a daemonic process (e.g. a multiprocessing pool worker of a parallel build) may not start
    # children: it decodes everything itself
    if workers and hasattr(os, "fork") and not mp.current_process().daemon:
        try:
            helper = th.HelperPool(path, chunk_bytes, workers)
        except OSError:  # no memory or processes left for helpers: decode here
            helper = None
    try:
        for k, (offset, buf, end) in enumerate(tb.iter_batches(path, chunk_bytes)):
            if helper is not None:
                helper.drain(asm, here, block=False)
                if asm.failure is not None:
                    break
                # with a helper per core, the helpers decode and this process only inflates, cuts
                # and assembles: when they are all busy it waits for one (decoding here as well
                # would leave them idle meanwhile: ~135 against ~200 MB/s on 2 cores); with fewer
                # helpers than cores it decodes what they cannot take
                submitted = helper.submit(k, buf, end, offset)
                while not submitted and helper.saturates_cpus and helper.can_take(end):
                    helper.drain(asm, here, block=True, at_most=1)
                    submitted = helper.submit(k, buf, end, offset)
                if submitted:
                    continue
                if asm.failure is not None:
                    break
            _decode_here(asm, local, k, buf, end, offset)
            if asm.failure is not None:
                break
    except tb.StreamError:
        # a failure in an earlier batch takes precedence over a file-level one found later
        if helper is not None:
            helper.drain(asm, here, block=True)
        if asm.failure is None:
            raise
    finally:
        if helper is not None:
            try:
                helper.drain(asm, here, block=True)
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


def _read_whole(path: Path) -> _Assembly:
    """Decode a document that is not cut into lines at ``,\\n`` in one piece."""
    asm = _Assembly(path, 0)
    data, line0 = tb.whole_document(path)
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
    if (twice := tb.duplicate_key(data, line0)) is not None:  # msgspec kept the last value
        raise td.BatchError(*twice)
    dec = td.BatchDecoder()
    asm.tables[0] = (dec.names.values, dec.hosts.values, dec.comms.values)
    if events:
        asm.batches[0] = (0, dec.decode_events(events, lambda i: f"event {i}"))
    return asm
