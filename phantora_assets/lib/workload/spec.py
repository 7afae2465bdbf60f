"""Workloads as data: the ``[workloads.NAME]`` schema of a run-matrix file, parsed and validated.

A workload is a table with three sub-tables (docs/WORKLOADS.md lists every key)::

    [workloads.NAME]            framework = "megatron" | "deepspeed" | "torchtitan"
    [workloads.NAME.model]      kind, layers, hidden, ffn_hidden, heads, kv_heads, vocab, (moe keys)
    [workloads.NAME.parallel]   tp, pp, dp ("rest"), ep, cp, sequence_parallel, zero, pp_schedule, ...
    [workloads.NAME.train]      seq_len, micro_batch, global_batch | grad_accumulation, recompute, ...

:func:`parse_workload` checks one table on its own (types as written, nothing coerced; known keys
only; ranges; the shape rules that do not depend on the GPU count: tp divides heads and kv_heads,
pp x virtual_stages divides layers, experts divisible by ep, ...) and returns a frozen, hashable
:class:`WorkloadSpec`. :func:`~phantora_assets.lib.workload.tables.resolve` adds the rules of a
layout (dp x tp x pp x cp
== GPUs, ep dividing the expert mesh, global_batch divisible by micro_batch x dp) and returns the
:class:`Parallel` sizes of one run. Both raise :class:`~phantora_assets.lib.errors.RunMatrixError`
naming the entry and the rule. Pure data: no Dagster import, no simulator import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from phantora_assets.lib.errors import RunMatrixError

FRAMEWORKS = ("megatron", "deepspeed", "torchtitan")
KINDS = ("dense", "moe")
ARCHS = ("llama", "gpt_oss")
#: The dense MLP and the norm of a Megatron block: Megatron's ``--swiglu`` (fc1 of 2 x ffn_hidden,
#: silu(x1) * x2) or its default GeLU MLP (fc1 of ffn_hidden), ``--normalization RMSNorm`` (a weight)
#: or ``LayerNorm`` (Megatron's default: a weight and a bias). The first of each is the default here
#: (the shipped W1-W5 are Llama-style).
MLPS = ("swiglu", "gelu")
NORMS = ("rmsnorm", "layernorm")
SCHEDULES = ("gpipe", "1f1b", "interleaved")
RECOMPUTE = ("none", "selective", "full")
DTYPES = ("bf16",)
#: ``train.grad_reduce_dtype``: the dtype the data-parallel gradient collectives carry, as the
#: frameworks name it (fp32 / bf16).
GRAD_REDUCE_DTYPES = ("bf16", "fp32")
#: Each framework's default ``train.grad_reduce_dtype`` for bf16 training, from its source:
#: megatron: megatron-core ``DistributedDataParallelConfig.grad_reduce_in_fp32 = False``
#: (megatron/core/distributed/distributed_data_parallel_config.py): the gradient buffer has the
#: parameters' dtype (param_and_grad_buffer.py ``group_params_for_buffers``: ``torch.float if
#: grad_reduce_in_fp32 else param.dtype``), bf16 -- the DDPConfig Phantora's Megatron test builds
#: (tests/test_megatron.py), so the shipped W1-W3's bytes. (Megatron-LM's own training script with
#: ``--bf16`` sets ``accumulate_allreduce_grads_in_fp32`` unless ``--grad-reduce-in-bf16``:
#: megatron/training/arguments.py; such a job states fp32.)
#: deepspeed: ``engine.communication_data_type``: the config's ``communication_data_type`` when set,
#: else bf16 when bf16 is enabled (runtime/engine.py) -- the shipped W4/W5.
#: torchtitan: FSDP2 ``MixedPrecisionPolicy(reduce_dtype=training.mixed_precision_reduce)``, whose
#: only choice is "float32" (torchtitan/config/job_config.py ``Literal["float32"]``; 9dec370
#: config_manager.py ``choices=["float32"]``); DDP (zero 0) reduces the fp32 parameters' gradients.
GRAD_REDUCE_DEFAULT = {"megatron": "bf16", "deepspeed": "bf16", "torchtitan": "fp32"}
#: A schema dtype as Phantora's traces name it (``Collective.dtype``).
PHANTORA_DTYPE = {"bf16": "Bf16", "fp32": "F32"}
REST = "rest"

#: key -> (TOML types allowed, default; ``...`` = required). Strings of choices are checked after.
_TOP: dict[str, tuple[tuple[type, ...], Any]] = {
    "framework": ((str,), ...),
    "notes": ((str,), ""),
    "options": ((list,), []),
    "parallelism": ((str,), ""),
    "model": ((dict,), ...),
    "parallel": ((dict,), ...),
    "train": ((dict,), ...),
}
_MODEL: dict[str, tuple[tuple[type, ...], Any]] = {
    "name": ((str,), ""),
    "kind": ((str,), ...),
    "arch": ((str,), "llama"),
    "layers": ((int,), ...),
    "hidden": ((int,), ...),
    "ffn_hidden": ((int,), ...),
    "heads": ((int,), ...),
    "kv_heads": ((int,), None),
    "head_dim": ((int,), None),
    "vocab": ((int,), ...),
    "experts": ((int,), 0),
    "topk": ((int,), 0),
    "moe_ffn_hidden": ((int,), None),
    "shared_experts": ((int,), 0),
    "dense_layers": ((int,), 0),
    "mlp": ((str,), "swiglu"),
    "norm": ((str,), "rmsnorm"),
}
_PARALLEL: dict[str, tuple[tuple[type, ...], Any]] = {
    "tp": ((int,), 1),
    "pp": ((int,), 1),
    "dp": ((int, str), REST),
    "ep": ((int, str), 1),
    "cp": ((int,), 1),
    "etp": ((int,), None),
    "sequence_parallel": ((bool,), False),
    "tp_comm_overlap": ((bool,), False),
    "overlap_grad_reduce": ((bool,), True),
    "zero": ((int,), 0),
    "dp_replicate": ((int,), 1),
    "pp_schedule": ((str,), "1f1b"),
    "virtual_stages": ((int,), 1),
    "first_stage_layers": ((int,), None),
    "last_stage_layers": ((int,), None),
}
_TRAIN: dict[str, tuple[tuple[type, ...], Any]] = {
    "seq_len": ((int,), ...),
    "micro_batch": ((int,), 1),
    "global_batch": ((int,), None),
    "grad_accumulation": ((int,), None),
    "recompute": ((str,), "none"),
    "attention": ((str,), "flash"),
    "compile": ((bool,), False),
    "uncaptured_kernels": ((bool,), False),
    "dtype": ((str,), "bf16"),
    "grad_reduce_dtype": ((str,), None),
    "iterations": ((int,), 20),
}
_KINDS_TOML = {bool: "boolean", int: "integer", float: "float", str: "string", dict: "table", list: "array"}


def got_repr(value: object) -> str:
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"got {shown} ({_KINDS_TOML.get(type(value), type(value).__name__)})"


def parse_fields(table: object, keys: dict, where: str) -> dict[str, Any]:
    """The table's values with defaults filled in; unknown keys, missing required keys and wrong
    TOML types refused (a boolean is not an integer)."""
    if not isinstance(table, dict):
        raise RunMatrixError(f"{where}: must be a table, {got_repr(table)}")
    unknown = set(table) - set(keys)
    if unknown:
        raise RunMatrixError(f"{where}: unknown keys {sorted(unknown)} (known: {', '.join(keys)})")
    out: dict[str, Any] = {}
    for key, (types, default) in keys.items():
        if key not in table:
            if default is ...:
                raise RunMatrixError(f"{where}: missing key {key!r}")
            out[key] = default
            continue
        value = table[key]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            want = " or ".join(_KINDS_TOML[t] for t in types)
            article = "an" if want[0] in "aeiou" else "a"
            raise RunMatrixError(f"{where}: {key} must be {article} {want}, {got_repr(value)}")
        out[key] = value
    return out


@dataclass(frozen=True)
class ModelSpec:
    """Model shape. ``kv_heads`` defaults to ``heads``, ``head_dim`` to hidden // heads,
    ``moe_ffn_hidden`` to ``ffn_hidden``; MoE keys are 0 for a dense model. ``arch``: the module
    structure of the Hugging Face model DeepSpeed trains (``llama`` or ``gpt_oss``). ``mlp``
    (:data:`MLPS`) and ``norm`` (:data:`NORMS`): a Megatron block's dense MLP and norms."""

    name: str
    kind: str
    arch: str
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0
    topk: int = 0
    moe_ffn_hidden: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    mlp: str = "swiglu"
    norm: str = "rmsnorm"

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` (0-based, global) has an MoE MLP (the first ``dense_layers`` are dense)."""
        return self.kind == "moe" and i >= self.dense_layers


@dataclass(frozen=True)
class ParallelSpec:
    """Parallelism as written: ``dp`` an int or ``"rest"``; ``ep`` an int or ``"dp"`` (the whole
    expert mesh: dp x cp x tp / etp ranks); ``etp`` None = tp (Megatron's default)."""

    tp: int = 1
    pp: int = 1
    dp: int | str = REST
    ep: int | str = 1
    cp: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = True
    zero: int = 0
    dp_replicate: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None


@dataclass(frozen=True)
class TrainSpec:
    """Training settings: exactly one of ``global_batch`` and ``grad_accumulation`` is set."""

    seq_len: int
    micro_batch: int = 1
    global_batch: int | None = None
    grad_accumulation: int | None = None
    recompute: str = "none"
    attention: str = "flash"
    compile: bool = False
    uncaptured_kernels: bool = False
    dtype: str = "bf16"
    iterations: int = 20
    #: the dtype of the data-parallel gradient reductions (fp32 / bf16); unset in the table: the
    #: framework's (:data:`GRAD_REDUCE_DEFAULT`)
    grad_reduce_dtype: str = "bf16"


@dataclass(frozen=True)
class Parallel:
    """The sizes of one run (a :class:`WorkloadSpec` resolved on a GPU count).

    ``world = dp * tp * pp * cp``; ``edp`` the expert-data-parallel size (world / (pp * ep * etp));
    ``micro_batches`` per step and per data-parallel rank = global_batch / (micro_batch * dp)."""

    world: int
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    etp: int
    edp: int
    micro_batches: int
    sequence_parallel: bool
    zero: int
    dp_replicate: int
    pp_schedule: str
    virtual_stages: int
    tp_comm_overlap: bool = False
    overlap_grad_reduce: bool = True


@dataclass(frozen=True)
class WorkloadSpec:
    """One ``[workloads.NAME]`` table, validated (see module docstring). ``raw`` is the table as
    written (sorted JSON, for records and fingerprints; :meth:`table` gives it back)."""

    name: str
    framework: str
    model: ModelSpec
    parallel: ParallelSpec
    train: TrainSpec
    raw: str = "{}"

    def table(self) -> dict[str, Any]:
        return json.loads(self.raw)

    @property
    def model_name(self) -> str:
        return self.model.name or self.name


def _choice(value: str, choices: tuple[str, ...], key: str, where: str) -> None:
    if value not in choices:
        raise RunMatrixError(f"{where}: {key} must be one of {' | '.join(choices)}, got {value!r}")


#: Fewest iterations a workload may run: a period the communicators repeat ``RULE.min_repeats`` (3) times
#: (the first iteration, the warm-up, issues the steady calls after the init broadcasts). A job whose first
#: iteration issues other calls needs one more, :data:`MIN_ITERATIONS_OTHER_FIRST`: DeepSpeed ZeRO-3, whose
#: first iteration has no recorded parameter trace (no prefetch, every parameter gathered again in backward:
#: ``lib/sim/workloads.py`` ``_zero3_step``); tests/unit/lib/workload/test_first_iteration.py derives which
#: jobs those are from the generator's programs.
MIN_ITERATIONS = 3
MIN_ITERATIONS_OTHER_FIRST = 4
#: Most elements one tensor (an activation or a weight) of a workload may hold: 2^40 (2 TiB of bf16; the
#: 405B model's logits at 128 k tokens are 2^34); byte counts of all layers stay within int64.
MAX_TENSOR_ELEMENTS = 2**40


def _positive(d: dict[str, Any], keys: tuple[str, ...], where: str, minimum: int = 1) -> None:
    for k in keys:
        v = d.get(k)
        if v is not None and isinstance(v, int) and v < minimum:
            raise RunMatrixError(f"{where}: {k} must be >= {minimum}, got {v}")


def parse_workload(name: str, table: object, source_name: str) -> WorkloadSpec:  # noqa: C901, PLR0912, PLR0915 (one check per schema rule, each with its message)
    """Validate one ``[workloads.NAME]`` table (module docstring) into a :class:`WorkloadSpec`.

    Raises:
        RunMatrixError: ``<source_name> [workloads.NAME]...: <rule>``.
    """
    where = f"{source_name} [workloads.{name}]"
    top = parse_fields(table, _TOP, where)
    _choice(top["framework"], FRAMEWORKS, "framework", where)
    fw = top["framework"]
    if not all(isinstance(o, str) for o in top["options"]):
        raise RunMatrixError(f"{where}: options must be an array of strings")
    mw, pw, tw = f"{where}.model", f"{where}.parallel", f"{where}.train"
    md = parse_fields(top["model"], _MODEL, mw)
    pd_ = parse_fields(top["parallel"], _PARALLEL, pw)
    td = parse_fields(top["train"], _TRAIN, tw)
    # ---- model
    _choice(md["kind"], KINDS, "kind", mw)
    _choice(md["arch"], ARCHS, "arch", mw)
    _positive(md, ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "head_dim", "vocab"), mw)
    _positive(md, ("experts", "topk", "shared_experts", "dense_layers"), mw, 0)
    md["kv_heads"] = md["kv_heads"] or md["heads"]
    if md["heads"] % md["kv_heads"]:
        raise RunMatrixError(f"{mw}: kv_heads = {md['kv_heads']} must divide heads = {md['heads']} (GQA)")
    if md["head_dim"] is None:
        if md["hidden"] % md["heads"]:
            raise RunMatrixError(f"{mw}: heads = {md['heads']} must divide hidden = {md['hidden']} (or set head_dim)")
        md["head_dim"] = md["hidden"] // md["heads"]
    moe_keys = ("experts", "topk", "shared_experts", "dense_layers")
    if md["kind"] == "moe":
        if md["experts"] < 1 or not 1 <= md["topk"] <= md["experts"]:
            raise RunMatrixError(f"{mw}: an moe model needs experts >= 1 and 1 <= topk <= experts")
        if md["dense_layers"] >= md["layers"]:
            raise RunMatrixError(f"{mw}: dense_layers = {md['dense_layers']} must be < layers = {md['layers']}")
        _positive(md, ("moe_ffn_hidden",), mw)  # unset: ffn_hidden; 0 is refused like every other size
        md["moe_ffn_hidden"] = md["ffn_hidden"] if md["moe_ffn_hidden"] is None else md["moe_ffn_hidden"]
    else:
        if any(md[k] for k in moe_keys) or md["moe_ffn_hidden"] is not None:
            raise RunMatrixError(f"{mw}: {', '.join(moe_keys)}, moe_ffn_hidden are for kind = 'moe' only")
        md["moe_ffn_hidden"] = 0
    if md["arch"] == "gpt_oss" and fw != "deepspeed":
        raise RunMatrixError(f"{mw}: arch = 'gpt_oss' (the Hugging Face gpt-oss modules) is for deepspeed only")
    if fw == "deepspeed" and md["kind"] == "moe" and md["arch"] != "gpt_oss":
        # the Hugging Face Llama modules have no experts: built as Llama, the experts would vanish
        # from the parameters, bytes and FLOPs (issue 39, item 2)
        raise RunMatrixError(
            f"{mw}: a deepspeed moe model is the Hugging Face gpt-oss structure (experts run locally on every "
            "rank, no expert all-to-all, ZeRO over them): set arch = 'gpt_oss' (arch = 'llama' has no experts)"
        )
    if md["arch"] == "gpt_oss" and (md["kind"] != "moe" or md["shared_experts"] or md["dense_layers"]):
        raise RunMatrixError(
            f"{mw}: arch = 'gpt_oss' is an moe model with every layer an MoE layer and no shared experts "
            "(kind = 'moe', shared_experts = 0, dense_layers = 0: the Hugging Face gpt-oss modules)"
        )
    _choice(md["mlp"], MLPS, "mlp", mw)
    _choice(md["norm"], NORMS, "norm", mw)
    if (md["mlp"], md["norm"]) != ("swiglu", "rmsnorm") and fw != "megatron":
        # DeepSpeed trains the Hugging Face Llama / gpt-oss modules and torchtitan its Llama: SwiGLU
        # and RMSNorm, nothing else (their GPT blocks are not modelled)
        raise RunMatrixError(
            f"{mw}: mlp = {md['mlp']!r}, norm = {md['norm']!r}: a GeLU MLP and LayerNorm (GPT blocks) are "
            f"modelled for framework = 'megatron' only ({fw} runs the Llama modules: mlp = 'swiglu', "
            "norm = 'rmsnorm')"
        )
    if md["mlp"] == "gelu" and md["kind"] == "moe":
        raise RunMatrixError(
            f"{mw}: mlp = 'gelu' is a dense model's MLP here: the experts and shared experts of an moe "
            "model are SwiGLU (set mlp = 'swiglu' or kind = 'dense')"
        )
    model = ModelSpec(**md)
    # ---- parallel
    _choice(pd_["pp_schedule"], SCHEDULES, "pp_schedule", pw)
    _positive(pd_, ("tp", "pp", "cp", "etp", "dp_replicate", "virtual_stages"), pw)
    for key, word in (("dp", REST), ("ep", "dp")):
        v = pd_[key]
        if isinstance(v, str) and v != word:
            raise RunMatrixError(f'{pw}: {key} must be an integer or "{word}", got {v!r}')
        if isinstance(v, int) and v < 1:
            raise RunMatrixError(f"{pw}: {key} must be >= 1, got {v}")
    if not 0 <= pd_["zero"] <= 3:
        raise RunMatrixError(f"{pw}: zero must be 0, 1, 2 or 3, got {pd_['zero']}")
    tp, pp, cp, vs = pd_["tp"], pd_["pp"], pd_["cp"], pd_["virtual_stages"]
    if model.heads % tp or model.kv_heads % tp:
        raise RunMatrixError(
            f"{pw}: tp = {tp} must divide heads = {model.heads} and kv_heads = {model.kv_heads} "
            "(attention heads and query groups are split over the tensor-parallel ranks)"
        )
    if model.ffn_hidden % tp or (model.kind == "moe" and model.moe_ffn_hidden % tp) or model.vocab % tp:
        raise RunMatrixError(f"{pw}: tp = {tp} must divide ffn_hidden, moe_ffn_hidden and vocab")
    if pd_["pp_schedule"] == "interleaved":
        if vs < 2:
            raise RunMatrixError(f"{pw}: pp_schedule = 'interleaved' needs virtual_stages >= 2")
    elif vs != 1:
        raise RunMatrixError(f"{pw}: virtual_stages > 1 needs pp_schedule = 'interleaved'")
    fl, ll = pd_["first_stage_layers"], pd_["last_stage_layers"]
    if fl is not None or ll is not None:
        mid = pp - (fl is not None) - (ll is not None)
        rest = model.layers - (fl or 0) - (ll or 0)
        set_counts = [n for n in (fl, ll) if n is not None]
        if pp < 2 or vs > 1 or min(set_counts) < 1 or rest < 0 or (rest % mid if mid else rest):
            raise RunMatrixError(
                f"{pw}: first_stage_layers / last_stage_layers need pp >= 2, virtual_stages = 1, at least one "
                f"layer each, and the other {mid} stage(s) to share the remaining layers evenly "
                f"(layers = {model.layers})"
            )
    elif model.layers % (pp * vs):
        what = f"pp x virtual_stages = {pp} x {vs}" if vs > 1 else f"pp = {pp}"
        raise RunMatrixError(f"{pw}: {what} must divide layers = {model.layers} (whole layers per pipeline stage)")
    if isinstance(pd_["ep"], int) and pd_["ep"] > 1 or pd_["ep"] == "dp":
        if model.kind != "moe":
            raise RunMatrixError(f"{pw}: ep > 1 needs an moe model")
        if fw != "megatron":
            raise RunMatrixError(f"{pw}: ep > 1 (expert all-to-all) is modelled for megatron only")
        if isinstance(pd_["ep"], int) and model.experts % pd_["ep"]:
            raise RunMatrixError(f"{pw}: experts = {model.experts} must be divisible by ep = {pd_['ep']}")
    if pd_["etp"] is not None and (fw != "megatron" or pd_["etp"] not in (1, tp)):
        raise RunMatrixError(f"{pw}: etp (expert tensor parallel size) is megatron's: 1 or tp = {tp}")
    if fw == "megatron" and model.kind == "moe" and tp > 1 and not pd_["sequence_parallel"]:
        raise RunMatrixError(f"{pw}: megatron MoE with tp > 1 needs sequence_parallel = true (Megatron-core's rule)")
    if fw == "torchtitan" and tp > 1 and not pd_["sequence_parallel"]:
        raise RunMatrixError(f"{pw}: torchtitan's TP plan is sequence parallel: set sequence_parallel = true")
    if pd_["tp_comm_overlap"] and not (fw == "megatron" and pd_["sequence_parallel"]):
        raise RunMatrixError(
            f"{pw}: tp_comm_overlap (Megatron's --tp-comm-overlap, Transformer Engine userbuffers) is for "
            "framework = 'megatron' with sequence_parallel = true"
        )
    if not pd_["overlap_grad_reduce"] and fw != "megatron":
        raise RunMatrixError(
            f"{pw}: overlap_grad_reduce (Megatron's --overlap-grad-reduce, DistributedDataParallelConfig) is "
            "megatron's; leave it out for deepspeed and torchtitan"
        )
    if pd_["sequence_parallel"] and tp == 1:
        raise RunMatrixError(f"{pw}: sequence_parallel needs tp > 1")
    if fw == "deepspeed" and (tp, pp, cp) != (1, 1, 1):
        raise RunMatrixError(f"{pw}: deepspeed runs ZeRO data parallelism only here: tp = pp = cp = 1")
    if fw == "megatron" and pd_["zero"] > 1:
        raise RunMatrixError(
            f"{pw}: megatron has zero = 0 (DDP all-reduce) or 1 (the distributed optimizer), got {pd_['zero']}"
        )
    if fw == "torchtitan" and pd_["zero"] == 1:
        raise RunMatrixError(
            f"{pw}: torchtitan has zero = 0 (replicate: DDP), 2 (FSDP2, reshard_after_forward=False) or 3 (FSDP2)"
        )
    if fw == "torchtitan" and pd_["zero"] == 0 and (tp, pp, cp) != (1, 1, 1):
        # torchtitan models/llama3/infra/parallelize.py (238fa99, the last with apply_ddp): with
        # cp > 1 it applies FSDP over dp_shard x cp (ParallelDims.fsdp_enabled = dp_shard_enabled
        # or cp_enabled), never DDP; DDP on a larger world raises "DDP has not supported > 1D
        # parallelism" (world_size != the dp_replicate mesh's size)
        raise RunMatrixError(
            f"{pw}: torchtitan's DDP (zero = 0, apply_ddp) is 1-D data parallelism only: with tp > 1 or "
            "pp > 1 torchtitan raises 'DDP has not supported > 1D parallelism', with cp > 1 it applies "
            f"FSDP over dp_shard x cp; got tp = {tp}, pp = {pp}, cp = {cp} (use zero = 2 or 3)"
        )
    if pd_["dp_replicate"] > 1 and not (fw == "torchtitan" and pd_["zero"] >= 2):
        raise RunMatrixError(f"{pw}: dp_replicate (HSDP) is for torchtitan with zero = 2 or 3")
    if fw == "torchtitan" and model.kind == "moe":
        raise RunMatrixError(f"{pw}: torchtitan MoE is not modelled (use megatron for expert parallelism)")
    if cp > 1 and fw == "deepspeed":
        raise RunMatrixError(f"{pw}: cp > 1 is megatron's or torchtitan's")
    parallel = ParallelSpec(**pd_)
    # ---- train
    _choice(td["recompute"], RECOMPUTE, "recompute", tw)
    _choice(td["attention"], ("flash", "eager"), "attention", tw)
    if fw == "deepspeed" and td["recompute"] != "none":
        raise RunMatrixError(
            f"{tw}: recompute is not modelled for deepspeed (its steps run no Hugging Face gradient "
            "checkpointing: no forward rerun, no ZeRO-3 re-gathers): set recompute = 'none'"
        )
    if td["compile"] and fw != "torchtitan":
        raise RunMatrixError(f"{tw}: compile (torchtitan's compile.enable, torch.compile per block) is torchtitan's")
    if fw == "torchtitan" and cp > 1 and td["attention"] != "flash":
        raise RunMatrixError(
            f"{tw}: torchtitan's context parallelism runs SDPA's flash / efficient kernels only (torch "
            "_context_parallel _sdpa_handler: 'CP only supports flash attention and memory efficient "
            "attention'): attention must be 'flash' with cp > 1"
        )
    _choice(td["dtype"], DTYPES, "dtype", tw)
    _grad_reduce_dtype(td, fw, tw)
    _positive(td, ("seq_len", "micro_batch", "global_batch", "grad_accumulation", "iterations"), tw)
    if (td["global_batch"] is None) == (td["grad_accumulation"] is None):
        raise RunMatrixError(f"{tw}: set exactly one of global_batch and grad_accumulation")
    if td["iterations"] < MIN_ITERATIONS:
        raise RunMatrixError(
            f"{tw}: iterations must be >= {MIN_ITERATIONS} (a step is a period the communicators repeat 3 times: "
            "docs/STEPS.md), got " + str(td["iterations"])
        )
    if fw == "deepspeed" and pd_["zero"] == 3 and td["iterations"] < MIN_ITERATIONS_OTHER_FIRST:
        raise RunMatrixError(
            f"{tw}: iterations must be >= {MIN_ITERATIONS_OTHER_FIRST} for DeepSpeed ZeRO-3 (its first iteration, "
            "with no recorded parameter trace, issues other gathers; 3 steady ones make a step: docs/STEPS.md), got "
            + str(td["iterations"])
        )
    if td["seq_len"] % (2 * cp if cp > 1 else 1) or (pd_["sequence_parallel"] and td["seq_len"] % (tp * cp)):
        raise RunMatrixError(
            f"{tw}: seq_len = {td['seq_len']} must be divisible by 2 x cp (load-balanced context parallelism) "
            "and by tp x cp with sequence_parallel"
        )
    widest = max(model.hidden, model.ffn_hidden, model.moe_ffn_hidden, model.vocab)
    largest = max(td["seq_len"] * td["micro_batch"] * widest, model.hidden * max(model.ffn_hidden, model.vocab))
    if largest > MAX_TENSOR_ELEMENTS:
        raise RunMatrixError(
            f"{name}: its largest tensor holds {largest:,} elements, more than 2^40 = {MAX_TENSOR_ELEMENTS:,} "
            "(seq_len x micro_batch x the widest of hidden / ffn_hidden / vocab, or hidden x ffn_hidden or vocab): "
            "no GPU holds it, and byte counts of such sizes overflow 64 bits"
        )
    train = TrainSpec(**td)
    raw = json.dumps(table, sort_keys=True)
    return WorkloadSpec(name, fw, model, parallel, train, raw)


def _grad_reduce_dtype(td: dict[str, Any], fw: str, tw: str) -> None:
    """``train.grad_reduce_dtype``: one of :data:`GRAD_REDUCE_DTYPES`, the framework's default
    (:data:`GRAD_REDUCE_DEFAULT`) when unset; a dtype the framework does not reduce in, or one the
    model does not cover, refused naming the rule."""
    if td["grad_reduce_dtype"] is None:
        td["grad_reduce_dtype"] = GRAD_REDUCE_DEFAULT[fw]
        return
    _choice(td["grad_reduce_dtype"], GRAD_REDUCE_DTYPES, "grad_reduce_dtype", tw)
    if fw == "torchtitan" and td["grad_reduce_dtype"] != "fp32":
        raise RunMatrixError(
            f"{tw}: torchtitan reduces gradients in fp32 only: FSDP2's reduce_dtype is "
            "training.mixed_precision_reduce, whose only choice is 'float32' (torchtitan job_config "
            "Literal['float32']), and DDP (zero = 0) reduces the fp32 parameters' gradients"
        )


def parse_workloads(tables: object, source_name: str) -> dict[str, WorkloadSpec]:
    """Every ``[workloads.NAME]`` of a file (``tables`` = the file's ``workloads`` value)."""
    if not isinstance(tables, dict):
        raise RunMatrixError(f"{source_name}: workloads must be a table of [workloads.NAME] tables, {got_repr(tables)}")
    return {name: parse_workload(name, t, source_name) for name, t in tables.items()}


def parallelism_label(par: Parallel, framework: str) -> str:
    """Published-style parallelism string: ``ep=N`` for an expert-parallel job over every GPU with no
    other model parallelism (tp = pp = cp = 1, so the dense part is DP over the same N GPUs: the
    published W2/W3 runs), else tp, pp (with its schedule when not 1F1B), cp, ep (> 1: a Megatron MoE
    only, ``tables.resolve``), dp and, for deepspeed and torchtitan, zero: ``tp=2,dp=4``,
    ``dp=4,zero=3``, ``tp=4,pp=2(interleaved2),dp=2,zero=3``, ``tp=2,ep=32,dp=16`` (etp = 1: EP spans
    tp x dp; was ``ep=32``, hiding the job's TP = 2, DP = 16)."""
    if par.ep > 1 and par.ep == par.world and par.tp == par.pp == par.cp == 1:
        return f"ep={par.ep}"
    parts = [f"tp={par.tp}"] if par.tp > 1 else []
    if par.pp > 1:
        vs = par.virtual_stages if par.virtual_stages > 1 else ""
        parts.append(f"pp={par.pp}" + ("" if par.pp_schedule == "1f1b" else f"({par.pp_schedule}{vs})"))
    parts += [f"cp={par.cp}"] if par.cp > 1 else []
    parts += [f"ep={par.ep}"] if par.ep > 1 else []
    parts.append(f"dp={par.dp}")
    if par.zero and framework != "megatron":
        parts.append(f"zero={par.zero}")
    return ",".join(parts)
