"""The runs of one ``phantora-assets build`` on a Dagster instance: created from the code
location's jobs, started by :class:`~phantora_assets.instance.ForkRunLauncher` (``fork``), at most
``jobs`` at once; a dead worker or a stop interrupts the others and records every run; runs an
earlier build left unfinished are closed (:func:`reap_stale_runs`). Used by ``cli/build.py``."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections import deque
from typing import Any

from phantora_assets.instance.launcher import PID_TAG, process_start_time

#: Seconds an interrupted worker gets to close its run before it is killed.
GRACE_S = 5.0
#: Runs one forked worker executes one after the other (``ForkRunLauncher.runs_per_worker``): a
#: fresh fork per run spent ~5 s more system CPU per build on copy-on-write faults.
RUNS_PER_WORKER = 8
#: Value of the run tag ``phantora/launched_by`` on the build's runs.
BUILD_TAG = "phantora-assets build"
#: Run tags naming the build that created a run: its pid and the kernel's start time of that pid
#: (:func:`reap_stale_runs` leaves the runs of a build that still runs alone).
BUILD_PID_TAG, BUILD_START_TAG = "phantora/build_pid", "phantora/build_start"
#: The code location the runs' workers load (as ``dagster dev`` and ``workspace.yaml`` do).
CODE_MODULE = "phantora_assets.definitions"
#: Run config of the build's runs: Dagster's console logger quiet (the event log keeps everything).
QUIET_LOGS = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


class BuildAborted(Exception):
    """A run worker died or the build was interrupted; the message says which and how."""


class BuildFault(BuildAborted):
    """A run worker ended on a resource fault (a full disk, a read-only data root: ``lib/faults``)
    that its run could not record; ``fault`` is it, ``what`` the run (its partition or job)."""

    def __init__(self, what: str, fault) -> None:
        super().__init__(f"run {what}: {fault.rule}")
        self.what, self.fault = what, fault


def _user_error(err) -> str:
    """The first line of the outermost error that is not Dagster's wrapper (e.g. ``TraceFormatError:
    <file>: <rule>: ...``): the file and rule the user needs, not "Error occurred while executing op"."""
    while str(getattr(err, "cls_name", "")).startswith("Dagster") and getattr(err, "cause", None) is not None:
        err = err.cause
    lines = str(err.message).strip().splitlines()
    return lines[0] if lines else str(err.cls_name)


def run_step_errors(instance, run_id: str) -> list[str]:
    """``"<step>: <root cause>"`` for every failed step of run ``run_id`` (from its event log)."""
    from dagster import DagsterEventType

    out = []
    for rec in instance.all_logs(run_id, of_type=DagsterEventType.STEP_FAILURE):
        ev = rec.dagster_event
        err = getattr(ev.event_specific_data, "error", None) if ev else None
        if ev is not None and err is not None:
            out.append(f"{ev.step_key}: {_user_error(err)}")
    return out


class BuildRuns:
    """The runs of one build on ``instance``: created from ``defs``' jobs, started by a
    ForkRunLauncher, at most ``jobs`` at once."""

    def __init__(self, instance, defs, jobs: int) -> None:
        from dagster._core.definitions.reconstruct import ReconstructableRepository

        from phantora_assets.instance import ForkRunLauncher

        self.instance = instance
        self.defs = defs
        self.jobs = max(1, jobs)
        self.repo = ReconstructableRepository.for_module(CODE_MODULE, "defs")
        self.launcher = ForkRunLauncher(start_method="fork", runs_per_worker=RUNS_PER_WORKER)
        self.launcher.prune = False  # this loop holds the handles and forgets each once it has seen it end
        self.launcher.register_instance(instance)
        self.running: dict[str, Any] = {}  # run_id -> the worker's process handle
        self.created: list[str] = []  # every run this build created, in order
        # run tag phantora/build_id: finds a run whose creation a signal cut short
        self.build_id = uuid.uuid4().hex[:12]
        pid = os.getpid()
        self.identity = {
            "phantora/build_id": self.build_id,
            BUILD_PID_TAG: str(pid),
            BUILD_START_TAG: process_start_time(pid) or "",
        }

    def create(self, job_name: str, partition: str | None, selection=None):
        import dagster as dg

        from phantora_assets.assets.common import seed_run_partitions

        job = self.defs.resolve_job_def(job_name)
        if selection is not None:
            job = job.get_subset(asset_selection=selection)
        tags = {"dagster/partition": partition} if partition else {}
        if partition and isinstance(job.partitions_def, dg.DynamicPartitionsDefinition):
            seed_run_partitions(self.instance, [partition])  # a key of the run partitions (dynamic)
        return self.instance.create_run_for_job(
            job_def=job,
            run_config=QUIET_LOGS,
            tags={**job.tags, **tags, "phantora/launched_by": BUILD_TAG, **self.identity},
            asset_selection=frozenset(selection) if selection is not None else None,
            job_code_origin=self.repo.get_reconstructable_job(job_name).get_python_origin(),
        )

    def _start(self, run) -> None:
        from dagster._core.events import DagsterEvent, DagsterEventType
        from dagster._core.launcher import LaunchRunContext

        self.instance.report_dagster_event(
            DagsterEvent(event_type_value=DagsterEventType.PIPELINE_STARTING.value, job_name=run.job_name),
            run_id=run.run_id,
        )
        self.launcher.launch_run(LaunchRunContext(dagster_run=self.instance.get_run_by_id(run.run_id), workspace=None))
        self.running[run.run_id] = self.launcher._processes[run.run_id]

    def run_all(self, items: list[tuple[str, str | None, Any]]) -> dict[str, Any]:
        """Create and execute one run per ``(job, partition, selection)``; return the finished
        runs by partition (or job name). Raises BuildAborted when a worker dies."""
        todo = deque(items)
        done: dict[str, Any] = {}
        keys: dict[str, str] = {}
        ready: deque = deque()
        self.ready = ready  # runs created ahead, while the workers compute
        while todo or ready or self.running:
            while (todo or ready) and len(self.running) < self.jobs:
                run = ready.popleft() if ready else self._create_item(todo.popleft(), keys)
                self._start(run)
            if todo and not ready:
                ready.append(self._create_item(todo.popleft(), keys))
            if not self.running:
                continue
            for rid in self.launcher.wait_finished(timeout=1.0):
                del self.running[rid]
                code = self.launcher.worker_exitcode(rid)
                self.launcher.forget(rid)
                run = self.instance.get_run_by_id(rid)
                if not run.is_finished:
                    self._worker_died(run, 1 if code is None else code)
                done[keys[rid]] = run
        return done

    def _create_item(self, item: tuple[str, str | None, Any], keys: dict[str, str]):
        job_name, partition, selection = item
        run = self.create(job_name, partition, selection)
        self.created.append(run.run_id)
        keys[run.run_id] = partition or job_name
        return run

    def _worker_died(self, run, code: int) -> None:
        what = run.tags.get("dagster/partition", run.job_name)
        fault = self.launcher.faults.pop(run.run_id, None)
        if fault is not None:  # the worker said why (worker.FAULT_EXIT): the run is recorded if it can be
            from phantora_assets.lib.faults import ResourceFault

            try:
                self.instance.report_run_failed(run, f"run worker ended on a resource fault: {fault[0]} ({fault[2]})")
            except Exception:  # the instance is on the full disk too: the build's line says it
                pass
            raise BuildFault(what, ResourceFault(*fault))
        how = f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
        msg = f"run worker of {what} (pid {run.tags.get(PID_TAG)}) was {how} before its run ended"
        self.instance.report_run_failed(run, msg)
        _free_slots(self.instance, run.run_id)
        raise BuildAborted(msg)

    def stop(self, why: str) -> None:
        """Interrupt every running worker, kill those still alive after GRACE_S, and mark their
        runs cancelled (or failed) on the instance."""
        # every worker this build started, also one whose start a signal cut short
        procs = {**self.launcher._processes, **self.running}
        for p in self.launcher.workers():
            if p.exitcode is None and p.pid is not None:
                os.kill(p.pid, signal.SIGINT)
        deadline = time.monotonic() + GRACE_S
        for p in self.launcher.workers():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.kill()
                p.join(5)
        import dagster as dg

        mine = self.instance.get_runs(
            filters=dg.RunsFilter(
                tags={"phantora/build_id": self.build_id}, statuses=[dg.DagsterRunStatus(x) for x in UNFINISHED]
            )
        )
        for rid in dict.fromkeys([*procs, *self.created, *(r.run_id for r in mine)]):
            run = self.instance.get_run_by_id(rid)
            if run is not None and not run.is_finished:
                self.instance.report_run_canceled(run, f"build stopped: {why}")
            _free_slots(self.instance, rid)
        for rid in procs:
            self.launcher.forget(rid)
        self.running.clear()
        self.ready.clear()


def _free_slots(instance, run_id: str) -> None:
    """Give back the pool slots (``phantora_simulation``) a run that did not end by itself holds:
    a killed worker never releases them, and two such runs would block every later simulation."""
    try:
        instance.event_log_storage.free_concurrency_slots_for_run(run_id)
    except Exception:  # storages without global concurrency support
        pass


#: Run statuses of runs that have not ended.
UNFINISHED = ("NOT_STARTED", "QUEUED", "STARTING", "STARTED", "CANCELING")


def build_alive(run) -> bool:
    """Whether the build that created ``run`` still runs: the pid of its ``phantora/build_pid``
    tag lives with the start time of its ``phantora/build_start`` tag (a reused pid is not taken
    for it). False for a run without these tags (made by an older version)."""
    pid = run.tags.get(BUILD_PID_TAG)
    if not pid or not pid.isdigit():
        return False
    started = process_start_time(int(pid))
    return started is not None and started == run.tags.get(BUILD_START_TAG, started)


def reap_stale_runs(instance) -> list[str]:
    """Close the runs an earlier build left unfinished (killed with SIGKILL, its terminal closed):
    a run of ``phantora-assets build`` whose build is gone (:func:`build_alive`) and whose worker
    is gone (or never started) is marked failed and its pool slots are freed, so that it neither
    blocks the dataset automation (which waits for runs in progress) nor holds a simulation slot
    forever. The runs of a build that still runs (one started beside this one) are left alone,
    also those it created ahead and has not launched yet. Returns their run ids."""
    import dagster as dg

    from phantora_assets.instance import ForkRunLauncher

    probe = ForkRunLauncher(start_method="fork")
    probe.register_instance(instance)
    reaped = []
    statuses = [dg.DagsterRunStatus(s) for s in UNFINISHED]
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=statuses, tags={"phantora/launched_by": BUILD_TAG})):
        if build_alive(run) or probe._alive(run):
            continue
        instance.report_run_failed(run, "left unfinished by an interrupted phantora-assets build (its worker is gone)")
        _free_slots(instance, run.run_id)
        reaped.append(run.run_id)
    return reaped
