"""A Dagster run launcher that starts each run in a process forked from a pre-imported one.

Dagster's ``DefaultRunLauncher`` asks the code server to start every run in a freshly spawned
interpreter, which imports Dagster, pandas, pyarrow and this package again (about 2.5 s of CPU a
run on a 2-core machine, more than most of our partitions compute). :class:`ForkRunLauncher`
implements Dagster's own ``RunLauncher`` interface instead: the first launch starts a
``multiprocessing`` forkserver that imports ``preload`` once; every run is then a fork of it that
executes the run exactly as ``dagster api execute_run`` does (same events, same run statuses, the
steps of the run in the job's executor: in process for the per-run jobs).

Configure it in ``dagster.yaml``::

    run_launcher:
      module: phantora_assets.instance
      class: ForkRunLauncher
      config:
        start_method: forkserver        # or fork (from the launching process), spawn
        preload: [phantora_assets.instance.warm]   # the code location and what its runs import

Run workers record their pid (run tags ``phantora/run_worker_pid`` and ``.../run_worker_start``,
the kernel's start time of that pid) so that run monitoring (``run_monitoring: enabled: true``)
fails a run whose worker was killed (``kill -9``, the OOM killer) instead of leaving it STARTED
forever. ``terminate`` marks the run CANCELING and sends its worker SIGUSR1: the worker
interrupts the run it executes only when that run is one whose termination was requested (a reused
worker's next run is never hit by a late terminate of its last one), and a run terminated before its
worker started it ends CANCELED without running (a SIGTERM to the worker, e.g. a system shutdown,
ends the run as failed, with its event log closed). Workers
are forked from the forkserver, which runs in a session of its own (``instance/forkserver.py``), not
from the daemon, so they finish their runs when the daemon or its whole process group is killed.
Each run executes with the launching process's environment as of its launch (handed to the
worker with the run: a forkserver started at the first launch, or a reused worker, does not keep
the environment of then), and its worker (``instance/worker.py``) drops the Definitions the code
location's loader (``phantora_assets.definitions.defs``) made when the run matrix, the import registry
or the ``PHANTORA_ASSETS_*`` environment changed since, so they are seen without restarting the daemon; a
change to the package's own code needs a daemon restart (the forkserver holds the imported code).

Linux/macOS only (fork). Errors: a run without a job code origin cannot be launched
(``DagsterLaunchFailedError``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from dagster import Array, Field, IntSource, StringSource
from dagster._core.errors import DagsterLaunchFailedError
from dagster._core.launcher.base import CheckRunHealthResult, LaunchRunContext, RunLauncher, WorkerStatus
from dagster._core.storage.dagster_run import DagsterRun, DagsterRunStatus
from dagster._serdes import ConfigurableClass, ConfigurableClassData, serialize_value

from phantora_assets.instance.worker import (  # PID_TAG, START_TAG: the run tags this launcher writes
    CANCEL_SIGNAL,
    HELD_SIGNALS,
    PID_TAG,
    START_TAG,
    process_start_time,
    run_worker,
    signals_deferred,
)
from phantora_assets.instance.worker import (
    WorkerHandle as _Worker,
)

#: Seconds an idle worker has to acknowledge the run it is handed (else a new worker is forked).
ACK_TIMEOUT_S = 2.0
#: Seconds a launch waits for a busy reusable worker to report its run ended before it forks.
REPORT_WAIT_S = 0.5
DEFAULT_PRELOAD = ("phantora_assets.instance.warm",)
START_METHODS = ("forkserver", "fork", "spawn")


class ForkRunLauncher(RunLauncher, ConfigurableClass):
    """Launch each run in a process forked from a pre-imported one (see the module docstring).

    Args:
        start_method: ``forkserver`` (default: a clean single-threaded server process that
            imported ``preload``), ``fork`` (fork the launching process itself: for a launcher
            owned by a single-threaded process such as ``phantora-assets build``) or ``spawn``
            (a fresh interpreter per run, like Dagster's default).
        preload: modules the forkserver imports once.
        runs_per_worker: runs one worker process executes, one after the other, before it exits
            (1: a fresh fork per run). More saves a fork, a new instance and the copy-on-write
            faults of a fresh process (it copies its parent's heap page by page as it touches
            it) per run. A worker's next run is handed over at a launch, once the worker has
            reported its last run ended (collected at every launch, or by :meth:`wait_finished`).
        idle_timeout_seconds: a reusable worker without a run for this long exits.
    """

    def __init__(
        self,
        inst_data: ConfigurableClassData | None = None,
        start_method: str = "forkserver",
        preload: Sequence[str] = DEFAULT_PRELOAD,
        runs_per_worker: int = 1,
        idle_timeout_seconds: float = 60.0,
    ) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method {start_method!r}: expected one of {', '.join(START_METHODS)}")
        if runs_per_worker < 1:
            raise ValueError(f"runs_per_worker must be >= 1, got {runs_per_worker}")
        self._inst_data = inst_data
        self.start_method = start_method
        self.preload = tuple(preload)
        self.runs_per_worker = runs_per_worker
        self.idle_timeout_seconds = float(idle_timeout_seconds)
        self._lock = threading.RLock()  # the daemon's run queue may launch from threads
        self._ended: list[str] = []  # runs seen ending at a launch, for wait_finished
        self._processes: dict[str, multiprocessing.process.BaseProcess] = {}
        self._busy: dict[str, _Worker] = {}  # run_id -> the worker executing it (owner-collected)
        self.faults: dict[str, tuple] = {}  # run_id -> (rule, path, detail) its worker ended on
        self._idle: list[_Worker] = []
        self._retired: list[_Worker] = []  # ended (their last run, or died), not yet reaped
        #: close the handles of finished workers at the next launch (False: the owner calls forget)
        self.prune = True
        self._mp: Any = None
        super().__init__()

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self._inst_data

    @classmethod
    def config_type(cls) -> dict:
        return {
            "start_method": Field(StringSource, is_required=False, default_value="forkserver"),
            "preload": Field(Array(str), is_required=False, default_value=list(DEFAULT_PRELOAD)),
            "runs_per_worker": Field(IntSource, is_required=False, default_value=1),
            "idle_timeout_seconds": Field(IntSource, is_required=False, default_value=60),
        }

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]) -> ForkRunLauncher:
        return cls(inst_data=inst_data, **config_value)

    def _context(self):
        if self._mp is None:
            ctx = multiprocessing.get_context(self.start_method)
            if self.start_method == "forkserver":
                ctx.set_forkserver_preload(["phantora_assets.instance.forkserver", *self.preload])
            self._mp = ctx
        return self._mp

    def launch_run(self, context: LaunchRunContext) -> None:
        from dagster._core.events import EngineEventData

        run = context.dagster_run
        if run.job_code_origin is None:
            raise DagsterLaunchFailedError(f"run {run.run_id} has no job code origin: ForkRunLauncher cannot start it")
        if self.prune:
            self._prune()  # handles of finished workers hold two descriptors each
        # signals held until the worker is recorded: a handler that raises (the build's Ctrl-C /
        # SIGTERM) right after the fork would leave a worker no list holds, which a build's stop
        # neither interrupts nor kills (it ran its run on, and the build's exit waited for it)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
        try:
            with signals_deferred(), self._lock:
                worker = self._hand_over(run.run_id) or self._fork(run.run_id)
                worker.run_id, worker.runs = run.run_id, worker.runs + 1
                self._busy[run.run_id] = worker
                self._processes[run.run_id] = worker.proc
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        pid = int(worker.proc.pid or 0)  # tagged on the run before the worker runs it (_hand_over, _fork)
        if (self._instance.get_run_by_id(run.run_id) or run).status == DagsterRunStatus.CANCELING:
            os.kill(pid, CANCEL_SIGNAL)  # terminated while it was handed over: its terminate saw no pid
        self._instance.report_engine_event(
            f"Run worker started (pid {pid}, {self.start_method} from a pre-imported process).",
            run,
            EngineEventData.in_process(pid),
        )

    def _fork(self, run_id: str) -> _Worker:
        ref = serialize_value(self._instance.get_ref())
        inherited = self._instance if self.start_method == "fork" else None
        ctx = self._context()
        conn = child = None
        if self.runs_per_worker > 1:
            conn, child = ctx.Pipe()
        proc = ctx.Process(
            target=run_worker,
            args=(run_id, ref, inherited, child, self.runs_per_worker, self.idle_timeout_seconds, dict(os.environ)),
            name=f"dagster-run-{run_id[:8]}",
        )
        # a signal handler that raises (the build's Ctrl-C / SIGTERM) must not run inside fork's
        # at-fork hooks, where Python prints and swallows the exception: held until the fork is done
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        self._tag(run_id, int(proc.pid or 0))  # the worker waits for it before it executes the run
        if child is not None:
            child.close()
        # not one of this process's children for multiprocessing's exit handler: a daemon that
        # stops must neither wait for its runs nor terminate them (they finish on their own)
        multiprocessing.process._children.discard(proc)  # type: ignore[attr-defined]
        return _Worker(proc, conn)

    def _hand_over(self, run_id: str) -> _Worker | None:
        """An idle worker that acknowledged ``run_id`` as its next run, or None (fork a new one).
        With none idle, waits up to ``REPORT_WAIT_S`` for a busy one to report: a launch usually
        follows a run's end (its slot freed), which its worker reports a moment later."""
        self._collect(0)
        if not self._idle and self.prune and self.runs_per_worker > 1 and self._a_busy_run_ended():
            self._collect(REPORT_WAIT_S)  # its worker reports in a moment (an owner that collects knows)
        while self._idle:
            w = self._idle.pop()
            try:
                self._tag(run_id, int(w.proc.pid or 0))  # before the worker has it: no write beside its own
                w.conn.send((run_id, dict(os.environ)))  # the run sees this environment, not the worker's
                if w.conn.poll(ACK_TIMEOUT_S) and w.conn.recv() == ("ack", run_id):
                    return w
            except (EOFError, OSError):
                pass
            # gone, or too slow to acknowledge (stopped, starved): killed, so that it never takes the
            # run id waiting on its pipe and runs it beside the worker forked for it (the run's pid
            # tag would name the other one: run monitoring and terminate would miss it)
            if w.proc.exitcode is None:
                w.proc.kill()
                w.proc.join(1.0)
            self._retired.append(w)
        return None

    def _tag(self, run_id: str, pid: int) -> None:
        """Record ``pid`` (and its start time) as the worker of run ``run_id`` (the run storage
        rewrites the whole run record: a write beside the worker's own status writes lost one)."""
        self._instance.add_run_tags(run_id, {PID_TAG: str(pid), START_TAG: process_start_time(pid) or ""})

    def _a_busy_run_ended(self) -> bool:
        """Whether the instance records a run of a busy worker as ended (that worker is about to
        report and take the next run); one run-storage query per busy worker."""
        for rid in list(self._busy):
            run = self._instance.get_run_by_id(rid)
            if run is None or run.is_finished:
                return True
        return False

    def _collect(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for busy workers to report their run ended or to exit; their
        runs go to ``_ended``, reusable workers with runs left to ``_idle``."""
        from multiprocessing.connection import wait

        busy = list(self._busy.items())
        if not busy:
            return
        if timeout:
            wait([w.conn for _, w in busy if w.conn is not None] + [w.proc.sentinel for _, w in busy], timeout)
        for rid, w in busy:
            reported = False
            try:
                while w.conn is not None and w.conn.poll():
                    msg = w.conn.recv()
                    reported = reported or msg == ("done", rid)
                    if isinstance(msg, tuple) and len(msg) == 3 and msg[0] == "fault":
                        self.faults[msg[1]] = msg[2]  # (rule, path, detail): worker.FAULT_EXIT follows
            except (EOFError, OSError):
                pass
            if not reported and w.proc.exitcode is None:
                continue
            self._ended.append(rid)
            del self._busy[rid]
            w.run_id, w.idle_since = None, time.monotonic()
            if reported and w.runs < self.runs_per_worker and w.proc.exitcode is None:
                self._idle.append(w)
            else:
                self._retired.append(w)
        # idle workers past their time have left by themselves (or will): not handed a run
        late = time.monotonic() - max(self.idle_timeout_seconds - ACK_TIMEOUT_S, self.idle_timeout_seconds / 2)
        self._retired += [w for w in self._idle if w.idle_since < late]
        self._idle = [w for w in self._idle if w.idle_since >= late]

    def wait_finished(self, timeout: float) -> list[str]:
        """Wait up to ``timeout`` s for runs this launcher started to end; return the run ids of
        those that ended since the last call: the worker reported the run ended, or the worker
        is gone (then :meth:`worker_exitcode` says how). For an owner that collects its runs
        (``prune = False``)."""
        with self._lock:
            if not self._ended:
                self._collect(timeout)
            ended, self._ended = self._ended, []
        return ended

    def workers(self) -> list[multiprocessing.process.BaseProcess]:
        """Every worker process this launcher holds a handle of (busy, idle or ended)."""
        procs = {id(p): p for p in self._processes.values()}
        procs.update({id(w.proc): w.proc for w in self._idle})
        return list(procs.values())

    def shutdown(self, timeout: float = 5.0) -> None:
        """End the idle reusable workers (told to stop on their pipe) and wait for them and for
        the workers that ended (reaped: no zombies, and their CPU time counts as this process's
        children's)."""
        idle, self._idle = self._idle, []
        retired, self._retired = self._retired, []
        for w in idle:
            if w.conn is not None:
                try:
                    w.conn.send(None)
                except OSError:  # it is gone already
                    pass
            w.close()
        for w in idle + retired:
            w.proc.join(timeout)
            w.close(process=w.proc.exitcode is not None)

    def worker_exitcode(self, run_id: str) -> int | None:
        """The exit code of the worker this launcher started for ``run_id`` (negative: killed by
        that signal), or None while it runs or when this launcher did not start it."""
        proc = self._processes.get(run_id)
        return None if proc is None else proc.exitcode

    def _alive(self, run: DagsterRun) -> bool | None:
        """Whether the run's worker runs: this launcher's own process handle when it says so, else
        the recorded pid with its recorded start time (a forkserver that died makes its handles
        report exit code 255 for workers that still run)."""
        proc = self._processes.get(run.run_id)
        if proc is not None and proc.is_alive():
            return True
        pid = run.tags.get(PID_TAG)
        if not pid:
            return None if proc is None else False
        started = process_start_time(int(pid))
        return started is not None and started == run.tags.get(START_TAG, started)

    def forget(self, run_id: str) -> None:
        """Drop the process handle of run ``run_id`` (the worker's own handle is closed once it
        has exited: at the next launch, or :meth:`shutdown`)."""
        self._processes.pop(run_id, None)

    def _prune(self) -> None:
        """Forget the runs that ended (nobody collects them: ``prune = True``, the daemon) and
        close the handles of workers that exited."""
        with self._lock:
            self._collect(0)
            ended, self._ended = self._ended, []
            for run_id in ended + [r for r, p in self._processes.items() if p.exitcode is not None]:
                self._busy.pop(run_id, None)
                self.forget(run_id)
            left = [w for w in self._retired if w.proc.exitcode is None]
            for w in self._retired:
                if w.proc.exitcode is not None:
                    w.close(process=True)
            self._retired = left

    def terminate(self, run_id: str) -> bool:
        """Request the termination of run ``run_id``: mark it CANCELING and send its worker
        ``CANCEL_SIGNAL``, which interrupts the run the worker executes if that is a run whose
        termination was requested. A run STARTING whose worker is not recorded yet (being handed
        over or forked) is marked too: its worker, or this launcher's ``launch_run``, sees it and
        cancels it before it runs. False: the run has ended, or its worker is gone."""
        run = self._instance.get_run_by_id(run_id)
        alive = None if run is None else self._alive(run)  # None: no worker recorded (yet)
        if run is None or run.is_finished or alive is False or (alive is None and run.status.value != "STARTING"):
            return False
        self._instance.report_run_canceling(run)
        pid = (self._instance.get_run_by_id(run_id) or run).tags.get(PID_TAG)  # tagged since?
        try:
            if pid:
                os.kill(int(pid), CANCEL_SIGNAL)
        except ProcessLookupError:
            return False
        return True

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        alive = self._alive(run)
        pid = run.tags.get(PID_TAG)
        if alive is None:
            return CheckRunHealthResult(WorkerStatus.UNKNOWN, "no run worker pid recorded")
        if alive:
            return CheckRunHealthResult(WorkerStatus.RUNNING, run_worker_id=pid)
        code = self.worker_exitcode(run.run_id)
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        if code is None:
            how = "the process is gone"
        return CheckRunHealthResult(WorkerStatus.FAILED, f"run worker (pid {pid}) ended before the run did: {how}")

    def dispose(self) -> None:
        self.shutdown(timeout=0)
        self._processes.clear()
        self._busy.clear()
