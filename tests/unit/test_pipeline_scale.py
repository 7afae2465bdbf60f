"""benchmarks/pipeline_scale.py runs every per-run asset of the graph: each has a call (the benchmark
failed every run's ``reconfig`` with ``KeyError: 'reconfig'`` once that asset joined the graph)."""

from __future__ import annotations

import importlib.util

from fixtures.paths import BENCHMARKS

from phantora_assets.assets import RUN_ASSET_NAMES

_spec = importlib.util.spec_from_file_location("pipeline_scale", BENCHMARKS / "pipeline_scale.py")
assert _spec and _spec.loader
pipeline_scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pipeline_scale)


def test_every_per_run_asset_and_dataset_stage_has_a_call():
    calls = pipeline_scale.stage_calls(spec=None, paths=None)
    assert "reconfig" in RUN_ASSET_NAMES
    assert set(calls) == set(RUN_ASSET_NAMES) | {"phantora_v0", "dataset_duckdb"}
    assert pipeline_scale.RUN_STAGES == RUN_ASSET_NAMES
