"""Cross-check a trace against the workload model: network bytes per steady step, by kind.

No Dagster import. The prediction is what :class:`~phantora_assets.lib.sim.workloads.WorkloadModel`
says one steady step of the same workload and layout issues, turned into Phantora ring flows by
:meth:`AnalyticSimulator.flows_of <phantora_assets.lib.sim.analytic.AnalyticSimulator.flows_of>`,
keeping the flows whose two ranks sit on different hosts. Both sides are broken down into

    dp           data-parallel gradient and parameter collectives (Megatron DDP buckets,
                 DeepSpeed all-reduce / bf16 all-gather, ZeRO-3 gradient reduce-scatters,
                 the 1-element grad-norm all-reduces)
    tp           tensor-parallel activation all-reduces
    all_to_all   MoE token dispatch / combine (grouped NCCL send/recv)
    zero_gather  ZeRO-3 parameter all-gathers before forward and backward
    send_recv    pipeline-parallel activations / gradients and context-parallel K/V ring exchanges

How a trace flow gets its kind: by its communicator first, then by its signature. The model's
collectives give a table ``(group, op, count x dtype size) -> kinds``, ``group`` the parallelism
group of the communicator the collective runs on (``tp cp ep dp pp``, docs/WORKLOADS.md "Groups";
a point-to-point call's op is ``send``). A trace flow's communicator has its group too
(:func:`~phantora_assets.lib.workload.collectives.comm_groups`: an analytic run's by the
communicator's name, another run's by the ranks that send on it); when that group is known (not
``other``) the flow's signature is looked up under it, so a pipeline send and an MoE all-to-all
message of the same size (``topk == ep``: both are [s, b, h] bf16 per peer) are told apart by the
communicator they run on (``pp`` vs ``ep``), never by their size. A flow on a communicator of group
``other`` is looked up by ``(op, size)`` alone: send / recv flows are ``all_to_all`` unless the
model's point-to-point sends of that size are pipeline / ring ones only (then ``send_recv``); a
size both kinds send is ambiguous and the flow is *unmatched*. A flow whose signature names one
kind gets it. Each communicator takes the kind most of its flows got (its *majority kind*); a flow
whose signature names several kinds gets its communicator's majority kind if that is one of them
(else the first in the order above), and a flow whose signature is not in the table gets its
communicator's majority kind and is counted as *unmatched* (``unmatched`` as kind when the
communicator has no matched flow at all).

Measured bytes of a kind = median over the steady steps of that kind's network bytes in the
step; measured total = median over the steady steps of the step's network bytes.

The check passes when the total and every kind are within ``TOLERANCE`` (1 %) of the
prediction; a kind the model does not predict but the trace carries (or the reverse) fails it.
It is advisory (WARN): Phantora runs the real framework, so small differences from the model are
expected, but a missing kind (e.g. a published MoE trace without its all-to-all flows) shows.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.analytic import AnalyticSimulator
from phantora_assets.lib.sim.workload_types import AllToAll, Collective, SendRecv
from phantora_assets.lib.traffic.ring import DTYPE_BYTES
from phantora_assets.lib.workload.collectives import comm_groups, group_of, stage_communicators

KINDS = ("dp", "tp", "all_to_all", "zero_gather", "send_recv")
UNMATCHED = "unmatched"
TOLERANCE = 0.01
LABELS = {
    "dp": "DP gradients / parameters",
    "tp": "TP activations",
    "all_to_all": "MoE all-to-all",
    "zero_gather": "ZeRO-3 parameter gathers",
    "send_recv": "pipeline / context-parallel send/recv",
    UNMATCHED: "not in the model",
}
_P2P = ("send", "recv")


def kind_of(item: Collective | AllToAll | SendRecv) -> str:
    """The cross-check kind of one workload-model collective."""
    if isinstance(item, SendRecv):
        return "send_recv"
    if isinstance(item, AllToAll) or item.kind == "ep":
        return "all_to_all"
    if item.op == "all_gather" and item.tag.startswith("zero3."):
        return "zero_gather"
    if item.kind == "tp":
        return "tp"
    return "dp"


@dataclass
class Prediction:
    """The workload model's network bytes of one steady step.

    Attributes:
        bytes_by_kind: kind -> network bytes (every kind of KINDS present, possibly 0).
        signatures: ``(op, count x dtype bytes)`` -> kinds of the model's collectives (``op``
            ``send`` for a point-to-point call).
        group_signatures: ``(group, op, count x dtype bytes)`` -> kinds, ``group`` that of the
            communicators the collective runs on (``collectives.group_of``).
    """

    bytes_by_kind: dict[str, int]
    signatures: dict[tuple[str, int], set[str]]
    group_signatures: dict[tuple[str, str, int], set[str]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.bytes_by_kind.values())


def predict(spec: RunSpec) -> Prediction:
    """Network bytes of one steady step of ``spec`` by kind, from the workload model."""
    sim = AnalyticSimulator(spec)
    model = sim.model
    gpn = spec.gpus_per_node
    by_kind = dict.fromkeys(KINDS, 0)
    sigs: dict[tuple[str, int], set[str]] = defaultdict(set)
    group_sigs: dict[tuple[str, str, int], set[str]] = defaultdict(set)
    seen: set[str] = set()
    for stage, program in enumerate(model.stage_programs(warmup=False)):
        for item in program:
            if not isinstance(item, (Collective, AllToAll, SendRecv)):
                continue
            if item.kind == "pp":  # a call over the pipeline: listed by every stage it spans
                if item.tag in seen:
                    continue
                seen.add(item.tag)
            kind = kind_of(item)
            op = item.op if isinstance(item, Collective) else "send"
            size = item.count * DTYPE_BYTES[item.dtype]
            sigs[(op, size)].add(kind)
            for comm in stage_communicators(model, item.kind, stage):
                group_sigs[(group_of(comm), op, size)].add(kind)
                for s, d, b in sim.flows_of(item, comm):
                    if s // gpn != d // gpn:
                        by_kind[kind] += int(b)
    return Prediction(by_kind, dict(sigs), dict(group_sigs))


def classify(
    flows: pd.DataFrame, prediction: Prediction, groups: dict[str, str] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Kind of each flow (object array) and whether its signature was in the model (bool array),
    by the rule of the module docstring.

    ``flows`` needs ``op, count, dtype_bytes, comm_id`` (FLOW_COLUMNS); ``groups`` maps a
    ``comm_id`` to its communicator's parallelism group (``collectives.comm_groups``; missing or
    None: ``other``, the signature alone decides).
    """
    n = len(flows)
    groups = groups or {}
    ops = flows["op"].to_numpy()
    sizes = flows["count"].to_numpy(dtype=np.int64) * flows["dtype_bytes"].to_numpy(dtype=np.int64)
    comms = flows["comm_id"].to_numpy()
    cache: dict[tuple[str, str, int], tuple[str, ...]] = {}
    candidates: list[tuple[str, ...]] = []
    for comm, op, size in zip(comms, ops, sizes):
        key = (groups.get(str(comm), "other"), "send" if op in _P2P else str(op), int(size))
        cand = cache.get(key)
        if cand is None:
            cand = cache[key] = _candidates(prediction, *key)
        candidates.append(cand)
    votes: dict[str, Counter] = defaultdict(Counter)
    for comm, cand in zip(comms, candidates):
        if len(cand) == 1:
            votes[comm][cand[0]] += 1
    majority = {c: v.most_common(1)[0][0] for c, v in votes.items() if v}
    out = np.empty(n, dtype=object)
    matched = np.ones(n, dtype=bool)
    for i, (comm, cand) in enumerate(zip(comms, candidates)):
        maj = majority.get(comm)
        if len(cand) == 1:
            out[i] = cand[0]
        elif cand:
            out[i] = maj if maj in cand else cand[0]
        else:
            matched[i] = False
            out[i] = maj if maj is not None else UNMATCHED
    return out, matched


