"""The general generator (issue 26): pipeline schedules, the collectives each framework issues per
step and communicator, rank placement, the memory estimate per stage, and the simulation of
pipelined jobs (lib/workload/, lib/sim/workloads.py, lib/sim/analytic.py)."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest

from phantora_assets.lib.sim.analytic import AnalyticSimulator
from phantora_assets.lib.sim.memory import estimate_memory
from phantora_assets.lib.sim.workloads import WorkloadModel
from phantora_assets.lib.workload.collectives import collective_table, run_spec_of, step_collectives
from phantora_assets.lib.workload.pipeline import in_flight, schedule

BASE: dict[str, Any] = {
    "framework": "megatron",
    "model": {"kind": "dense", "layers": 8, "hidden": 1024, "ffn_hidden": 4096, "heads": 16, "vocab": 32768},
    "parallel": {"tp": 2, "pp": 2, "dp": "rest", "zero": 1},
    "train": {"seq_len": 1024, "micro_batch": 1, "global_batch": 8, "iterations": 3},
}


def _t(framework: str = "megatron", **parallel: object) -> dict:
    t = copy.deepcopy(BASE)
    t["framework"] = framework
    t["parallel"].update(parallel)
    return t


def _calls(spec) -> Counter:
    """(group, op, tag family) -> calls per step, over every communicator."""
    return Counter((c.group, c.op) for c in step_collectives(spec))


@pytest.mark.parametrize("pp,m", [(2, 1), (4, 8), (4, 3), (8, 16)])
def test_1f1b_runs_each_micro_batch_once_and_keeps_pp_minus_stage_in_flight(pp, m):
    for stage in range(pp):
        ops = schedule("1f1b", pp, stage, m)
        assert sorted(mb for ph, mb, _ in ops if ph == "F") == list(range(m))
        assert sorted(mb for ph, mb, _ in ops if ph == "B") == list(range(m))
        assert in_flight("1f1b", pp, stage, m) == min(pp - stage, m)
        assert in_flight("gpipe", pp, stage, m) == m


def test_interleaved_schedule_runs_every_chunk_of_every_micro_batch():
    pp, vs, m = 4, 2, 8
    for stage in range(pp):
        ops = schedule("interleaved", pp, stage, m, vs)
        assert Counter(ops) == Counter((ph, mb, v) for ph in "FB" for mb in range(m) for v in range(vs))
        warm = next(i for i, (ph, _, _) in enumerate(ops) if ph == "B")
        assert warm == min((pp - stage - 1) * 2 + (vs - 1) * pp, m * vs) + 1


def test_megatron_placement_is_tp_innermost_then_dp_then_pp():
    spec = run_spec_of(_t(), 2, 4, "h100", "m")  # tp 2, pp 2, dp 2 on 8 GPUs
    comms = WorkloadModel(spec).comms
    assert [c.ranks for c in comms["tp"]] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [c.ranks for c in comms["dp"]] == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert [c.ranks for c in comms["pp"]] == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_expert_mesh_spans_tp_when_etp_is_one():
    moe = _t(sequence_parallel=True, ep=4, etp=1, pp=1)
    moe["model"].update(kind="moe", experts=8, topk=2, moe_ffn_hidden=1024)
    comms = WorkloadModel(run_spec_of(moe, 1, 8, "h100", "moe")).comms  # tp 2, dp 4
    assert [c.ranks for c in comms["ep"]] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [c.ranks for c in comms["edp"]] == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_megatron_tp_sequence_parallel_and_pipeline_calls():
    spec = run_spec_of(_t(), 2, 4, "h100", "m")  # no SP: all-reduces
    m = spec.par.micro_batches  # 8 / dp 2 = 4
    calls = _calls(spec)
    layers = 4  # per stage
    # per micro-batch and stage: 2 forward + 2 backward all-reduces per layer, embedding fwd (stage 0),
    # output-layer bwd and 3 fp32 cross-entropy all-reduces (last stage); + grad_norm.tp per stage
    ar_per_group = {0: 4 * layers * m + m + 1, 1: 4 * layers * m + m + 3 * m + 1}
    assert calls[("tp", "all_reduce")] == 2 * (ar_per_group[0] + ar_per_group[1])
    # pipeline: one activation and one gradient send per micro-batch per pp communicator (4 of them)
    assert calls[("pp", "send")] == 4 * 2 * m
    sp = run_spec_of(_t(sequence_parallel=True), 2, 4, "h100", "m")
    sp_calls = _calls(sp)
    # SP: per layer 2 all-gathers forward, 4 backward (grad of the reduce-scatter, input re-gather), 2 + 2 RS
    assert sp_calls[("tp", "all_gather")] == 2 * ((6 * layers * m) * 2 + m + 2 * m)
    assert sp_calls[("tp", "reduce_scatter")] == 2 * ((4 * layers * m) * 2 + m + m)
    pp_send = [c for c in step_collectives(sp) if c.op == "send"]
    assert {c.count for c in pp_send} == {1024 * 1024 // 2}  # [s, mbs, h] / tp with SP, bf16


def test_megatron_distributed_optimizer_vs_ddp():
    dist = _calls(run_spec_of(_t(), 2, 4, "h100", "m"))
    ddp = _calls(run_spec_of(_t(zero=0), 2, 4, "h100", "m"))
    assert dist[("dp", "reduce_scatter")] == dist[("dp", "all_gather")] > 0
    assert ddp[("dp", "all_gather")] == ddp[("dp", "reduce_scatter")] == 0
    assert ddp[("dp", "all_reduce")] == dist[("dp", "reduce_scatter")] + dist[("dp", "all_reduce")]


def test_context_parallel_ring_and_grad_sync_over_dp_x_cp():
    spec = run_spec_of(_t(cp=2, pp=1), 1, 8, "h100", "c")  # tp 2, cp 2, dp 2
    calls = step_collectives(spec)
    ring = [c for c in calls if c.group == "cp"]
    m, layers = spec.par.micro_batches, 8
    # 4 cp rings x 2 hops x (cp - 1 = 1 forward step + cp = 2 backward steps) x layers x micro-batches
    assert len(ring) == 4 * 2 * (1 + 2) * layers * m
    fwd = {c.count for c in ring if ".fwd." in c.tag}
    assert fwd == {2 * 512 * 16 // 2 * 64}  # K and V of [seq/cp, heads/tp, head_dim]
    # Transformer Engine's backward at cp = 2: KV, then dKV, each one chunk's size, to the previous rank
    assert {c.count for c in ring if ".bwd." in c.tag} == fwd
    rs = {c.ranks for c in calls if c.op == "reduce_scatter"}
    assert rs == {(0, 2, 4, 6), (1, 3, 5, 7)}  # gradients over dp x cp


def test_torchtitan_fsdp2_gathers_per_block_forward_and_backward():
    tt = _t("torchtitan", sequence_parallel=True, zero=3, pp=1)
    spec = run_spec_of(tt, 1, 8, "h100", "t")  # tp 2, dp 4
    m = spec.par.micro_batches  # 8 / 4 = 2
    df = collective_table(spec)
    dp = df[df.group == "dp"].groupby(["op", "dtype"]).calls.sum().to_dict()
    # 8 blocks gathered in forward and, but the last (reshard_after_forward = layer_id < n_layers - 1),
    # again in backward per micro-batch; the root once per micro-batch; x 2 dp comms
    assert dp[("all_gather", "Bf16")] == 2 * (8 * m + 7 * m + m)
    assert dp[("reduce_scatter", "F32")] == 2 * (8 + 1) * m  # fp32 gradients every backward (sync stays on)
    kept = run_spec_of(_t("torchtitan", sequence_parallel=True, zero=2, pp=1), 1, 8, "h100", "t2")
    assert collective_table(kept).query("group == 'dp' and op == 'all_gather'").calls.sum() == 2 * (8 * m + m)


def test_deepspeed_zero_stages():
    ds = copy.deepcopy(BASE)
    ds["framework"] = "deepspeed"
    ds["parallel"] = {"zero": 0}
    ops = {z: _calls(run_spec_of({**ds, "parallel": {"zero": z}}, 1, 4, "h100", f"d{z}")) for z in (0, 1, 2)}
    assert ops[0][("dp", "all_reduce")] > 1 and ops[0][("dp", "reduce_scatter")] == 0
    assert ops[1][("dp", "reduce_scatter")] == ops[0][("dp", "all_reduce")] - 1  # the grad-norm stays an all-reduce
    # global batch 8 on dp 4: 2 micro-batches; ZeRO-1 reduces at the accumulation boundary, ZeRO-2
    # after every backward (stage_1_and_2.py reduce_ready_partitions_and_remove_grads)
    assert ops[2][("dp", "reduce_scatter")] == 2 * ops[1][("dp", "reduce_scatter")]
    others = [{k: n for k, n in ops[z].items() if k != ("dp", "reduce_scatter")} for z in (1, 2)]
    assert others[0] == others[1] and others[0][("dp", "all_gather")] > 0


def test_memory_estimate_per_stage_and_refusal():
    spec = run_spec_of(_t(), 2, 4, "h100", "m")
    est = estimate_memory(WorkloadModel(spec))
    assert est.fits and est.peak_bytes > 0
    big = copy.deepcopy(BASE)
    big["model"].update(layers=80, hidden=8192, ffn_hidden=28672, heads=64, kv_heads=8)
    big["parallel"] = {"tp": 1, "pp": 1, "dp": "rest", "zero": 0}
    oom = run_spec_of(big, 1, 8, "h100", "big")
    assert not AnalyticSimulator(oom).run().fits  # 70B replicated: refused before simulating


@pytest.mark.parametrize(
    "parallel",
    [
        {"pp_schedule": "1f1b"},
        {"pp_schedule": "gpipe"},
        {"pp_schedule": "interleaved", "virtual_stages": 2},
        {"sequence_parallel": True, "cp": 2, "pp": 1},
    ],
)
def test_pipelined_jobs_simulate_to_the_end(parallel):
    spec = run_spec_of(_t(**parallel), 2, 4, "h100", "p")
    sim = AnalyticSimulator(spec)
    res = sim.run()
    assert res.fits and sim.unfinished == 0
    assert len(res.iteration_ns) == 3 and res.step_ns > res.compute_ns_per_step > 0
    sends = res.raw[res.raw["call"] == "NcclSend"]
    assert len(sends) > 0


def test_pipeline_bubble_grows_with_fewer_micro_batches():
    many = AnalyticSimulator(run_spec_of(_t(), 2, 4, "h100", "a")).run()
    t = _t()
    t["train"]["global_batch"] = 2  # one micro-batch per step: the stages run one after the other
    one = AnalyticSimulator(run_spec_of(t, 2, 4, "h100", "b")).run()
    # 4 micro-batches fill the pipe: more than 2x the one-micro-batch step, less than 4x
    assert 2.0 * one.step_ns < many.step_ns < 4.0 * one.step_ns


def test_a_trace_over_the_event_bound_is_scoped_to_one_rank_a_stage_or_refused_before_simulating():
    from phantora_assets.lib.errors import RunMatrixError
    from phantora_assets.lib.sim.analytic import MAX_TRACE_EVENTS, timeline_scope, trace_bound_rule
    from phantora_assets.lib.workload.collectives import ONE_RANK_A_STAGE, trace_events_per_step

    ds = copy.deepcopy(BASE)
    ds["framework"] = "deepspeed"
    ds["model"]["layers"] = 32
    ds["parallel"] = {"zero": 1}
    ds["train"] = {"seq_len": 1024, "grad_accumulation": 8, "iterations": 20}
    spec = run_spec_of(ds, 64, 8, "h100", "wide")
    # 512 ranks x ((32 layers x 4 compute items + embedding + head x 2) x 8 micro-batches + 3 optimizer
    # items), and 512 ring flows (one per rank) per collective over all 512 ranks
    calls = step_collectives(spec)
    assert {len(c.ranks) for c in calls} == {512}
    assert trace_events_per_step(spec) == 512 * ((32 * 4 + 3) * 8 + 3) + 512 * len(calls)
    assert trace_events_per_step(spec) * 20 > MAX_TRACE_EVENTS
    # past the bound: the compute of one rank (a single stage) and every flow of the 512-rank rings
    assert trace_events_per_step(spec, ONE_RANK_A_STAGE) == (32 * 4 + 3) * 8 + 3 + 512 * len(calls)
    # and before the first step DeepSpeed broadcasts each of the 291 parameter tensors (32 x 9 + embedding, final
    # norm, head) from rank 0 over the 512 ranks: 511 flows each (``engine._broadcast_model``), counted once
    assert timeline_scope(spec) == (ONE_RANK_A_STAGE, 20 * ((32 * 4 + 3) * 8 + 3 + 512 * 4) + 291 * 511)
    assert trace_bound_rule(spec) is None
    # ZeRO-3 gathers and reduce-scatters every layer of every micro-batch over all 512 ranks: its network
    # flows alone are past the bound
    ds["parallel"] = {"zero": 3}
    spec3 = run_spec_of(ds, 64, 8, "h100", "wide3")
    assert trace_events_per_step(spec3, ONE_RANK_A_STAGE) * 20 > MAX_TRACE_EVENTS
    with pytest.raises(RunMatrixError, match="refused before simulating; lower train.iterations"):
        AnalyticSimulator(spec3).run()


def test_torchtitan_cp_attention_flop_are_a_cp_share_of_the_sequence():
    # torch's ring attention (load-balanced, _templated_ring_attention) runs cp SDPA calls per block
    # on a rank: the local causal [s/cp]^2 block, then cp - 1 blocks of half the queries or half the
    # keys, unmasked: cp x 2 (s/cp)^2 d h FLOP forward, a 1/cp share of the sequence's 2 s^2 d h
    # (as Megatron's megatron_attention). Was: one [s/cp]^2 block, a 1/cp^2 share.
    def flash_flop(cp: int) -> float:
        t = _t("torchtitan", tp=1, pp=1, dp=1, cp=cp, zero=3)
        t["train"] = {"seq_len": 1024, "micro_batch": 1, "grad_accumulation": 1, "iterations": 3}
        program = WorkloadModel(run_spec_of(t, 1, cp, "h100", f"cp{cp}")).stage_programs(False)[0]
        return sum(k.flops for it in program for k in getattr(it, "kernels", ()) if k.op == "FlashAttention")

    s, d, h, layers = 1024, 64, 16, 8  # (cp = 1 on one GPU is no FSDP in torchtitan: the schema refuses it)
    assert flash_flop(2) == layers * 2 * s * s * d * h / 2
    assert flash_flop(4) == layers * 2 * s * s * d * h / 4


def _ds(zero: int, arch: str = "llama", accumulation: int = 1) -> Any:
    """A small DeepSpeed job on 4 GPUs: HF Llama (dense) or gpt-oss (8 experts, top-2)."""
    ds = copy.deepcopy(BASE)
    ds["framework"] = "deepspeed"
    ds["parallel"] = {"zero": zero}
    ds["train"] = {"seq_len": 1024, "micro_batch": 1, "grad_accumulation": accumulation, "iterations": 4}
    if arch == "gpt_oss":
        ds["model"].update(kind="moe", arch="gpt_oss", experts=8, topk=2, moe_ffn_hidden=512, head_dim=64)
    return run_spec_of(ds, 1, 4, "h100", f"ds{zero}{arch}{accumulation}")


def _gemm_flops(spec, phase: str, name: str = "") -> float:
    """GEMM FLOP of one rank's steady step, compute items of ``phase`` whose name contains ``name``."""
    from phantora_assets.lib.sim.workload_types import Compute

    items = WorkloadModel(spec).step_program()
    return sum(i.flops for i in items if isinstance(i, Compute) and i.phase == phase and name in i.name)


