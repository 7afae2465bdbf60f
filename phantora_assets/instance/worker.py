"""The body of a :class:`~phantora_assets.instance.launcher.ForkRunLauncher` run worker: execute
one run (or, given a pipe, several one after the other) exactly as ``dagster api execute_run``
does, with the code location re-executed when the environment it was loaded from changed.

Signals: SIGINT interrupts the run (Dagster records it as cancelled when termination was
requested); SIGTERM is turned into SIGINT; between runs either ends the worker. SIGUSR1
(:data:`CANCEL_SIGNAL`, from ``ForkRunLauncher.terminate``) interrupts the run only if it is one
whose termination was requested, and is dropped otherwise; a run already CANCELING when the worker
takes it is recorded as cancelled without running.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.process
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: Run tags ``ForkRunLauncher`` writes: the worker's pid and the kernel's start time of that pid (so a
#: reused pid is not taken for the worker).
PID_TAG = "phantora/run_worker_pid"
START_TAG = "phantora/run_worker_start"
#: Seconds a worker waits for the launcher to record it on a run (pid tag) before it executes the run.
TAG_WAIT_S = 2.0
#: What ``ForkRunLauncher.terminate`` sends a worker: "interrupt your run if its termination was
#: requested" (a worker keeps it blocked and waits for it in a thread of its own, :func:`_watch_cancel`).
CANCEL_SIGNAL = signal.SIGUSR1
#: Signals the launcher holds while it forks a worker (the worker releases them, but CANCEL_SIGNAL).
HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, CANCEL_SIGNAL}
_critical = [0]
_deferred: list[int] = []
#: The run this worker executes (None between runs); switched under ``_switch``.
_current: list[str | None] = [None]
_switch = threading.Lock()
#: True in a run worker (set by :func:`run_worker`): the code location it re-executes does not add
#: its run partitions to the instance (``definitions.seed_run_partitions``), the launching side did.
IN_RUN_WORKER = [False]


def process_start_time(pid: int) -> str | None:
    """The start time of ``pid`` in clock ticks since boot (field 22 of ``/proc/<pid>/stat``), or
    None when there is no such process or no ``/proc``; a zombie counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


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
    """Drop the Definitions the code location's loader made in this process (``definitions.defs``)
    when the run matrix, the import registry or the ``PHANTORA_ASSETS_*`` environment changed since
    (``definitions.forget_if_changed``), and the job definitions Dagster cached from them, then
    load them again (``defs()``), so that a forked worker sees them as they are now, not as they
    were at preload, and the workers forked after a build's call inherit them built. Nothing when
    this process has not loaded them.

    Raises:
        RunMatrixError: the run matrix or an import is invalid now (names the file and the rule)."""
    mod = sys.modules.get("phantora_assets.definitions")
    if mod is not None and mod.forget_if_changed():
        _forget_job_definitions()
        mod.defs()


def _forget_job_definitions() -> None:
    """Drop the job and repository definitions Dagster keeps from the last run: ``ReconstructableJob``
    caches them (``lru_cache``, global, keyed by the job's origin, equal for every run of a job), so a
    worker's next run of the same job would otherwise use the definitions of before the reload (a run
    of a partition added since fails with ``Nonexistent partition keys``)."""
    from dagster._core.definitions.reconstruct import ReconstructableJob

    ReconstructableJob.get_definition.cache_clear()
    ReconstructableJob.get_repository_definition.cache_clear()


