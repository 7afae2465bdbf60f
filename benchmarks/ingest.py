"""Ingest benchmark of ``phantora_assets.lib.phantora.chrome_trace.read_trace`` (issue 6 targets).

Usage::

    python benchmarks/ingest.py                        # >= 500 MB synthetic trace, every reader on it
    python benchmarks/ingest.py --trace path/to/timeline.json.gz
    python benchmarks/ingest.py --reference-mb 100     # slow references on a smaller trace (quick look)
    python benchmarks/ingest.py --repeat 1             # one round (~1.5 min instead of ~4)

What it does:

1. Generates (once; cached under the system temp folder, ``phantora_ingest_bench/``) a gzipped
   trace in the Phantora visualizer layout (``[\\n`` + one event per line joined by ``,\\n`` +
   ``\\n]``) of at least ``--size-mb`` MB (10**6 bytes, default 500) of decompressed JSON:
   about 3/4 of the events are Communication events of 8 hosts / 6 communicators with 128-byte
   ids (all six NCCL call kinds, random counts, some loopback and 0-dur flows), the rest
   Computation events with Torch or Cuda meta, in random (not time) order. ``--trace`` takes an
   existing trace instead.
2. Runs each reader in its own subprocess, one after the other, in ``--repeat`` rounds (default 3):
   every reader once per round, so that a slow spell of this shared machine falls on all of them;
   each reader's fastest run counts, as with ``timeit``, and its largest peak RSS (``ru_maxrss``
   of that subprocess, plus that of its helper processes for ``ours``):

   * ``ours``     -- ``read_trace(path)`` end to end from the ``.json.gz`` file: inflating,
     decoding, the flows DataFrame and the per-host compute summary (default settings: helper
     processes only for idle cores, ``chrome_trace.default_workers``; their peak RSS is added);
   * ``ours_1proc`` / ``ours_1helper`` -- the same with ``workers=0`` / ``workers=1``
     (information only: no target);
   * ``msgspec``  -- the typed whole-document reference: the text is inflated first (not timed),
     then one ``msgspec.json.decode`` of the whole document into Structs with ``args`` kept as
     ``msgspec.Raw``, garbage collector disabled;
   * ``orjson``   -- ``orjson.loads`` of the whole inflated document (inflating not timed; a
     benchmark-only extra: ``pip install -e ".[bench]"``; skipped with a message if missing);
   * ``stdlib``   -- ``json.loads`` of the whole inflated document (inflating not timed) then a
     pandas DataFrame of the flows.

   Rates are MB (10**6 bytes) of decompressed JSON per second. The references get the inflated
   text for free, so the ratios are conservative for ``ours``.
3. Prints a table (seconds, MB/s, peak RSS MB, ours/that speed ratio, the target) with the load
   average, and exits 1 when ``ours`` is under 150 MB/s, under 0.5x msgspec, under 10x orjson,
   under 15x stdlib, or peaks above 1024 MB of RSS. Exit 0 otherwise.
"""

import argparse
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

GEN_VERSION = 1
THRESHOLDS = {"min_mb_s": 150.0, "msgspec": 0.5, "orjson": 10.0, "stdlib": 15.0, "max_rss_mb": 1024.0}

# ------------------------------------------------------------------------------------- generator


def _comm_templates(rng: random.Random) -> list[bytes]:
    hosts = [f"host-{k}" for k in range(1, 9)]
    comms = [bytes(rng.randrange(256) for _ in range(128)) for _ in range(6)]
    ids = [("[" + ",".join(map(str, c)) + "]") for c in comms]
    out = []
    calls = [
        ("NcclAllReduce", '"op":"Sum",'),
        ("NcclAllGather", ""),
        ("NcclReduceScatter", '"op":"Sum",'),
        ("NcclBcast", '"root":0,'),
        ("NcclSend", '"peer":1,'),
        ("NcclRecv", '"peer":0,'),
    ]
    weights = [8, 4, 4, 1, 2, 2]
    for (call, extra), w in zip(calls, weights):
        for _ in range(w):
            src = rng.choice(hosts)
            dst = src if rng.random() < 0.1 else rng.choice(hosts)
            ci = rng.randrange(len(comms))
            dtype = rng.choice(["Bf16", "Bf16", "F32", "F16"])
            stream = (
                "null"
                if call in ("NcclSend", "NcclRecv") and rng.random() < 0.5
                else '{"device":%d,"id":7}' % rng.randrange(8)
            )
            name = {
                "NcclAllReduce": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL",
                "NcclAllGather": "ncclDevKernel_AllGather_RING_LL",
                "NcclReduceScatter": "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL",
                "NcclBcast": "ncclDevKernel_Broadcast_RING_LL",
                "NcclSend": "ncclDevKernel_SendRecv",
                "NcclRecv": "ncclDevKernel_SendRecv",
            }[call]
            t = (
                '{"name":"%s","cat":"Communication","ph":"X","ts":%%s,"dur":%%s,"pid":%d,"tid":%%d,'
                '"args":{"Communication":[{"id":%%d,"bytes":%%d,"src":"%s","dst":"%s","token":null,'
                '"tenant_id":null,"vsrc":null,"vdst":null,"udp_src_port":null},{"%s":{"count":%%d,'
                '"dtype":"%s",%s"comm":{"rank":%d,"id":%s},"stream":%s}}]}}'
                % (name, hosts.index(src), src, dst, call, dtype, extra, rng.randrange(8), ids[ci], stream)
            )
            out.append(t.encode())
    return out


