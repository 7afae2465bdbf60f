"""Read and write Chakra execution traces (``*.<rank>.et``) with this project's own description of
Chakra's schema (``schema.py``: the messages of MLCommons' ``et_def.proto``) and framing.

A file is one ``GlobalMetadata`` record, then ``Node`` records until the end of the file, each record
preceded by its length in bytes as a base-128 varint (the framing of Chakra's ``protolib`` and of
ASTRA-sim's ET feeder); a file may also be gzip-compressed as a whole (recognised by its magic bytes,
as Chakra's ``openFileRd`` does). Only the ``protobuf`` runtime is needed, a core dependency.

:func:`read_et` is the one decoding path: this project's exports, ASTRA-sim's microbenchmark ETs
and the output of Chakra's own PyTorch converter all go through it (``tests/integration/test_chakra.py``,
``tests/unit/lib/chakra/test_chakra_schema.py``). No Dagster import.
"""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from phantora_assets.lib.chakra import schema
from phantora_assets.lib.errors import FileRuleError, TraceFormatError
from phantora_assets.lib.store.io import atomic_write_bytes

#: The schema version written into the metadata record (the version ASTRA-sim's examples carry).
SCHEMA_VERSION = "0.0.4"

#: ``CollectiveCommType`` value -> the op name of this project's tables (``lib/traffic/ring.py``,
#: and ``all_to_all``). The values are those of ``et_def.proto``.
COMM_TYPE_OPS: dict[int, str] = {0: "all_reduce", 2: "all_gather", 5: "broadcast", 6: "all_to_all", 7: "reduce_scatter"}
OP_COMM_TYPES: dict[str, int] = {v: k for k, v in COMM_TYPE_OPS.items()}
#: ``NodeType`` values (``et_def.proto``).
COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE = 4, 5, 6, 7
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass
class EtNode:
    """One node of an ET as plain values.

    Attributes:
        id: node id (unique in its file). name: its name. type: ``NodeType`` value (4 compute,
            5 send, 6 recv, 7 collective).
        ctrl_deps / data_deps: ids of the nodes it waits for.
        start_us / dur_us: ``start_time_micros`` / ``duration_micros`` (whole us).
        attrs: attribute name -> value (``int64_val``, ``bool_val``, ``string_val`` ...; a list
            attribute as a Python list).
    """

    id: int
    name: str
    type: int
    ctrl_deps: list[int] = field(default_factory=list)
    data_deps: list[int] = field(default_factory=list)
    start_us: int = 0
    dur_us: int = 0
    attrs: dict[str, Any] = field(default_factory=dict)

    @property
    def is_collective(self) -> bool:
        """A COMM_COLL node that carries ``comm_type`` (the GPU-side node; Chakra's converter also
        writes the CPU op that launched it as a COMM_COLL node without one)."""
        return self.type == COMM_COLL_NODE and "comm_type" in self.attrs


@dataclass
class EtFile:
    """A decoded ET file: ``version`` and ``metadata`` attributes of its GlobalMetadata record, its nodes."""

    path: Path
    version: str
    metadata: dict[str, Any]
    nodes: list[EtNode]


def _attr_value(a: Any) -> Any:
    kind = a.WhichOneof("value")
    if kind is None:
        return None
    v = getattr(a, kind)
    return list(v.values) if kind.endswith("_list") else v


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """The base-128 varint at ``data[pos:]`` and the position after it; ValueError if cut or over 64 bits."""
    value = shift = 0
    while pos < len(data) and shift < 64:
        b = data[pos]
        value |= (b & 0x7F) << shift
        pos += 1
        if not b & 0x80:
            return value, pos
        shift += 7
    raise ValueError("the file ends inside a record's length" if pos >= len(data) else "a record length over 64 bits")


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.append(value)
    return bytes(out)


def _records(path: Path, data: bytes) -> Iterator[bytes]:
    """The length-delimited records of ``data`` in order (module docstring); TraceFormatError naming the
    record (0 is the metadata, k the k-th node) when a length is cut or announces more bytes than are left."""
    pos = index = 0
    while pos < len(data):
        what = "the GlobalMetadata record" if index == 0 else f"node #{index - 1}"
        try:
            size, body = _varint(data, pos)
        except ValueError as exc:
            raise TraceFormatError(path, "invalid ET", f"{what} at byte {pos}: {exc}") from None
        if body + size > len(data):
            raise TraceFormatError(
                path, "invalid ET", f"{what} at byte {pos}: {size} bytes announced, {len(data) - body} left (cut short)"
            )
        yield data[body : body + size]
        pos, index = body + size, index + 1


