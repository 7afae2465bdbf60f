"""Fidelity of the analytic simulator against the published phantora_v0 figures.

Usage::

    python benchmarks/fidelity.py          # the per-row table and the summary; exit 1 off target
    python benchmarks/fidelity.py --fit    # also: the L40S roofline constants refitted from perfdb/l40s
    python benchmarks/fidelity.py --full-depth [--max-gpus N]
                                           # also: published full-depth jobs (benchmarks/published_throughput.csv),
                                           # all 16 (1,536-6,144 GPUs too); --max-gpus N skips rows above N
    python benchmarks/fidelity.py --only tt_llama3_8b_fsdp8_h100,mlm_gpt_1p7b_h100
                                           # just these full-depth rows (no W1-W5 table)

For every ``ok`` row of ``tests/data/published_runs.csv`` it simulates the run (no Dagster, no
trace files) and prints the published and simulated step time with the error, the inter-node
bytes per step with the error, the share of compute time that came from the perf DB and the
exposed communication; then the median and max |step error| and whether every byte count is
within max(0.5 %, 0.005 GB). It also checks the memory verdicts: the published out-of-memory
configurations are flagged and no published ``ok`` one is.

Targets (issue 5): median |step error| <= 15 %, max <= 40 %, bytes within tolerance, OOM exact.
The constants are per GPU model (``phantora_assets/gpus.toml``, sources documented there).

``--full-depth`` (issue 26, item 5) adds the frameworks' own published throughput figures of
full-depth jobs (``benchmarks/published_throughput.csv``: source URL and figure per row). Each row
becomes a ``[workloads.*]`` table and is simulated with the analytic simulator; the published step
time is derived from the published figure (:func:`published_step_s`). Target: median |error| <=
10 %, max <= 20 %, no per-run constant. Every row is simulated by default, Megatron-LM's of 1,536-6,144
GPUs too: each runs one rank a pipeline stage (``SimulationResult.symmetry``), the platform's network
being symmetric (``published_clusters.toml``: ``ecmp``); about 15 s to a few minutes a row.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from phantora_assets.lib.sim.analytic import AnalyticSimulator  # noqa: E402
from phantora_assets.lib.sim.kernels import DTYPE_CODE_BYTES, load_compute_db  # noqa: E402
from phantora_assets.lib.sim.memory import estimate_memory  # noqa: E402
from phantora_assets.lib.sim.workloads import workload_model  # noqa: E402
from phantora_assets.matrix import load_run_matrix  # noqa: E402

PUBLISHED = ROOT / "tests" / "data" / "published_runs.csv"
TARGET_MEDIAN, TARGET_MAX = 0.15, 0.40
THROUGHPUT = ROOT / "benchmarks" / "published_throughput.csv"
PUBLISHED_GPUS = ROOT / "benchmarks" / "published_gpus.toml"
PUBLISHED_CLUSTERS = ROOT / "benchmarks" / "published_clusters.toml"
FULL_DEPTH_MEDIAN, FULL_DEPTH_MAX = 0.10, 0.20


def published_step_s(row: dict) -> float:
    """Step time in seconds implied by a published figure of ``published_throughput.csv``.

    * ``tokens_per_s_per_gpu`` (torchtitan's TPS/GPU: a rank's tokens over step time times the
      non-data-parallel size, torchtitan train.py): step = global_batch * seq_len / (GPUs * TPS).
    * ``model_tflops_per_gpu`` (Megatron-LM's per-GPU teraFLOP/s, model FLOPs without
      recomputation, megatron/training/training.py num_floating_point_operations for GPT with a
      4h MLP and multi-head attention): FLOPs = 12 B s L h^2 (6 + s/h + V / (2 L h)), step =
      FLOPs / (GPUs * TFLOP/s * 1e12)."""
    g, s, gb = int(row["gpus"]), int(row["seq_len"]), int(row["global_batch"])
    if row["metric"] == "tokens_per_s_per_gpu":
        return gb * s / (g * float(row["value"]))
    if row["metric"] == "model_tflops_per_gpu":
        L, h, v = int(row["layers"]), int(row["hidden"]), int(row["vocab"])
        flops = 12 * gb * s * L * h * h * (6 + s / h + v / (2 * L * h))
        return flops / (g * float(row["value"]) * 1e12)
    raise ValueError(f"{row['run_id']}: unknown metric {row['metric']!r}")


def gemm_floor_s(row: dict) -> float | None:
    """A compute-only floor of the step from ``gpus.toml``: the model's matmul FLOPs per GPU
    (6 N per token for the dense weights plus causal attention 6 L s h per token, one more
    forward (+1/3) with full recomputation) at ``peak_bf16_flops * matmul_efficiency``; None when
    the GPU is not in gpus.toml. No communication, no element-wise kernels, no PP bubble."""
    import tomllib

    gpus = tomllib.loads((ROOT / "phantora_assets" / "gpus.toml").read_text())
    gpus |= tomllib.loads(PUBLISHED_GPUS.read_text())
    g = gpus.get(row["gpu"])
    if g is None:
        return None
    L, h, f, a, kv, v = (int(row[k]) for k in ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab"))
    d = h // a
    n = L * (h * a * d * 2 + 2 * h * kv * d + 3 * h * f) + v * h  # weights touched by matmuls
    s = int(row["seq_len"])
    per_token = 6 * n + 6 * L * s * h  # fwd + bwd; causal attention QK^T and PV at half the square
    if row["recompute"] == "full":
        per_token *= 4 / 3
    tokens = int(row["global_batch"]) * s / int(row["gpus"])
    return tokens * per_token / (g["peak_bf16_flops"] * g["matmul_efficiency"])


def workload_table(row: dict) -> dict:
    """The ``[workloads.*]`` table (issue 26 schema) of one published row."""
    par: dict = {"tp": int(row["tp"]), "pp": int(row["pp"]), "dp": int(row["dp"]), "cp": int(row["cp"])}
    par["zero"] = int(row["zero"])
    if row["sequence_parallel"] == "true":
        par["sequence_parallel"] = True
    if row["tp_comm_overlap"] == "true":  # the published command line's --tp-comm-overlap
        par["tp_comm_overlap"] = True
    if row["pp_schedule"]:
        par["pp_schedule"] = row["pp_schedule"]
    model = {k: int(row[k]) for k in ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab")}
    model = {"kind": "dense", "name": row["model"], **model}
    train = {
        "seq_len": int(row["seq_len"]),
        "micro_batch": int(row["micro_batch"]),
        "global_batch": int(row["global_batch"]),
        "recompute": row["recompute"],
        "compile": row["compile"] == "true",  # the published run's torch.compile (torchtitan)
        "uncaptured_kernels": True,  # real GPUs: also the kernels Phantora does not intercept
        "iterations": 3,  # the fewest a step is found in (docs/STEPS.md)
    }
    return {"framework": row["framework"], "model": model, "parallel": par, "train": train}


def published_run_spec(run_spec_of, row: dict):
    """The RunSpec of a published row: its workload table on its GPUs; a GPU of
    ``published_gpus.toml`` becomes the run's own ``[gpus.NAME]`` (validated on h100, whose keys it
    shares); the platform's network of ``published_clusters.toml`` its ``topology``."""
    import dataclasses
    import tomllib

    gpn = int(row["gpus_per_node"])
    extra = tomllib.loads(PUBLISHED_GPUS.read_text())
    gpu = "h100" if row["gpu"] in extra else row["gpu"]
    spec = run_spec_of(
        workload_table(row), nodes=int(row["gpus"]) // gpn, gpus_per_node=gpn, gpu=gpu, name=row["run_id"]
    )
    if row["gpu"] in extra:
        spec = dataclasses.replace(spec, gpu=row["gpu"], gpu_def=tuple(sorted(extra[row["gpu"]].items())))
    net = tomllib.loads(PUBLISHED_CLUSTERS.read_text()).get(row["gpu"])
    if net:  # the published platform's network (published_clusters.toml), per GPU key
        spec = dataclasses.replace(spec, topology=tuple(sorted(net.items())))
    return spec


