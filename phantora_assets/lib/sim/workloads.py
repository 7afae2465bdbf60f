"""What each workload computes and communicates per training step (the rules of presets.toml).

A :class:`WorkloadModel` turns a workload preset and a layout into

* the model's parameters (name, element count, module, TP-sharded or expert-local),
* the communicators (TP, DP, EP groups over global ranks, host-major placement),
* the per-step program every rank executes in host issue order: :class:`Compute` items (each
  the list of torch calls Phantora intercepts, ``lib.torch_ops``) and :class:`Collective` /
  :class:`AllToAll` items, for a steady step and for the warm-up step, with the framework's
  stream semantics: a collective is ``blocking`` (the next compute waits for it) or asynchronous
  (a later compute names its tag in ``waits``),
* the init program (parameter broadcasts before the first step).

Overlap (see the step builders): Megatron DDP as Phantora's tests/test_megatron.py configures it
(``overlap_grad_reduce=True``, ``overlap_param_gather=True``), synchronous TP all-reduces and MoE
all-to-alls; DeepSpeed bf16 ZeRO-0 synchronous; ZeRO-3 with prefetch and overlapped reduce-scatter.

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
from functools import lru_cache
from typing import Literal

from phantora_assets.lib.sim.torch_ops import torch_ops
from phantora_assets.matrix import RunSpec, presets

MEGATRON_BUCKET_ELEMENTS = 40_000_000
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
ZERO3_PERSISTENCE_THRESHOLD = 100_000
ZERO3_MAX_REUSE_DISTANCE = 1_000_000_000
ZERO3_PREFETCH_BUCKET_ELEMENTS = 50_000_000


@dataclass(frozen=True)
class Param:
    """One parameter tensor. ``numel`` is the full (unsharded) element count; ``shape`` the
    tensor's shape on one rank (after tensor-parallel sharding)."""

    name: str
    numel: int
    module: str
    tp_sharded: bool = False
    expert: bool = False
    shape: tuple[int, ...] = ()


@dataclass(frozen=True)
class Communicator:
    """An NCCL communicator: ``ranks`` are global ranks in communicator-rank order."""

    name: str
    kind: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Compute:
    """Work of one rank on the compute stream.

    ``kernels`` are the intercepted torch calls (perf-DB keys, ``lib.kernels``); ``flops`` their
    GEMM FLOP and ``mem_bytes`` their traffic; ``phase`` fwd/bwd/opt. ``waits``: tags of
    asynchronous collectives this item waits for before it starts (``work.wait()``)."""

    name: str
    flops: float
    mem_bytes: float
    phase: str
    shapes: tuple[tuple[int, ...], ...] = ()
    kernels: tuple = ()
    waits: tuple[str, ...] = ()


def compute(name: str, phase: str, kernels: list, waits: tuple[str, ...] = ()) -> Compute:
    """A :class:`Compute` item from its kernel list (flops and bytes summed)."""
    ks = tuple(kernels)
    return Compute(name, sum(k.flops for k in ks), sum(k.bytes for k in ks), phase, (), ks, tuple(waits))


@dataclass(frozen=True)
class Collective:
    """One NCCL collective issued on every communicator of ``kind`` at the same time.

    ``blocking``: the compute stream waits for it right away (a synchronous collective); when
    False it runs asynchronously and a later :class:`Compute` names its ``tag`` in ``waits``."""

    kind: str
    op: Literal["all_reduce", "all_gather", "reduce_scatter", "broadcast"]
    count: int
    dtype: str
    tag: str
    root: int = 0
    blocking: bool = True


@dataclass(frozen=True)
class AllToAll:
    """Grouped send/recv on every communicator of ``kind``: each rank sends every peer ``count``."""

    kind: str
    count: int
    dtype: str
    tag: str
    blocking: bool = True


Item = Compute | Collective | AllToAll


