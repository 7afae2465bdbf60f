"""The Hugging Face / torchtitan Llama and gpt-oss torch calls of one rank (Phantora perf-DB keys).

:class:`HfOps` holds a run's dimensions (``s`` tokens of a micro-batch on the rank, ``h``, ``f``,
heads, head_dim, vocab; torchtitan's on its TP shards) and the lists of Hugging Face Llama and
gpt-oss eager attention (or fused flash attention, ``train.attention``), RMSNorm, SwiGLU MLP, LM
head and the gpt-oss MoE (every expert on every token); :class:`~phantora_assets.lib.sim.torch_ops.
TorchOps` adds Megatron-core's. Sources as in ``lib/sim/torch_ops.py``. Each method returns a list of
:class:`~phantora_assets.lib.sim.kernels.Kernel` for ONE rank; nothing raises for a valid layout.
No Dagster import.
"""

from __future__ import annotations

from phantora_assets.lib.sim.kernels import (
    Kernel,
    T,
    conv,
    ew,
    flash_attention,
    foreach,
    linear,
    matmul,
    uncaptured,
    zeros_like,
)
from phantora_assets.lib.sim.optimizer_ops import B16, F32, OptimizerOps, memo, r2_kernel
from phantora_assets.lib.sim.workload_layout import WorkloadLayout


def mm_kernel(a: tuple[int, ...], b: tuple[int, ...], dtype: str = B16) -> Kernel:
    return matmul(T(dtype, *a), T(dtype, *b), op="MM")


def bmm_kernel(a: tuple[int, ...], b: tuple[int, ...]) -> Kernel:
    return matmul(T(B16, *a), T(B16, *b), op="BMM")


def mat_kernel(a: tuple[int, ...], b: tuple[int, ...], dtype: str = B16) -> Kernel:
    return matmul(T(dtype, *a), T(dtype, *b), op="MatMul")


