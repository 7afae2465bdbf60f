"""The frontier-scale jobs users build (issue 37 item 6; docs/examples/*_frontier.toml, opus_strong_scaling.toml)
are what their files say, rule for rule as ``phantora-assets runs`` states them: every run's GPU memory
estimate fits and its trace is within the event bound; under the default host-memory bound
(``lib/stage_memory.host_memory_rule``, 4 GiB) the Llama 3 405B runs are accepted (3.5-3.7 GiB estimated),
and every run of the strong-scaling job (6.2-6.5 GiB; measured: 6,574 MiB at DP 16, 5,944 MiB at DP 128,
docs/BENCHMARKS.md "Frontier scale") is refused at its raw_timeline stage, and accepted with
``$PHANTORA_ASSETS_MAX_HOST_GIB`` = 8; the DeepSeek-V3-shaped run (every rank, 3.03 M events x 152 B x 6
copies: 2.9 GiB; measured 1,384 MiB) is accepted. The
shapes the files say are refused are refused by the trace bound, with at least as many events as a closed
form counts from one kind of flow alone:

* the photonic-rail study's strong-scaling job at the study's micro-batch of 1: its pipeline sends, 3
  iterations x 15360 / dp micro-batches x 3 stage boundaries x 2 directions (activations forward, gradients
  backward) x 32 TP shards (sequence parallel: each TP rank sends its slice) x dp pipelines = 8,847,360 at
  every dp;
* DeepSeek-V3 with EP 64 on 2,048 GPUs (DP 128, PP 16): its all-to-alls, 3 iterations x m micro-batches a
  pipeline x 58 MoE layers x 4 all-to-alls (dispatch and combine, forward and backward: Megatron's
  alltoall token dispatcher) x 2 expert groups a stage x 64 x 63 flows = 5,612,544 m, past 3,800,000 at
  m = 1, the smallest batch.
"""

from __future__ import annotations

import dataclasses

import pytest
from fixtures.paths import ROOT

from phantora_assets.lib.sim.analytic import MAX_TRACE_EVENTS, timeline_scope, trace_bound_rule
from phantora_assets.lib.sim.memory import estimate_memory
from phantora_assets.lib.sim.workloads import WorkloadModel
from phantora_assets.lib.stage_memory import MAX_HOST_GIB_ENV, host_memory_rule
from phantora_assets.lib.workload.spec import parse_workload
from phantora_assets.matrix import load_run_matrix

EXAMPLES = ROOT / "docs" / "examples"
FILES = ("llama3_405b_frontier.toml", "opus_strong_scaling.toml", "deepseek_v3_frontier.toml")

pytestmark = pytest.mark.slow  # each run's events are counted from its programs: seconds at 16,384 GPUs

#: Per file, whether its runs are refused at the default host-memory bound (4 GiB) and accepted at 8 GiB, as
#: ``phantora-assets runs`` shows them.
HOST_REFUSED = {
    "llama3_405b_frontier.toml": False,
    "opus_strong_scaling.toml": True,  # raw_timeline measured 6,574 / 5,944 MiB (DP 16 / 128)
    "deepseek_v3_frontier.toml": False,  # estimated 2.9 GiB (every rank: 6 copies a row); measured 1,384 MiB
}


def _variant(spec, nodes: int | None = None, **changes: dict) -> object:
    """``spec`` with its workload table's sections updated (``parallel={...}``, ``train={...}``)."""
    table = spec.wl.table()
    for section, values in changes.items():
        table[section].update(values)
    wl = parse_workload(spec.workload, table, "test")
    return dataclasses.replace(spec, n_nodes=nodes or spec.n_nodes, workload_def=wl)


@pytest.mark.parametrize("name", FILES)
def test_every_run_of_the_example_is_accepted_or_refused_as_runs_says(name, monkeypatch):
    """The rules ``phantora-assets runs`` applies, in its order: GPU memory, the trace bound, the host-memory
    bound (its sizes are counted once a spec: ``job_size``'s counts are cached, the second call only compares
    the estimate with the other bound)."""
    specs = load_run_matrix(EXAMPLES / name)
    assert specs and name in HOST_REFUSED
    for spec in specs:
        assert estimate_memory(WorkloadModel(spec)).fits, spec.run_id
        assert trace_bound_rule(spec) is None, spec.run_id
        monkeypatch.delenv(MAX_HOST_GIB_ENV, raising=False)
        why = host_memory_rule(spec)
        if not HOST_REFUSED[name]:
            assert why is None, (spec.run_id, why)
            continue
        assert why is not None, spec.run_id
        assert why.startswith("host memory: the raw_timeline stage would peak at about "), why
        assert f"more than the 4 GiB bound of ${MAX_HOST_GIB_ENV}: refused before simulating" in why
        monkeypatch.setenv(MAX_HOST_GIB_ENV, "8")
        assert host_memory_rule(spec) is None, spec.run_id


@pytest.mark.parametrize("nodes", [64, 512])
def test_opus_strong_scaling_at_the_studys_micro_batch_is_refused(nodes):
    spec = next(s for s in load_run_matrix(EXAMPLES / "opus_strong_scaling.toml") if s.n_nodes == nodes)
    assert spec.wl.train.micro_batch == 3 and spec.wl.train.global_batch == 15360
    study = _variant(spec, train={"micro_batch": 1})
    dp = study.par.dp
    sends = 3 * (15360 // dp) * 3 * 2 * 32 * dp
    assert sends == 8_847_360
    assert timeline_scope(study)[1] >= sends > MAX_TRACE_EVENTS
    assert "more than the 3,800,000" in trace_bound_rule(study)


@pytest.mark.parametrize("global_batch", [128, 15360])
def test_deepseek_v3_at_ep_64_is_refused_at_any_batch(global_batch):
    (spec,) = load_run_matrix(EXAMPLES / "deepseek_v3_frontier.toml")
    assert (spec.world_size, spec.par.pp, spec.par.dp, spec.par.ep) == (2048, 16, 128, 32)
    stated = _variant(spec, parallel={"ep": 64}, train={"global_batch": global_batch})
    m = global_batch // 128
    all_to_alls = 3 * m * 58 * 4 * 2 * 64 * 63
    assert all_to_alls == 5_612_544 * m
    assert timeline_scope(stated)[1] >= all_to_alls > MAX_TRACE_EVENTS
    assert "more than the 3,800,000" in trace_bound_rule(stated)
