"""The intercepted torch calls each framework issues per training step (Phantora perf-DB keys).

This module lists the layers' calls (attention, MLP, MoE, embedding, LM head). Sources (read, not
run): Megatron-core local layer spec (``get_gpt_layer_local_spec``: column/row-parallel linears as
``torch.matmul``, ``DotProductAttention`` = baddbmm + torch softmax in fp32 + dropout + bmm,
``bias_dropout_add``, unfused RoPE) and Megatron DDP's ``main_grad.add_`` into the bf16 grad
buffer; Hugging Face Llama and gpt-oss eager attention and RMSNorm. The shapes are those of the
L40S perf DB (``perfdb/l40s/compute.csv``), which holds these workloads' keys. The gradient and
optimizer calls (Megatron DDP and distributed optimizer, DeepSpeed ``BF16_Optimizer`` / ZeRO-3,
Adam) are the methods :class:`TorchOps` inherits from
:class:`~phantora_assets.lib.sim.optimizer_ops.OptimizerOps`.

Only what Phantora times is listed: ops it does not intercept (embedding, fused norms, index,
permute, copy_, zero_, sqrt, lerp, ...) cost zero in Phantora and are absent here. Each
method returns a list of :class:`~phantora_assets.lib.sim.kernels.Kernel` for ONE rank.

Built from a run's :class:`~phantora_assets.lib.sim.workload_layout.WorkloadLayout` (dimensions,
tp/cp/ep, per-rank shapes; torchtitan's on TP shards); the step programs call :func:`torch_ops`
(workloads -> torch_ops -> optimizer_ops -> workload_layout, never back). Shapes are element dims,
sizes element counts; nothing raises for a valid layout. No Dagster import.
"""

from __future__ import annotations

from phantora_assets.lib.sim.kernels import Kernel, T, baddbmm, conv, ew, flash_attention, uncaptured
from phantora_assets.lib.sim.optimizer_ops import B16, F32, memo, r2_kernel
from phantora_assets.lib.sim.workload_layout import WorkloadLayout
from phantora_assets.lib.workload.hf_ops import HfOps, bmm_kernel, mat_kernel, mm_kernel

DROPOUT_P = 100000  # p = 0.1 as Phantora serialises it (x 1e6)
DROPOUT_SCALE = 1111110  # 1 / (1 - p) x 1e6


_SHARED: dict[tuple, TorchOps] = {}


def torch_ops(model: WorkloadLayout) -> TorchOps:
    """A :class:`TorchOps` shared by every model with the same dimensions and parallelism (the
    kernel lists depend on nothing else; the optimizer ones take their sizes as arguments)."""
    sp = model.spec
    key = (
        sp.workload,
        sp.framework,
        sp.par,
        sp.wl.train.attention,
        sp.wl.train.uncaptured_kernels,
        sp.wl.train.grad_reduce_dtype,
        model.seq,
        model.mbs,
        model.hidden,
        model.ffn,
        model.heads,
        model.kv_heads,
        model.head_dim,
        model.vocab,
        model.experts,
        model.topk,
        sp.wl.model.mlp,
        sp.wl.model.norm,
    )
    ops = _SHARED.get(key)
    if ops is None:
        if len(_SHARED) > 256:
            _SHARED.clear()
        ops = _SHARED[key] = TorchOps(model)
    return ops


