"""Issue 12: ``phantora-assets build`` is Dagster runs on a persistent instance, started by the
project's run launcher; a killed run worker or Ctrl-C ends the build within seconds.

Everything is real: the build runs as a subprocess (its own session), the instance is the SQLite
one the build makes under the data root, workers are killed with real signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
from fixtures.paths import ROOT

from phantora_assets.instance.launcher import PID_TAG, ForkRunLauncher, process_start_time

FITS, NO_FIT = "phantora_l40s_W1_2x1", "phantora_l40s_W5_2x1"
SLOW = ["phantora_a100_40g_W1_4x2", "phantora_a100_40g_W2_4x2", "phantora_a100_40g_W3_4x2", "phantora_a100_40g_W4_4x2"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "PHANTORA_ASSETS_DATA_DIR")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _build(root: Path, runs: list[str], **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "phantora_assets.cli", "build", "--data-dir", str(root), "--no-plots"]
    for r in runs:
        cmd += ["--run", r]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


def _instance(root: Path) -> dg.DagsterInstance:
    """The build's instance, opened under the lock the build creates it under (Dagster's SQLite
    storages are not safe to set up from two processes at once)."""
    import fcntl

    home = root / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".phantora_init.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return dg.DagsterInstance.from_config(str(home))


def _project_home(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """``(home, data)``: a DAGSTER_HOME holding the project's dagster.yaml and a data root, both under
    ``tmp_path``, set as ``$DAGSTER_HOME`` and ``$PHANTORA_ASSETS_DATA_DIR``."""
    home, data = tmp_path / "home", tmp_path / "data"
    home.mkdir()
    (home / "dagster.yaml").write_text((ROOT / "dagster.yaml").read_text())
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("PHANTORA_ASSETS_DATA_DIR", str(data))
    return home, data


def _first_worker(root: Path, proc: subprocess.Popen, timeout: float = 120.0) -> tuple[str, int]:
    """(run_id, pid) of the first all_runs run whose worker has started."""
    t0 = time.monotonic()
    while not (root / "dagster_home" / "dagster.yaml").exists() and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, proc.communicate()
        with _instance(root) as inst:
            for r in inst.get_runs():
                if r.job_name == "all_runs" and r.tags.get(PID_TAG) and not r.is_finished:
                    return r.run_id, int(r.tags[PID_TAG])
        time.sleep(0.1)
    raise AssertionError("no run worker started")


def test_build_records_its_runs_and_materializations_in_the_data_roots_instance(tmp_path: Path) -> None:
    root = tmp_path / "data"
    proc = _build(root, [FITS, NO_FIT])
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    assert f"{NO_FIT:34s} analytic out of memory: does not fit: estimated peak" in out
    with _instance(root) as inst:
        runs = {(r.job_name, r.tags.get("dagster/partition")): r for r in inst.get_runs()}
        assert set(runs) == {
            ("perf_dbs", "l40s"),
            ("all_runs", FITS),
            ("all_runs", NO_FIT),
            ("dataset", None),
        }
        # every run green: the configuration that does not fit is a successful run too
        assert {r.status for r in runs.values()} == {dg.DagsterRunStatus.SUCCESS}
        assert all(r.job_code_origin is not None for r in runs.values())  # re-executable from the UI
        summary = inst.fetch_materializations(dg.AssetKey("run_summary"), limit=10).records
        # the configuration that does not fit reads "not applicable" (with the reason), not "Missing"
        status = {m.partition_key: m.asset_materialization.metadata.get("status") for m in summary}
        assert set(status) == {FITS, NO_FIT}
        assert status[NO_FIT] == dg.TextMetadataValue("not_applicable") and status[FITS] is None
        raw = {m.partition_key for m in inst.fetch_materializations(dg.AssetKey("raw_timeline"), limit=10).records}
        assert raw == {FITS, NO_FIT}
        assert inst.fetch_materializations(dg.AssetKey("phantora_v0"), limit=10).records
        # the asset status the UI shows: materialized partitions of run_summary
        # both partitions read materialized: the one that does not fit as "not applicable" (above)
    assert inst.get_materialized_partitions(dg.AssetKey("run_summary")) == {FITS, NO_FIT}


def _signalled_build(root: Path, send) -> tuple[str, int, subprocess.Popen, str, str, float]:
    """Start a build of SLOW in its own session, call ``send(proc, run_id, pid)`` once its first
    run worker runs, and wait for the build to end: (run_id, pid, proc, stdout, stderr, seconds it
    took to end after the signal). The session is killed if it outlives the 30 s timeout."""
    proc = _build(root, SLOW, start_new_session=True)
    try:
        run_id, pid = _first_worker(root, proc)
        send(proc, run_id, pid)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
        return run_id, pid, proc, out, err, time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_killed_run_worker_ends_the_build_within_seconds_with_a_message(tmp_path: Path) -> None:
    root = tmp_path / "data"
    run_id, pid, proc, out, err, elapsed = _signalled_build(root, lambda _p, _r, pid: os.kill(pid, signal.SIGKILL))
    assert proc.returncode == 1, out + err
    assert elapsed < 15, elapsed
    assert f"(pid {pid}) was killed by signal 9 (SIGKILL) before its run ended" in err
    with _instance(root) as inst:
        killed = inst.get_run_by_id(run_id)
        assert killed is not None and killed.status == dg.DagsterRunStatus.FAILURE
        # no run is left in progress: the others were interrupted and recorded
        assert not [r for r in inst.get_runs() if not r.is_finished]


def test_ctrl_c_ends_the_build_within_seconds_and_cancels_its_runs(tmp_path: Path) -> None:
    root = tmp_path / "data"

    def ctrl_c(proc, _run_id, _pid):
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole foreground group

    run_id, _pid, proc, out, err, elapsed = _signalled_build(root, ctrl_c)
    assert proc.returncode == 130, out + err
    assert elapsed < 15, elapsed
    assert "build stopped: interrupted (Ctrl-C / SIGINT)" in err
    with _instance(root) as inst:
        assert not [r for r in inst.get_runs() if not r.is_finished]
        assert inst.get_run_by_id(run_id).status in (dg.DagsterRunStatus.CANCELED, dg.DagsterRunStatus.FAILURE)
    # nothing half-written: no temporary file is left under the data root
    assert not [p for p in root.rglob("*.tmp")]


def test_worker_health_follows_the_pid_and_its_start_time(tmp_path: Path) -> None:
    """check_run_worker_health (what run monitoring asks) for a run launched elsewhere: RUNNING while
    the recorded pid is alive with the recorded start time, FAILED once it is gone or reused."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with dg.DagsterInstance.ephemeral() as inst:
            launcher = ForkRunLauncher()
            launcher.register_instance(inst)
            start = process_start_time(child.pid)
            assert start is not None
            run = dg.DagsterRun(job_name="x", tags={PID_TAG: str(child.pid), "phantora/run_worker_start": start})
            assert launcher.check_run_worker_health(run).status.value == "RUNNING"
            reused = dg.DagsterRun(job_name="x", tags={PID_TAG: str(child.pid), "phantora/run_worker_start": "1"})
            assert launcher.check_run_worker_health(reused).status.value == "FAILED"
            child.kill()
            child.wait()
            assert launcher.check_run_worker_health(run).status.value == "FAILED"
            assert launcher.check_run_worker_health(dg.DagsterRun(job_name="x")).status.value == "UNKNOWN"
    finally:
        child.kill()


