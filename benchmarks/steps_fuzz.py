"""Fuzz step detection with generated runs of a known truth (issue 13: right or loud; by hand, not in CI).

    python benchmarks/steps_fuzz.py [--seeds 300-599] [--with-compute] [--show SEED] [-v]

Each seed generates one run of ``n`` iterations of ``T`` = 1000 us (the truth: one step per
iteration) on 4 ranks over 2 hosts, flows only (no Computation events, no run.log) unless
``--with-compute`` adds three kernels per iteration on each host:

* 1-3 communicators (a ring of 4 ranks or a pair), each with its own per-iteration pattern of 1-3
  calls (all_reduce / all_gather of 8, 1024 or 4096 elements), sometimes repeated 2-3 times within
  the iteration (identical calls: evenly spaced or at random offsets);
* sometimes an extra 1-element all-reduce (on one of them or on its own communicator) every ``g``
  iterations or at 2-4 irregular ones; sometimes a warm-up first iteration (longer, extra calls);
* a class per seed (``seed % 3``): ``clean``; ``jittered`` (iteration lengths within +-0.5-3 %, each
  call a few us late); ``cut`` (jittered or not, the trace ends inside its last iteration);
* few iterations (3-8) in about a third of the runs, else 10-24.

Every run is classified: ``right`` (step time within 3 % of the true iterations', at most one step
per iteration, every flow of a steady step in one iteration), ``by the rule`` (issue 28's rule,
docs/STEPS.md, where its answer is not one step an iteration: steps of ``g`` iterations when the extra
all-reduce comes every ``g`` and nothing finer issues the same calls in every step, which flows alone
cannot tell from a ``g``-iteration step (Computation events or run.log refuse it); ``r`` steps an
iteration when every communicator repeats its block a multiple of ``r`` times: the finest partition),
``refused`` (StepDetectionError, by rule), ``wrong`` (any other step time that is a multiple or a
fraction of the iteration: silently wrong),
``misplaced`` (the step time is right but a steady step holds flows of two iterations: silently
wrong too; the flows of the extra calls are not checked: where a step starts in the quiet time
between two iterations is a convention; a cut inside one communicator's pattern, when it rotates
its periods, is counted apart as ``misplaced (rotated)``: the README leaves open a communicator with
warm-up calls that no other communicator periodic from its first call tells) or ``crash`` (any other
exception). Prints the counts per class and the seeds of every silently wrong or crashing run;
``--show SEED`` prints that run's description and the detector's answer. Exit status 1 when any run
is silently wrong or crashed.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fixtures.step_runs import FlowBuilder  # noqa: E402

from phantora_assets.lib.errors import StepDetectionError  # noqa: E402
from phantora_assets.lib.traffic.steps import detect_steps  # noqa: E402

T = 1000.0
COUNTS = (8, 1024, 4096)
OPS = ("all_reduce", "all_gather")
GROUPS = ([0, 1, 2, 3], [0, 2], [1, 3], [0, 1])
KINDS = ("clean", "jittered", "cut")


@dataclass
class Run:
    flows: pd.DataFrame
    compute: pd.DataFrame | None
    starts: np.ndarray  # true iteration starts
    end: float  # nominal end of the last iteration
    kind: str
    desc: list[str]
    rotated: bool  # the cut falls inside a communicator's pattern (README: partly left open)
    extra_every: int = 0  # the extra all-reduce comes every this many iterations (0: none or irregular)
    reps: tuple[int, ...] = ()  # each communicator's repetitions of its block within an iteration


def _pattern(rng: np.random.Generator) -> tuple[list[tuple[str, int]], np.ndarray, str]:
    """One communicator's calls of an iteration and their offsets (us)."""
    block = [(str(rng.choice(OPS)), int(rng.choice(COUNTS))) for _ in range(int(rng.integers(1, 4)))]
    reps = int(rng.integers(2, 4)) if rng.random() < 0.4 else 1
    calls = block * reps
    if reps > 1 and rng.random() < 0.5:  # identical blocks evenly spaced
        lo = rng.uniform(0.02, 0.3)
        span = (0.9 - lo) / reps
        offs = np.concatenate([lo + r * span + np.sort(rng.uniform(0, 0.8 * span, len(block))) for r in range(reps)])
        how = f"{len(block)}-call block x{reps} evenly"
    else:
        offs = np.sort(rng.uniform(0.02, 0.9, len(calls)))
        how = f"{len(block)}-call block x{reps}" if reps > 1 else f"{len(block)} calls"
    return calls, np.round(offs * T, 1), how


