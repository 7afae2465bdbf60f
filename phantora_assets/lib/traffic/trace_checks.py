"""The trace rules of docs/DATASET.md ("How a trace becomes the dataset", step 3, checks 1-4), as plain functions.

Each rule returns a :class:`CheckOutcome`; a violated rule never raises, it returns
``passed=False`` with a message naming the communicator / step / flow at fault. The
The validated_flows stage turns each outcome into a check result (``stages/flows.py``); the run
folder's ``checks.txt`` is written by ``phantora_assets.checks``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .binning import exact_sum
from .ring import DTYPE_BYTES, P2P_NAME_SEND_RECV, RING_OPS, group_sizes_for
from .rule_names import FLOWS_EXIST, RING_BYTES_MATCH, STEADY_STEPS_STABLE, STEPS_MATCH, STEPS_MATCH_RUN_LOG
from .steps import RULE, StepResult
from .steps.evidence import typical_step_us

#: How many individual violations a message lists before summarising the rest.
MAX_LISTED = 5
#: Sums of bytes must stay below this (2**63: they are int64 columns and int64 arithmetic).
INT64_LIMIT = 2**63


@dataclass(frozen=True)
class CheckOutcome:
    """Result of one trace rule.

    Attributes:
        name: short identifier of the rule (also the Dagster check name).
        passed: True when the rule holds.
        description: one plain-English sentence stating the rule.
        observed: what was measured (JSON-serialisable values).
        expected: what the rule requires (JSON-serialisable values).
        message: plain-words result, naming what is at fault on failure.
    """

    name: str
    passed: bool
    description: str
    observed: dict[str, Any] = field(default_factory=dict)
    expected: dict[str, Any] = field(default_factory=dict)
    message: str = ""


#: Communicators a passing ring rule's message names one by one; beyond, it counts them per group size.
LISTED_COMMUNICATORS = 16
#: Point-to-point ops. Their sizes follow no ring formula: an MoE all-to-all is issued as a send to every
#: peer (Phantora's grouped NcclSend, ``lib/kineto/collectives.py``), its sizes the tokens routed to each
#: peer, which vary step to step: Megatron-LM ``megatron/core/transformer/moe/token_dispatcher.py``
#: (``MoEAlltoAllTokenDispatcher``: ``all_to_all(ep_group, tokens, self.output_splits, self.input_splits)``,
#: the splits counted from the router's ``routing_map`` every forward), torchtitan
#: ``torchtitan/distributed/expert_parallel.py`` (``input_splits = num_tokens_per_expert.view(ep_degree,
#: -1).sum(dim=1)``, then ``all_to_all_single_autograd``). Ring ops (all-reduce, all-gather, reduce-scatter)
#: and broadcasts move sizes fixed by the model (parameter, gradient and activation shapes).
P2P_OPS = ("send", "recv")
#: ``steps_match``'s count of a routed send/recv (:func:`routed_p2p`): compared by number, not size.
ROUTED = -1


def _listing(items: list[str]) -> str:
    shown = "; ".join(items[:MAX_LISTED])
    if len(items) > MAX_LISTED:
        shown += f"; and {len(items) - MAX_LISTED} more"
    return shown


# --------------------------------------------------------------------------------------
def flows_exist(flows: pd.DataFrame) -> CheckOutcome:
    """Rule 1: the trace has at least one network flow (``src_node != dst_node``), and their
    bytes sum to less than 2**63 (rule ``bytes beyond int64``).

    The sum is exact (a Python int, ``binning.exact_sum``): an int64 sum would wrap and pass a
    negative (or a too small) total. Every later sum of network bytes (a step's, a communicator's)
    is part of this one, so none of them wraps once this rule holds; the 180 s window, which
    repeats a step, is checked by ``bins_conserve_bytes``.
    """
    desc = (
        "The trace contains at least one network flow, i.e. a flow between two different hosts, "
        "and the network bytes sum to less than 2**63 (int64)."
    )
    n_total = int(len(flows))
    net = flows["src_node"].to_numpy() != flows["dst_node"].to_numpy() if n_total else np.zeros(0, bool)
    n_net = int(net.sum())
    net_bytes = exact_sum(flows["bytes"].to_numpy(np.int64)[net]) if n_net else 0
    observed = {"flows": n_total, "network_flows": n_net, "loopback_flows": n_total - n_net, "network_bytes": net_bytes}
    expected = {"network_flows": ">= 1"}
    if net_bytes >= INT64_LIMIT:
        expected["network_bytes"] = f"< 2**63 = {INT64_LIMIT}"
        msg = (
            f"bytes beyond int64: the {n_net} network flows carry {net_bytes} bytes in total, more than an int64 "
            f"holds ({INT64_LIMIT - 1}), so step and bin sums would wrap."
        )
        return CheckOutcome(FLOWS_EXIST, False, desc, observed, expected, msg)
    if n_net:
        msg = f"{n_net} of {n_total} flows cross the network ({net_bytes} bytes in total)."
    elif n_total:
        msg = (
            f"No network flow: all {n_total} flows stay inside one host (loopback), "
            "so this run has no node-to-node traffic."
        )
    else:
        msg = "No network flow: the trace has no Communication event at all."
    return CheckOutcome(FLOWS_EXIST, n_net > 0, desc, observed, expected, msg)


# --------------------------------------------------------------------------------------
def routed_p2p(step_result: StepResult) -> set[tuple[str, str, str]]:
    """``(comm_id, op, dtype)`` of the send/recv whose element counts differ between steady steps (the
    multiset of counts a step issues is not the same in every steady step): sizes routing decides (an MoE
    all-to-all, :data:`P2P_OPS`), compared by number of calls in ``steps_match`` and by bytes within
    ``RULE.p2p_bytes_rel_tol`` in ``steady_steps_stable`` (the step rule's own tolerance, ``steps/rule.py``).
    Ring ops and broadcasts are never routed: their sizes are the model's; nor a send/recv whose source names
    it issued by a send/recv (``name`` :data:`~.ring.P2P_NAME_SEND_RECV`, the Kineto reader: a pipeline
    message, whose shape is fixed for the run, ``ring.P2P_NAME_SEND_RECV``); Phantora's ``NcclSend`` flows
    cannot tell, and may vary (docs/STEPS.md)."""
    f = step_result.flows
    keys = ["comm_id", "op", "dtype"]
    p2p = f["op"].isin(P2P_OPS)
    if "name" in f.columns:
        p2p &= f["name"].astype(str).to_numpy() != P2P_NAME_SEND_RECV
    f = f.loc[f["step"].isin(step_result.steady_steps) & p2p, ["step", *keys, "count"]]
    if f.empty:
        return set()
    per = f.groupby(["step", *keys, "count"]).size().rename("n").reset_index()
    per["sig"] = list(zip(per["count"], per["n"], strict=True))
    sigs = per.groupby([*keys, "step"])["sig"].agg(lambda x: tuple(sorted(x)))
    distinct = sigs.groupby(level=[0, 1, 2]).nunique()
    return {(str(c), str(o), str(d)) for (c, o, d), n in distinct.items() if n > 1}


def _step_signatures(step_result: StepResult, routed: set[tuple[str, str, str]]) -> pd.Series:
    """Per (step, comm_id, op, count, dtype): the number of flows; a routed send/recv's (count ``ROUTED``): the
    number of its calls, one per (communicator rank, start), since a peer routed no token receives no flow (a
    0-byte part is none: ``lib/kineto/collectives.py``), so its flows number fewer in such a step (was: a step
    in which one rank routed nothing to one peer, 22 flows beside 24, refused an MoE run)."""
    keys = ["step", "comm_id", "op", "count", "dtype"]
    f = step_result.flows
    cols = [*keys, "comm_rank", "ts_us"] if routed else keys
    f = f.loc[f["step"].isin(step_result.steady_steps), cols]  # only the keys: not a copy of every column
    if routed:
        m = _routed_mask(f, routed)
        f = f.assign(count=np.where(m, ROUTED, f["count"].to_numpy()))
        calls = f.loc[m].drop_duplicates(["step", "comm_id", "op", "dtype", "comm_rank", "ts_us"])
        f = pd.concat([f.loc[~m], calls])[keys]
    return f.groupby(keys).size()


def steps_match(step_result: StepResult) -> CheckOutcome:
    """Rule 2: every steady step issues the same collectives.

    A step's signature is, per communicator, the number of flows of each
    (op, count, dtype); the reference is the signature most steady steps share. A send/recv whose
    counts routing varies (:func:`routed_p2p`: an MoE all-to-all's parts) counts by (op, dtype) alone;
    its bytes are ``steady_steps_stable``'s.
    """
    desc = (
        "Every steady step issues the same collectives: per communicator, the same "
        "operations with the same element counts and dtypes, the same number of times."
    )
    steady = list(step_result.steady_steps)
    routed = routed_p2p(step_result)
    sig = _step_signatures(step_result, routed)
    per_step: dict[int, tuple] = {}
    for k in steady:
        part = sig.xs(k, level="step") if k in sig.index.get_level_values("step") else sig.iloc[:0]
        per_step[k] = tuple(sorted((tuple(map(str, idx)), int(v)) for idx, v in part.items()))
    if not steady:
        return CheckOutcome(
            STEPS_MATCH,
            False,
            desc,
            {"steady_steps": 0},
            {"steady_steps": ">= 1"},
            "There is no steady step to compare.",
        )
    uniq: dict[tuple, list[int]] = {}
    for k, s in per_step.items():
        uniq.setdefault(s, []).append(k)
    ref_sig, _ = max(uniq.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))
    ref = dict(ref_sig)
    problems: list[str] = []
    bad_steps: list[int] = []
    for k in steady:
        if per_step[k] == ref_sig:
            continue
        bad_steps.append(k)
        got = dict(per_step[k])
        for key in sorted(set(ref) | set(got)):
            a, b = got.get(key, 0), ref.get(key, 0)
            if a != b:
                comm, op, count, dtype = key
                size, what = ("of routed counts", "calls") if int(count) == ROUTED else (f"count={count}", "flows")
                problems.append(
                    f"step {k}, communicator {comm}: {op} {size} {dtype} has {a} {what}, the other steps have {b}"
                )
    observed = {
        "steady_steps": len(steady),
        "distinct_signatures": len(uniq),
        "mismatched_steps": bad_steps,
        "collectives_per_step": int(sum(ref.values())),
        "routed_p2p": [list(k) for k in sorted(routed)],
    }
    expected = {"distinct_signatures": 1, "mismatched_steps": []}
    if not bad_steps:
        n_comm = len({key[0] for key in ref})
        msg = (
            f"All {len(steady)} steady steps issue the same {len(ref)} kinds of collective "
            f"({sum(ref.values())} {'flows and routed calls' if routed else 'flows'}) on {n_comm} communicators."
        )
        if routed:
            comms = sorted({c for c, _, _ in routed})
            msg += (
                f" The send/recv sizes of {len(comms)} communicator(s) vary with routing (an all-to-all's splits: "
                f"{_listing(comms)}); compared by number of calls, their bytes by steady_steps_stable."
            )
        return CheckOutcome(STEPS_MATCH, True, desc, observed, expected, msg)
    msg = f"{len(bad_steps)} of {len(steady)} steady steps differ from the others: " + _listing(problems) + "."
    return CheckOutcome(STEPS_MATCH, False, desc, observed, expected, msg)


def _group_sizes(sizes: dict[str, int]) -> str:
    """A passing ring rule's group sizes: each communicator's, or (more than :data:`LISTED_COMMUNICATORS`:
    thousands at frontier scale) how many communicators have each size."""
    if len(sizes) <= LISTED_COMMUNICATORS:
        return ", ".join(f"{c}: n={n}" for c, n in sorted(sizes.items())) or "none needed"
    per = Counter(sizes.values())
    return ", ".join(f"{per[n]} communicators of n={n}" for n in sorted(per))


# --------------------------------------------------------------------------------------
def ring_bytes_match(flows: pd.DataFrame) -> CheckOutcome:
    """Rule 3: every flow's bytes fit the ring rule, with one group size n per communicator.

    Broadcast / send / recv flows must carry ``count x dtype size`` bytes. For ring ops
    (all_reduce, all_gather, reduce_scatter) each distinct (op, count, dtype, bytes)
    gives the candidate sizes ``ring.group_sizes_for``; a communicator passes when the
    intersection of its candidates (and, if more than one ``comm_rank`` is seen, the
    number of distinct ranks) is exactly one n.
    """
    desc = (
        "Every flow carries the bytes Phantora's ring rule gives for its operation, "
        "with one group size n per communicator."
    )
    problems: list[str] = []
    bad_comms: set[str] = set()
    sizes: dict[str, int] = {}
    n_flows = int(len(flows))
    if n_flows == 0:
        return CheckOutcome(RING_BYTES_MATCH, True, desc, {"flows": 0}, {}, "No flow to check.")

    # dtype size must agree with the dtype name
    dt_expected = flows["dtype"].map(DTYPE_BYTES)
    bad_dt = dt_expected.notna() & (dt_expected != flows["dtype_bytes"])
    for (comm, dtype, db), _ in flows.loc[bad_dt].groupby(["comm_id", "dtype", "dtype_bytes"]):
        bad_comms.add(str(comm))
        problems.append(
            f"communicator {comm}: dtype {dtype} given {db} bytes per element, expected {DTYPE_BYTES[dtype]}"
        )

    combos = (
        flows.groupby(["comm_id", "op", "count", "dtype", "dtype_bytes", "bytes"])
        .agg(n=("flow_id", "size"), flow_id=("flow_id", "min"))
        .reset_index()
    )
    ranks_seen = flows.groupby("comm_id")["comm_rank"].nunique().to_dict()
    n_bad_flows = 0
    for comm, part in combos.groupby("comm_id", sort=True):
        comm = str(comm)
        cand_sets: list[tuple[set[int], str]] = []
        for r in part.itertuples(index=False):
            try:
                cands = group_sizes_for(r.op, int(r.count), int(r.dtype_bytes), int(r.bytes))
            except ValueError:
                cands = []
            label = f"{r.op} count={r.count} {r.dtype} with {r.bytes} bytes per flow"
            if not cands:
                bad_comms.add(comm)
                n_bad_flows += int(r.n)
                if r.op in RING_OPS:
                    why = "no group size n fits the ring rule"
                else:
                    why = f"expected count x dtype size = {int(r.count) * int(r.dtype_bytes)}"
                problems.append(f"communicator {comm}: {label} ({int(r.n)} flows, e.g. flow {r.flow_id}): {why}")
                continue
            if r.op in RING_OPS and cands != [0]:
                cand_sets.append((set(cands), label))
        if not cand_sets:
            continue
        common = set.intersection(*(c for c, _ in cand_sets))
        n_ranks = int(ranks_seen.get(comm, 0))
        if n_ranks > 1:
            common &= {n_ranks}
        if len(common) == 1:
            sizes[comm] = next(iter(common))
            continue
        bad_comms.add(comm)

        def fmt(c: set[int]) -> str:
            s = sorted(c)
            return f"n in {s}" if len(s) <= 6 else f"n in {s[0]}..{s[-1]} ({len(s)} values)"

        detail = "; ".join(f"{lab} fits {fmt(c)}" for c, lab in cand_sets[:MAX_LISTED])
        rank_note = f"; {n_ranks} distinct ranks are seen" if n_ranks > 1 else ""
        if common:
            problems.append(f"communicator {comm}: group size is ambiguous, {fmt(common)} ({detail}{rank_note})")
        else:
            problems.append(f"communicator {comm}: no single group size fits all its flows ({detail}{rank_note})")
    observed = {
        "flows": n_flows,
        "communicators": int(flows["comm_id"].nunique()),
        "group_sizes": dict(sorted(sizes.items())),
        "bad_communicators": sorted(bad_comms),
        "bad_flows": n_bad_flows,
    }
    expected = {"bad_communicators": [], "group_size_per_communicator": "exactly one n"}
    if not problems:
        gs = _group_sizes(sizes)
        msg = (
            f"All {n_flows} flows on {observed['communicators']} communicators match the ring rule (group sizes {gs})."
        )
        return CheckOutcome(RING_BYTES_MATCH, True, desc, observed, expected, msg)
    noun = "violation" if len(problems) == 1 else "violations"
    msg = f"{len(problems)} ring-rule {noun}: " + _listing(problems) + "."
    return CheckOutcome(RING_BYTES_MATCH, False, desc, observed, expected, msg)


# --------------------------------------------------------------------------------------
def steady_steps_stable(step_result: StepResult, rel_tol: float = RULE.outlier_rel_tol) -> CheckOutcome:
    """Rule 4: steady steps carry identical network bytes and nearly equal durations.

    Bytes are compared over all steady steps. A send/recv whose sizes routing varies (:func:`routed_p2p`:
    an MoE all-to-all's parts) is the one exception, as in the step rule (``steps/rule.py``): every other
    flow's network bytes (the sizes the model fixes) are identical in every steady step, and each such
    communicator's bytes (all its flows) stay within ``RULE.p2p_bytes_rel_tol`` of its median steady step's.
    Durations are compared over the timed steps (``step_result.timed_steps``: the steady steps except the
    last, whose end is its last flow's end rather than the next step's start) not flagged as outliers
    (``steps.outlier``: more than ``RULE.outlier_rel_tol`` off the median, kept as steps by the step rule),
    relative to their median (``step_time_us``); the largest relative deviation must be <= ``rel_tol``,
    by default the step rule's own ``RULE.outlier_rel_tol`` (10 %: iteration jitter up to it is a typical
    step, the step rule's ``evidence.typical_step_us``; was 5 %, which refused what the step rule accepts).
    """
    desc = (
        f"Steady steps carry identical network bytes (send/recv sizes routing varies: within "
        f"{RULE.p2p_bytes_rel_tol:.0%} of the median step) and their durations stay within "
        f"{rel_tol:.1%} of the median step time."
    )
    steps = step_result.steps.set_index("step")
    steady = list(step_result.steady_steps)
    # outlier steps (an eval pass, a checkpoint: ``steps.outlier``, issue 28) are kept as steps, not timed here
    flagged = set(steps.index[steps["outlier"] != ""]) if "outlier" in steps.columns else set()
    timed = [k for k in step_result.timed_steps if k not in flagged]
    if not steady:
        return CheckOutcome(
            STEADY_STEPS_STABLE,
            False,
            desc,
            {"steady_steps": 0},
            {"steady_steps": ">= 1"},
            "There is no steady step.",
        )
    net = steps.loc[steady, "network_bytes"].astype("int64")
    ref_bytes = int(step_result.network_bytes_per_step)
    routed = routed_p2p(step_result)
    fixed, ref_fixed, spread = net, ref_bytes, _routed_spread(step_result, routed) if routed else {}
    if routed:
        routed_net = _routed_network_bytes(step_result, routed).reindex(steady, fill_value=0)
        fixed = net - routed_net
        ref_fixed = int(np.sort(fixed.to_numpy())[(len(fixed) - 1) // 2])
    odd_bytes = fixed[fixed != ref_fixed]
    durs = steps.loc[timed, "duration_us"].astype("float64")
    med = float(step_result.step_time_us)
    dev = (durs - med).abs() / med if med > 0 else pd.Series(np.inf, index=durs.index)
    max_dev = float(dev.max()) if len(dev) else 0.0
    worst = int(dev.idxmax()) if len(dev) else -1
    slow = dev[dev > rel_tol]
    observed = {
        "steady_steps": len(steady),
        "timed_steps": len(timed),
        "network_bytes_min": int(net.min()),
        "network_bytes_max": int(net.max()),
        "step_time_us": med,
        "max_rel_deviation": max_dev,
        "worst_step": worst,
        "steps_with_other_bytes": [int(k) for k in odd_bytes.index],
        "steps_out_of_tolerance": [int(k) for k in slow.index],
    }
    expected = {"network_bytes_per_step": ref_bytes, "max_rel_deviation": f"<= {rel_tol}"}
    if routed:
        observed["fixed_network_bytes_per_step"] = ref_fixed
        observed["routed_max_rel_deviation"] = {c: round(d, 6) for c, (d, _, _) in sorted(spread.items())}
        expected["routed_max_rel_deviation"] = f"<= {RULE.p2p_bytes_rel_tol}"
    problems: list[str] = []
    what = " of fixed-size collectives" if routed else ""
    for k, b in odd_bytes.items():
        problems.append(
            f"step {k} carries {int(b)} network bytes{what}, the median steady step {ref_fixed} "
            f"({int(b) - ref_fixed:+d})"
        )
    for c, (d, k, b) in sorted(spread.items()):
        if d > RULE.p2p_bytes_rel_tol:
            problems.append(
                f"communicator {c}, whose send/recv sizes vary with routing, moves {b} bytes in step {k}, {d:.0%} off "
                f"its median steady step (tolerance {RULE.p2p_bytes_rel_tol:.0%}, the step rule's)"
            )
    for k, d in slow.items():
        problems.append(
            f"step {k} lasts {durs[k]:.1f} us, {d:.1%} away from the median {med:.1f} us (tolerance {rel_tol:.1%})"
        )
    # the step rule's own condition (steps/detect._step_time, "no typical step"): outliers are the exception,
    # so most timed steps must be typical; ProfilerStep#N steps (lib/kineto/step_spans.py) flag outliers but
    # never refused this (a marked run slowing from 10 to 18 ms a step, 5 of its 9 steps outliers, passed)
    all_timed = [k for k in step_result.timed_steps if k in steps.index]
    _, n_typical = typical_step_us(steps.loc[all_timed, "duration_us"].to_numpy(dtype=np.float64))
    observed["typical_timed_steps"] = int(n_typical)
    expected["typical_timed_steps"] = f"> {len(all_timed) / 2:g}"
    if all_timed and 2 * n_typical <= len(all_timed):
        problems.append(
            f"no typical step: {n_typical} of the {len(all_timed)} timed steady steps lie within "
            f"{2 * RULE.outlier_rel_tol:.0%} of each other, the others as many outliers (the step rule's "
            f"'steps irregular'); the step time is undecidable"
        )
    if not problems:
        if routed:
            worst_c = max(spread, key=lambda c: spread[c][0])
            carry = (
                f"carry {ref_fixed} network bytes of fixed-size collectives; the send/recv of {len(spread)} "
                f"communicator(s) vary with routing, at most {spread[worst_c][0]:.1%} off their median step "
                f"(tolerance {RULE.p2p_bytes_rel_tol:.0%}), so steps carry {int(net.min())}..{int(net.max())} "
                f"network bytes, the median step {ref_bytes}"
            )
        else:
            carry = f"carry {ref_bytes} network bytes"
        msg = (
            f"All {len(steady)} steady steps {carry}; the {len(timed)} "
            f"timed steps stay within {max_dev:.2%} of the median {med:.1f} us "
            f"(tolerance {rel_tol:.1%})."
        )
        return CheckOutcome(STEADY_STEPS_STABLE, True, desc, observed, expected, msg)
    msg = "Steady steps are not stable: " + _listing(problems) + "."
    return CheckOutcome(STEADY_STEPS_STABLE, False, desc, observed, expected, msg)


def _routed_mask(f: pd.DataFrame, routed: set[tuple[str, str, str]]) -> np.ndarray:
    key = pd.Series(list(zip(f["comm_id"].astype(str), f["op"].astype(str), f["dtype"].astype(str), strict=True)))
    return key.isin(routed).to_numpy()


def _routed_network_bytes(step_result: StepResult, routed: set[tuple[str, str, str]]) -> pd.Series:
    """Network bytes of the routed send/recv (:func:`routed_p2p`) per steady step."""
    f = step_result.flows
    f = f.loc[
        f["step"].isin(step_result.steady_steps), ["step", "comm_id", "op", "dtype", "bytes", "src_node", "dst_node"]
    ]
    keep = _routed_mask(f, routed) & (f["src_node"].to_numpy() != f["dst_node"].to_numpy())
    return f.loc[keep].groupby("step")["bytes"].sum().astype("int64")


def _routed_spread(step_result: StepResult, routed: set[tuple[str, str, str]]) -> dict[str, tuple[float, int, int]]:
    """Per communicator with routed send/recv: ``(largest relative deviation of a steady step's bytes from
    the median steady step's, that step, its bytes)``; all its flows, as the step rule's ``detect._p2p_bytes``."""
    comms = sorted({c for c, _, _ in routed})
    f = step_result.flows
    f = f.loc[
        f["step"].isin(step_result.steady_steps) & f["comm_id"].astype(str).isin(comms), ["comm_id", "step", "bytes"]
    ]
    per = f.groupby([f["comm_id"].astype(str), "step"])["bytes"].sum().unstack(fill_value=0)
    per = per.reindex(columns=list(step_result.steady_steps), fill_value=0)
    out: dict[str, tuple[float, int, int]] = {}
    for c, row in per.iterrows():
        med = float(row.median())
        dev = (row - med).abs() / (med if med > 0 else 1.0)
        k = int(dev.idxmax())
        out[str(c)] = (float(dev[k]), k, int(row[k]))
    return out


# --------------------------------------------------------------------------------------
def run_trace_checks(
    flows: pd.DataFrame, step_result: StepResult, rel_tol: float = RULE.outlier_rel_tol
) -> list[CheckOutcome]:
    """The four trace rules, in DATASET.md order."""
    return [
        flows_exist(flows),
        steps_match(step_result),
        ring_bytes_match(flows),
        steady_steps_stable(step_result, rel_tol=rel_tol),
    ]


#: Fewest run.log iterations that let the step count and time be compared.
MIN_LOGGED_ITERATIONS = 3
#: Relative tolerance on the step time against run.log's median steady iteration.
ITERATION_REL_TOL = 0.10


def steps_match_run_log(step_result: StepResult, iteration_s: list[float], precise: bool) -> CheckOutcome:
    """The detected steps agree with the iterations the run's ``run.log`` reports: as many steps as
    iterations (up to 2 fewer: warm-up calls that form no full period), and a step time within
    10 % of the median iteration after the first (plus 0.01 s when the log prints only two
    decimals). Passes, saying so, when run.log reports fewer than 3 iterations. This is what
    catches a period that is a multiple (or a fraction) of the true step, e.g. a logging
    all-reduce every 5th step read as a 5-iteration step."""
    name = STEPS_MATCH_RUN_LOG
    desc = "The steps agree with the iterations run.log reports (count and median time), when it reports them."
    n_log = len(iteration_s)
    if n_log < MIN_LOGGED_ITERATIONS:
        return CheckOutcome(
            name,
            True,
            desc,
            {"run_log_iterations": n_log},
            {},
            "run.log reports no iteration times to compare with: not checked",
        )
    n_steps = len(step_result.steps)
    med_us = float(np.median(np.asarray(iteration_s[1:], dtype=float))) * 1e6
    tol_us = ITERATION_REL_TOL * med_us + (0.0 if precise else 0.01e6)
    step_us = float(step_result.step_time_us)
    observed = {
        "steps": n_steps,
        "step_time_us": round(step_us, 3),
        "run_log_iterations": n_log,
        "run_log_median_iteration_us": round(med_us, 3),
    }
    expected = {"steps": f"{max(1, n_log - 2)}..{n_log}", "step_time_us": f"{med_us:.0f} +- {tol_us:.0f}"}
    problems = []
    if not (n_log - 2 <= n_steps <= n_log):
        problems.append(f"{n_steps} steps detected but run.log reports {n_log} iterations")
    if abs(step_us - med_us) > tol_us:
        problems.append(
            f"step time {step_us / 1e3:.3f} ms but run.log's median iteration is {med_us / 1e3:.3f} ms "
            f"({step_us / med_us:.2f}x)"
        )
    if problems:
        return CheckOutcome(
            name,
            False,
            desc,
            observed,
            expected,
            "; ".join(problems) + ": the detected period is "
            "not the training step (an irregular collective, e.g. one every few steps?)",
        )
    return CheckOutcome(
        name,
        True,
        desc,
        observed,
        expected,
        f"{n_steps} steps of {step_us / 1e3:.3f} ms agree with run.log's {n_log} iterations "
        f"(median {med_us / 1e3:.3f} ms)",
    )