def test_launcher_refuses_an_unknown_start_method() -> None:
    with pytest.raises(ValueError, match="start_method 'threads'"):
        ForkRunLauncher(start_method="threads")


def test_sigterm_stops_the_build_like_ctrl_c(tmp_path: Path) -> None:
    """``timeout``, systemd or a CI cancel send SIGTERM: the build stops its workers, records its
    runs and exits 143, instead of dying and orphaning workers that keep writing."""
    root = tmp_path / "data"
    _, _, proc, out, err, _ = _signalled_build(root, lambda p, _r, _pid: p.send_signal(signal.SIGTERM))  # parent only
    assert proc.returncode == 143, out + err
    assert "build stopped: terminated (SIGTERM)" in err
    with _instance(root) as inst:
        assert not [r for r in inst.get_runs() if not r.is_finished]


def test_sighup_stops_the_build_with_exit_129(tmp_path: Path) -> None:
    """A closed terminal sends SIGHUP: the build stops like on SIGTERM (workers interrupted, runs
    recorded, nothing half-written) and exits 128 + 1 = 129, with a message naming the signal.
    Before, it exited 143 as if terminated."""
    root = tmp_path / "data"
    _, _, proc, out, err, elapsed = _signalled_build(root, lambda p, _r, _pid: p.send_signal(signal.SIGHUP))
    assert proc.returncode == 129, out + err
    assert elapsed < 15, elapsed
    assert "build stopped: hung up (SIGHUP: its terminal closed)" in err
    with _instance(root) as inst:
        assert not [r for r in inst.get_runs() if not r.is_finished]
    assert not [p for p in root.rglob("*.tmp")]


