"""The [workloads.NAME] / [gpus.NAME] schema of a run-matrix file: strict validation naming the
entry and the rule (lib/workload/spec.py, lib/workload/tables.py, docs/WORKLOADS.md)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.run.catalog import shipped_workloads
from phantora_assets.lib.workload.collectives import run_spec_of
from phantora_assets.lib.workload.spec import parse_workload
from phantora_assets.matrix import load_run_matrix

LLAMA = {
    "framework": "megatron",
    "model": {"kind": "dense", "layers": 32, "hidden": 4096, "ffn_hidden": 14336, "heads": 32, "kv_heads": 8},
    "parallel": {"tp": 4, "pp": 2, "dp": "rest", "sequence_parallel": True, "zero": 1},
    "train": {"seq_len": 4096, "micro_batch": 1, "global_batch": 16},
}
LLAMA["model"]["vocab"] = 128256
MOE = {
    "framework": "megatron",
    "model": {
        "kind": "moe",
        "layers": 28,
        "hidden": 2048,
        "ffn_hidden": 10944,
        "heads": 16,
        "vocab": 102400,
        "experts": 64,
        "topk": 6,
        "moe_ffn_hidden": 1408,
        "shared_experts": 2,
        "dense_layers": 1,
    },
    "parallel": {"tp": 4, "pp": 4, "dp": "rest", "sequence_parallel": True, "zero": 1},
    "train": {"seq_len": 4096, "global_batch": 8},
}


def _with(base: dict, **changes: object) -> dict:
    """``base`` with ``section.key = value`` changes (``model__heads=12``); None deletes the key."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        sect, _, k = key.partition("__")
        table = out[sect] if k else out
        k = k or sect
        if value is None:
            table.pop(k, None)
        else:
            table[k] = value
    return out


