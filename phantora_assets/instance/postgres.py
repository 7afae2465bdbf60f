"""Dagster's PostgreSQL storage (``dagster_postgres``) with its connections kept open and its schema
lookups remembered, as the SQLite event log of this project (``instance/sqlite.py``) has them.

``dagster_postgres``'s run, event-log and schedule storages open a new connection for every query
(SQLAlchemy ``NullPool``, "to prevent accumulating connections per DagsterInstance"): a TCP
connection, a scram-sha-256 handshake and a new PostgreSQL backend process each time, about 100
times a run of ``all_runs``, in the run worker, the daemon and the webserver. On 2 cores a daemon
backfill of the 30 shipped partitions took 4.25x ``phantora-assets build`` on PostgreSQL against
1.9x on SQLite (issue 29). Here each storage keeps a small pool per process (``pool_size`` 1,
up to :data:`MAX_OVERFLOW` more while threads of a daemon or webserver query at once, each checked
with a ping before use, recycled after :data:`RECYCLE_S`); a process that forks (the run launcher's
workers) never uses its parent's connections (they are dropped on first use in the child). Dagster
asks again and again whether a table or an ``asset_keys`` column exists; the event log remembers
those it found (a migration only ever adds them).

The URL: Dagster's docs write ``postgresql://user:password@host:5432/db`` (and ``postgres_db:``
builds that form), which SQLAlchemy 2.1 reads as the psycopg (3) driver; ``dagster-postgres``
installs psycopg2 and is written for it: at 0.29.27 ``retry_pg_creation_fn`` (``utils.py``) retries
two processes' race to create a table only when ``exc.orig.pgcode`` is ``42P07``, and ``pgcode`` is
psycopg2's (psycopg 3 has ``diag.sqlstate``; dagster-io/dagster pull request 33959 is open), and its
``NOTIFY run_events, :notify_id`` after every event needs psycopg2's client-side parameters (psycopg 3
sends ``$1``, which ``NOTIFY`` refuses: every event write fails). Here a bare ``postgresql://`` (or
``postgres://``) URL is therefore used as ``postgresql+psycopg2://``; an explicit driver is kept. The
``[postgres]`` extra pins SQLAlchemy 2.0, whose bare ``postgresql://`` is psycopg2's, so Dagster's own
``storage: postgres:`` block written as its docs write it works as well (docs/INSTANCE.md).

Name it in ``dagster.yaml`` (config as Dagster's ``storage: postgres:`` block)::

    storage:
      custom:
        module: phantora_assets.instance
        class: PooledPostgresStorage
        config:
          postgres_url:
            env: PHANTORA_ASSETS_POSTGRES_URL
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import sqlalchemy as db
from dagster._serdes import ConfigurableClassData
from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage
from dagster_postgres.storage import DagsterPostgresStorage
from dagster_postgres.utils import create_pg_engine, get_token_provider_from_config, pg_url_from_config
from sqlalchemy import exc as sa_exc

#: Extra connections a storage of one process may open while its threads query at once.
MAX_OVERFLOW = 8
#: Seconds after which a kept connection is replaced (a server or proxy may close idle ones).
RECYCLE_S = 1800


def driver_url(url: str) -> str:
    """``url`` with the driver dagster-postgres is written for: ``postgresql://`` / ``postgres://``
    become ``postgresql+psycopg2://`` (module docstring); any other URL is returned as is."""
    for bare in ("postgresql://", "postgres://"):
        if url.startswith(bare):
            return "postgresql+psycopg2://" + url[len(bare) :]
    return url


def _pooled_engine(url: str, token_provider: Any) -> db.engine.Engine:
    """An AUTOCOMMIT engine (as dagster_postgres's) keeping its connections, fork-safe."""
    engine = create_pg_engine(
        url,
        token_provider,
        isolation_level="AUTOCOMMIT",
        pool_size=1,
        max_overflow=MAX_OVERFLOW,
        pool_pre_ping=True,
        pool_recycle=RECYCLE_S,
    )

    @db.event.listens_for(engine, "connect")
    def _owner(_dbapi_conn, record) -> None:
        record.info["pid"] = os.getpid()

    @db.event.listens_for(engine, "checkout")
    def _same_process(_dbapi_conn, record, proxy) -> None:
        if record.info.get("pid") != os.getpid():  # inherited through fork: not ours to use or close
            record.dbapi_connection = proxy.dbapi_connection = None
            raise sa_exc.DisconnectionError(f"connection of process {record.info.get('pid')} in {os.getpid()}")

    return engine


