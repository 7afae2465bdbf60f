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
from typing import Literal

from phantora_assets.lib.sim.pipeline import schedule
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
    SendRecv,
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
    def init_program(self, stage: int = 0) -> list[Item]:
        """Before the first step: parameters broadcast from DP rank 0 (DDP / DeepSpeed init; the
        ranks of ``stage`` broadcast their stage's parameters). FSDP2 and ZeRO-3 shard on
        construction: nothing."""
        fw = self.spec.framework
        if fw == "megatron":
            n = sum(c for _, c in self.dense_params_local(stage))
            return [Collective("dp", "broadcast", n, "Bf16", "init.broadcast_params")]
        if self.spec.zero_stage == 3 or (fw == "torchtitan" and self.spec.zero_stage >= 2):
            return []  # zero.Init / fully_shard partition parameters on construction
        if fw == "torchtitan":
            n = sum(c for _, c in self.dense_params_local(stage))
            return [Collective("dp", "broadcast", n, "Bf16", "init.broadcast_params")]
        return [Collective("dp", "broadcast", p.numel, "Bf16", f"init.broadcast.{p.name}") for p in self.params]

    def step_program(self, warmup: bool = False) -> list[Item]:
        """Items of one training step of the first pipeline stage, in host issue order (the whole
        step of a one-stage job: every rank runs it). Built once per model; do not mutate."""
        return self.stage_programs(warmup)[0]

    def stage_programs(self, warmup: bool = False) -> list[list[Item]]:
        """One program per pipeline stage (its ranks: :meth:`stage_ranks`), in host issue order.
        A collective of stage s runs on the communicators of its kind whose ranks are in s; a
        :class:`SendRecv` of kind ``pp`` is listed by both of its stages. Built once per model."""
        cache = self.__dict__.setdefault("_programs", {})
        if warmup not in cache:
            fw, pp = self.spec.framework, self.spec.pp
            if fw == "megatron":
                cache[warmup] = [self._megatron_step(warmup, st) for st in range(pp)]
            elif fw == "torchtitan":
                cache[warmup] = [self._torchtitan_step(warmup, st) for st in range(pp)]
            elif self.spec.zero_stage == 3:
                cache[warmup] = [self._zero3_step(warmup)]
            elif self.spec.zero_stage in (1, 2):
                cache[warmup] = [self._deepspeed_zero12_step(warmup)]
            else:
                cache[warmup] = [self._deepspeed_zero0_step(warmup)]
        return cache[warmup]

    # ------------------------------------------------------------------ pipeline send/recv
    def _p2p(self, items: list[Item], stage: int, phase: str, mb: int, v: int, side: str) -> None:
        """The pipeline send (``side`` "send") or receive ("recv") around op (phase, mb, v) of
        ``stage``: forward activations go to the next model chunk, gradients to the previous one
        ([seq/cp, mbs, hidden] bf16, / tp with sequence parallelism). Chunk c = v * pp + stage."""
        par = self.spec.par
        pp, nchunks = par.pp, par.pp * par.virtual_stages
        c = v * pp + stage
        if phase == "F":
            peer_c = c + 1 if side == "send" else c - 1
        else:
            peer_c = c - 1 if side == "send" else c + 1
        if not 0 <= peer_c < nchunks:
            return
        a, b = (c, peer_c) if side == "send" else (peer_c, c)  # sender chunk, receiver chunk
        tp_div = par.tp if (par.sequence_parallel or self.spec.framework == "torchtitan") else 1
        count = self.seq * self.mbs * self.hidden // tp_div
        what = "act" if phase == "F" else "grad"
        tag = f"pp.{what}.mb{mb}.c{a}-c{b}"
        items.append(SendRecv("pp", ((a % pp, b % pp),), count, "Bf16", tag, blocking=False, receiver=b % pp))

    def _megatron_step(self, warmup: bool, stage: int = 0) -> list[Item]:
        """Megatron-core as Phantora's tests/test_megatron.py runs it: DDP with the distributed
        optimizer (zero = 1; zero = 0: gradient all-reduce per bucket, no parameter gather),
        ``overlap_grad_reduce=True`` (a bucket's reduce-scatter starts as soon as its gradients
        are ready in the last micro-batch's backward and overlaps the rest of it; the optimizer
        waits for all) and ``overlap_param_gather=True`` (the first bucket's all-gather is
        dispatched at ``zero_grad``, each forward pre-hook of the first micro-batch waits for its
        bucket and dispatches the next). TP all-reduces (or, with sequence parallelism, all-gathers
        and reduce-scatters), CP ring exchanges and MoE all-to-alls are synchronous (critical
        path). ``stage``: the pipeline stage; its ops follow :func:`~phantora_assets.lib.sim.
        pipeline.schedule` with a send/recv per micro-batch between adjacent model chunks."""
        ops = torch_ops(self)
        par = self.spec.par
        model = self.spec.wl.model
        s, h = self.seq * self.mbs, self.hidden
        tp_on = "tp" in self.comms and self.spec.tp > 1
        sp = par.sequence_parallel
        ep_on = "ep" in self.comms
        cp_on = "cp" in self.comms
        gk = "dp_cp" if cp_on else "dp"
        dp = self.grad_sync_size()
        dist_opt = par.zero >= 1
        pp, vs = par.pp, par.virtual_stages
        items: list[Item] = []
        pending_waits: list[str] = []

        def comp(name: str, phase: str, kernels: list) -> None:
            waits = tuple(pending_waits)
            pending_waits.clear()
            if kernels or waits:
                items.append(compute(name, phase, kernels, waits))

        def tp_ar(tag: str) -> None:
            if tp_on and not sp:
                items.append(Collective("tp", "all_reduce", s * h, "Bf16", tag))

        def tp_sp(op: Literal["all_gather", "reduce_scatter"], tag: str) -> None:
            """Sequence parallelism: an all-gather / reduce-scatter of [seq/tp, mbs, hidden]."""
            if tp_on and sp:
                items.append(Collective("tp", op, s * h // self.spec.tp, "Bf16", tag))

        tok = s // self.spec.tp if (tp_on and sp) else s  # tokens a rank routes (MoE with TP: SP)
        etp_on = tp_on and par.etp > 1
        a2a = (tok * self.topk // self.experts) * (self.experts // self.spec.ep) * h if ep_on else 0
        buckets = self.megatron_dense_buckets(stage) if dp > 1 else []
        ebuckets = self.megatron_expert_buckets(stage)
        edp = par.edp if ep_on else 1
        if self.experts and not ep_on:
            edp = par.edp
        bucket_of: dict[str, int] = {p.name: b for b, (_, mem) in enumerate(buckets) for p, _, _ in mem}
        by_module: dict[str, list[Param]] = {}
        for p in self.stage_params(stage):
            if not p.expert:
                by_module.setdefault(p.module, []).append(p)

        # ---- param all-gathers (overlap_param_gather): first needed bucket at zero_grad
        issued: set[int] = set()
        waited: set[int] = set()

        def ag(b: int) -> None:
            if dist_opt and 0 <= b < len(buckets) and b not in issued:
                issued.add(b)
                items.append(
                    Collective(
                        gk, "all_gather", buckets[b][0] // dp, "Bf16", f"ddp.bucket{b}.all_gather", blocking=False
                    )
                )

        def need(*modules: str) -> None:
            if not dist_opt:
                return
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
        if dist_opt:
            for b, (padded, _) in enumerate(ebuckets if edp > 1 else []):  # expert params, gathered over EDP
                tag = f"ddp.expert_bucket{b}.all_gather"
                items.append(Collective("edp", "all_gather", padded // edp, "Bf16", tag, blocking=False))
        first_expert_layer = next((i for i in range(self.layers) if model.is_moe_layer(i)), -1)

        def cp_ring(i: int, phase: str) -> None:
            """Context parallelism (ring attention, p2p): cp - 1 exchanges of this rank's K and V
            chunk ([seq/cp, mbs, kv_heads/tp, head_dim] each) around the CP ring; backward sends
            K, V and their gradients (twice the bytes)."""
            if not cp_on:
                return
            n = par.cp
            kv = 2 * s * (self.kv_heads // self.spec.tp) * self.head_dim * (1 if phase == "fwd" else 2)
            pairs = tuple((k, (k + 1) % n) for k in range(n))
            for step in range(n - 1):
                items.append(SendRecv("cp", pairs, kv, "Bf16", f"layers.{i}.attention.{phase}.cp_ring{step}"))

        def moe_fwd(i: int) -> None:
            comp(f"layers.{i}.router.fwd", "fwd", ops.megatron_router("fwd"))
            if i == first_expert_layer and edp > 1 and dist_opt:
                pending_waits.extend(f"ddp.expert_bucket{b}.all_gather" for b in range(len(ebuckets)))
            if ep_on:
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.dispatch.fwd"))
            if etp_on:
                items.append(
                    Collective("tp", "all_gather", a2a * self.spec.ep, "Bf16", f"layers.{i}.moe.etp.all_gather.fwd")
                )
            kernels = ops.megatron_experts("fwd") + ops._bda("fwd")
            if model.shared_experts:
                kernels += ops.megatron_mlp("fwd", model.shared_experts * self.ffn)
            comp(f"layers.{i}.moe.fwd", "fwd", kernels)
            if etp_on:
                items.append(
                    Collective(
                        "tp", "reduce_scatter", a2a * self.spec.ep, "Bf16", f"layers.{i}.moe.etp.reduce_scatter.fwd"
                    )
                )
            if ep_on:
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.combine.fwd"))

        def moe_bwd(i: int) -> None:
            if ep_on:
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.combine.bwd"))
            if etp_on:
                items.append(
                    Collective("tp", "all_gather", a2a * self.spec.ep, "Bf16", f"layers.{i}.moe.etp.all_gather.bwd")
                )
            kernels = ops._bda("bwd") + ops.megatron_experts("bwd")
            if model.shared_experts:
                kernels += ops.megatron_mlp("bwd", model.shared_experts * self.ffn)
            comp(f"layers.{i}.moe.bwd", "bwd", kernels)
            if etp_on:
                items.append(
                    Collective(
                        "tp", "reduce_scatter", a2a * self.spec.ep, "Bf16", f"layers.{i}.moe.etp.reduce_scatter.bwd"
                    )
                )
            if ep_on:
                items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.dispatch.bwd"))
            comp(f"layers.{i}.router.bwd", "bwd", ops.megatron_router("bwd"))

        def forward(mb: int, v: int) -> None:
            chunk = v * pp + stage
            gate = mb == 0  # overlap_param_gather: the first micro-batch's pre-hooks wait
            if chunk == 0:
                if gate:
                    need("embedding")
                comp("embedding.fwd", "fwd", ops.megatron_embedding("fwd"))
                tp_ar("embedding.fwd.all_reduce")
                tp_sp("reduce_scatter", "embedding.fwd.reduce_scatter")
            for i in self.chunk_layers(stage, v):
                if gate:
                    need(f"layers.{i}.attn")
                tp_sp("all_gather", f"layers.{i}.attention.fwd.all_gather")
                cp_ring(i, "fwd")
                comp(f"layers.{i}.attention.fwd", "fwd", ops.megatron_attention("fwd"))
                tp_ar(f"layers.{i}.attention.fwd.all_reduce")
                tp_sp("reduce_scatter", f"layers.{i}.attention.fwd.reduce_scatter")
                if gate:
                    need(f"layers.{i}.mlp")
                if model.is_moe_layer(i):
                    moe_fwd(i)
                else:
                    tp_sp("all_gather", f"layers.{i}.mlp.fwd.all_gather")
                    comp(f"layers.{i}.mlp.fwd", "fwd", ops.megatron_mlp("fwd", model.ffn_hidden))
                    tp_sp("reduce_scatter", f"layers.{i}.mlp.fwd.reduce_scatter")
                tp_ar(f"layers.{i}.mlp.fwd.all_reduce")
            if chunk == pp * vs - 1:
                if gate:
                    need("final_norm", "output_layer")
                tp_sp("all_gather", "output_layer.fwd.all_gather")
                comp("output_layer.fwd", "fwd", ops.megatron_head("fwd"))
                if tp_on:
                    for k in ("max", "predicted", "sum_exp"):
                        items.append(Collective("tp", "all_reduce", s, "F32", f"cross_entropy.{k}"))

        # ---- backward; in the last micro-batch a bucket's reduce-scatter starts when all its grads are ready
        ready: set[str] = set()
        launched: set[int] = set()
        elaunched: set[int] = set()
        rs_tags: list[str] = []
        sync = [False]

        def grads_ready(*modules: str) -> None:
            if not sync[0]:
                return
            ready.update(modules)
            for b, (padded, mem) in enumerate(buckets):
                if b not in launched and all(p.module in ready for p, _, _ in mem):
                    launched.add(b)
                    comp(f"ddp.bucket{b}.scale", "bwd", ops.megatron_grad_scale(padded))
                    if dist_opt:
                        tag = f"ddp.bucket{b}.reduce_scatter"
                        items.append(Collective(gk, "reduce_scatter", padded // dp, "Bf16", tag, blocking=False))
                    else:
                        tag = f"ddp.bucket{b}.all_reduce"
                        items.append(Collective(gk, "all_reduce", padded, "Bf16", tag, blocking=False))
                    rs_tags.append(tag)
            for b, (padded, mem) in enumerate(ebuckets):
                if b not in elaunched and all(p.module in ready for p, _, _ in mem) and dp > 1:
                    elaunched.add(b)
                    comp(f"ddp.expert_bucket{b}.scale", "bwd", ops.megatron_grad_scale(padded))
                    if edp > 1:  # expert-data-parallel gradient sync, as the dense buckets over DP
                        if dist_opt:
                            tag = f"ddp.expert_bucket{b}.reduce_scatter"
                            items.append(
                                Collective("edp", "reduce_scatter", padded // edp, "Bf16", tag, blocking=False)
                            )
                        else:
                            tag = f"ddp.expert_bucket{b}.all_reduce"
                            items.append(Collective("edp", "all_reduce", padded, "Bf16", tag, blocking=False))
                        rs_tags.append(tag)

        def backward(mb: int, v: int) -> None:
            chunk = v * pp + stage
            if chunk == pp * vs - 1:
                comp("output_layer.bwd", "bwd", ops.megatron_head("bwd"))
                tp_ar("output_layer.bwd.all_reduce")
                tp_sp("all_gather", "output_layer.bwd.all_gather")
                tp_sp("reduce_scatter", "output_layer.bwd.reduce_scatter")
                grads_ready("output_layer", "final_norm")
            for i in reversed(self.chunk_layers(stage, v)):
                if model.is_moe_layer(i):
                    moe_bwd(i)
                else:
                    tp_sp("all_gather", f"layers.{i}.mlp.bwd.all_gather")
                    comp(f"layers.{i}.mlp.bwd", "bwd", ops.megatron_mlp("bwd", model.ffn_hidden))
                    tp_sp("all_gather", f"layers.{i}.mlp.bwd.input_all_gather")
                    tp_sp("reduce_scatter", f"layers.{i}.mlp.bwd.reduce_scatter")
                tp_ar(f"layers.{i}.mlp.bwd.all_reduce")
                grads_ready(f"layers.{i}.mlp")
                tp_sp("all_gather", f"layers.{i}.attention.bwd.all_gather")
                cp_ring(i, "bwd")
                comp(f"layers.{i}.attention.bwd", "bwd", ops.megatron_attention("bwd"))
                tp_ar(f"layers.{i}.attention.bwd.all_reduce")
                tp_sp("all_gather", f"layers.{i}.attention.bwd.input_all_gather")
                tp_sp("reduce_scatter", f"layers.{i}.attention.bwd.reduce_scatter")
                grads_ready(f"layers.{i}.attn")
            if chunk == 0:
                tp_sp("all_gather", "embedding.bwd.all_gather")
                comp("embedding.bwd", "bwd", ops.megatron_embedding("bwd"))
                grads_ready("embedding")

        plan = schedule(par.pp_schedule, pp, stage, par.micro_batches, vs)
        last_b = {v: max(mb for ph, mb, vv in plan if ph == "B" and vv == v) for v in range(vs)}
        for phase, mb, v in plan:
            self._p2p(items, stage, phase, mb, v, "recv")
            if phase == "F":
                forward(mb, v)
            else:
                sync[0] = mb == last_b[v]  # no_sync for the other micro-batches
                backward(mb, v)
            self._p2p(items, stage, phase, mb, v, "send")
        pending_waits.extend(rs_tags)  # finish_grad_sync
        if dp > 1:
            items.append(Collective(gk, "all_reduce", 1, "F32", "loss.average"))
            items.append(Collective(gk, "all_reduce", 1, "F32", "grad_norm.dp"))
        if tp_on:
            items.append(Collective("tp", "all_reduce", 1, "F32", "grad_norm.tp"))
        if pp > 1:
            items.append(Collective("pp", "all_reduce", 1, "F32", "grad_norm.pp"))
        comp("optimizer.step", "opt", ops.megatron_optimizer(self.megatron_optimizer_groups(stage), warmup))
        return items

    def _deepspeed_zero12_step(self, warmup: bool) -> list[Item]:
        """DeepSpeed ZeRO stage 1 / 2 (bf16, ``reduce_scatter: true``, ``overlap_comm`` off): as
        stage 0 but each 5e8-element gradient bucket is reduce-scattered (ceil(bucket / dp) per
        rank) instead of all-reduced; the updated bf16 partitions are all-gathered after the step."""
        return self._deepspeed_zero0_step(warmup, reduce_scatter=True)

    def _deepspeed_zero0_step(self, warmup: bool, reduce_scatter: bool = False) -> list[Item]:
        """DeepSpeed 1-stage pipeline, bf16 optimizer (ZeRO stage 0): synchronous gradient
        all-reduce after the backward, synchronous parameter all-gather after the step (no
        overlap on this path: ``_exec_reduce_grads`` / ``update_lp_params``). With gradient
        accumulation the forward and backward repeat per micro-batch, the reduction once."""
        ops = torch_ops(self)
        items: list[Item] = []
        for _ in range(self.spec.par.micro_batches):
            items.append(compute("embedding.fwd", "fwd", ops.hf_rotary()))
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

            def reduce(n: int, b: int) -> Collective:
                if reduce_scatter:
                    return Collective("dp", "reduce_scatter", -(-n // dp), "Bf16", f"reduce_scatter.bucket{b}")
                return Collective("dp", "all_reduce", n, "Bf16", f"allreduce.bucket{b}")

            for p in reversed(self.params):
                cur += p.numel
                if cur >= DEEPSPEED_BUCKET_ELEMENTS:
                    items.append(reduce(cur, b))
                    cur, b = 0, b + 1
            if cur:
                items.append(reduce(cur, b))
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

    def _torchtitan_step(self, warmup: bool, stage: int = 0) -> list[Item]:
        """TorchTitan (``torchtitan/models/llama3/infra/parallelize.py``, ``torch.distributed.
        pipelining``) on stage ``stage``. FSDP2 (zero = 3, or 2 = ``reshard_after_forward=False``):
        every transformer block is a ``fully_shard`` unit, the root unit holds the embedding, final
        norm and output layer; a unit's bf16 parameters are all-gathered over the dp_shard x cp
        mesh before its forward (the next block's gather issued one ahead: FSDP2's implicit
        prefetch) and, with zero = 3, again before its backward; in the step's last micro-batch
        its gradients are reduce-scattered in fp32 (``reduce_dtype=float32``) after its backward
        and, with HSDP (dp_replicate > 1), all-reduced over dp_replicate; the root unit is
        gathered once per micro-batch and reduced after the whole backward. zero = 0: DDP, fp32
        gradient all-reduce in 25 MiB buckets after the last backward. TP (``tp > 1``) follows
        torchtitan's plan, always sequence parallel: all-gather before and reduce-scatter after
        attention and feed-forward, a reduce-scatter after the embedding, an all-gather before the
        output layer, loss_parallel's three fp32 all-reduces. PP: as Megatron's (send/recv per
        micro-batch). The optimizer (AdamW, foreach) updates the local shard."""
        ops = torch_ops(self)
        par = self.spec.par
        s, h = self.seq * self.mbs, self.hidden
        tp_on = "tp" in self.comms and self.spec.tp > 1
        pp, vs = par.pp, par.virtual_stages
        fsdp = par.zero >= 2
        reshard = par.zero == 3
        n = len(self.comms["dp"][0].ranks)  # FSDP mesh: dp_shard x cp
        hsdp = "dp_rep" in self.comms
        items: list[Item] = []
        pending: list[str] = []

        def comp(name: str, phase: str, kernels: list) -> None:
            waits = tuple(pending)
            pending.clear()
            if kernels or waits:
                items.append(compute(name, phase, kernels, waits))

        def tp_c(op: str, tag: str) -> None:
            if tp_on:
                if op == "ag":
                    items.append(Collective("tp", "all_gather", s * h // self.spec.tp, "Bf16", tag))
                else:
                    items.append(Collective("tp", "reduce_scatter", s * h // self.spec.tp, "Bf16", tag))

        units: dict[str, int] = {}
        for p in self.stage_params(stage):
            u = ".".join(p.module.split(".")[:2]) if p.module.startswith("layers.") else "root"
            units[u] = units.get(u, 0) + -(-self.local_numel(p) // n)
        gathered: set[tuple[str, str, int]] = set()
        rs_tags: list[str] = []

        def gather(u: str, phase: str, mb: int) -> None:
            tag = f"fsdp.{u}.{phase}.mb{mb}.all_gather"
            if fsdp and u in units and (u, phase, mb) not in gathered:
                gathered.add((u, phase, mb))
                items.append(Collective("dp", "all_gather", units[u], "Bf16", tag, blocking=False))

        def wait(u: str, phase: str, mb: int) -> None:
            if fsdp and u in units:
                pending.append(f"fsdp.{u}.{phase}.mb{mb}.all_gather")

        def reduce(u: str) -> None:
            if fsdp and u in units:
                tag = f"fsdp.{u}.reduce_scatter"
                items.append(Collective("dp", "reduce_scatter", units[u], "F32", tag, blocking=False))
                rs_tags.append(tag)
                if hsdp:
                    tag = f"fsdp.{u}.all_reduce"
                    items.append(Collective("dp_rep", "all_reduce", units[u], "F32", tag, blocking=False))
                    rs_tags.append(tag)

        def forward(mb: int, v: int) -> None:
            chunk = v * pp + stage
            layers = list(self.chunk_layers(stage, v))
            gather("root", "fwd", mb)
            wait("root", "fwd", mb)
            if layers:
                gather(f"layers.{layers[0]}", "fwd", mb)
            if chunk == 0:
                comp("embedding.fwd", "fwd", ops.hf_rotary())
                tp_c("rs", "embedding.fwd.reduce_scatter")
            for k, i in enumerate(layers):
                if k + 1 < len(layers):
                    gather(f"layers.{layers[k + 1]}", "fwd", mb)
                wait(f"layers.{i}", "fwd", mb)
                tp_c("ag", f"layers.{i}.attention.fwd.all_gather")
                comp(f"layers.{i}.attention.fwd", "fwd", ops.hf_attention("fwd"))
                tp_c("rs", f"layers.{i}.attention.fwd.reduce_scatter")
                tp_c("ag", f"layers.{i}.mlp.fwd.all_gather")
                comp(f"layers.{i}.mlp.fwd", "fwd", ops.hf_llama_mlp("fwd"))
                tp_c("rs", f"layers.{i}.mlp.fwd.reduce_scatter")
            if chunk == pp * vs - 1:
                tp_c("ag", "output_layer.fwd.all_gather")
                comp("output_layer.fwd", "fwd", ops.hf_head("fwd"))
                if tp_on:
                    for k2 in ("max", "sum_exp", "target"):
                        items.append(Collective("tp", "all_reduce", s, "F32", f"loss_parallel.{k2}"))

        def backward(mb: int, v: int, sync: bool) -> None:
            chunk = v * pp + stage
            layers = list(reversed(self.chunk_layers(stage, v)))
            if reshard and layers:
                gather(f"layers.{layers[0]}", "bwd", mb)
            if chunk == pp * vs - 1:
                comp("output_layer.bwd", "bwd", ops.hf_head("bwd"))
                tp_c("ag", "output_layer.bwd.all_gather")
                tp_c("rs", "output_layer.bwd.reduce_scatter")
            for k, i in enumerate(layers):
                if reshard:
                    if k + 1 < len(layers):
                        gather(f"layers.{layers[k + 1]}", "bwd", mb)
                    wait(f"layers.{i}", "bwd", mb)
                tp_c("ag", f"layers.{i}.mlp.bwd.all_gather")
                comp(f"layers.{i}.mlp.bwd", "bwd", ops.hf_llama_mlp("bwd"))
                tp_c("rs", f"layers.{i}.mlp.bwd.reduce_scatter")
                tp_c("ag", f"layers.{i}.attention.bwd.all_gather")
                comp(f"layers.{i}.attention.bwd", "bwd", ops.hf_attention("bwd"))
                tp_c("rs", f"layers.{i}.attention.bwd.reduce_scatter")
                if sync:
                    reduce(f"layers.{i}")
            if chunk == 0:
                comp("embedding.bwd", "bwd", [])

        plan = schedule(par.pp_schedule, pp, stage, par.micro_batches, vs)
        last_b = max(mb for ph, mb, _ in plan if ph == "B")
        for phase, mb, v in plan:
            self._p2p(items, stage, phase, mb, v, "recv")
            if phase == "F":
                forward(mb, v)
            else:
                backward(mb, v, mb == last_b)
            self._p2p(items, stage, phase, mb, v, "send")
        reduce("root")
        local = sum(self.local_numel(p) for p in self.stage_params(stage))
        if not fsdp and len(self.comms["dp"][0].ranks) > 1:  # DDP: fp32 buckets of 25 MiB
            bucket, left, b = 25 * 2**20 // 4, local, 0
            while left > 0:
                cnt = min(bucket, left)
                tag = f"ddp.bucket{b}.all_reduce"
                items.append(Collective("dp", "all_reduce", cnt, "F32", tag, blocking=False))
                rs_tags.append(tag)
                left, b = left - cnt, b + 1
        pending.extend(rs_tags)
        items.append(Collective("dp", "all_reduce", 1, "F32", "grad_norm.dp"))
        if tp_on:
            items.append(Collective("tp", "all_reduce", 1, "F32", "grad_norm.tp"))
        if pp > 1:
            items.append(Collective("pp", "all_reduce", 1, "F32", "grad_norm.pp"))
        shard = sum(units.values()) if fsdp else local
        comp("optimizer.step", "opt", ops.adam_flat(shard, warmup, False, False))
        return items
