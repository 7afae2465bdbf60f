"""The TorchTitan step program of one pipeline stage (FSDP2 / DDP, TP, PP, CP).

:func:`torchtitan_step` builds the items one rank of a pipeline stage issues per step (rules in
its docstring and docs/WORKLOADS.md); ``self`` is the run's
:class:`~phantora_assets.lib.sim.workload_layout.WorkloadLayout`. No Dagster import.
"""

from __future__ import annotations

from phantora_assets.lib.sim.kernels import Kernel, fuse_pointwise
from phantora_assets.lib.sim.torch_ops import torch_ops
from phantora_assets.lib.sim.workload_layout import WorkloadLayout
from phantora_assets.lib.sim.workload_types import Collective, Item, SendRecv, compute
from phantora_assets.lib.workload.megatron import p2p
from phantora_assets.lib.workload.pipeline import schedule
from phantora_assets.lib.workload.spec import PHANTORA_DTYPE

#: torch DDP's bucket caps in bytes: the first bucket ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB), the
#: others torchtitan's ``replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)`` (apply_ddp)
DDP_FIRST_BUCKET_BYTES = 2**20
DDP_BUCKET_BYTES = 100 * 2**20


def ddp_buckets(sizes: list[int], elem_bytes: int = 4) -> list[int]:
    """Element counts of torch DDP's gradient buckets (``Reducer``, ``compute_bucket_assignment_by_size``):
    ``sizes`` (elements per parameter) in the order their gradients become ready; a bucket closes
    once it holds >= its cap (the first ``DDP_FIRST_BUCKET_BYTES``, the rest ``DDP_BUCKET_BYTES``)."""
    out: list[int] = []
    n = 0
    for k in sizes:
        n += k
        cap = DDP_FIRST_BUCKET_BYTES if not out else DDP_BUCKET_BYTES
        if n * elem_bytes >= cap:
            out.append(n)
            n = 0
    if n:
        out.append(n)
    return out


def sac_recompute(block_fwd: list[Kernel]) -> list[Kernel]:
    """What torchtitan's per-op selective activation checkpointing (``selective_ac_option =
    "op"``, ``_save_list``) runs again before a block's backward: every op of the block's forward
    except fused attention (saved) and the saved matmuls: of the block's matmuls in forward order
    (wq, wk, wv, wo, w1, w3, w2) every second one is recomputed (wk, wo, w3), the others saved."""
    out, mm = [], 0
    for k in block_fwd:
        if k.op.startswith("FlashAttention"):
            continue
        if k.flops:
            mm += 1
            if mm % 2:
                continue
        out.append(k)
    return out


