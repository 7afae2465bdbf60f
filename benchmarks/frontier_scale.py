"""Frontier scale: the analytic simulator at 2,048 / 8,192 / 16,384 GPUs (issue 37).

Usage::

    python benchmarks/frontier_scale.py                       # Llama 3 405B at DP 16, 64, 128
    python benchmarks/frontier_scale.py --dp 2 --global-batch 64 --side-by-side 2
    python benchmarks/frontier_scale.py --assets                # every per-run asset and the dataset

The job (issue 37 item 6): Llama 3 405B (126 layers, hidden 16384, ffn 53248, 128 heads, 8 KV heads,
vocab 128256), Megatron, TP 8 with sequence parallelism, PP 16 with 7 layers on the first and last stage,
sequence 8192, global batch 2048, full recompute, H100, 8 GPUs a host, RailOptimized with a 400 Gb/s NIC
a GPU. Each size runs in a fresh process (its own peak RSS) and prints the simulation's wall time and
peak RSS, its DAG nodes, flows and network rate recomputations, the step time, which DAG was simulated
(``SimulationResult.symmetry``: one rank a stage, checked, or every rank), and whether the trace the
per-run assets would build fits their event bound (``lib/sim/analytic.trace_bound_rule``).

``--side-by-side DP``: the same job at that DP simulated both ways in one run, one rank a stage
(``compress=True``, the default) and every rank (``compress=False``), with the ratio of their times and
whether their step times agree.

``--assets``: the job at each DP through every per-run asset and the dataset (raw_timeline .. run_plots,
phantora_v0, dataset_duckdb), each stage in its own forked child as the assets call it
(``benchmarks/pipeline_scale.py``), with its seconds and peak RSS; the run's timeline scope (past the trace
bound: every network flow, the compute of one rank a stage) and events. Targets (issue 37): at 16,384 GPUs
<= 15 minutes over all stages and <= 4 GiB peak RSS in every stage; the time from the smallest to the
largest size grows no faster than the GPUs. Exit 1 when a target is missed.

Measured numbers live in docs/BENCHMARKS.md (command, commit).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TP, PP, GPUS_PER_HOST = 8, 16, 8


def job(dp: int, global_batch: int = 2048) -> dict:
    """The Llama 3 405B workload table at data-parallel size ``dp``."""
    model = {"name": "Llama3-405B", "kind": "dense", "layers": 126, "hidden": 16384, "ffn_hidden": 53248}
    model |= {"heads": 128, "kv_heads": 8, "vocab": 128256}
    par = {"tp": TP, "pp": PP, "dp": dp, "sequence_parallel": True, "zero": 1, "pp_schedule": "1f1b"}
    par |= {"first_stage_layers": 7, "last_stage_layers": 7}
    train = {"seq_len": 8192, "micro_batch": 1, "global_batch": global_batch, "recompute": "full", "iterations": 3}
    return {"framework": "megatron", "model": model, "parallel": par, "train": train}


def one(dp: int, compress: bool, global_batch: int) -> dict:
    """Simulate the job at ``dp`` in this process; the figures as a dict."""
    from phantora_assets.lib.run.spec import RunSpec
    from phantora_assets.lib.sim.analytic import AnalyticSimulator, trace_bound_rule
    from phantora_assets.lib.workload.collectives import run_spec_of

    gpus = TP * PP * dp
    hosts = gpus // GPUS_PER_HOST
    base = run_spec_of(job(dp, global_batch), nodes=hosts, gpus_per_node=GPUS_PER_HOST, gpu="h100", name="l405")
    topo = (("topology", "RailOptimized"), ("nic_bw_gbps", 400))
    spec = RunSpec(base.workload, "h100", hosts, GPUS_PER_HOST, topology=topo, workload_def=base.workload_def)
    t0 = time.perf_counter()
    sim = AnalyticSimulator(spec, emit=False, compress=compress)
    res = sim.run()
    wall = time.perf_counter() - t0
    return {
        "gpus": gpus,
        "dp": dp,
        "compress": compress,
        "wall_s": round(wall, 1),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "dag_nodes": sim.n_nodes,
        "flows": sim.n_flows,
        "recomputations": sim.net_recomputations,
        "step_s": round(res.step_ns / 1e9, 4),
        "symmetry": res.symmetry,
        "trace_bound": trace_bound_rule(spec) or "fits",
    }


ASSET_WALL_S = 15 * 60
ASSET_RSS_MIB = 4096


def spec_of(dp: int, global_batch: int = 2048):
    """The job's RunSpec at data-parallel size ``dp`` (RailOptimized, a 400 Gb/s NIC a GPU)."""
    from phantora_assets.lib.run.spec import RunSpec
    from phantora_assets.lib.workload.collectives import run_spec_of

    hosts = TP * PP * dp // GPUS_PER_HOST
    base = run_spec_of(job(dp, global_batch), nodes=hosts, gpus_per_node=GPUS_PER_HOST, gpu="h100", name="llama3_405b")
    topo = (("topology", "RailOptimized"), ("nic_bw_gbps", 400))
    return RunSpec(base.workload, "h100", hosts, GPUS_PER_HOST, topology=topo, workload_def=base.workload_def)


