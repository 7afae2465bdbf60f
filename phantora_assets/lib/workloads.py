"""What each workload computes and communicates per training step (the rules of presets.toml).

A :class:`WorkloadModel` turns a workload preset and a layout into

* the model's parameters (name, element count, module, TP-sharded or expert-local),
* the communicators (TP, DP, EP groups over global ranks, host-major placement),
* the per-step program every rank executes in order: :class:`Compute` items and
  :class:`Collective` / :class:`AllToAll` items, for a steady step and for the warm-up step,
* the init program (parameter broadcasts before the first step).

Rules (presets.toml notes, Megatron-core and DeepSpeed defaults):
    Megatron TP: per micro-batch 18 all-reduces of [seq, mbs, hidden] bf16 for 4 layers
        (embedding fwd, 2 fwd + 2 bwd per layer, LM-head bwd), plus 3 fp32 [seq, mbs]
        all-reduces of the vocab-parallel cross entropy.
    Megatron DP with the distributed optimizer: per bucket (>= max(40M, 1M x dp) elements, in
        reverse parameter order, padded to a multiple of lcm(dp, 128)) a bf16 reduce-scatter of
        gradients after backward and a bf16 all-gather of parameters after the optimizer step.
    MoE (alltoall dispatcher, balanced): per MoE layer 4 all-to-alls (dispatch + combine, fwd +
        bwd); each rank sends every peer (seq*mbs*topk // experts) * (experts // ep) tokens of
        hidden bf16 values as grouped NCCL send/recv. Expert parameters are local (no traffic).
    DeepSpeed bf16 ZeRO-0: gradients all-reduced over all ranks in bf16, in buckets of 5e8
        elements; after the step the updated bf16 parameters are all-gathered from their owners
        (flat buffer padded to a multiple of 2 * dp).
    DeepSpeed ZeRO-3: parameters of at most 1e5 elements are persistent; every other parameter
        is all-gathered (bf16, ceil(numel/dp) per rank) before its module runs in forward and in
        backward, unless the elements fetched since its own fetch (inclusive) are within
        stage3_max_reuse_distance = 1e9 (then it stays gathered); gradients are reduce-scattered
        in bf16. The warm-up step has no trace yet, so it re-gathers everything in backward.

No Dagster import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from phantora_assets.runs import RunSpec, presets

MEGATRON_BUCKET_ELEMENTS = 40_000_000
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
ZERO3_PERSISTENCE_THRESHOLD = 100_000
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000


@dataclass(frozen=True)
class Param:
    """One parameter tensor. ``numel`` is the full (unsharded) element count."""

    name: str
    numel: int
    module: str
    tp_sharded: bool = False
    expert: bool = False


@dataclass(frozen=True)
class Communicator:
    """An NCCL communicator: ``ranks`` are global ranks in communicator-rank order."""

    name: str
    kind: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Compute:
    """Work of one rank: ``flops`` (FLOP) and ``mem_bytes`` (bytes moved), ``phase`` fwd/bwd/opt."""

    name: str
    flops: float
    mem_bytes: float
    phase: str
    shapes: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Collective:
    """One NCCL collective issued on every communicator of ``kind`` at the same time."""

    kind: str
    op: Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
    count: int
    dtype: str
    tag: str
    root: int = 0


@dataclass(frozen=True)
class AllToAll:
    """Grouped send/recv on every communicator of ``kind``: each rank sends every peer ``count``."""

    kind: str
    count: int
    dtype: str
    tag: str


Item = Compute | Collective | AllToAll


def _ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass
class WorkloadModel:
    """Parameters, communicators and per-step programs of one run (see module docstring)."""

    spec: RunSpec
    params: list[Param] = field(init=False)
    comms: dict[str, list[Communicator]] = field(init=False)

    def __post_init__(self) -> None:
        p = self.spec.preset
        self.seq = int(presets()["common"]["sequence_length"])
        self.mbs = int(presets()["common"]["micro_batch_size"])
        self.layers = int(presets()["common"]["num_layers"])
        self.hidden = int(p["hidden_size"])
        self.ffn = int(p["ffn_hidden_size"])
        self.heads = int(p["num_attention_heads"])
        self.kv_heads = int(p.get("num_query_groups", p.get("num_key_value_heads", self.heads)))
        self.head_dim = int(p.get("kv_channels", p.get("head_dim", self.hidden // self.heads)))
        self.vocab = int(p["vocab_size"])
        self.experts = int(p.get("num_moe_experts", p.get("num_experts", 0)))
        self.topk = int(p.get("moe_router_topk", p.get("experts_per_token", 0)))
        self.params = self._build_params()
        self.comms = self._build_comms()

    # ------------------------------------------------------------------ parameters
    def _build_params(self) -> list[Param]:
        h, f, L = self.hidden, self.ffn, self.layers
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        out: list[Param] = [Param("embedding.word_embeddings.weight", self.vocab * h, "embedding", True)]
        wl = self.spec.workload
        for i in range(L):
            m = f"layers.{i}"
            if self.spec.framework == "megatron":
                out.append(Param(f"{m}.input_layernorm.weight", h, f"{m}.attn"))
                out.append(Param(f"{m}.self_attention.linear_qkv.weight", h * (q + 2 * kv), f"{m}.attn", True))
                if "qk_layernorm" in self.spec.preset.get("options", []):
                    out.append(Param(f"{m}.self_attention.q_layernorm.weight", self.head_dim, f"{m}.attn"))
                    out.append(Param(f"{m}.self_attention.k_layernorm.weight", self.head_dim, f"{m}.attn"))
                out.append(Param(f"{m}.self_attention.linear_proj.weight", q * h, f"{m}.attn", True))
                out.append(Param(f"{m}.pre_mlp_layernorm.weight", h, f"{m}.mlp"))
                if self.experts:
                    out.append(Param(f"{m}.mlp.router.weight", self.experts * h, f"{m}.mlp"))
                    for e in range(self.experts):
                        out.append(Param(f"{m}.mlp.experts.{e}.linear_fc1.weight", h * 2 * f, f"{m}.mlp", expert=True))
                        out.append(Param(f"{m}.mlp.experts.{e}.linear_fc2.weight", f * h, f"{m}.mlp", expert=True))
                else:
                    out.append(Param(f"{m}.mlp.linear_fc1.weight", h * 2 * f, f"{m}.mlp", True))
                    out.append(Param(f"{m}.mlp.linear_fc2.weight", f * h, f"{m}.mlp", True))
            elif wl == "W5":  # Hugging Face gpt-oss
                out += [
                    Param(f"{m}.input_layernorm.weight", h, f"{m}.input_layernorm"),
                    Param(f"{m}.self_attn.q_proj.weight", h * q, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.q_proj.bias", q, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.k_proj.weight", h * kv, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.k_proj.bias", kv, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.v_proj.weight", h * kv, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.v_proj.bias", kv, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.o_proj.weight", q * h, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.o_proj.bias", h, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.sinks", self.heads, f"{m}.self_attn"),
                    Param(f"{m}.post_attention_layernorm.weight", h, f"{m}.post_attention_layernorm"),
                    Param(f"{m}.mlp.router.weight", self.experts * h, f"{m}.mlp.router"),
                    Param(f"{m}.mlp.router.bias", self.experts, f"{m}.mlp.router"),
                    Param(f"{m}.mlp.experts.gate_up_proj", self.experts * h * 2 * f, f"{m}.mlp.experts"),
                    Param(f"{m}.mlp.experts.gate_up_proj_bias", self.experts * 2 * f, f"{m}.mlp.experts"),
                    Param(f"{m}.mlp.experts.down_proj", self.experts * f * h, f"{m}.mlp.experts"),
                    Param(f"{m}.mlp.experts.down_proj_bias", self.experts * h, f"{m}.mlp.experts"),
                ]
            else:  # Hugging Face Llama
                out += [
                    Param(f"{m}.input_layernorm.weight", h, f"{m}.input_layernorm"),
                    Param(f"{m}.self_attn.q_proj.weight", h * q, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.k_proj.weight", h * kv, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.v_proj.weight", h * kv, f"{m}.self_attn"),
                    Param(f"{m}.self_attn.o_proj.weight", q * h, f"{m}.self_attn"),
                    Param(f"{m}.post_attention_layernorm.weight", h, f"{m}.post_attention_layernorm"),
                    Param(f"{m}.mlp.gate_proj.weight", h * f, f"{m}.mlp"),
                    Param(f"{m}.mlp.up_proj.weight", h * f, f"{m}.mlp"),
                    Param(f"{m}.mlp.down_proj.weight", f * h, f"{m}.mlp"),
                ]
        out.append(Param("final_norm.weight", h, "final_norm"))
        out.append(Param("output_layer.weight", self.vocab * h, "output_layer", True))
        return out

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    def local_numel(self, p: Param) -> int:
        """Elements of ``p`` held by one rank before any ZeRO/optimizer sharding."""
        if p.expert:
            return p.numel if self.experts == 0 else p.numel  # one expert's tensor, owned by one rank
        return p.numel // self.spec.tp if p.tp_sharded else p.numel

    def dense_params_local(self) -> list[tuple[str, int]]:
        """(name, elements per rank) of the DP-replicated (non-expert) parameters."""
        return [(p.name, self.local_numel(p)) for p in self.params if not p.expert]

    def expert_params_per_rank(self) -> int:
        if not self.experts:
            return 0
        per_expert = sum(p.numel for p in self.params if p.expert) // self.experts
        return per_expert * (self.experts // self.spec.ep)

    # ------------------------------------------------------------------ communicators
    def _build_comms(self) -> dict[str, list[Communicator]]:
        world, tp = self.spec.world_size, self.spec.tp
        comms: dict[str, list[Communicator]] = {}
        if tp > 1:
            comms["tp"] = [Communicator(f"tp{g}", "tp", tuple(range(g * tp, (g + 1) * tp))) for g in range(world // tp)]
            comms["dp"] = [Communicator(f"dp{t}", "dp", tuple(range(t, world, tp))) for t in range(tp)]
        else:
            comms["dp"] = [Communicator("dp0", "dp", tuple(range(world)))]
        if self.spec.ep > 1:
            comms["ep"] = [Communicator("ep0", "ep", tuple(range(world)))]
        return comms

    # ------------------------------------------------------------------ compute
    def _gemm(self, name: str, m: int, k: int, n: int, phase: str, mult: float = 1.0) -> Compute:
        flops = 2.0 * m * k * n * mult
        mem = 2.0 * (m * k + k * n + m * n) * mult
        return Compute(name, flops, mem, phase, ((m, k), (k, n)))

    def _layer_compute(self, i: int, phase: str) -> list[Compute]:
        """Forward (``phase='fwd'``) or backward (2x the GEMMs) work of layer i on one rank."""
        s, h, f, tp = self.seq * self.mbs, self.hidden, self.ffn, self.spec.tp
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        mult = 1.0 if phase == "fwd" else 2.0
        attn_flops = 4.0 * s * s * q / tp * mult  # QK^T and PV
        attn = Compute(
            f"layers.{i}.attention.{phase}",
            2.0 * s * h * (q + 2 * kv + q) / tp * mult + attn_flops,
            2.0 * (h * (2 * q + 2 * kv) / tp + s * h * 6 + self.heads / tp * s * s) * mult,
            phase,
            ((s, h), (h, (q + 2 * kv) // tp)),
        )
        if self.experts:
            if self.spec.framework == "megatron":
                tokens = s * self.topk  # balanced: routed tokens per rank equal the local tokens x topk
                mlp_flops = 2.0 * tokens * h * 3 * f * mult
                mlp_mem = 2.0 * (self.expert_params_per_rank() // self.layers + tokens * (2 * h + 3 * f)) * mult
                shapes = ((tokens, h), (h, 2 * f))
            else:  # HF gpt-oss training path: every expert runs on every token
                tokens = s * self.experts
                mlp_flops = 2.0 * tokens * h * 3 * f * mult
                mlp_mem = 2.0 * (self.experts * 3 * h * f + tokens * (2 * h + 3 * f)) * mult
                shapes = ((self.experts, s, h), (self.experts, h, 2 * f))
            router = 2.0 * s * h * self.experts * mult
            mlp = Compute(f"layers.{i}.moe.{phase}", mlp_flops + router, mlp_mem, phase, shapes)
        else:
            mlp = Compute(
                f"layers.{i}.mlp.{phase}",
                2.0 * s * h * 3 * f / tp * mult,
                2.0 * (3 * h * f / tp + s * (2 * h + 3 * f / tp)) * mult,
                phase,
                ((s, h), (h, 2 * f // tp)),
            )
        return [attn, mlp]

    def _head_compute(self, phase: str) -> Compute:
        s, h, v, tp = self.seq * self.mbs, self.hidden, self.vocab, self.spec.tp
        mult = 1.0 if phase == "fwd" else 2.0
        return Compute(
            f"output_layer.{phase}", 2.0 * s * h * v / tp * mult, 2.0 * (h * v / tp + s * v / tp * 3) * mult, phase,
            ((s, h), (h, v // tp)),
        )

    def _optimizer_compute(self) -> Compute:
        """Adam on this rank's optimizer shard: fp32 master, m, v, grad read + master, m, v, bf16 param write."""
        spec = self.spec
        dense = sum(n for _, n in self.dense_params_local())
        if spec.framework == "megatron":
            shard = dense / spec.dp + self.expert_params_per_rank()
        elif spec.zero_stage == 3:
            shard = self.total_params / spec.dp
        else:
            shard = self.total_params / spec.dp
        return Compute("optimizer.step", 12.0 * shard, 30.0 * shard, "opt", ((int(shard),),))

    # ------------------------------------------------------------------ programs
    def init_program(self) -> list[Item]:
        """Before the first step: parameters broadcast from DP rank 0 (DDP / DeepSpeed init)."""
        if self.spec.framework == "megatron":
            n = sum(c for _, c in self.dense_params_local())
            return [Collective("dp", "broadcast", n, "Bf16", "init.broadcast_params")]
        if self.spec.zero_stage == 3:
            return []  # zero.Init partitions parameters on construction
        return [Collective("dp", "broadcast", p.numel, "Bf16", f"init.broadcast.{p.name}") for p in self.params]

    def step_program(self, warmup: bool = False) -> list[Item]:
        """Items of one training step, in issue order, for every rank."""
        if self.spec.framework == "megatron":
            return self._megatron_step(warmup)
        if self.spec.zero_stage == 3:
            return self._zero3_step(warmup)
        return self._deepspeed_zero0_step(warmup)

    def _megatron_buckets(self) -> list[int]:
        dp = self.spec.dp
        bucket_size = max(MEGATRON_BUCKET_ELEMENTS, 1_000_000 * dp)
        pad = math.lcm(dp, 128)
        buckets: list[int] = []
        cur = 0
        for _, n in reversed(self.dense_params_local()):
            cur += n
            if cur >= bucket_size:
                buckets.append(_ceil_to(cur, pad))
                cur = 0
        if cur:
            buckets.append(_ceil_to(cur, pad))
        return buckets

    def _megatron_step(self, warmup: bool) -> list[Item]:
        s, h = self.seq * self.mbs, self.hidden
        tp_on = "tp" in self.comms and self.spec.tp > 1
        ep_on = "ep" in self.comms
        items: list[Item] = []
        act = s * h

        def tp_ar(tag: str) -> None:
            if tp_on:
                items.append(Collective("tp", "all_reduce", act, "Bf16", tag))

        a2a = 0
        if ep_on:
            tokens = (s * self.topk // self.experts) * (self.experts // self.spec.ep)
            a2a = tokens * h
        items.append(Compute("embedding.fwd", 0.0, 2.0 * s * h * 2, "fwd", ((s, h),)))
        tp_ar("embedding.fwd.all_reduce")
        for i in range(self.layers):
            attn, mlp = self._layer_compute(i, "fwd")
            items.append(attn)
            tp_ar(f"layers.{i}.attention.fwd.all_reduce")
            if ep_on:
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.dispatch.fwd"))
                items.append(mlp)
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.combine.fwd"))
            else:
                items.append(mlp)
            tp_ar(f"layers.{i}.mlp.fwd.all_reduce")
        items.append(self._head_compute("fwd"))
        if tp_on:
            for k in ("max", "predicted", "sum_exp"):
                items.append(Collective("tp", "all_reduce", s * self.mbs // self.mbs, "F32", f"cross_entropy.{k}"))
        items.append(self._head_compute("bwd"))
        tp_ar("output_layer.bwd.all_reduce")
        for i in reversed(range(self.layers)):
            attn, mlp = self._layer_compute(i, "bwd")
            if ep_on:
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.combine.bwd"))
                items.append(mlp)
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.dispatch.bwd"))
            else:
                items.append(mlp)
            tp_ar(f"layers.{i}.mlp.bwd.all_reduce")
            items.append(attn)
            tp_ar(f"layers.{i}.attention.bwd.all_reduce")
        items.append(Compute("embedding.bwd", 0.0, 2.0 * s * h * 2, "bwd", ((s, h),)))
        dp = self.spec.dp
        buckets = self._megatron_buckets() if dp > 1 else []
        for b, n in enumerate(buckets):
            items.append(Collective("dp", "reduce_scatter", n // dp, "Bf16", f"ddp.bucket{b}.reduce_scatter"))
        if dp > 1:
            items.append(Collective("dp", "all_reduce", 1, "F32", "loss.average"))
            items.append(Collective("dp", "all_reduce", 1, "F32", "grad_norm.dp"))
        if tp_on:
            items.append(Collective("tp", "all_reduce", 1, "F32", "grad_norm.tp"))
        items.append(self._optimizer_compute())
        for b, n in enumerate(buckets):
            items.append(Collective("dp", "all_gather", n // dp, "Bf16", f"ddp.bucket{b}.all_gather"))
        return items

    def _deepspeed_zero0_step(self, warmup: bool) -> list[Item]:
        items: list[Item] = [Compute("embedding.fwd", 0.0, 4.0 * self.seq * self.hidden, "fwd")]
        for i in range(self.layers):
            items += self._layer_compute(i, "fwd")
        items.append(self._head_compute("fwd"))
        items.append(self._head_compute("bwd"))
        for i in reversed(range(self.layers)):
            items += list(reversed(self._layer_compute(i, "bwd")))
        items.append(Compute("embedding.bwd", 0.0, 4.0 * self.seq * self.hidden, "bwd"))
        dp = self.spec.dp
        if dp > 1:
            cur, b = 0, 0
            for p in reversed(self.params):
                cur += p.numel
                if cur >= DEEPSPEED_BUCKET_ELEMENTS:
                    items.append(Collective("dp", "all_reduce", cur, "Bf16", f"allreduce.bucket{b}"))
                    cur, b = 0, b + 1
            if cur:
                items.append(Collective("dp", "all_reduce", cur, "Bf16", f"allreduce.bucket{b}"))
            items.append(Collective("dp", "all_reduce", 1, "F32", "grad_norm"))
        items.append(self._optimizer_compute())
        if dp > 1:
            padded = _ceil_to(self.total_params, 2 * dp)
            partition = padded // dp
            shards = max(1, padded // DEEPSPEED_BUCKET_ELEMENTS)
            base = partition // shards
            for k in range(shards):
                n = base if k < shards - 1 else partition - base * (shards - 1)
                items.append(Collective("dp", "all_gather", n, "Bf16", f"bf16_optimizer.all_gather{k}"))
        return items

    def _zero3_modules(self) -> list[tuple[str, list[Param]]]:
        mods: dict[str, list[Param]] = {}
        for p in self.params:
            mods.setdefault(p.module, []).append(p)
        return list(mods.items())

    def _zero3_step(self, warmup: bool) -> list[Item]:
        dp = self.spec.dp
        mods = self._zero3_modules()
        compute_fwd: dict[str, list[Compute]] = {}
        for i in range(self.layers):
            attn, mlp = self._layer_compute(i, "fwd")
            compute_fwd[f"layers.{i}.self_attn"] = [attn]
            compute_fwd[f"layers.{i}.mlp.experts"] = [mlp]
        compute_fwd["output_layer"] = [self._head_compute("fwd")]
        compute_bwd: dict[str, list[Compute]] = {}
        for i in range(self.layers):
            attn, mlp = self._layer_compute(i, "bwd")
            compute_bwd[f"layers.{i}.self_attn"] = [attn]
            compute_bwd[f"layers.{i}.mlp.experts"] = [mlp]
        compute_bwd["output_layer"] = [self._head_compute("bwd")]

        def big(ps: list[Param]) -> list[Param]:
            return [p for p in ps if p.numel > ZERO3_PERSISTENCE_THRESHOLD]

        items: list[Item] = []
        fetched_total = 0
        fetched_at: dict[str, int] = {}

        def gather(name: str, ps: list[Param], phase: str) -> None:
            nonlocal fetched_total
            gathered = big(ps)
            if not gathered:
                return
            if phase == "bwd" and not warmup and name in fetched_at:
                if fetched_total - fetched_at[name] <= ZERO3_MAX_REUSE_DISTANCE:
                    return  # still gathered: next use within the reuse distance
            fetched_at[name] = fetched_total
            for p in gathered:
                items.append(Collective("dp", "all_gather", -(-p.numel // dp), "Bf16", f"zero3.{phase}.gather.{p.name}"))
                fetched_total += p.numel

        for name, ps in mods:
            gather(name, ps, "fwd")
            items += compute_fwd.get(name, [])
        for name, ps in reversed(mods):
            gather(name, ps, "bwd")
            items += compute_bwd.get(name, [])
            for p in reversed(ps):
                items.append(Collective("dp", "reduce_scatter", -(-p.numel // dp), "Bf16", f"zero3.reduce_scatter.{p.name}"))
        items.append(Collective("dp", "all_reduce", 1, "F32", "grad_norm"))
        items.append(self._optimizer_compute())
        return items
