"""A run's binned flows as a dense matrix and as its ``flows_100ms.parquet`` table, in bounded memory.

The binned build (``lib/traffic/binning.py``) holds ``bytes[bin, pair]``, an int64 matrix of
``(n_bins, n_pairs)`` with the ordered pairs ``src != dst`` in ``(src, dst)`` order
(:func:`pair_nodes`): 8 bytes a row, where the ``BIN_COLUMNS`` table in pandas takes 40 (a 128-node
run has 29 M rows). :func:`write_bins` writes the table from the matrix :data:`CHUNK_BINS` bins at a
time (one Parquet row group each); :func:`read_bin_matrix` reads such a file (or any table with
``t, src_node, dst_node, bytes``) back into the matrix one row group at a time. No Dagster import.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from phantora_assets.lib.columns import BIN_COLUMNS
from phantora_assets.lib.store.io import atomic_path

#: The most cells (bins x ordered node pairs) of a run's dense per-pair bin table the binned stages
#: build (``lib/traffic/binning.build_bins``, ``lib/net/link_bins``, ``lib/traffic/window_features``,
#: the run's plots hold it as int64 matrices, a few at once): 2**26 = 67 M cells (512 MiB a matrix),
#: so that every per-run stage stays within 2 GiB peak RSS. Measured (benchmarks/pipeline_scale.py,
#: W4 on h100, docs/BENCHMARKS.md): 29 M cells (128 x 1) peak 916 MiB (run_plots), 118 M cells
#: (256 x 1) 3,132 MiB: ~25 B a cell. At 100 ms bins that is 193 nodes; a 1024-node run has 1.9 G
#: cells (14 GiB a matrix). ``$PHANTORA_ASSETS_MAX_BIN_CELLS`` sets another bound.
MAX_DENSE_CELLS = 1 << 26
MAX_CELLS_ENV = "PHANTORA_ASSETS_MAX_BIN_CELLS"

#: Bins per written row group (x n_pairs rows: 16 k pairs -> 1.6 M rows, ~70 MB of columns), at most
#: CHUNK_ROWS rows (at least one bin).
CHUNK_BINS = 100
CHUNK_ROWS = 4_000_000


def max_dense_cells() -> int:
    """:data:`MAX_DENSE_CELLS`, or ``$PHANTORA_ASSETS_MAX_BIN_CELLS`` when it is a positive integer."""
    raw = os.environ.get(MAX_CELLS_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else MAX_DENSE_CELLS


def dense_cells(n_nodes: int, window_s: float, bin_s: float) -> int:
    """Cells of a run's dense per-pair bin table: bins of the window x ordered node pairs."""
    n_bins = int(round(window_s * 1e9)) // int(round(bin_s * 1e9))
    return n_bins * n_nodes * (n_nodes - 1)


def dense_table_rule(n_nodes: int, window_s: float, bin_s: float) -> str | None:
    """Why a run of ``n_nodes`` nodes cannot have its per-pair bins built in bounded memory (its
    dense table has more than :func:`max_dense_cells` cells), or None. Checked before the run is
    simulated (``stages/simulation.raw_timeline``), so such a run fails at once, named, instead of
    being simulated and then dying on a ``(bins, pairs)`` matrix of many GiB."""
    cells, bound = dense_cells(n_nodes, window_s, bin_s), max_dense_cells()
    if cells <= bound:
        return None
    n_bins = cells // max(1, n_nodes * (n_nodes - 1))
    return (
        f"{n_bins} bins x {n_nodes * (n_nodes - 1):,} ordered node pairs = {cells:,} cells, more than the "
        f"{bound:,} the binned stages hold in bounded memory ({cells * 8 / 2**30:.1f} GiB a dense int64 matrix; "
        f"the per-pair bins are kept dense, every bin x every pair: docs/DATASET_STORAGE.md); use fewer nodes "
        f"(more GPUs per node) or a wider bin_s, or set ${MAX_CELLS_ENV} on a host with the memory"
    )


