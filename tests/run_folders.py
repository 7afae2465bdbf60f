"""Build run folders laid out like the published Phantora dataset, for import tests.

``traces/<gpu>/<workload>_<N>x<G>/`` with ``timeline.json.gz`` (written by
``chrome_trace.write_chrome_trace`` from an analytic simulation, optionally edited),
``timeline.bin`` (opaque bytes: nothing reads it), ``run.log`` in the training scripts' own
formats and ``config/netconfig.toml``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pandas as pd

from phantora_assets.lib.phantora.chrome_trace import write_chrome_trace
from phantora_assets.lib.phantora.netconfig import dumps_netconfig, netconfig_for
from phantora_assets.lib.sim.analytic import simulate
from phantora_assets.lib.sim.timeline import SimulationResult
from phantora_assets.matrix import RunSpec, spec_from_run_id


@cache
def _simulated(spec: RunSpec) -> SimulationResult:
    return simulate(spec)


def analytic(run: str | RunSpec) -> tuple[RunSpec, pd.DataFrame, list[float]]:
    """(spec, raw timeline copy, iteration seconds) of an analytic simulation of ``run`` (a
    run_id of the shipped matrix, or any RunSpec)."""
    r = _simulated(spec_from_run_id(run) if isinstance(run, str) else run)
    return r.spec, r.raw.copy(), [ns / 1e9 for ns in r.iteration_ns]


def megatron_log(iteration_s: list[float], ranks: int, peak_mib: float, model_params: int = 1_000_000) -> str:
    """run.log as upstream tests/test_megatron.py prints it (every rank prints its own lines)."""
    lines = [f"Model size: {model_params}"]
    for i, t in enumerate(iteration_s):
        for r in range(ranks):
            lines.append(f"rank {r} iter {i} time: {t:.2f} wall: {3.0 + i:.2f}")
    for r in range(ranks):
        lines.append(f"Rank {r} Time: {iteration_s!r} Avg Time: {sum(iteration_s[1:]) / (len(iteration_s) - 1):.2f}")
        lines.append(f"Rank {r} Peak: {peak_mib - 10 * r:<.2f}MiB")
        lines.append(f"Rank {r} Wall: {[3.0] * len(iteration_s)!r} Avg Wall: 3.00")
    return "\n".join(lines) + "\n"


def deepspeed_log(iteration_s: list[float], ranks: int, prefix: str = "host-1: ") -> str:
    """run.log as the perf-DB fork's tests/test_deepspeed.py prints it, lines prefixed by pdsh."""
    lines = [f"{prefix}[2026-01-01 00:00:00,000] [INFO] [launch.py:256:main] process 123 spawned"]
    for i, t in enumerate(iteration_s):
        lines.append(f"{prefix}rank 0 iter {i} loss: 11.9{i % 10} time: {t:.2f} wall: {4.0 + i:.2f}")
    for r in range(ranks):
        lines.append(
            f"{prefix}Rank {r} Time: {iteration_s!r} Avg Time: {sum(iteration_s[1:]) / (len(iteration_s) - 1):.2f}"
        )
    return "\n".join(lines) + "\n"


def write_run_folder(
    root: Path,
    spec: RunSpec,
    raw: pd.DataFrame | None,
    *,
    run_log: str | None,
    gz: bool = True,
    timeline_bin: bool = True,
    netconfig: bool = True,
) -> Path:
    """One run folder under ``root/traces/``; returns it."""
    folder = root / "traces" / spec.gpu / f"{spec.workload}_{spec.layout}"
    folder.mkdir(parents=True, exist_ok=True)
    if raw is not None:
        write_chrome_trace(raw, folder / ("timeline.json.gz" if gz else "timeline.json"))
    if timeline_bin:
        (folder / "timeline.bin").write_bytes(b"\x00\x00\x00\x00\x00\x00\x00\x04opaque")
    if run_log is not None:
        (folder / "run.log").write_text(run_log)
    if netconfig:
        (folder / "config").mkdir(exist_ok=True)
        (folder / "config" / "netconfig.toml").write_text(dumps_netconfig(netconfig_for(spec)))
        (folder / "config" / "command.txt").write_text("# recorded elsewhere\n")
    return folder


def mixed_send_recv(raw: pd.DataFrame, n: int) -> pd.DataFrame:
    """Record the all-to-all of an ``n``-rank communicator as a group of NcclSend *and* NcclRecv
    events: the flow of the pair (s, d) is a receive (caller = rank d) when s + d is odd.

    The analytic simulator emits each all-to-all as n(n-1) consecutive NcclSend rows with one
    start time, sender-major (s, then d), which gives every row's receiver.
    """
    raw = raw.copy()
    idx = np.flatnonzero((raw["call"] == "NcclSend").to_numpy())
    pairs = [(s, d) for s in range(n) for d in range(n) if s != d]
    assert len(idx) % len(pairs) == 0
    call, name, rank = (raw.columns.get_loc(c) for c in ("call", "name", "comm_rank"))
    for b in range(0, len(idx), len(pairs)):
        rows = idx[b : b + len(pairs)]
        assert raw["start_ns"].iloc[rows].nunique() == 1
        for r, (s, d) in zip(rows, pairs):
            assert raw.iat[r, rank] == s
            if (s + d) % 2:
                raw.iat[r, call] = raw.iat[r, name] = "NcclRecv"
                raw.iat[r, rank] = d
    return raw
