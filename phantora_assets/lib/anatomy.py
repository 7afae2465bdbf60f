"""Step anatomy: per step and host, compute time against exposed network communication.

Definitions (one step ``[start_us, end_us)`` of ``steps.parquet``, one host ``h``):

* ``C`` = union of the intervals ``[ts, ts + dur)`` of the host's Computation events (any
  GPU of the host), clipped to the step;
* ``N`` = union of the intervals of the network flows (``src_node != dst_node``) the host
  sends or receives, clipped to the step (0-duration flows add nothing; loopback flows
  inside the host are not network traffic and are left out);
* ``compute_us = |C|``, ``comm_us = |N|``, ``overlap_us = |C & N|`` (communication hidden
  behind compute), ``exposed_comm_us = |N - C| = comm_us - overlap_us`` (communication
  nothing else hides), ``idle_us = step_time_us - |C | N|`` (neither: waiting, launch gaps).

So ``compute_us + exposed_comm_us + idle_us == step_time_us`` for every row. The chrome
trace's per-host summary keeps only totals, so the Computation intervals are read here in
a second pass over ``timeline.json(.gz)`` that decodes only Computation events.

No Dagster import.
"""

from __future__ import annotations

import gzip
import re
import zlib
from pathlib import Path

import msgspec
import numpy as np
import pandas as pd

from phantora_assets.lib.errors import TraceFormatError

#: Computation intervals read from a trace: one row per Computation event.
COMPUTE_EVENT_COLUMNS: dict[str, str] = {
    "host": "str",
    "ts_us": "float64",
    "dur_us": "float64",
}

#: step_anatomy.parquet: one row per (step, host).
ANATOMY_COLUMNS: dict[str, str] = {
    "step": "int64",
    "steady": "bool",
    "host": "str",
    "node": "int64",
    "step_start_us": "float64",
    "step_time_us": "float64",
    "compute_us": "float64",
    "comm_us": "float64",
    "overlap_us": "float64",
    "exposed_comm_us": "float64",
    "idle_us": "float64",
}

#: What each step_anatomy column means (the database's column comments).
ANATOMY_DOCS: dict[str, str] = {
    "steady": "false for warm-up steps",
    "host": "host-k (node k-1)",
    "step_start_us": "step start, simulated us since the trace start",
    "step_time_us": "step duration, us",
    "compute_us": "|C|: time with at least one Computation event of the host running, us",
    "comm_us": "|N|: time with at least one network flow to or from the host in flight, us",
    "overlap_us": "|C & N|: network time hidden behind compute, us",
    "exposed_comm_us": "|N - C| = comm_us - overlap_us: network time no compute hides, us",
    "idle_us": "step_time_us - |C | N|: neither compute nor network, us",
}

#: step_spans.parquet: merged intervals of one step, relative to its start.
SPAN_COLUMNS: dict[str, str] = {
    "step": "int64",
    "host": "str",
    "node": "int64",
    "kind": "str",             # compute | communication
    "start_us": "float64",     # offset from the step start, >= 0
    "end_us": "float64",       # <= step_time_us
}

_HOST_RE = re.compile(r"host-([0-9]+)")


class _Host(msgspec.Struct):
    hostname: str


class _CompArgs(msgspec.Struct):
    Computation: tuple[_Host, int, msgspec.Raw]


class _Event(msgspec.Struct):
    cat: str = ""
    ts: float = 0.0
    dur: float = 0.0
    args: msgspec.Raw = msgspec.Raw(b"null")


_MARK = b'"Computation"'
NEWLINE = b"\n"
_event = msgspec.json.Decoder(_Event)
_events = msgspec.json.Decoder(list[_Event])
_comp_args = msgspec.json.Decoder(_CompArgs)


def node_of(host: str) -> int:
    """``host-k`` -> node ``k - 1``."""
    m = _HOST_RE.fullmatch(host)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"{host!r} is not of the form host-<k>, k >= 1")
    return int(m.group(1)) - 1


