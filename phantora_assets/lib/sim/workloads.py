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
        in bf16. Every micro-batch gathers and reduce-scatters anew (the trace walk restarts at
        every forward; no accumulation-boundary test). The warm-up step's first micro-batch has
        no trace yet, so it re-gathers everything in backward.
    DeepSpeed models: Hugging Face Llama (dense) or gpt-oss (``arch = "gpt_oss"``, every expert
        on every rank and token), at every ZeRO stage.

A preset without a needed key raises ``KeyError`` when the model is built. No Dagster import.
"""

from __future__ import annotations

from functools import lru_cache

from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.kernels import T
from phantora_assets.lib.sim.optimizer_ops import B16, r2_kernel
from phantora_assets.lib.sim.torch_ops import torch_ops
from phantora_assets.lib.sim.workload_layout import WorkloadLayout, ceil_to
from phantora_assets.lib.sim.workload_types import (
    DEEPSPEED_BUCKET_ELEMENTS,
    ZERO3_MAX_REUSE_DISTANCE,
    ZERO3_PERSISTENCE_THRESHOLD,
    ZERO3_PREFETCH_BUCKET_ELEMENTS,
    Collective,
    Item,
    Param,
    compute,
)
from phantora_assets.lib.workload.megatron import megatron_step
from phantora_assets.lib.workload.spec import PHANTORA_DTYPE
from phantora_assets.lib.workload.torchtitan import torchtitan_step


@lru_cache(maxsize=64)
def workload_model(spec: RunSpec) -> WorkloadModel:
    """The (cached) :class:`WorkloadModel` of ``spec``."""
    return WorkloadModel(spec)


class WorkloadModel(WorkloadLayout):
    """Parameters, communicators and per-step programs of one run (see module docstring)."""

    # ------------------------------------------------------------------ programs
    def grad_reduce_dtype(self) -> str:
        """The dtype of DeepSpeed's gradient reductions, Phantora's name: ``train.grad_reduce_dtype``
        (DeepSpeed's ``communication_data_type``; unset, bf16 with bf16 training:
        ``engine.communication_data_type``). ``allreduce_bucket`` (ZeRO-0), ``average_tensor`` /
        ``gradient_reduction_w_predivide`` (ZeRO-1/2) and ``__avg_scatter_grads`` (ZeRO-3) cast the
        bucket to it before the collective; the parameter all-gathers stay bf16."""
        return PHANTORA_DTYPE[self.spec.wl.train.grad_reduce_dtype]

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
            fw, pp = self.spec.framework, self.spec.par.pp
            if fw == "megatron":
                cache[warmup] = [megatron_step(self, warmup, st) for st in range(pp)]
            elif fw == "torchtitan":
                cache[warmup] = [torchtitan_step(self, warmup, st) for st in range(pp)]
            elif self.spec.zero_stage == 3:
                cache[warmup] = [self._zero3_step(warmup)]
            elif self.spec.zero_stage in (1, 2):
                cache[warmup] = [self._deepspeed_zero12_step(warmup)]
            else:
                cache[warmup] = [self._deepspeed_zero0_step(warmup)]
        return cache[warmup]

    def _deepspeed_zero12_step(self, warmup: bool) -> list[Item]:
        """DeepSpeed ZeRO stage 1 / 2 (bf16, ``reduce_scatter: true``, ``overlap_comm`` off): as
        stage 0 but each 5e8-element gradient bucket is reduce-scattered (ceil(bucket / dp) per
        rank) instead of all-reduced; the updated bf16 partitions are all-gathered after the step.
        ZeRO-2 (partitioned gradients) reduces the buckets after every micro-batch's backward
        (``stage_1_and_2.py`` ``reduce_ready_partitions_and_remove_grads``: ``if
        self.partition_gradients or self.is_gradient_accumulation_boundary()``), ZeRO-1 at the
        accumulation boundary only."""
        return self._deepspeed_zero0_step(warmup, reduce_scatter=True)

    def _deepspeed_zero0_step(self, warmup: bool, reduce_scatter: bool = False) -> list[Item]:
        """DeepSpeed 1-stage pipeline, bf16 optimizer (ZeRO stage 0): synchronous gradient
        all-reduce after the backward, synchronous parameter all-gather after the step (no
        overlap on this path: ``_exec_reduce_grads`` / ``update_lp_params``). With gradient
        accumulation the forward and backward repeat per micro-batch, the reduction once (ZeRO-2:
        after every backward, :meth:`_deepspeed_zero12_step`)."""
        ops = torch_ops(self)
        items: list[Item] = []
        dp = self.spec.dp
        gdt = self.grad_reduce_dtype()

        def reduce_buckets(prefix: str = "") -> None:
            """The gradient buckets (5e8 elements, reverse parameter order); ``prefix`` names a
            ZeRO-2 reduction after a micro-batch's backward before the last. A reduce-scatter
            gives each rank its partition of the flat group padded to a multiple of 2 x dp
            (``stage_1_and_2.py``: the group is partitioned padded, as the all-gather after the
            step): floor(bucket / dp) per bucket, the last one topped up to padded / dp in all."""
            sizes, cur = [], 0
            for p in reversed(self.params):
                cur += p.numel
                if cur >= DEEPSPEED_BUCKET_ELEMENTS:
                    sizes.append(cur)
                    cur = 0
            if cur:
                sizes.append(cur)
            for b, n in enumerate(sizes):
                if not reduce_scatter:
                    items.append(Collective("dp", "all_reduce", n, gdt, f"{prefix}allreduce.bucket{b}"))
                    continue
                k = (
                    n // dp
                    if b < len(sizes) - 1
                    else ceil_to(self.total_params, 2 * dp) // dp - sum(m // dp for m in sizes[:-1])
                )
                items.append(Collective("dp", "reduce_scatter", k, gdt, f"{prefix}reduce_scatter.bucket{b}"))

        every_backward = reduce_scatter and self.spec.zero_stage == 2 and dp > 1
        micro_batches = self.spec.par.micro_batches
        go = self.spec.wl.model.arch == "gpt_oss"
        # the layer's modules: Llama's named attention / mlp as before, gpt-oss's by module
        label = {"self_attn": "attention", "mlp": "mlp", "mlp.experts": "mlp.experts"}
        layer_fwd = [(label[m], k) for m, k in self._hf_layer_kernels("fwd")]
        layer_bwd = [(label[m], k) for m, k in reversed(self._hf_layer_kernels("bwd"))]
        for mb in range(micro_batches):
            # BF16_Optimizer keeps the bf16 .grad tensors (zeroed, never None) from the first backward on, so
            # every later backward accumulates into them: AccumulateGrad's in-place add per parameter
            # (bf16_accumulate_grad_kernels); ZeRO-1/2 (reduce_scatter) clear the grads to None instead
            acc = self.bf16_accumulate_grad_kernels() if not reduce_scatter and not (warmup and mb == 0) else {}
            items.append(compute("embedding.fwd", "fwd", ops.hf_rotary(gpt_oss=go)))
            for i in range(self.layers):
                items += [compute(f"layers.{i}.{m}.fwd", "fwd", k) for m, k in layer_fwd]
            items.append(compute("output_layer.fwd", "fwd", ops.hf_head("fwd", go)))
            items.append(compute("output_layer.bwd", "bwd", ops.hf_head("bwd", go) + acc.get("head", [])))
            for i in reversed(range(self.layers)):
                items += [
                    compute(f"layers.{i}.{m}.bwd", "bwd", k + acc.get(f"layers.{i}.{m}", [])) for m, k in layer_bwd
                ]
            if acc.get("embedding"):
                items.append(compute("embedding.bwd", "bwd", acc["embedding"]))
            if every_backward and mb < micro_batches - 1:
                reduce_buckets(f"mb{mb}.")  # ZeRO-2: this micro-batch's gradients to their owners
        items.append(compute("bf16_optimizer.update_hp_grads", "opt", ops.bf16_update_hp_grads()))
        if dp > 1:
            items.append(
                compute("bf16_optimizer.grads_for_reduction", "opt", ops.bf16_grads_for_reduction(self.total_params))
            )
            reduce_buckets()
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

    def bf16_accumulate_grad_kernels(self) -> dict[str, list]:
        """AccumulateGrad of DeepSpeed's bf16 optimizer at ZeRO stage 0, per backward item: each parameter's
        new bf16 gradient added in place into its existing ``.grad`` (autograd's ``variable_grad += new_grad``
        when the parameter already has a gradient: torch/csrc/autograd/functions/accumulate_grad.h), the
        perf-DB key ``Add_`` of two bf16 tensors of the parameter's shape.

        Why the gradients exist: ``BF16_Optimizer.backward`` / ``backward_prologue`` call ``clear_lp_grads()``,
        whose default ``set_to_none=False`` zeroes every ``param.grad`` with ``torch._foreach_zero_`` and keeps
        it, and ``DeepSpeedEngine._take_model_step`` skips ``zero_grad`` for bf16 without ZeRO ("TODO: Temporary
        until bf16_optimizer and zero_optimizer are integrated": ``pass``); DeepSpeed ``runtime/bf16_optimizer.py``,
        ``runtime/engine.py``. So the first backward of a run steals the gradients and every later one adds
        (``_foreach_zero_`` itself is not a call Phantora intercepts). The L40S perf DB Phantora recorded for
        W1-W5 holds these keys, among them ``Add_`` of two bf16 [128256, 4096] (3.1 ms), a shape only the
        Hugging Face Llama-3-8B of W4 has in bf16 (W1 shards its vocabulary over TP = 2).

        Keys: ``"head"`` (output layer, final norm: ``output_layer.bwd``), ``"layers.{i}.attention"`` (input norm,
        attention), ``"layers.{i}.mlp"`` / ``"layers.{i}.mlp.experts"`` (post-attention norm, MLP or router and
        experts), ``"embedding"`` (the embedding's gradient, the last of the backward). Each a list of kernels
        of one rank."""
        out: dict[str, list] = {}
        gpt_oss = self.spec.wl.model.arch == "gpt_oss"
        mlp = "mlp.experts" if gpt_oss else "mlp"
        for p in self.params:
            m = p.module
            if m.startswith("layers."):
                i, sub = m.split(".")[1], m.split(".", 2)[2]
                key = f"layers.{i}.attention" if sub in ("self_attn", "input_layernorm") else f"layers.{i}.{mlp}"
            elif m == "embedding":
                key = "embedding"
            else:
                key = "head"
            out.setdefault(key, []).append(r2_kernel("Add_", T(B16, *self.param_shape(p))))
        return out

    def _hf_layer_kernels(self, phase: str) -> list[tuple[str, list]]:
        """(module of a decoder layer, its kernels in ``phase``) in forward order, for the Hugging
        Face model of the workload's ``arch``: Llama's ``self_attn`` (input norm, projections,
        attention) and ``mlp`` (post-attention norm, SwiGLU); gpt-oss's ``self_attn`` (biases,
        sinks) and ``mlp.experts`` (post-attention norm, router, every expert on every token).
        The module names are the parameters' modules (:class:`WorkloadLayout`), so the ZeRO-3
        program places each list at its module's gathers (:meth:`_zero3_step` checks it does)."""
        ops = torch_ops(self)
        if self.spec.wl.model.arch == "gpt_oss":
            return [("self_attn", ops.hf_attention(phase, gpt_oss=True)), ("mlp.experts", ops.gptoss_moe(phase))]
        return [("self_attn", ops.hf_attention(phase)), ("mlp", ops.hf_llama_mlp(phase))]

    def _zero3_step(self, warmup: bool) -> list[Item]:
        """DeepSpeed ZeRO-3 (overlap_comm defaults to True at stage 3): parameters are gathered
        before their module runs, and the steady steps prefetch the next parameters of the
        recorded trace up to ``stage3_prefetch_bucket_size`` (5e7) elements; the module's
        compute waits for its own gathers only. Gradients are reduce-scattered asynchronously
        after each module's backward.

        Gradient accumulation: every micro-batch is a whole forward and backward with its own
        gathers and reduce-scatters. The parameter trace is per forward + backward
        (``parameter_offload.py`` ``_start_of_forward_hook`` calls the coordinator's
        ``reset_step`` at every forward: fetch queue, step id and reuse distances restart), and
        ``stage3.py`` ``reduce_ready_partitions_and_remove_grads`` reduce-scatters at every
        backward, unconditionally (no ``is_gradient_accumulation_boundary`` test, unlike ZeRO-1;
        ``partition_grads`` adds the partitions into the fp32 gradient from the second
        micro-batch on); ``independent_gradient_partition_epilogue`` synchronizes the reduction
        stream after every backward, so a micro-batch starts once the previous one's
        reduce-scatters are done. The optimizer step follows the last micro-batch.

        The warm-up step's first micro-batch has no trace yet (the coordinator records it): no
        prefetch, everything gathered again in backward; its later micro-batches run on the
        recorded trace like the steady ones. Tags of micro-batches before the last carry
        ``zero3.mb<k>.`` (the last keeps ``zero3.``: a one-micro-batch step is unchanged)."""
        ops = torch_ops(self)
        dp = self.spec.dp
        mods = self._zero3_modules()
        go = self.spec.wl.model.arch == "gpt_oss"
        fwd: dict[str, list] = {"embedding": ops.hf_rotary(gpt_oss=go), "output_layer": ops.hf_head("fwd", go)}
        bwd: dict[str, list] = {"output_layer": ops.hf_head("bwd", go)}
        for phase, table in (("fwd", fwd), ("bwd", bwd)):
            for i in range(self.layers):
                for sub, kernels in self._hf_layer_kernels(phase):
                    table[f"layers.{i}.{sub}"] = kernels
        names = {n for n, _ in mods}
        lost = sorted(set(fwd) - names | set(bwd) - names)
        if lost:  # a kernel list no module runs would vanish from the step (issue 39, item 3)
            raise ValueError(f"ZeRO-3 step of arch {self.spec.wl.model.arch!r}: no parameters' module {lost}")

        items: list[Item] = []
        micro_batches = self.spec.par.micro_batches
        previous: list[str] = []
        for mb in range(micro_batches):
            prefix = "zero3." if mb == micro_batches - 1 else f"zero3.mb{mb}."
            if previous:  # the previous backward's epilogue: its reduce-scatters done
                items.append(compute(f"zero3.mb{mb - 1}.backward_epilogue", "bwd", [], waits=tuple(previous)))
            previous = self._zero3_micro_batch(items, mods, fwd, bwd, warmup and mb == 0, prefix)
        items.append(compute("zero3.grad_norm", "opt", ops.zero3_grad_norm(dp), waits=tuple(previous)))
        items.append(Collective("dp", "all_reduce", 1, "F32", "grad_norm"))
        items.append(compute("optimizer.step", "opt", ops.adam_flat(self.zero3_partition(), warmup, True, True)))
        return items

    def _zero3_micro_batch(
        self,
        items: list[Item],
        mods: list[tuple[str, list[Param]]],
        fwd: dict[str, list],
        bwd: dict[str, list],
        untraced: bool,
        prefix: str,
    ) -> list[str]:
        """One micro-batch of :meth:`_zero3_step` appended to ``items`` (``untraced``: no recorded
        trace: no prefetch, every parameter gathered again in backward); its reduce-scatter tags."""
        dp = self.spec.dp
        gdt = self.grad_reduce_dtype()
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
                    and not untraced
                    and name in fetched_at
                    and fetched_total - fetched_at[name] <= ZERO3_MAX_REUSE_DISTANCE
                ):
                    gathered = []  # still gathered: next use within the reuse distance
                if gathered:
                    fetched_at[name] = fetched_total
                    fetched_total += sum(p.numel for p in gathered)
                runs.append((name, phase, gathered))
        queue = [(j, p) for j, (_, phase, gathered) in enumerate(runs) for p in gathered]
        tags = {(j, p.name): f"{prefix}{runs[j][1]}.gather.{p.name}" for j, p in queue}

        qi = 0
        rs_tags: list[str] = []
        for j, (name, phase, gathered) in enumerate(runs):
            while qi < len(queue) and queue[qi][0] <= j:  # this module's own (not yet issued)
                jj, p = queue[qi]
                items.append(
                    Collective("dp", "all_gather", -(-p.numel // dp), "Bf16", tags[(jj, p.name)], blocking=False)
                )
                qi += 1
            if not untraced:
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
                    tag = f"{prefix}reduce_scatter.{p.name}"
                    items.append(Collective("dp", "reduce_scatter", -(-p.numel // dp), gdt, tag, blocking=False))
                    rs_tags.append(tag)
        return rs_tags
