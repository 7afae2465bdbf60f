"""The generator's collectives against an independent oracle and a measured FSDP table (issue 26, item 4).

* ``tests/fixtures/collective_oracle.py`` predicts, from the frameworks' documented rules, every
  communicator's calls (op, count, dtype) of one steady step. Hypothesis draws valid workload specs
  (framework, dense / MoE, tp / pp / dp / ep / cp, ZeRO, sequence parallelism, schedule, gradient
  accumulation, recompute) and the generator's per-step calls
  (``phantora_assets.lib.workload.collectives.step_collectives``) must equal the oracle's exactly, call
  for call (multiset per communicator) and so byte for byte.
* ``tests/data/tracelens/nccl_summary_long.csv`` (AMD TraceLens, MIT) is a measured per-collective
  table of a real FSDP run: Llama-3-70B on 8 MI300X in one node. The oracle and the generator must
  give its calls per step.

Calls of at most ``BOOKKEEPING`` elements (the loss and grad-norm scalars, MoE token counts) are
left out on both sides: they carry no model shape.
"""

from __future__ import annotations

import csv
import math
from collections import Counter

import pytest
from fixtures.collective_oracle import Call, Comm, Prediction, _hf_gpt_oss_params, _model, predict
from fixtures.paths import DATA
from fixtures.workload_strategies import any_spec
from hypothesis import HealthCheck, given, settings

TRACELENS = DATA / "tracelens" / "nccl_summary_long.csv"
BOOKKEEPING = 16
DTYPES = {"Bf16": "bf16", "F32": "fp32", "bf16": "bf16", "fp32": "fp32"}

LLAMA3_70B = {"kind": "dense", "layers": 80, "hidden": 8192, "ffn_hidden": 28672, "heads": 64, "kv_heads": 8}
LLAMA3_70B["vocab"] = 128256


def _fsdp_70b() -> dict:
    """TorchTitan Llama-3-70B, FSDP2 over 8 GPUs (the TraceLens run: one node, no TP/PP)."""
    return {
        "framework": "torchtitan",
        "model": dict(LLAMA3_70B),
        "parallel": {"dp": 8, "zero": 3},
        "train": {"seq_len": 8192, "micro_batch": 1, "global_batch": 8, "recompute": "full"},
    }


