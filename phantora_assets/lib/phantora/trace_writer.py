"""Phantora Chrome/Perfetto trace writer: a raw timeline -> ``timeline.json`` / ``timeline.json.gz``.

Job: :func:`write_chrome_trace` turns a raw timeline (``columns.RAW_TIMELINE_COLUMNS``, one row
per event, times in simulated ns) into a file in the layout of Phantora's ``phantora_visualizer``
(``docs/PHANTORA_FORMATS.md`` section 3): ``[\\n`` + one complete event (``"ph": "X"``) per line,
joined by ``,\\n``, + ``\\n]``; ``ts`` and ``dur`` are simulated microseconds (ns / 1000, up to 3
decimals). The file is byte-for-byte deterministic (gzip level :data:`GZIP_LEVEL`, ``mtime=0``, no
file name in the gzip header) and written atomically. The reader of this layout is
``chrome_trace.read_trace``.

Memory: the text is assembled and written :data:`CHUNK_ROWS` rows at a time, holding only integer
columns of the whole table (about 40 bytes a row): memory does not grow with the trace's text. A
raw timeline given as its Parquet file is read in record batches, its strings as dictionary codes.

Errors: ``ValueError`` naming the first offending row (missing columns, unknown kind, negative
time or duration, non-integer value in an int64 column, communicator id that is not hex), raised
before anything is written. No Dagster import.
"""

from __future__ import annotations

import contextlib
import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from phantora_assets.lib.columns import RAW_TIMELINE_COLUMNS
from phantora_assets.lib.store.io import atomic_path

__all__ = ["CHUNK_ROWS", "GZIP_LEVEL", "write_chrome_trace"]

_enc = msgspec.json.Encoder()
#: gzip level of written traces: 3 deflates ~3x faster than the default 9 for ~1.6x the size.
GZIP_LEVEL = 3
#: Rows whose text is assembled at once (~800 bytes of text each).
CHUNK_ROWS = 65_536
_FLOW_TAIL = ',"token":null,"tenant_id":null,"vsrc":null,"vdst":null,"udp_src_port":null},'


class _Columns:
    """Whole-table access to a raw timeline (a DataFrame or its Parquet file) and its row chunks."""

    def __init__(self, raw: Any) -> None:  # a DataFrame, or the path of a Parquet file
        self.df: Any = None  # one of df and pf is None
        self.pf: Any = None
        if isinstance(raw, pd.DataFrame):
            self.df = raw.reset_index(drop=True)
        else:
            self.pf = pq.ParquetFile(raw)
        names = list(self.df.columns) if self.pf is None else self.pf.schema_arrow.names
        self.n: int = len(self.df) if self.pf is None else self.pf.metadata.num_rows
        if missing := [c for c in RAW_TIMELINE_COLUMNS if c not in names]:
            raise ValueError(f"raw timeline lacks columns {missing}")

    def _series(self, c: str) -> pd.Series:
        return self.df[c] if self.df is not None else self.pf.read(columns=[c]).column(c).to_pandas()

    def int_errors(self) -> list[tuple[int, str]]:
        """A non-integer value in an int64 column (e.g. a float with a NaN): (row, message)."""
        errors = []
        for c, dtype in RAW_TIMELINE_COLUMNS.items():
            if dtype != "int64" or (self.df is None and pa.types.is_integer(self.pf.schema_arrow.field(c).type)):
                continue
            if (col := self._series(c)).dtype.kind in "iu":
                continue
            vals = pd.to_numeric(col, errors="coerce")
            bad = (vals.isna() | (vals != vals.round())).to_numpy()
            if bad.any():
                i = int(np.argmax(bad))
                errors.append((i, f"row {i}: {c} is not an integer: {col.iat[i]!r}"))
        return errors

    def ints(self, c: str) -> np.ndarray:
        return np.asarray(self._series(c) if self.df is not None else self.pf.read(columns=[c]).column(c), np.int64)

    def codes(self, c: str) -> tuple[np.ndarray, list[str]]:
        """Integer code per row and the distinct texts (``str`` of each value, as the lines have them)."""
        if self.df is not None:
            codes, uniques = pd.factorize(self.df[c].astype(str), sort=False, use_na_sentinel=False)
            return codes.astype(np.int64), [str(u) for u in uniques]
        seen: dict[str, int] = {}
        parts = []
        for g in range(self.pf.metadata.num_row_groups):
            arr = self.pf.read_row_group(g, columns=[c]).column(c)
            for chunk in arr.chunks:
                d = chunk.dictionary_encode() if not pa.types.is_dictionary(chunk.type) else chunk
                lut = np.array([seen.setdefault(str(v), len(seen)) for v in d.dictionary.to_pylist()], np.int64)
                idx = d.indices.to_numpy(zero_copy_only=False)
                parts.append(lut[idx] if len(lut) else idx.astype(np.int64))
        return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), list(seen)

    def chunks(self, rows: int) -> Iterator[tuple[int, pd.DataFrame]]:
        if self.df is not None:
            for a in range(0, self.n, rows):
                yield a, self.df.iloc[a : a + rows]
            return
        a = 0
        for batch in self.pf.iter_batches(batch_size=rows, columns=list(RAW_TIMELINE_COLUMNS)):
            df = batch.to_pandas()
            df.index = pd.RangeIndex(a, a + len(df))
            yield a, df
            a += len(df)


