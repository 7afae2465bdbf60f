"""Pipeline-parallel schedules: the order in which one stage runs its micro-batches.

:func:`schedule` gives, for stage ``stage`` of ``pp``, the list of ``(phase, micro_batch,
virtual_stage)`` a training step runs, ``phase`` ``"F"`` (forward) or ``"B"`` (backward):

* ``gpipe``: every forward, then every backward (micro-batches in order).
* ``1f1b`` (Megatron-core ``forward_backward_pipelining_without_interleaving``, torchtitan
  ``Schedule1F1B``): ``min(pp - stage - 1, M)`` warm-up forwards, then one forward and one backward
  in turn, then the remaining backwards.
* ``interleaved`` (Megatron-core ``forward_backward_pipelining_with_interleaving``, torchtitan
  ``ScheduleInterleaved1F1B``): ``vs`` model chunks per stage; virtual micro-batch k runs
  chunk ``(k // pp) % vs`` of micro-batch ``(k // (pp * vs)) * pp + k % pp`` (backward chunks in
  reverse); ``min((pp - stage - 1) * 2 + (vs - 1) * pp, M * vs)`` warm-up forwards, then 1F1B.
* ``none`` (one stage): forward and backward of each micro-batch in turn (gradient accumulation).

Pure functions of integers; raise ``ValueError`` for an unknown schedule. No Dagster import.
"""

from __future__ import annotations

Op = tuple[str, int, int]


def _interleaved_ids(k: int, pp: int, vs: int, forward: bool) -> tuple[int, int]:
    group = k // (pp * vs)
    in_group = k % (pp * vs)
    chunk = in_group // pp
    if not forward:
        chunk = vs - 1 - chunk
    return group * pp + in_group % pp, chunk


def schedule(kind: str, pp: int, stage: int, micro_batches: int, vs: int = 1) -> list[Op]:
    """The ops of ``stage`` (module docstring). ``micro_batches`` >= 1; ``interleaved`` needs
    ``micro_batches % pp == 0`` (checked by the workload schema)."""
    m = micro_batches
    if kind == "none" or pp == 1:
        return [op for mb in range(m) for op in (("F", mb, 0), ("B", mb, 0))]
    if kind == "gpipe":
        return [("F", mb, 0) for mb in range(m)] + [("B", mb, 0) for mb in range(m)]
    if kind == "1f1b":
        warm = min(pp - stage - 1, m)
        ops: list[Op] = [("F", mb, 0) for mb in range(warm)]
        f, b = warm, 0
        while f < m:
            ops.append(("F", f, 0))
            f += 1
            ops.append(("B", b, 0))
            b += 1
        ops += [("B", mb, 0) for mb in range(b, m)]
        return ops
    if kind == "interleaved":
        total = m * vs
        warm = min((pp - stage - 1) * 2 + (vs - 1) * pp, total)
        ops = []
        f = b = 0
        for _ in range(warm):
            mb, v = _interleaved_ids(f, pp, vs, True)
            ops.append(("F", mb, v))
            f += 1
        while f < total:
            mb, v = _interleaved_ids(f, pp, vs, True)
            ops.append(("F", mb, v))
            f += 1
            mb, v = _interleaved_ids(b, pp, vs, False)
            ops.append(("B", mb, v))
            b += 1
        while b < total:
            mb, v = _interleaved_ids(b, pp, vs, False)
            ops.append(("B", mb, v))
            b += 1
        return ops
    raise ValueError(f"unknown pipeline schedule {kind!r}")


def in_flight(kind: str, pp: int, stage: int, micro_batches: int, vs: int = 1) -> int:
    """Most micro-batch chunks whose activations ``stage`` holds at once under ``kind`` (forwards
    run minus backwards run, maximised over the schedule): 1F1B keeps ``pp - stage`` micro-batches."""
    live = peak = 0
    for phase, _, _ in schedule(kind, pp, stage, micro_batches, vs):
        live += 1 if phase == "F" else -1
        peak = max(peak, live)
    return peak


def stage_bounds(pp: int, layers: int, first: int | None, last: int | None) -> list[tuple[int, int]]:
    """(first layer, end) of each of ``pp`` stages (one model chunk per stage): the first and last
    stages hold ``first`` / ``last`` layers when set (Megatron-core's
    ``num_layers_in_first/last_pipeline_stage``), the others share the rest evenly."""
    mid = pp - (first is not None) - (last is not None)
    each = (layers - (first or 0) - (last or 0)) // mid if mid else 0
    sizes = [each] * pp
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    out, a = [], 0
    for n in sizes:
        out.append((a, a + n))
        a += n
    return out