def _comp_templates(rng: random.Random) -> list[bytes]:
    out = []
    ops = ["aten::mm", "aten::bmm", "aten::add_", "aten::_flash_attention_forward", "aten::layer_norm"]
    for k in range(16):
        host = f"host-{k % 8 + 1}"
        pid = 1000 + k
        if k % 4 == 3:
            meta = '{"Cuda":{"CudaMemcpyAsync":{"size":%d,"kind":"DeviceToHost"}}}' % (1 << (k + 4))
            name = "cudaMemcpyAsync"
        else:
            name = ops[k % len(ops)]
            meta = (
                '{"Torch":{"time":%%d,"id":{"host":{"hostname":"%s","pid":%d},"tid":%d},'
                '"stream":{"device":%d,"id":7},"info":{"MM":[{"shape":[%d,%d],"dtype":"BFloat16"},'
                '{"shape":[%d,%d],"dtype":"BFloat16"}]}}}' % (host, pid, k, k % 8, 1024, 4096, 4096, 1024)
            )
        t = (
            '{"name":"%s","cat":"Computation","ph":"X","ts":%%s,"dur":%%s,"pid":%d,"tid":%d,'
            '"args":{"Computation":[{"hostname":"%s","pid":%d},%%d,%s]}}'
            % (name, pid, 7 + ((k % 8) << 32), host, pid, meta)
        )
        out.append(t.encode())
    return out


def _us(ns: int) -> bytes:
    q, r = divmod(ns, 1000)
    return (b"%d" % q) if r == 0 else (b"%d.%03d" % (q, r)).rstrip(b"0")