def test_the_next_build_closes_the_runs_a_killed_build_left_behind(tmp_path: Path) -> None:
    """kill -9 of the whole build leaves runs STARTED / NOT_STARTED on the instance (they would
    block the dataset automation and hold pool slots): the next build marks them failed."""
    root = tmp_path / "data"
    proc = _build(root, SLOW, start_new_session=True)
    try:
        _first_worker(root, proc)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    time.sleep(0.5)
    with _instance(root) as inst:
        left = {r.run_id for r in inst.get_runs() if not r.is_finished}
    assert left
    again = _build(root, [FITS])
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, out + err
    assert re.search(r"marked \d+ run\(s\) left unfinished by an interrupted build as failed", out), out + err
    with _instance(root) as inst:
        for rid in left:
            run = inst.get_run_by_id(rid)
            assert run is not None and run.status == dg.DagsterRunStatus.FAILURE
        assert not [r for r in inst.get_runs() if not r.is_finished]


def test_a_build_leaves_the_runs_of_a_build_that_still_runs_alone(tmp_path: Path, monkeypatch) -> None:
    """Two builds on one data root: the second one's start (reap_stale_runs) must not fail the
    first one's run that is created ahead but not launched yet (NOT_STARTED, no worker pid). Here
    this test process is the first build (its run made by the build's own BuildRuns.create), a real
    ``phantora-assets build`` the second. Before, the second build marked that run failed. A run
    whose build is gone (a pid that has exited) is still reaped."""
    from phantora_assets.cli.build import HOME_YAML
    from phantora_assets.cli.engine import BuildRuns, reap_stale_runs

    root = tmp_path / "data"
    home = root / "dagster_home"
    home.mkdir(parents=True)
    (home / "dagster.yaml").write_text(HOME_YAML)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("PHANTORA_ASSETS_DATA_DIR", str(root))
    import phantora_assets.definitions as d

    with _instance(root) as inst:
        runs = BuildRuns(inst, d.build_defs(root), 1)
        ahead = runs.create("perf_dbs", "h100")  # created ahead, not launched: no worker pid tag
        orphan = runs.create("perf_dbs", "h200")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with _instance(root) as inst:  # the orphan's build has exited
        inst.add_run_tags(orphan.run_id, {"phantora/build_pid": str(gone.pid), "phantora/build_start": "1"})
    other = _build(root, [FITS])
    out, err = other.communicate(timeout=600)
    assert other.returncode == 0, out + err
    assert "marked 1 run(s) left unfinished by an interrupted build as failed" in out, out + err
    with _instance(root) as inst:
        assert inst.get_run_by_id(ahead.run_id).status == dg.DagsterRunStatus.NOT_STARTED
        assert inst.get_run_by_id(orphan.run_id).status == dg.DagsterRunStatus.FAILURE
        assert reap_stale_runs(inst) == []  # this build still runs: its run is left alone


