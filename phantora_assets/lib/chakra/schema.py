"""The message classes of Chakra's execution-trace schema, built at import from a description in Python.

Chakra's schema is MLCommons' ``et_def.proto`` (proto3, package ``ChakraProtoMsg``): ``GlobalMetadata``
(``version`` 1, ``attr`` 2), ``Node`` (``id`` 1, ``name`` 2, ``type`` 3, ``ctrl_deps`` 4, ``data_deps``
5, ``start_time_micros`` 6, ``duration_micros`` 7, ``inputs`` 8, ``outputs`` 9, ``attr`` 10),
``IOInfo``, ``Tensor``, ``AttributeProto`` (``name`` 1, ``doc_string`` 2 and the ``value`` oneof:
``<kind>_val`` = 3 + 2i and ``<kind>_list`` = 4 + 2i for the i-th of the 15 scalar kinds in
:data:`ATTRIBUTE_KINDS`, each list a ``<Kind>List`` message of ``repeated <kind> values = 1``), and the
``NodeType`` and ``CollectiveCommType`` enums. The names, field numbers and types below are those of
that file; the wire format follows from them alone, so ETs written by Chakra's own tools, ASTRA-sim's
examples and this project decode the same (``tests/unit/lib/chakra/test_chakra_schema.py`` pins the bytes).

Only the ``protobuf`` runtime is needed (``descriptor_pb2`` to describe the file, ``message_factory``
to make the classes); the classes live in a private descriptor pool, so they do not clash with another
copy of the schema (``mlc-chakra``'s generated module) loaded in the same process. No Dagster import.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "ChakraProtoMsg"

#: The scalar kinds of ``AttributeProto``'s oneof, in field-number order (``<kind>_val`` is field
#: 3 + 2i, ``<kind>_list`` field 4 + 2i).
ATTRIBUTE_KINDS: tuple[str, ...] = (
    "double", "float", "int32", "int64", "uint32", "uint64", "sint32", "sint64",
    "fixed32", "fixed64", "sfixed32", "sfixed64", "bool", "string", "bytes",
)  # fmt: skip

#: ``NodeType`` and ``CollectiveCommType`` of ``et_def.proto``: name -> value.
NODE_TYPES: dict[str, int] = {
    "INVALID_NODE": 0, "METADATA_NODE": 1, "MEM_LOAD_NODE": 2, "MEM_STORE_NODE": 3, "COMP_NODE": 4,
    "COMM_SEND_NODE": 5, "COMM_RECV_NODE": 6, "COMM_COLL_NODE": 7,
}  # fmt: skip
COLLECTIVE_COMM_TYPES: dict[str, int] = {
    "ALL_REDUCE": 0, "REDUCE": 1, "ALL_GATHER": 2, "GATHER": 3, "SCATTER": 4, "BROADCAST": 5,
    "ALL_TO_ALL": 6, "REDUCE_SCATTER": 7, "REDUCE_SCATTER_BLOCK": 8, "BARRIER": 9,
}  # fmt: skip

_LIST = {kind: f"{kind.capitalize()}List" for kind in ATTRIBUTE_KINDS}  # int64 -> Int64List
_VALUES = [
    f for i, k in enumerate(ATTRIBUTE_KINDS) for f in ((f"{k}_val", 3 + 2 * i, k), (f"{k}_list", 4 + 2 * i, _LIST[k]))
]
#: The messages of ``et_def.proto`` in its order: name -> [(field, number, "[repeated ]<type>")], a type
#: being a scalar kind, a message or an enum of the file; ``AttributeProto``'s fields from 3 on are
#: its oneof ``value``.
MESSAGES: dict[str, list[tuple[str, int, str]]] = {
    "AttributeProto": [("name", 1, "string"), ("doc_string", 2, "string")] + _VALUES,
    **{_LIST[k]: [("values", 1, f"repeated {k}")] for k in ATTRIBUTE_KINDS},
    "GlobalMetadata": [("version", 1, "string"), ("attr", 2, "repeated AttributeProto")],
    "Node": [
        ("id", 1, "uint64"), ("name", 2, "string"), ("type", 3, "NodeType"),
        ("ctrl_deps", 4, "repeated uint64"), ("data_deps", 5, "repeated uint64"),
        ("start_time_micros", 6, "uint64"), ("duration_micros", 7, "uint64"),
        ("inputs", 8, "IOInfo"), ("outputs", 9, "IOInfo"), ("attr", 10, "repeated AttributeProto"),
    ],
    "IOInfo": [("values", 1, "string"), ("shapes", 2, "string"), ("types", 3, "string")],
    "Tensor": [
        ("tensor_id", 1, "uint64"), ("storage_id", 2, "uint64"), ("offset", 3, "uint64"),
        ("num_elem", 4, "uint64"), ("elem_bytes", 5, "uint64"), ("device", 6, "string"),
    ],
}  # fmt: skip
ENUMS = {"NodeType": NODE_TYPES, "CollectiveCommType": COLLECTIVE_COMM_TYPES}
_ONEOF = ("AttributeProto", "value", 3)  # message, oneof name, first field number in it


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """``et_def.proto`` as a ``FileDescriptorProto`` (:data:`MESSAGES`, :data:`ENUMS`)."""
    fdp = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="phantora_assets/chakra/et_def.proto", package=PACKAGE)
    file.syntax = "proto3"
    for enum_name, values in ENUMS.items():
        enum = file.enum_type.add(name=enum_name)
        for value_name, number in values.items():
            enum.value.add(name=value_name, number=number)
    for msg_name, fields in MESSAGES.items():
        msg = file.message_type.add(name=msg_name)
        if msg_name == _ONEOF[0]:
            msg.oneof_decl.add(name=_ONEOF[1])
        for field_name, number, spec in fields:
            repeated, _, type_name = spec.rpartition(" ")
            f = msg.field.add(name=field_name, number=number)
            f.label = fdp.LABEL_REPEATED if repeated else fdp.LABEL_OPTIONAL
            if type_name in ATTRIBUTE_KINDS:
                f.type = getattr(fdp, f"TYPE_{type_name.upper()}")
            else:
                f.type = fdp.TYPE_ENUM if type_name in ENUMS else fdp.TYPE_MESSAGE
                f.type_name = f".{PACKAGE}.{type_name}"
            if msg_name == _ONEOF[0] and number >= _ONEOF[2]:
                f.oneof_index = 0
    return file


def _classes() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_descriptor())
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{n}")) for n in MESSAGES}


_CLASSES = _classes()
#: The message classes (protobuf ``Message`` subclasses) of the schema.
GlobalMetadata: Any = _CLASSES["GlobalMetadata"]
Node: Any = _CLASSES["Node"]
AttributeProto: Any = _CLASSES["AttributeProto"]