#: (table, nodes x gpus_per_node, the rule the error must name)
BAD = {
    "tp_not_dividing_heads": (_with(LLAMA, parallel__tp=3), 24, "tp = 3 must divide heads = 32 and kv_heads = 8"),
    "tp_not_dividing_kv_heads": (_with(LLAMA, model__kv_heads=2), 16, "must divide heads = 32 and kv_heads = 2"),
    "pp_not_dividing_layers": (_with(LLAMA, parallel__pp=3), 24, "pp = 3 must divide layers = 32"),
    "pp_vs_not_dividing_layers": (
        _with(LLAMA, parallel__pp_schedule="interleaved", parallel__virtual_stages=3),
        16,
        "pp x virtual_stages = 2 x 3 must divide layers = 32",
    ),
    "world_mismatch": (_with(LLAMA, parallel__dp=3), 16, "dp x tp x pp x cp = 3 x 4 x 2 x 1 = 24 must equal the GPU"),
    "rest_not_dividing": (LLAMA, 12, "tp x pp x cp = 4 x 2 x 1 = 8 must divide the GPU count 12"),
    "experts_not_divisible_by_ep": (_with(MOE, parallel__ep=3), 48, "experts = 64 must be divisible by ep = 3"),
    "ep_not_dividing_mesh": (_with(MOE, parallel__ep=8), 16, "ep = 8 must divide dp x cp x tp / etp"),
    "global_batch": (_with(LLAMA, train__global_batch=3), 16, "global_batch = 3 must be divisible by micro_batch x dp"),
    "unknown_key": (_with(LLAMA, parallel__tensor_parallel=2), 16, "unknown keys ['tensor_parallel']"),
    "unknown_model_key": (_with(LLAMA, model__hidden_size=4096), 16, "unknown keys ['hidden_size']"),
    "missing_key": (_with(LLAMA, model__layers=None), 16, "missing key 'layers'"),
    "bool_is_not_int": (_with(LLAMA, parallel__tp=True), 16, "tp must be an integer, got true (boolean)"),
    "float_is_not_int": (_with(LLAMA, train__seq_len=4096.0), 16, "seq_len must be an integer, got 4096.0"),
    "bad_dp_word": (_with(LLAMA, parallel__dp="all"), 16, 'dp must be an integer or "rest"'),
    "bad_framework": (_with(LLAMA, framework="nemo"), 16, "framework must be one of megatron | deepspeed"),
    "zero_megatron": (_with(LLAMA, parallel__zero=3), 16, "megatron has zero = 0 (DDP all-reduce) or 1"),
    "batch_and_accumulation": (
        _with(LLAMA, train__grad_accumulation=2),
        16,
        "set exactly one of global_batch and grad_accumulation",
    ),
    "moe_tp_without_sp": (_with(MOE, parallel__sequence_parallel=False), 16, "needs sequence_parallel = true"),
    "deepspeed_tp": (_with(LLAMA, framework="deepspeed"), 16, "deepspeed runs ZeRO data parallelism only here"),
    "interleaved_micro_batches": (
        _with(LLAMA, parallel__pp_schedule="interleaved", parallel__virtual_stages=2, train__global_batch=6),
        16,
        "needs micro-batches per step (3) divisible by pp = 2",
    ),
    "cp_seq": (_with(LLAMA, parallel__cp=2, train__seq_len=4094), 32, "must be divisible by 2 x cp"),
    "first_stage_layers_zero": (
        _with(LLAMA, parallel__first_stage_layers=0),
        16,
        "first_stage_layers / last_stage_layers need pp >= 2, virtual_stages = 1, at least one layer each",
    ),
    "moe_ffn_hidden_zero": (_with(MOE, model__moe_ffn_hidden=0), 16, "moe_ffn_hidden must be >= 1, got 0"),
    "two_iterations": (_with(LLAMA, train__iterations=2), 16, "iterations must be >= 3 (a step is a period"),
    "deepspeed_zero3_three_iterations": (
        _with(
            LLAMA,
            framework="deepspeed",
            parallel__tp=1,
            parallel__pp=1,
            parallel__zero=3,
            parallel__sequence_parallel=False,
            train__iterations=3,
        ),
        16,
        "iterations must be >= 4 for DeepSpeed ZeRO-3 (its first iteration",
    ),
    # issue 39, item 2: the HF Llama modules have no experts (they vanished from parameters, bytes
    # and FLOPs); a DeepSpeed MoE is the HF gpt-oss model, which has no shared experts or dense layers
    "deepspeed_moe_llama": (
        _with(MOE, framework="deepspeed", parallel={"zero": 3}, model__shared_experts=0, model__dense_layers=0),
        16,
        "a deepspeed moe model is the Hugging Face gpt-oss structure",
    ),
    "gpt_oss_dense": (
        _with(LLAMA, framework="deepspeed", parallel={"zero": 3}, model__arch="gpt_oss"),
        16,
        "arch = 'gpt_oss' is an moe model with every layer an MoE layer and no shared experts",
    ),
    "gpt_oss_shared_experts": (
        _with(MOE, framework="deepspeed", parallel={"zero": 3}, model__arch="gpt_oss", model__dense_layers=0),
        16,
        "arch = 'gpt_oss' is an moe model with every layer an MoE layer and no shared experts",
    ),
    "deepspeed_recompute": (
        _with(LLAMA, framework="deepspeed", parallel={"zero": 3}, train__recompute="full"),
        16,
        "recompute is not modelled for deepspeed",
    ),
    "tensor_past_2_40": (
        _with(LLAMA, model__ffn_hidden=2**31, train__seq_len=2**31),
        16,
        "more than 2^40 = 1,099,511,627,776 (seq_len x micro_batch",
    ),
    # torchtitan's DDP is 1-D (parallelize_llama: "DDP has not supported > 1D parallelism"; with cp > 1
    # torchtitan applies FSDP over dp_shard x cp instead): was accepted and generated as DDP
    "torchtitan_ddp_tp": (
        _with(LLAMA, framework="torchtitan", parallel__zero=0, parallel__pp=1),
        16,
        "torchtitan's DDP (zero = 0, apply_ddp) is 1-D data parallelism only",
    ),
    "torchtitan_ddp_pp": (
        _with(LLAMA, framework="torchtitan", parallel__zero=0, parallel__tp=1, parallel__sequence_parallel=False),
        16,
        "got tp = 1, pp = 2, cp = 1 (use zero = 2 or 3)",
    ),
    "torchtitan_ddp_cp": (
        _with(
            LLAMA,
            framework="torchtitan",
            parallel__zero=0,
            parallel__tp=1,
            parallel__pp=1,
            parallel__cp=2,
            parallel__sequence_parallel=False,
        ),
        16,
        "with cp > 1 it applies FSDP over dp_shard x cp; got tp = 1, pp = 1, cp = 2",
    ),
    "torchtitan_cp_eager": (
        _with(LLAMA, framework="torchtitan", parallel__zero=3, parallel__cp=2, train__attention="eager"),
        16,
        "torchtitan's context parallelism runs SDPA's flash / efficient kernels only",
    ),
    "uneven_stages": (
        _with(MOE, parallel__pp=8, parallel__first_stage_layers=5),
        32,
        "the other 7 stage(s) to share the remaining layers evenly (layers = 28)",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_spec_is_refused_with_entry_and_rule(case):
    table, gpus, rule = BAD[case]
    with pytest.raises(RunMatrixError) as err:
        run_spec_of(table, gpus // 8 if gpus % 8 == 0 else gpus, 8 if gpus % 8 == 0 else 1, "h100", "job")
    assert rule in str(err.value)
    assert "job" in str(err.value)  # the entry (the workload's name) is named


def test_good_specs_resolve():
    spec = run_spec_of(LLAMA, 2, 8, "h100", "llama")
    p = spec.par
    assert (p.tp, p.pp, p.dp, p.cp, p.micro_batches) == (4, 2, 2, 1, 8)
    assert spec.parallelism == "tp=4,pp=2,dp=2"
    moe = run_spec_of(MOE, 2, 8, "h100", "moe").par
    assert (moe.tp, moe.pp, moe.dp, moe.ep, moe.etp, moe.edp) == (4, 4, 1, 1, 4, 1)
    wide = run_spec_of(_with(MOE, parallel__ep=4, parallel__etp=1, parallel__pp=1), 2, 8, "h100", "moe2").par
    assert (wide.dp, wide.ep, wide.etp, wide.edp) == (4, 4, 1, 4)


def test_shipped_workloads_are_in_the_schema():
    wls = shipped_workloads()
    assert sorted(wls) == ["W1", "W2", "W3", "W4", "W5"]
    assert (wls["W1"].framework, wls["W1"].parallel.tp, wls["W1"].parallel.zero) == ("megatron", 2, 1)
    assert (wls["W2"].model.experts, wls["W2"].parallel.ep) == (8, "dp")
    assert (wls["W5"].model.arch, wls["W5"].parallel.zero) == ("gpt_oss", 3)
    for w in wls.values():
        assert (w.model.layers, w.train.seq_len, w.train.grad_accumulation, w.train.iterations) == (4, 1024, 1, 20)
    assert parse_workload("W1", wls["W1"].table(), "x") == wls["W1"]  # the raw table round-trips


def _matrix(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "runs.toml"
    p.write_text(text)
    return p


RUN = '[[run]]\nworkload = "{w}"\ngpu = "{g}"\nnodes = 2\ngpus_per_node = 8\n'
MY_GPU = """
[gpus.my_gpu]
name = "Some GPU"
memory_gb = 96
peak_bf16_flops = 500.0e12
mem_bw_bytes_per_s = 3.0e12
matmul_efficiency = 0.6
memory_efficiency = 0.8
"""
MY_JOB = """
[workloads.my_job]
framework = "torchtitan"
[workloads.my_job.model]
kind = "dense"
layers = 8
hidden = 2048
ffn_hidden = 8192
heads = 16
vocab = 32000
[workloads.my_job.parallel]
tp = 2
pp = 2
sequence_parallel = true
zero = 3
[workloads.my_job.train]
seq_len = 2048
global_batch = 16
"""


def test_matrix_file_with_workloads_and_gpus(tmp_path):
    path = _matrix(tmp_path, MY_GPU + MY_JOB + RUN.format(w="my_job", g="my_gpu") + RUN.format(w="W4", g="h100"))
    specs = load_run_matrix(path)
    assert [s.run_id for s in specs] == ["phantora_my_gpu_my_job_2x8", "phantora_h100_W4_2x8"]
    mine = specs[0]
    assert (mine.framework, mine.dp, mine.par.micro_batches, mine.model_name) == ("torchtitan", 4, 4, "my_job")
    assert mine.gpu_spec["memory_gb"] == 96 and mine.gpu_spec["perfdb"] == "my_gpu"


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        (MY_JOB.replace("my_job", "W1") + RUN.format(w="W1", g="h100"), "[workloads.W1] is a shipped workload"),
        (MY_GPU.replace("my_gpu", "h100") + RUN.format(w="W4", g="h100"), "[gpus.h100] is a shipped GPU"),
        (MY_GPU.replace("memory_gb = 96", "memory_gb = 0") + RUN.format(w="W4", g="my_gpu"), "memory_gb must be > 0"),
        (MY_GPU.replace("0.6", "1.5") + RUN.format(w="W4", g="my_gpu"), "matmul_efficiency must be in (0, 1]"),
        (MY_GPU + "peak = 1\n" + RUN.format(w="W4", g="my_gpu"), "unknown keys ['peak']"),
        (MY_JOB + "[extra]\n" + RUN.format(w="my_job", g="h100"), "unknown top-level keys ['extra']"),
        (MY_JOB + RUN.format(w="my_job2", g="h100"), "unknown workload 'my_job2'"),
        (MY_JOB.replace("tp = 2", "tp = 3") + RUN.format(w="my_job", g="h100"), "tp = 3 must divide heads = 16"),
    ],
)
def test_matrix_file_rules(tmp_path, text, rule):
    path = _matrix(tmp_path, text)
    with pytest.raises(RunMatrixError) as err:
        load_run_matrix(path)
    assert rule in str(err.value) and str(path) in str(err.value)


def test_shipped_gpus_include_a100_80g_and_mi300x():
    from phantora_assets.lib.run.catalog import shipped_gpu_specs

    g = shipped_gpu_specs()
    assert (g["a100_80g"]["memory_gb"], g["a100_80g"]["peak_bf16_flops"]) == (80, 312.0e12)
    assert (g["mi300x"]["memory_gb"], g["mi300x"]["peak_bf16_flops"]) == (192, 1307.4e12)


def _label_case(table: dict, gpus: int) -> str:
    return run_spec_of(table, gpus // 8, 8, "h100", "job").parallelism


def test_parallelism_shows_every_dimension_and_ep_only_for_an_moe():
    """``parallelism`` (runs.csv, ``phantora-assets runs``) names each dimension of the job as resolved:
    tp x pp x cp x dp = the GPUs, and ep (the expert mesh, Megatron-core: etp x ep x edp = tp x cp x dp)
    for an MoE only. ``ep=N`` alone is the published form of an EP job over every GPU with tp = pp = cp = 1
    (dp = ep = N). Was: a TP = 2, DP = 16 job whose EP spans tp x dp (etp = 1) read ``ep=32``."""
    dense = {**LLAMA, "parallel": {"tp": 2, "dp": "rest", "zero": 1}}
    assert _label_case(dense, 32) == "tp=2,dp=16"  # 32 / 2: no ep on a dense job
    sp = {"dp": "rest", "ep": "dp", "zero": 1, "sequence_parallel": True}  # Megatron MoE with tp > 1 needs SP
    moe = {**MOE, "parallel": {**sp, "tp": 2, "etp": 1}, "train": {"seq_len": 4096, "global_batch": 32}}
    assert _label_case(moe, 32) == "tp=2,ep=32,dp=16"  # ep = tp x dp / etp = 2 x 16 / 1
    moe_etp = {**moe, "parallel": {**sp, "tp": 2}}
    assert _label_case(moe_etp, 32) == "tp=2,ep=16,dp=16"  # etp = tp = 2: ep = 2 x 16 / 2
    pure = {**moe, "parallel": {**sp, "sequence_parallel": False}}
    assert _label_case(pure, 32) == "ep=32"  # tp = pp = cp = 1: dp = ep = 32, the published form
    for name, wl in shipped_workloads().items():  # every shipped kind on 8 GPUs: ep iff an MoE
        label = run_spec_of(wl.table(), 1, 8, "h100", name).parallelism
        assert ("ep=" in label) == (wl.model.kind == "moe" and wl.framework == "megatron"), (name, label)


@pytest.mark.parametrize(
    ("parallel", "gpus", "words"),
    [
        ({"dp": 4, "dp_replicate": 4, "zero": 3}, 4, "dp_replicate = 4 is torchtitan's DDP: write zero = 0"),
        ({"tp": 2, "dp": 1, "zero": 2}, 2, "TP / PP without FSDP trains in fp32"),
        ({"pp": 2, "dp": "rest", "zero": 3}, 2, "TP / PP without FSDP trains in fp32"),
        ({"dp": 1, "zero": 3}, 1, "one GPU trains under torch.autocast"),
    ],
)
def test_torchtitan_zero_without_a_shard_is_refused(parallel, gpus, words):
    """torchtitan applies FSDP only when ParallelDims.fsdp_enabled (dp_shard > 1 or cp > 1; parallelize.py,
    maybe_enable_amp @ 238fa99): with dp_shard = 1 and cp = 1 a zero = 2/3 job was simulated as FSDP2 in bf16
    and labelled ``zero=3`` in runs' parallelism column and runs.csv, where torchtitan runs DDP, or TP / PP
    in fp32, or one GPU under autocast. Refused, naming the entry and the rule; dp_shard 2 and cp 2 are FSDP."""
    table = copy.deepcopy(LLAMA) | {"framework": "torchtitan"}
    table["model"]["layers"] = 4
    table["parallel"] = {"sequence_parallel": True, **parallel} if parallel.get("tp", 1) > 1 else parallel
    with pytest.raises(RunMatrixError, match=r"workload job: zero = ") as err:
        run_spec_of(table, nodes=1, gpus_per_node=gpus, gpu="h100", name="job")
    assert "no FSDP in torchtitan (ParallelDims.fsdp_enabled = dp_shard > 1 or cp > 1)" in str(err.value)
    assert words in str(err.value)
    table["parallel"] = {"dp": 2, "zero": 3}  # dp_shard 2: FSDP, labelled zero=3
    assert run_spec_of(table, nodes=1, gpus_per_node=2, gpu="h100", name="job").parallelism == "dp=2,zero=3"
