"""An analytic run's Chrome trace is a view (issue 37, item 1): validated_flows reads the raw timeline table, and
a run of more events than ``CHROME_TRACE_MAX_EVENTS`` gets a trace of one rank per pipeline stage (every event of
those ranks' hosts), its metadata saying what it holds."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from phantora_assets.lib.phantora.chrome_trace import read_trace
from phantora_assets.matrix import load_run_matrix
from phantora_assets.paths import DataPaths
from phantora_assets.sources import analytic

_PP_MATRIX = """
[workloads.tiny_pp]
framework = "megatron"
model = {kind = "dense", layers = 4, hidden = 256, ffn_hidden = 512, heads = 8, kv_heads = 4, vocab = 1024}
parallel = {tp = 2, pp = 2}
train = {seq_len = 128, global_batch = 4, iterations = 3}

[[run]]
workload = "tiny_pp"
gpu = "h100"
nodes = 4
gpus_per_node = 2
"""


@pytest.fixture()
def spec(tmp_path: Path):
    matrix = tmp_path / "m.toml"
    matrix.write_text(_PP_MATRIX)
    (spec,) = load_run_matrix(matrix)
    return spec


def test_trace_hosts_one_rank_per_stage(spec) -> None:
    """tp 2 x dp 2 x pp 2 on 4 x 2 GPUs: stage 0 is ranks 0-3 (hosts 1-2), stage 1 ranks 4-7 (hosts 3-4)."""
    assert (spec.par.tp, spec.par.dp, spec.par.pp) == (2, 2, 2)
    assert analytic.trace_hosts(spec) == ["host-1", "host-3"]


def test_large_run_gets_a_bounded_trace(spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = DataPaths(tmp_path / "data")
    analytic.simulate_run(spec, paths)
    raw = pd.read_parquet(paths.table(spec.run_id, "raw_timeline"))
    whole = analytic.write_trace(spec, paths)
    assert whole.metadata["trace_holds"] == "every event" and whole.metadata["n_events"] == len(raw)

    monkeypatch.setattr(analytic, "CHROME_TRACE_MAX_EVENTS", len(raw) - 1)
    view = analytic.write_trace(spec, paths)
    keep = raw["src_host"].isin(["host-1", "host-3"]) | raw["dst_host"].isin(["host-1", "host-3"])
    assert view.metadata["events_in_run"] == len(raw)
    assert view.metadata["n_events"] == int(keep.sum()) < len(raw)
    assert "host-1, host-3" in view.metadata["trace_holds"]
    parsed = read_trace(paths.chrome_trace(spec), compute_events=True)
    comm = raw[keep & (raw["kind"] == "communication")]
    assert len(parsed.flows) == len(comm) and int(parsed.flows["bytes"].sum()) == int(comm["bytes"].sum())
    assert set(parsed.compute_events["host"]) == {"host-1", "host-3"}
    assert not list(paths.table(spec.run_id, "raw_timeline").parent.glob(".*.tmp"))  # the view is not kept
