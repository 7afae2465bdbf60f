"""``lib.store.parquet.write_parquet`` with a column contract: the file has the contract's columns and
Arrow types, also for an empty table (pandas alone writes an empty object column as Arrow's ``null``
type, which DuckDB cannot cast to VARCHAR when it unions the runs' files)."""

from __future__ import annotations

import duckdb
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from phantora_assets.lib.net.reconfig import TRANSITION_COLUMNS
from phantora_assets.lib.store.parquet import write_parquet


def test_an_empty_table_keeps_the_contract_types(tmp_path) -> None:
    empty = pd.DataFrame({c: pd.Series([], dtype=object if t == "str" else t) for c, t in TRANSITION_COLUMNS.items()})
    write_parquet(empty, tmp_path / "a.parquet", columns=TRANSITION_COLUMNS)
    schema = pq.read_schema(tmp_path / "a.parquet")
    assert schema.names == list(TRANSITION_COLUMNS)
    assert schema.field("run_id").type == pa.string()
    assert schema.field("step").type == pa.int64()
    assert schema.field("window_s").type == pa.float64()
    full = pd.DataFrame(
        {"run_id": ["r"], "step": [3], "nic": ["host-1"], "from_group": ["dp"], "to_group": ["pp"], "window_s": [0.5]}
    )
    write_parquet(full, tmp_path / "b.parquet", columns=TRANSITION_COLUMNS)
    # the empty run's file and a full one read together, as dataset_duckdb reads every run's file
    got = duckdb.sql(f"select run_id, step, window_s from read_parquet('{tmp_path}/*.parquet') order by 1").fetchall()
    assert got == [("r", 3, 0.5)]


def test_pandas_alone_writes_the_null_type_the_contract_avoids(tmp_path) -> None:
    empty = pd.DataFrame({"run_id": pd.Series([], dtype=object)})
    empty.to_parquet(tmp_path / "c.parquet", index=False)
    assert pq.read_schema(tmp_path / "c.parquet").field("run_id").type == pa.null()