def generate(path: Path, size_mb: float, seed: int = 0) -> int:
    """Write a synthetic visualizer-layout trace of >= size_mb MB; returns decompressed bytes."""
    rng = random.Random(seed)
    comm_t, comp_t = _comm_templates(rng), _comp_templates(rng)
    target = int(size_mb * 1e6)
    written = 0
    tmp = path.with_suffix(".tmp")
    fid = 0
    with open(tmp, "wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0, compresslevel=6) as gz:
        gz.write(b"[\n")
        written += 2
        first = True
        rnd = rng.random
        while written < target:
            lines = []
            for _ in range(2000):
                ts = int(rnd() * 60e9)
                if rnd() < 0.75:
                    t = comm_t[int(rnd() * len(comm_t))]
                    tiny = rnd() < 0.3
                    dur = 0 if tiny else int(rnd() * 5e6)
                    count = int(rnd() * 2048) if tiny else int(rnd() * 1e8)
                    fid += 1
                    lines.append(t % (_us(ts), _us(dur), 7, fid, count * 2, count))
                else:
                    t = comp_t[int(rnd() * len(comp_t))]
                    dur = int(rnd() * 2e6)
                    if b'%d,{"Torch' in t or t.count(b"%d") == 2:
                        lines.append(t % (_us(ts), _us(dur), dur, dur))
                    else:
                        lines.append(t % (_us(ts), _us(dur), dur))
            blob = b",\n".join(lines)
            if not first:
                blob = b",\n" + blob
            first = False
            gz.write(blob)
            written += len(blob)
        gz.write(b"\n]")
        written += 2
    os.replace(tmp, path)
    return written


def decompressed_size(path: Path) -> int:
    n = 0
    with open(path, "rb") as fh:
        if fh.read(2) != b"\x1f\x8b":
            return path.stat().st_size
    with gzip.open(path, "rb") as fh:
        while chunk := fh.read(16 << 20):
            n += len(chunk)
    return n


def cached_trace(size_mb: float) -> tuple[Path, int]:
    folder = Path(tempfile.gettempdir()) / "phantora_ingest_bench"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"trace_v{GEN_VERSION}_{size_mb:g}mb.json.gz"
    meta = path.with_suffix(".size")
    if path.exists() and meta.exists():
        return path, int(meta.read_text())
    t0 = time.perf_counter()
    n = generate(path, size_mb)
    meta.write_text(str(n))
    print(
        f"generated {path.name}: {n / 1e6:.0f} MB decompressed, {path.stat().st_size / 1e6:.0f} MB gz "
        f"in {time.perf_counter() - t0:.1f} s",
        flush=True,
    )
    return path, n


# ------------------------------------------------------------------------------------- workers


def _inflate(path: Path) -> bytes:
    data = path.read_bytes()
    return zlib.decompress(data, wbits=47) if data[:2] == b"\x1f\x8b" else data


def _ours(path: Path, workers: int | None) -> dict:
    from phantora_assets.lib.phantora import chrome_trace

    helpers = chrome_trace.default_workers(path) if workers is None else workers
    t0 = time.perf_counter()
    pt = chrome_trace.read_trace(path, workers=helpers)
    seconds = time.perf_counter() - t0
    return {"rows": len(pt.flows), "events": pt.n_events, "seconds": seconds, "helpers": helpers}


def worker_ours(path: Path) -> dict:
    return _ours(path, None)


def worker_ours_1proc(path: Path) -> dict:
    return _ours(path, 0)


def worker_ours_1helper(path: Path) -> dict:
    return _ours(path, 1)


def _msgspec_type():
    import msgspec

    class Event(msgspec.Struct):
        name: str
        cat: str
        ph: str
        ts: float
        dur: float
        pid: int
        tid: int
        args: msgspec.Raw

    return list[Event]


def worker_msgspec(path: Path) -> dict:
    import gc

    import msgspec

    text = _inflate(path)
    decoder = msgspec.json.Decoder(_msgspec_type())
    gc.disable()
    t0 = time.perf_counter()
    events = decoder.decode(text)
    seconds = time.perf_counter() - t0
    return {"rows": sum(e.cat == "Communication" for e in events), "events": len(events), "seconds": seconds}


def worker_orjson(path: Path) -> dict:
    import orjson

    text = _inflate(path)
    t0 = time.perf_counter()
    events = orjson.loads(text)
    seconds = time.perf_counter() - t0
    return {"rows": sum(e["cat"] == "Communication" for e in events), "events": len(events), "seconds": seconds}


def worker_stdlib(path: Path) -> dict:
    import pandas as pd

    text = _inflate(path)
    t0 = time.perf_counter()
    events = json.loads(text)
    rows = []
    for e in events:
        if e["cat"] != "Communication":
            continue
        flow, call = e["args"]["Communication"]
        ((name, p),) = call.items()
        rows.append(
            (
                flow["id"],
                e["ts"],
                e["dur"],
                flow["src"],
                flow["dst"],
                flow["bytes"],
                name,
                p["dtype"],
                p["count"],
                bytes(p["comm"]["id"]),
                p["comm"]["rank"],
                p.get("root", -1),
                e["tid"],
            )
        )
    df = pd.DataFrame(
        rows,
        columns=[
            "flow_id",
            "ts_us",
            "dur_us",
            "src_host",
            "dst_host",
            "bytes",
            "call",
            "dtype",
            "count",
            "comm",
            "comm_rank",
            "root",
            "stream",
        ],
    )
    seconds = time.perf_counter() - t0
    return {"rows": len(df), "events": len(events), "seconds": seconds}


WORKERS = {
    "ours": worker_ours,
    "ours_1proc": worker_ours_1proc,
    "ours_1helper": worker_ours_1helper,
    "msgspec": worker_msgspec,
    "orjson": worker_orjson,
    "stdlib": worker_stdlib,
}


def run_worker(mode: str, path: Path) -> None:
    # imports are not timed
    import msgspec  # noqa: F401
    import numpy  # noqa: F401
    import pandas  # noqa: F401

    import phantora_assets.lib.phantora.chrome_trace  # noqa: F401

    if mode == "orjson":
        import orjson  # noqa: F401
    info = WORKERS[mode](path)
    # this process plus its helper processes (each counted at the largest child's peak)
    info["peak_rss_mb"] = (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        + info.get("helpers", 0) * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    ) / 1024
    print("RESULT " + json.dumps(info), flush=True)


def spawn(mode: str, path: Path) -> dict | None:
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", mode, str(path)],
        capture_output=True,
        text=True,
        env=env,
    )
    for ln in proc.stdout.splitlines():
        if ln.startswith("RESULT "):
            return json.loads(ln[7:])
    print(f"[{mode}] failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}", flush=True)
    return None


