"""A run's binned flows as a dense matrix or as its sparse rows, and as its ``flows_100ms.parquet`` table,
in bounded memory.

Dense (a run whose table has at most :func:`max_dense_cells` cells, every shipped run): the binned build
(``lib/traffic/binning.py``) holds ``bytes[bin, pair]``, an int64 matrix of ``(n_bins, n_pairs)`` with the
ordered pairs ``src != dst`` in ``(src, dst)`` order (:func:`pair_nodes`): 8 bytes a row, where the
``BIN_COLUMNS`` table in pandas takes 40 (a 128-node run has 29 M rows). :func:`write_bins` writes the
table from the matrix :data:`CHUNK_BINS` bins at a time (one Parquet row group each); :func:`read_bin_matrix`
reads such a file (or any table with ``t, src_node, dst_node, bytes``) back into the matrix one row group
at a time.

Sparse (a run above that bound): :class:`SparseBins`, the ``(bin, pair, bytes)`` rows that carry flow
bytes; every row it omits holds only its pair's control traffic, a closed form of the build
(:data:`OMITTED_ROWS`; a sparse table without control traffic would not be small, since every node sends
control bytes to up to 500 others in every 100 ms bin). :func:`write_sparse_bins` / :func:`read_sparse_bins`
store it with metadata that says so, :func:`densify` gives the dense matrix back. No Dagster import.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from phantora_assets.lib.columns import BIN_COLUMNS
from phantora_assets.lib.store.io import atomic_path

#: The most cells (bins x ordered node pairs) of a run's DENSE per-pair bin table the binned stages
#: build (``lib/traffic/binning.build_bins``, ``lib/traffic/window_features``, the run's plots hold it as
#: int64 matrices, a few at once): 2**26 = 67 M cells (512 MiB a matrix), so that every per-run stage
#: stays within 2 GiB peak RSS. Measured (benchmarks/pipeline_scale.py, W4 on h100, docs/BENCHMARKS.md):
#: 29 M cells (128 x 1) peak 916 MiB (run_plots), 118 M cells (256 x 1) 3,132 MiB: ~25 B a cell. At
#: 100 ms bins that is 193 nodes. A run above it is built and stored SPARSE (:func:`is_sparse`,
#: :class:`SparseBins`: only the rows that carry flow bytes, :data:`OMITTED_ROWS`), never as this matrix.
#: ``$PHANTORA_ASSETS_MAX_BIN_CELLS`` sets another bound.
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


#: The most rows (bin, pair) of a run's SPARSE per-pair bin table (:class:`SparseBins`, for a run whose dense
#: table exceeds :func:`max_dense_cells`): 2**25 = 33.5 M rows, 24 B a row as three int64 columns in
#: memory (800 MiB), a few such arrays alive in the window features. ``$PHANTORA_ASSETS_MAX_SPARSE_ROWS``
#: sets another bound. A sparse table has at most bins x the pairs that carry flows (:func:`sparse_rows_rule`).
MAX_SPARSE_ROWS = 1 << 25
MAX_SPARSE_ROWS_ENV = "PHANTORA_ASSETS_MAX_SPARSE_ROWS"
#: Parquet key-value metadata of a sparse ``flows_100ms`` file (:func:`write_sparse_bins`): the node count.
SPARSE_META = b"phantora_sparse_pairs"
#: Parquet key-value metadata of a dense ``flows_100ms`` file (:func:`write_bins`): the node count.
DENSE_META = b"phantora_dense_pairs"
#: What a sparse table leaves out, in its metadata (``phantora_omitted_rows``) and the docs.
OMITTED_ROWS = (
    "control-only rows: a (bin, pair) row that carries no flow bytes is left out; its bytes are the pair's "
    "control traffic in the bin (binning.control_matrix at 100 ms, counted at the run's width by "
    "lib/bins/width.control_bins; 0 for a pair with none); bin_table.densify restores them"
)


def max_sparse_rows() -> int:
    """:data:`MAX_SPARSE_ROWS`, or ``$PHANTORA_ASSETS_MAX_SPARSE_ROWS`` when it is a positive integer."""
    raw = os.environ.get(MAX_SPARSE_ROWS_ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else MAX_SPARSE_ROWS


def is_sparse(n_nodes: int, window_s: float, bin_s: float) -> bool:
    """True when a run's per-pair bins are built and stored sparse: its dense table would exceed
    :func:`max_dense_cells` (below the bound the table stays dense, every bin x every pair, as v1)."""
    return dense_cells(n_nodes, window_s, bin_s) > max_dense_cells()


def sparse_rows_rule(n_bins: int, n_flow_pairs: int) -> str | None:
    """Why a sparse table of ``n_bins`` bins over ``n_flow_pairs`` node pairs that carry flows cannot be
    held in bounded memory (its rows can number ``n_bins x n_flow_pairs``, more than
    :func:`max_sparse_rows`), or None. Checked from the step's flows before the bins are built
    (``stages/flows.bin_flows``)."""
    rows, bound = n_bins * n_flow_pairs, max_sparse_rows()
    if rows <= bound:
        return None
    return (
        f"{n_bins} bins x {n_flow_pairs:,} node pairs that carry flows = up to {rows:,} rows of the sparse per-pair "
        f"table, more than the {bound:,} the binned stages hold in bounded memory (docs/DATASET_STORAGE.md); use a "
        f"wider bin_s, or set ${MAX_SPARSE_ROWS_ENV} on a host with the memory (24 B a row)"
    )


def pair_index(src: np.ndarray, dst: np.ndarray, n_nodes: int) -> np.ndarray:
    """Column of each ordered pair ``src != dst`` in the dense ``(src, dst)`` order (:func:`pair_nodes`)."""
    return src * (n_nodes - 1) + np.where(dst < src, dst, dst - 1)


def pair_of(index: np.ndarray, n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(src, dst)`` of dense pair columns ``index`` (the inverse of :func:`pair_index`)."""
    src, rest = np.divmod(np.asarray(index, dtype=np.int64), max(n_nodes - 1, 1))
    return src, np.where(rest < src, rest, rest + 1)


