"""``phantora-assets build``: Dagster runs of the code location on a persistent instance.

The build is a client of Dagster's own machinery: for each GPU (job ``perf_dbs``), each run
partition (job ``all_runs``, its steps in one process) and the dataset (job ``dataset``) it
creates a run on the instance -- ``$DAGSTER_HOME``, or ``<data-dir>/dagster_home`` -- and starts
it with :class:`~phantora_assets.instance.ForkRunLauncher` (``fork``: this process has the code
imported already), at most ``--jobs`` at once, largest world size first. The runs are the same
runs the UI shows and launches (same job, partition tag, code origin ``phantora_assets.definitions``
with ``PHANTORA_ASSETS_DATA_DIR`` set to the data root).

A run worker that dies (``kill -9``, the OOM killer) or Ctrl-C stops the build within seconds:
the other workers are interrupted (SIGINT, then SIGKILL after :data:`GRACE_S`), their runs are
marked failed or cancelled on the instance, and the exit code is non-zero. Outputs are written
atomically, so what a killed worker was writing never replaces a previous file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from phantora_assets.checks import FITS_IN_MEMORY, MATCHES_WORKLOAD_MODEL, blocking_failures, read_checks
from phantora_assets.cli.engine import BuildAborted, BuildFault, BuildRuns, reap_stale_runs, run_step_errors
from phantora_assets.lib.bins.width import BIN_S_ENV, bin_s_rule
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.faults import fault_from_text, resource_fault
from phantora_assets.lib.store.io import sweep_temp_files
from phantora_assets.paths import DATA_DIR_ENV, DataPaths

#: The instance ``<data-dir>/dagster_home`` gets when DAGSTER_HOME is unset: the settings of the
#: project's dagster.yaml (tests/system/test_instance_home.py keeps the two equal), so that
#: ``DAGSTER_HOME=<data-dir>/dagster_home dagster dev`` (and ``dagster-daemon run``) open the very
#: instance the build recorded its runs in, with the project's launcher, storage, run queue and
#: backfill settings (docs/INSTANCE.md).
HOME_YAML = """# written by `phantora-assets build` (DAGSTER_HOME was unset): the settings of the project's
# dagster.yaml (comments there). Start the UI on this instance, the one the build records into:
#   DAGSTER_HOME=<data-dir>/dagster_home PHANTORA_ASSETS_DATA_DIR=<data-dir> dagster dev
telemetry:
  enabled: false
run_launcher:
  module: phantora_assets.instance
  class: ForkRunLauncher
  config:
    start_method: forkserver
    preload: [phantora_assets.instance.warm]
    runs_per_worker: 8
    idle_timeout_seconds: 60
event_log_storage:
  module: phantora_assets.instance
  class: PooledSqliteEventLogStorage
compute_logs:
  module: dagster._core.storage.noop_compute_log_manager
  class: NoOpComputeLogManager
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  free_slots_after_run_end_seconds: 5
  start_timeout_seconds: 120
run_queue:
  dequeue_interval_seconds: 1
backfills:
  use_threads: true
  num_workers: 2
  num_submit_workers: 2
concurrency:
  runs:
    max_concurrent_runs: 4
    tag_concurrency_limits:
      - key: phantora/simulator
        value: docker
        limit: 1
  pools:
    default_limit: 2
