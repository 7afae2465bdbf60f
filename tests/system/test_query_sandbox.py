"""`phantora-assets query` only reads the database (issue 13, finding 5).

A real two-run `phantora-assets build` (its own data root, so an attack that got through could not spoil the
session's shared build); every call goes through the CLI's `main([...])`. Each attack must exit 2 and leave
no trace: the data root is byte-for-byte the same, the target files do not exist, and neither the working
directory nor $HOME (where DuckDB keeps extensions and secrets) gets a file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from phantora_assets.cli import main
from phantora_assets.lib.store.database import VIEWS
from phantora_assets.paths import DataPaths

RUNS = ("phantora_a100_40g_W1_2x1", "phantora_a100_40g_W1_2x2")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("query_sandbox") / "data"
    argv = ["build", "--data-dir", str(data), "--no-plots", "--quiet", "--jobs", "1"]
    for run in RUNS:
        argv += ["--run", run]
    assert main(argv) == 0
    assert DataPaths(data).duckdb_path.exists()
    return data


def _tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder``: relative path -> sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def sandbox(root, tmp_path, monkeypatch):
    """Run ``query`` from an empty working directory with an empty $HOME; check afterwards that nothing was written."""
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    before = _tree(root)
    yield tmp_path
    assert _tree(root) == before, "the data root changed"
    assert list(cwd.iterdir()) == [], "something was written in the working directory"
    assert list(home.rglob("*")) == [], "something was written in $HOME"


def query(root: Path, sql: str, capsys, *extra: str) -> tuple[int, str, str]:
    rc = main(["query", sql, "--data-dir", str(root), *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def refused(rc: int, out: str, err: str, *words: str) -> None:
    assert rc == 2 and out == "", (rc, out, err)
    assert err.startswith("error: ") and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


# --------------------------------------------------------------------------- writes
def test_copy_over_the_dataset_is_refused(root, sandbox, capsys) -> None:
    runs_csv = root / "phantora_v0" / "runs.csv"
    rc, out, err = query(root, f"COPY (SELECT 'overwritten' AS x) TO '{runs_csv}' (HEADER false)", capsys)
    refused(rc, out, err, "refused", "COPY statement")
    assert "overwritten" not in runs_csv.read_text()


@pytest.mark.parametrize(
    "sql",
    [
        "COPY runs TO '{out}'",
        "COPY (SELECT 1 AS x) TO '{out}' (FORMAT parquet)",
        "COPY runs TO 'relative.csv'",  # the working directory
        "EXPORT DATABASE '{dir}'",
        "EXPLAIN ANALYZE COPY runs TO '{out}'",
        "/* a comment */ explain (analyze, format json) copy runs to '{out}'",
    ],
)
def test_copy_and_export_write_nothing(root, sandbox, capsys, sql) -> None:
    out_file, out_dir = sandbox / "out.csv", sandbox / "exported"
    rc, out, err = query(root, sql.format(out=out_file, dir=out_dir), capsys)
    refused(rc, out, err, "refused", "COPY" if "COPY" in sql.upper() else "EXPORT")
    assert not out_file.exists() and not out_dir.exists()


def test_attach_read_write_and_create_table_change_no_database(root, sandbox, capsys) -> None:
    other = sandbox / "other.duckdb"
    with duckdb.connect(str(other)) as con:
        con.execute("CREATE TABLE keep AS SELECT 42 AS x")
    before = other.read_bytes()
    new = sandbox / "new.duckdb"
    for db in (other, new):
        for sql in (
            f"ATTACH '{db}' AS o (READ_ONLY false)",
            f"ATTACH '{db}' AS o (READ_ONLY false); CREATE TABLE o.t AS SELECT * FROM runs",
            "CREATE TABLE o.t AS SELECT * FROM runs",
            "CREATE TABLE t AS SELECT * FROM runs",
        ):
            rc, out, err = query(root, sql, capsys)
            refused(rc, out, err)
            assert ("2 SQL statements" in err) if ";" in sql else ("refused" in err and sql.split()[0] in err)
    assert other.read_bytes() == before
    assert not new.exists() and not new.with_name(new.name + ".wal").exists()
    with duckdb.connect(str(other), read_only=True) as con:
        assert con.execute("SELECT table_name FROM duckdb_tables()").fetchall() == [("keep",)]


# --------------------------------------------------------------------------- reads outside the database
@pytest.mark.parametrize(
    "sql",
    [
        "SELECT content FROM read_text('{secret}')",
        "SELECT * FROM read_csv('{secret}', header = false)",
        "SELECT * FROM read_blob('{secret}')",
        "SELECT * FROM '{secret}'",
        "SELECT * FROM glob('{folder}/*')",
        "SELECT * FROM read_text('/etc/hostname')",
        "SELECT count(*) FROM read_parquet('{root}/phantora_v0/runs.parquet')",
    ],
)
def test_files_outside_the_database_cannot_be_read(root, sandbox, capsys, sql) -> None:
    secret = sandbox / "secret.csv"
    secret.write_text("token\nsecret-7f3a\n")
    rc, out, err = query(root, sql.format(secret=secret, folder=sandbox, root=root), capsys)
    refused(rc, out, err)
    assert "secret-7f3a" not in out + err
    assert "Permission Error" in err or "does not exist" in err  # `FROM 'file'`: no replacement scan either


# --------------------------------------------------------------------------- extensions, settings
@pytest.mark.parametrize("sql", ["INSTALL httpfs", "FORCE INSTALL httpfs", "LOAD httpfs", "INSTALL h3 FROM community"])
def test_install_and_load_are_refused_before_they_run(root, sandbox, capsys, sql) -> None:
    rc, out, err = query(root, sql, capsys)
    refused(rc, out, err, "refused", "LOAD statement")  # no download tried: $HOME stays empty (fixture)


def test_no_extension_is_fetched_by_a_query(root, sandbox, capsys) -> None:
    rc, out, err = query(root, "SELECT * FROM read_parquet('https://example.invalid/x.parquet')", capsys)
    refused(rc, out, err, "Permission Error")


@pytest.mark.parametrize(
    "sql",
    [
        "SET enable_external_access = true",
        "RESET enable_external_access",
        "SET lock_configuration = false",
        "SET GLOBAL enable_external_access = true",
        "RESET threads",
        "PRAGMA threads = 1",
        "SET VARIABLE x = 1",
        "PRAGMA enable_profiling",
        "PRAGMA import_database('{dir}')",
        "IMPORT DATABASE '{dir}'",
        "CALL pragma_version()",
        "USE memory",
    ],
)
def test_settings_and_other_statements_are_refused(root, sandbox, capsys, sql) -> None:
    rc, out, err = query(root, sql.format(dir=sandbox), capsys)
    refused(rc, out, err, "refused", sql.split()[0])  # names the statement: SET, RESET, PRAGMA, IMPORT, CALL, USE


def test_sandbox_holds_without_the_statement_check(root, sandbox) -> None:
    """The settings alone stop the attacks: a statement the type check let through would still fail."""
    from phantora_assets.cli.query import sandboxed_connection

    out = sandbox / "out.csv"
    with sandboxed_connection(DataPaths(root).duckdb_path) as con:
        settings = dict(
            con.execute(
                "select name, value from duckdb_settings() where name in ('enable_external_access', "
                "'lock_configuration', 'autoinstall_known_extensions', 'autoload_known_extensions', "
                "'allow_community_extensions', 'temp_directory', 'allowed_directories')"
            ).fetchall()
        )
        assert settings == {
            "enable_external_access": "false",
            "lock_configuration": "true",
            "autoinstall_known_extensions": "false",
            "autoload_known_extensions": "false",
            "allow_community_extensions": "false",
            "temp_directory": "",
            "allowed_directories": "[]",
        }
        for sql, error in [
            (f"COPY runs TO '{out}'", duckdb.PermissionException),
            (f"ATTACH '{sandbox / 'x.duckdb'}' AS x (READ_ONLY false)", duckdb.PermissionException),
            ("SELECT * FROM read_text('/etc/hostname')", duckdb.PermissionException),
            ("LOAD httpfs", duckdb.PermissionException),
            ("SET enable_external_access = true", duckdb.InvalidInputException),
            ("RESET lock_configuration", duckdb.InvalidInputException),
            ("SET temp_directory = '.'", duckdb.InvalidInputException),
            ("INSERT INTO run_status VALUES ('x', 'y', 'z')", duckdb.InvalidInputException),  # READ_ONLY
            ("DETACH phantora", duckdb.BinderException),
        ]:
            with pytest.raises(error):
                con.execute(sql)
    assert not out.exists() and not (sandbox / "x.duckdb").exists()


def test_query_works_while_the_database_is_open_in_the_process(root, sandbox, capsys) -> None:
    """DuckDB keeps one instance per file and process: the sandbox must not need its own settings on it."""
    with duckdb.connect(str(DataPaths(root).duckdb_path), read_only=True) as held:
        rc, out, err = query(root, "select count(*) as n from runs", capsys, "--format", "csv")
        assert (rc, err) == (0, "") and out == f"n\n{len(RUNS)}\n"
        assert held.execute("select count(*) from runs").fetchone() == (len(RUNS),)


# --------------------------------------------------------------------------- one statement
@pytest.mark.parametrize(
    ("sql", "says"),
    [
        ("select 1; select 2", "2 SQL statements given"),
        ("select 1;select 2;select 3", "3 SQL statements given"),
        ("", "no SQL statement given"),
        ("  ;  -- only a comment", "no SQL statement given"),
    ],
)
def test_exactly_one_statement(root, sandbox, capsys, sql, says) -> None:
    rc, out, err = query(root, sql, capsys)
    refused(rc, out, err, says, "exactly one")


def test_one_statement_with_a_trailing_semicolon_and_comment_runs(root, sandbox, capsys) -> None:
    rc, out, err = query(root, "select 42 as answer; -- done", capsys, "--format", "csv")
    assert (rc, out, err) == (0, "answer\n42\n", "")


# --------------------------------------------------------------------------- queries still work
def test_bytes_per_run_match_the_dataset_parquet(root, sandbox, capsys) -> None:
    rc, out, err = query(root, "select run_id, sum(bytes) from flows_100ms group by 1", capsys, "--format", "json")
    assert rc == 0 and err == ""
    got = {r["run_id"]: int(r["sum(bytes)"]) for r in json.loads(out)}
    want = pd.read_parquet(root / "phantora_v0" / "flows_100ms", partitioning=None).groupby("run_id")["bytes"].sum()
    assert set(got) == set(RUNS) and got == {k: int(v) for k, v in want.items()}
    assert all(v > 0 for v in got.values())


@pytest.mark.parametrize("view", [v.name for v in VIEWS])
def test_every_view_reads_in_the_sandbox(root, sandbox, capsys, view) -> None:
    rc, out, err = query(root, f'select * from "{view}" order by all', capsys, "--format", "json")
    assert rc == 0 and err == "", err
    with duckdb.connect(str(DataPaths(root).duckdb_path), read_only=True) as con:  # no sandbox
        (want,) = con.execute(f'select count(*) from "{view}"').fetchone() or (0,)
    assert len(json.loads(out)) == want > 0


@pytest.mark.parametrize(
    "sql",
    [
        "with t as (select run_id from runs) select count(*) from t",
        "values (1, 'a')",
        "from runs select run_id limit 1",
        "table run_status",
        "describe runs",
        "show tables",
        "summarize runs",
        "pivot runs on layout using count(*)",
        "unpivot (select run_id, 1 as a, 2 as b from runs) on a, b into name k value v",
        "explain select * from pair_bytes",
        "explain analyze select count(*) from flows",
        "explain pivot runs on layout using count(*)",
        "pragma table_info('runs')",
        "pragma show_tables",
        "pragma database_size",
        "select view_name, comment from duckdb_views() where not internal",
        "select current_setting('enable_external_access') as external",
    ],
)
def test_read_only_queries_run(root, sandbox, capsys, sql) -> None:
    rc, out, err = query(root, sql, capsys, "--format", "csv")
    assert rc == 0 and err == "", err
    assert out.count("\n") >= 2  # header and at least one row
    if "enable_external_access" in sql:
        assert out == "external\nFalse\n"


def test_a_query_past_its_timeout_is_interrupted(root, sandbox, capsys) -> None:
    # was: a cross join of two 300,000-row ranges ran until killed (no time limit)
    sql = "select sum(a.range * b.range) from range(300000) a, range(300000) b"
    rc, out, err = query(root, sql, capsys, "--timeout", "1")
    assert rc == 2 and out == ""
    assert "ran longer than 1 s (--timeout) and was interrupted" in err


def test_a_query_needing_more_than_the_memory_limit_fails(root, sandbox, capsys) -> None:
    # was: a 20 GB string_agg took the process to 8.5 GB of RSS before failing
    rc, out, err = query(root, "select length(string_agg(repeat('x', 1000000), '')) from range(20000)", capsys)
    assert rc == 2 and out == ""
    assert "Out of Memory" in err
