"""Wall time of a second ``phantora-assets build`` of an unchanged matrix against the first (issue 39, item 16).

Usage::

    python benchmarks/build_current.py                    # the shipped matrix (30 runs)
    python benchmarks/build_current.py --matrix my.toml   # a run-matrix file (PHANTORA_ASSETS_RUN_MATRIX)

Both builds are fresh subprocesses timed end to end (interpreter start, imports, instance, every run
and the dataset), on one new data root, one after the other: the first builds everything; the
second finds every run, perf DB and the dataset current (``stages/build_state``) and runs none.
Printed side by side with the ratio (target: <= 0.3), the runs the second build skipped, and
whether the dataset (every file of ``phantora_v0/``, through its link) and ``phantora.duckdb`` are
byte-identical after it (they must be). The load average is printed before each build: the
machine is shared.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 0.3


def _digests(data: Path) -> dict[str, str]:
    """sha256 of every file of the published dataset and of the database, by path."""
    files = sorted(p for p in (data / "phantora_v0").rglob("*") if p.is_file()) + [data / "phantora.duckdb"]
    return {str(p.relative_to(data)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def _build(data: Path, env: dict[str, str]) -> tuple[float, str]:
    print(f"  load average {os.getloadavg()[0]:.2f}", flush=True)
    cmd = [sys.executable, "-m", "phantora_assets.cli", "build", "--data-dir", str(data)]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    elapsed = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"build failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return elapsed, r.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix", default=None, help="a run-matrix file (default: the shipped matrix)")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k not in ("DAGSTER_HOME", "PHANTORA_ASSETS_DATA_DIR")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if args.matrix:
        env["PHANTORA_ASSETS_RUN_MATRIX"] = str(Path(args.matrix).resolve())
    with tempfile.TemporaryDirectory(prefix="build_current.") as tmp:
        data = Path(tmp) / "data"
        print("first build (everything)")
        first, _ = _build(data, env)
        before = _digests(data)
        print("second build (unchanged matrix)")
        second, out = _build(data, env)
        after = _digests(data)
    current = [ln.split()[0] for ln in out.splitlines() if "(current, not rebuilt)" in ln and "/" not in ln]
    summary = next((ln for ln in out.splitlines() if re.match(r"built \d+ runs", ln)), "")
    print(f"\n{'':24s} {'wall s':>8s}")
    print(f"{'first build':24s} {first:8.1f}")
    print(f"{'unchanged rebuild':24s} {second:8.1f}")
    ratio = second / first
    print(f"ratio {ratio:.3f} (target <= {TARGET})  {'ok' if ratio <= TARGET else 'OVER'}")
    print(f"second build: {summary}")
    print(f"runs skipped as current: {len(current)}")
    same = before == after
    print(f"dataset and database byte-identical after the rebuild: {same} ({len(before)} files)")
    return 0 if same and ratio <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
