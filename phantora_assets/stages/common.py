"""What the stages share (no Dagster import): the window and bin constants, memory release
between stages, JSON-safe metadata. What a stage returns is in :mod:`phantora_assets.outcomes`; its
Parquet writers in :mod:`phantora_assets.lib.store.parquet`.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa

from phantora_assets.lib.bins.width import DEFAULT_BIN_S

#: The 180 s window of the build (docs/DATASET.md, "How a trace becomes the dataset", step 4),
#: v1's 100 ms bins (the width of ``flows_100ms``; a run's own is ``RunSpec.bin_s``) and the
#: control traffic each node sends, bytes/s.

WINDOW_S = 180.0
BIN_S = DEFAULT_BIN_S
CONTROL_BYTES_PER_S = 5000


#: Resident size above which :func:`release_memory` returns freed memory to the system.
RELEASE_ABOVE_BYTES = 512 << 20


def release_memory(above: int = RELEASE_ABOVE_BYTES) -> None:
    """Give the memory a finished stage freed back to the system when the process holds more than
    ``above`` bytes: collect garbage, empty Arrow's pool (mimalloc keeps freed pages: ~400 MiB
    after the 128x8 Chrome trace) and trim the C heap (glibc keeps freed arenas), so the next stage
    of a run -- all of them run in one process -- starts from what is still in use, not from the
    last stage's peak. Below ``above`` nothing is done (the interpreter's own collections go on):
    returning the pages after every step of the 30 shipped runs doubled the build's page faults
    (~1.2 s of system time), and a full collection after each of their 264 steps cost 1.8 s of CPU."""
    if _resident_bytes() <= above:
        return
    gc.collect()
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc: nothing to trim
        pass


def _resident_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; where it cannot be read, a
    size above any threshold, so that memory is always released)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 1 << 62


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, (np.integer,)):
            v = int(v)
        elif isinstance(v, (np.floating,)):
            v = float(v)
        elif not isinstance(v, (int, float, str, bool)) and v is not None:
            v = json.dumps(v, default=str)[:2000]
        out[k] = v
    return out