def measured_tracelens() -> tuple[tuple[int, ...], Counter, int]:
    """Rank 0's calls of one step in the TraceLens table: (ranks, Counter[Call], steps). The
    table sums a window of steps; their number is the gcd of the operation counts."""
    with TRACELENS.open(newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["rank"] == "0"]
    counts: Counter = Counter()
    ranks: set[tuple[int, ...]] = set()
    for r in rows:
        name, dt = r["Collective name"], {"BFloat16": "bf16", "Float": "fp32"}[r["dtype"]]
        n_in, n_out = int(r["In msg nelems"]), int(r["Out msg nelems"])
        if name == "_allgather_base":
            call = Call("all_gather", n_in, dt)  # the per-rank shard is the input
        elif name == "_reduce_scatter_base":
            call = Call("reduce_scatter", n_out, dt)  # the per-rank shard is the output
        elif name == "allreduce":
            call = Call("all_reduce", n_in, dt)
        else:
            raise AssertionError(f"unexpected collective {name}")
        ranks.add(tuple(int(x) for x in r["Process Group Ranks"].strip("[]").split(",")))
        if call.count > BOOKKEEPING:
            counts[call] += int(r["operation_count"])
    steps = math.gcd(*counts.values())
    assert len(ranks) == 1
    return ranks.pop(), Counter({c: k // steps for c, k in counts.items()}), steps


def test_oracle_matches_the_measured_fsdp_table():
    ranks, measured, steps = measured_tracelens()
    assert steps == 2 and ranks == tuple(range(8))
    pred = predict(_fsdp_70b(), 8, 8)
    assert pred.multiset(("dp", ranks)) == measured
    # what the table holds, in words: per step 80 + 79 block all-gathers (the last block is not
    # resharded after forward) of 855,654,400 / 8 bf16 elements, one root all-gather, and one fp32
    # reduce-scatter per block and for the root
    assert measured[Call("all_gather", 855_654_400 // 8, "bf16")] == 159
    assert measured[Call("reduce_scatter", 2_101_354_496 // 8, "fp32")] == 1


# --------------------------------------------------------------------------- the generator side
def _collectives():
    """The generator's API (docs/WORKLOADS.md); skips while it has not landed."""
    import importlib

    for name in ("phantora_assets.lib.workload.collectives", "phantora_assets.lib.sim.collectives"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("issue 26 generator (phantora_assets.lib.workload.collectives) not landed yet")


def generated(
    table: dict, gpus: int, gpus_per_node: int, gpu: str = "h100", drop_tags: tuple[str, ...] = ()
) -> dict[Comm, list[Call]]:
    """The generator's calls of one steady step per communicator, in the oracle's terms
    (``drop_tags``: leave out calls whose tag starts with one of these)."""
    col = _collectives()
    spec = col.run_spec_of(table, nodes=gpus // gpus_per_node, gpus_per_node=gpus_per_node, gpu=gpu, name="oracle")
    out: dict[Comm, list[Call]] = {}
    for c in col.step_collectives(spec, warmup=False):
        if c.count <= BOOKKEEPING or len(c.ranks) < 2 or c.tag.startswith(drop_tags):
            continue
        if c.op == "send":
            key: Comm = (c.group, (c.src, c.dst))
            call = Call("send_recv", c.count, DTYPES[c.dtype])
        else:
            key = (c.group, tuple(c.ranks))
            call = Call(c.op, c.count, DTYPES[c.dtype])
        out.setdefault(key, []).append(call)
    return out


def assert_matches_oracle(
    table: dict, gpus: int, gpus_per_node: int, skip_groups: tuple[str, ...] = (), pinned: frozenset[str] = frozenset()
) -> None:
    """The generator's calls equal the oracle's on every communicator (``skip_groups`` aside),
    less the calls of the ``pinned`` rules (bugs pinned by their own strict xfail)."""
    pred = predict(table, gpus, gpus_per_node)
    expected = {
        comm: Counter({c: k for c, k in calls.items() if c.count > BOOKKEEPING})
        for comm, calls in pred.without(pinned).items()
    }
    drop = tuple(PINNED_TAGS[r] for r in pinned if r in PINNED_TAGS and pred.ruled.get(r))
    got = generated(table, gpus, gpus_per_node, drop_tags=drop)
    diffs = []
    for comm in sorted(set(got) | set(expected)):
        if comm[0] in skip_groups:
            continue
        g = got.get(comm, [])
        if comm in pred.totals_only:
            gt: dict[tuple[str, str], int] = {}
            for c in g:
                gt[(c.op, c.dtype)] = gt.get((c.op, c.dtype), 0) + c.count
            want: dict[tuple[str, str], int] = {}
            for c in pred.calls.get(comm, []):
                if c.count > BOOKKEEPING:
                    want[(c.op, c.dtype)] = want.get((c.op, c.dtype), 0) + c.count
            if gt != want:
                diffs.append(f"{comm}: element totals generated {gt} vs oracle {want}")
        elif Counter(g) != expected.get(comm, Counter()):
            extra = Counter(g) - expected.get(comm, Counter())
            missing = expected.get(comm, Counter()) - Counter(g)
            diffs.append(
                f"{comm}: generated but not predicted {dict(extra)}; predicted but not generated {dict(missing)}"
            )
    assert not diffs, f"{len(diffs)} communicators differ, first: " + "\n".join(diffs[:4])


def test_generator_matches_the_measured_fsdp_table():
    # torchtitan apply_fsdp: reshard_after_forward = layer_id < n_layers - 1, so the measured run
    # all-gathers 80 + 79 blocks a step
    ranks, measured, _ = measured_tracelens()
    got = generated(_fsdp_70b(), 8, 8)
    assert Counter(got[("dp", ranks)]) == measured


# --------------------------------------------------------------------------- random specs
# While the generator has bugs pinned as strict xfails (KNOWN_BUGS), the draws stay outside the
# regions where a bug changes sizes or counts of calls the generator does issue, each region with
# its strict xfail; widen a draw when its bug is fixed. None is pinned now: every draw is compared.
KNOWN_BUGS = False
# Rules whose calls the generator leaves out entirely: the property test sets aside exactly their
# contribution (Prediction.ruled) instead of avoiding the specs they touch.
PINNED_RULES: frozenset[str] = frozenset()
# the generator's own calls of a pinned rule that the oracle's named calls replace
PINNED_TAGS: dict[str, str] = {}


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(any_spec())
def test_generated_collectives_match_the_oracle(case):
    _collectives()
    table, gpus, gpn = case
    assert_matches_oracle(table, gpus, gpn, (), PINNED_RULES if KNOWN_BUGS else frozenset())


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(any_spec())
def test_oracle_placement_is_a_partition(case):
    """The oracle itself, before any comparison: its TP / DP / EP groups partition the ranks (each
    rank in exactly one group of a kind per stage), point-to-point pairs are two distinct ranks."""
    table, gpus, gpn = case
    pred = predict(table, gpus, gpn)
    by_kind: dict[str, Counter] = {}
    for (group, ranks), calls in pred.calls.items():
        assert calls and all(0 <= r < gpus for r in ranks)
        sends = sum(c.op == "send_recv" for c in calls)
        if sends:  # a point-to-point pair (pp, a cp ring hop)
            assert group in ("pp", "cp") and len(ranks) == 2 and ranks[0] != ranks[1]
        # collectives: torchtitan's CP all-gathers K and V over the cp mesh (at cp = 2 the group's
        # key is also the hop 0 -> 1's)
        if sends < len(calls) and group in ("tp", "ep", "cp"):
            by_kind.setdefault(group, Counter()).update(ranks)
    for group, seen in by_kind.items():
        assert set(seen.values()) == {1}, f"a rank is in two {group} groups"
    if pred.sizes["tp"] > 1:
        assert len(by_kind["tp"]) == gpus


# --------------------------------------------------------------------------- the oracle's own numbers
def _megatron(model: dict, parallel: dict, train: dict) -> dict:
    base = {"kind": "dense", "layers": 4, "hidden": 4096, "ffn_hidden": 14336, "heads": 32, "kv_heads": 8}
    return {
        "framework": "megatron",
        "model": {**base, "vocab": 128256, **model},
        "parallel": parallel,
        "train": {"seq_len": 1024, "micro_batch": 1, **train},
    }


def test_oracle_hand_counts():
    """Closed forms worked by hand on small cases (not by the oracle's code paths)."""
    s, h = 1024, 4096
    # W1's published rule (presets.toml): TP = 2, no SP, 4 layers: 18 all-reduces of [s, b, h] bf16
    # per micro-batch (embedding fwd, 2 fwd + 2 bwd per layer, LM-head bwd) + 3 fp32 [s, b]
    pred = predict(_megatron({}, {"tp": 2, "dp": 2, "zero": 1}, {"grad_accumulation": 1}), 4, 2)
    assert pred.multiset(("tp", (0, 1))) == Counter(
        {Call("all_reduce", s * h, "bf16"): 18, Call("all_reduce", s, "fp32"): 3}
    )
    # with sequence parallelism: per layer 2 AG + 2 RS forward, 4 AG + 2 RS backward; embedding RS
    # fwd + AG bwd; head AG fwd, AG + RS bwd; one all-reduce of the 9 norm weights per step
    pred = predict(
        _megatron({}, {"tp": 2, "dp": 1, "zero": 1, "sequence_parallel": True}, {"grad_accumulation": 2}), 2, 2
    )
    n = s * h // 2
    tp = pred.multiset(("tp", (0, 1)))
    assert tp[Call("all_gather", n, "bf16")] == 2 * (4 * 6 + 1 + 2)  # layers, embedding bwd, head fwd + bwd
    assert tp[Call("reduce_scatter", n, "bf16")] == 2 * (4 * 4 + 1 + 1)
    assert tp[Call("all_reduce", 9 * h, "bf16")] == 1
    # PP = 2, 4 micro-batches, 1F1B: 4 activations forward, 4 gradients back, [s, b, h] bf16
    pred = predict(_megatron({}, {"pp": 2, "dp": 1, "zero": 1}, {"grad_accumulation": 4}), 2, 1)
    assert pred.multiset(("pp", (0, 1))) == Counter({Call("send_recv", s * h, "bf16"): 4})
    assert pred.multiset(("pp", (1, 0))) == Counter({Call("send_recv", s * h, "bf16"): 4})
    # interleaved, 2 chunks per rank, 2 micro-batches: 0 -> 1 carries 2 x 2 forward + (2 - 1) x 2
    # wrap gradients; 1 -> 0 the same the other way
    par = {"pp": 2, "dp": 1, "zero": 1, "pp_schedule": "interleaved", "virtual_stages": 2}
    pred = predict(_megatron({}, par, {"grad_accumulation": 2}), 2, 1)
    assert pred.multiset(("pp", (0, 1)))[Call("send_recv", s * h, "bf16")] == 6
    # CP = 2 ring: per layer 1 KV send forward, 2 backward (KV, then dKV), packed K and V of
    # s/2 tokens x 8 kv heads x 128; with CP = 2 both go to the one peer
    pred = predict(_megatron({}, {"cp": 2, "dp": 1, "zero": 1}, {"grad_accumulation": 1}), 2, 2)
    assert pred.multiset(("cp", (0, 1))) == Counter({Call("send_recv", 2 * (s // 2) * 8 * 128, "bf16"): 3 * 4})
    # distributed optimizer over DP x CP: W1's 4-layer TP-2 buffer on one rank holds 961,581,056
    # elements (embedding and output 262,668,288 each, 109,060,096 a layer, the final norm 4,096);
    # its buckets, padded to lcm(2, 128), are reduce-scattered and all-gathered once each
    pred = predict(_megatron({}, {"tp": 2, "dp": 2, "zero": 1}, {"grad_accumulation": 1}), 4, 2)
    dp = pred.calls[("dp", (0, 2))]
    padded = [2 * c.count for c in dp if c.op == "reduce_scatter"]
    assert [2 * c.count for c in dp if c.op == "all_gather"] == padded
    assert all(k % 128 == 0 for k in padded) and 0 <= sum(padded) - 961_581_056 < 128 * len(padded)


# --------------------------------------------------------------------------- generator bugs, by rule
# Each test holds one rule where the generator (issue 26 branch gen26, lib/sim) and the oracle
# disagreed and the frameworks' sources side with the oracle; each was a strict xfail until its
# fix (docs/ORACLE.md "Disagreements"). A new disagreement gets a strict xfail here, named
# test_bug_<rule>, until it is fixed.
def _small(framework: str, parallel: dict, train: dict, **model) -> dict:
    base = {"kind": "dense", "layers": 2, "hidden": 256, "ffn_hidden": 512, "heads": 4, "kv_heads": 4, "vocab": 1024}
    return {
        "framework": framework,
        "model": {**base, **model},
        "parallel": parallel,
        "train": {"seq_len": 512, **train},
    }


def test_megatron_cp_ring_backward():
    """Rule megatron.cp_ring_backward (fixed): TE sends KV, then dKV (cp = 2), per step."""
    # Transformer Engine AttnFuncWithCPAndKVP2P.backward (bf16): cp steps, each one send to the
    # previous rank: KV at the first, dKV at the last, both in between
    assert_matches_oracle(_small("megatron", {"cp": 2, "dp": 1, "zero": 1}, {"grad_accumulation": 1}), 2, 2)


def test_megatron_cp_ring_full_recompute():
    """Rule megatron.full_recompute_cp_ring: full recompute reruns the CP ring."""
    # --recompute-granularity full checkpoints whole layers: the attention forward, its KV ring
    # included, runs again in backward (the generator did rerun it; this failed on the backward
    # ring's calls at cp = 4, rule megatron.cp_ring_backward)
    par = {"cp": 4, "dp": 1, "zero": 1}
    assert_matches_oracle(_small("megatron", par, {"grad_accumulation": 1, "recompute": "full"}), 4, 4)


def test_megatron_interleaved_buffers():
    """Rule megatron.ddp_per_model_chunk (fixed): one DDP grad buffer per model chunk."""
    # megatron/training/training.py get_model: with virtual pipeline stages every model chunk is
    # wrapped in its own DistributedDataParallel (bucketing off for chunks after the first), so a
    # rank reduces one buffer per chunk
    par = {"pp": 2, "dp": 2, "zero": 0, "pp_schedule": "interleaved", "virtual_stages": 2}
    assert_matches_oracle(_small("megatron", par, {"grad_accumulation": 2}, layers=4), 4, 4)


def test_torchtitan_pp_embedding_backward():
    """Rule torchtitan.pp_embedding_backward (fixed): stage 0 all-gathers the embedding grad."""
    # tok_embeddings RowwiseParallel(output_layouts=Shard(1)): its output gradient is all-gathered
    # back to Replicate in backward on the first pipeline stage as without PP (one per micro-batch)
    par = {"tp": 2, "dp": 2, "zero": 2, "pp": 2, "pp_schedule": "gpipe", "sequence_parallel": True}
    assert_matches_oracle(_small("torchtitan", par, {"grad_accumulation": 2}), 8, 4)


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(any_spec())
def test_oracle_bytes_follow_the_flow_rule(case):
    """The oracle's bytes per step of a communicator (its closed forms) equal what the project's
    flow rule (lib/traffic/ring.py, the rule every simulated flow follows) makes of its calls."""
    from phantora_assets.lib.traffic.ring import ring_flows

    table, gpus, gpn = case
    pred = predict(table, gpus, gpn)
    for comm, calls in pred.calls.items():
        n = len(comm[1])
        flows = 0
        for c in calls:
            w = c.nbytes // c.count
            if c.op == "send_recv":
                flows += c.nbytes
            elif c.op == "all_to_all":  # grouped send/recv: every ordered pair of distinct ranks
                flows += n * (n - 1) * c.nbytes
            else:
                flows += sum(b for _, _, b in ring_flows(c.op, c.count, w, n))
        assert flows == pred.sent_bytes(comm), comm
    assert sum(pred.by_group().values()) == sum(pred.payload_bytes(c) for c in pred.calls)


def _moe_tp(ep: int, shared: int) -> dict:
    moe = {"kind": "moe", "experts": 4, "topk": 2, "moe_ffn_hidden": 256, "shared_experts": shared}
    par = {"tp": 2, "dp": 2, "zero": 1, "ep": ep, "sequence_parallel": True}
    return _small("megatron", par, {"grad_accumulation": 1}, **moe)


def test_megatron_shared_expert_tp():
    """Rule megatron.shared_expert_tp (fixed): shared experts are a TP MLP."""
    # SharedExpertMLP (transformer/moe/shared_experts.py) is an MLP with ColumnParallel fc1 and
    # RowParallel fc2: under TP + SP the same all-gathers / reduce-scatters as a dense MLP (the
    # rules still pinned set aside)
    assert_matches_oracle(_moe_tp(2, 1), 4, 4, pinned=PINNED_RULES)


def test_megatron_etp_without_ep():
    """Rule megatron.etp_gather_without_ep (fixed): expert TP gathers even with ep = 1."""
    # MoEAlltoAllTokenDispatcher.dispatch_postprocess all-gathers the tokens over the expert TP
    # group whenever tp_size > 1 (and combine_preprocess reduce-scatters them), whatever ep is
    # (the rules still pinned set aside)
    assert_matches_oracle(_moe_tp(1, 0), 4, 4, pinned=PINNED_RULES)


def _minus(seq: list[Call], calls: list[Call]) -> list[Call]:
    """``seq`` without one occurrence of each of ``calls`` (the last occurrence)."""
    out = list(seq)
    for c in calls:
        i = len(out) - 1 - out[::-1].index(c)
        del out[i]
    return out


def assert_tp_order_matches(table: dict, gpus: int, gpus_per_node: int, pinned: frozenset[str] = frozenset()) -> None:
    """On every TP communicator the generator issues the oracle's calls in the oracle's order."""
    pred = predict(table, gpus, gpus_per_node)
    got = generated(table, gpus, gpus_per_node)
    ruled: dict[Comm, list[Call]] = {}
    for rule in pinned:
        for comm, call in pred.ruled.get(rule, []):
            ruled.setdefault(comm, []).append(call)
    for comm, calls in pred.calls.items():
        if comm[0] != "tp":
            continue
        expected = [c for c in _minus(calls, ruled.get(comm, [])) if c.count > BOOKKEEPING]
        assert got.get(comm, []) == expected, f"{comm}: generated {got.get(comm)} vs oracle {expected}"


@settings(max_examples=30, suppress_health_check=[HealthCheck.too_slow])
@given(any_spec())
def test_tp_calls_in_issue_order(case):
    """One pipeline stage, dense, no full recompute: the TP calls in the frameworks' issue order
    (forward layer by layer, backward from the head back to the embedding)."""
    _collectives()
    table, gpus, gpn = case
    par, tr = table["parallel"], table["train"]
    if par.get("pp", 1) > 1 or table["model"]["kind"] != "dense" or tr.get("recompute") == "full":
        return
    assert_tp_order_matches(table, gpus, gpn, PINNED_RULES if KNOWN_BUGS else frozenset())


def test_torchtitan_tp_backward():
    """Rule torchtitan.tp_backward (fixed): output RS only, embedding AG in backward."""
    # DTensor saves the all-gathered input of ColwiseParallel(output), so its backward is one
    # reduce-scatter (no re-gather, unlike Megatron's SP); the RowwiseParallel embedding's
    # Partial -> Shard(1) forward makes its backward an all-gather (same multiset as an output
    # AG + RS and no embedding call: the order tells them apart)
    par = {"tp": 2, "dp": 2, "zero": 2, "sequence_parallel": True}
    assert_tp_order_matches(_small("torchtitan", par, {"grad_accumulation": 1}), 4, 4)


def test_torchtitan_sac_reruns_tp_all_gathers():
    """Rule torchtitan.sac_tp_all_gathers: per-op SAC reissues each block's two TP all-gathers."""
    # _op_sac_save_list (torchtitan models/llama3/infra/parallelize.py) saves mm, SDPA, max and
    # reduce_scatter_tensor outputs; the Shard(1) -> Replicate all-gathers of the attention and
    # feed-forward inputs are recomputed before the block's backward, the reduce-scatters are not
    par = {"tp": 2, "dp": 2, "zero": 3, "sequence_parallel": True}
    table = _small("torchtitan", par, {"grad_accumulation": 2, "recompute": "selective"})
    _collectives()
    assert_tp_order_matches(table, 4, 4)
    pred = predict(table, 4, 4)
    n = 512 * 1 * 256 // 2
    tp_calls = pred.multiset(("tp", (0, 1)))
    # per micro-batch: embedding RS + output RS + 2 RS fwd + 2 RS bwd a block; AG: output +
    # embedding + (2 fwd + 2 recompute + 2 bwd) a block
    assert tp_calls[Call("reduce_scatter", n, "bf16")] == 2 * (2 + 4 * 2)
    assert tp_calls[Call("all_gather", n, "bf16")] == 2 * (2 + 6 * 2)
    # the generator: the same calls, and per block exactly two more all-gathers than without AC
    got = Counter(generated(table, 4, 4)[("tp", (0, 1))])
    plain = Counter(generated(_small("torchtitan", par, {"grad_accumulation": 2}), 4, 4)[("tp", (0, 1))])
    assert got == +tp_calls
    assert got - plain == Counter({Call("all_gather", n, "bf16"): 2 * 2 * 2})


def test_deepspeed_zero2_accumulation():
    """Rule deepspeed.zero2_reduce_every_backward (fixed): ZeRO-2 reduces every micro-batch."""
    # stage_1_and_2.py reduce_ready_partitions_and_remove_grads reduces the gradient buckets at
    # every backward when gradients are partitioned (ZeRO-2), at the boundary only for ZeRO-1
    assert_matches_oracle(_small("deepspeed", {"dp": 4, "zero": 2}, {"grad_accumulation": 2}), 4, 4)


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(any_spec())
def test_inter_node_bytes_match_the_simulator(case):
    """End to end: the simulator's inter-node bytes of a steady step (what the dataset publishes
    per run, AnalyticSimulator.network_bytes_per_step over its flows) equal the oracle's calls laid
    on the documented placement (host = rank // GPUs per node) by the ring rule; the generator's
    bookkeeping scalars are added as they are, the pinned rules' calls left out."""
    col = _collectives()
    from phantora_assets.lib.sim.analytic import AnalyticSimulator

    table, gpus, gpn = case
    spec = col.run_spec_of(table, nodes=gpus // gpn, gpus_per_node=gpn, gpu="h100", name="oracle")
    simulated = AnalyticSimulator(spec, emit=False).network_bytes_per_step()
    pred = predict(table, gpus, gpn)
    pinned = PINNED_RULES if KNOWN_BUGS else frozenset()
    # taken as the generator has them: bookkeeping scalars and its own calls of a pinned rule
    drop = tuple(PINNED_TAGS[r] for r in pinned if r in PINNED_TAGS and pred.ruled.get(r))
    scalars = Prediction(gpus_per_node=gpn)
    for c in col.step_collectives(spec, warmup=False):
        if (c.count <= BOOKKEEPING and c.op != "send") or c.tag.startswith(drop):
            scalars.add((c.group, tuple(c.ranks)), Call(c.op, c.count, DTYPES[c.dtype]))
    expected = pred.inter_node_bytes(pinned, min_count=BOOKKEEPING) + scalars.inter_node_bytes()
    assert simulated == expected


def test_megatron_sp_router_grads():
    """Rule megatron.sp_router_grad_all_reduce (fixed): router grads are in the SP all-reduce."""
    # router.py sets the router weight's sequence_parallel attribute, so finalize_model_grads
    # all-reduces its gradient over TP with the norms' (one coalesced call)
    assert_matches_oracle(_moe_tp(2, 0), 4, 4, pinned=PINNED_RULES)


def test_megatron_expert_grads_etp_below_tp():
    """Rule megatron.expert_grad_reduce_etp_below_tp (fixed): experts replicated over EDP."""
    # Megatron's expert mesh of a stage is etp x ep x edp = tp x cp x dp ranks: with etp = 1 < tp
    # an expert lives on tp x cp x dp / ep ranks (here tp 4, ep 2, dp 1: edp 2) and its gradients
    # are reduced over them
    moe = {"kind": "moe", "experts": 4, "topk": 2, "moe_ffn_hidden": 256}
    par = {"tp": 4, "dp": 1, "zero": 1, "ep": 2, "etp": 1, "sequence_parallel": True}
    table = _small("megatron", par, {"grad_accumulation": 1}, **moe)
    table["model"]["heads"] = table["model"]["kv_heads"] = 8
    assert_matches_oracle(table, 4, 4, pinned=PINNED_RULES)


def test_torchtitan_cp_exchanges_kv():
    """Rule torchtitan.cp_ring_allgather (fixed): CP all-gathers K / V and sends dK / dV per block."""
    # torch _context_parallel/_attention.py with torchtitan's default rotate method "allgather":
    # forward one all-gather of the packed local K and V ([b, kv_heads, s/cp, d] each, bf16); backward
    # the same all-gather, then cp sends of the fp32 dK / dV accumulator to the next cp rank
    # (dkv_rotater = _AllToAllRotater: permute_tensor to rank + 1). Was: no cp traffic at all, the
    # bytes of a plain DP = 2 job. Here tp 1, cp 2, dp 2 on 4 GPUs: cp groups (0, 1), (2, 3), the
    # FSDP mesh dp_shard x cp = all four ranks; 2 blocks, 2 micro-batches.
    kvp = 2 * 1 * (512 // 2) * 4 * 64
    for recompute, gathers in (("none", 2), ("selective", 2), ("full", 3)):  # full AC reruns the forward
        table = _small("torchtitan", {"dp": 2, "cp": 2, "zero": 3}, {"grad_accumulation": 2, "recompute": recompute})
        got = {comm: Counter(calls) for comm, calls in generated(table, 4, 4).items() if comm[0] == "cp"}
        blocks = 2 * 2
        assert got == _cp_expected(kvp, gathers * blocks, 2 * blocks)
        assert_matches_oracle(table, 4, 4)
    # gradients stay on the FSDP mesh dp_shard x cp
    assert ("dp", (0, 1, 2, 3)) in generated(table, 4, 4)
    # with TP and PP the exchange is per TP rank and stage, of the TP-local heads
    par = {"tp": 2, "dp": 1, "cp": 4, "zero": 2, "pp": 2, "sequence_parallel": True}
    assert_matches_oracle(_small("torchtitan", par, {"grad_accumulation": 2, "recompute": "full"}), 16, 8)


def _cp_expected(kvp: int, gathers: int, sends: int) -> dict:
    ag = Counter({Call("all_gather", kvp, "bf16"): gathers})
    out: dict = {("cp", (0, 1)): ag + Counter({Call("send_recv", kvp, "fp32"): sends})}
    # ("cp", (0, 1)) names both the all-gather group and the 0 -> 1 hop: one communicator key
    out[("cp", (2, 3))] = ag + Counter({Call("send_recv", kvp, "fp32"): sends})
    out[("cp", (1, 0))] = Counter({Call("send_recv", kvp, "fp32"): sends})
    out[("cp", (3, 2))] = Counter({Call("send_recv", kvp, "fp32"): sends})
    return out


def test_torchtitan_ddp_reduces_every_micro_batch():
    """Rule torchtitan.ddp_every_micro_batch (fixed): DDP all-reduces at every backward."""
    # torchtitan train_step runs forward_backward_step (loss.backward()) per micro-batch, no no_sync:
    # torch DDP's reducer all-reduces every bucket each time. Was: once a step. 2 blocks of
    # 4 x 65,536 + 3 x 131,072 + 2 x 256 = 655,872, embedding and output 262,144 each, norm 256:
    # 1,836,288 fp32 elements a backward. Buckets (gradients ready from the output layer back;
    # 1 MiB first, then torchtitan's bucket_cap_mb = 100): the output alone (262,144 x 4 bytes =
    # 1 MiB), then the remaining 1,574,144.
    table = _small("torchtitan", {"dp": 4, "zero": 0}, {"grad_accumulation": 3})
    got = generated(table, 4, 4)
    assert list(got) == [("dp", (0, 1, 2, 3))]
    assert Counter(got[("dp", (0, 1, 2, 3))]) == Counter(
        {Call("all_reduce", 262_144, "fp32"): 3, Call("all_reduce", 1_574_144, "fp32"): 3}
    )
    assert_matches_oracle(table, 4, 4)
    # DDP's gradients are plain tensors: clip_grad_norm_ issues no collective (no DTensor full_tensor())
    col = _collectives()
    spec = col.run_spec_of(table, nodes=1, gpus_per_node=4, gpu="h100", name="ddp")
    assert not [c for c in col.step_collectives(spec, warmup=False) if c.tag.startswith("grad_norm")]


def test_deepspeed_zero3_accumulation():
    """Rule deepspeed.zero3_every_micro_batch (issue 39, item 1; fixed): ZeRO-3 gathers the
    parameters and reduce-scatters the gradients in every micro-batch."""
    # parameter_offload.py _start_of_forward_hook resets the coordinator's trace walk at every
    # forward; stage3.py reduce_ready_partitions_and_remove_grads reduces at every backward (no
    # accumulation-boundary test). Hand count, HF Llama, h 256, f 512, 2 layers, vocab 1024, dp 4:
    # gathered (> 1e5 elements): embedding and lm_head 262,144 each, gate / up / down 131,072
    # each (q / k / v / o 65,536 and the norms are persistent), per micro-batch and rank
    # (2 x 262,144 + 2 x 3 x 131,072) / 4 = 327,680 elements; reduce-scattered: every parameter,
    # (2 x 262,144 + 2 x (4 x 65,536 + 3 x 131,072 + 2 x 256) + 256) / 4 = 459,072 elements
    from fixtures.collective_oracle import deepspeed_zero3_totals

    for m in (1, 3):
        table = _small("deepspeed", {"dp": 4, "zero": 3}, {"grad_accumulation": m})
        assert deepspeed_zero3_totals(table, 4) == {
            "reduce_scatter": m * 459_072,
            "all_gather_min": m * 327_680,
            "all_gather_max": m * 327_680,
        }
        assert_matches_oracle(table, 4, 4)
        got = Counter()
        for c in _collectives().step_collectives(_collectives().run_spec_of(table, 1, 4, name="z3"), warmup=False):
            got[c.op] += c.count
        assert (got["all_gather"], got["reduce_scatter"]) == (m * 327_680, m * 459_072)


def test_deepspeed_zero3_beyond_the_reuse_distance_is_bounded():
    """W5's shape (gpt-oss, 4.4 G elements: past stage3_max_reuse_distance) with 1 and 2
    micro-batches: the reduce-scatters exact, the gathers within the oracle's bounds (one to two
    per parameter and micro-batch) and proportional to the micro-batches."""
    from fixtures.collective_oracle import deepspeed_zero3_totals

    col = _collectives()
    w5 = {
        "framework": "deepspeed",
        "model": {
            "kind": "moe",
            "arch": "gpt_oss",
            "layers": 4,
            "hidden": 2880,
            "ffn_hidden": 2880,
            "heads": 64,
            "kv_heads": 8,
            "head_dim": 64,
            "vocab": 201088,
            "experts": 32,
            "topk": 4,
        },
        "parallel": {"dp": 4, "zero": 3},
        "train": {"seq_len": 1024, "micro_batch": 1, "grad_accumulation": 1},
    }
    with pytest.raises(NotImplementedError, match="reuse_distance"):
        predict(w5, 4, 2)
    got = {}
    for m in (1, 2):
        w5["train"]["grad_accumulation"] = m
        bounds = deepspeed_zero3_totals(w5, 4)
        totals = Counter()
        for c in col.step_collectives(col.run_spec_of(w5, 2, 2, name="w5"), warmup=False):
            totals[c.op] += c.count if c.group == "dp" and c.count > 1 else 0
        assert totals["reduce_scatter"] == bounds["reduce_scatter"]
        assert bounds["all_gather_min"] < totals["all_gather"] <= bounds["all_gather_max"]
        got[m] = totals
    assert got[2]["all_gather"] == 2 * got[1]["all_gather"]


def test_deepspeed_zero12_reduce_scatter_of_the_padded_group():
    """Rule deepspeed.zero12_padded_partition (fixed; found by the gpt-oss draws): ZeRO-1/2 reduce
    each rank's partition of the flat group padded to 2 dp, as the all-gather after the step (a
    gpt-oss model's element count need not be a multiple of 2 dp: sinks, router biases)."""
    moe = {"kind": "moe", "arch": "gpt_oss", "experts": 2, "topk": 1, "moe_ffn_hidden": 64, "head_dim": 32}
    for zero in (1, 2):
        table = _small("deepspeed", {"dp": 2, "zero": zero}, {"grad_accumulation": 2}, **moe, kv_heads=1, layers=1)
        table["model"]["vocab"] = 200
        assert sum(_hf_gpt_oss_params(_model(table))) == 285_126  # 2 (mod 4): padded by 2
        assert_matches_oracle(table, 2, 1)