def full_depth_rows(max_gpus: int | None = None, only: set[str] | None = None, on_row=None) -> list[dict]:
    """One dict per published full-depth row: published and simulated step time and error
    (``simulated_s`` None, with ``why``, where the row was not simulated), the simulator's wall
    seconds (``wall_s``) and which DAG it ran (``symmetry``); ``max_gpus``: skip rows of more GPUs
    (None: none skipped); ``only``: just the rows of these run ids (``--only``); ``on_row``: called
    with each dict as soon as its row is done."""
    import importlib

    run_spec_of = None
    for name in ("phantora_assets.lib.workload.collectives", "phantora_assets.lib.sim.collectives"):
        try:
            run_spec_of = importlib.import_module(name).run_spec_of
            break
        except ImportError:
            continue
    with THROUGHPUT.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if only is None or r["run_id"] in only]
    out = []
    for r in rows:
        pub = published_step_s(r)
        rec = {"run_id": r["run_id"], "gpus": int(r["gpus"]), "gpu": r["gpu"], "published_s": pub}
        rec["floor_s"] = gemm_floor_s(r)
        rec |= {"simulated_s": None, "error": None, "why": "", "wall_s": None, "symmetry": ""}
        if run_spec_of is None:
            rec["why"] = "workload schema not landed (phantora_assets.lib.workload.collectives)"
        elif max_gpus is not None and int(r["gpus"]) > max_gpus:
            rec["why"] = f"more than --max-gpus {max_gpus}"
        else:
            try:
                spec = published_run_spec(run_spec_of, r)
                t0 = time.perf_counter()
                res = AnalyticSimulator(spec, emit=False).run()
                rec["wall_s"], rec["symmetry"] = time.perf_counter() - t0, res.symmetry
                if not res.fits:  # refused by the memory estimate: no step time to compare
                    peak = res.memory.as_dict()["peak_gib"]
                    rec["why"] = f"does not fit (estimate {peak:.1f} GiB > {spec.gpu_spec['memory_gb']} GB)"
                else:
                    rec["simulated_s"] = res.step_ns / 1e9
                    rec["error"] = (rec["simulated_s"] - pub) / pub
            except Exception as e:  # reported in the table, never hidden
                rec["why"] = f"{type(e).__name__}: {e}"[:100]
        out.append(rec)
        if on_row is not None:
            on_row(rec)
    return out


