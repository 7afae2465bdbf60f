"""Read and write Chakra execution traces (``*.<rank>.et``) with the ``mlc-chakra`` package.

The schema is the package's generated ``chakra.schema.protobuf.et_def_pb2`` (``et_def.proto``:
``GlobalMetadata``, ``Node``, ``AttributeProto``, the ``NodeType`` and ``CollectiveCommType``
enums) and the framing its ``chakra.src.third_party.utils.protolib`` (each message preceded by its
length as a varint; ``openFileRd`` also reads a gzip-compressed file). Nothing of it is vendored or
regenerated here: ``pip install --no-deps mlc-chakra`` next to ``protobuf >= 6.31.1, < 7`` (the
``chakra`` extra of pyproject.toml pins both). A file is one ``GlobalMetadata`` record, then nodes
until the end of the file (ASTRA-sim's ET feeder reads the same layout).

:func:`read_et` is the one decoding path: this project's exports, ASTRA-sim's microbenchmark ETs
and the output of Chakra's own PyTorch converter all go through it (``tests/test_chakra.py``).
No Dagster import.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phantora_assets.lib.errors import FileRuleError, TraceFormatError
from phantora_assets.lib.store.io import atomic_write_bytes

#: The schema version written into the metadata record (the version ASTRA-sim's examples carry).
SCHEMA_VERSION = "0.0.4"
INSTALL_HINT = 'pip install --no-deps mlc-chakra==1.0.0 "protobuf>=6.31.1,<7" (or pip install -e ".[chakra]")'

#: ``CollectiveCommType`` value -> the op name of this project's tables (``lib/traffic/ring.py``,
#: and ``all_to_all``). The values are those of ``et_def.proto``.
COMM_TYPE_OPS: dict[int, str] = {0: "all_reduce", 2: "all_gather", 5: "broadcast", 6: "all_to_all", 7: "reduce_scatter"}
OP_COMM_TYPES: dict[str, int] = {v: k for k, v in COMM_TYPE_OPS.items()}
#: ``NodeType`` values (``et_def.proto``).
COMP_NODE, COMM_SEND_NODE, COMM_RECV_NODE, COMM_COLL_NODE = 4, 5, 6, 7


def chakra_modules() -> tuple[Any, Any]:
    """``(et_def_pb2, protolib)`` of the installed ``mlc-chakra`` package.

    Raises:
        ImportError: the package (or a protobuf runtime it accepts) is not installed; the message
            says how to install it.
    """
    try:
        from chakra.schema.protobuf import et_def_pb2
        from chakra.src.third_party.utils import protolib
    except ImportError as exc:  # also protobuf's runtime-version check (a VersionError is an ImportError)
        raise ImportError(f"Chakra ETs need the mlc-chakra package: {INSTALL_HINT} ({exc})") from exc
    return et_def_pb2, protolib


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


def read_et(path: str | Path) -> EtFile:
    """Decode one ET file with Chakra's reader (``protolib.openFileRd`` and ``decodeMessage``).

    Returns:
        the metadata record's version and attributes, and every node in file order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        TraceFormatError: rule ``invalid ET``: no GlobalMetadata record could be decoded, or a
            node's bytes are not a Node message (names the file and the node's position).
        ImportError: ``mlc-chakra`` is not installed (:func:`chakra_modules`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such Chakra ET file")
    pb, protolib = chakra_modules()
    from google.protobuf.message import DecodeError

    fh = protolib.openFileRd(str(path))
    try:
        meta = pb.GlobalMetadata()
        try:
            ok = protolib.decodeMessage(fh, meta)
        except (DecodeError, OSError, EOFError) as exc:
            raise TraceFormatError(path, "invalid ET", f"the GlobalMetadata record: {exc}") from None
        if not ok:
            raise TraceFormatError(path, "invalid ET", "no GlobalMetadata record (empty or not an ET)")
        nodes: list[EtNode] = []
        msg = pb.Node()
        while True:
            try:
                if not protolib.decodeMessage(fh, msg):
                    break
            except (DecodeError, OSError, EOFError) as exc:
                raise TraceFormatError(path, "invalid ET", f"node #{len(nodes)}: {exc}") from None
            nodes.append(
                EtNode(
                    id=int(msg.id), name=msg.name, type=int(msg.type), ctrl_deps=[int(d) for d in msg.ctrl_deps],
                    data_deps=[int(d) for d in msg.data_deps], start_us=int(msg.start_time_micros),
                    dur_us=int(msg.duration_micros), attrs={a.name: _attr_value(a) for a in msg.attr},
                )
            )  # fmt: skip
    finally:
        fh.close()
    return EtFile(path, meta.version, {a.name: _attr_value(a) for a in meta.attr}, nodes)


def _attr(pb: Any, name: str, value: Any) -> Any:
    if isinstance(value, bool):
        return pb.AttributeProto(name=name, bool_val=value)
    if isinstance(value, int):
        return pb.AttributeProto(name=name, int64_val=value)
    if isinstance(value, str):
        return pb.AttributeProto(name=name, string_val=value)
    raise TypeError(f"attribute {name}: {type(value).__name__} is not written (bool, int or str)")


def encode_et(metadata: dict[str, Any], nodes: list[EtNode]) -> bytes:
    """The bytes of an ET file: the GlobalMetadata record (version :data:`SCHEMA_VERSION`,
    ``metadata`` as attributes) then ``nodes``, each framed by ``protolib.encodeMessage``.

    Raises:
        TypeError: an attribute value is not a bool, int or str.
        ImportError: ``mlc-chakra`` is not installed.
    """
    pb, protolib = chakra_modules()
    buf = io.BytesIO()
    meta = pb.GlobalMetadata(version=SCHEMA_VERSION, attr=[_attr(pb, k, v) for k, v in metadata.items()])
    protolib.encodeMessage(buf, meta)
    for n in nodes:
        msg = pb.Node(
            id=n.id, name=n.name, type=n.type, ctrl_deps=n.ctrl_deps, data_deps=n.data_deps,
            start_time_micros=n.start_us, duration_micros=n.dur_us, attr=[_attr(pb, k, v) for k, v in n.attrs.items()],
        )  # fmt: skip
        protolib.encodeMessage(buf, msg)
    return buf.getvalue()


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