class TorchOps(HfOps):
    """Kernel lists of one rank of ``model`` (see module docstring); the Hugging Face / torchtitan
    lists and the shared dimensions come from :class:`~phantora_assets.lib.workload.hf_ops.HfOps`."""

    # ================================================================== Megatron (local spec)
    def _mlin_fwd(self, k_in: int, n_out: int) -> list[Kernel]:
        return [mat_kernel((self.s, 1, k_in), (k_in, n_out))]

    def _mlin_bwd(self, k_in: int, n_out: int) -> list[Kernel]:
        """grad input, weight grad (2-D), main_grad.add_ into the grad buffer (bf16, or fp32)."""
        return [
            mat_kernel((self.s, 1, n_out), (n_out, k_in)),
            mat_kernel((n_out, self.s), (self.s, k_in)),
            self.main_grad_add(n_out, k_in),
        ]

    def _mrope(self, heads: int) -> list[Kernel]:
        t, c = T(B16, self.s, 1, heads, self.d), T(B16, self.s, 1, 1, self.d)
        return [ew("Mul", [t, c]), ew("Mul", [t, c]), r2_kernel("Add", t)]

    def _mcore_attention(self, phase: str) -> list[Kernel]:
        """DotProductAttention (unfused): baddbmm, fp32 softmax with masked_fill_, dropout, bmm.
        Megatron-core's ``DotProductAttention.forward`` (``megatron/core/transformer/
        dot_product_attention.py``) views the query [sq, b, np, hn] as [sq, b * np, hn] and the
        scores as [b * np, sq, sk], then [b, np, sq, sk]: per sample [s, s], never [s*b, s*b];
        the causal mask of ``get_ltor_masks_and_position_ids`` is [1, 1, s, s] (one for the batch)."""
        np_, d, b, n = self.nh // self.tp, self.d, self.mbs, self.seq
        bn = b * np_
        sc, sc4, mask = T(B16, bn, n, n), T(B16, b, np_, n, n), T("b8", 1, 1, n, n)
        f4 = T(F32, b, np_, n, n)
        if phase == "fwd":
            return [
                baddbmm(sc, T(B16, bn, n, d), T(B16, bn, d, n)),
                conv(sc4, "Float"),
                ew("MaskedFill_", [f4, mask], out=f4),
                ew("Softmax", [f4, -1]),
                conv(f4, "BFloat16"),
                ew("Dropout", [sc4, DROPOUT_P, True]),
                bmm_kernel((bn, n, n), (bn, n, d)),
            ]
        return [
            bmm_kernel((bn, n, d), (bn, d, n)),
            bmm_kernel((bn, n, n), (bn, n, d)),
            ew("NativeDropoutBackward", [sc4, T("b8", b, np_, n, n), DROPOUT_SCALE]),
            conv(sc4, "Float"),
            ew("SoftmaxBackward", [f4, f4, -1]),
            ew("MaskedFill", [f4, mask]),
            conv(f4, "BFloat16"),
            bmm_kernel((bn, n, n), (bn, n, d)),
            ew("MulScalar", T(B16, bn, n, d)),
            bmm_kernel((bn, d, n), (bn, n, n)),
            ew("MulScalar", T(B16, bn, d, n)),
        ]

    @memo
    def _bda(self, phase: str) -> list[Kernel]:
        """bias-dropout-add of the residual: dropout + add (fwd), dropout grad + grad add (bwd)."""
        t = T(B16, self.s, 1, self.h)
        if phase == "fwd":
            return [ew("Dropout", [t, DROPOUT_P, True]), r2_kernel("Add", t)]
        return [ew("NativeDropoutBackward", [t, T("b8", self.s, 1, self.h), DROPOUT_SCALE]), r2_kernel("Add", t)]

    def _hw_norm(self, phase: str) -> list[Kernel]:
        """``train.uncaptured_kernels``: Transformer Engine's fused LayerNorm / RMSNorm of the
        layer input (fwd: read x, write y, bf16; bwd: read x and dy, write dx), on the sequence
        shard with sequence parallelism. Phantora times none of it."""
        if not self.hw:
            return []
        sp = self.tp > 1 and self.m.spec.par.sequence_parallel
        n = (self.s // self.tp if sp else self.s) * self.h
        if phase == "fwd":
            return [uncaptured("LayerNorm", [n], 4 * n)]
        return [uncaptured("LayerNormBackward", [n], 6 * n)]

    @memo
    def megatron_attention(self, phase: str) -> list[Kernel]:
        """One layer's self-attention block (after input norm) incl. the residual."""
        h, tp, d = self.h, self.tp, self.d
        qkv = (self.nh + 2 * self.nkv) * d // tp
        proj_in = self.nh * d // tp
        rope = self._mrope(self.nh // tp) + self._mrope(max(1, self.nkv // tp))
        flash = [flash_attention(self.seq, self.seq, self.nh // tp, max(1, self.nkv // tp), d, phase, self.mbs)]
        core = (flash if self.flash else self._mcore_attention(phase)) * self.cp  # ring: cp blocks of [s/cp]^2
        if phase == "fwd":
            norm = self._hw_norm("fwd")
            return norm + self._mlin_fwd(h, qkv) + rope + core + self._mlin_fwd(proj_in, h) + self._bda("fwd")
        return (
            self._bda("bwd") + self._mlin_bwd(proj_in, h) + core + rope + self._mlin_bwd(h, qkv) + self._hw_norm("bwd")
        )

    @memo
    def megatron_mlp(self, phase: str, ffn: int | None = None) -> list[Kernel]:
        """Dense SwiGLU MLP (fc1 -> silu(x1) * x2 -> fc2) incl. the residual; ``ffn`` its width
        (default the model's). A GeLU MLP (``model.mlp = "gelu"``; shared experts stay SwiGLU: the
        schema refuses gelu with moe) is fc1 [h -> ffn] -> gelu -> fc2: Megatron-core's ``MLP``
        without ``gated_linear_unit`` (``megatron/core/transformer/mlp.py``), its activation a fused
        element-wise kernel Phantora does not intercept (``bias_gelu_impl`` / ``F.gelu``), so no
        ``Mul``: only the two GEMMs and, with ``train.uncaptured_kernels``, the activation's traffic."""
        h, f = self.h, (ffn or self.f) // self.tp
        if self.m.spec.wl.model.mlp == "gelu":  # a dense model (the schema)
            return self._megatron_gelu_mlp(phase, h, f)
        glu = T(B16, self.s, 1, f)
        act, act_bwd = [], []
        if self.hw:  # the activation (SiLU / GELU) Phantora does not intercept: fwd read, write; bwd read 2, write
            act = [uncaptured("Activation", [self.s, f], 2 * 2 * self.s * f)]
            act_bwd = [uncaptured("ActivationBackward", [self.s, f], 3 * 2 * self.s * f)]
        if phase == "fwd":
            return (
                self._hw_norm("fwd") + self._mlin_fwd(h, 2 * f) + act + [r2_kernel("Mul", glu)] + self._mlin_fwd(f, h)
            ) + self._bda("fwd")
        return (
            self._bda("bwd")
            + self._mlin_bwd(f, h)
            + [r2_kernel("Mul", glu), r2_kernel("Mul", glu)]
            + act_bwd
            + self._mlin_bwd(h, 2 * f)
            + self._hw_norm("bwd")
        )

    @memo
    def megatron_router(self, phase: str) -> list[Kernel]:
        e, s, h = self.m.experts, self.s, self.h
        if phase == "fwd":
            return [mm_kernel((s, h), (h, e)), ew("Softmax", [T(B16, s, e), -1]), ew("Sum", T("b8", s, e))]
        return [
            ew("SoftmaxBackward", [T(F32, s, e), T(F32, s, e), -1]),
            mm_kernel((s, e), (e, h)),
            mm_kernel((e, s), (s, h)),
            self.main_grad_add(e, h),
        ]

    @memo
    def megatron_experts(self, phase: str) -> list[Kernel]:
        """SequentialMLP over the local experts; each gets (s*topk/E) tokens from every EP rank."""
        m = self.m
        local = m.experts // m.spec.ep
        s_tok = self.s // self.tp if (self.tp > 1 and m.spec.par.sequence_parallel) else self.s
        tok = (s_tok * m.topk // m.experts) * m.spec.ep * m.spec.par.etp
        h, f = self.h, self.f // m.spec.par.etp
        a, p = T(B16, tok, f), T(B16, tok, 1)
        if phase == "fwd":
            one = [
                mat_kernel((tok, h), (h, 2 * f)),
                r2_kernel("Mul", a),
                ew("Mul", [a, p]),
                mat_kernel((tok, f), (f, h)),
            ]
        else:
            one = [
                mat_kernel((tok, h), (h, f)),
                mat_kernel((h, tok), (tok, f)),
                self.main_grad_add(h, f),
                ew("Mul", [a, p]),
                ew("Sum", a),
                r2_kernel("Mul", a),
                r2_kernel("Mul", a),
                mat_kernel((tok, 2 * f), (2 * f, h)),
                mat_kernel((2 * f, tok), (tok, h)),
                self.main_grad_add(2 * f, h),
            ]
        return one * local

    @memo
    def megatron_embedding(self, phase: str) -> list[Kernel]:
        t = T(B16, self.s, 1, self.h)
        sh, vh = self.s * self.h, self.v // self.tp * self.h
        if phase == "fwd":
            rope = T(F32, self.s, 1, 1, self.d)
            gather = [uncaptured("Embedding", [self.s, self.h], 4 * sh)] if self.hw else []
            return gather + [ew("Mul", [rope, T("f64")]), conv(rope, "BFloat16"), ew("Dropout", [t, DROPOUT_P, True])]
        dense = [uncaptured("EmbeddingBackward", [self.v // self.tp, self.h], 2 * vh + 6 * sh)] if self.hw else []
        return [
            ew("NativeDropoutBackward", [t, T("b8", self.s, 1, self.h), DROPOUT_SCALE]),
            *dense,
            self.main_grad_add(self.v // self.tp, self.h),
        ]

    @memo
    def megatron_head(self, phase: str) -> list[Kernel]:
        """Output layer and the vocab-parallel cross entropy in fp32."""
        s, h, vt = self.s, self.h, self.v // self.tp
        lg, lf = T(B16, s, 1, vt), T(F32, s, 1, vt)
        # uncaptured_kernels: the vocab-parallel cross entropy's max (read), logits - max, exp_ and
        # div_ by the sum (read and write each) over the fp32 logits, beside the final norm
        ce = [uncaptured("VocabParallelSoftmax", [s, vt], 28 * s * vt)] if self.hw else []
        if phase == "fwd":
            return (
                self._hw_norm("fwd")
                + self._mlin_fwd(h, vt)
                + [conv(lg, "Float")]
                + ce
                + [ew("Sum", lf), r2_kernel("Mul", T(F32, s)), ew("Sum", T(F32, s))]
            )
        return (
            [ew("Mul_", [lf, T(F32, s, 1, 1)], out=lf), conv(lf, "BFloat16")]
            + self._mlin_bwd(h, vt)
            + self._hw_norm("bwd")
        )

    def _megatron_gelu_mlp(self, phase: str, h: int, f: int) -> list[Kernel]:
        """:meth:`megatron_mlp` of a GeLU MLP: ``f`` the per-rank width (ffn / tp)."""
        act, act_bwd = [], []
        if self.hw:  # GeLU forward reads x1 and writes y; backward reads dy and x1, writes dx1
            act = [uncaptured("Activation", [self.s, f], 2 * 2 * self.s * f)]
            act_bwd = [uncaptured("ActivationBackward", [self.s, f], 3 * 2 * self.s * f)]
        if phase == "fwd":
            return self._hw_norm("fwd") + self._mlin_fwd(h, f) + act + self._mlin_fwd(f, h) + self._bda("fwd")
        return self._bda("bwd") + self._mlin_bwd(f, h) + act_bwd + self._mlin_bwd(h, f) + self._hw_norm("bwd")
