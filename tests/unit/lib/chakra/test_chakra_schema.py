"""The project's own Chakra ET schema and framing (lib/chakra/schema.py, lib/chakra/et_io.py): the bytes
it writes, worked out by hand from et_def.proto's field numbers; ASTRA-sim's reference ETs rewritten
byte for byte; gzip-compressed files; cut, empty and non-ET files refused by rule; and no package
beyond protobuf's runtime (mlc-chakra is not imported)."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.paths import ROOT

from phantora_assets.lib.chakra.et_io import EtNode, encode_et, read_et
from phantora_assets.lib.errors import TraceFormatError

ASTRA = ROOT.parent / "shared" / "reference" / "traces" / "astra-sim" / "microbenchmarks"  # not in the repo

# GlobalMetadata{version "0.0.4" (field 1), attr (2) [AttributeProto{name "rank" (1), int64_val 1 (9)}]}
META = "11" + "0a05" + b"0.0.4".hex() + "1208" + "0a04" + b"rank".hex() + "4801"
# Node{id 1 (field 1), name "a" (2), type 7 (3), ctrl_deps [2, 3] (4, packed), start_time_micros 300 (6,
# varint ac 02), duration_micros 5 (7), attr (10) [AttributeProto{name "comm_size", int64_val 2**20
# (varint 80 80 40)}]}: 33 bytes
NODE = "21" + "0801" + "120161" + "1807" + "22020203" + "30ac02" + "3805" + "520f" + "0a09" + b"comm_size".hex()
NODE += "48808040"
HAND = EtNode(1, "a", 7, ctrl_deps=[2, 3], start_us=300, dur_us=5, attrs={"comm_size": 2**20})


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_the_bytes_follow_et_def_proto_field_by_field():
    assert encode_et({"rank": 1}, [HAND]).hex() == META + NODE


def test_the_streamed_writer_writes_the_bytes_protobuf_serializes(tmp_path):
    """EtWriter (node by node, attribute entries encoded once) against protobuf's own serialization of
    each whole message (``SerializeToString`` with every attribute): the same bytes, True kept apart
    from 1."""
    from phantora_assets.lib.chakra import schema
    from phantora_assets.lib.chakra.et_io import EtWriter, _attr, _framed

    nodes = [
        HAND,
        EtNode(2, "b", 5, data_deps=[1], attrs={"is_cpu_op": False, "comm_src": 0, "comm_dst": 1, "pg_name": "3"}),
        EtNode(3, "c", 4, ctrl_deps=[1, 2], dur_us=7, attrs={"is_cpu_op": True, "stream": 1, "flag": 1}),
        EtNode(4, "", 4),
    ]
    with EtWriter(tmp_path / "w.0.et", {"rank": 1}) as w:
        for n in nodes:
            w.write(n)
    whole = [
        schema.Node(id=n.id, name=n.name, type=n.type, ctrl_deps=n.ctrl_deps, data_deps=n.data_deps,
                    start_time_micros=n.start_us, duration_micros=n.dur_us,
                    attr=[_attr(k, v) for k, v in n.attrs.items()])
        for n in nodes
    ]  # fmt: skip
    assert (tmp_path / "w.0.et").read_bytes() == bytes.fromhex(META) + b"".join(_framed(m) for m in whole)
    assert read_et(tmp_path / "w.0.et").nodes == nodes


def test_the_hand_encoded_bytes_decode(tmp_path):
    et = read_et(_write(tmp_path / "t.0.et", bytes.fromhex(META + NODE)))
    assert (et.version, et.metadata, et.nodes) == ("0.0.4", {"rank": 1}, [HAND])


@pytest.mark.parametrize(("bench", "comm_type"), [("all_reduce", 0), ("all_gather", 2), ("all_to_all", 6)])
def test_astra_sim_reference_ets_are_rewritten_byte_for_byte(bench, comm_type):
    path = ASTRA / bench / "4npus_1MB" / f"{bench}.0.et"
    if not path.is_file():
        pytest.skip(
            "../shared/reference/traces/astra-sim/ is not here: ASTRA-sim's examples/workload/microbenchmarks/ "
            "(repository astra-sim/astra-sim) copied there"
        )
    node = EtNode(0, f"{bench}_4npus_1MB", 7, attrs={"is_cpu_op": False, "comm_type": comm_type, "comm_size": 2**20})
    assert encode_et({}, [node]) == path.read_bytes()


def test_a_gzip_compressed_et_decodes_the_same(tmp_path):
    data = encode_et({"rank": 1}, [HAND, EtNode(2, "k", 4, dur_us=7)])
    plain, packed = _write(tmp_path / "t.0.et", data), _write(tmp_path / "t.1.et", gzip.compress(data))
    a, b = read_et(plain), read_et(packed)
    assert (a.version, a.metadata, a.nodes) == (b.version, b.metadata, b.nodes) and len(b.nodes) == 2


def test_an_empty_node_record_is_a_node_not_the_end_of_the_file(tmp_path):
    # a node of all defaults serializes to 0 bytes; Chakra's protolib took its length 0 for the end of
    # the file and dropped every node after it
    nodes = [EtNode(0, "", 0), EtNode(5, "k", 4, dur_us=3)]
    et = read_et(_write(tmp_path / "t.0.et", encode_et({}, nodes)))
    assert et.nodes == nodes


@pytest.mark.parametrize(
    ("data", "detail"),
    [
        (b"", "no GlobalMetadata record (empty or not an ET)"),
        (bytes.fromhex(META + NODE)[:-1], "node #0 at byte 18: 33 bytes announced, 32 left (cut short)"),
        (bytes.fromhex(META + "80"), "node #0 at byte 18: the file ends inside a record's length"),
        (b"hello, world\n", "the GlobalMetadata record at byte 0: 104 bytes announced, 12 left (cut short)"),
        (gzip.compress(bytes.fromhex(META + NODE))[:-9], "gzip-compressed, but it does not decompress"),
        (bytes.fromhex("02" + "0aff"), "the GlobalMetadata record: Error parsing message"),
    ],
    ids=["empty", "cut node", "cut length", "text", "cut gzip", "bad message"],
)
def test_a_file_that_is_no_et_is_refused_by_rule(tmp_path, data, detail):
    path = _write(tmp_path / "t.0.et", data)
    with pytest.raises(TraceFormatError) as exc:
        read_et(path)
    assert (exc.value.path, exc.value.rule) == (str(path), "invalid ET") and detail in exc.value.detail


def test_only_the_protobuf_runtime_is_needed(tmp_path):
    # mlc-chakra (the `chakra` package) made unimportable: writing and reading still work
    code = (
        "import sys; sys.modules['chakra'] = None\n"
        "from phantora_assets.lib.chakra.et_io import EtNode, write_et, read_et\n"
        f"write_et({str(tmp_path / 't.0.et')!r}, {{'rank': 0}}, [EtNode(1, 'a', 7, attrs={{'comm_size': 8}})])\n"
        f"print(read_et({str(tmp_path / 't.0.et')!r}).nodes[0].attrs)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "{'comm_size': 8}"