def control_per_split(n_nodes: int, control_bytes_per_s: float) -> np.ndarray:
    """int64 ``(n_pairs,)``: each ordered pair's control bytes per 100 ms, in dense pair order
    (``binning.control_matrix`` off the diagonal)."""
    from phantora_assets.lib.bins.width import CONTROL_SPLIT_NS
    from phantora_assets.lib.traffic.binning import control_matrix  # binning imports this module

    if n_nodes < 2:
        return np.zeros(0, dtype=np.int64)
    m = control_matrix(n_nodes, control_bytes_per_s, CONTROL_SPLIT_NS / 1e9)
    return m[~np.eye(n_nodes, dtype=bool)]


def control_at(per_split: np.ndarray, bins: np.ndarray, bin_ns: int, width: int = 1) -> np.ndarray:
    """Control bytes of pairs sending ``per_split`` bytes per 100 ms in the spans of ``width`` bins
    starting at bin ``bins`` (arrays of one length): ``floor(c * e1 / 100 ms) - floor(c * e0 / 100 ms)``,
    the cumulative count of ``lib/bins/width.control_bins`` at the span's ends (a span of bins holds the sum
    of its bins' control, exactly)."""
    from phantora_assets.lib.bins.width import CONTROL_SPLIT_NS

    c = np.asarray(per_split, dtype=np.int64)
    e0 = np.asarray(bins, dtype=np.int64) * bin_ns
    return (c * (e0 + width * bin_ns)) // CONTROL_SPLIT_NS - (c * e0) // CONTROL_SPLIT_NS


