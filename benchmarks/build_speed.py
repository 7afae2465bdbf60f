"""Wall time of the whole default build next to Dagster's own floor, in one run.

Usage::

    python benchmarks/build_speed.py                      # floor, build --jobs 1, build (default jobs)
    python benchmarks/build_speed.py --baseline main      # also the build of another git ref
    python benchmarks/build_speed.py --stages             # also a per-stage profile of one build
    python benchmarks/build_speed.py --baseline a86f02d --repeat 3   # alternate baseline/build 3 times

Each measurement is a fresh subprocess timed end to end (interpreter start, imports, code
location load, every asset and check of the 30 runs, the dataset), one after the other:

* ``dagster floor``: ``dagster asset materialize`` of a trivial one-asset code location with a
  temporary DAGSTER_HOME -- what any single Dagster materialization costs here;
* ``baseline`` (``--baseline REF``): ``phantora-assets build`` of that git ref, exported with
  ``git archive`` into a temporary folder (same machine, same moment);
* ``build --jobs 1`` and ``build``: this checkout's ``phantora-assets build``, sequential and with
  its default worker count.

The machine is shared: the load average is printed before and after every measurement, and
ratios are given against the floor measured in the same run. With ``--repeat N`` the baseline and
the default build run alternately N times each (fresh data roots) and the ratio of their medians
is printed: what issue 12's target (build <= 1.25x the baseline's wall time) is checked against.
Target (issue 5): the default build <= 30 s wall on this 2-core machine. ``--stages`` adds an
in-process build with every
pipeline stage timed (simulation, trace write, trace read + checks, bins, windows, summary,
export, fsync) and the rest attributed to Dagster.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET_S = 30.0

TRIVIAL = textwrap.dedent("""
    import dagster as dg

    @dg.asset
    def trivial() -> int:
        return 1

    defs = dg.Definitions(assets=[trivial])
