"""``run.log``: the training script's stdout. Per-iteration simulated time and peak memory.

No Dagster import. Three line formats are recognised, anywhere in a line (launchers prefix
lines: pdsh writes ``host-2: ``, ``torchrun --tee`` writes ``[default0]:``):

Megatron (upstream ``tests/test_megatron.py``; every rank prints its own lines)::

    rank 0 iter 3 time: 0.45 wall: 12.30
    Rank 0 Time: [0.5123, 0.4511, ...] Avg Time: 0.45
    Rank 0 Peak: 30512.25MiB
    Rank 0 Wall: [...] Avg Wall: 12.31

DeepSpeed (upstream ``tests/test_deepspeed.py``; the per-iteration line on rank 0 only, some
versions add ``loss: L``, older ones print no rank and ``Avg time``)::

    rank 0 iter 3 loss: 10.3711 time: 0.45 wall: 12.30
    Rank 1 Time: [0.5123, 0.4511, ...] Avg Time: 0.45
    time: 0.45 wall: 12.30
    Time: [0.5123, 0.4511, ...] Avg time: 0.4511

The embedded analytic simulator (``phantora_assets.sources.analytic.simulate_run``; its
``run_log.json`` is written from the simulator's numbers, not parsed back from this log)::

    iteration   3/20 | simulated time (ms): 450.123 | peak memory (GiB): 28.51
    peak memory estimate: 28.51 GiB of 40.00 GiB

Times printed by the training scripts are Phantora's simulated clock in **seconds**
(``get_time_double`` = simulated µs / 1e6). The ``Time: [...]`` list carries full precision,
the per-iteration lines only two decimals, so the list wins when both are present. An
iteration's time is the maximum over the ranks that reported it (ranks finish a synchronous
step together; the slowest one bounds it). Peak memory is ``torch.cuda.max_memory_allocated``
in MiB, reported per rank (Megatron only); the run's peak is the largest. A line with
``CUDA out of memory``, ``OutOfMemoryError`` or ``OUT OF MEMORY`` marks the run as not fitting.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

_NUM = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
# Gaps are bounded ({0,N}): an unbounded ``.*?`` rescans the rest of the line from every "rank"
# (``"rank 1 iter 1 " * 16000``, 224 KB, took 35 s); real lines have a few words in between.
_ITER = re.compile(r"\brank (\d+) iter (\d+)\b.{0,200}?\btime: " + _NUM)
_ITER_NORANK = re.compile(r"(?:^|[\s:\]])time: " + _NUM + r" wall: " + _NUM)
_TIME_LIST = re.compile(r"(?:\bRank (\d+) )?\bTime: (\[[^\[\]\n]{0,65536}\]) Avg [Tt]ime")
_PEAK = re.compile(r"\bRank (\d+) Peak: " + _NUM + r"\s*MiB")
_ANALYTIC_ITER = re.compile(
    r"\biteration\s+(\d+)/(\d+) \| simulated time \(ms\): " + _NUM + r"(?: \| peak memory \(GiB\): " + _NUM + r")?"
)
_ANALYTIC_PEAK = re.compile(r"peak memory estimate: " + _NUM + r" GiB of " + _NUM + r" GiB")
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|OUT OF MEMORY")
_MODEL_SIZE = re.compile(r"\bModel size: (\d+)")

MIB = 1024 * 1024
GIB = 1024**3


@dataclass
class RunLog:
    """What ``run.log`` says about a run.

    Attributes:
        format: ``megatron``, ``deepspeed``, ``analytic`` or ``unknown`` (nothing recognised).
        iteration_s: simulated seconds of each iteration in order (the first is warm-up);
            empty when the log has no timing line.
        per_rank_s: rank -> its own iteration times (seconds), for the ranks that printed them.
        peak_memory_mib: rank -> peak allocated memory (MiB), for the ranks that printed it.
        peak_memory_gib: largest peak over ranks in GiB (None when not reported).
        out_of_memory: a line reports a CUDA out-of-memory error.
        oom_line: that line (stripped), else ``""``.
        model_params: the ``Model size: N`` the script printed, if any.
        precise: True when ``iteration_s`` comes from full-precision values (the ``Time: [...]``
            list or the analytic log), False when only from the two-decimal iteration lines.
    """

    format: str = "unknown"
    iteration_s: list[float] = field(default_factory=list)
    per_rank_s: dict[int, list[float]] = field(default_factory=dict)
    peak_memory_mib: dict[int, float] = field(default_factory=dict)
    peak_memory_gib: float | None = None
    out_of_memory: bool = False
    oom_line: str = ""
    model_params: int | None = None
    precise: bool = False

    @property
    def n_iterations(self) -> int:
        return len(self.iteration_s)

    @property
    def steady_iteration_s(self) -> float | None:
        """Median of the iterations after the first (warm-up); None with fewer than 2."""
        return float(median(self.iteration_s[1:])) if len(self.iteration_s) > 1 else None

    def metadata(self) -> dict[str, Any]:
        """JSON-friendly summary for run metadata (times in ms, memory in GiB; the per-iteration
        times as a list)."""
        steady = self.steady_iteration_s
        return {
            "run_log_format": self.format,
            "run_log_iterations": self.n_iterations,
            "run_log_first_iteration_ms": round(self.iteration_s[0] * 1e3, 3) if self.iteration_s else None,
            "run_log_steady_iteration_ms": round(steady * 1e3, 3) if steady is not None else None,
            "run_log_iteration_ms": [round(t * 1e3, 3) for t in self.iteration_s],
            "run_log_peak_memory_gib": round(self.peak_memory_gib, 3) if self.peak_memory_gib is not None else None,
            "run_log_out_of_memory": self.out_of_memory,
        }

    def as_dict(self) -> dict[str, Any]:
        """Everything, JSON-serialisable (``run_log.json``)."""
        return {
            "format": self.format,
            "iteration_s": self.iteration_s,
            "per_rank_s": {str(k): v for k, v in sorted(self.per_rank_s.items())},
            "peak_memory_mib": {str(k): v for k, v in sorted(self.peak_memory_mib.items())},
            "peak_memory_gib": self.peak_memory_gib,
            "steady_iteration_s": self.steady_iteration_s,
            "out_of_memory": self.out_of_memory,
            "oom_line": self.oom_line,
            "model_params": self.model_params,
            "precise": self.precise,
        }


def _float_list(text: str) -> list[float] | None:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, float)) for v in value):
        return None
    return [float(v) for v in value]


def _merge_ranks(per_rank: dict[int, list[float]]) -> list[float]:
    """Iteration i = max over ranks of their iteration i (ranks with fewer entries skip it)."""
    n = max((len(v) for v in per_rank.values()), default=0)
    return [max(v[i] for v in per_rank.values() if len(v) > i) for i in range(n)]


def parse_run_log(text: str) -> RunLog:  # noqa: C901, PLR0912, PLR0915 (one pass over run.log, a branch per line format)
    """Parse ``run.log`` text (see the module docstring for the formats). Never raises."""
    out = RunLog()
    lists: dict[int, list[float]] = {}
    lines_iter: dict[int, dict[int, float]] = {}
    norank_iter: list[float] = []
    analytic: dict[int, float] = {}
    analytic_peak: list[float] = []
    saw_megatron = saw_deepspeed = False
    for line in text.splitlines():
        if not out.out_of_memory and _OOM.search(line):
            out.out_of_memory = True
            out.oom_line = line.strip()[:500]
        if m := _ANALYTIC_ITER.search(line):
            analytic[int(m.group(1))] = float(m.group(3)) / 1e3
            if m.group(4) is not None:
                analytic_peak.append(float(m.group(4)))
            continue
        if m := _ANALYTIC_PEAK.search(line):
            analytic_peak.append(float(m.group(1)))
            continue
        if m := _MODEL_SIZE.search(line):
            out.model_params = int(m.group(1))
        if m := _TIME_LIST.search(line):
            values = _float_list(m.group(2))
            if values is not None:
                rank = int(m.group(1)) if m.group(1) is not None else -1
                lists[rank] = values
                if m.group(1) is None:
                    saw_deepspeed = True
            continue
        if m := _PEAK.search(line):
            out.peak_memory_mib[int(m.group(1))] = float(m.group(2))
            saw_megatron = True
            continue
        if m := _ITER.search(line):
            lines_iter.setdefault(int(m.group(1)), {})[int(m.group(2))] = float(m.group(3))
            if "loss:" in line:
                saw_deepspeed = True
            continue
        if m := _ITER_NORANK.search(line):
            norank_iter.append(float(m.group(1)))
            saw_deepspeed = True
    if analytic:
        out.format = "analytic"
        out.iteration_s = [analytic[k] for k in sorted(analytic)]
        out.per_rank_s = {0: list(out.iteration_s)}
        out.precise = True
    elif lists:
        out.per_rank_s = dict(lists)
        out.iteration_s = _merge_ranks(lists)
        out.precise = True
    elif lines_iter:
        out.per_rank_s = {r: [its[k] for k in sorted(its)] for r, its in lines_iter.items()}
        out.iteration_s = _merge_ranks(out.per_rank_s)
    elif norank_iter:
        out.per_rank_s = {-1: list(norank_iter)}
        out.iteration_s = list(norank_iter)
    if out.format != "analytic" and (lists or lines_iter or norank_iter or out.peak_memory_mib):
        out.format = (
            "megatron" if saw_megatron and not saw_deepspeed else ("deepspeed" if saw_deepspeed else "megatron")
        )
    if analytic_peak:
        out.peak_memory_gib = max(analytic_peak)
    elif out.peak_memory_mib:
        out.peak_memory_gib = max(out.peak_memory_mib.values()) * MIB / GIB
    return out


def read_run_log(path: str | Path) -> RunLog:
    """Parse the file at ``path`` (UTF-8, undecodable bytes replaced)."""
    return parse_run_log(Path(path).read_text(encoding="utf-8", errors="replace"))
