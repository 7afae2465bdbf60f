"""GPT blocks (GeLU MLP, LayerNorm, multi-head attention), Megatron's ``overlap_grad_reduce = false``
and a user GPU whose roofline is given (issue 38 item 4; docs/WORKLOADS.md).

Every expected value is a closed form written here from Megatron-core's module structure
(``megatron/core/transformer/mlp.py``: linear_fc1 is [ffn, h], [2 ffn, h] only with
``gated_linear_unit`` / ``--swiglu``; LayerNorm registers a weight and a bias of [h]; no linear
biases: ``--disable-bias-linear``), never from the generator.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.sim.kernels import KernelTimer
from phantora_assets.lib.sim.torch_ops import torch_ops
from phantora_assets.lib.sim.workload_types import Collective, Compute
from phantora_assets.lib.sim.workloads import workload_model
from phantora_assets.lib.workload.collectives import run_spec_of, step_collectives
from phantora_assets.matrix import load_run_matrix

L, H, F, A, V = 4, 512, 2048, 8, 1024  # layers, hidden, ffn, heads (= kv heads), vocabulary
GPT = {
    "framework": "megatron",
    "model": {"kind": "dense", "layers": L, "hidden": H, "ffn_hidden": F, "heads": A, "vocab": V},
    "parallel": {"tp": 1, "pp": 1, "dp": "rest", "zero": 0},
    "train": {"seq_len": 256, "micro_batch": 1, "global_batch": 4, "iterations": 3},
}
GPT["model"] |= {"mlp": "gelu", "norm": "layernorm"}


def _with(base: dict, **changes: object) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        sect, _, k = key.partition("__")
        if value is None:
            out[sect].pop(k, None)
        else:
            out[sect][k] = value
    return out


def gpt_params(layers: int, h: int, f: int, vocab: int) -> int:
    """GPT block closed form: qkv 3h^2 + proj h^2 (full MHA), fc1 h f + fc2 f h, two LayerNorms of
    2h each; embedding and untied output layer vocab x h, final LayerNorm 2h."""
    return layers * (4 * h * h + 2 * h * f + 4 * h) + 2 * vocab * h + 2 * h


def llama_params(layers: int, h: int, f: int, vocab: int, kv: int, heads: int) -> int:
    """Llama block (SwiGLU, RMSNorm, GQA): q + o 2h^2, k + v 2 h (kv / heads) h, 3 h f, two norms of h."""
    return layers * (2 * h * h + 2 * h * h * kv // heads + 3 * h * f + 2 * h) + 2 * vocab * h + h


def test_gpt_parameter_count_is_the_closed_form():
    m = workload_model(run_spec_of(GPT, 2, 1, "h100", "gpt"))
    assert m.total_params == gpt_params(L, H, F, V)
    names = [p.name for p in m.params if p.name.startswith("layers.0.")]
    assert names == [
        "layers.0.input_layernorm.weight",
        "layers.0.input_layernorm.bias",
        "layers.0.self_attention.linear_proj.weight",
        "layers.0.self_attention.linear_qkv.weight",
        "layers.0.pre_mlp_layernorm.weight",
        "layers.0.pre_mlp_layernorm.bias",
        "layers.0.mlp.linear_fc1.weight",
        "layers.0.mlp.linear_fc2.weight",
    ]
    # the Llama defaults are unchanged: swiglu and rmsnorm, here with GQA
    llama = _with(GPT, model__mlp=None, model__norm=None, model__kv_heads=2)
    assert workload_model(run_spec_of(llama, 2, 1, "h100", "llama")).total_params == llama_params(L, H, F, V, 2, A)
    # either key alone
    gelu_rms = workload_model(run_spec_of(_with(GPT, model__norm=None), 2, 1, "h100", "g"))
    assert gelu_rms.total_params == gpt_params(L, H, F, V) - (2 * L + 1) * H


def test_gpt_gradient_bytes_follow_the_parameter_count():
    # DDP (zero 0) over dp = 2, one stage, no TP: the bf16 gradient all-reduces cover every parameter once
    calls = step_collectives(run_spec_of(GPT, 2, 1, "h100", "gpt"), warmup=False)
    ar = [c for c in calls if c.group == "dp" and c.op == "all_reduce" and c.tag.startswith("ddp.")]
    assert sum(c.nbytes for c in ar) == 2 * gpt_params(L, H, F, V)
    # distributed optimizer: reduce-scatter + all-gather of the padded buckets (lcm(2, 128) = 128)
    z1 = step_collectives(run_spec_of(_with(GPT, parallel__zero=1), 2, 1, "h100", "gpt1"), warmup=False)
    rs = sum(c.count for c in z1 if c.op == "reduce_scatter" and c.group == "dp")
    assert rs * 2 == -(-gpt_params(L, H, F, V) // 128) * 128


def test_gpt_tp_sp_bytes_and_norm_all_reduce():
    # TP = 2 with sequence parallelism, 2 micro-batches: per layer 2 AG + 2 RS fwd, 4 AG + 2 RS bwd of
    # [s / tp, b, h]; embedding RS fwd / AG bwd, output AG fwd and AG + RS bwd; the LayerNorms'
    # weights and biases all-reduced once a step: 2 norms x 2h per layer + the final norm's 2h
    t = _with(GPT, parallel__tp=2, parallel__sequence_parallel=True, train__global_batch=2)
    calls = [c for c in step_collectives(run_spec_of(t, 1, 2, "h100", "gpt_tp"), warmup=False) if c.group == "tp"]
    n = 256 * H // 2
    ag = [c for c in calls if c.op == "all_gather"]
    rs = [c for c in calls if c.op == "reduce_scatter"]
    assert {c.count for c in ag + rs} == {n}
    assert (len(ag), len(rs)) == (2 * (6 * L + 3), 2 * (4 * L + 2))
    norms = [c for c in calls if c.tag == "finalize.layernorm_grads.all_reduce"]
    assert [c.count for c in norms] == [2 * L * 2 * H + 2 * H]


def test_gpt_mlp_flops_and_kernels():
    s, t = 256, 2
    spec = run_spec_of(_with(GPT, parallel__tp=t), 1, 2, "h100", "gpt_tp2")
    ops = torch_ops(workload_model(spec))
    fwd, bwd = ops.megatron_mlp("fwd", F), ops.megatron_mlp("bwd", F)
    # fc1 [s, h] x [h, f/t] and fc2 [s, f/t] x [f/t, h]; backward: data and weight gradients of both
    assert sum(k.flops for k in fwd) == 2 * (2 * s * H * F // t)
    assert sum(k.flops for k in bwd) == 2 * 2 * (2 * s * H * F // t)
    assert not [k for k in fwd + bwd if k.op == "Mul"]  # no gate product: GeLU, not SwiGLU
    swiglu = torch_ops(workload_model(run_spec_of(_with(GPT, parallel__tp=t, model__mlp=None), 1, 2, "h100", "sw")))
    assert sum(k.flops for k in swiglu.megatron_mlp("fwd", F)) == 2 * s * H * (2 * F // t) + 2 * s * (F // t) * H
    # attention of full MHA: qkv [s, h] x [h, 3h / t]
    att = ops.megatron_attention("fwd")
    assert att[0].flops == 2 * s * H * 3 * H // t


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        ({"model__mlp": "relu"}, "mlp must be one of swiglu | gelu"),
        ({"model__norm": "LayerNorm"}, "norm must be one of rmsnorm | layernorm"),
        ({"framework": None, "model__mlp": "gelu"}, "modelled for framework = 'megatron' only"),
        ({"parallel__overlap_grad_reduce": 0}, "overlap_grad_reduce must be a boolean"),
    ],
)
def test_gpt_schema_rules(changes, rule):
    table = _with(GPT, **{k: v for k, v in changes.items() if k != "framework"})
    if "framework" in changes:
        table["framework"] = "torchtitan"
        table["parallel"]["zero"] = 3
    with pytest.raises(RunMatrixError) as err:
        run_spec_of(table, 2, 1, "h100", "job")
    assert rule in str(err.value) and "job" in str(err.value)


def test_gelu_moe_and_overlap_grad_reduce_outside_megatron_are_refused():
    moe = _with(GPT, model__kind="moe", model__experts=4, model__topk=1)
    with pytest.raises(RunMatrixError, match="mlp = 'gelu' is a dense model's MLP here"):
        run_spec_of(moe, 2, 1, "h100", "job")
    ds = {"framework": "deepspeed", "model": dict(GPT["model"], mlp="swiglu", norm="rmsnorm")}
    ds |= {"parallel": {"zero": 1, "overlap_grad_reduce": False}, "train": GPT["train"]}
    with pytest.raises(RunMatrixError, match="overlap_grad_reduce .* is megatron's"):
        run_spec_of(ds, 2, 1, "h100", "job")


# --------------------------------------------------------------------------- overlap_grad_reduce = false
def _program(table: dict, nodes: int = 2, gpn: int = 1) -> list:
    return workload_model(run_spec_of(table, nodes, gpn, "h100", "job")).stage_programs(False)[0]


@pytest.mark.parametrize("zero", [0, 1])
def test_no_overlap_grad_reduce_reduces_after_the_backward_blocking(zero):
    base = _with(GPT, parallel__zero=zero, train__global_batch=4)
    on, off = _program(base), _program(_with(base, parallel__overlap_grad_reduce=False))
    ddp = lambda prog: [i for i in prog if isinstance(i, Collective) and i.tag.startswith("ddp.")]
    # the same calls (Megatron reduces the same buckets), in the same bucket order
    assert [(c.op, c.count) for c in ddp(on) if c.op != "all_gather"] == [
        (c.op, c.count) for c in ddp(off) if c.op != "all_gather"
    ]
    assert sorted((c.op, c.count) for c in ddp(on)) == sorted((c.op, c.count) for c in ddp(off))
    # overlapped: asynchronous, issued inside the backward; not: blocking, after the last backward compute
    assert not any(c.blocking for c in ddp(on))
    assert all(c.blocking for c in ddp(off))
    last_bwd = max(k for k, i in enumerate(off) if isinstance(i, Compute) and i.phase == "bwd" and "ddp." not in i.name)
    first_red = min(k for k, i in enumerate(off) if isinstance(i, Collective) and i.tag.startswith("ddp."))
    assert first_red > last_bwd
    assert not [i for i in off if isinstance(i, Compute) and i.waits and any("ddp." in w for w in i.waits)]
    if zero:  # no overlap_param_gather: the parameters all-gathered at the end of the optimizer step
        step = next(k for k, i in enumerate(off) if isinstance(i, Compute) and i.name == "optimizer.step")
        gathers = [k for k, i in enumerate(off) if isinstance(i, Collective) and i.op == "all_gather"]
        assert gathers and min(gathers) > step


def test_no_overlap_grad_reduce_exposes_the_reduction():
    from phantora_assets.lib.sim.analytic import simulate

    # 8 layers of 12.6 M parameters: three 40 M-element buckets, the first two reducible during the
    # backward when overlapped
    table = _with(GPT, model__layers=8, model__hidden=1024, model__ffn_hidden=4096, train__global_batch=2)
    spec_on = run_spec_of(table, 2, 1, "h100", "job")
    assert len(workload_model(spec_on).megatron_dense_buckets(0)) == 3
    on = simulate(spec_on)
    off = simulate(run_spec_of(_with(table, parallel__overlap_grad_reduce=False), 2, 1, "h100", "job"))
    # a 2-rank ring all-reduce sends every gradient byte once from each rank, on 800 Gb/s hosts
    # (presets.toml [cluster]): reduced after the backward, the whole reduction is exposed
    grad_bytes = 2 * gpt_params(8, 1024, 4096, V)
    assert off.exposed_comm_ns >= grad_bytes / 1e11 * 1e9
    assert off.exposed_comm_ns > on.exposed_comm_ns and off.iteration_ns[-1] > on.iteration_ns[-1]
    assert off.compute_ns_per_step == on.compute_ns_per_step  # the same kernels


# --------------------------------------------------------------------------- a user GPU's roofline
ROOFLINE_GPU = """
[gpus.my_npu]
name = "A roofline NPU"
memory_gb = 512
peak_bf16_flops = 989.0e12
mem_bw_bytes_per_s = 4800.0e9
matmul_efficiency = 1.0
memory_efficiency = 1.0
kernel_floor_ns = 0
gemm_floor_ns = 0
scale_up_bw_bytes_per_s = 450.0e9
"""
RUN = '[[run]]\nworkload = "W1"\ngpu = "my_npu"\nnodes = 2\ngpus_per_node = 2\n'


def _matrix(tmp_path: Path, text: str, name: str = "runs.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_user_gpu_times_every_kernel_by_its_roofline(tmp_path):
    spec = load_run_matrix(_matrix(tmp_path, ROOFLINE_GPU + RUN))[0]
    assert spec.cluster["loopback_gbps"] == 450e9 * 8 / 1e9  # the scale-up bandwidth, in the topology's Gbps
    timer = KernelTimer(spec.gpu_spec, None)
    ops = torch_ops(workload_model(spec))
    gemm = next(k for k in ops.megatron_mlp("fwd", 14336) if k.flops)
    ew = next(k for k in ops._bda("fwd") if not k.flops)
    # no perf DB, no floor, 100 % of both peaks: t = max(flops / peak, bytes / bandwidth)
    assert timer.lookup(gemm) == (pytest.approx(max(gemm.flops / 989e12, gemm.bytes / 4.8e12) * 1e9), False)
    assert timer.lookup(ew)[0] == pytest.approx(ew.bytes / 4.8e12 * 1e9)


@pytest.mark.parametrize(
    ("old", "new", "rule"),
    [
        ("989.0e12", "989", "peak_bf16_flops is in FLOP/s (989 TFLOP/s is 989e12)"),
        ("4800.0e9", "4800", "mem_bw_bytes_per_s is in bytes/s (4.8 TB/s is 4.8e12)"),
        ("memory_gb = 512", "memory_gb = 141e9", "memory_gb is in GiB"),
        ("450.0e9", "450", "scale_up_bw_bytes_per_s is in bytes/s (450 GB/s is 450e9)"),
        ("450.0e9", "-1", "scale_up_bw_bytes_per_s is in bytes/s"),
        ("450.0e9", "inf", "scale_up_bw_bytes_per_s is in bytes/s"),
    ],
)
def test_user_gpu_units_are_checked(tmp_path, old, new, rule):
    with pytest.raises(RunMatrixError) as err:
        load_run_matrix(_matrix(tmp_path, ROOFLINE_GPU.replace(old, new) + RUN))
    assert rule in str(err.value) and "[gpus.my_npu]" in str(err.value)


def test_scale_up_bandwidth_is_given_once(tmp_path):
    run = RUN + "topology = { loopback_gbps = 2880 }\n"
    with pytest.raises(RunMatrixError, match="both set the scale-up bandwidth"):
        load_run_matrix(_matrix(tmp_path, ROOFLINE_GPU + run))
    # without the GPU's key the entry's loopback_gbps stands
    plain = ROOFLINE_GPU.replace("scale_up_bw_bytes_per_s = 450.0e9\n", "")
    spec = load_run_matrix(_matrix(tmp_path, plain + run, "b.toml"))[0]
    assert spec.cluster["loopback_gbps"] == 2880 and "scale_up_bw_bytes_per_s" not in spec.gpu_spec


def test_user_gpu_is_in_the_fingerprint_by_content(tmp_path):
    from phantora_assets.stages.simulation import run_spec_record

    a = load_run_matrix(_matrix(tmp_path, ROOFLINE_GPU + RUN, "a.toml"))[0]
    b = load_run_matrix(_matrix(tmp_path, ROOFLINE_GPU.replace("989.0e12", "990.0e12") + RUN, "b.toml"))[0]
    c = load_run_matrix(_matrix(tmp_path, ROOFLINE_GPU.replace("450.0e9", "400.0e9") + RUN, "c.toml"))[0]
    assert a.run_id == b.run_id == c.run_id
    prints = {run_spec_record(s).fingerprint for s in (a, b, c)}
    assert len(prints) == 3  # same name, other roofline or scale-up: another run
    assert run_spec_record(a).inputs["gpu"]["peak_bf16_flops"] == 989e12


# --------------------------------------------------------------------------- the study's example as data
EXAMPLE = Path(__file__).resolve().parents[4] / "docs" / "examples" / "opus_small.toml"


def test_opus_small_example_is_the_study_job():
    from phantora_assets.lib.sim.analytic import MAX_TRACE_EVENTS
    from phantora_assets.lib.sim.memory import estimate_memory
    from phantora_assets.lib.workload.collectives import trace_events

    (spec,) = load_run_matrix(EXAMPLE)
    p, m = spec.par, spec.wl.model
    assert (p.dp, p.pp, p.tp, p.micro_batches, p.sequence_parallel, p.zero) == (2, 2, 2, 128, True, 0)
    assert not p.overlap_grad_reduce
    assert (m.layers, m.hidden, m.ffn_hidden, m.heads, m.kv_heads, m.mlp, m.norm) == (
        96, 8192, 28672, 64, 64, "gelu", "layernorm",
    )  # fmt: skip
    assert (spec.wl.train.seq_len, spec.wl.train.global_batch) == (4096, 256)
    assert spec.gpus_per_node == spec.par.tp  # TP inside a host, DP and PP across
    assert spec.cluster["loopback_gbps"] == 3600 and spec.cluster["nic_bw_gbps"] == 400  # 450 / 50 GB/s
    model = workload_model(spec)
    assert model.total_params == gpt_params(96, 8192, 28672, 32000) == 71_394_410_496
    assert estimate_memory(model).fits
    assert trace_events(spec) <= MAX_TRACE_EVENTS
