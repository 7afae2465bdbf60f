"""What the project's Dagster instance (``dagster.yaml``) plugs into Dagster's own interfaces.

* :class:`~phantora_assets.instance.launcher.ForkRunLauncher` -- a ``RunLauncher`` that starts each
  run in a process forked from one that imported the code location once;
* :class:`~phantora_assets.instance.sqlite.PooledSqliteEventLogStorage` -- Dagster's SQLite
  event-log storage with one open connection per database file instead of a new engine and
  connection per query.

Importing this package also shortens the daemon's backfill and asset loops
(:mod:`phantora_assets.instance.daemon_loops`): a backfill launched from the UI starts its runs
within a second, not after up to 30 s.
"""

from phantora_assets.instance import daemon_loops
from phantora_assets.instance.launcher import ForkRunLauncher
from phantora_assets.instance.sqlite import PooledSqliteEventLogStorage

daemon_loops.apply()

__all__ = ["ForkRunLauncher", "PooledSqliteEventLogStorage"]
