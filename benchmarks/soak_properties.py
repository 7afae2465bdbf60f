"""Soak the property tests: run them with fresh randomness for many seeds (by hand, not in CI).

    python benchmarks/soak_properties.py [--seeds 0-30] [--profile random|soak] [pytest args...]

CI runs the derandomized "ci" profile (tests/conftest.py). This script runs every property test
file once per seed with ``--hypothesis-seed=N`` under the "random" profile (or "soak": 2000
examples for tests that do not set their own budget) and prints, per seed, passed or the failing
test; an example it finds must be pinned with ``@example`` on the test. Exit status 1 if any seed
failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROPERTY_TESTS = ["tests/properties"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0-30", help="inclusive range a-b, or a comma list")
    p.add_argument("--profile", default="random", choices=["random", "soak"])
    args, rest = p.parse_known_args(argv)
    if "-" in args.seeds:
        a, b = (int(x) for x in args.seeds.split("-"))
        seeds = list(range(a, b + 1))
    else:
        seeds = [int(x) for x in args.seeds.split(",")]
    env = {**os.environ, "HYPOTHESIS_PROFILE": args.profile}
    failed = []
    t0 = time.perf_counter()
    for seed in seeds:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            f"--hypothesis-seed={seed}",
            *(rest or PROPERTY_TESTS),
        ]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        last = (out.stdout.strip().splitlines() or ["?"])[-1]
        print(f"seed {seed:3d}: {'passed' if out.returncode == 0 else 'FAILED'}  {last}", flush=True)
        if out.returncode != 0:
            failed.append(seed)
    print(
        f"\n{len(seeds) - len(failed)}/{len(seeds)} seeds passed in {time.perf_counter() - t0:.0f} s"
        + (f"; failed: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
