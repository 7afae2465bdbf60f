"""Where the simulated step goes, per published W1-W5 row, against Phantora's published step.

Usage::

    python benchmarks/step_attribution.py            # every published ok row of tests/data/published_runs.csv
    python benchmarks/step_attribution.py --only phantora_l40s_W4_2x1,phantora_a100_40g_W4_2x1
    python benchmarks/step_attribution.py --kernels phantora_l40s_W4_2x1
                                                     # also that row's steady compute, item by item

For each row the analytic simulator runs one job (no Dagster, no trace files) and keeps its
simulated DAG (``AnalyticSimulator(keep_schedule=True)``). The first steady step of rank 0 is
split into

* ``fwd`` / ``bwd`` / ``opt``: the compute stream busy with forward, backward and optimizer items
  (``Compute.phase``; the gradient casts and scaling of DeepSpeed's bf16 optimizer are ``opt``),
* ``comm``: exposed communication, the time rank 0's compute stream is idle while a collective of
  one of its communicators is in flight (a blocking TP all-reduce, MoE all-to-all, DeepSpeed's
  all-reduce and all-gather),
* ``idle``: the rest (rank 0 waits for nothing it owns: another rank, the step's barrier),

so ``fwd + bwd + opt + comm + idle`` is the simulated step. ``host`` is the time the host side
adds (launch gaps, Python between kernels): none here, as in the published runs, which Phantora ran
with ``PHANTORA_IGNORE_CPU_TIME=1`` (``tests/docker/*/config_gen.py``; ``cuda_call/src/capi.rs``
``get_current_sim_time`` then advances simulated time by GPU and network events only). ``gap`` is
published minus simulated: the time the simulator does not issue.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phantora_assets.lib.sim.analytic import AnalyticSimulator  # noqa: E402
from phantora_assets.lib.sim.workload_types import Compute  # noqa: E402
from phantora_assets.matrix import load_run_matrix  # noqa: E402

PUBLISHED = ROOT / "tests" / "data" / "published_runs.csv"


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(iv):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(iv: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in iv)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """|a - b| of two unions of intervals."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


def attribution(spec) -> dict:
    """Rank 0's first steady step of ``spec`` split into fwd, bwd, opt, comm, idle (ms), plus
    the simulated step (median of the steady ones, ms) and the compute items' times by name."""
    sim = AnalyticSimulator(spec, emit=False, keep_schedule=True)
    res = sim.run()
    dag, times, _ = sim.simulated  # type: ignore[misc]
    t0 = times.sim_start[1]
    t1 = t0 + times.durations[1]
    kind, who, what, it = dag.kind, dag.who, dag.what, dag.iter_of
    phase_ns = {"fwd": 0.0, "bwd": 0.0, "opt": 0.0}
    busy: list[tuple[float, float]] = []
    comm: list[tuple[float, float]] = []
    items: dict[str, float] = {}
    for n in range(len(kind)):
        if it[n] != 1:
            continue
        s, e = float(dag.start[n]), float(dag.end[n])
        if kind[n] == 0 and who[n] == 0 and isinstance(what[n], Compute):
            phase_ns[what[n].phase] = phase_ns.get(what[n].phase, 0.0) + (e - s)
            busy.append((s, e))
            items[what[n].name] = items.get(what[n].name, 0.0) + (e - s)
        elif kind[n] == 1 and 0 in dag.comm_list[who[n]].ranks:
            comm.append((max(s, t0), min(e, t1)))
    busy_u, comm_u = _union(busy), _union(comm)
    exposed = _minus(comm_u, busy_u)
    step = t1 - t0
    idle = step - _length(busy_u) - exposed
    return {
        "step_ms": res.step_ns / 1e6,
        "first_steady_ms": step / 1e6,
        **{k: v / 1e6 for k, v in phase_ns.items()},
        "comm": exposed / 1e6,
        "idle": idle / 1e6,
        "items": {k: v / 1e6 for k, v in items.items()},
        "db_fraction": res.db_fraction,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated run ids (default: every published ok row)")
    ap.add_argument("--kernels", default="", help="a run id: also its steady compute, item by item (ms)")
    args = ap.parse_args(argv)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    specs = {s.run_id: s for s in load_run_matrix()}
    with PUBLISHED.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["status"] == "ok" and (not only or r["run_id"] in only)]
    print(
        f"{'run_id':28s} {'published':>9s} {'simulated':>9s} {'gap':>7s} {'error':>7s} | "
        f"{'fwd':>6s} {'bwd':>6s} {'opt':>6s} {'comm':>6s} {'idle':>6s} {'host':>5s}  (ms, rank 0, first steady step)"
    )
    errs = []
    for r in rows:
        a = attribution(specs[r["run_id"]])
        pub = float(r["step_time_ms"])
        err = (a["step_ms"] - pub) / pub
        errs.append(abs(err))
        print(
            f"{r['run_id']:28s} {pub:9.1f} {a['step_ms']:9.1f} {pub - a['step_ms']:+7.1f} {err:+7.1%} | "
            f"{a['fwd']:6.1f} {a['bwd']:6.1f} {a['opt']:6.1f} {a['comm']:6.1f} {a['idle']:6.1f} {0.0:5.1f}"
        )
    if errs:
        print(f"\n{len(errs)} rows: median |error| {float(np.median(errs)):.1%}, max |error| {max(errs):.1%}")
    if args.kernels:
        a = attribution(specs[args.kernels])
        print(f"\n{args.kernels}: steady compute of rank 0 by item (ms), largest first")
        for name, ms in sorted(a["items"].items(), key=lambda x: -x[1]):
            print(f"  {name:48s} {ms:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
