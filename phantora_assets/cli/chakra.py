"""``phantora-assets chakra RUN_ID OUT_DIR [--prefix P] [--stream-order ctrl|data] [--data-dir D]``: a
built run as Chakra ETs.

Writes ``OUT_DIR/P.<rank>.et`` for every rank and ``OUT_DIR/P.comm_groups.json`` (P defaults to the
run_id), for a run of any source whose ``validated_flows`` has been materialized (``phantora-assets
build --run RUN_ID``): a run of the embedded simulator (source ``analytic``) from its step program
(``lib/chakra/program.py``: the dependencies the simulator runs, streamed rank by rank; its steady steps
from ``steps.parquet``), any other from its timeline (``lib/chakra/export.py``). Exit 2 with a
message naming the run or file: an unknown run_id, a run not built, a run that does not fit in GPU
memory (it has no trace: a rebuild cannot help), a trace that breaks a rule, a ``--prefix`` that is
not a plain file name, or an OUT_DIR that is not a folder or cannot be written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from phantora_assets.paths import DataPaths


def cmd_chakra(args: argparse.Namespace) -> int:
    import pandas as pd

    from phantora_assets.imported_runs import runs_by_id
    from phantora_assets.lib.chakra.export import export_run
    from phantora_assets.lib.errors import FileRuleError

    paths = DataPaths(Path(args.data_dir))
    spec = runs_by_id(paths.root).get(args.run_id)
    if spec is None:
        print(f"chakra: {args.run_id} is not a run of the matrix under {paths.root}", file=sys.stderr)
        return 2
    pdir = paths.partition_dir(spec.run_id)
    needed = [pdir / "steps.parquet", pdir / "flows.parquet", paths.chrome_trace(spec)]
    missing = [p for p in needed if not p.is_file()]
    memory = _memory_verdict(spec, paths) if missing else None
    if memory is not None and not memory.fits:
        print(
            f"chakra: {spec.run_id}: {memory.message} (fits_in_memory failed): a run that does not fit in GPU "
            "memory is not simulated, so it has no trace to export, and a rebuild gives the same; "
            "`phantora-assets runs` lists the runs that fit",
            file=sys.stderr,
        )
        return 2
    if missing:
        print(
            f"chakra: {spec.run_id} is not built ({missing[0]} missing): phantora-assets build --run {spec.run_id}",
            file=sys.stderr,
        )
        return 2
    if spec.source == "analytic":
        return _export_program(spec, needed[0], Path(args.out_dir), args.prefix or spec.run_id, args.stream_order)
    if args.stream_order != "ctrl":
        print(
            f"chakra: {spec.run_id}: --stream-order applies to a simulated run (source analytic) only", file=sys.stderr
        )
        return 2
    try:
        summary = export_run(
            paths.chrome_trace(spec), pd.read_parquet(needed[0]), pd.read_parquet(needed[1]), Path(args.out_dir),
            args.prefix or spec.run_id, spec.run_id, spec.gpus_per_node, spec.world_size,
        )  # fmt: skip
    except (FileRuleError, ValueError, OSError) as exc:
        print(f"chakra: {exc}", file=sys.stderr)
        return 2
    steps = summary.steady_steps
    print(f"{spec.run_id}: steady steps {steps[0]}..{steps[-1]} ({len(steps)}) as Chakra ETs")
    for f, (rank, n) in zip(summary.files, summary.nodes.items()):
        kinds = ", ".join(f"{v} {k}" for k, v in n.items())
        print(f"  {f}  rank {rank}: {kinds}")
    print(f"  {summary.comm_groups}")
    return 0


def _export_program(spec, steps_path: Path, out_dir: Path, prefix: str, stream_order: str) -> int:
    import pandas as pd

    from phantora_assets.lib.chakra.program import export_program
    from phantora_assets.lib.errors import RunMatrixError

    steps = pd.read_parquet(steps_path, columns=["step", "steady"])
    steady = sorted(int(s) for s in steps.loc[steps["steady"], "step"])
    try:
        summary = export_program(spec, steady, out_dir, prefix, stream_order)
    except (RunMatrixError, ValueError, OSError) as exc:  # OSError: OUT_DIR cannot be made or written
        print(f"chakra: {exc}", file=sys.stderr)
        return 2
    print(f"{spec.run_id}: steady steps {steady[0]}..{steady[-1]} ({len(steady)}) as Chakra ETs from the step program "
          f"(stream order in {stream_order}_deps; simulated: {summary.symmetry.split(' (')[0]})")  # fmt: skip
    for f, (rank, n) in zip(summary.files, summary.nodes.items()):
        print(f"  {f}  rank {rank}: " + ", ".join(f"{v} {k}" for k, v in n.items()))
    print(f"  {summary.comm_groups}")
    return 0


def _memory_verdict(spec, paths: DataPaths):
    """``stages/simulation.memory_verdict`` of the run, None also when its records are malformed (the
    "not built" message then names the missing file)."""
    from phantora_assets.records import RecordError
    from phantora_assets.stages.simulation import memory_verdict

    try:
        return memory_verdict(spec, paths)
    except RecordError:
        return None