@lru_cache(maxsize=64)
def workload_model(spec: RunSpec) -> WorkloadModel:
    """The (cached) :class:`WorkloadModel` of ``spec``."""
    return WorkloadModel(spec)


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
        tpv = self.spec.tp if self.spec.framework == "megatron" else 1
        out: list[Param] = [Param("embedding.word_embeddings.weight", self.vocab * h, "embedding", True,
                                  shape=(self.vocab // tpv, h))]
        wl = self.spec.workload
        for i in range(L):
            m = f"layers.{i}"
            if self.spec.framework == "megatron":
                # registration order of Megatron-core: input_layernorm, linear_proj (created by
                # Attention.__init__), linear_qkv, pre_mlp_layernorm, mlp
                t = self.spec.tp
                out.append(Param(f"{m}.input_layernorm.weight", h, f"{m}.attn", shape=(h,)))
                out.append(Param(f"{m}.self_attention.linear_proj.weight", q * h, f"{m}.attn", True, shape=(h, q // t)))
                out.append(Param(f"{m}.self_attention.linear_qkv.weight", h * (q + 2 * kv), f"{m}.attn", True,
                                 shape=((q + 2 * kv) // t, h)))
                # no q/k layernorm parameters: Phantora's tests/test_megatron.py builds its
                # TransformerConfig without qk_layernorm (W3's recorded shard sizes in
                # perfdb/l40s confirm: its grad buffer has no 128-element norms per layer)
                out.append(Param(f"{m}.pre_mlp_layernorm.weight", h, f"{m}.mlp", shape=(h,)))
                if self.experts:
                    out.append(Param(f"{m}.mlp.router.weight", self.experts * h, f"{m}.mlp", shape=(self.experts, h)))
                    for e in range(self.experts):
                        out.append(Param(f"{m}.mlp.experts.{e}.linear_fc1.weight", h * 2 * f, f"{m}.mlp", expert=True,
                                         shape=(2 * f, h)))
                        out.append(Param(f"{m}.mlp.experts.{e}.linear_fc2.weight", f * h, f"{m}.mlp", expert=True,
                                         shape=(h, f)))
                else:
                    out.append(Param(f"{m}.mlp.linear_fc1.weight", h * 2 * f, f"{m}.mlp", True, shape=(2 * f // t, h)))
                    out.append(Param(f"{m}.mlp.linear_fc2.weight", f * h, f"{m}.mlp", True, shape=(h, f // t)))
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
                    Param(f"{m}.input_layernorm.weight", h, f"{m}.input_layernorm", shape=(h,)),
                    Param(f"{m}.self_attn.q_proj.weight", h * q, f"{m}.self_attn", shape=(q, h)),
                    Param(f"{m}.self_attn.k_proj.weight", h * kv, f"{m}.self_attn", shape=(kv, h)),
                    Param(f"{m}.self_attn.v_proj.weight", h * kv, f"{m}.self_attn", shape=(kv, h)),
                    Param(f"{m}.self_attn.o_proj.weight", q * h, f"{m}.self_attn", shape=(h, q)),
                    Param(f"{m}.post_attention_layernorm.weight", h, f"{m}.post_attention_layernorm", shape=(h,)),
                    Param(f"{m}.mlp.gate_proj.weight", h * f, f"{m}.mlp", shape=(f, h)),
                    Param(f"{m}.mlp.up_proj.weight", h * f, f"{m}.mlp", shape=(f, h)),
                    Param(f"{m}.mlp.down_proj.weight", f * h, f"{m}.mlp", shape=(h, f)),
                ]
        out.append(Param("final_norm.weight", h, "final_norm", shape=(h,)))
        out.append(Param("output_layer.weight", self.vocab * h, "output_layer", True, shape=(self.vocab // tpv, h)))
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

    def param_shape(self, p: Param) -> tuple[int, ...]:
        return p.shape or (self.local_numel(p),)

    # ------------------------------------------------------------------ Megatron buffers
    def megatron_dense_buckets(self) -> list[tuple[int, list[tuple[Param, int, int]]]]:
        """The DDP grad buffer of the dense parameters: parameters in reverse order, a bucket
        closes once it holds >= max(40M, 1M x dp) elements and is padded to lcm(dp, 128).
        Returns ``(padded_numel, [(param, offset_in_bucket, numel)])`` per bucket."""
        dp = self.spec.dp
        size = max(MEGATRON_BUCKET_ELEMENTS, 1_000_000 * dp)
        return self._buckets([p for p in self.params if not p.expert], size, math.lcm(dp, 128))

    def megatron_expert_buckets(self) -> list[tuple[int, list[tuple[Param, int, int]]]]:
        """The expert grad buffer of rank 0's local experts (expert-data-parallel size world/ep)."""
        if not self.experts or self.spec.framework != "megatron":
            return []
        local = self.experts // self.spec.ep
        mine = [p for p in self.params if p.expert and int(p.name.split(".")[4]) < local]
        edp = max(1, self.spec.world_size // self.spec.ep)
        return self._buckets(mine, max(MEGATRON_BUCKET_ELEMENTS, 1_000_000 * edp), math.lcm(edp, 128))

    def _buckets(self, params: list[Param], size: int, pad: int) -> list[tuple[int, list[tuple[Param, int, int]]]]:
        out: list[tuple[int, list[tuple[Param, int, int]]]] = []
        cur: list[tuple[Param, int, int]] = []
        n = 0
        for p in reversed(params):
            k = self.local_numel(p)
            cur.append((p, n, k))
            n += k
            if n >= size:
                out.append((_ceil_to(n, pad), cur))
                cur, n = [], 0
        if cur:
            out.append((_ceil_to(n, pad), cur))
        return out

    def megatron_optimizer_groups(self) -> list[tuple[bool, list[int]]]:
        """Rank 0's fp32 shard pieces per AdamW param group (decay?, sizes in buffer order):
        dense weights (decay), dense 1-D params (no decay), expert weights (decay)."""
        dp = self.spec.dp
        decay: list[int] = []
        nodecay: list[int] = []
        for padded, members in self.megatron_dense_buckets():
            lo, hi = 0, padded // dp  # rank 0's shard of this bucket
            for p, off, k in members:
                a, b = max(lo, off), min(hi, off + k)
                if b > a:
                    (decay if len(self.param_shape(p)) >= 2 else nodecay).append(b - a)
        experts = [k for _, members in self.megatron_expert_buckets() for _, _, k in members]
        return [(True, decay), (False, nodecay), (True, experts)]

    def _megatron_buckets(self) -> list[int]:
        return [padded for padded, _ in self.megatron_dense_buckets()]

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
        """Items of one training step, in host issue order, for every rank (built once per
        model; do not mutate the returned list)."""
        cache = self.__dict__.setdefault("_programs", {})
        if warmup not in cache:
            if self.spec.framework == "megatron":
                cache[warmup] = self._megatron_step(warmup)
            elif self.spec.zero_stage == 3:
                cache[warmup] = self._zero3_step(warmup)
            else:
                cache[warmup] = self._deepspeed_zero0_step(warmup)
        return cache[warmup]

    def _megatron_step(self, warmup: bool) -> list[Item]:
        """Megatron-core as Phantora's tests/test_megatron.py runs it: DDP with the distributed
        optimizer, ``overlap_grad_reduce=True`` (a bucket's reduce-scatter starts as soon as its
        gradients are ready and overlaps the rest of the backward; the optimizer waits for all)
        and ``overlap_param_gather=True`` (the first bucket's all-gather is dispatched at
        ``zero_grad``, each forward pre-hook waits for its bucket and dispatches the next).
        TP all-reduces and MoE all-to-alls are synchronous (critical path)."""
        ops = torch_ops(self)
        s, h = self.seq * self.mbs, self.hidden
        tp_on = "tp" in self.comms and self.spec.tp > 1
        ep_on = "ep" in self.comms
        dp = self.spec.dp
        items: list[Item] = []
        pending_waits: list[str] = []

        def comp(name: str, phase: str, kernels: list) -> None:
            waits = tuple(pending_waits)
            pending_waits.clear()
            if kernels or waits:
                items.append(compute(name, phase, kernels, waits))

        def tp_ar(tag: str) -> None:
            if tp_on:
                items.append(Collective("tp", "all_reduce", s * h, "Bf16", tag))

        a2a = (s * self.topk // self.experts) * (self.experts // self.spec.ep) * h if ep_on else 0
        buckets = self.megatron_dense_buckets() if dp > 1 else []
        ebuckets = self.megatron_expert_buckets()
        bucket_of: dict[str, int] = {p.name: b for b, (_, mem) in enumerate(buckets) for p, _, _ in mem}
        by_module: dict[str, list[Param]] = {}
        for p in self.params:
            if not p.expert:
                by_module.setdefault(p.module, []).append(p)

        # ---- param all-gathers (overlap_param_gather): first needed bucket at zero_grad
        issued: set[int] = set()
        waited: set[int] = set()

        def ag(b: int) -> None:
            if 0 <= b < len(buckets) and b not in issued:
                issued.add(b)
                items.append(Collective("dp", "all_gather", buckets[b][0] // dp, "Bf16",
                                        f"ddp.bucket{b}.all_gather", blocking=False))

        def need(*modules: str) -> None:
            for b in sorted({bucket_of[p.name] for mod in modules for p in by_module.get(mod, [])
                             if p.name in bucket_of}, reverse=True):
                if b in waited:
                    continue
                ag(b)
                pending_waits.append(f"ddp.bucket{b}.all_gather")
                waited.add(b)
                ag(b - 1)

        if buckets:
            ag(len(buckets) - 1)
        need("embedding")
        comp("embedding.fwd", "fwd", ops.megatron_embedding("fwd"))
        tp_ar("embedding.fwd.all_reduce")
        for i in range(self.layers):
            need(f"layers.{i}.attn")
            comp(f"layers.{i}.attention.fwd", "fwd", ops.megatron_attention("fwd"))
            tp_ar(f"layers.{i}.attention.fwd.all_reduce")
            need(f"layers.{i}.mlp")
            if ep_on:
                comp(f"layers.{i}.router.fwd", "fwd", ops.megatron_router("fwd"))
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.dispatch.fwd"))
                comp(f"layers.{i}.moe.fwd", "fwd", ops.megatron_experts("fwd") + ops._bda("fwd"))
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.combine.fwd"))
            else:
                comp(f"layers.{i}.mlp.fwd", "fwd", ops.megatron_mlp("fwd"))
            tp_ar(f"layers.{i}.mlp.fwd.all_reduce")
        need("final_norm", "output_layer")
        comp("output_layer.fwd", "fwd", ops.megatron_head("fwd"))
        if tp_on:
            for k in ("max", "predicted", "sum_exp"):
                items.append(Collective("tp", "all_reduce", s, "F32", f"cross_entropy.{k}"))

        # ---- backward; a bucket's reduce-scatter starts when all its grads are ready
        ready: set[str] = set()
        launched: set[int] = set()
        elaunched: set[int] = set()
        rs_tags: list[str] = []

        def grads_ready(*modules: str) -> None:
            ready.update(modules)
            for b, (padded, mem) in enumerate(buckets):
                if b not in launched and all(p.module in ready for p, _, _ in mem):
                    launched.add(b)
                    comp(f"ddp.bucket{b}.scale", "bwd", ops.megatron_grad_scale(padded))
                    items.append(Collective("dp", "reduce_scatter", padded // dp, "Bf16",
                                            f"ddp.bucket{b}.reduce_scatter", blocking=False))
                    rs_tags.append(f"ddp.bucket{b}.reduce_scatter")
            for b, (padded, mem) in enumerate(ebuckets):
                if b not in elaunched and all(p.module in ready for p, _, _ in mem) and dp > 1:
                    elaunched.add(b)
                    comp(f"ddp.expert_bucket{b}.scale", "bwd", ops.megatron_grad_scale(padded))

        comp("output_layer.bwd", "bwd", ops.megatron_head("bwd"))
        tp_ar("output_layer.bwd.all_reduce")
        grads_ready("output_layer", "final_norm")
        for i in reversed(range(self.layers)):
            if ep_on:
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.combine.bwd"))
                comp(f"layers.{i}.moe.bwd", "bwd", ops._bda("bwd") + ops.megatron_experts("bwd"))
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.dispatch.bwd"))
                comp(f"layers.{i}.router.bwd", "bwd", ops.megatron_router("bwd"))
            else:
                comp(f"layers.{i}.mlp.bwd", "bwd", ops.megatron_mlp("bwd"))
            tp_ar(f"layers.{i}.mlp.bwd.all_reduce")
            grads_ready(f"layers.{i}.mlp")
            comp(f"layers.{i}.attention.bwd", "bwd", ops.megatron_attention("bwd"))
            tp_ar(f"layers.{i}.attention.bwd.all_reduce")
            grads_ready(f"layers.{i}.attn")
        comp("embedding.bwd", "bwd", ops.megatron_embedding("bwd"))
        grads_ready("embedding")
        pending_waits.extend(rs_tags)  # finish_grad_sync
        if dp > 1:
            items.append(Collective("dp", "all_reduce", 1, "F32", "loss.average"))
            items.append(Collective("dp", "all_reduce", 1, "F32", "grad_norm.dp"))
        if tp_on:
            items.append(Collective("tp", "all_reduce", 1, "F32", "grad_norm.tp"))
        comp("optimizer.step", "opt", ops.megatron_optimizer(self.megatron_optimizer_groups(), warmup))
        return items

    def _deepspeed_zero0_step(self, warmup: bool) -> list[Item]:
        """DeepSpeed 1-stage pipeline, bf16 optimizer (ZeRO stage 0): synchronous gradient
        all-reduce after the backward, synchronous parameter all-gather after the step (no
        overlap on this path: ``_exec_reduce_grads`` / ``update_lp_params``)."""
        ops = torch_ops(self)
        items: list[Item] = [compute("embedding.fwd", "fwd", ops.hf_rotary())]
        for i in range(self.layers):
            items.append(compute(f"layers.{i}.attention.fwd", "fwd", ops.hf_attention("fwd")))
            items.append(compute(f"layers.{i}.mlp.fwd", "fwd", ops.hf_llama_mlp("fwd")))
        items.append(compute("output_layer.fwd", "fwd", ops.hf_head("fwd")))
        items.append(compute("output_layer.bwd", "bwd", ops.hf_head("bwd")))
        for i in reversed(range(self.layers)):
            items.append(compute(f"layers.{i}.mlp.bwd", "bwd", ops.hf_llama_mlp("bwd")))
            items.append(compute(f"layers.{i}.attention.bwd", "bwd", ops.hf_attention("bwd")))
        items.append(compute("bf16_optimizer.update_hp_grads", "opt", ops.bf16_update_hp_grads()))
        dp = self.spec.dp
        if dp > 1:
            items.append(compute("bf16_optimizer.grads_for_reduction", "opt",
                                 ops.bf16_grads_for_reduction(self.total_params)))
            cur, b = 0, 0
            for p in reversed(self.params):
                cur += p.numel
                if cur >= DEEPSPEED_BUCKET_ELEMENTS:
                    items.append(Collective("dp", "all_reduce", cur, "Bf16", f"allreduce.bucket{b}"))
                    cur, b = 0, b + 1
            if cur:
                items.append(Collective("dp", "all_reduce", cur, "Bf16", f"allreduce.bucket{b}"))
            items.append(Collective("dp", "all_reduce", 1, "F32", "grad_norm"))
        padded = _ceil_to(self.total_params, 2 * dp)
        partition = padded // dp
        items.append(compute("optimizer.step", "opt", ops.adam_flat(partition, warmup, False, False)))
        if dp > 1:
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

    def zero3_partition(self) -> int:
        """Elements of one rank's fp32 partition (every parameter split ceil(numel / dp))."""
        return sum(-(-p.numel // self.spec.dp) for p in self.params)

    def _zero3_step(self, warmup: bool) -> list[Item]:
        """DeepSpeed ZeRO-3 (overlap_comm defaults to True at stage 3): parameters are gathered
        before their module runs, and the steady steps prefetch the next parameters of the
        recorded trace up to ``stage3_prefetch_bucket_size`` (5e7) elements; the module's
        compute waits for its own gathers only. Gradients are reduce-scattered asynchronously
        after each module's backward and waited for before the optimizer step. The warm-up step
        has no trace: no prefetch, everything gathered again in backward."""
        ops = torch_ops(self)
        dp = self.spec.dp
        mods = self._zero3_modules()
        fwd: dict[str, list] = {"embedding": ops.hf_rotary(gpt_oss=True), "output_layer": ops.hf_head("fwd", True)}
        bwd: dict[str, list] = {"output_layer": ops.hf_head("bwd", True)}
        for i in range(self.layers):
            fwd[f"layers.{i}.self_attn"] = ops.hf_attention("fwd", gpt_oss=True)
            fwd[f"layers.{i}.mlp.experts"] = ops.gptoss_moe("fwd")
            bwd[f"layers.{i}.self_attn"] = ops.hf_attention("bwd", gpt_oss=True)
            bwd[f"layers.{i}.mlp.experts"] = ops.gptoss_moe("bwd")

        # which parameters each module execution gathers (persistence, reuse distance)
        fetched_total = 0
        fetched_at: dict[str, int] = {}
        runs: list[tuple[str, str, list[Param]]] = []
        for phase, order in (("fwd", mods), ("bwd", list(reversed(mods)))):
            for name, ps in order:
                gathered = [p for p in ps if p.numel > ZERO3_PERSISTENCE_THRESHOLD]
                if gathered and phase == "bwd" and not warmup and name in fetched_at:
                    if fetched_total - fetched_at[name] <= ZERO3_MAX_REUSE_DISTANCE:
                        gathered = []  # still gathered: next use within the reuse distance
                if gathered:
                    fetched_at[name] = fetched_total
                    fetched_total += sum(p.numel for p in gathered)
                runs.append((name, phase, gathered))
        queue = [(j, p) for j, (_, phase, gathered) in enumerate(runs) for p in gathered]
        tags = {(j, p.name): f"zero3.{runs[j][1]}.gather.{p.name}" for j, p in queue}

        items: list[Item] = []
        qi = 0
        rs_tags: list[str] = []
        for j, (name, phase, gathered) in enumerate(runs):
            while qi < len(queue) and queue[qi][0] <= j:  # this module's own (not yet issued)
                jj, p = queue[qi]
                items.append(Collective("dp", "all_gather", -(-p.numel // dp), "Bf16", tags[(jj, p.name)], blocking=False))
                qi += 1
            if not warmup:
                ahead = 0
                while qi < len(queue) and ahead < ZERO3_PREFETCH_BUCKET_ELEMENTS:
                    jj, p = queue[qi]
                    items.append(Collective("dp", "all_gather", -(-p.numel // dp), "Bf16", tags[(jj, p.name)],
                                            blocking=False))
                    ahead += p.numel
                    qi += 1
            kernels = (fwd if phase == "fwd" else bwd).get(name, [])
            waits = tuple(tags[(j, p.name)] for p in gathered)
            if kernels or waits:
                items.append(compute(f"{name}.{phase}", phase, kernels, waits))
            if phase == "bwd":
                for p in reversed(next(ps for n, ps in mods if n == name)):
                    tag = f"zero3.reduce_scatter.{p.name}"
                    items.append(Collective("dp", "reduce_scatter", -(-p.numel // dp), "Bf16", tag, blocking=False))
                    rs_tags.append(tag)
        items.append(compute("zero3.grad_norm", "opt", ops.zero3_grad_norm(dp), waits=tuple(rs_tags)))
        items.append(Collective("dp", "all_reduce", 1, "F32", "grad_norm"))
        items.append(compute("optimizer.step", "opt", ops.adam_flat(self.zero3_partition(), warmup, True, True)))
        return items