def print_full_depth(max_gpus: int | None = None, only: set[str] | None = None) -> bool:
    print(f"\nFull-depth published jobs ({THROUGHPUT.relative_to(ROOT)}):")
    print(
        f"{'run_id':32s} {'GPUs':>5s} {'gpu':>15s} {'published':>10s} {'GEMM floor':>10s} {'simulated':>10s} "
        f"{'error':>7s} {'sim wall':>8s}  DAG",
        flush=True,
    )

    def show(r: dict) -> None:
        sim = f"{r['simulated_s']:9.4f}s" if r["simulated_s"] is not None else f"{'-':>10s}"
        err = f"{r['error']:+7.1%}" if r["error"] is not None else f"{'-':>7s}"
        floor = f"{r['floor_s']:9.3f}s" if r["floor_s"] is not None else f"{'-':>10s}"
        wall = f"{r['wall_s']:7.1f}s" if r["wall_s"] is not None else f"{'-':>8s}"
        dag = r["symmetry"].split(":")[0]  # "one rank a stage" or "every rank"
        print(
            f"{r['run_id']:32s} {r['gpus']:5d} {r['gpu']:>15s} {r['published_s']:9.3f}s {floor} {sim} {err} {wall}  "
            f"{dag}{r['why']}",
            flush=True,
        )

    rows = full_depth_rows(max_gpus, only, on_row=show)
    errs = np.abs([r["error"] for r in rows if r["error"] is not None])
    if not len(errs):
        print("no row simulated")
        return False
    med, mx = float(np.median(errs)), float(errs.max())
    print(
        f"{len(errs)} of {len(rows)} rows simulated: median |error| {med:.1%} (target <= {FULL_DEPTH_MEDIAN:.0%}), "
        f"max |error| {mx:.1%} (target <= {FULL_DEPTH_MAX:.0%})"
    )
    return med <= FULL_DEPTH_MEDIAN and mx <= FULL_DEPTH_MAX