"""


@contextmanager
def _build_env(data_dir: Path) -> Iterator[None]:
    """While the build runs: ``PHANTORA_ASSETS_DATA_DIR`` = the data root (the run workers load the
    code location from it) and, when unset, ``DAGSTER_HOME`` = ``<data_dir>/dagster_home`` (made,
    with :data:`HOME_YAML`, on first use); both restored afterwards."""
    old = {k: os.environ.get(k) for k in (DATA_DIR_ENV, "DAGSTER_HOME")}
    os.environ[DATA_DIR_ENV] = str(data_dir.resolve())
    own = (data_dir / "dagster_home").resolve()
    if old["DAGSTER_HOME"] and Path(old["DAGSTER_HOME"]).resolve() != own and (own / "dagster.yaml").exists():
        print(
            f"note: DAGSTER_HOME={old['DAGSTER_HOME']}: this build records its runs there, while earlier builds "
            f"of this data root recorded theirs in {own} (a UI opened on one instance does not show the other's "
            f"runs; docs/INSTANCE.md)",
            file=sys.stderr,
        )
    if not old["DAGSTER_HOME"]:
        home = own
        home.mkdir(parents=True, exist_ok=True)
        yaml_path = home / "dagster.yaml"
        mine = not yaml_path.exists() or yaml_path.read_text().startswith(HOME_YAML.splitlines()[0])
        if mine and (not yaml_path.exists() or yaml_path.read_text() != HOME_YAML):  # ours, from an older build
            yaml_path.write_text(HOME_YAML)
        os.environ["DAGSTER_HOME"] = str(home)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _open_instance() -> Iterator[Any]:
    """``DagsterInstance.get()`` made under an exclusive lock on ``$DAGSTER_HOME/.phantora_init.lock``:
    Dagster's SQLite storages set their databases up without one, and builds starting together on
    a fresh instance left ``alembic_version`` with two heads (every later build then failed)."""
    import fcntl

    import dagster as dg

    home = Path(os.environ["DAGSTER_HOME"])
    with open(home / ".phantora_init.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        instance = dg.DagsterInstance.get()
        fcntl.flock(lock, fcntl.LOCK_UN)
    with instance:
        yield instance


class _Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled like Ctrl-C (the build stops its workers and records its runs);
    ``signum`` is the signal (the build exits 128 + signum, as a shell reports a process it ended)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def _signals_interrupt() -> Iterator[None]:
    """SIGTERM (``timeout``, systemd, a CI cancel) and SIGHUP (a closed terminal) stop the build
    as Ctrl-C does, instead of killing it and orphaning its workers."""

    from phantora_assets.instance.worker import defer_if_critical

    def handler(signum, _frame):  # kept for later while the launcher forks and records a worker
        if not defer_if_critical(signum):
            raise _Terminated(signum)

    def interrupt(signum, _frame):
        if not defer_if_critical(signum):
            raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C raises KeyboardInterrupt, also when a shell started the build in the background with
    # SIGINT ignored (its workers would take the signal, the build would not)
    old[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _cost_order(specs) -> list:
    """The specs, largest world size first, so that runs handed out one at a time end with short
    runs on every worker (the cost of a run grows with its number of ranks)."""
    return sorted(specs, key=lambda s: -s.n_nodes * s.gpus_per_node)


def cmd_build(args: argparse.Namespace) -> int:
    """``build``; ``--bin-s S`` sets ``$PHANTORA_ASSETS_BIN_S`` for the build (its workers inherit it):
    every run's ``bin_s`` is S, a run built at another width is stale and rebuilt. ``--force``
    rebuilds the runs, perf DBs and dataset that are current (``stages/build_state``) too.

    Raises:
        RunMatrixError: S is not an allowed width (``lib/bins/width.bin_s_rule``), or the matrix is invalid.
    """
    from phantora_assets.imported_runs import matrix_for, remember_watched

    bin_s = getattr(args, "bin_s", None)
    if bin_s is not None and (rule := bin_s_rule(bin_s)):
        raise RunMatrixError(f"--bin-s {bin_s:g}: bin_s {rule}")
    try:
        with _env(BIN_S_ENV, None if bin_s is None else repr(bin_s)):
            data_dir = Path(args.data_dir)
            remember_watched(data_dir)  # the watched folder's runs stay runs of the data root
            matrix = matrix_for(data_dir)
            unknown = set(args.run or []) - {s.run_id for s in matrix}
            if unknown:
                print(f"unknown run_id(s): {', '.join(sorted(unknown))}", file=sys.stderr)
                return 2
            return build_runs(
                data_dir,
                matrix,
                args.run,
                quiet=args.quiet,
                plots=not args.no_plots,
                jobs=args.jobs,
                force=getattr(args, "force", False),
            )
    finally:
        if bin_s is not None:  # build_runs refreshed this process's code location with --bin-s still set
            from phantora_assets.instance.worker import refresh_definitions

            refresh_definitions()


@contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """``$name`` = ``value`` while the block runs (nothing changes when ``value`` is None), then as before."""
    old = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None and old is None:
            os.environ.pop(name, None)
        elif value is not None and old is not None:
            os.environ[name] = old


#: How the report names a run the build skipped (``stages/build_state``: current).
CURRENT = "current, not rebuilt"


def _status(paths: DataPaths, spec, run, instance) -> str:
    """A run's line of the report; ``run`` None: the build skipped it as current (its last build,
    from the same inputs and code, succeeded: ``stages/build_state``)."""
    checks = read_checks(paths.run_folder(spec))
    skipped = f" ({CURRENT})" if run is None else ""
    if checks.get(FITS_IN_MEMORY, {}).get("status") == "failed":
        return "out of memory: " + checks[FITS_IN_MEMORY]["message"] + skipped
    if run is None or run.status.value == "SUCCESS":
        warn = checks.get(MATCHES_WORKLOAD_MODEL, {})
        return "ok" + skipped + (" (warning: " + warn["message"][:200] + ")" if warn.get("status") == "warning" else "")
    failed = [
        f"{k}: {v['message']}" for k, v in blocking_failures(paths.run_folder(spec)).items() if v["status"] == "failed"
    ]
    return "FAILED: " + "; ".join(run_step_errors(instance, run.run_id) + failed)[:300]


def build_runs(
    data_dir: Path,
    matrix,
    only: list[str] | None,
    quiet: bool = False,
    plots: bool = True,
    jobs: int = 1,
    force: bool = False,
) -> int:
    """Materialize perf_db, the run assets of ``only`` (default: all of ``matrix``), the dataset assets,
    as Dagster runs on the build's instance (module docstring). ``plots=False`` leaves out the assets
    that only draw (``assets.PLOT_ASSET_NAMES``). A run, perf DB or dataset whose last build by this
    command succeeded from the same inputs and code, and whose files are as it left them, is
    skipped as current (``stages/build_state``), unless ``force``. Returns the exit code: 0, 1 (a
    run failed or a worker died), 130 (Ctrl-C), 143 (SIGTERM) or 129 (SIGHUP)."""
    from phantora_assets.instance.worker import refresh_definitions

    where = _Where("removing the temporary files of interrupted builds", str(data_dir))
    try:
        return _build_in(data_dir, matrix, only, quiet, plots, jobs, where, force)
    except Exception as exc:
        fault = resource_fault(exc)
        if fault is None:
            raise
        _say_fault(fault.line(where.step, where.path))
        return 1
    finally:
        refresh_definitions()  # this process's code location module as the environment is again


class _Where:
    """The build's step in progress and the path it writes, for the line of a resource fault."""

    def __init__(self, step: str, path: str) -> None:
        self.step, self.path = step, path

    def __call__(self, step: str, path: str) -> None:
        self.step, self.path = step, path


