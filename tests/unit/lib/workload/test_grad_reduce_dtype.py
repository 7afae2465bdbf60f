"""``train.grad_reduce_dtype`` (issue 39, item 17): the dtype of the data-parallel gradient reductions.

Defaults from the frameworks' source (megatron-core ``DistributedDataParallelConfig.grad_reduce_in_fp32 =
False``: bf16; DeepSpeed ``engine.communication_data_type``: bf16 with bf16 training; torchtitan FSDP2
``reduce_dtype`` = ``mixed_precision_reduce``, "float32" its only choice), what the framework refuses
refused, and the bytes of the gradient collectives against closed forms worked here from the Hugging Face
Llama parameter shapes (not from the generator's or the oracle's code)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
from fixtures.collective_oracle import predict

from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.workload.collectives import run_spec_of, step_collectives
from phantora_assets.lib.workload.spec import parse_workload

BYTES = {"Bf16": 2, "F32": 4}
H, F, HEADS, KV, V, LAYERS = 256, 512, 4, 2, 1024, 2


def _llama_params() -> int:
    """Parameters of the Hugging Face Llama below, by hand: embedding and untied head V x h, per layer
    q and o h x h, k and v h x (kv x h / heads), gate, up, down h x f, two norms h; the final norm h."""
    per_layer = 2 * H * H + 2 * H * (KV * H // HEADS) + 3 * H * F + 2 * H
    return 2 * V * H + LAYERS * per_layer + H


def _deepspeed(zero: int, dtype: str | None, accumulation: int = 1) -> dict:
    train: dict = {"seq_len": 256, "micro_batch": 1, "grad_accumulation": accumulation}
    if dtype is not None:
        train["grad_reduce_dtype"] = dtype
    if zero == 3:
        train["iterations"] = 4
    model = {"kind": "dense", "layers": LAYERS, "hidden": H, "ffn_hidden": F, "heads": HEADS, "kv_heads": KV}
    return {
        "framework": "deepspeed",
        "model": {**model, "vocab": V},
        "parallel": {"dp": 4, "zero": zero},
        "train": train,
    }


def _bytes_by_op(table: dict, gpus: int) -> dict[tuple[str, str], int]:
    """The generator's bytes per rank of one steady step on the dp group, by (op, dtype)."""
    spec = run_spec_of(table, nodes=gpus, gpus_per_node=1, gpu="h100")
    out: Counter = Counter()
    for c in step_collectives(spec):
        if c.group == "dp" and c.count > 16 and 0 in c.ranks:
            out[(c.op, c.dtype)] += c.count * BYTES[c.dtype]
    return dict(out)


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


def test_the_defaults_are_the_frameworks():
    """Unset: megatron bf16, deepspeed bf16, torchtitan fp32; the table as written is unchanged (the
    shipped runs' fingerprints and records do not move)."""
    base = _deepspeed(1, None)
    assert parse_workload("d", base, "t").train.grad_reduce_dtype == "bf16"
    assert "grad_reduce_dtype" not in parse_workload("d", base, "t").table()["train"]
    mega = {**copy.deepcopy(base), "framework": "megatron", "parallel": {"dp": 4, "zero": 1}}
    assert parse_workload("m", mega, "t").train.grad_reduce_dtype == "bf16"
    titan = {**copy.deepcopy(base), "framework": "torchtitan", "parallel": {"dp": 4, "zero": 3}}
    assert parse_workload("t", titan, "t").train.grad_reduce_dtype == "fp32"