def test_deepspeed_zero3_llama_runs_its_mlp():
    """Issue 39, item 3: ZeRO-3 with the HF Llama modules runs every layer's SwiGLU MLP (the
    step found compute by gpt-oss module names only). Closed form: gate, up and down
    projections, 2 s h f FLOP each forward, twice that backward (input and weight gradients)."""
    s, h, f, layers = 1024, 1024, 4096, 8
    z3 = _ds(3)
    assert _gemm_flops(z3, "fwd", ".mlp.") == layers * 3 * 2 * s * h * f
    assert _gemm_flops(z3, "bwd", ".mlp.") == layers * 3 * 2 * 2 * s * h * f
    # ZeRO changes where parameters live, not what a micro-batch computes
    for phase in ("fwd", "bwd"):
        assert _gemm_flops(z3, phase) == _gemm_flops(_ds(0), phase)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_deepspeed_gpt_oss_runs_every_expert_at_every_zero_stage(zero):
    """Issue 39, item 2: a DeepSpeed MoE is the HF gpt-oss model at every ZeRO stage: every expert
    on every token (the ZeRO-0/1/2 steps ran a Llama MLP of moe_ffn_hidden). Closed form per layer
    forward: the router 2 s h E, gate_up 2 E s h 2f, down 2 E s f h; the memory estimate's
    activations do not depend on the ZeRO stage."""
    s, h, f, e, layers = 1024, 1024, 512, 8, 8
    spec = _ds(zero, "gpt_oss")
    assert _gemm_flops(spec, "fwd", ".mlp.") == layers * (2 * s * h * e + 2 * e * s * h * 2 * f + 2 * e * s * f * h)
    for phase in ("fwd", "bwd"):
        assert _gemm_flops(spec, phase) == _gemm_flops(_ds(3, "gpt_oss"), phase)
    z3 = estimate_memory(WorkloadModel(_ds(3, "gpt_oss")))
    assert estimate_memory(WorkloadModel(spec)).activations_bytes == z3.activations_bytes


