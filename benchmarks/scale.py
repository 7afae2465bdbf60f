"""Scale of the analytic simulator: one training step on 16 .. 1024 GPUs.

Usage::

    python benchmarks/scale.py                 # W4 and W1 on a100_40g, 8 GPUs per node
    python benchmarks/scale.py --workloads W4 --max-gpus 2048

For each GPU count (powers of two from 16 to ``--max-gpus``, 8 GPUs per node, so 2 .. 128 nodes
on the default 800 Gbps leaf-spine) it simulates ONE steady training step from idle (no warm-up
step, no parameter broadcast) in this process, on one core (numpy is single-threaded here), and
prints the wall time of the simulation alone and with the raw timeline emitted, the number of
DAG nodes (per-rank compute items, per-communicator collectives), of flows and of network rate
recomputations, and the time per flow. The "vs flows" column is (time / time at 16 GPUs) /
(flows / flows at 16 GPUs): ~1 when the cost grows linearly in the number of flows. A log-log
slope of time against flows is printed per workload.

Target (issue 5): one W4-like step on 128 nodes x 8 GPUs (1024 GPUs) within 5 s; exit 1 if not.
The GPU is a100_40g (W4 fits its 40 GB at any data-parallel size).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from phantora_assets.lib.run.spec import RunSpec  # noqa: E402
from phantora_assets.lib.sim.analytic import AnalyticSimulator  # noqa: E402

TARGET_S = 5.0


def one_step(workload: str, gpu: str, nodes: int, gpn: int, emit: bool) -> tuple[float, AnalyticSimulator, object]:
    spec = RunSpec(workload, gpu, nodes, gpn)
    t0 = time.perf_counter()
    sim = AnalyticSimulator(spec, iterations=1, warmup=False, emit=emit)
    res = sim.run()
    return time.perf_counter() - t0, sim, res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="W4,W1")
    ap.add_argument("--gpu", default="a100_40g")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--max-gpus", type=int, default=1024)
    args = ap.parse_args(argv)
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
        core = "pinned to one core"
    except (AttributeError, OSError):
        core = "not pinned"
    load = os.getloadavg()
    print(
        f"one steady step per point, {core}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        f"on {os.cpu_count()} CPUs\n"
    )
    counts = [c for c in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if c <= args.max_gpus]
    ok = True
    for wl in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        print(f"{wl} on {args.gpu}, {args.gpus_per_node} GPUs per node")
        print(
            f"{'GPUs':>6s} {'nodes':>5s} {'step ms':>9s} {'sim s':>7s} {'+emit s':>8s} {'DAG nodes':>10s} "
            f"{'flows':>8s} {'rate recomp.':>12s} {'us/flow':>8s} {'vs flows':>9s}"
        )
        base = None
        xs, ys = [], []
        for n in counts:
            nodes = n // args.gpus_per_node
            t_sim, sim, res = one_step(wl, args.gpu, nodes, args.gpus_per_node, emit=False)
            if not res.fits:
                print(f"{n:6d} {nodes:5d}  does not fit ({res.memory.as_dict()['peak_gib']} GiB)")
                continue
            t_emit, _, _ = one_step(wl, args.gpu, nodes, args.gpus_per_node, emit=True)
            flows = sim.n_flows
            if base is None:
                base = (t_sim, flows)
            ratio = (t_sim / base[0]) / (flows / base[1])
            xs.append(flows)
            ys.append(t_sim)
            print(
                f"{n:6d} {nodes:5d} {res.step_ns / 1e6:9.1f} {t_sim:7.3f} {t_emit:8.3f} {sim.n_nodes:10d} "
                f"{flows:8d} {sim.net_recomputations:12d} {1e6 * t_sim / flows:8.1f} {ratio:9.2f}"
            )
            if wl == "W4" and n == 1024 and t_emit > TARGET_S:
                ok = False
        if len(xs) > 2:
            slope = np.polyfit(np.log(xs), np.log(ys), 1)[0]
            print(f"log-log slope of simulation time vs flows: {slope:.2f} (1.00 = linear)\n")
    w4 = [w for w in args.workloads.split(",") if w.strip() == "W4"]
    if w4 and 1024 in counts:
        print(
            f"target: one W4 step on 128 x 8 GPUs <= {TARGET_S:.0f} s (simulation + raw timeline): "
            f"{'met' if ok else 'MISSED'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
