"""A raw timeline table read as the pipeline's input, without its Chrome JSON (issue 37, item 1).

A source that simulates a run (the analytic simulator) already holds the run as a table, its raw
timeline (``columns.RAW_TIMELINE_COLUMNS``, one row per flow and per kernel, times in integer
simulated ns). :func:`read_raw_timeline` turns that table into the same :class:`ParsedTrace` that
``chrome_trace.read_trace`` gives for the Chrome JSON ``write_chrome_trace`` writes from it, column
for column and value for value, without writing or parsing the text:

* ``ts_us = start_ns / 1000`` and ``dur_us = (end_ns - start_ns) / 1000`` (float64): the writer
  prints ``ns / 1000`` exactly (an integer and up to 3 decimals), and a correctly rounded parse of
  that decimal is the correctly rounded quotient, so the two agree to the bit;
* ``flow_id`` is the event id, ``stream`` the event's ``tid`` (``(stream_device << 32) |
  stream_id``; 0 for a point-to-point call without a stream, ``stream_id < 0``), ``root`` -1 but
  for ``NcclBcast``, ``comm_id`` the blake2b digest of the communicator id's bytes
  (``chrome_trace.comm_id_of``);
* the compute summary and the compute events in table order, as the reader has them in file order.

``tests/unit/lib/phantora/test_raw_tables.py`` holds the two routes equal on generated timelines.

Memory: the table is read one row group at a time, its strings as dictionary codes; what is kept is
the flow table (about 100 bytes a flow) and, with ``compute_events``, 24 bytes a kernel.

Errors: :class:`~phantora_assets.lib.errors.TraceFormatError` naming the file and the rule the
Chrome reader would have named (``missing column``, ``negative duration``, ``overflowing
duration``, ``unknown NCCL op``, ``unknown dtype``, ``bad host name``, ``negative bytes``,
``bad communicator``, ``empty trace``). No Dagster import.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from phantora_assets.lib.columns import COMPUTE_SUMMARY_COLUMNS, FLOW_COLUMNS, RAW_TIMELINE_COLUMNS
from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.phantora.trace_decode import MAX_TIME_US
from phantora_assets.lib.traffic.ring import CALL_TO_OP, DTYPE_BYTES

__all__ = ["read_raw_timeline"]

_COLUMNS = [c for c in RAW_TIMELINE_COLUMNS if c not in ("reduce_op", "os_pid", "meta_json")]
_STRINGS = ("kind", "name", "src_host", "dst_host", "call", "dtype", "comm_id_hex")
_MAX_NS = int(MAX_TIME_US) * 1000
_HOST_RE = re.compile(r"host-([1-9][0-9]{0,17})")  # the Chrome reader's rule (chrome_trace._HOST_RE)


class _Codes:
    """Codes of the distinct values of a string column across row groups (first-seen order)."""

    def __init__(self) -> None:
        self.values: list[str] = []
        self._index: dict[str, int] = {}

    def codes(self, arr: pa.ChunkedArray) -> np.ndarray:
        parts = []
        for chunk in arr.chunks:
            d = chunk if pa.types.is_dictionary(chunk.type) else chunk.dictionary_encode()
            lut = np.array([self._code(str(v)) for v in d.dictionary.to_pylist()], np.int64)
            idx = d.indices.to_numpy(zero_copy_only=False)
            parts.append(lut[idx] if len(lut) else idx.astype(np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _code(self, v: str) -> int:
        if (k := self._index.get(v)) is None:
            k = self._index[v] = len(self.values)
            self.values.append(v)
        return k


def read_raw_timeline(path: str | Path, *, compute_events: bool = False):  # -> chrome_trace.ParsedTrace
    """The :class:`~phantora_assets.lib.phantora.chrome_trace.ParsedTrace` of a raw timeline's Parquet file.

    Args:
        path: a Parquet file with ``columns.RAW_TIMELINE_COLUMNS`` (as the analytic source writes
            ``partitions/<run_id>/raw_timeline.parquet``).
        compute_events: also return every computation row as ``host``, ``ts_us``, ``dur_us``
            (µs) in table order, as ``read_trace(compute_events=True)`` does.

    Returns:
        The ParsedTrace ``read_trace`` returns for ``write_chrome_trace(path)``'s file, its
        ``path`` the table's: ``flows`` (``columns.FLOW_COLUMNS``, sorted by ``(ts_us, flow_id)``),
        ``compute`` (``columns.COMPUTE_SUMMARY_COLUMNS``, sorted by host), ``n_events`` (rows).

    Raises:
        TraceFormatError: the table breaks a rule of the trace format (named, with the event id).
        OSError: the file cannot be read.
    """
    from phantora_assets.lib.phantora.chrome_trace import ParsedTrace, comm_id_of

    path = Path(path)
    pf = pq.ParquetFile(path, read_dictionary=list(_STRINGS))  # strings as codes, never one text a row
    if missing := [c for c in _COLUMNS if c not in pf.schema_arrow.names]:
        raise TraceFormatError(path, "missing column", f"the raw timeline lacks {missing}")
    codes = {c: _Codes() for c in _STRINGS}
    comm: dict[str, list[np.ndarray]] = {}
    comp: dict[str, list[np.ndarray]] = {}
    n_events = 0
    for g in range(pf.metadata.num_row_groups):
        t = pf.read_row_group(g, columns=_COLUMNS)
        n_events += t.num_rows
        col = {c: codes[c].codes(t.column(c)) if c in _STRINGS else t.column(c).to_numpy() for c in _COLUMNS}
        del t
        kinds = codes["kind"].values
        is_comm = np.isin(col["kind"], [i for i, k in enumerate(kinds) if k == "communication"])
        is_comp = np.isin(col["kind"], [i for i, k in enumerate(kinds) if k == "computation"])
        _check_rows(path, col, is_comm | is_comp, kinds)
        for key in ("event_id", "start_ns", "end_ns", "src_host", "dst_host", "bytes", "call", "count", "dtype"):
            comm.setdefault(key, []).append(col[key][is_comm])
        for key in ("root", "comm_id_hex", "comm_rank", "stream_device", "stream_id", "name"):
            comm.setdefault(key, []).append(col[key][is_comm])
        for key in ("src_host", "start_ns", "end_ns"):
            comp.setdefault(key, []).append(col[key][is_comp])
    if n_events == 0:
        raise TraceFormatError(path, "empty trace", "the raw timeline has no rows")
    c = {k: np.concatenate(v) for k, v in comm.items()}
    hosts = codes["src_host"], codes["dst_host"]
    flows = _flows(path, c, codes, comm_id_of)
    del c
    p = {k: np.concatenate(v) for k, v in comp.items()}
    ts = p["start_ns"] / 1000
    dur = (p["end_ns"] - p["start_ns"]) / 1000
    host_names = hosts[0].values
    nh = len(host_names)
    h = p["src_host"]
    first, last = np.full(nh, np.inf), np.full(nh, -np.inf)
    np.minimum.at(first, h, ts)
    np.maximum.at(last, h, ts + dur)
    n = np.bincount(h, minlength=nh).astype(np.int64)
    busy = np.bincount(h, weights=dur, minlength=nh)
    has = n > 0
    for name in np.asarray(host_names, object)[has]:
        _node(path, name)
    compute = pd.DataFrame(
        {
            "host": np.asarray(host_names, object)[has],
            "n_events": n[has],
            "busy_us": busy[has],
            "first_ts_us": first[has],
            "last_end_us": last[has],
        },
        columns=list(COMPUTE_SUMMARY_COLUMNS),
    )
    compute = compute.sort_values("host", kind="stable").reset_index(drop=True)
    events = None
    if compute_events:
        events = pd.DataFrame({"host": np.asarray(host_names, object)[h], "ts_us": ts, "dur_us": dur})
    return ParsedTrace(path=path, flows=flows, compute=compute, n_events=n_events, compute_events=events)


def _check_rows(path: Path, col: dict[str, np.ndarray], known: np.ndarray, kinds: list[str]) -> None:
    """The row rules the Chrome reader applies to the events the writer would print."""

    def fail(bad: np.ndarray, rule: str, what: Callable[[int], str]) -> None:
        if bad.any():
            i = int(np.argmax(bad))
            raise TraceFormatError(path, rule, f"event {int(col['event_id'][i])}: {what(i)}")

    fail(~known, "invalid event", lambda i: f"kind {kinds[col['kind'][i]]!r} is neither communication nor computation")
    start, end = col["start_ns"], col["end_ns"]
    fail((start < 0) | (end < start), "negative duration", lambda i: f"span [{start[i]}, {end[i]}] ns")
    fail(
        (start > _MAX_NS) | (end - start > _MAX_NS), "overflowing duration", lambda i: f"span [{start[i]}, {end[i]}] ns"
    )


def _flows(path: Path, c: dict[str, np.ndarray], codes: dict[str, _Codes], comm_id_of) -> pd.DataFrame:
    """The flow table of the communication rows ``c`` (``columns.FLOW_COLUMNS``), sorted as the reader sorts."""
    if not len(c["event_id"]):
        return pd.DataFrame({k: pd.Series([], dtype=v if v != "str" else object) for k, v in FLOW_COLUMNS.items()})
    for key in ("bytes", "count"):
        bad = c[key] < 0
        if bad.any():
            i = int(np.argmax(bad))
            raise TraceFormatError(path, "negative bytes", f"flow {int(c['event_id'][i])}: {key}={int(c[key][i])}")
    calls, dtypes = codes["call"].values, codes["dtype"].values
    for values, known, rule in ((calls, CALL_TO_OP, "unknown NCCL op"), (dtypes, DTYPE_BYTES, "unknown dtype")):
        used = np.unique(c["call" if values is calls else "dtype"])
        if bad_names := [values[k] for k in used if values[k] not in known]:
            raise TraceFormatError(path, rule, f"{bad_names[0]!r:.80} is not one of {sorted(known)}")
    cids = codes["comm_id_hex"].values
    digests = []
    for k in range(len(cids)):
        try:
            digests.append(comm_id_of(bytes.fromhex(cids[k])))
        except ValueError:
            digests.append(None)
    if bad_c := [cids[k] for k in np.unique(c["comm_id_hex"]) if digests[k] is None]:
        raise TraceFormatError(path, "bad communicator", f"comm_id_hex {bad_c[0][:80]!r} is not hex")
    order = np.lexsort((c["event_id"], c["start_ns"]))  # ts_us is start_ns / 1000: the same order
    c = {k: v[order] for k, v in c.items()}
    call_names = np.asarray(calls, object)[c["call"]]
    p2p = (call_names == "NcclSend") | (call_names == "NcclRecv")
    stream = np.where(p2p & (c["stream_id"] < 0), 0, (c["stream_device"] << 32) | c["stream_id"])
    src_names = np.asarray(codes["src_host"].values, object)
    dst_names = np.asarray(codes["dst_host"].values, object)
    src_nodes, dst_nodes = _nodes(path, src_names, c["src_host"]), _nodes(path, dst_names, c["dst_host"])
    dtype_names = np.asarray(dtypes, object)[c["dtype"]]
    return pd.DataFrame(
        {
            "flow_id": c["event_id"].astype(np.int64),
            "ts_us": c["start_ns"] / 1000,
            "dur_us": (c["end_ns"] - c["start_ns"]) / 1000,
            "src_host": src_names[c["src_host"]],
            "dst_host": dst_names[c["dst_host"]],
            "src_node": src_nodes[c["src_host"]],
            "dst_node": dst_nodes[c["dst_host"]],
            "bytes": c["bytes"].astype(np.int64),
            "call": call_names,
            "op": np.array([CALL_TO_OP.get(x, "") for x in calls], object)[c["call"]],
            "dtype": dtype_names,
            "dtype_bytes": np.array([DTYPE_BYTES.get(x, 0) for x in dtypes], np.int64)[c["dtype"]],
            "count": c["count"].astype(np.int64),
            "comm_id": np.asarray(digests, object)[c["comm_id_hex"]],
            "comm_rank": c["comm_rank"].astype(np.int64),
            "root": np.where(call_names == "NcclBcast", c["root"], -1).astype(np.int64),
            "stream": stream.astype(np.int64),
            "name": np.asarray(codes["name"].values, object)[c["name"]],
        },
        columns=list(FLOW_COLUMNS),
    )


def _nodes(path: Path, names: np.ndarray, used: np.ndarray) -> np.ndarray:
    """Node of each name (-1 where no flow uses it); a used name that is no host is refused."""
    out = np.full(len(names), -1, np.int64)
    for k in np.unique(used):
        out[k] = _node(path, names[k])
    return out


def _node(path: Path, host: str) -> int:
    """Node ``k - 1`` of ``host-k`` (the Chrome reader's rule), else ``bad host name``."""
    m = _HOST_RE.fullmatch(host)
    if not m:
        raise TraceFormatError(path, "bad host name", f"{host!r:.80} is not of the form host-<k>, k >= 1")
    return int(m.group(1)) - 1
