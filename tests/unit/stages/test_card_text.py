"""The dataset card's words about the runs hold for a user's workload too (issue 39 item 18)."""

from __future__ import annotations

from phantora_assets.stages.card import dataset_card


def test_the_card_does_not_call_a_users_job_a_4_layer_slice() -> None:
    """The card said "Models are 4-layer slices of the named models" and "workload W1-W5" of every run,
    also of a run of a `[workloads.NAME]` table with 32 layers. It says it of the shipped W1-W5 only."""
    text = dataset_card({"runs": 1}, ["phantora_h100_llama3_8b_3d_4x4"], {"phantora_h100_llama3_8b_3d_4x4": 0.1})
    assert "Models are 4-layer slices" not in text
    assert "The shipped workloads W1-W5 are 4-layer slices of the named models" in text
    assert "has the layers, sequence and batch its table gives" in text
    assert "(workload W1-W5," not in text and "W1-W5 or a `[workloads.NAME]` of the run" in text