class _Pooled:
    """Mixin: after dagster_postgres's ``__init__`` (which creates or checks the schema), its
    ``NullPool`` engine is replaced by :func:`_pooled_engine`."""

    postgres_url: str
    _token_provider: Any
    _engine: db.engine.Engine

    def _keep_connections(self) -> None:
        self._engine.dispose()
        self._engine = _pooled_engine(self.postgres_url, self._token_provider)
        self._engine_pid = os.getpid()

    def dispose(self) -> None:
        super().dispose()  # type: ignore[misc]
        # in a forked child the kept connections are the parent's: drop them without closing
        # (closing would end the parent's sessions)
        self._engine.dispose(close=os.getpid() == getattr(self, "_engine_pid", os.getpid()))


def _kwargs(inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "inst_data": inst_data,
        "postgres_url": pg_url_from_config(config_value),
        "should_autocreate_tables": config_value.get("should_autocreate_tables", True),
        "token_provider": get_token_provider_from_config(config_value),
    }


class PooledPostgresRunStorage(_Pooled, PostgresRunStorage):
    """dagster_postgres's ``PostgresRunStorage`` with kept connections (module docstring)."""

    def __init__(self, postgres_url: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(driver_url(postgres_url), *args, **kwargs)
        self._keep_connections()

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        return cls(**_kwargs(inst_data, config_value))


class PooledPostgresScheduleStorage(_Pooled, PostgresScheduleStorage):
    """dagster_postgres's ``PostgresScheduleStorage`` with kept connections (module docstring)."""

    def __init__(self, postgres_url: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(driver_url(postgres_url), *args, **kwargs)
        self._keep_connections()

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        return cls(**_kwargs(inst_data, config_value))


class PooledPostgresEventLogStorage(_Pooled, PostgresEventLogStorage):
    """dagster_postgres's ``PostgresEventLogStorage`` with kept connections and remembered
    tables and ``asset_keys`` columns (module docstring)."""

    def __init__(self, postgres_url: str, *args: Any, **kwargs: Any) -> None:
        self._tables: set[str] = set()
        self._key_columns: set[str] = set()
        super().__init__(driver_url(postgres_url), *args, **kwargs)
        self._keep_connections()

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        return cls(**_kwargs(inst_data, config_value))

    def has_table(self, table_name: str) -> bool:
        if table_name not in self._tables and super().has_table(table_name):
            self._tables.add(table_name)
        return table_name in self._tables

    def _has_asset_key_col_on_connection(self, conn: db.engine.Connection, column_name: str) -> bool:
        if column_name not in self._key_columns and super()._has_asset_key_col_on_connection(conn, column_name):
            self._key_columns.add(column_name)
        return column_name in self._key_columns


class PooledPostgresStorage(DagsterPostgresStorage):
    """dagster_postgres's ``DagsterPostgresStorage`` (runs, event log, schedules in one database)
    made of the pooled storages above; configured as Dagster's ``storage: postgres:`` block
    (``postgres_url`` or ``postgres_db``), named with ``storage: custom:`` (module docstring).

    Raises:
        sqlalchemy.exc.OperationalError: the server cannot be reached (after dagster_postgres's retries).
    """

    def __init__(
        self,
        postgres_url: str,
        should_autocreate_tables: bool = True,
        inst_data: ConfigurableClassData | None = None,
        token_provider: Any = None,
    ) -> None:
        url = driver_url(postgres_url)
        self.postgres_url = url
        self.should_autocreate_tables = should_autocreate_tables
        self._inst_data = inst_data
        self._run_storage = PooledPostgresRunStorage(url, should_autocreate_tables, token_provider=token_provider)
        self._event_log_storage = PooledPostgresEventLogStorage(
            url, should_autocreate_tables, token_provider=token_provider
        )
        self._schedule_storage = PooledPostgresScheduleStorage(
            url, should_autocreate_tables, token_provider=token_provider
        )
        super(DagsterPostgresStorage, self).__init__()

    @classmethod
    def from_config_value(cls, inst_data, config_value):
        return cls(**_kwargs(inst_data, config_value))

    def _data(self, class_name: str) -> ConfigurableClassData | None:
        return ConfigurableClassData(__name__, class_name, self.inst_data.config_yaml) if self.inst_data else None

    @property
    def event_storage_data(self) -> ConfigurableClassData | None:
        return self._data("PooledPostgresEventLogStorage")

    @property
    def run_storage_data(self) -> ConfigurableClassData | None:
        return self._data("PooledPostgresRunStorage")

    @property
    def schedule_storage_data(self) -> ConfigurableClassData | None:
        return self._data("PooledPostgresScheduleStorage")