def run_worker(
    run_id: str,
    instance_ref: str,
    inherited=None,
    conn=None,
    max_runs: int = 1,
    idle_s: float = 60.0,
    env: dict[str, str] | None = None,
) -> None:
    """Body of a forked run worker: execute run ``run_id`` of the instance ``instance_ref`` (a
    serialized ``InstanceRef``) like ``dagster api execute_run``; exit 0 unless the worker itself
    broke (a failed run is recorded in the instance, not in the exit code). ``inherited``: the
    launching process's own ``DagsterInstance`` (``fork`` only: its storages open their own
    connections in the child), which saves re-creating it. ``env``: the environment the run
    executes with (``os.environ`` is replaced by it; None: this process's).

    With ``conn`` (one end of a pipe) the worker takes more runs, up to ``max_runs`` in all. On
    the pipe: the worker sends ``("done", run_id)`` when a run has ended; the launcher sends the
    next ``(run_id, environment)``, which the worker answers with ``("ack", run_id)`` before
    running it, or None to stop. The worker also stops when the pipe closes, on SIGINT while it waits, when the process
    that forked it is gone, or after ``idle_s`` seconds without a run."""
    from dagster._core.instance import DagsterInstance, InstanceRef
    from dagster._serdes import deserialize_value

    gc.freeze()  # what the launcher built after the preload is not the run's to collect either (warm.py)
    IN_RUN_WORKER[0] = True
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    # held by the launcher while it forked; CANCEL_SIGNAL stays blocked, for _watch_cancel's sigwait
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS - {CANCEL_SIGNAL})
    signal.pthread_sigmask(signal.SIG_BLOCK, {CANCEL_SIGNAL})
    if inherited is not None:
        instance = inherited
    else:
        instance = DagsterInstance.from_ref(deserialize_value(instance_ref, InstanceRef))
    threading.Thread(target=_watch_cancel, args=(instance,), name="phantora-cancel", daemon=True).start()
    done = 0
    current: str | None = run_id
    parent = os.getppid()
    sys.stderr = _QuietStorageFaults(sys.stderr)
    try:
        while current is not None:
            _use_environment(env)
            try:
                _execute_one(current, instance)
            except Exception as exc:
                _exit_on_fault(exc, current, conn)
                raise
            done += 1
            if conn is None:
                return
            try:
                conn.send(("done", current))
            except OSError:  # the launcher is gone
                return
            if done >= max_runs:
                return
            current, env = _next_run(conn, parent, idle_s)
    finally:
        if inherited is None:
            instance.dispose()


#: Exit code of a worker that stopped on a resource fault (``lib/faults``; EX_IOERR of sysexits.h).
FAULT_EXIT = 74


def _exit_on_fault(exc: BaseException, run_id: str, conn) -> None:
    """A resource fault (a full disk, a read-only data root) the run could not even record: tell
    the launcher on the pipe (``("fault", run_id, (rule, path, detail))``) and end the worker with
    :data:`FAULT_EXIT`, without the traceback (the build says it in one line, ``cli/build.py``).
    Any other exception returns (the caller raises it)."""
    from phantora_assets.lib.faults import resource_fault

    fault = resource_fault(exc)
    if fault is None:
        return
    if conn is not None:
        try:
            conn.send(("fault", run_id, (fault.rule, fault.path, fault.detail)))
        except (OSError, ValueError):
            pass
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    os._exit(FAULT_EXIT)


class _QuietStorageFaults:
    """The worker's stderr without Dagster's ``Exception while writing logger call to event log:
    <fault>`` lines when the fault is a resource fault (``lib/faults``): the run cannot record
    anything then, and the worker ends on it (:func:`_exit_on_fault`); every other line passes."""

    PREFIX = "Exception while writing logger call to event log: "

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if text.startswith(self.PREFIX):
            from phantora_assets.lib.faults import fault_from_text

            if fault_from_text(text[len(self.PREFIX) :]) is not None:
                return len(text)
        return self._stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _next_run(conn, parent: int, idle_s: float) -> tuple[str | None, dict[str, str] | None]:
    """The next ``(run_id, environment)`` from ``conn``, acknowledged; ``(None, None)`` when told
    to stop, when the pipe closes, on SIGINT, when the process that forked this one (``parent``)
    is gone (a sibling forked later may hold a copy of the pipe, so its closing alone may never
    be seen), or after ``idle_s`` seconds without a run. A run id that arrives as the wait ends
    is still taken: the launcher waits for the acknowledgement and forks a new worker when none
    comes."""
    deadline = time.monotonic() + idle_s
    try:
        while not conn.poll(1.0):
            if os.getppid() != parent or time.monotonic() > deadline:
                if conn.poll(0):
                    break
                return None, None
        msg = conn.recv()
        if msg is None:
            return None, None
        conn.send(("ack", msg[0]))
        return msg
    except (EOFError, OSError, KeyboardInterrupt):
        return None, None


