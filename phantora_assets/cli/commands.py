"""``phantora-assets import | runs | query | sweep``: the commands that are not the Dagster build."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from phantora_assets.checks import read_checks
from phantora_assets.cli.build import build_runs
from phantora_assets.paths import DataPaths
from phantora_assets.records import RecordError
from phantora_assets.stages.export import run_exclusion

if TYPE_CHECKING:
    from phantora_assets.lib.run.spec import RunSpec


def cmd_import(args: argparse.Namespace) -> int:
    from phantora_assets.imported_runs import matrix_for, register, remember_watched
    from phantora_assets.lib.errors import FileRuleError
    from phantora_assets.lib.phantora.run_folder import RunFolder, Skipped, discover
    from phantora_assets.sources import chakra, kineto

    data_dir = Path(args.data_dir)
    found: list[RunFolder] = []
    skipped: list[Skipped] = []
    profiled = [f for f in args.folders if kineto.is_trace_folder(f) or chakra.is_et_folder(f)]
    if (args.run_id or args.world_size is not None or args.rank is not None) and len(profiled) != 1:
        print(
            "import: --run-id, --world-size and --rank name one folder of profiler traces or Chakra ETs",
            file=sys.stderr,
        )
        return 2
    for folder in profiled:
        try:
            spec = _profiled_spec(Path(folder), args)
        except FileRuleError as exc:
            print(f"import: declined {exc}", file=sys.stderr)
            return 2
        found.append(RunFolder(Path(spec.path), spec, None))
    for folder in [f for f in args.folders if f not in profiled]:
        try:
            got, missed = discover(folder)
        except FileNotFoundError as exc:
            print(f"import: {exc}", file=sys.stderr)
            return 2
        found += got
        skipped += missed
    for s in skipped:
        print(f"skipped {s.path}: {s.reason}", file=sys.stderr)
    if not found:
        print(
            "import: no run folder (traces/<gpu>/<workload>_<nodes>x<gpus>/ with timeline.json.gz) found",
            file=sys.stderr,
        )
        return 2
    remember_watched(data_dir)  # the watched folder's runs stay runs of the data root (imported_runs.forget)
    registry = register(data_dir, [f.spec for f in found])
    for f in found:
        print(f"registered {f.spec.run_id:34s} <- {f.path}")
    print(f"imports registry: {registry.resolve()}")
    if args.no_build:
        return 0
    matrix = matrix_for(data_dir)
    return build_runs(data_dir, matrix, [f.spec.run_id for f in found], quiet=args.quiet)


def cmd_forget(args: argparse.Namespace) -> int:
    """``forget RUN_ID ...``: remove imported runs from ``DIR/imports.toml`` (``imported_runs.forget``);
    the next dataset materialization leaves them out. Exit 2 (nothing changed) when a run_id is not
    imported or its folder is still under ``$PHANTORA_ASSETS_IMPORT_DIR``."""
    from phantora_assets.imported_runs import forget
    from phantora_assets.lib.errors import RunMatrixError

    try:
        removed = forget(Path(args.data_dir), list(args.run_ids))
    except RunMatrixError as exc:
        print(f"forget: {exc}", file=sys.stderr)
        return 2
    for s in removed:
        print(f"forgot {s.run_id:34s} (was {s.path})")
    home = _instance_home(Path(args.data_dir))
    if home is not None:  # the run partition goes too (runs and materializations stay in the history)
        import dagster as dg

        from phantora_assets.assets.common import RUN_PARTITIONS

        with dg.DagsterInstance.from_config(str(home)) as instance:
            have = set(instance.get_dynamic_partitions(RUN_PARTITIONS))
            for s in removed:
                if s.run_id in have:
                    instance.delete_dynamic_partition(RUN_PARTITIONS, s.run_id)
        print(f"removed their run partitions from the Dagster instance {home}")
    print("the dataset leaves them out from its next materialization (phantora-assets build, or the daemon)")
    return 0


def _instance_home(data_dir: Path) -> Path | None:
    """The Dagster instance a build of ``data_dir`` records into (``$DAGSTER_HOME``, else
    ``<data_dir>/dagster_home``), when it exists."""
    import os

    home = Path(os.environ["DAGSTER_HOME"]) if os.environ.get("DAGSTER_HOME") else data_dir / "dagster_home"
    return home if (home / "dagster.yaml").is_file() else None


def _profiled_spec(folder: Path, args: argparse.Namespace):
    """The RunSpec of a folder of profiler traces or Chakra ETs: the options, else its
    ``import.toml`` (``sources/profiled.read_sidecar``), else the defaults."""
    from phantora_assets.lib.errors import FileRuleError
    from phantora_assets.sources import chakra, kineto
    from phantora_assets.sources.profiled import read_sidecar

    opts = {k: v for k, v in (read_sidecar(folder) or {}).items()}
    for key in ("gpus_per_node", "run_id", "world_size", "rank"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    gpn, run_id, world = opts.get("gpus_per_node", 1), opts.get("run_id"), opts.get("world_size")
    if not chakra.is_et_folder(folder):
        return kineto.spec_for(folder, gpn, run_id, world, opts.get("rank"))
    if "rank" in opts:
        raise FileRuleError(
            folder, "placement", "a Chakra ET's rank is in its file name: --rank is for profiler traces"
        )
    return chakra.spec_for(folder, gpn, run_id, world)


def check_status(spec: RunSpec, paths: DataPaths) -> str:
    """One phrase for a run: ``all checks passed``, or the exclusion reason ``run_status.csv`` and
    the database give (``stages/export.run_exclusion``: a failed step first as ``step <asset>:
    <error>``, each gating check not passed, or ``stale: ...``), then the advisory ``warning``s."""
    out = run_exclusion(spec, paths) or "all checks passed"
    try:
        checks = read_checks(paths.run_folder(spec))
    except RecordError:
        checks = {}
    warned = [k for k, v in checks.items() if v["status"] == "warning"]
    if warned:
        out += " (warning: " + ", ".join(warned) + ")"
    return out


def cmd_runs(args: argparse.Namespace) -> int:
    """The run matrix, a line a run: its GPU memory estimate against the card, the largest per-run stage's
    host memory estimate (``lib/stage_memory``, counted before simulating; ``-`` where it does not apply), and
    whether it fits: ``NO`` with ``refused at build: <rule>`` for a run the build refuses before simulating (the
    trace bound, ``lib/sim/analytic.trace_bound_rule``; the host-memory bound,
    ``lib/stage_memory.host_memory_rule``), so a run shown as fitting is not refused at build; a run whose
    timeline holds one rank a stage says when the simulation of every rank it falls back to if the ranks of a
    stage differ (``lib/sim/symmetry.py``, known only by simulating) would be refused."""
    from phantora_assets.imported_runs import matrix_for
    from phantora_assets.lib.sim.analytic import timeline_scope, trace_bound_rule
    from phantora_assets.lib.sim.memory import estimate_memory
    from phantora_assets.lib.sim.workloads import WorkloadModel
    from phantora_assets.lib.stage_memory import applies, host_memory_rule, job_size, largest_stage
    from phantora_assets.lib.workload.collectives import EVERY_RANK

    paths = DataPaths(Path(args.data_dir))
    specs = matrix_for(paths.root)
    w_id = max([34, *(len(s.run_id) for s in specs)])
    w_par = max([12, *(len(s.parallelism) for s in specs)])
    w_model = max([10, *(len(s.model_name) for s in specs)])
    cols = f"{'run_id':{w_id}s} {'source':9s} {'model':{w_model}s} {'parallelism':{w_par}s}"
    print(f"{cols} {'memory GiB':>11s} {'host GiB':>8s} {'fits':5s} built")
    for spec in specs:
        built = check_status(spec, paths)
        head = f"{spec.run_id:{w_id}s} {spec.source:9s} {spec.model_name:{w_model}s} {spec.parallelism:{w_par}s}"
        if not spec.workload:  # a profiled run: no memory model (it ran on real GPUs)
            print(f"{head} {'profiled':>11s} {'-':>8s} {'yes':5s} {built}")
            continue
        mem = estimate_memory(WorkloadModel(spec)).as_dict()
        fits = "yes" if mem["fits"] else "NO"
        host = "-"
        if mem["fits"] and spec.source == "analytic" and (why := trace_bound_rule(spec)) is not None:
            fits, built = "NO", f"refused at build: {why}"  # the simulator's own rule (lib/sim/analytic)
        elif mem["fits"] and applies(spec):
            host = f"{largest_stage(job_size(spec)).mib / 1024:8.2f}"
            if (why := host_memory_rule(spec)) is not None:  # the simulator's rule too, before simulating
                fits, built = "NO", f"refused at build: {why}"
            elif timeline_scope(spec)[0] != EVERY_RANK:
                built += f" (timeline: {timeline_scope(spec)[0]}, docs/WORKLOADS.md 'Scale')"
                if (why := host_memory_rule(spec, every_rank=True)) is not None:  # the fallback's DAG of every rank
                    built += f" (refused at build if the ranks of a stage differ: {why})"
        print(f"{head} {mem['peak_gib']:5.1f}/{mem['card_gib']:<5.0f} {host:>8s} {fits:5s} {built}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from phantora_assets.lib.run.catalog import gpu_specs, workload_specs
    from phantora_assets.sweep import grid, parse_set, run_sweep

    if args.gpu not in gpu_specs():
        print(f"unknown GPU {args.gpu!r} (known: {', '.join(sorted(gpu_specs()))})", file=sys.stderr)
        return 2
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in workload_specs()]
    if unknown:
        print(f"unknown workload(s) {unknown} (known: {', '.join(sorted(workload_specs()))})", file=sys.stderr)
        return 2
    try:
        bandwidths = [float(b) for b in args.bandwidths.split(",") if b.strip()]
        sets = [parse_set(x) for x in args.set or []]
        points = grid(
            [x for x in args.layouts.split(",") if x.strip()],
            bandwidths,
            workloads,
            args.gpu,
            sets,
            uplink_bw_gbps=args.uplink_bw,
            rack_size=args.rack_size,
            nspines=args.nspines,
            ecmp=args.ecmp,
        )
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    df = run_sweep(points, jobs=args.jobs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".parquet":
        df.to_parquet(out, index=False)
    else:
        df.to_csv(out, index=False, float_format="%.6g", lineterminator="\n")
    if not args.quiet:
        show = df[
            [
                "workload",
                "settings",
                "layout",
                "host_bw_gbps",
                "status",
                "iteration_time_ms",
                "compute_ms",
                "exposed_comm_ms",
                "inter_node_bytes_per_step",
            ]
        ].copy()
        show["status"] = show["status"].str.slice(0, 120)
        print(show.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
    print(f"\n{len(df)} points ({(df['status'] == 'ok').sum()} ok) in {time.perf_counter() - t0:.1f} s -> {out}")
    return 0
