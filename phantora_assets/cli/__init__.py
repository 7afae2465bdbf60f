"""``phantora-assets``: build the dataset (Dagster runs of the code location), import run folders, list runs.

    phantora-assets build  [--data-dir DIR] [--run RUN_ID ...] [--no-plots] [--jobs N] [--force]
    phantora-assets import FOLDER [FOLDER ...] [--data-dir DIR] [--no-build] [--gpus-per-node N] [--run-id ID]
                           [--world-size N] [--rank R]
    phantora-assets forget RUN_ID [RUN_ID ...] [--data-dir DIR]
    phantora-assets runs   [--data-dir DIR]
    phantora-assets chakra RUN_ID OUT_DIR [--prefix P] [--stream-order ctrl|data] [--data-dir DIR]
    phantora-assets query  "SQL" [--format table|csv|json] [--data-dir DIR]
    phantora-assets sweep  [--layouts 2x8,4x8,16x8] [--bandwidths 100,200,400,800] [--workloads W1,W4]
                           [--gpu h100] [--out sweep.csv]

``build`` materializes every asset and check of every run, then the dataset, the DuckDB database
and the dataset plots, as Dagster runs on a persistent instance (``$DAGSTER_HOME``, else
``<data-dir>/dagster_home``): one run per GPU, per run partition and for the dataset, started by
the project's run launcher, at most ``--jobs N`` at once (``cli/build.py``). Runs that do not
fit in GPU memory are reported as such; any other failure makes the exit code 1. What an earlier
``build`` built from the same inputs and code, its files untouched since, is skipped as current
and named so (``stages/build_state``); ``--force`` rebuilds it too.
``import`` registers every run folder found under FOLDER (``traces/<gpu>/<workload>_<N>x<G>/``)
in ``DIR/imports.toml`` and builds those runs, then the dataset; a FOLDER of PyTorch profiler
traces (one per rank) is one run (``sources/kineto.py``: rank r on host r // N + 1, partition ID,
else ``<folder>_<nodes>x<N>``), declined with the file and the reason when it cannot give flows.
The run matrix of a data root is ``runs.toml`` merged with its imports (``imported_runs.matrix_for``).
``chakra`` writes a built run's steady steps as Chakra execution traces, one per rank, and the
comm groups ASTRA-sim reads (``cli/chakra.py``); ``import`` also takes a folder of such ETs
(``sources/chakra.py``).
``query`` runs one SQL statement against ``<data-dir>/phantora.duckdb`` (read-only); a bad
statement prints DuckDB's message and exits 2, as does one that runs past ``--timeout`` or needs
more than DuckDB's ``memory_limit`` of the sandbox (1 GB).
"""

from __future__ import annotations

import argparse
import os
import sys

import phantora_assets.matrix  # noqa: F401 (names the run-matrix file to lib/run/catalog: its tables reach every command)
from phantora_assets.cli.build import cmd_build
from phantora_assets.cli.chakra import cmd_chakra
from phantora_assets.cli.commands import cmd_forget, cmd_import, cmd_runs, cmd_sweep
from phantora_assets.cli.query import cmd_query, format_rows
from phantora_assets.paths import DATA_DIR_ENV

