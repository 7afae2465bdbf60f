"""Phantora Chrome/Perfetto trace writer: a raw timeline -> ``timeline.json`` / ``timeline.json.gz``.

Job: :func:`write_chrome_trace` turns a raw timeline (``columns.RAW_TIMELINE_COLUMNS``, one row
per event, times in simulated ns) into a file in the layout of Phantora's ``phantora_visualizer``
(``docs/PHANTORA_FORMATS.md`` section 3): ``[\\n`` + one complete event (``"ph": "X"``) per line,
joined by ``,\\n``, + ``\\n]``; ``ts`` and ``dur`` are simulated microseconds (ns / 1000, up to 3
decimals). The file is byte-for-byte deterministic (gzip level :data:`GZIP_LEVEL`, ``mtime=0``, no
file name in the gzip header) and written atomically. The reader of this layout is
``chrome_trace.read_trace``.

Errors: ``ValueError`` naming the first offending row (missing columns, unknown kind, negative
time or duration, non-integer value in an int64 column, communicator id that is not hex).

This module does not import dagster.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from phantora_assets.columns import RAW_TIMELINE_COLUMNS
from phantora_assets.lib.store.io import atomic_path

__all__ = ["GZIP_LEVEL", "write_chrome_trace"]

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
    for call, cid, rank, src, dst in zip(
        firsts["call"], firsts["comm_id_hex"], firsts["comm_rank"], firsts["src_host"], firsts["dst_host"]
    ):
        host = dst if call == "NcclRecv" else src
        rank_host.setdefault(cid, {}).setdefault(int(rank), host)
    peers: dict[int, int] = {}
    p2p = comm[comm["call"].isin(("NcclSend", "NcclRecv"))]
    memo: dict[tuple, int] = {}
    for idx, call, cid, rank, src, dst in zip(
        p2p.index, p2p["call"], p2p["comm_id_hex"], p2p["comm_rank"], p2p["src_host"], p2p["dst_host"]
    ):
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
    ``docs/PHANTORA_FORMATS.md`` section 3 (``pid`` = index of the source host in order of first
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
        if dtype == "int64" and raw[c].dtype.kind not in "iu":  # e.g. float with a NaN
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
        errors.append(
            (i, f"row {i} (event {int(raw['event_id'].iat[i])}): bad span [{int(start[i])}, {int(end[i])}] ns")
        )
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
            with (
                open(tmp, "wb") as fh,
                gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0, compresslevel=GZIP_LEVEL) as gz,
            ):
                gz.write(data)
        else:
            tmp.write_bytes(data)
    return {
        "n_events": n,
        "n_communication": int(is_comm.sum()),
        "n_computation": int(is_comp.sum()),
        "bytes_written": path.stat().st_size,
    }


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
    pid_codes, _ = pd.factorize(src, sort=False)  # hosts in order of first appearance
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
        post.append(',"id":' + ids + "}" + ',"stream":' + stream + "}}]}}")
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