def _file_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:2] != _GZIP_MAGIC:
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceFormatError(path, "invalid ET", f"gzip-compressed, but it does not decompress: {exc}") from None


def read_et(path: str | Path) -> EtFile:
    """Decode one ET file (plain or gzip-compressed; module docstring).

    Returns:
        the metadata record's version and attributes, and every node in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceFormatError: rule ``invalid ET``: the file is empty, does not decompress, a record is cut
            short, or its bytes are not a GlobalMetadata / Node message (names the file and the record).
    """
    from google.protobuf.message import DecodeError

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such Chakra ET file")
    records = _records(path, _file_bytes(path))
    meta = schema.GlobalMetadata()
    first = next(records, None)
    if first is None:
        raise TraceFormatError(path, "invalid ET", "no GlobalMetadata record (empty or not an ET)")
    try:
        meta.ParseFromString(first)
    except DecodeError as exc:
        raise TraceFormatError(path, "invalid ET", f"the GlobalMetadata record: {exc}") from None
    nodes: list[EtNode] = []
    msg = schema.Node()
    for rec in records:
        try:
            msg.ParseFromString(rec)
        except DecodeError as exc:
            raise TraceFormatError(path, "invalid ET", f"node #{len(nodes)}: {exc}") from None
        nodes.append(
            EtNode(
                id=int(msg.id), name=msg.name, type=int(msg.type), ctrl_deps=[int(d) for d in msg.ctrl_deps],
                data_deps=[int(d) for d in msg.data_deps], start_us=int(msg.start_time_micros),
                dur_us=int(msg.duration_micros), attrs={a.name: _attr_value(a) for a in msg.attr},
            )
        )  # fmt: skip
    return EtFile(path, meta.version, {a.name: _attr_value(a) for a in meta.attr}, nodes)


def _attr(name: str, value: Any) -> Any:
    if isinstance(value, bool):
        return schema.AttributeProto(name=name, bool_val=value)
    if isinstance(value, int):
        return schema.AttributeProto(name=name, int64_val=value)
    if isinstance(value, str):
        return schema.AttributeProto(name=name, string_val=value)
    raise TypeError(f"attribute {name}: {type(value).__name__} is not written (bool, int or str)")


def _framed(message: Any) -> bytes:
    body = message.SerializeToString()
    return _encode_varint(len(body)) + body


def _framed_meta(metadata: dict[str, Any]) -> bytes:
    return _framed(schema.GlobalMetadata(version=SCHEMA_VERSION, attr=[_attr(k, v) for k, v in metadata.items()]))


@lru_cache(maxsize=65536)
def _attr_field(name: str, kind: str, value: Any) -> bytes:
    """One ``attr`` entry of a Node as wire bytes: field 10, length-delimited (tag byte 0x52), the
    AttributeProto's bytes (``kind`` keys the cache: ``True == 1`` in Python)."""
    body = _attr(name, value).SerializeToString()
    return b"\x52" + _encode_varint(len(body)) + body


def node_head(n: EtNode) -> bytes:
    """The node's message without its ``attr`` entries (fields 1-7; :func:`_framed_node`)."""
    return schema.Node(
        id=n.id, name=n.name, type=n.type, ctrl_deps=n.ctrl_deps, data_deps=n.data_deps,
        start_time_micros=n.start_us, duration_micros=n.dur_us,
    ).SerializeToString()  # fmt: skip


def attr_field(name: str, value: Any) -> bytes:
    """One ``attr`` entry of a Node as wire bytes (:func:`_framed_node`)."""
    return _attr_field(name, type(value).__name__, value)


#: The varints of record lengths below 2**14 (two bytes at most), looked up rather than encoded.
_SHORT_VARINTS = [_encode_varint(i) for i in range(1 << 14)]


def length_prefix(size: int) -> bytes:
    """The base-128 varint of a record's length (the framing of the module docstring)."""
    return _SHORT_VARINTS[size] if size < 1 << 14 else _encode_varint(size)


