"""The analytic simulator's one rank a stage (lib/sim/symmetry.py) against the full simulation (issue 37 item 2).

Hypothesis draws valid jobs of the three frameworks (tests/fixtures/workload_strategies.py: TP / PP / DP /
CP / EP, ZeRO and FSDP, every pipeline schedule) and a fabric (the leaf-spine with each ECMP mode, the rail
fabrics with and without PXN, a fat-tree, two planes). The simulator with ``compress=True`` (the default)
must give the full simulation's (``compress=False``, one DAG node a rank) raw timeline: every event with the
same bytes, hosts, communicator, rank and stream, to the byte, in the same order, and iteration times
within 0.1 % -- whether it ran one rank a stage or found the ranks unequal and ran every rank.
"""

from __future__ import annotations

import numpy as np
from fixtures.workload_strategies import any_spec
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from phantora_assets.lib.run.spec import RunSpec
from phantora_assets.lib.sim.analytic import AnalyticSimulator
from phantora_assets.lib.workload.collectives import run_spec_of

FABRICS = (
    (),
    (("ecmp", "split"),),
    (("ecmp", "first"),),
    (("topology", "RailOptimized"), ("nic_bw_gbps", 400)),
    (("topology", "RailOptimized"), ("nic_bw_gbps", 400), ("pxn", False), ("rail_group_hosts", 2)),
    (("topology", "FatTree"), ("fattree_k", 8), ("oversubscription", 2.0)),
    (("topology", "MultiPlane"), ("nic_bw_gbps", 400), ("planes", 2)),
)
TIMES = ("start_ns", "end_ns", "meta_json")  # meta_json holds the compute event's duration


def _same_simulation(spec: RunSpec) -> str:
    """Simulate ``spec`` both ways; assert they agree; return the compressed run's symmetry note."""
    short = AnalyticSimulator(spec, iterations=3)
    fast, full = short.run(), AnalyticSimulator(spec, iterations=3, compress=False).run()
    assert fast.fits == full.fits
    if not fast.fits:
        return "does not fit"
    a, b = fast.raw, full.raw
    assert len(a) == len(b)
    same = [c for c in a.columns if c not in TIMES]
    for c in same:  # every flow and compute event: the same values in the same order
        assert a[c].tolist() == b[c].tolist(), c
    for c in ("start_ns", "end_ns"):  # to the ns, up to float rounding of the network's sums
        assert np.abs(a[c].to_numpy() - b[c].to_numpy()).max() <= 1, c
    for x, y in zip(fast.iteration_ns, full.iteration_ns):
        assert abs(x - y) <= 1e-3 * y
    return short.symmetry


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_spec(), st.sampled_from(FABRICS))
def test_one_rank_a_stage_is_the_full_simulation(case, fabric):
    table, gpus, gpn = case
    spec = run_spec_of(table, nodes=gpus // gpn, gpus_per_node=gpn, gpu="h100", name="sym")
    nodes = gpus // gpn
    if dict(fabric).get("topology") == "MultiPlane" and nodes < 2:
        fabric = ()
    spec = RunSpec(spec.workload, spec.gpu, nodes, gpn, topology=fabric, workload_def=spec.workload_def)
    event(_same_simulation(spec).split(" (")[0].split(":")[0])
