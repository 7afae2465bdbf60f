"""How the per-run graph scales with the trace: seconds and peak RSS per stage, W1..W5 on 16..128 x 8.

    python benchmarks/pipeline_scale.py                          # W1..W5 x {16,32,64,128}x8, h200
    python benchmarks/pipeline_scale.py --workloads W5,W1 --sizes 16,128 --gpu h100
    python benchmarks/pipeline_scale.py --workloads W4 --sizes 16 --no-dataset   # a quick look

Every stage of a run (raw_timeline, chrome_trace, validated_flows, binned_flows, link_bins,
window_features, run_summary, step_anatomy, reconfig, run_plots, then phantora_v0 and dataset_duckdb of
that one run) runs in its own forked child of this process (which imported the stages once, before), one
after the other on one data root, exactly as the assets call them (``stages/``); each child reports its wall time and
its peak RSS (``ru_maxrss``, which counts the pages it shares with the parent: about the
interpreter with the package imported). The per-run chain's time is the sum over the stages from
raw_timeline to run_plots; ``events`` is the number of events of the run's Chrome trace.

Targets (issue 14): every stage of every run within 2 GiB peak RSS; the log-log slope of the
chain's time against the events from the smallest to the largest size of a workload <= 1.15;
the 64-node run's binned_flows and window_features each <= 1 s. Exit 1 when a target is missed,
0 otherwise (a workload measured at one size has no slope). Results go to stdout as a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pickle
import resource
import sys
import tempfile
import time
from pathlib import Path

from phantora_assets.assets import RUN_ASSET_NAMES

RSS_LIMIT_MIB = 2048
SLOPE_TARGET = 1.15
BIN_TARGET_S = 1.0
RUN_STAGES = RUN_ASSET_NAMES  # every per-run asset, in graph order
DATASET_STAGES = ("phantora_v0", "dataset_duckdb")


def stage_calls(spec, paths) -> dict:
    """One call per stage this benchmark runs (every per-run asset and the dataset's), by name."""
    from phantora_assets.sources.base import SourceContext
    from phantora_assets.stages import analysis, dataset, flows, links, reconfig, simulation, traces

    return {
        "raw_timeline": lambda: simulation.raw_timeline(spec, paths, SourceContext()),
        "chrome_trace": lambda: traces.chrome_trace(spec, paths, SourceContext()),
        "validated_flows": lambda: flows.validate_flows(spec, paths),
        "binned_flows": lambda: flows.bin_flows(spec, paths),
        "link_bins": lambda: links.link_bins_stage(spec, paths),
        "window_features": lambda: dataset.window_features(spec, paths),
        "run_summary": lambda: dataset.summarize_run(spec, paths),
        "step_anatomy": lambda: analysis.step_anatomy_stage(spec, paths),
        "reconfig": lambda: reconfig.reconfig_stage(spec, paths),
        "run_plots": lambda: analysis.run_plots_stage(spec, paths),
        "phantora_v0": lambda: dataset.export_dataset([spec], paths),
        "dataset_duckdb": lambda: dataset.dataset_duckdb_stage([spec], paths),
    }


def _stage(name: str, spec, paths):
    return stage_calls(spec, paths)[name]()


def run_forked(name: str, spec, paths) -> tuple[float, float, str]:
    """(seconds, peak RSS MiB, error or '') of one stage in a forked child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        err = ""
        t0 = time.perf_counter()
        try:
            _stage(name, spec, paths)
        except BaseException as exc:  # reported, never raised past the fork
            err = f"{type(exc).__name__}: {exc}"[:300]
        dt = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        os.write(w, pickle.dumps((dt, rss, err)))
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return math.nan, math.nan, f"child died (status {status})"
    return pickle.loads(data)


def trace_events(spec, paths) -> int:
    import pyarrow.parquet as pq

    return pq.ParquetFile(paths.table(spec.run_id, "raw_timeline")).metadata.num_rows


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of log(y) against log(x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="W1,W2,W3,W4,W5")
    ap.add_argument("--sizes", default="16,32,64,128", help="node counts (8 GPUs each)")
    ap.add_argument("--gpu", default="h200")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--no-dataset", action="store_true", help="skip phantora_v0 and dataset_duckdb")
    ap.add_argument(
        "--ep", type=int, default=8, help="ep of the MoE runs (W2, W3) whose GPU count does not divide the experts"
    )
    ap.add_argument("--data-dir", default=None, help="data root (default: a temporary folder, removed)")
    args = ap.parse_args(argv)

    from phantora_assets.lib.run.spec import RunSpec, validate
    from phantora_assets.paths import DataPaths
    from phantora_assets.stages import analysis, dataset, flows, links, reconfig, simulation, traces  # noqa: F401 (imported once, before the forks)

    stages = RUN_STAGES + (() if args.no_dataset else DATASET_STAGES)
    sizes = [int(s) for s in args.sizes.split(",")]
    failures: list[str] = []
    header = f"{'run':<28} {'events':>9} " + " ".join(f"{s[:10]:>10}" for s in stages) + f" {'chain s':>8}"
    print("seconds / peak RSS MiB per stage (each stage in its own forked process)")
    print(header)
    chain: dict[str, list[tuple[int, float]]] = {}
    bins64: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pipeline_scale_") as tmp:
        root = Path(args.data_dir or tmp)
        paths = DataPaths(root)
        for wl in args.workloads.split(","):
            for n in sizes:
                spec = RunSpec(workload=wl, gpu=args.gpu, n_nodes=n, gpus_per_node=args.gpus_per_node)
                experts = int(spec.preset.get("num_moe_experts", 0))
                if spec.preset.get("expert_parallel") and experts % spec.world_size:
                    spec = dataclasses.replace(spec, ep_size=args.ep)  # the preset rule (ep = GPUs) cannot hold
                validate(spec, f"{wl} {n}x{args.gpus_per_node}")
                res = {s: run_forked(s, spec, paths) for s in stages}
                errs = [f"{spec.run_id} {s}: {e}" for s, (_, _, e) in res.items() if e]
                events = trace_events(spec, paths) if not res["raw_timeline"][2] else 0
                total = sum(res[s][0] for s in RUN_STAGES)
                secs = " ".join(f"{res[s][0]:>10.2f}" for s in stages)
                rss = " ".join(f"{res[s][1]:>10.0f}" for s in stages)
                print(
                    f"{spec.run_id + (f' ep={spec.ep}' if spec.ep_size else ''):<28} {events:>9} {secs} {total:>8.2f}"
                )
                print(f"{'  peak RSS MiB':<28} {'':>9} {rss}", flush=True)
                failures += errs
                failures += [
                    f"{spec.run_id} {s}: peak RSS {res[s][1]:.0f} MiB > {RSS_LIMIT_MIB}"
                    for s in stages
                    if res[s][1] > RSS_LIMIT_MIB
                ]
                if not errs:
                    chain.setdefault(wl, []).append((events, total))
                if n == 64:
                    for s in ("binned_flows", "window_features"):
                        bins64.append(f"{spec.run_id} {s}: {res[s][0]:.2f} s (target <= {BIN_TARGET_S} s)")
                        if res[s][0] > BIN_TARGET_S:
                            failures.append(bins64[-1])
                for p in sorted(paths.root.glob("traces/*/*/timeline.json*")):
                    p.unlink()  # keep the disk small: the next runs need only their own
    print()
    for wl, pts in chain.items():
        if len(pts) >= 2:
            s = slope([e for e, _ in pts], [t for _, t in pts])
            print(f"{wl}: log-log slope of the chain's seconds vs events, {len(pts)} sizes: {s:.3f} (target <= 1.15)")
            if not s <= SLOPE_TARGET:
                failures.append(f"{wl}: slope {s:.3f} > {SLOPE_TARGET}")
    for line in bins64:
        print(line)
    for f in failures:
        print("MISSED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
