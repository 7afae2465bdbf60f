"""Peak GPU memory estimate per rank: weights, gradients, optimizer state, activations.

Bytes per parameter (bf16 training with Adam):
    Megatron, distributed optimizer: bf16 weight 2 + grad buffer 2 (bf16; 4 with
        ``train.grad_reduce_dtype = "fp32"``, grad_reduce_in_fp32) on the rank; fp32
        master + Adam m + v = 12, sharded over the parameter's DP group (dense: dp, experts:
        world / ep).
    DeepSpeed bf16 optimizer (ZeRO-0): bf16 weight 2 + bf16 grad 2 + fp32 grad accumulator 4
        on every rank; fp32 master + m + v = 12 sharded over dp.
    DeepSpeed ZeRO-3: bf16 weight partition 2 + fp32 master 4 + m 4 + v 4 + fp32 grad
        partition 4 = 18 per parameter, divided by dp; plus the gathered working set (the
        two largest modules in bf16, one in use and one prefetched or kept by reuse distance).
    Megatron without the distributed optimizer (zero = 0): the 12 bytes on every rank.
    DeepSpeed ZeRO-1: as ZeRO-0; ZeRO-2: the fp32 gradient accumulator sharded over dp too.
    TorchTitan FSDP2 (zero 2/3): fp32 sharded parameters 4 + gradients 4 + Adam m, v 8 = 16 per
        parameter / the FSDP mesh (dp_shard x cp), plus two bf16 units gathered (the largest);
        DDP (zero 0): the 16 bytes on every rank.
    Parameters are those of the rank's pipeline stage; the estimate is the largest stage's.
Activations per layer (bytes; s = seq / cp tokens of one sample on the rank, b = micro_batch samples,
tensor parallel t; after Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.1 and eq. 1: s*b*h*(34 + 5*a*s/h) for a GeLU MLP of width 4h,
generalised to an MLP of width f):
s*b*h*(10/t_sp + 8/t) + 5*a*s^2*cp*b/t + k_mlp*s*b*f_eff/t -- every term is linear in b (the
attention scores are [b, a/t, s, s*cp]: s^2 per sample, never (s*b)^2), t_sp = t with sequence
parallelism (torchtitan's TP always) else 1. The paper's terms: 10 sbh not split by TP (the two
LayerNorm inputs 4, the QKV input 2, the attention's output dropout mask 1, the MLP input 2, the
MLP's dropout mask 1); 8 sbh split by TP in attention (Q and K 4, V 2, the output projection's
input 2); and its MLP's 16 sbh split by TP, which are the GeLU's input [s, b, 4h] (8) and the
second linear's input [s, b, 4h] (8): 4*s*b*f for a GeLU MLP of width f (k_mlp = 4). A SwiGLU
MLP keeps its first linear's output [s, b, 2f] (the fused swiglu's input, 4) and the product
[s, b, f] (the second linear's input, 2): k_mlp = 6 (was 6 on top of the GeLU's 16 sbh in
"24/t", and 6 for GeLU too: the MLP counted twice). f_eff the MLP
width seen per token (ffn; (topk + shared) * moe_ffn for a Megatron MoE layer; experts*ffn plus the
repeated input for Hugging Face gpt-oss (any ZeRO stage), which runs every expert on every token). Recompute
``selective`` drops the attention-score term, ``full`` keeps only the layer input (2*s*h/t_sp).
Fused attention (``train.attention = "flash"``) has no attention-score term either (it keeps the
output and the fp32 log-sum-exp, not the [s, s] scores; the output is in the 8/t part).
TorchTitan's ``selective`` is its per-op SAC policy (``activation_checkpoint.mode = "selective"``,
``selective_ac_option = "op"``: the layer is checkpointed and only the ops of ``_save_list`` keep
their outputs, every second matmul among them): the layer input 2sh, the attention output 2sh
and the saved matmul outputs wq 2sh, wv 2sh*kv/heads, w1 2sf, w2 2sh, i.e.
(s*h*(8 + 2*kv/heads) + 2*s*f)/t bytes (no dropout, no norm or SwiGLU intermediates: recomputed).
A stage keeps the activations of the micro-batches its schedule has in flight
(:func:`~phantora_assets.lib.workload.pipeline.in_flight`: 1F1B pp - stage, GPipe all, one without
pipelining). Logits on the last stage: s*V/t*10 (bf16 logits, fp32 copy and fp32 gradient). A 5 %
allocator overhead is added.

The verdict compares the estimate with the simulated card memory (``memory_gb`` GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from phantora_assets.lib.sim.workload_layout import WorkloadLayout
from phantora_assets.lib.sim.workload_types import ZERO3_PERSISTENCE_THRESHOLD
from phantora_assets.lib.workload.pipeline import in_flight

GIB = 1 << 30
ALLOCATOR_OVERHEAD = 1.05


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak bytes per GPU by component, and the verdict against the card."""

    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    working_set_bytes: int
    card_bytes: int

    @property
    def peak_bytes(self) -> int:
        raw = (
            self.weights_bytes
            + self.gradients_bytes
            + self.optimizer_bytes
            + self.activations_bytes
            + self.working_set_bytes
        )
        return int(raw * ALLOCATOR_OVERHEAD)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.card_bytes

    def as_dict(self) -> dict[str, float]:
        """Components in GiB (rounded to 0.01), peak, card and the verdict."""
        g = lambda b: round(b / GIB, 2)
        return {
            "weights_gib": g(self.weights_bytes),
            "gradients_gib": g(self.gradients_bytes),
            "optimizer_gib": g(self.optimizer_bytes),
            "activations_gib": g(self.activations_bytes),
            "working_set_gib": g(self.working_set_bytes),
            "peak_gib": g(self.peak_bytes),
            "card_gib": g(self.card_bytes),
            "fits": self.fits,
        }