class HfOps(OptimizerOps):
    """Dimensions and the Hugging Face-style kernel lists of one rank of ``model``."""

    def __init__(self, model: WorkloadLayout) -> None:
        super().__init__(model)
        self.s = model.seq * model.mbs
        self.seq, self.mbs = model.seq, model.mbs  # fused attention: mbs sequences of seq tokens
        self.h = model.hidden
        self.f = model.ffn
        self.tp = model.spec.tp
        self.cp = model.spec.par.cp
        self.flash = model.spec.wl.train.attention == "flash"  # fused attention (else the eager calls)
        self.hw = model.spec.wl.train.uncaptured_kernels  # also the kernels Phantora does not intercept
        self.nh = model.heads
        self.nkv = model.kv_heads
        self.d = model.head_dim
        self.v = model.vocab
        self.s_sp = self.s  # tokens of the norms and residual adds (sequence-parallel shard)
        if model.spec.framework == "torchtitan":  # the Hugging Face-style lists on TP shards
            self.nh, self.nkv, self.f, self.v = (x // self.tp for x in (self.nh, self.nkv, self.f, self.v))
            # torchtitan's TP plan: attention_norm, ffn_norm and the final norm are SequenceParallel
            # and the block's residual stream is Shard(1): norms and residual adds on s / tp tokens
            self.s_sp = self.s // self.tp

    # ================================================================== Hugging Face Llama
    def _hf_lin_fwd(self, k_in: int, n_out: int, bias: bool = False, x3: bool = True) -> list[Kernel]:
        x = T(B16, 1, self.s, k_in) if x3 else T(B16, self.s, k_in)
        return [linear(x, T(B16, n_out, k_in), T(B16, n_out) if bias else None)]

    def _hf_lin_bwd(self, k_in: int, n_out: int, bias: bool = False) -> list[Kernel]:
        out = [mm_kernel((self.s, n_out), (n_out, k_in)), mm_kernel((n_out, self.s), (self.s, k_in))]
        if bias:
            out.append(ew("Sum", T(B16, self.s, n_out)))
        return out

    def _hf_rmsnorm(self, phase: str, weight_first: bool) -> list[Kernel]:
        s, h = self.s_sp, self.h
        xb, xf, r = T(B16, 1, s, h), T(F32, 1, s, h), T(F32, 1, s, 1)
        w = T(B16, h)
        if phase == "fwd":
            scale = ew("Mul", [w, xf]) if not weight_first else ew("Mul", [w, xb])
            tail = [scale, conv(xf, "BFloat16")] if not weight_first else [conv(xf, "BFloat16"), scale]
            mean = [uncaptured("Mean", [s, h], 4 * s * h + 4 * s)] if self.hw else []  # x.pow(2).mean(-1)
            return [conv(xb, "Float"), ew("Pow", xf)] + mean + [ew("Add", [r, T("f64")]), ew("Mul", [xf, r])] + tail
        scale = ew("Mul", [xf, w]) if not weight_first else ew("Mul", [xb, w])
        return [
            scale,
            conv(xb, "Float"),
            ew("Mul", [xf, r]),
            r2_kernel("Mul", xf),
            ew("Sum", xf),
            ew("MulScalar", xf),
            ew("DivScalar", xf),
            r2_kernel("Add_", xf),
            conv(xf, "BFloat16"),
            ew("Sum", xb),
        ]

    def _hf_rope(self, heads: int, half: bool) -> list[Kernel]:
        s, d = self.s, self.d
        if half:  # gpt-oss: first*cos - second*sin, second*cos + first*sin on head halves
            t, c = T(B16, 1, heads, s, d // 2), T(B16, 1, 1, s, d // 2)
            return [ew("Mul", [t, c])] * 4 + [r2_kernel("Add", t)]
        t, c = T(B16, 1, heads, s, d), T(B16, 1, 1, s, d)
        return [ew("Mul", [t, c]), ew("Mul", [t, c]), r2_kernel("Add", t)]

    @memo
    def hf_rotary(self, gpt_oss: bool = False) -> list[Kernel]:
        """The rotary embedding once per forward: inv_freq @ positions, cos/sin x scaling
        (gpt-oss keeps half-width cos/sin)."""
        cs = T(F32, 1, self.s, self.d // 2 if gpt_oss else self.d)
        return [
            mat_kernel((1, self.d // 2, 1), (1, 1, self.s), F32),
            ew("Mul", [cs, T("f64")]),
            ew("Mul", [cs, T("f64")]),
            conv(cs, "BFloat16"),
            conv(cs, "BFloat16"),
        ]

    @memo
    def hf_attention(self, phase: str, gpt_oss: bool = False) -> list[Kernel]:
        """input RMSNorm, q/k/v/o projections, RoPE, eager attention (softmax in fp32 for Llama;
        bf16 with attention sinks for gpt-oss), residual add. Fused attention with torchtitan's
        context parallelism (ring attention, load-balanced) is cp calls of [s/cp]^2 causal FLOP each
        (as Megatron's ``megatron_attention``)."""
        h, nh, nkv, d = self.h, self.nh, self.nkv, self.d
        q, kv = nh * d, nkv * d
        # eager scores: [mbs, heads, seq, seq] -- quadratic in the sample's tokens, linear in the
        # micro-batch (attention stays inside a sample; Korthikanti et al. 2022 eq. 1: 5*a*s^2*b);
        # never [1, heads, seq*mbs, seq*mbs], which squared the micro-batch (issue 39, round 5)
        b, n = self.mbs, self.seq
        sc = T(B16, b, nh, n, n)
        res = T(B16, 1, self.s_sp, h)
        if phase == "fwd":
            out = self._hf_rmsnorm("fwd", weight_first=not gpt_oss)
            out += self._hf_lin_fwd(h, q, gpt_oss) + self._hf_lin_fwd(h, kv, gpt_oss) + self._hf_lin_fwd(h, kv, gpt_oss)
            out += self._hf_rope(nh, gpt_oss) + self._hf_rope(nkv, gpt_oss)
            if self.flash:
                return (
                    out
                    + [flash_attention(self.seq, self.seq, nh, nkv, d, "fwd", self.mbs, "sdpa")] * self.cp
                    + self._hf_lin_fwd(q, h, gpt_oss)
                    + [r2_kernel("Add", res)]
                )
            out += [mat_kernel((b, nh, n, d), (b, nh, d, n)), ew("Mul", [sc, T("f64")])]
            if gpt_oss:  # the attention sinks: one more column a query row; the causal mask [b, 1, n, n]
                sk = T(B16, b, nh, n, n + 1)
                out += [ew("Add", [sc, T(B16, b, 1, n, n)]), ew("Softmax", [sk, -1])]
            else:
                out += [ew("Softmax", [sc, -1], out=T(F32, b, nh, n, n)), conv(T(F32, b, nh, n, n), "BFloat16")]
            out += [ew("Dropout", [sc, 0, True]), mat_kernel((b, nh, n, n), (b, nh, n, d))]
            return out + self._hf_lin_fwd(q, h, gpt_oss) + [r2_kernel("Add", res)]
        out = [r2_kernel("Add", res)] + self._hf_lin_bwd(q, h, gpt_oss)
        bh = b * nh  # autograd's bmm over the flattened [mbs * heads] batch
        core = [bmm_kernel((bh, n, d), (bh, d, n)), bmm_kernel((bh, n, n), (bh, n, d))]
        if self.flash:
            # torchtitan CP (torch ring attention, load-balanced): cp blocks of [s/cp]^2 causal FLOP
            core = [flash_attention(self.seq, self.seq, nh, nkv, d, "bwd", self.mbs, "sdpa")] * self.cp
        elif gpt_oss:
            sk = T(B16, b, nh, n, n + 1)
            core += [
                ew("SoftmaxBackward", [sk, sk, -1]),
                ew("Sum", sk),
                r2_kernel("Add_", sk),
                ew("Sum", T(B16, b, nh, n, 1)),
            ]
        else:
            f4 = T(F32, b, nh, n, n)
            core += [conv(sc, "Float"), ew("SoftmaxBackward", [f4, f4, -1])]
        if not self.flash:
            core += [ew("Mul", [sc, T("f64")]), bmm_kernel((bh, n, n), (bh, n, d)), bmm_kernel((bh, d, n), (bh, n, n))]
        out += core
        out += self._hf_rope(nh, gpt_oss) + self._hf_rope(nkv, gpt_oss)
        out += self._hf_lin_bwd(h, kv, gpt_oss) + self._hf_lin_bwd(h, kv, gpt_oss) + self._hf_lin_bwd(h, q, gpt_oss)
        return out + self._hf_rmsnorm("bwd", weight_first=not gpt_oss)

    @memo
    def hf_llama_mlp(self, phase: str) -> list[Kernel]:
        h, f, s = self.h, self.f, self.s
        glu, res = T(B16, 1, s, f), T(B16, 1, self.s_sp, h)
        silu = [uncaptured("SiLU", [s, f], 2 * 2 * s * f)] if self.hw else []  # read x1, write silu(x1)
        silu_bwd = [uncaptured("SiLUBackward", [s, f], 3 * 2 * s * f)] if self.hw else []  # read dy, x1; write dx1
        if phase == "fwd":
            return (
                self._hf_rmsnorm("fwd", True)
                + self._hf_lin_fwd(h, f)
                + silu
                + self._hf_lin_fwd(h, f)
                + [r2_kernel("Mul", glu)]
                + self._hf_lin_fwd(f, h)
                + [r2_kernel("Add", res)]
            )
        return (
            [r2_kernel("Add", res)]
            + self._hf_lin_bwd(f, h)
            + [r2_kernel("Mul", glu), r2_kernel("Mul", glu)]
            + silu_bwd
            + self._hf_lin_bwd(h, f)
            + self._hf_lin_bwd(h, f)
            + self._hf_rmsnorm("bwd", True)
        )

    @memo
    def hf_head(self, phase: str, gpt_oss: bool = False) -> list[Kernel]:
        """Final norm, LM head and the loss's fp32 upcast of the logits."""
        s, h, v = self.s, self.h, self.v
        logits = T(B16, 1, s, v) if gpt_oss else T(B16, 1, s - 1, v)
        n = s * v
        if phase == "fwd":  # cross entropy: log_softmax over the fp32 logits (read, write)
            loss = [uncaptured("LogSoftmax", [s, v], 8 * n)] if self.hw else []
            return self._hf_rmsnorm("fwd", not gpt_oss) + self._hf_lin_fwd(h, v) + [conv(logits, "Float")] + loss
        # nll_loss backward (zero-filled fp32 gradient), log_softmax backward (read 2, write 1)
        loss = [uncaptured("NllLossBackward", [s, v], 4 * n), uncaptured("LogSoftmaxBackward", [s, v], 12 * n)]
        return (
            (loss if self.hw else [])
            + [conv(T(F32, *logits[1]), "BFloat16")]
            + self._hf_lin_bwd(h, v)
            + self._hf_rmsnorm("bwd", not gpt_oss)
        )

    # ================================================================== kernels Phantora does not see
    def hw_embedding(self, phase: str) -> list[Kernel]:
        """``train.uncaptured_kernels``: the token embedding's gather (fwd: read and write [s, h]
        bf16) and its dense backward (a zero-filled bf16 [v, h] gradient, the rows added in)."""
        if not self.hw:
            return []
        s, h, v = self.s, self.h, self.v
        if phase == "fwd":
            return [uncaptured("Embedding", [s, h], 4 * s * h)]
        return [uncaptured("EmbeddingBackward", [v, h], 2 * v * h + 6 * s * h)]

    def hw_fsdp_copy_out(self, unsharded: int) -> list[Kernel]:
        """FSDP2's all-gather copy-out of one unit (``foreach_all_gather_copy_out``: the gathered
        flat bf16 buffer split into the parameters: read and write ``unsharded`` elements)."""
        return [uncaptured("FsdpCopyOut", [unsharded], 4 * unsharded)] if self.hw else []

    def hw_fsdp_rs_copy_in(self, unsharded: int) -> list[Kernel]:
        """FSDP2's reduce-scatter copy-in of one unit (``foreach_reduce``: the unsharded bf16
        gradients chunk-cat into the fp32 reduce-scatter input: read 2, write 4 bytes each)."""
        return [uncaptured("FsdpReduceCopyIn", [unsharded], 6 * unsharded)] if self.hw else []

    def hw_adamw_rest(self, partition: int) -> list[Kernel]:
        """The rest of torch AdamW (foreach, weight decay > 0) beyond the three calls Phantora
        intercepts (``adam_flat``): the decoupled weight decay ``_foreach_mul_`` of the
        parameters, ``_foreach_lerp_`` of exp_avg, ``_foreach_sqrt`` / ``_foreach_div_`` /
        ``_foreach_add_`` of the denominator; and the gradient clipping before it
        (``clip_grad_norm_``: ``_foreach_norm`` reads the gradients, ``_foreach_mul_`` scales them)."""
        if not self.hw:
            return []
        p = [T(F32, partition)]
        names = ("ForeachMulWd_", "ForeachLerp_", "ForeachSqrt", "ForeachDiv_", "ForeachAdd_", "ForeachMulClip_")
        return [foreach(k, p) for k in names] + [uncaptured("ForeachNorm", [partition], 4 * partition)]

    # ================================================================== gpt-oss MoE (HF training path)
    @memo
    def gptoss_moe(self, phase: str) -> list[Kernel]:
        """post-attention norm, router, every expert on every token (bmm), residual."""
        m = self.m
        e, s, h, f = m.experts, self.s, self.h, self.f
        x2 = T(B16, e, s, f)
        x4, w4 = T(B16, e, 1, s, h), T(B16, e, 1, s, 1)
        res = T(B16, 1, s, h)
        if phase == "fwd":
            router = [
                linear(T(B16, s, h), T(B16, e, h), T(B16, e)),
                ew("Softmax", [T(B16, s, m.topk), 1]),
                zeros_like(T(B16, s, e)),
            ]
            experts = [
                bmm_kernel((e, s, h), (e, h, 2 * f)),
                ew("Add", [T(B16, e, s, 2 * f), T(B16, e, 1, 2 * f)]),
                ew("Mul", [x2, T("f64")]),
                r2_kernel("Mul", x2),
                ew("Add", [x2, T("i64")]),
                r2_kernel("Mul", x2),
                bmm_kernel((e, s, f), (e, f, h)),
                ew("Add", [T(B16, e, s, h), T(B16, e, 1, h)]),
                ew("Mul", [x4, w4]),
                ew("Sum", x4),
            ]
            return self._hf_rmsnorm("fwd", False) + router + experts + [r2_kernel("Add", res)]
        experts = [
            ew("Mul", [x4, w4]),
            r2_kernel("Mul", x4),
            ew("Sum", T(B16, e, s, h)),
            bmm_kernel((e, s, h), (e, h, f)),
            bmm_kernel((e, f, s), (e, s, h)),
            r2_kernel("Mul", x2),
            r2_kernel("Mul", x2),
            r2_kernel("Mul", x2),
            r2_kernel("Mul", x2),
            ew("Mul", [x2, T("f64")]),
            ew("Where", [T("b8", e, s, f), x2, T(B16)]),
            ew("Where", [T("b8", e, s, f), x2, T(B16)]),
            ew("Sum", T(B16, e, s, 2 * f)),
            bmm_kernel((e, s, 2 * f), (e, 2 * f, h)),
            bmm_kernel((e, h, s), (e, s, 2 * f)),
        ]
        router = [
            ew("SoftmaxBackward", [T(B16, s, m.topk), T(B16, s, m.topk), 1]),
            mm_kernel((s, e), (e, h)),
            mm_kernel((e, s), (s, h)),
            ew("Sum", T(B16, s, e)),
        ]
        return [r2_kernel("Add", res)] + experts + router + self._hf_rmsnorm("bwd", False)
