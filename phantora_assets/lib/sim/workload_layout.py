"""The parameter layout of one run: model dimensions, parameters, communicators, grad buckets.

A :class:`WorkloadLayout` turns a workload preset (``presets.toml``) and a layout (tp, dp, ep
of the :class:`~phantora_assets.lib.run.spec.RunSpec`) into

* the model's dimensions (``seq``, ``mbs``, ``layers``, ``hidden``, ``ffn``, ``heads``,
  ``kv_heads``, ``head_dim``, ``vocab``, ``experts``, ``topk``; all ints),
* the parameters (:class:`~phantora_assets.lib.sim.workload_types.Param`, in registration order
  of Megatron-core or the Hugging Face model; element counts unsharded, shapes per rank),
* the communicators (TP, DP, EP groups over global ranks, host-major placement),
* the Megatron DDP grad buffers: per bucket (>= max(40M, 1M x dp) elements, in reverse
  parameter order, padded to a multiple of lcm(dp, 128)) the padded element count and the
  members with their offsets; rank 0's optimizer shard pieces per AdamW group,
* the ZeRO-3 partition (every parameter split ceil(numel / dp) elements per rank).

Sizes are element counts, never bytes. A preset without a needed key raises ``KeyError`` when
the layout is built. The step programs built on it are in
:mod:`~phantora_assets.lib.sim.workloads` (:class:`~phantora_assets.lib.sim.workloads.WorkloadModel`
extends this class). No Dagster import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.workload_types import MEGATRON_BUCKET_ELEMENTS, Communicator, Param
from phantora_assets.lib.workload.pipeline import stage_bounds
from phantora_assets.lib.workload.placement import groups_of

# a DDP bucket: (padded elements, [(param, offset in the bucket, elements)])
Bucket = tuple[int, list[tuple[Param, int, int]]]


def ceil_to(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m``."""
    return -(-x // m) * m


@dataclass
class WorkloadLayout:
    """Dimensions, parameters, communicators and grad buckets of one run (see module docstring)."""

    spec: RunSpec
    params: list[Param] = field(init=False)
    comms: dict[str, list[Communicator]] = field(init=False)

    def __post_init__(self) -> None:
        m, t = self.spec.wl.model, self.spec.wl.train
        self.seq_len = t.seq_len
        self.seq = (
            t.seq_len // self.spec.par.cp
        )  # the tokens of a micro-batch on one rank (context parallelism splits them)
        self.mbs = t.micro_batch
        self.layers = m.layers
        self.hidden = m.hidden
        self.ffn = m.moe_ffn_hidden if m.kind == "moe" else m.ffn_hidden
        self.heads = m.heads
        self.kv_heads = m.kv_heads
        self.head_dim = m.head_dim
        # Megatron pads the vocabulary to a multiple of 128 x tp (--make-vocab-size-divisible-by 128)
        self.vocab = ceil_to(m.vocab, 128 * self.spec.par.tp) if self.spec.framework == "megatron" else m.vocab
        self.experts = m.experts
        self.topk = m.topk
        self.params = self._build_params()
        self.comms = self._build_comms()

    # ------------------------------------------------------------------ parameters
    def _build_params(self) -> list[Param]:
        h, f, L = self.hidden, self.ffn, self.layers
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        fw = self.spec.framework
        tpv = self.spec.tp if fw in ("megatron", "torchtitan") else 1
        model = self.spec.wl.model
        etp = self.spec.par.etp
        out: list[Param] = [
            Param("embedding.word_embeddings.weight", self.vocab * h, "embedding", True, shape=(self.vocab // tpv, h))
        ]
        arch = self.spec.wl.model.arch
        ln = model.norm == "layernorm"  # megatron only (the schema): a bias beside every norm weight
        for i in range(L):
            m = f"layers.{i}"
            if self.spec.framework == "megatron":
                # registration order of Megatron-core: input_layernorm, linear_proj (created by
                # Attention.__init__), linear_qkv, pre_mlp_layernorm, mlp
                t = self.spec.tp
                out.append(Param(f"{m}.input_layernorm.weight", h, f"{m}.attn", shape=(h,)))
                if ln:  # LayerNorm (Megatron's default normalization): a weight and a bias
                    out.append(Param(f"{m}.input_layernorm.bias", h, f"{m}.attn", shape=(h,)))
                out.append(Param(f"{m}.self_attention.linear_proj.weight", q * h, f"{m}.attn", True, shape=(h, q // t)))
                out.append(
                    Param(
                        f"{m}.self_attention.linear_qkv.weight",
                        h * (q + 2 * kv),
                        f"{m}.attn",
                        True,
                        shape=((q + 2 * kv) // t, h),
                    )
                )
                # no q/k layernorm parameters: Phantora's tests/test_megatron.py builds its
                # TransformerConfig without qk_layernorm (W3's recorded shard sizes in
                # perfdb/l40s confirm: its grad buffer has no 128-element norms per layer)
                out.append(Param(f"{m}.pre_mlp_layernorm.weight", h, f"{m}.mlp", shape=(h,)))
                if ln:
                    out.append(Param(f"{m}.pre_mlp_layernorm.bias", h, f"{m}.mlp", shape=(h,)))
                if model.is_moe_layer(i):
                    out.append(Param(f"{m}.mlp.router.weight", self.experts * h, f"{m}.mlp", shape=(self.experts, h)))
                    for e in range(self.experts):
                        out.append(
                            Param(
                                f"{m}.mlp.experts.{e}.linear_fc1.weight",
                                h * 2 * f,
                                f"{m}.mlp",
                                expert=True,
                                shape=(2 * f // etp, h),
                            )
                        )
                        out.append(
                            Param(
                                f"{m}.mlp.experts.{e}.linear_fc2.weight",
                                f * h,
                                f"{m}.mlp",
                                expert=True,
                                shape=(h, f // etp),
                            )
                        )
                    if model.shared_experts:  # one dense SwiGLU MLP of shared_experts x moe_ffn_hidden
                        fs = model.shared_experts * f
                        out.append(
                            Param(
                                f"{m}.mlp.shared_experts.linear_fc1.weight",
                                h * 2 * fs,
                                f"{m}.mlp",
                                True,
                                shape=(2 * fs // t, h),
                            )
                        )
                        out.append(
                            Param(
                                f"{m}.mlp.shared_experts.linear_fc2.weight",
                                fs * h,
                                f"{m}.mlp",
                                True,
                                shape=(h, fs // t),
                            )
                        )
                else:
                    # fc1: [2 ffn, h] with SwiGLU (--swiglu: gate and up in one matrix), [ffn, h] for
                    # the GeLU MLP (Megatron-core mlp.py: ffn_hidden_size * 2 if gated_linear_unit)
                    fd = model.ffn_hidden
                    g = 2 if model.mlp == "swiglu" else 1
                    out.append(
                        Param(f"{m}.mlp.linear_fc1.weight", h * g * fd, f"{m}.mlp", True, shape=(g * fd // t, h))
                    )
                    out.append(Param(f"{m}.mlp.linear_fc2.weight", fd * h, f"{m}.mlp", True, shape=(h, fd // t)))
            elif arch == "gpt_oss":  # Hugging Face gpt-oss
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
            else:  # Hugging Face Llama (DeepSpeed) / torchtitan's Llama (the same tensors; TP-sharded there)
                sh = fw == "torchtitan" and self.spec.tp > 1
                t = self.spec.tp if sh else 1
                out += [
                    Param(f"{m}.input_layernorm.weight", h, f"{m}.input_layernorm", shape=(h,)),
                    Param(f"{m}.self_attn.q_proj.weight", h * q, f"{m}.self_attn", sh, shape=(q // t, h)),
                    Param(f"{m}.self_attn.k_proj.weight", h * kv, f"{m}.self_attn", sh, shape=(kv // t, h)),
                    Param(f"{m}.self_attn.v_proj.weight", h * kv, f"{m}.self_attn", sh, shape=(kv // t, h)),
                    Param(f"{m}.self_attn.o_proj.weight", q * h, f"{m}.self_attn", sh, shape=(h, q // t)),
                    Param(f"{m}.post_attention_layernorm.weight", h, f"{m}.post_attention_layernorm", shape=(h,)),
                    Param(f"{m}.mlp.gate_proj.weight", h * f, f"{m}.mlp", sh, shape=(f // t, h)),
                    Param(f"{m}.mlp.up_proj.weight", h * f, f"{m}.mlp", sh, shape=(f // t, h)),
                    Param(f"{m}.mlp.down_proj.weight", f * h, f"{m}.mlp", sh, shape=(h, f // t)),
                ]
        out.append(Param("final_norm.weight", h, "final_norm", shape=(h,)))
        if ln:
            out.append(Param("final_norm.bias", h, "final_norm", shape=(h,)))
        out.append(Param("output_layer.weight", self.vocab * h, "output_layer", True, shape=(self.vocab // tpv, h)))
        return out

    @property
    def total_params(self) -> int:
        return sum(p.numel for p in self.params)

    def local_numel(self, p: Param) -> int:
        """Elements of ``p`` held by one rank before any ZeRO/optimizer sharding (an expert's
        tensor is held whole by its EP rank, split over etp)."""
        if p.expert:
            return p.numel // self.spec.par.etp
        return p.numel // self.spec.tp if p.tp_sharded else p.numel

    # ------------------------------------------------------------------ pipeline stages
    def layers_per_chunk(self) -> int:
        """Layers of one model chunk (pp x virtual_stages chunks in all; the largest with uneven stages)."""
        if self.spec.wl.parallel.first_stage_layers or self.spec.wl.parallel.last_stage_layers:
            return max(b - a for a, b in self._bounds())
        return self.layers // (self.spec.par.pp * self.spec.par.virtual_stages)

    def _bounds(self) -> list[tuple[int, int]]:
        par = self.spec.wl.parallel
        return stage_bounds(par.pp, self.layers, par.first_stage_layers, par.last_stage_layers)

    def stage_of_layer(self, i: int) -> int:
        """Pipeline stage holding layer ``i``: chunk c = i // layers_per_chunk lives on stage c % pp
        (Megatron-core's and torchtitan's interleaved placement; c // pp is its virtual stage);
        with uneven first / last stages, the stage whose bounds hold i."""
        if self.spec.par.pp > 1 and (
            self.spec.wl.parallel.first_stage_layers or self.spec.wl.parallel.last_stage_layers
        ):
            return next(st for st, (a, b) in enumerate(self._bounds()) if a <= i < b)
        return (i // self.layers_per_chunk()) % self.spec.par.pp

    def chunk_layers(self, stage: int, v: int) -> range:
        """Layers of virtual stage ``v`` of ``stage`` (global chunk v * pp + stage)."""
        if self.spec.par.pp > 1 and (
            self.spec.wl.parallel.first_stage_layers or self.spec.wl.parallel.last_stage_layers
        ):
            return range(*self._bounds()[stage])
        n = self.layers_per_chunk()
        c = v * self.spec.par.pp + stage
        return range(c * n, (c + 1) * n)

    def stage_of(self, module: str) -> int:
        """Stage of a parameter's module: the embedding on the first, the final norm and output
        layer on the last, a layer's modules on its layer's stage."""
        if module.startswith("layers."):
            return self.stage_of_layer(int(module.split(".")[1]))
        return 0 if module.startswith("embedding") else self.spec.par.pp - 1

    def stage_params(self, stage: int | None) -> list[Param]:
        """Parameters held by the ranks of ``stage`` (all for None or a one-stage job)."""
        if stage is None or self.spec.par.pp == 1:
            return self.params
        cache = self.__dict__.setdefault("_stage_params", {})
        if stage not in cache:
            cache[stage] = [p for p in self.params if self.stage_of(p.module) == stage]
        return cache[stage]

    def stage_ranks(self, stage: int) -> range:
        """Global ranks of pipeline stage ``stage`` (pp is the outermost coordinate)."""
        n = self.spec.world_size // self.spec.par.pp
        return range(stage * n, (stage + 1) * n)

    def dense_params_local(self, stage: int | None = None) -> list[tuple[str, int]]:
        """(name, elements per rank) of the DP-replicated (non-expert) parameters of ``stage``."""
        return [(p.name, self.local_numel(p)) for p in self.stage_params(stage) if not p.expert]

    def expert_params_per_rank(self, stage: int | None = None) -> int:
        """Expert elements one rank of ``stage`` holds (its experts // ep experts per MoE layer)."""
        if not self.experts:
            return 0
        ps = self.stage_params(stage)
        per_expert = sum(self.local_numel(p) for p in ps if p.expert) // self.experts
        return per_expert * (self.experts // self.spec.ep)

    # ------------------------------------------------------------------ communicators
    def _build_comms(self) -> dict[str, list[Communicator]]:
        """The communicators of the run, by kind, in the order each framework creates them (kinds:
        tp, dp, ep, edp, then cp, dp_cp, pp, dp_shard, dp_rep); each a tuple of ascending global ranks
        that differ only in the kind's coordinates. Names: kind + index in order of first rank."""
        par = self.spec.par
        fw = self.spec.framework
        comms: dict[str, list[Communicator]] = {}

        def add(kind: str, dims: tuple[str, ...]) -> None:
            comms[kind] = groups_of(par, kind, dims)

        if par.tp > 1:
            add("tp", ("tp",))
        if fw == "torchtitan" and par.zero >= 2:
            add("dp", ("dp", "cp"))  # FSDP2 shards over dp_shard x cp (torchtitan's dp_shard_cp mesh)
            if par.dp_replicate > 1:
                comms["dp"] = groups_of(par, "dp", ("dp_shard", "cp"))
                add("dp_rep", ("dp_rep",))
        else:
            add("dp", ("dp",))
        moe = self.experts and fw == "megatron"
        if par.ep > 1:
            add("ep", ("ep",))
        if moe and par.edp > 1:
            add("edp", ("edp",))
        if par.cp > 1:
            add("cp", ("cp",))
            if fw == "megatron":
                add("dp_cp", ("dp", "cp"))
        if par.pp > 1:
            add("pp", ("pp",))
        return comms

    def param_shape(self, p: Param) -> tuple[int, ...]:
        return p.shape or (self.local_numel(p),)

    # ------------------------------------------------------------------ Megatron buffers
    def grad_sync_size(self) -> int:
        """Ranks a dense gradient is reduced over: dp x cp (Megatron's data-parallel group with
        context parallelism; dp alone when cp = 1)."""
        return self.spec.dp * self.spec.par.cp

    def virtual_stage_of(self, module: str) -> int:
        """Model chunk (virtual stage) of its pipeline stage that holds ``module``: a layer's chunk
        c // pp (c = layer // layers per chunk), the embedding 0, the final norm and output layer
        the last."""
        par = self.spec.par
        if par.virtual_stages == 1:
            return 0
        if module.startswith("layers."):
            return (int(module.split(".")[1]) // self.layers_per_chunk()) // par.pp
        return 0 if module.startswith("embedding") else par.virtual_stages - 1

    def _chunk_buffers(self, params: list[Param], stage: int | None, size: int, pad: int) -> list[list[Bucket]]:
        """Megatron-core's DDP grad buffers of ``params`` (one stage), one per model chunk
        (training.py get_model wraps every chunk in its own DistributedDataParallel), each in
        buckets of ``size`` elements; bucketing is off (one bucket) for chunks after the first
        (``disable_bucketing``) and on pipeline stages > 0 (distributed_data_parallel.py)."""
        out: list[list[Bucket]] = []
        for v in range(self.spec.par.virtual_stages):
            mine = [p for p in params if self.virtual_stage_of(p.module) == v]
            bucketed = v == 0 and not stage
            out.append(self._buckets(mine, size if bucketed else sum(map(self.local_numel, mine)), pad) if mine else [])
        return out

    def megatron_dense_buffers(self, stage: int | None = None) -> list[list[Bucket]]:
        """The DDP grad buffers (one per model chunk, :meth:`_chunk_buffers`) of the dense parameters
        of ``stage``: parameters in reverse order, a bucket closes once it holds >= max(40M, 1M x
        dp) elements and, with the distributed optimizer (zero = 1), is padded to lcm(dp, 128)
        (dp: :meth:`grad_sync_size`). Per bucket ``(padded_numel, [(param, offset_in_bucket, numel)])``."""
        dp = self.grad_sync_size()
        size = max(MEGATRON_BUCKET_ELEMENTS, 1_000_000 * dp)
        pad = math.lcm(dp, 128) if self.spec.zero_stage >= 1 else 1
        return self._chunk_buffers([p for p in self.stage_params(stage) if not p.expert], stage, size, pad)

    def megatron_dense_buckets(self, stage: int | None = None) -> list[Bucket]:
        """:meth:`megatron_dense_buffers`' buckets, chunk by chunk."""
        return [b for buf in self.megatron_dense_buffers(stage) for b in buf]

    def megatron_expert_buckets(self, stage: int | None = None) -> list[Bucket]:
        """The expert grad buffers of rank 0's local experts of ``stage`` (expert-data-parallel size
        edp), one per model chunk as the dense ones (:meth:`_chunk_buffers`), chunk by chunk."""
        if not self.experts or self.spec.framework != "megatron":
            return []
        local = self.experts // self.spec.ep
        mine = [p for p in self.stage_params(stage) if p.expert and int(p.name.split(".")[4]) < local]
        edp = self.spec.par.edp
        pad = math.lcm(edp, 128) if self.spec.zero_stage >= 1 else 1
        size = max(MEGATRON_BUCKET_ELEMENTS, 1_000_000 * edp)
        return [b for buf in self._chunk_buffers(mine, stage, size, pad) for b in buf]

    def _buckets(self, params: list[Param], size: int, pad: int) -> list[Bucket]:
        out: list[Bucket] = []
        cur: list[tuple[Param, int, int]] = []
        n = 0
        for p in reversed(params):
            k = self.local_numel(p)
            cur.append((p, n, k))
            n += k
            if n >= size:
                out.append((ceil_to(n, pad), cur))
                cur, n = [], 0
        if cur:
            out.append((ceil_to(n, pad), cur))
        return out

    def megatron_optimizer_groups(self, stage: int | None = None) -> list[tuple[bool, list[int]]]:
        """Rank 0's fp32 shard pieces per AdamW param group (decay?, sizes in buffer order):
        dense weights (decay), dense 1-D params (no decay), expert weights (decay). Without the
        distributed optimizer (zero = 0) a rank updates all of its parameters."""
        dp = self.grad_sync_size() if self.spec.zero_stage >= 1 else 1
        decay: list[int] = []
        nodecay: list[int] = []
        for padded, members in self.megatron_dense_buckets(stage):
            lo, hi = 0, padded // dp  # rank 0's shard of this bucket
            for p, off, k in members:
                a, b = max(lo, off), min(hi, off + k)
                if b > a:
                    (decay if len(self.param_shape(p)) >= 2 else nodecay).append(b - a)
        experts: list[int] = []
        edp = self.spec.par.edp if self.spec.zero_stage >= 1 else 1
        for padded, members in self.megatron_expert_buckets(stage):
            for _, off, k in members:  # rank 0's EDP shard of the bucket (all of it when edp = 1)
                if min(padded // edp, off + k) > off:
                    experts.append(min(padded // edp, off + k) - off)
        return [(True, decay), (False, nodecay), (True, experts)]

    # ------------------------------------------------------------------ ZeRO-3
    def _zero3_modules(self) -> list[tuple[str, list[Param]]]:
        """(module, its parameters) in first-registration order."""
        mods: dict[str, list[Param]] = {}
        for p in self.params:
            mods.setdefault(p.module, []).append(p)
        return list(mods.items())

    def zero3_partition(self) -> int:
        """Elements of one rank's fp32 partition (every parameter split ceil(numel / dp))."""
        return sum(-(-p.numel // self.spec.dp) for p in self.params)