def test_a_forkserver_worker_takes_the_next_run_then_leaves(tmp_path: Path, monkeypatch) -> None:
    """The daemon's launcher (forkserver, runs_per_worker as in dagster.yaml): a worker whose run
    ended takes the next launch (same pid), a fresh worker follows after runs_per_worker runs, and
    a worker idle past idle_timeout_seconds is not handed a run (a new one is forked). Real runs of
    the perf_dbs job on a real SQLite instance."""

    from phantora_assets.cli.engine import BuildRuns

    home, data = _project_home(tmp_path, monkeypatch)
    import phantora_assets.definitions as d

    with dg.DagsterInstance.from_config(str(home)) as inst:
        runs = BuildRuns(inst, d.build_defs(data), 1)  # its run creation (code origin, tags) only
        launcher = ForkRunLauncher(start_method="forkserver", runs_per_worker=2, idle_timeout_seconds=3)
        launcher.register_instance(inst)

        def run_one(gpu: str) -> dg.DagsterRun:
            return _launch_to_end(inst, launcher, runs.create("perf_dbs", gpu), 60)

        try:
            pids = [run_one(g).tags[PID_TAG] for g in ("l40s", "h100", "h200")]
            assert pids[0] == pids[1] != pids[2]  # the second run in the first worker; two runs each
            time.sleep(4.5)  # the third worker is idle past its timeout and has left
            assert run_one("a100_40g").tags[PID_TAG] != pids[2]
        finally:
            launcher.dispose()
    assert (data / "perfdb" / "a100_40g" / "perf_db.json").is_file()


def test_a_reused_worker_runs_a_partition_added_since_its_last_run(tmp_path: Path, monkeypatch) -> None:
    """A run folder dropped into $PHANTORA_ASSETS_IMPORT_DIR after a worker's first run of
    all_runs: the same worker's next all_runs run is of the new partition. The worker re-executes
    the code location, and Dagster's cached job definition (ReconstructableJob.get_definition, an
    lru_cache keyed by the job's origin) must not outlive it: the run failed with "Nonexistent
    partition keys"."""
    from fixtures.run_folders import analytic, megatron_log, write_run_folder

    from phantora_assets.cli.engine import BuildRuns
    from phantora_assets.lib.run.spec import RunSpec

    home, data, imports = tmp_path / "home", tmp_path / "data", tmp_path / "imports"
    home.mkdir()
    imports.mkdir()
    (home / "dagster.yaml").write_text((ROOT / "dagster.yaml").read_text())
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("PHANTORA_ASSETS_DATA_DIR", str(data))
    monkeypatch.setenv("PHANTORA_ASSETS_IMPORT_DIR", str(imports))
    import phantora_assets.definitions as d

    with dg.DagsterInstance.from_config(str(home)) as inst:
        # fork (as the build does): a forkserver is one per process, with the environment of the
        # test that started it
        launcher = ForkRunLauncher(start_method="fork", runs_per_worker=2, idle_timeout_seconds=60)
        launcher.register_instance(inst)

        def run_one(partition: str) -> dg.DagsterRun:
            run = BuildRuns(inst, d.build_defs(data), 1).create("all_runs", partition)
            return _launch_to_end(inst, launcher, run, 120)

        try:
            first = run_one(FITS)
            spec, raw, its = analytic(RunSpec("W4", "h100", 2, 2))
            write_run_folder(imports, spec, raw, run_log=megatron_log(its, 4, 16000.0))
            second = run_one("phantora_h100_W4_2x2")
            assert first.tags[PID_TAG] == second.tags[PID_TAG]  # one worker, reused
        finally:
            launcher.dispose()