@pytest.mark.parametrize(
    ("framework", "parallel", "dtype", "words"),
    [
        ("torchtitan", {"dp": 4, "zero": 3}, "bf16", "torchtitan reduces gradients in fp32 only"),
        ("torchtitan", {"dp": 4, "zero": 0}, "bf16", "mixed_precision_reduce"),
        ("deepspeed", {"dp": 4, "zero": 1}, "fp16", "grad_reduce_dtype must be one of bf16 | fp32"),
    ],
)
def test_what_the_framework_or_the_model_does_not_take_is_refused(framework, parallel, dtype, words):
    table = {**_deepspeed(1, dtype), "framework": framework, "parallel": parallel}
    with pytest.raises(RunMatrixError, match=r"\[workloads\.w\]\.train: .*") as err:
        parse_workload("w", table, "jobs.toml")
    assert words in str(err.value)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_deepspeed_gradient_bytes_follow_the_dtype_by_closed_form(zero, dtype):
    """DeepSpeed, 4 ranks, 2 micro-batches: ZeRO-0 all-reduces the P gradients once a step; ZeRO-1
    reduces the flat group padded to 2 dp (each rank receives ceil_to(P, 8) / 4) once, ZeRO-2 at every
    backward; ZeRO-3 reduce-scatters every parameter, ceil(numel / 4) each, at every backward. The
    bytes are those elements times the dtype's size; the parameter all-gathers stay bf16."""
    size = {"bf16": 2, "fp32": 4}[dtype]
    tag = {"bf16": "Bf16", "fp32": "F32"}[dtype]
    P, dp, nmb = _llama_params(), 4, 2
    got = _bytes_by_op(_deepspeed(zero, dtype, nmb), dp)
    if zero == 0:
        want = {("all_reduce", tag): size * P, ("all_gather", "Bf16"): 2 * _ceil_to(P, 2 * dp) // dp}
    elif zero in (1, 2):
        times = nmb if zero == 2 else 1
        shard = _ceil_to(P, 2 * dp) // dp
        want = {("reduce_scatter", tag): times * size * shard, ("all_gather", "Bf16"): 2 * shard}
    else:
        per_layer = [H * H, H * KV * H // HEADS, H * KV * H // HEADS, H * H, H * F, H * F, H * F, H, H]
        shapes = [V * H] + per_layer * LAYERS + [H, V * H]
        assert sum(shapes) == P
        shards = sum(-(-k // dp) for k in shapes)
        gathered = sum(-(-k // dp) for k in shapes if k > 100_000)  # stage3_param_persistence_threshold
        want = {("reduce_scatter", tag): nmb * size * shards, ("all_gather", "Bf16"): nmb * 2 * gathered}
    assert got == want
    # the oracle covers the key: its payload on the dp group is the same closed form
    pred = predict(_deepspeed(zero, dtype, nmb), dp, 1)
    assert pred.payload_bytes(("dp", tuple(range(dp)))) == sum(want.values())


def test_the_oracle_reduces_megatron_gradients_in_the_stated_dtype():
    """Megatron-core with grad_reduce_in_fp32 (the oracle's side): the same reduce-scatter elements as
    bf16, each 4 bytes; the parameter all-gathers stay bf16."""
    model = {"kind": "dense", "layers": LAYERS, "hidden": H, "ffn_hidden": F, "heads": HEADS, "kv_heads": KV}
    table = {
        "framework": "megatron",
        "model": {**model, "vocab": V},
        "parallel": {"dp": 4, "zero": 1},
        "train": {"seq_len": 256, "grad_accumulation": 1},
    }
    group = ("dp", (0, 1, 2, 3))
    bf16 = predict(table, 4, 1).multiset(group)
    fp32 = predict({**table, "train": {**table["train"], "grad_reduce_dtype": "fp32"}}, 4, 1).multiset(group)
    assert {c.op for c in bf16} == {"reduce_scatter", "all_gather"}
    assert {(c.op, c.dtype) for c in fp32} == {("reduce_scatter", "fp32"), ("all_gather", "bf16")}
    assert sorted(c.count for c in bf16 if c.op == "reduce_scatter") == sorted(
        c.count for c in fp32 if c.op == "reduce_scatter"
    )
    # Megatron's padded buffer: P elements (embedding and head padded to 128, here already) in one
    # bucket padded to lcm(4, 128) = 128, each rank receiving a quarter
    P = _llama_params()
    assert sum(c.count * k for c, k in fp32.items() if c.op == "reduce_scatter") == _ceil_to(P, 128) // 4


def _megatron(dtype: str, zero: int = 1) -> dict:
    model = {"kind": "dense", "layers": LAYERS, "hidden": H, "ffn_hidden": F, "heads": HEADS, "kv_heads": KV}
    train = {"seq_len": 256, "grad_accumulation": 1, "grad_reduce_dtype": dtype}
    return {
        "framework": "megatron",
        "model": {**model, "vocab": V},
        "parallel": {"dp": 4, "zero": zero},
        "train": train,
    }


@pytest.mark.parametrize("zero", [0, 1])
def test_megatron_fp32_gradient_reduction_bytes_by_closed_form(zero):
    """Megatron-core, grad_reduce_in_fp32 (was refused): the gradient buffer is fp32
    (param_and_grad_buffer.py ``torch.float if grad_reduce_in_fp32 else param.dtype``), so the
    distributed optimizer reduce-scatters ceil_to(P, lcm(dp, 128)) / dp elements of 4 bytes to each rank
    and all-gathers the bf16 parameters (2 bytes); DDP (zero 0) all-reduces the padded buffer in fp32."""
    P, dp = _llama_params(), 4
    padded = _ceil_to(P, 128)
    got = _bytes_by_op(_megatron("fp32", zero), dp)
    if zero == 1:
        assert got == {("reduce_scatter", "F32"): 4 * padded // dp, ("all_gather", "Bf16"): 2 * padded // dp}
    else:
        assert got == {("all_reduce", "F32"): 4 * padded}
    assert predict(_megatron("fp32", zero), dp, 1).payload_bytes(("dp", tuple(range(dp)))) == sum(got.values())


def test_megatron_fp32_gradient_buffer_is_in_the_memory_estimate():
    """The fp32 buffer is 4 bytes a parameter on every rank (2 for bf16); weights and the sharded fp32
    optimizer state (the main grads are views into the fp32 buffer: distrib_optimizer.py
    ``shard_model_grad.float()`` returns the buffer itself) do not change."""
    from phantora_assets.lib.sim.memory import estimate_memory
    from phantora_assets.lib.sim.workloads import workload_model

    P = _llama_params()
    est = {d: estimate_memory(workload_model(run_spec_of(_megatron(d), 4, 1, "h100"))) for d in ("bf16", "fp32")}
    assert est["bf16"].gradients_bytes == 2 * P
    assert est["fp32"].gradients_bytes == 4 * P
    assert est["fp32"].optimizer_bytes == est["bf16"].optimizer_bytes
    assert est["fp32"].weights_bytes == est["bf16"].weights_bytes


def test_megatron_fp32_gradient_buffer_compute():
    """The DDP backward hook ``main_grad.add_(grad)`` reads the bf16 gradient (2 bytes) and the fp32
    buffer (4) and writes the buffer (4): 10 bytes an element, where bf16 into bf16 moves 4 (Phantora's
    estimator draws same-sized same-dtype tensors from one cache: read 2 once, write 2); the 1/dp scaling of a
    bucket reads and writes fp32; the optimizer's ``.float()`` of an fp32 main grad is no kernel."""
    from phantora_assets.lib.sim.torch_ops import torch_ops
    from phantora_assets.lib.sim.workloads import workload_model

    ops = {d: torch_ops(workload_model(run_spec_of(_megatron(d), 4, 1, "h100"))) for d in ("bf16", "fp32")}
    adds = {d: [k for k in o.megatron_mlp("bwd") if k.op == "Add_"] for d, o in ops.items()}
    n = [H * F, 2 * F * H]  # fc2 [h, f], fc1 [2f, h] (SwiGLU)
    assert [k.bytes for k in adds["bf16"]] == [4 * x for x in n]
    assert [k.bytes for k in adds["fp32"]] == [10 * x for x in n]
    assert [k.bytes for k in ops["fp32"].megatron_grad_scale(1024)] == [8 * 1024 + 8]
    groups = [(True, [100, 200]), (False, [50])]
    assert [k.op for k in ops["bf16"].megatron_optimizer(groups, False)][:3] == ["ConvDType"] * 3
    assert "ConvDType" not in [k.op for k in ops["fp32"].megatron_optimizer(groups, False)]
