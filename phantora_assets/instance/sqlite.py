"""Dagster's SQLite run and event-log storages with their connections kept open.

Dagster's SQLite storages create a new SQLAlchemy engine and a new connection for every query
and close it afterwards; in WAL mode each last close checkpoints the log into the database file.
A run of ``all_runs`` writes ~80 events, each touching the run's file and the index file: on
this project's 2-core machines that was 2-4 s of a 1 s run, and concurrent runs queued on each
other's checkpoints. These subclasses change only how a connection is obtained: one engine per
database file with one connection, kept open (``StaticPool``, serialized by the storage's lock
for the event log), ``PRAGMA synchronous=NORMAL`` (in WAL mode: durable against a process crash,
the last transactions may be lost on power loss, never corrupted). Schema, files and queries are
Dagster's, so an instance can switch between these and ``storage: sqlite`` at any time.

A process that forks (``ForkRunLauncher``) never reuses its parent's connections: each storage
drops its engines when it finds itself in another process. At most :data:`MAX_OPEN` run
databases stay open per storage (least recently used closed first).

Configure in ``dagster.yaml`` (paths as Dagster's default layout under ``$DAGSTER_HOME``)::

    run_storage:
      module: phantora_assets.instance
      class: PooledSqliteRunStorage
      config: {base_dir: {env: DAGSTER_HOME}}
    event_log_storage:
      module: phantora_assets.instance
      class: PooledSqliteEventLogStorage
      config: {base_dir: {env: DAGSTER_HOME}}

``base_dir`` is the instance root: run storage in ``<base_dir>/history/runs.db``, event logs in
``<base_dir>/history/runs/*.db`` (the files ``storage: sqlite`` uses).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import sqlalchemy as db
from dagster import StringSource
from dagster._core.storage.event_log.sqlite.sqlite_event_log import SqliteEventLogStorage
from dagster._core.storage.runs.sqlite.sqlite_run_storage import SqliteRunStorage
from dagster._core.storage.sqlite import SQLITE_BUSY_TIMEOUT_SECONDS
from dagster._serdes import ConfigurableClassData
from sqlalchemy.pool import StaticPool

#: Run databases a storage keeps open at once (the index database is always open).
MAX_OPEN = 16


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


class PooledSqliteEventLogStorage(SqliteEventLogStorage):
    """``SqliteEventLogStorage`` with an open connection per shard (module docstring).

    Args:
        base_dir: the instance root; event logs live in ``<base_dir>/history/runs``.
    """

    def __init__(self, base_dir: str, inst_data: ConfigurableClassData | None = None) -> None:
        self._engines: OrderedDict[str, db.engine.Engine] = OrderedDict()
        self._pid = os.getpid()
        self._root = base_dir
        super().__init__(os.path.join(base_dir, "history", "runs"), inst_data)

    @classmethod
    def config_type(cls) -> dict:
        return {"base_dir": StringSource}

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> PooledSqliteEventLogStorage:
        return cls(inst_data=inst_data, **config_value)

    def _shard_engine(self, shard: str) -> db.engine.Engine:
        if os.getpid() != self._pid:  # forked: the parent's connections are not ours
            self._engines = OrderedDict()
            self._pid = os.getpid()
        engine = self._engines.get(shard)
        if engine is None:
            engine = _engine(self.conn_string_for_shard(shard))
            if shard not in self._initialized_dbs:
                self._initdb(engine)
                self._initialized_dbs.add(shard)
            self._engines[shard] = engine
            while len(self._engines) > MAX_OPEN + 1:
                old = next(k for k in self._engines if k != "index")
                self._engines.pop(old).dispose()
        else:
            self._engines.move_to_end(shard)
        return engine

    @contextmanager
    def _connect(self, shard: str) -> Iterator[db.engine.Connection]:
        with self._db_lock, self._shard_engine(shard).connect() as conn, conn.begin():
            yield conn

    def dispose(self) -> None:
        for engine in self._engines.values():
            engine.dispose()
        self._engines.clear()
        super().dispose()


class PooledSqliteRunStorage(SqliteRunStorage):
    """``SqliteRunStorage`` with one open connection (module docstring).

    Args:
        base_dir: the instance root; runs live in ``<base_dir>/history/runs.db``.
    """

    def __init__(self, conn_string: str, inst_data: ConfigurableClassData | None = None) -> None:
        super().__init__(conn_string, inst_data)
        self._lock = threading.RLock()
        self._depth = threading.local()
        self._pooled: db.engine.Engine | None = None
        self._pid = os.getpid()

    @classmethod
    def config_type(cls) -> dict:
        return {"base_dir": StringSource}

    @classmethod
    def from_config_value(
        cls, inst_data: ConfigurableClassData | None, config_value: Mapping[str, Any]
    ) -> PooledSqliteRunStorage:
        return cls.from_local(os.path.join(config_value["base_dir"], "history", ""), inst_data=inst_data)

    @contextmanager
    def connect(self) -> Iterator[db.engine.Connection]:
        if getattr(self._depth, "n", 0):  # nested in this thread: a connection of its own, as Dagster does
            with super().connect() as conn:
                yield conn
            return
        with self._lock:
            if self._pooled is None or os.getpid() != self._pid:
                self._pooled = _engine(self._conn_string)
                self._pid = os.getpid()
            self._depth.n = 1
            try:
                with self._pooled.connect() as conn, conn.begin():
                    yield conn
            finally:
                self._depth.n = 0

    def dispose(self) -> None:
        if self._pooled is not None:
            self._pooled.dispose()
            self._pooled = None
        super().dispose()
