"""Fewest iterations a job may run (``lib/workload/spec.py`` ``MIN_ITERATIONS``, ``MIN_ITERATIONS_OTHER_FIRST``):
which jobs' first iteration issues other calls than the steady ones is read from the generator's own programs,
and a job at its fewest iterations goes through step detection the way ``validated_flows`` runs it (with the
simulator's iteration marks). Was: iterations = 3 built, then a Megatron CP or MoE job was refused at
validated_flows (``no steady step``: the last step of a time-assigned communicator taken as cut by the trace's
end), and DeepSpeed ZeRO-3 was refused there too (``steps never repeat``) instead of by the run matrix."""

from __future__ import annotations

import pytest

from phantora_assets.lib.phantora.chrome_trace import read_trace, write_chrome_trace
from phantora_assets.lib.sim.analytic import simulate
from phantora_assets.lib.sim.workload_types import AllToAll, Collective, SendRecv
from phantora_assets.lib.sim.workloads import WorkloadModel
from phantora_assets.lib.traffic.steps import detect_steps
from phantora_assets.lib.workload.collectives import run_spec_of
from phantora_assets.lib.workload.spec import MIN_ITERATIONS, MIN_ITERATIONS_OTHER_FIRST

DENSE = {"kind": "dense", "layers": 4, "hidden": 1024, "ffn_hidden": 4096, "heads": 16, "kv_heads": 8, "vocab": 32000}
MOE = {**DENSE, "kind": "moe", "experts": 8, "topk": 2, "moe_ffn_hidden": 1024}

#: (framework, model, parallel): every framework and the options that change an iteration's calls
JOBS = {
    "megatron-tp2-pp2-cp2": ("megatron", DENSE, {"tp": 2, "pp": 2, "dp": "rest", "cp": 2, "zero": 1}),
    "megatron-moe-ep2": ("megatron", MOE, {"tp": 1, "dp": "rest", "ep": 2, "zero": 0}),
    "megatron-interleaved": (
        "megatron",
        DENSE,
        {"tp": 2, "pp": 2, "dp": "rest", "zero": 1, "pp_schedule": "interleaved", "virtual_stages": 2},
    ),
    "deepspeed-zero0": ("deepspeed", DENSE, {"dp": "rest", "zero": 0}),
    "deepspeed-zero2": ("deepspeed", DENSE, {"dp": "rest", "zero": 2}),
    "deepspeed-zero3": ("deepspeed", DENSE, {"dp": "rest", "zero": 3}),
    "torchtitan-fsdp2-tp2-pp2-cp2": (
        "torchtitan",
        DENSE,
        {"tp": 2, "pp": 2, "dp": "rest", "cp": 2, "zero": 3, "sequence_parallel": True},
    ),
    "torchtitan-hsdp": ("torchtitan", DENSE, {"dp": "rest", "zero": 3, "dp_replicate": 2}),
    "torchtitan-ddp": ("torchtitan", DENSE, {"dp": "rest", "zero": 0}),
}


def _spec(job: str, iterations: int):
    fw, model, par = JOBS[job]
    train = {"seq_len": 1024, "micro_batch": 1, "grad_accumulation": 2, "iterations": iterations}
    return run_spec_of({"framework": fw, "model": model, "parallel": par, "train": train}, 2, 4, "h100", job)


def _calls(program) -> list[tuple]:
    return [
        (type(it).__name__, it.kind, getattr(it, "op", ""), it.count, it.dtype)
        for it in program
        if isinstance(it, (Collective, AllToAll, SendRecv))
    ]


def _fewest(job: str) -> int:
    return MIN_ITERATIONS_OTHER_FIRST if JOBS[job][0] == "deepspeed" and JOBS[job][2]["zero"] == 3 else MIN_ITERATIONS


@pytest.mark.parametrize("job", sorted(JOBS))
def test_the_first_iteration_issues_other_calls_only_where_the_rule_says(job: str) -> None:
    """The warm-up program (init broadcasts aside) issues the steady calls, but for DeepSpeed ZeRO-3."""
    model = WorkloadModel(_spec(job, 6))
    warm = [_calls(p) for p in model.stage_programs(True)]
    steady = [_calls(p) for p in model.stage_programs(False)]
    assert (warm != steady) == (_fewest(job) == MIN_ITERATIONS_OTHER_FIRST)


@pytest.mark.parametrize("job", sorted(JOBS))
def test_a_job_at_its_fewest_iterations_has_two_steady_steps(job: str, tmp_path) -> None:
    n = _fewest(job)
    r = simulate(_spec(job, n))
    path = tmp_path / "timeline.json.gz"
    write_chrome_trace(r.raw, path)
    tr = read_trace(path, compute_events=True)
    sr = detect_steps(tr.flows, compute=tr.compute_events, iteration_s=[ns / 1e9 for ns in r.iteration_ns])
    assert len(sr.steady_steps) >= 2 and sr.steady_steps[-1] == len(sr.steps) - 1
    assert len(sr.steps) in (n - 1, n)  # ZeRO-3's other first iteration: calls before the first full period
    assert sr.step_time_us == pytest.approx(r.iteration_ns[-2] / 1e3, rel=0.01)