def test_deepspeed_zero3_accumulation_repeats_the_micro_batch():
    """Issue 39, item 1: with 4 micro-batches a ZeRO-3 step computes, gathers and reduce-scatters
    4 times what one micro-batch does (one optimizer step), and takes longer than the
    one-micro-batch step; each micro-batch after the first starts once the previous backward's
    reduce-scatters are done (stage3.py independent_gradient_partition_epilogue synchronizes)."""
    one, four = _ds(3, accumulation=1), _ds(3, accumulation=4)
    for phase in ("fwd", "bwd"):
        assert _gemm_flops(four, phase) == 4 * _gemm_flops(one, phase)
    c1, c4 = _calls(one), _calls(four)
    assert c4[("dp", "all_gather")] == 4 * c1[("dp", "all_gather")] > 0
    assert c4[("dp", "reduce_scatter")] == 4 * c1[("dp", "reduce_scatter")] > 0
    assert c4[("dp", "all_reduce")] == c1[("dp", "all_reduce")] == 1  # the grad norm, once a step
    items = WorkloadModel(four).step_program()
    epilogues = [i for i in items if getattr(i, "name", "").endswith("backward_epilogue")]
    assert len(epilogues) == 3 and all(len(i.waits) == c1[("dp", "reduce_scatter")] for i in epilogues)
    r1, r4 = AnalyticSimulator(one).run(), AnalyticSimulator(four).run()
    assert 3.0 * r1.step_ns < r4.step_ns


