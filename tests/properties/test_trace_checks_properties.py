"""Property of the trace checks (lib/traffic/trace_checks.py): the ring rule through the check, one group
size per communicator."""

from __future__ import annotations

from fixtures.step_runs import FlowBuilder
from hypothesis import given, settings
from hypothesis import strategies as st

from phantora_assets.lib.traffic.trace_checks import ring_bytes_match

_OPS = st.sampled_from(["all_reduce", "all_gather", "reduce_scatter"])
_DTYPES = st.sampled_from(["Bf16", "F32", "F16", "I8", "F64"])


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(2, 16),
    other=st.integers(2, 16),
    calls=st.lists(st.tuples(_OPS, st.integers(1, 2**28), _DTYPES), min_size=0, max_size=6),
    big=st.integers(2**20, 2**28),
    dtype=_DTYPES,
    seed=st.integers(0, 2**16),
)
def test_property_ring_rule_one_group_size_per_communicator(n, other, calls, big, dtype, seed):
    """Flows following the ring rule for one n pass with group size n (a large all-gather pins
    n down); adding one collective whose bytes follow the rule for another n fails, naming the
    communicator."""
    comm = "00000000000000aa"
    ranks = list(range(n))
    fb = FlowBuilder({r: r for r in range(64)})  # every rank on its own host
    fb.ring(comm, ranks, "all_gather", big, dtype, 0.0, 1.0)
    for k, (op, count, dt) in enumerate(calls):
        fb.ring(comm, ranks, op, count, dt, 10.0 * (k + 1), 1.0)
    o = ring_bytes_match(fb.frame(shuffle_seed=seed))
    assert o.passed, o.message
    assert o.observed["group_sizes"] == {comm: n}
    if other == n:
        return
    fb.ring(comm, list(range(other)), "all_gather", big + 1, dtype, 1000.0, 1.0)
    bad = ring_bytes_match(fb.frame(shuffle_seed=seed))
    assert not bad.passed
    assert bad.observed["bad_communicators"] == [comm] and comm in bad.message
