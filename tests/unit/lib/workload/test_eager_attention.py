"""The eager attention kernels are per sample: [mbs, heads, seq, seq] scores, linear in the micro-batch.

Closed forms written here from the frameworks' shapes, not from the generator: Megatron-core's
``DotProductAttention`` (``megatron/core/transformer/dot_product_attention.py``: the scores are
``baddbmm`` over [b * np, sq, hn] x [b * np, hn, sk], viewed as [b, np, sq, sk]) and Hugging Face's
``eager_attention_forward`` (``torch.matmul(query [b, nh, s, d], key^T [b, nkv->nh, d, s])``): the
score GEMMs are 2 b np s^2 d FLOP each and the fp32 softmax reads and writes 4 b np s^2 bytes
each way. Before the fix the kernels took s = seq x micro-batch as one sequence, so micro-batch 4
cost 16x the score FLOP and bytes of micro-batch 1, not 4x (the memory estimate had the same
error, fixed in 8b207f0; Korthikanti et al. 2022 eq. 1: 5 a s^2 b).
"""

from __future__ import annotations

import copy

import pytest

from phantora_assets.lib.run.catalog import presets
from phantora_assets.lib.sim.torch_ops import torch_ops
from phantora_assets.lib.sim.workloads import workload_model
from phantora_assets.lib.workload.collectives import run_spec_of

SEQ = 256


def _ops(workload: str, mbs: int):
    table = copy.deepcopy(presets()["workloads"][workload])
    table["train"].update(seq_len=SEQ, micro_batch=mbs, grad_accumulation=1)
    table["model"]["layers"] = 2
    return torch_ops(workload_model(run_spec_of(table, nodes=1, gpus_per_node=4, gpu="h100", name="att")))


@pytest.mark.parametrize("mbs", [1, 4])
def test_megatron_eager_scores_are_per_sample(mbs: int) -> None:
    """W1 (Llama3-8B, tp 2, Megatron local spec): baddbmm and the scores x V bmm are 2 b np s^2 d
    FLOP each; the fp32 softmax reads and writes b np s^2 fp32 elements."""
    ops = _ops("W1", mbs)
    np_, d = 32 // 2, 4096 // 32
    fwd = ops.megatron_attention("fwd")
    score = [k for k in fwd if k.op == "BAddBMM"]
    assert [k.flops for k in score] == [2 * mbs * np_ * SEQ * SEQ * d]
    (softmax,) = [k for k in fwd if k.op == "Softmax"]
    assert softmax.bytes == 2 * 4 * mbs * np_ * SEQ * SEQ
    # the whole block: projections per token (b*s rows) plus the two score GEMMs per sample
    h, qkv, proj = 4096, (32 + 2 * 8) * d // 2, 32 * d // 2
    expected = 2 * mbs * SEQ * h * qkv + 2 * mbs * SEQ * proj * h + 2 * (2 * mbs * np_ * SEQ * SEQ * d)
    assert sum(k.flops for k in fwd) == expected
    # backward: four score-sized GEMMs (dP, dV, dQ, dK), each 2 b np s^2 d
    bwd_sq = [k for k in ops.megatron_attention("bwd") if k.op == "BMM"]
    assert sum(k.flops for k in bwd_sq) == 4 * 2 * mbs * np_ * SEQ * SEQ * d


@pytest.mark.parametrize(("workload", "heads", "head_dim"), [("W4", 32, 128), ("W5", 64, 64)])
def test_hugging_face_eager_scores_are_per_sample(workload: str, heads: int, head_dim: int) -> None:
    """W4 (Hugging Face Llama) and W5 (gpt-oss, with attention sinks): the QK^T and PV matmuls are
    2 b nh s^2 d FLOP each, the same per sample at micro-batch 1 and 4 (4x in total, not 16x)."""
    per_sample = 2 * heads * SEQ * SEQ * head_dim
    for mbs in (1, 4):
        fwd = _ops(workload, mbs).hf_attention("fwd", gpt_oss=workload == "W5")
        sq = [k for k in fwd if k.op == "MatMul"]
        assert [k.flops for k in sq] == [mbs * per_sample] * 2
        (softmax,) = [k for k in fwd if k.op == "Softmax"]
        cols = SEQ + 1 if workload == "W5" else SEQ  # gpt-oss: one sink column; bf16 in, bf16 out
        expected = 2 * 2 * mbs * heads * SEQ * cols if workload == "W5" else (2 + 4) * mbs * heads * SEQ * SEQ
        assert softmax.bytes == expected