def _say_fault(line: str) -> None:
    """The build's last line on a resource fault: ``build: <step>: <path>: <rule> (<detail>)``."""
    try:
        print(f"build: {line}", file=sys.stderr, flush=True)
    except OSError:
        pass


def _step_faults(instance, run, what: str, paths: DataPaths) -> list[str]:
    """The lines of the failed steps of ``run`` whose error is a resource fault (``lib/faults``);
    an error that names no path is said with the step's output (the dataset, the database) or
    the data root."""
    outputs = {"phantora_v0": paths.dataset_dir, "dataset_duckdb": paths.duckdb_path}
    out = []
    for err in run_step_errors(instance, run.run_id):
        step, _, text = err.partition(": ")
        fault = fault_from_text(text)
        if fault is not None:
            out.append(fault.line(f"run {what}, step {step}", str(outputs.get(step, paths.root))))
    return out


def _build_in(
    data_dir: Path,
    matrix,
    only: list[str] | None,
    quiet: bool = False,
    plots: bool = True,
    jobs: int = 1,
    where: _Where | None = None,
    force: bool = False,
) -> int:
    """:func:`build_runs` in the build's environment (``_build_env``); ``where`` follows its steps."""
    where = where if where is not None else _Where("build", str(data_dir))
    from phantora_assets import assets as a
    from phantora_assets.definitions import build_defs, seed_run_partitions

    paths = DataPaths(data_dir)
    specs = [s for s in matrix if not only or s.run_id in only]
    t0 = time.perf_counter()
    stale = sweep_temp_files(data_dir)  # left by a build that was killed mid-write
    if stale and not quiet:
        print(f"removed {len(stale)} temporary file(s) left by an interrupted build", flush=True)

    where("setting up the Dagster instance", os.environ.get("DAGSTER_HOME") or str(data_dir / "dagster_home"))
    with _build_env(data_dir), _open_instance() as instance, _signals_interrupt():
        home = os.environ["DAGSTER_HOME"]
        where("Dagster instance writes", home)
        reaped = reap_stale_runs(instance)
        if reaped and not quiet:
            print(f"marked {len(reaped)} run(s) left unfinished by an interrupted build as failed", flush=True)
        defs = build_defs(data_dir, matrix)
        seed_run_partitions(instance, [s.run_id for s in matrix])  # the run partitions are dynamic
        skip = set() if plots else set(a.PLOT_ASSET_NAMES)
        sel = {n: defs.resolve_assets_def(n).key for n in (*a.RUN_ASSET_NAMES, *a.DATASET_ASSET_NAMES)}
        run_sel = None if plots else {sel[n] for n in a.RUN_ASSET_NAMES if n not in skip}
        data_sel = None if plots else {sel[n] for n in a.DATASET_ASSET_NAMES if n not in skip}
        runs = BuildRuns(instance, defs, jobs)
        import gc

        import phantora_assets.instance.warm  # noqa: F401  (what every run imports, once, before the forks)
        from phantora_assets.instance.worker import refresh_definitions

        refresh_definitions()  # the code location of this data root, inherited by every worker

        gc.freeze()  # the forked workers share the parent's objects: their collections skip them
        names = (
            [n for n in a.RUN_ASSET_NAMES if n not in skip],
            [n for n in a.DATASET_ASSET_NAMES if n not in skip],
        )
        plan = _Plan(paths, matrix, names, force, where)
        try:
            done, dataset = plan.run(runs, specs, run_sel, data_sel)
        except BuildFault as e:  # a worker ended on a full disk / read-only root it could not record
            _stop_quietly(runs, str(e), data_dir)
            _say_fault(e.fault.line(f"run {e.what}", str(data_dir)))
            return 1
        except (BuildAborted, KeyboardInterrupt) as e:
            return _stopped(runs, data_dir, e)
        except Exception as e:
            if (stop := _interrupt_behind(e)) is not None:
                return _stopped(runs, data_dir, stop)
            if resource_fault(e) is not None:  # the instance's own writes (said by build_runs)
                _stop_quietly(runs, "a resource fault", data_dir)
            raise
        finally:
            runs.launcher.shutdown()
            gc.unfreeze()
        report = (time.perf_counter() - t0, runs.jobs, home, quiet)
        return _finish(paths, specs, done, dataset, instance, report)


