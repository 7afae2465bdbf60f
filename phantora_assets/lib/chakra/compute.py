"""Every Computation event of a Phantora Chrome trace, on the rank that ran it.

``lib/traffic/anatomy.read_compute_events`` keeps (host, ts, dur) per event; an ET is per rank,
so this reader also keeps the name and places each event on its global rank
``(host k - 1) * gpus_per_node + local GPU``, the local GPU taken from, in order:

1. ``meta.Cuda.Kernel.rank`` (the global rank; what the kineto and chakra sources write);
2. ``meta.Torch.stream.device`` (Phantora's own traces and the analytic simulator's);
3. the rank's OS pid (``args.Computation[0].pid``): the host's ranks in increasing pid order.

The visualizer layout (one event per line) is streamed and only the lines naming ``Computation``
are decoded; any other JSON array layout is decoded whole. No Dagster import.
"""

from __future__ import annotations

import gzip
import zlib
from pathlib import Path

import msgspec
import pandas as pd

from phantora_assets.lib.errors import TraceFormatError
from phantora_assets.lib.traffic.anatomy import node_of

#: The table :func:`rank_compute_events` returns: one row per Computation event.
RANK_COMPUTE_COLUMNS = {"rank": "int64", "name": "str", "ts_us": "float64", "dur_us": "float64", "stream": "int64"}


class _Host(msgspec.Struct):
    hostname: str
    pid: int = 0


class _Rank(msgspec.Struct):
    rank: int | None = None


class _Cuda(msgspec.Struct):
    Kernel: _Rank | None = None


class _Stream(msgspec.Struct):
    device: int = 0
    id: int = 0


class _Torch(msgspec.Struct):
    stream: _Stream | None = None


class _Meta(msgspec.Struct):
    Torch: _Torch | None = None
    Cuda: _Cuda | None = None


class _Args(msgspec.Struct):
    Computation: tuple[_Host, int, _Meta | None]


class _Event(msgspec.Struct):
    cat: str = ""
    name: str = ""
    ts: float = 0.0
    dur: float = 0.0
    tid: int = 0
    args: _Args | None = None


_events = msgspec.json.Decoder(list[_Event])
_MARK = b'"Computation"'


def _open(path: Path):
    with open(path, "rb") as fh:
        magic = fh.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def _decode(path: Path, text: bytes, where: str) -> list[_Event]:
    try:
        return [e for e in _events.decode(text) if e.cat == "Computation" and e.args is not None]
    except msgspec.DecodeError as exc:
        raise TraceFormatError(path, "bad Computation event", f"{where}: {exc}") from None


def rank_compute_events(path: str | Path, gpus_per_node: int, batch_lines: int = 20000) -> pd.DataFrame:
    """The Computation events of the trace at ``path`` with their global rank
    (:data:`RANK_COMPUTE_COLUMNS`; ``ts_us``/``dur_us`` in trace us, ``stream`` the event's tid).

    Raises:
        TraceFormatError: the trace is unreadable, not a JSON array, an event breaks the schema
            (``bad Computation event``), or a local GPU is not below ``gpus_per_node``
            (``rank placement``); each names the file.
    """
    path = Path(path)
    events: list[_Event] = []
    try:
        with _open(path) as fh:
            first = fh.readline()
            if first.strip() == b"[":
                picked: list[bytes] = []
                line = 1
                for raw in fh:
                    line += 1
                    if _MARK in raw:
                        picked.append(raw.rstrip().rstrip(b","))
                    if len(picked) >= batch_lines:
                        events += _decode(path, b"[" + b",".join(picked) + b"]", f"line {line} or above")
                        picked = []
                if picked:
                    events += _decode(path, b"[" + b",".join(picked) + b"]", f"line {line} or above")
            else:
                events = _decode(path, first + fh.read(), "the JSON array")
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceFormatError(path, "unreadable trace", str(exc)) from None
    pids: dict[str, list[int]] = {}
    for e in events:
        assert e.args is not None
        h = e.args.Computation[0]
        pids.setdefault(h.hostname, [])
        if h.pid not in pids[h.hostname]:
            pids[h.hostname].append(h.pid)
    order = {host: {p: i for i, p in enumerate(sorted(ps))} for host, ps in pids.items()}
    ranks: list[int] = []
    for e in events:
        assert e.args is not None
        h, _, meta = e.args.Computation
        node = node_of(h.hostname)
        if (
            meta is not None
            and meta.Cuda is not None
            and meta.Cuda.Kernel is not None
            and meta.Cuda.Kernel.rank is not None
        ):
            ranks.append(meta.Cuda.Kernel.rank)
            continue
        local = (
            meta.Torch.stream.device
            if meta is not None and meta.Torch is not None and meta.Torch.stream is not None
            else order[h.hostname][h.pid]
        )
        if not 0 <= local < gpus_per_node:
            raise TraceFormatError(
                path, "rank placement", f"{e.name} on {h.hostname} GPU {local}, but a host has {gpus_per_node} GPUs"
            )
        ranks.append(node * gpus_per_node + local)
    return pd.DataFrame(
        {"rank": pd.Series(ranks, dtype="int64"), "name": pd.Series([e.name for e in events], dtype=object),
         "ts_us": pd.Series([e.ts for e in events], dtype="float64"),
         "dur_us": pd.Series([e.dur for e in events], dtype="float64"),
         "stream": pd.Series([e.tid for e in events], dtype="int64")},
        columns=list(RANK_COMPUTE_COLUMNS),
    )  # fmt: skip