def test_a_worker_too_slow_to_acknowledge_never_runs_the_run(tmp_path: Path, monkeypatch) -> None:
    """An idle worker that does not acknowledge the run it is handed (here: stopped with SIGSTOP,
    continued once the launch has forked another worker) is killed: before, it read the run id
    waiting on its pipe when it woke and executed the run a second time (beside the worker whose
    pid the run's tag names, which monitoring and terminate then follow)."""
    from dagster._core.events import DagsterEvent, DagsterEventType
    from dagster._core.launcher import LaunchRunContext

    from phantora_assets.cli.engine import BuildRuns
    from phantora_assets.instance import launcher as launcher_mod

    monkeypatch.setattr(launcher_mod, "ACK_TIMEOUT_S", 0.5)
    home, data = _project_home(tmp_path, monkeypatch)
    import phantora_assets.definitions as d

    with dg.DagsterInstance.from_config(str(home)) as inst:
        runs = BuildRuns(inst, d.build_defs(data), 1)
        launcher = ForkRunLauncher(start_method="fork", runs_per_worker=4, idle_timeout_seconds=60)
        launcher.register_instance(inst)

        def launch(gpu: str) -> str:
            run = runs.create("perf_dbs", gpu)
            inst.report_dagster_event(
                DagsterEvent(event_type_value=DagsterEventType.PIPELINE_STARTING.value, job_name=run.job_name),
                run_id=run.run_id,
            )
            launcher.launch_run(LaunchRunContext(dagster_run=inst.get_run_by_id(run.run_id), workspace=None))
            return run.run_id

        def wait(run_id: str) -> dg.DagsterRun:
            t0 = time.monotonic()
            while not inst.get_run_by_id(run_id).is_finished:
                assert time.monotonic() - t0 < 60, "run did not end"
                time.sleep(0.1)
            return inst.get_run_by_id(run_id)

        try:
            slow = int(wait(launch("l40s")).tags[PID_TAG])
            time.sleep(1.0)  # it has reported its run ended: idle
            os.kill(slow, signal.SIGSTOP)
            try:
                run_id = launch("h100")
            finally:
                try:
                    os.kill(slow, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            run = wait(run_id)
            time.sleep(2.0)  # time for a woken worker to take the run id from its pipe
            assert run.status == dg.DagsterRunStatus.SUCCESS
            assert int(run.tags[PID_TAG]) != slow
            started = [
                r.user_message or r.dagster_event.message
                for r in inst.all_logs(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT)
                if "Started process for run" in (r.user_message or r.dagster_event.message or "")
            ]
            assert started == [f"Started process for run (pid: {run.tags[PID_TAG]})."], started
        finally:
            launcher.dispose()


def test_a_signal_during_a_fork_is_handled_once_the_worker_is_recorded(tmp_path: Path, monkeypatch) -> None:
    """SIGTERM arriving while the launcher forks (held, delivered when the fork is done): the
    build's handler raises; the new worker must already be one the launcher holds, so that the
    build's stop interrupts it. Before, the handler raised before it was recorded: the worker
    ran its run on after "build stopped", and the build's exit waited for it (>30 s)."""
    from dagster._core.events import DagsterEvent, DagsterEventType
    from dagster._core.launcher import LaunchRunContext

    from phantora_assets.cli.engine import BuildRuns

    home, data = _project_home(tmp_path, monkeypatch)
    import phantora_assets.definitions as d

    class Stop(Exception):
        pass

    from phantora_assets.instance.worker import defer_if_critical

    def handler(signum, _frame):  # as the build's handlers do
        if not defer_if_critical(signum):
            raise Stop

    old = signal.signal(signal.SIGTERM, handler)
    with dg.DagsterInstance.from_config(str(home)) as inst:
        runs = BuildRuns(inst, d.build_defs(data), 1)
        launcher = ForkRunLauncher(start_method="fork", runs_per_worker=2)
        launcher.register_instance(inst)
        start = launcher._context().Process.start

        def start_then_signalled(self):
            start(self)
            os.kill(os.getpid(), signal.SIGTERM)  # pending: held while the launcher forks

        monkeypatch.setattr(launcher._context().Process, "start", start_then_signalled)
        run = runs.create("perf_dbs", "l40s")
        inst.report_dagster_event(
            DagsterEvent(event_type_value=DagsterEventType.PIPELINE_STARTING.value, job_name=run.job_name),
            run_id=run.run_id,
        )
        try:
            with pytest.raises(Stop):
                launcher.launch_run(LaunchRunContext(dagster_run=inst.get_run_by_id(run.run_id), workspace=None))
            workers = launcher.workers()
            assert len(workers) == 1, "the forked worker is not recorded"
        finally:
            signal.signal(signal.SIGTERM, old)
            for p in launcher.workers():
                p.kill()
                p.join(5)
            launcher.dispose()


def _launch_to_end(inst: dg.DagsterInstance, launcher: ForkRunLauncher, run: dg.DagsterRun, timeout: float):
    """Start ``run`` through ``launcher`` as the run queue does and wait for it to succeed."""
    from dagster._core.events import DagsterEvent, DagsterEventType
    from dagster._core.launcher import LaunchRunContext

    from phantora_assets.cli.engine import run_step_errors

    inst.report_dagster_event(
        DagsterEvent(event_type_value=DagsterEventType.PIPELINE_STARTING.value, job_name=run.job_name),
        run_id=run.run_id,
    )
    launcher.launch_run(LaunchRunContext(dagster_run=inst.get_run_by_id(run.run_id), workspace=None))
    t0 = time.monotonic()
    while not inst.get_run_by_id(run.run_id).is_finished:
        assert time.monotonic() - t0 < timeout, f"run {run.tags.get('dagster/partition')} did not end"
        time.sleep(0.1)
    done = inst.get_run_by_id(run.run_id)
    assert done.status == dg.DagsterRunStatus.SUCCESS, run_step_errors(inst, run.run_id)
    return done


def _reuse_launcher(tmp_path: Path, monkeypatch):
    """(instance, BuildRuns for run creation, a fork ForkRunLauncher reusing its workers) on a SQLite
    instance with the project's dagster.yaml; the caller disposes of the launcher."""
    from phantora_assets.cli.engine import BuildRuns

    home, data = _project_home(tmp_path, monkeypatch)
    import phantora_assets.definitions as d

    inst = dg.DagsterInstance.from_config(str(home))
    launcher = ForkRunLauncher(start_method="fork", runs_per_worker=4, idle_timeout_seconds=60)
    launcher.register_instance(inst)
    return inst, BuildRuns(inst, d.build_defs(data), 1), launcher


def _starting(inst: dg.DagsterInstance, run: dg.DagsterRun) -> dg.DagsterRun:
    """``run`` marked STARTING, as the run queue does before it calls the launcher."""
    from dagster._core.events import DagsterEvent, DagsterEventType

    inst.report_dagster_event(
        DagsterEvent(event_type_value=DagsterEventType.PIPELINE_STARTING.value, job_name=run.job_name),
        run_id=run.run_id,
    )
    return inst.get_run_by_id(run.run_id)


def _until_idle(launcher: ForkRunLauncher, reusable: bool = True, timeout: float = 20) -> None:
    """Wait until the launcher's worker has reported its run ended and waits for the next one
    (a loaded machine may take more than a moment)."""
    t0 = time.monotonic()
    while reusable and not launcher._idle:
        assert time.monotonic() - t0 < timeout, "the worker did not report its run ended"
        launcher._collect(0.2)


def _until_finished(inst: dg.DagsterInstance, run_id: str, timeout: float = 120) -> dg.DagsterRun:
    t0 = time.monotonic()
    while not inst.get_run_by_id(run_id).is_finished:
        assert time.monotonic() - t0 < timeout, "run did not end"
        time.sleep(0.1)
    return inst.get_run_by_id(run_id)


def test_a_run_terminated_as_a_reused_worker_takes_it_is_canceled_and_never_runs(tmp_path, monkeypatch) -> None:
    """terminate of a run the queue has marked STARTING but whose worker is not recorded yet (the
    hand-over to a reused worker, or the fork): the run ends CANCELED without a step executed, and
    the worker takes the next run. Before, terminate found no worker pid and returned False: the
    run was not cancelled and ran to SUCCESS."""
    from dagster._core.launcher import LaunchRunContext

    inst, runs, launcher = _reuse_launcher(tmp_path, monkeypatch)
    try:
        first = _launch_to_end(inst, launcher, runs.create("perf_dbs", "l40s"), 60)
        _until_idle(launcher)  # its worker has reported the run ended: reused by the next launch
        doomed = _starting(inst, runs.create("perf_dbs", "h100"))
        assert launcher.terminate(doomed.run_id)
        launcher.launch_run(LaunchRunContext(dagster_run=inst.get_run_by_id(doomed.run_id), workspace=None))
        done = _until_finished(inst, doomed.run_id)
        assert done.status == dg.DagsterRunStatus.CANCELED
        assert done.tags[PID_TAG] == first.tags[PID_TAG]  # the reused worker took it
        assert not inst.all_logs(doomed.run_id, of_type=dg.DagsterEventType.STEP_START)
        assert not (tmp_path / "data" / "perfdb" / "h100").exists()
        after = _launch_to_end(inst, launcher, runs.create("perf_dbs", "h200"), 60)
        assert after.tags[PID_TAG] == first.tags[PID_TAG]  # and takes the next one
    finally:
        launcher.dispose()
        inst.dispose()


def test_a_late_terminate_of_a_workers_last_run_spares_its_next_run(tmp_path, monkeypatch) -> None:
    """terminate of a run that read the run as unfinished just before its reused worker moved on
    to its next run (here: the launcher is shown the run as it was while it ran): the next run
    must not be interrupted. Before, terminate sent SIGINT to the worker's pid, which interrupted
    whatever run it executed: the next run ended FAILURE."""
    inst, runs, launcher = _reuse_launcher(tmp_path, monkeypatch)
    try:
        first = _launch_to_end(inst, launcher, runs.create("perf_dbs", "l40s"), 60)
        as_it_ran = first.with_status(dg.DagsterRunStatus.STARTED)
        _until_idle(launcher)
        from dagster._core.launcher import LaunchRunContext

        nxt = _starting(inst, runs.create("all_runs", FITS))
        launcher.launch_run(LaunchRunContext(dagster_run=nxt, workspace=None))
        t0 = time.monotonic()
        while not inst.all_logs(nxt.run_id, of_type=dg.DagsterEventType.STEP_START):
            assert time.monotonic() - t0 < 60, "the next run did not start a step"
            time.sleep(0.05)
        assert inst.get_run_by_id(nxt.run_id).tags[PID_TAG] == first.tags[PID_TAG]  # same worker
        real = inst.get_run_by_id
        monkeypatch.setattr(inst, "get_run_by_id", lambda rid: as_it_ran if rid == first.run_id else real(rid))
        launcher.terminate(first.run_id)
        monkeypatch.setattr(inst, "get_run_by_id", real)
        assert _until_finished(inst, nxt.run_id).status == dg.DagsterRunStatus.SUCCESS
    finally:
        launcher.dispose()
        inst.dispose()


@pytest.mark.parametrize(("start_method", "runs_per_worker"), [("fork", 2), ("forkserver", 1)])
def test_a_run_sees_the_launchers_environment_as_of_its_launch(
    tmp_path: Path, monkeypatch, start_method: str, runs_per_worker: int
) -> None:
    """A PHANTORA_ASSETS_* setting changed in the launching process after a first launch (here
    the data root): the next run, in a reused worker or forked from the forkserver that the first
    launch started, runs with the new value. Before, it ran with the environment of the first
    launch and wrote into the old data root."""
    from phantora_assets.cli.engine import BuildRuns

    home, old, new = tmp_path / "home", tmp_path / "old", tmp_path / "new"
    home.mkdir()
    (home / "dagster.yaml").write_text((ROOT / "dagster.yaml").read_text())
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    monkeypatch.setenv("PHANTORA_ASSETS_DATA_DIR", str(old))
    import phantora_assets.definitions as d

    with dg.DagsterInstance.from_config(str(home)) as inst:
        launcher = ForkRunLauncher(start_method=start_method, runs_per_worker=runs_per_worker)
        launcher.register_instance(inst)
        try:
            first = _launch_to_end(inst, launcher, BuildRuns(inst, d.build_defs(old), 1).create("perf_dbs", "l40s"), 60)
            _until_idle(launcher, runs_per_worker > 1)
            monkeypatch.setenv("PHANTORA_ASSETS_DATA_DIR", str(new))
            run = BuildRuns(inst, d.build_defs(new), 1).create("perf_dbs", "h100")
            second = _launch_to_end(inst, launcher, run, 60)
            assert (first.tags[PID_TAG] == second.tags[PID_TAG]) == (runs_per_worker > 1)
        finally:
            launcher.dispose()
    assert (old / "perfdb" / "l40s" / "perf_db.json").is_file()
    assert (new / "perfdb" / "h100" / "perf_db.json").is_file()
    assert not (old / "perfdb" / "h100").exists()


def test_a_signal_a_library_turned_into_its_own_error_still_stops_the_build() -> None:
    """Seen under load: SIGTERM arrived inside SQLite's executemany, SQLAlchemy's rollback then raised
    "database is locked" from it, and the build ended in a traceback instead of exit 143. The error a
    signal was raised under is that signal."""
    import sqlite3

    from phantora_assets.cli.build import _interrupt_behind, _signal_code, _Terminated

    term = _Terminated(signal.SIGTERM)
    try:
        try:
            raise term
        except _Terminated as inner:
            raise sqlite3.OperationalError("database is locked") from inner
    except sqlite3.OperationalError as e:
        stop = _interrupt_behind(e)
    assert stop is term and _signal_code(stop) == 143
    assert _interrupt_behind(sqlite3.OperationalError("database is locked")) is None