@dataclass(frozen=True)
class SparseBins:
    """A run's per-pair bins without the rows that carry no flow bytes (:data:`OMITTED_ROWS`).

    Attributes:
        bin_idx: int64 ``(rows,)`` bin of each row (bin ``i`` starts at ``i * bin_s``).
        pair: int64 ``(rows,)`` dense pair column of each row (:func:`pair_index`); rows sorted by
            ``(bin_idx, pair)``, i.e. by ``(t, src_node, dst_node)``, each (bin, pair) at most once.
        bytes: int64 ``(rows,)`` bytes of the row: its flow bytes (> 0) plus its control bytes, the
            value of the dense table's cell.
        n_bins, n_nodes, bin_s: the table's bins, nodes and width (s).
        control_bytes_per_s: each node's control traffic (bytes/s) of the build: the omitted rows' rule.
    """

    bin_idx: np.ndarray
    pair: np.ndarray
    bytes: np.ndarray
    n_bins: int
    n_nodes: int
    bin_s: float
    control_bytes_per_s: float

    @property
    def n_pairs(self) -> int:
        return self.n_nodes * (self.n_nodes - 1)

    def per_split(self) -> np.ndarray:
        """Each pair's control bytes per 100 ms (:func:`control_per_split`)."""
        return control_per_split(self.n_nodes, self.control_bytes_per_s)

    def row_control(self, per_split: np.ndarray | None = None) -> np.ndarray:
        """int64 ``(rows,)``: the control bytes inside each row's bytes."""
        c = self.per_split() if per_split is None else per_split
        return control_at(c[self.pair], self.bin_idx, int(round(self.bin_s * 1e9)))

    def control_total(self) -> int:
        """Control bytes of the whole dense table (every bin x every pair), a Python int."""
        c = self.per_split()
        vals, counts = np.unique(c, return_counts=True)
        span = control_at(vals, np.zeros(len(vals), np.int64), int(round(self.bin_s * 1e9)), self.n_bins)
        return sum(int(a) * int(b) for a, b in zip(span.tolist(), counts.tolist()))


