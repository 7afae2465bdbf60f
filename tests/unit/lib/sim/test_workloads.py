"""The workload model: parameter counts and the collectives' network bytes, without Dagster."""

from __future__ import annotations

import pytest
from fixtures.paths import published_rows

from phantora_assets.lib.sim.memory import estimate_memory
from phantora_assets.lib.sim.workload_types import AllToAll, Collective
from phantora_assets.lib.sim.workloads import WorkloadModel
from phantora_assets.lib.traffic.ring import DTYPE_BYTES
from phantora_assets.matrix import load_run_matrix

SPECS = {s.run_id: s for s in load_run_matrix()}


def model_network_bytes(spec) -> int:
    from phantora_assets.lib.sim.analytic import AnalyticSimulator

    sim = AnalyticSimulator(spec)
    G = spec.gpus_per_node
    total = 0
    for item in sim.model.step_program():
        if isinstance(item, (Collective, AllToAll)):
            for comm in sim.model.comms[item.kind]:
                total += sum(b for s, d, b in sim.flows_of(item, comm) if s // G != d // G)
    return total


def test_llama3_8b_four_layer_parameter_count():
    # presets.toml: "1,923,125,248 parameters at 4 layers"
    assert WorkloadModel(SPECS["phantora_a100_40g_W4_2x1"]).total_params == 1_923_125_248
    assert WorkloadModel(SPECS["phantora_a100_40g_W1_2x1"]).total_params == 1_923_125_248


@pytest.mark.parametrize("row", [r for r in published_rows() if r["status"] == "ok"], ids=lambda r: r["run_id"])
def test_model_bytes_match_published(row):
    expected = float(row["inter_node_gb_per_step"]) * 1e9
    got = model_network_bytes(SPECS[row["run_id"]])
    assert abs(got - expected) <= max(0.005 * expected, 0.005e9)


def test_w1_tensor_parallel_all_reduces():
    """18 bf16 [1024, 1, 4096] all-reduces per step on the TP group (presets.toml, W1 notes)."""
    model = WorkloadModel(SPECS["phantora_a100_40g_W1_2x1"])
    big = [i for i in model.step_program() if isinstance(i, Collective) and i.kind == "tp" and i.dtype == "Bf16"]
    assert len(big) == 18
    assert {i.count * DTYPE_BYTES[i.dtype] for i in big} == {1024 * 4096 * 2}


def test_zero3_keeps_lm_head_gathered_in_backward_after_warmup():
    model = WorkloadModel(SPECS["phantora_a100_40g_W5_2x2"])
    steady = [i.tag for i in model.step_program() if isinstance(i, Collective)]
    warm = [i.tag for i in model.step_program(warmup=True) if isinstance(i, Collective)]
    assert "zero3.bwd.gather.output_layer.weight" not in steady
    assert "zero3.bwd.gather.output_layer.weight" in warm


@pytest.mark.parametrize("spec", list(SPECS.values()), ids=list(SPECS))
def test_memory_verdict_matches_published_status(spec):
    assert estimate_memory(WorkloadModel(spec)).fits == (spec.published == "ok")