class _Plan:
    """What a build materializes: the perf DBs, runs and dataset that are not current
    (``stages/build_state.why_rebuild``; every one with ``force``), and the records of those that
    succeeded. ``names``: the run assets and dataset assets of the build's selection."""

    def __init__(
        self, paths: DataPaths, matrix, names: tuple[list[str], list[str]], force: bool, where: _Where
    ) -> None:
        from phantora_assets.stages import build_state

        self.paths, self.matrix, self.force, self.where = paths, list(matrix), force, where
        self.run_names, self.dataset_names = names
        self.key = build_state.code_key()
        self.by_id = {s.run_id: s for s in self.matrix}
        self.inputs: dict[str, str] = {}

    def run(self, runs: BuildRuns, specs, run_sel, data_sel) -> tuple[dict[str, Any], Any]:
        """Build the perf DBs of ``specs``' GPUs, the runs ``specs``, then the dataset, each that is
        not current, with ``runs``; return the finished runs by run_id and the dataset's run (None:
        current, not run)."""
        gpus = self.perf_dbs_to_build(sorted({s.gpu for s in specs if s.gpu}))
        self.recorded(runs.run_all([("perf_dbs", gpu, None) for gpu in gpus]), "perf_db")
        todo = self.runs_to_build(specs)
        done = runs.run_all([("all_runs", s.run_id, run_sel) for s in _cost_order(todo)])
        self.recorded(done, "run")
        if not self.dataset_to_build():
            return done, None
        dataset = runs.run_all([("dataset", None, data_sel)])["dataset"]
        self.recorded({"dataset": dataset}, "dataset")
        return done, dataset

    def _current(self, what: str, inputs: str, assets: list[str], outputs) -> bool:
        from phantora_assets.stages import build_state

        self.inputs[what] = inputs
        if not self.force and build_state.why_rebuild(self.paths, what, self.key, inputs, assets, outputs) is None:
            return True
        build_state.forget(self.paths, what)  # a build stopped half-way leaves no record
        return False

    def perf_dbs_to_build(self, gpus: list[str]) -> list[str]:
        from phantora_assets.lib.phantora.perfdb import perfdb_folder
        from phantora_assets.lib.run.catalog import gpu_specs
        from phantora_assets.stages import build_state as bs

        out = []
        for gpu in gpus:
            spec = gpu_specs()[gpu]
            inputs = bs.digest([spec, bs.perf_db_inputs(perfdb_folder(gpu, spec))])
            if not self._current(f"perf_db.{gpu}", inputs, ["perf_db"], bs.perf_db_outputs(self.paths, gpu)):
                out.append(gpu)
        return out

    def runs_to_build(self, specs) -> list:
        """The runs of ``specs`` to build: a run is current when its build reason is None
        (``stages/simulation.build_reason``, what ``runs`` and the sensors read) and its record holds."""
        from phantora_assets.stages import build_state as bs
        from phantora_assets.stages.simulation import build_reason_or_record_error

        todo = []
        for spec in specs:
            why = build_reason_or_record_error(spec, self.paths)
            outputs = bs.run_outputs(self.paths, spec)
            if why is None and self._current(f"run.{spec.run_id}", "", self.run_names, outputs):
                continue
            bs.forget(self.paths, f"run.{spec.run_id}")
            self.inputs[f"run.{spec.run_id}"] = ""
            todo.append(spec)
        return todo

    def dataset_to_build(self) -> bool:
        """Whether the dataset is to be built: its inputs are every run of the matrix (its build
        reason and the files of its folders, after this build's runs)."""
        from phantora_assets.stages import build_state as bs
        from phantora_assets.stages.simulation import build_reason_or_record_error

        runs = {
            s.run_id: [build_reason_or_record_error(s, self.paths), bs.run_outputs(self.paths, s)] for s in self.matrix
        }
        outputs = bs.dataset_outputs(self.paths)
        return not self._current("dataset", bs.digest(runs), self.dataset_names, outputs)

    def recorded(self, done: dict, kind: str) -> None:
        """Record each target of ``done`` (``partition or job -> DagsterRun``) whose run succeeded."""
        from phantora_assets.stages import build_state as bs

        before = (self.where.step, self.where.path)
        self.where("recording what the build built", str(self.paths.root / bs.STATE_DIR))
        self._record(done, kind)
        self.where(*before)

    def _record(self, done: dict, kind: str) -> None:
        from phantora_assets.stages import build_state as bs

        for key, run in done.items():
            if run.status.value != "SUCCESS":
                continue
            what = "dataset" if kind == "dataset" else f"{kind}.{key}"
            if kind == "run":
                assets, outputs = self.run_names, bs.run_outputs(self.paths, self.by_id[key])
            elif kind == "perf_db":
                assets, outputs = ["perf_db"], bs.perf_db_outputs(self.paths, key)
            else:
                assets, outputs = self.dataset_names, bs.dataset_outputs(self.paths)
            bs.record(self.paths, what, self.key, self.inputs[what], assets, outputs)


