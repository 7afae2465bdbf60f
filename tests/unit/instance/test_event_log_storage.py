"""The project's SQLite event log (phantora_assets/instance/sqlite.py, PooledSqliteEventLogStorage) on a
real instance made from the project's dagster.yaml: it remembers the tables and asset_keys columns it
has found, and still sees one a migration adds later."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import dagster as dg
import pytest
from fixtures.paths import ROOT

from phantora_assets.instance import PooledSqliteEventLogStorage


@pytest.fixture
def instance(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copy(ROOT / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    with dg.DagsterInstance.get() as inst:
        yield inst


def _db(instance) -> Path:
    return Path(instance.root_directory) / "history" / "event_log" / "event_log.db"


def test_tables_found_are_remembered_and_a_table_added_later_is_seen(instance) -> None:
    storage = instance.event_log_storage
    assert isinstance(storage, PooledSqliteEventLogStorage)
    assert storage.has_table("asset_check_executions") and storage.supports_asset_checks
    assert "asset_check_executions" in storage._tables
    assert not storage.has_table("added_by_a_later_migration")
    with sqlite3.connect(_db(instance)) as con:
        con.execute("create table added_by_a_later_migration (id integer)")
    assert storage.has_table("added_by_a_later_migration")


def test_asset_key_columns_found_are_remembered_and_one_added_later_is_seen(instance) -> None:
    storage = instance.event_log_storage
    assert storage.has_asset_key_col("last_materialization_timestamp")
    assert "last_materialization_timestamp" in storage._key_columns
    assert not storage.has_asset_key_col("added_later")
    with sqlite3.connect(_db(instance)) as con:
        con.execute("alter table asset_keys add column added_later text")
    assert storage.has_asset_key_col("added_later")


def test_check_evaluations_and_materializations_are_recorded(instance) -> None:
    """The remembered tables serve the real path: a materialization with a check, recorded."""

    @dg.asset(check_specs=[dg.AssetCheckSpec("positive", asset="a")])
    def a():
        yield dg.MaterializeResult(metadata={"rows": 3})
        yield dg.AssetCheckResult(check_name="positive", passed=True)

    for _ in range(2):
        assert dg.materialize([a], instance=instance).success
    key = dg.AssetKey("a")
    assert instance.get_latest_materialization_event(key).asset_materialization.metadata["rows"].value == 3
    evals = instance.event_log_storage.get_asset_check_execution_history(dg.AssetCheckKey(key, "positive"), limit=10)
    assert len(evals) == 2 and all(e.status.value == "SUCCEEDED" for e in evals)
