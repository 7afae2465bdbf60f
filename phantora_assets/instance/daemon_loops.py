"""How often ``dagster-daemon``'s backfill and asset loops wake up in a process of this project's instance.

Dagster's backfill daemon looks for requested backfills every 30 s (``DEFAULT_DAEMON_INTERVAL_SECONDS``
of ``dagster._daemon.controller``, read by ``dagster._daemon.backfill.execute_backfill_iteration_loop``
when the loop starts), and no ``dagster.yaml`` setting changes it (``backfills:`` sets only its
threads). A backfill launched from the UI's button (GraphQL ``launchPartitionBackfill``) is only
stored by the webserver; its runs are created by that daemon loop: 22-29 s passed between the click
and the first run (issue 29), longer than the 30 runs of ``all_runs`` took to execute. The asset
daemon, which evaluates the ``dataset_automation`` sensor, sleeps up to 5 s between passes
(``MIN_INTERVAL_LOOP_SECONDS`` of ``dagster._daemon.asset_daemon``).

:func:`apply` sets both to this project's values (:data:`BACKFILL_LOOP_S`, :data:`ASSET_LOOP_S`, or
``$PHANTORA_ASSETS_BACKFILL_LOOP_SECONDS`` / ``$PHANTORA_ASSETS_ASSET_LOOP_SECONDS``); it runs when
``phantora_assets.instance`` is imported, which every process of the project's instance does
before its daemons start (``dagster.yaml`` names the instance's storage and run launcher from it).
An idle backfill pass is two queries of the run storage (requested and canceling backfills); an
idle asset pass evaluates nothing until a sensor's ``minimum_interval_seconds`` has passed.

Only the values are changed, never Dagster's code: if a Dagster upgrade removes or renames either
constant, :func:`apply` leaves that loop at Dagster's interval and returns which ones it set.
"""

from __future__ import annotations

import os

#: Seconds between passes of the backfill daemon (Dagster's: 30).
BACKFILL_LOOP_S = 1.0
#: Seconds between passes of the asset daemon, which runs the automation sensors (Dagster's: 5).
ASSET_LOOP_S = 1.0
BACKFILL_ENV, ASSET_ENV = "PHANTORA_ASSETS_BACKFILL_LOOP_SECONDS", "PHANTORA_ASSETS_ASSET_LOOP_SECONDS"


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${env}={raw!r}: not a number of seconds") from None
    if not 0 < value <= 3600:
        raise ValueError(f"${env}={raw!r}: must be > 0 and <= 3600 seconds")
    return value


def apply() -> dict[str, float]:
    """Set the daemon loops' intervals; returns ``{constant: seconds}`` of those it set.

    Raises:
        ValueError: one of the environment variables is not a number in (0, 3600].
    """
    from dagster._daemon import asset_daemon, backfill, controller

    done: dict[str, float] = {}
    # the backfill loop reads the controller's constant by name when it starts
    if hasattr(controller, "DEFAULT_DAEMON_INTERVAL_SECONDS") and "DEFAULT_DAEMON_INTERVAL_SECONDS" in (
        backfill.execute_backfill_iteration_loop.__code__.co_names
    ):
        controller.DEFAULT_DAEMON_INTERVAL_SECONDS = _seconds(BACKFILL_ENV, BACKFILL_LOOP_S)  # type: ignore[assignment]
        done["DEFAULT_DAEMON_INTERVAL_SECONDS"] = controller.DEFAULT_DAEMON_INTERVAL_SECONDS
    if hasattr(asset_daemon, "MIN_INTERVAL_LOOP_SECONDS"):
        asset_daemon.MIN_INTERVAL_LOOP_SECONDS = _seconds(ASSET_ENV, ASSET_LOOP_S)  # type: ignore[assignment]
        done["MIN_INTERVAL_LOOP_SECONDS"] = asset_daemon.MIN_INTERVAL_LOOP_SECONDS
    return done