def test_runs_says_a_trace_over_the_event_bound_is_refused(tmp_path, monkeypatch, capsys):
    """Issue 37 item 4: 'fits: yes' is never followed by a refusal at build: `phantora-assets runs` states the
    simulator's own event bound (the job above with ZeRO-3, 64 x 8 GPUs, 8 micro-batches, 20 iterations: past the
    bound even with one rank a stage)."""
    from phantora_assets.cli import main

    matrix = tmp_path / "m.toml"
    matrix.write_text(
        """
[workloads.wide]
framework = "deepspeed"
model = {kind = "dense", layers = 32, hidden = 1024, ffn_hidden = 4096, heads = 16, kv_heads = 4, vocab = 32000}
parallel = {zero = 3}
train = {seq_len = 1024, grad_accumulation = 8, iterations = 20}

[workloads.wide1]
framework = "deepspeed"
model = {kind = "dense", layers = 32, hidden = 1024, ffn_hidden = 4096, heads = 16, kv_heads = 4, vocab = 32000}
parallel = {zero = 1}
train = {seq_len = 1024, grad_accumulation = 8, iterations = 20}

[workloads.narrow]
framework = "deepspeed"
model = {kind = "dense", layers = 2, hidden = 1024, ffn_hidden = 4096, heads = 16, kv_heads = 4, vocab = 32000}
parallel = {zero = 1}
train = {seq_len = 1024, grad_accumulation = 1, iterations = 3}

[[run]]
workload = "wide"
gpu = "h100"
nodes = 64
gpus_per_node = 8

[[run]]
workload = "wide1"
gpu = "h100"
nodes = 64
gpus_per_node = 8

[[run]]
workload = "narrow"
gpu = "h100"
nodes = 1
gpus_per_node = 2
"""
    )
    monkeypatch.setenv("PHANTORA_ASSETS_RUN_MATRIX", str(matrix))
    monkeypatch.delenv("PHANTORA_ASSETS_IMPORT_DIR", raising=False)
    assert main(["runs", "--data-dir", str(tmp_path / "data")]) == 0
    out = capsys.readouterr().out.splitlines()
    (wide,) = [line for line in out if "_wide_" in line]
    (wide1,) = [line for line in out if "_wide1_" in line]
    (narrow,) = [line for line in out if "_narrow_" in line]
    assert " NO " in wide and "refused at build: the trace would hold about" in wide and "3,800,000" in wide
    # ZeRO-1: past the bound with every rank (10.8 M events), within it with one rank a stage (62 k)
    assert " yes " in wide1 and "refused" not in wide1 and "(timeline: one rank a stage" in wide1
    assert " yes " in narrow and "refused" not in narrow and "timeline" not in narrow
