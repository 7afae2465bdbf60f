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

from phantora_assets.lib.sim.kernels import Kernel, T, baddbmm, conv, ew, linear, matmul, zeros_like
from phantora_assets.lib.sim.optimizer_ops import B16, F32, OptimizerOps, _memo, _r2
from phantora_assets.lib.sim.workload_layout import WorkloadLayout

DROPOUT_P = 100000  # p = 0.1 as Phantora serialises it (x 1e6)
DROPOUT_SCALE = 1111110  # 1 / (1 - p) x 1e6


def _mm(a: tuple[int, ...], b: tuple[int, ...], dtype: str = B16) -> Kernel:
    return matmul(T(dtype, *a), T(dtype, *b), op="MM")


def _bmm(a: tuple[int, ...], b: tuple[int, ...]) -> Kernel:
    return matmul(T(B16, *a), T(B16, *b), op="BMM")


def _mat(a: tuple[int, ...], b: tuple[int, ...], dtype: str = B16) -> Kernel:
    return matmul(T(dtype, *a), T(dtype, *b), op="MatMul")


_SHARED: dict[tuple, TorchOps] = {}


def torch_ops(model: WorkloadLayout) -> TorchOps:
    """A :class:`TorchOps` shared by every model with the same dimensions and parallelism (the
    kernel lists depend on nothing else; the optimizer ones take their sizes as arguments)."""
    sp = model.spec
    key = (
        sp.workload,
        sp.framework,
        sp.par,
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
    )
    ops = _SHARED.get(key)
    if ops is None:
        if len(_SHARED) > 256:
            _SHARED.clear()
        ops = _SHARED[key] = TorchOps(model)
    return ops


