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