def pair_nodes(n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) int64 of the ordered pairs ``src != dst`` in ``(src, dst)`` order: the matrix columns."""
    src, dst = np.nonzero(~np.eye(n_nodes, dtype=bool))
    return src.astype(np.int64), dst.astype(np.int64)


def bin_times(n_bins: int, bin_s: float) -> np.ndarray:
    """``t`` (s) of bins ``0 .. n_bins - 1``: ``round(i * bin_ns / 1e9, 6)`` from integer ns."""
    bin_ns = int(round(float(bin_s) * 1_000_000_000))
    return np.round(np.arange(n_bins, dtype=np.int64) * bin_ns / 1_000_000_000, 6).astype(np.float64)


def bins_frame(matrix: np.ndarray, run_id: str, bin_s: float, n_nodes: int, first_bin: int = 0) -> pd.DataFrame:
    """``matrix`` (rows: bins ``first_bin ..``) as ``BIN_COLUMNS`` rows sorted by ``(t, src_node, dst_node)``."""
    n_bins, n_pairs = matrix.shape
    src, dst = pair_nodes(n_nodes) if n_pairs else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    t = bin_times(first_bin + n_bins, bin_s)[first_bin:]
    data = {
        "run_id": pd.Series([run_id] * (n_bins * n_pairs), dtype=object),
        "t": np.repeat(t, n_pairs),
        "src_node": np.tile(src, n_bins),
        "dst_node": np.tile(dst, n_bins),
        "bytes": matrix.reshape(-1),
    }
    return pd.DataFrame(data, columns=list(BIN_COLUMNS))


def write_bins(matrix: np.ndarray, run_id: str, bin_s: float, n_nodes: int, path: Path) -> None:
    """Write ``matrix`` as the ``BIN_COLUMNS`` table (zstd Parquet, every column dictionary-encoded; read
    back, the types ``write_parquet`` gives the same DataFrame), atomically, :data:`CHUNK_BINS` bins per
    row group. The file's metadata records the dense layout (``phantora_dense_pairs``: the node
    count), so that :func:`read_bin_matrix` reads only its ``bytes`` column back.

    Cost (7.26 M rows of a 64-node run: about 0.3 s of CPU, all of it Parquet's encoding): the run id
    is handed over as a dictionary array (one value; Parquet writes its indices without hashing a
    string a row, and keeps no statistics of it) and the node columns are tiled once. The file
    stores no Arrow schema, which would make readers return that dictionary type: every column
    reads back as its plain Parquet type (string, double, int64)."""
    n_bins, n_pairs = matrix.shape
    meta = {"phantora_dense_pairs": str(n_nodes), "phantora_bins": str(n_bins)}
    plain = [("t", pa.float64()), ("src_node", pa.int64()), ("dst_node", pa.int64()), ("bytes", pa.int64())]
    schema = pa.schema([("run_id", pa.dictionary(pa.int32(), pa.string())), *plain])
    src, dst = pair_nodes(n_nodes) if n_pairs else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    step = max(1, min(CHUNK_BINS, CHUNK_ROWS // max(n_pairs, 1)))
    k = min(step, n_bins) if n_pairs else 0  # the rows of a whole row group; a last, shorter one slices them
    ids, zeros = pa.array([run_id]), pa.array(np.zeros(k * n_pairs, dtype=np.int32))
    src_k, dst_k, times = pa.array(np.tile(src, k)), pa.array(np.tile(dst, k)), bin_times(n_bins, bin_s)
    stats = [c for c, _ in plain]
    with (
        atomic_path(path) as tmp,
        pq.ParquetWriter(tmp, schema, compression="zstd", store_schema=False, write_statistics=stats) as writer,
    ):
        for b0 in range(0, max(n_bins, 1) if n_pairs else 1, step):
            rows = (min(step, n_bins - b0) if n_pairs else 0) * n_pairs
            arrays = [
                pa.DictionaryArray.from_arrays(zeros[:rows], ids, safe=False),
                pa.array(np.repeat(times[b0 : b0 + step], n_pairs)),
                src_k[:rows],
                dst_k[:rows],
                pa.array(matrix[b0 : b0 + step].reshape(-1)),
            ]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
        writer.add_key_value_metadata(meta)


def read_bin_matrix(path: Path, bin_s: float, n_total: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """The ``(n_total, n_pairs)`` int64 matrix of a binned table, the mask of the bins present and
    the sorted ``(src, dst)`` pairs present, one row group at a time.

    Raises:
        ValueError: ``t`` off the bin grid or outside ``[0, n_total * bin_s)``.
    """
    pf = pq.ParquetFile(path)
    groups = range(pf.metadata.num_row_groups)
    meta = pf.schema_arrow.metadata or {}
    n_nodes = int(meta.get(b"phantora_dense_pairs", 0))
    if n_nodes > 1 and int(meta[b"phantora_bins"]) == n_total:  # written by write_bins: every bin, every pair
        src, dst = pair_nodes(n_nodes)
        flat = pf.read(columns=["bytes"]).column("bytes").to_numpy()
        pairs = [(int(a), int(b)) for a, b in zip(src, dst)]
        return flat.reshape(n_total, len(pairs)), np.ones(n_total, dtype=bool), pairs
    keys = [pf.read_row_group(g, columns=["src_node", "dst_node"]) for g in groups]
    src = np.concatenate([k.column("src_node").to_numpy() for k in keys] or [np.zeros(0, np.int64)])
    dst = np.concatenate([k.column("dst_node").to_numpy() for k in keys] or [np.zeros(0, np.int64)])
    del keys
    width = 1 + int(max(dst.max(initial=0), src.max(initial=0)))
    code = src * width + dst
    del src, dst
    if width * width <= 64 * 2**20:  # pairs by a count table: no sort of the rows
        lut = np.cumsum(np.bincount(code, minlength=width * width) > 0) - 1
        uniq = np.flatnonzero(np.bincount(code, minlength=width * width))
        pidx = lut[code]
    else:
        uniq, pidx = np.unique(code, return_inverse=True)
    del code
    n_pairs = len(uniq)
    flat = np.zeros(n_total * n_pairs, dtype=np.int64)
    present = np.zeros(n_total, dtype=bool)
    a = 0
    for g in groups:
        rg = pf.read_row_group(g, columns=["t", "bytes"])
        ratio = rg.column("t").to_numpy() / bin_s
        idx = np.rint(ratio).astype(np.int64)
        if len(idx) and (np.abs(ratio - idx) > 1e-6).any():
            raise ValueError("bins has t values off the bin grid")
        if len(idx) and ((idx < 0) | (idx >= n_total)).any():
            raise ValueError(f"bins has t outside [0, {n_total * bin_s:g}) s")
        f = idx * n_pairs + pidx[a : a + len(idx)]
        vals = rg.column("bytes").to_numpy()
        lo = int(f.min(initial=0))
        if len(f) and np.bincount(f - lo).max() <= 1:  # no (bin, pair) twice: a plain indexed add
            flat[f] += vals
        else:
            np.add.at(flat, f, vals)
        present[idx] = True
        a += len(idx)
    return flat.reshape(n_total, n_pairs), present, [(int(u // width), int(u % width)) for u in uniq]