def fidelity_rows() -> list[dict]:
    """One dict per published ok row: published/simulated step and bytes, errors, DB share."""
    specs = {s.run_id: s for s in load_run_matrix()}
    with PUBLISHED.open(newline="") as fh:
        published = [r for r in csv.DictReader(fh) if r["status"] == "ok"]
    out = []
    for r in published:
        spec = specs[r["run_id"]]
        sim = AnalyticSimulator(spec, emit=False)
        res = sim.run()
        pub_ms, pub_gb = float(r["step_time_ms"]), float(r["inter_node_gb_per_step"])
        sim_ms, sim_b = res.step_ns / 1e6, sim.network_bytes_per_step()
        out.append(
            {
                "run_id": r["run_id"],
                "published_ms": pub_ms,
                "simulated_ms": sim_ms,
                "error": (sim_ms - pub_ms) / pub_ms,
                "published_gb": pub_gb,
                "simulated_gb": sim_b / 1e9,
                "bytes_ok": abs(sim_b - pub_gb * 1e9) <= max(0.005 * pub_gb * 1e9, 0.005e9),
                "db_fraction": res.db_fraction,
                "exposed_ms": res.exposed_comm_ns / 1e6,
            }
        )
    return out


def oom_check() -> tuple[bool, set[str], set[str]]:
    with PUBLISHED.open(newline="") as fh:
        published = list(csv.DictReader(fh))
    expected = {r["run_id"] for r in published if r["status"] == "out_of_memory"}
    flagged = {s.run_id for s in load_run_matrix() if not estimate_memory(workload_model(s)).fits}
    ok_rows = {r["run_id"] for r in published if r["status"] == "ok"}
    return flagged == expected and not (flagged & ok_rows), flagged, expected