__all__ = [
    "build_parser",
    "cmd_build",
    "cmd_chakra",
    "cmd_forget",
    "cmd_import",
    "cmd_query",
    "cmd_runs",
    "cmd_sweep",
    "format_rows",
    "main",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phantora-assets", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    default_dir = os.environ.get(DATA_DIR_ENV, "data")
    b = sub.add_parser("build", help="materialize every asset and check of every run, then the dataset")
    b.add_argument("--data-dir", default=default_dir, help="data root (default: $PHANTORA_ASSETS_DATA_DIR or ./data)")
    b.add_argument("--run", action="append", help="only this run_id (repeatable)")
    b.add_argument("--quiet", action="store_true", help="print only the summary")
    b.add_argument("--no-plots", action="store_true", help="skip the plot assets (run_plots, dataset_plots)")
    b.add_argument(
        "--force",
        action="store_true",
        help="rebuild every run, perf DB and the dataset, also those current (built by this command from the "
        "same inputs and code, files untouched since), which are skipped otherwise",
    )
    b.add_argument(
        "--bin-s",
        type=float,
        default=None,
        metavar="S",
        help="bin width of every run for this build, s (as a run entry's bin_s: 0.001 .. 1.0; default: the entry's)",
    )
    b.add_argument(
        "--jobs",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="worker processes for the runs (default: min(2, CPUs)); 1 = sequential",
    )
    b.set_defaults(func=cmd_build)
    w = sub.add_parser(
        "sweep",
        help="what-if grid (layouts x host bandwidths x workloads) with the analytic "
        "simulator, one table row per point (no Dagster)",
    )
    w.add_argument("--layouts", default="2x8,4x8,16x8", help="comma-separated <nodes>x<gpus_per_node>")
    w.add_argument("--bandwidths", default="100,200,400,800", help="host link bandwidths, Gbps")
    w.add_argument("--workloads", default="W1,W4", help="comma-separated W1..W5 or [workloads.NAME] of the matrix")
    w.add_argument("--gpu", default="h100", help="a key of gpus.toml")
    w.add_argument(
        "--uplink-bw",
        type=float,
        default=None,
        help="spine-uplink port bandwidth, Gbps (default: the host bandwidth of the point)",
    )
    w.add_argument("--rack-size", type=int, default=None, help="hosts per rack (default: presets.toml)")
    w.add_argument("--nspines", type=int, default=None, help="spines (default: presets.toml)")
    w.add_argument("--ecmp", choices=["hash", "split", "first"], default=None, help="spine choice (lib/sim/network.py)")
    w.add_argument(
        "--set",
        action="append",
        metavar="KEY=V1,V2",
        help="vary a workload schema key, e.g. parallel.tp=2,4,8 or train.micro_batch=1,2 (repeatable: product)",
    )
    w.add_argument("--out", default="sweep.csv", help="output table (.csv or .parquet)")
    w.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    w.add_argument("--quiet", action="store_true", help="print only the summary line")
    w.set_defaults(func=cmd_sweep)
    i = sub.add_parser("import", help="register run folders of a Phantora dataset (or profiler traces) and build them")
    i.add_argument(
        "folders",
        nargs="+",
        metavar="FOLDER",
        help="a dataset root, its traces/ folder, a GPU folder, a run folder, or a folder of PyTorch profiler traces",
    )
    i.add_argument("--data-dir", default=default_dir, help="data root (default: $PHANTORA_ASSETS_DATA_DIR or ./data)")
    i.add_argument("--no-build", action="store_true", help="only register the folders in DIR/imports.toml")
    i.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="N",
        help="profiler traces: rank r on host r // N + 1 (default: the folder's import.toml, else 1)",
    )
    i.add_argument(
        "--run-id", default=None, metavar="ID", help="profiler traces: the partition (default <folder>_<layout>)"
    )
    i.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="profiler traces without distributedInfo: the job's GPU count (must agree with distributedInfo)",
    )
    i.add_argument(
        "--rank",
        type=int,
        default=None,
        metavar="R",
        help="a folder of one profiler trace without distributedInfo: its rank (else from the file name, rank-R)",
    )
    i.add_argument("--quiet", action="store_true", help="print only the summary")
    i.set_defaults(func=cmd_import)
    f = sub.add_parser(
        "forget", help="remove imported runs from DIR/imports.toml (the explicit way out of the run matrix and dataset)"
    )
    f.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    f.add_argument("--data-dir", default=default_dir, help="data root (default: $PHANTORA_ASSETS_DATA_DIR or ./data)")
    f.set_defaults(func=cmd_forget)
    r = sub.add_parser("runs", help="list the run matrix with memory verdicts and check status")
    r.add_argument("--data-dir", default=default_dir)
    r.set_defaults(func=cmd_runs)
    c = sub.add_parser("chakra", help="write a built run's steady steps as Chakra ETs (one per rank) for ASTRA-sim")
    c.add_argument("run_id", metavar="RUN_ID")
    c.add_argument("out_dir", metavar="OUT_DIR")
    c.add_argument("--prefix", default=None, metavar="P", help="file prefix: P.<rank>.et (default: the run_id)")
    c.add_argument(
        "--stream-order",
        choices=("ctrl", "data"),
        default="ctrl",
        help="stream order as ctrl_deps (Chakra's feeder_v3, newer ASTRA-sim; default) or as data_deps (the first "
        "feeder, which reads data_deps only); a simulated run only (docs/CHAKRA.md)",
    )
    c.add_argument("--data-dir", default=default_dir)
    c.set_defaults(func=cmd_chakra)
    q = sub.add_parser("query", help="run one SQL statement against the DuckDB database and print the result")
    q.add_argument("sql", help='e.g. "select run_id, sum(bytes) from flows_100ms group by 1"')
    q.add_argument("--format", choices=["table", "csv", "json"], default="table")
    q.add_argument("--data-dir", default=default_dir)
    q.add_argument(
        "--timeout", type=float, default=600.0, help="seconds before the query is interrupted (exit 2; default 600)"
    )
    q.set_defaults(func=cmd_query)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point. An invalid run matrix (or another input error of ours) prints its message
    (naming the file, entry and rule) and exits 2, without a traceback; a resource fault (a full
    disk, a read-only data root: ``lib/faults``) prints one line naming the path and exits 1."""
    from phantora_assets.lib.errors import RunMatrixError
    from phantora_assets.lib.faults import resource_fault
    from phantora_assets.paths import data_root_rule

    args = build_parser().parse_args(argv)
    data_dir = getattr(args, "data_dir", None)
    if data_dir is not None and (rule := data_root_rule(data_dir)):  # checked before anything is read under it
        print(f"error: --data-dir {data_dir}: {rule}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except RunMatrixError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a full disk, a read-only data root: one line, exit 1 (lib/faults)
        fault = resource_fault(exc)
        if fault is None:
            raise
        where = getattr(args, "data_dir", None)
        print(f"{getattr(args, 'command', None) or 'phantora-assets'}: {fault.line('writing', where)}", file=sys.stderr)
        return 1


def run() -> None:
    """The ``phantora-assets`` command (and ``python -m phantora_assets.cli``): :func:`main`, then exit
    with its code without tearing the interpreter down. The exit handlers run (``atexit``: logging,
    multiprocessing's children, temporary folders) and the standard streams are flushed; then the
    process ends (``os._exit``) instead of freeing every object and module one by one, which took
    0.8 s after a build's last line (~300k objects). Every output was already closed and renamed
    into place. An exception (``SystemExit`` of argparse included) ends the process the usual way.
    Output that cannot be written at that flush (a full disk, a file size limit) is said on stderr
    and the exit code is 120, as the interpreter's own exit does; a reader that left (``| head``)
    and a stream that is closed or absent (``>&-``) are not errors. A reader that leaves while
    ``main`` writes (``query ... | head``) ends it with 141 (128 + SIGPIPE, as a shell reports a
    writer that the pipe ended), without a traceback."""
    import atexit

    try:
        code = main()
    except BrokenPipeError:
        if not _stdout_reader_gone():  # another pipe (e.g. to a run worker): a real error
            raise
        code = 141
        try:  # what is left in stdout's buffer has no reader either: drop it at the flush below
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
    atexit._run_exitfuncs()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            if stream is not None:
                stream.flush()
        except (BrokenPipeError, ValueError):  # the reader is gone, or the stream closed
            pass
        except OSError as exc:
            code = code or 120
            try:
                os.write(2, f"phantora-assets: output lost: writing {name} failed: {exc}\n".encode())
            except OSError:
                pass
    os._exit(code)


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe (or socket) whose reading end was closed (poll says POLLERR)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False
