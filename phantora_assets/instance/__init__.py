"""What the project's Dagster instance (``dagster.yaml``) plugs into Dagster's own interfaces.

* :class:`~phantora_assets.instance.launcher.ForkRunLauncher` -- a ``RunLauncher`` that starts each
  run in a process forked from one that imported the code location once;
* :class:`~phantora_assets.instance.sqlite.PooledSqliteEventLogStorage` -- Dagster's SQLite
  event-log storage with one open connection per database file instead of a new engine and
  connection per query.
"""

from phantora_assets.instance.launcher import ForkRunLauncher
from phantora_assets.instance.sqlite import PooledSqliteEventLogStorage

__all__ = ["ForkRunLauncher", "PooledSqliteEventLogStorage"]