def _finish(paths: DataPaths, specs, done, dataset, instance, report: tuple[float, int, str, bool]) -> int:
    """Report every run and the dataset (:func:`_report`; ``report``: its elapsed s, jobs, Dagster
    home and quiet), then the first resource fault a step
    recorded (the build's last line); the exit code: 0, 1 (a run or the dataset failed) or 128 +
    the signal that cut the report short."""
    failures = 0
    try:
        rows = [(spec, _status(paths, spec, done.get(spec.run_id), instance)) for spec in specs]
        failures = sum(status.startswith("FAILED") for _, status in rows)
        dataset_errs = None
        if dataset is not None and dataset.status.value != "SUCCESS":
            failures += 1
            dataset_errs = run_step_errors(instance, dataset.run_id) or ["a blocking check (see its checks)"]
        faults = [f for s in specs if s.run_id in done for f in _step_faults(instance, done[s.run_id], s.run_id, paths)]
        dataset_faults = [] if dataset is None else _step_faults(instance, dataset, "dataset", paths)
        faults += dataset_faults
        # a dataset that failed on a resource fault is said once, by the fault's line below
        _report(paths, rows, None if dataset_faults else dataset_errs, *report, dataset_skipped=dataset is None)
        if faults:  # the first is the cause; the dataset published before stays whole
            _say_fault(faults[0])
            return 1
    except BrokenPipeError:  # the reader left (| head): the exit code still tells the outcome
        pass
    except KeyboardInterrupt as e:  # every run had ended: only the report is cut short
        try:
            print(f"\nbuild stopped: {_why(e)} while reporting; every run had ended", file=sys.stderr)
        except OSError:
            pass
        return _signal_code(e)
    return 1 if failures else 0


