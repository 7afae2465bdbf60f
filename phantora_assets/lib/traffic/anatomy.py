"""Step anatomy: per step and host, compute time against exposed network communication.

Definitions (one step ``[start_us, end_us)`` of ``steps.parquet``, one host ``h``):

* ``C`` = union of the intervals ``[ts, ts + dur)`` of the host's Computation events (any
  GPU of the host), clipped to the step;
* ``N`` = union of the intervals of the network flows (``src_node != dst_node``) the host
  sends or receives, clipped to the step (0-duration flows add nothing; loopback flows
  inside the host are not network traffic and are left out);
* ``compute_us = |C|``, ``comm_us = |N|``, ``overlap_us = |C & N|`` (communication hidden
  behind compute), ``exposed_comm_us = |N - C| = comm_us - overlap_us`` (communication
  nothing else hides), ``idle_us = duration_us - |C | N|`` (neither: waiting, launch gaps).

So ``compute_us + exposed_comm_us + idle_us == duration_us`` for every row: ``duration_us`` is the step's
own duration (``steps.duration_us``); the run's *step time* is one number, the median of its typical timed
steady steps (``lib/traffic/steps``: ``runs.step_time_s``, ``trace_summary.step_time_us``, the DuckDB
``run_anatomy.step_time_ms``), never a per-step value or a mean (issue 39 item 18). A mean over steps of
these times is one over the ``timed`` rows (``steps.timed``): the last steady step of a trace that ends with
its last flow lacks the time after that flow (a DeepSpeed job of 4 micro-batches: 3.42 ms beside 10.48 ms). The chrome
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
    "timed": "bool",
    "host": "str",
    "node": "int64",
    "step_start_us": "float64",
    "duration_us": "float64",
    "compute_us": "float64",
    "comm_us": "float64",
    "overlap_us": "float64",
    "exposed_comm_us": "float64",
    "idle_us": "float64",
}

#: What each step_anatomy column means (the database's column comments).
ANATOMY_DOCS: dict[str, str] = {
    "steady": "false for warm-up steps",
    "timed": "steady and ending at its own end (steps.timed): the last step of a trace that ends with its last "
    "flow is not (its time is cut short); average times over timed rows",
    "host": "host-k (node k-1)",
    "step_start_us": "step start, simulated us since the trace start",
    "duration_us": "the step's duration (steps.duration_us), us; the run's step time is runs.step_time_s",
    "compute_us": "|C|: time with at least one Computation event of the host running, us",
    "comm_us": "|N|: time with at least one network flow to or from the host in flight, us",
    "overlap_us": "|C & N|: network time hidden behind compute, us",
    "exposed_comm_us": "|N - C| = comm_us - overlap_us: network time no compute hides, us",
    "idle_us": "duration_us - |C | N|: neither compute nor network, us",
}

#: step_spans.parquet: merged intervals of one step, relative to its start.
SPAN_COLUMNS: dict[str, str] = {
    "step": "int64",
    "host": "str",
    "node": "int64",
    "kind": "str",  # compute | communication
    "start_us": "float64",  # offset from the step start, >= 0
    "end_us": "float64",  # <= the step's duration_us
}

_HOST_RE = re.compile(r"host-([1-9][0-9]{0,18})")  # as chrome_trace reads hosts: host-01 is not host-1


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
_comp_args_list = msgspec.json.Decoder(list[_CompArgs])


def node_of(host: str) -> int:
    """``host-k`` -> node ``k - 1``."""
    m = _HOST_RE.fullmatch(host)
    if not m:
        raise ValueError(f"{host!r:.80} is not of the form host-<k>, k >= 1 written without leading zeros")
    return int(m.group(1)) - 1


def _open(path: Path):
    with open(path, "rb") as fh:
        magic = fh.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def read_compute_events(path: str | Path, *, chunk_bytes: int = 1 << 22) -> pd.DataFrame:
    """Every Computation event of a Phantora Chrome trace (``COMPUTE_EVENT_COLUMNS``).

    The visualizer layout (one event per line) is streamed a few MiB at a time and only the
    lines that name ``Computation`` are decoded (in one ``msgspec`` call per chunk); any other
    JSON array layout is decoded whole.

    Raises:
        TraceFormatError: the file is not such a JSON array, or an event breaks the schema
            (names the file and, in the visualizer layout, the line).
    """
    path = Path(path)
    hosts: list[str] = []
    ts: list[float] = []
    dur: list[float] = []

    def add(events: list[_Event], where) -> None:
        comp = [e for e in events if e.cat == "Computation"]
        if not comp:
            return
        try:
            args = _comp_args_list.decode(b"[" + b",".join(e.args for e in comp) + b"]")
        except msgspec.DecodeError as exc:
            raise TraceFormatError(path, "bad Computation event", f"{where(None)}: {exc}") from None
        hosts.extend(a.Computation[0].hostname for a in args)
        ts.extend(e.ts for e in comp)
        dur.extend(e.dur for e in comp)

    try:
        with _open(path) as fh:
            first = fh.readline()
            if first.strip() == b"[":
                _scan_lines(path, fh, add, chunk_bytes)
            else:
                try:
                    events = _events.decode(first + fh.read())
                except msgspec.DecodeError as exc:
                    raise TraceFormatError(path, "invalid JSON", str(exc)) from None
                add(events, lambda _i: "the JSON array")
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceFormatError(path, "unreadable trace", str(exc)) from None
    return pd.DataFrame(
        {
            "host": pd.Series(hosts, dtype=object),
            "ts_us": np.asarray(ts, dtype=np.float64),
            "dur_us": np.asarray(dur, dtype=np.float64),
        },
        columns=list(COMPUTE_EVENT_COLUMNS),
    )


def _scan_lines(path: Path, fh, add, chunk_bytes: int) -> None:
    """Pass the Computation lines of ``fh`` to ``add``, one decoded batch per chunk of text."""
    tail = b""
    line0 = 2  # line number of the chunk's first line
    while True:
        chunk = fh.read(chunk_bytes)
        buf = tail + chunk
        cut = len(buf) if not chunk else buf.rfind(NEWLINE) + 1
        text, tail = buf[:cut], buf[cut:]
        lines = text.split(NEWLINE)
        picked = [k for k, ln in enumerate(lines) if _MARK in ln]
        if picked:
            bodies = [lines[k].rstrip().rstrip(b",") for k in picked]
            try:
                events = _events.decode(b"[" + b",".join(bodies) + b"]")
            except msgspec.DecodeError:
                for k, body in zip(picked, bodies):  # find the line to name it
                    try:
                        _event.decode(body)
                    except msgspec.DecodeError as exc:
                        raise TraceFormatError(path, "invalid JSON", f"line {line0 + k}: {exc}") from None
                raise
            first_line = line0 + picked[0]
            add(events, lambda _i, n=first_line: f"line {n} or below")
        line0 += len(lines) - 1
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
        j = np.searchsorted(e, t, side="right")  # intervals ended by t
        partial = np.zeros_like(t)
        inside = j < len(s)
        jj = np.minimum(j, max(len(s) - 1, 0))
        if len(s):
            partial = np.where(inside, np.clip(t - s[jj], 0.0, None), 0.0)
        return cum[j] + partial

    return np.maximum(upto(b) - upto(a), 0.0)


Intervals = dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]


def host_intervals(flows: pd.DataFrame, compute: pd.DataFrame, hosts: list[str]) -> Intervals:
    """Per host: merged ``compute``, ``communication`` (network flows) and ``union`` intervals (us)."""
    src = flows["src_node"].to_numpy(np.int64)
    dst = flows["dst_node"].to_numpy(np.int64)
    fs = flows["ts_us"].to_numpy(np.float64)
    fe = fs + flows["dur_us"].to_numpy(np.float64)
    net = src != dst
    ch = compute["host"].to_numpy(object)
    cs = compute["ts_us"].to_numpy(np.float64)
    ce = cs + compute["dur_us"].to_numpy(np.float64)
    out: Intervals = {}
    for host in hosts:
        node = node_of(host)
        mine = ch == host
        on = net & ((src == node) | (dst == node))
        c = merge_intervals(cs[mine], ce[mine])
        n = merge_intervals(fs[on], fe[on])
        u = merge_intervals(np.concatenate([c[0], n[0]]), np.concatenate([c[1], n[1]]))
        out[host] = {"compute": c, "communication": n, "union": u}
    return out


def hosts_of(flows: pd.DataFrame, compute: pd.DataFrame, n_nodes: int | None = None) -> list[str]:
    """Hosts seen in the flows or the compute events (or ``host-1..host-n_nodes``), by node."""
    nodes = set(np.union1d(flows["src_node"].to_numpy(), flows["dst_node"].to_numpy()).tolist())
    nodes |= {node_of(h) for h in compute["host"].unique()}
    if n_nodes is not None:
        nodes |= set(range(n_nodes))
    return [f"host-{n + 1}" for n in sorted(nodes)]


def step_anatomy(
    steps: pd.DataFrame,
    flows: pd.DataFrame,
    compute: pd.DataFrame,
    hosts: list[str] | None = None,
    intervals: Intervals | None = None,
) -> pd.DataFrame:
    """One ``ANATOMY_COLUMNS`` row per (step, host) (module docstring: definitions).

    Args:
        steps: ``tables.STEP_COLUMNS`` rows.
        flows: flows with ``ts_us, dur_us, src_node, dst_node`` (all of them; the network ones
            are selected here).
        compute: ``COMPUTE_EVENT_COLUMNS`` rows.
        hosts: hosts to report (default: :func:`hosts_of`).
        intervals: :func:`host_intervals` of these hosts, if already computed.
    """
    hosts = hosts if hosts is not None else hosts_of(flows, compute)
    intervals = intervals if intervals is not None else host_intervals(flows, compute, hosts)
    a = steps["start_us"].to_numpy(np.float64)
    b = steps["end_us"].to_numpy(np.float64)
    frames = []
    for host in hosts:
        iv = intervals[host]
        # rounded to the trace's resolution (1 ns = 0.001 us) so that float noise does not show as
        # picoseconds of overlap
        comp = np.round(covered(*iv["compute"], a, b), 3)
        comm = np.round(covered(*iv["communication"], a, b), 3)
        union = np.round(covered(*iv["union"], a, b), 3)
        overlap = np.maximum(np.round(comp + comm - union, 3), 0.0)
        frames.append(
            pd.DataFrame(
                {
                    "step": steps["step"].to_numpy(np.int64),
                    "steady": steps["steady"].to_numpy(bool),
                    "timed": steps["timed"].to_numpy(bool),
                    "host": host,
                    "node": node_of(host),
                    "step_start_us": a,
                    "duration_us": b - a,
                    "compute_us": comp,
                    "comm_us": comm,
                    "overlap_us": overlap,
                    "exposed_comm_us": np.round(comm - overlap, 3),
                    "idle_us": np.maximum(np.round((b - a) - union, 3), 0.0),
                }
            )
        )
    if not frames:
        return pd.DataFrame({k: pd.Series([], dtype=(object if v == "str" else v)) for k, v in ANATOMY_COLUMNS.items()})
    out = pd.concat(frames, ignore_index=True).sort_values(["step", "node"], kind="stable").reset_index(drop=True)
    return out[list(ANATOMY_COLUMNS)]


def step_spans(
    step: pd.Series, flows: pd.DataFrame, compute: pd.DataFrame, hosts: list[str], intervals: Intervals | None = None
) -> pd.DataFrame:
    """Merged compute and network intervals of one step per host, relative to the step start."""
    intervals = intervals if intervals is not None else host_intervals(flows, compute, hosts)
    a, b = float(step["start_us"]), float(step["end_us"])
    rows = []
    for host in hosts:
        iv = intervals[host]
        for kind in ("compute", "communication"):
            s, e = iv[kind]
            s, e = np.clip(s, a, b), np.clip(e, a, b)
            keep = e > s
            for lo, hi in zip(s[keep], e[keep]):
                rows.append((int(step["step"]), host, node_of(host), kind, lo - a, hi - a))
    df = pd.DataFrame(rows, columns=list(SPAN_COLUMNS))
    return df.astype({k: (object if v == "str" else v) for k, v in SPAN_COLUMNS.items()})
