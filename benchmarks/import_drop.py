"""A run folder dropped into the watched folder under plain ``dagster dev``: the time until the
dataset is current, against ``phantora-assets import`` of the same folder, side by side in one run.

Usage::

    python benchmarks/import_drop.py [--drops 3]

* ``dev``: a fresh ``$DAGSTER_HOME`` with the project's ``dagster.yaml``, a one-run matrix
  (W4 l40s 2x1), ``$PHANTORA_ASSETS_IMPORT_DIR`` = an empty folder, and a real ``dagster dev -w
  workspace.yaml`` (webserver and daemon sharing one code server, as the docs start it). Once the
  ``import_dir`` sensor has ticked, run folders (analytic simulations laid out like the published
  dataset, written aside and moved in whole) are dropped one after the other; for each, the clock
  runs from the move to: its key among the dynamic run partitions (``import_dir`` adds it), its
  run of ``all_runs`` succeeded, and its row in ``phantora_v0/runs.csv`` (``dataset_automation``).
  Nobody clicks, nothing reloads the code location.
* ``cli``: ``phantora-assets import <folder> --quiet`` of the same folder into a fresh data root,
  wall time of the process (simulation-free: the folder's trace is imported, then the dataset).

Printed: one line per drop, the median of each, and the ratio dev/cli of the medians. Exit code 0
iff every drop reached the dataset.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import dagster as dg  # noqa: E402
from fixtures.dagster_proc import Timeout, drop_folder, in_dataset, partition_runs, place, running, ticks, wait  # noqa: E402
from fixtures.run_folders import analytic, deepspeed_log, write_run_folder  # noqa: E402

from phantora_assets.assets.common import RUN_PARTITIONS  # noqa: E402
from phantora_assets.lib.run.spec import RunSpec  # noqa: E402

DROPS = [RunSpec("W4", "h100", 2, 1), RunSpec("W4", "h100", 2, 2), RunSpec("W4", "h100", 4, 1)]


def _cli(spec: RunSpec, tmp: Path) -> float:
    src = tmp / f"cli_src_{spec.run_id}"
    s, raw, its = analytic(spec)
    folder = write_run_folder(src, s, raw, run_log=deepspeed_log(its, spec.n_nodes * spec.gpus_per_node))
    env = {**os.environ, "PHANTORA_ASSETS_RUN_MATRIX": str(tmp / "runs.toml")}
    env.pop("PHANTORA_ASSETS_IMPORT_DIR", None)
    env.pop("DAGSTER_HOME", None)
    t0 = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "phantora_assets.cli",
            "import",
            str(folder),
            "--data-dir",
            str(tmp / f"cli_{spec.run_id}"),
            "--quiet",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.monotonic() - t0
    if out.returncode != 0:
        raise SystemExit(f"phantora-assets import failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return seconds


def _drop(p, instance: dg.DagsterInstance, spec: RunSpec, folder: Path) -> tuple[str, float, float, float]:
    """Drop ``folder``; seconds from the move to: a partition, its run succeeded, in the dataset."""
    rid = spec.run_id
    t0 = drop_folder(p, folder, spec.gpu)
    wait(f"{rid} a partition", lambda: rid in instance.get_dynamic_partitions(RUN_PARTITIONS), 120, p.log, 0.1)
    t_part = time.monotonic() - t0
    wait(f"{rid} built", lambda: partition_runs(instance, rid, dg.DagsterRunStatus.SUCCESS), 180, p.log, 0.2)
    t_run = time.monotonic() - t0
    wait(f"{rid} in the dataset", lambda: in_dataset(p.data, rid), 180, p.log, 0.2)
    return rid, t_part, t_run, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drops", type=int, default=3, choices=range(1, len(DROPS) + 1))
    args = ap.parse_args()
    specs = DROPS[: args.drops]
    with tempfile.TemporaryDirectory(prefix="import_drop_") as t:
        tmp = Path(t)
        p = place(tmp / "dev")
        (tmp / "runs.toml").write_text((tmp / "dev" / "runs.toml").read_text())
        folders = {}
        for spec in specs:
            s, raw, its = analytic(spec)
            folders[spec.run_id] = write_run_folder(
                p.staging / spec.run_id, s, raw, run_log=deepspeed_log(its, spec.n_nodes * spec.gpus_per_node)
            )
        rows: list[tuple[str, float, float, float]] = []
        ok = True
        t_start = time.monotonic()
        with running(p, "dev"), dg.DagsterInstance.from_config(str(p.home)) as instance:
            wait("the import_dir sensor's first tick", lambda: ticks(instance, "import_dir"), 180, p.log)
            print(f"dagster dev up (import_dir ticked) after {time.monotonic() - t_start:.1f} s", flush=True)
            for spec in specs:
                try:
                    row = _drop(p, instance, spec, folders[spec.run_id])
                except Timeout as exc:
                    print(str(exc).splitlines()[0], flush=True)
                    ok = False
                    break
                rows.append(row)
                print(
                    f"dev  {row[0]:24s} partition {row[1]:5.1f} s  run ok {row[2]:5.1f} s  in dataset {row[3]:5.1f} s",
                    flush=True,
                )
        cli = []
        for spec in specs:
            cli.append(_cli(spec, tmp))
            print(f"cli  {spec.run_id:24s} phantora-assets import: {cli[-1]:5.1f} s", flush=True)
        if rows:
            med = statistics.median(r[3] for r in rows)
            part, run = (statistics.median(r[i] for r in rows) for i in (1, 2))
            print(
                f"\nmedian drop -> dataset under dagster dev: {med:.1f} s (partition {part:.1f} s, run {run:.1f} s); "
                f"phantora-assets import: {statistics.median(cli):.1f} s; dev/cli = {med / statistics.median(cli):.2f}"
            )
    return 0 if ok and len(rows) == len(specs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