def _framed_node(n: EtNode) -> bytes:
    """The node's record. ``attr`` (field 10) is the last field of ``Node``, and protobuf writes fields
    in number order, so the message without it followed by its entries is the message's serialization
    (``tests/unit/lib/chakra/test_chakra_schema.py`` checks the bytes); the entries repeat a lot
    (``is_cpu_op``, ``stream``, ``pg_name``) and are encoded once."""
    body = node_head(n) + b"".join([_attr_field(k, type(v).__name__, v) for k, v in n.attrs.items()])
    return _encode_varint(len(body)) + body


def encode_et(metadata: dict[str, Any], nodes: list[EtNode]) -> bytes:
    """The bytes of an ET file: the GlobalMetadata record (version :data:`SCHEMA_VERSION`,
    ``metadata`` as attributes) then ``nodes``, each preceded by its length (module docstring).

    Raises:
        TypeError: an attribute value is not a bool, int or str.
        ValueError: a node's id, times or dependencies are negative or beyond 64 bits (``uint64``).
    """
    return b"".join([_framed_meta(metadata), *(_framed_node(n) for n in nodes)])


class EtWriter:
    """Write one ET file node by node (the bytes of :func:`encode_et`), holding one node at a time:
    ``with EtWriter(path, metadata) as w: w.write(node)``. The file appears whole at ``path`` when the
    block ends without an exception (``lib/store/io.atomic_path``), else not at all.

    Raises:
        TypeError / ValueError: as :func:`encode_et`. OutputWriteError: the file cannot be written.
    """

    def __init__(self, path: str | Path, metadata: dict[str, Any]) -> None:
        self.path, self.metadata, self.nodes, self.bytes = Path(path), metadata, 0, 0

    def __enter__(self) -> EtWriter:
        from phantora_assets.lib.store.io import atomic_path

        self._ctx = atomic_path(self.path)
        self._fh = open(self._ctx.__enter__(), "wb", buffering=1 << 20)
        self._put(_framed_meta(self.metadata))
        return self

    def _put(self, data: bytes) -> None:
        self._fh.write(data)
        self.bytes += len(data)

    def write(self, node: EtNode) -> None:
        """Append ``node`` (its record, length-prefixed)."""
        self._put(_framed_node(node))
        self.nodes += 1

    def write_records(self, data: bytes, nodes: int) -> None:
        """Append ``nodes`` node records already framed (:func:`framed_node` bytes, joined)."""
        self._put(data)
        self.nodes += nodes

    def __exit__(self, *exc: Any) -> None:
        self._fh.close()
        self._ctx.__exit__(*exc)


def write_et(path: str | Path, metadata: dict[str, Any], nodes: list[EtNode]) -> int:
    """Write :func:`encode_et` to ``path`` atomically; returns the bytes written.

    Raises:
        OutputWriteError: the file cannot be written (``lib/store/io``).
    """
    data = encode_et(metadata, nodes)
    atomic_write_bytes(path, data)
    return len(data)


def et_files(folder: str | Path) -> dict[int, Path]:
    """The ``<prefix>.<rank>.et`` files directly in ``folder``, by rank (one prefix only).

    Raises:
        FileNotFoundError: ``folder`` is not a directory.
        FileRuleError: ``ET names`` (two prefixes; a rank twice, e.g. ``t.1.et`` and ``t.01.et``: a
            TraceFormatError), ``symlink in run folder``, ``not a regular file`` (a FIFO, a directory).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a directory")
    out: dict[int, Path] = {}
    prefixes: set[str] = set()
    for p in sorted(folder.iterdir()):
        stem, _, rank = p.name[: -len(".et")].rpartition(".") if p.name.endswith(".et") else ("", "", "")
        if not stem or not rank.isdigit() or p.name.startswith("."):
            continue
        if p.is_symlink():
            raise FileRuleError(p, "symlink in run folder", "the import does not follow links")
        if not p.is_file():  # a FIFO would block its reader; a directory is no ET
            raise FileRuleError(p, "not a regular file", "an ET must be a regular file")
        prefixes.add(stem)
        if int(rank) in out:
            raise TraceFormatError(p, "ET names", f"rank {int(rank)} again (also {out[int(rank)].name})")
        out[int(rank)] = p
    if len(prefixes) > 1:
        raise FileRuleError(folder, "ET names", f"one <prefix>.<rank>.et set per folder, found {sorted(prefixes)}")
    return dict(sorted(out.items()))