def _use_environment(env: dict[str, str] | None) -> None:
    """Make ``os.environ`` (and the C environment) exactly ``env``, the launching process's
    environment at the run's launch; None keeps this process's."""
    if env is not None and env != dict(os.environ):
        os.environ.clear()
        os.environ.update(env)


def _execute_one(run_id: str, instance) -> None:
    from dagster import DagsterRunStatus
    from dagster._cli.api import _execute_run_command_body
    from dagster._utils.interrupts import capture_interrupts

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    refresh_definitions()
    with capture_interrupts():  # from here a SIGINT of _watch_cancel is kept for the run, not raised
        with _switch:
            _current[0] = run_id
        try:
            run = _recorded(instance, run_id)
            if run is not None and run.status == DagsterRunStatus.CANCELING:  # terminated before it ran
                instance.report_run_canceled(run, "Run terminated before its worker started it.")
            else:
                _execute_run_command_body(run_id, instance, lambda _event: None, set_exit_code_on_failure=False)
        finally:
            with _switch:
                _current[0] = None
    # between runs SIGINT/SIGTERM end the worker (capture_interrupts leaves both on the SIGINT handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def _sigterm_as_interrupt(signum, frame) -> None:
    """SIGTERM (``docker stop``, a system shutdown) interrupts the run like SIGINT -- it ends as
    failed (no termination was requested), with its event log closed -- instead of the worker
    vanishing mid-step."""
    os.kill(os.getpid(), signal.SIGINT)


def _recorded(instance, run_id: str):
    """Run ``run_id`` once the launcher has recorded this worker on it (its pid tag; up to
    :data:`TAG_WAIT_S`): the run storage rewrites a run's whole record on every change, so the
    launcher's tag written beside this worker's status writes was lost (run monitoring and
    terminate then had no pid)."""
    deadline = time.monotonic() + TAG_WAIT_S
    run = instance.get_run_by_id(run_id)
    while run is not None and run.tags.get(PID_TAG) != str(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.01)
        run = instance.get_run_by_id(run_id)
    return run


def _watch_cancel(instance) -> None:
    """Thread of a run worker: on each ``CANCEL_SIGNAL``, interrupt (SIGINT to the main thread,
    which Dagster records as a cancelled run) the run this worker executes if its termination
    was requested (status CANCELING or CANCELED); otherwise the signal was for a run that has
    ended (a late terminate of this worker's last run) and is dropped."""
    from dagster import DagsterRunStatus

    main = threading.main_thread().ident
    assert main is not None
    while True:
        signal.sigwait({CANCEL_SIGNAL})
        with _switch:  # the main thread does not move to another run meanwhile
            rid = _current[0]
            try:
                run = instance.get_run_by_id(rid) if rid is not None else None
            except Exception:  # the storage failing: the run's own end reports it
                continue
            if run is not None and run.status in (DagsterRunStatus.CANCELING, DagsterRunStatus.CANCELED):
                signal.pthread_kill(main, signal.SIGINT)


class WorkerHandle:
    """For ``ForkRunLauncher``: a worker process, the launcher's end of its pipe (None for one-run
    workers), the run it executes and how many it was given."""

    def __init__(self, proc: multiprocessing.process.BaseProcess, conn: Any) -> None:
        self.proc = proc
        self.conn = conn
        self.run_id: str | None = None
        self.runs = 0
        self.idle_since = 0.0

    def close(self, process: bool = False) -> None:
        """Close this end of the pipe, and with ``process`` the process handle (it has exited)."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if process:
            self.proc.close()