def load() -> str:
    try:
        return "load average " + " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:  # noqa: C901, PLR0912, PLR0915 (a benchmark's main: its options, then one timed section per reader)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--size-mb",
        type=float,
        default=500.0,
        help="decompressed size of the generated trace (MB, at least 500 for the targets)",
    )
    ap.add_argument("--trace", type=Path, help="use this trace instead of a generated one (every reader)")
    ap.add_argument(
        "--reference-mb",
        type=float,
        default=None,
        help="run orjson and stdlib on a smaller generated trace of this size (quick look; "
        "default: every reader on the same trace)",
    )
    ap.add_argument("--skip", action="append", default=[], choices=list(WORKERS), help="skip a reader")
    ap.add_argument(
        "--repeat", type=int, default=3, help="rounds (every reader once per round; each reader's fastest run counts)"
    )
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.worker:
        run_worker(args.worker[0], Path(args.worker[1]))
        return 0

    if args.trace:
        main_path, main_n = args.trace, decompressed_size(args.trace)
    else:
        main_path, main_n = cached_trace(args.size_mb)
    ref_path, ref_n = main_path, main_n
    if args.reference_mb and not args.trace and args.reference_mb < args.size_mb:
        ref_path, ref_n = cached_trace(args.reference_mb)
    print(
        f"trace {main_path} ({main_n / 1e6:.0f} MB decompressed, {main_path.stat().st_size / 1e6:.0f} MB "
        f"on disk); cpus={os.cpu_count()}; {load()}",
        flush=True,
    )
    if ref_path != main_path:
        print(f"orjson and stdlib read {ref_path.name} ({ref_n / 1e6:.0f} MB)", flush=True)

    results: dict[str, dict] = {}
    plan = [
        ("ours", main_path, main_n),
        ("ours_1proc", main_path, main_n),
        ("ours_1helper", main_path, main_n),
        ("msgspec", main_path, main_n),
        ("orjson", ref_path, ref_n),
        ("stdlib", ref_path, ref_n),
    ]
    if "orjson" not in args.skip:
        try:
            import orjson  # noqa: F401
        except ImportError:
            print("orjson not importable: skipping the orjson reference (pip install -e '.[bench]')")
            args.skip.append("orjson")
    plan = [p for p in plan if p[0] not in args.skip]
    # rounds: every reader once per round, so that a slow spell of this shared machine falls on
    # all of them; each reader's best (shortest) run counts, its peak RSS is the largest
    for rnd in range(1, args.repeat + 1):
        for mode, path, n in plan:
            r = spawn(mode, path)
            if r is None:
                continue
            r["mb"] = n / 1e6
            r["mb_s"] = r["mb"] / r["seconds"]
            print(
                f"  [{rnd}/{args.repeat}] {mode:12s} {r['mb']:7.0f} MB {r['seconds']:8.2f} s {r['mb_s']:8.1f} MB/s "
                f"rss {r['peak_rss_mb']:7.0f} MB rows {r['rows']}"
                + (f" helpers {r['helpers']}" if "helpers" in r else "")
                + f"  ({load()})",
                flush=True,
            )
            best = results.get(mode)
            if best is None or r["seconds"] < best["seconds"]:
                r["peak_rss_mb"] = max(r["peak_rss_mb"], best["peak_rss_mb"] if best else 0.0)
                results[mode] = r
            else:
                best["peak_rss_mb"] = max(best["peak_rss_mb"], r["peak_rss_mb"])

    ours = results.get("ours")
    if ours is None:
        print("FAIL: our reader did not run")
        return 1
    print()
    print(f"best of {args.repeat} round(s) per reader")
    print(f"{'reader':12s} {'MB':>7s} {'s':>8s} {'MB/s':>9s} {'peak RSS MB':>12s} {'ours/this':>10s} {'target':>8s}")
    failures = []
    for mode, r in results.items():
        ratio = ours["mb_s"] / r["mb_s"]
        need = THRESHOLDS.get(mode)
        print(
            f"{mode:12s} {r['mb']:7.0f} {r['seconds']:8.2f} {r['mb_s']:9.1f} {r['peak_rss_mb']:12.0f} "
            f"{ratio:10.2f} {('>= %gx' % need) if need else '':>8s}"
        )
        if need is not None and ratio < need:
            failures.append(f"ours is {ratio:.2f}x {mode}, needs >= {need}x")
    if ours["mb"] < 500:
        print(f"note: the targets are stated for a trace of >= 500 MB; this one has {ours['mb']:.0f} MB")
    if ours["mb_s"] < THRESHOLDS["min_mb_s"]:
        failures.append(f"ours {ours['mb_s']:.1f} MB/s < {THRESHOLDS['min_mb_s']} MB/s")
    if ours["peak_rss_mb"] > THRESHOLDS["max_rss_mb"]:
        failures.append(f"ours peak RSS {ours['peak_rss_mb']:.0f} MB > {THRESHOLDS['max_rss_mb']} MB")
    print(f"({load()})")
    print()
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