def fit_l40s(folder: Path = ROOT / "perfdb" / "l40s") -> dict[str, float]:
    """The L40S roofline constants of gpus.toml, refitted from its perf DB (medians)."""
    db = load_compute_db(str(folder))

    def tensors(v):
        if isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], list):
            return [v]
        if isinstance(v, dict) and "R" in v:
            return tensors(v["R"][1]) * v["R"][0]
        if isinstance(v, list):
            return [t for x in v for t in tensors(x)]
        if isinstance(v, dict):
            return [t for x in v.values() for t in tensors(x)]
        return []

    gemm, bw, l2, all_ns, gemm_extra = [], [], [], [], []
    small = []
    for key, ns in db.items():
        if ns <= 0:
            continue
        obj = json.loads(key)
        op = next(iter(obj))
        ts = tensors(obj[op])
        all_ns.append(ns)
        if op in ("MM", "MatMul", "BMM", "Linear"):
            a, b = ts[0][1], ts[1][1]
            n = b[0] if op == "Linear" else b[-1]
            flops = 2 * math.prod(a[:-1]) * a[-1] * n
            if flops >= 5e10:
                gemm.append(flops / ns * 1e9)
            if flops < 5e9 and ts[0][0] == "bf16":
                small.append((flops, ns))
        elif op in ("Add_", "Mul", "Add", "Softmax", "ConvDType", "Mul_") and ts:
            size = lambda t: math.prod(t[1] or [1]) * DTYPE_CODE_BYTES[t[0]]
            big = max(size(t) for t in ts)
            out = math.prod(ts[0][1]) * (2 if obj[op][1] == "BFloat16" else 4) if op == "ConvDType" else big
            traffic = size(ts[0]) + out
            if big >= 200e6:
                bw.append(traffic / ns * 1e9)
            if op == "Add_" and 16e6 <= big <= 48e6:
                l2.append(traffic / ns * 1e9)
    eff = float(np.median(gemm)) / 362e12
    gemm_extra = [ns - f / (362e12 * eff) * 1e9 for f, ns in small]
    return {
        "matmul_efficiency": eff,
        "memory_efficiency": float(np.median(bw)) / 864e9,
        "gemm_floor_ns": float(np.median(gemm_extra)),
        "n_small_gemm": len(gemm_extra),
        "l2_bw_bytes_per_s": float(np.median(l2)),
        "kernel_floor_ns": float(np.median(sorted(all_ns)[:30])),
        "n_gemm": len(gemm),
        "n_elementwise": len(bw),
        "n_l2": len(l2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fit", action="store_true", help="also refit the L40S roofline constants from perfdb/l40s")
    ap.add_argument("--full-depth", action="store_true", help="also the published full-depth jobs (issue 26)")
    ap.add_argument(
        "--max-gpus", type=int, default=None, help="simulate only full-depth rows up to this many GPUs (default: all)"
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated run ids of published_throughput.csv: simulate just these full-depth rows, "
        "skipping the W1-W5 table (implies --full-depth; for iterating)",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.only:
        only = {x.strip() for x in args.only.split(",") if x.strip()}
        ok = print_full_depth(args.max_gpus, only)
        print(f"({time.perf_counter() - t0:.1f} s)")
        return 0 if ok else 1
    rows = fidelity_rows()
    print(
        f"{'run_id':30s} {'published':>10s} {'simulated':>10s} {'error':>8s}   {'pub GB':>7s} {'sim GB':>8s} "
        f"{'bytes':>5s}  {'perf DB':>7s} {'exposed':>8s}"
    )
    for r in rows:
        print(
            f"{r['run_id']:30s} {r['published_ms']:8.1f}ms {r['simulated_ms']:8.1f}ms {r['error']:+8.1%}   "
            f"{r['published_gb']:7.2f} {r['simulated_gb']:8.3f} {'ok' if r['bytes_ok'] else 'OFF':>5s}  "
            f"{r['db_fraction']:7.0%} {r['exposed_ms']:6.1f}ms"
        )
    err = np.abs([r["error"] for r in rows])
    med, mx = float(np.median(err)), float(err.max())
    bytes_ok = all(r["bytes_ok"] for r in rows)
    oom_ok, flagged, expected = oom_check()
    print(
        f"\n{len(rows)} published ok rows: median |error| {med:.1%} (target <= {TARGET_MEDIAN:.0%}), "
        f"max |error| {mx:.1%} (target <= {TARGET_MAX:.0%})"
    )
    print(
        f"bytes within max(0.5 %, 0.005 GB): {'all' if bytes_ok else 'NOT all'}; "
        "out-of-memory flags: "
        + (f"exactly the published {len(expected)}" if oom_ok else f"{sorted(flagged)} vs {sorted(expected)}")
    )
    if args.fit:
        fit = fit_l40s()
        print("\nL40S roofline constants refitted from perfdb/l40s (gpus.toml [l40s]):")
        print(
            f"  matmul_efficiency  {fit['matmul_efficiency']:.3f}  (median of {fit['n_gemm']} BF16 GEMMs >= 50 GFLOP)"
        )
        print(
            f"  memory_efficiency  {fit['memory_efficiency']:.3f}  "
            f"(median of {fit['n_elementwise']} element-wise calls >= 200 MB)"
        )
        print(
            f"  l2_bw_bytes_per_s  {fit['l2_bw_bytes_per_s']:.3g}  (median of {fit['n_l2']} in-place adds of 16-48 MB)"
        )
        print(f"  kernel_floor_ns    {fit['kernel_floor_ns']:.0f}  (median of the 30 shortest recorded calls)")
        print(
            f"  gemm_floor_ns      {fit['gemm_floor_ns']:.0f}  "
            f"(median over {fit['n_small_gemm']} BF16 GEMMs < 5 GFLOP of "
            "time minus FLOPs at matmul_efficiency)"
        )
    full_ok = print_full_depth(args.max_gpus) if args.full_depth else True
    print(f"({time.perf_counter() - t0:.1f} s)")
    ok = med <= TARGET_MEDIAN and mx <= TARGET_MAX and bytes_ok and oom_ok and full_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
