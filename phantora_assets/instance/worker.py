"""The body of a :class:`~phantora_assets.instance.launcher.ForkRunLauncher` run worker: execute
one run (or, given a pipe, several one after the other) exactly as ``dagster api execute_run``
does, with the code location re-executed when the environment it was loaded from changed.

Signals: SIGINT interrupts the run (Dagster records it as cancelled when termination was
requested); SIGTERM is turned into SIGINT; between runs either ends the worker.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

#: Signals the launcher holds while it forks a worker (the worker releases them).
HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
_critical = [0]
_deferred: list[int] = []


@contextmanager
def signals_deferred() -> Iterator[None]:
    """A section a raising signal handler must not interrupt (the launcher forking a worker and
    recording it): handlers that ask :func:`defer_if_critical` return at once, and the first
    deferred signal is raised again when the outermost section ends. Blocking the signals does
    not suffice: a signal delivered to another thread still runs its handler in this one."""
    _critical[0] += 1
    try:
        yield
    finally:
        _critical[0] -= 1
        if not _critical[0] and _deferred:
            signum = _deferred[0]
            _deferred.clear()
            signal.raise_signal(signum)


def defer_if_critical(signum: int) -> bool:
    """For a signal handler: True (the signal is kept for later) inside :func:`signals_deferred`."""
    if _critical[0]:
        _deferred.append(signum)
        return True
    return False


def refresh_definitions() -> None:
    """Re-execute the code location module this process imported when the run matrix, the import
    registry or the ``PHANTORA_ASSETS_*`` environment changed since (``definitions.loaded_from``),
    so that a forked worker sees them as they are now, not as they were at preload."""
    mod = sys.modules.get("phantora_assets.definitions")
    if mod is None:
        return
    try:
        current = mod.loaded_from() == mod.LOADED_FROM
    except Exception:  # an invalid matrix now: re-executing the module reports it
        current = False
    if not current:
        importlib.reload(mod)
        _forget_job_definitions()


def _forget_job_definitions() -> None:
    """Drop the job and repository definitions Dagster keeps from the last run: ``ReconstructableJob``
    caches them (``lru_cache``, global, keyed by the job's origin, equal for every run of a job), so a
    worker's next run of the same job would otherwise use the definitions of before the reload (a run
    of a partition added since fails with ``Nonexistent partition keys``)."""
    from dagster._core.definitions.reconstruct import ReconstructableJob

    ReconstructableJob.get_definition.cache_clear()
    ReconstructableJob.get_repository_definition.cache_clear()


def run_worker(
    run_id: str, instance_ref: str, inherited=None, conn=None, max_runs: int = 1, idle_s: float = 60.0
) -> None:
    """Body of a forked run worker: execute run ``run_id`` of the instance ``instance_ref`` (a
    serialized ``InstanceRef``) like ``dagster api execute_run``; exit 0 unless the worker itself
    broke (a failed run is recorded in the instance, not in the exit code). ``inherited``: the
    launching process's own ``DagsterInstance`` (``fork`` only: its storages open their own
    connections in the child), which saves re-creating it.

    With ``conn`` (one end of a pipe) the worker takes more runs, up to ``max_runs`` in all. On
    the pipe: the worker sends ``("done", run_id)`` when a run has ended; the launcher sends the
    next run id, which the worker answers with ``("ack", run_id)`` before running it, or None to
    stop. The worker also stops when the pipe closes, on SIGINT while it waits, when the process
    that forked it is gone, or after ``idle_s`` seconds without a run."""
    from dagster._core.instance import DagsterInstance, InstanceRef
    from dagster._serdes import deserialize_value

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)  # held by the launcher while it forked
    if inherited is not None:
        instance = inherited
    else:
        instance = DagsterInstance.from_ref(deserialize_value(instance_ref, InstanceRef))
    done = 0
    current: str | None = run_id
    parent = os.getppid()
    try:
        while current is not None:
            _execute_one(current, instance)
            done += 1
            if conn is None:
                return
            try:
                conn.send(("done", current))
            except OSError:  # the launcher is gone
                return
            if done >= max_runs:
                return
            current = _next_run(conn, parent, idle_s)
    finally:
        if inherited is None:
            instance.dispose()


def _next_run(conn, parent: int, idle_s: float) -> str | None:
    """The next run id from ``conn``, acknowledged; None when told to stop, when the pipe closes,
    on SIGINT, when the process that forked this one (``parent``) is gone (a sibling forked later
    may hold a copy of the pipe, so its closing alone may never be seen), or after ``idle_s``
    seconds without a run. A run id that arrives as the wait ends is still taken: the launcher
    waits for the acknowledgement and forks a new worker when none comes."""
    deadline = time.monotonic() + idle_s
    try:
        while not conn.poll(1.0):
            if os.getppid() != parent or time.monotonic() > deadline:
                if conn.poll(0):
                    break
                return None
        rid = conn.recv()
        if rid is not None:
            conn.send(("ack", rid))
        return rid
    except (EOFError, OSError, KeyboardInterrupt):
        return None


def _execute_one(run_id: str, instance) -> None:
    from dagster._cli.api import _execute_run_command_body
    from dagster._utils.interrupts import capture_interrupts

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    refresh_definitions()
    with capture_interrupts():
        _execute_run_command_body(run_id, instance, lambda _event: None, set_exit_code_on_failure=False)
    # between runs SIGINT/SIGTERM end the worker (capture_interrupts leaves both on the SIGINT handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def _sigterm_as_interrupt(signum, frame) -> None:
    """SIGTERM (``docker stop``, a system shutdown) interrupts the run like SIGINT -- it ends as
    failed (no termination was requested), with its event log closed -- instead of the worker
    vanishing mid-step."""
    os.kill(os.getpid(), signal.SIGINT)
