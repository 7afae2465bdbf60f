"""Reconfigurable-network analysis: per NIC, communication phases by parallelism group, the transition
windows between them, and what a reconfiguration delay costs (docs/FABRIC.md, "Reconfiguration").

The setting is a photonic rail: an optical circuit switch per rail (NIC index), whose circuits suit one
parallelism group's traffic at a time and are reconfigured, taking ``delay``, when the NIC's traffic
passes from one group to another.

Phases. A NIC's flows are the network flows it sends or receives (not those inside one scale-up domain).
Sorted by start, a **phase** is a maximal run of consecutive flows of one ``group``
(``tp``, ``cp``, ``ep``, ``dp``, ``pp``, ``other``): it starts at its first flow's start and ends at the
latest end of its flows. Consecutive phases of a NIC have different groups by construction. Flows that
start at one instant (a step's zero-length scalar all-reduces: the loss over DP, the gradient norm over
DP and over PP) have no order in the trace, so none is taken from the rows: the current phase's group
continues first, then the instant's other groups in :data:`GROUPS` order (was: sent before received,
then row order, which read the same three flows as dp -> pp -> dp -> pp or as dp -> pp by row order).
The flows of a call of at most ``packet_bytes`` are in no phase (control collectives on the packet network:
the simulator's rule, ``lib/net/optical.py``).

Transitions. Between two consecutive phases of a NIC, ``from_group -> to_group``, the **window** is the
time with no flow of any group on the NIC: ``max(0, next start - busy end)``, ``busy end`` the latest end
of all the NIC's flows of the phases before the transition (not only the previous phase's: a flow of an
earlier phase can still be on the NIC). 0 when traffic is on the NIC until the next phase starts, or
overlaps it: no reconfiguration can be hidden. A transition belongs to the step of the phase it
leads into (so the last phase of step s-1 -> the first of step s counts in step s); only timed steady
steps are kept (``steps.timed``: a step cut by the trace's end, its end its last flow's, has no step time).

Sweep. For each delay D (:data:`DELAYS_MS`) and mode:

* ``on_demand``: the next configuration is requested at the phase boundary: every transition stalls D;
* ``provisioned``: it is requested when the previous phase ends: a transition stalls max(0, D - window).

A NIC's stall in a step is the sum over its transitions, ``T_stall = sum_i max(0, D - window_i)``
(provisioned) or ``n * D`` (on demand); the **step's stall is its most stalled NIC's** (the step waits
for it). Per steady step ``T_compute`` is the step's compute time and ``T_non-overlapped comm`` the rest
of its time (step time - compute: exposed communication and the waits on it, pipeline bubbles
included); the stalled step takes ``step time + stall``, and
``Util = T_compute / (T_compute + T_non-overlapped comm + T_stall)``. Over the timed steady steps:
``step_time_s`` is the step time of the stalled steps by the run's one definition (the median of the
typical ones, ``lib/traffic/steps/evidence.typical_step_us``, as ``runs.step_time_s``: at D = 0 the two
are the same number), ``stall_s`` the mean stall, ``utilisation`` the ratio of the sums.

Assumptions (docs/FABRIC.md): a stall delays the whole step by that amount (it is not overlapped with
compute, and stalls of different NICs overlap fully), the flows keep their simulated times (a stall does
not move later phases, so windows are those of the unstalled run), every transition between different
groups needs a reconfiguration (also between two groups whose circuits could coincide), and the switch
serves one configuration at a time. No Dagster import.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from phantora_assets.lib.net.fabric import nic_name
from phantora_assets.lib.net.optical import PACKET_BYTES
from phantora_assets.lib.traffic.steps.evidence import typical_step_us

GROUPS = ("tp", "cp", "ep", "dp", "pp", "other")
DELAYS_MS = (0, 1, 5, 10, 50, 100, 250, 500, 750, 1000)
MODES = ("on_demand", "provisioned")

#: Columns the analysis reads from a run's flows (``flows.parquet`` with the NIC and group columns).
NIC_FLOW_COLUMNS = ("step", "ts_us", "dur_us", "src_node", "src_nic", "dst_node", "dst_nic", "group", "network")

PHASE_COLUMNS: dict[str, str] = {
    "run_id": "str",
    "nic": "str",  # host-k (one NIC a host) or host-k/nic-i
    "step": "int64",  # step of the phase's first flow
    "phase": "int64",  # 0-based, per NIC in time order
    "group": "str",
    "start_s": "float64",  # since the trace's start
    "end_s": "float64",
    "n_flows": "int64",
    "bytes": "int64",  # bytes sent and received by the NIC in the phase
}

TRANSITION_COLUMNS: dict[str, str] = {
    "run_id": "str",
    "step": "int64",
    "nic": "str",
    "from_group": "str",
    "to_group": "str",
    "window_s": "float64",  # time with no flow on the NIC before the next phase, >= 0
}

SWEEP_COLUMNS: dict[str, str] = {
    "run_id": "str",
    "method": "str",  # formula (this module, over the unreconfigured run) | simulated (lib/net/reconfig_sim.py)
    "delay_ms": "int64",
    "mode": "str",  # on_demand | provisioned
    "step_time_s": "float64",  # step time (typical_step_us: runs.step_time_s at D = 0) of the timed steps + stall
    "stall_s": "float64",  # mean over timed steady steps of the step's stall (its most stalled NIC's)
    "utilisation": "float64",  # sum of T_compute / sum of stalled step times
}


def nic_phases(
    flows: pd.DataFrame, nics_per_host: int, run_id: str, packet_bytes: int | None = PACKET_BYTES
) -> pd.DataFrame:
    """Every NIC's phases (module docstring): ``PHASE_COLUMNS``, sorted by (nic, phase).

    Args:
        flows: :data:`NIC_FLOW_COLUMNS`; ``network`` False rows (inside a scale-up domain) and rows with
            ``src_node == dst_node`` are on no NIC and skipped.
        nics_per_host: NICs per host (names the NICs, :func:`lib.net.fabric.nic_name`).
        packet_bytes: the flows of a call of at most this many bytes (``count`` x ``dtype_bytes``, its
            per-rank buffer) are control collectives on the packet network beside the optical one and in no
            phase, the simulator's rule (``lib/net/optical.py``, ``reconfig.packet_bytes``, default 4096; was
            every flow: a step's 4-byte gradient norm over pp started the pp phase at the DP all-reduce's end,
            a window of 0 where the pp circuit is first needed at the next pipeline send). 0 or None: every
            call is on the circuits; flows without ``count`` / ``dtype_bytes`` are kept.

    Raises:
        ValueError: a ``group`` outside :data:`GROUPS`, or a column of :data:`NIC_FLOW_COLUMNS` missing.
    """
    missing = sorted(set(NIC_FLOW_COLUMNS) - set(flows.columns))
    if missing:
        raise ValueError(f"flows lack the columns {missing} the phases are made from")
    keep = flows["network"].to_numpy(bool) & (flows["src_node"].to_numpy() != flows["dst_node"].to_numpy())
    if packet_bytes and {"count", "dtype_bytes"} <= set(flows.columns):
        call_bytes = flows["count"].to_numpy(np.float64) * flows["dtype_bytes"].to_numpy(np.float64)
        keep &= ~(call_bytes <= packet_bytes)  # NaN (a flow of no call size) stays on the circuits
    f = flows[keep]
    bad = sorted(set(f["group"].astype(str)) - set(GROUPS))
    if bad:
        raise ValueError(f"flows carry groups {bad} outside {', '.join(GROUPS)}")
    k = int(nics_per_host)
    start = f["ts_us"].to_numpy(np.float64)
    end = start + f["dur_us"].to_numpy(np.float64)
    ends = np.concatenate(
        [
            f["src_node"].to_numpy(np.int64) * k + f["src_nic"].to_numpy(np.int64),
            f["dst_node"].to_numpy(np.int64) * k + f["dst_nic"].to_numpy(np.int64),
        ]
    )
    long = pd.DataFrame(
        {
            "ep": ends,
            "start": np.tile(start, 2),
            "end": np.tile(end, 2),
            "group": np.tile(f["group"].astype(str).to_numpy(), 2),
            "step": np.tile(f["step"].to_numpy(np.int64), 2),
            "bytes": np.tile(f["bytes"].to_numpy(np.int64), 2) if "bytes" in f else 0,
        }
    ).sort_values(["ep", "start"], kind="stable")
    long["rank"] = _instant_rank(long["ep"].to_numpy(), long["start"].to_numpy(), long["group"].to_numpy())
    long = long.sort_values(["ep", "start", "rank", "end", "step"], kind="stable")
    ep = long["ep"].to_numpy()
    grp = long["group"].to_numpy()
    new = np.r_[True, (ep[1:] != ep[:-1]) | (grp[1:] != grp[:-1])] if len(long) else np.zeros(0, bool)
    long["pid"] = np.cumsum(new) - 1
    agg = long.groupby("pid", sort=True).agg(
        ep=("ep", "first"),
        step=("step", "first"),
        group=("group", "first"),
        start=("start", "min"),
        end=("end", "max"),
        n_flows=("ep", "size"),
        bytes=("bytes", "sum"),
    )
    eps = agg["ep"].to_numpy(np.int64)
    first = np.r_[True, eps[1:] != eps[:-1]] if len(eps) else np.zeros(0, bool)
    phase = np.arange(len(eps)) - np.maximum.accumulate(np.where(first, np.arange(len(eps)), 0))
    return pd.DataFrame(
        {
            "run_id": pd.Series([run_id] * len(agg), dtype=object),
            "nic": pd.Series([nic_name(int(e) // k, int(e) % k, k) for e in eps], dtype=object),
            "step": agg["step"].to_numpy(np.int64),
            "phase": phase.astype(np.int64),
            "group": pd.Series(agg["group"].to_numpy(), dtype=object),
            "start_s": agg["start"].to_numpy(np.float64) / 1e6,
            "end_s": agg["end"].to_numpy(np.float64) / 1e6,
            "n_flows": agg["n_flows"].to_numpy(np.int64),
            "bytes": agg["bytes"].to_numpy(np.int64),
        },
        columns=list(PHASE_COLUMNS),
    )


def _instant_rank(ep: np.ndarray, start: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Order of every row among the rows of its NIC that start at the same instant: 0 for the group the
    NIC's current phase has (it continues), else ``1 +`` the group's index in :data:`GROUPS` (a fixed order,
    never the rows' order). The current phase entering an instant is the last group of the instant before
    it; rows sorted by (``ep``, ``start``), shape (n,) each."""
    n = len(ep)
    if not n:
        return np.zeros(0, np.int64)
    gi = pd.Categorical(group, categories=list(GROUPS)).codes.astype(np.int64)
    new = np.r_[True, (ep[1:] != ep[:-1]) | (start[1:] != start[:-1])]
    inst = np.cumsum(new) - 1
    n_inst = int(inst[-1]) + 1
    mask = np.zeros(n_inst, np.int64)
    np.bitwise_or.at(mask, inst, np.left_shift(1, gi))
    first_of_nic = np.r_[True, ep[new][1:] != ep[new][:-1]]
    top = np.floor(np.log2(mask)).astype(np.int64)  # highest group index present at the instant
    last = np.where((mask & (mask - 1)) == 0, top, -1)  # one group: it; several: below
    for i in np.flatnonzero(last < 0):  # instants of several groups, in time order: each needs the one before
        c = -1 if first_of_nic[i] else int(last[i - 1])
        rest = int(mask[i]) & ~(1 << c) if c >= 0 else int(mask[i])
        last[i] = rest.bit_length() - 1 if rest else c
    cur = np.where(first_of_nic, -1, np.r_[-1, last[:-1]])  # the group of the phase entering the instant
    return np.where(gi == cur[inst], 0, 1 + gi)


