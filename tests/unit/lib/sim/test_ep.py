"""``ep`` in a run-matrix entry (issue 14): an MoE run's expert_model_parallel_size, the other GPUs
expert-data-parallel as Megatron lays them out; validated strictly, the CLI exits 2 with the rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from phantora_assets.cli import main
from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.memory import estimate_memory
from phantora_assets.lib.sim.workload_types import Collective
from phantora_assets.lib.sim.workloads import workload_model
from phantora_assets.matrix import parse_entries
from phantora_assets.stages.simulation import run_spec_record


def _moe(workload: str = "W2", nodes: int = 2, gpn: int = 8, extra: str = "") -> str:
    return f'[[run]]\nworkload = "{workload}"\ngpu = "h200"\nnodes = {nodes}\ngpus_per_node = {gpn}\n{extra}'


#: matrix text -> the rule the CLI prints (after ``error: <file> [[run]] #1 (...)``).
EP_RULES = {
    "float": (_moe(extra="ep = 8.0\n"), "ep must be an integer, got 8.0 (float)"),
    "boolean": (_moe(extra="ep = true\n"), "ep must be an integer, got true (boolean)"),
    "string": (_moe(extra='ep = "8"\n'), "ep must be an integer, got '8' (string)"),
    "dp_string": (
        _moe(extra='ep = "dp"\n'),
        'ep must be an integer (ep = "dp", the expert mesh, is the workload\'s parallel.ep',
    ),
    "zero": (_moe(extra="ep = 0\n"), "W2 needs ep from 1 to 16 dividing the GPU count and num_moe_experts=8, got 0"),
    "above_world": (
        _moe(nodes=1, gpn=4, extra="ep = 8\n"),
        "W2 needs ep from 1 to 4 dividing the GPU count and num_moe_experts=8, got 8",
    ),
    "not_dividing_gpus": (
        _moe(nodes=3, gpn=2, extra="ep = 4\n"),
        "needs ep from 1 to 6 dividing the GPU count and num_moe_experts=8, got 4",
    ),
    "not_dividing_experts": (
        _moe(extra="ep = 16\n"),
        "needs ep from 1 to 16 dividing the GPU count and num_moe_experts=8, got 16",
    ),
    "dense_workload": (
        _moe("W1", extra="ep = 2\n"),
        "ep is only allowed for an MoE workload (expert_parallel in presets.toml)",
    ),
    "default_rule": (
        _moe(nodes=2, gpn=8),
        "W2 sets expert_model_parallel_size = GPU count, which must divide num_moe_experts=8 (or set ep)",
    ),
}


@pytest.mark.parametrize("case", list(EP_RULES))
def test_ep_rules_refused_by_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, case: str) -> None:
    text, rule = EP_RULES[case]
    matrix = tmp_path / "matrix.toml"
    matrix.write_text(text)
    monkeypatch.setenv("PHANTORA_ASSETS_RUN_MATRIX", str(matrix))
    monkeypatch.delenv("PHANTORA_ASSETS_IMPORT_DIR", raising=False)
    rc = main(["runs", "--data-dir", str(tmp_path / "data")])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: {matrix} [[run]] #1" in err and rule in err, err


def test_ep_entry_parsed_and_laid_out_as_megatron() -> None:
    """W2 on 2x8 with ep = 8: 2 EP groups of 8 consecutive ranks, 8 EDP groups of 2 strided by 8."""
    (spec,) = parse_entries([{"workload": "W2", "gpu": "h200", "nodes": 2, "gpus_per_node": 8, "ep": 8}])
    assert (spec.ep_size, spec.ep, spec.dp, spec.parallelism) == (8, 8, 16, "ep=8,dp=16")
    model = workload_model(spec)
    assert [c.ranks for c in model.comms["ep"]] == [tuple(range(8)), tuple(range(8, 16))]
    assert [c.ranks for c in model.comms["edp"]] == [(i, i + 8) for i in range(8)]
    edp = [i for i in model.step_program(warmup=False) if isinstance(i, Collective) and i.kind == "edp"]
    buckets = model.megatron_expert_buckets()
    assert sorted((i.op, i.count) for i in edp) == sorted(
        [("all_gather", p // 2) for p, _ in buckets] + [("reduce_scatter", p // 2) for p, _ in buckets]
    )
    # one expert per rank (8 experts over ep = 8), its optimizer state sharded over the 2 EDP ranks
    per_expert = sum(p.numel for p in model.params if p.expert) // 8
    assert model.expert_params_per_rank() == per_expert
    assert sum(model.megatron_optimizer_groups()[2][1]) == sum(p for p, _ in buckets) // 2
    assert estimate_memory(model).fits


def test_default_ep_is_the_preset_rule_and_leaves_the_record_unchanged() -> None:
    spec = RunSpec("W2", "a100_40g", 2, 2)
    assert (spec.ep, spec.parallelism) == (4, "ep=4")
    assert "edp" not in workload_model(spec).comms
    assert "ep" not in run_spec_record(spec).inputs["entry"]
    with_ep = RunSpec("W2", "a100_40g", 2, 2, ep_size=4)  # same layout, written explicitly: another entry
    assert with_ep.ep == 4 and run_spec_record(with_ep).inputs["entry"]["ep"] == 4
    assert run_spec_record(with_ep).fingerprint != run_spec_record(spec).fingerprint
    with pytest.raises(RunMatrixError, match=r"#1 \(W3 h200 1x8\): ep must be an integer, got 2.5 \(float\)"):
        parse_entries([{"workload": "W3", "gpu": "h200", "nodes": 1, "gpus_per_node": 8, "ep": 2.5}])
