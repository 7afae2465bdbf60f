"""A throwaway PostgreSQL server for tests, from the machine's own binaries.

``pg_server(folder)`` runs ``initdb`` in ``folder`` and starts a server that listens on 127.0.0.1 only
(unix sockets in the same folder), on a free port, with a random password (scram-sha-256), and stops
it (``pg_ctl stop -m immediate``) when the block ends, however it ends.

PostgreSQL refuses to run as root: when the tests run as root, the server runs as an unprivileged user
(``postgres`` if it exists, else ``nobody``), and its folder is a fresh directory of the system temp dir
owned by that user (pytest's temp folders are private to root, mode 0700, so that user could not
reach them); it is removed afterwards and the server log copied into ``folder``.

The binaries are found at run time: ``$PHANTORA_ASSETS_PG_BINDIR``, ``pg_config --bindir``, the folder of
``initdb`` on PATH, then Debian's ``/usr/lib/postgresql/<version>/bin`` (newest first).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: set (e.g. by .ci/run) to make a missing PostgreSQL a failure instead of a skip
REQUIRE_ENV = "PHANTORA_ASSETS_REQUIRE_POSTGRES"
BINDIR_ENV = "PHANTORA_ASSETS_PG_BINDIR"
NEEDED = ("initdb", "pg_ctl", "postgres")
#: unix socket paths are limited to 107 bytes; ".s.PGSQL.<port>" takes up to 15 of them
MAX_SOCKET_DIR = 90


class PostgresUnavailable(RuntimeError):
    """No usable PostgreSQL server binaries (or no way to run them) on this machine."""


def _has_all(folder: str | os.PathLike[str]) -> bool:
    return all(os.access(os.path.join(folder, name), os.X_OK) for name in NEEDED)


def _version_key(folder: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", Path(folder).parent.name)) or (0,)


def find_bindir() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres, or None."""
    candidates: list[str] = []
    if os.environ.get(BINDIR_ENV):
        candidates.append(os.environ[BINDIR_ENV])
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip():
            candidates.append(out.stdout.strip())
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(os.path.dirname(os.path.realpath(initdb)))
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    for folder in candidates:
        if _has_all(folder):
            return Path(folder)
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PgServer:
    bindir: Path
    home: Path  # holds data/, sock/, server.log, pwfile
    port: int
    user: str  # the database superuser
    password: str
    dbname: str
    os_user: str | None  # the OS user the server runs as, when not the current one
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"

    @property
    def data(self) -> Path:
        return self.home / "data"

    @property
    def log(self) -> Path:
        return self.home / "server.log"

    def dagster_storage(self) -> dict[str, Any]:
        """The ``storage:`` block of a dagster.yaml for this server.

        The scheme names the driver: dagster-postgres builds ``postgresql://`` URLs and installs
        psycopg2, but SQLAlchemy 2.1 reads a bare ``postgresql://`` as psycopg (3), which it does not
        install ("No module named 'psycopg'").
        """
        return {
            "postgres": {
                "postgres_db": {
                    "hostname": self.host,
                    "port": self.port,
                    "username": self.user,
                    "password": self.password,
                    "db_name": self.dbname,
                    "scheme": "postgresql+psycopg2",
                }
            }
        }

    def url(self, scheme: str = "postgresql") -> str:
        """The server's database as a URL, in Dagster's docs' form by default (no driver named)."""
        return f"{scheme}://{self.user}:{self.password}@{self.host}:{self.port}/{self.dbname}"

    def project_storage(self, scheme: str = "postgresql") -> dict[str, Any]:
        """The ``storage:`` block naming the project's PostgreSQL storage
        (``phantora_assets.instance.PooledPostgresStorage``) on this server, by :meth:`url`."""
        return {
            "custom": {
                "module": "phantora_assets.instance",
                "class": "PooledPostgresStorage",
                "config": {"postgres_url": self.url(scheme)},
            }
        }

    def run(self, binary: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run one of the server binaries as the server's OS user (PGPASSWORD set for the clients)."""
        env = {**self.env, "PGPASSWORD": self.password}
        return _run_as([str(self.bindir / binary), *args], self.os_user, self.home, env, check=check)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError as exc:
            return f"(no server log: {exc})"

    def stop(self) -> None:
        self.run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "-t", "30", "stop", check=False)


def _run_as(
    cmd: list[str], os_user: str | None, cwd: Path, env: dict[str, str], *, check: bool = True
) -> subprocess.CompletedProcess[str]:
    kwargs: dict[str, Any] = {}
    if os_user is not None:
        pw = pwd.getpwnam(os_user)
        kwargs = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        env = {**env, "HOME": str(cwd), "USER": os_user, "LOGNAME": os_user}
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, **kwargs)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout}\n{out.stderr}")
    return out