""")

STAGES = textwrap.dedent("""
    import collections, os, sys, time
    from phantora_assets.lib.phantora import chrome_trace
    from phantora_assets.sources import analytic as source
    from phantora_assets.stages import dataset, flows
    T = collections.Counter()
    def wrap(mod, name, label):
        f = getattr(mod, name)
        def g(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                T[label] += time.perf_counter() - t
        setattr(mod, name, g)
    wrap(source, "simulate", "  analytic simulation")
    wrap(chrome_trace, "write_chrome_trace", "  trace write (JSON + gzip)")
    wrap(chrome_trace, "read_trace", "  trace read")
    for mod, names in ((source, ["simulate_run", "write_trace"]), (flows, ["validate_flows", "bin_flows"]),
                       (dataset, ["window_features", "summarize_run", "export_dataset"])):
        for n in names:
            wrap(mod, n, n)
    _fsync = os.fsync
    def fsync(fd):
        t = time.perf_counter(); _fsync(fd); T["  (fsync, inside the stages)"] += time.perf_counter() - t
    os.fsync = fsync
    from phantora_assets.cli import main
    t0 = time.perf_counter()
    rc = main(["build", "--data-dir", sys.argv[1], "--quiet", "--jobs", "1"])
    total = time.perf_counter() - t0
    ours = sum(v for k, v in T.items() if not k.startswith(" "))
    for k, v in sorted(T.items(), key=lambda kv: -kv[1]):
        print(f"    {k:34s} {v:6.2f} s")
    print(f"    {'Dagster + CLI (the rest)':34s} {total - ours:6.2f} s")
    print(f"    {'total (in process, --jobs 1)':34s} {total:6.2f} s")
    sys.exit(rc)
""")


def _load() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.2f}"


def _share_scanner(src: Path) -> None:
    """Give the exported baseline a compiled trace scanner (``git archive`` exports no build
    products; without it the baseline would read traces on the slower pure-Python path and look
    slower than it is): this checkout's when its C source is the same file, else the baseline's own
    source compiled as ``pip install`` would (``-O3``, the Python headers)."""
    import sysconfig

    ours = ROOT / "phantora_assets" / "lib" / "phantora" / "_tracescan.c"
    built = sorted(ours.parent.glob("_tracescan*.so"))
    for c in src.rglob("_tracescan.c"):
        if built and ours.is_file() and c.read_bytes() == ours.read_bytes():
            shutil.copy2(built[0], c.parent / built[0].name)
            print(f"baseline: using this checkout's compiled scanner for {c.relative_to(src)} (same source)")
            continue
        out = c.parent / ("_tracescan" + sysconfig.get_config_var("EXT_SUFFIX"))
        cc = ["gcc", "-O3", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(c), "-o", str(out)]
        subprocess.run(cc, check=True)
        print(f"baseline: compiled its own scanner {c.relative_to(src)} (-O3)")


#: user and system CPU seconds of the last :func:`_timed` command (its whole process tree)
LAST_CPU: dict[str, float] = {"user": 0.0, "sys": 0.0}


def _timed(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, int, str, str, str]:
    import resource

    before = _load()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    LAST_CPU.update(user=r1.ru_utime - r0.ru_utime, sys=r1.ru_stime - r0.ru_stime)
    return wall, out.returncode, before, _load(), (out.stdout + out.stderr)


def _export(ref: str, dest: Path) -> None:
    dest.mkdir()
    arch = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=arch, check=True)
    _share_scanner(dest)


def _alternate(args, tmp: Path, py: str, base_env: dict[str, str]) -> int:
    """Baseline and this checkout's default build, alternately, ``args.repeat`` times each."""
    import statistics

    src = tmp / "baseline"
    _export(args.baseline, src)
    walls: dict[str, list[float]] = {"baseline": [], "build": []}
    for i in range(args.repeat):
        for name, where in (("baseline", src), ("build", ROOT)):
            env = {**base_env, "PYTHONPATH": str(where)}
            data = tmp / f"{name}{i}"
            wall, rc, b, a, log = _timed(
                [py, "-m", "phantora_assets.cli", "build", "--data-dir", str(data), "--quiet"], where, env
            )
            walls[name].append(wall)
            cpu = f"cpu user {LAST_CPU['user']:5.1f} s sys {LAST_CPU['sys']:5.1f} s"
            print(f"{name:9s} #{i + 1}  {wall:6.1f} s  rc {rc}  {cpu}  load {b} -> {a}", flush=True)
            if rc:
                print(log[-2000:])
                return 1
            shutil.rmtree(data)
    mb, mo = statistics.median(walls["baseline"]), statistics.median(walls["build"])
    ratio = mo / mb
    print(f"\nmedian baseline ({args.baseline}) {mb:.1f} s, median build {mo:.1f} s: build / baseline = {ratio:.2f}")
    print(f"target (issue 12): build <= 1.25x the baseline: {'met' if ratio <= 1.25 else 'MISSED'}")
    return 0 if ratio <= 1.25 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="git ref to build too (exported with git archive)")
    ap.add_argument("--stages", action="store_true", help="also a per-stage profile of one in-process build")
    ap.add_argument("--skip-sequential", action="store_true", help="skip the --jobs 1 build")
    ap.add_argument("--repeat", type=int, default=1, help="with --baseline: alternate baseline/build N times")
    args = ap.parse_args(argv)
    py = sys.executable
    base_env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "PHANTORA_ASSETS_RUN_MATRIX")}
    base_env["PYTHONDONTWRITEBYTECODE"] = "1"
    rows: list[tuple[str, float, int, str, str]] = []
    print(f"{os.cpu_count()} CPUs; load averages are the 1-minute value before -> after each measurement\n")
    with tempfile.TemporaryDirectory(prefix="build_speed_") as tmp:
        tmp = Path(tmp)
        (tmp / "trivial_defs.py").write_text(TRIVIAL)
        (tmp / "home").mkdir()
        env = {**base_env, "DAGSTER_HOME": str(tmp / "home")}
        wall, rc, b, a, log = _timed(
            [py, "-m", "dagster", "asset", "materialize", "-f", str(tmp / "trivial_defs.py"), "--select", "trivial"],
            tmp,
            env,
        )
        rows.append(("dagster floor (trivial 1-asset materialize)", wall, rc, b, a))
        if rc:
            print(log[-2000:])
        if args.baseline and args.repeat > 1:
            return _alternate(args, tmp, py, base_env)
        if args.baseline:
            src = tmp / "baseline"
            src.mkdir()
            arch = subprocess.run(["git", "archive", args.baseline], cwd=ROOT, capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(src)], input=arch, check=True)
            _share_scanner(src)
            env = {**base_env, "PYTHONPATH": str(src)}
            wall, rc, b, a, log = _timed(
                [py, "-m", "phantora_assets.cli", "build", "--data-dir", str(tmp / "d0"), "--quiet"], src, env
            )
            rows.append((f"baseline build ({args.baseline})", wall, rc, b, a))
            if rc:
                print(log[-2000:])
        env = {**base_env, "PYTHONPATH": str(ROOT)}
        if not args.skip_sequential:
            wall, rc, b, a, log = _timed(
                [py, "-m", "phantora_assets.cli", "build", "--data-dir", str(tmp / "d1"), "--quiet", "--jobs", "1"],
                ROOT,
                env,
            )
            rows.append(("build --jobs 1", wall, rc, b, a))
            if rc:
                print(log[-2000:])
        wall, rc, b, a, log = _timed(
            [py, "-m", "phantora_assets.cli", "build", "--data-dir", str(tmp / "d2"), "--quiet"], ROOT, env
        )
        rows.append(("build (default --jobs)", wall, rc, b, a))
        if rc:
            print(log[-2000:])
        final = wall
        floor = rows[0][1]
        print(f"{'measurement':46s} {'wall s':>7s} {'x floor':>8s} {'rc':>3s}  load")
        for name, w, r, b, a in rows:
            print(f"{name:46s} {w:7.1f} {w / floor:8.2f} {r:3d}  {b} -> {a}")
        if args.baseline:
            print(f"\nspeed-up over the baseline: {rows[1][1] / final:.2f}x")
        print(
            f"target: default build <= {TARGET_S:.0f} s wall: {'met' if final <= TARGET_S else 'MISSED'} "
            f"({final:.1f} s)"
        )
        if args.stages:
            (tmp / "stages.py").write_text(STAGES)
            print("\nper-stage profile of one in-process build (--jobs 1):")
            out = subprocess.run(
                [py, str(tmp / "stages.py"), str(tmp / "d3")], cwd=ROOT, env=env, capture_output=True, text=True
            )
            print(out.stdout.rstrip() or out.stderr[-2000:])
    return 0 if final <= TARGET_S and all(r[2] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