def torchtitan_step(self: WorkloadLayout, warmup: bool, stage: int = 0) -> list[Item]:  # noqa: C901, PLR0915 (torchtitan's step in program order, a branch per option)
    """TorchTitan (``torchtitan/models/llama3/infra/parallelize.py``, ``torch.distributed.
    pipelining``) on stage ``stage``. FSDP2 (zero = 3, or 2 = ``reshard_after_forward=False``):
    every transformer block is a ``fully_shard`` unit, the root unit holds the embedding, final
    norm and output layer; a unit's bf16 parameters are all-gathered over the dp_shard x cp
    mesh before its forward (the next block's gather issued one ahead: FSDP2's implicit
    prefetch) and, with zero = 3, again before its backward; in the step's last micro-batch
    its gradients are reduce-scattered in fp32 (``reduce_dtype=float32``) after its backward
    and, with HSDP (dp_replicate > 1), all-reduced over dp_replicate; the root unit is
    gathered once per micro-batch and reduced after the whole backward. zero = 0: DDP
    (``replicate``, 1-D only: the schema refuses it with tp, pp or cp), fp32 gradient all-reduce
    in torch DDP's buckets (1 MiB first, then 100 MiB) after every micro-batch's backward
    (torchtitan's train_step runs ``backward()`` per micro-batch, no ``no_sync``). CP (``cp > 1``,
    torch ``_context_parallel`` ring attention, torchtitan's default rotate method "allgather"):
    per block and micro-batch an all-gather of the packed local K and V (bf16) over cp in forward
    (again in a full-AC recompute; per-op SAC saves the SDPA output), in backward the same
    all-gather and cp sends of the fp32 dK / dV accumulator to the next cp rank (the dKV rotater
    is all-to-all: ``permute_tensor``, one peer). TP (``tp > 1``) follows
    torchtitan's plan, always sequence parallel: all-gather before and reduce-scatter after
    attention and feed-forward, a reduce-scatter after the embedding, an all-gather before the
    output layer, loss_parallel's three fp32 all-reduces; backward: the transposes (an
    all-gather for each reduce-scatter and vice versa), but the output layer's backward only
    reduce-scatters (its gathered input is saved). Recompute before a block's backward: full AC
    reruns its forward, TP collectives included; per-op SAC reruns the two TP all-gathers (the
    reduce-scatters' outputs are on the save list). PP: as Megatron's (send/recv per
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
    cp_n = par.cp if "cp" in self.comms else 1
    # K and V as SDPA gets them (torchtitan GQA without repeats: kv_heads / tp heads of [mbs, seq / cp, d])
    kv = 2 * s * (self.kv_heads // self.spec.tp) * self.head_dim
    full_ac = self.spec.wl.train.recompute == "full"
    sac = self.spec.wl.train.recompute == "selective"
    items: list[Item] = []
    pending: list[str] = []

    compiled = self.spec.wl.train.compile  # torch.compile per block: element-wise runs fused

    copy_out: list[Kernel] = []  # uncaptured_kernels: FSDP2 copy-outs of the gathers waited for

    def comp(name: str, phase: str, kernels: list) -> None:
        waits = tuple(pending)
        pending.clear()
        kernels, copy_out[:] = copy_out + (fuse_pointwise(kernels) if compiled else kernels), []
        if kernels or waits:
            items.append(compute(name, phase, kernels, waits))

    def tp_c(op: str, tag: str) -> None:
        if tp_on:
            if op == "ag":
                items.append(Collective("tp", "all_gather", s * h // self.spec.tp, "Bf16", tag))
            else:
                items.append(Collective("tp", "reduce_scatter", s * h // self.spec.tp, "Bf16", tag))

    def cp_kv(tag: str) -> None:
        """torch ``_templated_ring_attention`` (``_AllGatherRotater``): K and V flattened into one
        buffer, all-gathered once over the cp mesh (the rotater's only collective)."""
        if cp_n > 1:
            items.append(Collective("cp", "all_gather", kv, "Bf16", tag))

    def cp_dkv(i: int) -> None:
        """torch ``_templated_ring_attention_backward``: ``dkv_rotater`` is ``_AllToAllRotater``
        (``permute_tensor`` to rank + 1, an all-to-all with one non-empty split: a send), called at
        each of the cp steps; the accumulator is fp32 (``convert_to_f32``)."""
        if cp_n > 1:
            pairs = tuple((k, (k + 1) % cp_n) for k in range(cp_n))
            for step in range(cp_n):
                items.append(SendRecv("cp", pairs, kv, "F32", f"layers.{i}.attention.bwd.cp_dkv{step}"))

    units: dict[str, int] = {}
    for p in self.stage_params(stage):
        u = ".".join(p.module.split(".")[:2]) if p.module.startswith("layers.") else "root"
        rows = p.shape[0] if p.shape else self.local_numel(p)  # fully_shard splits dim 0 in ceil(rows / n)
        units[u] = units.get(u, 0) + -(-rows // n) * (self.local_numel(p) // max(rows, 1))
    gathered: set[tuple[str, str, int]] = set()
    copied: set[tuple[str, str, int]] = set()
    rs_tags: list[str] = []

    def gather(u: str, phase: str, mb: int) -> None:
        phase, mb = ("fwd", 0) if pp > 1 else (phase, mb)  # with PP a unit is gathered once a step
        tag = f"fsdp.{u}.{phase}.mb{mb}.all_gather"
        if fsdp and u in units and (u, phase, mb) not in gathered:
            gathered.add((u, phase, mb))
            items.append(Collective("dp", "all_gather", units[u], "Bf16", tag, blocking=False))

    def wait(u: str, phase: str, mb: int) -> None:
        phase, mb = ("fwd", 0) if pp > 1 else (phase, mb)
        if fsdp and u in units:
            tag = f"fsdp.{u}.{phase}.mb{mb}.all_gather"
            if tag not in pending and (u, phase, mb) not in copied:
                copied.add((u, phase, mb))
                copy_out.extend(ops.hw_fsdp_copy_out(units[u] * n))
            pending.append(tag)

    def regather(i: int) -> bool:
        """Block i is gathered again for its backward: zero 3 without PP, all but the last block
        (torchtitan: reshard_after_forward = layer_id < n_layers - 1; with PP: never)."""
        return reshard and pp == 1 and i < self.layers - 1

    # FSDP2's MixedPrecisionPolicy reduce_dtype (train.grad_reduce_dtype: torchtitan's only choice, fp32)
    gdt = PHANTORA_DTYPE[self.spec.wl.train.grad_reduce_dtype]

    def reduce(u: str) -> None:
        if fsdp and u in units:
            tag = f"fsdp.{u}.reduce_scatter"
            if ops.hw:  # the reduce-scatter input's fp32 copy-in (uncaptured_kernels)
                items.append(compute(f"fsdp.{u}.reduce_scatter.copy_in", "bwd", ops.hw_fsdp_rs_copy_in(units[u] * n)))
            items.append(Collective("dp", "reduce_scatter", units[u], gdt, tag, blocking=False))
            rs_tags.append(tag)
            if hsdp:
                tag = f"fsdp.{u}.all_reduce"
                items.append(Collective("dp_rep", "all_reduce", units[u], gdt, tag, blocking=False))
                rs_tags.append(tag)

    def forward(mb: int, v: int) -> None:
        chunk = v * pp + stage
        layers = list(self.chunk_layers(stage, v))
        gather("root", "fwd", mb)
        wait("root", "fwd", mb)
        if layers:
            gather(f"layers.{layers[0]}", "fwd", mb)
        if chunk == 0:
            comp("embedding.fwd", "fwd", ops.hw_embedding("fwd") + ops.hf_rotary())
            tp_c("rs", "embedding.fwd.reduce_scatter")
        for k, i in enumerate(layers):
            if k + 1 < len(layers):
                gather(f"layers.{layers[k + 1]}", "fwd", mb)
            wait(f"layers.{i}", "fwd", mb)
            tp_c("ag", f"layers.{i}.attention.fwd.all_gather")
            cp_kv(f"layers.{i}.attention.fwd.cp_all_gather")
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
        if layers and regather(layers[0]):
            gather(f"layers.{layers[0]}", "bwd", mb)
        if chunk == pp * vs - 1:
            # ColwiseParallel(input_layouts=Shard(1)): DTensor saved the all-gathered input, so the
            # backward only reduce-scatters the input gradient back to Shard(1)
            comp("output_layer.bwd", "bwd", ops.hf_head("bwd"))
            tp_c("rs", "output_layer.bwd.reduce_scatter")
        for k, i in enumerate(layers):
            if k + 1 < len(layers) and regather(layers[k + 1]):
                gather(f"layers.{layers[k + 1]}", "bwd", mb)
            if regather(i):
                wait(f"layers.{i}", "bwd", mb)
            if full_ac:  # checkpointed block: its forward, TP redistributes included, runs again
                tp_c("ag", f"layers.{i}.attention.recompute.all_gather")
                cp_kv(f"layers.{i}.attention.recompute.cp_all_gather")
                comp(f"layers.{i}.attention.recompute", "bwd", ops.hf_attention("fwd"))
                tp_c("rs", f"layers.{i}.attention.recompute.reduce_scatter")
                tp_c("ag", f"layers.{i}.mlp.recompute.all_gather")
                comp(f"layers.{i}.mlp.recompute", "bwd", ops.hf_llama_mlp("fwd"))
                tp_c("rs", f"layers.{i}.mlp.recompute.reduce_scatter")
            if sac:
                # per-op SAC: the block's unsaved ops run again. The save list (torchtitan
                # models/llama3/infra/parallelize.py _op_sac_save_list) holds mm, SDPA, max and
                # _c10d_functional.reduce_scatter_tensor, not all_gather_into_tensor: the
                # sequence-parallel inputs of attention and feed-forward are all-gathered again
                # (the wo / w2 reduce-scatters are saved)
                tp_c("ag", f"layers.{i}.attention.recompute.all_gather")
                tp_c("ag", f"layers.{i}.mlp.recompute.all_gather")
                comp(f"layers.{i}.recompute", "bwd", sac_recompute(ops.hf_attention("fwd") + ops.hf_llama_mlp("fwd")))
            tp_c("ag", f"layers.{i}.mlp.bwd.all_gather")
            comp(f"layers.{i}.mlp.bwd", "bwd", ops.hf_llama_mlp("bwd"))
            tp_c("rs", f"layers.{i}.mlp.bwd.reduce_scatter")
            tp_c("ag", f"layers.{i}.attention.bwd.all_gather")
            cp_kv(f"layers.{i}.attention.bwd.cp_all_gather")
            comp(f"layers.{i}.attention.bwd", "bwd", ops.hf_attention("bwd"))
            cp_dkv(i)
            tp_c("rs", f"layers.{i}.attention.bwd.reduce_scatter")
            if sync:
                reduce(f"layers.{i}")
        if chunk == 0:
            # RowwiseParallel(output_layouts=Shard(1)): the forward's Partial -> Shard(1)
            # reduce-scatter is an all-gather of the output gradient in backward
            tp_c("ag", "embedding.bwd.all_gather")
            comp("embedding.bwd", "bwd", ops.hw_embedding("bwd"))
        if sync and pp == 1:
            reduce("root")  # no PP: every backward reduce-scatters (gradient sync stays on)
        if ddp:
            ddp_all_reduce(mb)

    local = sum(self.local_numel(p) for p in self.stage_params(stage))
    ddp = not fsdp and len(self.comms["dp"][0].ranks) > 1
    # DDP's buckets, gradients in the order they become ready (the parameters reversed: the output
    # layer's first); DDP is 1-D here (the schema), so a rank holds every parameter whole
    buckets = ddp_buckets([self.local_numel(p) for p in reversed(self.stage_params(stage))]) if ddp else []

    def ddp_all_reduce(mb: int) -> None:
        """torch DDP (``replicate``): every backward all-reduces every bucket (fp32: torchtitan keeps
        fp32 parameters under DDP, mixed precision is autocast); the next compute waits for them
        (the reducer's ``finalize_backward``)."""
        for b, cnt in enumerate(buckets):
            tag = f"ddp.mb{mb}.bucket{b}.all_reduce"
            items.append(Collective("dp", "all_reduce", cnt, "F32", tag, blocking=False))
            pending.append(tag)

    plan = schedule(par.pp_schedule, pp, stage, par.micro_batches, vs)
    last_b = max(mb for ph, mb, _ in plan if ph == "B")
    for phase, mb, v in plan:
        p2p(self, items, stage, phase, mb, v, "recv")
        if phase == "F":
            forward(mb, v)
        else:
            backward(mb, v, mb == last_b or pp == 1)
        p2p(self, items, stage, phase, mb, v, "send")
    if pp > 1:
        reduce("root")
    pending.extend(rs_tags)
    if fsdp:  # the norm of DTensor gradients: full_tensor(); DDP's are plain tensors, reduced already
        items.append(Collective("dp", "all_reduce", 1, "F32", "grad_norm.dp"))
    if tp_on:
        items.append(Collective("tp", "all_reduce", 1, "F32", "grad_norm.tp"))
    if pp > 1:
        items.append(Collective("pp", "all_reduce", 1, "F32", "grad_norm.pp"))
    shard = sum(units.values()) if fsdp else local
    comp("optimizer.step", "opt", ops.adam_flat(shard, warmup, False, False) + ops.hw_adamw_rest(shard))
    return items