class TorchOps(OptimizerOps):
    """Kernel lists of one rank of ``model`` (see module docstring)."""

    def __init__(self, model: WorkloadLayout) -> None:
        super().__init__(model)
        self.s = model.seq * model.mbs
        self.h = model.hidden
        self.f = model.ffn
        self.tp = model.spec.tp
        self.cp = model.spec.par.cp
        self.nh = model.heads
        self.nkv = model.kv_heads
        self.d = model.head_dim
        self.v = model.vocab
        if model.spec.framework == "torchtitan":  # the Hugging Face-style lists on TP shards
            self.nh, self.nkv, self.f, self.v = (x // self.tp for x in (self.nh, self.nkv, self.f, self.v))

    # ================================================================== Megatron (local spec)
    def _mlin_fwd(self, k_in: int, n_out: int) -> list[Kernel]:
        return [_mat((self.s, 1, k_in), (k_in, n_out))]

    def _mlin_bwd(self, k_in: int, n_out: int) -> list[Kernel]:
        """grad input, weight grad (2-D), main_grad.add_ into the bf16 grad buffer."""
        return [
            _mat((self.s, 1, n_out), (n_out, k_in)),
            _mat((n_out, self.s), (self.s, k_in)),
            _r2("Add_", T(B16, n_out, k_in)),
        ]

    def _mrope(self, heads: int) -> list[Kernel]:
        t, c = T(B16, self.s, 1, heads, self.d), T(B16, self.s, 1, 1, self.d)
        return [ew("Mul", [t, c]), ew("Mul", [t, c]), _r2("Add", t)]

    def _mcore_attention(self, phase: str) -> list[Kernel]:
        """DotProductAttention (unfused): baddbmm, fp32 softmax with masked_fill_, dropout, bmm."""
        np_, s, d = self.nh // self.tp, self.s, self.d
        sc, sc4, mask = T(B16, np_, s, s), T(B16, 1, np_, s, s), T("b8", 1, 1, s, s)
        f4 = T(F32, 1, np_, s, s)
        if phase == "fwd":
            return [
                baddbmm(sc, T(B16, np_, s, d), T(B16, np_, d, s)),
                conv(sc4, "Float"),
                ew("MaskedFill_", [f4, mask], out=f4),
                ew("Softmax", [f4, -1]),
                conv(f4, "BFloat16"),
                ew("Dropout", [sc4, DROPOUT_P, True]),
                _bmm((np_, s, s), (np_, s, d)),
            ]
        return [
            _bmm((np_, s, d), (np_, d, s)),
            _bmm((np_, s, s), (np_, s, d)),
            ew("NativeDropoutBackward", [sc4, T("b8", 1, np_, s, s), DROPOUT_SCALE]),
            conv(sc4, "Float"),
            ew("SoftmaxBackward", [f4, f4, -1]),
            ew("MaskedFill", [f4, mask]),
            conv(f4, "BFloat16"),
            _bmm((np_, s, s), (np_, s, d)),
            ew("MulScalar", T(B16, np_, s, d)),
            _bmm((np_, d, s), (np_, s, s)),
            ew("MulScalar", T(B16, np_, d, s)),
        ]

    @_memo
    def _bda(self, phase: str) -> list[Kernel]:
        """bias-dropout-add of the residual: dropout + add (fwd), dropout grad + grad add (bwd)."""
        t = T(B16, self.s, 1, self.h)
        if phase == "fwd":
            return [ew("Dropout", [t, DROPOUT_P, True]), _r2("Add", t)]
        return [ew("NativeDropoutBackward", [t, T("b8", self.s, 1, self.h), DROPOUT_SCALE]), _r2("Add", t)]

    @_memo
    def megatron_attention(self, phase: str) -> list[Kernel]:
        """One layer's self-attention block (after input norm) incl. the residual."""
        h, tp, d = self.h, self.tp, self.d
        qkv = (self.nh + 2 * self.nkv) * d // tp
        proj_in = self.nh * d // tp
        rope = self._mrope(self.nh // tp) + self._mrope(max(1, self.nkv // tp))
        core = self._mcore_attention(phase) * self.cp  # ring attention: cp blocks of [s/cp, s/cp]
        if phase == "fwd":
            return self._mlin_fwd(h, qkv) + rope + core + self._mlin_fwd(proj_in, h) + self._bda("fwd")
        return self._bda("bwd") + self._mlin_bwd(proj_in, h) + core + rope + self._mlin_bwd(h, qkv)

    @_memo
    def megatron_mlp(self, phase: str, ffn: int | None = None) -> list[Kernel]:
        """Dense SwiGLU MLP (fc1 -> silu(x1) * x2 -> fc2) incl. the residual; ``ffn`` its width
        (default the model's)."""
        h, f = self.h, (ffn or self.f) // self.tp
        glu = T(B16, self.s, 1, f)
        if phase == "fwd":
            return self._mlin_fwd(h, 2 * f) + [_r2("Mul", glu)] + self._mlin_fwd(f, h) + self._bda("fwd")
        return self._bda("bwd") + self._mlin_bwd(f, h) + [_r2("Mul", glu), _r2("Mul", glu)] + self._mlin_bwd(h, 2 * f)

    @_memo
    def megatron_router(self, phase: str) -> list[Kernel]:
        e, s, h = self.m.experts, self.s, self.h
        if phase == "fwd":
            return [_mm((s, h), (h, e)), ew("Softmax", [T(B16, s, e), -1]), ew("Sum", T("b8", s, e))]
        return [
            ew("SoftmaxBackward", [T(F32, s, e), T(F32, s, e), -1]),
            _mm((s, e), (e, h)),
            _mm((e, s), (s, h)),
            _r2("Add_", T(B16, e, h)),
        ]

    @_memo
    def megatron_experts(self, phase: str) -> list[Kernel]:
        """SequentialMLP over the local experts; each gets (s*topk/E) tokens from every EP rank."""
        m = self.m
        local = m.experts // m.spec.ep
        s_tok = self.s // self.tp if (self.tp > 1 and m.spec.par.sequence_parallel) else self.s
        tok = (s_tok * m.topk // m.experts) * m.spec.ep * m.spec.par.etp
        h, f = self.h, self.f // m.spec.par.etp
        a, p = T(B16, tok, f), T(B16, tok, 1)
        if phase == "fwd":
            one = [_mat((tok, h), (h, 2 * f)), _r2("Mul", a), ew("Mul", [a, p]), _mat((tok, f), (f, h))]
        else:
            one = [
                _mat((tok, h), (h, f)),
                _mat((h, tok), (tok, f)),
                _r2("Add_", T(B16, h, f)),
                ew("Mul", [a, p]),
                ew("Sum", a),
                _r2("Mul", a),
                _r2("Mul", a),
                _mat((tok, 2 * f), (2 * f, h)),
                _mat((2 * f, tok), (tok, h)),
                _r2("Add_", T(B16, 2 * f, h)),
            ]
        return one * local

    @_memo
    def megatron_embedding(self, phase: str) -> list[Kernel]:
        t = T(B16, self.s, 1, self.h)
        if phase == "fwd":
            rope = T(F32, self.s, 1, 1, self.d)
            return [ew("Mul", [rope, T("f64")]), conv(rope, "BFloat16"), ew("Dropout", [t, DROPOUT_P, True])]
        return [
            ew("NativeDropoutBackward", [t, T("b8", self.s, 1, self.h), DROPOUT_SCALE]),
            _r2("Add_", T(B16, self.v // self.tp, self.h)),
        ]

    @_memo
    def megatron_head(self, phase: str) -> list[Kernel]:
        """Output layer and the vocab-parallel cross entropy in fp32."""
        s, h, vt = self.s, self.h, self.v // self.tp
        lg, lf = T(B16, s, 1, vt), T(F32, s, 1, vt)
        if phase == "fwd":
            return self._mlin_fwd(h, vt) + [
                conv(lg, "Float"),
                ew("Sum", lf),
                _r2("Mul", T(F32, s)),
                ew("Sum", T(F32, s)),
            ]
        return [ew("Mul_", [lf, T(F32, s, 1, 1)], out=lf), conv(lf, "BFloat16")] + self._mlin_bwd(h, vt)

    # ================================================================== Hugging Face Llama
    def _hf_lin_fwd(self, k_in: int, n_out: int, bias: bool = False, x3: bool = True) -> list[Kernel]:
        x = T(B16, 1, self.s, k_in) if x3 else T(B16, self.s, k_in)
        return [linear(x, T(B16, n_out, k_in), T(B16, n_out) if bias else None)]

    def _hf_lin_bwd(self, k_in: int, n_out: int, bias: bool = False) -> list[Kernel]:
        out = [_mm((self.s, n_out), (n_out, k_in)), _mm((n_out, self.s), (self.s, k_in))]
        if bias:
            out.append(ew("Sum", T(B16, self.s, n_out)))
        return out

    def _hf_rmsnorm(self, phase: str, weight_first: bool) -> list[Kernel]:
        s, h = self.s, self.h
        xb, xf, r = T(B16, 1, s, h), T(F32, 1, s, h), T(F32, 1, s, 1)
        w = T(B16, h)
        if phase == "fwd":
            scale = ew("Mul", [w, xf]) if not weight_first else ew("Mul", [w, xb])
            tail = [scale, conv(xf, "BFloat16")] if not weight_first else [conv(xf, "BFloat16"), scale]
            return [conv(xb, "Float"), ew("Pow", xf), ew("Add", [r, T("f64")]), ew("Mul", [xf, r])] + tail
        scale = ew("Mul", [xf, w]) if not weight_first else ew("Mul", [xb, w])
        return [
            scale,
            conv(xb, "Float"),
            ew("Mul", [xf, r]),
            _r2("Mul", xf),
            ew("Sum", xf),
            ew("MulScalar", xf),
            ew("DivScalar", xf),
            _r2("Add_", xf),
            conv(xf, "BFloat16"),
            ew("Sum", xb),
        ]

    def _hf_rope(self, heads: int, half: bool) -> list[Kernel]:
        s, d = self.s, self.d
        if half:  # gpt-oss: first*cos - second*sin, second*cos + first*sin on head halves
            t, c = T(B16, 1, heads, s, d // 2), T(B16, 1, 1, s, d // 2)
            return [ew("Mul", [t, c])] * 4 + [_r2("Add", t)]
        t, c = T(B16, 1, heads, s, d), T(B16, 1, 1, s, d)
        return [ew("Mul", [t, c]), ew("Mul", [t, c]), _r2("Add", t)]

    @_memo
    def hf_rotary(self, gpt_oss: bool = False) -> list[Kernel]:
        """The rotary embedding once per forward: inv_freq @ positions, cos/sin x scaling
        (gpt-oss keeps half-width cos/sin)."""
        cs = T(F32, 1, self.s, self.d // 2 if gpt_oss else self.d)
        return [
            _mat((1, self.d // 2, 1), (1, 1, self.s), F32),
            ew("Mul", [cs, T("f64")]),
            ew("Mul", [cs, T("f64")]),
            conv(cs, "BFloat16"),
            conv(cs, "BFloat16"),
        ]

    @_memo
    def hf_attention(self, phase: str, gpt_oss: bool = False) -> list[Kernel]:
        """input RMSNorm, q/k/v/o projections, RoPE, eager attention (softmax in fp32 for Llama;
        bf16 with attention sinks for gpt-oss), residual add."""
        s, h, nh, nkv, d = self.s, self.h, self.nh, self.nkv, self.d
        q, kv = nh * d, nkv * d
        sc = T(B16, 1, nh, s, s)
        res = T(B16, 1, s, h)
        if phase == "fwd":
            out = self._hf_rmsnorm("fwd", weight_first=not gpt_oss)
            out += self._hf_lin_fwd(h, q, gpt_oss) + self._hf_lin_fwd(h, kv, gpt_oss) + self._hf_lin_fwd(h, kv, gpt_oss)
            out += self._hf_rope(nh, gpt_oss) + self._hf_rope(nkv, gpt_oss)
            out += [_mat((1, nh, s, d), (1, nh, d, s)), ew("Mul", [sc, T("f64")])]
            if gpt_oss:
                sk = T(B16, 1, nh, s, s + 1)
                out += [ew("Add", [sc, T(B16, 1, 1, s, s)]), ew("Softmax", [sk, -1])]
            else:
                out += [ew("Softmax", [sc, -1], out=T(F32, 1, nh, s, s)), conv(T(F32, 1, nh, s, s), "BFloat16")]
            out += [ew("Dropout", [sc, 0, True]), _mat((1, nh, s, s), (1, nh, s, d))]
            return out + self._hf_lin_fwd(q, h, gpt_oss) + [_r2("Add", res)]
        out = [_r2("Add", res)] + self._hf_lin_bwd(q, h, gpt_oss)
        out += [_bmm((nh, s, d), (nh, d, s)), _bmm((nh, s, s), (nh, s, d))]
        if gpt_oss:
            sk = T(B16, 1, nh, s, s + 1)
            out += [ew("SoftmaxBackward", [sk, sk, -1]), ew("Sum", sk), _r2("Add_", sk), ew("Sum", T(B16, 1, nh, s, 1))]
        else:
            f4 = T(F32, 1, nh, s, s)
            out += [conv(sc, "Float"), ew("SoftmaxBackward", [f4, f4, -1])]
        out += [ew("Mul", [sc, T("f64")]), _bmm((nh, s, s), (nh, s, d)), _bmm((nh, d, s), (nh, s, s))]
        out += self._hf_rope(nh, gpt_oss) + self._hf_rope(nkv, gpt_oss)
        out += self._hf_lin_bwd(h, kv, gpt_oss) + self._hf_lin_bwd(h, kv, gpt_oss) + self._hf_lin_bwd(h, q, gpt_oss)
        return out + self._hf_rmsnorm("bwd", weight_first=not gpt_oss)

    @_memo
    def hf_llama_mlp(self, phase: str) -> list[Kernel]:
        h, f, s = self.h, self.f, self.s
        glu, res = T(B16, 1, s, f), T(B16, 1, s, h)
        if phase == "fwd":
            return (
                self._hf_rmsnorm("fwd", True)
                + self._hf_lin_fwd(h, f)
                + self._hf_lin_fwd(h, f)
                + [_r2("Mul", glu)]
                + self._hf_lin_fwd(f, h)
                + [_r2("Add", res)]
            )
        return (
            [_r2("Add", res)]
            + self._hf_lin_bwd(f, h)
            + [_r2("Mul", glu), _r2("Mul", glu)]
            + self._hf_lin_bwd(h, f)
            + self._hf_lin_bwd(h, f)
            + self._hf_rmsnorm("bwd", True)
        )

    @_memo
    def hf_head(self, phase: str, gpt_oss: bool = False) -> list[Kernel]:
        """Final norm, LM head and the loss's fp32 upcast of the logits."""
        s, h, v = self.s, self.h, self.v
        logits = T(B16, 1, s, v) if gpt_oss else T(B16, 1, s - 1, v)
        if phase == "fwd":
            return self._hf_rmsnorm("fwd", not gpt_oss) + self._hf_lin_fwd(h, v) + [conv(logits, "Float")]
        return [conv(T(F32, *logits[1]), "BFloat16")] + self._hf_lin_bwd(h, v) + self._hf_rmsnorm("bwd", not gpt_oss)

    # ================================================================== gpt-oss MoE (HF training path)
    @_memo
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
                _bmm((e, s, h), (e, h, 2 * f)),
                ew("Add", [T(B16, e, s, 2 * f), T(B16, e, 1, 2 * f)]),
                ew("Mul", [x2, T("f64")]),
                _r2("Mul", x2),
                ew("Add", [x2, T("i64")]),
                _r2("Mul", x2),
                _bmm((e, s, f), (e, f, h)),
                ew("Add", [T(B16, e, s, h), T(B16, e, 1, h)]),
                ew("Mul", [x4, w4]),
                ew("Sum", x4),
            ]
            return self._hf_rmsnorm("fwd", False) + router + experts + [_r2("Add", res)]
        experts = [
            ew("Mul", [x4, w4]),
            _r2("Mul", x4),
            ew("Sum", T(B16, e, s, h)),
            _bmm((e, s, h), (e, h, f)),
            _bmm((e, f, s), (e, s, h)),
            _r2("Mul", x2),
            _r2("Mul", x2),
            _r2("Mul", x2),
            _r2("Mul", x2),
            ew("Mul", [x2, T("f64")]),
            ew("Where", [T("b8", e, s, f), x2, T(B16)]),
            ew("Where", [T("b8", e, s, f), x2, T(B16)]),
            ew("Sum", T(B16, e, s, 2 * f)),
            _bmm((e, s, 2 * f), (e, 2 * f, h)),
            _bmm((e, h, s), (e, s, 2 * f)),
        ]
        router = [
            ew("SoftmaxBackward", [T(B16, s, m.topk), T(B16, s, m.topk), 1]),
            _mm((s, e), (e, h)),
            _mm((e, s), (s, h)),
            ew("Sum", T(B16, s, e)),
        ]
        return [_r2("Add", res)] + experts + router + self._hf_rmsnorm("bwd", False)