def _open(path: Path):
    with open(path, "rb") as fh:
        magic = fh.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def read_compute_events(path: str | Path) -> pd.DataFrame:
    """Every Computation event of a Phantora Chrome trace (``COMPUTE_EVENT_COLUMNS``).

    The visualizer layout (one event per line) is streamed line by line and only lines that
    name ``Computation`` are decoded; any other JSON array layout is decoded whole.

    Raises:
        TraceFormatError: the file is not such a JSON array, or an event breaks the schema.
    """
    path = Path(path)
    hosts: list[str] = []
    ts: list[float] = []
    dur: list[float] = []

    def add(ev: _Event, where) -> None:
        if ev.cat != "Computation":
            return
        try:
            args = _comp_args.decode(ev.args)
        except msgspec.DecodeError as exc:
            raise TraceFormatError(path, "bad Computation event", f"{where()}: {exc}") from None
        hosts.append(args.Computation[0].hostname)
        ts.append(ev.ts)
        dur.append(ev.dur)

    try:
        with _open(path) as fh:
            first = fh.readline()
            if first.strip() == b"[":
                _scan_lines(fh, add)
            else:
                try:
                    for i, ev in enumerate(_events.decode(first + fh.read())):
                        add(ev, lambda i=i: f"event {i}")
                except msgspec.DecodeError as exc:
                    raise TraceFormatError(path, "invalid JSON", str(exc)) from None
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceFormatError(path, "unreadable trace", str(exc)) from None
    return pd.DataFrame({"host": pd.Series(hosts, dtype=object),
                         "ts_us": np.asarray(ts, dtype=np.float64),
                         "dur_us": np.asarray(dur, dtype=np.float64)}, columns=list(COMPUTE_EVENT_COLUMNS))


def _scan_lines(fh, add, chunk_bytes: int = 1 << 22) -> None:
    """Decode the lines of ``fh`` that hold a Computation event, a few MiB of text at a time."""
    tail = b""
    offset_lines = 1
    while True:
        chunk = fh.read(chunk_bytes)
        buf = tail + chunk
        cut = len(buf) if not chunk else buf.rfind(b"\n") + 1
        if cut <= 0:
            tail = buf
            continue
        text, tail = buf[:cut], buf[cut:]
        pos = text.find(_MARK)
        while pos >= 0:
            lo = text.rfind(b"\n", 0, pos) + 1
            hi = text.find(b"\n", pos)
            hi = len(text) if hi < 0 else hi
            body = text[lo:hi].rstrip().rstrip(b",")

            def where(lo: int = lo, text: bytes = text, base: int = offset_lines) -> str:
                return f"line {base + text.count(NEWLINE, 0, lo) + 1}"
            try:
                event = _event.decode(body)
            except msgspec.DecodeError as exc:
                raise TraceFormatError(fh.name, "invalid JSON", f"{where()}: {exc}") from None
            add(event, where)
            pos = text.find(_MARK, hi)
        offset_lines += text.count(b"\n")
        if not chunk:
            return


