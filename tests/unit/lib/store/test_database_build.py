"""``lib/store/database.build_database`` on small real Parquet files: every table filled from its
per-run files (several runs per statement), a run_id taken from the partition folder's name, values
from ``runs``, a run filter, optional files, and a folder not named after its run refused."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pandas as pd
import pytest

from phantora_assets.lib.store import database as db

RUNS = db.Table("runs", {"run_id": "str", "bin_s": "float64"}, "runs.parquet", "one row per run")
TABLES = [
    RUNS,
    db.Table("per_row", {"x": "int64"}, "rows.parquet", "rows", add_run_id=True),
    db.Table(
        "binned", {"run_id": "str", "bin_s": "float64", "x": "int64"}, "rows_id.parquet", "b", from_runs=("bin_s",)
    ),
    db.Table("coarse", {"run_id": "str", "x": "int64"}, "rows_id.parquet", "c", run_filter="r.bin_s >= 0.1"),
    db.Table("maybe", {"y": "int64"}, "maybe.parquet", "optional", add_run_id=True, optional=True),
]
WIDTH = {"run_a": 0.1, "run_b": 0.01, "run_c": 0.1}


def _runs(root: Path) -> dict[str, Path]:
    out = {}
    for i, (run_id, bin_s) in enumerate(WIDTH.items()):
        d = root / "partitions" / run_id
        d.mkdir(parents=True)
        pd.DataFrame({"run_id": [run_id], "bin_s": [bin_s]}).to_parquet(d / "runs.parquet")
        pd.DataFrame({"x": [10 * i + k for k in range(i + 2)]}).to_parquet(d / "rows.parquet")
        pd.DataFrame({"run_id": run_id, "x": [100 * i + k for k in range(3)]}).to_parquet(d / "rows_id.parquet")
        if run_id != "run_b":
            pd.DataFrame({"y": [i]}).to_parquet(d / "maybe.parquet")
        out[run_id] = d
    return out


def test_tables_are_filled_from_every_run_s_file(tmp_path):
    parts = _runs(tmp_path)
    status = [(r, "included", "") for r in WIDTH]
    res = db.build_database(tmp_path / "x.duckdb", TABLES, parts, status, views=())
    assert res.rows == {"runs": 3, "per_row": 9, "binned": 9, "coarse": 6, "maybe": 2, "run_status": 3}
    assert res.missing == {"maybe": ["run_b"]}
    with duckdb.connect(str(tmp_path / "x.duckdb"), read_only=True) as con:
        assert con.execute("SELECT run_id, x FROM per_row").fetchall() == [
            ("run_a", 0), ("run_a", 1), ("run_b", 10), ("run_b", 11), ("run_b", 12),
            ("run_c", 20), ("run_c", 21), ("run_c", 22), ("run_c", 23),
        ]  # fmt: skip
        got = con.execute("SELECT run_id, bin_s, count(*), sum(x) FROM binned GROUP BY ALL ORDER BY 1").fetchall()
        assert got == [("run_a", 0.1, 3, 3), ("run_b", 0.01, 3, 303), ("run_c", 0.1, 3, 603)]
        assert con.execute("SELECT DISTINCT run_id FROM coarse ORDER BY 1").fetchall() == [("run_a",), ("run_c",)]
        assert con.execute("SELECT run_id, y FROM maybe ORDER BY 1").fetchall() == [("run_a", 0), ("run_c", 2)]


def test_a_required_file_that_is_missing_fails_the_build_and_keeps_the_old_database(tmp_path):
    parts = _runs(tmp_path)
    out = tmp_path / "x.duckdb"
    out.write_bytes(b"old")
    (parts["run_c"] / "rows.parquet").unlink()
    with pytest.raises(duckdb.Error, match="rows.parquet"):
        db.build_database(out, TABLES, parts, [(r, "included", "") for r in WIDTH], views=())
    assert out.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["partitions", "x.duckdb"]


def test_a_partition_folder_not_named_after_its_run_is_refused(tmp_path):
    parts = _runs(tmp_path)
    parts["run_a"] = parts["run_b"]
    with pytest.raises(ValueError, match="of run run_a is not named after it"):
        db.build_database(tmp_path / "x.duckdb", TABLES, parts, [(r, "included", "") for r in WIDTH], views=())
    assert not (tmp_path / "x.duckdb").exists()
