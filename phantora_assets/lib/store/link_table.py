"""A run's link bins on disk: the ``(bins, links)`` byte matrix -> ``link_bins.parquet`` a row group at a
time, and the busiest link of each class per bin read back a row group at a time (issue 37 item 5).

The file holds the ``LINK_BIN_COLUMNS`` rows of ``lib/net/link_bins.py``, dense over links (every bin x
every directed link, zeros included, sorted by ``(t, link_id)``): links grow linearly with the hosts
(2 per host plus the fabric's), so a 2,048-host leaf-spine holds 1800 x 8192 = 14.7 M rows, 118 MB as
the matrix. What does not fit is that many rows as one pandas table with five string columns (about
260 B a row at build and write: 4.3 GiB peak at 2,048 hosts, docs/BENCHMARKS.md), so neither side
makes one:

* :func:`write_link_bins` writes :data:`CHUNK_ROWS` rows a row group (whole bins; a run of at most
  :data:`CHUNK_ROWS` rows is one row group). Its string columns are handed to Parquet as dictionary
  arrays (codes into the run's links, tiled once), and the file stores no Arrow schema, so every column
  reads back as its plain Parquet type (string, double, int64): the same DataFrame ``pd.read_parquet``
  gave before, and the same DuckDB view (``stages/links.link_bins_table``).
* :func:`class_peaks` reads the columns the utilisation plot needs a row group at a time, the class
  column as its dictionary codes: memory is one row group, not the table.

No Dagster import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from phantora_assets.lib.store.io import atomic_path

#: Rows at most in one row group of ``link_bins.parquet`` (whole bins; at least one bin).
CHUNK_ROWS = 1 << 20

_STRINGS = ("run_id", "link_class", "src", "dst", "routes")
_NUMBERS = (("t", pa.float64()), ("bin_s", pa.float64()), ("link_id", pa.int64()), ("bytes", pa.int64()))


def _schema() -> pa.Schema:
    dict_str = pa.dictionary(pa.int32(), pa.string())
    types = {**dict.fromkeys(_STRINGS, dict_str), **dict(_NUMBERS), "capacity_bps": pa.float64()}
    order = ("run_id", "t", "bin_s", "link_id", "link_class", "src", "dst", "bytes", "capacity_bps", "routes")
    return pa.schema([(c, types[c]) for c in order])


def write_link_bins(
    per_link: np.ndarray, links: pd.DataFrame, run_id: str, bin_s: float, routes: str, times: np.ndarray, path: Path
) -> None:
    """Write the ``LINK_BIN_COLUMNS`` rows of ``per_link`` (int64 ``(n_bins, n_links)``, column ``k`` the
    link ``links.link_id[k] == k``) to ``path`` (zstd Parquet, atomically), bins ``times`` (s), rows in
    ``(t, link_id)`` order, :data:`CHUNK_ROWS` rows at most a row group.

    ``links``: ``routes.link_table`` columns (``link_id``, ``link_class``, ``src``, ``dst``, ``capacity_bps``).
    Memory: the matrix, one row group's columns (about 60 B a row) and Parquet's buffers.

    Raises:
        ValueError: ``per_link``'s columns are not the links, or ``times`` not its bins.
    """
    n_bins, n_links = per_link.shape
    if n_links != len(links) or len(times) != n_bins:
        raise ValueError(f"link bins: a ({n_bins}, {n_links}) matrix for {len(links)} links and {len(times)} bins")
    schema = _schema()
    step = max(1, CHUNK_ROWS // max(n_links, 1))
    k = min(step, n_bins)  # bins of a whole row group; a last, shorter one slices its arrays
    one = pa.array(np.zeros(k * n_links, dtype=np.int32))
    codes: dict[str, tuple[pa.Array, pa.Array]] = {
        "run_id": (one, pa.array([run_id])),
        "routes": (one, pa.array([routes])),
    }
    for col in ("link_class", "src", "dst"):
        idx, values = pd.factorize(links[col].to_numpy(dtype=object))
        codes[col] = (
            pa.array(np.tile(idx.astype(np.int32), k)),
            pa.array(np.asarray(values, dtype=object), pa.string()),
        )
    link_id = pa.array(np.tile(links["link_id"].to_numpy(np.int64), k))
    cap = pa.array(np.tile(links["capacity_bps"].to_numpy(np.float64), k))
    stats = [c for c, _ in _NUMBERS] + ["capacity_bps"]
    with (
        atomic_path(path) as tmp,
        pq.ParquetWriter(tmp, schema, compression="zstd", store_schema=False, write_statistics=stats) as writer,
    ):
        for b0 in range(0, max(n_bins, 1), step):
            rows = min(step, n_bins - b0) * n_links
            cols = {c: pa.DictionaryArray.from_arrays(i[:rows], v, safe=False) for c, (i, v) in codes.items()}
            cols |= {
                "t": pa.array(np.repeat(times[b0 : b0 + step], n_links)),
                "bin_s": pa.array(np.full(rows, float(bin_s))),
                "link_id": link_id[:rows],
                "bytes": pa.array(per_link[b0 : b0 + step].reshape(-1)),
                "capacity_bps": cap[:rows],
            }
            writer.write_table(pa.Table.from_arrays([cols[c] for c in schema.names], schema=schema))


@dataclass(frozen=True)
class ClassPeaks:
    """The busiest link of each class in every bin: ``t`` (s, the bins present, sorted), ``peak``
    (``(len(t), len(classes))`` utilisation in %, ``bytes * 8 / bin_s / capacity_bps``; 0 where a class has
    no row in a bin), ``classes`` (names, by first appearance), ``links`` (distinct links of each class),
    ``bin_s`` (the first row's; 0.1 for an empty table) and ``routes`` (the first row's, or '')."""

    t: np.ndarray
    peak: np.ndarray
    classes: tuple[str, ...]
    links: tuple[int, ...]
    bin_s: float
    routes: str


def _frame_parts(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """(t, utilisation %, link_id, class code, class names) of a ``link_bins`` table or row group."""
    util = df["bytes"].to_numpy(np.float64) * 8 / df["bin_s"].to_numpy(np.float64)
    util = 100 * util / df["capacity_bps"].to_numpy(np.float64)
    cls = df["link_class"]
    if isinstance(cls.dtype, pd.CategoricalDtype):
        code, names = cls.cat.codes.to_numpy(np.int64), [str(c) for c in cls.cat.categories]
    else:
        code, uniq = pd.factorize(cls.to_numpy(dtype=object))
        code, names = code.astype(np.int64), [str(c) for c in uniq]
    return df["t"].to_numpy(np.float64), util, df["link_id"].to_numpy(np.int64), code, names


def class_peaks(source: pd.DataFrame | Path) -> ClassPeaks:
    """:class:`ClassPeaks` of a ``link_bins`` table, or of a ``link_bins.parquet`` read one row group at a
    time (columns ``t``, ``bin_s``, ``link_id``, ``link_class``, ``bytes``, ``capacity_bps``, ``routes``;
    the class as its dictionary)."""
    names: list[str] = []
    grids: list[np.ndarray] = []
    peaks: list[np.ndarray] = []
    per_class: dict[str, np.ndarray] = {}
    first: tuple[float, str] | None = None
    for df in _pieces(source):
        if not len(df):
            continue
        if first is None:
            first = (float(df["bin_s"].iloc[0]), str(df["routes"].iloc[0]))
        t, util, link_id, code, local = _frame_parts(df)
        for name in local:
            if name not in per_class:
                names.append(name)
                per_class[name] = np.zeros(0, np.int64)
        to_global = np.array([names.index(n) for n in local], np.int64)
        gcode = to_global[code]
        grid, ti = np.unique(t, return_inverse=True)
        pk = np.zeros((len(grid), len(names)))
        np.maximum.at(pk, (ti.reshape(-1), gcode), util)
        grids.append(grid)
        peaks.append(pk)
        for j, name in enumerate(local):
            per_class[name] = np.union1d(per_class[name], link_id[code == j])
    if not grids:
        return ClassPeaks(np.zeros(0), np.zeros((0, 0)), (), (), 0.1, "")
    wide = [np.pad(p, ((0, 0), (0, len(names) - p.shape[1]))) for p in peaks]
    t_all, pk_all = np.concatenate(grids), np.concatenate(wide)
    grid, ti = np.unique(t_all, return_inverse=True)
    peak = np.zeros((len(grid), len(names)))
    np.maximum.at(peak, ti.reshape(-1), pk_all)
    assert first is not None
    return ClassPeaks(grid, peak, tuple(names), tuple(len(per_class[n]) for n in names), *first)


def _pieces(source: pd.DataFrame | Path):
    if isinstance(source, pd.DataFrame):
        yield source
        return
    cols = ["t", "bin_s", "link_id", "link_class", "bytes", "capacity_bps", "routes"]
    f = pq.ParquetFile(source, read_dictionary=["link_class", "routes"])
    for g in range(f.num_row_groups):
        yield f.read_row_group(g, columns=cols).to_pandas()