def _p2p_peers(cols: _Columns, is_comm: np.ndarray, host: dict[str, np.ndarray], call: np.ndarray) -> np.ndarray:
    """Best-effort peer rank of every NcclSend/NcclRecv row (the raw timeline has no peer column).

    The caller's host is the flow source for a send and the destination for a recv; the peer is
    the smallest other rank of the same communicator seen on the other end's host (a rank's host is
    the one of its first row in the table). Falls back to ``comm_rank ^ 1`` (the other rank of a
    2-rank communicator). Returns an int64 array over all rows (0 where not p2p).
    """
    peers = np.zeros(cols.n, np.int64)
    send, recv = call == 1, call == 2
    p2p = (send | recv) & is_comm
    if not p2p.any():
        return peers
    rank = cols.ints("comm_rank")
    cid, _ = cols.codes("comm_id_hex")
    ci = np.flatnonzero(is_comm)
    own = np.where(recv, host["dst"], host["src"])
    width = int(rank[ci].max()) + 2
    key = cid[ci] * width + (rank[ci] + 1)
    uniq, first = np.unique(key, return_index=True)
    ranks_on: dict[tuple[int, int], list[int]] = {}
    for k, h in zip(uniq.tolist(), own[ci[first]].tolist()):  # keys sorted: each list's ranks ascend
        ranks_on.setdefault((k // width, h), []).append(k % width - 1)
    pi = np.flatnonzero(p2p)
    other = np.where(send, host["dst"], host["src"])[pi]
    n_hosts = int(max(host["src"].max(), host["dst"].max())) + 1
    u3, inv = np.unique((cid[pi] * width + rank[pi] + 1) * n_hosts + other, return_inverse=True)
    out = np.empty(len(u3), np.int64)
    for j, k in enumerate(u3.tolist()):
        (c, r), h = divmod(k // n_hosts, width), k % n_hosts
        cands = [x for x in ranks_on.get((c, h), ()) if x != r - 1]
        out[j] = cands[0] if cands else (r - 1) ^ 1
    peers[pi] = out[inv.reshape(-1)]
    return peers


def write_chrome_trace(raw: pd.DataFrame | str | Path, path: str | Path, *, chunk_rows: int = CHUNK_ROWS) -> dict:
    """Write a raw timeline as a Phantora visualizer Chrome trace.

    Rows are written in the order given (the visualizer's order is arbitrary too).
    Communication rows become ``"cat": "Communication"`` events exactly as in
    ``docs/PHANTORA_FORMATS.md`` section 3 (``pid`` = index of the source host in order of first
    appearance, ``tid`` = ``(stream_device << 32) | stream_id``); computation rows become
    ``"cat": "Computation"`` events with ``pid`` = ``os_pid``, ``tid`` as above and
    ``args = {"Computation": [{"hostname", "pid"}, <dur ns>, <meta>]}``. For ``NcclSend`` /
    ``NcclRecv`` rows with a negative ``stream_id`` the call's ``"stream"`` is written as
    ``null`` and ``tid`` as 0 (upstream p2p calls carry no stream); their ``peer`` is inferred
    (see ``_p2p_peers``).

    The lines are assembled column-wise (pyarrow string kernels), ``chunk_rows`` rows at a time
    (the output does not depend on it): every JSON fragment that only depends on repeated values
    (names, hosts, calls with communicator and stream, meta) is encoded once per distinct value in
    a chunk, numbers are formatted by array casts.

    Args:
        raw: DataFrame with ``RAW_TIMELINE_COLUMNS`` (times in ns, ``end_ns >= start_ns >= 0``),
            or the path of such a table's Parquet file (read in batches: bounded memory).
        path: output file; gzip-compressed when the name ends in ``.gz``. Written atomically;
            identical input gives a byte-identical file.
        chunk_rows: rows assembled at once (>= 1).

    Returns:
        ``{"n_events", "n_communication", "n_computation", "bytes_written"}``; bytes_written is
        the size of the file on disk.

    Raises:
        ValueError: missing columns, unknown kind, negative time or duration, or a
            communicator id that is not hex (the first offending row is named); nothing is written.
    """
    cols = _Columns(raw)
    n = cols.n
    errors = cols.int_errors()
    if errors:
        raise ValueError(min(errors)[1])
    kind, kinds = cols.codes("kind")
    is_comm = np.isin(kind, [i for i, k in enumerate(kinds) if k == "communication"])
    is_comp = np.isin(kind, [i for i, k in enumerate(kinds) if k == "computation"])
    start, end = cols.ints("start_ns"), cols.ints("end_ns")
    unknown = ~(is_comm | is_comp)
    if unknown.any():
        i = int(np.argmax(unknown))
        errors.append((i, f"row {i}: unknown kind {kinds[kind[i]]!r}"))
    bad = (start < 0) | (end < start)
    if bad.any():
        i = int(np.argmax(bad))
        eid = int(cols.ints("event_id")[i])
        errors.append((i, f"row {i} (event {eid}): bad span [{int(start[i])}, {int(end[i])}] ns"))
    pid, peers = np.zeros(n, np.int64), np.zeros(n, np.int64)
    if is_comm.any():
        cid, cids = cols.codes("comm_id_hex")
        bad_cid = np.isin(cid, [i for i, c in enumerate(cids) if not _is_hex(c)]) & is_comm
        if bad_cid.any():
            i = int(np.argmax(bad_cid))
            errors.append((i, f"row {i}: comm_id_hex is not hex: {cids[cid[i]][:40]!r}"))
        host: dict[str, np.ndarray] = {}
        names: dict[str, int] = {}
        for end_ in ("src", "dst"):
            codes, texts = cols.codes(f"{end_}_host")
            host[end_] = np.array([names.setdefault(t, len(names)) for t in texts], np.int64)[codes]
        pid[is_comm] = pd.factorize(host["src"][is_comm], sort=False)[0]
        call_codes, calls = cols.codes("call")
        call = np.array([{"NcclSend": 1, "NcclRecv": 2}.get(c, 0) for c in calls], np.int64)[call_codes]
        peers = _p2p_peers(cols, is_comm, host, call) if not errors else peers
    if errors:
        raise ValueError(min(errors)[1])
    path = Path(path)
    gz = path.name.endswith(".gz")
    with (
        atomic_path(path) as tmp,
        open(tmp, "wb") as fh,
        gzip.GzipFile("", "wb", GZIP_LEVEL, fh, mtime=0) if gz else contextlib.nullcontext(fh) as out,
    ):
        out.write(b"[\n")
        for a, chunk in cols.chunks(max(1, int(chunk_rows))):
            b = a + len(chunk)
            out.write(_chunk_text(chunk, is_comm[a:b], is_comp[a:b], pid[a:b], peers[a:b], last=b == n))
        out.write(b"]" if n else b"\n]")
    counts = {"n_events": n, "n_communication": int(is_comm.sum()), "n_computation": int(is_comp.sum())}
    return {**counts, "bytes_written": path.stat().st_size}


def _is_hex(text: str) -> bool:
    try:
        return bytes.fromhex(text) is not None
    except ValueError:
        return False


def _chunk_text(chunk: pd.DataFrame, is_comm, is_comp, pid, peers, *, last: bool) -> memoryview:
    """The lines of ``chunk``'s rows in their order, each followed by ``,\\n`` (``\\n`` after the table's last)."""
    lines: list[pa.Array] = []
    rows: list[np.ndarray] = []
    if is_comm.any():
        lines.append(_join(_comm_line_parts(chunk[is_comm], pid[is_comm], peers[is_comm])))
        rows.append(np.flatnonzero(is_comm))
    if is_comp.any():
        lines.append(_join(_comp_line_parts(chunk[is_comp])))
        rows.append(np.flatnonzero(is_comp))
    text = pa.concat_arrays(lines).take(pa.array(np.argsort(np.concatenate(rows), kind="stable")))
    text = _join([text, ",\n"])
    offsets = np.frombuffer(text.buffers()[1], np.int64, len(text) + 1, text.offset * 8)
    size = int(offsets[-1] - offsets[0]) - (2 if last else 0)
    body = memoryview(text.buffers()[2].slice(int(offsets[0]), size))
    return memoryview(bytes(body) + b"\n") if last else body  # the table's last line ends with "\n"


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


def _comm_line_parts(comm: pd.DataFrame, pid_codes: np.ndarray, peers: np.ndarray) -> list:
    """The pieces of the Communication lines of ``comm``; ``pid_codes`` (the source host's index in
    order of first appearance in the table) and ``peers`` (see ``_p2p_peers``) per row."""
    call = comm["call"].astype(str).to_numpy(object)
    p2p = (call == "NcclSend") | (call == "NcclRecv")
    dev = comm["stream_device"].to_numpy(np.int64)
    sid = comm["stream_id"].to_numpy(np.int64)
    null_stream = p2p & (sid < 0)
    tid = np.where(null_stream, 0, (dev << 32) | sid)
    src = comm["src_host"].astype(str)
    root = np.where(call == "NcclBcast", comm["root"].to_numpy(np.int64), 0)
    key = pd.DataFrame(
        {
            "call": call,
            "dtype": comm["dtype"].astype(str).to_numpy(object),
            "op": comm["reduce_op"].astype(str).to_numpy(object),
            "root": root,
            "cid": comm["comm_id_hex"].astype(str).to_numpy(object),
            "null": null_stream,
            "dev": dev,
            "sid": sid,
        }
    )
    codes, uniques = pd.factorize(pd.MultiIndex.from_frame(key), sort=False)
    pre, mid, post = [], [], []
    for c, dtype, op, rt, cid, nul, d, sd in uniques:
        ids = _enc.encode(list(bytes.fromhex(cid))).decode()  # hex: write_chrome_trace checked it
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
        post.append(',"id":' + ids + "}" + ',"stream":' + stream + "}}]}}")
    take = pa.array(codes)
    peer_text = pa.array([""] * len(comm), _TEXT)
    if p2p.any():
        peer_text = pc.if_else(pa.array(p2p), _num(np.where(p2p, peers, 0)), peer_text)
    start = comm["start_ns"].to_numpy(np.int64)
    dur = comm["end_ns"].to_numpy(np.int64) - start
    parts = [
        '{"name":',
        _coded(comm["name"], _js),
        ',"cat":"Communication","ph":"X","ts":',
        _micros(start),
        ',"dur":',
        _micros(dur),
        ',"pid":',
        _num(pid_codes),
        ',"tid":',
        _num(tid),
        ',"args":{"Communication":[{"id":',
        _num(comm["event_id"].to_numpy(np.int64)),
        ',"bytes":',
        _num(comm["bytes"].to_numpy(np.int64)),
        ',"src":',
        _coded(src, _js),
        ',"dst":',
        _coded(comm["dst_host"], _js),
        _FLOW_TAIL,
        pa.array(pre, _TEXT).take(take),
        _num(comm["count"].to_numpy(np.int64)),
        pa.array(mid, _TEXT).take(take),
        peer_text,
        ',"comm":{"rank":',
        _num(comm["comm_rank"].to_numpy(np.int64)),
        pa.array(post, _TEXT).take(take),
    ]
    return parts


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
        '{"name":',
        _coded(comp["name"], _js),
        ',"cat":"Computation","ph":"X","ts":',
        _micros(start),
        ',"dur":',
        _micros(dur),
        ',"pid":',
        os_pid,
        ',"tid":',
        _num(tid),
        ',"args":{"Computation":[{"hostname":',
        _coded(comp["src_host"], _js),
        ',"pid":',
        os_pid,
        "},",
        _num(dur),
        ",",
        _coded(comp["meta_json"], _meta_json),
        "]}}",
    ]


def _join(parts: list) -> pa.Array:
    """Element-wise concatenation of text arrays and (broadcast) str pieces."""
    return pc.binary_join_element_wise(
        *(pa.scalar(p, _TEXT) if isinstance(p, str) else p for p in parts), pa.scalar("", _TEXT)
    )
