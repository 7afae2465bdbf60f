"""What `phantora-assets chakra` costs against the build of the same run: wall seconds and peak RSS side by side.

    python benchmarks/chakra_export.py                      # the 3-D Llama 3 8B job at 64 and 256 GPUs
    python benchmarks/chakra_export.py --sizes 64,256,1024  # and 1,024 (minutes on two cores)

The job is `llama3_8b_3d_64` of docs/examples/opus_jobs.toml (torchtitan, FSDP2 over dp, TP 4 with
sequence parallelism, PP 2 1F1B, 4 micro-batches a data-parallel rank) with dp grown to the size
(global batch 4 x dp), on hosts of 8 H100s. For each size, in a fresh data root: `phantora-assets
build --no-plots` of that one run, then `phantora-assets chakra` of it, each a child process of this
one; a child's peak RSS is ``ru_maxrss`` of ``os.wait4`` (the child and the processes it waited for:
the build's Dagster runs). Target (issue 42): the export takes no longer and no more memory than the
build. Exit 1 when a size misses it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "examples" / "opus_jobs.toml"


def _matrix(size: int) -> str:
    job = tomllib.loads(EXAMPLE.read_text())["workloads"]["llama3_8b_3d_64"]
    tp, pp = job["parallel"]["tp"], job["parallel"]["pp"]
    dp = size // (tp * pp)
    job["parallel"]["dp"] = dp
    job["train"]["global_batch"] = 4 * dp
    lines = ["[workloads.l8b3d]", f'framework = "{job["framework"]}"']
    for sect in ("model", "parallel", "train"):
        lines.append(f"[workloads.l8b3d.{sect}]")
        for k, v in job[sect].items():
            lines.append(
                f"{k} = " + (f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v))
            )
    lines += ["[[run]]", 'workload = "l8b3d"', 'gpu = "h100"', f"nodes = {size // 8}", "gpus_per_node = 8"]
    return "\n".join(lines) + "\n"


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """(wall s, peak RSS MiB, exit code) of ``cmd`` as a child process."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.perf_counter() - t, usage.ru_maxrss / 1024, proc.returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64,256", help="GPUs, comma-separated (multiples of 64)")
    args = ap.parse_args(argv)
    exe = [sys.executable, "-m", "phantora_assets.cli"]
    print(f"{'GPUs':>6} {'build s':>9} {'build MiB':>10} {'export s':>9} {'export MiB':>11} {'ET MiB':>8}  verdict")
    missed = False
    for size in (int(s) for s in args.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="chakra_bench_") as tmp:
            matrix, data, out = Path(tmp) / "jobs.toml", Path(tmp) / "data", Path(tmp) / "et"
            matrix.write_text(_matrix(size))
            env = {**os.environ, "PHANTORA_ASSETS_RUN_MATRIX": str(matrix)}
            b_s, b_mib, rc = _run([*exe, "build", "--data-dir", str(data), "--no-plots", "--quiet"], env)
            if rc:
                print(f"{size:>6} build failed (exit {rc})")
                return 1
            run_id = f"phantora_h100_l8b3d_{size // 8}x8"
            e_s, e_mib, rc = _run([*exe, "chakra", run_id, str(out), "--data-dir", str(data)], env)
            if rc:
                print(f"{size:>6} export failed (exit {rc})")
                return 1
            et_mib = sum(p.stat().st_size for p in out.iterdir()) / 2**20
            ok = e_s <= b_s and e_mib <= b_mib
            missed |= not ok
            verdict = "ok" if ok else "MISSED"
            print(
                f"{size:>6} {b_s:>9.1f} {b_mib:>10.0f} {e_s:>9.1f} {e_mib:>11.0f} {et_mib:>8.1f}  {verdict}", flush=True
            )
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