def transition_windows(phases: pd.DataFrame, steady_steps: set[int] | list[int], run_id: str) -> pd.DataFrame:
    """The transitions of every NIC between consecutive phases (of different groups, by construction),
    in steady steps: ``TRANSITION_COLUMNS``, sorted by (step, nic, time). ``window_s``: the idle time
    before the next phase after every earlier flow of the NIC (module docstring), s, >= 0."""
    p = phases.sort_values(["nic", "phase"], kind="stable")
    nic = p["nic"].to_numpy()
    same = np.r_[False, nic[1:] == nic[:-1]] if len(p) else np.zeros(0, bool)
    idx = np.nonzero(same)[0]
    prev, nxt = p.iloc[idx - 1], p.iloc[idx]
    # the end of every flow on the NIC so far: the running max of its phases' ends (a NIC's first phase
    # starts it afresh); an earlier phase's flow can outlast the phase just before the transition
    end = p["end_s"].to_numpy(np.float64)
    nic_start = np.flatnonzero(~same) if len(p) else np.zeros(0, np.int64)
    busy = np.concatenate([np.maximum.accumulate(seg) for seg in np.split(end, nic_start[1:])]) if len(p) else end
    window = np.maximum(0.0, nxt["start_s"].to_numpy() - busy[idx - 1])
    out = pd.DataFrame(
        {
            "run_id": pd.Series([run_id] * len(idx), dtype=object),
            "step": nxt["step"].to_numpy(np.int64),
            "nic": pd.Series(nxt["nic"].to_numpy(), dtype=object),
            "from_group": pd.Series(prev["group"].to_numpy(), dtype=object),
            "to_group": pd.Series(nxt["group"].to_numpy(), dtype=object),
            "window_s": window.astype(np.float64),
            "_t": nxt["start_s"].to_numpy(),
        }
    )
    out = out[out["step"].isin(set(steady_steps))]
    out = out.sort_values(["step", "nic", "_t"], kind="stable").drop(columns="_t").reset_index(drop=True)
    return out[list(TRANSITION_COLUMNS)]