def _candidates(prediction: Prediction, group: str, op: str, size: int) -> tuple[str, ...]:
    """The kinds a flow of ``op`` and ``size`` bytes on a communicator of ``group`` may be (in the
    order of KINDS; empty: not in the model)."""
    if group != "other":  # the communicator says what it carries (module docstring)
        kinds = prediction.group_signatures.get((group, op, size), set())
        return tuple(k for k in KINDS if k in kinds)
    kinds = prediction.signatures.get((op, size), set())
    if op == "send":
        p2p = kinds & {"all_to_all", "send_recv"}
        if p2p == {"all_to_all", "send_recv"}:  # one size, two kinds, no communicator to tell: unmatched
            return ()
        return ("send_recv",) if p2p == {"send_recv"} else ("all_to_all",)
    return tuple(k for k in KINDS if k in kinds)


@dataclass
class CrossCheck:
    """Outcome of the cross-check of one run (see the module docstring)."""

    run_id: str
    predicted: dict[str, int]
    measured: dict[str, int]
    n_steady_steps: int
    unmatched_flows_per_step: float
    passed: bool
    message: str
    kinds: list[str] = field(default_factory=list)

    @property
    def predicted_total(self) -> int:
        return sum(self.predicted.values())

    @property
    def measured_total(self) -> int:
        return int(self.measured.get("total", sum(v for k, v in self.measured.items() if k != "total")))

    @staticmethod
    def deviation(measured: int, predicted: int) -> float | None:
        """(measured - predicted) / predicted; None when both are 0; inf when only predicted is 0."""
        if predicted == 0:
            return None if measured == 0 else math.inf
        return (measured - predicted) / predicted

    def rows(self) -> list[dict[str, Any]]:
        """One dict per kind (then ``total``): predicted, measured bytes and deviation in %."""
        out = []
        for k in self.kinds + ["total"]:
            p = self.predicted_total if k == "total" else self.predicted.get(k, 0)
            m = self.measured_total if k == "total" else self.measured.get(k, 0)
            d = self.deviation(m, p)
            out.append(
                {
                    "kind": k,
                    "label": LABELS.get(k, "all kinds"),
                    "predicted_bytes": int(p),
                    "measured_bytes": int(m),
                    "deviation_pct": None if d is None else (d * 100 if math.isfinite(d) else math.inf),
                }
            )
        return out

    def markdown(self) -> str:
        lines = ["| kind | predicted bytes/step | trace bytes/step | deviation |", "|---|---:|---:|---:|"]
        for r in self.rows():
            d = r["deviation_pct"]
            dev = "-" if d is None else ("new in trace" if math.isinf(d) else f"{d:+.2f} %")
            lines.append(f"| {r['kind']} ({r['label']}) | {r['predicted_bytes']:,} | {r['measured_bytes']:,} | {dev} |")
        return "\n".join(lines)

    def metadata(self) -> dict[str, Any]:
        """Flat metadata: ``predicted_bytes_<kind>``, ``trace_bytes_<kind>``, ``deviation_pct_<kind>``."""
        meta: dict[str, Any] = {
            "n_steady_steps": self.n_steady_steps,
            "unmatched_flows_per_step": self.unmatched_flows_per_step,
        }
        for r in self.rows():
            k = r["kind"]
            meta[f"predicted_bytes_{k}"] = r["predicted_bytes"]
            meta[f"trace_bytes_{k}"] = r["measured_bytes"]
            d = r["deviation_pct"]
            meta[f"deviation_pct_{k}"] = None if d is None else (round(d, 4) if math.isfinite(d) else "inf")
        return meta

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "passed": self.passed,
            "message": self.message,
            "tolerance": TOLERANCE,
            "rows": [
                {
                    **r,
                    "deviation_pct": (
                        None
                        if r["deviation_pct"] is None
                        else (r["deviation_pct"] if math.isfinite(r["deviation_pct"]) else "inf")
                    ),
                }
                for r in self.rows()
            ],
            "n_steady_steps": self.n_steady_steps,
            "unmatched_flows_per_step": self.unmatched_flows_per_step,
        }


