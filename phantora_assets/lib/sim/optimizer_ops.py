"""The gradient and optimizer torch calls of a training step (Phantora perf-DB keys).

Sources (read, not run): Megatron DDP (1/dp grad scaling per bucket) and the distributed
optimizer with ``torch.optim.AdamW`` (foreach; the Megatron fallback without Apex/TE); DeepSpeed
``BF16_Optimizer`` (fp32 grad accumulation per parameter, one flat fp32 -> bf16 conversion and
1/dp scaling before the all-reduce) and ZeRO-3 (fp32 gradient partition) with
``torch.optim.Adam`` (foreach, no weight decay). The shapes are those of the L40S perf DB
(``perfdb/l40s/compute.csv``), which holds these workloads' keys.

:class:`OptimizerOps` is the base of :class:`~phantora_assets.lib.sim.torch_ops.TorchOps` (which
adds the layers' calls): it holds the run's
:class:`~phantora_assets.lib.sim.workload_layout.WorkloadLayout` and the per-instance cache of
kernel lists that :func:`memo` fills. The shorthands both modules build lists with live here
too: the dtype codes :data:`B16` / :data:`F32` and :func:`r2_kernel` (an element-wise op of a tensor
with itself). Each method returns a list of :class:`~phantora_assets.lib.sim.kernels.Kernel` for
ONE rank; sizes are element counts (the flat buffers' and partitions' sizes are arguments, the
per-parameter lists read the layout's parameters); nothing here raises for a valid layout. No
Dagster import.
"""

from __future__ import annotations

from phantora_assets.lib.sim.kernels import Kernel, T, conv, ew, foreach, zeros_like
from phantora_assets.lib.sim.workload_layout import WorkloadLayout

B16, F32 = "bf16", "f32"


def r2_kernel(op: str, t: list) -> Kernel:
    return ew(op, [t, t])


def memo(fn):
    """Cache a kernel-list method per (instance, arguments); callers get a fresh list."""

    def wrapper(self, *args, **kwargs):
        key = (fn.__name__, args, tuple(sorted(kwargs.items())))
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = tuple(fn(self, *args, **kwargs))
        return list(hit)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class OptimizerOps:
    """Gradient and optimizer kernel lists of one rank of ``model`` (see module docstring)."""

    def __init__(self, model: WorkloadLayout) -> None:
        self._memo: dict[tuple, tuple[Kernel, ...]] = {}
        self.m = model
        # Megatron's gradient buffer dtype (megatron-core param_and_grad_buffer.py: ``torch.float if
        # grad_reduce_in_fp32 else param.dtype``; train.grad_reduce_dtype): main_grad.add_, the 1/dp
        # scaling and the optimizer's ``.float()`` run on it
        fp32 = model.spec.framework == "megatron" and model.spec.wl.train.grad_reduce_dtype == "fp32"
        self.grad_dt = F32 if fp32 else B16

    def main_grad_add(self, *shape: int) -> Kernel:
        """Megatron DDP's backward hook ``param.main_grad.add_(param.grad)`` into the gradient
        buffer: bf16 into bf16, or the bf16 gradient into the fp32 buffer (grad_reduce_in_fp32)."""
        if self.grad_dt == B16:
            return r2_kernel("Add_", T(B16, *shape))
        return ew("Add_", [T(F32, *shape), T(B16, *shape)])

    # ================================================================== Megatron DDP / distributed optimizer
    @memo
    def megatron_grad_scale(self, bucket_numel: int) -> list[Kernel]:
        """``bucket.grad_data *= 1/dp`` before the bucket's reduce-scatter (in the buffer's dtype)."""
        g = T(self.grad_dt, bucket_numel)
        return [ew("Mul_", [g, T("f64")], out=g)]

    def megatron_optimizer(self, groups: list[tuple[bool, list[int]]], warmup: bool) -> list[Kernel]:
        """Distributed optimizer step: main grads to fp32 per shard piece, then AdamW (foreach)
        per param group. ``groups``: (weight decay?, shard piece sizes in buffer order). With an
        fp32 gradient buffer ``shard_model_grad.float()`` is the buffer itself (no conversion;
        megatron-core distrib_optimizer.py ``_copy_model_grads_to_main_grads``)."""
        out: list[Kernel] = []
        for _, pieces in groups:
            out += [conv(T(self.grad_dt, n), "Float") for n in pieces if self.grad_dt != F32]
        for decay, pieces in groups:
            if not pieces:
                continue
            lst = [T(F32, n) for n in pieces]
            if warmup:
                out += [zeros_like(t) for t in lst for _ in range(2)]
            ops = [foreach("ForeachMulScalar_", lst)] * (2 if decay else 1)
            out += ops + [foreach("ForeachAddCMul_", [lst, lst, lst]), foreach("ForeachAddCDiv_", [lst, lst, lst])]
        return out

    # ================================================================== DeepSpeed optimizers
    @memo
    def bf16_update_hp_grads(self) -> list[Kernel]:
        """BF16_Optimizer: every parameter's bf16 grad converted and added to its fp32 grad."""
        out: list[Kernel] = []
        for p in self.m.params:
            shape = self.m.param_shape(p)
            out += [conv(T(B16, *shape), "Float"), r2_kernel("Add_", T(F32, p.numel))]
        return out

    @memo
    def bf16_grads_for_reduction(self, total: int) -> list[Kernel]:
        """The flat fp32 grads converted to the bf16 communication dtype and scaled by 1/dp."""
        return [conv(T(F32, total), "BFloat16"), ew("Mul_", [T(B16, total), T("f64")], out=T(B16, total))]

    @memo
    def zero3_grad_norm(self, dp: int) -> list[Kernel]:
        """ZeRO-3 ``get_grad_norm_direct``: every gradient partition ``.double()`` before its norm."""
        return [conv(T(B16, -(-p.numel // dp)), "Double") for p in self.m.params]

    @memo
    def adam_flat(self, partition: int, warmup: bool, convert_grads: bool, unscale: bool) -> list[Kernel]:
        """torch.optim.Adam (foreach, weight decay 0) over one flat fp32 partition."""
        p = T(F32, partition)
        out: list[Kernel] = []
        if convert_grads:
            out.append(conv(T(B16, partition), "Float"))
        if unscale:
            out.append(ew("Mul_", [p, T("f64")], out=p))
        if warmup:
            out += [zeros_like(p), zeros_like(p)]
        lst = [p]
        return out + [
            foreach("ForeachMulScalar_", lst),
            foreach("ForeachAddCMul_", [lst, lst, lst]),
            foreach("ForeachAddCDiv_", [lst, lst, lst]),
        ]
