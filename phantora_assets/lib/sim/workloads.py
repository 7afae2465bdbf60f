"""What each workload computes and communicates per training step (the rules of presets.toml).

A :class:`WorkloadModel` is the run's
:class:`~phantora_assets.lib.sim.workload_layout.WorkloadLayout` (dimensions, parameters,
communicators, grad buckets) plus its programs:

* the per-step program every rank executes in host issue order: ``Compute`` items (each the
  list of torch calls Phantora intercepts, ``lib.sim.torch_ops``) and ``Collective`` /
  ``AllToAll`` items (:mod:`~phantora_assets.lib.sim.workload_types`; counts in elements per
  rank), for a steady step and for the warm-up step, with the framework's stream semantics: a
  collective is ``blocking`` (the next compute waits for it) or asynchronous (a later compute
  names its tag in ``waits``),
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

A preset without a needed key raises ``KeyError`` when the model is built. No Dagster import.
"""

from __future__ import annotations

from functools import lru_cache

from phantora_assets.lib.sim.torch_ops import torch_ops
from phantora_assets.lib.sim.workload_layout import WorkloadLayout, ceil_to
from phantora_assets.lib.sim.workload_types import (
    DEEPSPEED_BUCKET_ELEMENTS,
    ZERO3_MAX_REUSE_DISTANCE,
    ZERO3_PERSISTENCE_THRESHOLD,
    ZERO3_PREFETCH_BUCKET_ELEMENTS,
    AllToAll,
    Collective,
    Item,
    Param,
    compute,
)
from phantora_assets.matrix import RunSpec


@lru_cache(maxsize=64)
def workload_model(spec: RunSpec) -> WorkloadModel:
    """The (cached) :class:`WorkloadModel` of ``spec``."""
    return WorkloadModel(spec)


class WorkloadModel(WorkloadLayout):
    """Parameters, communicators and per-step programs of one run (see module docstring)."""

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

    def _megatron_step(self, warmup: bool) -> list[Item]:  # noqa: C901, PLR0915 (Megatron-core's step in program order, a branch per option)
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
        edp = self.spec.world_size // self.spec.ep if ep_on else 1
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
                items.append(
                    Collective(
                        "dp", "all_gather", buckets[b][0] // dp, "Bf16", f"ddp.bucket{b}.all_gather", blocking=False
                    )
                )

        def need(*modules: str) -> None:
            for b in sorted(
                {bucket_of[p.name] for mod in modules for p in by_module.get(mod, []) if p.name in bucket_of},
                reverse=True,
            ):
                if b in waited:
                    continue
                ag(b)
                pending_waits.append(f"ddp.bucket{b}.all_gather")
                waited.add(b)
                ag(b - 1)

        if buckets:
            ag(len(buckets) - 1)
        for b, (padded, _) in enumerate(ebuckets if edp > 1 else []):  # expert params, gathered over EDP
            tag = f"ddp.expert_bucket{b}.all_gather"
            items.append(Collective("edp", "all_gather", padded // edp, "Bf16", tag, blocking=False))
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
                if i == 0 and edp > 1:
                    pending_waits.extend(f"ddp.expert_bucket{b}.all_gather" for b in range(len(ebuckets)))
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
                    items.append(
                        Collective(
                            "dp",
                            "reduce_scatter",
                            padded // dp,
                            "Bf16",
                            f"ddp.bucket{b}.reduce_scatter",
                            blocking=False,
                        )
                    )
                    rs_tags.append(f"ddp.bucket{b}.reduce_scatter")
            for b, (padded, mem) in enumerate(ebuckets):
                if b not in elaunched and all(p.module in ready for p, _, _ in mem) and dp > 1:
                    elaunched.add(b)
                    comp(f"ddp.expert_bucket{b}.scale", "bwd", ops.megatron_grad_scale(padded))
                    if edp > 1:  # expert-data-parallel gradient sync, as the dense buckets over DP
                        tag = f"ddp.expert_bucket{b}.reduce_scatter"
                        items.append(Collective("edp", "reduce_scatter", padded // edp, "Bf16", tag, blocking=False))
                        rs_tags.append(tag)

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
            items.append(
                compute("bf16_optimizer.grads_for_reduction", "opt", ops.bf16_grads_for_reduction(self.total_params))
            )
            cur, b = 0, 0
            for p in reversed(self.params):
                cur += p.numel
                if cur >= DEEPSPEED_BUCKET_ELEMENTS:
                    items.append(Collective("dp", "all_reduce", cur, "Bf16", f"allreduce.bucket{b}"))
                    cur, b = 0, b + 1
            if cur:
                items.append(Collective("dp", "all_reduce", cur, "Bf16", f"allreduce.bucket{b}"))
            items.append(Collective("dp", "all_reduce", 1, "F32", "grad_norm"))
        padded = ceil_to(self.total_params, 2 * dp)
        partition = padded // dp
        items.append(compute("optimizer.step", "opt", ops.adam_flat(partition, warmup, False, False)))
        if dp > 1:
            shards = max(1, padded // DEEPSPEED_BUCKET_ELEMENTS)
            base = partition // shards
            for k in range(shards):
                n = base if k < shards - 1 else partition - base * (shards - 1)
                items.append(Collective("dp", "all_gather", n, "Bf16", f"bf16_optimizer.all_gather{k}"))
        return items

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
                if (
                    gathered
                    and phase == "bwd"
                    and not warmup
                    and name in fetched_at
                    and fetched_total - fetched_at[name] <= ZERO3_MAX_REUSE_DISTANCE
                ):
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
                items.append(
                    Collective("dp", "all_gather", -(-p.numel // dp), "Bf16", tags[(jj, p.name)], blocking=False)
                )
                qi += 1
            if not warmup:
                ahead = 0
                while qi < len(queue) and ahead < ZERO3_PREFETCH_BUCKET_ELEMENTS:
                    jj, p = queue[qi]
                    items.append(
                        Collective("dp", "all_gather", -(-p.numel // dp), "Bf16", tags[(jj, p.name)], blocking=False)
                    )
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
