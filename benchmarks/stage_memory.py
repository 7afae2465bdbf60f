"""Host memory per stage: the estimate known before simulating against the measured peak RSS (issue 37 item 4).

Usage::

    python benchmarks/stage_memory.py                            # 3 shipped runs, W1 16x8, W4 32x8, W5 32x8
    python benchmarks/stage_memory.py --runs F16                 # Llama 3 405B on 2,048 GPUs (frontier_scale.py)
    python benchmarks/stage_memory.py --runs W4:128x1,W5:64      # W<k>:<nodes>[x<gpus a node>] on h200 (x1: h100)

Each run goes through every per-run asset, each stage in its own forked child of this process
(``benchmarks/pipeline_scale.run_forked``: ``ru_maxrss`` of the child). This process first imports what a build's
run worker has imported (``instance/warm.py``: Dagster, the code location, pandas, pyarrow, matplotlib, DuckDB), so
that a child's baseline is the build's (``lib/stage_memory.BASELINE_MIB``). Per stage it prints the estimate
(``lib/stage_memory.estimate_stages`` of ``job_size``, counted before simulating), the measured peak and their
ratio; then, per run, the job sizes against the rows the stages wrote (they must be equal: the counts are exact),
and over every stage of every run the smallest and largest ratio estimate / measured. The estimate is meant as an
upper bound (ratio >= 1). Exit 1 when a ratio is below 1 or a count differs.

Measured numbers live in docs/BENCHMARKS.md ("Host memory per stage").
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

DEFAULT_RUNS = "phantora_a100_40g_W1_4x2,phantora_a100_40g_W3_2x4,phantora_l40s_W4_2x1,W1:16,W4:32,W5:32"


def spec_of(token: str):
    """A run of the shipped matrix (its run id), ``W<k>:<nodes>[x<gpus>]`` (h200; one GPU a node: h100), or
    ``F<dp>`` (``frontier_scale.spec_of``)."""
    from phantora_assets.lib.run.spec import RunSpec, validate
    from phantora_assets.matrix import load_run_matrix

    if token.startswith("F"):
        import frontier_scale

        return frontier_scale.spec_of(int(token[1:]))
    if ":" in token:
        wl, size = token.split(":")
        nodes, _, gpn = size.partition("x")
        g = int(gpn or 8)
        spec = RunSpec(workload=wl, gpu="h200" if g > 1 else "h100", n_nodes=int(nodes), gpus_per_node=g)
        experts = int(spec.preset.get("num_moe_experts", 0))
        if spec.preset.get("expert_parallel") and experts % spec.world_size:
            spec = dataclasses.replace(spec, ep_size=8)
        validate(spec, token)
        return spec
    return {s.run_id: s for s in load_run_matrix()}[token]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default=DEFAULT_RUNS, help="comma-separated: run ids, W<k>:<nodes>[x<gpus>], F<dp>")
    args = ap.parse_args(argv)

    import importlib

    import pyarrow.parquet as pq
    from pipeline_scale import run_forked

    import phantora_assets.instance.warm as warm
    from phantora_assets.lib.stage_memory import STAGES, estimate_stages, job_size
    from phantora_assets.paths import DataPaths

    for name in warm.LAZY_MODULES:  # what the build's worker holds before its stage
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"parent with the build's imports: {base:.0f} MiB (lib/stage_memory.BASELINE_MIB)\n")
    ratios: list[tuple[float, str]] = []
    failures: list[str] = []
    largest: list[tuple[str, float, float]] = []
    for token in [t for t in args.runs.split(",") if t]:
        spec = spec_of(token)
        size = job_size(spec)
        est = {e.stage: e for e in estimate_stages(size)}
        print(
            f"{spec.run_id} ({token}): {size.events:,} events ({size.scope}), {size.network_flows:,} network flows, "
            f"{size.step_network_flows:,} a step, {size.pairs:,} host pairs, {size.pair_rows:,} per-pair rows "
            f"({'sparse' if size.sparse else 'dense'}), {size.bins} bins x {size.links:,} links"
        )
        print(f"  {'stage':16s} {'estimate MiB':>12s} {'measured MiB':>12s} {'est/meas':>9s}  seconds")
        with tempfile.TemporaryDirectory(prefix="stage_memory_") as tmp:
            paths = DataPaths(Path(tmp))
            measured: dict[str, float] = {}
            for stage in STAGES:
                secs, rss, err = run_forked(stage, spec, paths)
                e = est[stage].mib
                r = e / rss if rss == rss and rss > 0 else float("nan")
                print(f"  {stage:16s} {e:>12,.0f} {rss:>12,.0f} {r:>9.2f}  {secs:7.1f} {err[:80]}", flush=True)
                if err:
                    failures.append(f"{token} {stage}: {err[:120]}")
                elif r == r:
                    ratios.append((r, f"{token} {stage}"))
                    if r < 1:
                        failures.append(f"{token} {stage}: estimate {e:.0f} MiB < measured {rss:.0f} MiB")
                measured[stage] = rss
            largest.append((token, max(x.mib for x in est.values()), max(measured.values())))
            part = paths.partition_dir(spec.run_id)

            def rows(name: str, part: Path = part) -> int:
                f = part / f"{name}.parquet"
                return pq.ParquetFile(f).metadata.num_rows if f.exists() else -1

            counted = {
                "raw_timeline": size.events,
                "flows": size.network_flows,
                "step_flows": size.step_network_flows,
                "flows_100ms": size.pair_rows if not size.sparse else -2,
                "link_bins": size.bins * size.links,
            }
            for name, want in counted.items():
                got = rows(name)
                if want == -2:  # sparse: at most bins x pairs
                    ok = 0 <= got <= size.pair_rows
                else:
                    ok = got == want
                print(
                    f"  rows of {name}: counted {want if want >= 0 else size.pair_rows:,}, written {got:,}"
                    f"{'' if ok else '  DIFFERENT'}"
                )
                if not ok:
                    failures.append(f"{token} {name}: counted {want}, written {got}")
        print(flush=True)
    if ratios:
        lo, hi = min(ratios), max(ratios)
        print(f"estimate / measured over {len(ratios)} stages: min {lo[0]:.2f} ({lo[1]}), max {hi[0]:.2f} ({hi[1]})")
    for token, e, m in largest:
        print(f"{token}: largest stage estimated {e:,.0f} MiB, measured {m:,.0f} MiB: {e / m:.2f}")
    for f in failures:
        print("MISSED:", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