def _per_layer(model: WorkloadLayout, i: int) -> float:
    """Activation bytes one micro-batch leaves for layer ``i``'s backward (module docstring)."""
    spec, par, m = model.spec, model.spec.par, model.spec.wl.model
    s, h, t = model.seq * model.mbs, model.hidden, spec.tp  # s: tokens of a micro-batch on the rank
    sp = par.sequence_parallel or (spec.framework == "torchtitan" and t > 1)
    recompute = spec.wl.train.recompute
    if recompute == "full":  # only the layer's input is kept
        return 2 * s * h / (t if sp else 1)
    if recompute == "selective" and spec.framework == "torchtitan":  # per-op SAC (module docstring)
        return (s * h * (8 + 2 * model.kv_heads / model.heads) + 2 * s * m.ffn_hidden) / t
    input_repeat = 0.0
    if spec.framework == "megatron":
        f_eff = (m.topk + m.shared_experts) * model.ffn if m.is_moe_layer(i) else m.ffn_hidden
    elif m.arch == "gpt_oss":  # Hugging Face gpt-oss (any ZeRO stage): every expert on every token
        f_eff = model.experts * model.ffn
        input_repeat = model.experts * s * h * 2 * 2
    else:
        f_eff = m.ffn_hidden
    flash = spec.wl.train.attention == "flash"  # fused attention keeps O and the log-sum-exp, no [s, s]
    # [mbs, heads / t, seq / cp, seq] scores per sample: quadratic in the sequence, linear in the
    # micro-batch (Korthikanti et al. 2022, eq. 1: 5*a*s^2*b; was 5*a*(s*b)^2, issue 39 item 9)
    attn_scores = (
        0.0 if recompute == "selective" or flash else 5 * model.heads * model.seq * model.seq * par.cp * model.mbs / t
    )
    # the MLP's TP-split activations (module docstring): GeLU keeps its input and output [s, f]
    # (Korthikanti et al. 2022 section 4.1, 16 sbh at f = 4h); SwiGLU its [s, 2f] input and [s, f] output
    k_mlp = 4 if m.mlp == "gelu" else 6
    return s * h * (10 / (t if sp else 1) + 8 / t) + attn_scores + k_mlp * s * f_eff / t + input_repeat


