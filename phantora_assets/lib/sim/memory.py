"""Peak GPU memory estimate per rank: weights, gradients, optimizer state, activations.

Bytes per parameter (bf16 training with Adam):
    Megatron, distributed optimizer: bf16 weight 2 + bf16 grad buffer 2 on the rank; fp32
        master + Adam m + v = 12, sharded over the parameter's DP group (dense: dp, experts:
        world / ep).
    DeepSpeed bf16 optimizer (ZeRO-0): bf16 weight 2 + bf16 grad 2 + fp32 grad accumulator 4
        on every rank; fp32 master + m + v = 12 sharded over dp.
    DeepSpeed ZeRO-3: bf16 weight partition 2 + fp32 master 4 + m 4 + v 4 + fp32 grad
        partition 4 = 18 per parameter, divided by dp; plus the gathered working set (the
        two largest modules in bf16, one in use and one prefetched or kept by reuse distance).
Activations per layer (bytes, s tokens, no recomputation, tensor parallel t, after Korthikanti
et al. 2022 generalised to SwiGLU/MoE): s*h*(10 + 24/t) + 5*a*s^2/t + 6*s*f_eff/t, with f_eff
the MLP width seen per token (ffn; topk*ffn for Megatron MoE; experts*ffn plus the repeated
input for Hugging Face gpt-oss, which runs every expert on every token). Logits: s*V/t*10
(bf16 logits, fp32 copy and fp32 gradient). A 5 % allocator overhead is added.

The verdict compares the estimate with the simulated card memory (``memory_gb`` GiB).
"""

from __future__ import annotations

from dataclasses import dataclass

from phantora_assets.lib.sim.workload_layout import WorkloadLayout
from phantora_assets.lib.sim.workload_types import ZERO3_PERSISTENCE_THRESHOLD

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


def estimate_memory(model: WorkloadLayout) -> MemoryEstimate:
    """Estimate the peak memory of one rank of ``model``'s run (see module docstring)."""
    spec = model.spec
    s, h, f, t = model.seq * model.mbs, model.hidden, model.ffn, spec.tp
    dense = sum(n for _, n in model.dense_params_local())
    experts = model.expert_params_per_rank()
    card = int(spec.gpu_spec["memory_gb"] * GIB)
    working = 0
    if spec.framework == "megatron":
        weights: float = 2 * (dense + experts)  # int here, float (per-dp share) in the ZeRO branches
        grads: float = 2 * (dense + experts)
        expert_dp = max(1, spec.world_size // spec.ep)
        optim = 12 * (dense / spec.dp + experts / expert_dp)
        f_eff = model.topk * f if model.experts else f
        input_repeat = 0
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
        f_eff = model.experts * f if model.experts else f
        input_repeat = model.experts * s * h * 2 * 2 if model.experts else 0
    else:
        total = model.total_params
        weights = 2 * total
        grads = (2 + 4) * total
        optim = 12 * total / spec.dp
        f_eff = f
        input_repeat = 0
    per_layer = s * h * (10 + 24 / t) + 5 * model.heads * s * s / t + 6 * s * f_eff / t + input_repeat
    logits = s * model.vocab / t * 10
    activations = model.layers * per_layer + logits
    return MemoryEstimate(int(weights), int(grads), int(optim), int(activations), int(working), card)