def _stop_quietly(runs: BuildRuns, why: str, data_dir: Path) -> None:
    """Stop the workers on a resource fault; what the full disk refuses (recording the runs as
    cancelled, removing temporary files) is left: the next build closes those runs."""
    with contextlib.suppress(Exception):
        runs.stop(why)
    with contextlib.suppress(Exception):
        sweep_temp_files(data_dir)


def _interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C or signal (``_Terminated``) an exception was raised while handling, or None: a signal that
    arrives inside a library call can come out as the library's own error (SQLite's "database is locked" from
    the rollback that SQLAlchemy runs after the interrupt cut a write short), and is still the signal."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, KeyboardInterrupt):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _stopped(runs: BuildRuns, data_dir: Path, e: BaseException) -> int:
    """Stop the workers after ``e`` (a ``BuildAborted`` or an interrupt), record the runs, remove temporary
    files and say so; the build's exit code (128 + the signal, 130 Ctrl-C, 1 aborted)."""
    why = _why(e) if isinstance(e, KeyboardInterrupt) else str(e)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second one must not cut the
        signal.signal(sig, signal.SIG_IGN)  # clean-up short (restored by _signals_interrupt)
    runs.stop(why)
    sweep_temp_files(data_dir)
    try:  # after a hang-up the terminal may be gone (EIO): the exit code still tells
        msg = f"\nbuild stopped: {why}; nothing half-written (outputs are replaced atomically)"
        print(msg, file=sys.stderr)
    except OSError:
        pass
    return _signal_code(e) if isinstance(e, KeyboardInterrupt) else 1


def _why(e: KeyboardInterrupt) -> str:
    """What stopped the build, for its last message."""
    if isinstance(e, _Terminated) and e.signum == signal.SIGHUP:
        return "hung up (SIGHUP: its terminal closed)"
    if isinstance(e, _Terminated):
        return f"terminated ({e.args[0]})"
    return "interrupted (Ctrl-C / SIGINT)"


def _signal_code(e: KeyboardInterrupt) -> int:
    """128 + the signal, as a shell reports a process it ended: 130 Ctrl-C, 143 SIGTERM, 129 SIGHUP."""
    return 128 + e.signum if isinstance(e, _Terminated) else 130


def _report(
    paths: DataPaths,
    rows,
    dataset_errs,
    elapsed: float,
    jobs: int,
    home: str,
    quiet: bool,
    dataset_skipped: bool = False,
) -> None:
    """The build's last lines: each run's status (``quiet``: the failed runs' only; a run skipped as
    current says so), the dataset's failure, the counts (how many runs were current) and where
    things are."""
    for spec, status in rows:  # --quiet leaves out the runs that went well, never a failure
        if not quiet or status.startswith("FAILED"):
            print(f"{spec.run_id:34s} {spec.source:8s} {status}", flush=True)
    if dataset_errs is not None:
        print(f"dataset: FAILED: {'; '.join(dataset_errs)[:300]}", file=sys.stderr)
    current = [spec.run_id for spec, status in rows if f"({CURRENT})" in status]
    built = f"built {len(rows) - len(current)} runs, {len(current)} current (not rebuilt; --force rebuilds them)"
    print(
        f"\n{built if current else f'built {len(rows)} runs'} in {elapsed:.1f} s "
        f"({jobs} worker{'s' if jobs > 1 else ''}): "
        f"{sum(r[1].startswith('ok') for r in rows)} ok, "
        f"{sum(r[1].startswith('out of memory') for r in rows)} not fitting, "
        f"{sum(r[1].startswith('FAILED') for r in rows)} failed"
    )
    dataset_current = f"  ({CURRENT})" if dataset_skipped else ""
    print(f"dataset:     {paths.root.resolve() / paths.dataset_dir.name}{dataset_current}")
    print(f'database:    {paths.duckdb_path.resolve()}  (phantora-assets query "SQL")')
    print(f"run folders: {(paths.root / 'traces').resolve()}")
    print(f"dagster:     {home}  (runs and materializations; DAGSTER_HOME for dagster dev)")
