"""The dataset export at scale (issue 14, item 3): a 50 M-row ``flows_100ms`` exports and answers
``phantora-assets query`` within 2 GB of peak RSS.

Usage::

    python benchmarks/dataset_scale.py                  # 7 runs of 64 nodes: 50,803,200 flows_100ms rows
    python benchmarks/dataset_scale.py --runs 2 --nodes 16 --keep DIR

Synthesises per-run stage outputs as the build writes them (``partitions/<run_id>/``:
``flows_100ms.parquet`` dense over 1800 bins x every ordered node pair, sorted by (t, src_node,
dst_node) as ``lib/traffic/binning.build_bins`` gives them; ``windows.parquet`` from the real
``compute_window_features``; ``run_summary.parquet``; small ``flows.parquet`` / ``steps.parquet``;
``run_spec.json`` and passed checks in the run folder), then runs, each in a fresh process:

* ``export``: ``stages/dataset.export_dataset`` (phantora_v0/: CSVs, per-run Parquet, card);
* ``duckdb``: ``stages/dataset.dataset_duckdb_stage`` (phantora.duckdb and its check);
* ``query``: ``phantora-assets query "select run_id, sum(bytes) ... group by 1"``.

and prints, per step, the rows, the seconds and the peak RSS (``ru_maxrss`` of that process).
Exit 1 when a step exceeds ``--max-rss-mb`` (2048) or the query's sums differ from the synthesis.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SPECS = [("W1", "h100"), ("W4", "h100"), ("W5", "h100"), ("W1", "h200"), ("W4", "h200"), ("W5", "h200")]
SPECS += [("W4", "l40s"), ("W1", "l40s"), ("W5", "l40s"), ("W1", "a100_40g"), ("W4", "a100_40g"), ("W5", "a100_40g")]
N_BINS = 1800


def _specs(n_runs: int, nodes: int):
    from phantora_assets.lib.run.spec import RunSpec

    return [RunSpec(w, g, nodes, 8) for w, g in SPECS[:n_runs]]


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def synthesise(root: Path, n_runs: int, nodes: int) -> dict:
    """Write every per-run file the export and the database build read; returns bytes per run."""
    import pandas as pd

    from phantora_assets.checks import CHECKS, record_checks
    from phantora_assets.lib.columns import BIN_COLUMNS, FLOW_COLUMNS, STEP_COLUMNS
    from phantora_assets.lib.store.export import arrow_schema
    from phantora_assets.lib.store.parquet import write_parquet
    from phantora_assets.lib.traffic.window_features import compute_window_features
    from phantora_assets.paths import DataPaths
    from phantora_assets.records import write_record
    from phantora_assets.stages.dataset import runs_frame
    from phantora_assets.stages.simulation import run_spec_record

    paths = DataPaths(root)
    src, dst = np.nonzero(~np.eye(nodes, dtype=bool))  # every ordered pair, src-major
    pairs = len(src)
    sums = {}
    for k, spec in enumerate(_specs(n_runs, nodes)):
        rng = np.random.default_rng(k)
        pdir = paths.partition_dir(spec.run_id)
        pdir.mkdir(parents=True, exist_ok=True)
        schema = arrow_schema(BIN_COLUMNS)
        control = 5000 // 10 // (nodes - 1)
        total = 0
        with pq.ParquetWriter(pdir / "flows_100ms.parquet", schema, compression="zstd") as w:
            for b0 in range(0, N_BINS, 100):
                nb = min(100, N_BINS - b0)
                t = np.repeat(np.round(np.arange(b0, b0 + nb) * 0.1, 6), pairs)
                burst = rng.integers(0, 4, size=nb * pairs) == 0
                byts = control + burst * rng.integers(1, 2_000_000_000, size=nb * pairs)
                total += int(byts.sum())
                cols = [pa.array([spec.run_id] * (nb * pairs)), t, np.tile(src, nb), np.tile(dst, nb), byts]
                w.write_table(pa.Table.from_arrays([pa.array(c) for c in cols], schema=schema))
        sums[spec.run_id] = total
        bins = pd.read_parquet(pdir / "flows_100ms.parquet")
        write_parquet(compute_window_features(bins, run_id=spec.run_id), pdir / "windows.parquet")
        del bins
        row = {c: None for c in runs_frame([]).columns}
        row.update(
            run_id=spec.run_id, source="phantora_analytic", layout=spec.layout, n_nodes=nodes, step_time_s=0.5,
            inter_node_bytes_per_step=10**9, nic_bw=1e11, workload=spec.workload, framework="Megatron",
            model="synthetic", parallelism="dp=8", gpu=spec.gpu, gpus_per_node=8, world_size=nodes * 8,
            simulator="analytic", n_steady_steps=10, window_s=180.0, bin_s=0.1, seed=k,
        )  # fmt: skip
        write_parquet(runs_frame([row]), pdir / "run_summary.parquet")
        flows = pd.DataFrame({c: pd.Series([0] * 4 if d != "str" else ["x"] * 4) for c, d in FLOW_COLUMNS.items()})
        flows = flows.astype({c: d for c, d in FLOW_COLUMNS.items() if d != "str"}).assign(step=0)
        write_parquet(flows, pdir / "flows.parquet")
        steps = pd.DataFrame({c: pd.Series([1]).astype(d) for c, d in STEP_COLUMNS.items()}).assign(step=0)
        write_parquet(steps, pdir / "steps.parquet")
        write_record(pdir / "run_spec.json", run_spec_record(spec))
        by_asset: dict[str, list] = {}
        for c in CHECKS:
            by_asset.setdefault(c.asset, []).append((c.name, True, "synthetic", False))
        for asset, outcomes in by_asset.items():
            record_checks(paths.run_folder(spec), asset, outcomes)
    return {"rows": n_runs * N_BINS * pairs, "sums": sums}


def step(name: str, root: Path, n_runs: int, nodes: int) -> dict:
    """One step in this process; returns rows, seconds, peak RSS."""
    from phantora_assets.paths import DataPaths
    from phantora_assets.stages import dataset as stage

    paths, specs = DataPaths(root), _specs(n_runs, nodes)
    t0 = time.perf_counter()
    out: dict = {}
    if name == "synthesise":
        out = synthesise(root, n_runs, nodes)
    elif name == "export":
        res = stage.export_dataset(specs, paths)
        assert res.outcome.passed, res.outcome.message
        out = {"rows": res.rows.get("flows_100ms", 0), "included": len(res.included)}
    elif name == "duckdb":
        db = stage.dataset_duckdb_stage(specs, paths)
        assert db.outcome.passed, db.outcome.message
        out = {"rows": db.build.rows["flows_100ms"]}
    elif name == "query":
        import contextlib
        import io

        from phantora_assets.cli import main

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = main(["query", "select run_id, sum(bytes) from flows_100ms group by 1", "--data-dir", str(root),
                       "--format", "json"])  # fmt: skip
        assert rc == 0, buf.getvalue()
        got = json.loads(buf.getvalue())
        out = {"sums": {r["run_id"]: int(r["sum(bytes)"]) for r in got}}
    out.update(seconds=round(time.perf_counter() - t0, 2), peak_rss_mb=round(_peak_mb(), 1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--max-rss-mb", type=float, default=2048)
    ap.add_argument("--keep", type=Path, help="data root to keep (default: a temporary folder, removed)")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        print(json.dumps(step(args.step, args.root, args.runs, args.nodes)))
        return 0
    root = args.keep or Path(tempfile.mkdtemp(prefix="dataset_scale_")) / "data"
    results = {}
    try:
        for name in ("synthesise", "export", "duckdb", "query"):
            cmd = [sys.executable, __file__, "--step", name, "--root", str(root)]
            cmd += ["--runs", str(args.runs), "--nodes", str(args.nodes)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                print(proc.stdout, proc.stderr, file=sys.stderr)
                return 1
            results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            r = results[name]
            rows = f"{r['rows']:>12,}" if isinstance(r.get("rows"), int) else f"{'-':>12}"
            print(f"{name:<11} rows {rows}  {r['seconds']:8.2f} s  peak RSS {r['peak_rss_mb']:8.1f} MB", flush=True)
        sizes = {p.name: p.stat().st_size for p in (root / "phantora_v0").glob("*.csv")}
        pq_bytes = sum(p.stat().st_size for p in (root / "phantora_v0" / "flows_100ms").rglob("*.parquet"))
        print(f"flows_100ms.csv {sizes['flows_100ms.csv'] / 1e6:.0f} MB, its Parquet parts {pq_bytes / 1e6:.0f} MB, "
              f"phantora.duckdb {(root / 'phantora.duckdb').stat().st_size / 1e6:.0f} MB")  # fmt: skip
    finally:
        if args.keep is None:
            shutil.rmtree(root.parent, ignore_errors=True)
    ok = results["query"]["sums"] == results["synthesise"]["sums"]
    worst = max(results[n]["peak_rss_mb"] for n in ("export", "duckdb", "query"))
    print(f"query sums equal the synthesis: {ok}; worst peak RSS {worst:.0f} MB (target <= {args.max_rss_mb:.0f} MB)")
    return 0 if ok and worst <= args.max_rss_mb else 1


if __name__ == "__main__":
    sys.exit(main())