def merge_intervals(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of ``[starts, ends)`` as sorted disjoint intervals (empty ones dropped)."""
    s = np.asarray(starts, dtype=np.float64)
    e = np.asarray(ends, dtype=np.float64)
    keep = e > s
    s, e = s[keep], e[keep]
    if len(s) == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.concatenate([[True], s[1:] > reach[:-1]])
    group_end = np.concatenate([np.flatnonzero(new)[1:] - 1, [len(s) - 1]])
    return s[new], reach[group_end]


def covered(starts: np.ndarray, ends: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Length of ``[a, b)`` covered by the disjoint sorted intervals, for arrays ``a``, ``b``."""
    s, e = np.asarray(starts, np.float64), np.asarray(ends, np.float64)
    cum = np.concatenate([[0.0], np.cumsum(e - s)])

    def upto(t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        j = np.searchsorted(e, t, side="right")          # intervals ended by t
        partial = np.zeros_like(t)
        inside = j < len(s)
        jj = np.minimum(j, max(len(s) - 1, 0))
        if len(s):
            partial = np.where(inside, np.clip(t - s[jj], 0.0, None), 0.0)
        return cum[j] + partial

    return np.maximum(upto(b) - upto(a), 0.0)


def _host_intervals(flows: pd.DataFrame, compute: pd.DataFrame, host: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    node = node_of(host)
    c = compute[compute["host"] == host]
    net = flows[(flows["src_node"] != flows["dst_node"]) & ((flows["src_node"] == node) | (flows["dst_node"] == node))]
    cs, ce = merge_intervals(c["ts_us"].to_numpy(), (c["ts_us"] + c["dur_us"]).to_numpy())
    ns, ne = merge_intervals(net["ts_us"].to_numpy(), (net["ts_us"] + net["dur_us"]).to_numpy())
    us, ue = merge_intervals(np.concatenate([cs, ns]), np.concatenate([ce, ne]))
    return {"compute": (cs, ce), "communication": (ns, ne), "union": (us, ue)}


def hosts_of(flows: pd.DataFrame, compute: pd.DataFrame, n_nodes: int | None = None) -> list[str]:
    """Hosts seen in the flows or the compute events (or ``host-1..host-n_nodes``), by node."""
    nodes = set(flows["src_node"].tolist()) | set(flows["dst_node"].tolist())
    nodes |= {node_of(h) for h in compute["host"].unique()}
    if n_nodes is not None:
        nodes |= set(range(n_nodes))
    return [f"host-{n + 1}" for n in sorted(nodes)]


def step_anatomy(steps: pd.DataFrame, flows: pd.DataFrame, compute: pd.DataFrame,
                 hosts: list[str] | None = None) -> pd.DataFrame:
    """One ``ANATOMY_COLUMNS`` row per (step, host) (module docstring: definitions).

    Args:
        steps: ``tables.STEP_COLUMNS`` rows.
        flows: flows with ``ts_us, dur_us, src_node, dst_node`` (all of them; the network ones
            are selected here).
        compute: ``COMPUTE_EVENT_COLUMNS`` rows.
        hosts: hosts to report (default: :func:`hosts_of`).
    """
    hosts = hosts if hosts is not None else hosts_of(flows, compute)
    a = steps["start_us"].to_numpy(np.float64)
    b = steps["end_us"].to_numpy(np.float64)
    frames = []
    for host in hosts:
        iv = _host_intervals(flows, compute, host)
        # rounded to the trace's resolution (1 ns = 0.001 us) so that float noise does not show as
        # picoseconds of overlap
        comp = np.round(covered(*iv["compute"], a, b), 3)
        comm = np.round(covered(*iv["communication"], a, b), 3)
        union = np.round(covered(*iv["union"], a, b), 3)
        overlap = np.maximum(np.round(comp + comm - union, 3), 0.0)
        frames.append(pd.DataFrame({
            "step": steps["step"].to_numpy(np.int64),
            "steady": steps["steady"].to_numpy(bool),
            "host": host,
            "node": node_of(host),
            "step_start_us": a,
            "step_time_us": b - a,
            "compute_us": comp,
            "comm_us": comm,
            "overlap_us": overlap,
            "exposed_comm_us": np.round(comm - overlap, 3),
            "idle_us": np.maximum(np.round((b - a) - union, 3), 0.0),
        }))
    if not frames:
        return pd.DataFrame({k: pd.Series([], dtype=(object if v == "str" else v)) for k, v in ANATOMY_COLUMNS.items()})
    out = pd.concat(frames, ignore_index=True).sort_values(["step", "node"], kind="stable").reset_index(drop=True)
    return out[list(ANATOMY_COLUMNS)]


def step_spans(step: pd.Series, flows: pd.DataFrame, compute: pd.DataFrame, hosts: list[str]) -> pd.DataFrame:
    """Merged compute and network intervals of one step per host, relative to the step start."""
    a, b = float(step["start_us"]), float(step["end_us"])
    rows = []
    for host in hosts:
        iv = _host_intervals(flows, compute, host)
        for kind in ("compute", "communication"):
            s, e = iv[kind]
            s, e = np.clip(s, a, b), np.clip(e, a, b)
            keep = e > s
            for lo, hi in zip(s[keep], e[keep]):
                rows.append((int(step["step"]), host, node_of(host), kind, lo - a, hi - a))
    df = pd.DataFrame(rows, columns=list(SPAN_COLUMNS))
    return df.astype({k: (object if v == "str" else v) for k, v in SPAN_COLUMNS.items()})