def assets(dps: list[int], global_batch: int) -> int:
    """Every per-run asset and the dataset at each DP, a stage a forked child; the table and the targets."""
    import tempfile

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import pyarrow.parquet as pq
    from pipeline_scale import DATASET_STAGES, RUN_STAGES, run_forked

    from phantora_assets.lib.sim.analytic import timeline_scope
    from phantora_assets.paths import DataPaths
    from phantora_assets.stages import analysis, dataset, flows, links, reconfig, simulation, traces  # noqa: F401 (imported once, before the forks)

    stages = RUN_STAGES + DATASET_STAGES
    print("seconds / peak RSS MiB per stage (each stage in its own forked process)")
    print(f"{'GPUs':>6} {'events':>9} " + " ".join(f"{s[:10]:>10}" for s in stages) + f" {'total s':>8} {'max MiB':>8}")
    failures: list[str] = []
    totals: list[tuple[int, float]] = []
    for dp in dps:
        spec = spec_of(dp, global_batch)
        gpus = spec.world_size
        with tempfile.TemporaryDirectory(prefix="frontier_scale_") as tmp:
            paths = DataPaths(Path(tmp))
            res = {s: run_forked(s, spec, paths) for s in stages}
            raw = paths.table(spec.run_id, "raw_timeline")
            events = pq.ParquetFile(raw).metadata.num_rows if raw.exists() else 0
        total = sum(res[s][0] for s in stages)
        peak = max(res[s][1] for s in stages)
        print(
            f"{gpus:>6} {events:>9} " + " ".join(f"{res[s][0]:>10.2f}" for s in stages) + f" {total:>8.1f} {peak:>8.0f}"
        )
        print(f"{'':>6} {'':>9} " + " ".join(f"{res[s][1]:>10.0f}" for s in stages), flush=True)
        print(f"{'':>6} scope: {timeline_scope(spec)[0]}", flush=True)
        failures += [f"{gpus} GPUs {s}: {e}" for s, (_, _, e) in res.items() if e]
        if gpus >= 16384 and total > ASSET_WALL_S:
            failures.append(f"{gpus} GPUs: {total:.0f} s > {ASSET_WALL_S} s")
        if gpus >= 16384 and peak > ASSET_RSS_MIB:
            failures.append(f"{gpus} GPUs: peak RSS {peak:.0f} MiB > {ASSET_RSS_MIB}")
        totals.append((gpus, total))
    if len(totals) > 1:
        (g0, t0), (g1, t1) = totals[0], totals[-1]
        verdict = "at most" if t1 / t0 <= g1 / g0 else "more than"
        print(f"\nall stages, {g1 // g0}x the GPUs: {t1 / t0:.2f}x the time ({verdict} linear)")
        if t1 / t0 > g1 / g0:
            failures.append(f"time grows {t1 / t0:.2f}x for {g1 // g0}x the GPUs")
    for f in failures:
        print("MISSED:", f)
    return 1 if failures else 0


def in_child(dp: int, compress: bool, global_batch: int) -> dict:
    args = ["--child", str(dp), "--compress", str(int(compress)), "--global-batch", str(global_batch)]
    out = subprocess.run(
        [sys.executable, __file__, *args],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", default="16,64,128", help="data-parallel sizes (comma-separated)")
    ap.add_argument("--side-by-side", type=int, default=0, metavar="DP", help="also simulate every rank at this DP")
    ap.add_argument("--global-batch", type=int, default=2048, help="sequences a step (2048: the job's)")
    ap.add_argument("--assets", action="store_true", help="every per-run asset and the dataset, a stage at a time")
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--compress", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one(args.child, bool(args.compress), args.global_batch)))
        return 0
    if args.assets:
        return assets([int(x) for x in args.dp.split(",") if x], args.global_batch)
    load = os.getloadavg()
    print(f"Llama 3 405B, TP {TP} PP {PP}, global batch {args.global_batch}, RailOptimized", end="; ")
    print(f"load average {load[0]:.2f} on {os.cpu_count()} CPUs\n")
    hdr = f"{'GPUs':>6s} {'DP':>4s} {'sim s':>7s} {'RSS MiB':>8s} {'DAG nodes':>10s} {'flows':>10s}"
    hdr += f" {'recomp.':>9s} {'step s':>8s}"
    print(hdr + "  simulated / trace")
    rows = []
    for dp in [int(x) for x in args.dp.split(",") if x]:
        r = in_child(dp, True, args.global_batch)
        rows.append(r)
        print(
            f"{r['gpus']:>6d} {dp:>4d} {r['wall_s']:>7.1f} {r['peak_rss_mib']:>8d} {r['dag_nodes']:>10,d} "
            f"{r['flows']:>10,d} {r['recomputations']:>9,d} {r['step_s']:>8.3f}  {r['symmetry'][:60]} / "
            f"{r['trace_bound'][:70]}",
            flush=True,
        )
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        print(
            f"\nwall time {b['gpus'] // a['gpus']}x the GPUs: {b['wall_s'] / a['wall_s']:.2f}x "
            f"({'at most' if b['wall_s'] / a['wall_s'] <= b['gpus'] / a['gpus'] else 'more than'} linear)"
        )
    if args.side_by_side:
        gb = args.global_batch
        fast, full = in_child(args.side_by_side, True, gb), in_child(args.side_by_side, False, gb)
        print(
            f"\nside by side at DP {args.side_by_side} ({fast['gpus']} GPUs): one rank a stage {fast['wall_s']} s, "
            f"{fast['peak_rss_mib']} MiB, {fast['dag_nodes']:,} nodes; every rank {full['wall_s']} s, "
            f"{full['peak_rss_mib']} MiB, {full['dag_nodes']:,} nodes; "
            f"time ratio {fast['wall_s'] / full['wall_s']:.3f}; "
            f"step {fast['step_s']} s against {full['step_s']} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
