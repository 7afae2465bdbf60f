"""The Megatron-core step program of one pipeline stage, and the pipeline send/recv rule.

:func:`megatron_step` builds the items (:mod:`~phantora_assets.lib.sim.workload_types`) one rank
of a pipeline stage issues per training step (rules in its docstring and docs/WORKLOADS.md);
:func:`p2p` adds the send or receive of activations / gradients between adjacent model chunks
(also used by :mod:`~phantora_assets.lib.workload.torchtitan`). ``self`` is the run's
:class:`~phantora_assets.lib.sim.workload_layout.WorkloadLayout`. No Dagster import.
"""

from __future__ import annotations

from typing import Literal

from phantora_assets.lib.sim.torch_ops import torch_ops
from phantora_assets.lib.sim.workload_layout import WorkloadLayout
from phantora_assets.lib.sim.workload_types import AllToAll, Collective, Item, Param, SendRecv, compute
from phantora_assets.lib.workload.pipeline import schedule
from phantora_assets.lib.workload.spec import PHANTORA_DTYPE


def p2p(self: WorkloadLayout, items: list[Item], stage: int, phase: str, mb: int, v: int, side: str) -> None:
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


def megatron_step(self: WorkloadLayout, warmup: bool, stage: int = 0) -> list[Item]:  # noqa: C901, PLR0912, PLR0915 (Megatron-core's step in program order, a branch per option)
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
    # the gradient buffer's dtype, which its reduce-scatters / all-reduces and finalize_model_grads'
    # norm all-reduce carry (DDPConfig grad_reduce_in_fp32: train.grad_reduce_dtype); parameters
    # are all-gathered in their own dtype, bf16
    gdt = PHANTORA_DTYPE[self.spec.wl.train.grad_reduce_dtype]
    dp = self.grad_sync_size()
    dist_opt = par.zero >= 1
    # overlap_grad_reduce = False (Megatron's CLI default; True here by default, as Phantora's
    # tests/test_megatron.py runs it): param_and_grad_buffer.py finish_grad_sync "If
    # overlap_grad_reduce is False, start (and finish) synchronous communication call here": every
    # bucket reduced after the whole backward, blocking. overlap_param_gather needs it
    # (arguments.py: "--overlap-grad-reduce should be turned on when using --overlap-param-gather"),
    # so the distributed optimizer then all-gathers the parameters synchronously at the end of its
    # step (distrib_optimizer.py step_with_ready_grads: start_param_sync when not overlap_param_gather)
    ogr = par.overlap_grad_reduce
    pp, vs = par.pp, par.virtual_stages
    items: list[Item] = []
    pending_waits: list[str] = []

    overlap = tp_on and sp and par.tp_comm_overlap
    tp_inflight: list[str] = []  # tp_comm_overlap: TP collectives issued since the last compute
    tp_carry: list[str] = []  # ... and those issued before it: the next compute waits for them

    def comp(name: str, phase: str, kernels: list) -> None:
        waits = tuple(pending_waits)
        pending_waits.clear()
        if kernels or waits:
            if overlap:  # a TP collective runs beside the compute after it, waited one compute later
                waits += tuple(tp_carry)
                tp_carry[:] = tp_inflight
                tp_inflight.clear()
            items.append(compute(name, phase, kernels, waits))

    def tp_ar(tag: str) -> None:
        if tp_on and not sp:
            items.append(Collective("tp", "all_reduce", s * h, "Bf16", tag))

    def tp_sp(op: Literal["all_gather", "reduce_scatter"], tag: str) -> None:
        """Sequence parallelism: an all-gather / reduce-scatter of [seq/tp, mbs, hidden]."""
        if tp_on and sp:
            items.append(Collective("tp", op, s * h // self.spec.tp, "Bf16", tag, blocking=not overlap))
            if overlap:
                tp_inflight.append(tag)

    tok = s // self.spec.tp if (tp_on and sp) else s  # tokens a rank routes (MoE with TP: SP)
    etp_on = tp_on and par.etp > 1
    # hidden vectors a rank sends each EP peer (balanced routing); expert TP all-gathers the ep
    # peers' shares it received (dispatch_postprocess gathers whenever the expert TP size > 1,
    # with or without EP)
    routed = (tok * self.topk // self.experts) * (self.experts // self.spec.ep) * h if self.experts else 0
    a2a = routed if ep_on else 0
    etp_n = routed * self.spec.ep
    # one DDP buffer per model chunk (interleaved: every chunk its own DistributedDataParallel),
    # their buckets numbered chunk by chunk
    buffers = self.megatron_dense_buffers(stage) if dp > 1 else []
    buckets = [b for buf in buffers for b in buf]
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
        if dist_opt and ogr and 0 <= b < len(buckets) and b not in issued:
            issued.add(b)
            items.append(
                Collective(gk, "all_gather", buckets[b][0] // dp, "Bf16", f"ddp.bucket{b}.all_gather", blocking=False)
            )

    def need(*modules: str) -> None:
        if not dist_opt or not ogr:
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
        ag(len(buffers[0]) - 1)  # the first chunk's first needed bucket (its last: reverse order)
    if dist_opt and ogr:
        for b, (padded, _) in enumerate(ebuckets if edp > 1 else []):  # expert params, gathered over EDP
            tag = f"ddp.expert_bucket{b}.all_gather"
            items.append(Collective("edp", "all_gather", padded // edp, "Bf16", tag, blocking=False))
    first_expert_layer = next((i for i in range(self.layers) if model.is_moe_layer(i)), -1)

    def cp_ring(i: int, phase: str) -> None:
        """Context parallelism, Transformer Engine's P2P ring (``AttnFuncWithCPAndKVP2P``): the
        rank's K and V chunk ([seq/cp, mbs, kv_heads/tp, head_dim] each, one packed buffer).
        Forward: cp - 1 sends to the next CP rank. Backward: cp steps, each a send to the
        previous rank: the KV chunk at the first, its gradient dKV at the last, KV and dKV
        together (twice the bytes) at the cp - 2 in between."""
        if not cp_on:
            return
        n = par.cp
        kv = 2 * s * (self.kv_heads // self.spec.tp) * self.head_dim
        if phase == "fwd":
            pairs = tuple((k, (k + 1) % n) for k in range(n))
            for step in range(n - 1):
                items.append(SendRecv("cp", pairs, kv, "Bf16", f"layers.{i}.attention.{phase}.cp_ring{step}"))
            return
        pairs = tuple((k, (k - 1) % n) for k in range(n))
        for step in range(n):
            count = kv if step in (0, n - 1) else 2 * kv
            items.append(SendRecv("cp", pairs, count, "Bf16", f"layers.{i}.attention.{phase}.cp_ring{step}"))

    def moe_fwd(i: int) -> None:
        comp(f"layers.{i}.router.fwd", "fwd", ops.megatron_router("fwd"))
        if i == first_expert_layer and edp > 1 and dist_opt and ogr:
            pending_waits.extend(f"ddp.expert_bucket{b}.all_gather" for b in range(len(ebuckets)))
        if ep_on:
            items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.dispatch.fwd"))
        if etp_on:
            items.append(Collective("tp", "all_gather", etp_n, "Bf16", f"layers.{i}.moe.etp.all_gather.fwd"))
        comp(f"layers.{i}.moe.fwd", "fwd", ops.megatron_experts("fwd") + ops._bda("fwd"))
        if etp_on:
            items.append(Collective("tp", "reduce_scatter", etp_n, "Bf16", f"layers.{i}.moe.etp.reduce_scatter.fwd"))
        if ep_on:
            items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.combine.fwd"))
        if model.shared_experts:  # SharedExpertMLP (shared_experts.py): a TP MLP on the input, after the combine
            tp_sp("all_gather", f"layers.{i}.shared_experts.fwd.all_gather")
            comp(f"layers.{i}.shared_experts.fwd", "fwd", ops.megatron_mlp("fwd", model.shared_experts * self.ffn))
            tp_sp("reduce_scatter", f"layers.{i}.shared_experts.fwd.reduce_scatter")
            tp_ar(f"layers.{i}.shared_experts.fwd.all_reduce")

    def moe_bwd(i: int) -> None:
        if model.shared_experts:  # the shared TP MLP's backward, as a dense MLP's
            tp_sp("all_gather", f"layers.{i}.shared_experts.bwd.all_gather")
            comp(f"layers.{i}.shared_experts.bwd", "bwd", ops.megatron_mlp("bwd", model.shared_experts * self.ffn))
            tp_sp("all_gather", f"layers.{i}.shared_experts.bwd.input_all_gather")
            tp_sp("reduce_scatter", f"layers.{i}.shared_experts.bwd.reduce_scatter")
            tp_ar(f"layers.{i}.shared_experts.bwd.all_reduce")
        if ep_on:
            items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.combine.bwd"))
        if etp_on:
            items.append(Collective("tp", "all_gather", etp_n, "Bf16", f"layers.{i}.moe.etp.all_gather.bwd"))
        comp(f"layers.{i}.moe.bwd", "bwd", ops._bda("bwd") + ops.megatron_experts("bwd"))
        if etp_on:
            items.append(Collective("tp", "reduce_scatter", etp_n, "Bf16", f"layers.{i}.moe.etp.reduce_scatter.bwd"))
        if ep_on:
            items.append(AllToAll("ep", a2a, "Bf16", f"layers.{i}.moe.dispatch.bwd"))
        comp(f"layers.{i}.router.bwd", "bwd", ops.megatron_router("bwd"))

    def layer_fwd(i: int, gate: bool) -> None:
        """Layer i's forward (again before its backward with full recompute: its collectives too)."""
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

    full_recompute = self.spec.wl.train.recompute == "full"

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
            layer_fwd(i, gate)
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
        """overlap_grad_reduce: the buckets whose gradients are all ready start their reduction
        (asynchronous, waited by the optimizer); without it (``finish``: after the backward) every
        bucket is reduced in order, each call blocking."""
        if not sync[0]:
            return
        ready.update(modules)
        blocking = not ogr
        for b, (padded, mem) in enumerate(buckets):
            if b not in launched and all(p.module in ready for p, _, _ in mem):
                launched.add(b)
                comp(f"ddp.bucket{b}.scale", "bwd", ops.megatron_grad_scale(padded))
                if dist_opt:
                    tag = f"ddp.bucket{b}.reduce_scatter"
                    items.append(Collective(gk, "reduce_scatter", padded // dp, gdt, tag, blocking=blocking))
                else:
                    tag = f"ddp.bucket{b}.all_reduce"
                    items.append(Collective(gk, "all_reduce", padded, gdt, tag, blocking=blocking))
                if not blocking:
                    rs_tags.append(tag)
        for b, (padded, mem) in enumerate(ebuckets):
            # the expert mesh replicates each expert over edp = tp cp dp / (ep etp) ranks: with
            # etp < tp also at dp x cp = 1
            if b not in elaunched and all(p.module in ready for p, _, _ in mem) and (dp > 1 or edp > 1):
                elaunched.add(b)
                comp(f"ddp.expert_bucket{b}.scale", "bwd", ops.megatron_grad_scale(padded))
                if edp > 1:  # expert-data-parallel gradient sync, as the dense buckets over DP
                    if dist_opt:
                        tag = f"ddp.expert_bucket{b}.reduce_scatter"
                        items.append(Collective("edp", "reduce_scatter", padded // edp, gdt, tag, blocking=blocking))
                    else:
                        tag = f"ddp.expert_bucket{b}.all_reduce"
                        items.append(Collective("edp", "all_reduce", padded, gdt, tag, blocking=blocking))
                    if not blocking:
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
            if full_recompute:  # tensor_parallel.checkpoint of the whole layer: its forward runs again
                layer_fwd(i, False)
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
        p2p(self, items, stage, phase, mb, v, "recv")
        if phase == "F":
            forward(mb, v)
        else:
            sync[0] = ogr and mb == last_b[v]  # no_sync for the other micro-batches
            backward(mb, v)
        p2p(self, items, stage, phase, mb, v, "send")
    if not ogr:  # finish_grad_sync: every bucket's reduction now, synchronous
        sync[0] = True
        grads_ready(*{p.module for p in self.stage_params(stage)})
    pending_waits.extend(rs_tags)  # finish_grad_sync
    pending_waits.extend(tp_carry + tp_inflight)  # tp_comm_overlap: the last TP collectives
    if dp > 1:
        items.append(Collective(gk, "all_reduce", 1, "F32", "loss.average"))
        items.append(Collective(gk, "all_reduce", 1, "F32", "grad_norm.dp"))
    if tp_on and sp:
        # finalize_model_grads: the gradients of the sequence-parallel (replicated) parameters, one
        # coalesced buffer: the norm weights and the MoE router's weight (router.py sets its
        # sequence_parallel attribute)
        norms = sum(
            p.numel
            for p in self.stage_params(stage)
            if not p.tp_sharded and not p.expert and (len(p.shape) == 1 or p.name.endswith(".router.weight"))
        )
        items.append(Collective("tp", "all_reduce", norms, gdt, "finalize.layernorm_grads.all_reduce"))
    if tp_on:
        items.append(Collective("tp", "all_reduce", 1, "F32", "grad_norm.tp"))
    if pp > 1:
        items.append(Collective("pp", "all_reduce", 1, "F32", "grad_norm.pp"))
    comp("optimizer.step", "opt", ops.megatron_optimizer(self.megatron_optimizer_groups(stage), warmup))
    if dist_opt and not ogr:  # no overlap_param_gather: the optimizer step's synchronous all-gathers
        for b, (padded, _) in enumerate(buckets):
            items.append(Collective(gk, "all_gather", padded // dp, "Bf16", f"ddp.bucket{b}.all_gather"))
        for b, (padded, _) in enumerate(ebuckets if edp > 1 else []):
            items.append(Collective("edp", "all_gather", padded // edp, "Bf16", f"ddp.expert_bucket{b}.all_gather"))
    return items
