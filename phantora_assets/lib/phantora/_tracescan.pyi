"""Type stub of the compiled scanner ``_tracescan.c`` (see its header and ``trace_decode``)."""

#: ``scan``'s answer: ``n_events``; the 13 Communication columns ``ts``, ``dur`` (float64),
#: ``tid``, ``flow_id``, ``bytes``, ``count``, ``root`` (int64), ``name``, ``src``, ``dst``,
#: ``comm`` (int32 codes into the lists below), ``call``, ``dtype`` (int8 indices into
#: ``calls`` / ``dtypes``); the 3 Computation columns ``ts``, ``dur`` (float64), ``host`` (int32
#: code); each column the raw native-endian bytes of its array (a bytearray, so that numpy arrays
#: over it are writable); then the distinct ``names``, ``hosts`` and ``comms`` (communicator
#: object texts) in code order.
ScanResult = tuple[
    int,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    bytearray,
    list[bytes],
    list[bytes],
    list[bytes],
]

def scan(
    batch: bytes | bytearray | memoryview,
    calls: tuple[bytes, ...],
    dtypes: tuple[bytes, ...],
    /,
) -> ScanResult | None:
    """Columns of one batch (``[`` + elements + ``]``), or None when the scanner declines it.

    ``calls`` / ``dtypes``: the accepted NCCL call names and dtype names (at most 16 each), whose
    indices are the ``call`` / ``dtype`` codes. Raises TypeError when they are not tuples of
    bytes, ValueError when there are more than 16, MemoryError when out of memory.
    """
