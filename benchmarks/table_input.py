"""validated_flows' input read two ways, side by side on one simulated run (issue 37, item 1): the analytic
run's raw timeline table (``lib/phantora/raw_tables.read_raw_timeline``, what the pipeline reads now) and
the Chrome JSON written from it, parsed back (``chrome_trace.read_trace``, what it read before). Both give
the same tables (checked here too); the ratio is the time and the peak RSS of the table route over the JSON
route (each route in its own forked child, ``ru_maxrss``).

    python benchmarks/table_input.py                        # W1 on 32 x 8 H100
    python benchmarks/table_input.py --workload W2 --nodes 64 --gpus-per-node 8
"""

from __future__ import annotations

import argparse
import os
import pickle
import resource
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from phantora_assets.lib.phantora.chrome_trace import read_trace, write_chrome_trace
from phantora_assets.lib.phantora.raw_tables import read_raw_timeline
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.analytic import simulate
from phantora_assets.lib.store.parquet import write_parquet_frames


def _in_child(fn, *args):
    """(seconds, peak RSS MiB, result) of ``fn(*args)`` in a forked child."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        t0 = time.perf_counter()
        out = fn(*args)
        dt = time.perf_counter() - t0
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        with os.fdopen(w, "wb") as fh:
            pickle.dump((dt, rss, out), fh)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as fh:
        got = pickle.load(fh)
    os.waitpid(pid, 0)
    return got


def _tables(parsed):
    return parsed.flows, parsed.compute, parsed.compute_events


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="h100")
    a = ap.parse_args(argv)
    spec = RunSpec(a.workload, a.gpu, a.nodes, a.gpus_per_node)
    with tempfile.TemporaryDirectory() as tmp:
        table, trace = Path(tmp) / "raw_timeline.parquet", Path(tmp) / "timeline.json.gz"
        result = simulate(spec)
        assert result.timeline is not None
        write_parquet_frames(result.timeline.frames(), table, chunk_rows=500_000)
        t0 = time.perf_counter()
        write_chrome_trace(table, trace)
        write_s = time.perf_counter() - t0
        del result
        js, js_rss, js_out = _in_child(lambda: _tables(read_trace(trace, compute_events=True)))
        tb, tb_rss, tb_out = _in_child(lambda: _tables(read_raw_timeline(table, compute_events=True)))
        for x, y in zip(js_out, tb_out):
            pd.testing.assert_frame_equal(x, y, check_exact=True)
        n = len(js_out[0]) + len(js_out[2])
        print(
            f"{spec.run_id}: {n:,} events; Chrome trace written in {write_s:.2f} s "
            f"({trace.stat().st_size / 2**20:.1f} MiB)"
        )
        print("| route | read s | peak RSS MiB |")
        print("|---|---|---|")
        print(f"| Chrome JSON (write_chrome_trace + read_trace) | {write_s:.2f} + {js:.2f} | {js_rss:,.0f} |")
        print(f"| raw timeline table (read_raw_timeline) | {tb:.2f} | {tb_rss:,.0f} |")
        print(
            f"ratio table / JSON: time {tb / (write_s + js):.3f} (read only: {tb / js:.3f}), "
            f"peak RSS {tb_rss / js_rss:.3f}"
        )
        print("tables identical: yes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
