"""Phantora performance databases (``perfdb/<gpu>/``): load and validate.

Layout (PHANTORA_FORMATS.md section 5): ``compute.csv`` (``key,nanos``; older files
``op,key,nanos``), ``memcpy.csv`` (``kind,size_bytes,nanos``), optional ``flash_attn.csv`` and
``sequence.csv``, and ``manifest.md`` (``- **GPU:** NVIDIA L40S``, schema version, entry counts).
Values are nanoseconds. ``key`` is the torch call as compact JSON with one top-level op name.

Where they live: :func:`default_perfdb_dir` (``$PHANTORA_ASSETS_PERFDB_DIR``, else the repository's
``perfdb/``), one folder a GPU (:func:`perfdb_folder`: ``gpus.toml``'s ``perfdb`` name, else the GPU
name); a folder need not exist.

No Dagster import. pandera schemas for the tables live in ``phantora_assets.contracts``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from phantora_assets.lib.errors import PerfDBError

#: Environment variable naming the perf-DB root (a folder of ``<gpu>/`` perf DBs).
PERFDB_DIR_ENV = "PHANTORA_ASSETS_PERFDB_DIR"


def default_perfdb_dir() -> Path:
    """``$PHANTORA_ASSETS_PERFDB_DIR`` or the repository's ``perfdb/`` folder (beside the package)."""
    env = os.environ.get(PERFDB_DIR_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "perfdb"


def perfdb_folder(gpu: str, gpu_spec: Mapping[str, object]) -> Path:
    """``<default perf-DB root>/<gpu_spec's perfdb name, else gpu>``: the folder of ``gpu``'s perf DB."""
    return default_perfdb_dir() / str(gpu_spec.get("perfdb", gpu))


MEMCPY_KINDS = (
    "HostToHost",
    "HostToDevice",
    "PinnedHostToDevice",
    "DeviceToHost",
    "DeviceToPinnedHost",
    "DeviceToDevice",
)
_MANIFEST_LINE = re.compile(r"^\s*-\s*\*\*(?P<k>[^*]+):\*\*\s*(?P<v>.+?)\s*$")


@dataclass(frozen=True)
class PerfDB:
    """A loaded performance database.

    Attributes:
        path: the folder.
        gpu_name: GPU name from the manifest, e.g. ``NVIDIA L40S``.
        compute: DataFrame ``op`` (str), ``key`` (str, compact JSON), ``nanos`` (int64).
        memcpy: DataFrame ``kind`` (str), ``size_bytes`` (int64), ``nanos`` (int64).
        manifest: every ``- **Key:** value`` line of manifest.md.
    """

    path: Path
    gpu_name: str
    compute: pd.DataFrame
    memcpy: pd.DataFrame
    manifest: dict[str, str] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        return {"compute": len(self.compute), "memcpy": len(self.memcpy)}


def parse_manifest(path: Path) -> dict[str, str]:
    """``- **Key:** value`` lines of a manifest.md as a dict (PerfDBError if unreadable)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise PerfDBError(f"{path}: cannot read manifest ({exc})") from exc
    out = {}
    for line in text.splitlines():
        m = _MANIFEST_LINE.match(line)
        if m:
            out[m["k"].strip()] = m["v"].strip()
    return out


def _op_of(key: str, path: Path, row: int) -> str:
    try:
        obj = json.loads(key)
    except json.JSONDecodeError as exc:
        raise PerfDBError(f"{path}: row {row}: key is not valid JSON ({exc.msg})") from exc
    if not isinstance(obj, dict) or len(obj) != 1:
        raise PerfDBError(f"{path}: row {row}: key must be a JSON object with exactly one op name")
    return next(iter(obj))


def _read_csv(path: Path, columns: list[str]) -> pd.DataFrame:
    try:
        df = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (OSError, pd.errors.ParserError, UnicodeDecodeError) as exc:
        raise PerfDBError(f"{path}: cannot parse CSV ({exc})") from exc
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise PerfDBError(f"{path}: missing columns {missing} (has {list(df.columns)})")
    return df


def _int_column(df: pd.DataFrame, col: str, path: Path) -> pd.Series:
    values = pd.to_numeric(df[col], errors="coerce")
    bad = values.isna() | (values % 1 != 0)
    if bad.any():
        row = int(bad.idxmax()) + 2
        raise PerfDBError(f"{path}: row {row}: {col}={df[col].iloc[row - 2]!r} is not an integer")
    values = values.astype("int64")
    if (values < 0).any():
        row = int((values < 0).idxmax()) + 2
        raise PerfDBError(f"{path}: row {row}: {col} must be >= 0 (got {values.iloc[row - 2]})")
    return values


def load_perfdb(path: str | Path, expected_gpu_name: str | None = None) -> PerfDB:
    """Load and validate ``path`` (a ``perfdb/<gpu>/`` folder).

    Rules: manifest.md exists and names the GPU (equal to ``expected_gpu_name`` when given);
    every compute key parses as a one-op JSON object; nanos and size_bytes are integers >= 0;
    memcpy kinds are Phantora's; manifest entry counts, when present, equal the row counts.

    Raises:
        PerfDBError: naming the file, the row (1-based, header = row 1) and the rule.
        FileNotFoundError: ``path`` does not exist (the caller reports the GPU as absent).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(path)
    manifest = parse_manifest(path / "manifest.md")
    gpu_name = manifest.get("GPU", "")
    if not gpu_name:
        raise PerfDBError(f"{path / 'manifest.md'}: no '- **GPU:** <name>' line")
    if expected_gpu_name and gpu_name != expected_gpu_name:
        raise PerfDBError(f"{path / 'manifest.md'}: GPU is {gpu_name!r}, expected {expected_gpu_name!r}")

    cpath = path / "compute.csv"
    cdf = _read_csv(cpath, ["key", "nanos"])
    ops = [(cdf["op"].iloc[i] if "op" in cdf.columns else _op_of(k, cpath, i + 2)) for i, k in enumerate(cdf["key"])]
    if "op" in cdf.columns:  # older layout: still check that keys parse
        for i, k in enumerate(cdf["key"]):
            _op_of(k, cpath, i + 2)
    compute = pd.DataFrame({"op": ops, "key": cdf["key"].astype(str), "nanos": _int_column(cdf, "nanos", cpath)})

    mpath = path / "memcpy.csv"
    if mpath.exists():
        mdf = _read_csv(mpath, ["kind", "size_bytes", "nanos"])
        unknown = sorted(set(mdf["kind"]) - set(MEMCPY_KINDS))
        if unknown:
            raise PerfDBError(f"{mpath}: unknown memcpy kind(s) {unknown}")
        memcpy = pd.DataFrame(
            {
                "kind": mdf["kind"].astype(str),
                "size_bytes": _int_column(mdf, "size_bytes", mpath),
                "nanos": _int_column(mdf, "nanos", mpath),
            }
        )
    else:
        memcpy = pd.DataFrame(
            {"kind": pd.Series(dtype=str), "size_bytes": pd.Series(dtype="int64"), "nanos": pd.Series(dtype="int64")}
        )

    for table, df in (("compute", compute), ("memcpy", memcpy)):
        declared = manifest.get(f"{table} entries")
        if declared is not None and declared.isdigit() and int(declared) != len(df):
            raise PerfDBError(f"{path / 'manifest.md'}: declares {declared} {table} entries, {table}.csv has {len(df)}")
    return PerfDB(path, gpu_name, compute, memcpy, manifest)
