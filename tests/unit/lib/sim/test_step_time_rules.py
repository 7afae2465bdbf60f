"""Rules of the simulated step time that follow from how the frameworks batch (issue 26, item 5).

Found while comparing full-depth published runs (docs/BENCHMARKS.md "Fidelity: full-depth jobs").
"""

from __future__ import annotations

import importlib

import pytest
from fixtures.paths import ROOT


def _api():
    for name in ("phantora_assets.lib.workload.collectives", "phantora_assets.lib.sim.collectives"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("issue 26 workload schema not landed yet")


def _step_ms(framework: str, micro_batch: int, accumulation: int) -> float:
    from phantora_assets.lib.sim.analytic import AnalyticSimulator

    table = {
        "framework": framework,
        "model": {"kind": "dense", "layers": 2, "hidden": 1024, "ffn_hidden": 2816, "heads": 8, "kv_heads": 8},
        # torchtitan: FSDP needs dp_shard > 1 (one GPU is no FSDP: the schema refuses it)
        "parallel": {"dp": 1, "zero": 1} if framework == "megatron" else {"dp": 2, "zero": 3},
        "train": {"seq_len": 4096, "micro_batch": micro_batch, "grad_accumulation": accumulation},
    }
    table["model"]["vocab"] = 32000
    gpus = table["parallel"]["dp"]
    spec = _api().run_spec_of(table, nodes=1, gpus_per_node=gpus, gpu="h100", name="batching")
    return AnalyticSimulator(spec, emit=False).run().step_ns / 1e6


@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
def test_micro_batch_of_two_costs_two_micro_batches_of_one(framework):
    # rule time.attention_per_sequence: core attention is b x [s, s] (Megatron DotProductAttention,
    # torch SDPA, flash attention), so a micro-batch of 2 sequences does the work of 2 micro-batches
    # of 1 and, at the same tokens per step, takes about the same time (larger GEMMs only help).
    # (Kernel lists with s x b as the attention length, as gen26's branch had before 4b20ce8, made
    # it 1.58 x for megatron and 1.48 x for torchtitan at s = 4096.)
    _api()
    one, two = _step_ms(framework, 1, 2), _step_ms(framework, 2, 1)
    assert two <= 1.1 * one, f"micro-batch 2: {two:.1f} ms, 2 x micro-batch 1: {one:.1f} ms"


def _tp_table(overlap: bool | None, sp: bool = True) -> dict:
    par: dict = {"tp": 4, "dp": 1, "zero": 1, "sequence_parallel": sp}
    if overlap is not None:
        par["tp_comm_overlap"] = overlap
    model = {"kind": "dense", "layers": 2, "hidden": 4096, "ffn_hidden": 11008, "heads": 32, "kv_heads": 32}
    return {
        "framework": "megatron",
        "model": model | {"vocab": 32000},
        "parallel": par,
        "train": {"seq_len": 4096, "micro_batch": 1, "grad_accumulation": 2},
    }


def test_tp_comm_overlap_hides_sequence_parallel_collectives_and_keeps_their_bytes():
    # rule time.tp_comm_overlap: Megatron's --tp-comm-overlap (Transformer Engine userbuffers)
    # runs a TP all-gather / reduce-scatter beside the compute after it; the calls and bytes stay.
    from phantora_assets.lib.sim.analytic import AnalyticSimulator

    api = _api()
    specs = {o: api.run_spec_of(_tp_table(o), nodes=1, gpus_per_node=4, gpu="h100", name="ov") for o in (False, True)}
    calls = {o: [(c.group, c.op, c.nbytes) for c in api.step_collectives(s)] for o, s in specs.items()}
    assert calls[True] == calls[False] and any(c[0] == "tp" for c in calls[True])
    res = {o: AnalyticSimulator(s, emit=False).run() for o, s in specs.items()}
    sync, over = res[False].step_ns, res[True].step_ns
    assert over < 0.97 * sync, f"overlapped {over / 1e6:.2f} ms, synchronous {sync / 1e6:.2f} ms"
    # the default is the synchronous program (the shipped W1-W5 keep their step times)
    default = api.run_spec_of(_tp_table(None), nodes=1, gpus_per_node=4, gpu="h100", name="ov")
    assert AnalyticSimulator(default, emit=False).run().step_ns == sync


def test_tp_comm_overlap_needs_megatron_sequence_parallelism():
    from phantora_assets.lib.errors import RunMatrixError

    with pytest.raises(RunMatrixError, match="tp_comm_overlap .* sequence_parallel = true"):
        _api().run_spec_of(_tp_table(True, sp=False), nodes=1, gpus_per_node=4, gpu="h100", name="ov")


def test_fused_attention_is_per_sequence():
    # rule time.attention_per_sequence for fused attention: b sequences of s tokens cost b x one
    # sequence (attention stays inside a sequence), not one sequence of b x s tokens (b^2 x).
    from phantora_assets.lib.sim.kernels import flash_attention

    for phase in ("fwd", "bwd"):
        one, sixteen = flash_attention(8192, 8192, 8, 1, 128, phase), flash_attention(8192, 8192, 8, 1, 128, phase, 16)
        assert sixteen.flops == 16 * one.flops and sixteen.bytes == 16 * one.bytes
        assert sixteen.key != one.key and one.key == flash_attention(8192, 8192, 8, 1, 128, phase, 1).key


def test_compile_fuses_element_wise_runs_only():
    # rule time.compile: torch.compile (torchtitan compile.enable) fuses each run of consecutive
    # element-wise kernels into one (largest member's traffic, one launch floor); GEMMs stay.
    from phantora_assets.lib.sim.kernels import T, ew, fuse_pointwise, linear

    x, w = T("bf16", 1, 4096, 4096), T("bf16", 4096, 4096)
    ks = [ew("Pow", [x, 2]), ew("Mean", [x]), ew("Mul", [x, x]), linear(x, w), ew("Add", [x, x])]
    fused = fuse_pointwise(ks)
    assert [k.op for k in fused] == ["FusedPointwise", "Linear", "Add"]
    assert fused[0].bytes == max(k.bytes for k in ks[:3]) and fused[1:] == ks[3:]


def test_torchtitan_selective_ac_memory_is_below_the_published_peaks():
    # torchtitan's H100 Table 1 / 3 (Llama 3.1 8B, local batch 2, seq 8192, selective op AC):
    # published peak memory 82.4 GiB (FSDP 8) and 67.0 GiB (FSDP 128) on 96 GB cards. The estimate
    # (per-op SAC rule of lib/sim/memory.py) fits and sits within 12 GiB below each (the published
    # peak also holds NCCL buffers and allocator fragmentation, not estimated).
    import csv
    import sys

    from phantora_assets.lib.sim.memory import estimate_memory
    from phantora_assets.lib.sim.workloads import WorkloadModel

    root = ROOT
    sys.path.insert(0, str(root / "benchmarks"))
    fidelity = importlib.import_module("fidelity")
    rows = {r["run_id"]: r for r in csv.DictReader((root / "benchmarks" / "published_throughput.csv").open())}
    for run_id, published_gib in (("tt_llama3_8b_fsdp8_h100", 82.4), ("tt_llama3_8b_fsdp128_h100", 67.0)):
        est = estimate_memory(WorkloadModel(fidelity.published_run_spec(_api().run_spec_of, rows[run_id])))
        got = est.as_dict()
        assert got["fits"] and published_gib - 12 <= got["peak_gib"] <= published_gib, (run_id, got)


def _tt_spec(uncaptured: bool, gpu: str = "h100", framework: str = "torchtitan"):
    table = {
        "framework": framework,
        "model": {"kind": "dense", "layers": 2, "hidden": 1024, "ffn_hidden": 2816, "heads": 8, "kv_heads": 8},
        "parallel": {"dp": 2, "zero": 3 if framework == "torchtitan" else 1},
        "train": {"seq_len": 2048, "micro_batch": 1, "grad_accumulation": 1, "uncaptured_kernels": uncaptured},
    }
    table["model"]["vocab"] = 32000
    return _api().run_spec_of(table, nodes=1, gpus_per_node=2, gpu=gpu, name="uncaptured")


def _kernels(spec) -> list:
    from phantora_assets.lib.sim.workload_types import Compute
    from phantora_assets.lib.sim.workloads import workload_model

    return [k for it in workload_model(spec).stage_programs(False)[0] if isinstance(it, Compute) for k in it.kernels]


@pytest.mark.parametrize("framework", ["torchtitan", "megatron"])
def test_uncaptured_kernels_add_only_kernels_phantora_does_not_intercept(framework):
    # rule time.uncaptured_kernels: off (the default, W1-W5) the programs hold Phantora's
    # intercepted calls only; on, the same calls in the same order plus the real GPU's others
    # (norm statistics, activation, loss softmax, embedding, FSDP2 copies, the rest of AdamW),
    # each timed by its traffic (no FLOP), so the step gets longer and no GEMM changes.
    from phantora_assets.lib.sim.analytic import AnalyticSimulator

    _api()
    off, on = _kernels(_tt_spec(False, framework=framework)), _kernels(_tt_spec(True, framework=framework))
    extra = [k for k in on if k not in set(off)]
    assert [k for k in on if k in set(off)] == off
    ops = {k.op for k in extra}
    expected = {"SiLU", "LogSoftmax", "FsdpCopyOut", "ForeachLerp_"} if framework == "torchtitan" else {"LayerNorm"}
    assert expected <= ops, ops
    assert all(k.flops == 0 and k.bytes > 0 for k in extra)
    t_off = AnalyticSimulator(_tt_spec(False, framework=framework), emit=False).run().step_ns
    t_on = AnalyticSimulator(_tt_spec(True, framework=framework), emit=False).run().step_ns
    assert t_on > 1.02 * t_off, (t_on, t_off)


def test_sdpa_attention_runs_at_the_gpus_sdpa_efficiency():
    # rule time.sdpa_efficiency: torch SDPA's flash kernels (torchtitan, HF) run at gpus.toml's
    # sdpa_efficiency (H100: 0.35, FlashAttention-2 per the FA3 paper), Transformer Engine's fused
    # attention (Megatron) and every GEMM at matmul_efficiency; a GPU without the key: the GEMMs'.
    from phantora_assets.lib.run.catalog import gpu_specs
    from phantora_assets.lib.sim.kernels import GpuRoofline, flash_attention

    h100 = GpuRoofline.from_spec(gpu_specs()["h100"])
    te, sdpa = (flash_attention(8192, 8192, 32, 8, 128, "fwd", 2, e) for e in ("", "sdpa"))
    assert te.key == sdpa.key  # the perf-DB key does not name the engine
    gemm_ns = te.flops / (989.0e12 * 0.60) * 1e9
    assert h100.time_ns(te) == pytest.approx(gemm_ns + 4900)
    assert h100.time_ns(sdpa) == pytest.approx(te.flops / (989.0e12 * 0.35) * 1e9 + 4900)
    a100 = GpuRoofline.from_spec(gpu_specs()["a100_80g"])
    assert a100.time_ns(sdpa) == a100.time_ns(te)
    tt = [k for k in _kernels(_tt_spec(False)) if k.op.startswith("FlashAttention")]
    mg = [k for k in _kernels(_tt_spec(False, framework="megatron")) if k.op.startswith("FlashAttention")]
    assert tt and {k.engine for k in tt} == {"sdpa"}
    assert mg and {k.engine for k in mg} == {""}


def _w4_programs(run_id: str = "phantora_l40s_W4_2x1"):
    from phantora_assets.lib.sim.workloads import WorkloadModel
    from phantora_assets.matrix import load_run_matrix

    spec = {s.run_id: s for s in load_run_matrix()}[run_id]
    model = WorkloadModel(spec)
    return spec, model, model.stage_programs(False)[0], model.stage_programs(True)[0]


def test_deepspeed_bf16_zero0_accumulates_into_kept_bf16_grads():
    # rule deepspeed.bf16_accumulate_grad: DeepSpeed's BF16_Optimizer zeroes the bf16 .grad tensors and keeps
    # them (clear_lp_grads(set_to_none=False); engine._take_model_step skips zero_grad for bf16 without ZeRO),
    # so every backward after the first adds each parameter's new gradient into its .grad in place (autograd
    # AccumulateGrad: variable_grad += new_grad), an Add_ of two bf16 tensors of the parameter's shape. The
    # shipped W4 (Llama-3-8B, 4 layers) has 2 x 4 x 9 + 3 = 39 parameters; the perf DB Phantora recorded holds
    # Add_ of two bf16 [128256, 4096] (the untied embedding and LM head: no other shipped model has that
    # bf16 shape). Before the rule the step had no such Add_ (W4 on L40S 213.6 ms against the published 234.9).
    import csv
    import json

    from phantora_assets.lib.sim.workload_types import Compute

    spec, model, steady, warm = _w4_programs()

    def adds(program):
        out = []
        for item in program:
            if isinstance(item, Compute):
                out += [k.key for k in item.kernels if k.key.startswith('{"Add_":{"R":[2,[["bf16"')]
        return out

    got = adds(steady)
    assert len(got) == 4 * 9 + 3  # per layer 2 norms + q k v o + gate up down; final norm, embedding, LM head
    vocab = '{"Add_":{"R":[2,[["bf16",[128256,4096]]]]}}'
    assert got.count(vocab) == 2
    assert adds(warm) == []  # the first backward of the run steals the gradients: nothing to add to
    # every key is one Phantora recorded on the L40S: the added time is the perf DB's, summed from the CSV
    with (ROOT / "perfdb" / "l40s" / "compute.csv").open(newline="") as fh:
        db = {r["key"]: int(r["nanos"]) for r in csv.DictReader(fh)}
    assert all(k in db for k in got), [k for k in got if k not in db]
    shapes = [[128256, 4096]] * 2 + [[4096]] * 9 + [[4096, 4096]] * 8 + [[1024, 4096]] * 8
    shapes += [[14336, 4096]] * 8 + [[4096, 14336]] * 4
    want = sum(db[json.dumps({"Add_": {"R": [2, [["bf16", s]]]}}, separators=(",", ":"))] for s in shapes)
    assert sorted(got) == sorted(json.dumps({"Add_": {"R": [2, [["bf16", s]]]}}, separators=(",", ":")) for s in shapes)
    assert 10.0e6 < want < 12.0e6  # about 10.8 ms of the L40S's step


def test_deepspeed_zero12_sets_grads_to_none_no_accumulation():
    # ZeRO-1/2 (stage_1_and_2.py) free each gradient after reducing it: no Add_ into kept bf16 grads
    from phantora_assets.lib.sim.workloads import WorkloadModel

    table = {
        "framework": "deepspeed",
        "model": {"kind": "dense", "layers": 2, "hidden": 1024, "ffn_hidden": 2816, "heads": 8, "kv_heads": 8},
        "parallel": {"dp": 2, "zero": 2},
        "train": {"seq_len": 1024, "micro_batch": 1, "grad_accumulation": 1},
    }
    table["model"]["vocab"] = 32000
    spec = _api().run_spec_of(table, nodes=1, gpus_per_node=2, gpu="l40s", name="zero2")
    keys = [k.key for item in WorkloadModel(spec).stage_programs(False)[0] for k in getattr(item, "kernels", ())]
    assert '{"Add_":{"R":[2,[["bf16",[32000,1024]]]]}}' not in keys
