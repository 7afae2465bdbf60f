"""The tables of a run-matrix file beside its ``[[run]]`` entries, and a run's layout rules.

* :func:`file_tables`: a file's ``[workloads.NAME]`` (:func:`~phantora_assets.lib.workload.spec.
  parse_workloads`) and ``[gpus.NAME]`` (:func:`parse_gpu`: the keys of ``gpus.toml``);
* :func:`tables_of_file`: those of a file on disk, parsed once per state of the file (:func:`file_stamp`);
* :func:`resolve`: a workload's parallel sizes on a GPU count (the rules of a layout);
* :func:`check_layout`: a ``RunSpec``'s workload on its GPU count (the published runs' wording
  first, then :meth:`~phantora_assets.lib.workload.spec.WorkloadSpec.resolve`) and its ``ep``.

Raise :class:`~phantora_assets.lib.errors.RunMatrixError` naming the file or entry and the rule.
No Dagster import.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any

from phantora_assets.lib.errors import RunMatrixError
from phantora_assets.lib.workload.spec import REST, Parallel, WorkloadSpec, got_repr, parse_fields, parse_workloads

_NAME = re.compile(r"^(?!phantora_)[a-z0-9][a-z0-9_]{0,99}$")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _describe(workload: object, gpu: object, nodes: object, gpus_per_node: object) -> str:
    """``<workload> <gpu> <layout>`` of an entry for its label; ``?`` for a value of the wrong type."""
    name = [v if isinstance(v, str) else "?" for v in (workload, gpu)]
    layout = "x".join(str(v) if _is_int(v) else "?" for v in (nodes, gpus_per_node))
    return f"{name[0]} {name[1]} {layout}"


GPU_KEYS: dict[str, tuple[tuple[type, ...], Any]] = {
    "name": ((str,), ...),
    "memory_gb": ((int, float), ...),
    "peak_bf16_flops": ((int, float), ...),
    "mem_bw_bytes_per_s": ((int, float), ...),
    "matmul_efficiency": ((int, float), ...),
    "memory_efficiency": ((int, float), ...),
    "l2_bytes": ((int,), 0),
    "l2_bw_bytes_per_s": ((int, float), 0),
    "kernel_floor_ns": ((int, float), 1000),
    "gemm_floor_ns": ((int, float), 4900),
    "sdpa_efficiency": ((int, float), 0),
    "scale_up_bw_bytes_per_s": ((int, float), 0),
    "perfdb": ((str,), ""),
    "source": ((str,), ""),
}


#: The range of each of a GPU's sizes, in the unit its key names: a value outside is a unit mistaken
#: (989 for an H100's 989 TFLOP/s, 141e9 for 141 GB) or no GPU. (key, unit, least, most)
GPU_RANGES: tuple[tuple[str, str, float, float], ...] = (
    ("memory_gb", "GiB", 0.001, 1e5),
    ("peak_bf16_flops", "FLOP/s (989 TFLOP/s is 989e12)", 1e9, 1e18),
    ("mem_bw_bytes_per_s", "bytes/s (4.8 TB/s is 4.8e12)", 1e6, 1e15),
)
#: scale_up_bw_bytes_per_s (bytes/s a GPU sends over its scale-up link, NVLink): the run's
#: ``loopback_gbps`` = value x 8 / 1e9, within the topology's 0.001 .. 1e6 Gbps
SCALE_UP_RANGE = (1.25e5, 1.25e14)


def parse_gpu(name: str, table: object, source_name: str) -> dict[str, Any]:
    """One ``[gpus.NAME]`` table (the keys of ``gpus.toml``), checked: known keys, TOML types,
    positive finite sizes in their key's unit (:data:`GPU_RANGES`: FLOP/s, bytes/s, GiB; a value
    off by a unit prefix is refused with the unit), efficiencies in (0, 1], the optional
    ``scale_up_bw_bytes_per_s`` (bytes/s, :data:`SCALE_UP_RANGE`; 0 = not given). Returns the
    dict with defaults filled in (a key left at 0 / "" that means "not given" is dropped)."""
    where = f"{source_name} [gpus.{name}]"
    d = parse_fields(table, GPU_KEYS, where)
    for k, unit, lo, hi in GPU_RANGES:
        if not (math.isfinite(d[k]) and d[k] > 0):
            raise RunMatrixError(f"{where}: {k} must be > 0 and finite ({unit}), got {d[k]!r}")
        if not lo <= d[k] <= hi:
            raise RunMatrixError(f"{where}: {k} is in {unit}: from {lo:g} to {hi:g}, got {d[k]!r}")
    su = d["scale_up_bw_bytes_per_s"]
    if su != 0 and not (math.isfinite(su) and SCALE_UP_RANGE[0] <= su <= SCALE_UP_RANGE[1]):
        raise RunMatrixError(
            f"{where}: scale_up_bw_bytes_per_s is in bytes/s (450 GB/s is 450e9): from {SCALE_UP_RANGE[0]:g} to "
            f"{SCALE_UP_RANGE[1]:g}, or leave it out (the run's topology loopback_gbps), got {su!r}"
        )
    if su == 0:
        d.pop("scale_up_bw_bytes_per_s")
    for k in ("matmul_efficiency", "memory_efficiency"):
        if not 0 < d[k] <= 1:
            raise RunMatrixError(f"{where}: {k} must be in (0, 1], got {d[k]!r}")
    for k in ("l2_bytes", "l2_bw_bytes_per_s", "kernel_floor_ns", "gemm_floor_ns"):
        if not (math.isfinite(d[k]) and d[k] >= 0):
            raise RunMatrixError(f"{where}: {k} must be >= 0 and finite, got {d[k]!r}")
    if not 0 <= d["sdpa_efficiency"] <= 1:
        sdpa = d["sdpa_efficiency"]
        raise RunMatrixError(f"{where}: sdpa_efficiency must be in [0, 1] (0: matmul_efficiency), got {sdpa!r}")
    if not d["perfdb"]:
        d["perfdb"] = name
    if not d["source"]:
        d.pop("source")
    return d


def file_tables(
    data: dict[str, Any], name: str, shipped_workloads: dict[str, WorkloadSpec], shipped_gpus: dict[str, Any]
) -> tuple[dict[str, WorkloadSpec], dict[str, dict[str, Any]]]:
    """The ``[workloads.*]`` and ``[gpus.*]`` of a run-matrix file's ``data`` (unknown top-level keys,
    names of shipped workloads or GPUs and names not of ``[a-z0-9_]`` refused: RunMatrixError)."""
    unknown = set(data) - {"run", "workloads", "gpus"}
    if unknown:
        raise RunMatrixError(f"{name}: unknown top-level keys {sorted(unknown)} (known: run, workloads, gpus)")
    wls = parse_workloads(data.get("workloads", {}), name)
    clash = set(wls) & set(shipped_workloads)
    if clash:
        raise RunMatrixError(f"{name}: [workloads.{sorted(clash)[0]}] is a shipped workload: name yours differently")
    for w in wls:
        if not _NAME.match(w):
            raise RunMatrixError(f"{name}: [workloads.{w}]: a workload name is [a-z0-9_], up to 100 characters")
    gpus_t = data.get("gpus", {})
    if not isinstance(gpus_t, dict):
        raise RunMatrixError(f"{name}: gpus must be a table of [gpus.NAME] tables, {got_repr(gpus_t)}")
    gpus = {g: parse_gpu(g, t, name) for g, t in gpus_t.items()}
    clash = set(gpus) & set(shipped_gpus)
    if clash:
        raise RunMatrixError(f"{name}: [gpus.{sorted(clash)[0]}] is a shipped GPU (gpus.toml): name yours differently")
    for g in gpus:
        if not _NAME.match(g):
            raise RunMatrixError(f"{name}: [gpus.{g}]: a GPU name is [a-z0-9_], up to 100 characters")
    return wls, gpus


def check_layout(spec: Any, entry: str) -> None:
    """The workload's layout rules on the run's GPU count (:meth:`WorkloadSpec.resolve`), the
    published runs' wording first: tp alone not dividing the GPU count, and the entry's ``ep``."""
    wl, world = spec.wl, spec.world_size
    p = wl.parallel
    if p.dp == "rest" and p.pp == p.cp == 1 and world % p.tp:
        raise RunMatrixError(
            f"{entry}: layout {spec.layout} has {world} GPU(s); {spec.workload} needs tensor_parallel_size={p.tp} "
            f"to divide the GPU count"
        )
    _check_ep(spec, entry)
    resolve(wl, world, entry, spec.ep_size)


def _check_ep(spec: Any, entry: str) -> None:
    """``ep``: an integer from 1 to the expert mesh (the GPU count for a one-stage, etp = 1 job)
    that divides it and the experts, Megatron MoE only."""
    wl, world, ep = spec.wl, spec.world_size, spec.ep_size
    experts, moe = wl.model.experts, wl.model.kind == "moe" and wl.framework == "megatron"
    p = wl.parallel
    mesh = world // (p.pp * (p.etp or p.tp)) if world % (p.pp * (p.etp or p.tp)) == 0 else world
    where = "the GPU count" if mesh == world else f"the expert mesh ({mesh} ranks: GPUs / (pp x etp))"
    if ep is None and moe and p.ep == "dp" and experts % mesh:
        what = "GPU count" if mesh == world else "expert mesh"
        why = f"sets expert_model_parallel_size = {what}, which must divide num_moe_experts={experts} (or set ep)"
    elif ep is None:
        return
    elif not _is_int(ep):
        hint = (
            " (ep = \"dp\", the expert mesh, is the workload's parallel.ep: leave the entry's ep out)"
            if ep == "dp"
            else ""
        )
        raise RunMatrixError(f"{entry}: ep must be an integer{hint}, {got_repr(ep)}")
    elif not moe:
        raise RunMatrixError(f"{entry}: ep is only allowed for an MoE workload (expert_parallel in presets.toml)")
    elif not 1 <= ep <= mesh or mesh % ep or experts % ep:
        why = f"needs ep from 1 to {mesh} dividing {where} and num_moe_experts={experts}, got {ep}"
    else:
        return
    raise RunMatrixError(f"{entry}: layout {spec.layout} has {world} GPUs; {spec.workload} {why}")


def _torchtitan_needs_a_shard(wl: WorkloadSpec, dp: int, w: str) -> None:
    """torchtitan zero 2 / 3 needs dp_shard = dp / dp_replicate > 1 or cp > 1, else RunMatrixError
    naming ``w`` and what torchtitan runs instead."""
    p = wl.parallel
    if wl.framework != "torchtitan" or p.zero < 2 or dp // p.dp_replicate > 1 or p.cp > 1:
        return
    # torchtitan (models/llama3/infra/parallelize.py, distributed/utils.py maybe_enable_amp @ 238fa99):
    # FSDP is applied only when ParallelDims.fsdp_enabled = dp_shard > 1 or cp > 1. With dp_shard = 1
    # and cp = 1 there is no sharding: dp_replicate > 1 is DDP (apply_ddp, 1-D only, else "DDP has not
    # supported > 1D parallelism"); with TP or PP mixed precision is disabled ("Mixed precision training
    # with TP or PP is only supported when FSDP/HSDP/CP is enabled": fp32 compute and collectives);
    # alone, torch.autocast. None of that is the FSDP2 bf16 step modelled here (nor the zero label).
    what = (
        f"dp_replicate = {p.dp_replicate} is torchtitan's DDP: write zero = 0 (1-D only)"
        if p.dp_replicate > 1
        else "TP / PP without FSDP trains in fp32 (maybe_enable_amp disables mixed precision), not modelled"
        if p.tp > 1 or p.pp > 1
        else "one GPU trains under torch.autocast, not modelled"
    )
    raise RunMatrixError(
        f"{w}: zero = {p.zero} with dp_shard = dp / dp_replicate = {dp // p.dp_replicate} and cp = 1 is "
        "no FSDP in torchtitan (ParallelDims.fsdp_enabled = dp_shard > 1 or cp > 1): " + what
    )


def resolve(wl: WorkloadSpec, world: int, entry: str, ep_override: int | None = None) -> Parallel:
    """The sizes of workload ``wl`` on ``world`` GPUs (``ep_override``: a ``[[run]]`` entry's
    ``ep``). Raises RunMatrixError naming ``entry`` and the rule."""
    p, m, t = wl.parallel, wl.model, wl.train
    w = f"{entry}: workload {wl.name}"
    fixed = p.tp * p.pp * p.cp
    if p.dp == REST:
        if world % fixed:
            raise RunMatrixError(
                f"{w}: tp x pp x cp = {p.tp} x {p.pp} x {p.cp} = {fixed} must divide the GPU count {world} "
                f'(dp = "rest" takes the GPUs left)'
            )
        dp = world // fixed
    else:
        dp = int(p.dp)
        if dp * fixed != world:
            raise RunMatrixError(
                f"{w}: dp x tp x pp x cp = {dp} x {p.tp} x {p.pp} x {p.cp} = {dp * fixed} must equal the GPU "
                f'count {world} (or write dp = "rest")'
            )
    etp = p.tp if p.etp is None else p.etp
    mesh = dp * p.cp * p.tp  # ranks of one pipeline stage
    if m.kind == "moe" and wl.framework == "megatron":
        ep = mesh // etp if p.ep == "dp" else int(p.ep)
        if ep_override is not None:
            ep = ep_override
        if mesh % etp or (mesh // etp) % ep:
            raise RunMatrixError(
                f"{w}: ep = {ep} must divide dp x cp x tp / etp = {dp} x {p.cp} x {p.tp} / {etp} = {mesh // etp}"
                " (Megatron-core's expert mesh: etp x ep x edp = the ranks of a pipeline stage)"
            )
        if m.experts % ep:
            raise RunMatrixError(f"{w}: experts = {m.experts} must be divisible by ep = {ep}")
    elif ep_override is not None:
        raise RunMatrixError(f"{entry}: ep is only allowed for a Megatron MoE workload ({wl.name} is not)")
    else:
        ep = 1
    edp = mesh // (ep * etp)
    if p.dp_replicate > 1 and dp % p.dp_replicate:
        raise RunMatrixError(f"{w}: dp_replicate = {p.dp_replicate} must divide dp = {dp} (HSDP)")
    _torchtitan_needs_a_shard(wl, dp, w)
    if t.global_batch is not None:
        if t.global_batch % (t.micro_batch * dp):
            raise RunMatrixError(
                f"{w}: global_batch = {t.global_batch} must be divisible by micro_batch x dp = "
                f"{t.micro_batch} x {dp} = {t.micro_batch * dp}"
            )
        mbs = t.global_batch // (t.micro_batch * dp)
    else:
        mbs = int(t.grad_accumulation or 1)
    if p.pp_schedule == "interleaved" and p.pp > 1 and mbs % p.pp:
        raise RunMatrixError(
            f"{w}: the interleaved schedule needs micro-batches per step ({mbs}) divisible by pp = {p.pp}"
            " (Megatron-core's rule)"
        )
    return Parallel(
        world, p.tp, p.pp, dp, p.cp, ep, etp, edp, mbs, p.sequence_parallel, p.zero, p.dp_replicate,
        p.pp_schedule if p.pp > 1 else "none", p.virtual_stages, p.tp_comm_overlap, p.overlap_grad_reduce,
    )  # fmt: skip


def file_stamp(path: Path) -> tuple[int, ...] | None:
    """(inode, size, mtime_ns, ctime_ns) of ``path``, None when it cannot be stat'ed."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


_TABLES: dict[str, tuple[tuple[int, ...] | None, tuple[dict[str, WorkloadSpec], dict[str, dict[str, Any]]]]] = {}


def tables_of_file(
    path: Path | None, shipped_workloads: dict[str, WorkloadSpec], shipped_gpus: dict[str, Any]
) -> tuple[dict[str, WorkloadSpec], dict[str, dict[str, Any]]]:
    """:func:`file_tables` of the run-matrix file ``path`` (none for None, or a file that cannot be
    read: loading the matrix reports it), parsed once per state of the file."""
    if path is None:
        return {}, {}
    stamp = file_stamp(path)
    hit = _TABLES.get(str(path))
    if hit is not None and hit[0] == stamp and stamp is not None:
        return hit[1]
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}, {}
    got = file_tables(data, str(path), shipped_workloads, shipped_gpus)
    _TABLES[str(path)] = (stamp, got)
    return got
