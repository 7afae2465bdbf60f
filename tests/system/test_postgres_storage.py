"""The project's PostgreSQL storage (phantora_assets/instance/postgres.py) on a throwaway server
(tests/fixtures/pg_server.py): both URL forms load, connections are kept (dagster_postgres's own storage opens
one per query), a forked child never ends its parent's sessions, and every storage an instance of it
hands out (and serializes for other processes) is the pooled one."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy as db
import yaml
from fixtures.pg_server import REQUIRE_ENV, PgServer, PostgresUnavailable, pg_server

from phantora_assets.instance.postgres import (
    PooledPostgresEventLogStorage,
    PooledPostgresRunStorage,
    PooledPostgresScheduleStorage,
    driver_url,
)


@pytest.fixture(scope="module")
def pg(tmp_path_factory) -> Iterator[PgServer]:
    try:
        with pg_server(tmp_path_factory.mktemp("pg")) as server:
            yield server
    except PostgresUnavailable as exc:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{exc} (and ${REQUIRE_ENV} is set)")
        pytest.skip(str(exc))


def _instance(tmp_path: Path, storage: dict) -> dg.DagsterInstance:
    home = tmp_path / "home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "dagster.yaml").write_text(yaml.safe_dump({"telemetry": {"enabled": False}, "storage": storage}))
    return dg.DagsterInstance.from_config(str(home))


def _connects(engine: db.engine.Engine) -> list[int]:
    seen: list[int] = []
    db.event.listen(engine, "connect", lambda *_: seen.append(os.getpid()))
    return seen


def _log(instance: dg.DagsterInstance, run_id: str, n: int) -> None:
    for i in range(n):
        instance.report_engine_event(f"event {i}", dg.DagsterRun(job_name="j", run_id=run_id))


def test_the_bare_url_is_read_with_psycopg2() -> None:
    """The project's storage reads a bare URL with psycopg2, the driver dagster-postgres 0.29.27 is
    written for (its table-creation retry reads psycopg2's ``pgcode``), psycopg 3 installed or not."""
    assert driver_url("postgresql://u:p@h:5432/d") == "postgresql+psycopg2://u:p@h:5432/d"
    assert driver_url("postgres://u:p@h/d") == "postgresql+psycopg2://u:p@h/d"
    assert driver_url("postgresql+psycopg2://u:p@h/d") == "postgresql+psycopg2://u:p@h/d"
    assert driver_url("postgresql+pg8000://u:p@h/d") == "postgresql+pg8000://u:p@h/d"


@pytest.mark.parametrize("scheme", ["postgresql", "postgresql+psycopg2"])
def test_both_url_forms_load_and_store(pg: PgServer, tmp_path: Path, scheme: str) -> None:
    with _instance(tmp_path, pg.project_storage(scheme)) as inst:
        assert isinstance(inst.run_storage, PooledPostgresRunStorage)
        assert isinstance(inst.event_log_storage, PooledPostgresEventLogStorage)
        assert isinstance(inst.schedule_storage, PooledPostgresScheduleStorage)
        run = inst.create_run_for_job(dg.GraphDefinition("g_" + scheme.replace("+", "_")).to_job())
        _log(inst, run.run_id, 3)
        assert [e.message for e in inst.all_logs(run.run_id)][-3:] == ["event 0", "event 1", "event 2"]
        # what other processes (run workers, code servers) rehydrate is the pooled storage too
        ref = inst.get_ref()
        assert ref.storage_data is not None and ref.storage_data.class_name == "PooledPostgresStorage"
        with dg.DagsterInstance.from_ref(ref) as again:
            assert isinstance(again.event_log_storage, PooledPostgresEventLogStorage)
            assert len(again.all_logs(run.run_id)) == len(inst.all_logs(run.run_id))


@pytest.mark.parametrize("form", ["postgres_url", "postgres_db"])
def test_dagsters_own_storage_as_dagsters_docs_write_it(pg: PgServer, tmp_path: Path, form: str) -> None:
    """Issue 39 item 15: Dagster's ``storage: postgres:`` block with a bare ``postgresql://`` URL (its
    docs' form; ``postgres_db:`` builds the same, scheme ``postgresql``) failed with "No module named
    'psycopg'" after ``pip install -e ".[postgres]"``: SQLAlchemy 2.1 reads the bare URL as psycopg (3),
    which dagster-postgres does not install (and with which its event writes fail: ``NOTIFY`` with a
    server-side parameter). The extra pins SQLAlchemy 2.0, whose bare URL is psycopg2's."""
    from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage

    if form == "postgres_url":
        config: dict = {"postgres_url": pg.url()}
    else:
        db_config = {"hostname": pg.host, "port": pg.port, "username": pg.user, "password": pg.password}
        config = {"postgres_db": {**db_config, "db_name": pg.dbname}}
    with _instance(tmp_path, {"postgres": config}) as inst:
        assert type(inst.run_storage) is PostgresRunStorage
        assert type(inst.event_log_storage) is PostgresEventLogStorage
        engine = inst.event_log_storage._engine
        assert engine.url.drivername == "postgresql" and engine.dialect.driver == "psycopg2"  # as documented
        run = inst.create_run_for_job(dg.GraphDefinition("g_" + form).to_job())
        _log(inst, run.run_id, 3)
        assert [e.message for e in inst.all_logs(run.run_id)][-3:] == ["event 0", "event 1", "event 2"]
        assert inst.get_run_by_id(run.run_id) is not None


def test_connections_are_kept_where_dagster_postgres_opens_one_per_query(pg: PgServer, tmp_path: Path) -> None:
    with _instance(tmp_path / "pooled", pg.project_storage()) as inst:
        opened = _connects(inst.event_log_storage._engine)  # the engine under test
        _log(inst, "r-pooled", 40)
        assert len(inst.all_logs("r-pooled")) == 40
        assert len(opened) <= 2, f"{len(opened)} connections for 40 events and a read"
    with _instance(tmp_path / "plain", pg.dagster_storage()) as inst:
        opened = _connects(inst.event_log_storage._engine)
        _log(inst, "r-plain", 40)
        assert len(opened) >= 40  # the baseline this storage removes


def test_a_forked_child_does_not_end_its_parents_sessions(pg: PgServer, tmp_path: Path) -> None:
    with _instance(tmp_path, pg.project_storage()) as inst:
        _log(inst, "r-parent", 2)  # the parent holds a kept connection now
        pid = os.fork()
        if pid == 0:  # the child: writes through the inherited instance, disposes it, exits
            code = 1
            try:
                _log(inst, "r-child", 2)
                inst.dispose()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        _log(inst, "r-parent", 2)  # the parent's kept connection still works
        assert len(inst.all_logs("r-parent")) == 4
        assert len(inst.all_logs("r-child")) == 2