def step_stalls(transitions: pd.DataFrame, delay_s: float, mode: str) -> pd.Series:
    """Stall of every step with transitions (index ``step``), s: per NIC the sum of its transitions'
    stalls (``delay`` each on demand, ``max(0, delay - window)`` provisioned), the step's the largest."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (known: {', '.join(MODES)})")
    w = transitions["window_s"].to_numpy(np.float64)
    stall = np.full(len(w), float(delay_s)) if mode == "on_demand" else np.maximum(0.0, float(delay_s) - w)
    per_nic = pd.DataFrame({"step": transitions["step"].to_numpy(), "nic": transitions["nic"].to_numpy(), "s": stall})
    return per_nic.groupby(["step", "nic"])["s"].sum().groupby(level="step").max()


def reconfig_sweep(
    transitions: pd.DataFrame,
    steps: pd.DataFrame,
    run_id: str,
    delays_ms: tuple[int, ...] = DELAYS_MS,
) -> pd.DataFrame:
    """The sweep (module docstring): ``SWEEP_COLUMNS``, one row per (delay, mode), delays ascending,
    ``on_demand`` before ``provisioned``.

    Args:
        transitions: :func:`transition_windows` rows.
        steps: one row per timed steady step: ``step``, ``step_time_s``, ``compute_s`` (``0 <= compute_s <=
            step_time_s``; the rest of the step is non-overlapped communication).

    Raises:
        ValueError: no steady step, or a compute time outside [0, step time].
    """
    if not len(steps):
        raise ValueError("no steady step: the sweep needs step times")
    st = steps["step_time_s"].to_numpy(np.float64)
    comp = steps["compute_s"].to_numpy(np.float64)
    if (comp < 0).any() or (comp > st * (1 + 1e-9)).any():
        raise ValueError("a step's compute time is outside [0, step time]")
    rows = []
    for d in delays_ms:
        for mode in MODES:
            stall = step_stalls(transitions, d / 1000.0, mode).reindex(steps["step"].to_numpy(), fill_value=0.0)
            s = stall.to_numpy(np.float64)
            step_time = typical_step_us(st + s)[0]  # the run's step time of the stalled steps (module docstring)
            rows.append((run_id, int(d), mode, step_time, float(s.mean()), float(comp.sum() / (st + s).sum())))
    out = pd.DataFrame(rows, columns=[c for c in SWEEP_COLUMNS if c != "method"])
    out["method"] = "formula"
    return out[list(SWEEP_COLUMNS)].astype({"delay_ms": "int64"})


def window_cdf(transitions: pd.DataFrame) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per transition pair (``"dp->pp"``), the sorted windows (s) and their empirical CDF (k / n)."""
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for (a, b), g in transitions.groupby(["from_group", "to_group"], sort=True):
        w = np.sort(g["window_s"].to_numpy(np.float64))
        out[f"{a}->{b}"] = (w, np.arange(1, len(w) + 1) / len(w))
    return out