def make_run(seed: int, with_compute: bool = False) -> Run:  # noqa: C901, PLR0912, PLR0915 (draws every trace shape the fuzzer covers, a branch per shape)
    """The run of ``seed`` (module docstring)."""
    rng = np.random.default_rng(seed)
    kind = KINDS[seed % 3]
    n_iter = int(rng.integers(3, 9)) if rng.random() < 0.33 else int(rng.integers(10, 25))
    n_comm = int(rng.integers(1, 4))
    comms = []
    reps: list[int] = []
    desc = [f"{kind}, {n_iter} iterations, {n_comm} communicator(s)"]
    for c in range(n_comm):
        calls, offs, how = _pattern(rng)
        ranks = GROUPS[int(rng.integers(len(GROUPS)))]
        comms.append((f"00000000000d{c:04x}", ranks, calls, offs))
        d = next(d for d in range(1, len(calls) + 1) if len(calls) % d == 0 and calls == calls[:d] * (len(calls) // d))
        reps.append(len(calls) // d)  # identical blocks (drawn so, or calls alike by chance)
        desc.append(
            f"  comm {c} ranks {ranks}: {how}: " + ", ".join(f"{o}:{n}@{t:.0f}" for (o, n), t in zip(calls, offs))
        )
    extra = None
    every = 0
    if rng.random() < 0.35:
        target = int(rng.integers(0, n_comm + 1))  # n_comm: its own communicator
        if rng.random() < 0.6:
            g = int(rng.integers(2, 8))
            its = set(range(int(rng.integers(0, g)), n_iter, g))
            what, every = f"every {g}", g
        else:
            its = {int(i) for i in rng.choice(n_iter, size=min(n_iter, int(rng.integers(2, 5))), replace=False)}
            what = f"at {sorted(its)}"
        extra = (target, its, round(float(rng.uniform(0.0, 0.97)) * T, 1))
        on = "own comm" if target == n_comm else f"comm {target}"
        desc.append(f"  extra 1-element all_reduce on {on} {what}, at {extra[2]} us")
    warm = rng.random() < 0.3
    jitter = float(rng.uniform(0.005, 0.03)) if kind == "jittered" or (kind == "cut" and rng.random() < 0.5) else 0.0
    lengths = T * (1 + rng.uniform(-jitter, jitter, n_iter))
    if warm:
        lengths[0] *= float(rng.uniform(1.0, 3.0))
        desc.append(f"  warm-up: first iteration {lengths[0]:.0f} us with extra calls")
    if jitter:
        desc.append(f"  jitter {100 * jitter:.1f} %")
    starts = np.concatenate([[0.0], np.cumsum(lengths)[:-1]]) + 100.0
    fb = FlowBuilder({r: r % 2 for r in range(4)})
    late = lambda: float(rng.uniform(0, 5)) if jitter else 0.0
    for it, s in enumerate(starts):
        scale = lengths[it] / T if it else 1.0
        if warm and it == 0:
            for k in range(int(rng.integers(1, 4))):
                fb.ring(comms[0][0], comms[0][1], "all_reduce", 200 + k, "Bf16", s + 2.0 * k, 0)
            scale = 1.0  # the warm-up's calls keep their offsets; the rest of it is a longer wait
        for comm, ranks, calls, offs in comms:
            for (op, n), off in zip(calls, offs):
                fb.ring(comm, ranks, op, n, "F32", s + off * scale + late(), 1)
        if extra is not None and it in extra[1]:
            comm, ranks = (
                (comms[extra[0]][0], comms[extra[0]][1]) if extra[0] < n_comm else ("00000000000e0000", [0, 1, 2, 3])
            )
            fb.ring(comm, ranks, "all_reduce", 1, "F32", s + extra[2] * lengths[it] / T, 0)
    flows = fb.frame(shuffle_seed=seed)
    end = float(starts[-1] + lengths[-1])
    rotated = False
    if kind == "cut":
        cut_at = float(starts[-1] + rng.uniform(0.05, 1.0) * lengths[-1])
        flows = flows[flows["ts_us"] < cut_at].reset_index(drop=True)
        last = flows["ts_us"].to_numpy() >= starts[-1]
        for comm, ranks, calls, _o in comms:  # calls of its pattern (one flow a rank) in the last iteration
            n = int(((flows.loc[last, "comm_id"] == comm) & (flows.loc[last, "count"] != 1)).sum()) // len(ranks)
            rotated |= 0 < n < len(calls)
        desc.append(
            f"  cut at {cut_at - starts[-1]:.0f} us into the last iteration"
            + (" (inside a pattern)" if rotated else "")
        )
    compute = None
    if with_compute:
        rows = [
            (h, s + o * lengths[i] / T, d)
            for i, s in enumerate(starts)
            for o, d in ((0, 150), (170, 60), (800, 90))
            for h in ("host-1", "host-2")
        ]
        compute = pd.DataFrame(rows, columns=["host", "ts_us", "dur_us"])
        if kind == "cut":
            compute = compute[compute["ts_us"] < flows["ts_us"].max() + 1]
    return Run(flows, compute, starts, end, kind, desc, rotated, every, tuple(reps))


def classify(run: Run) -> tuple[str, str]:
    """``(outcome, detail)``: right / refused / wrong / misplaced / crash (module docstring)."""
    try:
        sr = detect_steps(run.flows, compute=run.compute)
    except StepDetectionError as e:
        return "refused", e.rule
    except Exception:  # the harness counts every other exception as a crash
        return "crash", traceback.format_exc(limit=-3).strip().splitlines()[-1]
    n_iter = len(run.starts)
    lengths = np.diff(np.append(run.starts, run.end))
    timed = lengths[1:-1] if n_iter > 2 else lengths
    lo, hi = float(timed.min()), float(timed.max())
    got = f"{len(sr.steps)} steps of {sr.step_time_us:.1f} us (true {np.median(timed):.1f} us, {n_iter} iterations)"
    it = np.searchsorted(run.starts, sr.flows["ts_us"].to_numpy(), side="right") - 1
    step = sr.flows["step"].to_numpy()
    if len(sr.steps) > n_iter or not lo * 0.97 <= sr.step_time_us <= hi * 1.03:
        return (f"by the rule ({_by_rule(run, sr, it, step)})", got) if _by_rule(run, sr, it, step) else ("wrong", got)
    steady = (step >= 0) & (sr.flows["count"].to_numpy() != 1)  # the pattern's calls, not the extra ones
    offsets = np.unique(step[steady] - it[steady])
    if len(offsets) > 1:
        return ("misplaced (rotated)" if run.rotated else "misplaced"), f"{got}; step - iteration in {offsets.tolist()}"
    return "right", got


def _by_rule(run: Run, sr, it: np.ndarray, step: np.ndarray) -> str:
    """The rule's own answer where it is not one step an iteration (docs/STEPS.md), or "": steps of ``g``
    whole iterations when the extra all-reduce comes every ``g`` (nothing finer has the same calls in every
    step: flows alone cannot tell it from a ``g``-iteration step; Computation events or run.log refuse it),
    or ``r`` steps an iteration when every communicator repeats its block a multiple of ``r`` times (the
    finest partition; their parts ordered in time)."""
    m = step >= 0
    if not m.any():
        return ""
    per_step = pd.Series(it[m]).groupby(step[m]).agg(["min", "max", "nunique"])
    per_it = pd.Series(step[m]).groupby(it[m]).nunique()
    g, lengths = run.extra_every, np.diff(np.append(run.starts, run.end))
    lo, hi = float(lengths[1:].min()), float(lengths[1:].max())
    if g >= 2 and g * lo * 0.97 <= sr.step_time_us <= g * hi * 1.03 and len(sr.steps) <= len(run.starts) // g + 2:
        return f"{g}-iteration steps"  # at the phase of the extra call, maybe: inside an iteration
    inner = per_it.iloc[1:-1] if len(per_it) > 2 else per_it
    r = int(inner.iloc[0]) if len(inner) else 0
    if r >= 2 and (per_step["nunique"] == 1).all() and (inner == r).all() and all(k % r == 0 for k in run.reps):
        return f"{r} steps an iteration"
    return ""


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="300-599", help="inclusive range a-b, or a comma list of them")
    p.add_argument("--with-compute", action="store_true", help="add each host's Computation events")
    p.add_argument("--show", type=int, help="print one seed's run and the detector's answer")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per seed")
    args = p.parse_args(argv)
    if args.show is not None:
        run = make_run(args.show, args.with_compute)
        print("\n".join(run.desc))
        print(*classify(run), sep=": ")
        return 0
    counts: Counter[tuple[str, str]] = Counter()
    rules: Counter[str] = Counter()
    bad: list[str] = []
    for seed in _seeds(args.seeds):
        run = make_run(seed, args.with_compute)
        outcome, detail = classify(run)
        counts[(run.kind, outcome)] += 1
        if outcome == "refused":
            rules[detail] += 1
        if args.verbose:
            print(f"{seed}: {run.kind}: {outcome}: {detail}")
        if outcome in ("wrong", "misplaced", "crash"):
            bad.append(f"  seed {seed} ({run.kind}) {outcome}: {detail}")
    outcomes = ("right", "by the rule", "refused", "wrong", "misplaced", "misplaced (rotated)", "crash")
    print(f"{'class':10}" + "".join(f"{o:>21}" for o in outcomes))
    for kind in (*KINDS, "all"):
        key = lambda o: "by the rule" if o.startswith("by the rule") else o
        row = [sum(v for (k, o), v in counts.items() if key(o) == out and kind in (k, "all")) for out in outcomes]
        print(f"{kind:10}" + "".join(f"{n:>21}" for n in row))
    print("refused by rule: " + ", ".join(f"{r} {n}" for r, n in sorted(rules.items())))
    print(f"silently wrong or crash: {len(bad)}")
    print("\n".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
