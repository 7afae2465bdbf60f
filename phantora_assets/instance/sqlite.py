"""Dagster's SQLite event-log storage with its connections kept open.

Dagster's default ``SqliteEventLogStorage`` keeps one database file per run, creates each with an
alembic stamp (~0.15 s a run), and opens a new SQLAlchemy engine and connection for every query
(in WAL mode each last close checkpoints the log into the file). A run of ``all_runs`` writes ~100
events: on this project's 2-core machines that was 2-4 s of a 1 s run.
:class:`PooledSqliteEventLogStorage` is Dagster's ``ConsolidatedSqliteEventLogStorage`` (one
database for all runs, Dagster's schema and queries) with one connection kept open (``StaticPool``,
serialized by a lock) and ``PRAGMA synchronous=NORMAL`` (in WAL mode: durable against a process
crash; the last transactions may be lost on power loss, the file is never corrupted). Switching an
instance back to the default storage starts an empty event log (the files differ).

A process that forks (``ForkRunLauncher``) never reuses its parent's connection: the storage makes
a new one when it finds itself in another process.

Dagster asks the schema again and again whether a table or an ``asset_keys`` column exists (before
every asset check event and asset event: a new engine and a schema query each time, ~1,600 times
in a build of the shipped matrix). The storage remembers the tables and columns it has found: a
migration only ever adds them, and one not found is asked again next time.

Configure in ``dagster.yaml``; without ``base_dir`` the instance's root directory is used (the
``$DAGSTER_HOME`` folder, or the temporary one ``dagster dev`` makes when it is unset)::

    event_log_storage:
      module: phantora_assets.instance
      class: PooledSqliteEventLogStorage
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import sqlalchemy as db
from dagster import Field, StringSource
from dagster._core.storage.event_log.sqlite.consolidated_sqlite_event_log import ConsolidatedSqliteEventLogStorage
from dagster._core.storage.sqlite import SQLITE_BUSY_TIMEOUT_SECONDS
from dagster._serdes import ConfigurableClassData
from sqlalchemy.pool import StaticPool


def _engine(conn_string: str) -> db.engine.Engine:
    """An engine with one connection kept open, ``synchronous=NORMAL``, Dagster's busy timeout."""
    engine = db.create_engine(
        conn_string,
        poolclass=StaticPool,
        connect_args={"timeout": SQLITE_BUSY_TIMEOUT_SECONDS, "check_same_thread": False},
    )

    @db.event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record) -> None:
        dbapi_conn.execute("PRAGMA synchronous=NORMAL")

    return engine


class PooledSqliteEventLogStorage(ConsolidatedSqliteEventLogStorage):
    """Dagster's ``ConsolidatedSqliteEventLogStorage`` (one database for every run's events) with
    one connection kept open (module docstring).

    Args:
        base_dir: the instance root; events live in ``<base_dir>/history/event_log/event_log.db``.
            None: the root of the instance this storage is registered with (set up then).
    """

    def __init__(self, base_dir: str | None = None, inst_data: ConfigurableClassData | None = None) -> None:
        self._pooled: db.engine.Engine | None = None
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._depth = threading.local()
        self._inst_data_ = inst_data
        self._ready = False
        self._tables: set[str] = set()  # tables and asset_keys columns known to exist
        self._key_columns: set[str] = set()
        if base_dir is not None:
            self._set_up(base_dir)

    def _set_up(self, root: str) -> None:
        super().__init__(os.path.join(root, "history", "event_log"), self._inst_data_)
        self._ready = True

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self._inst_data_

    def _init_db(self) -> None:
        """Dagster's schema set-up under an exclusive file lock (``<base_dir>/event_log.init.lock``):
        without it, processes starting together on a fresh instance (the daemon, the webserver, a
        build) each stamped the schema and left a database alembic refuses ("more than one head")."""
        os.makedirs(self._base_dir, exist_ok=True)
        with open(os.path.join(self._base_dir, "event_log.init.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            super()._init_db()

    def register_instance(self, instance) -> None:
        if not self._ready:
            self._set_up(instance.root_directory)
        super().register_instance(instance)

    @classmethod
    def config_type(cls) -> dict:
        return {"base_dir": Field(StringSource, is_required=False)}

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> PooledSqliteEventLogStorage:
        return cls(inst_data=inst_data, **config_value)

    @contextmanager
    def _connect(self) -> Iterator[db.engine.Connection]:
        if getattr(self._depth, "n", 0):  # nested in this thread: a connection of its own, as Dagster does
            with super()._connect() as conn:
                yield conn
            return
        with self._lock:
            if self._pooled is None or os.getpid() != self._pid:  # forked: the parent's connection is not ours
                self._pooled = _engine(self._conn_string)
                self._pid = os.getpid()
            self._depth.n = 1
            try:
                with self._pooled.connect() as conn, conn.begin():
                    yield conn
            finally:
                self._depth.n = 0

    def has_table(self, table_name: str) -> bool:
        if table_name not in self._tables and super().has_table(table_name):
            self._tables.add(table_name)
        return table_name in self._tables

    def _has_asset_key_col_on_connection(self, conn: db.engine.Connection, column_name: str) -> bool:
        if column_name not in self._key_columns and super()._has_asset_key_col_on_connection(conn, column_name):
            self._key_columns.add(column_name)
        return column_name in self._key_columns

    def dispose(self) -> None:
        if self._pooled is not None and os.getpid() == self._pid:
            self._pooled.dispose()
        self._pooled = None
        super().dispose()