def _write_private(path: Path, text: str, os_user: str | None) -> None:
    """Write ``path`` (mode 0600), owned by ``os_user`` when given."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        if os_user is not None:
            pw = pwd.getpwnam(os_user)
            os.fchown(fh.fileno(), pw.pw_uid, pw.pw_gid)
        fh.write(text)


def _unprivileged_user() -> str:
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise PostgresUnavailable("running as root and there is no unprivileged user (postgres, nobody) to run the server")


def _server_home(folder: Path, os_user: str | None) -> tuple[Path, bool]:
    """(folder for the cluster, whether it is a temp dir of ours to remove afterwards)."""
    folder.mkdir(parents=True, exist_ok=True)
    if os_user is None and len(str(folder / "sock")) <= MAX_SOCKET_DIR:
        return folder, False
    home = Path(tempfile.mkdtemp(prefix="pg-"))
    if os_user is not None:
        pw = pwd.getpwnam(os_user)
        os.chown(home, pw.pw_uid, pw.pw_gid)
    return home, True


@contextlib.contextmanager
def pg_server(folder: Path, *, dbname: str = "dagster", user: str = "dagster") -> Iterator[PgServer]:
    """A running throwaway server with an empty database ``dbname``; stopped when the block ends.

    Raises:
        PostgresUnavailable: no server binaries, or no unprivileged user to run them as root.
    """
    bindir = find_bindir()
    if bindir is None:
        raise PostgresUnavailable(
            "no PostgreSQL server binaries (initdb, pg_ctl, postgres): not in $PHANTORA_ASSETS_PG_BINDIR, "
            "pg_config --bindir, PATH or /usr/lib/postgresql/*/bin; install postgresql"
        )
    os_user = _unprivileged_user() if os.geteuid() == 0 else None
    home, remove = _server_home(folder, os_user)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env.update(LC_ALL="C", LANG="C")
    password = secrets.token_hex(16)
    server = PgServer(bindir, home, 0, user, password, dbname, os_user, env)
    initialized = started = False
    try:
        pwfile = home / "pwfile"
        _write_private(pwfile, password + "\n", os_user)
        server.run(
            "initdb", "-D", str(server.data), "-U", user, f"--pwfile={pwfile}", "--auth=scram-sha-256",
            "-E", "UTF8", "--locale=C", "--no-sync",
        )  # fmt: skip
        initialized = True
        sock = home / "sock"
        sock.mkdir()
        if os_user is not None:
            pw = pwd.getpwnam(os_user)
            os.chown(sock, pw.pw_uid, pw.pw_gid)
        with open(server.data / "postgresql.conf", "a") as fh:
            fh.write("\ninclude = 'throwaway.conf'\n")
        for _attempt in range(5):
            server.port = free_port()
            settings = {
                "listen_addresses": "'127.0.0.1'",
                "port": str(server.port),
                "unix_socket_directories": f"'{sock}'",
                # a throwaway: durability is not under test (the server itself is never killed)
                "fsync": "off",
                "synchronous_commit": "off",
                "full_page_writes": "off",
                "max_connections": "200",
                "shared_buffers": "32MB",
            }
            conf = "".join(f"{k} = {v}\n" for k, v in settings.items())
            _write_private(server.data / "throwaway.conf", conf, os_user)
            out = server.run(
                "pg_ctl", "-D", str(server.data), "-l", str(server.log), "-w", "-t", "60", "start", check=False
            )
            if out.returncode == 0:
                started = True
                break
            if "could not bind" not in server.log_tail():
                raise RuntimeError(f"pg_ctl start failed:\n{out.stdout}\n{out.stderr}\n{server.log_tail()}")
        if not started:
            raise RuntimeError(f"no free port for the server after 5 tries:\n{server.log_tail()}")
        # createdb: next to the server where the distribution puts it (Debian), else a client on PATH
        createdb = server.bindir / "createdb"
        if not os.access(createdb, os.X_OK):
            createdb = Path(shutil.which("createdb") or createdb)
        cmd = [str(createdb), "-h", server.host, "-p", str(server.port), "-U", user, dbname]
        _run_as(cmd, os_user, home, {**env, "PGPASSWORD": password})
        yield server
    finally:
        if initialized:  # also when start timed out: stopping a stopped server is harmless
            server.stop()
        if remove:
            with contextlib.suppress(OSError):
                shutil.copy(server.log, folder / "pg_server.log")
            shutil.rmtree(home, ignore_errors=True)