def _gb(b: float) -> str:
    return f"{b / 1e9:.3f} GB"


def cross_check(
    spec: RunSpec,
    flows: pd.DataFrame,
    steady_steps: list[int],
    prediction: Prediction | None = None,
    groups: dict[str, str] | None = None,
) -> CrossCheck:
    """Compare a run's network flows with the workload model.

    Args:
        spec: the run (workload and layout give the prediction).
        flows: the run's flows (``FLOW_COLUMNS`` plus ``step``); loopback flows are ignored.
        steady_steps: the steady step indices (``StepResult.steady_steps``).
        prediction: precomputed :func:`predict` of ``spec`` (tests), else computed.
        groups: ``comm_id -> group`` of ``flows``' communicators
            (:func:`~phantora_assets.lib.workload.collectives.comm_groups` of ``spec`` and
            ``flows``, computed when None).

    Returns:
        A :class:`CrossCheck`; never raises for a mismatch.
    """
    pred = prediction or predict(spec)
    # one take of only the columns used: a take of the whole table copied every column (713 MB at 4.9 M flows)
    is_net = flows["src_node"].to_numpy() != flows["dst_node"].to_numpy()
    net = flows.loc[is_net, ["op", "count", "dtype_bytes", "comm_id", "step", "bytes"]]
    kinds, matched = classify(net, pred, comm_groups(spec, flows) if groups is None else groups)
    steps = np.asarray(net["step"].to_numpy(), dtype=np.int64)
    steady = sorted(int(s) for s in steady_steps)
    in_steady = np.isin(steps, steady)
    frame = pd.DataFrame(
        {"step": steps[in_steady], "kind": kinds[in_steady], "bytes": net["bytes"].to_numpy(dtype=np.int64)[in_steady]}
    )
    per = frame.groupby(["step", "kind"])["bytes"].sum().unstack(fill_value=0).reindex(steady, fill_value=0)
    present = [
        k for k in (*KINDS, UNMATCHED) if pred.bytes_by_kind.get(k, 0) > 0 or (k in per.columns and per[k].any())
    ]
    measured = {k: int(np.median(per[k].to_numpy())) if k in per.columns and len(per) else 0 for k in present}
    measured["total"] = int(np.median(per.sum(axis=1).to_numpy())) if len(per) else 0
    n_unmatched = float((~matched[in_steady]).sum()) / max(len(steady), 1)
    predicted = {k: int(pred.bytes_by_kind.get(k, 0)) for k in present}
    result = CrossCheck(spec.run_id, predicted, measured, len(steady), round(n_unmatched, 3), True, "", present)
    bad = []
    for r in result.rows():
        d = r["deviation_pct"]
        if d is not None and abs(d) > TOLERANCE * 100:
            bad.append(r)
    result.passed = not bad
    total = result.rows()[-1]
    head = (
        f"trace carries {_gb(total['measured_bytes'])} of network traffic per steady step, the workload model "
        f"of {spec.workload} {spec.layout} predicts {_gb(total['predicted_bytes'])}"
    )
    if total["deviation_pct"] is not None and math.isfinite(total["deviation_pct"]):
        head += f" ({total['deviation_pct']:+.2f} %)"
    parts = []
    for r in bad:
        if r["kind"] == "total":
            continue
        d = r["deviation_pct"]
        what = "not predicted" if math.isinf(d) else f"{d:+.1f} %"
        parts.append(f"{r['kind']} {_gb(r['measured_bytes'])} vs {_gb(r['predicted_bytes'])} ({what})")
    if result.passed:
        msg = head + f"; every kind within {TOLERANCE:.0%}."
    else:
        msg = head + "; off by more than 1 %: " + "; ".join(parts or ["total"])
        if predicted.get("all_to_all", 0) > 0 and measured.get("all_to_all", 0) == 0:
            msg += (
                ". The trace has no MoE all-to-all (send/recv) network flows although the workload "
                "exchanges tokens between experts on different hosts: they are missing from this trace"
            )
        msg += "."
    result.message = msg
    return result