def estimate_memory(model: WorkloadLayout) -> MemoryEstimate:
    """Estimate the peak memory of one rank of ``model``'s run (see module docstring): the
    largest over its pipeline stages."""
    return max((estimate_stage_memory(model, st) for st in range(model.spec.par.pp)), key=lambda e: e.peak_bytes)


def estimate_stage_memory(model: WorkloadLayout, stage: int) -> MemoryEstimate:
    """The peak memory of one rank of pipeline stage ``stage`` (module docstring)."""
    spec, par = model.spec, model.spec.par
    s = model.seq * model.mbs
    t = spec.tp
    dense = sum(n for _, n in model.dense_params_local(stage))
    experts = model.expert_params_per_rank(stage)
    card = int(spec.gpu_spec["memory_gb"] * GIB)
    working = 0
    if spec.framework == "megatron":
        weights: float = 2 * (dense + experts)  # int here, float (per-dp share) in the ZeRO branches
        # the gradient buffer: bf16, or fp32 with grad_reduce_in_fp32 (train.grad_reduce_dtype; megatron-core
        # param_and_grad_buffer.py ``grad_dtype = torch.float if grad_reduce_in_fp32 else param.dtype``); the
        # distributed optimizer's fp32 main grads are then views into it (``shard_model_grad.float()``)
        grads: float = (4 if spec.wl.train.grad_reduce_dtype == "fp32" else 2) * (dense + experts)
        if par.zero >= 1:  # distributed optimizer: fp32 master + m + v sharded over the grad-sync group
            optim = 12 * (dense / model.grad_sync_size() + experts / par.edp)
        else:
            optim = 12 * (dense + experts)
    elif spec.framework == "torchtitan":
        local = dense
        n = len(model.comms["dp"][0].ranks)
        if par.zero >= 2:  # FSDP2: fp32 sharded parameters, gradients, Adam m and v; two bf16 units gathered
            weights, grads, optim = 4 * local / n, 4 * local / n, 8 * local / n
            units: dict[str, int] = {}
            for p in model.stage_params(stage):
                u = ".".join(p.module.split(".")[:2]) if p.module.startswith("layers.") else "root"
                units[u] = units.get(u, 0) + model.local_numel(p)
            working = 2 * sum(sorted(units.values(), reverse=True)[:2])
        else:  # DDP: fp32 parameters, gradients, m and v on every rank
            weights, grads, optim = 4 * local, 4 * local, 8 * local
    elif spec.zero_stage == 3:
        total = model.total_params
        weights = 2 * total / spec.dp
        grads = 4 * total / spec.dp
        optim = 12 * total / spec.dp
        mods: dict[str, int] = {}
        for p in model.params:
            if p.numel > ZERO3_PERSISTENCE_THRESHOLD:
                mods[p.module] = mods.get(p.module, 0) + p.numel
        largest = sorted(mods.values(), reverse=True)[:2]
        working = 2 * sum(largest)
    else:
        total = model.total_params
        weights = 2 * total
        grads = (2 + 4) * total if spec.zero_stage < 2 else 2 * total + 4 * total / spec.dp
        optim = 12 * total / spec.dp
    vs = par.virtual_stages
    chunks = in_flight(par.pp_schedule, par.pp, stage, par.micro_batches, vs) if par.pp > 1 else 1
    layers = [i for v in range(vs) for i in model.chunk_layers(stage, v)]
    per_chunk = sum(_per_layer(model, i) for i in layers) / vs
    logits = s * model.vocab / t * 10 if stage == par.pp - 1 else 0
    activations = chunks * per_chunk + logits
    return MemoryEstimate(int(weights), int(grads), int(optim), int(activations), int(working), card)
