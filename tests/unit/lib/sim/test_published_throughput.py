"""benchmarks/published_throughput.csv: the published full-depth rows of fidelity.py --full-depth (issue 26, item 5)."""

from __future__ import annotations

import csv
import importlib
import sys

import pytest
from fixtures.paths import BENCHMARKS, ROOT

sys.path.insert(0, str(BENCHMARKS))
fidelity = importlib.import_module("fidelity")

ROWS = list(csv.DictReader((ROOT / "benchmarks" / "published_throughput.csv").open(newline="")))


def test_rows_name_their_source_and_shape():
    assert len(ROWS) >= 5
    assert len({r["run_id"] for r in ROWS}) == len(ROWS)
    for r in ROWS:
        assert r["source"].startswith("https://github.com/") and "/blob/" in r["source"], r["run_id"]
        assert r["figure"] and float(r["value"]) > 0
        g, tp, pp, dp, cp = (int(r[k]) for k in ("gpus", "tp", "pp", "dp", "cp"))
        assert tp * pp * dp * cp == g, r["run_id"]
        assert int(r["global_batch"]) % (int(r["micro_batch"]) * dp) == 0, r["run_id"]
        assert int(r["layers"]) % pp == 0 and int(r["heads"]) % tp == 0, r["run_id"]


def test_published_step_times():
    by = {r["run_id"]: r for r in ROWS}
    # torchtitan Table 1: 5,762 tokens/s/GPU, local batch 2 x 8192 tokens per step and rank
    assert fidelity.published_step_s(by["tt_llama3_8b_fsdp8_h100"]) == pytest.approx(2 * 8192 / 5762)
    # TP 8: the page's TPS/GPU divides a DP rank's 12 x 8192 tokens by step time x 8 TP ranks
    assert fidelity.published_step_s(by["tt_llama3_8b_fsdp8_tp8_h100"]) == pytest.approx(12 * 8192 / (4378 * 8))
    # Megatron 1.7B: 72 B s L h^2 (1 + s / 6h + V / 12 L h) FLOPs per step at 408.8 TFLOP/s on 48 GPUs
    b, s, L, h, v = 192, 4096, 24, 2048, 131072
    flops = 72 * b * s * L * h * h * (1 + s / (6 * h) + v / (12 * L * h))
    assert fidelity.published_step_s(by["mlm_gpt_1p7b_h100"]) == pytest.approx(flops / (48 * 408.8e12))


def test_rows_are_valid_workloads():
    col = None
    for name in ("phantora_assets.lib.workload.collectives", "phantora_assets.lib.sim.collectives"):
        try:
            col = importlib.import_module(name)
            break
        except ImportError:
            continue
    if col is None:
        pytest.skip("issue 26 workload schema not landed yet")
    for r in ROWS:
        spec = fidelity.published_run_spec(col.run_spec_of, r)
        assert spec.gpu == r["gpu"] and spec.n_nodes * spec.gpus_per_node == int(r["gpus"])


def _small_megatron_row(**over) -> dict:
    """mlm_gpt_119b_h100's layout (TP 8 with SP and --tp-comm-overlap, PP 4 1F1B, H100 hosts of 8) at DP 4
    and 8 layers of a small GPT: 128 GPUs, two racks a pipeline stage on the published platform."""
    row = dict(next(r for r in ROWS if r["run_id"] == "mlm_gpt_119b_h100"))
    row |= {"layers": "8", "hidden": "1024", "ffn_hidden": "2816", "heads": "8", "kv_heads": "8", "vocab": "32768"}
    row |= {"dp": "4", "gpus": "128", "global_batch": "16", "seq_len": "1024"}
    return row | over


def test_published_h100_platform_runs_one_rank_a_stage():
    """The Megatron rows of 1,536-6,144 GPUs ran every rank (beyond 3,000 s): presets.toml's ecmp = "hash"
    gives each connection its own spine, so each communicator of a stage had its own collisions and the
    symmetry check (lib/sim/symmetry.py) failed. The published H100 platform routes adaptively
    (InfiniBand; published_clusters.toml ecmp = "split"): one rank a stage, and the step is the one
    simulating every rank gives, to the nanosecond."""
    col = importlib.import_module("phantora_assets.lib.workload.collectives")
    from phantora_assets.lib.sim.analytic import AnalyticSimulator

    spec = fidelity.published_run_spec(col.run_spec_of, _small_megatron_row())
    assert spec.cluster["ecmp"] == "split"
    fast = AnalyticSimulator(spec, emit=False).run()
    assert fast.symmetry.startswith("one rank a stage: 4 of 128 ranks"), fast.symmetry
    every = AnalyticSimulator(spec, emit=False, compress=False).run()
    assert every.symmetry == "every rank"
    assert fast.iteration_ns == every.iteration_ns


def test_full_depth_simulates_every_row_by_default(monkeypatch):
    """--full-depth skipped the rows above 400 GPUs (the --max-gpus default): now no row is skipped unless asked."""
    handed: list[str] = []

    class Stub:
        def __init__(self, spec, emit):
            handed.append(spec.run_id)

        def run(self):
            return type("R", (), {"fits": True, "step_ns": 1e9, "symmetry": "one rank a stage: stub"})()

    monkeypatch.setattr(fidelity, "AnalyticSimulator", Stub)
    rows = fidelity.full_depth_rows()
    assert len(handed) == len(ROWS) == 16
    assert [r["run_id"] for r in rows] == [r["run_id"] for r in ROWS]
    assert all(r["why"] == "" and r["simulated_s"] == 1.0 for r in rows)
    assert [r["run_id"] for r in fidelity.full_depth_rows(max_gpus=800) if r["why"]] == [
        "mlm_gpt_119b_h100",
        "mlm_gpt_177b_h100",
        "mlm_gpt_314b_h100",
        "mlm_gpt_462b_h100",
    ]