def densify(sparse: SparseBins) -> np.ndarray:
    """The dense int64 ``(n_bins, n_pairs)`` matrix of a sparse table (:func:`write_bins`' input): every
    omitted row filled with its control bytes (:data:`OMITTED_ROWS`). The v1 form of a sparse run, for
    runs small enough to hold it (``n_bins x n_pairs x 8`` bytes).

    Raises:
        ValueError: the dense matrix would exceed ``$PHANTORA_ASSETS_MAX_BIN_CELLS`` (names the sizes).
    """
    from phantora_assets.lib.bins.width import control_bins

    cells = sparse.n_bins * sparse.n_pairs
    if cells > max_dense_cells():
        raise ValueError(
            f"densify: {sparse.n_bins} bins x {sparse.n_pairs:,} pairs = {cells:,} cells, more than the "
            f"{max_dense_cells():,} of ${MAX_CELLS_ENV}"
        )
    out = np.zeros((sparse.n_bins, sparse.n_pairs), dtype=np.int64)
    if sparse.n_pairs:
        ctrl = control_bins(sparse.per_split(), int(round(sparse.bin_s * 1e9)), sparse.n_bins)
        out += ctrl  # (n_pairs,) broadcast, or (n_bins, n_pairs)
    out[sparse.bin_idx, sparse.pair] = sparse.bytes
    return out


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
    the sorted ``(src, dst)`` pairs present, one row group at a time. A sparse file
    (:func:`write_sparse_bins`) is read densified (:func:`densify`: every pair, omitted rows filled).

    Raises:
        ValueError: ``t`` off the bin grid or outside ``[0, n_total * bin_s)``.
    """
    pf = pq.ParquetFile(path)
    groups = range(pf.metadata.num_row_groups)
    meta = pf.schema_arrow.metadata or {}
    if SPARSE_META in meta:  # its omitted rows are not zeros: the dense form (every pair) of the run
        dense = densify(read_sparse_bins(path, bin_s, n_total))
        src, dst = pair_nodes(int(meta[SPARSE_META]))
        return dense, np.ones(n_total, dtype=bool), [(int(a), int(b)) for a, b in zip(src, dst)]
    n_nodes = int(meta.get(DENSE_META, 0))
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


def write_sparse_bins(sparse: SparseBins, run_id: str, path: Path) -> None:
    """Write ``sparse``'s rows as the ``BIN_COLUMNS`` table (:func:`write_bins`' schema, encoding and types),
    atomically, :data:`CHUNK_ROWS` rows per row group, in ``(t, src_node, dst_node)`` order. Its metadata
    says so: ``phantora_sparse_pairs`` (the node count), ``phantora_bins``, ``phantora_bin_s``,
    ``phantora_control_bytes_per_s`` and ``phantora_omitted_rows`` (:data:`OMITTED_ROWS`); no
    ``phantora_dense_pairs``."""
    meta = {
        SPARSE_META.decode(): str(sparse.n_nodes),
        "phantora_bins": str(sparse.n_bins),
        "phantora_bin_s": repr(float(sparse.bin_s)),
        "phantora_control_bytes_per_s": repr(float(sparse.control_bytes_per_s)),
        "phantora_omitted_rows": OMITTED_ROWS,
    }
    plain = [("t", pa.float64()), ("src_node", pa.int64()), ("dst_node", pa.int64()), ("bytes", pa.int64())]
    schema = pa.schema([("run_id", pa.dictionary(pa.int32(), pa.string())), *plain])
    times, ids = bin_times(sparse.n_bins, sparse.bin_s), pa.array([run_id])
    n = len(sparse.bytes)
    with (
        atomic_path(path) as tmp,
        pq.ParquetWriter(
            tmp, schema, compression="zstd", store_schema=False, write_statistics=[c for c, _ in plain]
        ) as writer,
    ):
        for r0 in range(0, max(n, 1), CHUNK_ROWS):
            sl = slice(r0, min(n, r0 + CHUNK_ROWS))
            src, dst = pair_of(sparse.pair[sl], sparse.n_nodes)
            rows = len(src)
            arrays = [
                pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, dtype=np.int32)), ids, safe=False),
                pa.array(times[sparse.bin_idx[sl]]),
                pa.array(src),
                pa.array(dst),
                pa.array(sparse.bytes[sl]),
            ]
            writer.write_table(pa.Table.from_arrays(arrays, schema=schema))
        writer.add_key_value_metadata(meta)


def is_sparse_file(path: Path) -> bool:
    """True when ``path`` is a sparse table (:func:`write_sparse_bins`' metadata)."""
    return SPARSE_META in (pq.ParquetFile(path).schema_arrow.metadata or {})


def read_sparse_bins(path: Path, bin_s: float, n_total: int) -> SparseBins:
    """The :class:`SparseBins` of a file :func:`write_sparse_bins` wrote.

    Raises:
        ValueError: no sparse metadata, another bin count or width than ``n_total`` / ``bin_s``, or
            ``t`` off the bin grid.
    """
    pf = pq.ParquetFile(path)
    meta = pf.schema_arrow.metadata or {}
    if SPARSE_META not in meta:
        raise ValueError(f"{path}: not a sparse bin table (no {SPARSE_META.decode()} metadata)")
    n_nodes, n_bins = int(meta[SPARSE_META]), int(meta[b"phantora_bins"])
    if n_bins != n_total or abs(float(meta[b"phantora_bin_s"]) - bin_s) > 1e-12:
        raise ValueError(
            f"{path}: {n_bins} bins of {meta[b'phantora_bin_s'].decode()} s, expected {n_total} of {bin_s}"
        )
    table = pf.read(columns=["t", "src_node", "dst_node", "bytes"])
    ratio = table.column("t").to_numpy() / bin_s
    idx = np.rint(ratio).astype(np.int64)
    if len(idx) and (np.abs(ratio - idx) > 1e-6).any():
        raise ValueError(f"{path}: t values off the bin grid")
    del ratio
    pair = pair_index(table.column("src_node").to_numpy(), table.column("dst_node").to_numpy(), n_nodes)
    return SparseBins(
        idx,
        pair,
        table.column("bytes").to_numpy(),
        n_bins,
        n_nodes,
        bin_s,
        float(meta[b"phantora_control_bytes_per_s"]),
    )


def read_bins(
    path: Path, bin_s: float, n_total: int
) -> SparseBins | tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """A run's ``flows_100ms`` file as the binned stages read it: :class:`SparseBins` for a sparse file,
    else :func:`read_bin_matrix`'s ``(matrix, present, pairs)``."""
    if is_sparse_file(path):
        return read_sparse_bins(path, bin_s, n_total)
    return read_bin_matrix(path, bin_s, n_total)
